"""The per-rank multi-source loader users build without a data service: the baseline of the memory
and peer benchmarks.

Every rank runs a ``torch.utils.data.DataLoader`` with ``W`` worker processes over one
``IterableDataset`` that opens *every* source (the textbook multi-source setup):

- each source is read row group by row group (each worker its share of the rank's share), one
  decoded row group held as read-ahead;
- documents pass through a per-source shuffle buffer of ``shuffle_buffer`` raw texts (1,000:
  Hugging Face ``IterableDataset.shuffle``'s default), tokenized when drawn (the byte tokenizer the
  service's plans use);
- sources are interleaved by weight (a seeded random draw per document, like
  ``interleave_datasets(probabilities=...)``), and documents are packed first-fit into
  micro-batches of the same tokens as the service's.

Texts rather than token arrays sit in the buffer, the smaller of the two: the baseline's memory is
not inflated.
"""

from __future__ import annotations

import numpy as np
import torch

SHUFFLE_BUFFER = 1_000


def _source_docs(files: list[str], shard: int, shards: int, buffer: int, rng: np.random.Generator):
    """One source's documents for one worker of one rank, through a shuffle buffer, forever."""
    import pyarrow.parquet as pq

    groups = [(f, g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]
    mine = groups[shard::shards] or groups[shard % len(groups) :: len(groups)]
    pool: list[str] = []
    while True:
        for f, g in mine:
            texts = pq.ParquetFile(f).read_row_group(g, columns=["text"]).column(0)  # the read-ahead
            for t in texts:
                pool.append(t.as_py())
                if len(pool) >= buffer:
                    i = int(rng.integers(len(pool)))
                    pool[i], pool[-1] = pool[-1], pool[i]
                    yield pool.pop()


def _tokens(text: str) -> np.ndarray:
    from overlord_dask.sources.tokenizers import BYTE_OFFSET, EOS_ID

    b = np.frombuffer(text.encode(), np.uint8).astype(np.int64) + BYTE_OFFSET
    return np.append(b, EOS_ID)


class MixedSources(torch.utils.data.IterableDataset):
    """One rank's view of every source, mixed by weight and packed into micro-batches."""

    def __init__(
        self,
        sources: dict[str, list[str]],
        weights: dict[str, float],
        capacity: int,
        rank: int,
        world: int,
        shuffle_buffer: int = SHUFFLE_BUFFER,
        seed: int = 0,
    ):
        super().__init__()
        self.sources, self.capacity, self.rank, self.world = sources, capacity, rank, world
        names = sorted(sources)
        w = np.array([weights[n] for n in names], float)
        self.names, self.p = names, w / w.sum()
        self.shuffle_buffer, self.seed = shuffle_buffer, seed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        rng = np.random.default_rng([self.seed, self.rank, wid])
        shard, shards = self.rank * nw + wid, self.world * nw
        its = [_source_docs(self.sources[n], shard, shards, self.shuffle_buffer, rng) for n in self.names]
        cap = self.capacity
        ids, pos, cu = np.zeros(cap, np.int64), 0, [0]
        while True:
            doc = _tokens(next(its[int(rng.choice(len(its), p=self.p))]))[:cap]
            if pos + len(doc) > cap:
                yield as_batch(ids, cu, cap)
                ids, pos, cu = np.zeros(cap, np.int64), 0, [0]
            ids[pos : pos + len(doc)] = doc
            pos += len(doc)
            cu.append(pos)


def as_batch(ids: np.ndarray, cu: list[int], capacity: int) -> dict:
    """A packed micro-batch as the service's consumer yields it (same fields and dtypes)."""
    cu = np.asarray(cu, dtype=np.int64)
    n = int(cu[-1])
    labels = np.full(capacity, -100, np.int64)
    labels[: n - 1] = ids[1:n]
    labels[cu[1:] - 1] = -100
    pos = np.arange(capacity, dtype=np.int64)
    pos[:n] -= np.repeat(cu[:-1], np.diff(cu))
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(pos),
        "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
    }


def loader(
    sources: dict[str, list[str]],
    weights: dict[str, float],
    capacity: int,
    rank: int,
    world: int,
    workers: int = 2,
    **kw,
) -> torch.utils.data.DataLoader:
    """The rank's ``DataLoader`` at its documented defaults (prefetch factor 2)."""
    return torch.utils.data.DataLoader(
        MixedSources(sources, weights, capacity, rank, world, **kw),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=2 if workers else None,
    )
