"""A training job restarts from any checkpoint it kept, while the service runs on (issue "Plug into
real training jobs"): every rank's new stream loads an older ``state_dict`` and receives, from that
step on, exactly what it received the first time; with another dp the run is re-planned from that
step, exactly once; beyond the retention the error names the oldest step and the setting."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from overlord_dask import Service, connect
from overlord_dask.errors import ServiceError
from overlord_dask.observe.figures import exactly_once, planned_identities
from overlord_dask.service.replay import replay
from overlord_dask.trainer.handover import HandOver
from overlord_dask.trainer.reconnect import attached_again

from .harness import assert_same_stream, consume, run_ranks, token_digest

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')


def _run(address, dp: int, until: int, **kw):
    """Every rank of ``dp`` consumes up to step ``until`` (``harness.consume``; no final checkpoint)."""
    return consume(address, range(dp), until=until, dp=dp, save_final=False, **kw)


@pytest.mark.parametrize("with_snapshots", [False, True], ids=["no snapshot location", "snapshots"])
def test_a_job_restarts_from_older_checkpoints_while_the_service_runs_on(cluster, small_plan, tmp_path, with_snapshots):
    """The job runs to step 30 keeping checkpoints at steps 1, 12 and 29; it dies and every rank
    restarts (new streams) from each of them in turn: token-identical to the first time, nothing
    before the checkpoint again, nothing after it skipped. The default plan (commit: ack)."""
    ck = {"checkpoint": {"url": str(tmp_path / "ck"), "base_every_steps": 5}} if with_snapshots else {}
    plan = small_plan(**ck)
    dp = plan.topology.dp
    with Service.start(plan, cluster=cluster) as service:
        first = _run(service.address, dp, 30, save_at=(1, 12, 29))
        for k in (12, 1, 29):
            again = _run(service.address, dp, 30, states={r: first.saved[(r, k)] for r in range(dp)})
            assert_same_stream(again.digests, {key: d for key, d in first.digests.items() if key[1] >= k})
        assert service.status()["failure"] is None


@pytest.mark.parametrize("taken", [0, 2], ids=["at that step", "past it"])
def test_a_rank_attached_at_the_step_another_rank_rewinds_to_goes_on(cluster, small_plan, taken):
    """A job dies after rank 0 acknowledged step 5 but rank 1 only step 3 (its last chunk's
    acknowledgement was lost with it). Restarted from the checkpoint at step 4, rank 1 attaches
    first (the service hands it step 4 next: nothing to rewind for it) and its trainer takes
    ``taken`` steps; rank 0 then rewinds the service to step 4, which ends every attachment.
    Rank 1's stream, at that very step or past it (the rewind replays those steps
    token-identical), attaches again and goes on instead of failing: both ranks receive steps
    4-7 as an uninterrupted run."""
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2}, topology={"dp": 2})
    with Service.start(plan, cluster=cluster) as service:
        want = _run(service.address, 2, 8).digests
    with Service.start(plan, cluster=cluster) as service:
        until = {0: 6, 1: 4}

        def first_job(r):
            with connect(service.address, r, 2, timeout=60) as s:
                while s.next_step < until[r]:
                    s.next_batch()
                s.commit()

        run_ranks(first_job, [0, 1])
        got = {}

        def take(r, s, n):
            for _ in range(n):
                b = s.next_batch()
                got[(r, b["step"])] = token_digest(b)

        lagging = connect(service.address, 1, 2, timeout=60)
        lagging.load_state_dict({"version": 1, "next_step": 4})  # nothing to rewind for rank 1
        take(1, lagging, taken)  # from the attachment the rewind ends
        ahead = connect(service.address, 0, 2, timeout=60)
        ahead.load_state_dict({"version": 1, "next_step": 4})  # rank 0 was at 6: the service goes back
        take(1, lagging, 4 - taken)
        take(0, ahead, 4)
        assert got == {k: v for k, v in want.items() if 4 <= k[1] < 8}
        # its checkpoint goes through: the attachment it holds is the current one
        assert lagging.state_dict()["next_step"] == ahead.state_dict()["next_step"] == 8
        assert service.status()["failure"] is None
        for s in (lagging, ahead):
            s.close()


def test_a_rank_whose_stream_is_made_while_another_ranks_rewind_rebuilds_the_planner_goes_on(
    cluster, small_plan, monkeypatch
):
    """The job comes back with dp 2 (it ran with 3) from its checkpoint at step 4: rank 0's
    ``load_state_dict`` rewinds the service for the new dp, and rank 1's stream is made while the
    planner is being rebuilt, after the rebuilt state is in place: it finds the new dp and
    attaches at once. Its attachment waits for the rewind to end, and both ranks take steps 4-7
    of the re-planned run, each exactly once. (An attachment made in that moment was ended by the
    rewind as one of the old job's: rank 1 failed with "the run was rewound to step 4".)"""
    from overlord_dask.scheduler.planner_thread import PlannerThread

    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2})
    with Service.start(plan, cluster=cluster) as service:
        first = _run(service.address, 3, 8, save_at=(4,))
        real, replaced = PlannerThread.replace_state, threading.Event()

        def slowly(self, *a, **kw):  # (planner thread) the rebuilt state in place, the rewind not yet over
            out = real(self, *a, **kw)
            replaced.set()
            time.sleep(1.0)
            return out

        monkeypatch.setattr(PlannerThread, "replace_state", slowly)
        streams = {}

        def rank_0():
            streams[0] = connect(service.address, 0, 2, timeout=60)
            streams[0].load_state_dict(first.saved[(0, 4)])

        rewinding = threading.Thread(target=rank_0)
        rewinding.start()
        assert replaced.wait(60)
        streams[1] = connect(service.address, 1, 2, timeout=60)  # the service runs dp 2 already
        streams[1].load_state_dict(first.saved[(1, 4)])
        rewinding.join(60)
        got = {}

        def take(r):
            for _ in range(4):
                b = streams[r].next_batch()
                got[(r, b["step"])] = token_digest(b)

        run_ranks(take, [0, 1])
        assert sorted(got) == [(r, s) for r in (0, 1) for s in range(4, 8)]
        assert service.status()["failure"] is None
        for s in streams.values():
            s.close()


