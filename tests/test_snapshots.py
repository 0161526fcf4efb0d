"""Snapshots: the store on a local folder and on a real S3-compatible server (moto, 127.0.0.1),
and the planner's resume harness: N steps + restore + M steps == N + M steps."""

from __future__ import annotations

import numpy as np
import pytest

from overlord_dask.plan import plan_from_dict
from overlord_dask.planner.state import PlannerState
from overlord_dask.planner.streams.order import stable_seed
from overlord_dask.snapshots import SnapshotError, SnapshotStore

from .harness import planner_stream


# ---- the store ---------------------------------------------------------------------------------
def _exercise_store(url, **opts):
    store = SnapshotStore(url, opts or None)
    assert store.load() is None and not store.exists()
    store.write_base(0, {"committed": 0, "x": b"\x00\x01"})
    store.write_delta(1, 0, 3)
    store.write_delta(2, 0, 5)
    state, seq = store.load()
    assert state["committed"] == 5 and seq == 2 and state["x"] == b"\x00\x01"
    store.write_base(3, {"committed": 7})
    store.write_delta(4, 3, 9)
    store.write_base(5, {"committed": 10})
    assert store.gc(keep_bases=2) == 3  # base 0 and its two deltas
    state, seq = store.load()
    assert state["committed"] == 10 and seq == 5
    return store


def test_store_on_a_local_folder(tmp_path):
    store = _exercise_store(str(tmp_path / "ck"))
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.endswith(".tmp")]  # atomic writes leave nothing behind
    # a crash while writing the next base leaves only a partial temporary file: ignored
    (tmp_path / "ck" / ".base-000000000006.msgpack.0badc0de.tmp").write_bytes(b"\x82\xa7version")
    state, seq = store.load()
    assert state["committed"] == 10 and seq == 5
    # a corrupt newest base: fall back to the previous base and its deltas
    (tmp_path / "ck" / "base-000000000005.msgpack").write_bytes(b"\x93garbage")
    state, seq = store.load()
    assert state["committed"] == 9 and seq == 4
    # a gap in the deltas of a base is an error, not a silent skip
    store.write_base(6, {"committed": 11})
    store.write_delta(8, 6, 12)
    with pytest.raises(SnapshotError, match="has a gap: delta 7 is missing before 8"):
        store.load()


@pytest.mark.integration
def test_store_on_s3(s3_server):
    from overlord_dask.testing.object_store import storage_options

    _exercise_store("s3://overlord/run-1", **storage_options(s3_server))


# ---- the planner resume harness -----------------------------------------------------------------
def _plan(dp=4, policy="cost", window=4):
    return plan_from_dict(
        {
            "seed": 3,
            "sources": [
                {"name": "web", "format": "zarr", "url": "w", "weight": 0.6},
                {"name": "books", "format": "zarr", "url": "b", "weight": 0.4},
            ],
            "topology": {"dp": dp, "micro_batches": 2, "tokens_per_micro_batch": 4096},
            "balance": {"policy": policy, "window": window},
            "loading": {"prefetch_steps": 2 * window + 2, "units_ahead": 8},
        }
    )


FIRST_IDS = {"web": list(range(0, 300 * 64, 64)), "books": list(range(0, 300 * 64, 64))}


def _lengths(name, epoch, unit):
    """Deterministic per unit (a reload after a restart gives the same lengths), like real files."""
    rng = np.random.default_rng(stable_seed("test", name, unit))
    if name == "web":
        return np.clip(rng.lognormal(5.5, 1.0, 64), 1, 20_000).astype(np.int64)
    return np.clip((rng.pareto(1.0, 64) + 1) * 400, 1, 20_000).astype(np.int64)


def _run(state: PlannerState, until: int, *, lengths=_lengths, on_commit=None, hook=None) -> dict[int, tuple]:
    """``harness.planner_stream`` over this file's unit lengths."""
    return planner_stream(state, until, lengths, on_commit=on_commit, hook=hook)


def test_loss_tokens_of_units_still_loading_are_counted_as_their_steps_go_out(monkeypatch):
    """A window's loss tokens are counted when it is planned; where a unit's lengths are not
    there yet (pieces restored from a snapshot, their units loaded again), each step's are
    counted as it goes out, as before: the same counts, and no planning failure."""
    reference = PlannerState(_plan(), FIRST_IDS)
    _run(reference, 12)
    st = PlannerState(_plan(), FIRST_IDS)

    whole = st.streams.targets.loss_tokens_of

    def missing(steps):  # a window's: a unit's lengths missing; a step's at hand-out: there by then
        if len(steps) > 1:
            raise KeyError((0, 0, 5))
        return whole(steps)

    monkeypatch.setattr(st.streams.targets, "loss_tokens_of", missing)
    _run(st, 12)
    counts = [st.ledger.metrics[s]["loss_tokens"] for s in range(12)]
    assert counts == [reference.ledger.metrics[s]["loss_tokens"] for s in range(12)] and all(c[0] > 0 for c in counts)


