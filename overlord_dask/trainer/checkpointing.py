"""The stream's part of a training job's checkpoint, torchdata ``StatefulDataLoader`` style (and
DCP's ``Stateful``): ``state_dict()`` says which step the trainer needs next, ``load_state_dict()``
resumes there on a new stream, whatever the service has done since.

A mixin of ``stream.RankStream`` (it works on the stream's attachment: ``rio``, ``hand``, the
service's ``info``), kept apart so one file says how a job's checkpoint and the service meet.
"""

from __future__ import annotations

from ..errors import ServiceError

STATE_VERSION = 1


class Checkpointing:
    """(mixin of ``RankStream``) The consumer state in a trainer checkpoint."""

    def state_dict(self) -> dict:
        """Small and topology-free: the next step this trainer needs. Save it with the trainer's
        own checkpoint; ``load_state_dict`` on a new stream resumes there, also when the service
        has handed out far past it, restarted from its snapshot, or the job comes back with
        another number of ranks. This call waits until the service has every acknowledgement up
        to it; with the plan's ``checkpoint.commit: checkpoint`` it also makes those steps
        durable in the service's snapshots."""
        self._ensure_attached()
        self._finish_previous()
        self._flush(durable=True)
        return {"version": STATE_VERSION, "next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a trainer checkpoint (``state_dict()``'s), whatever the service has
        handed out since: where it is past that step for this rank, or runs another number of
        ranks than this stream's ``dp``, the service goes back to it (the whole job's ranks
        restart from the same checkpoint; their other streams find it done) and delivers from
        there exactly what it delivered the first time (with the same dp), nothing before it and
        nothing skipped. Where the service is behind it, the steps in between are skipped and
        acknowledged. A step older than the service keeps (``checkpoint.keep_steps``) is refused,
        naming the oldest it can serve."""
        target = _checked_step(state)
        dp = self.dp if self.dp is not None else self._info["dp"]
        if self.rio is None or dp != self._info["dp"] or target < self.next_step:
            # the service may have to go back: this attachment ends, a new one starts from target
            if self.rio is not None:
                self.rio.stop(wait=10)
                self.rio, self.hand, self._unacked = None, None, None
            planner = self.io.planner(self._address)
            resp = self.io.run(planner.rewind(self.rank, target, dp, self.cp_rank or 0, self.replica), timeout=120)
            if resp.get("error"):
                raise ServiceError(f"rank {self.rank}: {resp['error']}")
            if resp.get("rewound") or dp != self._info["dp"]:
                self._info = self.io.service_info(self._address, self.timeout)
                self.micro_batches = self._info["micro_batches"]
            self._ensure_attached()
        if target > self.next_step:
            self.next_step = target
            self.hand.skip_to(target)
            self.io.loop.call_soon_threadsafe(self.rio.wake_acks)


def _checked_step(state) -> int:
    """The step a consumer state (``RankStream.state_dict()``'s) resumes at; a ValueError naming
    what is wrong with it otherwise."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"consumer state version {got!r} is not supported (expected {STATE_VERSION})")
    target = state.get("next_step")
    if not isinstance(target, int) or isinstance(target, bool) or target < 0:
        raise ValueError(f"consumer state next_step must be a step number >= 0, got {target!r}")
    return target
