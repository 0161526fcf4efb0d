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
