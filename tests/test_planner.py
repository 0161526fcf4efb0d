"""The planner without a cluster: property tests of mixing, packing, assignment and the ledger."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from overlord_dask.observe.figures import step_imbalance
from overlord_dask.plan import plan_from_dict
from overlord_dask.planner.cost_model import doc_costs
from overlord_dask.planner.policies.base import Starved
from overlord_dask.planner.policies.exact import CARRY_FRACTION, assign_bins, next_carry, select_step
from overlord_dask.planner.state import PlannerState
from overlord_dask.planner.streams.stream import SourceStream


def make_streams(
    lengths: list[list[np.ndarray]], piece_tokens: int, epochs: int = 3, seed: int = 0, block_units: int = 1
) -> list[SourceStream]:
    """Streams whose every unit (for ``epochs`` epochs) is already loaded."""
    out = []
    for i, units in enumerate(lengths):
        first = np.concatenate([[0], np.cumsum([len(u) for u in units])[:-1]]).astype(np.int64)
        s = SourceStream(f"s{i}", i, len(units), first, seed, piece_tokens, block_units=block_units)
        for e in range(epochs):
            for u, L in enumerate(units):
                assert s.add_lengths(e, u, np.asarray(L, dtype=np.int64))
        out.append(s)
    return out


def run_steps(streams, weights, n_bins, capacity, steps):
    carry = np.zeros(len(streams))
    cum = np.zeros(len(streams), dtype=np.int64)
    out = []
    for _ in range(steps):
        sel = select_step(streams, weights, n_bins, capacity, carry)
        cum += sel.source_tokens
        carry = next_carry(cum, weights * cum.sum(), sel.longest_piece)
        out.append(sel)
    return out


source_lengths = st.lists(  # units of a source, each a list of document lengths (0 = empty document)
    st.lists(st.integers(0, 3000), min_size=1, max_size=12), min_size=1, max_size=5
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sources=st.lists(source_lengths, min_size=1, max_size=4),
    raw_weights=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4),
    n_bins=st.integers(1, 6),
    capacity=st.sampled_from([256, 1024, 4096]),
    seed=st.integers(0, 2**32),
    block_units=st.sampled_from([1, 2, 5]),  # loading.shuffle_units: units whose documents are shuffled together
)
@example(  # four sources, one far behind at a step's close: the others' surpluses add up
    sources=[[[0]], [[1164]], [[0], [0, 0, 1338], [200], [3, 0, 203, 916, 1594, 3000], [0]], [[0]]],
    raw_weights=[1.0, 0.625, 0.25, 1.0],
    n_bins=4,
    capacity=4096,
    seed=131,
    block_units=1,
)
def test_selection_properties(sources, raw_weights, n_bins, capacity, seed, block_units):
    # every source needs enough tokens per epoch for 40 epochs to cover 6 steps
    sources = [list(units) + [[3000] * 5] for units in sources]
    w = np.array(raw_weights[: len(sources)])
    w = w / w.sum()
    piece = capacity
    streams = make_streams([[np.array(u) for u in units] for units in sources], piece, 40, seed, block_units)
    sels = run_steps(streams, w, n_bins, capacity, steps=6)
    per_source: dict[int, list] = {i: [] for i in range(len(sources))}
    previous_longest = 0
    for sel in sels:
        assert all(sum(p.length for p in b) <= capacity for b in sel.bins)  # no capacity violation
        assert sel.total_tokens == sum(p.length for b in sel.bins for p in b)
        # per-step mix bound: a source ends a step at most one piece (plus the carry's spread) ahead,
        # so one is behind by at most the others' surpluses (see the policy's docstring)
        err = np.abs(sel.source_tokens - w * sel.total_tokens)
        one_ahead = sel.longest_piece + 2 * CARRY_FRACTION * previous_longest
        assert err.max() <= max(1, len(sources) - 1) * one_ahead + 1e-9
        previous_longest = sel.longest_piece
        order = sorted(
            (p for b in sel.bins for p in b),
            key=lambda p: (*streams[p.source].order_key(p.epoch, p.unit, p.doc), p.start),
        )
        for p in order:
            per_source[p.source].append(p)
    # each source's pieces tile its documents in (shuffled) order, exactly once, each piece <= piece size
    for i, pieces in per_source.items():
        s = streams[i]
        expect_e, expect_pos, expect_doc, expect_tok = 0, 0, 0, 0
        for p in pieces:
            assert p.length <= piece and p.length > 0
            e, pos, doc = s.order_key(p.epoch, p.unit, p.doc)
            L = s.lengths[(e, pos)]  # the block's lengths, in shuffled order
            # skip empty documents and finished blocks between consecutive pieces
            while (expect_e, expect_pos) != (e, pos) or expect_doc != doc:
                assert expect_tok == 0, "a document was left half-delivered"
                Lcur = s.lengths[(expect_e, expect_pos)]
                if expect_doc < len(Lcur):
                    assert Lcur[expect_doc] == 0, "a non-empty document was skipped"
                    expect_doc += 1
                else:
                    expect_doc = 0
                    expect_pos += 1
                    if expect_pos == s.ordering.n_blocks:
                        expect_e, expect_pos = expect_e + 1, 0
            assert p.start == expect_tok
            expect_tok = p.stop if p.stop < L[doc] else 0
            if expect_tok == 0:
                expect_doc += 1


def test_deterministic_and_independent_of_load_timing():
    rng = np.random.default_rng(3)
    lengths = [[rng.integers(1, 3000, 40) for _ in range(6)] for _ in range(3)]
    w = np.array([0.5, 0.3, 0.2])
    a = run_steps(make_streams(lengths, 2048), w, 4, 2048, 20)
    # same plan, but unit lengths arrive late and in another order: Starved until they do
    streams = make_streams(lengths, 2048, epochs=0)
    pending = [(i, e, u) for e in range(3) for i in range(3) for u in range(6)]
    rng.shuffle(pending)
    b, carry, cum = [], np.zeros(3), np.zeros(3, dtype=np.int64)
    while len(b) < 20:
        try:
            sel = select_step(streams, w, 4, 2048, carry)
        except Starved:
            i, e, u = pending.pop()
            assert streams[i].add_lengths(e, u, lengths[i][u])
            continue
        cum += sel.source_tokens
        carry = next_carry(cum, w * cum.sum(), sel.longest_piece)
        b.append(sel)
    for x, y in zip(a, b):
        assert [[p.as_list() for p in bin_] for bin_ in x.bins] == [[p.as_list() for p in bin_] for bin_ in y.bins]


@pytest.mark.parametrize("seed", range(24))
def test_wfq_select_takes_the_smallest_tags_over_every_piece_ahead(seed):
    """``wfq_select`` equals its definition over every piece the streams have ahead: the pieces
    sorted by tag ``(surplus + tokens before it) / weight`` (ties: the lower source), taken while
    they fit the budget (with ``cut``, the next one cut to the tokens left), each source's
    cursor moved past what it gave; window after window, a surplus carried."""
    from overlord_dask.pieces import SOURCE, STOP, WIDTH, stream_lengths
    from overlord_dask.planner.policies.balance import wfq_select

    rng = np.random.default_rng(seed)
    sources = [  # units of documents of 0 to 3,000 tokens, each with one of at least 1,000
        [
            np.append(rng.integers(0, 3000, int(rng.integers(0, 12))), rng.integers(1000, 3000))
            for _ in range(rng.integers(1, 5))
        ]
        for _ in range(rng.integers(1, 5))
    ]
    weights = rng.choice([0.0, 0.05, 0.3, 1.0], len(sources))
    weights[rng.integers(len(sources))] = 1.0
    weights = weights / weights.sum()
    budgets = rng.integers(1, 6000, 6)
    piece_tokens, cut = int(rng.choice([64, 700, 4096])), bool(seed % 2)
    got = make_streams(sources, piece_tokens, epochs=80, seed=seed)
    ref = make_streams(sources, piece_tokens, epochs=80, seed=seed)
    surplus = np.zeros(len(sources))
    for budget in budgets:
        active = np.flatnonzero(weights > 0)
        ahead = {int(i): ref[i].pieces_ahead(int(budget) + 2 * piece_tokens)[0] for i in active}
        keys = []
        for i, rows in ahead.items():
            lens = stream_lengths(rows)
            before = np.cumsum(lens) - lens
            keys += [((surplus[i] + b) / weights[i], i, k, int(n)) for k, (b, n) in enumerate(zip(before, lens))]
        keys.sort(key=lambda t: (t[0], t[1]))
        want, total = [], 0
        for _, i, k, n in keys:
            if total + n > budget:
                if cut and budget > total:
                    want.append([i, *ahead[i][k]])
                    want[-1][STOP] -= total + n - budget
                break
            want.append([i, *ahead[i][k]])
            total += n
        want = np.array(want, dtype=np.int64).reshape(-1, WIDTH)
        rows = wfq_select(got, weights, budget, surplus, cut)
        assert rows.tolist() == want.tolist()
        for i in active:
            ref[i].take(want[want[:, SOURCE] == i, 1:])
        assert [s.cursor() for s in got] == [s.cursor() for s in ref]
        for i in range(len(sources)):
            surplus[i] += stream_lengths(rows[rows[:, SOURCE] == i, 1:]).sum() - weights[i] * budget


def test_long_documents_are_split_into_pieces():
    streams = make_streams([[np.array([10_000, 100])]], piece_tokens=4096)
    sel = select_step(streams, np.array([1.0]), 4, 4096)
    pieces = sorted((p for b in sel.bins for p in b if p.epoch == 0), key=lambda p: (p.doc, p.start))
    assert [(p.doc, p.start, p.stop) for p in pieces] == [(0, 0, 4096), (0, 4096, 8192), (0, 8192, 10_000), (1, 0, 100)]


def test_starved_step_rolls_back_cursors():
    streams = make_streams([[np.array([100] * 5)], [np.array([100] * 5)]], 1024, epochs=1)
    del streams[1].lengths[(0, 0)]
    before = [s.cursor() for s in streams]
    with pytest.raises(Starved) as exc:
        select_step(streams, np.array([0.5, 0.5]), 2, 1024)
    assert exc.value.source == "s1"
    assert [s.cursor() for s in streams] == before


def test_assign_bins_fills_every_slot_once():
    costs = np.random.default_rng(0).random(12) * 100
    slots = assign_bins(costs, dp=4, micro_batches=3)
    assert sorted(slots.ravel()) == list(range(12))
    with pytest.raises(ValueError, match="expected 12 bins"):
        assign_bins(costs[:5], 4, 3)


def test_imbalance_metrics():
    mb = np.array([[4.0, 1.0], [2.0, 1.0]])
    step, per_mb = step_imbalance(mb)
    assert step == pytest.approx(5 / 4)  # rank costs 5 and 3
    assert per_mb == pytest.approx(4 / 3)  # micro-batch 0: 4 vs 2


def _state(dp=2, prefetch=2, weights=(0.6, 0.4)):
    plan = plan_from_dict(
        {
            "sources": [
                {"name": "a", "format": "zarr", "url": "a.zarr", "weight": weights[0]},
                {"name": "b", "format": "zarr", "url": "b.zarr", "weight": weights[1]},
            ],
            "topology": {"dp": dp, "micro_batches": 2, "tokens_per_micro_batch": 1024},
            "loading": {"prefetch_steps": prefetch, "units_ahead": 3},
        }
    )
    return PlannerState(plan, {"a": [0, 50, 100], "b": [0, 40]})


def _feed(state, rng):
    for name, epoch, unit in state.wanted():
        state.add_lengths(name, epoch, unit, rng.integers(1, 900, 50 if name == "a" else 40))


def test_state_prefetch_bound_acks_and_cost_accounting():
    st_ = _state()
    rng = np.random.default_rng(1)
    planned = []
    for _ in range(10):
        _feed(st_, rng)
        steps, _ = st_.plan_steps(10)
        planned += steps
    assert st_.next_step == 2  # prefetch_steps=2 and nothing acknowledged
    assert st_.ack(0, 1) == 0 and st_.ack(1, 0) == 1  # committed = min over ranks + 1
    assert st_.ack(0, 0) == 1  # idempotent, never goes back
    with pytest.raises(ValueError, match=r"rank 2 does not exist: the plan has dp=2 ranks \(0..1\)"):
        st_.ack(2, 0)
    with pytest.raises(ValueError, match="acknowledged step 5, but only steps < 2 were planned"):
        st_.ack(0, 5)
    _feed(st_, rng)
    steps, _ = st_.plan_steps(10)
    assert [s["step"] for s in steps] == [2]
    # metrics equal a recomputation from the ledger
    for s in range(3):
        entry, m = st_.ledger[s], st_.metrics[s]
        lens = entry["pieces"][:, 5] - entry["pieces"][:, 4]
        per_rank = np.zeros(2)
        np.add.at(per_rank, entry["slot"][:, 0], doc_costs(lens, st_.plan.cost))
        assert m["cost_max"] == pytest.approx(per_rank.max()) and m["cost_mean"] == pytest.approx(per_rank.mean())
        assert m["tokens"] == lens.sum()


def test_a_starved_window_is_tried_again_only_once_a_unit_of_its_source_arrived(monkeypatch):
    st_ = _state(prefetch=8)
    tries = []
    plan = st_.policy.plan
    monkeypatch.setattr(st_.policy, "plan", lambda w: tries.append(w.start) or plan(w))
    assert st_.plan_steps(8) == ([], []) and st_.starved_on is not None and len(tries) == 1
    starved = st_.starved_on
    for _ in range(3):  # acks, other sources' units: nothing planning could use
        assert st_.plan_steps(8)[0] == [] and st_.plan_ahead(8) == 0
    wanted = st_.wanted()
    for name, epoch, unit in wanted:
        if name != starved:
            st_.add_lengths(name, epoch, unit, np.full(50 if name == "a" else 40, 100))
    assert st_.plan_steps(8)[0] == [] and len(tries) == 1 and st_.starved_on == starved  # not tried again
    for name, epoch, unit in wanted:
        if name == starved:
            st_.add_lengths(name, epoch, unit, np.full(50 if name == "a" else 40, 100))
    rng = np.random.default_rng(3)
    for _ in range(10):
        _feed(st_, rng)
        st_.plan_steps(8)
    assert st_.next_step == 8 and len(tries) > 1  # its units arrived: planning went on


def test_a_window_that_needs_many_units_is_selected_again_only_once_enough_of_them_arrived(monkeypatch):
    """A window waits for many units of a source (large steps): its selection is not repeated,
    and rolled back, at every unit that arrives (quadratic in the units a window waits for),
    only once the source holds as many tokens as the failed selection asked for; the planned
    stream is the one planned with every unit at hand."""

    def state():
        plan = plan_from_dict(
            {
                "sources": [
                    {"name": "a", "format": "zarr", "url": "a.zarr", "weight": 0.6},
                    {"name": "b", "format": "zarr", "url": "b.zarr", "weight": 0.4},
                ],
                "topology": {"dp": 4, "micro_batches": 2, "tokens_per_micro_batch": 2048},
                "loading": {"prefetch_steps": 16, "units_ahead": 64},
            }
        )
        return PlannerState(plan, {"a": list(range(0, 50 * 64, 50)), "b": list(range(0, 40 * 64, 40))})

    def lengths(name, epoch, unit):
        return np.random.default_rng([epoch, unit, name == "a"]).integers(1, 300, 50 if name == "a" else 40)

    ref = state()
    while ref.next_step < 16:
        for w in ref.wanted():
            ref.add_lengths(*w, lengths(*w))
        ref.plan_steps(16)

    st_ = state()
    tries, arrivals = [], 0
    plan = st_.policy.plan
    monkeypatch.setattr(st_.policy, "plan", lambda w: tries.append(w.start) or plan(w))
    while st_.next_step < 16:
        for w in st_.wanted():  # one unit at a time, planning after each (as the service does)
            st_.add_lengths(*w, lengths(*w))
            arrivals += 1
            st_.plan_steps(16)
    assert arrivals > 40 and len(tries) < arrivals / 4, (arrivals, len(tries))
    for step in range(16):
        assert np.array_equal(st_.ledger[step]["pieces"], ref.ledger[step]["pieces"])
        assert np.array_equal(st_.ledger[step]["slot"], ref.ledger[step]["slot"])


def test_the_ledger_history_is_out_of_the_garbage_collectors_sight():
    """Every planned step's metrics stay in the ledger's history (100,000 steps by default);
    a full collection in the scheduler's process must not walk them (it blocks the event loop)."""
    import gc

    st_ = _state(prefetch=8)
    rng = np.random.default_rng(2)
    for _ in range(10):
        _feed(st_, rng)
        st_.plan_steps(10)
    assert st_.next_step == 8
    gc.collect()
    for s in range(8):
        assert not gc.is_tracked(st_.metrics[s]), {k: type(v).__name__ for k, v in st_.metrics[s].items()}
        assert not gc.is_tracked(st_.ledger[s])


