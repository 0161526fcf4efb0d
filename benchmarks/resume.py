"""Resume benchmark: snapshot cost and exactness at 100 sources and 10,000 load units.

    python benchmarks/resume.py            # readable table
    python benchmarks/resume.py --json     # one JSON object

Part 1 (planner + snapshot store, local folder): an uninterrupted run of ``--steps`` steps is
the reference; a second run writes a snapshot on every committed step with the service's own
``SnapshotWriter`` (a base every ``--base-every`` steps, else a delta that carries the window
state when planning moved to a new window), "crashes" at a seeded random step,
restores from storage (load + rebuild + replay to the committed step) and runs to the end.
``identical`` says whether the combined stream equals the reference step for step.

Part 2 (the real service, demo corpus, 4 trainer processes): consumer wait p99 with and without
snapshots, measured in the same run, to show snapshots add no wait on the trainers' path.

Part 3 (the real service): time to the first batch after a restart from a snapshot, next to a
cold start in the same run (both include starting a LocalCluster of worker processes).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import msgpack
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from output import emit  # noqa: E402  (benchmarks/output.py)

from overlord_dask.observe.figures import exactly_once  # noqa: E402
from overlord_dask.plan import plan_from_dict  # noqa: E402
from overlord_dask.planner.state import PlannerState  # noqa: E402
from overlord_dask.planner.streams.order import stable_seed  # noqa: E402
from overlord_dask.snapshots import SnapshotStore, SnapshotWriter  # noqa: E402

N_SOURCES, UNITS_PER_SOURCE, DOCS_PER_UNIT = 100, 100, 256


def make_plan(seed: int):
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.ones(N_SOURCES))
    return plan_from_dict(
        {
            "name": "resume-bench",
            "seed": seed,
            "sources": [
                {"name": f"src{i:03d}", "format": "zarr", "url": f"s{i}.zarr", "weight": float(w)}
                for i, w in enumerate(weights)
            ],
            "topology": {"dp": 8, "micro_batches": 4, "tokens_per_micro_batch": 32_768},
            "loading": {"prefetch_steps": 20, "units_ahead": 4},
        }
    )


FIRST_IDS = {f"src{i:03d}": list(range(0, UNITS_PER_SOURCE * DOCS_PER_UNIT, DOCS_PER_UNIT)) for i in range(N_SOURCES)}


def lengths(name: str, unit: int) -> np.ndarray:
    """Deterministic per unit, like reading the same file again after a restart."""
    rng = np.random.default_rng(stable_seed("bench", name, unit))
    return np.clip(rng.lognormal(6.0, 1.2, DOCS_PER_UNIT), 8, 32_768).astype(np.int64)


def feed(state: PlannerState) -> None:
    for name, epoch, unit in state.wanted():
        state.add_lengths(name, epoch, unit, lengths(name, unit))


def step_ids(state: PlannerState, step: int) -> np.ndarray:
    e = state.ledger[step]
    p = e["pieces"]
    return np.stack([p[:, 0], p[:, 1], state.streams.sample_ids(p), p[:, 4], e["slot"][:, 0], e["slot"][:, 1]], axis=1)


def run(state: PlannerState, until: int, on_commit=None) -> dict[int, np.ndarray]:
    out = {}
    while state.next_step < until:
        feed(state)
        planned, _ = state.plan_steps(until - state.next_step)
        for p in planned:
            out[p["step"]] = step_ids(state, p["step"])
            for r in range(state.topology.dp):
                state.ack(r, p["step"])
            if on_commit:
                on_commit(state)
    return out


def part1(steps: int, seed: int, base_every: int = 50) -> dict:
    plan = make_plan(seed)
    reference = run(PlannerState(plan, FIRST_IDS), steps)
    crash = int(np.random.default_rng(seed).integers(steps // 3, 2 * steps // 3))
    with tempfile.TemporaryDirectory() as tmp:
        store = SnapshotStore(os.path.join(tmp, "ck"))
        writer = SnapshotWriter(store, base_every_steps=base_every)  # the plugin's policy
        stats = {"delta_bytes": [], "base_bytes": [], "encode_ms": [], "snapshot_ms": []}

        def snapshot(state: PlannerState) -> None:  # what the plugin does on each newly committed step
            t0 = time.perf_counter()
            st = state.get_state()
            msgpack.packb(st, use_bin_type=True)
            stats["encode_ms"].append(1e3 * (time.perf_counter() - t0))
            kind, n = writer.write(st)
            stats[f"{kind}_bytes"].append(n)
            stats["snapshot_ms"].append(1e3 * (time.perf_counter() - t0))

        before = run(PlannerState(plan, FIRST_IDS), crash, on_commit=snapshot)
        # restore: load the snapshot chain, rebuild the planner, replay to the committed step; the
        # restore time ends when the first step is handed out again (lengths come from the files)
        t0 = time.perf_counter()
        loaded, _ = store.load()
        resumed = PlannerState(plan, FIRST_IDS, state=loaded)
        first_out = []
        after = run(resumed, steps, on_commit=lambda st: first_out or first_out.append(time.perf_counter()))
        restore_s = first_out[0] - t0
    combined = {**before, **after}
    identical = sorted(combined) == sorted(reference) and all(
        np.array_equal(combined[s], reference[s]) for s in reference
    )
    planned = [reference[s][:, :4] for s in sorted(reference)]
    delivered = [combined[s][:, :4] for s in sorted(combined)]
    duplicates, missing = exactly_once(planned, delivered)
    q = lambda a, x: round(float(np.percentile(a, x)), 3) if len(a) else None  # noqa: E731
    return {
        "sources": N_SOURCES,
        "load_units": N_SOURCES * UNITS_PER_SOURCE,
        "steps": steps,
        "crash_at_step": crash,
        "identical": bool(identical),
        "duplicates": duplicates,
        "missing": missing,
        "delta_bytes_p50": q(stats["delta_bytes"], 50),
        "delta_bytes_max": max(stats["delta_bytes"]),
        "base_every_steps": base_every,
        "base_bytes": q(stats["base_bytes"], 50),
        "base_bytes_max": max(stats["base_bytes"]),
        "encode_ms_p50": q(stats["encode_ms"], 50),
        "snapshot_ms_p50": q(stats["snapshot_ms"], 50),
        "snapshot_ms_p99": q(stats["snapshot_ms"], 99),
        "restore_s": round(restore_s, 3),
    }


def part2(steps: int, data: str) -> dict:
    """Consumer wait p99 of the real service, without and with snapshots, in the same run."""
    import yaml

    from overlord_dask.service.cli import run_demo
    from overlord_dask.service.demo import PLAN_FILE, generate_demo_corpus

    corpus = generate_demo_corpus(data)  # the demo corpus, shared with `overlord demo`
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, ck in (("without", None), ("with", os.path.join(tmp, "ck"))):
            plan = yaml.safe_load(PLAN_FILE.read_text())
            for s in plan["sources"]:
                s["url"] = os.path.join(os.path.abspath(corpus), s["url"])
            if ck:
                plan["checkpoint"] = {"url": ck}
            path = os.path.join(tmp, f"plan-{label}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(plan, f)
            res = run_demo(steps=steps, plan_path=path, quiet=True)
            out[f"wait_p50_ms_{label}_snapshots"] = res["wait_p50_ms"]
            out[f"wait_p99_ms_{label}_snapshots"] = res["wait_p99_ms"]
            out[f"duplicates_{label}_snapshots"] = res["duplicates"]
    out["wait_p99_ratio"] = round(out["wait_p99_ms_with_snapshots"] / out["wait_p99_ms_without_snapshots"], 3)
    return out


def part3(data: str, steps: int = 30) -> dict:
    """Service-level restart: time from ``Service.start`` to the first batch on a trainer, for a
    cold start and for a restart from the snapshot of a run that committed ``steps`` steps
    (both on a new LocalCluster of 2 worker processes, so cluster start-up counts)."""
    from overlord_dask import Service, connect
    from overlord_dask.service.demo import demo_plan, generate_demo_corpus

    corpus = generate_demo_corpus(data)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        plan = demo_plan(corpus, checkpoint={"url": os.path.join(tmp, "ck")})

        def first_batch(consume: int) -> float:
            t0 = time.perf_counter()
            with Service.start(plan, n_workers=2) as service:
                streams = [connect(service.address, r) for r in range(plan.topology.dp)]
                first = None
                for _ in range(max(consume, 1)):
                    for s in streams:
                        s.next_batch()
                        first = first or time.perf_counter() - t0
                for s in streams:
                    s.commit()
                    s.close()
                if consume:
                    service.wait_for_step(service.status()["committed"], timeout=60)
            return first

        out["service_cold_start_s"] = round(first_batch(steps), 3)  # also leaves a snapshot at `steps`
        out["service_restore_s"] = round(first_batch(0), 3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-every", type=int, default=50, help="committed steps between base snapshots")
    ap.add_argument("--service-steps", type=int, default=60, help="steps for the consumer-wait comparison (0: skip)")
    ap.add_argument("--data", default="demo-data")
    args = ap.parse_args(argv)
    out = part1(args.steps, args.seed, args.base_every)
    if args.service_steps:
        out.update(part2(args.service_steps, args.data))
        out.update(part3(args.data))
    emit(out, args.json)
    return out


if __name__ == "__main__":
    main()
