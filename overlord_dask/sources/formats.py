"""The reader interface every source format implements, and how a format name finds its reader.

A format is a class with two methods, run in two places:

- ``discover(source, plan) -> list[LoadUnit]`` runs once per source in the service (and in
  ``overlord validate``), before the run: it finds the source's files and cuts them into load
  units, in a deterministic order, **from metadata alone** (footers, indexes, offsets arrays,
  file sizes, frame headers). It must not read or decompress document data: a corpus of
  thousands of files is indexed in seconds, and every service start pays it. It raises
  ``SourceError`` naming the source and file for a missing file, a missing field or a damaged
  index.
- ``read(source, plan, unit) -> pyarrow.Table | SampleBlock`` runs in a load task on a worker:
  the unit's documents in file order. Record formats return a table of records (every column
  the plan may use; ``_sample_id`` is optional); the shared pipeline then applies the source's
  ``prepare`` steps, tokenizes ``text_field`` or takes ``tokens_field``, and adds images
  (``records.py``). Token formats return a ``SampleBlock``. It must read only its unit and be a
  pure function of the files (the same unit, the same documents, on any worker, at any time),
  and raise ``SourceError`` naming the unit and what is wrong.

``plan`` is the source's slice of the plan (``plan.SourcePlan``: its folder, loading settings,
tokenizer, the run's name and seed), what a load task carries instead of the whole plan.

Sample ids are source-wide and stable: document ``k`` of a unit has id ``unit.first_id + k``.
A format that cannot count a unit's documents from metadata gives the unit ``stop = -1`` and a
``first_id`` with room for any count (``UNKNOWN_BASE``): the planner learns the count when the
unit is loaded, and such a unit is always read by one task.

Register a format by entry point (group ``overlord_dask.formats``, ``name = "module:Class"``) or
name the class in the plan (``format: my_pkg.formats:MyFormat``). ``check(source)`` may refuse a
source's fields early (at plan load for built-in formats: ``plan/formats.py``).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

from ..errors import SourceError
from ..plan import Source, SourcePlan
from ..plan import formats as names
from ..plan.base import import_callable
from .records import fields
from .units import LoadUnit

UNKNOWN_BASE = 1 << 32
"""``first_id`` spacing of units whose document count is unknown until loaded (unit ``i`` of such
a source starts at ``i * UNKNOWN_BASE``): room for 4 billion documents per unit."""


class Format(ABC):
    """A source format (see the module docstring). Subclasses set ``name`` and ``records``."""

    name = ""
    records = True  # read() returns a pyarrow.Table of records (else a SampleBlock of token ids)
    suffixes: tuple[str, ...] = ()  # the files a folder URL stands for

    def check(self, source: Source) -> None:
        """Raise ValueError if ``source`` names fields this format cannot read."""

    def warnings(self, source: Source, plan: SourcePlan) -> list[str]:
        """Advice on the source's layout for ``overlord validate`` (files that make loading slow)."""
        return []

    @abstractmethod
    def discover(self, source: Source, plan: SourcePlan) -> list[LoadUnit]:
        """The source's load units, from metadata only, in a deterministic order."""

    @abstractmethod
    def read(self, source: Source, plan: SourcePlan, unit: LoadUnit):
        """The unit's documents: a ``pyarrow.Table`` of records, or a ``SampleBlock``."""

    def regions(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> list[tuple[str, int, int | None]]:
        """The byte ranges ``(path, start, stop or None: to the end)`` a unit is read from, which
        its integrity digest covers (``integrity.py``); by default its whole file (or folder)."""
        return [(unit.path, 0, None)]

    def columns(self, source: Source) -> list[str] | None:
        """The columns ``read`` needs: the plan's fields, or every column (None) when the source
        prepares its records (a prepare step may read any column)."""
        return None if source.prepare else fields(source)


@functools.cache
def get_format(name: str) -> Format:
    """The reader of format ``name`` (a registered name, or ``module:Class``)."""
    try:
        spec = names.spec(name)
    except ValueError as err:
        raise SourceError(str(err)) from None
    try:
        cls = import_callable(spec)
    except ValueError as err:
        raise SourceError(f"format {name!r}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, Format)):
        raise SourceError(f"format {name!r}: {spec} is not a subclass of overlord_dask.sources.formats.Format")
    return cls()