def test_add_lengths_is_idempotent():
    st_ = _state()
    rng = np.random.default_rng(2)
    wanted = st_.wanted()
    name, e, u = wanted[0]
    L = rng.integers(1, 900, 50)
    assert st_.add_lengths(name, e, u, L) is True
    assert st_.add_lengths(name, e, u, L) is False  # a recomputed load is ignored


def test_progress_keeps_the_committed_step_without_scanning_every_rank():
    """``committed`` is the lowest acknowledged step + 1, kept incrementally (a scan of every
    rank per ack grew with dp²): it moves only when the last rank at the minimum moves on,
    acks are idempotent, and restarts reset it."""
    from overlord_dask.planner.progress import Progress

    rng = np.random.default_rng(0)
    p = Progress("checkpoint", dp=64, cp=2)
    acked = np.full(128, -1)
    for _ in range(3000):
        r, j, step = int(rng.integers(64)), int(rng.integers(2)), int(rng.integers(0, 40))
        durable = bool(rng.random() < 0.3)
        p.ack(r, step, j, durable, planned=40)
        acked[r * 2 + j] = max(acked[r * 2 + j], step)
        assert p.committed == acked.min() + 1
        assert list(p.acked) == acked.tolist()
    assert p.durable_step == min(p.committed, min(p.durable) + 1)
    p.restart_at(7)
    assert p.committed == 7 and p.durable_step == 7 and p.acked[5] == 6
