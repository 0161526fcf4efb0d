"""The ``/overlord`` page: one static document (``templates/overlord.html``) whose script polls
``/overlord.json`` every two seconds and redraws in place: headline figures with thresholds,
charts over wall-clock time and over steps (drawn as SVG in the browser), and tables of the
worst ranks, sources, pools, the learned cost model and the planner's decisions.

The server only hands out the document (read once) and the dashboard snapshot as JSON
(``dashboard.snapshot``, refreshed by the planner thread): nothing is drawn on the scheduler, so
a page view costs the same at dp 8 and at dp 1,024, and neither blocks the event loop.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources


@functools.lru_cache(maxsize=1)
def page() -> str:
    """The page's document (the same for every run and every view)."""
    return resources.files("overlord_dask.observe").joinpath("templates", "overlord.html").read_text()


def _plain(v):
    """JSON for what the snapshot holds beyond plain data (numpy scalars, tuples in sets)."""
    if hasattr(v, "item"):
        return v.item()
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    return str(v)


def _finite(v):
    """``v`` with NaN and infinities (which JSON lacks, and a browser refuses) as None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def as_json(snap: dict) -> str:
    """The snapshot as strict JSON (what a browser's ``JSON.parse`` takes)."""
    return json.dumps(_finite(snap), default=_plain, allow_nan=False)
