"""An independent checker of what a training job kept, against the stream its run should deliver.

The chaos benchmark (``benchmarks/chaos.py``) records every step each rank of each life of a
training job received; a life that starts from a checkpoint throws away what the job took from
that step on (its model weights went back there too). :func:`kept` turns the lives into the
history the model was trained on, and :func:`check` compares it with ``replay(plan, timeline)``
(``service/replay.py``: the run planned again offline from its plan and its recorded timeline).
It shares nothing else with the service: the pieces come from the batches' own fields, each as
``(micro_batch, source, epoch, sample id, first token, tokens)``.
"""

from __future__ import annotations

from ..pieces import EPOCH, SOURCE, START, STOP

Piece = tuple[int, int, int, int, int, int]  # (micro_batch, source, epoch, sample id, start, length)


def batch_pieces(batch: dict) -> list[list[int]]:
    """A rank's step batch (``next_batch()``'s) as its pieces, each ``[micro_batch, source, epoch,
    sample id, first token, tokens]``."""
    out = []
    for m, mb in enumerate(batch["micro_batches"]):
        cu = mb["cu_seqlens"]
        for i in range(len(mb["sample_ids"])):
            row = (mb["source_ids"][i], mb["epochs"][i], mb["sample_ids"][i], mb["piece_starts"][i])
            out.append([m, *map(int, row), int(cu[i + 1] - cu[i])])
    return out


def kept(lives: list[tuple[int, list[dict]]]) -> dict[tuple[int, int], list[Piece]]:
    """What the trainers kept, per ``(rank, step)``: ``lives`` in the order they ran, each as
    (the step it started from, its records ``{"rank", "step", "ids": batch_pieces(...)}``).
    A life throws away every step from its start on, of every rank (a job with fewer ranks
    than before drops the ranks it no longer has)."""
    out: dict[tuple[int, int], list] = {}
    for start, records in lives:
        out = {k: v for k, v in out.items() if k[1] < start}
        for x in records:
            if x["step"] >= start:
                out[(x["rank"], x["step"])] = sorted(map(tuple, x["ids"]))
    return out


def check(replayed: dict[int, dict], history: dict[tuple[int, int], list], steps: int) -> dict:
    """Steps ``[0, steps)`` of ``history`` (:func:`kept`) against ``replayed``
    (``replay(plan, timeline, steps)``): ``lost`` planned pieces no rank kept, ``repeated``
    pieces kept more than once (every extra copy), ``identical`` every (rank, step) holds exactly
    the replayed pieces in the replayed micro-batches (``mismatched``: the first ten that do not)."""
    want: dict[tuple[int, int], list] = {}
    planned = set()
    for s in range(steps):
        e = replayed[s]
        p, slot, ids = e["pieces"], e["slot"], e["sample_ids"]
        for i in range(len(p)):
            piece = (int(p[i, SOURCE]), int(p[i, EPOCH]), int(ids[i]), int(p[i, START]))
            want.setdefault((int(slot[i, 0]), s), []).append((int(slot[i, 1]), *piece, int(p[i, STOP] - p[i, START])))
            planned.add(piece)
    want = {k: sorted(v) for k, v in want.items()}
    seen: dict[tuple, int] = {}
    for (_, s), pieces in history.items():
        if s < steps:
            for x in pieces:
                seen[tuple(x[1:5])] = seen.get(tuple(x[1:5]), 0) + 1
    keys = set(want) | {k for k in history if k[1] < steps}
    mismatched = sorted(k for k in keys if want.get(k) != history.get(k))
    return {
        "lost": len(planned - set(seen)),
        "repeated": sum(c - 1 for c in seen.values()),
        "identical": not mismatched,
        "mismatched": [list(k) for k in mismatched[:10]],
    }
