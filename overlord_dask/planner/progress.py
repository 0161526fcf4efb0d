"""What the trainers have consumed and saved: acknowledgements, the committed and durable steps.

Each (rank, cp rank) acknowledges the last step it consumed (and, in ``checkpoint`` commit mode,
the last one its trainer checkpoint saved). ``committed`` is the first step some rank has not
consumed; ``durable_step`` the first step a restart may deliver again: everything before it was
consumed (commit ``ack``) or saved by every trainer (commit ``checkpoint``). Snapshots are taken
at the durable step.
"""

from __future__ import annotations


class RunningMin:
    """The minimum of per-rank counters that only grow, kept as the lowest value and how many
    ranks are at it: an update is O(1), and the whole list is scanned again only when the last
    rank at the minimum moves on (once per step and chunk, not once per acknowledgement: at
    thousands of ranks, ``min()`` per ack was a cost per step that grew with dp²)."""

    __slots__ = ("values", "low", "at_low")

    def __init__(self, values: list[int]):
        self.values = values
        self._rescan()

    def _rescan(self) -> None:
        self.low = min(self.values)
        self.at_low = self.values.count(self.low)

    def raise_to(self, i: int, value: int) -> None:
        old = self.values[i]
        if value <= old:
            return
        self.values[i] = value
        if old == self.low:
            self.at_low -= 1
            if self.at_low == 0:
                self._rescan()

    def __getitem__(self, i: int) -> int:
        return self.values[i]

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        return iter(self.values)


class Progress:
    def __init__(self, commit_mode: str, dp: int, cp: int, acked_through: int = -1):
        self.commit_mode, self.dp, self.cp = commit_mode, dp, cp
        self.restart_at(acked_through + 1)

    def last(self, i: int) -> tuple[int, int]:
        """(last step consumed, last saved) of (rank, cp rank) index ``i``; ``(-1, -1)`` for one
        these counts do not cover (a rank that a dp switch still ahead of the planner adds)."""
        return (self.acked[i], self.durable[i]) if i < len(self.acked) else (-1, -1)

    @property
    def committed(self) -> int:
        """Number of steps every rank has acknowledged (steps 0..committed-1 are done)."""
        return self.acked.low + 1

    @property
    def durable_step(self) -> int:
        """Steps a restart must never deliver again: consumed (commit 'ack') or saved in every
        trainer's checkpoint (commit 'checkpoint')."""
        return self.committed if self.commit_mode == "ack" else min(self.committed, self.durable.low + 1)

    def restart_at(self, step: int) -> None:
        """A restore: every rank consumed and saved the steps before ``step``."""
        self.acked = RunningMin([step - 1] * (self.dp * self.cp))  # last step each (rank, cp rank) consumed
        self.durable = RunningMin([step - 1] * (self.dp * self.cp))  # last step each saved in a trainer checkpoint

    def check(self, rank: int, step: int, cp_rank: int, planned: int) -> None:
        """ValueError naming what is wrong with an acknowledgement of ``step`` by (``rank``,
        ``cp_rank``) when ``planned`` steps are planned."""
        if not 0 <= rank < self.dp:
            raise ValueError(f"rank {rank} does not exist: the plan has dp={self.dp} ranks (0..{self.dp - 1})")
        if not 0 <= cp_rank < self.cp:
            raise ValueError(f"cp rank {cp_rank} does not exist: the plan has cp={self.cp}")
        if step >= planned:
            raise ValueError(f"rank {rank} acknowledged step {step}, but only steps < {planned} were planned")

    def ack(
        self,
        rank: int,
        step: int,
        cp_rank: int = 0,
        durable: bool = False,
        *,
        planned: int,
        saved: int = -1,
        checked: bool = False,
    ) -> int:
        """(``rank``, ``cp_rank``) consumed every step up to ``step`` (and, if ``durable``, saved
        them in its trainer checkpoint; else, saved those up to ``saved``, if that is a step);
        idempotent. ``planned``: steps planned so far (``checked``: the caller checked the
        acknowledgement against it already). Returns ``committed``."""
        if not checked:
            self.check(rank, step, cp_rank, planned)
        i = rank * self.cp + cp_rank
        self.acked.raise_to(i, step)
        if durable:
            self.durable.raise_to(i, step)
        elif saved >= 0:
            self.durable.raise_to(i, min(saved, step))
        return self.committed
