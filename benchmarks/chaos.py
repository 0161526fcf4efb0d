"""A chaos run: random faults, several at once, over a long run; an independent checker of what
the trainers kept.

    python benchmarks/chaos.py                      # 20 minutes, readable table
    python benchmarks/chaos.py --seconds 150 --json # one JSON object

The service runs as ``overlord serve`` (scheduler, planner, two worker processes) on a fixed
port, its sources on an S3-compatible server on loopback (moto) behind a fault-injecting proxy
(``overlord_dask.testing.faulty_store``), its snapshots on a small tmpfs of their own (``--snapshots
disk``, where this machine lets root mount one) or in the same object store (``--snapshots s3``).
The training job is a process of its own (``--dp`` rank threads, each computing ``--compute-ms``
per step) that saves every rank's ``state_dict()`` every ``--checkpoint-every`` steps, as a
trainer checkpoint does.

A seeded schedule (the same ``--seed``, the same faults at the same offsets) injects, with gaps
drawn around ``--gap-s`` seconds, so that faults that last overlap those that follow:

- ``worker_kill``: SIGKILL a worker process (its nanny starts another);
- ``worker_stop``: SIGSTOP a worker for a few seconds, then SIGCONT (a hung host that comes back);
- ``host_cut``: the loader host's network link goes down for a while, then up (below);
- ``service_kill``: SIGKILL the whole service and start it again on the same port from its
  snapshots (the trainers' streams reconnect);
- ``job_restart``: SIGKILL the training job and start it again from one of its recent
  checkpoints (sometimes not the newest), sometimes with another dp;
- ``store_errors`` / ``store_latency``: the object store answers a share of requests with
  ``503 SlowDown``, or delays each, for a while (sources, and snapshots with ``--snapshots s3``);
- ``disk_full``: the snapshot location's file system is filled for a while (``--snapshots disk``).

Where root may make network namespaces (``ip netns``, as ``tests/test_hosts.py`` does), a third
worker runs as a loader host of its own behind a virtual bridge (the service, the store and the
job listen on the bridge's address), and ``host_cut`` takes its link down for a while and up again
(its worker, if the scheduler dropped it meanwhile, is started again, as a cluster's supervisor
would). Without them ``host_cut`` is left out, as ``disk_full`` is without a tmpfs.

The checker shares no code with the service beyond ``replay``: at the end it asks the service for
its timeline (plan versions, decisions, dp changes) and plans the run again offline
(``replay(plan, timeline)``); what the trainers kept (each step from the last life of the job that
took it: a job restarted from a checkpoint throws away what its previous life took after it) must
be that stream, rank by rank, step by step, micro-batch by micro-batch: ``lost`` counts planned
pieces no rank kept, ``repeated`` pieces kept more than once, ``identical`` says every kept step
equals the replayed one. Each fault's ``stall`` is the longest a rank waited for a batch from
the fault until 15 s after it ended (for ``job_restart``: from the new job's start to its last
rank's first batch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.output import print_rows  # noqa: E402

KINDS = (
    "worker_kill",
    "worker_stop",
    "host_cut",
    "service_kill",
    "job_restart",
    "store_errors",
    "store_latency",
    "disk_full",
)
WEIGHTS = {
    "worker_kill": 3,
    "worker_stop": 2,
    "host_cut": 2,
    "service_kill": 2,
    "job_restart": 3,
    "store_errors": 2,
    "store_latency": 2,
    "disk_full": 1,
}
AFTER_S = 15.0  # a fault's stall window goes on this long after it ends


# ---- the schedule ---------------------------------------------------------------------------------
def schedule(seed: int, seconds: float, gap_s: float, kinds: tuple[str, ...]) -> list[dict]:
    """The faults of a run: ``[{"at", "kind", ...parameters}]``, a pure function of its arguments."""
    rng = random.Random(seed)
    weighted = [k for k in kinds for _ in range(WEIGHTS[k])]
    out, t = [], 20.0  # the run warms up first
    while True:
        t += rng.expovariate(1.0 / gap_s)
        if t > seconds - 30:  # the run ends calm: the last faults heal before the checker runs
            return out
        kind = rng.choice(weighted)
        f = {"at": round(t, 2), "kind": kind}
        if kind == "worker_stop":
            f["seconds"] = round(rng.uniform(2, 12), 1)
        elif kind == "host_cut":
            f["seconds"] = round(rng.uniform(5, 30), 1)
        elif kind == "job_restart":
            f["back"] = rng.choice((0, 0, 1, 2))  # which recent checkpoint: 0 the newest
            f["dp_change"] = rng.random() < 0.4
        elif kind == "store_errors":
            f["seconds"] = round(rng.uniform(5, 20), 1)
            f["rate"] = round(rng.uniform(0.05, 0.3), 2)
        elif kind == "store_latency":
            f["seconds"] = round(rng.uniform(5, 20), 1)
            f["latency_s"] = round(rng.uniform(0.05, 0.5), 2)
        elif kind == "disk_full":
            f["seconds"] = round(rng.uniform(5, 20), 1)
        out.append(f)


# ---- the training job (a process of its own) ------------------------------------------------------
def job_main(spec: dict) -> None:
    """One life of the training job: every rank loads its checkpoint state (if any), takes steps
    until the ``stop`` file names a step it reached, writes what it received (one JSON line per
    step, flushed) and its ``state_dict()`` every ``checkpoint_every`` steps."""
    from overlord_dask import connect
    from overlord_dask.testing.history import batch_pieces

    out, dp, life = Path(spec["out"]), spec["dp"], spec["life"]
    stop_file = out / "stop"

    def rank(r: int) -> None:
        log = open(out / f"life{life}-rank{r}.jsonl", "a")
        s = connect(spec["address"], r, dp, timeout=900, prefetch_steps=1, reconnect_timeout=900)
        if spec["states"] is not None:
            s.load_state_dict(spec["states"][str(r)] if str(r) in spec["states"] else spec["states"]["0"])
        while True:
            if s.next_step % spec["checkpoint_every"] == 0:
                state = s.state_dict()
                tmp = out / f".ck-{life}-{s.next_step}-{r}"
                tmp.write_text(json.dumps(state))
                tmp.rename(out / f"ck-{life}-{s.next_step}-{r}.json")
            if stop_file.exists() and s.next_step >= int(stop_file.read_text()):
                break
            t0 = time.time()
            b = s.next_batch()
            wait = time.time() - t0
            ids = batch_pieces(b)
            log.write(json.dumps({"step": b["step"], "t0": t0, "wait": wait, "ids": ids}) + "\n")
            log.flush()
            time.sleep(spec["compute_s"])
        s.commit()
        s.close()

    def guarded(r):
        try:
            rank(r)
        except BaseException as e:  # noqa: BLE001 (a rank that fails ends the job, as in a real one)
            print(f"rank {r}: {type(e).__name__}: {e}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            os._exit(1)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Job:
    """The training job's lives, as the benchmark drives them."""

    def __init__(self, address: str, out: Path, dp: int, compute_s: float, checkpoint_every: int):
        self.address, self.out, self.compute_s, self.every = address, out, compute_s, checkpoint_every
        self.lives: list[dict] = []  # {"life", "dp", "from", "proc", "started"}
        self.errors: list[str] = []
        self.start(dp, None, 0)

    def start(self, dp: int, states: dict | None, step: int) -> None:
        life = len(self.lives)
        spec = {
            "address": self.address,
            "out": str(self.out),
            "dp": dp,
            "life": life,
            "states": states,
            "compute_s": self.compute_s,
            "checkpoint_every": self.every,
        }
        err = open(self.out / f"life{life}.stderr", "w")
        proc = subprocess.Popen(
            [sys.executable, __file__, "--job", json.dumps(spec)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.lives.append({"life": life, "dp": dp, "from": step, "proc": proc, "started": time.time()})

    @property
    def current(self) -> dict:
        return self.lives[-1]

    def checkpoints(self) -> list[int]:
        """Steps of the complete checkpoints (every rank saved) the kept history still holds: each
        life throws away the checkpoints after the one it started from, then adds its own."""
        steps: set[int] = set()
        for lf in self.lives:
            steps = {s for s in steps if s <= lf["from"]}
            found: dict[int, set] = {}
            for p in self.out.glob(f"ck-{lf['life']}-*.json"):
                _, _, step, r = p.stem.split("-")
                found.setdefault(int(step), set()).add(int(r))
            steps |= {s for s, rs in found.items() if len(rs) == lf["dp"] and s >= lf["from"]}
        return sorted(steps)

    def state_of(self, step: int) -> dict:
        """Every rank's state of the newest life's checkpoint at ``step``."""
        for lf in reversed(self.lives):
            files = sorted(self.out.glob(f"ck-{lf['life']}-{step}-*.json"))
            if len(files) == lf["dp"]:
                return {p.stem.split("-")[3]: json.loads(p.read_text()) for p in files}
        raise KeyError(step)

    def restart(self, back: int, dp: int) -> int:
        """SIGKILL the job; start it again from its ``back``-th newest checkpoint with ``dp``
        ranks. Returns the checkpoint's step."""
        proc = self.current["proc"]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        cks = self.checkpoints()
        step = cks[max(0, len(cks) - 1 - back)] if cks else 0
        states = self.state_of(step) if cks else None
        self.start(dp, states, step)
        return step

    def watch(self) -> None:
        """A life that died on its own (an error in a rank) is an error of the run; the job is
        started again from its newest checkpoint, as a cluster's requeue would."""
        proc = self.current["proc"]
        if proc.poll() not in (None, 0):
            tail = (self.out / f"life{self.current['life']}.stderr").read_text()[-2000:]
            self.errors.append(f"life {self.current['life']} exited {proc.returncode}: {tail.strip()}")
            self.restart(0, self.current["dp"])

    def records(self) -> dict[int, list[dict]]:
        """Per life, its ranks' records ``{"rank", "step", "t0", "wait", "ids"}``."""
        out = {}
        for lf in self.lives:
            rows = []
            for r in range(lf["dp"]):
                p = self.out / f"life{lf['life']}-rank{r}.jsonl"
                for line in p.read_text().splitlines() if p.exists() else ():
                    try:
                        rows.append({"rank": r, **json.loads(line)})
                    except json.JSONDecodeError:  # the last line of a killed life
                        pass
            out[lf["life"]] = rows
        return out

    def reached(self) -> int:
        """The newest step a rank of the current life took (-1: none yet)."""
        return max((x["step"] for x in self.records()[self.current["life"]]), default=-1)


# ---- the service ----------------------------------------------------------------------------------
class Served:
    """``overlord serve`` on a fixed port; SIGKILLed and started again from its snapshots."""

    def __init__(self, plan_file: Path, port: int, out: Path, host: str = "127.0.0.1"):
        self.plan_file, self.port, self.out, self.starts, self.host = plan_file, port, out, 0, host
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def start(self) -> None:
        err = open(self.out / f"service{self.starts}.stderr", "w")
        self.starts += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "overlord_dask", "serve", str(self.plan_file), "--port", str(self.port)]
            + (["--host", self.host] if self.host != "127.0.0.1" else []),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the service did not start: {(self.out / f'service{self.starts - 1}.stderr').read_text()}"
            )
        json.loads(line)
        threading.Thread(target=_drain, args=(self.proc.stdout, err), daemon=True).start()  # (a full pipe blocks it)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def workers(self) -> list[psutil.Process]:
        """The worker processes (the embedded LocalCluster's, spawned by their nannies)."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        out = []
        for k in kids:
            try:
                cmd = " ".join(k.cmdline())
            except psutil.Error:
                continue
            if "spawn_main" in cmd and "resource_tracker" not in cmd:
                out.append(k)
        return out


def _drain(pipe, into) -> None:
    for line in pipe:
        into.write(line)
        into.flush()


class Host:
    """A loader host in a network namespace of its own, joined to this machine by a bridge: one
    Dask worker process group that ``cut()`` cuts off and ``heal()`` reconnects."""

    NET = "10.232.0"  # the bridge (this side: .1) and the host (.2)

    def __init__(self, tag: str):
        self.tag, self.ns, self.proc, self.starts = tag, f"{tag}h", None, 0
        self.out: Path | None = None
        self.address: str | None = None
        cmds = [
            ("ip", "link", "add", f"{tag}br", "type", "bridge"),
            ("ip", "addr", "add", f"{self.NET}.1/24", "dev", f"{tag}br"),
            ("ip", "link", "set", f"{tag}br", "up"),
            ("ip", "netns", "add", self.ns),
            ("ip", "link", "add", f"{tag}v0", "type", "veth", "peer", "name", f"{tag}v1"),
            ("ip", "link", "set", f"{tag}v0", "master", f"{tag}br", "up"),
            ("ip", "link", "set", f"{tag}v1", "netns", self.ns),
            ("ip", "-n", self.ns, "addr", "add", f"{self.NET}.2/24", "dev", f"{tag}v1"),
            ("ip", "-n", self.ns, "link", "set", f"{tag}v1", "up"),
            ("ip", "-n", self.ns, "link", "set", "lo", "up"),
        ]
        try:
            for c in cmds:
                subprocess.run(c, check=True, capture_output=True, timeout=30)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
            self.remove()
            raise

    @property
    def here(self) -> str:
        """This machine's address on the bridge (what the service and the store listen on)."""
        return f"{self.NET}.1"

    def start(self, address: str, out: Path) -> None:
        self.address, self.out = address, out
        err = open(out / f"host{self.starts}.stderr", "w")
        self.starts += 1
        cmd = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "1", "--nthreads", "1"]
        cmd += ["--name", "host-c", "--no-dashboard", "--host", f"{self.NET}.2"]
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, *cmd],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def supervise(self) -> None:
        """Start the host's worker again if it ended (dropped by the scheduler, or its service restarted)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.start(self.address, self.out)

    def cut(self) -> None:
        subprocess.run(["ip", "link", "set", f"{self.tag}v0", "down"], check=True, capture_output=True)

    def heal(self) -> None:
        subprocess.run(["ip", "link", "set", f"{self.tag}v0", "up"], check=True, capture_output=True)

    def remove(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.tag}br"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.tag}v0"], capture_output=True)


# ---- the faults -----------------------------------------------------------------------------------
class Injector:
    """Runs a schedule against a service, a job, a store and a snapshot disk; records what ran."""

    def __init__(
        self, served: Served, job: Job, store, disk: Path | None, rng: random.Random, dp_choices, host: Host | None
    ):
        self.served, self.job, self.store, self.disk, self.rng, self.host = served, job, store, disk, rng, host
        self.dp_choices = dp_choices
        self.done: list[dict] = []
        self.lock = threading.Lock()  # one fault changes the service or the job at a time
        self.stopped: set[int] = set()

    def run(self, faults: list[dict], t0: float, stop: threading.Event) -> None:
        for f in faults:
            if stop.wait(max(0.0, t0 + f["at"] - time.time())):
                return
            with self.lock:
                self.job.watch()
            try:
                self.inject(f)
            except Exception as e:  # noqa: BLE001 (a fault that could not be injected is reported, not fatal)
                self.done.append({**f, "start": time.time(), "end": time.time(), "skipped": repr(e)})

    def inject(self, f: dict) -> None:
        kind, start = f["kind"], time.time()
        rec = {**f, "start": start}
        with self.lock:
            if kind == "worker_kill":
                w = self.served.workers()
                if not w:
                    rec["skipped"] = "no worker process"
                else:
                    os.kill(self.rng.choice(w).pid, signal.SIGKILL)
            elif kind == "worker_stop":
                w = [p for p in self.served.workers() if p.pid not in self.stopped]
                if not w or self.stopped:  # one hung worker at a time: the other keeps the run going
                    rec["skipped"] = "a worker is stopped already" if self.stopped else "no worker process"
                else:
                    pid = self.rng.choice(w).pid
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped.add(pid)
                    self._later(f["seconds"], self._cont, pid)
            elif kind == "host_cut":
                self.host.cut()
                self._later(f["seconds"], self.host.heal)
            elif kind == "service_kill":
                self.stopped.clear()  # (its processes die with it)
                self.served.kill()
                self.served.start()
            elif kind == "job_restart":
                dp = self.job.current["dp"]
                if f["dp_change"]:
                    dp = self.rng.choice([d for d in self.dp_choices if d != dp])
                rec["from_step"], rec["dp"] = self.job.restart(f["back"], dp), dp
                rec["life"] = self.job.current["life"]
            elif kind == "store_errors":
                self.store.set(error_rate=f["rate"])
                self._later(f["seconds"], self.store.set)
            elif kind == "store_latency":
                self.store.set(latency_s=f["latency_s"])
                self._later(f["seconds"], self.store.set)
            elif kind == "disk_full":
                filler = self.disk / "filler"
                with open(filler, "wb") as fh:
                    try:
                        while True:
                            fh.write(b"\0" * (1 << 20))
                            fh.flush()
                    except OSError:
                        pass
                self._later(f["seconds"], lambda: filler.unlink(missing_ok=True))
        rec["end"] = start + f.get("seconds", 0.0)
        self.done.append(rec)

    def _cont(self, pid: int) -> None:
        with self.lock:
            if pid in self.stopped:
                self.stopped.discard(pid)
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def _later(self, seconds: float, fn, *args) -> None:
        t = threading.Timer(seconds, fn, args)
        t.daemon = True
        t.start()
        self.timers = [*getattr(self, "timers", []), (t, fn, args)]

    def heal(self) -> None:
        """End every lasting fault now."""
        for t, fn, args in getattr(self, "timers", []):
            if t.is_alive():
                t.cancel()
                fn(*args)


def stalls(done: list[dict], job: Job, recs: dict[int, list[dict]]) -> list[float]:
    """Each injected fault's stall (module docstring); ``recs``: ``job.records()``."""
    rows = [x for v in recs.values() for x in v]
    out = []
    for f in done:
        if f.get("skipped"):
            continue
        if f["kind"] == "job_restart":
            lf, firsts = job.lives[f["life"]], []
            for r in range(lf["dp"]):
                mine = [x for x in recs[lf["life"]] if x["rank"] == r]
                if mine:
                    firsts.append(min(x["t0"] + x["wait"] for x in mine) - lf["started"])
            out.append(max(firsts, default=float("nan")))
        else:
            lo, hi = f["start"], f["end"] + AFTER_S
            out.append(max((x["wait"] for x in rows if lo <= x["t0"] + x["wait"] and x["t0"] <= hi), default=0.0))
    return out


