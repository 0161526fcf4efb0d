"""One source's slice of a plan: what reading its load units needs, and nothing else.

A load task carries this, not the whole plan: the run's name and seed (logs, seeded choices), the
plan's folder (relative URLs and tokenizer paths resolve against it), the loading settings (how
units are cut, what a failed read does), the plan's default tokenizer and the one source. It has
the shape of a :class:`~overlord_dask.plan.Plan` where readers look (``base_dir``, ``loading``,
``tokenizer_of(source)``, ``source(name)``), so a format reader written against a plan reads a
slice unchanged. Built from an already validated plan (:meth:`Plan.source_plan`), it is not
validated again, and a worker never re-validates the plan it came from.

Every load task carries its source's slice as an argument, so the scheduler (which unpickles a
task's arguments when it is submitted, and holds them while the task's block is wanted) and the
workers would each hold one copy of it per task, and build each of its nested models anew per
task. A slice is immutable, so it pickles as its content and a digest of it (:func:`shared`):
unpickled in a process that already holds a slice with that digest, it is that slice. A process
holds one copy per source, plan version and run, however many tasks name it.
"""

from __future__ import annotations

import hashlib
import pickle
import threading

from pydantic import Field

from .base import Strict
from .loading import Loading
from .source import Source
from .text import Tokenizer


class SourcePlan(Strict):
    """The slice of a plan that the loaders of one source read with."""

    name: str
    """The run's plan name."""
    seed: int
    """The plan's seed."""
    base_dir: str | None = None
    """The plan's folder (relative URLs and tokenizer paths resolve against it)."""
    tokenizer: Tokenizer = Field(default_factory=Tokenizer)
    """The plan's tokenizer (for a source that names none)."""
    loading: Loading = Field(default_factory=Loading)
    """The plan's loading settings."""
    sources: list[Source] = Field(min_length=1, max_length=1)
    """The one source."""
    run_id: str | None = None
    """The run whose load tasks carry the slice. What a process keeps per slice (the shared copy
    itself, a zarr group opened once for every load) lasts one run: a run started after the
    source's files were rewritten opens them anew."""

    def source(self, name: str) -> Source:
        (s,) = self.sources
        if s.name != name:
            raise KeyError(f"no source named {name!r} in the slice of source {s.name!r}")
        return s

    def tokenizer_of(self, source: Source) -> Tokenizer:
        """The tokenizer a source's text is encoded with: its own, else the plan's."""
        return source.tokenizer or self.tokenizer

    def __reduce__(self):
        state = pickle.dumps(self.__getstate__(), protocol=pickle.HIGHEST_PROTOCOL)
        return shared, (hashlib.blake2b(state, digest_size=16).digest(), state)


SHARED_MAX = 1024  # slices kept per process (sources × plan versions; the oldest go first)
_SHARED: dict[bytes, SourcePlan] = {}  # digest of a slice's pickled state -> this process's copy
_SHARED_LOCK = threading.Lock()  # (the scheduler's loop and a worker's task threads unpickle at once)


def shared(digest: bytes, state: bytes) -> SourcePlan:
    """The slice pickled as ``state`` (``digest`` names its content): the copy this process
    already holds, else one made from ``state`` and kept (the unpickling side of
    ``SourcePlan.__reduce__``)."""
    sp = _SHARED.get(digest)
    if sp is None:
        made = SourcePlan.__new__(SourcePlan)
        made.__setstate__(pickle.loads(state))
        with _SHARED_LOCK:
            sp = _SHARED.get(digest)
            if sp is None:
                if len(_SHARED) >= SHARED_MAX:
                    del _SHARED[next(iter(_SHARED))]
                sp = _SHARED[digest] = made
    return sp
