"""The planner's parts on their own: the piece-row schema, progress, the ledger's history, window
starts, and the policies' state round trip."""

from __future__ import annotations

import numpy as np
import pytest

from overlord_dask import pieces as P
from overlord_dask.batch_layout import BatchLayout
from overlord_dask.planner.ledger import Ledger
from overlord_dask.planner.policies import POLICIES, CostBalanced, ExactStep
from overlord_dask.planner.progress import Progress
from overlord_dask.planner.windows import WindowStarts


def test_piece_rows_recut_flatten_and_bytes():
    rows = np.array([[0, 0, 3, 7, 0, 10, 1], [1, 2, 5, 1, 4, 6, 0]], dtype=np.int64)  # with AGE
    cut = P.recut(rows, 4)
    # 10 tokens -> 4 + 4 + 2 (same document, ages kept), 2 tokens stay whole
    assert cut[:, P.START].tolist() == [0, 4, 8, 4] and cut[:, P.STOP].tolist() == [4, 8, 10, 6]
    assert (cut[:3, [P.SOURCE, P.EPOCH, P.UNIT, P.DOC, P.AGE]] == rows[0, [0, 1, 2, 3, 6]]).all()
    assert P.tokens(cut) == P.tokens(rows) == 12 and P.recut(rows, 100) is rows
    assert P.source_tokens(rows, 3).tolist() == [10, 2, 0]
    a, b = rows[:1, : P.WIDTH], rows[1:, : P.WIDTH]
    pieces, slot = P.flatten([[a, P.empty()], [b, a]])  # [rank][micro_batch]
    assert pieces.tolist() == [a[0].tolist(), b[0].tolist(), a[0].tolist()] and slot.tolist() == [
        [0, 0],
        [1, 0],
        [1, 1],
    ]
    assert (
        np.array_equal(P.from_bytes(P.to_bytes(pieces)), pieces) and P.from_bytes(P.to_bytes(pieces)).dtype == P.DTYPE
    )
    # on the way to a constructor: each column in the smallest type that holds it, back as int64
    wide = np.array([[0, 1, 70_000, 3, 1 << 40, 5], [2, 0, 1, 300, 7, -1]], dtype=np.int64)
    for rows in (pieces, wide, P.empty()):
        back = P.unpack(P.pack(rows))
        assert back.dtype == P.DTYPE and back.shape == rows.shape and np.array_equal(back, rows)
    assert len(P.pack(pieces)) < len(P.to_bytes(pieces)) / 3
    assert P.stream_lengths(pieces[:, 1:]).tolist() == P.lengths(pieces).tolist()


def test_rows_appended_to_a_window_are_those_with_age_gives_and_reuse_its_buffer():
    """A window topped up (``pieces.appended``): the rows are the pending ones followed by the new
    ones with age 0, as ``with_age`` makes them; a top-up that fits writes into the buffer of the
    one before (no copy of the window's rows), one that does not gets a new buffer."""
    rng = np.random.default_rng(2)

    def new(n):
        return rng.integers(0, 1000, (n, P.WIDTH)).astype(P.DTYPE)

    pending = P.with_age(new(5), age=2)
    rows, buf = P.appended(pending, first := new(40))
    assert np.array_equal(rows, P.with_age(first, after=pending)) and not np.shares_memory(rows, pending)
    more = new(6)
    rows2, buf2 = P.appended(rows, more, buf)
    assert buf2 is buf and np.array_equal(rows2, P.with_age(more, after=P.with_age(first, after=pending)))
    assert np.array_equal(rows2[: len(rows)], rows)  # (the earlier rows stay as they were)
    rows3, buf3 = P.appended(rows2, lots := new(100), buf2)
    assert buf3 is not buf2 and np.array_equal(rows3, P.with_age(lots, after=rows2))


