"""The code identity of the functions that decide which documents a source yields (its
``prepare`` steps and ``transform``), so that a run resumed with changed functions is noticed.

A snapshot says which documents were delivered up to its step by position; a changed filter
would make the same positions other documents from there on (a record dropped before is kept now,
or the reverse), so resuming silently would repeat or skip data. The identity is a hash of the
function's source text (its bytecode where there is no source), read when the plan is loaded;
what the function calls is not covered. ``checkpoint.on_code_change`` decides: refuse (the
default) or accept and log.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import marshal

from .base import import_callable


@functools.lru_cache(maxsize=256)
def identity(spec: str) -> str:
    """A short hash of the code behind ``module:callable``."""
    fn = import_callable(spec)
    try:
        text = inspect.getsource(fn).encode()
    except (OSError, TypeError):  # no source file (a compiled or interactive function): its code object
        code = getattr(fn, "__code__", None)
        text = marshal.dumps(code) if code is not None else repr(fn).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def identities(sources) -> dict[str, str]:
    """``"<source>: <module:callable>"`` -> identity, for each source's prepare steps and transform."""
    out = {}
    for s in sources:
        for spec in [p.function for p in s.prepare] + ([s.transform] if s.transform else []):
            out[f"{s.name}: {spec}"] = identity(spec)
    return out


def changed(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """The functions whose code differs between a snapshot's record and now (both named)."""
    return sorted(k for k in recorded.keys() & now.keys() if recorded[k] != now[k])
