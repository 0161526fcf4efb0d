"""Loss-spike forensics: ``explain`` says which documents every rank trained on at a step (checked
token for token against what the trainers received, live, replayed and offline, across a live
update and a dp change), and a skip of steps A..B is recorded, durable, replayed and explained,
with the skipped documents never delivered (``service/explain.py``, ``planner/timeline.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from overlord_dask import Service
from overlord_dask.errors import PlanError
from overlord_dask.plan import load_plan, plan_from_dict, plan_to_dict
from overlord_dask.planner.rewind import memory_source, rebuild_at
from overlord_dask.planner.state import PlannerState
from overlord_dask.planner.timeline import Timeline
from overlord_dask.service.explain import Explainer, explain_offline, replayed_entry, window_start
from overlord_dask.service.replay import replay

from .harness import ROOT, assert_exactly_once, assert_same_stream, consume, plan_file, planner_stream


def _overlord(*args) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "overlord_dask", *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _received(into: dict):
    """An ``on_batch`` that keeps each piece's tokens by (rank, step, micro-batch, sample id, start)."""

    def on_batch(rank, b):
        for m, mb in enumerate(b["micro_batches"]):
            cu = mb["cu_seqlens"]
            for i, sid in enumerate(mb["sample_ids"]):
                key = (rank, b["step"], m, int(sid), int(mb["piece_starts"][i]))
                into[key] = mb["input_ids"][cu[i] : cu[i + 1]].tolist()

    return on_batch


def _check(explained: dict, received: dict, step: int) -> None:
    """``explained`` lists exactly the pieces the ranks received at ``step``, with their tokens."""
    got = {(p["rank"], step, p["micro_batch"], p["sample_id"], p["start"]): p["token_ids"] for p in explained["pieces"]}
    want = {k: v for k, v in received.items() if k[1] == step}
    assert sorted(got) == sorted(want), f"step {step}: the pieces differ"
    for k in want:
        assert got[k] == want[k], f"{k}: the tokens differ"
    assert explained["skipped"] is None


# ---- the timeline's skips, without a cluster --------------------------------------------------------
def _plan():
    return plan_from_dict(
        {
            "seed": 5,
            "sources": [{"name": "web", "format": "zarr", "url": "w", "weight": 1.0}],
            "topology": {"dp": 2, "micro_batches": 2, "tokens_per_micro_batch": 2048},
            "balance": {"window": 4},
            "loading": {"shuffle_units": 8, "prefetch_steps": 6},
        }
    )


def _lengths(name, epoch, unit):
    return np.random.default_rng(unit).integers(1, 900, 32).astype(np.int64)


FIRST_IDS = {"web": list(range(0, 40 * 32, 32))}


def test_a_skip_is_a_decision_that_covers_its_steps_and_refuses_a_bad_range():
    tl = Timeline(_plan())
    d = tl.decide("skip", 5, {"until": 8}, "spike")
    tl.decide("skip", 20, {"until": 20}, "another")
    assert tl.skip_at(4) is None and tl.skip_at(5) == d and tl.skip_at(8) == d and tl.skip_at(9) is None
    assert tl.first_delivered(6) == 9 and tl.first_delivered(9) == 9 and tl.first_delivered(20) == 21
    assert tl.skipped_between(0, 30) == 5 and tl.skipped_between(6, 21) == 4 and tl.skipped_between(9, 20) == 0
    assert tl.next_jump(0) is None  # a skip ends no planning window: its steps are planned as they would be
    again = Timeline.from_state(_plan(), tl.get_state())
    assert again.skip_at(7).reason == "spike" and again.first_delivered(20) == 21
    for values in ({"until": 3}, {"until": "9"}, {}):
        with pytest.raises(PlanError, match="skip from step 5: 'until' must be a step >= 5"):
            tl.decide("skip", 5, values, "")


