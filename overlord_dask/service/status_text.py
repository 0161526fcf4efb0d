"""``overlord status`` for a person: the summary (``ServiceViews.summary``) as a short table of
labelled lines, numbers formatted for reading, the worst ranks named, and, when watched, the
rates since the previous look. ``overlord status --json`` prints the summary itself."""

from __future__ import annotations

import time

from dask.utils import format_bytes

WAIT_WARN, WAIT_BAD = 0.05, 0.25  # a rank waiting this share of its time for data: worth a look / a problem
TOP = 3  # ranks named on the lag and wait lines


def count(n: float | int | None) -> str:
    """1234567 -> '1.23M' (counts and rates a person reads at a glance)."""
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}" if isinstance(n, float) else str(n)


def nbytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def ago(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def worst(values: dict, n: int = TOP) -> list[tuple[str, float]]:
    return sorted(((str(k), float(v)) for k, v in values.items()), key=lambda kv: -kv[1])[:n]


def render(s: dict, previous: tuple[float, dict] | None = None, now: float | None = None) -> str:
    """The summary ``s`` as text; ``previous`` is ``(time, summary)`` of the last look (rates)."""
    now = time.time() if now is None else now
    lines = [("time", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)))]
    lines.append(("run", f"{s['run_id']} (plan {s['name']}), dp {s['dp']}, sources {', '.join(s['sources'])}"))
    if s.get("dashboard"):
        lines.append(("dashboard", s["dashboard"]))
    state = "FAILED" if s["failure"] else "stopping" if s.get("stop_requested") else "running"
    lines.append(("state", state + (f": {s['failure']}" if s["failure"] else "")))
    lines.append(
        (
            "steps",
            f"{s['committed']:,} committed (every rank consumed), {s['planned']:,} planned, "
            f"{s['durable']:,} durable (a restart resumes there)",
        )
    )
    lines.append(("tokens", f"{count(s.get('tokens_committed'))} delivered since the service started"))
    if previous is not None:
        t0, p = previous
        dt = max(now - t0, 1e-9)
        steps = (s["committed"] - p["committed"]) / dt
        tokens = ((s.get("tokens_committed") or 0) - (p.get("tokens_committed") or 0)) / dt
        lines.append(("rate", f"{steps:.2f} steps/s, {count(tokens)} tokens/s (over the last {dt:.0f} s)"))
    lag = worst(s["rank_lag"])
    behind = [f"rank {r}: {v:.0f}" for r, v in lag if v > 0]
    lines.append(("lag", ", ".join(behind) + " steps behind the leader" if behind else "none (every rank level)"))
    waits = worst(s.get("rank_wait_share") or {})
    if waits:
        top = waits[0][1]
        flag = "  << trainers starve for data" if top >= WAIT_BAD else "  < worth a look" if top >= WAIT_WARN else ""
        shares = ", ".join(f"rank {r} {v:.1%}" for r, v in waits)
        lines.append(("waiting", f"{shares} of their time (worst first){flag}"))
    else:
        lines.append(("waiting", "no trainer has reported yet"))
    if s["imbalance"] is None:
        lines.append(("balance", "no committed step yet"))
    else:
        lines.append(
            (
                "balance",
                f"imbalance {s['imbalance']:.3f} per step, {s['mb_imbalance']:.3f} per micro-batch "
                "(max / mean cost over ranks; 1 is even), last 20 committed steps",
            )
        )
        mix = f"error {s['mix_error']:.2%} of tokens off the declared shares, last 20 committed steps"
        if s.get("mix_grain"):  # (what a group of long pieces weighs there: the error's own scale)
            mix += f" (long pieces go dp at a time: one such group is up to {s['mix_grain']:.2%} of them)"
        lines.append(("mix", mix))
    if s.get("starved_on"):
        lines.append(("waiting on", f"source {s['starved_on']!r} (its loads are behind the planner)"))
    w = s.get("waiting")
    if w:
        lines.append(("blocked", f"step {w['step']:,} for {w['since_s']:g} s: {w['cause']}"))
    for pool, p in (s.get("pools") or {}).items():
        lines.append(("pool", f"{pool}: {p['workers']} workers (target {p['target']})"))
    snap = s.get("last_snapshot")
    if snap:
        when = f", {ago(now - snap['time'])}" if snap.get("time") else ""
        lines.append(("snapshot", f"{snap['kind']} at step {snap['committed']:,}, {nbytes(snap['bytes'])}{when}"))
    else:
        lines.append(("snapshot", "none written yet"))
    if s.get("snapshot_error"):
        lines.append(("snapshot error", s["snapshot_error"]))
    lines.append(("event loop", f"longest block {s['loop_block_max_ms']:.1f} ms"))
    width = max(len(k) for k, _ in lines) + 2
    return "\n".join(f"{k:<{width}}{v}" for k, v in lines)
