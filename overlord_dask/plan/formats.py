"""Which formats a plan may name: the built-in readers, those packages register, and any
``module:Class`` the plan names itself.

The plan knows formats by name only (its package imports no reader): a name maps to the
``module:Class`` that implements ``overlord_dask.sources.formats.Format``, resolved where data is
read. Packages register formats under the entry-point group ``overlord_dask.formats``
(``name = "package.module:Class"``). What a plan must give a format is checked here for the
built-in ones (``RECORDS``: documents as records, with exactly one of ``text_field`` and
``tokens_field``; ``TOKENS``: token arrays, no ``text_field``) and by the reader's ``check`` for
the others.
"""

from __future__ import annotations

import functools
import re

BUILTIN = {
    "parquet": "overlord_dask.sources.parquet:ParquetFormat",
    "zarr": "overlord_dask.sources.zarr_source:ZarrFormat",
    "jsonl": "overlord_dask.sources.jsonl:JsonlFormat",
    "arrow": "overlord_dask.sources.arrow:ArrowFormat",
    "webdataset": "overlord_dask.sources.webdataset:WebDatasetFormat",
    "megatron": "overlord_dask.sources.megatron:MegatronFormat",
}
RECORDS = {"parquet", "jsonl", "arrow", "webdataset"}  # documents as records: text or token-list fields, preparation
TOKENS = {"zarr", "megatron"}  # token arrays: no text, no record preparation
ENTRY_POINTS = "overlord_dask.formats"
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@functools.lru_cache(maxsize=1)
def registered() -> dict[str, str]:
    """Format name -> ``module:Class``: the built-in ones, then those of installed packages."""
    from importlib.metadata import entry_points

    out = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINTS):
        out.setdefault(ep.name, ep.value)
    return out


def spec(name: str) -> str:
    """The ``module:Class`` behind a format name (a ``module:Class`` is its own)."""
    if _SPEC.match(name):
        return name
    try:
        return registered()[name]
    except KeyError:
        raise ValueError(unknown(name)) from None


def unknown(name: str) -> str:
    return (
        f"unknown format {name!r}: registered formats are {sorted(registered())}, "
        "or name a reader class as 'module:Class'"
    )


def check(name: str) -> str:
    """``name`` if a plan may use it (a registered format, or a ``module:Class``)."""
    spec(name)
    return name
