"""Load units: the grain of source loading, found from file metadata alone.

A load unit is one contiguous range of documents in one file (a parquet row-group range, a zarr
document range). Units are found from parquet footers and the zarr offsets array, without reading
token data, so a source with thousands of files is indexed cheaply. A unit is small and plain
(msgpack-friendly) because the planner keeps one per unit of every source.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class LoadUnit:
    source: str
    index: int
    """Position of this unit in the source's canonical (file) order."""
    path: str
    """Resolved file (parquet) or group (zarr) path, as the source's filesystem names it."""
    part: int
    """parquet: the row group; zarr: unused (-1)."""
    start: int
    """parquet: first row in the row group; zarr: first document."""
    stop: int
    first_id: int
    """Source-wide id of the unit's first document; document k of the unit has id first_id + k."""

    @property
    def n_docs(self) -> int:
        return self.stop - self.start

    def describe(self) -> str:
        where = f"row group {self.part} rows {self.start}:{self.stop}" if self.part >= 0 else f"documents {self.start}:{self.stop}"
        return f"source {self.source!r} unit {self.index} ({self.path}, {where})"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LoadUnit":
        return cls(**d)
