"""Shuffle blocks (``planner/streams/order.py``): a source's documents are drawn from
``loading.shuffle_units`` units at once, every document once per epoch, in an order that is a pure
function of the plan and seed, whatever the loading did; a snapshot holds the setting."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlord_dask.errors import PlanError
from overlord_dask.plan import plan_from_dict
from overlord_dask.planner.state import PlannerState
from overlord_dask.planner.streams import SourceStream
from overlord_dask.planner.streams.order import SourceOrder

from .harness import planner_stream


def _stream(sizes, k: int, seed: int = 3, lengths=None, warmup: int = 0) -> tuple[SourceStream, list[np.ndarray]]:
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    s = SourceStream("src", 0, len(sizes), first, seed, 1 << 30, block_units=k, warmup_units=warmup)
    rng = np.random.default_rng(seed)
    lens = lengths or [rng.integers(0, 50, int(n)).astype(np.int64) for n in sizes]
    return s, lens


def _walk(s: SourceStream, lens, docs: int, chunk_tokens, rng=None) -> np.ndarray:
    """Rows ``[epoch, unit, doc, start, stop]`` of the first ``docs`` pieces the stream yields,
    its units loaded as its lookahead asks (in a shuffled order when ``rng``), taken in chunks."""
    out = []
    got = 0
    while got < docs:
        want = s.loads.want(s, 400, 2)
        if rng is not None:
            want = [want[i] for i in rng.permutation(len(want))]
        for e, u in want:
            s.add_lengths(e, u, lens[u])
        n = chunk_tokens() if callable(chunk_tokens) else chunk_tokens
        rows, _ = s.pieces_ahead(n)
        if len(rows):
            rows = rows[: docs - got]
            s.take(rows)
            s.finished_units()
            out.append(rows)
            got += len(rows)
    return np.concatenate(out)


def test_blocks_cut_each_epoch_into_near_equal_runs_regrouped_every_epoch():
    o = SourceOrder("web", 7, n_units=100, block_units=16)
    assert o.n_blocks == 7
    sizes = [o.block_bounds(0, b)[1] - o.block_bounds(0, b)[0] for b in range(o.n_blocks)]
    assert sum(sizes) == 100 and max(sizes) - min(sizes) <= 1  # no small remainder block
    for e in (0, 1):
        seen = np.concatenate([o.block_units_of(e, b) for b in range(o.n_blocks)])
        assert sorted(seen.tolist()) == list(range(100))  # every unit in exactly one block
        assert all(o.block_units_of(e, o.block_of(e, u)).tolist().count(u) == 1 for u in range(100))
    groups = [{frozenset(o.block_units_of(e, b).tolist()) for b in range(o.n_blocks)} for e in (0, 1)]
    assert groups[0] != groups[1]  # a new grouping every epoch
    single = SourceOrder("web", 7, n_units=5, block_units=1)
    assert [single.block_units_of(0, b).tolist() for b in range(5)] == [[int(u)] for u in single.units(0)]


def test_the_runs_first_blocks_ramp_up_from_the_warm_up_and_later_epochs_have_none():
    def sizes(o, e):
        return [o.block_bounds(e, b)[1] - o.block_bounds(e, b)[0] for b in range(o.n_blocks_of(e))]

    o = SourceOrder("web", 7, n_units=300, block_units=64, warmup_units=4)
    plain = SourceOrder("web", 7, n_units=300, block_units=64)
    assert sizes(o, 0) == [4, 8, 16, 54, 54, 55, 54, 55] and o.n_blocks == 8  # the warm-up within 300 / 8 units
    assert sizes(o, 1) == sizes(plain, 1) == sizes(plain, 0) == [60] * 5 and o.n_blocks_of(1) == 5
    for e in (0, 1):  # every unit in exactly one block, the same unit order as without a warm-up
        seen = np.concatenate([o.block_units_of(e, b) for b in range(o.n_blocks_of(e))])
        assert seen.tolist() == plain.units(e).tolist()
        assert all(u in o.block_units_of(e, o.block_of(e, u)).tolist() for u in range(300))
    assert o.next_block(0, 7) == (1, 0) and o.next_block(1, 4) == (2, 0)
    assert sizes(SourceOrder("web", 7, n_units=64, block_units=64, warmup_units=4), 0) == [4, 60]
    assert sizes(SourceOrder("web", 7, n_units=31, block_units=64, warmup_units=4), 0) == [31]  # too few to warm up
    big = SourceOrder("web", 7, n_units=10_000, block_units=64, warmup_units=4)
    assert sizes(big, 0)[:4] == [4, 8, 16, 32] and max(sizes(big, 0)) == 64
    for off in (0, 64, 100):
        assert sizes(SourceOrder("web", 7, n_units=300, block_units=64, warmup_units=off), 0) == [60] * 5


def test_the_first_pieces_wait_for_the_warm_up_units_only():
    """300 units, blocks of 64: without a warm-up nothing is planned before 60 units arrived; with
    one of 4, the first 4 units' documents are planned as soon as they arrived."""
    lens = [np.full(20, 10, np.int64)] * 300
    for warmup, first_block in ((0, 60), (4, 4)):
        s, _ = _stream([20] * 300, 64, lengths=lens, warmup=warmup)
        first = s.loads.want(s, 50, 1)
        assert {s.ordering.block_of(0, u) for _, u in first} == {0} and len(first) == first_block
        for e, u in first[:-1]:
            s.add_lengths(e, u, lens[u])
        assert s.peek() is None  # a block is planned only once all of its units arrived
        s.add_lengths(*first[-1], lens[first[-1][1]])
        rows, _ = s.pieces_ahead(400)
        assert len(rows) == 20 * first_block and set(rows[:, 1].tolist()) == {u for _, u in first}


