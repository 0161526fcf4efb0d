"""Zarr sources: a group holding a flat int token array and an int64 offsets array (n_docs + 1).

Units are document ranges of about ``loading.unit_tokens`` tokens, cut from the offsets array alone.

Multimodal groups (``images_field``) also hold the images as an array ``[n_images, patches,
patch_dim]``, ``image_offsets`` (images per document, like ``offsets``) and ``image_positions``
(where in its document's text each image goes). Loading inserts ``patches`` placeholder tokens
per image into the token stream, so everything downstream (lengths, packing, splitting) counts
image tokens like text tokens, and the block keeps the patches for the constructor.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import zarr

from ..errors import SourceError
from ..plan import Source, SourcePlan
from .blocks import SampleBlock, check_tokens
from .formats import Format
from .fs import source_fs, source_url
from .images import with_image_tokens
from .tokenizers import image_token_id
from .units import LoadUnit


def _open_group(source: Source, plan: SourcePlan):
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
    names = [source.token_array, source.offsets_field]
    if source.images_field:
        names += [source.images_field, source.image_offsets_field, source.image_positions_field]
    for name in names:
        if name not in group:
            raise SourceError(
                f"source {source.name!r}: array {name!r} not found in zarr group {url!r}; "
                f"available arrays: {sorted(group.array_keys())}"
            )
    return group, path


_GROUPS: OrderedDict[tuple[int, str], tuple] = OrderedDict()  # (id(plan), source) -> (plan, group, path)
_GROUPS_MAX = 32
_GROUPS_LOCK = threading.Lock()


def _loading_group(source: Source, plan: SourcePlan):
    """The source's group, opened once per plan object in this process (a process holds one
    slice per source, plan version and run: ``SourcePlan``'s shared copies; a later run opens
    the group anew). Opening reads the group's and the arrays' metadata (a few object-store
    requests on S3), for every unit otherwise. Chunks are still read at every load."""
    key = (id(plan), source.name)
    with _GROUPS_LOCK:
        hit = _GROUPS.get(key)
        if hit is not None and hit[0] is plan:
            _GROUPS.move_to_end(key)
            return hit[1], hit[2]
    group, path = _open_group(source, plan)
    with _GROUPS_LOCK:
        _GROUPS[key] = (plan, group, path)
        while len(_GROUPS) > _GROUPS_MAX:
            _GROUPS.popitem(last=False)
    return group, path


class ZarrFormat(Format):
    name = "zarr"
    records = False

    def discover(self, source: Source, plan: SourcePlan) -> list[LoadUnit]:
        return _discover(source, plan)

    def read(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> SampleBlock:
        return _load(source, plan, unit)

    def warnings(self, source: Source, plan: SourcePlan) -> list[str]:
        return layout_warnings(source, plan)


def _discover(source: Source, plan: SourcePlan) -> list[LoadUnit]:
    group, path = _open_group(source, plan)
    tokens, offsets_arr = group[source.token_array], group[source.offsets_field]
    if not np.issubdtype(tokens.dtype, np.integer):
        raise SourceError(f"source {source.name!r}: {source.token_array!r} has dtype {tokens.dtype}, expected integers")
    offsets = np.asarray(offsets_arr[:], dtype=np.int64)
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise SourceError(f"source {source.name!r}: {source.offsets_field!r} must start at 0 and never decrease")
    if offsets[-1] != tokens.shape[0]:
        raise SourceError(
            f"source {source.name!r}: offsets end at {offsets[-1]} but {source.token_array!r} holds {tokens.shape[0]} "
            "tokens"
        )
    n_docs = len(offsets) - 1
    if source.images_field:
        _check_images(source, group, n_docs)
    # cut at the first document boundary at or after each multiple of unit_tokens
    targets = np.arange(plan.loading.unit_tokens, offsets[-1], plan.loading.unit_tokens)
    cuts = np.unique(np.concatenate([[0], np.searchsorted(offsets, targets, side="left"), [n_docs]]))
    cuts = cuts[(cuts >= 0) & (cuts <= n_docs)]
    units = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b > a:
            units.append(LoadUnit(source.name, len(units), path, -1, int(a), int(b), int(a)))
    return units


def layout_warnings(source: Source, plan: SourcePlan) -> list[str]:
    """Advice on the group's layout (``overlord validate``): token chunks larger than the plan's
    units make every load decompress a whole chunk to keep part of it."""
    group, _ = _open_group(source, plan)
    tokens, unit = group[source.token_array], plan.loading.unit_tokens
    chunk = min(int(tokens.chunks[0]), int(tokens.shape[0]))  # a chunk past the array's end holds only what is there
    if chunk <= unit:
        return []
    return [
        f"source {source.name!r}: {source.token_array!r} is stored in chunks of {chunk:,} tokens, more than "
        f"loading.unit_tokens ({unit:,}): each load decompresses up to {-(-chunk // unit)}x the tokens it keeps; "
        "rechunk the array to at most unit_tokens, or raise unit_tokens"
    ]


def _check_images(source: Source, group, n_docs: int) -> None:
    images, img_off, img_pos = (
        group[source.images_field],
        group[source.image_offsets_field],
        group[source.image_positions_field],
    )
    where = f"source {source.name!r}"
    if images.ndim != 3:
        raise SourceError(
            f"{where}: {source.images_field!r} must be [n_images, patches, patch_dim] (got shape {images.shape})"
        )
    off = np.asarray(img_off[:], dtype=np.int64)
    if off.shape != (n_docs + 1,) or off[0] != 0 or np.any(np.diff(off) < 0) or off[-1] != images.shape[0]:
        raise SourceError(
            f"{where}: {source.image_offsets_field!r} must have n_docs + 1 = {n_docs + 1} entries, start at 0, never "
            f"decrease and end at the number of images {images.shape[0]} (got shape {off.shape}, last "
            f"{off[-1] if len(off) else None})"
        )
    if img_pos.shape != (images.shape[0],):
        raise SourceError(
            f"{where}: {source.image_positions_field!r} needs one entry per image ({images.shape[0]}), got shape "
            f"{img_pos.shape}"
        )


def _load(source: Source, plan: SourcePlan, unit: LoadUnit) -> SampleBlock:
    group, _ = _loading_group(source, plan)
    try:
        offsets = np.asarray(group[source.offsets_field][unit.start : unit.stop + 1], dtype=np.int64)
        tokens = np.asarray(group[source.token_array][int(offsets[0]) : int(offsets[-1])])
        if source.images_field:
            img_off = np.asarray(group[source.image_offsets_field][unit.start : unit.stop + 1], dtype=np.int64)
            images = np.asarray(group[source.images_field][int(img_off[0]) : int(img_off[-1])])
            positions = np.asarray(
                group[source.image_positions_field][int(img_off[0]) : int(img_off[-1])], dtype=np.int64
            )
    except Exception as err:
        raise SourceError(f"corrupt data in {unit.describe()}: {err}") from None
    if len(offsets) != unit.n_docs + 1:
        raise SourceError(f"{unit.describe()}: offsets array is shorter than when the source was indexed")
    ids = np.arange(unit.first_id, unit.first_id + unit.n_docs, dtype=np.int64)
    offsets = offsets - offsets[0]
    tokens = check_tokens(source.name, tokens)  # before the image placeholders are inserted
    if not source.images_field:
        return SampleBlock(source.name, tokens, offsets, ids)
    return with_image_tokens(
        source.name,
        image_token_id(source, plan),
        unit.describe(),
        tokens,
        offsets,
        ids,
        list(images),
        img_off - img_off[0],
        positions,
    )
