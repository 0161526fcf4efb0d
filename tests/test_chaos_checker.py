"""The chaos run's checker (``overlord_dask.testing.history``) finds what it must: a lost piece, a
repeated one, a piece in the wrong micro-batch or rank, and a job's lives folded the way its
checkpoints say (a life throws away what the job took from its starting step on)."""

from __future__ import annotations

import numpy as np

from overlord_dask.testing.history import batch_pieces, check, kept


def _replayed(steps: int, dp: int = 2) -> dict:
    """A stream of ``steps`` steps: each rank gets two pieces per step, one per micro-batch."""
    out = {}
    for s in range(steps):
        rows, slot, ids = [], [], []
        for r in range(dp):
            for m in range(2):
                doc = (s * dp + r) * 2 + m
                rows.append([r % 2, 0, 0, doc, 0, 100 + doc])  # SOURCE EPOCH UNIT DOC START STOP
                slot.append([r, m])
                ids.append(1000 + doc)
        out[s] = {"pieces": np.array(rows, np.int64), "slot": np.array(slot, np.int32), "sample_ids": np.array(ids)}
    return out


def _records(replayed: dict, steps, dp: int = 2) -> list[dict]:
    recs = []
    for s in steps:
        e = replayed[s]
        for r in range(dp):
            mine = e["slot"][:, 0] == r
            p, slot, ids = e["pieces"][mine], e["slot"][mine], e["sample_ids"][mine]
            pieces = [
                [int(slot[i, 1]), int(p[i, 0]), int(p[i, 1]), int(ids[i]), int(p[i, 4]), int(p[i, 5] - p[i, 4])]
                for i in range(len(p))
            ]
            recs.append({"rank": r, "step": s, "ids": pieces})
    return recs


def test_a_clean_history_passes_and_every_kind_of_damage_is_found():
    rep = _replayed(10)
    good = kept([(0, _records(rep, range(10)))])
    assert check(rep, good, 10) == {"lost": 0, "repeated": 0, "identical": True, "mismatched": []}

    lost = dict(good)
    lost[(1, 4)] = lost[(1, 4)][1:]
    assert check(rep, lost, 10) | {"mismatched": None} == {
        "lost": 1,
        "repeated": 0,
        "identical": False,
        "mismatched": None,
    }

    repeated = dict(good)
    repeated[(0, 5)] = sorted(repeated[(0, 5)] + [repeated[(0, 4)][0]])
    out = check(rep, repeated, 10)
    assert (out["lost"], out["repeated"], out["identical"], out["mismatched"]) == (0, 1, False, [[0, 5]])

    moved = dict(good)  # the same pieces, one in the other micro-batch
    a, b = moved[(0, 2)]
    moved[(0, 2)] = sorted([(1 - a[0], *a[1:]), b])
    out = check(rep, moved, 10)
    assert (out["lost"], out["repeated"], out["identical"], out["mismatched"]) == (0, 0, False, [[0, 2]])

    swapped = dict(good)  # two ranks' steps exchanged
    swapped[(0, 3)], swapped[(1, 3)] = good[(1, 3)], good[(0, 3)]
    assert check(rep, swapped, 10)["mismatched"] == [[0, 3], [1, 3]]


def test_lives_fold_at_their_checkpoints():
    """Life 0 took steps 0-7; life 1 started from the checkpoint at 4 but took other pieces for
    5-6 (say) and died; life 2 started from 5: the history is life 0's 0-4 and life 2's 5-9."""
    rep = _replayed(10)
    wrong = _records(_replayed(10, dp=2), range(5, 7))
    for x in wrong:
        x["ids"] = [[m, src, ep, sid + 7, st, n] for m, src, ep, sid, st, n in x["ids"]]
    lives = [(0, _records(rep, range(8))), (4, _records(rep, [4]) + wrong), (5, _records(rep, range(5, 10)))]
    out = check(rep, kept(lives), 10)
    assert out == {"lost": 0, "repeated": 0, "identical": True, "mismatched": []}
    # without the third life, life 1's pieces are what the job kept for 5-6 and 7-9 are missing
    out = check(rep, kept(lives[:2]), 10)
    assert out["lost"] > 0 and not out["identical"]


def test_batch_pieces_reads_a_batch_as_the_checker_compares_it():
    mb = {
        "source_ids": np.array([2, 0]),
        "epochs": np.array([0, 1]),
        "sample_ids": np.array([11, 12]),
        "piece_starts": np.array([0, 4096]),
        "cu_seqlens": np.array([0, 30, 130]),
    }
    assert batch_pieces({"micro_batches": [mb]}) == [[0, 2, 0, 11, 0, 30], [0, 0, 1, 12, 4096, 100]]
