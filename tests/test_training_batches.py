"""What a training job's ranks receive (issue "Plug into real training jobs"): tensor- and
pipeline-parallel replicas of a data-parallel rank get identical batches without taking its slot;
the rank's place comes from a DeviceMesh or the launcher; labels in either convention, a loss mask,
``max_seqlen``, the ``[1, C]`` layout, and the step's loss-token count over all ranks."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

from overlord_dask import Service, connect
from overlord_dask.errors import RankError
from overlord_dask.trainer.place import place
from tests.harness import run_ranks


def _pieces(mb):
    cu = np.asarray(mb["cu_seqlens"]).astype(int)
    return list(zip(cu[:-1], cu[1:]))


@pytest.mark.integration
def test_replicas_get_identical_batches_and_both_label_conventions_count_the_step(cluster, small_plan):
    """Each of 3 ranks has two replicas (its tensor-parallel ranks, say): replica 0 takes shifted
    labels with a loss mask, replica 1 HF-style labels in the [1, C] layout. Both see the same
    tokens; their labels follow each convention piece by piece; every micro-batch's
    step_loss_tokens is the count of labels not -100 over the whole step, in its convention."""
    plan = small_plan(topology={"max_doc_tokens": 1500})  # long documents split: pieces that end before their document
    dp, steps = plan.topology.dp, 12
    got = {}
    with Service.start(plan, cluster=cluster) as service:

        def consume(key):
            rank, replica = key
            opts = {"loss_mask": True} if replica == 0 else {"labels": "hf", "batch_dim": True}
            with connect(service.address, rank, dp, replica=replica, timeout=120, **opts) as s:
                for _ in range(steps):
                    b = s.next_batch()
                    got[(rank, replica, b["step"])] = b["micro_batches"]
                s.commit()

        run_ranks(consume, [(r, q) for r in range(dp) for q in (0, 1)])
        assert service.status()["failure"] is None
    cut = 0
    for step in range(steps):
        counts = {0: 0, 1: 0}
        for rank in range(dp):
            a, b = got[(rank, 0, step)], got[(rank, 1, step)]
            assert len(a) == len(b) == plan.topology.micro_batches
            for ma, mb in zip(a, b):
                ids, shifted, hf = ma["input_ids"], ma["labels"], mb["labels"][0]
                assert mb["input_ids"].shape == (1, len(ids)) and np.array_equal(
                    mb["input_ids"][0], ids
                )  # the same batch
                np.testing.assert_array_equal(ma["loss_mask"], (shifted != -100).astype(np.float32))
                pieces = _pieces(ma)
                assert ma["max_seqlen"] == mb["max_seqlen"] == max(e - s for s, e in pieces)
                for s, e in pieces:
                    assert hf[s] == -100 and np.array_equal(
                        hf[s + 1 : e], ids[s + 1 : e]
                    )  # HF shifts: never across documents
                    assert np.array_equal(
                        shifted[s : e - 1], ids[s + 1 : e]
                    )  # shifted: the next token, inside the piece
                    cut += shifted[e - 1] != -100  # a split document's piece keeps its next token
                n = int(ma["num_tokens"])
                assert (hf[n:] == -100).all() and (shifted[n:] == -100).all()
                counts[0] += int((shifted != -100).sum())
                counts[1] += int((hf != -100).sum())
        for rank in range(dp):
            for mb in got[(rank, 0, step)]:
                assert mb["step_loss_tokens"] == counts[0], step
            for mb in got[(rank, 1, step)]:
                assert mb["step_loss_tokens"] == counts[1], step
    assert cut > 0  # the plan does split documents, so both counts differ


@pytest.mark.integration
def test_a_replica_that_leaves_does_not_hold_its_rank_back(cluster, small_plan):
    plan = small_plan(topology={"dp": 1})
    with Service.start(plan, cluster=cluster) as service:
        quitter = connect(service.address, 0, replica=1, timeout=60)
        quitter.next_batch()
        quitter.close()
        with connect(service.address, 0, timeout=60) as s:
            assert [s.next_batch()["step"] for _ in range(20)] == list(range(20))  # past the prefetch bound
        assert service.status()["failure"] is None


@pytest.mark.integration
def test_labels_for_models_that_shift_do_not_fit_context_parallelism(cluster, small_plan):
    plan = small_plan(topology={"cp": 2})
    with Service.start(plan, cluster=cluster) as service:
        with pytest.raises(ValueError, match="labels='hf'.*context parallelism"):
            connect(service.address, 0, cp_rank=0, labels="hf")
        with pytest.raises(ValueError, match="labels must be one of"):
            connect(service.address, 0, cp_rank=0, labels="next")


def _mesh(names, shape, coord):
    return SimpleNamespace(mesh_dim_names=names, mesh=np.zeros(shape), get_coordinate=lambda: list(coord))


def test_the_place_of_a_process_comes_from_its_device_mesh_or_its_launcher(monkeypatch):
    # torchtitan-style 4-D mesh: pp 2 x dp_shard 2 x cp 2 x tp 2; this process at (1, 1, 0, 1)
    p = place(device_mesh=_mesh(("pp", "dp_shard", "cp", "tp"), (2, 2, 2, 2), (1, 1, 0, 1)))
    assert (p.rank, p.dp, p.cp_rank, p.replica) == (1, 2, 0, 3)  # replica: row-major over (pp, tp)
    p = place(device_mesh=_mesh(("dp_replicate", "dp_shard", "tp"), (2, 3, 4), (1, 2, 3)))
    assert (p.rank, p.dp, p.cp_rank, p.replica) == (5, 6, None, 3)
    p = place(device_mesh=_mesh(("data", "model"), (4, 2), (3, 1)), dp_dims=("data",))
    assert (p.rank, p.dp, p.replica) == (3, 4, 1)
    with pytest.raises(RankError, match=r"dp_dims \['dp'\] are not dimensions"):
        place(device_mesh=_mesh(("data", "model"), (4, 2), (3, 1)), dp_dims=("dp",))
    with pytest.raises(RankError, match="not both"):
        place(0, device_mesh=_mesh(("dp",), (2,), (0,)))
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    p = place()
    assert (p.rank, p.dp, p.replica) == (5, 8, 0)
    monkeypatch.delenv("RANK")
    with pytest.raises(RankError, match="RANK and WORLD_SIZE"):
        place()


def test_identical_fetches_of_replicas_in_one_process_share_one_transfer():
    import asyncio

    from overlord_dask.trainer.fetch import fetch_shared

    calls = []

    class FakeIO:
        inflight, fetches_shared = {}, 0

        async def call_worker(self, address, call, abort=None):
            calls.append(address)
            await asyncio.sleep(0.05)
            return {"status": "OK", "payload": address}

    async def main():
        io = FakeIO()
        same = [fetch_shared(io, "tcp://w", ("key", 0, None, (3, 4)), None) for _ in range(3)]
        other = fetch_shared(io, "tcp://w", ("key", 1, None, (3, 4)), None)
        out = await asyncio.gather(*same, other)
        return io, out

    io, out = asyncio.run(main())
    assert len(calls) == 2 and io.fetches_shared == 2 and not io.inflight  # three replicas of rank 0: one transfer
    assert all(o["status"] == "OK" for o in out)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="host-shared payloads live in /dev/shm")
def test_a_relay_hands_a_ranks_chunk_to_its_replicas_once_and_leaves_no_file(monkeypatch):
    """``host_fetch.SharedPayloads`` (a host's relay): two replicas of a rank ask for steps of
    one chunk, the second for a part of it first; the worker is asked once, each reads its
    steps' bytes from the file, which goes once both took every step. A file that cannot be
    written (a full /dev/shm) is not left half-written, and the replicas are told to fetch
    themselves."""
    import asyncio

    from overlord_dask.trainer import host_fetch
    from overlord_dask.wire import Payload

    calls, frames = [], [b"step-four", b"step-five!"]

    class FakeIO:
        inflight, fetches_shared = {}, 0

        async def call_worker(self, address, call, abort=None):
            calls.append(address)
            return {"status": "OK", "payload": Payload(list(frames))}

    class Local:
        def __init__(self):
            self.got = []

        def send(self, msg):
            self.got.append(msg)

    def ask(shared, local, rid, replica, steps):
        msg = {"op": "fetch", "id": rid, "address": "tcp://w", "key": "k", "rank": 0, "cp_rank": None}
        shared.serve(local, {**msg, "replica": replica, "steps": steps, "chunk_steps": [4, 5]})

    def read(reply):
        with open(reply["path"], "rb") as f:
            data = f.read()
        return [data[at : at + n] for at, n in reply["at"]]

    mine = f"overlord-payload-{os.getuid()}-{os.getpid()}-"

    async def main():
        shared = host_fetch.SharedPayloads(FakeIO(), lambda rank_cp: 2)
        a, b = Local(), Local()
        ask(shared, a, 0, 0, [4, 5])
        ask(shared, b, 0, 1, [4])
        await asyncio.sleep(0.05)
        (ra,), (rb,) = a.got, b.got
        assert read(ra) == frames and read(rb) == frames[:1] and calls == ["tcp://w"]
        shared.done(a, {"id": 0})
        shared.done(b, {"id": 0})
        assert os.path.exists(ra["path"])  # replica 1 has not taken step 5 yet
        ask(shared, b, 1, 1, [5])
        await asyncio.sleep(0.05)
        assert read(b.got[-1]) == frames[1:] and calls == ["tcp://w"]
        shared.done(b, {"id": 1})
        assert not os.path.exists(ra["path"])  # both took every step
        monkeypatch.setattr(host_fetch.os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(28, "full")))
        ask(shared, a, 1, 0, [4])
        await asyncio.sleep(0.05)
        assert "direct" in a.got[-1] and "path" not in a.got[-1]
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(mine)]

    asyncio.run(main())
