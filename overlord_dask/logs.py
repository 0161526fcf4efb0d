"""The service's logs: one structured line per notable event, and quiet for expected races.

Events (logger ``overlord_dask.events``, INFO) are one line each, ``event=<name> run=<id>
step=<n> key=value ...``, so that ``grep event=`` over a week of logs answers "when did the
stage change, who rewound, which worker was lost": ``stage``, ``plan_update``,
``snapshot_base``, ``worker_lost``, ``rank_rewind``, ``stop_requested``.

Shadow-copy races:

A built batch (and a loaded block) is copied to another worker as soon as it exists
(``loading.shadows``) and released as soon as it is no longer needed. With fast trainers the release can overtake the
copy; Dask then logs "Key lost during replication" (scheduler), "Could not find data" (worker,
at ERROR) and "failed to acquire keys", for data nobody needs any more. Those lines about
``overlord-batch-`` and ``overlord-load-`` keys are dropped; every other message, and these
messages about any other key, pass.

Stopping a run with loads or builds still executing: a closing worker cancels them, and Dask
logs "Async instruction for <Task cancelled name="execute('KEY')" ...> ended with CancelledError"
(``distributed.worker.state_machine``, WARNING) for each. For our keys that is the stop the
user asked for, not a fault, and it is dropped the same way.
"""

from __future__ import annotations

import logging

EVENTS = logging.getLogger("overlord_dask.events")

RACES = ("Key lost during replication", "Could not find data", "failed to acquire keys")
OURS = ("overlord-batch-", "overlord-load-")
LOGGERS = ("distributed.scheduler", "distributed.worker", "distributed.worker.state_machine")


class ShadowRaceFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        if "ended with CancelledError" in text:  # a task cancelled by its worker's close
            return not any(f"execute('{k}" in text for k in OURS)
        if not (text.startswith(RACES) or "failed to acquire keys" in text):
            return True
        return not any(k in text for k in OURS)


def install() -> None:
    """Add the filter to Dask's scheduler and worker loggers in this process (idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ShadowRaceFilter) for f in logger.filters):
            logger.addFilter(ShadowRaceFilter())


def event(name: str, run: str, step: int | None = None, **fields) -> None:
    """Log one event line (values with spaces are quoted)."""
    parts = [f"event={name}", f"run={run}"] + ([f"step={step}"] if step is not None else [])
    for k, v in fields.items():
        v = str(v)
        parts.append(f"{k}={v!r}" if (" " in v or not v) else f"{k}={v}")
    EVENTS.info(" ".join(parts))