def test_a_block_permutes_all_its_units_documents_together_and_maps_back():
    o = SourceOrder("web", 7, n_units=6, block_units=3)
    units = o.block_units_of(0, 0)
    lens = [np.arange(10 * (i + 1), 10 * (i + 1) + 4 + i) for i in range(3)]  # units of 4, 5 and 6 documents
    shuffled = o.assemble((0, 0), lens)
    u, d = o.file_docs((0, 0), np.arange(len(shuffled)))
    assert sorted(zip(u.tolist(), d.tolist())) == sorted((int(units[i]), k) for i in range(3) for k in range(4 + i))
    for j in range(len(shuffled)):  # each shuffled position is that document's length, and maps back
        i = units.tolist().index(int(u[j]))
        assert shuffled[j] == lens[i][d[j]] and o.shuffled_doc((0, 0), int(u[j]), int(d[j])) == j
    assert len(set(u[:6].tolist())) > 1  # the units' documents are interleaved, not one after another


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=12),
    k=st.integers(1, 6),
    seed=st.integers(0, 1000),
    warmup=st.integers(0, 3),
)
def test_every_document_once_per_epoch_in_an_order_load_timing_cannot_change(sizes, k, seed, warmup):
    """Three epochs: every document's tokens exactly once per epoch, whole and in order; the same
    sequence whatever order the units arrive in and however much each call asks for."""
    sizes = [max(1, n) for n in sizes]
    sizes[0] += 3  # a source with documents
    s, lens = _stream(sizes, k, seed, warmup=warmup)
    lens[0][0] = 7  # ... and tokens
    per_epoch = int(sum(int((x > 0).sum()) for x in lens))
    rows = _walk(s, lens, 3 * per_epoch, 64)
    other, _ = _stream(sizes, k, seed, lengths=lens, warmup=warmup)
    rng = np.random.default_rng(seed)
    again = _walk(other, lens, 3 * per_epoch, lambda: int(rng.integers(1, 500)), rng)
    np.testing.assert_array_equal(rows, again)
    for e in range(3):
        mine = rows[rows[:, 0] == e]
        got = sorted((int(u), int(d), int(b - a)) for _, u, d, a, b in mine.tolist())
        want = sorted((u, d, int(n)) for u in range(len(sizes)) for d, n in enumerate(lens[u]) if n > 0)
        assert got == want, e


