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
