"""A source's order: each epoch a seeded permutation of its load units, cut into *shuffle blocks*
of ``loading.shuffle_units`` consecutive units, and the documents of all of a block's units
permuted together.

Real corpora are written in order (a file per crawl dump, repository, language or date), so a
stream that walks one unit at a time draws its neighbouring documents from one file. Permuting
the documents of K units together makes neighbours come from K different units, as a global
shuffle's would from a window of the same size (a neighbour shares a unit with probability about
1/K; a window of W documents touches about ``K·(1 - (1 - 1/K)^W)`` units), at the cost of having
the K units of a block loaded before its first document is planned. The grouping is a new one
every epoch (the unit permutation is per epoch). ``benchmarks/shuffle.py`` measures it against a
global permutation and MosaicML Streaming's shuffles.

The run's first blocks are a warm-up (``loading.shuffle_warmup_units``, W): epoch 0 starts with
blocks of W, 2W, 4W, ... units while each is smaller than K and together they hold at most an
eighth of the source's units (``WARMUP_SHARE``), then cuts the rest into near-equal blocks of at
most K. The first batch then waits for W units, not K, and each next block loads while the one
before it is planned; what it costs is the warm-up blocks' neighbours coming from fewer units,
in at most an eighth of the first epoch (a source of fewer than 8W units has none). Later epochs
have no warm-up (their blocks load while the previous epoch ends). W >= K turns it off. A
resumed run keeps the warm-up it started with (its snapshot records it).

Everything is seeded from (plan seed, source name, epoch[, block]) so it never depends on list
position, worker count or dp size: the same plan and seed give the same order anywhere. Blocks
split an epoch's units into ``ceil(n / K)`` runs of near-equal length (the last block is not a
remainder). With K = 1 a block is a unit and its documents are permuted with the unit's own
seed, the order of a source read unit by unit. Piece rows name documents by their unit and their
index in the unit's *file* order (so a constructor needs no permutation); the stream walks them
in *shuffled* order, by block position and position in the block.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from stable names and numbers (never from list positions or ranks)."""
    h = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


WARMUP_SHARE = 8  # the warm-up blocks hold at most 1/8 of a source's units


@dataclass(slots=True)
class BlockMap:
    """Where each document of an assembled block comes from, in the block's shuffled order."""

    units: np.ndarray  # the block's units, in epoch order
    unit_of: np.ndarray  # int64 [docs]: the unit of the document at each shuffled position
    doc_of: np.ndarray  # int64 [docs]: its index in the unit's file order
    inverse: np.ndarray  # int64 [docs]: shuffled position of the concatenation's k-th document
    starts: dict  # unit -> offset of its first document in the concatenation (epoch order)


