"""The service's log filter: expected races and stops about our keys are dropped, nothing else."""

from __future__ import annotations

import logging

import pytest

from overlord_dask import logs


def _passes(text: str, logger: str = "distributed.worker") -> bool:
    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, text, None, None)
    return logs.ShadowRaceFilter().filter(record)


@pytest.mark.parametrize("text", [
    "Key lost during replication: overlord-batch-demo-s16-r0-2",
    "Could not find data: ['overlord-load-demo-web-e0-u3-n2'] on workers: []",
    "Async instruction for <Task cancelled name=\"execute('overlord-load-demo-310e497e-web-e2-u8-n33-g3')\" coro=<Worker.execute() "
    "done, defined at worker_state_machine.py:3606>> ended with CancelledError",
    "Async instruction for <Task cancelled name=\"execute('overlord-batch-demo-s16-r0-2')\" coro=<...>> ended with CancelledError",
])
def test_expected_races_and_stops_about_our_keys_are_dropped(text):
    assert not _passes(text)


@pytest.mark.parametrize("text", [
    "Key lost during replication: ('sum-abc', 0)",  # somebody else's key
    "Async instruction for <Task cancelled name=\"execute('inc-123')\" coro=<...>> ended with CancelledError",
    "Async instruction for <Task finished name=\"execute('overlord-load-x')\"> ended with ValueError",  # a real failure
    "Worker tcp://127.0.0.1:1 (pid=1) exceeded 95% memory budget. Restarting...",
])
def test_everything_else_passes(text):
    assert _passes(text)


def test_install_covers_the_worker_state_machine_logger():
    logs.install()
    logs.install()  # idempotent
    for name in logs.LOGGERS:
        assert sum(isinstance(f, logs.ShadowRaceFilter) for f in logging.getLogger(name).filters) == 1
    assert "distributed.worker.state_machine" in logs.LOGGERS