def test_ranks_at_the_start_of_a_skip_go_on_after_it_without_the_steps_they_had_fetched(cluster, small_plan):
    """Both ranks' trainers took steps 0..2 and their streams fetched steps ahead when steps 3..4
    are skipped: at the skip's start, each attaches again and receives step 5 next, then 6 and
    7, each as an unskipped run delivers it, and never a batch of step 3 or 4 it had fetched."""
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2}, topology={"dp": 2})
    with Service.start(plan, cluster=cluster) as service:
        want = _run(service.address, 2, 8).digests
    with Service.start(plan, cluster=cluster) as service:
        streams = {r: connect(service.address, r, 2, timeout=30) for r in (0, 1)}
        got = {}
        for _ in range(3):
            for r, s in streams.items():
                b = s.next_batch()
                got[(r, b["step"])] = token_digest(b)
        time.sleep(0.5)  # (their streams fetch steps 3.. meanwhile)
        attachments = {r: s.rio.generation for r, s in streams.items()}
        assert service.skip_steps(3, 4) == (3, 4)
        # (a trainer that took step 3 before its stream heard of the skip would fail instead,
        # naming it: the next test)
        deadline = time.monotonic() + 30
        while any(s.rio.generation == attachments[r] for r, s in streams.items()) and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(3):
            for r, s in streams.items():
                b = s.next_batch()
                got[(r, b["step"])] = token_digest(b)
        assert got == {k: v for k, v in want.items() if k[1] in (0, 1, 2, 5, 6, 7)}
        assert service.status()["failure"] is None
        for s in streams.values():
            s.close()