@pytest.mark.parametrize("policy", ["cost", "none"])
@pytest.mark.parametrize("cut", [0, 7, 9])  # at the start, at an odd step, just past a window boundary
def test_resume_equals_uninterrupted(policy, cut):
    total = 20
    reference = _run(PlannerState(_plan(policy=policy), FIRST_IDS), total)
    first = PlannerState(_plan(policy=policy), FIRST_IDS)
    _run(first, cut)
    state = first.get_state()
    assert state["committed"] == cut
    import msgpack

    state = msgpack.unpackb(msgpack.packb(state, use_bin_type=True), raw=False)  # as stored
    resumed = PlannerState(_plan(policy=policy), FIRST_IDS, state=state)
    again = _run(resumed, total)
    assert sorted(again) == list(range(cut, total))
    for s in range(cut, total):
        np.testing.assert_array_equal(again[s][0], reference[s][0])
        np.testing.assert_array_equal(again[s][1], reference[s][1])


@pytest.mark.parametrize("policy", ["cost", "none"])
def test_a_resume_that_re_plans_a_delivered_step_differently_stops_naming_it(policy, tmp_path):
    """A restore re-plans the steps from its window's start to the committed one without handing
    them out. The snapshot keeps each one's digest as handed out (bases hold them, deltas add
    the ones they commit), and a step that comes out otherwise (here a unit's documents changed
    length since: its file was rewritten) stops the run with a ``ReplayError`` naming it, where
    the run went on before with documents lost or repeated; unless the start accepted changed
    data or code. A snapshot without digests (an older version's) resumes unchecked."""
    import msgpack

    from overlord_dask.errors import ReplayError
    from overlord_dask.planner.ledger import unpack_digests
    from overlord_dask.snapshots import SnapshotWriter

    first = PlannerState(_plan(policy=policy), FIRST_IDS)
    store = SnapshotStore(str(tmp_path / "ck"))
    writer = SnapshotWriter(store, base_every_steps=1000, base_every_seconds=1e9)
    _run(first, 10, on_commit=lambda st: writer.write(msgpack.unpackb(msgpack.packb(st.get_state()), raw=False)))
    state, _ = store.load()
    assert state["committed"] > state["window_step"]  # steps to re-plan
    digests = unpack_digests(state["digests"])
    assert {s: first.ledger.metrics[s]["digest"] for s in range(state["window_step"], state["committed"])}.items() <= (
        digests.items()
    )
    assert store._read(store.url + "/delta-000000000002.msgpack").get("digests")  # (a delta's own)
    again = _run(PlannerState(_plan(policy=policy), FIRST_IDS, state=state), 12)  # the same data: goes on
    assert min(again) == state["committed"] and {10, 11} <= set(again)

    def rewritten(name, epoch, unit):  # the files rewritten since the run began: documents in another order
        out = _lengths(name, epoch, unit)
        return out[::-1].copy()

    with pytest.raises(
        ReplayError, match=f"step {state['window_step']} came out differently .* from the window at step"
    ):
        _run(PlannerState(_plan(policy=policy), FIRST_IDS, state=state), 12, lengths=rewritten)
    # a start that accepted the change (checkpoint.on_data_change or on_code_change: accept) goes on
    _run(PlannerState(_plan(policy=policy), FIRST_IDS, state={**state, "accepted_change": True}), 12, lengths=rewritten)
    state.pop("digests")  # written before digests were kept
    _run(PlannerState(_plan(policy=policy), FIRST_IDS, state=state), 12, lengths=rewritten)


@pytest.mark.parametrize("policy", ["cost", "none"])
def test_a_version_2_snapshot_still_resumes_exactly(policy):
    """Snapshots written before the planner was split into parts (version 2) held every policy's
    counters; a restore reads the running policy's and resumes the same stream."""
    reference = _run(PlannerState(_plan(policy=policy), FIRST_IDS), 16)
    first = PlannerState(_plan(policy=policy), FIRST_IDS)
    _run(first, 9)
    state = first.get_state()
    assert state["version"] == 3
    window = state["window"]
    assert ("carry" in window) == (policy == "none") and ("selected" in window) == (
        policy == "cost"
    )  # the running policy's only
    n = len(window["cursors"])
    state["version"] = 2  # as the previous format wrote it: both policies' counters
    window.setdefault("pending", b""), window.setdefault("selected", [0] * n), window.setdefault("declared", [0.0] * n)
    window.setdefault("cls_selected", b"\0" * 16 * n), window.setdefault("cls_declared", [0.0] * 2 * n)
    (
        window.setdefault("cum_tokens", [0] * n),
        window.setdefault("cum_declared", [0.0] * n),
        window.setdefault("carry", [0.0] * n),
    )
    again = _run(PlannerState(_plan(policy=policy), FIRST_IDS, state=state), 16)
    for s in range(9, 16):
        np.testing.assert_array_equal(again[s][0], reference[s][0])
    state["version"] = 1
    with pytest.raises(ValueError, match="snapshot version 1 is not supported"):
        PlannerState(_plan(policy=policy), FIRST_IDS, state=state)


