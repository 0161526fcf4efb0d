"""Cutting a tar shard into byte ranges of whole samples, from a few small reads.

A plain tar is a chain of 512-byte header blocks, each followed by its member's data padded to
512 bytes; a webdataset sample is a run of consecutive members that share a key. A shard of
hundreds of MB read as one load unit makes the first batch wait for all of it, so a shard is
cut into units of about ``loading.unit_bytes`` without reading it: each cut looks near its
target offset for the first header block (a block whose ustar magic and checksum hold), walks
the members from there past the one it landed in (its key may be a pax header's truncated
name) and cuts where the key next changes, at the first header of a sample. A unit ``[lo, hi)``
thus holds whole samples. Its reader checks that the members it walks from ``lo`` end exactly at
``hi`` (``check_end``), so a cut placed wrongly (a data block that passes for a header: a tar
stored inside a member) is an error naming the shard, never a lost or doubled sample; so is a
damaged header, where ``tarfile`` alone would end the shard early without a word.

Compressed shards (``.tar.gz``) can only be entered at their start: they stay one unit each.
"""

from __future__ import annotations

import io
import tarfile

BLOCK = 512
WINDOW = 1 << 16  # bytes read per look for a header block
_MAGIC = b"ustar"
_ZEROS = bytes(2 * BLOCK)


def is_header(block: bytes) -> bool:
    """Whether a 512-byte block is a ustar header whose checksum holds (as ``tarfile`` checks it:
    the unsigned or the signed byte sum, the checksum field counted as spaces)."""
    if len(block) < BLOCK or block[257:262] != _MAGIC:
        return False
    field = block[148:156].rstrip(b"\0 ")
    try:
        want = int(field or b"0", 8)
    except ValueError:
        return False
    unsigned = sum(block) - sum(block[148:156]) + 8 * 32
    signed = unsigned - 256 * sum(1 for b in block if b > 127) + 256 * sum(1 for b in block[148:156] if b > 127)
    return want in (unsigned, signed)


def cuts(f, size: int, step: int, key_of) -> list[int]:
    """The start offsets of a shard's units (the first is 0): a cut about every ``step`` bytes,
    each at the first header of a sample. ``key_of(name)`` is a member's sample key, or None for
    a member that belongs to no sample (a directory, webdataset's ``__index__``)."""
    out, target = [0], step
    while target < size:
        cut = boundary(f, target, size, key_of)
        if cut is None:
            break
        out.append(cut)
        target = cut + step
    return out


def boundary(f, target: int, size: int, key_of) -> int | None:
    """The first header of the first sample that starts after a header found at or after
    ``target``; None when no sample starts there before the end of the archive."""
    pos = -(-target // BLOCK) * BLOCK
    while pos < size:
        head = _next_header(f, pos, size)
        if head is None:
            return None
        try:
            return _key_change(f, head, key_of)
        except (tarfile.TarError, EOFError):  # not a real header after all: look further on
            pos = head + BLOCK
    return None


def _next_header(f, pos: int, size: int) -> int | None:
    """The offset of the first header block at or after ``pos`` (512-aligned), or None."""
    while pos < size:
        f.seek(pos)
        data = f.read(min(WINDOW, size - pos))
        if not data:
            return None
        at = data.find(_MAGIC, 257)
        while at >= 0:
            start = at - 257
            if start % BLOCK == 0 and is_header(data[start : start + BLOCK]):
                return pos + start
            at = data.find(_MAGIC, at + 1)
        pos += max(len(data) // BLOCK * BLOCK, BLOCK)
    return None


def _key_change(f, head: int, key_of) -> int | None:
    """Walking the members from the header at ``head``: the offset of the first member (its
    first header block, extended headers included) whose key differs from the key of the member
    after the one at ``head``; None at the end of the archive."""
    f.seek(head)
    key, first = None, True
    with tarfile.open(fileobj=_From(f, head), mode="r|") as tar:
        for m in tar:
            if first:
                first = False
                continue
            k = key_of(m.name) if m.isfile() else None
            if k is None:
                continue
            if key is None:
                key = k
            elif k != key:
                return head + m.offset
    return None


class _From(io.RawIOBase):
    """A read-only view of ``f`` from ``start`` on (``tarfile``'s stream mode reads forward)."""

    def __init__(self, f, start: int) -> None:
        self._f, self._pos = f, start

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        self._f.seek(self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data


def unit_stream(data: bytes, last: bool) -> io.BytesIO:
    """A unit's bytes as a tar stream: a unit that does not end its shard gets the two zero blocks
    that end an archive."""
    return io.BytesIO(data if last else data + _ZEROS)


def check_end(tar: tarfile.TarFile, data: bytes, last: bool, where: str) -> None:
    """After walking a unit's members (``data``: the unit's bytes): they must end exactly at the
    unit's end, or for a shard's last unit at its end-of-archive blocks (zeros). ``tarfile`` ends a stream
    quietly at a damaged header; this raises ValueError saying where instead."""
    end = tar.offset
    if (end == len(data) and not last) or (last and end < len(data) and not data[end : end + BLOCK].strip(b"\0")):
        return
    if end == len(data):
        raise ValueError(f"{where}: the shard ends without the blocks that end an archive (truncated?)")
    if end > len(data):
        raise ValueError(past_end(where))
    what = "the end of an archive" if not data[end : end + BLOCK].strip(b"\0") else "a damaged tar header"
    raise ValueError(f"{where}: {what} at byte {end} of the unit, before its end at byte {len(data)}")


def past_end(where: str) -> str:
    """What a unit whose last member runs past its end says (a cut inside a member)."""
    return (
        f"{where}: its last member runs past the unit's end (the shard was cut inside a member: a tar stored in a "
        "sample?); set loading.unit_bytes above the shard's size to read it whole"
    )
