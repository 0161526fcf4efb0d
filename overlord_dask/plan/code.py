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

from .base import import_callable, is_callable_ref


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


def references(value) -> set[str]:
    """Every ``module:callable`` string in a plan (as its plain dict)."""
    out: set[str] = set()
    if isinstance(value, dict):
        for v in value.values():
            out |= references(v)
    elif isinstance(value, list):
        for v in value:
            out |= references(v)
    elif isinstance(value, str) and is_callable_ref(value):
        out.add(value)
    return out


def local_code(plan_dict: dict, base_dir: str | None) -> list[str]:
    """Files of the plan-local code its references need (modules and packages in the plan's
    folder, not installed): what the service uploads to the scheduler and every worker, present
    and future, so that user code next to a plan needs no install on the cluster. A package is
    given as its folder (the caller zips it)."""
    import importlib.util
    import os

    if not base_dir:
        return []
    root = os.path.realpath(base_dir)
    out: list[str] = []
    for ref in sorted(references(plan_dict)):
        top = ref.partition(":")[0].split(".")[0]
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        origin = spec.origin if spec is not None else None
        if origin is None or not os.path.realpath(origin).startswith(root + os.sep):
            continue  # installed (or built in): the cluster's environment has it
        path = os.path.dirname(origin) if spec.submodule_search_locations else origin
        if path not in out:
            out.append(path)
    return out
