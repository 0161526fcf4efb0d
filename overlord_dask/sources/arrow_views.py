"""numpy views of Arrow arrays, and Arrow arrays of numpy ones, made from their buffers.

pyarrow converts between the two through its pandas layer: ``Array.to_numpy()``,
``np.asarray(array)`` and ``pa.array(ndarray)`` each import pandas the first time they run in a
process where pandas is installed (it is wherever Dask's dashboard is: bokeh needs it). A
loader process that never uses pandas then holds it all the same, tens of MB in every worker
and in a service run in one process. A primitive array without nulls is its data buffer, so
these functions read and write the buffers themselves, and go through pyarrow only for what
has nulls or is not a fixed-width number (the same result, with pandas imported as before).
"""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa


def _numpy_dtype(t: pa.DataType) -> np.dtype | None:
    """The numpy dtype of a fixed-width integer or float Arrow type (None for any other)."""
    if pa.types.is_integer(t):
        return np.dtype(f"{'i' if pa.types.is_signed_integer(t) else 'u'}{t.bit_width // 8}")
    if pa.types.is_floating(t) and t.bit_width in (32, 64):
        return np.dtype(f"f{t.bit_width // 8}")
    return None


def values(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``arr`` as numpy: a read-only view of its data buffer where it is a fixed-width number
    without nulls (one chunk; several are joined), else ``to_numpy(zero_copy_only=False)``."""
    if isinstance(arr, pa.ChunkedArray):
        if arr.num_chunks == 1:
            return values(arr.chunk(0))
        dtype = _numpy_dtype(arr.type)
        if dtype is None or arr.null_count:
            return arr.to_numpy()
        return np.concatenate([values(c) for c in arr.chunks]) if arr.num_chunks else np.zeros(0, dtype)
    dtype = _numpy_dtype(arr.type)
    if dtype is None or arr.null_count:
        return arr.to_numpy(zero_copy_only=False)
    data = arr.buffers()[1]
    if data is None or len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype=dtype)[arr.offset : arr.offset + len(arr)]


def from_numpy(a: np.ndarray) -> pa.Array:
    """A 1-D numpy array of fixed-width numbers as an Arrow array sharing its memory (kept
    alive by the array), without nulls."""
    a = np.ascontiguousarray(a)
    t = pa.from_numpy_dtype(a.dtype)
    if _numpy_dtype(t) is None:
        raise TypeError(f"from_numpy takes integer or float arrays, got {a.dtype}")
    return pa.Array.from_buffers(t, len(a), [None, pa.py_buffer(a)])


def _validity(items: list) -> tuple[pa.Buffer | None, int]:
    """The validity bitmap of ``items`` (None where every item is there) and its null count."""
    nulls = items.count(None)
    if not nulls:
        return None, 0
    valid = np.fromiter((v is not None for v in items), bool, len(items))
    return pa.py_buffer(np.packbits(valid, bitorder="little")), nulls


def from_items(items: list, typ: pa.DataType) -> pa.Array:
    """Python ``items`` (None for a null) as an Arrow array of ``typ``: string and binary items,
    and lists of integers (``list<int64>``), built from their buffers; any other type through
    ``pa.array``."""
    mask, nulls = _validity(items)
    if typ in (pa.string(), pa.binary()):
        empty = "" if typ == pa.string() else b""
        present = [empty if v is None else v for v in items] if nulls else items
        try:
            if typ == pa.string():
                text = "".join(present)
                joined = text.encode()
                data = present if len(joined) == len(text) else list(map(str.encode, present))  # (ASCII: as long)
            else:
                data, joined = present, b"".join(present)
        except TypeError:  # (text given as bytes, or the other way round)
            data = [v.encode() if isinstance(v, str) else bytes(v) for v in present]
            joined = b"".join(data)
        offsets = np.zeros(len(data) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, data), np.int64, len(data)), out=offsets[1:])
        if offsets[-1] >= 2**31:  # (past 32-bit offsets: pyarrow splits it into chunks)
            return pa.array(items, type=typ)
        buffers = [mask, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(joined)]
        return pa.Array.from_buffers(typ, len(data), buffers, null_count=nulls)
    if typ == pa.list_(pa.int64()):
        present = [() if v is None else v for v in items] if nulls else items
        offsets = np.zeros(len(present) + 1, np.int32)
        np.cumsum(np.fromiter(map(len, present), np.int64, len(present)), out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(present), np.int64, int(offsets[-1]))
        return pa.ListArray.from_buffers(
            typ, len(present), [mask, pa.py_buffer(offsets)], null_count=nulls, children=[from_numpy(flat)]
        )
    return pa.array(items, type=typ)


def validity(arr: pa.Array) -> np.ndarray:
    """Which entries of ``arr`` are not null (bool ``[len(arr)]``), from its validity bitmap."""
    bitmap = arr.buffers()[0]
    if bitmap is None or arr.null_count == 0:
        return np.ones(len(arr), bool)
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].astype(bool)


def nulls_emptied(offsets: np.ndarray, flat: pa.Array, valid: np.ndarray) -> tuple[np.ndarray, pa.Array]:
    """A list column's row ``offsets`` (from 0) and ``flat`` values with every null row
    (``~valid``) an empty list: Arrow lets a null row span values, which are then dropped."""
    lengths = np.diff(offsets)
    if not (~valid & (lengths > 0)).any():
        return offsets, flat
    keep = np.repeat(valid, lengths)
    out = np.zeros(len(offsets), np.int64)
    np.cumsum(np.where(valid, lengths, 0), out=out[1:])
    if _numpy_dtype(flat.type) is not None and not flat.null_count:
        return out, from_numpy(values(flat)[keep])
    mask = pa.Array.from_buffers(pa.bool_(), len(keep), [None, pa.py_buffer(np.packbits(keep, bitorder="little"))])
    return out, flat.filter(mask)