def _ids(pieces):
    return {tuple(r) for r in pieces[:, [0, 1, 2, 3, 4]].tolist()}


def test_resume_with_another_dp_keeps_exactly_once():
    before = PlannerState(_plan(dp=4), FIRST_IDS)
    delivered = _run(before, 10)
    state = before.get_state()
    after = PlannerState(_plan(dp=2), FIRST_IDS, state=state)
    later = _run(after, 30)
    assert min(later) == 10 and after.topology.dp == 2
    seen: set = set()
    for steps in (delivered, later):
        for pieces, slot in steps.values():
            ids = _ids(pieces)
            assert len(ids) == len(pieces) and not (ids & seen)  # never twice, across the restart
            seen |= ids
            if steps is later:
                assert slot[:, 0].max() < 2  # the new topology
    # nothing lost: everything selected was delivered or is still waiting its turn
    waiting = len(after.pending) + sum(len(rows) for rows, *_ in after.ready)
    selected_tokens = int(after.policy.selected.sum())
    delivered_tokens = sum(int((p[:, 5] - p[:, 4]).sum()) for steps in (delivered, later) for p, _ in steps.values())
    waiting_tokens = int((after.pending[:, 5] - after.pending[:, 4]).sum()) + sum(
        int((rows[:, 5] - rows[:, 4]).sum()) for rows, *_ in after.ready
    )
    assert waiting >= 0 and delivered_tokens + waiting_tokens == selected_tokens


def test_snapshot_state_is_small_and_rejects_other_sources():
    st_ = PlannerState(_plan(), FIRST_IDS)
    _run(st_, 12)
    import msgpack

    blob = msgpack.packb(st_.get_state(), use_bin_type=True)
    assert len(blob) < 16_384
    other = plan_from_dict(
        {**_plan().model_dump(mode="json"), "sources": [{"name": "web", "format": "zarr", "url": "w", "weight": 1.0}]}
    )
    with pytest.raises(ValueError, match=r"snapshot sources \['web', 'books'\] differ from the plan's \['web'\]"):
        PlannerState(other, {"web": FIRST_IDS["web"]}, state=st_.get_state())


def test_resume_after_a_live_update_equals_uninterrupted():
    """The snapshot carries the plan versions: a restart from it (given the original plan)
    continues with the update in force, and the stream equals an uninterrupted run's."""
    base = _plan(policy="cost")
    d = base.model_dump(mode="json")
    d["sources"] = [
        {**d["sources"][1], "weight": 0.6},
        {"name": "extra", "format": "zarr", "url": "x.zarr", "weight": 0.4},
    ]  # web leaves
    new = plan_from_dict(d)
    ids = {**FIRST_IDS, "extra": FIRST_IDS["web"]}

    def lengths(name, epoch, unit):
        return _lengths("web" if name == "extra" else name, epoch, unit + (7 if name == "extra" else 0))

    def run(state, until, update_at=None):
        def live(st):  # the update arrives once the planner is at step 6; planning waits for it there
            if update_at is None:
                return None
            if st.next_step >= 6 and st.plan_version == 0:
                st.update(new, update_at, {"extra": ids["extra"]})
            return 6 if st.plan_version == 0 else None

        return _run(state, until, lengths=lengths, hook=live)

    reference = run(PlannerState(base, ids), 30, update_at=12)
    import msgpack

    first = PlannerState(base, ids)
    run(first, 17, update_at=12)  # crash at 17, after the update applied at 12
    state = msgpack.unpackb(msgpack.packb(first.get_state(), use_bin_type=True), raw=False)
    assert [at for at, _ in state["updates"]] == [12]
    resumed = PlannerState(base, ids, state=state)
    assert resumed.plan_version == 1 and resumed.source_names == ["web", "books", "extra"]
    again = run(resumed, 30)
    assert sorted(again) == list(range(17, 30))
    for s in range(17, 30):
        np.testing.assert_array_equal(again[s][0], reference[s][0])
        np.testing.assert_array_equal(again[s][1], reference[s][1])
    assert not any(
        (reference[s][0][:, 0] == 0).any() for s in range(16, 30)
    )  # web is out from the update on (and its last waiting pieces)


