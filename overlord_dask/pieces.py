"""Piece rows: the planner's one row schema.

A *piece* is a run of tokens of one document, the grain everything after selection works on.
Pieces travel as int64 numpy rows (no Python object per piece: a window holds tens of thousands)
with these columns::

    SOURCE  EPOCH  UNIT  DOC  START  STOP  [AGE]

``SOURCE`` is the source's plan index, ``UNIT`` its load unit, ``DOC`` the document's index in
the unit's file order, ``[START, STOP)`` the tokens of the document the piece holds. The
balancer appends ``AGE`` (windows the piece has waited). A source's stream hands out rows
without the source column (``[epoch, unit, doc, start, stop]``, ``STREAM_*`` below), since it
knows only itself.

Rows are int64 (:data:`DTYPE`) wherever they are: in the planner, the ledger and snapshots
(as little-endian bytes: :func:`to_bytes` / :func:`from_bytes`). On their way to a constructor
(planner → submitter → scheduler → worker: a task's arguments cross the scheduler) they travel
packed (:func:`pack` / :func:`unpack`): each column in the smallest integer type that holds it, as
tokens travel on the wire, and come back int64. A planned piece's ``[rank, micro_batch]`` slot is
int32 (:data:`SLOT_DTYPE`, :func:`slot_bytes` / :func:`slot_from_bytes`).
"""

from __future__ import annotations

import math

import numpy as np

SOURCE, EPOCH, UNIT, DOC, START, STOP, AGE = range(7)
DTYPE = np.int64  # piece rows, everywhere
WIRE = "<i8"  # ... and as bytes
SLOT_DTYPE = np.int32  # a planned piece's [rank, micro_batch]
SLOT_WIRE = "<i4"
WIDTH = 6  # a planned piece; WIDTH + 1 with AGE
STREAM_START, STREAM_STOP = START - 1, STOP - 1  # a stream's rows lack the source column


def empty(width: int = WIDTH) -> np.ndarray:
    return np.zeros((0, width), dtype=DTYPE)


def lengths(rows: np.ndarray) -> np.ndarray:
    """Tokens per piece of planned rows (``WIDTH`` columns, with or without ``AGE``)."""
    return rows[:, STOP] - rows[:, START]


def stream_lengths(rows: np.ndarray) -> np.ndarray:
    """Tokens per piece of a stream's rows (no source column)."""
    return rows[:, STREAM_STOP] - rows[:, STREAM_START]


def tokens(rows: np.ndarray) -> int:
    return int(lengths(rows).sum())


def units(rows: np.ndarray) -> np.ndarray:
    """``[source, epoch, unit]`` of each piece: the block it lives in."""
    return rows[:, : UNIT + 1]


def unique_rows(rows: np.ndarray, return_counts: bool = False, return_inverse: bool = False):
    """The distinct rows of an integer array in lexicographic order (then, if asked, each input
    row's index among them, and how often each occurs), as ``np.unique(rows, axis=0)`` gives
    them, many times faster: where the columns' value ranges fit one int64 together, each row
    becomes one key (the first column its most significant digit). Keys from a range not much
    larger than the rows (a step's units, a window's documents) are counted, not sorted
    (``np.bincount``: linear, where a sort of a step's ~100k pieces took most of the planner's
    bookkeeping at thousands of ranks); other keys go through a 1-D unique (``axis=0`` sorts
    the rows as opaque bytes, which is slow on a long run's piece identities). Past an int64,
    rows are sorted with ``np.lexsort``."""
    rows = np.asarray(rows)
    if len(rows) == 0:
        uniq, inverse, counts = rows[:0], np.zeros(0, np.int64), np.zeros(0, np.int64)
    else:
        # per column: a reduction over a strided 2-D axis is several times slower
        lo = [int(rows[:, j].min()) for j in range(rows.shape[1])]
        spans = [int(rows[:, j].max()) - low + 1 for j, low in enumerate(lo)]
        n_keys = math.prod(spans)  # Python ints: the product cannot overflow
        if n_keys < 1 << 62:
            key = np.zeros(len(rows), np.int64)
            for j, span in enumerate(spans):
                key = key * span + np.subtract(rows[:, j], lo[j], dtype=np.int64)
            if n_keys <= DENSE_KEYS_PER_ROW * len(rows) + DENSE_KEYS_MIN:
                counts = np.bincount(key, minlength=n_keys)
                present = counts > 0
                ukey, counts = np.flatnonzero(present), counts[present]
                inverse = (np.cumsum(present) - 1)[key] if return_inverse else None
            elif return_inverse or return_counts:
                ukey, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
                inverse = inverse.ravel()
            else:
                ukey = np.unique(key)
            uniq = np.empty((len(ukey), rows.shape[1]), dtype=rows.dtype)
            for j in range(len(spans) - 1, -1, -1):
                ukey, digit = np.divmod(ukey, spans[j])
                uniq[:, j] = digit + lo[j]
        else:
            order = np.lexsort(rows.T[::-1])
            srt = rows[order]
            new = np.ones(len(srt), dtype=bool)
            new[1:] = np.any(srt[1:] != srt[:-1], axis=1)
            starts = np.flatnonzero(new)
            uniq, counts = srt[starts], np.diff(np.append(starts, len(srt)))
            inverse = np.empty(len(rows), np.int64)
            inverse[order] = np.cumsum(new) - 1
    out = (uniq,) + ((inverse,) if return_inverse else ()) + ((counts,) if return_counts else ())
    return out if len(out) > 1 else uniq


