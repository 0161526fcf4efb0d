"""Logging on the workers as the service's process has it.

A worker plugin is unpickled in every worker process, which imports the module that defines it:
defined here, beside the worker's own code, a worker imports only this and ``logs`` for it (it
was defined with the service, which made every worker import the planner and its compiled
kernels, tens of MB per worker process)."""

from __future__ import annotations

from distributed import WorkerPlugin

from .. import logs


class LogSetup(WorkerPlugin):
    """``logs.setup`` in every worker process (present and future), as this process has it."""

    name = "overlord-log-setup"

    def __init__(self, fmt: str, level):
        self.fmt, self.level = fmt, level

    def setup(self, worker) -> None:
        logs.setup(self.fmt, self.level)

    def teardown(self, worker) -> None:
        logs.reset()
