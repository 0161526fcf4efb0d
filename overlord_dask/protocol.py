"""The control protocol in one place: scheduler routes, queue names, task keys, descriptors.

The planner plugin (scheduler), the driver (service process), the loader and constructor tasks
(workers), the batch server (workers) and the consumer (trainers) meet only through the names
defined here, so none of them imports another just to learn a string.

Routes on the scheduler (request/response unless noted):

- ``overlord_info()``: topology and names a consumer needs to attach.
- ``overlord_attach(rank, cp_rank)``: a consumer joins; answers the first step it gets (the one
  after the rank's last acknowledged step) and its queue's new generation. Descriptors of built
  batches from that step on are queued again under the new generation, so a trainer that
  restarted (or a second consumer after a first one died) loses and repeats nothing.
- ``overlord_channel(channel_id, run_id)`` (a stream, one per consumer process and run): the
  consumer sends ``{"op": "subscribe", rank, cp_rank, generation}`` (after attaching),
  ``{"op": "unsubscribe", rank, cp_rank, generation}`` and one-way ``{"op": "ack", rank, step,
  cp_rank, durable, wait_s, since_s}`` (the trainer's time in ``next()``, and its time, since it attached); the scheduler pushes ``{"op": "descriptors", rank, cp_rank, generation,
  items: [queue items]}`` as batches are built and ``{"op": "error", rank, cp_rank, generation,
  message}`` (``rank`` None: every rank of the channel, e.g. the run stopped; an attachment that
  a newer consumer of its rank replaced is told so). Both ways batched every few ms.
- ``overlord_ack(rank, step, cp_rank, durable)``: consumed every step up to ``step``; the
  request/response form, for ``commit()`` and ``state_dict()``, which wait for it.
- ``overlord_where(key, timeout)``: the workers holding a built batch (waits until it is built).
- ``overlord_work(timeout)``: the driver's long poll: loads to submit, constructor tasks to
  submit, batches to release, blocks no longer needed, failure.
- ``overlord_lengths`` (one-way, worker stream): a load task reports its unit's lengths, and the
  seconds and bytes loading it took.
- ``overlord_pools(lead_s)``: the pool autoscaler's inputs (weights over the schedule ahead, step
  rate, measured seconds per token, pending loads, the source planning waits on).
- ``overlord_request_stop()``: ask the serving process to stop cleanly (``status()["stop_requested"]``).
- ``overlord_status``, ``overlord_metrics``, ``overlord_ledger``, ``overlord_snapshots``,
  ``overlord_loop``, ``overlord_fail``, ``overlord_update``, ``overlord_plans``.

A queue item (``distributed.Queue`` per (rank, cp rank), msgpack, a few hundred bytes) names one
constructor task and the consecutive steps of that rank it holds::

    {"key": "overlord-batch-<run>-<first step>-r<lo>-<hi>", "steps": [s0, s1, ...],
     "workers": ["tcp://..."], "gen": 3, "run_id": "<run>"}

or ``{"error": "..."}`` when the run failed. The batch itself is fetched from the worker
(``overlord_fetch`` on the worker, see ``batch_server``), never through the scheduler.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

HANDLERS = (
    "overlord_info",
    "overlord_attach",
    "overlord_channel",
    "overlord_ack",
    "overlord_where",
    "overlord_work",
    "overlord_status",
    "overlord_metrics",
    "overlord_ledger",
    "overlord_fail",
    "overlord_snapshots",
    "overlord_loop",
    "overlord_update",
    "overlord_plans",
    "overlord_pools",
    "overlord_request_stop",
)
STREAM_HANDLERS = ("overlord_lengths",)
WORKER_FETCH = "overlord_fetch"


def queue_prefix(run_id: str) -> str:
    return f"overlord-{run_id}"


def rank_queue_name(run_id: str, rank: int, cp_rank: int = 0) -> str:
    return f"{queue_prefix(run_id)}-rank-{rank}" + (f"-cp-{cp_rank}" if cp_rank else "")


def load_prefix(run_id: str) -> str:
    return f"overlord-load-{run_id}-"


def load_key(run_id: str, source: str, epoch: int, unit: int) -> str:
    return f"{load_prefix(run_id)}{source}-e{epoch}-u{unit}"


def batch_key(run_id: str, first_step: int, rank_lo: int, rank_hi: int) -> str:
    """One constructor task: consecutive steps from ``first_step`` for ranks ``[rank_lo, rank_hi)``."""
    return f"overlord-batch-{run_id}-{first_step}-r{rank_lo}-{rank_hi}"


def block_key(source: int, epoch: int, unit: int) -> str:
    """Name of a sample block among a constructor task's inputs (source index, epoch, unit)."""
    return f"s{source}-e{epoch}-u{unit}"


def write_scheduler_file(path: str | os.PathLike, address: str, run_id: str, dp: int) -> None:
    """Where a service is, for trainers and tools that start elsewhere (``overlord serve
    --scheduler-file``): Dask's scheduler-file shape (``address``) plus the run. Written whole
    (temporary file, then rename), so a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"type": "Scheduler", "address": address, "run_id": run_id, "dp": dp}))
    os.replace(tmp, path)


def resolve_address(where: str) -> str:
    """A scheduler address (``tcp://host:port``), or the path of a scheduler file (ours or Dask's):
    the address. Read again on every reconnect, so a service restarted elsewhere is found."""
    if "://" in where:
        return where
    if os.path.isfile(where):
        try:
            return json.loads(Path(where).read_text())["address"]
        except (ValueError, KeyError, OSError) as err:
            raise ValueError(f"{where} is not a scheduler file (JSON with an 'address'): {err}") from None
    if "/" in where or where.endswith(".json"):
        raise ValueError(f"no scheduler file at {where} (is the service started with --scheduler-file {where}?)")
    return where  # host:port
