"""A deliberately naive reader: every document of a source, read straight from its files, by id.

The integration tests compare delivered pieces with this, so it shares nothing with the loaders
but the plan and the byte tokenizer."""

from __future__ import annotations

import glob
import os

import numpy as np
import pyarrow.parquet as pq
import zarr

from overlord_dask.sources.tokenizers import byte_tokenize


def read_source(plan, name: str) -> list[np.ndarray]:
    src = plan.source(name)
    url = src.url if os.path.isabs(src.url) else os.path.join(plan.base_dir, src.url)
    docs: list[np.ndarray] = []
    if src.format == "zarr":
        g = zarr.open_group(url, mode="r")
        toks, offs = g[src.token_array][:], g[src.offsets_field][:]
        return [toks[offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]
    for path in sorted(glob.glob(url)):
        col = pq.read_table(path).column(src.text_field or src.tokens_field)
        if src.text_field:
            t, o = byte_tokenize(col.combine_chunks())
            docs += [t[o[i] : o[i + 1]] for i in range(len(o) - 1)]
        else:
            docs += [np.asarray(v if v is not None else [], dtype=np.int32) for v in col.to_pylist()]
    return docs


# ---- the other formats, read with their own libraries or by hand (tests/test_formats.py) -----------------
def jsonl_records(path: str) -> list[tuple[int, dict]]:
    """(byte offset of the line in the decompressed file, record) per non-blank line."""
    import gzip
    import json

    import zstandard

    raw = open(path, "rb").read()
    if path.endswith(".gz"):
        raw = gzip.decompress(raw)
    elif path.endswith(".zst"):
        raw = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True).read()
    out, pos = [], 0
    for line in raw.split(b"\n"):
        if line.strip():
            out.append((pos, json.loads(line)))
        pos += len(line) + 1
    return out


def webdataset_samples(paths: list[str]) -> list[list[tuple[str, dict]]]:
    """Per shard, its samples as (key, {extension: bytes}), grouped with the webdataset library."""
    import webdataset as wds

    shards = []
    for p in paths:
        it = wds.tariterators.group_by_keys(wds.tariterators.tar_file_expander([{"url": p, "stream": open(p, "rb")}]))
        shards.append([(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}) for s in it])
    return shards


def webdataset_unit_sizes(path: str, step: int) -> list[int]:
    """A plain tar shard's samples per load unit, by the cutting rule (``tar_cuts.py``) applied to
    ``tarfile``'s own member listing: the first header block at or after each target (a member's
    extended header or its header) names a member; skip it; cut at the first header of the first
    later member whose key differs from the key of the member after it. Targets: ``step``, then
    ``step`` past each cut."""
    import tarfile

    with tarfile.open(path) as tar:
        members = tar.getmembers()
    size = os.path.getsize(path)

    def key(m):
        stem = m.name[: m.name.find(".", m.name.rfind("/") + 1)] if "." in m.name.rsplit("/", 1)[-1] else None
        return stem if m.isfile() and stem and not stem.rsplit("/", 1)[-1].startswith("__") else None

    cuts, target = [0], step
    while target < size:
        aligned = -(-target // 512) * 512
        first = next((i for i, m in enumerate(members) if m.offset_data - 512 >= aligned or m.offset >= aligned), None)
        later = [m for m in members[first + 1 :] if key(m)] if first is not None else []
        cut = next((m.offset for m in later if key(m) != key(later[0])), None)
        if cut is None:
            break
        cuts.append(cut)
        target = cut + step
    keyed = [m for m in members if key(m)]
    starts = [m.offset for i, m in enumerate(keyed) if i == 0 or key(m) != key(keyed[i - 1])]
    bounds = cuts + [size]
    return [sum(1 for o in starts if a <= o < b) for a, b in zip(bounds, bounds[1:])]


def megatron_docs(prefix: str) -> list[np.ndarray]:
    """Every document of a Megatron indexed dataset, with megatron-core's own reader."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)  # our test files hold one sequence per document
    return [np.array(ds[i]) for i in range(len(ds))]  # copies: the views die with the reader's memory map


def tokens_of(texts: list) -> list[np.ndarray]:
    """The byte tokenizer's documents for texts (None: an empty document)."""
    import pyarrow as pa

    t, o = byte_tokenize(pa.array([x if x is not None else "" for x in texts], pa.string()))
    return [t[o[i] : o[i + 1]] for i in range(len(o) - 1)]
