"""A source's order: a seeded permutation of its load units per epoch, and of the documents
inside each unit.

Both are seeded from (plan seed, source name, epoch[, unit]) so they never depend on list
position, worker count or dp size: the same plan and seed give the same order anywhere. Piece
rows name documents by their index in the unit's *file* order (so a constructor needs no
permutation); the stream walks them in *shuffled* order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from stable names and numbers (never from list positions or ranks)."""
    h = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True)
class SourceOrder:
    name: str
    seed: int
    n_units: int
    perms: dict = field(default_factory=dict)  # (epoch, unit) -> (document order, its inverse) of a loaded unit
    _epochs: dict = field(default_factory=dict)  # epoch -> (unit order, its inverse): the current and previous epoch

    def units(self, epoch: int) -> np.ndarray:
        """The units of ``epoch`` in the order they are planned."""
        return self._order_and_rank(epoch)[0]

    def position(self, epoch: int, unit: int) -> int:
        """Where ``unit`` stands in ``epoch``'s order."""
        return int(self._order_and_rank(epoch)[1][unit])

    def _order_and_rank(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        o = self._epochs.get(epoch)
        if o is None:
            order = np.random.default_rng(stable_seed(self.seed, "units", self.name, epoch)).permutation(self.n_units)
            o = (order, np.argsort(order))
            self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1}
            self._epochs[epoch] = o
        return o

    def next_unit(self, epoch: int, pos: int) -> tuple[int, int]:
        """The position after ``pos`` in ``epoch``'s order (the next epoch's first at the end)."""
        return (epoch, pos + 1) if pos + 1 < self.n_units else (epoch + 1, 0)

    def shuffle_docs(self, key: tuple[int, int], lengths: np.ndarray) -> np.ndarray:
        """A loaded unit's document lengths in its shuffled order (the permutation is kept)."""
        if len(lengths) <= 1:
            return lengths
        perm = np.random.default_rng(stable_seed(self.seed, "docs", self.name, *key)).permutation(len(lengths))
        self.perms[key] = (perm, np.argsort(perm))
        return lengths[perm]

    def file_doc(self, key: tuple[int, int], shuffled):
        """Document index in the unit's file order from its position in the shuffled order."""
        perm = self.perms.get(key)
        return shuffled if perm is None else perm[0][shuffled]

    def shuffled_doc(self, key: tuple[int, int], file_doc: int) -> int:
        """The inverse of :meth:`file_doc`."""
        perm = self.perms.get(key)
        return file_doc if perm is None else int(perm[1][file_doc])

    def forget(self, key: tuple[int, int]) -> None:
        """A unit no longer loaded."""
        self.perms.pop(key, None)
