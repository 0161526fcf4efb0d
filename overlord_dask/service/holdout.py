"""Held-out units (``Source.holdout``): taken out of a source's units before the planner sees
them, so no document of theirs can reach training; they make the evaluation stream instead.

The training units are numbered again from 0 (the planner knows units by position); their
documents keep their sample ids, which do not depend on the split.
"""

from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import replace

from ..errors import PlanError
from ..plan import Source
from ..sources.units import LoadUnit


def _score(seed: int, source: str, unit: LoadUnit) -> float:
    """A stable number in [0, 1) per (seed, source, unit position in the file order)."""
    h = hashlib.blake2b(f"{seed}/{source}/{unit.index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


def split(seed: int, source: Source, units: list[LoadUnit]) -> tuple[list[LoadUnit], list[LoadUnit]]:
    """(training units, numbered from 0; held-out units) of ``source``."""
    name, h = source.name, source.holdout
    if h is None:
        return units, []
    if isinstance(h, float):
        held = [u for u in units if _score(seed, name, u) < h]
        if not held and len(units) > 1:  # a small source: at least one unit, the lowest score
            held = [min(units, key=lambda u: _score(seed, name, u))]
    else:
        held = [u for u in units if any(fnmatch.fnmatch(u.path, p) or fnmatch.fnmatch(u.path, f"*/{p}") for p in h)]
        if not held:
            raise PlanError(f"source {name!r}: holdout patterns {h} match none of its files")
    keep = [u for u in units if u not in held]
    if not keep:
        raise PlanError(f"source {name!r}: holdout {h!r} leaves no unit for training")
    return [replace(u, index=i) for i, u in enumerate(keep)], held


def training(seed: int, source_of, units: dict[str, list[LoadUnit]]) -> dict[str, list[LoadUnit]]:
    """Each source's training units (``source_of(name)``: its Source)."""
    return {name: split(seed, source_of(name), us)[0] for name, us in units.items()}


def held_out(seed: int, source_of, units: dict[str, list[LoadUnit]]) -> dict[str, list[LoadUnit]]:
    """Each source's held-out units (sources holding none are left out)."""
    return {name: held for name, us in units.items() if (held := split(seed, source_of(name), us)[1])}
