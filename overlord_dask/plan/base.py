"""What every part of a plan shares: the strict pydantic base, ``module:callable`` references,
and the rule for relative URLs (relative to the plan's own folder).

A plan names user code (a cost function, a schedule function, a tokenizer, a transform) as
``package.module:callable``. It is resolved when the plan is loaded, so that a typo fails on the
user's machine with the reference in the message, not later on a scheduler or a worker.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown fields are errors, models are immutable, defaults are validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, use_attribute_docstrings=True)


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def is_callable_ref(text: str) -> bool:
    """Whether ``text`` has the form ``package.module:callable`` (not a path, URL or drive)."""
    mod, colon, attr = text.partition(":")
    return bool(colon and _DOTTED.match(mod) and _DOTTED.match(attr))


def import_callable(spec: str) -> Callable:
    """Resolve ``package.module:callable``; the error names the reference and what went wrong."""
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"{spec!r} is not of the form 'module:callable'")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as err:
        raise ValueError(f"cannot import {spec!r}: module {mod_name!r}: {err}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"cannot import {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable")
    return obj


def resolve_url(url: str, base_dir: str | None) -> str:
    """An fsspec URL as given, or a relative local path joined to the plan's folder (``base_dir``;
    the working directory for a plan built in Python without one)."""
    if "://" not in url and not os.path.isabs(url):
        url = os.path.join(base_dir or os.getcwd(), url)
    return url