def test_writer_bases_every_n_steps_and_window_deltas_restore_exactly(tmp_path):
    """Bases every N committed steps (or seconds); deltas in between carry the new window's
    state when planning moved on, so a restore from base + deltas is exact at any step."""
    from overlord_dask.snapshots import SnapshotStore, SnapshotWriter

    reference = _run(PlannerState(_plan(policy="cost"), FIRST_IDS), 30)
    store = SnapshotStore(str(tmp_path / "ck"))
    ticks = iter(range(10_000))
    writer = SnapshotWriter(store, base_every_steps=8, base_every_seconds=1e9, keep_bases=10, clock=lambda: next(ticks))
    kinds = []

    def snapshot(state):
        st = state.get_state()
        kinds.append((writer.write(st)[0], st["committed"], st["window_step"]))

    first = PlannerState(_plan(policy="cost"), FIRST_IDS)
    _run(first, 19, on_commit=snapshot)
    assert [k for k, c, _ in kinds if k == "base"] == ["base"] * 3  # at committed 1, 9, 17
    assert [c for k, c, _ in kinds if k == "base"] == [1, 9, 17]
    window_deltas = [f for f in sorted((tmp_path / "ck").glob("delta-*.msgpack")) if "window" in store._read(str(f))]
    assert window_deltas  # planning moved to new windows between bases
    loaded, _ = store.load()
    assert loaded["committed"] == 19 and loaded["window_step"] == first.get_state()["window_step"]
    resumed = PlannerState(_plan(policy="cost"), FIRST_IDS, state=loaded)
    again = _run(resumed, 30)
    for s in range(19, 30):
        np.testing.assert_array_equal(again[s][0], reference[s][0])
    # seconds count too
    writer2 = SnapshotWriter(
        SnapshotStore(str(tmp_path / "ck2")),
        base_every_steps=10**6,
        base_every_seconds=5,
        clock=lambda: next(ticks) * 3.0,
    )
    assert [writer2.write(first.get_state())[0] for _ in range(4)] == ["base", "delta", "base", "delta"]


def test_decisions_travel_in_deltas_and_come_back_whole(tmp_path):
    """The planner's decisions only grow: a delta carries the new ones, a load puts them back
    after the base's (no base per decision)."""
    from overlord_dask.snapshots import SnapshotStore, SnapshotWriter

    store = SnapshotStore(str(tmp_path / "ck"))
    w = SnapshotWriter(store, base_every_steps=1000)
    d = [
        {"at": 5 * i, "kind": "weights", "values": {"a": 1.0}, "reason": f"r{i}", "after": 1, "state": None}
        for i in range(5)
    ]
    state = {"topology": {"dp": 2}, "updates": [], "committed": 0, "window_step": 0, "window": {}, "decisions": d[:1]}
    assert w.write(state)[0] == "base"
    assert w.write({**state, "committed": 3, "decisions": d[:3]})[0] == "delta"
    assert w.write({**state, "committed": 4, "decisions": d[:3]})[0] == "delta"
    assert w.write({**state, "committed": 6, "decisions": d})[0] == "delta"
    loaded, _ = store.load()
    assert loaded["decisions"] == d and loaded["committed"] == 6


def test_a_location_that_keeps_failing_is_logged_once_per_cause_and_its_recovery_once(tmp_path, caplog):
    """A full disk fails every commit's snapshot: one error with its traceback (status shows it
    meanwhile), not one per step; a warning when writes work again."""
    import asyncio
    import logging

    from overlord_dask.plan.checkpoint import Checkpoint
    from overlord_dask.scheduler.snapshot_loop import SnapshotLoop

    async def scenario():
        async def capture():
            return {}

        loop = SnapshotLoop(str(tmp_path / "ck"), Checkpoint(), capture, "r1", seq=-1)
        outcomes = iter([OSError(28, "No space left on device")] * 5 + [None])
        seen = []

        async def write(force=False):
            seen.append(loop.error)
            err = next(outcomes)
            if err is not None:
                raise err

        loop.write = write
        task = asyncio.ensure_future(loop.run())
        for _ in range(6):
            loop.wake()
            await asyncio.sleep(0.01)
        task.cancel()
        return loop, seen

    with caplog.at_level(logging.WARNING, logger="overlord_dask.scheduler.snapshot_loop"):
        loop, seen = asyncio.run(scenario())
    assert len(seen) == 6 and loop.error is None
    assert "No space left on device" in seen[-1]  # what status showed while it lasted
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failed" in m for m in messages) == 1 and sum("works again" in m for m in messages) == 1, messages
