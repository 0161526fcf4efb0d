"""Content digests of load units: files that change or rot under a weeks-long run are noticed.

With ``loading.integrity: true`` each unit gets, when its source is indexed, a digest (BLAKE2b,
128 bits) of the bytes it is read from (:meth:`Format.regions`: a parquet unit's row group, a
webdataset unit's byte range, the whole file for other formats, every file of a zarr group), and
every load checks it before reading. A parquet file written without page checksums with bytes
flipped inside a data page, a shard rewritten in place, a file truncated by a failing disk: each
is an error naming the unit and its file, or a quarantined unit under
``loading.on_corrupt: quarantine``. The service keeps the digests with its snapshots
(``service/manifest.py``), so a restart weeks later checks the files against what the run first
saw, not against what they are now.

Several units read from one region (a row group cut into units, a file's units) share one
digest, computed once per indexing.
"""

from __future__ import annotations

import hashlib

from ..errors import SourceError
from .fs import source_fs
from .units import LoadUnit

CHUNK = 1 << 22


def _hash_region(fs, path: str, start: int, stop: int | None, h) -> None:
    if fs.isdir(path):  # a zarr group: every file in it, in name order
        for f in sorted(fs.find(path)):
            h.update(f[len(path) :].encode())
            _hash_region(fs, f, 0, None, h)
        return
    with fs.open(path, "rb") as f:
        f.seek(start)
        left = None if stop is None else stop - start
        while left is None or left > 0:
            data = f.read(CHUNK if left is None else min(CHUNK, left))
            if not data:
                break
            h.update(data)
            if left is not None:
                left -= len(data)


def regions(source, plan, unit: LoadUnit) -> tuple:
    """The byte ranges ``unit`` is read from (its format says: ``Format.regions``)."""
    from .formats import get_format

    return tuple(get_format(source.format).regions(source, plan, unit))


def region_digest(fs, ranges: tuple) -> str:
    """The digest of byte ranges ``(path, start, stop)`` of ``fs``."""
    h = hashlib.blake2b(digest_size=16)
    for path, start, stop in ranges:
        h.update(f"{path}:{start}:{stop}".encode())
        _hash_region(fs, path, start, stop, h)
    return h.hexdigest()


def digest(source, plan, unit: LoadUnit) -> str:
    """The digest of the bytes ``unit`` is read from."""
    fs, _ = source_fs(source, plan.base_dir)
    return region_digest(fs, regions(source, plan, unit))


def check(source, plan, unit: LoadUnit) -> None:
    """SourceError naming the unit if its bytes are not those it was indexed with."""
    if unit.digest is None:
        return
    try:
        now = digest(source, plan, unit)
    except FileNotFoundError:
        raise SourceError(f"{unit.describe()}: the file is gone since the source was indexed") from None
    if now != unit.digest:
        raise SourceError(
            f"{unit.describe()}: the unit's bytes changed since the source was indexed (digest {unit.digest}, "
            f"now {now}): the file was rewritten or is damaged"
        )
