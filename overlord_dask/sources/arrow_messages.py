"""Where the record batches of an Arrow IPC file or stream lie, from the message headers alone.

An IPC stream is a run of encapsulated messages: ``0xFFFFFFFF``, the metadata's length, a
flatbuffer ``Message`` (its kind, its body's length and, for a record batch, its row count), then
the body; an IPC file is the same stream between a magic and a footer. Walking the headers and
skipping the bodies finds every batch's byte range and rows: on an object store that is one small
read per batch instead of fetching the file, so a remote Arrow file is cut into row ranges like
a local one, and a unit is read with one ranged request (the schema message, its batches' bytes
and an end-of-stream marker make a stream of their own that ``pyarrow`` reads).

The few flatbuffer fields needed are read here by hand (``Message.header_type``, ``.header``,
``.bodyLength``, ``RecordBatch.length``; layout from Arrow's ``Message.fbs``): pyarrow does not
expose a message's metadata without reading its body.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

MAGIC = b"ARROW1"
_CONTINUATION = b"\xff\xff\xff\xff"
_SCHEMA, _DICTIONARY, _RECORD_BATCH = 1, 2, 3  # MessageHeader union tags
EOS = _CONTINUATION + b"\x00\x00\x00\x00"
READ_AHEAD = 1 << 16  # bytes a remote read fetches while walking headers (small batches come in one read)


@dataclass
class Layout:
    """A file's messages: the schema message's bytes, and per record batch ``(offset, length,
    rows)``; ``dictionaries`` when the file has dictionary batches (a unit then needs them too)."""

    schema: tuple[int, int] = (0, 0)
    batches: list[tuple[int, int, int]] = field(default_factory=list)
    dictionaries: bool = False

    def to_json(self) -> list:
        return [list(self.schema), [list(b) for b in self.batches], self.dictionaries]

    @classmethod
    def from_json(cls, value: list) -> Layout:
        return cls(tuple(value[0]), [tuple(b) for b in value[1]], bool(value[2]))


def _table_field(buf: bytes, table: int, index: int) -> int | None:
    """The absolute position of field ``index`` of the flatbuffer table at ``table``, or None."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vsize = struct.unpack_from("<H", buf, vtable)[0]
    slot = 4 + 2 * index
    if slot >= vsize:
        return None
    off = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + off if off else None


def parse_message(meta: bytes) -> tuple[int, int, int]:
    """``(header type, body length, rows)`` of a flatbuffer ``Message`` (rows: a record batch's
    length, else 0)."""
    root = struct.unpack_from("<I", meta, 0)[0]
    at = _table_field(meta, root, 1)
    kind = meta[at] if at is not None else 0
    at = _table_field(meta, root, 3)
    body = struct.unpack_from("<q", meta, at)[0] if at is not None else 0
    rows = 0
    if kind == _RECORD_BATCH:
        at = _table_field(meta, root, 2)
        header = at + struct.unpack_from("<I", meta, at)[0]
        at = _table_field(meta, header, 0)
        rows = struct.unpack_from("<q", meta, at)[0] if at is not None else 0
    return kind, body, rows


def walk(f, size: int) -> Layout:
    """The layout of the IPC file or stream in ``f`` (``size`` bytes); ValueError saying what is
    wrong for bytes that are not one."""
    f.seek(0)
    pos = 8 if f.read(6) == MAGIC else 0
    out = Layout()
    while pos + 8 <= size:
        f.seek(pos)
        head = f.read(8)
        if head[:4] != _CONTINUATION:
            raise ValueError(f"no Arrow IPC message at byte {pos} (a pre-1.0 stream, or not Arrow)")
        meta_len = struct.unpack_from("<i", head, 4)[0]
        if meta_len == 0:  # end of stream
            return out
        meta = f.read(meta_len)
        if len(meta) != meta_len:
            raise ValueError(f"truncated Arrow IPC message at byte {pos}")
        try:
            kind, body, rows = parse_message(meta)
        except (struct.error, TypeError, IndexError) as err:
            raise ValueError(f"damaged Arrow IPC message at byte {pos}: {err}") from None
        length = 8 + meta_len + body
        if kind == _SCHEMA:
            out.schema = (pos, pos + length)
        elif kind == _DICTIONARY:
            out.dictionaries = True
        elif kind == _RECORD_BATCH:
            out.batches.append((pos, length, rows))
        pos += length
    if pos > size:
        raise ValueError(f"truncated Arrow IPC stream: a message runs to byte {pos}, the file holds {size}")
    return out
