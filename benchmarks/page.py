"""The /overlord page at scale: what a view costs the scheduler, and what drawing it costs the
browser, at a small and a large data-parallel world (the baseline is the small one, in the same
run: the page must cost about the same at dp 1,024 as at dp 8).

A snapshot of the shape the planner thread publishes (``observe.dashboard.snapshot``: 200
steps of series, 30 minutes of progress samples, per-rank lag and wait shares, 50 decisions) is
served over loopback HTTP with the page's real handlers' functions (``observe.page``); headless
Chromium loads the page, and its script draws it from the JSON it fetched. Headless Chromium runs
the page on a virtual clock (its ``performance.now()`` does not see the work), so a draw's cost is
measured from outside: the wall time of a load that draws ``--draws`` more times, less that of a
load that draws once, divided by ``--draws``.

    python benchmarks/page.py --json            # dp 8 and dp 1,024
"""

from __future__ import annotations

import argparse
import http.server
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.output import emit_rows  # noqa: E402
from overlord_dask.observe.page import as_json, page  # noqa: E402
from overlord_dask.testing import browser  # noqa: E402


def fake_snapshot(dp: int, steps: int = 200, sources: int = 3, seed: int = 0) -> dict:
    """A dashboard snapshot of a run at ``dp`` ranks, ``steps`` steps of history planned."""
    rng = np.random.default_rng(seed)
    names = [f"source{i}" for i in range(sources)]
    w = rng.dirichlet(np.ones(sources))
    now, committed = time.time(), 10_000
    step = list(range(committed - steps + 8, committed + 8))
    share = {n: [float(x) for x in np.clip(w[i] + rng.normal(0, 0.02, steps), 0, 1)] for i, n in enumerate(names)}
    return {
        "run_id": f"bench-{dp}",
        "time": now,
        "name": "bench",
        "dp": dp,
        "planned": committed + 8,
        "committed": committed,
        "durable": committed - 3,
        "tokens_committed": committed * dp * 32_768,
        "starved_on": None,
        "failure": None,
        "stop_requested": False,
        "snapshot_error": None,
        "rank_lag": [int(x) for x in rng.integers(0, 3, dp)],
        "rank_wait_share": {str(r): float(x) for r, x in enumerate(rng.beta(1, 40, dp))},
        "mix_error": 0.004,
        "imbalance": 1.01,
        "mb_imbalance": 1.03,
        "series": {
            "step": step,
            "imbalance": [float(x) for x in 1 + rng.exponential(0.01, steps)],
            "mb_imbalance": [float(x) for x in 1 + rng.exponential(0.03, steps)],
            "share": share,
            "weight": {n: [float(w[i])] * steps for i, n in enumerate(names)},
        },
        "sources": [
            {
                "source": n,
                "pool": n,
                "weight": float(w[i]),
                "delivered_share": float(w[i]),
                "declared_share": float(w[i]),
                "epoch": 1,
                "loads_pending": 3,
                "units_loaded": 64,
                "seconds_per_token": 2e-8,
                "records_read": 10**7,
                "records_dropped": 12,
                "units_quarantined": 0,
            }
            for i, n in enumerate(names)
        ],
        "pools": {n: {"target": 4, "demand_cores": 3.2, "reason": "demand"} for n in names},
        "arrived": dict.fromkeys(names, 4),
        "last_snapshot": {
            "kind": "delta",
            "bytes": 48_000,
            "seconds": 0.02,
            "committed": committed - 3,
            "time": now - 4,
        },
        "loop": {"block_max_ms": 3.1},
        "history": [
            (now - 2 * (900 - i), committed - (900 - i), (committed - (900 - i)) * dp * 32_768, committed + 8)
            for i in range(900)
        ],
        "rates": {"tokens_per_s": dp * 16_384.0, "steps_per_s": 0.5, "seconds": 60.0},
        "counters": {"descriptors_put": committed * dp, "acks": committed * dp},
        "timings": {},
        "dropped": {"records": {}, "quarantined": []},
        "feedback": {
            "decisions": [
                {
                    "at": committed - 400 + 8 * i,
                    "kind": "weights",
                    "values": dict(zip(names, map(float, w))),
                    "reason": "odm round",
                }
                for i in range(50)
            ],
            "cost_fit": {
                "fitted": {"attention": 1.1e-10, "linear": 2.2e-7, "constant": 1e-5, "encoder": 0.0, "fixed": 0.01},
                "declared": {"attention": 1e-10, "linear": 2e-7, "constant": 0.0, "encoder": 0.0, "fixed": 0.012},
                "error_fitted": 0.03,
                "error_declared": 0.08,
                "in_force": "learned",
            },
        },
    }


def serve(snap: dict) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body, kind = (
                (as_json(snap), "application/json")
                if self.path.startswith("/overlord.json")
                else (page(), "text/html; charset=utf-8")
            )
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def timed(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def measure(dp: int, draws: int, repeats: int) -> dict:
    snap = fake_snapshot(dp)
    httpd, base = serve(snap)
    try:
        page.cache_clear()
        json_ms = timed(lambda: as_json(snap), 20) * 1e3
        page_ms = timed(page, 200) * 1e3

        def load(n: int) -> float:
            t0 = time.perf_counter()
            dom = browser.dom(f"{base}/overlord?bench={n}", wait_ms=1000)
            if f'data-committed="{snap["committed"]}"' not in dom:
                raise SystemExit(f"the page did not draw at dp {dp}")
            return time.perf_counter() - t0

        draw = []
        for _ in range(repeats):
            once, many = load(1), load(1 + draws)
            draw.append(max(many - once, 0.0) / draws * 1e3)
    finally:
        httpd.shutdown()
    return {
        "dp": dp,
        "page_ms": round(page_ms, 4),
        "json_ms": round(json_ms, 2),
        "json_kb": round(len(as_json(snap)) / 1024, 1),
        "draw_ms_p50": round(statistics.median(draw), 2),
        "draw_ms_max": round(max(draw), 2),
        "view_ms": round(page_ms + json_ms + statistics.median(draw), 2),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 1024])
    ap.add_argument("--draws", type=int, default=100, help="extra draws of the page in the timed load")
    ap.add_argument("--repeats", type=int, default=3, help="page loads per dp")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [measure(dp, args.draws, args.repeats) for dp in args.dp]
    out = {
        "benchmark": "page",
        "rows": rows,
        "view_ms_ratio_largest_to_smallest": round(rows[-1]["view_ms"] / rows[0]["view_ms"], 2),
        "target_view_ms_at_largest": 200,
    }
    emit_rows(out, args.json, ["dp", "page_ms", "json_ms", "json_kb", "draw_ms_p50", "draw_ms_max", "view_ms"])
    return out


if __name__ == "__main__":
    main()
