"""Source-loader tasks: the functions Dask runs on workers to load units.

``load_block`` reads one unit and keeps the resulting ``SampleBlock`` on the worker. What the
planner needs of it (document lengths, ~8 bytes per document, and image tokens per document)
goes from the worker to the scheduler as one message on the worker's own stream
(``overlord_lengths``), sent before the task finishes: no second task, no submitter hop, no
polling. A recomputed load (after a lost worker) reports again; the planner ignores repeats.
Task keys (``protocol.load_key`` plus the submitter's request number) name one request, so a
recomputation after a lost worker produces the same block under the same name, and a unit asked
for again (evicted, then needed) runs, and reports its lengths, again.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..client import lengths_report
from ..errors import SourceError
from ..plan.loading import plan_from_dict
from ..sources import load_unit
from ..sources.blocks import SampleBlock
from ..sources.units import LoadUnit

_PLAN_CACHE: dict[str, object] = {}


def _plan(plan_dict: dict, cache_key: str):
    plan = _PLAN_CACHE.get(cache_key)
    if plan is None:
        plan = _PLAN_CACHE[cache_key] = plan_from_dict(plan_dict, where="<service plan>")
    return plan


def load_block(plan_dict: dict, cache_key: str, unit: dict, run_id: str | None = None, epoch: int = 0,
               part: tuple[int, int] | None = None) -> SampleBlock:
    """Load one unit (or documents ``part = (lo, hi)`` of it: auto-partitioning); ``cache_key``
    names the plan version (run id and version) that defines the unit's source, so a worker
    validates each version's plan once. Inside a worker, the unit's lengths are reported to the
    planner of run ``run_id`` (``epoch`` is the planner's)."""
    plan = _plan(plan_dict, cache_key)
    u = LoadUnit.from_dict(unit)
    whole = u
    if part is not None:  # the same documents a whole-unit load reads, from lo to hi
        u = replace(u, start=u.start + part[0], stop=u.start + part[1], first_id=u.first_id + part[0])
    t0 = time.thread_time()  # CPU, not wall: on a crowded machine wall time grows with the workers added
    try:
        block = load_unit(plan.source(u.source), plan, u)
    except Exception as err:  # name the unit and its file: the run's error must say where to look
        raise SourceError(f"loading {u.describe()}: {type(err).__name__}: {err}") from None
    if run_id is not None:
        report_lengths(run_id, u.source, epoch, u.index, block, time.thread_time() - t0,
                       None if part is None else (part[0], part[1], whole.n_docs))
    return block


def load_group(plan_dict: dict, cache_key: str, units: list[dict], run_id: str | None = None, epochs: list[int] | None = None) -> tuple:
    """Several small units of one source read by one task (auto-partitioning): their blocks, in order."""
    epochs = epochs or [0] * len(units)
    return tuple(load_block(plan_dict, cache_key, u, run_id, e) for u, e in zip(units, epochs))


def report_lengths(run_id: str, source: str, epoch: int, unit: int, block: SampleBlock, seconds: float = 0.0,
                   part: tuple[int, int, int] | None = None) -> None:
    """Send a loaded unit's metadata to the planner through the worker's scheduler stream, with
    what loading it cost (CPU seconds, bytes): the autoscaler sizes the source's pool from it.
    ``part = (lo, hi, unit documents)``: the block holds only those documents of the unit."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:  # not inside a worker (a direct call): nobody to tell
        return
    vision = block.vision_tokens()
    msg = lengths_report(run_id, source, epoch, unit, block.lengths().astype("<i8").tobytes(),
                         None if vision is None else vision.astype("<i8").tobytes(), seconds, block.nbytes,
                         None if part is None else list(part))
    worker.loop.add_callback(worker.batched_send, msg)  # tasks run in a thread; the stream lives on the loop
