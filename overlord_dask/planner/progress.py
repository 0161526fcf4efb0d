"""What the trainers have consumed and saved: acknowledgements, the committed and durable steps.

Each (rank, cp rank) acknowledges the last step it consumed (and, in ``checkpoint`` commit mode,
the last one its trainer checkpoint saved). ``committed`` is the first step some rank has not
consumed; ``durable_step`` the first step a restart may deliver again: everything before it was
consumed (commit ``ack``) or saved by every trainer (commit ``checkpoint``). Snapshots are taken
at the durable step.
"""

from __future__ import annotations


class Progress:
    def __init__(self, commit_mode: str, dp: int, cp: int, acked_through: int = -1):
        self.commit_mode, self.dp, self.cp = commit_mode, dp, cp
        self.acked = [acked_through] * (dp * cp)  # last step each (rank, cp rank) consumed
        self.durable = list(self.acked)  # last step each saved in a trainer checkpoint

    @property
    def committed(self) -> int:
        """Number of steps every rank has acknowledged (steps 0..committed-1 are done)."""
        return min(self.acked) + 1

    @property
    def durable_step(self) -> int:
        """Steps a restart must never deliver again: consumed (commit 'ack') or saved in every
        trainer's checkpoint (commit 'checkpoint')."""
        return self.committed if self.commit_mode == "ack" else min(self.committed, min(self.durable) + 1)

    def restart_at(self, step: int) -> None:
        """A restore: every rank consumed and saved the steps before ``step``."""
        self.acked = [step - 1] * len(self.acked)
        self.durable = list(self.acked)

    def check(self, rank: int, step: int, cp_rank: int, planned: int) -> None:
        """ValueError naming what is wrong with an acknowledgement of ``step`` by (``rank``,
        ``cp_rank``) when ``planned`` steps are planned."""
        if not 0 <= rank < self.dp:
            raise ValueError(f"rank {rank} does not exist: the plan has dp={self.dp} ranks (0..{self.dp - 1})")
        if not 0 <= cp_rank < self.cp:
            raise ValueError(f"cp rank {cp_rank} does not exist: the plan has cp={self.cp}")
        if step >= planned:
            raise ValueError(f"rank {rank} acknowledged step {step}, but only steps < {planned} were planned")

    def ack(self, rank: int, step: int, cp_rank: int = 0, durable: bool = False, *, planned: int) -> int:
        """(``rank``, ``cp_rank``) consumed every step up to ``step`` (and, if ``durable``, saved
        them in its trainer checkpoint); idempotent. ``planned``: steps planned so far. Returns
        ``committed``."""
        self.check(rank, step, cp_rank, planned)
        i = rank * self.cp + cp_rank
        self.acked[i] = max(self.acked[i], step)
        if durable:
            self.durable[i] = max(self.durable[i], step)
        return self.committed