def test_skipped_steps_are_planned_never_handed_out_and_the_stream_after_them_is_unchanged():
    """The PaLM remedy at the planner: steps 5..8 are planned (their documents count as used) but
    not handed out; every other step is the one an unskipped run plans; a replay and a restore
    from a snapshot before the skip plan the same."""
    reference = planner_stream(PlannerState(_plan(), FIRST_IDS), 24, _lengths)
    st = PlannerState(_plan(), FIRST_IDS)
    st.timeline.decide("skip", 5, {"until": 8}, "spike")
    got = planner_stream(st, 24, _lengths)
    assert sorted(got) == [s for s in range(24) if not 5 <= s <= 8]
    for s, (pieces, slot) in got.items():
        np.testing.assert_array_equal(pieces, reference[s][0])
        np.testing.assert_array_equal(slot, reference[s][1])
    assert all(st.ledger.metrics[s].get("skipped") for s in range(5, 9)) and not st.ledger.metrics[9].get("skipped")
    skipped = {tuple(r) for s in range(5, 9) for r in reference[s][0][:, :4].tolist()}
    assert not skipped & {tuple(r) for p, _ in got.values() for r in p[:, :4].tolist()}  # never delivered

    snap = PlannerState(_plan(), FIRST_IDS)
    planner_stream(snap, 3, _lengths)
    state = snap.get_state()
    restored = PlannerState(_plan(), FIRST_IDS, state=state, decisions=st.timeline.decisions)
    again = planner_stream(restored, 24, _lengths)
    for s in range(3, 24):
        assert (s in again) == (s in got)
        if s in got:
            np.testing.assert_array_equal(again[s][0], got[s][0])


def test_a_skip_longer_than_the_prefetch_bound_does_not_stall_planning():
    st = PlannerState(_plan(), FIRST_IDS)
    st.timeline.decide("skip", 2, {"until": 40}, "a long stretch")
    got = planner_stream(st, 46, _lengths)
    assert sorted(got)[:7] == [0, 1, 41, 42, 43, 44, 45]


def test_a_rebuilt_planner_can_go_back_to_its_source_window_before_it_plans_it_again():
    """A planner rebuilt at step 3 (a rewind, or a skip of steps it planned) from the run's
    first window (at 0) must load that window's units again before it plans: meanwhile, and
    while a window it tries starves, a rewind to step 2 (a job restarting from an older
    checkpoint) finds that window start, instead of being refused as older than the service
    keeps; planned again, steps 2 on are the first time's."""
    st = PlannerState(_plan(), FIRST_IDS)
    first = planner_stream(st, 12, _lengths)
    rebuilt = rebuild_at(st, 3, memory_source(st, 3))
    assert memory_source(rebuilt, 2)[0] == 0
    planned, _ = rebuilt.plan_steps(4)  # no unit loaded: the window starves
    assert planned == [] and memory_source(rebuilt, 2)[0] == 0
    again = rebuild_at(rebuilt, 2, memory_source(rebuilt, 2))
    got = planner_stream(again, 12, _lengths)
    assert sorted(got) == list(range(2, 12))
    for s in got:
        np.testing.assert_array_equal(got[s][0], first[s][0])


# ---- a service --------------------------------------------------------------------------------------
@pytest.mark.integration
def test_explain_lists_what_each_rank_received_token_for_token(tmp_path, corpus, cluster):
    """Live (the service's ledger), replayed from a snapshot window and offline (the plan file and
    its snapshots, the service gone), across a live update at step 4 and a rewind to dp 1 at
    step 6: every piece each rank received, with its tokens, and nothing else."""
    path = plan_file(tmp_path, corpus, str(tmp_path / "ck"))
    plan = load_plan(path)
    d = plan_to_dict(plan)
    d["sources"][0]["weight"] *= 3
    at_dp2, at_dp1 = {}, {}
    with Service.start(plan, cluster=cluster) as svc:
        assert svc.update_plan(plan_from_dict(d), at_step=4) == 4
        first = consume(svc.address, [0, 1], steps=8, save_at=[6], on_batch=_received(at_dp2))
        second = consume(svc.address, [0], dp=1, states={0: first.saved[(0, 6)]}, steps=4, on_batch=_received(at_dp1))
        assert second.steps() == [(0, s) for s in range(6, 10)]
        received = {**{k: v for k, v in at_dp2.items() if k[1] < 6}, **at_dp1}  # the job went on from step 6 at dp 1
        for step in (0, 3, 4, 7, 9):
            _check(svc.explain(step, tokens=True), received, step)
        one = svc.explain(9, rank=0, preview=50)
        assert {p["rank"] for p in one["pieces"]} == {0} and all(0 < len(p["preview"]) <= 50 for p in one["pieces"])
        piece = one["pieces"][0]
        assert piece["file"].startswith(str(corpus))
        assert {"source", "sample_id", "start", "stop", "tokens"} <= set(piece)
        tl = svc.timeline()
        for step in (1, 5):  # planned again from a stored window start, as for a step the ledger no longer keeps
            entry = replayed_entry(svc.plan, tl, step, window_start(svc.plan, step))
            _check(Explainer(tl.initial, tl).entry(step, entry, tokens=True), received, step)
    for step in (2, 5, 8):
        _check(explain_offline(plan, step, tokens=True), received, step)
    out = json.loads(_overlord("explain", path, "--step", 5, "--rank", 1, "--json"))
    assert {p["rank"] for p in out["pieces"]} == {1} and out["pieces"][0]["preview"]


