"""The payload path: trainers fetch finished batches straight from the worker that holds them.

A ``WorkerPlugin`` adds one request/response handler to every worker (new workers included):
``overlord_fetch(key)`` returns the batch stored under ``key`` as zero-copy frames, or
``{"status": "missing"}`` if this worker does not hold it (it died and the batch was recomputed
elsewhere, say). The scheduler only ever routes the descriptor; it never sees the batch.

The consumer side, :func:`fetch_batch`, tries the address in the descriptor first and otherwise
asks the scheduler where the key lives now, until the timeout.
"""

from __future__ import annotations

import time

from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from .constructors import select_cp
from .errors import ServiceError


class BatchServer(WorkerPlugin):
    name = "overlord-batch-server"
    idempotent = True

    def setup(self, worker) -> None:
        async def overlord_fetch(key: str, cp_rank: int | None = None) -> dict:
            if key not in worker.data:
                return {"status": "missing"}
            batch = worker.data[key]
            if cp_rank is not None:  # send a context-parallel rank only its slices
                batch = select_cp(batch, cp_rank)
            return {"status": "OK", "batch": to_serialize(batch)}

        worker.handlers["overlord_fetch"] = overlord_fetch

    def teardown(self, worker) -> None:
        worker.handlers.pop("overlord_fetch", None)


def fetch_batch(client: Client, key: str, addresses: list[str], timeout: float, cp_rank: int | None = None) -> dict:
    """Gather one batch directly from a worker; follows the key if it moved."""
    deadline = time.monotonic() + timeout
    tried_without_location = 0
    while True:
        for addr in addresses:
            try:
                resp = client.sync(_fetch_from, client, addr, key, cp_rank)
            except (OSError, EnvironmentError):
                continue  # the worker went away; look the key up again
            if resp.get("status") == "OK":
                return resp["batch"]
        if time.monotonic() > deadline:
            raise ServiceError(f"batch {key} could not be fetched within {timeout}s (last known workers: {addresses})")
        addresses = client.sync(client.scheduler.who_has, keys=[key]).get(key) or []
        if not addresses:
            tried_without_location += 1
            time.sleep(min(0.5, 0.01 * tried_without_location))


async def _fetch_from(client: Client, addr: str, key: str, cp_rank: int | None) -> dict:
    return await client.rpc(addr).overlord_fetch(key=key, cp_rank=cp_rank)
