"""Context parallelism: zigzag slices reassemble to the original documents, and a service with
cp > 1 serves each (rank, cp rank) its own slice."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord_dask import RankError, Service, connect
from overlord_dask.batch_layout import BatchLayout
from overlord_dask.sources.blocks import SampleBlock
from overlord_dask.worker.constructors import (
    IGNORE_INDEX,
    block_key,
    build_rank_batch,
    check_micro_batch,
    zigzag_chunks,
)

from .harness import run_ranks
from .reference import read_source


def _mb(lengths, capacity, split, cp):
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    block = SampleBlock("s", np.arange(3, 3 + offsets[-1]), offsets, np.arange(len(lengths)))
    pieces = [[0, 0, 0, d, 0, int(L)] for d, L in enumerate(lengths)]
    layout = BatchLayout(1, capacity, cp=cp, cp_split_tokens=split)
    return build_rank_batch(0, 0, [pieces], {block_key(0, 0, 0): block}, capacity, layout)["micro_batches"][0]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=12), cp=st.integers(2, 4), split=st.integers(8, 200))
def test_cp_slices_reassemble_to_the_micro_batch(lengths, cp, split):
    capacity = int(sum(lengths)) + 7
    mb = _mb(lengths, capacity, split, cp)
    check_micro_batch(mb, capacity)
    slices = mb["cp"]
    assert len(slices) == cp and len({len(s["input_ids"]) for s in slices}) == 1  # one shape per CP group
    cu = mb["cu_seqlens"]
    for k in range(len(lengths)):
        a, b = int(cu[k]), int(cu[k + 1])
        parts = {}  # chunk index -> (tokens, positions, labels)
        owners = []
        for j, sl in enumerate(slices):
            scu = sl["cu_seqlens"]
            for g in np.flatnonzero(sl["seg_piece"] == k):
                x, y = int(scu[g]), int(scu[g + 1])
                parts[int(sl["seg_chunk"][g])] = (sl["input_ids"][x:y], sl["position_ids"][x:y], sl["labels"][x:y])
                owners.append((j, int(sl["seg_chunk"][g])))
        if b - a >= split:
            assert sorted(parts) == list(range(2 * cp))
            assert sorted(owners) == sorted((j, c) for j in range(cp) for c in (j, 2 * cp - 1 - j))  # zigzag
        else:
            assert list(parts) == [-1] and len(owners) == 1  # whole, on one CP rank
        order = sorted(parts)
        np.testing.assert_array_equal(np.concatenate([parts[c][0] for c in order]), mb["input_ids"][a:b])
        np.testing.assert_array_equal(np.concatenate([parts[c][1] for c in order]), mb["position_ids"][a:b])
        np.testing.assert_array_equal(np.concatenate([parts[c][2] for c in order]), mb["labels"][a:b])
    assert sum(s["num_tokens"] for s in slices) == mb["num_tokens"]
    for sl in slices:  # padding after the real tokens
        assert np.all(sl["labels"][sl["num_tokens"] :] == IGNORE_INDEX)


def test_zigzag_chunks_are_near_equal():
    b = zigzag_chunks(103, 4)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == 103 and len(sizes) == 8 and sizes.max() - sizes.min() <= 1


@pytest.mark.integration
@pytest.mark.parametrize("packing", ["whole", "cut"])
def test_service_with_context_parallelism(cluster, small_plan, packing):
    plan = small_plan(
        topology={"dp": 2, "micro_batches": 2, "tokens_per_micro_batch": 4096, "cp": 2, "cp_min_tokens": 512},
        balance={"packing": packing},
    )
    steps = 6
    got: dict = {}
    with Service.start(plan, cluster=cluster) as service:
        with pytest.raises(RankError, match="runs context parallelism cp=2: pass cp_rank"):
            connect(service.address, 0)

        def run(rank_cp):
            rank, cp_rank = rank_cp
            with connect(service.address, rank, cp_rank=cp_rank, timeout=120) as s:
                got[(rank, cp_rank)] = [s.next_batch() for _ in range(steps)]
                s.commit()

        run_ranks(run, [(r, j) for r in range(2) for j in range(2)])
        service.wait_for_step(steps, timeout=60)
    reference = {i: read_source(plan, s.name) for i, s in enumerate(plan.sources)}
    split_seen = 0
    for r in range(2):
        for step in range(steps):
            a, b = got[(r, 0)][step], got[(r, 1)][step]
            for m in range(2):
                s0, s1 = a["micro_batches"][m], b["micro_batches"][m]
                np.testing.assert_array_equal(s0["sample_ids"], s1["sample_ids"])  # same micro-batch
                for k in range(len(s0["sample_ids"])):
                    parts = {}
                    for sl in (s0, s1):
                        for g in np.flatnonzero(sl["seg_piece"] == k):
                            x, y = sl["cu_seqlens"][g], sl["cu_seqlens"][g + 1]
                            parts[int(sl["seg_chunk"][g])] = sl["input_ids"][x:y]
                    split_seen += len(parts) > 1
                    doc = reference[s0["source_ids"][k]][s0["sample_ids"][k]]
                    start = int(s0["piece_starts"][k])
                    tokens = np.concatenate([parts[c] for c in sorted(parts)])
                    np.testing.assert_array_equal(tokens, doc[start : start + len(tokens)])
    assert split_seen > 0  # long documents were really split across the CP group