@dataclass(slots=True)
class SourceOrder:
    name: str
    seed: int
    n_units: int
    block_units: int = 1  # K: units whose documents are permuted together
    warmup_units: int = 0  # W: epoch 0's first block (then 2W, 4W, ... below K); 0 or >= K: none
    maps: dict = field(default_factory=dict)  # (epoch, block) -> BlockMap of an assembled block
    _epochs: dict = field(default_factory=dict)  # epoch -> (unit order, its inverse): the current and previous epoch
    _bounds: dict = field(default_factory=dict)  # 0 (epoch 0) or 1 (any later epoch) -> block starts, then n_units

    @property
    def n_blocks(self) -> int:
        """Blocks in the epoch that has the most (epoch 0, with a warm-up): a bound for a pass."""
        return self.n_blocks_of(0)

    def n_blocks_of(self, epoch: int) -> int:
        return len(self._starts(epoch)) - 1

    def _starts(self, epoch: int) -> np.ndarray:
        """Unit positions where ``epoch``'s blocks start, then ``n_units``: epoch 0's warm-up blocks,
        then near-equal runs of at most K units (the last block is not a remainder)."""
        first = 0 if epoch == 0 else 1
        starts = self._bounds.get(first)
        if starts is None:
            n, k = self.n_units, max(1, self.block_units)
            ramp, size = [], self.warmup_units
            while first == 0 and 0 < size < k and (sum(ramp) + size) * WARMUP_SHARE <= n:
                ramp.append(size)
                size *= 2
            done = sum(ramp)
            nb = max(1, -(-(n - done) // k))
            starts = np.array(
                np.cumsum([0] + ramp)[:-1].tolist() + [done + b * (n - done) // nb for b in range(nb)] + [n], np.int64
            )
            self._bounds[first] = starts
        return starts

    # ---- units --------------------------------------------------------------------------------
    def units(self, epoch: int) -> np.ndarray:
        """The units of ``epoch`` in the order they are planned."""
        return self._order_and_rank(epoch)[0]

    def position(self, epoch: int, unit: int) -> int:
        """Where ``unit`` stands in ``epoch``'s unit order."""
        return int(self._order_and_rank(epoch)[1][unit])

    def _order_and_rank(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        o = self._epochs.get(epoch)
        if o is None:
            order = np.random.default_rng(stable_seed(self.seed, "units", self.name, epoch)).permutation(self.n_units)
            o = (order, np.argsort(order))
            self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1}
            self._epochs[epoch] = o
        return o

    # ---- blocks ---------------------------------------------------------------------------------
    def block_bounds(self, epoch: int, block: int) -> tuple[int, int]:
        """Unit positions ``[lo, hi)`` of ``block`` of ``epoch``."""
        starts = self._starts(epoch)
        return int(starts[block]), int(starts[block + 1])

    def block_units_of(self, epoch: int, block: int) -> np.ndarray:
        """The units of ``block`` in ``epoch``, in epoch order."""
        lo, hi = self.block_bounds(epoch, block)
        return self.units(epoch)[lo:hi]

    def block_of(self, epoch: int, unit: int) -> int:
        """The block ``unit`` belongs to in ``epoch``."""
        return int(np.searchsorted(self._starts(epoch), self.position(epoch, unit), side="right")) - 1

    def next_block(self, epoch: int, block: int) -> tuple[int, int]:
        """The block after ``block`` (the next epoch's first at the end)."""
        return (epoch, block + 1) if block + 1 < self.n_blocks_of(epoch) else (epoch + 1, 0)

    def first_unit_position(self, epoch: int, block: int) -> tuple[int, int]:
        """``(epoch, unit position)`` where ``block`` starts."""
        return epoch, self.block_bounds(epoch, block)[0]

    def assemble(self, key: tuple[int, int], unit_lengths: list[np.ndarray]) -> np.ndarray:
        """The document lengths of block ``key`` (its units' lengths, in the block's epoch order)
        in its shuffled order; the map from there to units and documents is kept."""
        e, b = key
        units = self.block_units_of(e, b)
        counts = np.array([len(x) for x in unit_lengths], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        n = int(offsets[-1])
        lengths = np.concatenate(unit_lengths).astype(np.int64) if n else np.zeros(0, np.int64)
        if self.block_units == 1:  # a unit alone: its own documents' seed (the order read unit by unit)
            seed = stable_seed(self.seed, "docs", self.name, e, int(units[0]))
        else:
            seed = stable_seed(self.seed, "block", self.name, self.block_units, e, b)
        perm = np.random.default_rng(seed).permutation(n) if n > 1 else np.arange(n)
        which = np.repeat(np.arange(len(units)), counts)  # unit index of each concatenated document
        inverse = np.empty(n, dtype=np.int64)
        inverse[perm] = np.arange(n)
        self.maps[key] = BlockMap(
            units=units,
            unit_of=units[which[perm]].astype(np.int64),
            doc_of=(perm - offsets[which[perm]]).astype(np.int64),
            inverse=inverse,
            starts={int(u): int(o) for u, o in zip(units, offsets[:-1])},
        )
        return lengths[perm]

    def file_docs(self, key: tuple[int, int], shuffled) -> tuple[np.ndarray, np.ndarray]:
        """``(units, documents in file order)`` of positions ``shuffled`` of block ``key``."""
        m = self.maps[key]
        return m.unit_of[shuffled], m.doc_of[shuffled]

    def shuffled_doc(self, key: tuple[int, int], unit: int, file_doc: int) -> int:
        """The position in block ``key``'s shuffled order of ``unit``'s document ``file_doc``."""
        m = self.maps[key]
        return int(m.inverse[m.starts[int(unit)] + int(file_doc)])

    def forget(self, key: tuple[int, int]) -> None:
        """A block no longer loaded."""
        self.maps.pop(key, None)
