"""Exact resume of the whole service: SIGKILL the service (scheduler, planner, workers) mid-run,
start it again from its snapshot, and the trainers, restored from their own state_dicts,
receive exactly the stream an uninterrupted run delivers: no sample repeated, none lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from overlord_dask import Service, connect
from overlord_dask.observe.figures import delivered_identities, delivered_record

from .harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _plan_file(tmp_path, corpus, checkpoint: str | None, commit: str = "ack") -> Path:
    data = yaml.safe_load((ROOT / "overlord_dask" / "service" / "demo_plan.yaml").read_text())
    for s in data["sources"]:
        s["url"] = str(Path(corpus) / s["url"])
    data["topology"] = {"dp": 2, "micro_batches": 2, "tokens_per_micro_batch": 4096}
    data["loading"].update(unit_rows=300, unit_tokens=65536, prefetch_steps=3)
    data["balance"]["window"] = 4
    if checkpoint:
        data["checkpoint"] = {"url": checkpoint, "commit": commit}
    path = tmp_path / ("plan-ck.yaml" if checkpoint else "plan.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def _serve(plan: Path, port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "overlord_dask", "serve", str(plan), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    line = proc.stdout.readline()
    return proc, json.loads(line)["address"]


def _consume(address, ranks, steps, states=None) -> tuple[dict, dict]:
    """Each rank (a thread) consumes `steps` steps; returns identities per (rank, step) and state_dicts."""
    got, out_states = {}, {}

    def run(r):
        with connect(address, r, timeout=120) as s:
            if states:
                s.load_state_dict(states[r])
            for _ in range(steps):
                b = s.next_batch()
                got[(r, b["step"])] = sorted(map(tuple, delivered_identities(delivered_record(b)).tolist()))
            s.commit()
            out_states[r] = s.state_dict()

    run_ranks(run, ranks)
    return got, out_states


def test_sigkill_whole_service_and_resume_exactly(tmp_path, corpus, cluster):
    from overlord_dask.plan import load_plan

    k, m = 7, 9  # kill after 7 steps (inside the second 4-step window), then 9 more
    with Service.start(load_plan(_plan_file(tmp_path, corpus, None)), cluster=cluster) as ref_service:
        reference, _ = _consume(ref_service.address, [0, 1], k + m)

    plan = _plan_file(tmp_path, corpus, str(tmp_path / "ck"))
    proc, address = _serve(plan)
    try:
        before, states = _consume(address, [0, 1], k)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # scheduler, planner, nannies and workers: all at once
        proc.wait(timeout=30)
    assert states[0]["next_step"] == k and list((tmp_path / "ck").glob("base-*.msgpack"))

    proc, address = _serve(plan)
    try:
        after, _ = _consume(address, [0, 1], m, states=states)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert sorted(before) == [(r, s) for r in (0, 1) for s in range(k)]
    assert sorted(after) == [(r, s) for r in (0, 1) for s in range(k, k + m)]
    combined = {**before, **after}
    for key, ids in reference.items():
        assert combined[key] == ids, key  # the same stream, step by step and rank by rank
    everything = [i for ids in combined.values() for i in ids]
    assert len(everything) == len(set(everything))  # no piece twice


def test_trainers_ride_through_a_service_restart(tmp_path, corpus, cluster):
    """The service is SIGKILLed mid-run and started again at the same address: the trainers'
    streams (the same objects, no state reloaded) reconnect and deliver exactly the stream of
    an uninterrupted run."""
    import socket
    import threading
    import time

    from overlord_dask.plan import load_plan

    steps = 14
    with Service.start(load_plan(_plan_file(tmp_path, corpus, None)), cluster=cluster) as ref_service:
        reference, _ = _consume(ref_service.address, [0, 1], steps)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    plan = _plan_file(tmp_path, corpus, str(tmp_path / "ck3"))
    proc, address = _serve(plan, port)
    streams = {r: connect(address, r, timeout=120, reconnect_timeout=90) for r in (0, 1)}
    got, killed = {}, threading.Event()

    def run(r):
        for _ in range(steps):
            b = streams[r].next_batch()
            got[(r, b["step"])] = sorted(map(tuple, delivered_identities(delivered_record(b)).tolist()))
            if b["step"] == 5:
                killed.wait(60)  # both ranks are past step 5 when the service dies
        streams[r].commit()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed.set()
        proc, address2 = _serve(plan, port)
        assert address2 == address
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    finally:
        for s in streams.values():
            s.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert sorted(got) == [(r, s) for r in (0, 1) for s in range(steps)]
    for key, ids in reference.items():
        assert got[key] == ids, key


def test_clean_restart_resumes_from_the_committed_step(tmp_path, corpus, cluster):
    from overlord_dask.plan import load_plan

    plan = load_plan(_plan_file(tmp_path, corpus, str(tmp_path / "ck2")))
    with Service.start(plan, cluster=cluster) as a:
        first, _ = _consume(a.address, [0, 1], 5)
        a.wait_for_step(5, timeout=30)
    with Service.start(plan, cluster=cluster) as b:  # resumes: the trainers need no state of their own
        second, _ = _consume(b.address, [0, 1], 3)
        stats = b.snapshots()
    assert sorted(s for _, s in second) == [5, 5, 6, 6, 7, 7]
    ids = [i for d in (first, second) for v in d.values() for i in v]
    assert len(ids) == len(set(ids))
    assert stats and all(s["bytes"] < 65_536 for s in stats)
    deltas = sorted(s["bytes"] for s in stats if s["kind"] == "delta")
    bases = sorted(s["bytes"] for s in stats if s["kind"] == "base")
    # differential: a delta is a fraction of a base (one that only moves the committed step is ~50
    # bytes, one that carries a new window ~1 KB; which ones a short run writes depends on timing)
    assert deltas and bases and deltas[0] < bases[0] / 4


def test_one_trainer_restarted_alone(tmp_path, corpus, cluster):
    """Rank 1 dies after taking step 3's batch (never acknowledged) and restarts from its
    state_dict; rank 0 never stops. Rank 1 gets step 3 again and then its normal stream."""
    from overlord_dask.plan import load_plan

    plan = load_plan(_plan_file(tmp_path, corpus, None))
    with Service.start(plan, cluster=cluster) as service:
        reference = {}
        r0 = connect(service.address, 0, timeout=120)
        r1 = connect(service.address, 1, timeout=120)
        for _ in range(3):
            for r, s in ((0, r0), (1, r1)):
                b = s.next_batch()
                reference[(r, b["step"])] = sorted(map(tuple, delivered_identities(delivered_record(b)).tolist()))
        r1.commit()
        saved = r1.state_dict()  # the trainer's checkpoint: next step 3
        lost = r1.next_batch()  # takes step 3 ... and dies before acknowledging it
        assert lost["step"] == 3
        r1.close()
        r1 = connect(service.address, 1, timeout=120)
        r1.load_state_dict(saved)
        for _ in range(4):
            b = r1.next_batch()
            reference[(1, b["step"])] = sorted(map(tuple, delivered_identities(delivered_record(b)).tolist()))
            b0 = r0.next_batch()
            reference[(0, b0["step"])] = sorted(map(tuple, delivered_identities(delivered_record(b0)).tolist()))
        assert sorted(s for r, s in reference if r == 1) == list(range(7))
        assert reference[(1, 3)] == sorted(map(tuple, delivered_identities(delivered_record(lost)).tolist()))
        ids = [i for v in reference.values() for i in v]
        assert len(ids) == len(set(ids))
        r0.close()
        r1.close()


def test_commit_on_trainer_checkpoint_resumes_at_the_checkpoint(tmp_path, corpus, cluster):
    """commit: checkpoint. The trainers save their state at step 4, train on to step 7, then the
    whole system dies. Restarted from their checkpoint, they get steps 4, 5, 6 again (their
    weights never saw them) and then the rest: the stream equals the uninterrupted one."""
    from overlord_dask.plan import load_plan

    with Service.start(load_plan(_plan_file(tmp_path, corpus, None)), cluster=cluster) as ref_service:
        reference, _ = _consume(ref_service.address, [0, 1], 12)

    plan = _plan_file(tmp_path, corpus, str(tmp_path / "ck3"), commit="checkpoint")
    proc, address = _serve(plan)
    saved = {}
    try:

        def trainer(r):
            with connect(address, r, timeout=120) as s:
                for step in range(7):
                    s.next_batch()
                    if step == 3:
                        saved[r] = s.state_dict()  # the trainer checkpoints after step 3
                s.commit()

        run_ranks(trainer, (0, 1))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert saved[0]["next_step"] == 4 == saved[1]["next_step"]
    proc, address = _serve(plan)
    try:
        after, _ = _consume(address, [0, 1], 8, states=saved)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert sorted(after) == [(r, s) for r in (0, 1) for s in range(4, 12)]
    for key, ids in after.items():
        assert reference[key] == ids, key


def test_resume_with_fewer_ranks_keeps_exactly_once(tmp_path, corpus, cluster):
    """Run on dp=2, stop, resume the same run on dp=1: the one rank continues where the pair
    left off; no piece is delivered twice over the union of ranks and runs."""
    from overlord_dask.plan import load_plan

    path = _plan_file(tmp_path, corpus, str(tmp_path / "ck4"))
    with Service.start(load_plan(path), cluster=cluster) as a:
        first, _ = _consume(a.address, [0, 1], 6)
        a.wait_for_step(6, timeout=30)
    data = yaml.safe_load(path.read_text())
    data["topology"]["dp"] = 1
    path.write_text(yaml.safe_dump(data))
    with Service.start(load_plan(path), cluster=cluster) as b:
        second, _ = _consume(b.address, [0], 8)
    assert sorted(second) == [(0, s) for s in range(6, 14)]
    ids = [i for d in (first, second) for v in d.values() for i in v]
    assert len(ids) == len(set(ids))


def test_sigkill_after_a_live_update_resumes_with_it(tmp_path, corpus, cluster):
    """A plan update applied live (from another process, through ``Service.attach``) is in the
    snapshot: the restarted service, given the original plan file, continues with it in force,
    and the stream equals an uninterrupted run that applied the same update."""
    from overlord_dask.plan import load_plan, plan_from_dict, plan_to_dict

    at, k, m = 10, 13, 7
    original = load_plan(_plan_file(tmp_path, corpus, None))
    d = plan_to_dict(original)
    d["sources"] = [s for s in d["sources"] if s["name"] != "books"] + [
        {**d["sources"][0], "name": "web_late", "weight": 0.3}
    ]
    new = plan_from_dict(d)
    with Service.start(original, cluster=cluster) as ref_service:
        assert ref_service.update_plan(new, at_step=at) == at
        reference, _ = _consume(ref_service.address, [0, 1], k + m)

    plan = _plan_file(tmp_path, corpus, str(tmp_path / "ck"))
    proc, address = _serve(plan)
    try:
        first, states = _consume(address, [0, 1], 3)
        handle = Service.attach(address)
        try:
            assert handle.update_plan(new.model_copy(update={"checkpoint": handle.plan.checkpoint}), at_step=at) == at
        finally:
            handle.close()
        more, states = _consume(address, [0, 1], k - 3, states=states)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    proc, address = _serve(plan)
    try:
        handle = Service.attach(address)
        try:
            tl = handle.timeline()
        finally:
            handle.close()
        after, _ = _consume(address, [0, 1], m, states=states)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert [a for a, _ in tl.versions] == [0, at] and "web_late" in tl.source_names
    combined = {**first, **more, **after}
    assert sorted(combined) == sorted(reference)
    for key, ids in reference.items():
        assert combined[key] == ids, key
