"""The service's logs: one structured record per notable event, and quiet for expected races.

Events (logger ``overlord_dask.events``, INFO) carry their fields as data (``record.overlord``):
``event``, ``run``, ``step`` where one applies, and ``source``, ``rank``, ``worker`` and others
where they apply (``worker`` is added on a Dask worker). :func:`setup` writes them as logfmt
(``ts=... level=info event=stage run=... step=1200 stage=long``, quoted as logfmt parsers read
it) or as one JSON object per line, so that a query over a week of logs answers "when did the
stage change, who rewound, which worker was lost": ``stage``, ``plan_update``,
``snapshot_base``, ``worker_lost``, ``rank_rewind``, ``stop_requested``, ``quarantine``,
``bad_records``, ``code_changed``. ``overlord serve`` sets it up (``--log-format``); a library
user calls ``overlord_dask.logs.setup()`` once, and ``Service.start`` passes the same setup to the
cluster's workers.

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

import json
import logging
import sys
import time

EVENTS = logging.getLogger("overlord_dask.events")
FORMATS = ("logfmt", "json")

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


def _worker() -> str | None:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return None


def event(name: str, run: str, step: int | None = None, **fields) -> None:
    """Log one event (its fields as data; the message is their logfmt line)."""
    data = {"event": name, "run": run, **({"step": step} if step is not None else {}), **fields}
    if "worker" not in data and (worker := _worker()) is not None:
        data["worker"] = worker
    EVENTS.info(logfmt(data), extra={"overlord": data})


def logfmt_value(v) -> str:
    """A value as logfmt writes it: bare where it can be, else double-quoted with escapes."""
    text = v if isinstance(v, str) else json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    if text and not any(c in text for c in ' "=\\') and text.isprintable():
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def logfmt(data: dict) -> str:
    return " ".join(f"{k}={logfmt_value(v)}" for k, v in data.items())


class LogfmtFormatter(logging.Formatter):
    """``ts=<ISO time> level=<level> logger=<name>``, then an event's fields, or ``msg="..."``."""

    def format(self, record: logging.LogRecord) -> str:
        head = {"ts": _iso(record.created), "level": record.levelname.lower(), "logger": record.name}
        data = getattr(record, "overlord", None)
        out = logfmt({**head, **data}) if data is not None else logfmt({**head, "msg": record.getMessage()})
        if record.exc_info:
            out += " " + logfmt({"exc": self.formatException(record.exc_info)})
        return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, then an event's fields or ``msg``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": _iso(record.created), "level": record.levelname.lower(), "logger": record.name}
        data = getattr(record, "overlord", None)
        out.update(data if data is not None else {"msg": record.getMessage()})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


_HANDLER: dict = {}  # the handler setup() installed in this process, and its settings


def setup(fmt: str = "logfmt", level: str | int = "INFO", stream=None) -> logging.Handler:
    """Write the service's events (and its other ``overlord_dask`` log records) to ``stream``
    (stderr) as ``logfmt`` or ``json``; idempotent (a second call replaces the first)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    root = logging.getLogger("overlord_dask")
    for logger in (root, EVENTS):  # a logging.config call elsewhere may have disabled loggers that existed then
        logger.disabled = False
    if _HANDLER.get("handler") is not None:
        root.removeHandler(_HANDLER["handler"])
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    EVENTS.setLevel(min(logging.INFO, root.level))
    root.propagate = False  # once here, not again through a root handler
    _HANDLER.update(handler=handler, fmt=fmt, level=level)
    return handler


def settings() -> dict | None:
    """What :func:`setup` was called with in this process (None: not called)."""
    return {"fmt": _HANDLER["fmt"], "level": _HANDLER["level"]} if _HANDLER.get("handler") is not None else None


def reset() -> None:
    """Undo :func:`setup`: ``overlord_dask`` records go to the root logger's handlers again."""
    handler = _HANDLER.pop("handler", None)
    if handler is not None:
        root = logging.getLogger("overlord_dask")
        root.removeHandler(handler)
        root.propagate = True
    _HANDLER.clear()
