"""The run's integrity manifest: each load unit's digest (``sources/integrity.py``), computed when
its source is first indexed and kept with the snapshots (``<checkpoint.url>/manifest/<source>.json``),
so that every later start of the run checks the files against what the run first saw.

A kept manifest applies only to the same units: if a source's files now index to other units (a
file added or removed), the start fails naming the source, since the run's sample ids and
positions would no longer mean what its snapshots say.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from ..errors import SourceError
from ..plan.base import resolve_url
from ..plan.versions import PlanVersions
from ..sources.fs import source_fs
from ..sources.integrity import region_digest, regions
from ..sources.units import LoadUnit


def _key(u: LoadUnit) -> list:
    return [u.index, u.path, u.part, u.start, u.stop, list(u.span) if u.span is not None else None]


def with_digests(timeline: PlanVersions, units: dict[str, list[LoadUnit]]) -> dict[str, list[LoadUnit]]:
    """``units`` with their digests, for the sources whose plan asks for integrity checks."""
    out = dict(units)
    for name, us in units.items():
        src = timeline.source(name)
        plan = next(p for _, p in reversed(timeline.versions) if any(s.name == name for s in p.sources))
        if not plan.loading.integrity:
            continue
        store = _store(plan)
        kept = _read(store, name) if store is not None else None
        if kept is not None:
            if kept["units"] != [_key(u) for u in us]:
                raise SourceError(
                    f"source {name!r}: its files index to other load units than when the run's integrity manifest "
                    "was written (a file added, removed or rewritten): the run cannot resume on them"
                )
            out[name] = [replace(u, digest=d) for u, d in zip(us, kept["digests"])]
            continue
        fs, _ = source_fs(src, plan.base_dir)
        per_unit = [regions(src, plan, u) for u in us]
        distinct = list(dict.fromkeys(per_unit))  # units of one row group or file share its digest
        with ThreadPoolExecutor(max_workers=4) as pool:  # remote stores: requests overlap
            digests = dict(zip(distinct, pool.map(lambda r, fs=fs: region_digest(fs, r), distinct)))
        out[name] = [replace(u, digest=digests[r]) for u, r in zip(us, per_unit)]
        if store is not None:
            _write(store, name, {"units": [_key(u) for u in us], "digests": [u.digest for u in out[name]]})
    return out


def _store(plan):
    if not plan.checkpoint.url:
        return None
    import fsspec

    fs, root = fsspec.core.url_to_fs(resolve_url(plan.checkpoint.url, plan.base_dir), **plan.checkpoint.storage_options)
    return fs, f"{root}/manifest"


def _read(store, name: str) -> dict | None:
    fs, root = store
    path = f"{root}/{name}.json"
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return json.load(f)


def _write(store, name: str, payload: dict) -> None:
    fs, root = store
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/{name}.json", "w") as f:
        json.dump(payload, f)
