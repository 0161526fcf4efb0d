"""Load units: the grain of source loading, found from file metadata alone.

A load unit is one contiguous range of documents in one file: a parquet row-group range, a zarr
or Megatron document range, an Arrow row range, a byte range of a jsonl file (whole lines), a
webdataset shard. Units are found from footers, indexes, offsets arrays, frame headers and file
sizes, without reading document data, so a source with thousands of files is indexed cheaply. A
unit is small and plain (msgpack-friendly) because the planner keeps one per unit of every source.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class LoadUnit:
    source: str
    index: int
    """Position of this unit in the source's canonical (file) order."""
    path: str
    """Resolved file (parquet, jsonl, ...) or group (zarr) path, as the source's filesystem names it."""
    part: int
    """parquet: the row group; other formats: -1."""
    start: int
    """First document of the unit in its file (parquet: in its row group)."""
    stop: int
    """End of the unit's documents (exclusive), or -1 when the format cannot count them from
    metadata (a jsonl byte range, a webdataset shard): the planner learns the count at load."""
    first_id: int
    """Source-wide id of the unit's first document; document k of the unit has id first_id + k."""
    span: tuple[int, ...] | None = None
    """Where the unit lies in its file when that is not a document range: the byte range
    ``[lo, hi)`` of a jsonl file (decompressed bytes for a compressed one) whose lines start in it."""
    digest: str | None = None
    """With ``loading.integrity``: the digest of the bytes the unit is read from (``integrity.py``)."""

    @property
    def n_docs(self) -> int | None:
        """The unit's documents, or None when only loading it tells."""
        return None if self.stop < 0 else self.stop - self.start

    def describe(self) -> str:
        if self.span is not None:
            where = f"bytes {self.span[0]}:{self.span[1]}"
        elif self.part >= 0:
            where = f"row group {self.part} rows {self.start}:{self.stop}"
        elif self.stop < 0:
            where = "whole file"
        else:
            where = f"documents {self.start}:{self.stop}"
        return f"source {self.source!r} unit {self.index} ({self.path}, {where})"

    def to_dict(self) -> dict:
        # field by field: dataclasses.asdict deep-copies recursively, and the submitter turns a
        # unit into a dict for every load task it submits
        return {f: getattr(self, f) for f in FIELDS}

    @classmethod
    def from_dict(cls, d: dict) -> LoadUnit:
        span = d.get("span")
        return cls(**{**d, "span": None if span is None else tuple(int(x) for x in span)})


FIELDS = tuple(f.name for f in fields(LoadUnit))
