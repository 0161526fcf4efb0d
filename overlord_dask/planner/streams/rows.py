"""Reading a source as numpy rows: the balancing planner's view of a stream.

Weighted fair queuing (``balance.wfq_select``) asks each stream for its upcoming pieces as int64
rows ``[epoch, unit, doc, start, stop]`` (numpy per block, no Python object per piece), takes a
prefix of them, and moves the stream's cursor past what it took. While a source is read by
length class, each class has its own cursor, and rows of "every class" come in the source's
merged order. Documents a drop policy skips yield no rows; they are recorded as the cursor
passes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...errors import SourceError

if TYPE_CHECKING:
    from .stream import SourceStream


def pieces_ahead(s: SourceStream, min_tokens: int, cls: str | None = None) -> tuple[np.ndarray, bool]:
    """Upcoming pieces as int64 rows ``[epoch, unit, doc, start, stop]`` (of length class
    ``cls``, or every class in the source's order), covering at least ``min_tokens`` tokens
    if that much metadata is loaded. Returns (rows, enough); numpy per block."""
    if not s.split:
        return _ahead(s, min_tokens)
    s.ahead = None
    if cls is not None:
        rows, _, total, enough = _scan(s, cls, min_tokens, keys=False)
        return rows, enough
    # merged order: the trailing class for min_tokens, the other one up to where that ends
    trail = "short" if tuple(s.class_cursor("short")) <= tuple(s.long_cur) else "long"
    other = "long" if trail == "short" else "short"
    rt, kt, _, enough = _scan(s, trail, min_tokens)
    if not enough:
        return rt, False
    ro, ko, _, loaded = _scan(s, other, 0, until=tuple(kt[-1]))
    if not loaded:
        return np.zeros((0, 5), np.int64), False
    keep = np.array([tuple(k) <= tuple(kt[-1]) for k in ko.tolist()], dtype=bool)
    rows, keys = np.concatenate([rt, ro[keep]]), np.concatenate([kt, ko[keep]])
    return rows[np.lexsort(keys.T[::-1])], True


def _key(s: SourceStream) -> tuple:
    """What the rows ahead of a (single) cursor depend on, besides the lengths of the blocks."""
    return (s.epoch, s.pos, s.doc, s.tok, s.piece_tokens, s.drop_over, s.split)


def _ahead(s: SourceStream, min_tokens: int) -> tuple[np.ndarray, bool]:
    """:func:`pieces_ahead` of a source read with one cursor. The rows a call scanned and the
    planner did not take (weighted fair queuing asks for a quarter more than it takes, and a
    window's top-up asks again) are kept (``s.ahead``: the cursor they start at, the rows, and
    the tokens up to the end of each, counted from an earlier cursor), and the next call from
    that cursor answers with as many of them as hold ``min_tokens``, scanning on from where they
    end only if they hold fewer. The rows from a cursor are the same however they were scanned:
    a block's lengths never change while it is ahead of the cursor, and anything else they
    depend on is in the key."""
    key = _key(s)
    if s.ahead is not None and s.ahead[0] == key:
        _, rows, ends, base = s.ahead
        total = int(ends[-1]) - base if len(rows) else 0
        if total >= min_tokens:
            return rows[: int(np.searchsorted(ends, base + min_tokens)) + 1], True
        start, started = _past(s, rows[-1]) if len(rows) else (None, False)
        more, _, got, enough = _scan(s, None, min_tokens - total, keys=False, start=start, started=started)
        ends = np.concatenate([ends, base + total + np.cumsum(more[:, 4] - more[:, 3])])
        rows = np.concatenate([rows, more])
    else:
        rows, _, _, enough = _scan(s, None, min_tokens, keys=False)
        ends, base = np.cumsum(rows[:, 4] - rows[:, 3]), 0
    s.ahead = (key, rows, ends, base)
    return rows, enough


def _past(s: SourceStream, row: np.ndarray) -> tuple[tuple, bool]:
    """The cursor just past piece ``row`` as a scan from the start would reach it, and whether
    that is inside the block the row is in (whose rows a scan counts as found)."""
    e, pos, doc, tok = _just_past(s, row)
    if doc < len(s.lengths[(e, pos)]):
        return (e, pos, doc, tok), True
    return (*s.ordering.next_block(e, pos), 0, 0), False


def _just_past(s: SourceStream, row: np.ndarray) -> tuple[int, int, int, int]:
    """``(epoch, block, doc, tok)`` just past piece ``row`` = [epoch, unit, doc, start, stop] in
    the block's order: the next document where the piece ends its own (``doc`` may then be the
    block's length), else the same document at the piece's stop."""
    e, unit, file_doc, _, stop = (int(x) for x in row)
    _, pos, doc = s.order_key(e, unit, file_doc)
    return (e, pos, doc + 1, 0) if stop >= int(s.lengths[(e, pos)][doc]) else (e, pos, doc, stop)


SCAN_DOCS = 4096  # documents of a block turned into rows at a time (doubling): work follows what is asked for


def _scan(
    s: SourceStream,
    cls: str | None,
    min_tokens: int,
    until: tuple | None = None,
    keys: bool = True,
    start: tuple | None = None,
    started: bool = False,
) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """Rows of class ``cls`` from its cursor (or from ``start``, inside a block that yielded
    rows already with ``started``), their order keys ``[epoch, block position, doc position,
    start]`` (with ``keys``; else none: only a merge of length classes reads them), their
    tokens, and whether ``min_tokens`` were reached (with ``until``, a key: every block up to
    that key's block instead, and whether they were all loaded). A large block is read a slice
    at a time, so a call costs what it returns, not what its block holds."""
    rows: list[np.ndarray] = []
    order_keys: list[np.ndarray] = []
    total = 0
    e, pos, doc, tok = start if start is not None else s.class_cursor(cls)
    empty_blocks, chunk = 0, SCAN_DOCS

    def more() -> bool:
        return (total < min_tokens) if until is None else ((e, pos) <= tuple(until[:2]))

    while more():
        lens = s.lengths.get((e, pos))
        if lens is None:
            out = np.concatenate(rows) if rows else np.zeros((0, 5), np.int64)
            return out, _joined_keys(order_keys), total, False
        found, started = started, False
        while doc < len(lens) and more():
            hi = len(lens) if until is not None else min(len(lens), doc + chunk)
            got = _slice_rows(s, cls, (e, pos), lens, doc, hi, tok, want_keys=keys)
            if got is not None:
                rows.append(got[0])
                order_keys.append(got[1])
                total += got[2]
                found = True
            doc, tok, chunk = hi, 0, 2 * chunk
        if doc < len(lens):
            break  # enough: the rest of this block waits for the next call
        empty_blocks = 0 if found else empty_blocks + 1
        if empty_blocks > s.ordering.n_blocks and until is None:
            if cls is not None and s.split:
                raise SourceError(
                    f"source {s.name!r} has no {cls} documents (long: over long_tokens={s.split} tokens) "
                    "in a whole pass over its files; leave it out of the stage's long_sources"
                )
            raise SourceError(f"source {s.name!r} is empty: a whole pass over its files found no tokens")
        doc, tok = 0, 0
        e, pos = s.ordering.next_block(e, pos)
    out = np.concatenate(rows) if rows else np.zeros((0, 5), dtype=np.int64)
    return out, _joined_keys(order_keys), total, (total >= min_tokens) if until is None else True


def _joined_keys(parts: list) -> np.ndarray:
    parts = [k for k in parts if k is not None]
    return np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)


def _slice_rows(
    s: SourceStream,
    cls: str | None,
    key: tuple[int, int],
    lens: np.ndarray,
    lo: int,
    hi: int,
    tok: int,
    want_keys: bool = True,
):
    """Rows, order keys (None without ``want_keys``) and tokens of block ``key``'s documents
    ``[lo, hi)`` (shuffled order; the first from token ``tok`` on), or None if they yield no
    piece."""
    L = lens[lo:hi]
    if not len(L):
        return None
    rem = L.copy()
    rem[0] -= tok
    mask = s.class_mask(L, cls)
    if mask is not None:
        rem[~mask] = 0
    if s.drop_over is not None:  # dropped documents yield no pieces (a started one finishes)
        dropped = L > s.drop_over
        dropped[0] &= tok == 0
        rem[dropped] = 0
    n = np.where(rem > 0, -(-rem // s.piece_tokens), 0)
    k_total = int(n.sum())
    if not k_total:
        return None
    if k_total == len(L) and n.min() == 1:  # every document one piece (the usual slice): nothing to expand
        d = np.arange(len(L))
        start = np.zeros(len(L), dtype=np.int64)
        start[0] = tok
        stop = L.astype(np.int64, copy=False)
    else:
        d = np.repeat(np.arange(len(L)), n)
        k = np.arange(k_total) - np.repeat(np.cumsum(n) - n, n)
        start = k * s.piece_tokens + np.where(d == 0, tok, 0)
        stop = np.minimum(start + s.piece_tokens, L[d])
    units, docs = s.ordering.file_docs(key, d + lo)
    block = np.empty((k_total, 5), dtype=np.int64)
    block[:, 0], block[:, 1], block[:, 2], block[:, 3], block[:, 4] = key[0], units, docs, start, stop
    order = None
    if want_keys:
        order = np.empty((k_total, 4), dtype=np.int64)
        order[:, 0], order[:, 1], order[:, 2], order[:, 3] = key[0], key[1], d + lo, start
    return block, order, int((stop - start).sum())


def shortfall(s: SourceStream, need: int, cls: str | None = None) -> tuple[int, tuple]:
    """What must arrive before a scan of ``need`` tokens (of class ``cls``) that stopped short can
    get further (``policies.Starved``): the tokens it lacks beyond every unit whose lengths are
    held (in a block, behind the cursor or not, any class, or waiting for the rest of its
    block: no scan covers more until more arrive), and the first block without lengths from
    the class cursor on (from each class cursor, for a source read by length class in merged
    order): where a scan stops."""
    held = sum(int(lens.sum()) for lens in (*s.lengths.values(), *s.arrived.values()))
    missing = []
    for c in [cls] if cls is not None or not s.split else ["short", "long"]:
        e, pos = s.class_cursor(c if s.split else None)[:2]
        for _ in range(s.ordering.n_blocks + 1):
            if (e, pos) not in s.lengths:
                missing.append((e, pos))
                break
            e, pos = s.ordering.next_block(e, pos)
    return need - held, tuple(missing)


def take(s: SourceStream, rows: np.ndarray, cls: str | None = None) -> None:
    """The planner took ``rows``, a prefix of ``pieces_ahead(.., cls)``: move the cursors past them."""
    if not len(rows):
        return
    if not s.split:
        held = s.ahead if s.ahead is not None and s.ahead[0] == _key(s) else None
        advance_past(s, rows[-1])
        s.ahead = None
        k = len(rows)
        if held is not None and k <= len(held[1]) and np.array_equal(held[1][k - 1], rows[-1]):
            _, kept, ends, _ = held  # (a piece cut at its end leaves rows that start elsewhere: scanned again)
            s.ahead = (_key(s), kept[k:], ends[k:], int(ends[k - 1]))
        return
    s.ahead = None
    if cls is not None:
        advance_past(s, rows[-1], cls)
        return
    lens = np.array([s.lengths[k[:2]][k[2]] for k in (s.order_key(e, u, d) for e, u, d in rows[:, :3].tolist())])
    is_long = lens > s.split
    for c, sel in (("short", ~is_long), ("long", is_long)):
        if sel.any():
            advance_past(s, rows[np.flatnonzero(sel)[-1]], c)
    s.try_unsplit()


def advance_past(s: SourceStream, row: np.ndarray, cls: str | None = None) -> None:
    """Move the cursor (of class ``cls``) just past piece ``row`` = [epoch, unit, doc, start,
    stop], recording the documents the drop policy skipped on the way."""
    e, pos, doc, tok = _just_past(s, row)
    if s.drop_over is not None:
        own = doc if tok else doc - 1  # the piece's document (the cursor is at its next only where it ended it)
        _record_drops(s, e, pos, own, cls)
    s.set_class_cursor(cls, e, pos, doc, tok)
    s.epoch_tokens = 1  # this epoch has tokens: the empty-source check is satisfied


def _record_drops(s: SourceStream, epoch: int, pos: int, doc: int, cls: str | None = None) -> None:
    """Record the documents over ``drop_over`` (of class ``cls``) between that class's cursor
    and (epoch, pos, doc)."""
    e, p, d, tok = s.class_cursor(cls)
    while (e, p) <= (epoch, pos):
        lens = s.lengths.get((e, p))
        if lens is not None:
            hi = doc if (e, p) == (epoch, pos) else len(lens)
            idx = np.arange(d, hi)
            if tok and len(idx):
                idx = idx[1:]  # a started document is finished, never dropped
            over = lens[idx] > s.drop_over
            mask = s.class_mask(lens[idx], cls)
            picked = idx[over if mask is None else over & mask]
            units, docs = s.ordering.file_docs((e, p), picked)
            for k, u, fd in zip(picked.tolist(), units.tolist(), docs.tolist()):
                s.drops[(e, u, fd)] = int(lens[k])
        d, tok = 0, 0
        e, p = s.ordering.next_block(e, p)
