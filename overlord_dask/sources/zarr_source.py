"""Zarr sources: a group holding a flat int token array and an int64 offsets array (n_docs + 1).

Units are document ranges of about ``loading.unit_tokens`` tokens, cut from the offsets array alone.
"""

from __future__ import annotations

import numpy as np
import zarr

from ..errors import SourceError
from ..plan.models import Plan, Source
from .blocks import SampleBlock
from .fs import source_fs, source_url
from .units import LoadUnit


def _open_group(source: Source, plan: Plan):
    fs, path = source_fs(source, plan.base_dir)
    url = source_url(source, plan.base_dir)
    if not fs.exists(path):
        raise SourceError(f"source {source.name!r}: zarr group not found: {url!r}")
    try:
        if "://" in url:
            group = zarr.open_group(url, mode="r", storage_options=source.storage_options or None)
        else:
            group = zarr.open_group(url, mode="r")
    except Exception as err:  # zarr raises a zoo of errors for broken metadata
        raise SourceError(f"source {source.name!r}: cannot open zarr group {url!r}: {err}") from None
    for name in (source.token_array, source.offsets_field):
        if name not in group:
            raise SourceError(
                f"source {source.name!r}: array {name!r} not found in zarr group {url!r}; "
                f"available arrays: {sorted(group.array_keys())}"
            )
    return group, path


def discover(source: Source, plan: Plan) -> list[LoadUnit]:
    group, path = _open_group(source, plan)
    tokens, offsets_arr = group[source.token_array], group[source.offsets_field]
    if not np.issubdtype(tokens.dtype, np.integer):
        raise SourceError(f"source {source.name!r}: {source.token_array!r} has dtype {tokens.dtype}, expected integers")
    offsets = np.asarray(offsets_arr[:], dtype=np.int64)
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise SourceError(f"source {source.name!r}: {source.offsets_field!r} must start at 0 and never decrease")
    if offsets[-1] != tokens.shape[0]:
        raise SourceError(
            f"source {source.name!r}: offsets end at {offsets[-1]} but {source.token_array!r} holds {tokens.shape[0]} tokens"
        )
    n_docs = len(offsets) - 1
    # cut at the first document boundary at or after each multiple of unit_tokens
    targets = np.arange(plan.loading.unit_tokens, offsets[-1], plan.loading.unit_tokens)
    cuts = np.unique(np.concatenate([[0], np.searchsorted(offsets, targets, side="left"), [n_docs]]))
    cuts = cuts[(cuts >= 0) & (cuts <= n_docs)]
    units = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b > a:
            units.append(LoadUnit(source.name, len(units), path, -1, int(a), int(b), int(a)))
    return units


def load(source: Source, plan: Plan, unit: LoadUnit) -> SampleBlock:
    group, _ = _open_group(source, plan)
    try:
        offsets = np.asarray(group[source.offsets_field][unit.start : unit.stop + 1], dtype=np.int64)
        tokens = np.asarray(group[source.token_array][int(offsets[0]) : int(offsets[-1])])
    except Exception as err:
        raise SourceError(f"corrupt data in {unit.describe()}: {err}") from None
    if len(offsets) != unit.n_docs + 1:
        raise SourceError(f"{unit.describe()}: offsets array is shorter than when the source was indexed")
    ids = np.arange(unit.first_id, unit.first_id + unit.n_docs, dtype=np.int64)
    return SampleBlock(source.name, tokens.astype(np.int32, copy=False), offsets - offsets[0], ids)
