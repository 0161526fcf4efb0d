"""Exact resume of the whole service: SIGKILL the service (scheduler, planner, workers) mid-run,
start it again from its snapshot, and the trainers, restored from their own state_dicts,
receive exactly the stream an uninterrupted run delivers: no sample repeated, none lost
(``harness.py``: the save/restore harness every resume test uses)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import yaml

from overlord_dask import Service, connect
from overlord_dask.plan import load_plan, plan_from_dict, plan_to_dict

from .harness import (
    Served,
    assert_exactly_once,
    assert_same_stream,
    consume,
    identities,
    plan_file,
)

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')


def _reference(tmp_path, corpus, cluster, steps: int, **kw):
    """What an uninterrupted run of the small plan delivers, per (rank, step)."""
    with Service.start(load_plan(plan_file(tmp_path, corpus, None)), cluster=cluster) as ref:
        return consume(ref.address, [0, 1], steps=steps, **kw)


def test_sigkill_whole_service_and_resume_exactly(tmp_path, corpus, cluster):
    k, m = 7, 9  # kill after 7 steps (inside the second 4-step window), then 9 more
    reference = _reference(tmp_path, corpus, cluster, k + m)
    plan = plan_file(tmp_path, corpus, str(tmp_path / "ck"))
    with Served(plan) as service:
        before = consume(service.address, [0, 1], steps=k)
    assert before.states[0]["next_step"] == k and list((tmp_path / "ck").glob("base-*.msgpack"))
    with Served(plan) as service:
        after = consume(service.address, [0, 1], steps=m, states=before.states)
    assert before.steps() == [(r, s) for r in (0, 1) for s in range(k)]
    assert after.steps() == [(r, s) for r in (0, 1) for s in range(k, k + m)]
    assert_same_stream({**before.ids, **after.ids}, reference.ids)
    assert_exactly_once(before.ids, after.ids)


def test_trainers_ride_through_a_service_restart(tmp_path, corpus, cluster):
    """The service is SIGKILLed mid-run and started again at the same address: the trainers'
    streams (the same objects, no state reloaded) reconnect and deliver exactly the stream of
    an uninterrupted run."""
    steps = 14
    reference = _reference(tmp_path, corpus, cluster, steps)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    plan = plan_file(tmp_path, corpus, str(tmp_path / "ck3"))
    service = Served(plan, port)
    streams = {r: connect(service.address, r, timeout=120, reconnect_timeout=90) for r in (0, 1)}
    got, killed = {}, threading.Event()

    def run(r):
        for _ in range(steps):
            b = streams[r].next_batch()
            got[(r, b["step"])] = identities(b)
            if b["step"] == 5:
                killed.wait(60)  # both ranks are past step 5 when the service dies
        streams[r].commit()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        service.kill()
        killed.set()
        service = Served(plan, port)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    finally:
        for s in streams.values():
            s.close()
        service.kill()
    assert_same_stream(got, reference.ids)


def test_clean_restart_resumes_from_the_committed_step(tmp_path, corpus, cluster):
    plan = load_plan(plan_file(tmp_path, corpus, str(tmp_path / "ck2")))
    with Service.start(plan, cluster=cluster) as a:
        first = consume(a.address, [0, 1], steps=5)
        a.wait_for_step(5, timeout=30)
    with Service.start(plan, cluster=cluster) as b:  # resumes: the trainers need no state of their own
        second = consume(b.address, [0, 1], steps=3)
        # the trainers' last acks made steps 5..7 durable: the snapshot loop writes a delta for them
        # in the background (read the stats once it has, not before)
        deadline = time.monotonic() + 30
        stats = b.snapshots()
        while not any(s["kind"] == "delta" and s["committed"] >= 8 for s in stats):
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
            stats = b.snapshots()
    assert second.steps() == [(r, s) for r in (0, 1) for s in (5, 6, 7)]
    assert_exactly_once(first.ids, second.ids)
    assert stats and all(s["bytes"] < 65_536 for s in stats)
    # differential: a delta moves the committed step (~50 bytes) and, where planning moved to a
    # new window, carries that window's starting state (here most of the state: few sources);
    # a base holds the whole state. Which deltas carry a window depends on how the trainers'
    # acknowledgements were batched (under load, one delta may cover every step): read them.
    from overlord_dask.snapshots import SnapshotStore

    store = SnapshotStore(str(tmp_path / "ck2"))
    files = [
        (store._read(path), store.fs.size(path)) for kind, _, path in store._entries() if kind in ("base", "delta")
    ]
    bases = [n for p, n in files if p["kind"] == "base"]
    moves = [n for p, n in files if p["kind"] == "delta" and "window" not in p]
    windows = [n for p, n in files if p["kind"] == "delta" and "window" in p]
    assert bases and (moves or windows)
    assert all(n < 200 for n in moves), moves  # the committed step alone
    assert all(n <= max(bases) for n in windows), (windows, bases)  # at most a window's state, never more


def test_one_trainer_restarted_alone(tmp_path, corpus, cluster):
    """Rank 1 dies after taking step 3's batch (never acknowledged) and restarts from its
    state_dict; rank 0 never stops. Rank 1 gets step 3 again and then its normal stream."""
    plan = load_plan(plan_file(tmp_path, corpus, None))
    with Service.start(plan, cluster=cluster) as service:
        got = {}
        r0 = connect(service.address, 0, timeout=120)
        r1 = connect(service.address, 1, timeout=120)
        for _ in range(3):
            for r, s in ((0, r0), (1, r1)):
                b = s.next_batch()
                got[(r, b["step"])] = identities(b)
        r1.commit()
        saved = r1.state_dict()  # the trainer's checkpoint: next step 3
        lost = r1.next_batch()  # takes step 3 ... and dies before acknowledging it
        assert lost["step"] == 3
        r1.close()
        r1 = connect(service.address, 1, timeout=120)
        r1.load_state_dict(saved)
        for _ in range(4):
            b = r1.next_batch()
            got[(1, b["step"])] = identities(b)
            b0 = r0.next_batch()
            got[(0, b0["step"])] = identities(b0)
        assert sorted(s for r, s in got if r == 1) == list(range(7))
        assert got[(1, 3)] == identities(lost)
        assert_exactly_once(got)
        r0.close()
        r1.close()


def test_commit_on_trainer_checkpoint_resumes_at_the_checkpoint(tmp_path, corpus, cluster):
    """commit: checkpoint. The trainers save their state at step 4, train on to step 7, then the
    whole system dies. Restarted from their checkpoint, they get steps 4, 5, 6 again (their
    weights never saw them) and then the rest: the stream equals the uninterrupted one."""
    reference = _reference(tmp_path, corpus, cluster, 12)
    plan = plan_file(tmp_path, corpus, str(tmp_path / "ck3"), commit="checkpoint")
    with Served(plan) as service:
        # the trainers checkpoint after step 3 and train on (no checkpoint at the end: the system dies)
        first = consume(service.address, [0, 1], steps=7, save_at=(4,), save_final=False)
    saved = {r: first.saved[(r, 4)] for r in (0, 1)}
    assert saved[0]["next_step"] == 4 == saved[1]["next_step"]
    with Served(plan) as service:
        after = consume(service.address, [0, 1], steps=8, states=saved)
    assert after.steps() == [(r, s) for r in (0, 1) for s in range(4, 12)]
    assert_same_stream(after.ids, {k: v for k, v in reference.ids.items() if k[1] >= 4})


def test_resume_with_fewer_ranks_keeps_exactly_once(tmp_path, corpus, cluster):
    """Run on dp=2, stop, resume the same run on dp=1: the one rank continues where the pair
    left off; no piece is delivered twice over the union of ranks and runs."""
    path = plan_file(tmp_path, corpus, str(tmp_path / "ck4"))
    with Service.start(load_plan(path), cluster=cluster) as a:
        first = consume(a.address, [0, 1], steps=6)
        a.wait_for_step(6, timeout=30)
    data = yaml.safe_load(path.read_text())
    data["topology"]["dp"] = 1
    path.write_text(yaml.safe_dump(data))
    with Service.start(load_plan(path), cluster=cluster) as b:
        second = consume(b.address, [0], steps=8)
    assert second.steps() == [(0, s) for s in range(6, 14)]
    assert_exactly_once(first.ids, second.ids)


def test_sigkill_after_a_live_update_resumes_with_it(tmp_path, corpus, cluster):
    """A plan update applied live (from another process, through ``Service.attach``) is in the
    snapshot: the restarted service, given the original plan file, continues with it in force,
    and the stream equals an uninterrupted run that applied the same update."""
    at, k, m = 10, 13, 7
    original = load_plan(plan_file(tmp_path, corpus, None))
    d = plan_to_dict(original)
    d["sources"] = [s for s in d["sources"] if s["name"] != "books"] + [
        {**d["sources"][0], "name": "web_late", "weight": 0.3}
    ]
    new = plan_from_dict(d)
    with Service.start(original, cluster=cluster) as ref_service:
        assert ref_service.update_plan(new, at_step=at) == at
        reference = consume(ref_service.address, [0, 1], steps=k + m)

    plan = plan_file(tmp_path, corpus, str(tmp_path / "ck"))
    with Served(plan) as service:
        first = consume(service.address, [0, 1], steps=3)
        handle = Service.attach(service.address)
        try:
            assert handle.update_plan(new.model_copy(update={"checkpoint": handle.plan.checkpoint}), at_step=at) == at
        finally:
            handle.close()
        more = consume(service.address, [0, 1], steps=k - 3, states=first.states)
    with Served(plan) as service:
        handle = Service.attach(service.address)
        try:
            tl = handle.timeline()
        finally:
            handle.close()
        after = consume(service.address, [0, 1], steps=m, states=more.states)
    assert [a for a, _ in tl.versions] == [0, at] and "web_late" in tl.source_names
    assert_same_stream({**first.ids, **more.ids, **after.ids}, reference.ids)


def test_a_resume_whose_planner_plans_otherwise_stops_naming_the_step_instead_of_going_on(
    tmp_path, corpus, monkeypatch
):
    """The run resumed by code that plans differently (here a planner that hands a window's steps
    out in the other order: an upgrade of overlord-dask between a crash and its restart)
    re-plans the steps from the window's start to the durable one otherwise than it handed them
    out. Positions after them would be off (documents lost or repeated, silently):
    the snapshot's digests stop the run instead, and the trainer hears why, naming the step."""
    from overlord_dask import ServiceError
    from overlord_dask.planner.policies.cost_balanced import CostBalanced

    plan = load_plan(plan_file(tmp_path, corpus, str(tmp_path / "ck")))
    with Service.start(plan, in_process=True, n_workers=1) as service:
        consume(service.address, [0, 1], steps=6)  # into the second 4-step window: steps 4, 5 are re-planned
        service.wait_for_step(6, timeout=30)
    ordered = CostBalanced._mix_order
    monkeypatch.setattr(CostBalanced, "_mix_order", lambda self, w, tokens: ordered(self, w, tokens)[::-1])
    with Service.start(plan, in_process=True, n_workers=1) as service:
        with pytest.raises(ServiceError, match=r"ReplayError: step 4 came out differently when re-planned"):
            consume(service.address, [0, 1], steps=2, timeout=60)
        assert "step 4 came out differently" in service.status()["failure"]
