"""The run's ``overlord_*`` metrics on Dask's own Prometheus endpoint (``/metrics``).

A collector registered once per process with ``prometheus_client``'s default registry (which
Dask's ``/metrics`` serves) reads, at scrape time, the snapshot of whichever planner runs on the
scheduler now (``dashboard.snapshot``): a scrape never touches the planner's state.
"""

from __future__ import annotations

from .dashboard import PLUGIN
from .figures import MIX_WINDOW

_COLLECTOR = None  # the process's one Prometheus collector (finds the live planner at scrape time)


def install(scheduler) -> None:
    """Register the Overlord gauges with ``prometheus_client`` (Dask's ``/metrics`` serves its
    default registry); the collector reads whichever planner runs on ``scheduler`` now."""
    global _COLLECTOR
    try:
        import prometheus_client
    except ImportError:  # Dask's /metrics itself says how to get it
        return
    if _COLLECTOR is None:
        _COLLECTOR = _Collector()
        prometheus_client.REGISTRY.register(_COLLECTOR)
    _COLLECTOR.scheduler = scheduler


class _Collector:
    scheduler = None

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        plugin = self.scheduler.plugins.get(PLUGIN) if self.scheduler is not None else None
        snap = getattr(plugin, "observed", None)
        if snap is None:
            return
        run = [snap["run_id"]]

        def gauge(name: str, doc: str, value, labels: dict | None = None):
            g = GaugeMetricFamily(f"overlord_{name}", doc, labels=["run", *(labels or {})])
            if value is not None:
                g.add_metric(run + [str(v) for v in (labels or {}).values()], float(value))
            return g

        yield gauge("steps_planned", "Steps planned (handed out or about to be)", snap["planned"])
        yield gauge("steps_committed", "Steps every rank consumed", snap["committed"])
        yield gauge("steps_durable", "Steps a snapshot can resume from", snap["durable"])
        for name, key in (("imbalance", "imbalance"), ("mb_imbalance", "mb_imbalance"), ("mix_error", "mix_error")):
            yield gauge(name, f"{key} over the last {MIX_WINDOW} committed steps", snap[key])
        lag = GaugeMetricFamily("overlord_rank_lag_steps", "Steps a rank is behind the most advanced one", labels=["run", "rank"])
        for r, v in enumerate(snap["rank_lag"]):
            lag.add_metric(run + [str(r)], v)
        yield lag
        wait = GaugeMetricFamily("overlord_rank_wait_share", "Share of a rank's time spent waiting for data (its own count)",
                                 labels=["run", "rank"])
        for r, v in snap.get("rank_wait_share", {}).items():
            wait.add_metric(run + [r], v)
        yield wait
        per_source = {"source_weight": ("weight", "Declared weight now"),
                      "source_delivered_share": ("delivered_share", f"Delivered token share over the last {MIX_WINDOW} steps"),
                      "source_loads_pending": ("loads_pending", "Load tasks asked for and not reported yet (backlog)"),
                      "source_seconds_per_token": ("seconds_per_token", "Measured CPU seconds of loading per token")}
        for metric, (key, doc) in per_source.items():
            g = GaugeMetricFamily(f"overlord_{metric}", doc, labels=["run", "source"])
            for s in snap["sources"]:
                if s[key] is not None:
                    g.add_metric(run + [s["source"]], float(s[key]))
            yield g
        pools = GaugeMetricFamily("overlord_pool_workers", "Workers of each loader pool", labels=["run", "pool"])
        for p, n in snap["arrived"].items():
            pools.add_metric(run + [p], n)
        yield pools
        yield gauge("loop_block_max_ms", "Longest event-loop block of the scheduler", snap["loop"].get("block_max_ms"))
        last = snap["last_snapshot"]
        yield gauge("snapshot_committed", "Committed step of the last snapshot written", last["committed"] if last else None)
