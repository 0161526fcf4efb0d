"""The run's manifests, kept with the snapshots (``<checkpoint.url>/manifest/``), so that every
later start of the run checks the files against what the run first saw:

- always (a run with a checkpoint URL), each source file's cheap identity: size and modification
  stamp (mtime, or the object store's ETag; a zarr group: those of every file in it), from file
  metadata alone (``files/<source>.json``): a file rewritten or gone is refused on resume
  (``checkpoint.on_data_change``) rather than delivered as if it were the data the snapshots
  describe;
- with ``loading.integrity``, each load unit's digest (``sources/integrity.py``, ``<source>.json``),
  which also catches bytes that rot without the file's stamps changing.

A kept manifest applies only to the same units: if a source's files now index to other units (a
file added or removed), the start fails naming the source, since the run's sample ids and
positions would no longer mean what its snapshots say.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from .. import logs
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
        plan = _plan_of(timeline, name)
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


def _plan_of(timeline: PlanVersions, name: str):
    """The newest plan version that defines source ``name``."""
    return next(p for _, p in reversed(timeline.versions) if any(s.name == name for s in p.sources))


def _stamp(info: dict):
    return info.get("ETag") or info.get("etag") or info.get("mtime") or str(info.get("LastModified") or "")


def identity(fs, path: str) -> list:
    """A file's size and modification stamp; a folder's (a zarr group): those of each file in it."""
    info = fs.info(path)
    if info.get("type") == "directory":
        found = fs.find(path, detail=True)
        return sorted([k[len(path) :], v.get("size"), _stamp(v)] for k, v in found.items())
    return [info.get("size"), _stamp(info)]


def check_files(timeline: PlanVersions, units: dict[str, list[LoadUnit]], resuming: bool = True) -> bool:
    """On a resume, compare each source's files with the identities kept when the run first
    indexed them; a changed or vanished file stops the start, naming it, unless the plan accepts
    data changes (``checkpoint.on_data_change``): True then. A fresh run (``resuming`` False: no
    snapshot to resume from) keeps its own. Sources with ``loading.integrity`` are checked by
    their digests instead (``with_digests``)."""
    accepted = False
    for name, us in units.items():
        plan = _plan_of(timeline, name)
        store = _store(plan)
        if store is None or plan.loading.integrity:
            continue
        fs, _ = source_fs(timeline.source(name), plan.base_dir)
        paths = list(dict.fromkeys(u.path for u in us))
        with ThreadPoolExecutor(max_workers=8) as pool:  # remote stores: requests overlap
            now = dict(zip(paths, pool.map(lambda p, fs=fs: identity(fs, p), paths)))
        kept = _read(store, f"files/{name}") if resuming else None
        if kept is not None:
            gone = [p for p in kept["files"] if p not in now]
            changed = [p for p, ident in kept["files"].items() if p in now and now[p] != ident]
            if not gone and not changed:
                continue
            what = "; ".join(
                [f"changed (size or modification stamp): {', '.join(changed[:5])}"] * bool(changed)
                + [f"gone: {', '.join(gone[:5])}"] * bool(gone)
            )
            if plan.checkpoint.on_data_change == "refuse":
                raise SourceError(
                    f"source {name!r}: files differ from when the run first indexed them ({what}): resuming would "
                    "deliver other documents than the run's snapshots describe. Restore the files, start a new run "
                    "(a new checkpoint url), or set checkpoint.on_data_change: accept"
                )
            logs.event("data_changed", plan.name, source=name, files=what)
            accepted = True
        _write(store, f"files/{name}", {"files": now})
    return accepted


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
    path = f"{root}/{name}.json"
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as f:
        json.dump(payload, f)
