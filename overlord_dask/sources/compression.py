"""Compressed files, read as streams of their decompressed bytes: gzip and zstd (by extension),
and the frames of a zstd file, found from their headers without decompressing anything.

A zstd file written as several frames (``pzstd``, the seekable format of ``t2sz`` and
``zstd --seekable``-style writers, or any writer that starts a frame every few MB) can be entered
at any frame: that is what lets a compressed jsonl file be read as many load units in parallel.
The frames are found from the seekable format's seek table when the file has one (one read at its
end), otherwise by walking the frame and block headers (a few bytes per block, read with seeks).
A gzip file, or a zstd file of one frame, can only be read from its start.

Truncated or corrupt data raises ``SourceError`` naming the file: a zstd stream that ends inside a
frame is an error here (the zstandard library's readers return what they have and say nothing).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

from ..errors import SourceError

ZSTD_MAGIC = 0xFD2FB528
SKIPPABLE_MASK, SKIPPABLE_MAGIC = 0xFFFFFFF0, 0x184D2A50
SEEKABLE_MAGIC = 0x8F92EAB1
CHUNK = 1 << 20  # compressed bytes read at a time


def compression(path: str) -> str | None:
    """``gzip``, ``zstd`` or None (plain), from the file's extension."""
    if path.endswith(".gz"):
        return "gzip"
    if path.endswith((".zst", ".zstd")):
        return "zstd"
    return None


def decompressed(f, kind: str | None, path: str, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
    """The decompressed bytes of file object ``f`` from compressed offset ``start`` (a frame
    start, for zstd; 0 for gzip) to ``stop`` (a frame end; None: the end of the file), in chunks."""
    f.seek(start)
    remaining = None if stop is None else stop - start

    def raw() -> Iterator[bytes]:
        nonlocal remaining
        while remaining is None or remaining > 0:
            data = f.read(CHUNK if remaining is None else min(CHUNK, remaining))
            if not data:
                return
            if remaining is not None:
                remaining -= len(data)
            yield data

    if kind is None:
        yield from raw()
    elif kind == "gzip":
        yield from _gunzip(raw(), path)
    else:
        yield from _unzstd(raw(), path)


def _gunzip(chunks: Iterator[bytes], path: str) -> Iterator[bytes]:
    """Every member of a gzip stream (``cat a.gz b.gz`` is one valid file); zero padding after the
    last member is ignored, as gzip does."""
    d, open_member = zlib.decompressobj(zlib.MAX_WBITS | 16), False
    try:
        for data in chunks:
            while data:
                if d.eof:  # the member ended: a new one starts here, unless only padding follows
                    if not data.strip(b"\0"):
                        break
                    d = zlib.decompressobj(zlib.MAX_WBITS | 16)
                out = d.decompress(data)
                open_member = not d.eof
                if out:
                    yield out
                data = d.unused_data if d.eof else b""
        tail = d.flush()
        if tail:
            yield tail
    except zlib.error as err:
        raise SourceError(f"corrupt gzip data in {path}: {err}") from None
    if open_member and not d.eof:
        raise SourceError(f"truncated gzip file {path}: it ends before its end-of-stream marker")


def _unzstd(chunks: Iterator[bytes], path: str) -> Iterator[bytes]:
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    d, fed = dctx.decompressobj(), False
    try:
        for data in chunks:
            while data:
                out = d.decompress(data)
                fed = True
                if out:
                    yield out
                data = b""
                if d.eof:
                    data, d, fed = d.unused_data, dctx.decompressobj(), False
    except zstandard.ZstdError as err:
        raise SourceError(f"corrupt zstd data in {path}: {err}") from None
    if fed and not d.eof:
        raise SourceError(f"truncated zstd file {path}: it ends inside a frame")


def zstd_frames(f, size: int, path: str) -> list[tuple[int, int, int | None]]:
    """The data frames of a zstd file: ``(offset, compressed size, decompressed size or None)``
    each, skippable frames left out. From the seek table if the file ends with one, else from
    the frame and block headers."""
    table = _seek_table(f, size)
    if table is not None:
        return table
    frames, pos = [], 0
    while pos < size:
        f.seek(pos)
        head = f.read(18)
        if len(head) < 4:
            raise SourceError(f"truncated zstd file {path}: {size - pos} stray bytes at offset {pos}")
        magic = struct.unpack_from("<I", head)[0]
        if magic & SKIPPABLE_MASK == SKIPPABLE_MAGIC:
            if len(head) < 8:
                raise SourceError(f"truncated zstd file {path}: a skippable frame at offset {pos} has no size")
            pos += 8 + struct.unpack_from("<I", head, 4)[0]
            continue
        if magic != ZSTD_MAGIC:
            raise SourceError(f"corrupt zstd file {path}: no frame starts at offset {pos} (magic {magic:#010x})")
        header, content, checksum = _frame_header(head, path, pos)
        end = pos + header
        while True:
            f.seek(end)
            block = f.read(3)
            if len(block) < 3:
                raise SourceError(f"truncated zstd file {path}: the frame at offset {pos} ends inside a block header")
            b = int.from_bytes(block, "little")
            last, kind, bsize = b & 1, (b >> 1) & 3, b >> 3
            if kind == 3:
                raise SourceError(f"corrupt zstd file {path}: a reserved block type in the frame at offset {pos}")
            end += 3 + (1 if kind == 1 else bsize)
            if last:
                break
        end += 4 if checksum else 0
        if end > size:
            raise SourceError(f"truncated zstd file {path}: the frame at offset {pos} runs past the end of the file")
        frames.append((pos, end - pos, content))
        pos = end
    return frames


def _frame_header(head: bytes, path: str, pos: int) -> tuple[int, int | None, bool]:
    """(header length, content size or None, has a checksum) of the frame whose first bytes are ``head``."""
    if len(head) < 5:
        raise SourceError(f"truncated zstd file {path}: the frame header at offset {pos} is cut short")
    fhd = head[4]
    fcs_flag, single, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    dict_len = (0, 1, 2, 4)[dict_flag]
    fcs_len = (1 if single else 0, 2, 4, 8)[fcs_flag]
    n = 5 + (0 if single else 1) + dict_len
    if len(head) < n + fcs_len:
        raise SourceError(f"truncated zstd file {path}: the frame header at offset {pos} is cut short")
    content = None
    if fcs_len:
        content = int.from_bytes(head[n : n + fcs_len], "little") + (256 if fcs_len == 2 else 0)
    return n + fcs_len, content, bool(checksum)


def _seek_table(f, size: int) -> list[tuple[int, int, int]] | None:
    """The frames listed by a seekable-format seek table at the end of the file, if any."""
    if size < 17:
        return None
    f.seek(size - 9)
    n, desc, magic = struct.unpack("<IBI", f.read(9))
    if magic != SEEKABLE_MAGIC:
        return None
    entry = 12 if desc & 0x80 else 8
    length = n * entry + 9
    f.seek(size - length - 8)
    head = f.read(8)
    if (
        struct.unpack_from("<I", head)[0] & SKIPPABLE_MASK != SKIPPABLE_MAGIC
        or struct.unpack_from("<I", head, 4)[0] != length
    ):
        return None
    raw = f.read(n * entry)
    frames, pos = [], 0
    for i in range(n):
        csize, dsize = struct.unpack_from("<II", raw, i * entry)
        frames.append((pos, csize, dsize))
        pos += csize
    return frames
