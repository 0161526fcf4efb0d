"""Indexes that cost a pass over a file, kept on the local disk between service starts.

Most formats are indexed from metadata in a few reads. Two need more: a gzip (or one-frame zstd)
jsonl file can only be indexed by reading it once, and an Arrow IPC file on an object store by a
request per record batch. Their indexes are cached as JSON under ``$OVERLORD_CACHE_DIR`` (default
``~/.cache/overlord_dask``), keyed by the file's URL, size and modification stamp and by what
shaped the index (a format version, a unit size): a file that changes gets a new key, and a
read-only or missing cache only costs indexing again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("OVERLORD_CACHE_DIR") or Path.home() / ".cache" / "overlord_dask")


def cached(fs, path: str, size: int, kind: str, shape: list, build: Callable[[], object]):
    """``build()``'s JSON-able result for ``path``, from the cache when it holds one for the file
    as it is now (URL, ``size``, modification stamp) and ``shape``; else built and stored."""
    info = fs.info(path)
    stamp = info.get("mtime") or info.get("LastModified") or info.get("ETag") or info.get("created")
    key = hashlib.sha256(json.dumps([fs.unstrip_protocol(path), size, str(stamp), *shape]).encode()).hexdigest()[:32]
    where = cache_dir() / kind / f"{key}.json"
    try:
        return json.loads(where.read_text())
    except (OSError, ValueError):
        pass
    value = build()
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(value))
        tmp.replace(where)
    except OSError:  # a read-only home: index again next time
        pass
    return value
