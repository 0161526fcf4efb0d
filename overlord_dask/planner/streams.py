"""Per-source streams: each source's own order, position and loaded metadata, inside the planner.

A source's order is a seeded permutation of its load units per epoch and, inside each unit (a
bounded window of documents), a seeded permutation of its documents; both are seeded from (plan
seed, source name, epoch[, unit]) so they never depend on list position, worker count or dp size.
The position is a small cursor ``(epoch, pos, doc, tok)``: the next piece is the ``tok``-th token
onward of the ``doc``-th document (in shuffled order) of unit ``order[pos]``. Piece rows name
documents by their index in the unit's file order, so the constructor needs no permutation. Documents longer than the piece size are cut into consecutive
pieces, each a sample in its own right (same sample id, increasing chunk index).

The stream only knows lengths of units whose metadata arrived; ``peek()`` returns ``None`` when the
next unit is not loaded yet, and the planner then waits instead of substituting another sample:
that is what keeps the stream independent of load timing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..errors import SourceError


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from stable names and numbers (never from list positions or ranks)."""
    h = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


@dataclass(slots=True)
class Piece:
    source: int  # index of the source in the plan
    epoch: int
    unit: int
    doc: int  # document index inside the unit
    start: int  # first token of the piece inside the document
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    def as_list(self) -> list[int]:
        return [self.source, self.epoch, self.unit, self.doc, self.start, self.stop]


