"""Replicas of a data-parallel rank: the tensor- and pipeline-parallel ranks that receive the same
stream. Each acknowledges on its own; the planner hears, per (rank, cp rank), the last step every
attached replica consumed (and saved), so no batch is released while a replica still needs it.
A replica whose process went away stops holding the others back."""

from __future__ import annotations

Consumer = tuple[int, int, int]  # (rank, cp rank, replica)


class ReplicaAcks:
    def __init__(self) -> None:
        self.acked: dict[tuple[int, int], dict[int, list[int]]] = {}  # (rank, cp rank) -> replica -> [acked, durable]

    def attach(self, consumer: Consumer, rank_acked: int, rank_durable: int) -> int:
        """A replica attaches (again): the last step it consumed; a replica new to the rank
        starts where the rank is."""
        rank, cp_rank, replica = consumer
        return self.acked.setdefault((rank, cp_rank), {}).setdefault(replica, [rank_acked, rank_durable])[0]

    def ack(self, consumer: Consumer, step: int, durable: bool) -> tuple[int, int]:
        """The replica consumed (and, with ``durable``, saved) every step up to ``step``:
        ``(acked, durable)`` of the rank, the least over its replicas."""
        rank, cp_rank, replica = consumer
        replicas = self.acked.setdefault((rank, cp_rank), {})
        mine = replicas.setdefault(replica, [-1, -1])
        mine[0] = max(mine[0], step)
        if durable:
            mine[1] = max(mine[1], step)
        if len(replicas) == 1:  # (the common case: no tensor- or pipeline-parallel replicas)
            return mine[0], mine[1]
        return min(a for a, _ in replicas.values()), min(d for _, d in replicas.values())

    def leave(self, consumer: Consumer) -> None:
        rank, cp_rank, replica = consumer
        replicas = self.acked.get((rank, cp_rank), {})
        replicas.pop(replica, None)
        if not replicas:
            self.acked.pop((rank, cp_rank), None)

    def clear(self) -> None:
        self.acked.clear()