def test_a_rank_that_took_steps_a_skip_removes_fails_naming_the_skip(cluster, small_plan):
    """Steps 3..4 are skipped while both ranks' trainers are at step 6 (they took steps 3 and 4):
    those steps are no longer the run's, so each stream fails, naming the skip, instead of
    going on; the job then restarts from a checkpoint before the skip and never sees them."""
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2}, topology={"dp": 2})
    with Service.start(plan, cluster=cluster) as service:
        streams = {r: connect(service.address, r, 2, timeout=30) for r in (0, 1)}
        for _ in range(6):
            for s in streams.values():
                s.next_batch()
        assert service.skip_steps(3, 4) == (3, 4)
        for s in streams.values():
            with pytest.raises(ServiceError, match=r"rewound to step 3 \(steps 3\.\.4 are skipped\)"):
                for _ in range(8):  # (until its stream hears of the skip, steps it fetched past the range go out)
                    s.next_batch()
            s.close()
        again = _run(service.address, 2, 8, states=dict.fromkeys(range(2), {"version": 1, "next_step": 2}))
        assert {s for (_, s) in again.ids} == {2, 5, 6, 7}
        assert service.status()["failure"] is None


def test_a_rank_goes_on_after_a_rewind_at_its_step_or_one_that_replays_the_steps_it_took():
    """A rewind's message names its step and whether the steps from there come out as the first
    time (a restart with the same ranks) or not (a skip): a trainer whose next step is that one
    goes on either way; one that took it or later ones (finished or still on them) only where
    they are replayed unchanged; one before it never. At a skip, the steps fetched from its
    start are dropped whether the trainer goes on or fails: they may be skipped ones."""

    def trainer_on(step: int) -> HandOver:  # took steps 0..step, finished those before it
        hand = HandOver(0, max_steps=16, max_bytes=1 << 30)
        hand.put(list(range(8)), [{"step": s} for s in range(8)], [1] * 8)
        for s in range(step + 1):
            assert hand.take(s, 1.0, lambda room, ack: None, finished=s - 1 if s else None)[0] == {"step": s}
        return hand

    assert [trainer_on(s).rewound(4, replayed=True) for s in (2, 3, 4, 6)] == [False, True, True, True]
    assert [trainer_on(s).rewound(4, replayed=False) for s in (2, 3, 4, 6)] == [False, True, False, False]
    at_skip, past_skip = trainer_on(3), trainer_on(4)
    assert at_skip.rewound(4, replayed=False) and at_skip.buffered() == 0 and at_skip.dropped == 1
    assert not past_skip.rewound(4, replayed=False) and past_skip.buffered() == 0
    replay = trainer_on(3)
    assert replay.rewound(4, replayed=True) and replay.buffered() == 4 and replay.dropped == 0


def test_a_refused_fetch_goes_on_at_once_when_its_rank_attached_again_as_the_wait_began():
    """The rewind's message came before the fetch's refusal, and the rank attached again right as
    the fetch began to wait for it (the reconnect's "disconnected" signal set and cleared before
    the wait looked): the fetch goes on with the new attachment at once, not as a failure after
    the wait."""

    async def main():
        rank = SimpleNamespace(generation=2, disconnected=asyncio.Event(), connected=asyncio.Event())
        rank.disconnected.set()  # the rewind's message: the rank attaches again

        async def reattach():
            rank.generation = 4
            rank.disconnected.clear()
            rank.connected.set()

        again = asyncio.ensure_future(reattach())  # runs before the wait's first look
        t0 = time.monotonic()
        goes_on = await attached_again(lambda: rank.generation, 2, rank.disconnected, rank.connected, within=1.0)
        await again
        return goes_on, time.monotonic() - t0

    goes_on, waited = asyncio.run(main())
    assert goes_on and waited < 0.5


