"""The reading side of a ``Service``: summary, metrics, ledger, pools, snapshots, and the same as
tables and plots for notebooks (``observe.tables``). Everything reads planner metadata through
the planner's routes; no batch is fetched."""

from __future__ import annotations

from collections import Counter

import numpy as np

from .. import pieces as P
from ..loading.pools import pool_resource, uses_pools
from ..observe.figures import mix_grain, rank_lag, window_figures
from ..observe.tables import (
    DEFAULT_EDGES,
    decisions_table,
    imbalance_table,
    length_table,
    mix_table,
    plot_mix,
    pool_workers_table,
    pools_table,
    scaling_table,
    schedule_table,
    service_html,
)


class ServiceViews:
    """The reading side of ``Service``: what an operator or a notebook looks at (the summary,
    metrics, ledger, pools, snapshots) and the same as tables and plots (``observe.tables``).
    Needs ``self.planner`` (a ``client.BlockingPlannerClient``), ``self.client``, ``self.plan``,
    ``self.run_id``, ``status()`` and ``timeline()``."""

    @property
    def dashboard(self) -> str | None:
        """The run's ``/overlord`` page (on the scheduler's dashboard server), or None if the
        scheduler serves no dashboard."""
        link = self.client.dashboard_link
        return link.rsplit("/", 1)[0] + "/overlord" if link else None

    def summary(self, window: int = 20) -> dict:
        """What an operator looks at (``overlord status``): steps planned and committed, each
        rank's lag behind the most advanced one and share of its time spent waiting for data, imbalance and mix error
        over the last ``window``
        committed steps, the source planning waits on, pools, the last snapshot, the event loop."""
        st, info = self.status(), self.planner.info()
        acked = st["acked"]
        recent = self.metrics(max(0, st["committed"] - window), st["committed"])  # committed steps only
        figures = window_figures(
            recent, len(info["sources"])
        )  # (steps from before a live update that added sources too)
        snaps = self.snapshots()
        return {
            "run_id": info["run_id"],
            "name": info["name"],
            "dp": info["dp"],
            "sources": info["sources"],
            "dashboard": self.dashboard,
            "planned": st["next_step"],
            "committed": st["committed"],
            "durable": st["durable"],
            "tokens_committed": st["tokens_committed"],
            "rank_lag": dict(enumerate(rank_lag(acked))),
            "rank_wait_share": st.get("rank_wait_share", {}),
            **{
                k: None if figures[k] is None else round(figures[k], 4)
                for k in ("imbalance", "mb_imbalance", "mix_error")
            },
            "mix_grain": None
            if (g := mix_grain(recent, info["dp"], self.plan.balance.policy)) is None
            else round(g, 4),
            "starved_on": st["starved_on"],
            "waiting": st.get("waiting"),
            "pools": {p["pool"]: {"workers": p["workers"], "target": p["target"]} for p in self.pools()}
            if uses_pools(self.plan)
            else {},
            "last_snapshot": snaps[-1] if snaps else None,
            "snapshot_error": st["snapshot_error"],
            "loop_block_max_ms": st["loop"]["block_max_ms"],
            "failure": st["failure"],
            "stop_requested": st["stop_requested"],
        }

    def metrics(self, start: int = 0, stop: int | None = None) -> list[dict]:
        """Per planned step: tokens, fill, imbalance (step and micro-batch level), tokens per source."""
        return self.planner.metrics(start, stop)

    def ledger(self, start: int = 0, stop: int | None = None) -> dict[int, dict[str, np.ndarray]]:
        """What was planned per step: pieces ``[source, epoch, unit, doc, start, stop]``, their
        ``(rank, micro_batch)`` slots and source-wide sample ids, and the documents a ``drop``
        policy skipped while planning it (``[source, epoch, sample id, tokens]``)."""
        out = {}
        for e in self.planner.ledger(start, stop):
            out[e["step"]] = {
                "pieces": P.from_bytes(e["pieces"]),
                "slot": np.frombuffer(e["slot"], dtype=np.int32).reshape(-1, 2),
                "sample_ids": np.frombuffer(e["sample_ids"], dtype=np.int64),
                "dropped": np.frombuffer(e["dropped"], dtype=np.int64).reshape(-1, 4),
            }
        return out

    def pools(self) -> list[dict]:
        """One row per loader pool: its sources, workers (requested and arrived), the autoscaler's
        target and reason, demand in cores, measured seconds per token and pending loads of its
        sources. Works from any client (the autoscaler reports its decisions to the planner)."""
        sig = self.planner.pools()
        scaling = sig.get("scaling") or {}
        decisions, arrived = scaling.get("decisions", {}), scaling.get("arrived", {})
        workers = self.client.scheduler_info(n_workers=-1)["workers"].values()
        prefix = pool_resource("")
        have = Counter(res[len(prefix) :] for w in workers for res in w.get("resources", {}) if res.startswith(prefix))
        rows: dict[str, dict] = {}
        for name, src in sig["sources"].items():
            row = rows.setdefault(
                src["pool"],
                {
                    "pool": src["pool"],
                    "sources": [],
                    "workers": have.get(src["pool"], 0),
                    "seconds_per_token": {},
                    "loads_pending": 0,
                    "weight_ahead": 0.0,
                },
            )
            row["sources"].append(name)
            row["seconds_per_token"][name] = src["seconds_per_token"]
            row["loads_pending"] += src["loads_pending"]
            row["weight_ahead"] += src["weight_ahead"]
        for name, row in rows.items():
            d = decisions.get(name, {})
            row.update(
                requested=d.get("workers"),
                target=d.get("target"),
                demand_cores=d.get("demand_cores"),
                reason=d.get("reason"),
                arrived=arrived.get(name),
            )
        return list(rows.values())

    def scaling_history(self) -> list[dict]:
        """The autoscaler's changes, oldest first: time, step, pool, from, to, reason."""
        return list(((self.planner.pools().get("scaling") or {}).get("history")) or [])

    def loop_stats(self, reset: bool = False) -> dict:
        """How late the scheduler's event loop woke up (``block_max_ms``, ``block_p99_ms``): a
        handler or step that blocked the loop shows here. ``reset`` starts a new measurement."""
        return self.planner.loop(reset)

    def snapshots(self) -> list[dict]:
        """Snapshots written by this service: kind (base/delta), bytes, seconds, committed step."""
        return self.planner.snapshots()

    def mix_table(self, start: int = 0, stop: int | None = None):
        """Tokens, share and declared share per (planned step, source), with plan version, stage
        and whether the step is committed (pyarrow.Table)."""
        return mix_table(self.metrics(start, stop), self.timeline().source_names, self.status()["committed"])

    def schedule_table(self, start: int | None = None, stop: int | None = None):
        """The declared mix of the steps not planned yet (default: up to the plan's ``steps``, or
        100 steps ahead): what will be delivered."""
        tl = self.timeline()
        start = self.status()["frontier"] if start is None else start
        stop = stop if stop is not None else max(tl.latest.steps or 0, start + 100)
        return schedule_table(tl, start, stop)

    def imbalance_table(self, start: int = 0, stop: int | None = None):
        return imbalance_table(self.metrics(start, stop))

    def decisions_table(self):
        """The planner's own decisions (a learned cost model, a mixing controller's shares):
        the step each applies from, its kind, its values and its reason (pyarrow.Table)."""
        return decisions_table(self.timeline().decisions)

    def pools_table(self):
        """Loader pools (``pools()``) as a table: one row per (pool, source)."""
        return pools_table(self.pools())

    def scaling_table(self):
        """The autoscaler's changes (``scaling_history()``): step, pool, from, to, reason."""
        return scaling_table(self.scaling_history())

    def pool_workers_table(self, start: int = 0, stop: int | None = None):
        """Workers per pool at each planned step of an autoscaled run."""
        return pool_workers_table(self.metrics(start, stop))

    def length_table(self, start: int = 0, stop: int | None = None, edges=None):
        """Histogram of delivered piece lengths per source over the planned steps."""
        return length_table(
            self.ledger(start, stop), self.timeline().source_names, DEFAULT_EDGES if edges is None else edges
        )

    def plot_mix(self, start: int = 0, stop: int | None = None, window: int = 20, ax=None, ahead: int = 0):
        """Declared vs delivered mix over a sliding window of steps (matplotlib axes); ``ahead``
        steps of the declared schedule beyond the planned ones are drawn dotted."""
        schedule = self.schedule_table(stop=self.status()["frontier"] + ahead) if ahead else None
        return plot_mix(self.mix_table(start, stop), window=window, ax=ax, schedule=schedule)

    def _repr_html_(self) -> str:
        try:
            st = self.status()
            return service_html(
                st, self.timeline(), self.metrics(max(0, st["next_step"] - 20)), self.run_id, self.dashboard
            )
        except Exception as err:  # a notebook must still show something when the service is gone
            return f"<b>overlord service</b> {self.run_id}: unreachable ({err})"