# keys from a small range (counted) / a wide one (sorted) / too wide for one int64 (lexsort)
@pytest.mark.parametrize("high", [50, 100_000, 1 << 60])
def test_unique_rows_match_numpy_unique_over_rows(high):
    rng = np.random.default_rng(3)
    rows = np.stack(
        [rng.integers(0, 3, 500), rng.integers(-2, 2, 500), rng.integers(0, high, 500), rng.integers(0, 7, 500)], axis=1
    )
    rows = np.concatenate([rows, rows[::3]])  # duplicates
    want, want_counts = np.unique(rows, axis=0, return_counts=True)
    got, counts = P.unique_rows(rows, return_counts=True)
    assert np.array_equal(got, want) and np.array_equal(counts, want_counts) and got.dtype == rows.dtype
    assert np.array_equal(P.unique_rows(rows), want)
    got, inverse, counts = P.unique_rows(rows, return_counts=True, return_inverse=True)
    assert np.array_equal(got, want) and np.array_equal(counts, want_counts) and np.array_equal(got[inverse], rows)
    got, inverse = P.unique_rows(rows, return_inverse=True)
    assert np.array_equal(got, want) and np.array_equal(got[inverse], rows)
    assert np.array_equal(
        P.unique_rows(rows[:, 2:3].astype(np.int32)), np.unique(rows[:, 2:3].astype(np.int32), axis=0)
    )
    empty = np.zeros((0, 3), np.int64)
    assert P.unique_rows(empty).shape == (0, 3) and P.unique_rows(empty, return_counts=True)[1].shape == (0,)
    assert P.unique_rows(empty, return_inverse=True)[1].shape == (0,)
    # a window's steps: the units of each, found together
    pieces = np.zeros((len(rows), P.WIDTH), P.DTYPE)
    pieces[:, : P.UNIT + 1] = rows[:, :3]
    steps = np.split(pieces, [100, 100, 700])
    for got, part in zip(P.units_of_each(steps), steps):
        assert np.array_equal(got, np.unique(part[:, :3], axis=0).reshape(-1, 3))


@pytest.mark.parametrize("low, high", [(0, 3), (-5, 70_000), (-(1 << 31), 1 << 31), (0, 1 << 40)])
def test_stable_order_is_numpys_stable_argsort(low, high):
    """Keys in one 16-bit pass, two, or too wide for radix passes: the same order as numpy's
    stable argsort, equal keys in index order (a bin's pieces keep the planner's order)."""
    rng = np.random.default_rng(11)
    for n in (0, 5, 300, 20_000):
        keys = rng.integers(low, high, n)
        keys = np.concatenate([keys, keys[::2]])  # equal keys
        for k in (keys, keys.astype(np.int32)) if high <= 1 << 31 else (keys,):
            assert np.array_equal(P.stable_order(k), np.argsort(k, kind="stable")), (n, k.dtype)


@pytest.mark.parametrize("docs_per_unit", [50, 40_000])  # gathered from every unit's lengths / unit by unit
def test_loss_targets_count_the_pieces_that_end_before_their_document(docs_per_unit):
    """A piece whose document goes on past it labels its last token with the document's next one:
    ``cut`` finds them, from the units' document lengths, the same on either path; a window's
    steps have the loss tokens counted together that they have one by one."""
    from overlord_dask.planner.streams.loss_targets import LossTargets

    rng = np.random.default_rng(5)
    targets, doc_lengths = LossTargets(), {}
    for key in [(0, 0, 3), (0, 1, 3), (1, 0, 0), (2, 4, 17)]:
        doc_lengths[key] = rng.integers(1, 300, docs_per_unit)
        targets.keep_lengths(key, doc_lengths[key], None)
    rows, want = [], 0
    for _ in range(400):
        key = list(doc_lengths)[rng.integers(len(doc_lengths))]
        doc = int(rng.integers(docs_per_unit))
        length = int(doc_lengths[key][doc])
        start = int(rng.integers(length))
        stop = int(rng.integers(start + 1, length + 1))
        rows.append([*key, doc, start, stop])
        want += stop < length
    rows = np.array(rows, dtype=P.DTYPE)
    assert 0 < want < len(rows)
    assert int(targets.cut(rows).sum()) == want
    assert targets.cut(rows[:0]).tolist() == []
    # a window's steps counted together, as one by one; two of the units mask some tokens
    from overlord_dask import masked_runs

    runs = {}
    for key in [(0, 1, 3), (2, 4, 17)][: 2 if docs_per_unit < 1000 else 0]:
        lens = doc_lengths[key]
        offsets = np.concatenate([[0], np.cumsum(lens)])
        runs[key] = masked_runs.encode(rng.random(int(offsets[-1])) < 0.7, offsets)
        targets.keep_lengths(key, lens, runs[key])

    def expected(step_rows):  # piece by piece, from the runs
        shifted = hf = 0
        for *key, doc, start, stop in step_rows.tolist():
            L = int(doc_lengths[tuple(key)][doc])
            shifted += stop - start - 1 + (stop < L)
            hf += stop - start - 1
            if tuple(key) in runs:
                r, n, d = runs[tuple(key)], len(doc_lengths[tuple(key)]), np.array([doc])
                shifted -= int(masked_runs.masked_in(r, n, d, np.array([start + 1]), np.array([min(stop + 1, L)]))[0])
                hf -= int(masked_runs.masked_in(r, n, d, np.array([start + 1]), np.array([stop]))[0])
        return shifted, hf

    steps = np.split(rows, [30, 30, 170, 390])  # (an empty step among them)
    assert targets.loss_tokens_of(steps) == [expected(r) for r in steps]
    assert (min(targets.masked_targets(rows)) > 0) == bool(runs)
    targets.forget((2, 4, 17))
    with pytest.raises(KeyError):  # a piece of a unit whose lengths were let go: a bug, said loudly
        targets.cut(rows)


