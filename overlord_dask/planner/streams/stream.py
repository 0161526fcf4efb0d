"""Per-source streams: each source's own order, position and loaded metadata, inside the planner.

A source's order (``order.py``) is, per epoch, a seeded permutation of its load units cut into
shuffle blocks of ``loading.shuffle_units`` units, and inside each block a seeded permutation of
all its units' documents together; both are seeded from (plan seed, source name, epoch[, block])
so they never depend on list position, worker count or dp size. The position is a small cursor
``(epoch, pos, doc, tok)``: the next piece is the ``tok``-th token onward of the ``doc``-th
document (in shuffled order) of block ``pos``. Piece rows name documents by their unit and their
index in the unit's file order, so the constructor needs no permutation. Documents longer than
the piece size are cut into consecutive pieces, each a sample in its own right (same sample id,
increasing chunk index).

The stream knows the lengths of a block once every one of its units' metadata arrived
(``add_lengths`` keeps the units of a block that is not complete yet); ``peek()`` returns
``None`` when the next block is not loaded yet, and the planner then waits instead of
substituting another sample: that is what keeps the stream independent of load timing.

Two readers share the cursor: ``peek()``/``advance()`` a piece at a time (policy ``none``'s exact
per-step selection) and ``pieces_ahead()``/``take()`` as numpy rows (``rows.py``, the balancing
planner). Parts: ``order.py`` (unit and document permutations, blocks), ``lookahead.py`` (which
units to load next).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...errors import SourceError
from . import rows
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

    stream: SourceStream
    cls: str

    @property
    def name(self) -> str:
        return self.stream.name

    @property
    def piece_tokens(self) -> int:
        return self.stream.piece_tokens

    def pieces_ahead(self, min_tokens: int) -> tuple[np.ndarray, bool]:
        return self.stream.pieces_ahead(min_tokens, self.cls)

    def shortfall(self, need: int) -> tuple[int, tuple]:
        return self.stream.shortfall(need, self.cls)

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
    block_units: int = 1  # loading.shuffle_units: units whose documents are shuffled together
    warmup_units: int = 0  # loading.shuffle_warmup_units: the run's first block (order.py); 0: none
    drop_over: int | None = None  # context policy 'drop': documents longer than this are skipped
    # cursor of the next piece to plan
    epoch: int = 0
    pos: int = 0
    doc: int = 0
    tok: int = 0
    lengths: dict = field(default_factory=dict)  # (epoch, block) -> int64 lengths (shuffled), not yet fully planned
    arrived: dict = field(default_factory=dict)  # (epoch, unit) -> lengths of a unit whose block is not complete
    epoch_tokens: int = 0  # tokens planned in the current epoch (to detect an all-empty source)
    vision: dict = field(default_factory=dict)  # (epoch, unit) -> (image tokens, length) per document in file order
    drops: dict = field(default_factory=dict)  # (epoch, unit, doc) -> tokens of a dropped document, until drained
    split: int = 0  # > 0: read by length class, documents over this many tokens are "long"
    long_cur: list | None = None  # [epoch, pos, doc, tok] of the long class while split
    split_wanted: bool = False
    evict_after: int = 4  # blocks between the class cursors further than this past the trailing one are evicted
    ordering: SourceOrder = field(init=False)  # unit and document order (order.py)
    loads: LoadRequests = field(init=False)  # the loading look-ahead (lookahead.py)
    ahead: tuple | None = field(default=None, init=False, repr=False)  # rows scanned, not taken (rows.py)

    def __post_init__(self) -> None:
        self.ordering = SourceOrder(self.name, self.seed, self.n_units, self.block_units, self.warmup_units)
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

    def peek(self) -> Piece | None:
        """The next piece, or None if its block's lengths have not all arrived yet."""
        while True:
            key = (self.epoch, self.pos)
            lens = self.lengths.get(key)
            if lens is None:
                return None
            if self.doc >= len(lens):
                self._next_block()
                continue
            L = int(lens[self.doc])
            if self.tok >= L:  # empty document (or fully consumed): nothing to deliver
                self.doc += 1
                self.tok = 0
                continue
            unit, doc = (int(x) for x in self.ordering.file_docs(key, self.doc))
            if self.tok == 0 and self.drop_over is not None and L > self.drop_over:
                self.drops[(self.epoch, unit, doc)] = L
                self.doc += 1
                continue
            return Piece(self.index, self.epoch, unit, doc, self.tok, min(L, self.tok + self.piece_tokens))

    def advance(self, piece: Piece) -> None:
        self.epoch_tokens += piece.length
        self.tok = piece.stop
        lens = self.lengths[(self.epoch, self.pos)]
        if self.tok >= int(lens[self.doc]):
            self.doc += 1
            self.tok = 0

    def _next_block(self) -> None:
        self.doc = 0
        self.tok = 0
        self.pos += 1
        if self.pos >= self.ordering.n_blocks_of(self.epoch):
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
            self.try_unsplit()

    def class_cursor(self, cls: str | None) -> list[int]:
        return self.long_cur if cls == "long" else [self.epoch, self.pos, self.doc, self.tok]

    def set_class_cursor(self, cls: str | None, e: int, pos: int, doc: int, tok: int) -> None:
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

    def try_unsplit(self) -> None:
        """Back to one cursor once the trailing class has nothing left before the leading cursor."""
        if not self.split or self.split_wanted:
            return
        main = tuple(self.class_cursor("short"))
        lead, trail_cls = (tuple(self.long_cur), "short") if tuple(self.long_cur) >= main else (main, "long")
        e, pos, doc, _ = self.class_cursor(trail_cls)
        while (e, pos, doc) < lead[:3]:
            lens = self.lengths.get((e, pos))
            if lens is None:
                return  # not loaded: cannot tell yet
            stop = lead[2] if (e, pos) == lead[:2] else len(lens)
            mine = self.class_mask(lens[doc:stop], trail_cls)
            first = doc + (int(np.argmax(mine)) if mine.any() else stop - doc)
            if first < stop:
                return  # a document of the trailing class is still unconsumed before the leading cursor
            doc = 0
            e, pos = self.ordering.next_block(e, pos)
            if (e, pos) > lead[:2]:
                break
        self.epoch, self.pos, self.doc, self.tok = lead
        self.split, self.long_cur = 0, None

    # ---- numpy rows (the balancing planner; rows.py) ----------------------------------------------
    def pieces_ahead(self, min_tokens: int, cls: str | None = None) -> tuple[np.ndarray, bool]:
        return rows.pieces_ahead(self, min_tokens, cls)

    def shortfall(self, need: int, cls: str | None = None) -> tuple[int, tuple]:
        return rows.shortfall(self, need, cls)

    def take(self, taken: np.ndarray, cls: str | None = None) -> None:
        rows.take(self, taken, cls)

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
        """Units no longer needed for planning: those of blocks wholly behind the (trailing)
        cursor, or, while reading by length class, of blocks between the cursors and far from
        the trailing one (evicted: loaded again when the trailing cursor gets near)."""
        done = [key for key in self.lengths if self._behind(key)]
        if self.split:
            (te, tp), (le, lp) = self.trailing()[:2], self.leading()[:2]
            far = (te * self.ordering.n_blocks + tp) + max(self.evict_after, self.loads.keep_units)
            for e, b in self.lengths:
                if (e, b) < (le, lp) and e * self.ordering.n_blocks + b > far:
                    done.append((e, b))
        out = []
        for key in done:
            del self.lengths[key]
            self.ordering.forget(key)
            out += [(key[0], int(u)) for u in self.ordering.block_units_of(*key)]
        stale = [key for key in self.arrived if self.behind(*key)]  # (a unit reloaded for a block passed since)
        for key in stale:
            del self.arrived[key]
        return out

    def _behind(self, key: tuple[int, int]) -> bool:
        """Whether the (trailing) cursor has passed block ``key``."""
        te, tp = self.trailing()[:2]
        return key < (te, tp)

    def behind(self, epoch: int, unit: int) -> bool:
        """Whether the (trailing) cursor has passed the unit's block."""
        te, tp = self.trailing()[:2]
        return epoch < te or (epoch == te and self.ordering.block_of(epoch, unit) < tp)

    def loaded_units(self) -> int:
        """Units whose metadata is here (in assembled blocks, or waiting for the rest of theirs)."""
        return len(self.arrived) + sum(len(self.ordering.maps[k].units) for k in self.lengths)

    def has_unit(self, epoch: int, unit: int) -> bool:
        """Whether the unit's lengths are here (alone, or in its assembled block)."""
        return (epoch, unit) in self.arrived or (epoch, self.ordering.block_of(epoch, unit)) in self.lengths

    def order_key(self, epoch: int, unit: int, doc: int) -> tuple[int, int, int]:
        """``(epoch, block position, position in the block)`` of a unit's document (file order):
        where the stream walks it (its block must be assembled)."""
        b = self.ordering.block_of(epoch, unit)
        return epoch, b, self.ordering.shuffled_doc((epoch, b), unit, doc)

    # ---- loading -------------------------------------------------------------------------------
    def unplanned_tokens(self) -> int:
        """Loaded tokens not planned yet (one cursor; while split, the look-ahead counts per class):
        assembled blocks past the cursor, and the units of blocks not complete yet."""
        total = sum(int(lens.sum()) for lens in self.arrived.values())
        for key, lens in self.lengths.items():
            if key == (self.epoch, self.pos):
                total += int(lens[self.doc :].sum()) - self.tok
            else:
                total += int(lens.sum())
        return total

    def add_lengths(self, epoch: int, unit: int, lengths: np.ndarray, vision: np.ndarray | None = None) -> bool:
        """Register a loaded unit's document lengths (and image tokens per document, for the
        encoder cost); its block is assembled once all its units arrived. Idempotent (a
        recomputed load is ignored)."""
        key = (epoch, unit)
        self.loads.requested.discard(key)
        if self.has_unit(epoch, unit) or self.behind(epoch, unit):
            return False  # a duplicate, or a unit the cursor has already passed
        lengths = np.asarray(lengths, dtype=np.int64)
        images = vision is not None and bool(np.any(vision))
        self.loads.arrived(epoch, unit, int(lengths.sum()), images)
        if images:
            self.vision[key] = (np.asarray(vision, dtype=np.int64), lengths)
        self.arrived[key] = lengths
        b = self.ordering.block_of(epoch, unit)
        units = self.ordering.block_units_of(epoch, b)
        if all((epoch, int(u)) in self.arrived for u in units):
            parts = [self.arrived.pop((epoch, int(u))) for u in units]
            self.lengths[(epoch, b)] = self.ordering.assemble((epoch, b), parts)
        return True
