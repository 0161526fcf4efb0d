"""Resolving a source's fsspec URL, glob or brace pattern into a filesystem and a list of paths."""

from __future__ import annotations

import re

import fsspec
from fsspec.core import url_to_fs

from ..errors import SourceError
from ..plan import Source
from ..plan.base import resolve_url

INDEX_THREADS = 8  # files indexed at once per source on remote storage, where each read is a round trip
_GLOB_CHARS = "*?["
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """Shell-style brace expansion, in order: ``shard-{000..099}.tar`` (numeric ranges keep the
    zero padding of their first bound) and ``{train,val}/x`` (alternatives), nested or not: the
    shard patterns of webdataset, accepted by every format."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    r = _RANGE.match(body)
    if r:
        lo, hi = int(r.group(1)), int(r.group(2))
        width = len(r.group(1)) if r.group(1).startswith("0") else 0
        step = 1 if hi >= lo else -1
        items = [str(i).zfill(width) for i in range(lo, hi + step, step)]
    elif "," in body:
        items = body.split(",")
    else:  # a literal {…}: leave it, expand what follows
        head, tail = pattern[: m.end()], pattern[m.end() :]
        return [head + t for t in expand_braces(tail)]
    out: list[str] = []
    for item in items:
        out += expand_braces(pattern[: m.start()] + item + pattern[m.end() :])
    return out


def source_url(source: Source, base_dir: str | None) -> str:
    """Absolute URL of a source: relative local paths are joined to the plan's folder."""
    return resolve_url(source.url, base_dir)


def is_local(source: Source, base_dir: str | None) -> bool:
    """Whether a source lives on a local disk, where reading its metadata is CPU, not waiting:
    indexing it in threads only contends for the GIL."""
    from fsspec.utils import get_protocol

    return get_protocol(source_url(source, base_dir)) in ("file", "local")


def source_fs(source: Source, base_dir: str | None) -> tuple[fsspec.AbstractFileSystem, str]:
    url = source_url(source, base_dir)
    try:
        return url_to_fs(url, **source.storage_options)
    except ImportError as err:
        from fsspec.utils import get_protocol

        extra = {
            "s3": "s3",
            "gs": "gcs",
            "gcs": "gcs",
            "az": "azure",
            "abfs": "azure",
            "abfss": "azure",
            "hf": "hf",
        }.get(get_protocol(url))
        hint = f" (install overlord-dask[{extra}])" if extra else ""
        raise SourceError(f"source {source.name!r}: cannot open filesystem for {url!r}: {err}{hint}") from None
    except ValueError as err:
        raise SourceError(f"source {source.name!r}: cannot open filesystem for {url!r}: {err}") from None


def list_files(
    source: Source, base_dir: str | None, suffixes: tuple[str, ...] = (".parquet",)
) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """A source's files in a stable order: a folder's files ending in ``suffixes`` (sorted), a
    glob's matches (sorted), a brace pattern's expansions (in their order), or one file. Errors
    name the source and URL."""
    fs, path = source_fs(source, base_dir)
    url = source_url(source, base_dir)
    files: list[str] = []
    for one in expand_braces(path):
        if any(c in one for c in _GLOB_CHARS):
            found = sorted(p for p in fs.glob(one) if not fs.isdir(p))
            if not found:
                raise SourceError(f"source {source.name!r}: no files match {url!r}")
            files += found
        elif not fs.exists(one):
            raise SourceError(
                f"source {source.name!r}: file not found: {one!r}" + (f" (from {url!r})" if one != path else "")
            )
        elif fs.isdir(one):
            found = sorted(p for p in fs.find(one) if p.endswith(suffixes))
            if not found:
                raise SourceError(f"source {source.name!r}: folder {one!r} holds no {', '.join(suffixes)} files")
            files += found
        else:
            files.append(one)
    return fs, list(dict.fromkeys(files))


def per_file(fn, files: list[str], remote: bool) -> list:
    """``fn(path)`` for each file, in file order: in parallel threads on remote storage (each read
    of a footer or a header is a request), one after the other on a local disk (a little CPU each:
    threads would only contend for the GIL; ``benchmarks/corpus_scale.py`` compares both)."""
    if not remote or len(files) < 2:
        return [fn(path) for path in files]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(INDEX_THREADS, len(files)), thread_name_prefix="overlord-index") as pool:
        return list(pool.map(fn, files))
