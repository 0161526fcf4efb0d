"""Indexing sources: their load units found from file metadata (no data read), in the service
process before a run starts (so a missing file or column fails there, naming it) and when a live
update adds sources."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..plan import Plan, Source
from ..plan.versions import PlanVersions
from ..sources import discover_units
from ..sources.fs import is_local
from ..sources.units import LoadUnit


def index_sources(plan: Plan, sources: list[Source] | None = None) -> dict[str, list[LoadUnit]]:
    """Discover the load units (metadata only) of ``sources`` (default: all of the plan's), in
    parallel where any is remote (local ones are indexed in turn: see ``sources/fs.is_local``);
    errors name the source."""
    sources = plan.sources if sources is None else sources
    if not sources:
        return {}
    if all(is_local(s, plan.base_dir) for s in sources):
        return {s.name: discover_units(s, plan) for s in sources}
    with ThreadPoolExecutor(max_workers=min(8, len(sources))) as pool:
        futs = {s.name: pool.submit(discover_units, s, plan) for s in sources}
        return {name: f.result() for name, f in futs.items()}


def index_timeline(timeline: PlanVersions) -> dict[str, list[LoadUnit]]:
    """Units of every source any plan version names (each source indexed once, with the plan
    version that defines it, so relative URLs resolve against that plan's folder)."""
    units: dict[str, list[LoadUnit]] = {}
    for _, plan in timeline.versions:
        units.update(index_sources(plan, [s for s in plan.sources if s.name not in units]))
    return units