def test_neighbours_come_from_many_units():
    """64 files of 400 documents: with shuffle blocks of 64 units, neighbours share a file about
    as rarely as under a global permutation (1/64), and a run of 256 documents touches ~63 files;
    read unit by unit (1) nearly every neighbour shares its file."""
    sizes = [400] * 64
    figures = {}
    for k in (1, 64):
        s, lens = _stream(sizes, k, lengths=[np.full(400, 5, np.int64)] * 64)
        units = _walk(s, lens, 64 * 400, 10_000)[:, 1]
        same = float(np.mean(units[1:] == units[:-1]))
        files = float(np.mean([len(set(w)) for w in units[: len(units) // 256 * 256].reshape(-1, 256).tolist()]))
        figures[k] = (same, files)
    assert figures[1][0] > 0.99 and figures[1][1] < 2
    assert figures[64][0] < 0.03 and figures[64][1] > 55, figures


def test_the_lookahead_asks_for_whole_blocks_and_the_next_one_as_this_one_is_planned():
    s, lens = _stream([20] * 12, 4, lengths=[np.full(20, 10, np.int64)] * 12)
    first = s.loads.want(s, 50, 1)
    assert len(first) == 4 and {s.ordering.block_of(0, u) for _, u in first} == {0}  # a whole block, at once
    for e, u in first:
        s.add_lengths(e, u, lens[u])
    rows, _ = s.pieces_ahead(400)
    s.take(rows[:40])  # half of the block's 80 documents
    more = s.loads.want(s, 50, 1)
    assert 1 <= len(more) <= 3 and {s.ordering.block_of(0, u) for _, u in more} == {1}  # the next, in step


def _plan(shuffle_units: int, warmup: int = 4):
    return plan_from_dict(
        {
            "seed": 5,
            "sources": [{"name": "web", "format": "zarr", "url": "w", "weight": 1.0}],
            "topology": {"dp": 2, "micro_batches": 2, "tokens_per_micro_batch": 2048},
            "balance": {"window": 4},
            "loading": {"shuffle_units": shuffle_units, "shuffle_warmup_units": warmup, "prefetch_steps": 8},
        }
    )


def _lengths(name, epoch, unit):
    return np.random.default_rng(unit).integers(1, 900, 32).astype(np.int64)


def test_a_snapshot_resumes_its_own_block_order_and_refuses_another_setting():
    first_ids = {"web": list(range(0, 40 * 32, 32))}
    reference = planner_stream(PlannerState(_plan(8), first_ids), 20, _lengths)
    st = PlannerState(_plan(8), first_ids)
    planner_stream(st, 9, _lengths)
    state = st.get_state()
    assert state["window"]["shuffle_units"] == 8
    again = planner_stream(PlannerState(_plan(8), first_ids, state=state), 20, _lengths)
    for step in range(9, 20):
        np.testing.assert_array_equal(again[step][0], reference[step][0])
    with pytest.raises(PlanError, match=r"shuffle blocks of loading.shuffle_units=8 units, the plan says 64"):
        PlannerState(_plan(64), first_ids, state=state)


def test_a_resumed_run_keeps_the_warm_up_it_started_with():
    """The warm-up shaped the run's first epoch, which a snapshot's cursors point into: a resume
    keeps the recorded one whatever the plan says now, and a snapshot from before the setting
    existed (no key) resumes without one."""
    first_ids = {"web": list(range(0, 40 * 32, 32))}
    for started, now in ((2, 4), (0, 4)):
        reference = planner_stream(PlannerState(_plan(8, started), first_ids), 20, _lengths)
        st = PlannerState(_plan(8, started), first_ids)
        planner_stream(st, 9, _lengths)
        state = st.get_state()
        assert state["window"]["shuffle_warmup_units"] == started
        if started == 0:
            del state["window"]["shuffle_warmup_units"]
        again = planner_stream(PlannerState(_plan(8, now), first_ids, state=state), 20, _lengths)
        for step in range(9, 20):
            np.testing.assert_array_equal(again[step][0], reference[step][0])
    differs = planner_stream(PlannerState(_plan(8, 4), first_ids), 9, _lengths)
    assert any(not np.array_equal(differs[k][0], reference[k][0]) for k in range(9))  # the warm-up changes the order
