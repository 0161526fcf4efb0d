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


TOP_RANKS = 8
"""Per-rank series only for this many ranks (the most behind, the longest waiting): with
thousands of ranks a series per rank would swamp Prometheus; summaries cover the rest."""


class _Collector:
    scheduler = None

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        plugin = self.scheduler.plugins.get(PLUGIN) if self.scheduler is not None else None
        snap = getattr(plugin, "observed", None)
        if snap is None:
            return
        run = [snap["run_id"]]

        def family(kind, name: str, doc: str, value=None, labels: dict | None = None):
            g = kind(f"overlord_{name}", doc, labels=["run", *(labels or {})])
            if value is not None:
                g.add_metric(run + [str(v) for v in (labels or {}).values()], float(value))
            return g

        # monotonic figures are counters (rate() works on them; a rewound run shows as a counter reset)
        yield family(CounterMetricFamily, "steps_planned", "Steps planned (handed out or about to be)", snap["planned"])
        yield family(CounterMetricFamily, "steps_committed", "Steps every rank consumed", snap["committed"])
        yield family(CounterMetricFamily, "steps_durable", "Steps a snapshot can resume from", snap["durable"])
        yield family(
            CounterMetricFamily,
            "tokens_committed",
            "Real (not padding) tokens of the steps every rank consumed, since this service started",
            snap["tokens_committed"],
        )
        yield family(
            CounterMetricFamily,
            "acks",
            "Acknowledgements received from trainers",
            snap.get("counters", {}).get("acks", 0),
        )
        for name, key in (("imbalance", "imbalance"), ("mb_imbalance", "mb_imbalance"), ("mix_error", "mix_error")):
            yield family(GaugeMetricFamily, name, f"{key} over the last {MIX_WINDOW} committed steps", snap[key])
        yield from _timings(snap, run, HistogramMetricFamily)
        yield from _feedback(snap.get("feedback") or {}, run, GaugeMetricFamily, CounterMetricFamily)
        yield from _ranks(snap, run, GaugeMetricFamily)
        per_source = {
            "source_weight": ("weight", "Weight in force now (declared, or set by the mixing controller)"),
            "source_delivered_share": ("delivered_share", f"Delivered token share over the last {MIX_WINDOW} steps"),
            "source_loads_pending": ("loads_pending", "Load tasks asked for and not reported yet (backlog)"),
            "source_seconds_per_token": ("seconds_per_token", "Measured CPU seconds of loading per token"),
        }
        for metric, (key, doc) in per_source.items():
            g = GaugeMetricFamily(f"overlord_{metric}", doc, labels=["run", "source"])
            for s in snap["sources"]:
                if s[key] is not None:
                    g.add_metric(run + [s["source"]], float(s[key]))
            yield g
        for metric, (key, doc) in {
            "source_records_read": ("records_read", "Records read by load tasks"),
            "source_records_dropped": ("records_dropped", "Records prepare steps or on_bad_record dropped"),
            "source_units_quarantined": ("units_quarantined", "Load units quarantined as corrupt"),
        }.items():
            c = CounterMetricFamily(f"overlord_{metric}", doc, labels=["run", "source"])
            for s in snap["sources"]:
                c.add_metric(run + [s["source"]], float(s[key]))
            yield c
        yield family(GaugeMetricFamily, "workers", "Workers on the scheduler (every pool)", len(self.scheduler.workers))
        pools = GaugeMetricFamily("overlord_pool_workers", "Workers of each loader pool", labels=["run", "pool"])
        for p, n in snap["arrived"].items():
            pools.add_metric(run + [p], n)
        yield pools
        yield family(
            GaugeMetricFamily,
            "loop_block_max_ms",
            "Longest event-loop block of the scheduler",
            snap["loop"].get("block_max_ms"),
        )
        last = snap["last_snapshot"]
        yield family(
            GaugeMetricFamily,
            "snapshot_committed",
            "Committed step of the last snapshot written",
            last["committed"] if last else None,
        )


def _feedback(fb: dict, run: list, gauge, counter):
    """What the trainers reported and what the planner made of it (``planner/feedback.py``)."""
    c = counter("overlord_feedback_reports", "Step reports (times, metrics) received from trainers", labels=["run"])
    c.add_metric(run, float(fb.get("received", 0)))
    yield c
    g = gauge(
        "overlord_measured_imbalance",
        "Measured step-time imbalance (max / mean over ranks), median of the last 100 reported steps",
        labels=["run"],
    )
    if fb.get("measured_imbalance_p50") is not None:
        g.add_metric(run, float(fb["measured_imbalance_p50"]))
    yield g
    d = counter("overlord_decisions", "Decisions the planner took from the trainers' reports", labels=["run", "kind"])
    for kind in ("cost", "weights"):
        d.add_metric(run + [kind], float(fb.get("decision_counts", {}).get(kind, 0)))
    yield d
    cf = fb.get("cost_fit") or {}
    coef = gauge(
        "overlord_cost_coefficient",
        "Cost model coefficients in seconds per unit (declared at its best scale, fitted)",
        labels=["run", "model", "term"],
    )
    err = gauge(
        "overlord_cost_error",
        "Median relative error of the cost model's step-time predictions",
        labels=["run", "model"],
    )
    for model in ("declared", "fitted"):
        for term, v in (cf.get(model) or {}).items():
            coef.add_metric(run + [model, term], float(v))
        e = cf.get(f"error_{model}")
        if e is not None and e == e:
            err.add_metric(run + [model], float(e))
    yield coef
    yield err


def _timings(snap: dict, run: list, kind):
    for name, doc in (
        ("trainer_wait_seconds", "A trainer's wait for data per step (averaged over each acknowledgement interval)"),
        ("step_seconds", "Wall time per committed step (every rank done)"),
    ):
        h = snap.get("timings", {}).get(name)
        if h is None:
            continue
        fam = kind(f"overlord_{name}", doc, labels=["run"])
        fam.add_metric(run, [(str(le), float(c)) for le, c in h["buckets"]], sum_value=h["sum"])
        yield fam


def _ranks(snap: dict, run: list, kind):
    """Per-rank lag and wait share of the :data:`TOP_RANKS` worst ranks, and summaries of all."""
    lag = list(enumerate(snap["rank_lag"]))
    waits = list(snap.get("rank_wait_share", {}).items())
    for name, values, doc in (
        ("rank_lag_steps", lag, "Steps a rank is behind the most advanced one"),
        ("rank_wait_share", waits, "Share of a rank's time spent waiting for data (its own count)"),
    ):
        g = kind(f"overlord_{name}", f"{doc}; the {TOP_RANKS} worst ranks", labels=["run", "rank"])
        for r, v in sorted(values, key=lambda rv: -rv[1])[:TOP_RANKS]:
            g.add_metric(run + [str(r)], float(v))
        yield g
        vs = [float(v) for _, v in values]
        for stat, fn in (("max", max), ("mean", lambda x: sum(x) / len(x))):
            s = kind(f"overlord_{name}_{stat}", f"{doc}: {stat} over all ranks", labels=["run"])
            if vs:
                s.add_metric(run, fn(vs))
            yield s
