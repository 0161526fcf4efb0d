"""Where the planner's snapshots go, what they keep, and when a step is durable."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict


class Checkpoint(Strict):
    """Where the planner's snapshots go, so that a restarted service resumes exactly."""

    url: str | None = None
    """fsspec URL of a folder (`file:///…`, a path, `s3://bucket/run`); None: no snapshots.
    A relative path is resolved against the plan file's folder."""
    storage_options: dict = Field(default_factory=dict)
    """fsspec options for the snapshot location (credentials, endpoint)."""
    keep_bases: int = Field(default=2, ge=1, le=1000)
    """Base snapshots kept (with their deltas) by garbage collection, at least."""
    keep_steps: int = Field(default=2000, ge=0, le=10_000_000)
    """How far back a training job may restart from its checkpoint while the service runs on:
    the planner keeps its state at every planning window of the last ``keep_steps`` committed
    steps (in memory: a few KB per window), and snapshot garbage collection keeps the bases that
    reach that far. A checkpoint older than that is refused, naming the oldest step the service
    can serve."""
    keep_hours: float | None = Field(default=None, gt=0)
    """With a snapshot location: also keep the bases written in the last ``keep_hours`` hours, so
    a job can restart from checkpoints that old (served from storage)."""
    base_every_steps: int = Field(default=1000, ge=1)
    """A full base snapshot after this many committed steps (deltas in between)."""
    base_every_seconds: float = Field(default=600.0, gt=0)
    """... or after this many seconds, whichever comes first."""
    resume: bool = True
    """Start from the newest snapshot at `url` when there is one."""
    on_code_change: Literal["refuse", "accept"] = "refuse"
    """A resumed run whose sources' ``prepare`` functions changed since the snapshot (their code,
    not only their names) would deliver other documents from the resume point on: ``refuse``
    stops the start, naming the function; ``accept`` goes on and logs ``event=code_changed``."""
    on_data_change: Literal["refuse", "accept"] = "refuse"
    """A source file whose size or modification stamp (mtime, or the object store's ETag) changed
    since the run first indexed it, or that is gone, would deliver other documents than the run's
    snapshots describe: ``refuse`` stops the start, naming the files; ``accept`` goes on, logs
    ``event=data_changed`` and keeps the new stamps (a copy of the data to another disk changes
    mtimes: accept it once). With ``loading.integrity`` the units' digests decide instead."""
    commit: Literal["ack", "checkpoint"] = "ack"
    """When a step is durable (what a snapshot resumes from): `ack`, once every rank has consumed
    it; `checkpoint`, once every rank's trainer has saved its state (``stream.state_dict()``).
    A training job restarting from any checkpoint within the retention (``keep_steps``,
    ``keep_hours``) is served in either mode; `checkpoint` keeps the service's own snapshots at
    the trainers' checkpoints, so a restart of everything resumes there whatever the
    retention."""
