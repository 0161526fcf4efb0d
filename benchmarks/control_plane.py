"""The central control path at thousands of ranks: sustained steps/s, the service process's
CPU per (step, rank), and the longest block of the scheduler's event loop.

    python benchmarks/control_plane.py                  # dp 256, 1,024, 4,096: readable table
    python benchmarks/control_plane.py --json --dp 256 1024 4096 --tokens 1024

Each row starts a service (planner plugin, driver and a LocalCluster of worker processes, all
in this process but the workers) with small micro-batches (``--tokens`` per rank and step), so
that the control path, not packing or the payload, sets the pace (``heavy_tokens`` is half a
micro-batch). The ranks are grouped into simulated hosts of ``--ranks-per-host`` (8), each host
with one connection (channel) to the scheduler, as many as a deployment with that many trainer
processes per connection has, spread over ``--procs`` consumer processes at lower CPU priority
(they stand in for trainers on other hosts). ``--consumers lean`` (default): asyncio stand-ins
that speak a ``RankStream``'s protocol (attach, subscribe, fetch each chunk from the worker
holding it, acknowledge at its end) without decoding batches into arrays, since thousands of
trainer threads do not fit on two cores; ``--consumers rankstream``: a ``RankStream`` per rank,
one thread per host. After a warm-up, for ``--seconds``: steps committed per second, this
process's CPU time (user + system: scheduler, planner thread, driver, nannies) divided by
steps × dp, and the scheduler's longest event-loop block (``overlord_loop``: how late the
watchdog's 50 ms timer on the loop fired). Then, the consumers stopped, the same process's CPU
per second while the service waits for them (``idle_cpu_ms_per_s``, over ``--idle-seconds``):
what a service costs its host between steps, mostly wake-ups of its event loop.

The same run also measures a baseline row at the smallest ``dp``: the plan with
``loading.batch_steps: 1``, i.e. a descriptor, a fetch and an ack per (step, rank) and
constructor tasks per step, as the control path was before chunking.

The service's CPU is also split by thread: the planner thread's (``planner_ms_per_1m_tokens``:
its CPU over the tokens committed) and the rest, the control path (event loop, submitter,
nannies), per (step, host): ``control_ms_per_step_host``. A simulated host's channel is what a
host's relay (``trainer/relay.py``) gives the service: one connection for its processes.

    python benchmarks/control_plane.py --hosts-rows    # dp 1,024 / 4,096 / 16,384, with and without tp 8

``--hosts-rows``: per host, 8 ranks (or, with ``tp`` 8, one rank and its 8 tensor-parallel
replicas, each a consumer with its subscription and acknowledgements; replica 0 fetches the
payload, which a host's replicas share). Above dp 1,024 the consumers fetch nothing
(``fetch: false``: 16,384 ranks' payloads do not fit this machine); the descriptors, the acks
and the planning are the same.

Targets (issue 37): at most 0.05 ms of service CPU per (step, rank), no higher at dp 4,096 than
at dp 256; at least 12 steps/s at dp 1,024 and 3 at dp 4,096. Issue 49: control path at most
0.02 ms per (step, host) at dp 16,384, no higher than at dp 1,024, the same with tp 8 replicas.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import print_rows  # noqa: E402


def _hosts_process(address: str, hosts: list[list[int]], stop_at: float, out) -> None:
    """Simulated trainer hosts, each with its own connection to the service (a channel group)
    and ``len(host)`` ranks taken in turn by one thread, as fast as batches come, until
    ``stop_at`` (wall clock)."""
    from overlord_dask import connect

    os.nice(10)  # the ranks stand in for trainers on other hosts: the service's figures must be its own
    counts = {}

    def run(h: int, ranks: list[int]) -> None:
        streams = [connect(address, r, timeout=300, channel_group=f"host-{h}") for r in ranks]
        n = 0
        while time.time() < stop_at:
            for s in streams:
                s.next_batch()
                n += 1
        counts[h] = n
        for s in streams:
            s.close()

    threads = [threading.Thread(target=run, args=(h, ranks), daemon=True) for h, ranks in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(counts)


def _lean_hosts_process(
    address: str, hosts: list[list[int]], stop_at: float, out, replicas: int = 1, fetch: bool = True
) -> None:
    """Simulated trainer hosts as asyncio consumers (where thousands of trainer threads would
    not fit on two cores): per host one channel (connection) to the service, and per rank the
    same protocol as a ``RankStream``: attach, subscribe, fetch each chunk's batches from the
    worker holding it (payload straight from the worker, its frames unpickled), acknowledge at
    the chunk's end. Only the decoding into arrays (the trainer's own CPU, on its own host) is
    left out."""
    import asyncio

    from overlord_dask.trainer.connection import ProcessIO
    from overlord_dask.trainer.fetch import fetch_batches

    os.nice(10)
    io = ProcessIO.get()
    counts = {}

    class Rank:
        def __init__(self, rank: int, replica: int, generation: int, channel):
            self.rank, self.replica, self.generation, self.channel = rank, replica, generation, channel
            self.descs: dict[int, dict] = {}
            self.ready = asyncio.Event()

        def on_message(self, msg: dict) -> None:
            if msg.get("op") == "descriptors":
                for d in msg["items"]:
                    if "error" in d:
                        raise RuntimeError(d["error"])
                    self.descs[d["steps"][0]] = d
                self.ready.set()

        def lost(self, why: str) -> None:
            pass

        async def run(self, planner, h: int) -> None:
            step, n = 0, 0
            while time.time() < stop_at:
                if step not in self.descs:
                    self.ready.clear()
                    await self.ready.wait()
                    continue
                d = self.descs.pop(step)
                if fetch and self.replica == 0:  # a host's replicas share the payload replica 0 fetched
                    await fetch_batches(
                        io,
                        planner,
                        d,
                        d["steps"],
                        rank=self.rank,
                        cp_rank=0,
                        timeout=300,
                        abort=asyncio.Event(),
                        address=address,
                    )
                step = d["steps"][-1] + 1
                n += len(d["steps"])
                self.channel.send(
                    {
                        "op": "ack",
                        "rank": self.rank,
                        "step": step - 1,
                        "cp_rank": 0,
                        "replica": self.replica,
                        "generation": self.generation,
                        "durable": True,
                    }
                )
            counts[h] = counts.get(h, 0) + n

    async def host(h: int, ranks: list[int]) -> None:
        planner = io.planner(address)
        info = await planner.info()
        channel = io.channel(address, info["run_id"], wait=False, group=f"host-{h}")
        await channel.opened()
        streams = []
        for r in ranks:
            for k in range(replicas):
                att = await planner.attach(r, 0, k)
                s = Rank(r, k, int(att["generation"]), channel)
                channel.streams[(r, 0, k)] = {s.generation: s}
                channel.send({"op": "subscribe", "rank": r, "cp_rank": 0, "replica": k, "generation": s.generation})
                streams.append(s)
        await asyncio.gather(*(s.run(planner, h) for s in streams))

    async def main():
        await asyncio.gather(*(host(h, ranks) for h, ranks in hosts))

    io.run(main(), timeout=max(1.0, stop_at - time.time() + 60))
    out.put(counts)


def _planner_cpu(me) -> float:
    """CPU seconds (user + system) of the planner thread(s) of this process."""
    ids = {t.native_id for t in threading.enumerate() if t.name.startswith("overlord-planner")}
    return sum(t.user_time + t.system_time for t in me.threads() if t.id in ids)


def _balancer_cpu(me) -> float | None:
    """CPU seconds of the balancer's process (``planner/policies/balancer_process.py``), None
    where the planner thread balances."""
    import psutil

    for child in me.children():
        with contextlib.suppress(psutil.Error):
            if any("balancer_process" in part for part in child.cmdline()):
                return sum(child.cpu_times()[:2])
    return None


def measure(
    cluster,
    data: str,
    dp: int,
    tokens: int,
    procs: int,
    seconds: float,
    warmup_steps: int,
    batch_steps: int | None,
    prefetch: int,
    ranks_per_host: int,
    consumers: str = "lean",
    replicas: int = 1,
    fetch: bool = True,
    idle_seconds: float = 5.0,
) -> dict:
    import psutil

    from overlord_dask import Service
    from overlord_dask.service.demo import demo_plan

    plan = demo_plan(
        data,
        topology={"dp": dp, "micro_batches": 1, "tokens_per_micro_batch": tokens},
        loading={"prefetch_steps": prefetch, "batch_steps": batch_steps, "units_ahead": 4},
        balance={"window": 16, "heavy_tokens": tokens // 2},
    )
    me = psutil.Process()
    ctx = mp.get_context("spawn")
    with Service.start(plan, cluster=cluster) as service:
        q = ctx.Queue()
        hosts = [(h, list(range(r, min(r + ranks_per_host, dp)))) for h, r in enumerate(range(0, dp, ranks_per_host))]
        groups = [hosts[i::procs] for i in range(min(procs, len(hosts)))]
        if consumers == "lean":
            target, extra = _lean_hosts_process, (replicas, fetch)
        else:
            target, extra = _hosts_process, ()
        ps = [
            ctx.Process(target=target, args=(service.address, g, time.time() + 900, q, *extra), daemon=True)
            for g in groups
        ]
        for p in ps:
            p.start()
        st = service.wait_for_step(warmup_steps, timeout=900)
        service.loop_stats(reset=True)
        c0, cpu0, p0, t0 = st["committed"], sum(me.cpu_times()[:2]), _planner_cpu(me), time.perf_counter()
        b0 = _balancer_cpu(me)
        tok0 = st["tokens_committed"]
        time.sleep(seconds)
        st = service.status()
        c1, cpu1, p1, t1 = st["committed"], sum(me.cpu_times()[:2]), _planner_cpu(me), time.perf_counter()
        b1 = _balancer_cpu(me)
        tok1 = st["tokens_committed"]
        loop = service.loop_stats()
        for p in ps:  # the consumers run until stopped: the figures above are taken while they stream
            p.terminate()
        for p in ps:
            p.join(timeout=30)
        idle = None
        if idle_seconds > 0:
            time.sleep(2.0)  # the stopped consumers' channels closed, the constructor tasks in flight done
            i0, ti = sum(me.cpu_times()[:2]), time.perf_counter()
            time.sleep(idle_seconds)
            idle = (sum(me.cpu_times()[:2]) - i0) * 1e3 / (time.perf_counter() - ti)
    steps = c1 - c0
    control_s = (cpu1 - cpu0) - (p1 - p0)
    return {
        "dp": dp,
        "replicas": replicas,
        "fetch": fetch,
        "batch_steps": batch_steps,
        "steps": steps,
        "steps_per_s": round(steps / (t1 - t0), 2),
        "cpu_ms_per_step_rank": round((cpu1 - cpu0) * 1e3 / max(1, steps * dp), 4),
        "cpu_ms_per_step": round((cpu1 - cpu0) * 1e3 / max(1, steps), 2),
        "control_ms_per_step_host": round(control_s * 1e3 / max(1, steps * len(hosts)), 4),
        "planner_ms_per_1m_tokens": round((p1 - p0) * 1e3 / max(1e-9, (tok1 - tok0) / 1e6), 3),
        "balancer_process_ms_per_1m_tokens": (
            round((b1 - b0) * 1e3 / max(1e-9, (tok1 - tok0) / 1e6), 3) if b0 is not None and b1 is not None else None
        ),
        "loop_block_max_ms": loop["block_max_ms"],
        "loop_block_p99_ms": loop["block_p99_ms"],
        "idle_cpu_ms_per_s": None if idle is None else round(idle, 1),
        "consumer_processes": len(ps),
        "connections": len(hosts),
        "consumers": consumers,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dp", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank and step (one micro-batch)")
    ap.add_argument("--procs", type=int, default=8, help="consumer processes the simulated hosts are spread over")
    ap.add_argument("--ranks-per-host", type=int, default=8, help="ranks per simulated host (one connection each)")
    ap.add_argument(
        "--consumers",
        choices=["lean", "rankstream"],
        default="lean",
        help="lean: asyncio stand-ins (fetch and ack, no decoding); "
        "rankstream: a RankStream per rank, a thread per host",
    )
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument(
        "--idle-seconds",
        type=float,
        default=5.0,
        help="the service's CPU measured this long once the consumers stop (0: not)",
    )
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=16, help="the plan's prefetch_steps")
    ap.add_argument("--batch-steps", type=int, default=None, help="steps per chunk (default: half of prefetch)")
    ap.add_argument("--data", default="demo-data")
    ap.add_argument("--no-baseline", action="store_true", help="skip the per-step baseline row")
    ap.add_argument("--replicas", type=int, default=1, help="consumers per rank (tensor-parallel replicas)")
    ap.add_argument("--no-fetch", action="store_true", help="consumers fetch no payload (descriptors and acks only)")
    ap.add_argument(
        "--hosts-rows",
        action="store_true",
        help="dp 1,024 / 4,096 / 16,384 with 8 ranks per host, and dp/8 ranks of 8 tp replicas "
        "(payload-free above dp 1,024); no baseline",
    )
    ap.add_argument(
        "--balancer",
        choices=["auto", "thread", "process"],
        default="auto",
        help="where the service places windows: its planner thread, the balancer's process, or by step size",
    )
    args = ap.parse_args(argv)
    from overlord_dask.planner.policies import balancer_process

    os.environ[balancer_process.ENV] = {"auto": "", "thread": "0", "process": "1"}[args.balancer]

    from overlord_dask.service.demo import generate_demo_corpus
    from overlord_dask.service.deploy import local_cluster

    if not os.path.exists(os.path.join(args.data, "CORPUS.json")):  # an existing corpus (any scale) is used as it is
        generate_demo_corpus(args.data)
    rows = []
    with local_cluster(n_workers=args.workers) as cluster:
        if args.hosts_rows:
            for gpus in (1024, 4096, 16384):
                for tp in (1, 8):
                    dp, per_host = gpus // tp, 8 // tp  # 8 GPUs (consumers) per host
                    row = measure(
                        cluster,
                        args.data,
                        dp,
                        args.tokens * tp,  # the same tokens per GPU: a tp group shares its rank's batch
                        args.procs,
                        args.seconds,
                        args.warmup_steps,
                        args.batch_steps or args.prefetch // 2,
                        args.prefetch,
                        per_host,
                        "lean",
                        replicas=tp,
                        fetch=gpus <= 1024,
                        idle_seconds=args.idle_seconds,
                    )
                    rows.append({**row, "gpus": gpus, "row": f"{gpus} GPUs, " + (f"tp {tp}" if tp > 1 else "no tp")})
            args.dp, args.no_baseline = [], True
        if not args.no_baseline:
            base = measure(
                cluster,
                args.data,
                min(args.dp),
                args.tokens,
                args.procs,
                args.seconds,
                args.warmup_steps,
                1,
                args.prefetch,
                args.ranks_per_host,
                args.consumers,
                idle_seconds=args.idle_seconds,
            )
            rows.append({**base, "row": "baseline: one step per chunk"})
        for dp in args.dp:
            rows.append(
                {
                    **measure(
                        cluster,
                        args.data,
                        dp,
                        args.tokens,
                        args.procs,
                        args.seconds,
                        args.warmup_steps,
                        args.batch_steps or args.prefetch // 2,
                        args.prefetch,
                        args.ranks_per_host,
                        args.consumers,
                        replicas=args.replicas,
                        fetch=not args.no_fetch,
                        idle_seconds=args.idle_seconds,
                    ),
                    "row": "chunked",
                }
            )
    out = {
        "benchmark": "control_plane",
        "cores": os.cpu_count(),
        "workers": args.workers,
        "tokens_per_rank_step": args.tokens,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print_rows(
            rows,
            [
                "row",
                "dp",
                "replicas",
                "fetch",
                "batch_steps",
                "connections",
                "steps_per_s",
                "cpu_ms_per_step_rank",
                "cpu_ms_per_step",
                "control_ms_per_step_host",
                "planner_ms_per_1m_tokens",
                "loop_block_max_ms",
                "loop_block_p99_ms",
                "idle_cpu_ms_per_s",
            ],
        )
    return out


if __name__ == "__main__":
    main()