DENSE_KEYS_PER_ROW, DENSE_KEYS_MIN = 4, 1 << 16  # unique_rows counts keys up to this range (8 bytes each)


def stable_order(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of integer keys (equal keys in index order), in one or
    two radix passes of 16 bits where the keys' range allows: numpy sorts 16-bit integers by
    radix (linear), any wider integer by timsort: grouping a window's pieces by bin or source
    (millions of rows at thousands of ranks) is linear in them."""
    keys = np.asarray(keys)
    if len(keys) < RADIX_MIN_KEYS or not np.issubdtype(keys.dtype, np.integer):
        return np.argsort(keys, kind="stable")
    lo = int(keys.min())
    span = int(keys.max()) - lo
    if span < 1 << 16:
        return np.argsort(np.subtract(keys, lo, dtype=np.int64).astype(np.uint16), kind="stable")
    if span < 1 << 32:
        k = np.subtract(keys, lo, dtype=np.int64)
        order = np.argsort((k & 0xFFFF).astype(np.uint16), kind="stable")  # low digit first (LSD radix)
        return order[np.argsort((k[order] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(keys, kind="stable")


RADIX_MIN_KEYS = 256  # stable_order sorts fewer keys directly (the passes cost more than they save)


def grouped(inverse: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices grouped by their group index ``inverse`` (``unique_rows``' inverse), each
    group's rows in their order, and the bounds: group ``k``'s rows are
    ``order[bounds[k]:bounds[k + 1]]``."""
    order = stable_order(inverse)
    return order, np.searchsorted(inverse[order], np.arange(n_groups + 1))


def units_of_each(parts: list[np.ndarray]) -> list[np.ndarray]:
    """``unique_rows(units(part))`` of each of ``parts`` (a window's steps), found together."""
    if len(parts) == 1:
        return [unique_rows(units(parts[0]))]
    rows = np.concatenate(parts)
    keyed = np.empty((len(rows), UNIT + 2), dtype=DTYPE)
    keyed[:, 0] = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    keyed[:, 1:] = units(rows)
    uniq = unique_rows(keyed)
    bounds = np.searchsorted(uniq[:, 0], np.arange(len(parts) + 1))
    return [np.ascontiguousarray(uniq[a:b, 1:]) for a, b in zip(bounds[:-1], bounds[1:])]


def source_tokens(rows: np.ndarray, n_sources: int) -> np.ndarray:
    """Tokens per source index, int64 ``[n_sources]``."""
    return np.bincount(rows[:, SOURCE], weights=lengths(rows), minlength=n_sources).astype(np.int64)


def with_age(rows: np.ndarray, age: int = 0, after: np.ndarray | None = None) -> np.ndarray:
    """Planned rows with the balancer's waiting-age column appended (after the rows ``after``,
    which have it: one copy of a window's pieces, not two)."""
    head = 0 if after is None else len(after)
    out = np.empty((head + len(rows), WIDTH + 1), dtype=DTYPE)
    if head:
        out[:head] = after
    out[head:, :WIDTH] = rows
    out[head:, AGE] = age
    return out


def appended(rows: np.ndarray, new: np.ndarray, buf: np.ndarray | None = None, spare: float = 0.25):
    """``with_age(new, after=rows)`` and the buffer it lies in: written into ``buf`` (a buffer from
    an earlier call whose first rows are ``rows``) where it has room, else into a new buffer with
    room for a ``spare`` share more. A window topped up with a few more pieces and placed again
    copied all its rows for every top-up (a few percent of planning at thousands of ranks)."""
    n, k = len(rows), len(new)
    if buf is None or len(buf) < n + k:
        buf = np.empty((int((n + k) * (1 + spare)) + 1, WIDTH + 1), dtype=DTYPE)
        buf[:n] = rows
    buf[n : n + k, :WIDTH] = new
    buf[n : n + k, AGE] = 0
    return buf[: n + k], buf


def recut(rows: np.ndarray, piece_tokens: int) -> np.ndarray:
    """Rows with every piece longer than ``piece_tokens`` cut into consecutive pieces of at most
    that many tokens (same document; every other column repeated)."""
    lens = lengths(rows)
    if not len(rows) or lens.max() <= piece_tokens:
        return rows
    n = -(-lens // piece_tokens)
    out = np.repeat(rows, n, axis=0)
    k = np.arange(len(out)) - np.repeat(np.cumsum(n) - n, n)
    out[:, START] = np.repeat(rows[:, START], n) + k * piece_tokens
    out[:, STOP] = np.minimum(out[:, START] + piece_tokens, np.repeat(rows[:, STOP], n))
    return out


def flatten(ranks: list[list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """A step's ``[rank][micro_batch] -> rows`` as one array of rows and int32 ``[rank,
    micro_batch]`` per row (the ledger's layout)."""
    parts, slots = [], []
    for r, mbs in enumerate(ranks):
        for m, rows in enumerate(mbs):
            parts.append(rows)
            slots.append(np.broadcast_to(np.array([r, m], dtype=np.int32), (len(rows), 2)))
    if not parts:
        return empty(), np.zeros((0, 2), np.int32)
    return np.concatenate(parts), np.concatenate(slots)


def to_bytes(rows: np.ndarray) -> bytes:
    """Rows (any width) as little-endian int64 bytes."""
    return np.asarray(rows).astype(WIRE, copy=False).tobytes()


def from_bytes(buf: bytes, width: int = WIDTH) -> np.ndarray:
    """The int64 rows :func:`to_bytes` wrote (a writable copy)."""
    return np.frombuffer(buf, dtype=WIRE).reshape(-1, width).astype(DTYPE)


_PACKED = (np.uint8, np.uint16, np.uint32, np.int64)  # (pieces hold no negative value)


def pack(rows: np.ndarray) -> bytes:
    """Rows (any width) packed for a task's arguments: ``[width, n]`` then per column a type code
    and its values in the smallest unsigned type that holds them (:func:`unpack` reverses it)."""
    rows = np.asarray(rows, dtype=DTYPE)
    n, width = rows.shape
    parts = [np.array([width, n], "<u4").tobytes()]
    for c in range(width):
        col = rows[:, c]
        hi, lo = (int(col.max()), int(col.min())) if n else (0, 0)
        code = 3 if lo < 0 or hi >= 1 << 32 else 0 if hi < 1 << 8 else 1 if hi < 1 << 16 else 2
        parts += [bytes([code]), col.astype(np.dtype(_PACKED[code]).newbyteorder("<")).tobytes()]
    return b"".join(parts)


def unpack(buf: bytes) -> np.ndarray:
    """The int64 rows :func:`pack` packed."""
    width, n = (int(x) for x in np.frombuffer(buf, "<u4", count=2))
    out, pos = np.empty((n, width), DTYPE), 8
    for c in range(width):
        t = np.dtype(_PACKED[buf[pos]]).newbyteorder("<")
        out[:, c] = np.frombuffer(buf, t, count=n, offset=pos + 1)
        pos += 1 + n * t.itemsize
    return out


def flat_slots(slot: np.ndarray, micro_batches: int) -> np.ndarray:
    """Each planned piece's bin in flat order ``rank * micro_batches + micro_batch`` (int64)."""
    return slot[:, 0].astype(np.int64) * micro_batches + slot[:, 1]


def slots(flat: np.ndarray, micro_batches: int) -> np.ndarray:
    """The ``[rank, micro_batch]`` rows of flat bin indices (:func:`flat_slots` undone)."""
    return np.stack([flat // micro_batches, flat % micro_batches], axis=1).astype(SLOT_DTYPE)


def slot_bytes(slot: np.ndarray) -> bytes:
    """``[rank, micro_batch]`` per planned piece as little-endian int32 bytes."""
    return np.asarray(slot).astype(SLOT_WIRE, copy=False).tobytes()


def slot_from_bytes(buf: bytes) -> np.ndarray:
    """The int32 ``[rank, micro_batch]`` rows :func:`slot_bytes` wrote."""
    return np.frombuffer(buf, dtype=SLOT_WIRE).reshape(-1, 2).astype(SLOT_DTYPE)
