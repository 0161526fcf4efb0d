"""Quiet the expected races of shadow copies in Dask's logs.

A built batch (and a loaded block) is copied to another worker as soon as it exists
(``loading.shadows``) and released as soon as it is no longer needed. With fast trainers the release can overtake the
copy; Dask then logs "Key lost during replication" (scheduler), "Could not find data" (worker,
at ERROR) and "failed to acquire keys", for data nobody needs any more. Those lines about
``overlord-batch-`` and ``overlord-load-`` keys are dropped; every other message, and these
messages about any other key, pass.
"""

from __future__ import annotations

import logging

RACES = ("Key lost during replication", "Could not find data", "failed to acquire keys")
LOGGERS = ("distributed.scheduler", "distributed.worker")


class ShadowRaceFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        if not (text.startswith(RACES) or "failed to acquire keys" in text):
            return True
        return "overlord-batch-" not in text and "overlord-load-" not in text


def install() -> None:
    """Add the filter to Dask's scheduler and worker loggers in this process (idempotent)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ShadowRaceFilter) for f in logger.filters):
            logger.addFilter(ShadowRaceFilter())
