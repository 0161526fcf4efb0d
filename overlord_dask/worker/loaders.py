"""Source-loader tasks: the functions Dask runs on workers to load units.

``load_block`` reads one unit and keeps the resulting ``SampleBlock`` on the worker. What the
planner needs of it (document lengths, ~8 bytes per document, and image tokens per document)
goes from the worker to the scheduler as one message on the worker's own stream
(``overlord_lengths``), sent before the task finishes: no second task, no submitter hop, no
polling. A recomputed load (after a lost worker) reports again; the planner ignores repeats.
With ``loading.block_store: disk`` the block's token ids go to a file on the worker's local
disk (``sources/block_files.py``) as soon as the unit is read.
Task keys (``protocol.load_key`` plus the submitter's request number) name one request, so a
recomputation after a lost worker produces the same block under the same name, and a unit asked
for again (evicted, then needed) runs, and reports its lengths, again.

A unit that cannot be read fails its task (Dask retries it ``loading.retries`` times, then the
run stops naming the unit), unless the plan says ``loading.on_corrupt: quarantine``: then the task
itself tries ``retries + 1`` times and, failing, keeps an empty block for the unit (its documents,
if counted, as empty documents: sample ids keep their meaning) and reports the reason with its
lengths; the planner records it (``status()["quarantined"]``) and logs ``event=quarantine``.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from ..allocator import give_back_freed
from ..client import lengths_report
from ..errors import SourceError
from ..plan import SourcePlan
from ..sources import LoadedUnit, read_unit
from ..sources.blocks import SampleBlock
from ..sources.units import LoadUnit


def load_block(
    plan: SourcePlan,
    unit: dict,
    run_id: str | None = None,
    epoch: int = 0,
    part: tuple[int, int] | None = None,
) -> SampleBlock:
    """Load one unit (or documents ``part = (lo, hi)`` of it: auto-partitioning) with its
    source's slice of the plan (``plan.SourcePlan``, validated once in the service: the worker
    takes it as it is). Inside a worker, the unit's lengths are reported to the planner of run
    ``run_id`` (``epoch`` is the planner's)."""
    u = LoadUnit.from_dict(unit)
    whole = u
    if part is not None:  # the same documents a whole-unit load reads, from lo to hi
        u = replace(u, start=u.start + part[0], stop=u.start + part[1], first_id=u.first_id + part[0])
    t0 = time.thread_time()  # CPU, not wall: on a crowded machine wall time grows with the workers added
    loaded, reason = _read(plan, u)
    if plan.loading.block_store == "disk":  # (before the report: it tells what the block holds in memory)
        loaded = replace(loaded, block=loaded.block.on_disk())
        give_back_freed()  # the unit's read buffers and ids, freed: not kept for the next read
    if run_id is not None:
        report_lengths(
            run_id,
            u.source,
            epoch,
            u.index,
            loaded,
            time.thread_time() - t0,
            None if part is None else (part[0], part[1], whole.n_docs),
            reason,
        )
    return loaded.block


QUARANTINE_BACKOFF_S = 0.5  # wait before attempt k + 1: k times this


def _read(plan, u: LoadUnit) -> tuple[LoadedUnit, str | None]:
    """The unit read, or (``on_corrupt: quarantine``, after its attempts) an empty block and why."""
    source = plan.source(u.source)
    quarantine = plan.loading.on_corrupt == "quarantine"
    attempts = plan.loading.retries + 1 if quarantine else 1
    for k in range(attempts):
        try:
            return read_unit(source, plan, u), None
        except Exception as err:  # name the unit and its file: the run's error must say where to look
            reason = f"loading {u.describe()}: {type(err).__name__}: {err}"
            if not quarantine:  # Dask retries the task, then the run stops naming the unit
                raise SourceError(reason) from None
            if k + 1 < attempts:
                time.sleep(QUARANTINE_BACKOFF_S * (k + 1))
    n = u.n_docs or 0
    empty = SampleBlock(
        u.source,
        np.zeros(0, np.int32),
        np.zeros(n + 1, np.int64),
        np.arange(u.first_id, u.first_id + n, dtype=np.int64),
    )
    return LoadedUnit(empty), reason


def load_group(
    plan: SourcePlan, units: list[dict], run_id: str | None = None, epochs: list[int] | None = None
) -> tuple:
    """Several small units of one source read by one task (auto-partitioning): their blocks, in order."""
    epochs = epochs or [0] * len(units)
    return tuple(load_block(plan, u, run_id, e) for u, e in zip(units, epochs))


def report_lengths(
    run_id: str,
    source: str,
    epoch: int,
    unit: int,
    loaded: LoadedUnit,
    seconds: float = 0.0,
    part: tuple[int, int, int] | None = None,
    quarantined: str | None = None,
) -> None:
    """Send a loaded unit's metadata to the planner through the worker's scheduler stream, with
    what loading it cost (CPU seconds, bytes): the autoscaler sizes the source's pool from it;
    the records its prepare steps dropped, and why it was quarantined, if it was.
    ``part = (lo, hi, unit documents)``: the block holds only those documents of the unit."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:  # not inside a worker (a direct call): nobody to tell
        return
    block = loaded.block
    vision, masked = block.vision_tokens(), block.masked_runs()
    msg = lengths_report(
        run_id,
        source,
        epoch,
        unit,
        block.lengths().astype("<i8").tobytes(),
        None if vision is None else vision.astype("<i8").tobytes(),
        seconds,
        block.nbytes,
        None if part is None else list(part),
        loaded.dropped,
        quarantined,
        None if masked is None else masked.astype("<i8").tobytes(),
    )
    worker.loop.add_callback(worker.batched_send, msg)  # tasks run in a thread; the stream lives on the loop