# ---- the run --------------------------------------------------------------------------------------
def _mount_tmpfs(path: Path, mib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def _upload(data: Path, endpoint: str) -> None:
    import fsspec

    from overlord_dask.testing.object_store import create_bucket, storage_options

    create_bucket(endpoint, "corpus")
    create_bucket(endpoint, "snapshots")
    fs = fsspec.filesystem("s3", **storage_options(endpoint))
    for name in ("web", "chat", "books.zarr"):
        fs.put(str(data / name), f"corpus/{name}", recursive=True)


def _plan_file(data: Path, tmp: Path, endpoint: str, checkpoint: str, dp: int, seed: int) -> Path:
    import yaml

    from overlord_dask.plan import plan_to_dict
    from overlord_dask.service.demo import demo_plan
    from overlord_dask.testing.object_store import storage_options

    plan = demo_plan(
        data,
        topology={"dp": dp, "micro_batches": 2, "tokens_per_micro_batch": 8192},
        loading={"prefetch_steps": 8, "batch_steps": 2, "shadows": 1},
    )
    d = plan_to_dict(plan)
    d["seed"] = seed
    for s in d["sources"]:
        s["url"] = f"s3://corpus/{s['url']}"
        s["storage_options"] = storage_options(endpoint)
    d["checkpoint"] = {"url": checkpoint, "base_every_steps": 10, "keep_steps": 1_000_000}
    if checkpoint.startswith("s3://"):
        d["checkpoint"]["storage_options"] = storage_options(endpoint)
    path = tmp / "plan.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def run(args) -> dict:
    from overlord_dask import Service, load_plan
    from overlord_dask.service.demo import generate_demo_corpus
    from overlord_dask.service.replay import replay
    from overlord_dask.testing.faulty_store import FaultyStore
    from overlord_dask.testing.history import check, kept
    from overlord_dask.testing.object_store import start_moto

    data = Path(args.data).resolve()
    if not (data / "CORPUS.json").exists():
        generate_demo_corpus(str(data))
    kinds = tuple(args.kinds)
    t_run = time.time()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        disk = tmp / "snapshots"
        mounted = args.snapshots == "disk" and _mount_tmpfs(disk, 48)
        if not mounted:
            kinds = tuple(k for k in kinds if k != "disk_full")  # no file system of its own to fill
        host = None
        if "host_cut" in kinds:
            try:
                host = Host(f"ovc{os.getpid() % 10000}")
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
                kinds = tuple(k for k in kinds if k != "host_cut")  # no network namespaces here
        here = host.here if host is not None else "127.0.0.1"
        moto, upstream = start_moto()
        store = FaultyStore(upstream, seed=args.seed, host=here).start()
        served = job = injector = None
        stop = threading.Event()
        try:
            _upload(data, upstream)
            checkpoint = str(disk / "run") if args.snapshots == "disk" else "s3://snapshots/run"
            plan_file = _plan_file(data, tmp, store.endpoint, checkpoint, args.dp, args.seed)
            with socket.socket() as sock:
                sock.bind((here, 0))
                port = sock.getsockname()[1]
            logs = tmp / "job"
            logs.mkdir()
            served = Served(plan_file, port, tmp, here)
            if host is not None:
                host.start(served.address, tmp)
            job = Job(served.address, logs, args.dp, args.compute_ms / 1e3, args.checkpoint_every)
            faults = schedule(args.seed, args.seconds, args.gap_s, kinds)
            injector = Injector(
                served, job, store, disk if mounted else None, random.Random(args.seed + 1), (2, 3), host
            )
            t0 = time.time()
            thread = threading.Thread(target=injector.run, args=(faults, t0, stop), daemon=True)
            thread.start()
            while time.time() < t0 + args.seconds:
                time.sleep(1.0)
                with injector.lock:
                    job.watch()
                    if host is not None:
                        host.supervise()
            stop.set()
            thread.join(timeout=600)
            injector.heal()
            target = max(job.reached(), job.current["from"]) + 10  # past where any rank is now
            (logs / "stop").write_text(str(target))
            deadline = time.time() + 600
            while job.current["proc"].poll() is None and time.time() < deadline:
                time.sleep(0.5)
            job.watch()
            if job.current["proc"].poll() is None:
                services = "".join(f.read_text()[-2000:] for f in sorted(tmp.glob("service*.stderr")))
                raise RuntimeError(
                    f"the job did not reach step {target} within 600 s after the faults (a life that fails is "
                    f"started again); its lives' errors: {job.errors}; the service's log ends: {services}"
                )
            with Service.attach(served.address, timeout=60) as svc:
                timeline = svc.timeline()
            replayed = replay(load_plan(plan_file), timeline, target)
            lives = job.records()
            result = check(replayed, kept([(lf["from"], lives[lf["life"]]) for lf in job.lives]), target)
            st = stalls(injector.done, job, lives)
            ran = [f for f in injector.done if not f.get("skipped")]
            return {
                "benchmark": "chaos",
                "cores": os.cpu_count(),
                "seed": args.seed,
                "seconds": round(time.time() - t_run, 1),
                "steps": target,
                "faults": len(ran),
                "kinds": {k: sum(f["kind"] == k for f in ran) for k in KINDS if k in kinds},
                "skipped": len(injector.done) - len(ran),
                "dp_changes": [list(c) for c in timeline.dp_changes()],
                "job_lives": len(job.lives),
                "job_errors": job.errors,
                **result,
                "stall_p50_s": round(float(np.nanmedian(st)), 3) if st else 0.0,
                "stall_max_s": round(float(np.nanmax(st)), 3) if st else 0.0,
                "store_requests": dict(store.counts),
                "host_starts": host.starts if host is not None else 0,
                "snapshots": args.snapshots if mounted or args.snapshots == "s3" else "disk (no tmpfs: no disk_full)",
                "schedule": faults,
                "fault_stalls": [
                    {"kind": f["kind"], "at": f["at"], "stall_s": round(s, 3)}
                    for f, s in zip([f for f in injector.done if not f.get("skipped")], st)
                ],
            }
        finally:
            stop.set()
            if injector is not None:
                injector.heal()
            if job is not None and job.current["proc"].poll() is None:
                os.killpg(job.current["proc"].pid, signal.SIGKILL)
            if served is not None and served.proc.poll() is None:
                served.kill()
            store.stop()
            moto.kill()
            if host is not None:
                host.remove()
            if mounted:
                subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seconds", type=float, default=1200.0, help="how long faults are injected")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dp", type=int, default=2, help="the job's first dp (a restart may change it to 2 or 3)")
    ap.add_argument("--gap-s", type=float, default=20.0, help="mean gap between faults")
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--snapshots", choices=("disk", "s3"), default="disk")
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    ap.add_argument("--data", default="demo-data")
    ap.add_argument("--job", help=argparse.SUPPRESS)  # (the training job's own process)
    args = ap.parse_args(argv)
    if args.job:
        job_main(json.loads(args.job))
        return {}
    # a benchmark stopped with SIGTERM (a CI timeout, `kill`) still unmounts its tmpfs, deletes its
    # namespace and stops its processes (run's `finally`)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = run(args)
    if args.json:
        print(json.dumps(out))
    else:
        by_kind = {}
        for f in out["fault_stalls"]:
            by_kind.setdefault(f["kind"], []).append(f["stall_s"])
        print_rows(
            [
                {"kind": k, "injected": len(v), "stall_p50_s": round(float(np.nanmedian(v)), 3), "stall_max_s": max(v)}
                for k, v in by_kind.items()
            ],
            ["kind", "injected", "stall_p50_s", "stall_max_s"],
        )
        keys = ("faults", "kinds", "lost", "repeated", "identical", "stall_p50_s", "stall_max_s", "steps", "seconds")
        print_rows([{k: out[k] for k in keys}], list(keys))
        if out["job_errors"]:
            print("job errors:", *out["job_errors"], sep="\n  ")
    return out


if __name__ == "__main__":
    main()
