"""Packed micro-batches: fields consistent, tokens exactly the planned pieces."""

from __future__ import annotations

import numpy as np
import pytest

from overlord_dask.batch_layout import BatchLayout
from overlord_dask.sources.blocks import SampleBlock
from overlord_dask.worker.constructors import IGNORE_INDEX, block_key, build_rank_batch, check_micro_batch

from .harness import same_fields


def _block(lengths, first_id=100, source="s"):
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return SampleBlock(source, np.arange(3, 3 + offsets[-1]), offsets, np.arange(first_id, first_id + len(lengths)))


def test_pack_fields_are_consistent():
    blocks = {block_key(0, 0, 0): _block([5, 9, 3]), block_key(1, 2, 7): _block([12], first_id=7)}
    mbs = [
        [
            [0, 0, 0, 0, 0, 5],
            [1, 2, 7, 0, 4, 8],
            [0, 0, 0, 2, 0, 3],
        ],  # a whole doc, the middle piece of a split doc, a whole doc
        [[0, 0, 0, 1, 0, 9]],
    ]
    batch = build_rank_batch(3, 1, mbs, blocks, 4, BatchLayout(2, 20))
    assert batch["step"] == 3 and batch["rank"] == 1 and len(batch["micro_batches"]) == 2
    mb = batch["micro_batches"][0]
    check_micro_batch(mb, 20)
    assert mb["cu_seqlens"].tolist() == [0, 5, 9, 12] and mb["num_tokens"] == 12
    assert mb["sample_ids"].tolist() == [100, 7, 102]
    assert (
        mb["source_ids"].tolist() == [0, 1, 0]
        and mb["chunk_ids"].tolist() == [0, 1, 0]
        and mb["epochs"].tolist() == [0, 2, 0]
    )
    b1 = blocks[block_key(1, 2, 7)].doc(0)
    assert mb["input_ids"][5:9].tolist() == b1[4:8].tolist()
    # a split piece keeps its document's true next token; a document's last token gets -100
    assert mb["labels"][8] == b1[8]
    assert mb["labels"][4] == IGNORE_INDEX and mb["labels"][11] == IGNORE_INDEX
    check_micro_batch(batch["micro_batches"][1], 20)


def test_over_capacity_is_refused():
    blocks = {block_key(0, 0, 0): _block([15, 9])}
    with pytest.raises(ValueError, match="over capacity"):
        build_rank_batch(0, 0, [[[0, 0, 0, 0, 0, 15], [0, 0, 0, 1, 0, 9]]], blocks, 20, BatchLayout(1, 20))


def test_checker_catches_inconsistency():
    blocks = {block_key(0, 0, 0): _block([5, 9])}
    mb = build_rank_batch(0, 0, [[[0, 0, 0, 0, 0, 5], [0, 0, 0, 1, 0, 9]]], blocks, 16, BatchLayout(1, 16))[
        "micro_batches"
    ][0]
    bad = dict(mb, position_ids=np.arange(16, dtype=np.int32))
    with pytest.raises(ValueError, match="position_ids"):
        check_micro_batch(bad, 16)
    bad = dict(mb, labels=np.roll(mb["labels"], 1))
    with pytest.raises(ValueError, match="labels|padding"):
        check_micro_batch(bad, 16)


def test_a_built_chunk_is_sized_by_its_arrays_and_survives_pickling():
    """Dask's memory accounting (spilling, ``status()`` bytes) sees a constructor task's batches,
    without walking them, and a chunk copied to a shadow worker (in one buffer) serves the same batches."""
    import pickle

    from dask.sizeof import sizeof

    from overlord_dask import pieces as P
    from overlord_dask.wire import decode_batch, nbytes
    from overlord_dask.worker.constructors import build_chunk

    blocks = {block_key(0, 0, 0): _block([5, 9, 3])}
    pieces = np.array([[0, 0, 0, 0, 0, 5], [0, 0, 0, 1, 0, 9], [0, 0, 0, 2, 0, 3]])
    slot = np.array([[0, 0], [1, 0], [1, 1]])  # (rank, micro-batch) of each piece
    steps = [{"step": 4, "pieces": P.pack(pieces), "slot": P.slot_bytes(slot), "piece_tokens": 16}]
    chunk = build_chunk(steps, (0, 2), BatchLayout(2, 16), blocks)
    arrays = sum(nbytes(chunk.batch(4, r)) for r in (0, 1))
    packed = sum(len(chunk.packed(4, r)) for r in (0, 1))  # held packed for the wire: the arrays and pickle's framing
    assert 0 < arrays < packed < arrays + 2048 and chunk.nbytes == packed and sizeof(chunk) == packed + 200
    from distributed.protocol import dumps, loads, to_serialize

    # a shadow copy travels as one frame per (step, rank) batch, not a frame per array, and those
    # frames are the bytes the constructor packed (no copy on the serving worker's event loop)
    frames = dumps({"data": to_serialize(chunk)})
    assert len(frames) == 3 + 2  # the message, its header, the pickle stream, and the two batches
    for r in (0, 1):
        held = np.frombuffer(chunk.packed(4, r), np.uint8)
        assert any(np.shares_memory(np.frombuffer(f, np.uint8), held) for f in frames if len(memoryview(f)))
    for copy in (
        pickle.loads(pickle.dumps(chunk)),
        pickle.loads(pickle.dumps(chunk, protocol=5)),
        loads(frames)["data"],
    ):
        assert copy.nbytes == chunk.nbytes
        for r in (0, 1):
            a, b = decode_batch(chunk.batch(4, r)), decode_batch(copy.batch(4, r))
            for m in range(2):
                assert a["micro_batches"][m]["input_ids"].tolist() == b["micro_batches"][m]["input_ids"].tolist()
        assert decode_batch(copy.batch(4, 1))["micro_batches"][1]["num_tokens"] == 3


