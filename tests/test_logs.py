"""The service's log filter: expected races and stops about our keys are dropped, nothing else."""

from __future__ import annotations

import logging

import pytest

from overlord_dask import logs


def _passes(text: str, logger: str = "distributed.worker") -> bool:
    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, text, None, None)
    return logs.ShadowRaceFilter().filter(record)


@pytest.mark.parametrize(
    "text",
    [
        "Key lost during replication: overlord-batch-demo-s16-r0-2",
        "Could not find data: ['overlord-load-demo-web-e0-u3-n2'] on workers: []",
        "Async instruction for <Task cancelled name=\"execute('overlord-load-demo-310e497e-web-e2-u8-n33-g3')\" "
        "coro=<Worker.execute() "
        "done, defined at worker_state_machine.py:3606>> ended with CancelledError",
        "Async instruction for <Task cancelled name=\"execute('overlord-batch-demo-s16-r0-2')\" coro=<...>> ended with "
        "CancelledError",
    ],
)
def test_expected_races_and_stops_about_our_keys_are_dropped(text):
    assert not _passes(text)


@pytest.mark.parametrize(
    "text",
    [
        "Key lost during replication: ('sum-abc', 0)",  # somebody else's key
        "Async instruction for <Task cancelled name=\"execute('inc-123')\" coro=<...>> ended with CancelledError",
        "Async instruction for <Task finished name=\"execute('overlord-load-x')\"> ended with "
        "ValueError",  # a real failure
        "Worker tcp://127.0.0.1:1 (pid=1) exceeded 95% memory budget. Restarting...",
    ],
)
def test_everything_else_passes(text):
    assert _passes(text)


def test_install_covers_the_worker_state_machine_logger():
    logs.install()
    logs.install()  # idempotent
    for name in logs.LOGGERS:
        assert sum(isinstance(f, logs.ShadowRaceFilter) for f in logging.getLogger(name).filters) == 1
    assert "distributed.worker.state_machine" in logs.LOGGERS


def _parse_logfmt(line: str) -> dict:
    """An independent logfmt reader: shell-style words (double quotes, backslash escapes), key=value."""
    import shlex

    return dict(word.split("=", 1) for word in shlex.split(line))


def test_events_as_logfmt_and_json_lines_that_parsers_read():
    import io
    import json

    buf = io.StringIO()
    try:
        logs.setup("logfmt", stream=buf)
        logs.event("quarantine", "run-1", 42, source="web", unit=3, reason='bad "page" = 7\nin row 2', rank=0)
        logs.setup("json", stream=buf)
        logs.event("stage", "run-1", 1200, stage="long context", previous=None)
        logging.getLogger("overlord_dask.service").warning("plain record %s", "here")
    finally:
        logs.reset()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    first = _parse_logfmt(lines[0])
    assert first["level"] == "info" and first["logger"] == "overlord_dask.events" and first["ts"].endswith("Z")
    assert {k: first[k] for k in ("event", "run", "step", "source", "unit", "rank")} == {
        "event": "quarantine",
        "run": "run-1",
        "step": "42",
        "source": "web",
        "unit": "3",
        "rank": "0",
    }
    assert first["reason"].replace("\\n", "\n") == 'bad "page" = 7\nin row 2'
    second, third = json.loads(lines[1]), json.loads(lines[2])
    assert (
        second["event"] == "stage"
        and second["step"] == 1200
        and second["stage"] == "long context"
        and second["previous"] is None
    )
    assert third["msg"] == "plain record here" and third["level"] == "warning"
    with pytest.raises(ValueError, match="log format must be one of"):
        logs.setup("xml")


@pytest.mark.integration
def test_a_library_user_s_setup_reaches_the_workers(cluster, small_plan):
    from overlord_dask import Service

    try:
        logs.setup("json")
        with Service.start(small_plan(), cluster=cluster) as service:
            formats = service.client.run(
                lambda: [type(h.formatter).__name__ for h in logging.getLogger("overlord_dask").handlers]
            )
            service.client.unregister_worker_plugin("overlord-log-setup")  # the shared cluster's workers log as before
    finally:
        logs.reset()
    assert formats and all("JsonFormatter" in f for f in formats.values())
