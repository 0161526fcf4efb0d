"""Per-source pools and the autoscaler: the sizing policy on signals, the cluster specs (local and
Slurm), and a real service whose photo source's pool grows before its curriculum stage."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from distributed.diagnostics.plugin import SchedulerPlugin

from overlord_dask import Service
from overlord_dask.loading.autoscale import PoolPolicy
from overlord_dask.loading.pools import PoolSpec, plan_pools, pool_of, pool_resource, worker_spec
from overlord_dask.plan import Autoscale, plan_from_dict

from .harness import consume

ROOT = Path(__file__).resolve().parents[1]


def _signals(rate=10.0, weights=None, cost=None, starved_on=None, steps_ready=8, pending=None):
    weights = weights or {"text": (0.9, 0.9), "photos": (0.1, 0.1)}
    cost = cost or {"text": 2e-8, "photos": 8e-6}
    return {
        "committed": 100,
        "next_step": 108,
        "steps_per_s": rate,
        "steps_per_s_peak": rate,
        "horizon_steps": 100,
        "step_tokens": 16384,
        "starved_on": starved_on,
        "steps_ready": steps_ready,
        "prefetch_steps": 8,
        "sources": {
            s: {
                "pool": s,
                "weight": w,
                "weight_ahead": wa,
                "seconds_per_token": cost.get(s),
                "block_bytes": 1e6,
                "loads": 3,
                "loads_pending": (pending or {}).get(s, 0),
                "tokens_ready": 0,
            }
            for s, (w, wa) in weights.items()
        },
    }


def _policy(**cfg):
    pools = {"text": PoolSpec("text", ("text",)), "photos": PoolSpec("photos", ("photos",))}
    return PoolPolicy(pools, Autoscale(enabled=True, **{"down_after": 3, **cfg}))


def test_a_pool_grows_before_its_stage_and_shrinks_only_after_it():
    policy = _policy()
    # photos at 10% now, 60% in the schedule ahead: 10 steps/s × 16384 × 0.6 × 8 µs = 0.79 cores, × 1.5 headroom
    d = policy.decide(
        _signals(weights={"text": (0.9, 0.9), "photos": (0.1, 0.6)}), {"text": 1, "photos": 1}, {"text": 1, "photos": 1}
    )
    assert d["photos"].target == 2 and d["text"].target == 1
    assert d["photos"].demand_cores == pytest.approx(10 * 16384 * 0.6 * 8e-6)
    assert "demand 0.79 cores" in d["photos"].reason
    # the stage is over: demand falls, but the pool shrinks only after `down_after` decisions in a row
    low = _signals(weights={"text": (0.9, 0.9), "photos": (0.1, 0.1)})
    targets = [policy.decide(low, {"text": 1, "photos": 2}, {"text": 1, "photos": 2})["photos"] for _ in range(3)]
    assert [t.target for t in targets] == [2, 2, 1]
    assert "shrink to 1 after 2 more" in targets[0].reason
    # a decision that wants the pool again resets the count
    policy.decide(low, {"text": 1, "photos": 2}, {"text": 1, "photos": 2})
    policy.decide(
        _signals(weights={"text": (0.4, 0.4), "photos": (0.6, 0.6)}), {"text": 1, "photos": 2}, {"text": 1, "photos": 2}
    )
    assert policy.decide(low, {"text": 1, "photos": 2}, {"text": 1, "photos": 2})["photos"].target == 2


def test_a_starving_pool_grows_one_worker_at_a_time_and_never_shrinks_meanwhile():
    policy = _policy(down_after=1)
    sig = _signals(rate=1.0, starved_on="photos", steps_ready=0)  # a low rate: demand alone says 1
    assert policy.decide(sig, {"text": 1, "photos": 2}, {"text": 1, "photos": 2})["photos"].target == 3
    # the worker asked for last time has not arrived: no second one on top
    assert policy.decide(sig, {"text": 1, "photos": 3}, {"text": 1, "photos": 2})["photos"].target == 3
    # at the start (no step consumed yet) waiting for the first loads is not starvation
    assert (
        policy.decide(
            _signals(rate=0.0, starved_on="photos", steps_ready=0), {"text": 1, "photos": 1}, {"text": 1, "photos": 1}
        )["photos"].target
        == 1
    )
    # starving no more, demand says 1: the worker grown for it is still starting, so no shrink yet
    calm = _signals(rate=1.0)
    d = policy.decide(calm, {"text": 1, "photos": 3}, {"text": 1, "photos": 2})["photos"]
    assert d.target == 3 and "still starting" in d.reason
    assert (
        policy.decide(calm, {"text": 1, "photos": 3}, {"text": 1, "photos": 3})["photos"].target < 3
    )  # arrived: it may shrink
    # a pool out of the mix is released even while its workers start
    d = policy.decide(
        _signals(weights={"text": (1.0, 1.0), "photos": (0.0, 0.0)}), {"text": 1, "photos": 3}, {"text": 1, "photos": 2}
    )["photos"]
    assert d.target < 3 and "no weight" in d.reason


def test_a_pool_holds_its_blocks_in_flight_in_half_its_memory():
    sig = _signals()
    sig["sources"]["photos"].update(blocks_held=12, block_bytes=512 * 2**20)  # 6 GiB of blocks loaded or on their way
    d = _policy().decide(sig, {"text": 1, "photos": 1}, {"text": 1, "photos": 1}, memory={"photos": 4 * 2**30})
    assert d["photos"].target == 3 and d["photos"].reason == "blocks in flight (6144 MiB) need 3 workers of 4.0 GiB"
    assert (
        _policy().decide(sig, {"text": 1, "photos": 1}, {"text": 1, "photos": 1})["photos"].target == 1
    )  # limit unknown


def test_pools_without_weight_ahead_are_released_and_the_budget_caps_the_rest():
    policy = _policy(down_after=1, max_workers=3)
    d = policy.decide(
        _signals(rate=40.0, weights={"text": (0.0, 0.0), "photos": (1.0, 1.0)}),
        {"text": 1, "photos": 1},
        {"text": 1, "photos": 1},
    )
    assert d["text"].target == 1  # its minimum (min_workers=1) even without weight
    assert d["photos"].target == 2 and "capped by max_workers=3" in d["photos"].reason
    released = PoolPolicy({"text": PoolSpec("text", ("text",), min_workers=0)}, Autoscale(enabled=True, down_after=1))
    d = released.decide(_signals(weights={"text": (0.0, 0.0)}), {"text": 2}, {"text": 2})
    assert d["text"].target == 0 and d["text"].reason == "no weight over the schedule ahead"
    # a source whose cost is not measured yet keeps what it has (and gets at least one worker)
    d = _policy().decide(_signals(cost={"text": 2e-8}), {"text": 1, "photos": 0}, {"text": 1, "photos": 0})
    assert d["photos"].target == 1 and "no load cost measured yet" in d["photos"].reason


@pytest.mark.integration
def test_pool_specs_pin_by_resource_on_local_and_slurm_clusters():
    from overlord_dask.service.deploy import local_cluster, slurm_cluster

    spec = PoolSpec("photos", ("photos",), cores=2, memory="3GB")
    with local_cluster(n_workers=0) as lc:
        opts = worker_spec(lc, spec)["options"]
        assert (
            opts["resources"] == {pool_resource("photos"): 2}
            and opts["nthreads"] == 2
            and opts["memory_limit"] == "3GB"
        )
    sc = slurm_cluster(cores=8, memory="32GB")
    try:
        entry = worker_spec(sc, spec)
        job = entry["cls"](scheduler=sc.scheduler_address, name="overlord-pool-photos-0", **entry["options"])
        script = job.job_script()
        assert "--resources overlord-pool-photos=2" in script and "--nthreads 2" in script
        assert "--lifetime" in script  # the deployment's own arguments stay
    finally:
        sc.close()
    assert (
        pool_of("overlord-pool-photos-12") == "photos"
        and pool_of(3) is None
        and pool_of("overlord-pool-a-b-1") == "a-b"
    )


def test_plan_pools_merge_sources_that_share_one():
    plan = plan_from_dict(
        {
            "sources": [
                {"name": "a", "format": "zarr", "url": "a.zarr", "pool": {"name": "text", "cores": 2}},
                {"name": "b", "format": "zarr", "url": "b.zarr", "pool": {"name": "text", "cores": 2}},
                {"name": "c", "format": "zarr", "url": "c.zarr", "pool": {"workers": 3}},
            ],
            "topology": {"dp": 1, "tokens_per_micro_batch": 1024},
        }
    )
    pools = plan_pools(plan)
    assert pools["text"].sources == ("a", "b") and pools["text"].cores == 2 and pools["c"].fixed == 3
    assert pools["c"].clamp(10) == 3 and pools["text"].clamp(0) == 1


class _WhereLoadsRan(SchedulerPlugin):
    """Records the worker name each load task finished on (scheduler side, processing → memory)."""

    name = "test-where-loads-ran"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.ran: dict[str, str] = {}

    def transition(self, key, start, finish, *args, **kwargs):
        if (
            start == "processing"
            and finish == "memory"
            and str(key).startswith("overlord-load-")
            and "worker" in kwargs
        ):
            ws = self.scheduler.workers.get(kwargs["worker"])
            self.ran[str(key)] = str(ws.name) if ws is not None else "?"


def _photos_plan(corpus, autoscale: bool, steps: int = 40):
    d = yaml.safe_load((ROOT / "pipelines" / "photos.yaml").read_text())
    for s in d["sources"]:
        s["url"] = s["url"].replace("../demo-data/", f"{Path(corpus).resolve()}/")
        if not autoscale:
            s.pop("pool", None)
    d["topology"]["tokens_per_micro_batch"] = 2048
    d["stages"][1]["start_step"] = steps // 2
    d["loading"]["unit_rows"] = 50
    # a big headroom: the test's small steps need a fraction of a core, and the pool must visibly grow
    d["loading"]["autoscale"] = {
        "enabled": autoscale,
        "max_workers": 5,
        "interval_s": 0.2,
        "lead_s": 30.0,
        "headroom": 16.0,
    }
    return plan_from_dict(d, where="pipelines/photos.yaml")


def _consume(service, dp: int, steps: int, compute_s: float = 0.0) -> dict:
    """What each (rank, step) receives (``harness.consume``), each step computing ``compute_s``."""
    return consume(service.address, range(dp), steps=steps, on_batch=lambda r, b: time.sleep(compute_s)).ids


@pytest.mark.integration
def test_autoscaled_pools_load_each_source_on_its_own_workers_and_keep_the_stream(corpus, cluster):
    from overlord_dask.service.deploy import local_cluster

    steps = 60
    with Service.start(_photos_plan(corpus, autoscale=False, steps=steps), cluster=cluster) as plain:
        reference = _consume(plain, 2, steps)
    with local_cluster(n_workers=0) as lc:
        recorder = _WhereLoadsRan(lc.scheduler)
        lc.scheduler.add_plugin(recorder)
        with Service.start(_photos_plan(corpus, autoscale=True, steps=steps), cluster=lc) as service:
            got = _consume(service, 2, steps, compute_s=0.05)  # trainers that compute: a step rate to size pools by
            rows = {r["pool"]: r for r in service.pools()}
            history = service.scaling_history()
            metrics = service.metrics()
    assert got == reference  # pools and scaling change where loads run, never what is delivered
    assert set(rows) == {"web", "chat", "photos"} and rows["photos"]["sources"] == ["photos"]
    # the autoscaler asked for a second photo worker; when it arrives is how fast this machine
    # starts a worker process (a busy CI machine may end the run first)
    asked = max(h["to"] or 0 for h in history if h["pool"] == "photos") if history else 0
    assert asked >= 2 and rows["photos"]["seconds_per_token"]["photos"] > 0, (history, rows)
    assert (
        rows["photos"]["target"] >= 1 and rows["photos"]["reason"]
    )  # (its last decision, after the run: may already shrink)
    # the photo pool grew, for the demand the planner signalled; whether that came before the stage
    # change depends on how fast this machine runs the trainers and measures the photos' first
    # loads (CI saw step 32 of 60 once): the lead is measured by benchmarks/autoscale.py
    grew = [h for h in history if h["pool"] == "photos" and h["delta"] > 0]
    assert grew, (history, rows)
    assert "demand" in grew[0]["reason"] or "waits on" in grew[0]["reason"]
    ran = recorder.ran
    assert ran and all(pool_of(w) == key.split("-")[4] for key, w in ran.items()), (
        ran
    )  # overlord-load-<run>-<source>-...
    assert {pool_of(w) for w in ran.values()} == {"web", "chat", "photos"}
    assert metrics and all("pool_workers" in m for m in metrics[-5:])


@pytest.mark.integration
def test_the_stream_does_not_depend_on_how_loading_is_cut(corpus, cluster):
    """Auto-partitioning: one task per unit, units read in many parts (a tiny task_seconds) and
    several units per task (a large one) deliver the same stream."""
    base = _photos_plan(corpus, autoscale=False, steps=40)
    streams, keys = {}, {}
    for name, task_seconds in {"unit": None, "parts": 0.002, "groups": 60.0}.items():
        d = base.model_dump(mode="json")
        d["loading"]["task_seconds"] = task_seconds
        d["loading"]["unit_rows"] = 30  # many small units: groups have something to merge
        recorder = _WhereLoadsRan(cluster.scheduler)
        cluster.scheduler.add_plugin(recorder)
        try:
            with Service.start(plan_from_dict(d), cluster=cluster) as service:
                streams[name] = _consume(service, 2, 40)
        finally:
            cluster.scheduler.remove_plugin(name=recorder.name)
        keys[name] = list(recorder.ran)
    assert streams["parts"] == streams["unit"] and streams["groups"] == streams["unit"]
    assert not any("-p" in k.rsplit("-n", 1)[1] or "-g" in k.rsplit("-n", 1)[1] for k in keys["unit"])
    assert sum("-p" in k.rsplit("-n", 1)[1] for k in keys["parts"]) > 10  # measured units were cut into parts
    # and small ones read together: how many groups form depends on how many units of one source a
    # round asks for once costs are measured, which is timing (CI saw 3 where this machine sees more);
    # the grouping rule itself is pinned by test_partition_cuts_by_measured_cost
    assert sum("-g" in k.rsplit("-n", 1)[1] for k in keys["groups"]) >= 1
    assert len(keys["unit"]) < len(keys["parts"])  # (how many groups form depends on how many units a round asks for)


def test_partition_cuts_by_measured_cost():
    from overlord_dask.loading.partition import partition

    wanted = [["a", 0, u] for u in range(6)] + [["b", 0, 0]]
    docs = lambda s, u: 100  # noqa: E731
    tasks = partition(wanted, docs, {"a": 0.001}, target=1.0)  # 0.1 s per unit: six units in one task
    assert [(t.source, t.units, t.parts) for t in tasks] == [
        ("a", [(0, u) for u in range(6)], None),
        ("b", [(0, 0)], None),
    ]
    (t,) = partition([["a", 1, 3]], docs, {"a": 0.05}, target=1.0)  # 5 s: five parts of 20 documents
    assert t.units == [(1, 3)] and t.parts == [(0, 20), (20, 40), (40, 60), (60, 80), (80, 100)]
    assert all(t.parts is None and len(t.units) == 1 for t in partition(wanted, docs, {"a": 0.05}, target=None))


def test_unit_parts_wait_for_a_chain_that_covers_the_unit():
    import numpy as np

    from overlord_dask.loading.partition import UnitParts

    parts = UnitParts()
    assert parts.add(("a", 0, 1), (5, 10, 10), np.array([5, 6]), None) is None
    assert parts.add(("a", 0, 1), (0, 5, 10), np.array([1, 2, 3]), None)[0].tolist() == [1, 2, 3, 5, 6]
    assert parts.add(("a", 0, 1), (5, 10, 10), np.array([5, 6]), None) is None  # a recomputed part alone: not whole
