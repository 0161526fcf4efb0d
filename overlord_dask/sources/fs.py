"""Resolving a source's fsspec URL or glob into a filesystem and a sorted list of paths."""

from __future__ import annotations

import fsspec
from fsspec.core import url_to_fs

from ..errors import SourceError
from ..plan.base import resolve_url
from ..plan.models import Source

_GLOB_CHARS = "*?["


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
    except (ImportError, ValueError) as err:
        raise SourceError(f"source {source.name!r}: cannot open filesystem for {url!r}: {err}") from None


def list_files(source: Source, base_dir: str | None) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """Files of a parquet source in a stable (sorted) order; errors name the source and URL."""
    fs, path = source_fs(source, base_dir)
    if any(c in path for c in _GLOB_CHARS):
        files = sorted(p for p in fs.glob(path) if not fs.isdir(p))
        if not files:
            raise SourceError(f"source {source.name!r}: no files match {source_url(source, base_dir)!r}")
        return fs, files
    if not fs.exists(path):
        raise SourceError(f"source {source.name!r}: file not found: {source_url(source, base_dir)!r}")
    if fs.isdir(path):
        files = sorted(p for p in fs.find(path) if p.endswith(".parquet"))
        if not files:
            raise SourceError(f"source {source.name!r}: folder {path!r} holds no .parquet files")
        return fs, files
    return fs, [path]