def test_a_constructor_task_names_each_load_future_once_and_builds_what_the_blocks_build():
    """The submitter passes a constructor task its blocks as the distinct load futures (a group
    of units read by one task is one future) and ``BlockRefs`` naming each unit's place among
    them (a unit read in parts: its parts, concatenated): the chunk is the one its blocks build."""
    import pickle
    from types import SimpleNamespace

    from overlord_dask import pieces as P
    from overlord_dask.worker.constructors import BlockRefs, build_chunk

    a, b, c, d = _block([5, 9]), _block([4, 6, 3], first_id=7), _block([8], first_id=20), _block([2, 7], first_id=30)
    b0 = SampleBlock("s", b.tokens[:10], [0, 4, 10], [7, 8])  # the parts of b: its first two documents
    b1 = SampleBlock("s", b.tokens[10:], [0, 3], [9])  # and its third
    results = {"load-a": a, "load-b-p0": b0, "load-b-p1": b1, "load-cd": [c, d]}
    fut = {k: SimpleNamespace(key=k) for k in results}
    entries = {
        block_key(0, 0, 0): fut["load-a"],
        block_key(0, 0, 1): ("parts", [fut["load-b-p0"], fut["load-b-p1"]]),
        block_key(1, 0, 4): ("group", 0, fut["load-cd"]),
        block_key(1, 0, 5): ("group", 1, fut["load-cd"]),
    }
    refs, deps = BlockRefs.of(entries)
    assert [f.key for f in deps] == ["load-a", "load-b-p0", "load-b-p1", "load-cd"]  # the group's future once
    refs = pickle.loads(pickle.dumps(refs))  # as the task travels
    pieces = np.array(
        [[0, 0, 0, 1, 0, 9], [0, 0, 1, 2, 0, 3], [1, 0, 4, 0, 0, 8], [1, 0, 5, 1, 2, 7], [0, 0, 1, 0, 0, 4]]
    )
    slot = np.array([[0, 0], [0, 0], [1, 0], [1, 0], [1, 0]])
    steps = [{"step": 3, "pieces": P.pack(pieces), "slot": P.slot_bytes(slot), "piece_tokens": 16}]
    plain = {block_key(0, 0, 0): a, block_key(0, 0, 1): b, block_key(1, 0, 4): c, block_key(1, 0, 5): d}
    want = build_chunk(steps, (0, 2), BatchLayout(1, 24), plain)
    got = build_chunk(steps, (0, 2), BatchLayout(1, 24), refs, [results[f.key] for f in deps])
    assert [got.packed(3, r) for r in (0, 1)] == [want.packed(3, r) for r in (0, 1)]
    assert want.packed(3, 0) != want.packed(3, 1)


def test_a_fetch_sends_the_batches_the_constructor_packed_as_frames():
    """A chunk holds each (step, rank) batch pickled by the constructor task, so that serving a
    fetch or a shadow copy pickles no array on the worker's event loop: the fetch's reply
    carries those bytes as they are, one Dask frame each (not copied into the message), and
    reads back as the same batches as packing them afresh."""
    import pickle

    from distributed.protocol import dumps, loads, to_serialize

    from overlord_dask import pieces as P
    from overlord_dask.trainer import comm
    from overlord_dask.wire import Payload, pack_batch, register_payload_with_dask
    from overlord_dask.worker.constructors import build_chunk

    register_payload_with_dask()  # as the worker's batch server does
    blocks = {block_key(0, 0, 0): _block([5, 9, 3, 7])}
    pieces = np.array([[0, 0, 0, 0, 0, 5], [0, 0, 0, 1, 0, 9], [0, 0, 0, 2, 0, 3], [0, 0, 0, 3, 0, 7]])
    slot = np.array([[0, 0], [1, 0], [1, 1], [0, 1]])
    steps = [{"step": s, "pieces": P.pack(pieces), "slot": P.slot_bytes(slot), "piece_tokens": 16} for s in (4, 5)]
    chunk = build_chunk(steps, (0, 2), BatchLayout(2, 16), blocks)
    for per_rank in chunk.batches.values():
        assert all(isinstance(b, bytes) for b in per_rank.values())
    packed = [chunk.packed(s, 1) for s in (4, 5)]
    frames = dumps({"status": "OK", "payload": to_serialize(Payload(packed))})  # as the worker's reply goes on the wire

    def sent_as_is(f):
        return any(f is b or getattr(f, "obj", None) is b for b in packed)

    assert sum(map(sent_as_is, frames)) == len(packed)  # each batch's bytes are a frame (or a view of them), not copied
    assert all(len(f) < min(map(len, packed)) for f in frames if not sent_as_is(f))  # besides them: headers only
    reply = loads([memoryview(bytes(f)) for f in frames])  # the trainer reads views of one received buffer
    own = comm.decode([memoryview(bytes(f)) for f in frames])  # ... with its own comms, without distributed
    assert [bytes(f) for f in own["payload"].frames] == [bytes(f) for f in reply["payload"].frames] == packed
    got, fresh = reply["payload"].batches(), [pickle.loads(pack_batch(chunk.batch(s, 1))) for s in (4, 5)]
    assert [b["step"] for b in got] == [4, 5] and [b["rank"] for b in got] == [1, 1]
    for a, b in zip(got, fresh):
        for ma, mb in zip(a["micro_batches"], b["micro_batches"]):
            same_fields(ma, mb)
    copy = pickle.loads(pickle.dumps(chunk))  # a shadow copy carries the packed bytes as they are
    assert all(copy.packed(s, r) == chunk.packed(s, r) for s in (4, 5) for r in (0, 1))