@pytest.mark.integration
def test_skip_a_bad_stretch_after_restarting_from_a_checkpoint(tmp_path, corpus, cluster):
    """A spike around step 7: the job restarts from its checkpoint at step 4 after
    ``overlord update RUN --skip-steps 5:8``; it receives step 4, then 9 on, each as an unskipped
    run delivers it, and never a document of steps 5..8. The skip is in the timeline and the
    snapshots (a restarted service keeps it, and a checkpoint inside the skip resumes at 9),
    replays and ``explain`` report it."""
    plan = load_plan(plan_file(tmp_path, corpus, str(tmp_path / "ck")))
    with Service.start(load_plan(plan_file(tmp_path, corpus, None)), cluster=cluster) as ref:
        reference = consume(ref.address, [0, 1], steps=16)
    with Service.start(plan, cluster=cluster) as svc:
        first = consume(svc.address, [0, 1], steps=10, save_at=[4, 6])
        out = json.loads(_overlord("update", svc.address, "--skip-steps", "5:8", "--reason", "loss spike at 7"))
        assert out == {"skipped": [5, 8], "reason": "loss spike at 7"}
        after = consume(svc.address, [0, 1], until=14, states={r: first.saved[(r, 4)] for r in (0, 1)})
        assert after.steps() == [(r, s) for r in (0, 1) for s in (4, 9, 10, 11, 12, 13)]
        assert_same_stream(after.ids, {k: v for k, v in reference.ids.items() if k in after.ids})
        skipped = {k: v for k, v in reference.ids.items() if 5 <= k[1] <= 8}
        assert_exactly_once(after.ids, skipped)  # none of steps 5..8's pieces came again
        (skip,) = [d for d in svc.timeline().decisions if d.kind == "skip"]
        assert (skip.at, skip.values, skip.reason) == (5, {"until": 8}, "loss spike at 7")
        ex = svc.explain(6)
        assert ex["skipped"] == {"steps": [5, 8], "reason": "loss spike at 7"}
        assert sorted((p["rank"], p["sample_id"]) for p in ex["pieces"]) == sorted(
            (r, i[2]) for (r, s), ids in reference.ids.items() if s == 6 for i in ids
        )
        tl = svc.timeline()
    ledger = replay(plan, tl, 14)
    assert sorted(ledger) == list(range(14))  # a replay plans the skipped steps too
    with Service.start(plan, cluster=cluster) as again:  # resumed from the snapshots: the skip holds
        assert [d.kind for d in again.timeline().decisions] == ["skip"]
        resumed = consume(again.address, [0, 1], steps=3, states={r: first.saved[(r, 6)] for r in (0, 1)})
        assert resumed.steps() == [(r, s) for r in (0, 1) for s in (9, 10, 11)]
        assert_same_stream(resumed.ids, {k: v for k, v in reference.ids.items() if k in resumed.ids})
    assert explain_offline(plan, 7, preview=0)["skipped"]["reason"] == "loss spike at 7"
    with Service.start(plan, cluster=cluster) as svc, pytest.raises(PlanError, match="'until' must be a step"):
        svc.skip_steps(30, 20)