@dataclass(slots=True)
class SourceStream:
    name: str
    index: int
    n_units: int
    first_ids: np.ndarray  # int64 [n_units]
    seed: int
    piece_tokens: int
    shuffle_units: bool = True
    shuffle_docs: bool = True
    drop_over: int | None = None  # context policy 'drop': documents longer than this are skipped
    # cursor of the next piece to plan
    epoch: int = 0
    pos: int = 0
    doc: int = 0
    tok: int = 0
    # cursor of the next unit to request for loading
    req_epoch: int = 0
    req_pos: int = 0
    lengths: dict = field(default_factory=dict)  # (epoch, unit) -> int64 lengths, loaded and not yet fully planned
    requested: set = field(default_factory=set)  # (epoch, unit) requested, lengths not yet arrived
    epoch_tokens: int = 0  # tokens planned in the current epoch (to detect an all-empty source)
    perms: dict = field(default_factory=dict)  # (epoch, unit) -> document order inside the unit
    vision: dict = field(default_factory=dict)  # (epoch, unit) -> (image tokens, length) per document in file order
    drops: dict = field(default_factory=dict)  # (epoch, unit, doc) -> tokens of a dropped document, until drained
    _orders: dict = field(default_factory=dict)

    def order(self, epoch: int) -> np.ndarray:
        """The units of ``epoch`` in the order they are planned."""
        return self._order_and_rank(epoch)[0]

    def position(self, epoch: int, unit: int) -> int:
        """Where ``unit`` stands in ``epoch``'s order."""
        return int(self._order_and_rank(epoch)[1][unit])

    def _order_and_rank(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        o = self._orders.get(epoch)
        if o is None:
            if self.shuffle_units:
                rng = np.random.default_rng(stable_seed(self.seed, "units", self.name, epoch))
                order = rng.permutation(self.n_units)
            else:
                order = np.arange(self.n_units)
            o = (order, np.argsort(order))
            self._orders = {e: v for e, v in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = o
        return o

    # ---- cursor -------------------------------------------------------------------------------
    def cursor(self) -> tuple[int, int, int, int, int]:
        return (self.epoch, self.pos, self.doc, self.tok, self.epoch_tokens)

    def restore(self, cur: tuple[int, int, int, int, int]) -> None:
        self.epoch, self.pos, self.doc, self.tok, self.epoch_tokens = cur

    def _unit_here(self) -> tuple[int, int]:
        return self.epoch, int(self.order(self.epoch)[self.pos])

    def peek(self) -> Piece | None:
        """The next piece, or None if its unit's lengths have not arrived yet."""
        while True:
            key = self._unit_here()
            lens = self.lengths.get(key)
            if lens is None:
                return None
            if self.doc >= len(lens):
                self._next_unit()
                continue
            L = int(lens[self.doc])
            if self.tok >= L:  # empty document (or fully consumed): nothing to deliver
                self.doc += 1
                self.tok = 0
                continue
            doc = self._file_doc(key, self.doc)
            if self.tok == 0 and self.drop_over is not None and L > self.drop_over:
                self.drops[(key[0], key[1], doc)] = L
                self.doc += 1
                continue
            return Piece(self.index, key[0], key[1], doc, self.tok, min(L, self.tok + self.piece_tokens))

    def advance(self, piece: Piece) -> None:
        self.epoch_tokens += piece.length
        self.tok = piece.stop
        lens = self.lengths[(piece.epoch, piece.unit)]
        if self.tok >= int(lens[self.doc]):
            self.doc += 1
            self.tok = 0

    def _next_unit(self) -> None:
        self.doc = 0
        self.tok = 0
        self.pos += 1
        if self.pos >= self.n_units:
            if self.epoch_tokens == 0:
                raise SourceError(f"source {self.name!r} is empty: a whole pass over its files found no tokens")
            self.epoch += 1
            self.pos = 0
            self.epoch_tokens = 0

    # ---- vectorised access (the balancing planner) --------------------------------------------
    def pieces_ahead(self, min_tokens: int) -> tuple[np.ndarray, bool]:
        """Upcoming pieces from the cursor as int64 rows ``[epoch, unit, doc, start, stop]``,
        covering at least ``min_tokens`` tokens if that much metadata is loaded. Returns
        (rows, enough); numpy per unit, no Python loop per document."""
        rows: list[np.ndarray] = []
        total = 0
        e, pos, doc, tok = self.epoch, self.pos, self.doc, self.tok
        empty_units = 0
        while total < min_tokens:
            unit = int(self.order(e)[pos])
            lens = self.lengths.get((e, unit))
            if lens is None:
                break
            L = lens[doc:]
            if len(L):
                rem = L.copy()
                rem[0] -= tok
                if self.drop_over is not None:  # dropped documents yield no pieces (a started one finishes)
                    dropped = L > self.drop_over
                    dropped[0] &= tok == 0
                    rem[dropped] = 0
                n = np.where(rem > 0, -(-rem // self.piece_tokens), 0)
                k_total = int(n.sum())
                if k_total:
                    d = np.repeat(np.arange(len(L)), n)
                    k = np.arange(k_total) - np.repeat(np.cumsum(n) - n, n)
                    start = k * self.piece_tokens + np.where(d == 0, tok, 0)
                    stop = np.minimum(start + self.piece_tokens, L[d])
                    block = np.empty((k_total, 5), dtype=np.int64)
                    block[:, 0], block[:, 1], block[:, 2], block[:, 3], block[:, 4] = e, unit, self._file_doc((e, unit), d + doc), start, stop
                    rows.append(block)
                    total += int((stop - start).sum())
                    empty_units = 0
                else:
                    empty_units += 1
            else:
                empty_units += 1
            if empty_units > self.n_units:
                raise SourceError(f"source {self.name!r} is empty: a whole pass over its files found no tokens")
            doc, tok = 0, 0
            pos += 1
            if pos >= self.n_units:
                e, pos = e + 1, 0
        out = np.concatenate(rows) if rows else np.zeros((0, 5), dtype=np.int64)
        return out, total >= min_tokens

    def advance_past(self, row: np.ndarray) -> None:
        """Move the cursor just past piece ``row`` = [epoch, unit, doc, start, stop] (recording the
        documents the drop policy skipped on the way)."""
        e, unit, file_doc, _, stop = (int(x) for x in row)
        doc = self._shuffled_doc((e, unit), file_doc)
        if self.drop_over is not None:
            self._record_drops(e, self.position(e, unit), doc)
        self.epoch, self.pos = e, self.position(e, unit)
        L = int(self.lengths[(e, unit)][doc])
        self.doc, self.tok = (doc + 1, 0) if stop >= L else (doc, stop)
        self.epoch_tokens = 1  # this epoch has tokens: the empty-source check is satisfied

    def _record_drops(self, epoch: int, pos: int, doc: int) -> None:
        """Record the documents over ``drop_over`` between the cursor and (epoch, pos, doc)."""
        e, p, d, tok = self.epoch, self.pos, self.doc, self.tok
        while (e, p) <= (epoch, pos):
            unit = int(self.order(e)[p])
            lens = self.lengths.get((e, unit))
            if lens is not None:
                hi = doc if (e, p) == (epoch, pos) else len(lens)
                idx = np.arange(d, hi)
                if tok and len(idx):
                    idx = idx[1:]  # a started document is finished, never dropped
                for k in idx[lens[idx] > self.drop_over].tolist():
                    self.drops[(e, unit, self._file_doc((e, unit), k))] = int(lens[k])
            d, tok, p = 0, 0, p + 1
            if p >= self.n_units:
                e, p = e + 1, 0

    def _file_doc(self, key: tuple[int, int], shuffled):
        """Document index in the unit's file order from its position in the shuffled order."""
        perm = self.perms.get(key)
        return shuffled if perm is None else perm[0][shuffled]

    def _shuffled_doc(self, key: tuple[int, int], file_doc: int) -> int:
        perm = self.perms.get(key)
        return file_doc if perm is None else int(perm[1][file_doc])

    def piece_vision(self, rows: np.ndarray) -> np.ndarray:
        """Image tokens in pieces ``[.., epoch, unit, doc, start, stop]`` (last five columns) of
        this source: the document's image tokens in proportion to the piece's share of it."""
        out = np.zeros(len(rows))
        if not self.vision:
            return out
        for k, (e, u, d, a, b) in enumerate(rows[:, -5:].tolist()):
            v = self.vision.get((e, u))
            if v is not None and v[1][d]:
                out[k] = v[0][d] * (b - a) / v[1][d]
        return out

    def finished_units(self) -> list[tuple[int, int]]:
        """Loaded units wholly behind the cursor: their blocks are no longer needed for planning."""
        done = [key for key in self.lengths if self._behind(*key)]
        for key in done:
            del self.lengths[key]
            self.perms.pop(key, None)
        return done

    def _behind(self, epoch: int, unit: int) -> bool:
        return epoch < self.epoch or (epoch == self.epoch and self.position(epoch, unit) < self.pos)

    # ---- loading look-ahead -------------------------------------------------------------------
    def unplanned_tokens(self) -> int:
        total = 0
        for (e, u), lens in self.lengths.items():
            if (e, u) == self._unit_here():
                total += int(lens[self.doc :].sum()) - self.tok
            else:
                total += int(lens.sum())
        return total

    def want(self, target_tokens: int, max_inflight: int) -> list[tuple[int, int]]:
        """Next units to load so that about ``target_tokens`` unplanned tokens are at hand."""
        out = []
        # never request units behind the planning cursor (after a restore, say)
        if (self.req_epoch, self.req_pos) < (self.epoch, self.pos):
            self.req_epoch, self.req_pos = self.epoch, self.pos
        have = self.unplanned_tokens()
        while len(self.requested) < max_inflight and (have < target_tokens or not self.lengths and not self.requested):
            key = (self.req_epoch, int(self.order(self.req_epoch)[self.req_pos]))
            self.req_pos += 1
            if self.req_pos >= self.n_units:
                self.req_epoch += 1
                self.req_pos = 0
            if key in self.lengths or key in self.requested:
                continue
            self.requested.add(key)
            out.append(key)
            if have >= target_tokens:
                break
        return out

    def add_lengths(self, epoch: int, unit: int, lengths: np.ndarray, vision: np.ndarray | None = None) -> bool:
        """Register a loaded unit's document lengths (and image tokens per document, for the
        encoder cost); idempotent (a recomputed load is ignored)."""
        key = (epoch, unit)
        self.requested.discard(key)
        if key in self.lengths or self._behind(epoch, unit):
            return False  # a duplicate, or a unit the cursor has already passed
        lengths = np.asarray(lengths, dtype=np.int64)
        if vision is not None and np.any(vision):
            self.vision[key] = (np.asarray(vision, dtype=np.int64), lengths)
        if self.shuffle_docs and len(lengths) > 1:
            rng = np.random.default_rng(stable_seed(self.seed, "docs", self.name, epoch, unit))
            perm = rng.permutation(len(lengths))
            self.perms[key] = (perm, np.argsort(perm))
            lengths = lengths[perm]
        self.lengths[key] = lengths
        return True