@pytest.mark.parametrize("before,after", [(3, 2), (2, 3)])
def test_a_job_back_with_another_dp_is_replanned_from_its_checkpoint_exactly_once(cluster, small_plan, before, after):
    """dp ``before`` runs to step 20 (checkpoint at 9); the job comes back with dp ``after`` from
    step 9 (a rank it adds loads rank 0's state: the state is topology-free): the service
    re-plans from there for the new ranks; every planned piece is delivered exactly once."""
    plan = small_plan(topology={"dp": before})
    with Service.start(plan, cluster=cluster) as service:
        first = _run(service.address, before, 20, save_at=(9,))
        second = _run(service.address, after, 24, states=dict.fromkeys(range(after), first.saved[0, 9]))

        assert service.status()["failure"] is None and service.summary()["dp"] == after
        ledger = service.ledger(0, 24)
    delivered = first.delivered(before=9) + second.delivered()
    planned = [planned_identities(ledger[s]) for s in range(24)]
    assert exactly_once(planned, delivered) == (0, 0)
    assert {s for (_, s) in second.ids} == set(range(9, 24))


def test_a_dp_change_is_in_the_timeline_replayed_and_kept_across_a_service_restart(cluster, small_plan, tmp_path):
    """dp 3 to step 20, the job back with dp 2 from its checkpoint at 9, to 24: the timeline
    records the change, ``replay`` of it equals the service's ledger piece for piece; the service
    stops and starts again from its snapshot still planning for 2 ranks, and the job goes on from
    its last state to step 30, every planned piece delivered exactly once."""
    plan = small_plan(checkpoint={"url": str(tmp_path / "ck"), "base_every_steps": 4})
    with Service.start(plan, cluster=cluster) as service:
        three = _run(service.address, 3, 20, save_at=(9,))
        two = consume(service.address, range(2), until=24, dp=2, states={r: three.saved[(r, 9)] for r in range(2)})
        tl = service.timeline()
        ledger = service.ledger(0, 24)
    assert tl.dp_changes() == [(9, 2)]
    replayed = replay(plan, tl, 24)
    for s in range(24):
        assert np.array_equal(replayed[s]["pieces"], ledger[s]["pieces"]), s
        assert np.array_equal(replayed[s]["slot"], ledger[s]["slot"]), s
    with Service.start(plan, cluster=cluster) as service:
        assert service.summary()["dp"] == 2 and service.status()["committed"] == 24
        more = consume(service.address, range(2), until=30, dp=2, states=two.states)
        assert service.status()["failure"] is None
        ledger |= service.ledger(24, 30)
    planned = [planned_identities(ledger[s]) for s in range(30)]
    assert exactly_once(planned, three.delivered(before=9) + two.delivered() + more.delivered()) == (0, 0)
    assert {s for (_, s) in more.ids} == set(range(24, 30))


def test_a_checkpoint_older_than_the_retention_is_refused_naming_the_oldest_step(cluster, small_plan):
    plan = small_plan(checkpoint={"keep_steps": 4})
    with Service.start(plan, cluster=cluster) as service:
        saved = _run(service.address, 3, 40, save_at=(2,)).saved
        with connect(service.address, 0, timeout=60) as s:
            with pytest.raises(
                ServiceError,
                match=r"cannot resume at step 2: the service can serve steps from \d+ on.*checkpoint.keep_steps",
            ):
                s.load_state_dict(saved[(0, 2)])
        with connect(service.address, 0, timeout=60) as s:
            with pytest.raises(ValueError, match="next_step must be a step number >= 0, got -1"):
                s.load_state_dict({"version": 1, "next_step": -1})


def test_after_a_service_restart_a_job_resumes_from_a_checkpoint_older_than_the_snapshot(cluster, small_plan, tmp_path):
    """The service stops at step 30 (its snapshot there) and starts again; the job restarts from
    its checkpoint of step 10: served from the bases in storage, identical to the first time."""
    plan = small_plan(checkpoint={"url": str(tmp_path / "ck"), "base_every_steps": 4})
    with Service.start(plan, cluster=cluster) as service:
        first = _run(service.address, 3, 30, save_at=(10,))
    with Service.start(plan, cluster=cluster) as service:
        assert service.status()["committed"] == 30
        again = _run(service.address, 3, 30, states={r: first.saved[(r, 10)] for r in range(3)})
    assert_same_stream(again.digests, {key: d for key, d in first.digests.items() if key[1] >= 10})