def test_a_streams_slice_of_pieces_is_the_same_on_the_one_piece_path_and_without_keys():
    """A block's slice of documents becomes piece rows the same way whether every document is
    one piece (no expansion) or some are cut, emptied by a length class, dropped, or started
    mid-document; without order keys the rows are the same."""
    from types import SimpleNamespace

    from overlord_dask.planner.streams import rows as R

    class Ordering:
        def file_docs(self, key, idx):
            return idx * 3 + 1, idx + 7

    def expanded(s, key, lens, lo, hi, tok):  # every document through the general expansion
        L = lens[lo:hi].copy()
        rem = L.copy()
        rem[0] -= tok
        if (mask := s.class_mask(L, None)) is not None:
            rem[~mask] = 0
        if s.drop_over is not None:
            dropped = L > s.drop_over
            dropped[0] &= tok == 0
            rem[dropped] = 0
        n = np.where(rem > 0, -(-rem // s.piece_tokens), 0)
        if not n.sum():
            return None
        d = np.repeat(np.arange(len(L)), n)
        k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        start = k * s.piece_tokens + np.where(d == 0, tok, 0)
        stop = np.minimum(start + s.piece_tokens, L[d])
        units, docs = s.ordering.file_docs(key, d + lo)
        rows = np.stack([np.full(len(d), key[0]), units, docs, start, stop], axis=1)
        keys = np.stack([np.full(len(d), key[0]), np.full(len(d), key[1]), d + lo, start], axis=1)
        return rows, keys, int((stop - start).sum())

    rng = np.random.default_rng(8)
    fast = 0
    for _ in range(1500):
        n = int(rng.integers(1, 30))
        lens = rng.integers(0 if rng.random() < 0.2 else 1, int(rng.choice([5, 64, 3000])), n).astype(np.int64)
        lo = int(rng.integers(0, n))
        hi = int(rng.integers(lo + 1, n + 1))
        tok = int(rng.integers(0, max(1, lens[lo]))) if rng.random() < 0.4 else 0
        masked = rng.random() < 0.2
        s = SimpleNamespace(
            piece_tokens=int(rng.choice([4, 64, 1000])),
            drop_over=int(rng.integers(1, 100)) if rng.random() < 0.2 else None,
            ordering=Ordering(),
            class_mask=lambda L, cls, m=masked: (L > 20) if m else None,
        )
        got, want = R._slice_rows(s, None, (2, 5), lens, lo, hi, tok), expanded(s, (2, 5), lens, lo, hi, tok)
        assert (got is None) == (want is None)
        if got is None:
            continue
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]
        bare = R._slice_rows(s, None, (2, 5), lens, lo, hi, tok, want_keys=False)
        assert bare[1] is None and np.array_equal(bare[0], want[0])
        fast += len(want[0]) == hi - lo and (lens[lo:hi] <= s.piece_tokens).all()
    assert fast > 100  # (the one-piece path was taken often)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_kept_ahead_of_a_cursor_are_those_a_fresh_scan_gives(seed):
    """A stream keeps the rows it scanned and the planner did not take (``rows._ahead``); asked
    again from the same cursor it starts from them. Two streams of one source, one keeping rows
    and one scanning afresh at every call, go through the same asks and takes (prefixes, a last
    piece cut short as ``packing: cut`` cuts it), partly loaded blocks, a drop policy and a
    piece size that change on the way, and cursors put back: they give the same rows and move
    their cursors alike; many asks need no scan."""
    from overlord_dask.planner.streams import SourceStream
    from overlord_dask.planner.streams import rows as R

    rng = np.random.default_rng(seed)
    sizes = rng.integers(5, 40, 12)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    lens = [rng.integers(0, 60, int(n)).astype(np.int64) for n in sizes]
    kept, fresh = (SourceStream("src", 0, len(sizes), first, seed, 16, block_units=3) for _ in range(2))
    scans = {"kept": 0}
    scan = R._scan

    def counting(s, *a, **k):
        scans["kept"] += s is kept
        return scan(s, *a, **k)

    R._scan = counting
    try:
        hits, asked = 0, []
        for _ in range(600):
            want = kept.loads.want(kept, 400, 2)
            assert want == fresh.loads.want(fresh, 400, 2)
            asked += want
            arrive = len(asked) if rng.random() < 0.7 else int(rng.integers(0, len(asked) + 1))  # (or a part)
            for e, u in asked[:arrive]:
                kept.add_lengths(e, u, lens[u])
                fresh.add_lengths(e, u, lens[u])
            del asked[:arrive]
            if rng.random() < 0.05:
                pt, drop = int(rng.choice([8, 16, 40])), (45 if rng.random() < 0.5 else None)
                for s in (kept, fresh):
                    s.piece_tokens, s.drop_over = pt, drop
            n = int(rng.integers(1, 150))
            fresh.ahead = None
            before = scans["kept"]
            (a, ok_a), (b, ok_b) = kept.pieces_ahead(n), fresh.pieces_ahead(n)
            hits += scans["kept"] == before
            m = min(len(a), len(b))
            assert ok_a == ok_b and np.array_equal(a[:m], b[:m])
            if not ok_a or not m:
                continue
            taken = a[: int(rng.integers(1, m + 1))].copy()
            if rng.random() < 0.3 and taken[-1, 4] - taken[-1, 3] > 1:
                taken[-1, 4] -= 1  # cut short: the rest of the document comes next
            saved = kept.cursor()
            kept.take(taken), fresh.take(taken)
            assert kept.cursor() == fresh.cursor()
            if rng.random() < 0.1:  # a later source of the window starved: the planner puts the cursors back
                kept.restore(saved), fresh.restore(saved)
            else:
                kept.finished_units(), fresh.finished_units()
    finally:
        R._scan = scan
    assert hits >= 150, hits  # (asks the kept rows answered without a scan)


def test_progress_commits_and_makes_durable_by_mode():
    p = Progress("checkpoint", dp=2, cp=1)
    assert p.ack(0, 3, planned=5) == 0  # rank 1 has not consumed anything yet
    assert p.ack(1, 2, planned=5) == 3 and p.durable_step == 0  # consumed, not saved by any trainer
    p.ack(0, 3, durable=True, planned=5)
    p.ack(1, 1, durable=True, planned=5)
    assert p.committed == 3 and p.durable_step == 2
    assert p.ack(1, 0, planned=5) == 3  # idempotent: acks never move back
    with pytest.raises(ValueError, match=r"rank 2 does not exist: the plan has dp=2 ranks \(0..1\)"):
        p.ack(2, 0, planned=5)
    with pytest.raises(ValueError, match="only steps < 5 were planned"):
        p.ack(0, 5, planned=5)
    assert Progress("ack", 2, 1).durable_step == Progress("ack", 2, 1).committed == 0
    # one call for what a rank consumed and what it saved (its replicas' least): saved never past consumed
    q = Progress("checkpoint", dp=1, cp=1)
    assert q.ack(0, 4, planned=9, saved=2) == 5 and q.durable_step == 3
    assert q.ack(0, 5, planned=9, saved=7) == 6 and q.durable_step == 6
    assert q.ack(0, 5, planned=9, saved=-1) == 6 and q.durable_step == 6  # nothing saved: unchanged
    with pytest.raises(ValueError, match="only steps < 5 were planned"):
        q.ack(0, 6, planned=5)
    assert q.ack(0, 6, planned=5, checked=True) == 7  # (the caller checked against what was planned then)
    p.restart_at(7)
    assert p.committed == p.durable_step == 7


def test_ledger_keeps_a_bounded_history_but_never_an_uncommitted_step():
    ledger = Ledger(history_steps=3)
    rows = np.array([[0, 0, 0, 0, 0, 5]], dtype=np.int64)
    for step in range(6):
        ledger.record(step, rows, np.zeros((1, 2), np.int32), np.zeros((0, 5), np.int64), {"step": step}, committed=1)
    assert list(ledger) == [1, 2, 3, 4, 5]  # step 0 was committed; 1.. were not, so they stay
    assert list(ledger.metrics) == [3, 4, 5] and ledger[5]["pieces"] is rows and len(ledger) == 5


def test_window_starts_keep_the_window_of_the_oldest_non_durable_step():
    n = iter(range(100))
    w = WindowStarts(lambda: {"at": next(n)})
    topo = {"dp": 2}
    for start in (0, 8, 16, 24):
        w.begin(start, topo)
    w.prune(keep_from=17)  # steps 16.. are in the window starting at 16: 0 and 8 can go
    assert list(w.starts) == [16, 24] and w.at(17) == (16, {"at": 2}, topo) and w.oldest == 16
    w.begin(32, topo)
    w.abandon(32)  # starved: it is planned again from the same state
    assert list(w.starts) == [16, 24]
    assert w.at(15) is None  # nothing kept that far back
    other = WindowStarts(lambda: {})
    other.begin(40, {"dp": 3})
    other.keep_before(40, w)  # a rewound planner keeps the older window starts
    assert list(other.starts) == [16, 24, 40] and other.at(30)[2] == topo and other.at(41)[2] == {"dp": 3}


def test_policies_are_named_in_one_registry_and_their_counters_round_trip():
    assert POLICIES == {"none": ExactStep, "cost": CostBalanced}
    cost = CostBalanced(2)
    cost.selected[:] = [5, 7]
    cost.cls_selected[:] = [[1, 2], [3, 4]]
    cost.pending = P.with_age(np.array([[1, 0, 2, 3, 0, 9]], dtype=np.int64), 2)
    again = CostBalanced(3)  # a plan update added a source after the snapshot
    again.set_state(cost.get_state(), 3)
    assert again.selected.tolist() == [5, 7, 0] and again.cls_selected.tolist() == [[1, 2], [3, 4], [0, 0]]
    assert np.array_equal(again.pending, cost.pending)
    exact = ExactStep(2)
    exact.carry[:] = [0.5, -0.5]
    exact.grow(3)
    assert exact.carry.tolist() == [0.5, -0.5, 0.0] and exact.window_steps(None) == 1 and not exact.plans_ahead
    assert set(exact.get_state()) == {"cum_tokens", "cum_declared", "carry"}


def test_chunks_default_to_a_million_tokens_within_half_the_prefetch_bound():
    from overlord_dask.plan import Loading, Topology
    from overlord_dask.scheduler.chunks import CHUNK_TOKENS, chunk_steps

    small = Topology(dp=4, micro_batches=2, tokens_per_micro_batch=16384)  # 131k tokens per step
    big = Topology(dp=64, micro_batches=8, tokens_per_micro_batch=8192)  # 4M tokens per step
    assert chunk_steps(Loading(prefetch_steps=32), small) == 8 == CHUNK_TOKENS // small.step_tokens
    assert chunk_steps(Loading(prefetch_steps=16), small) == 8  # raised from a quarter (4) to ~1M tokens
    assert chunk_steps(Loading(prefetch_steps=8), small) == 4  # but never past half the bound
    assert chunk_steps(Loading(prefetch_steps=3), small) == 1
    assert chunk_steps(Loading(prefetch_steps=64), small) == 16  # a quarter, when that is more
    assert chunk_steps(Loading(prefetch_steps=16), big) == 4  # big steps: a quarter of the bound
    assert chunk_steps(Loading(prefetch_steps=16, batch_steps=3), small) == 3  # the plan's own choice wins
    assert chunk_steps(Loading(prefetch_steps=4, batch_steps=9), small) == 4  # within the bound


def test_a_chunk_is_split_into_tasks_only_to_keep_each_within_its_token_cap():
    """Each group of ranks draws on nearly every block, so a chunk split over workers copies its
    blocks to each of them: a chunk is one task unless that task would exceed ``TASK_TOKENS`` or
    ``TASK_RANKS``."""
    from overlord_dask.plan import Topology
    from overlord_dask.scheduler.chunks import TASK_RANKS, TASK_TOKENS, chunk_tasks

    dp, steps, ledger = 8, [], {}
    for s in range(8):
        ledger[s] = {
            "pieces": np.array([[0, 0, r, 0, 0, 10] for r in range(dp)], np.int64),
            "slot": np.array([[r, 0] for r in range(dp)], np.int64),
        }
        steps.append({"step": s, "piece_tokens": 10})
    for tpmb in (1024, 65536, 262144):  # chunks of 64k, 4M and 16M tokens: one task each
        topo = Topology(dp=dp, micro_batches=1, tokens_per_micro_batch=tpmb)
        assert 8 * topo.step_tokens <= TASK_TOKENS
        (task,) = chunk_tasks(steps, ledger, topo, BatchLayout(1, tpmb), run_id="r")
        assert task["ranks"] == [0, dp] and [len(P.slot_from_bytes(p["slot"])) for p in task["steps"]] == [dp] * 8
    big = Topology(dp=dp, micro_batches=8, tokens_per_micro_batch=65536)  # 32M tokens: two tasks of 16M
    assert [t["ranks"] for t in chunk_tasks(steps, ledger, big, BatchLayout(8, 65536), run_id="r")] == [[0, 4], [4, 8]]
    huge = Topology(dp=dp, micro_batches=32, tokens_per_micro_batch=65536)  # 128M tokens: one task per rank
    tasks = chunk_tasks(steps, ledger, huge, BatchLayout(32, 65536), run_id="r")
    assert [t["ranks"] for t in tasks] == [[r, r + 1] for r in range(dp)]
    assert all(
        (t["ranks"][1] - t["ranks"][0]) * 8 * huge.micro_batches * huge.tokens_per_micro_batch <= TASK_TOKENS
        for t in tasks
    )
    # many small ranks: at most TASK_RANKS per task, however few their tokens
    wide = 2 * TASK_RANKS + 1
    ledger = {
        s: {
            "pieces": np.array([[0, 0, r, 0, 0, 10] for r in range(wide)], np.int64),
            "slot": np.array([[r, 0] for r in range(wide)], np.int64),
        }
        for s in range(8)
    }
    small = Topology(dp=wide, micro_batches=1, tokens_per_micro_batch=16)
    tasks = chunk_tasks(steps, ledger, small, BatchLayout(1, 16), run_id="r")
    spans = [t["ranks"] for t in tasks]
    assert len(tasks) == 3 and spans[0][0] == 0 and spans[-1][1] == wide
    assert all(hi - lo <= TASK_RANKS for lo, hi in spans) and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_a_chunk_task_holds_its_ranks_pieces_in_the_order_the_planner_put_them_in_each_bin():
    """Each task holds exactly its ranks' pieces, every (rank, micro-batch) bin's in the ledger's
    order (the order they are packed in), and the units they come from."""
    from overlord_dask.plan import Topology
    from overlord_dask.scheduler.chunks import chunk_tasks

    rng = np.random.default_rng(4)
    dp, mbs, ledger, steps = 8, 2, {}, []
    for s in range(3):
        n = 200
        pieces = np.zeros((n, P.WIDTH), np.int64)
        pieces[:, P.SOURCE], pieces[:, P.UNIT] = rng.integers(0, 3, n), rng.integers(0, 50, n)
        pieces[:, P.DOC], pieces[:, P.STOP] = np.arange(n), rng.integers(1, 100, n)
        ledger[s] = {"pieces": pieces, "slot": np.stack([rng.integers(0, dp, n), rng.integers(0, mbs, n)], axis=1)}
        steps.append({"step": s, "piece_tokens": 100})
    topo = Topology(dp=dp, micro_batches=mbs, tokens_per_micro_batch=1 << 20)  # 3 x 16M tokens: 12 tasks of 4M
    tasks = chunk_tasks(steps, ledger, topo, BatchLayout(mbs, 1 << 20), run_id="r")
    assert len(tasks) > 1
    for t in tasks:
        lo, hi = t["ranks"]
        used = set()
        for part in t["steps"]:
            entry = ledger[part["step"]]
            got, slot = P.unpack(part["pieces"]), P.slot_from_bytes(part["slot"])
            for r in range(dp):
                for m in range(mbs):
                    want = entry["pieces"][(entry["slot"][:, 0] == r) & (entry["slot"][:, 1] == m)]
                    mine = got[(slot[:, 0] == r) & (slot[:, 1] == m)]
                    assert np.array_equal(mine, want if lo <= r < hi else want[:0])
            used |= {tuple(u) for u in P.units(got).tolist()}
        assert {tuple(u) for u in P.from_bytes(t["units"], 3).tolist()} == used


def test_a_text_source_short_of_metadata_asks_for_a_batch_of_units_that_one_task_reads():
    from overlord_dask.loading.partition import partition
    from overlord_dask.planner.streams.lookahead import REFILL_TOKENS
    from overlord_dask.planner.streams.stream import SourceStream

    n_units, per_unit = 64, 100_000  # 100 documents of 1,000 tokens per unit
    s = SourceStream("web", 0, n_units, np.arange(n_units, dtype=np.int64) * 100, seed=0, piece_tokens=4096)
    first = s.loads.want(s, 250_000, 2)
    assert len(first) == 2  # nothing measured yet: units_ahead loads
    for e, u in first:
        s.add_lengths(e, u, np.full(100, 1000))
    assert s.loads.want(s, 150_000, 2) == []  # 200k tokens at hand cover the target
    batch = s.loads.want(s, 250_000, 2)  # short of it: ~REFILL_TOKENS worth of units at once
    assert len(batch) == -(-REFILL_TOKENS // per_unit)
    assert s.loads.want(s, 250_000, 2) == []  # what is on its way covers the target: nothing more
    # the driver reads such a batch of cheap units with few tasks (at 1 ms a document: 0.1 s a unit)
    tasks = partition([["web", e, u] for e, u in batch], lambda src, u: 100, {"web": 1e-3}, 0.5)
    assert len(tasks) < len(batch) and sum(len(t.units) for t in tasks) == len(batch)

    img = SourceStream("photos", 1, n_units, np.arange(n_units, dtype=np.int64) * 100, seed=0, piece_tokens=4096)
    for e, u in img.loads.want(img, 250_000, 2):
        img.add_lengths(e, u, np.full(100, 1000), vision=np.full(100, 256))
    assert len(img.loads.want(img, 300_000, 2)) == 2  # units with images: units_ahead at a time, as before


def test_step_digests_pack_in_chunks_of_consecutive_steps_and_a_delta_carries_those_after_its_last():
    from overlord_dask.planner.ledger import digests_after, pack_digests, step_digest, unpack_digests

    rows, slot = np.arange(12, dtype=np.int64).reshape(2, 6), np.array([[0, 1], [1, 0]], dtype=np.int32)
    d = step_digest(rows, slot)
    assert d == step_digest(rows.copy(), slot.copy()) and d != step_digest(rows, slot[::-1].copy())
    assert d != step_digest(rows[::-1].copy(), slot)  # the order of a step's pieces is part of it
    digests = {5: 1, 6: 2, 7: 2**32 - 1, 9: 4}
    chunks = pack_digests(digests)
    assert [c[0] for c in chunks] == [5, 9] and unpack_digests(chunks) == digests
    assert unpack_digests(digests_after(chunks, 5)) == {6: 2, 7: 2**32 - 1, 9: 4}
    assert unpack_digests(digests_after(chunks, 8)) == {9: 4} and digests_after(chunks, 9) == []
    assert unpack_digests(chunks + digests_after(pack_digests({10: 7}), 9)) == {**digests, 10: 7}  # base + delta
