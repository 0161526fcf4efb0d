"""Faults while trainers compute: how long a trainer stalls, and whether the stream stays exact.

    python benchmarks/faults.py            # readable table
    python benchmarks/faults.py --json     # one JSON object

``dp`` trainer ranks (threads of this process, each with its own stream, taking one step ahead)
compute ``--compute-ms`` per step (sleep) for ``--steps`` steps. Every scenario runs the same
plan as an uninterrupted reference run in the same invocation and compares, rank by rank and
step by step, the pieces delivered (``identical``, ``duplicates``, ``missing``); ``stall_max_s``
is the longest a trainer waited for a step after the fault, against ``baseline_wait_max_s`` of
the reference run.

Scenarios:

- ``worker_kill_shadows``: SIGKILL a worker mid-run (it holds loaded blocks and built batches;
  its nanny starts a new one) with ``loading.shadows: 1``: the batches it held are served from
  their copies on the other worker.
- ``worker_kill_no_shadows``: the same with ``shadows: 0``: its batches are rebuilt elsewhere.
- ``worker_hung_shadows``: SIGSTOP a worker mid-run (it neither answers nor dies): a fetch
  unanswered for 2 s goes to the batch's shadow, and the scheduler removes the worker after the
  worker TTL (20 s in ``deploy.py``), rebuilding what it was building. SIGCONT at the end.
- ``slow_trainer``: rank 1 computes 10× longer per step than the others for ``--slow-seconds``
  (60 s by default; the scenario runs that many steps, with a reference run of its own), while the memory (RSS) of the
  service process and of
  every worker is sampled: ``rss_growth_mb`` is the largest growth of any of them from the first
  to the last third of the samples (a bounded pipeline shows none). The fast ranks wait for the
  slow one by design (the prefetch bound): their stall is not a fault's.
- ``trainer_restart``: rank 1 saves its ``state_dict``, takes the next step's batch and dies
  with it (its stream goes away without acknowledging that step); a new stream for rank 1
  loads the saved state and goes on: it gets the lost step again, then its normal stream, while
  rank 0 never stops. ``stall_max_s`` is the restarted rank's time from its new stream to its
  first batch.
- ``job_restart_from_checkpoint_k<k>``: every rank runs to a step, keeping its ``state_dict``
  from ``k`` steps before (``--restart-ks``, default 1, 17, 200), and dies there; the job restarts
  every rank from that checkpoint while the service runs on. ``stall_max_s`` is a restarted rank's
  time to its first batch; ``identical`` compares what the trainers kept (the first life before
  the checkpoint, the second from it) with an uninterrupted run, and ``repeats_first_life`` says
  the second life delivered the steps after the checkpoint as the first had.
- ``service_restart``: SIGKILL the whole service (``overlord serve --port``: scheduler, planner,
  workers) mid-run and start it again at the same address from its snapshot; the trainers' streams
  (the same objects) reconnect and go on.

``batch_bytes_max`` / ``shadow_bytes_max``: the most bytes of built batches held on the workers
during the run, and what their shadow copies added; ``block_bytes_max`` / ``block_shadow_bytes_max``
the same for loaded blocks (``loading.shadow_blocks``): together, the shadows' memory cost.

Top level: ``bad_inputs`` (cases in the catalogue ``tests/test_bad_inputs.py``) and
``bad_inputs_clear`` (those that get their clear error or handling: the catalogue run here).
Targets (issue 10): worker loss with shadows stall ≤ 1 s; every scenario 0 duplicates, 0
missing, identical.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.output import print_rows  # noqa: E402


def _plan(data: str, dp: int, shadows: int, checkpoint: str | None = None):
    from overlord_dask.service.demo import demo_plan

    extra = {"checkpoint": {"url": checkpoint}} if checkpoint else {}
    return demo_plan(
        data,
        topology={"dp": dp, "micro_batches": 2, "tokens_per_micro_batch": 8192},
        loading={"prefetch_steps": 8, "batch_steps": 2, "shadows": shadows},
        **extra,
    )


def _train(
    streams: dict, steps: int, compute_s: float, fault_at: int | None = None, fault=None, slow: dict | None = None
) -> tuple[dict, list, float]:
    """Every rank takes ``steps`` steps, computing ``compute_s`` each; ``fault`` runs when rank 0
    reaches step ``fault_at``. Returns (identities per (rank, step), waits after the fault, wait max before)."""
    from overlord_dask.observe.figures import delivered_identities, delivered_record

    got, after, before, t_fault = {}, [], [], []

    def run(r):
        for _ in range(steps):
            t0 = time.perf_counter()
            b = streams[r].next_batch()
            w = time.perf_counter() - t0
            (after if t_fault and t0 >= t_fault[0] else before).append(w)
            got[(r, b["step"])] = sorted(map(tuple, delivered_identities(delivered_record(b)).tolist()))
            if r == 0 and b["step"] == fault_at and fault is not None:
                t_fault.append(time.perf_counter())
                threading.Thread(target=fault, daemon=True).start()
            time.sleep(compute_s * (slow or {}).get(r, 1))

    threads = [threading.Thread(target=run, args=(r,)) for r in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got, after, max(before[len(streams) :], default=0.0)  # the first step of each rank is the start


def _compare(reference: dict, got: dict) -> dict:
    ref_ids = [i for v in reference.values() for i in v]
    ids = [i for v in got.values() for i in v]
    return {
        "identical": got == reference,
        "duplicates": len(ids) - len(set(ids)),
        "missing": len(set(ref_ids) - set(ids)),
    }


def _service_run(plan, cluster, steps, compute_s, fault_at=None, fault_on=None, slow=None):
    from overlord_dask import Service, connect

    with Service.start(plan, cluster=cluster) as service:
        streams = {r: connect(service.address, r, timeout=120, prefetch_steps=1) for r in range(plan.topology.dp)}
        fault = (lambda: fault_on(service)) if fault_on else None
        memory, rss = [], []  # (batch bytes, shadow bytes); {pid: RSS} of this process and the workers, every 0.2 s
        done = threading.Event()
        procs = [psutil.Process()] + [psutil.Process(p) for p in service.client.run(os.getpid).values()]

        def sample():
            while not done.wait(0.2):
                st = service.status()
                memory.append((st["batch_bytes"], st["shadow_bytes"], st["block_bytes"], st["block_shadow_bytes"]))
                row = {}
                for p in procs:
                    try:
                        row[p.pid] = p.memory_info().rss
                    except psutil.Error:  # a worker killed by the scenario
                        pass
                rss.append(row)

        threading.Thread(target=sample, daemon=True).start()
        out = _train(streams, steps, compute_s, fault_at, fault, slow)
        done.set()
        shadowed = {
            "batches_shadowed": service.status()["shadowed"],
            "batch_bytes_max": max((m[0] for m in memory), default=0),
            "shadow_bytes_max": max((m[1] for m in memory), default=0),
            "block_bytes_max": max((m[2] for m in memory), default=0),
            "block_shadow_bytes_max": max((m[3] for m in memory), default=0),
            "rss_growth_mb": _growth(rss),
        }
        for s in streams.values():
            s.close()
    return (*out, shadowed)


def _growth(rss: list[dict]) -> float:
    """Largest RSS growth (MB) of any sampled process from the first to the last third of the run."""
    k = len(rss) // 3
    if k == 0:
        return 0.0
    out = 0.0
    for pid in rss[0]:
        first = [r[pid] for r in rss[:k] if pid in r]
        last = [r[pid] for r in rss[-k:] if pid in r]
        if first and last:
            out = max(out, (sum(last) / len(last) - sum(first) / len(first)) / 2**20)
    return round(out, 1)


def _signal_a_worker(sig: int, stopped: list):
    def fault(service) -> None:
        pids = service.client.run(
            os.getpid, on_error="ignore"
        )  # a worker replaced in an earlier scenario may still be listed
        pid = pids[sorted(pids)[0]]
        os.kill(pid, sig)
        stopped.append(pid)

    return fault


def _serve(plan_file: Path, port: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "overlord_dask", "serve", str(plan_file), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return proc, json.loads(proc.stdout.readline())["address"]


def _service_restart(plan, steps, compute_s, fault_at, tmp) -> tuple[dict, list]:
    import yaml

    from overlord_dask import connect
    from overlord_dask.plan import plan_to_dict

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    d = plan_to_dict(plan)
    for s in d["sources"]:
        s["url"] = str(Path(plan.base_dir) / s["url"])
    plan_file = Path(tmp) / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(d))
    procs = [_serve(plan_file, port)[0]]
    address = f"tcp://127.0.0.1:{port}"
    streams = {
        r: connect(address, r, timeout=120, prefetch_steps=1, reconnect_timeout=120) for r in range(plan.topology.dp)
    }

    def restart():
        os.killpg(procs[-1].pid, signal.SIGKILL)
        procs[-1].wait()
        procs.append(_serve(plan_file, port)[0])

    try:
        got, after, _ = _train(streams, steps, compute_s, fault_at, restart)
    finally:
        for s in streams.values():
            s.close()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return got, after


def _trainer_restart(plan, cluster, steps: int, compute_s: float, fault_at: int) -> tuple[dict, float]:
    """Rank 1 dies holding step ``fault_at`` (unacknowledged) and restarts from the state it saved
    just before; returns (pieces per (rank, step), the restarted rank's wait for its first batch)."""
    from overlord_dask import Service, connect
    from overlord_dask.observe.figures import delivered_identities, delivered_record

    got, stall = {}, []

    def ids(b):
        return sorted(map(tuple, delivered_identities(delivered_record(b)).tolist()))

    with Service.start(plan, cluster=cluster) as service:

        def run(r):
            stream = connect(service.address, r, timeout=120, prefetch_steps=1)
            for _ in range(steps):
                if r == 1 and stream.next_step == fault_at:
                    saved = stream.state_dict()  # the trainer's checkpoint
                    lost = stream.next_batch()  # ... it takes the next step and dies in it
                    stream.close()
                    t0 = time.perf_counter()
                    stream = connect(service.address, r, timeout=120, prefetch_steps=1)
                    stream.load_state_dict(saved)
                    b = stream.next_batch()
                    stall.append(time.perf_counter() - t0)
                    assert b["step"] == lost["step"] and ids(b) == ids(lost), "the lost step comes again, the same"
                else:
                    b = stream.next_batch()
                got[(r, b["step"])] = ids(b)
                time.sleep(compute_s)
            stream.close()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(plan.topology.dp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return got, max(stall, default=0.0)


def _job_restart(plan, cluster, kill_at: int, k: int, total: int, compute_s: float) -> tuple[dict, dict, float]:
    """Every rank runs to step ``kill_at`` keeping its ``state_dict`` of step ``kill_at - k``, and
    dies there (its stream dropped, nothing more acknowledged); the job restarts every rank from
    that checkpoint while the service runs on and goes to step ``total``. Returns (pieces per
    (rank, step) of the run as the trainers kept it: the first life before the checkpoint, the
    second from it), (pieces per (rank, step) of the first life from the checkpoint on: what the
    second must repeat), and the longest a restarted rank waited for its first batch."""
    from overlord_dask import Service, connect
    from overlord_dask.observe.figures import delivered_identities, delivered_record

    kept, first_life, stall = {}, {}, []

    def ids(b):
        return sorted(map(tuple, delivered_identities(delivered_record(b)).tolist()))

    with Service.start(plan, cluster=cluster) as service:
        saved = {}

        def first(r):
            stream = connect(service.address, r, timeout=120, prefetch_steps=1)
            while stream.next_step < kill_at:
                if stream.next_step == kill_at - k:
                    saved[r] = stream.state_dict()  # the job's checkpoint, k steps before it dies
                b = stream.next_batch()
                (kept if b["step"] < kill_at - k else first_life)[(r, b["step"])] = ids(b)
                time.sleep(compute_s)
            stream.rio.stop(wait=10)  # the process dies: no acknowledgement of what it held

        def second(r):
            t0 = time.perf_counter()
            stream = connect(service.address, r, timeout=120, prefetch_steps=1)
            stream.load_state_dict(saved[r])
            for i in range(total - (kill_at - k)):
                b = stream.next_batch()
                if i == 0:
                    stall.append(time.perf_counter() - t0)
                kept[(r, b["step"])] = ids(b)
                time.sleep(compute_s)
            stream.close()

        for fn in (first, second):
            threads = [threading.Thread(target=fn, args=(r,)) for r in range(plan.topology.dp)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    return kept, first_life, max(stall, default=0.0)


def _bad_inputs() -> tuple[int, int]:
    """(cases in the catalogue, cases that pass): the catalogue test, run as CI runs it."""
    from tests.test_bad_inputs import CASES

    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_bad_inputs.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    passed = 0
    for line in out.stdout.splitlines():
        if " passed" in line:
            passed = int(line.strip().split(" passed")[0].split()[-1])
    return len(CASES), passed


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault-at", type=int, default=15)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument(
        "--slow-seconds", type=float, default=60.0, help="how long the slow trainer runs (10x --compute-ms per step)"
    )
    ap.add_argument("--data", default="demo-data")
    ap.add_argument("--no-catalogue", action="store_true", help="skip running the bad-input catalogue")
    ap.add_argument(
        "--restart-ks",
        type=int,
        nargs="*",
        default=[1, 17, 200],
        help="job_restart_from_checkpoint: how many steps old the checkpoint is (none: skip)",
    )
    args = ap.parse_args(argv)

    from overlord_dask.service.demo import generate_demo_corpus
    from overlord_dask.service.deploy import local_cluster

    if not os.path.exists(os.path.join(args.data, "CORPUS.json")):
        generate_demo_corpus(args.data)
    compute_s = args.compute_ms / 1e3
    rows = []
    with local_cluster(n_workers=2) as cluster:
        reference, _, base_wait, _ = _service_run(_plan(args.data, args.dp, 1), cluster, args.steps, compute_s)
        for name, shadows, sig in (
            ("worker_kill_shadows", 1, signal.SIGKILL),
            ("worker_kill_no_shadows", 0, signal.SIGKILL),
            ("worker_hung_shadows", 1, signal.SIGSTOP),
        ):
            hit: list[int] = []
            try:
                got, after, _, shadowed = _service_run(
                    _plan(args.data, args.dp, shadows),
                    cluster,
                    args.steps,
                    compute_s,
                    args.fault_at,
                    _signal_a_worker(sig, hit),
                )
            finally:
                for pid in hit if sig == signal.SIGSTOP else ():
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:  # its nanny already replaced it
                        pass
            rows.append(
                {
                    "scenario": name,
                    "stall_max_s": round(max(after, default=0.0), 3),
                    "baseline_wait_max_s": round(base_wait, 3),
                    **shadowed,
                    **_compare(reference, got),
                }
            )
            deadline = time.monotonic() + 60  # the nanny starts a new worker
            while len(cluster.scheduler_info["workers"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
        got, stall = _trainer_restart(_plan(args.data, args.dp, 1), cluster, args.steps, compute_s, args.fault_at)
        rows.append(
            {
                "scenario": "trainer_restart",
                "stall_max_s": round(stall, 3),
                "baseline_wait_max_s": round(base_wait, 3),
                "batches_shadowed": "",
                **_compare(reference, got),
            }
        )
        if args.restart_ks:
            tail = 5  # steps run after the restart, past the step the job died at
            kill_ats = {k: max(args.fault_at, k + 1) for k in args.restart_ks}
            total = max(kill_ats.values()) + tail
            long_ref = (
                _service_run(_plan(args.data, args.dp, 1), cluster, total, compute_s)[0]
                if total > args.steps
                else reference
            )
            for k in args.restart_ks:
                kept, first_life, stall = _job_restart(
                    _plan(args.data, args.dp, 1), cluster, kill_ats[k], k, kill_ats[k] + tail, compute_s
                )
                ref = {key: v for key, v in long_ref.items() if key[1] < kill_ats[k] + tail}
                again = all(kept[key] == v for key, v in first_life.items())
                rows.append(
                    {
                        "scenario": f"job_restart_from_checkpoint_k{k}",
                        "stall_max_s": round(stall, 3),
                        "baseline_wait_max_s": round(base_wait, 3),
                        "batches_shadowed": "",
                        **_compare(ref, kept),
                        "repeats_first_life": again,
                    }
                )
        slow_steps = max(args.steps, round(args.slow_seconds / (10 * compute_s)))
        slow_ref = (
            reference
            if slow_steps == args.steps
            else _service_run(_plan(args.data, args.dp, 1), cluster, slow_steps, compute_s)[0]
        )
        got, after, _, mem = _service_run(_plan(args.data, args.dp, 1), cluster, slow_steps, compute_s, slow={1: 10})
        rows.append(
            {
                "scenario": "slow_trainer",
                "stall_max_s": round(max(after, default=0.0), 3),
                "baseline_wait_max_s": round(base_wait, 3),
                "seconds": round(slow_steps * 10 * compute_s, 1),
                **mem,
                **_compare(slow_ref, got),
            }
        )
    with tempfile.TemporaryDirectory() as tmp:
        plan = _plan(args.data, args.dp, 1, checkpoint=os.path.join(tmp, "ck"))
        got, after = _service_restart(plan, args.steps, compute_s, args.fault_at, tmp)
        rows.append(
            {
                "scenario": "service_restart",
                "stall_max_s": round(max(after, default=0.0), 3),
                "baseline_wait_max_s": round(base_wait, 3),
                "batches_shadowed": "",
                **_compare(reference, got),
            }
        )
    cases, clear = (0, 0) if args.no_catalogue else _bad_inputs()
    out = {
        "benchmark": "faults",
        "cores": os.cpu_count(),
        "dp": args.dp,
        "steps": args.steps,
        "compute_ms": args.compute_ms,
        "scenarios": {r["scenario"]: {k: v for k, v in r.items() if k != "scenario"} for r in rows},
        "bad_inputs": cases,
        "bad_inputs_clear": clear,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print_rows(
            rows,
            [
                "scenario",
                "stall_max_s",
                "baseline_wait_max_s",
                "batches_shadowed",
                "batch_bytes_max",
                "shadow_bytes_max",
                "block_bytes_max",
                "block_shadow_bytes_max",
                "rss_growth_mb",
                "identical",
                "duplicates",
                "missing",
                "repeats_first_life",
            ],
        )
        print(f"bad inputs: {clear} of {cases} get their clear error or handling (tests/test_bad_inputs.py)")
    return out


if __name__ == "__main__":
    main()
