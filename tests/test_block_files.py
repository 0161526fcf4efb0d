"""Blocks kept on the worker's local disk (``loading.block_store: disk``): the same reads, the
same batches, files gone with their blocks, descriptors bounded."""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest

from overlord_dask import pieces as P
from overlord_dask.batch_layout import BatchLayout
from overlord_dask.sources import block_files
from overlord_dask.sources.block_files import FileArray
from overlord_dask.sources.blocks import SampleBlock
from overlord_dask.worker.constructors import block_key, build_chunk


def _files(directory) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.startswith(block_files.PREFIX))


def test_a_file_array_reads_what_the_array_holds(tmp_path):
    values = np.arange(1000, 1257, dtype=np.uint16)
    f = FileArray(values, str(tmp_path))
    assert len(f) == 257 and f.dtype == np.uint16 and f.shape == (257,) and f.nbytes == values.nbytes
    for key in (slice(0, 10), slice(250, 400), slice(5, 5), slice(-7, None), slice(3, 40, 5), slice(None, 2, -1)):
        got = f[key]
        assert got.dtype == values.dtype and got.tolist() == values[key].tolist(), key
    assert f[0] == 1000 and f[-1] == 1256 and f[np.int64(17)] == 1017
    with pytest.raises(IndexError, match="257"):
        f[257]
    idx = np.array([4, 0, 256, 4])
    assert f[idx].tolist() == values[idx].tolist()
    mask = values % 3 == 0
    assert f[mask].tolist() == values[mask].tolist()
    assert np.asarray(f).tolist() == values.tolist() and np.asarray(f, dtype=np.int64).dtype == np.int64
    assert _files(tmp_path) == [os.path.basename(f.path)]


def test_a_file_array_travels_as_its_values_into_a_file_of_its_own_and_its_file_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.setattr(block_files, "block_directory", lambda: str(tmp_path / "other"))
    (tmp_path / "other").mkdir()
    f = FileArray(np.arange(50, dtype=np.int32), str(tmp_path))
    copy = pickle.loads(pickle.dumps(f, protocol=5))  # a transfer to another worker, a shadow
    assert isinstance(copy, FileArray) and np.asarray(copy).tolist() == list(range(50))
    assert os.path.dirname(copy.path) == str(tmp_path / "other") and copy.path != f.path
    path = f.path
    f[3]  # (open)
    del f
    gc.collect()
    assert not os.path.exists(path) and _files(tmp_path) == []
    assert len(_files(tmp_path / "other")) == 1


def test_more_block_files_than_open_descriptors_are_read_right(tmp_path, monkeypatch):
    """A worker holds thousands of blocks; its open descriptors stay at the limit, the least
    recently read closed first and reopened when read again."""
    monkeypatch.setattr(block_files, "_DESCRIPTORS", block_files._Descriptors(4))
    arrays = [FileArray(np.full(10, i, dtype=np.int32), str(tmp_path)) for i in range(12)]
    for _ in range(2):
        for i, a in enumerate(arrays):
            assert a[2:5].tolist() == [i] * 3
            assert len(block_files._DESCRIPTORS) <= 4


def test_a_descriptor_being_read_from_is_not_closed_under_its_reader(tmp_path, monkeypatch):
    """Threads read at once: a file opened while another thread reads one at the limit closes
    only idle descriptors, so the reader's descriptor cannot be given to another file meanwhile."""
    d = block_files._Descriptors(1)
    monkeypatch.setattr(block_files, "_DESCRIPTORS", d)
    a, b = (
        FileArray(np.arange(10, dtype=np.int32), str(tmp_path)),
        FileArray(np.arange(10, 20, dtype=np.int32), str(tmp_path)),
    )
    fd = d.acquire(a.path)  # a read of a in flight
    assert b[0:3].tolist() == [10, 11, 12]  # b opened beside it: a's descriptor is not idle
    assert os.pread(fd, 4, 4) == np.int32(1).tobytes()  # still a's file
    d.done(a.path)
    assert len(d) == 1 and a[5] == 5


def _chat_block(lengths, first_id=0, source="s"):
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = (np.arange(offsets[-1]) * 7 + 3) % 250
    mask = np.ones(offsets[-1], np.uint8)
    mask[offsets[:-1]] = 0  # each document's first token is no target (a prompt)
    mask[1::5] = 0
    return SampleBlock(source, tokens, offsets, np.arange(first_id, first_id + len(lengths)), loss_mask=mask)


def test_a_block_on_disk_holds_its_ids_in_files_and_reads_as_before(tmp_path):
    block = _chat_block([5, 9, 4, 11])
    disk = block.on_disk(str(tmp_path))
    assert disk.on_disk(str(tmp_path)) is disk and len(_files(tmp_path)) == 2  # tokens and loss mask
    assert disk.nbytes == block.offsets.nbytes + block.sample_ids.nbytes  # what Dask counts: memory only
    assert disk.disk_bytes == block.tokens.nbytes + block.loss_mask.nbytes and block.disk_bytes == 0
    assert [disk.doc(i).tolist() for i in range(4)] == [block.doc(i).tolist() for i in range(4)]
    assert disk.lengths().tolist() == block.lengths().tolist()
    assert disk.masked_runs().tolist() == block.masked_runs().tolist()
    parts = SampleBlock.concat([_chat_block([5, 9]).on_disk(str(tmp_path)), _chat_block([4], 2).on_disk(str(tmp_path))])
    plain = SampleBlock.concat([_chat_block([5, 9]), _chat_block([4], 2)])
    assert np.asarray(parts.tokens).tolist() == plain.tokens.tolist()
    assert parts.loss_mask.tolist() == plain.loss_mask.tolist()


def test_blocks_on_disk_build_the_batches_blocks_in_memory_build(tmp_path):
    """Whole and cut pieces (a cut piece's label is the next token of its document, read from the
    file), loss masks, two sources, two ranks: the same packed bytes."""
    a, b = _chat_block([5, 9, 30], first_id=0), _chat_block([12, 6], first_id=3, source="t")
    pieces = np.array(
        [[0, 0, 0, 1, 0, 9], [0, 0, 0, 2, 0, 13], [1, 0, 1, 0, 0, 12], [0, 0, 0, 2, 13, 30], [1, 0, 1, 1, 2, 6]]
    )
    slot = np.array([[0, 0], [0, 1], [1, 0], [1, 1], [0, 1]])
    steps = [{"step": 5, "pieces": P.pack(pieces), "slot": P.slot_bytes(slot), "piece_tokens": 13}]
    layout = BatchLayout(2, 24)
    memory = {block_key(0, 0, 0): a, block_key(1, 0, 1): b}
    disk = {k: v.on_disk(str(tmp_path)) for k, v in memory.items()}
    want, got = build_chunk(steps, (0, 2), layout, memory), build_chunk(steps, (0, 2), layout, disk)
    assert [got.packed(5, r) for r in (0, 1)] == [want.packed(5, r) for r in (0, 1)]
    assert want.packed(5, 0) != want.packed(5, 1)
