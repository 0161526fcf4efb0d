"""Why a rank waits: the error a trainer gets when no batch came within its timeout names the
cause the service's status shows (a failure, the load or build the step's batches wait on, a
step not planned yet, a source whose units are still loading, a rank that holds planning back, a
quarantined unit, a snapshot that cannot be written) and the step, instead of the status as a raw dict,
and what the rank's own fetches met where they failed."""

from __future__ import annotations

import time

FAR = 1000  # steps beyond the planned ones: not a service catching up, a state from elsewhere


def why_waiting(status: dict, rank: int, step: int, timeout: float) -> str:
    """The message for rank ``rank`` that waited ``timeout`` seconds for ``step``."""
    if status.get("failure"):
        return f"the overlord service failed: {status['failure']}"
    planned, committed = int(status.get("next_step", 0)), int(status.get("committed", 0))
    causes = []
    w = status.get("waiting")
    if w and w.get("step") == step:  # the service sees what the step's batches wait on
        causes.append(f"{w['cause']} (for {w['since_s']:g} s)")
    if step >= planned:
        far = step - planned >= FAR
        causes.append(
            f"the service has planned steps up to {planned - 1:,} (committed {committed:,})"
            + (
                f"; step {step:,} is {step - planned + 1:,} steps beyond them: a consumer state of another run, or a "
                "service restarted from an older snapshot than the trainer's checkpoint?"
                if far
                else ""
            )
        )
    if status.get("starved_on"):
        causes.append(f"planning waits on source {status['starved_on']!r}: its next units are still loading")
    acked = list(status.get("acked") or [])
    if acked and min(acked) + 1 < step - 1:
        low = min(acked)
        slow = [i for i, a in enumerate(acked) if a == low]
        causes.append(
            f"rank{'s' if len(slow) > 1 else ''} {', '.join(map(str, slow[:8]))}{' ...' if len(slow) > 8 else ''} "
            f"consumed only up to step {low:,}: the service plans at most loading.prefetch_steps ahead of the "
            "slowest rank"
        )
    quarantined = status.get("quarantined") or []
    if quarantined:
        q = quarantined[-1]
        causes.append(
            f"unit {q.get('unit')} of source {q.get('source')!r} was quarantined at step {q.get('step')} "
            f"({str(q.get('reason'))[:300]})"
        )
    if status.get("snapshot_error"):
        causes.append(status["snapshot_error"])
    if not causes:
        causes.append(
            f"the service has planned up to step {planned - 1:,} and committed {committed:,}; its status shows no "
            "cause (a load or build task may be retrying: see the service's log)"
        )
    return f"rank {rank}: no batch for step {step:,} within {timeout:g}s: " + "; ".join(causes)


class FetchTrouble:
    """What a rank's own fetches met (``fetch.fetch_batches`` tells it each holder that failed,
    and success), said beside the service's status when the rank times out: batches that are
    built but that this rank cannot fetch from the workers holding them show nowhere else."""

    def __init__(self):
        self.steps: list[int] | None = None  # the steps of the fetch that fails, None while fetches succeed
        self.last, self.since, self.failures = "", 0.0, 0

    def tell(self, steps: list[int], text: str | None) -> None:
        """(the IO loop) A holder of ``steps``' batches failed (``text``: how), or they came (None)."""
        if text is None:
            self.steps = None
            return
        if self.steps != steps:
            self.steps, self.since, self.failures = list(steps), time.monotonic(), 0
        self.last, self.failures = text, self.failures + 1

    def text(self, now: float | None = None) -> str | None:
        """The trouble in words, or None while fetches succeed."""
        if self.steps is None:
            return None
        steps, n = self.steps, self.failures
        span = f"step {steps[0]:,}" if len(steps) == 1 else f"steps {steps[0]:,}-{steps[-1]:,}"
        took = (time.monotonic() if now is None else now) - self.since
        return f"this rank's fetch of {span} failed {n:,} time{'s' if n > 1 else ''} in {took:.0f} s, last: {self.last}"
