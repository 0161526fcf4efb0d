"""Per-source streams: each source's own order, position and loaded metadata, inside the planner.

A source's order is a seeded permutation of its load units per epoch and, inside each unit (a
bounded window of documents), a seeded permutation of its documents; both are seeded from (plan
seed, source name, epoch[, unit]) so they never depend on list position, worker count or dp size.
The position is a small cursor ``(epoch, pos, doc, tok)``: the next piece is the ``tok``-th token
onward of the ``doc``-th document (in shuffled order) of unit ``order[pos]``. Piece rows name
documents by their index in the unit's file order, so the constructor needs no permutation.
Documents longer than the piece size are cut into consecutive pieces, each a sample in its own
right (same sample id, increasing chunk index).

The stream only knows lengths of units whose metadata arrived; ``peek()`` returns ``None`` when the
next unit is not loaded yet, and the planner then waits instead of substituting another sample:
that is what keeps the stream independent of load timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import SourceError
from .lookahead import LoadRequests
from .order import SourceOrder

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
class ClassView:
    """One length class of a source ("long" or "short"), which selection treats as a source of
    its own (its own weight, its own cursor)."""

    stream: "SourceStream"
    cls: str

    @property
    def name(self) -> str:
        return self.stream.name

    @property
    def piece_tokens(self) -> int:
        return self.stream.piece_tokens

    def pieces_ahead(self, min_tokens: int) -> tuple[np.ndarray, bool]:
        return self.stream.pieces_ahead(min_tokens, self.cls)

    def take(self, rows: np.ndarray) -> None:
        self.stream.take(rows, self.cls)


@dataclass(slots=True)
class SourceStream:
    name: str
    index: int
    n_units: int
    first_ids: np.ndarray  # int64 [n_units]
    seed: int
    piece_tokens: int
    drop_over: int | None = None  # context policy 'drop': documents longer than this are skipped
    # cursor of the next piece to plan
    epoch: int = 0
    pos: int = 0
    doc: int = 0
    tok: int = 0
    lengths: dict = field(default_factory=dict)  # (epoch, unit) -> int64 lengths, loaded and not yet fully planned
    epoch_tokens: int = 0  # tokens planned in the current epoch (to detect an all-empty source)
    vision: dict = field(default_factory=dict)  # (epoch, unit) -> (image tokens, length) per document in file order
    drops: dict = field(default_factory=dict)  # (epoch, unit, doc) -> tokens of a dropped document, until drained
    split: int = 0  # > 0: read by length class, documents over this many tokens are "long"
    long_cur: list | None = None  # [epoch, pos, doc, tok] of the long class while split
    split_wanted: bool = False
    evict_after: int = 4  # units between the class cursors further than this past the trailing one are evicted
    ordering: SourceOrder = field(init=False)  # unit and document order (order.py)
    loads: LoadRequests = field(init=False)  # the loading look-ahead (lookahead.py)

    def __post_init__(self) -> None:
        self.ordering = SourceOrder(self.name, self.seed, self.n_units)
        self.loads = LoadRequests(self.n_units, self.evict_after)

    # ---- cursor -------------------------------------------------------------------------------
    def cursor(self) -> tuple:
        """``(epoch, pos, doc, tok, epoch_tokens)``, plus ``(split, *long cursor, wanted)`` while
        reading by length class."""
        base = (self.epoch, self.pos, self.doc, self.tok, self.epoch_tokens)
        return base + ((self.split, *self.long_cur, int(self.split_wanted)) if self.split else ())

    def restore(self, cur) -> None:
        self.epoch, self.pos, self.doc, self.tok, self.epoch_tokens = cur[:5]
        if len(cur) > 5:
            self.split, self.long_cur, self.split_wanted = int(cur[5]), [int(x) for x in cur[6:10]], bool(cur[10])
        else:
            self.split, self.long_cur, self.split_wanted = 0, None, False

    def _unit_here(self) -> tuple[int, int]:
        return self.epoch, int(self.ordering.units(self.epoch)[self.pos])

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
            doc = self.ordering.file_doc(key, self.doc)
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

    # ---- length classes (a stage's long-document share) ----------------------------------------
    # With ``split = T`` the source is read with two cursors in its one order: the main cursor
    # takes only documents of at most T tokens ("short"), ``long_cur`` only longer ones ("long").
    # Each document belongs to one class, so each is delivered once; the docs between the cursors
    # that the leading class skipped wait for the trailing one (their units are evicted and
    # reloaded when it gets there, so the gap costs no memory). When no stage asks for a share
    # any more, both classes are read merged in the source's order until the cursors meet.

    def set_split(self, threshold: int | None) -> None:
        """Read by length class from now on (``threshold``), or stop wanting it (None)."""
        self.split_wanted = threshold is not None
        if threshold is not None and not self.split:
            self.split = int(threshold)
            self.long_cur = [self.epoch, self.pos, self.doc, self.tok]
        elif threshold is None:
            self._try_unsplit()

    def class_cursor(self, cls: str | None) -> list[int]:
        return self.long_cur if cls == "long" else [self.epoch, self.pos, self.doc, self.tok]

    def _set_cur(self, cls: str | None, e: int, pos: int, doc: int, tok: int) -> None:
        if cls == "long":
            self.long_cur = [e, pos, doc, tok]
        else:
            self.epoch, self.pos, self.doc, self.tok = e, pos, doc, tok

    def class_mask(self, L: np.ndarray, cls: str | None) -> np.ndarray | None:
        if cls is None or not self.split:
            return None
        return L > self.split if cls == "long" else L <= self.split

    def trailing(self) -> tuple:
        """The cursor behind: of the two length classes while split, else the one cursor."""
        main = tuple(self.class_cursor("short"))
        return min(main, tuple(self.long_cur)) if self.split else main

    def leading(self) -> tuple:
        """The cursor ahead (see ``trailing``)."""
        main = tuple(self.class_cursor("short"))
        return max(main, tuple(self.long_cur)) if self.split else main

    def _try_unsplit(self) -> None:
        """Back to one cursor once the trailing class has nothing left before the leading cursor."""
        if not self.split or self.split_wanted:
            return
        main = tuple(self.class_cursor("short"))
        lead, trail_cls = (tuple(self.long_cur), "short") if tuple(self.long_cur) >= main else (main, "long")
        e, pos, doc, tok = self.class_cursor(trail_cls)
        while (e, pos, doc) < lead[:3]:
            unit = int(self.ordering.units(e)[pos])
            lens = self.lengths.get((e, unit))
            if lens is None:
                return  # not loaded: cannot tell yet
            stop = lead[2] if (e, pos) == lead[:2] else len(lens)
            mine = self.class_mask(lens[doc:stop], trail_cls)
            first = doc + (int(np.argmax(mine)) if mine.any() else stop - doc)
            if first < stop:
                return  # a document of the trailing class is still unconsumed before the leading cursor
            doc, tok = 0, 0
            e, pos = self.ordering.next_unit(e, pos)
            if (e, pos) > lead[:2]:
                break
        self.epoch, self.pos, self.doc, self.tok = lead
        self.split, self.long_cur = 0, None

    # ---- vectorised access (the balancing planner) --------------------------------------------
    def pieces_ahead(self, min_tokens: int, cls: str | None = None) -> tuple[np.ndarray, bool]:
        """Upcoming pieces as int64 rows ``[epoch, unit, doc, start, stop]`` (of length class
        ``cls``, or every class in the source's order), covering at least ``min_tokens`` tokens
        if that much metadata is loaded. Returns (rows, enough); numpy per unit."""
        if not self.split or cls is not None:
            rows, _, total, enough = self._scan(cls if self.split else None, min_tokens)
            return rows, enough
        # merged order: the trailing class for min_tokens, the other one up to where that ends
        trail = "short" if tuple(self.class_cursor("short")) <= tuple(self.long_cur) else "long"
        other = "long" if trail == "short" else "short"
        rt, kt, _, enough = self._scan(trail, min_tokens)
        if not enough:
            return rt, False
        ro, ko, _, loaded = self._scan(other, 0, until=tuple(kt[-1]))
        if not loaded:
            return np.zeros((0, 5), np.int64), False
        keep = np.array([tuple(k) <= tuple(kt[-1]) for k in ko.tolist()], dtype=bool)
        rows, keys = np.concatenate([rt, ro[keep]]), np.concatenate([kt, ko[keep]])
        return rows[np.lexsort(keys.T[::-1])], True

    def _scan(self, cls: str | None, min_tokens: int, until: tuple | None = None) -> tuple[np.ndarray, np.ndarray, int, bool]:
        """Rows of class ``cls`` from its cursor, their order keys ``[epoch, pos, doc position,
        start]``, their tokens, and whether ``min_tokens`` were reached (with ``until``, a key:
        every unit up to that key's unit instead, and whether they were all loaded)."""
        rows: list[np.ndarray] = []
        keys: list[np.ndarray] = []
        total = 0
        e, pos, doc, tok = self.class_cursor(cls)
        empty_units = 0
        while (total < min_tokens) if until is None else ((e, pos) <= tuple(until[:2])):
            unit = int(self.ordering.units(e)[pos])
            lens = self.lengths.get((e, unit))
            if lens is None:
                return (np.concatenate(rows) if rows else np.zeros((0, 5), np.int64),
                        np.concatenate(keys) if keys else np.zeros((0, 4), np.int64), total, False)
            L = lens[doc:]
            if len(L):
                rem = L.copy()
                rem[0] -= tok
                mask = self.class_mask(L, cls)
                if mask is not None:
                    rem[~mask] = 0
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
                    block[:, 0], block[:, 1], block[:, 2], block[:, 3], block[:, 4] = e, unit, self.ordering.file_doc((e, unit), d + doc), start, stop
                    rows.append(block)
                    key = np.empty((k_total, 4), dtype=np.int64)
                    key[:, 0], key[:, 1], key[:, 2], key[:, 3] = e, pos, d + doc, start
                    keys.append(key)
                    total += int((stop - start).sum())
                    empty_units = 0
                else:
                    empty_units += 1
            else:
                empty_units += 1
            if empty_units > self.n_units and until is None:
                if cls is not None and self.split:
                    raise SourceError(f"source {self.name!r} has no {cls} documents (long: over long_tokens={self.split} tokens) "
                                      "in a whole pass over its files; leave it out of the stage's long_sources")
                raise SourceError(f"source {self.name!r} is empty: a whole pass over its files found no tokens")
            doc, tok = 0, 0
            e, pos = self.ordering.next_unit(e, pos)
        out = np.concatenate(rows) if rows else np.zeros((0, 5), dtype=np.int64)
        kout = np.concatenate(keys) if keys else np.zeros((0, 4), dtype=np.int64)
        return out, kout, total, (total >= min_tokens) if until is None else True

    def take(self, rows: np.ndarray, cls: str | None = None) -> None:
        """The planner took ``rows``, a prefix of ``pieces_ahead(.., cls)``: move the cursors past them."""
        if not len(rows):
            return
        if not self.split or cls is not None:
            self.advance_past(rows[-1], cls if self.split else None)
            return
        lens = np.array([self.lengths[(int(e), int(u))][self.ordering.shuffled_doc((int(e), int(u)), int(d))] for e, u, d in rows[:, :3].tolist()])
        is_long = lens > self.split
        for c, sel in (("short", ~is_long), ("long", is_long)):
            if sel.any():
                self.advance_past(rows[np.flatnonzero(sel)[-1]], c)
        self._try_unsplit()

    def advance_past(self, row: np.ndarray, cls: str | None = None) -> None:
        """Move the cursor (of class ``cls``) just past piece ``row`` = [epoch, unit, doc, start,
        stop], recording the documents the drop policy skipped on the way."""
        e, unit, file_doc, _, stop = (int(x) for x in row)
        doc = self.ordering.shuffled_doc((e, unit), file_doc)
        if self.drop_over is not None:
            self._record_drops(e, self.ordering.position(e, unit), doc, cls)
        L = int(self.lengths[(e, unit)][doc])
        self._set_cur(cls, e, self.ordering.position(e, unit), *((doc + 1, 0) if stop >= L else (doc, stop)))
        self.epoch_tokens = 1  # this epoch has tokens: the empty-source check is satisfied

    def _record_drops(self, epoch: int, pos: int, doc: int, cls: str | None = None) -> None:
        """Record the documents over ``drop_over`` (of class ``cls``) between that class's cursor
        and (epoch, pos, doc)."""
        e, p, d, tok = self.class_cursor(cls)
        while (e, p) <= (epoch, pos):
            unit = int(self.ordering.units(e)[p])
            lens = self.lengths.get((e, unit))
            if lens is not None:
                hi = doc if (e, p) == (epoch, pos) else len(lens)
                idx = np.arange(d, hi)
                if tok and len(idx):
                    idx = idx[1:]  # a started document is finished, never dropped
                over = lens[idx] > self.drop_over
                mask = self.class_mask(lens[idx], cls)
                for k in idx[over if mask is None else over & mask].tolist():
                    self.drops[(e, unit, self.ordering.file_doc((e, unit), k))] = int(lens[k])
            d, tok = 0, 0
            e, p = self.ordering.next_unit(e, p)

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
        """Loaded units no longer needed for planning: wholly behind the (trailing) cursor, or,
        while reading by length class, between the cursors and far from the trailing one
        (evicted: loaded again when the trailing cursor gets near)."""
        done = [key for key in self.lengths if self._behind(*key)]
        if self.split:
            te, tp = self.trailing()[:2]
            le, lp = self.leading()[:2]
            far = (te * self.n_units + tp) + max(self.evict_after, self.loads.keep_units)
            for e, u in self.lengths:
                p = self.ordering.position(e, u)
                if (e, p) < (le, lp) and e * self.n_units + p > far:
                    done.append((e, u))
        for key in done:
            del self.lengths[key]
            self.ordering.forget(key)
        return done

    def _behind(self, epoch: int, unit: int) -> bool:
        te, tp = self.trailing()[:2]
        return epoch < te or (epoch == te and self.ordering.position(epoch, unit) < tp)

    # ---- loading -------------------------------------------------------------------------------
    def unplanned_tokens(self) -> int:
        """Loaded tokens not planned yet (one cursor; while split, the look-ahead counts per class)."""
        total = 0
        for (e, u), lens in self.lengths.items():
            if (e, u) == self._unit_here():
                total += int(lens[self.doc :].sum()) - self.tok
            else:
                total += int(lens.sum())
        return total

    def add_lengths(self, epoch: int, unit: int, lengths: np.ndarray, vision: np.ndarray | None = None) -> bool:
        """Register a loaded unit's document lengths (and image tokens per document, for the
        encoder cost); idempotent (a recomputed load is ignored)."""
        key = (epoch, unit)
        self.loads.requested.discard(key)
        if key in self.lengths or self._behind(epoch, unit):
            return False  # a duplicate, or a unit the cursor has already passed
        lengths = np.asarray(lengths, dtype=np.int64)
        self.loads.arrived(epoch, unit, int(lengths.sum()))
        if vision is not None and np.any(vision):
            self.vision[key] = (np.asarray(vision, dtype=np.int64), lengths)
        self.lengths[key] = self.ordering.shuffle_docs(key, lengths)
        return True
