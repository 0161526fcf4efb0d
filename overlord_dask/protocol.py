"""The control protocol in one place: scheduler routes, task keys, descriptors.

The planner plugin (scheduler), the submitter (service process), the loader and constructor
tasks (workers), the batch server (workers) and the trainers meet only through the names defined
here, so none of them imports another just to learn a string. Each route's name is written once,
in :class:`Route`; ``scheduler/routes.py`` binds them to handlers and ``client.py`` calls them.

What each route takes and answers is listed with the route table, in ``scheduler/routes.py``.

A descriptor (msgpack, a few hundred bytes) names one constructor task and the consecutive
steps it holds; it travels on the channels (``scheduler/channels.py``) once per channel, with
the consumers it is for::

    {"op": "descriptors", "to": [[rank, cp_rank, replica, generation], ...],
     "items": [{"key": "overlord-batch-<run>-<first step>-r<lo>-<hi>", "steps": [s0, s1, ...],
                "workers": ["tcp://..."], "run_id": "<run>"}]}

or an item ``{"error": "..."}`` when the run failed. The batch itself is fetched from the worker
(``overlord_fetch`` on the worker, see ``batch_server``), never through the scheduler.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CHANNEL_INTERVAL = 0.002
"""Batching interval (seconds) of a trainer process's channel to the scheduler, both directions."""


class Route:
    """The name of every route, written here once: the scheduler's route table
    (``scheduler/routes.py``) binds them, the client (``client.py``) calls them."""

    INFO = "overlord_info"
    ATTACH = "overlord_attach"
    REWIND = "overlord_rewind"
    CHANNEL = "overlord_channel"  # a stream, one per consumer process and run
    ACK = "overlord_ack"
    WHERE = "overlord_where"
    WORK = "overlord_work"
    STATUS = "overlord_status"
    METRICS = "overlord_metrics"
    LEDGER = "overlord_ledger"
    FAIL = "overlord_fail"
    SNAPSHOTS = "overlord_snapshots"
    LOOP = "overlord_loop"
    UPDATE = "overlord_update"
    PLANS = "overlord_plans"
    POOLS = "overlord_pools"
    REQUEST_STOP = "overlord_request_stop"
    LENGTHS = "overlord_lengths"  # one-way, on a worker's own stream to the scheduler
    FETCH = "overlord_fetch"  # on every worker: a trainer fetches built batches
    EVAL = "overlord_eval"  # where the run's evaluation batches are
    SKIP = "overlord_skip"  # steps not to hand out (a decision in the run's timeline)


def reports_in(item: dict) -> int:
    """How many trainer reports one report item stands for (``trainer/reporting.aggregate``
    sends a chunk's step times as columns and its loss reports merged, with their count)."""
    steps = item.get("steps")
    if isinstance(steps, (list, tuple)):
        return len(steps)
    n = item.get("n", 1)
    return n if isinstance(n, int) and n > 0 else 1


def step_times(item: dict) -> tuple[list, list, list] | None:
    """A report item's compute times as columns ``(steps, seconds, per micro-batch seconds or
    None)``, from the aggregated ``{"steps", "t", "mb"}`` or a single step's ``{"s", "t", "mb"}``;
    None when it carries no times or its columns disagree in length (a malformed item is
    dropped, not the planner's failure)."""
    if "steps" in item:
        steps = list(item["steps"])
        k = len(steps)
        times = item.get("t") or ()
        mb = item.get("mb") or [None] * k
        if len(times) != k or len(mb) != k:
            return None
        return steps, list(times), list(mb)
    if "t" in item:
        return [int(item["s"])], [item["t"]], [item.get("mb")]
    return None


def eval_key(run_id: str) -> str:
    """The task holding a run's evaluation batches (``worker/evaluation.py``)."""
    return f"overlord-eval-{run_id}"


def load_prefix(run_id: str) -> str:
    return f"overlord-load-{run_id}-"


def load_key(run_id: str, source: str, epoch: int, unit: int) -> str:
    return f"{load_prefix(run_id)}{source}-e{epoch}-u{unit}"


def batch_key(run_id: str, first_step: int, rank_lo: int, rank_hi: int, rewinds: int = 0) -> str:
    """One constructor task: consecutive steps from ``first_step`` for ranks ``[rank_lo, rank_hi)``
    (after the run's ``rewinds``-th rewind: its steps are built anew, under keys of their own)."""
    return f"overlord-batch-{run_id}-{first_step}-r{rank_lo}-{rank_hi}" + (f"-w{rewinds}" if rewinds else "")


def block_key(source: int, epoch: int, unit: int) -> str:
    """Name of a sample block among a constructor task's inputs (source index, epoch, unit)."""
    return f"s{source}-e{epoch}-u{unit}"


def write_scheduler_file(
    path: str | os.PathLike, address: str, run_id: str, dp: int, dashboard: str | None = None
) -> None:
    """Where a service is, for trainers and tools that start elsewhere (``overlord serve
    --scheduler-file``): Dask's scheduler-file shape (``address``) plus the run and its
    ``/overlord`` page. Written whole (temporary file, then rename), so a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    body = {"type": "Scheduler", "address": address, "run_id": run_id, "dp": dp, "dashboard": dashboard}
    tmp.write_text(json.dumps(body))
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
