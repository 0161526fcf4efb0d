"""The control path (issue 13): wire form, background fetch, chunked queue items and acks,
bounded buffers, and the planner kept off the scheduler's event loop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from overlord_dask import Service, ServiceError, connect
from overlord_dask.batch_layout import BatchLayout
from overlord_dask.protocol import block_key
from overlord_dask.sources.blocks import SampleBlock
from overlord_dask.trainer.tensors import TORCH_DTYPES
from overlord_dask.wire import decode, decode_batch, encode, encode_batch, nbytes
from overlord_dask.worker.constructors import build_rank_batch, check_micro_batch

from .harness import same_fields


def _block(rng, n_docs=40, vocab=300):
    lens = rng.integers(1, 400, n_docs)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    return SampleBlock(
        "s", rng.integers(0, vocab, int(offsets[-1])).astype(np.int32), offsets, np.arange(n_docs) + 1000
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wire_form_decodes_to_exactly_the_packed_micro_batch(seed):
    rng = np.random.default_rng(seed)
    block = _block(rng)
    lens = np.diff(block.offsets)
    pieces, used = [], 0
    for d in rng.permutation(len(lens))[:12]:
        L = int(lens[d])
        a = int(rng.integers(0, L))  # a piece from inside the document: its last label is the true next token
        b = min(L, a + int(rng.integers(1, 200)))
        if used + b - a > 2048:
            break
        pieces.append([0, 0, 0, int(d), a, b])
        used += b - a
    batch = build_rank_batch(0, 0, [pieces, []], {block_key(0, 0, 0): block}, 512, BatchLayout(2, 2048))
    wire = encode_batch(batch)
    for mb, w in zip(batch["micro_batches"], wire["micro_batches"]):
        assert "labels" not in w and "position_ids" not in w and "input_ids" not in w  # derived on the trainer
        if mb["num_tokens"]:
            assert w["tokens"].dtype == np.uint16  # a 300-token vocabulary needs 2 bytes, not 4
        back = decode(w)
        check_micro_batch(back, 2048)
        same_fields(mb, back)
        wide = decode(w, TORCH_DTYPES)  # what the torch consumer asks for: int64 ids, labels and positions
        assert wide["input_ids"].dtype == wide["labels"].dtype == wide["position_ids"].dtype == np.int64
        same_fields(mb, {k: v.astype(mb[k].dtype) if isinstance(v, np.ndarray) else v for k, v in wide.items()})
    assert nbytes(wire) * 4 < nbytes(batch)  # 12 bytes per token slot became about 2 per real token
    assert decode_batch(wire)["step"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constructors_build_the_wire_form_directly(seed):
    """What a constructor stores (``wire_micro_batch``: no padded labels or positions built) is
    exactly the wire form of the packed micro-batch, split pieces, whole documents and an empty
    micro-batch alike."""
    from overlord_dask.worker.constructors import pack_micro_batch, wire_micro_batch

    rng = np.random.default_rng(seed)
    blocks = {block_key(0, 0, 0): _block(rng), block_key(2, 1, 5): _block(rng)}
    pieces = []
    for key in rng.permutation([(0, 0, 0), (2, 1, 5)] * 6).tolist():
        lens = np.diff(blocks[block_key(*key)].offsets)
        d = int(rng.integers(0, len(lens)))
        a = int(rng.integers(0, lens[d])) if rng.random() < 0.5 else 0  # inside the document, or from its start
        b = (
            int(lens[d]) if rng.random() < 0.5 else min(int(lens[d]), a + int(rng.integers(1, 100)))
        )  # to its end, or not
        pieces.append([*key, d, a, b])
    for mb in (pieces, pieces[:1], []):
        same_fields(encode(pack_micro_batch(mb, blocks, 4096, 64)), wire_micro_batch(mb, blocks, 4096, 64))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_chunk_built_at_once_decodes_to_the_packed_micro_batches(seed):
    """``build_chunk`` builds a text-only chunk for all its micro-batches at once (one numpy call
    per block, tokens narrowed per chunk): each (step, rank) batch decodes, in both dtype sets,
    to exactly what :func:`pack_micro_batch` makes for its pieces. Blocks of both token dtypes,
    split pieces, pieces ending at a document's (and a block's) end, empty micro-batches, and
    a rank group that does not start at rank 0."""
    import pickle

    from overlord_dask import pieces as P
    from overlord_dask.worker.constructors import build_chunk, pack_micro_batch

    rng = np.random.default_rng(seed)
    blocks = {
        block_key(0, 0, 0): _block(rng),
        block_key(2, 1, 5): _block(rng, vocab=70_000),
        block_key(0, 1, 0): _block(rng, n_docs=3),
    }
    keys = [(0, 0, 0), (2, 1, 5), (0, 1, 0)]
    dp, mb, lo, hi, capacity = 4, 2, 1, 3, 2048
    steps, expected = [], {}
    for step in (7, 8, 9):
        rows, slots = [], []
        for rank in range(dp):
            for m in range(mb):
                if (step, rank, m) == (8, 2, 1):
                    continue  # an empty micro-batch
                used = 0
                for _ in range(int(rng.integers(1, 8))):
                    key = keys[int(rng.integers(0, 3))]
                    lens = np.diff(blocks[block_key(*key)].offsets)
                    d = int(rng.integers(0, len(lens)))
                    a = int(rng.integers(0, lens[d])) if rng.random() < 0.5 else 0
                    b = int(lens[d]) if rng.random() < 0.5 else min(int(lens[d]), a + int(rng.integers(1, 100)))
                    if b == lens[d] and b - 1 > a and rng.random() < 0.3:
                        b -= 1  # one token short of its document's end: the last label is that token
                    if used + b - a > capacity:
                        break
                    used += b - a
                    rows.append([*key, d, a, b])
                    slots.append([rank, m])
        rows, slots = np.array(rows), np.array(slots)
        order = rng.permutation(len(rows))  # the ledger need not list a step's pieces by rank
        rows, slots = rows[order], slots[order]
        steps.append({"step": step, "pieces": P.pack(rows), "slot": P.slot_bytes(slots), "piece_tokens": 64})
        for rank in range(lo, hi):
            expected[step, rank] = [
                pack_micro_batch(rows[(slots[:, 0] == rank) & (slots[:, 1] == m)].tolist(), blocks, capacity, 64)
                for m in range(mb)
            ]
    chunk = build_chunk(steps, (lo, hi), BatchLayout(mb, capacity), blocks)
    assert sorted(chunk.batches) == [7, 8, 9] and all(sorted(b) == [lo, hi - 1] for b in chunk.batches.values())
    for (step, rank), packed in expected.items():
        batch = pickle.loads(chunk.packed(step, rank))
        assert (batch["step"], batch["rank"], len(batch["micro_batches"])) == (step, rank, mb)
        for dtypes in (None, TORCH_DTYPES):
            got = decode_batch(batch, *(() if dtypes is None else (dtypes,)))["micro_batches"]
            for want, have in zip(packed, got):
                want = {
                    k: v.astype(dtypes[k]) if dtypes and k in dtypes and isinstance(v, np.ndarray) else v
                    for k, v in want.items()
                }
                same_fields(want, have)
                assert all(have[k].dtype == want[k].dtype for k in want if isinstance(want[k], np.ndarray))
    with pytest.raises(ValueError, match="over capacity"):
        build_chunk(steps, (lo, hi), BatchLayout(mb, 64), blocks)


def test_wire_form_keeps_context_parallel_slices_whole():
    from overlord_dask.worker.constructors import select_cp

    rng = np.random.default_rng(3)
    block = _block(rng)
    pieces = [[[0, 0, 0, 1, 0, int(np.diff(block.offsets)[1])]]]
    batch = build_rank_batch(
        0, 0, pieces, {block_key(0, 0, 0): block}, 1024, BatchLayout(1, 1024, cp=2, cp_split_tokens=4)
    )
    sl = select_cp(batch, 1)["micro_batches"][0]
    back = decode(encode(sl))
    for k, v in sl.items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(back[k], v, err_msg=k)


_FAULTS_PER_DECODE = """
import collections, resource, sys
import numpy as np
from overlord_dask.allocator import keep_freed_memory
from overlord_dask.trainer.tensors import TORCH_DTYPES
from overlord_dask.wire import decode, encode

C, n = 16384, 16000
w = encode({"input_ids": np.arange(C, dtype=np.int32) % 1000, "labels": np.zeros(C, np.int32),
            "position_ids": np.zeros(C, np.int32), "cu_seqlens": np.array([0, 5000, 9000, n], np.int32), "num_tokens":
            n})

def faults_per_decode():
    held = collections.deque(maxlen=64)  # a consumer holds the batches it fetched ahead
    for _ in range(100):
        held.append(decode(w, TORCH_DTYPES))
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(300):
        held.append(decode(w, TORCH_DTYPES))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 300

before = faults_per_decode()
tuned = keep_freed_memory()
print(before, tuned, faults_per_decode())
"""


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_consumers_decode_into_reused_memory_even_under_dasks_trim_setting():
    """A process started with ``MALLOC_TRIM_THRESHOLD_`` (as Dask's nanny leaves it in the
    process that starts a LocalCluster) faults in fresh pages for every decoded micro-batch;
    after ``keep_freed_memory`` (which every ``RankStream`` calls) it reuses freed memory."""
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536", "OVERLORD_KEEP_FREED_MEMORY": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_PER_DECODE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    before, tuned, after = out.stdout.split()
    assert tuned == "True"
    assert float(before) >= 8 and float(after) < 1, out.stdout  # a 128 KiB array is 32 pages, three per decode


def _consume_all(address, ranks, steps, **kw):
    out = {}
    streams = {r: connect(address, r, timeout=120, **kw) for r in ranks}
    try:
        for _ in range(steps):
            for r, s in streams.items():
                out.setdefault(r, []).append(s.next_batch()["step"])
        for s in streams.values():
            s.commit()
    finally:
        for s in streams.values():
            s.close()
    return out


@pytest.mark.integration
def test_queue_items_and_acks_are_per_chunk_not_per_step(cluster, small_plan):
    plan = small_plan(loading={"prefetch_steps": 8, "batch_steps": 4})
    steps, dp = 16, plan.topology.dp
    with Service.start(plan, cluster=cluster) as service:
        got = _consume_all(service.address, range(dp), steps)
        service.wait_for_step(steps, timeout=60)
        st = service.status()
    assert all(v == list(range(steps)) for v in got.values())
    assert st["chunk_steps"] == 4
    # one descriptor per rank per chunk of 4 steps (not one per step), one ack per chunk plus the final commit
    assert st["descriptors_put"] <= dp * (steps // 4 + 2), st
    assert st["acks"] <= dp * (steps // 4 + 2), st
    assert st["loop"]["samples"] > 0 and "block_max_ms" in st["loop"]


def test_the_loop_watchdog_sees_a_block_longer_than_its_tick_and_wakes_an_idle_loop_seldom():
    """A block of the event loop that spans a tick's due time shows as lag (at least the block
    less one tick), and an idle loop is woken by it at most 25 times a second (``watchdog.py``: a
    wake-up of an idle loop costs more than the tick's work)."""
    import asyncio

    from overlord_dask.scheduler.watchdog import LOOP_TICK_S, LoopWatch

    async def run() -> tuple[LoopWatch, int]:
        ticks = []
        watch = LoopWatch(on_tick=lambda: ticks.append(time.perf_counter()))
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(0.3)
        idle_ticks = len(ticks)
        time.sleep(3 * LOOP_TICK_S)  # a handler that blocks the loop
        await asyncio.sleep(0.2)
        task.cancel()
        return watch, idle_ticks

    watch, idle_ticks = asyncio.run(run())
    assert idle_ticks <= 0.3 * 25 + 1, idle_ticks
    assert watch.block_max >= 2 * LOOP_TICK_S - 0.005, watch.figures()
    assert watch.figures()["block_max_ms"] >= 1e3 * (2 * LOOP_TICK_S - 0.005)


TRAINER_WITHOUT_DASK = """
import json, sys
import numpy as np
from overlord_dask import OverlordDataset

ds = OverlordDataset(sys.argv[1], rank=int(sys.argv[2]))
it = iter(ds)
steps = [int(next(it)["step"]) for _ in range(6)]
state = ds.state_dict()  # a request answered by the scheduler, waited for
ds.close()
print(json.dumps({"steps": steps, "state": state["next_step"], "dask": sorted(
    {m.split(".")[0] for m in sys.modules} & {"dask", "distributed", "tornado"})}))
"""


@pytest.mark.integration
def test_a_trainer_process_speaks_to_the_service_without_importing_dask(cluster, small_plan):
    """A trainer reaches the scheduler and the workers over TCP with its own comms
    (``trainer/comm.py``): its descriptors, fetches, acknowledgements and a checkpoint's request
    work, and nothing of Dask (``dask``, ``distributed``, ``tornado``) is imported in its
    process. (Every other test's trainers use these comms too: the exactness tests check what
    they deliver.)"""
    import json

    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2}, topology={"dp": 2, "micro_batches": 1})
    with Service.start(plan, cluster=cluster) as service:
        assert service.address.startswith("tcp://")
        proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER_WITHOUT_DASK, service.address, "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with connect(service.address, 0, timeout=120) as s:  # rank 0 keeps pace (prefetch bounds the ranks' lead)
            mine = [s.next_batch()["step"] for _ in range(7)][:6]
            stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        got = json.loads(stdout.strip().splitlines()[-1])
    assert got["dask"] == [], got
    assert got["steps"] == mine == list(range(6)) and got["state"] == 6


TRAINERS_THAT_END = """
import multiprocessing as mp
import sys


def trainer(address, rank, done):
    from overlord_dask import OverlordDataset

    ds = OverlordDataset(address, rank=rank)
    for i, mb in enumerate(ds):
        if i == 2:
            break
    done.put(rank)
    ds.close()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")  # as torchrun's and the benchmarks' trainers end: a normal interpreter exit
    done = ctx.Queue()
    ps = [ctx.Process(target=trainer, args=(sys.argv[1], r, done)) for r in range(int(sys.argv[2]))]
    for p in ps:
        p.start()
    print(sorted(done.get(timeout=120) for _ in ps))
    for p in ps:
        p.join(60)
    print([p.exitcode for p in ps])
"""


@pytest.mark.integration
def test_trainer_processes_end_without_a_word_on_stderr(cluster, small_plan, tmp_path):
    """A trainer process that closes its stream and ends (or ends without closing it) leaves
    nothing on stderr: its IO loop's tasks and connections are stopped at exit, not torn down
    pending (asyncio's "Task was destroyed but it is pending!" for every rank at every stop)."""
    script = tmp_path / "trainers.py"
    script.write_text(TRAINERS_THAT_END)
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2}, topology={"dp": 2, "micro_batches": 1})
    with Service.start(plan, cluster=cluster) as service:
        out = subprocess.run(
            [sys.executable, str(script), service.address, "2"], capture_output=True, text=True, timeout=300
        )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["[0, 1]", "[0, 0]"], out.stdout
    assert out.stderr == "", out.stderr[-3000:]


@pytest.mark.integration
def test_ranks_of_one_process_share_one_channel_and_descriptors_are_pushed(cluster, small_plan):
    """Every rank in this process receives its descriptors on one stream (no per-rank polling);
    a closed stream unsubscribes; a stream waiting when the run stops fails at once, naming it."""
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2})
    dp = plan.topology.dp
    with Service.start(plan, cluster=cluster) as service:
        streams = [connect(service.address, r, timeout=120) for r in range(dp)]
        assert [s.next_batch()["step"] for s in streams] == [0] * dp
        st = service.status()
        assert st["channels"] == 1 and st["subscribed"] == dp, st
        assert len({id(s.channel) for s in streams}) == 1
        streams[0].close()
        assert all(t.done() for t in streams[0].rio.tasks)  # nothing of a closed stream still runs on the IO thread
        deadline = time.monotonic() + 10
        while service.status()["subscribed"] != dp - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.status()["subscribed"] == dp - 1
        waiting = streams[1]
        for _ in range(3):  # everything fetched ahead is still handed over
            waiting.next_batch()
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match="stopped"):
        for _ in range(20):
            waiting.next_batch()
    assert time.monotonic() - t0 < 30  # told, not left to time out (120 s)
    for s in streams[1:]:
        s.close()


@pytest.mark.integration
def test_channel_groups_give_ranks_of_one_process_connections_of_their_own(cluster, small_plan):
    """``channel_group``: the ranks of one name share a connection (a simulated host, or a
    group of trainers); closing one group's channel unsubscribes its ranks only, and the others
    go on receiving."""
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2})
    dp = plan.topology.dp
    assert dp >= 2
    with Service.start(plan, cluster=cluster) as service:
        streams = [connect(service.address, r, timeout=120, channel_group=f"g{r % 2}") for r in range(dp)]
        assert [s.next_batch()["step"] for s in streams] == [0] * dp
        st = service.status()
        assert st["channels"] == 2 and st["subscribed"] == dp, st
        assert len({id(s.channel) for s in streams}) == 2
        streams[0].channel.comm.abort()  # group g0's connection drops: its ranks reconnect on a new one
        for s in streams:
            assert s.next_batch()["step"] == 1
        for s in streams:
            s.close()


def test_batched_writer_batches_and_leaves_no_cyclic_garbage():
    """The channels' batched writer sends the first message at once and the next ones together,
    and raises nothing while it waits (``distributed.BatchedSend`` leaves a caught TimeoutError,
    a reference cycle, per batch: frequent full collections at hundreds of connections)."""
    import asyncio
    import gc

    from overlord_dask.batched import BatchedWriter
    from overlord_dask.errors import ConnectionClosed

    class Comm:
        def __init__(self):
            self.writes, self._closed = [], False

        async def write(self, msg, **_):
            self.writes.append(list(msg))

        def closed(self):
            return self._closed

        def abort(self):
            self._closed = True

        async def close(self):
            self._closed = True

    async def main():
        comm, w = Comm(), BatchedWriter(0.005)
        w.start(comm)
        gc.collect()
        gc.disable()
        try:
            w.send({"i": 0})
            await asyncio.sleep(0.001)  # well within the 5 ms interval
            assert comm.writes == [[{"i": 0}]]  # after a quiet spell: at once
            for i in range(1, 4):
                w.send({"i": i})
            await asyncio.sleep(0.05)
            assert comm.writes[1] == [{"i": 1}, {"i": 2}, {"i": 3}]  # within the interval: one batch
            for i in range(200):
                w.send({"i": i})
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()

            def ours(e):  # raised in the writer (other tests' Dask clients may still run their own BatchedSends)
                tb = e.__traceback__
                while tb is not None:
                    if tb.tb_frame.f_code.co_filename.endswith(os.path.join("overlord_dask", "batched.py")):
                        return True
                    tb = tb.tb_next
                return False

            raised = [o for o in gc.garbage if isinstance(o, BaseException) and ours(o)]
            assert raised == []  # no exception (and its frames) was left behind as cyclic garbage
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert sum(len(b) for b in comm.writes) == 204 and w.batch_count == len(comm.writes)
        await w.close()
        with pytest.raises(ConnectionClosed):
            w.send({"late": True})

        class SlowComm(Comm):
            async def write(self, msg, **_):
                await asyncio.sleep(0.02)
                self.writes.append(list(msg))

        comm, w = SlowComm(), BatchedWriter(0.005)
        w.start(comm)
        w.send({"i": 0})
        await asyncio.sleep(0.005)  # that write is in flight
        w.send({"last": True})  # queued behind it, as a run's stop message may be
        await w.close(timeout=2)
        assert comm.writes == [[{"i": 0}], [{"last": True}]] and comm.closed()

    asyncio.run(main())


def test_channel_batches_are_written_at_once_as_dask_writes_them():
    """The scheduler writes a channel's batch to its Dask comm without a task
    (``scheduler/channel_write.py``): the bytes are those Dask's ``TCP.write`` sends (sets and
    all), the trainer's comm and Dask's read them, a batch msgpack cannot pack alone still goes
    Dask's way, and a closed stream is a ``ConnectionClosed``."""
    import asyncio

    from distributed.comm import connect as dask_connect
    from distributed.comm import listen
    from distributed.comm.tcp import _add_frames_header
    from distributed.protocol.core import dumps

    from overlord_dask.batched import BatchedWriter
    from overlord_dask.errors import ConnectionClosed
    from overlord_dask.scheduler.channel_write import write_now
    from overlord_dask.trainer import comm as native
    from overlord_dask.trainer.comm import frame

    batch = [
        {
            "op": "descriptors",
            "to": [(3, 0, 1, 2)],
            "items": [{"key": "k-1", "steps": [4, 5], "workers": ["tcp://a:1"]}],
        },
        {"op": "error", "rank": None, "message": "stopped ✓", "resumable": True, "ranks": {1, 2}},
    ]
    frames, _, _ = _add_frames_header(dumps(batch))
    assert frame(dumps(batch)[0]) == b"".join(bytes(f) for f in frames)

    async def main():
        served: asyncio.Queue = asyncio.Queue()
        listener = listen("tcp://127.0.0.1:0", served.put)
        await listener.start()
        try:
            reader = await native.connect(listener.contact_address, timeout=10)  # the trainer's own comm
            server = await served.get()
            dask_writes = []
            dask_write = server.write

            async def counted(msg, **kw):  # Dask's coroutine, counted
                dask_writes.append(msg)
                return await dask_write(msg, **kw)

            server.write = counted
            w = BatchedWriter(0.0, write_now=write_now)
            w.start(server)
            w.send(*batch)
            got = await asyncio.wait_for(reader.read(), 10)
            assert w.batch_count == 1 and dask_writes == []  # written in the flush: no coroutine, no task
            assert got[0]["items"][0]["steps"] == (4, 5) and got[1]["ranks"] == {1, 2}
            assert got[1]["message"] == "stopped ✓"

            dask_reader = await dask_connect(listener.contact_address)
            server2 = await served.get()
            w2 = BatchedWriter(0.0, write_now=write_now)
            w2.start(server2)
            w2.send({"op": "x", "array": np.arange(3)})  # msgpack alone cannot: Dask serializes it (declined)
            got = await asyncio.wait_for(dask_reader.read(), 10)
            assert got[0]["array"].tolist() == [0, 1, 2]

            server2.stream.close()  # the connection went away under the comm
            with pytest.raises(ConnectionClosed):
                write_now(server2, batch)
            assert server2.closed()  # aborted, as Dask's write leaves it
            assert not write_now(server2, batch)  # no stream: Dask's write says it is closed

            class Failing:  # a stream that fails mid-write (a full buffer, say): the comm is aborted
                def write(self, data):
                    raise RuntimeError("buffer full")

            class Comm:
                stream, aborted = Failing(), False

                def abort(self):
                    self.aborted = True

            broken = Comm()
            with pytest.raises(ConnectionClosed, match="buffer full"):
                write_now(broken, batch)
            assert broken.aborted
            server.abort()
            reader.abort()
            await dask_reader.close()
        finally:
            listener.stop()

    asyncio.run(main())


@pytest.mark.integration
def test_a_slow_rank_bounds_everyone(cluster, small_plan):
    """Rank 1 never asks: the service plans at most prefetch_steps ahead of it, rank 0 gets no
    further, and the consumers' buffers hold what their bounds allow."""
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2})
    with Service.start(plan, cluster=cluster) as service:
        slow = connect(service.address, 1, timeout=120, prefetch_steps=1)
        fast = connect(service.address, 0, timeout=3)
        taken = []
        with pytest.raises(ServiceError, match="no batch for step"):
            for _ in range(50):
                taken.append(fast.next_batch()["step"])
        assert taken == list(range(4))  # the prefetch bound of the plan, not more
        st = service.status()
        assert st["next_step"] - st["committed"] <= 4
        assert slow.buffered() <= 1  # its own bound, while nobody reads it
        fast.close()
        slow.close()


@pytest.mark.integration
def test_byte_bound_holds_one_step_at_most_when_tiny(cluster, small_plan):
    plan = small_plan(loading={"prefetch_steps": 6, "batch_steps": 3})
    with Service.start(plan, cluster=cluster) as service:
        streams = [connect(service.address, r, timeout=120, prefetch_bytes=1) for r in range(plan.topology.dp)]
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(s.buffered() for s in streams):
                time.sleep(0.05)
            time.sleep(0.5)  # room for a (wrong) second fetch to land
            assert [s.buffered() for s in streams] == [1] * len(streams)
            assert [s.next_batch()["step"] for s in streams] == [0] * len(streams)
        finally:
            for s in streams:
                s.close()


@pytest.mark.integration
def test_pin_memory_without_an_accelerator_warns_and_still_delivers(cluster, small_plan):
    import torch

    from overlord_dask import OverlordDataset

    plan = small_plan(topology={"dp": 1})
    with Service.start(plan, cluster=cluster) as service:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ds = OverlordDataset(service.address, rank=0, pin_memory=True, timeout=120)
            mb = next(iter(ds))
        ds.close()
    assert torch.cuda.is_available() or any("pin_memory" in str(w.message) for w in caught)
    assert (
        mb["input_ids"].dtype == torch.int64
        and mb["labels"].dtype == torch.int64
        and mb["cu_seqlens"].dtype == torch.int32
    )


def test_a_channels_connection_is_taken_over_from_dasks_comm_and_speaks_the_same_frames():
    """``scheduler/channel_transport.py``: a plain TCP comm's connection is read by a protocol
    of its own, messages handed over as they arrive (those Dask's stream had already read first,
    in order), written in Dask's frames (``write_now``'s and Dask-serialized ones alike); the Dask
    comm is closed without shutting the connection down, aborting it aborts the connection, and
    the connection ending ends ``ended``. A comm that is not plain TCP is left to Dask."""
    import asyncio
    import struct

    import msgpack
    from distributed.comm import listen
    from distributed.comm.inproc import InProc

    from overlord_dask.batched import BatchedWriter
    from overlord_dask.scheduler.channel_transport import take_over
    from overlord_dask.scheduler.channel_write import write_now
    from overlord_dask.trainer import comm as native

    async def main():
        served: asyncio.Queue = asyncio.Queue()
        listener = listen("tcp://127.0.0.1:0", served.put)
        await listener.start()
        try:
            client = await native.connect(listener.contact_address, timeout=10)
            server = await served.get()
            # three messages in one write: Dask's read returns the first, Tornado has read the rest
            client.writer.write(b"".join(native.encode([{"op": "m", "n": n}]) for n in range(3)))
            assert (await server.read())[0]["n"] == 0
            got: list = []
            conn = take_over(server, got.append)
            assert conn is not None and server.closed() and server.stream is None
            w = BatchedWriter(0.0, write_now=write_now)
            w.start(conn)
            w.send({"op": "descriptors", "to": [(1, 0, 0, 1)], "items": [{"key": "k", "steps": [2, 3]}]})
            await conn.start()
            assert [m[0]["n"] for m in got] == [1, 2]  # (what Tornado had buffered, before any new byte)
            await client.write([{"op": "m", "n": 3}, {"op": "m", "n": 4, "rows": [[1, 2]]}])
            deadline = asyncio.get_running_loop().time() + 10
            while len(got) < 3 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert [m["n"] for m in got[2]] == [3, 4] and got[2][1]["rows"] == ((1, 2),)  # (tuples, as Dask reads them)
            # a frame sent after the part the leading size counts (as Dask sends large buffers),
            # the message arriving in two pieces, then a plain one
            body = msgpack.packb([{"op": "m", "n": 5}])
            later = bytes(100_000)
            head = struct.pack("<3Q", 2, len(body), len(later)) + body
            wire = struct.pack("<Q", len(head)) + head + later
            client.writer.write(wire[: len(wire) // 2])
            await client.writer.drain()
            await asyncio.sleep(0.05)
            client.writer.write(wire[len(wire) // 2 :] + native.encode([{"op": "m", "n": 6}]))
            deadline = asyncio.get_running_loop().time() + 10
            while len(got) < 5 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert [m[0]["n"] for m in got[3:]] == [5, 6]
            first = await asyncio.wait_for(client.read(), 10)
            assert first[0]["items"][0]["steps"] == (2, 3)
            w.send({"op": "x", "array": np.arange(3)})  # msgpack alone cannot: Dask serializes it, framed alike
            second = await asyncio.wait_for(client.read(), 10)
            assert second[0]["op"] == "x"
            client.abort()  # the consumer process goes away
            await asyncio.wait_for(conn.ended, 10)
            assert conn.closed()
            with pytest.raises(OSError):
                w.send({"op": "late"})

            other = await native.connect(listener.contact_address, timeout=10)
            server2 = await served.get()
            conn2 = take_over(server2, lambda m: None)
            await conn2.start()
            server2.abort()  # what Dask's server does to its comms when it closes
            await asyncio.wait_for(conn2.ended, 10)
            with pytest.raises(native.ConnectionClosed):
                await asyncio.wait_for(other.read(), 10)
        finally:
            listener.stop()
        assert take_over(InProc.__new__(InProc), lambda m: None) is None  # not a TCP comm: Dask's

    asyncio.run(main())


def test_fetched_batches_wait_in_wire_form_and_only_the_next_steps_are_decoded():
    """A rank's buffer holds its fetched steps in wire form; the IO side keeps ``DECODE_AHEAD``
    of them decoded, asks to be woken when a take leaves fewer than half, and a step the trainer
    reaches still in wire form it decodes itself: every step comes out decoded, in order."""
    from overlord_dask.trainer.handover import DECODE_AHEAD, HandOver

    decoded = []

    def decode(raw):
        decoded.append(raw["step"])
        return {**raw, "decoded": True}

    hand = HandOver(0, max_steps=64, max_bytes=1 << 30, decode=decode, away_to_decode_ahead=0.0)  # (it computes)
    hand.put(list(range(40)), [{"step": s} for s in range(40)], [100] * 40)
    hand.decode_ahead()
    assert decoded == list(range(DECODE_AHEAD))  # the rest waits in wire form
    wakes = []
    got = []
    for s in range(DECODE_AHEAD // 2 + 1):
        batch, _ = hand.take(s, timeout=1.0, wake=lambda room, ack: wakes.append(s))
        got.append(batch)
    assert wakes == [DECODE_AHEAD // 2]  # once, when fewer than half were left decoded
    hand.decode_ahead()  # (what the wake runs on the IO loop)
    assert decoded == list(range(DECODE_AHEAD // 2 + 1 + DECODE_AHEAD))
    s = DECODE_AHEAD // 2 + 1 + DECODE_AHEAD  # not decoded ahead: the trainer decodes it itself
    for step in range(DECODE_AHEAD // 2 + 1, s + 1):
        batch, _ = hand.take(step, timeout=1.0, wake=lambda room, ack: None)
        got.append(batch)
    assert [b["step"] for b in got] == list(range(s + 1)) and all(b["decoded"] for b in got)
    assert decoded.count(s) == 1 and hand.buffered() == 40 - (s + 1)


def test_a_trainer_that_takes_steps_back_to_back_decodes_them_itself_and_one_that_computes_is_decoded_ahead():
    """Decoding ahead on the IO side while the trainer's thread decodes too hands the GIL back
    and forth: a trainer that takes steps back to back decodes each itself (no wake-up asks the
    IO side to decode, and a decode_ahead then does nothing); once it computes between takes
    (longer than ``away_to_decode_ahead``), the IO side decodes ahead again. A fetch's steps go
    in under one lock and wake a waiting trainer once."""
    import threading

    from overlord_dask.trainer.handover import DECODE_AHEAD, HandOver

    decoded = []

    def decode(raw):
        decoded.append((raw["step"], threading.current_thread().name))
        return {**raw, "decoded": True}

    hand = HandOver(0, max_steps=64, max_bytes=1 << 30, decode=decode, away_to_decode_ahead=0.05)
    hand.put(list(range(30)), [{"step": s} for s in range(30)], [100] * 30)
    hand.decode_ahead()  # the trainer has not taken a step yet: it may be computing
    assert [s for s, _ in decoded] == list(range(DECODE_AHEAD))
    wakes = []
    for s in range(20):  # back to back
        batch, _ = hand.take(s, timeout=1.0, wake=lambda room, ack: wakes.append(s))
        assert batch["decoded"] and batch["step"] == s
    assert wakes == []  # never asked to decode ahead
    hand.decode_ahead()  # (a wake for room or an ack still runs it): nothing is decoded
    assert [s for s, _ in decoded] == list(range(20))  # each step once, steps 8-19 by the trainer itself
    time.sleep(0.06)  # the trainer computes
    hand.take(20, timeout=1.0, wake=lambda room, ack: wakes.append(20))
    assert wakes == [20]  # fewer than half decoded ahead: the IO side is asked
    hand.decode_ahead()
    assert [s for s, _ in decoded][21:] == list(range(21, 21 + DECODE_AHEAD))

    # one wake-up for a fetch's steps: the waiting trainer gets the first of them
    waiting = HandOver(0, max_steps=64, max_bytes=1 << 30)
    got = []
    t = threading.Thread(target=lambda: got.append(waiting.take(0, 5.0, lambda room, ack: None)[0]))
    t.start()
    time.sleep(0.05)
    waiting.put([0, 1, 2], [{"step": s} for s in range(3)], [10, 20, 30])
    t.join(5)
    assert got == [{"step": 0}] and waiting.buffered() == 2 and waiting._ready_bytes == 50


def test_a_take_finishes_the_step_before_and_acknowledges_a_chunk_end_at_once():
    """The trainer's next take finishes the step it held (one lock for both): a step that ended
    a chunk wakes the IO side with an acknowledgement, others do not; a chunk's end is forgotten
    once finished (a long run kept them all), and a skip forgets the ends it passes."""
    from overlord_dask.trainer.handover import HandOver

    hand = HandOver(0, max_steps=64, max_bytes=1 << 30)
    hand.put(list(range(12)), [{"step": s} for s in range(12)], [10] * 12)
    for end in (3, 7, 11):
        hand.chunk_ends_at(end)
    acks, finished = [], None
    for s in range(8):
        batch, _ = hand.take(s, 1.0, lambda room, ack: acks.append((s, ack)), finished=finished)
        assert batch["step"] == s and hand.consumed == (finished if finished is not None else -1)
        finished = s
    assert [s for s, ack in acks if ack] == [4]  # step 3 ended a chunk: acknowledged as step 4 is taken
    assert hand._chunk_ends == {7, 11}
    hand.skip_to(10)
    assert hand._chunk_ends == {11} and hand.consumed == 9
    batch, _ = hand.take(10, 1.0, lambda room, ack: acks.append((10, ack)), finished=7)
    assert batch["step"] == 10 and hand.consumed == 9  # (finishing an older step moves nothing back)


@pytest.mark.integration
def test_the_trainers_own_comms_speak_to_a_dask_server_as_dasks_do():
    """``trainer/comm.py`` against a real ``distributed`` server: requests and their answers
    (sets, bytes, nested values), a reply carrying batches out of band in frames large enough to
    travel apart from the message, a handler's error as an error naming the route, a one-way
    stream both ways (a channel), and keepalive on its sockets."""
    import asyncio
    import socket

    from distributed.core import Server
    from distributed.protocol import to_serialize

    from overlord_dask.errors import ConnectionClosed
    from overlord_dask.trainer.comm import KEEPALIVE, Pool
    from overlord_dask.wire import Payload, register_payload_with_dask

    register_payload_with_dask()
    big = [bytes([i]) * (300_000 + i) for i in range(3)]

    async def echo(comm=None, **kw):
        return {"got": kw, "set": {1, 2}, "blob": b"\x00\x01"}

    async def batches(comm=None, n=3):
        return {"status": "OK", "payload": to_serialize(Payload(big[:n]))}

    async def boom(comm=None):
        raise ValueError("no such unit")

    async def stream(comm=None, first=None):
        got = await comm.read()
        await comm.write([{"op": "echoed", "items": got}])

    async def main():
        server = Server({"echo": echo, "batches": batches, "boom": boom}, stream_handlers={})
        server.handlers["stream"] = stream
        await server.listen("tcp://127.0.0.1:0")
        pool = Pool(timeout=5)
        rpc = pool(server.address)
        try:
            answer = await rpc.echo(rank=np.int64(3), steps=[1, 2], nested={"a": (1.5, None)})
            assert answer["got"] == {"rank": 3, "steps": (1, 2), "nested": {"a": (1.5, None)}}
            assert answer["set"] == {1, 2} and answer["blob"] == b"\x00\x01"
            reply = await rpc.batches(n=3)
            assert [bytes(f) for f in reply["payload"].frames] == big
            with pytest.raises(RuntimeError, match="boom at tcp://.*no such unit"):
                await rpc.boom()
            assert (await rpc.echo(x=1))["got"] == {"x": 1}  # the connection that answered an error is reused
            comm = await pool.connect(server.address, timeout=5)
            await comm.write({"op": "stream", "reply": False})
            await comm.write([{"op": "ack", "step": 4}])
            assert await comm.read() == ({"op": "echoed", "items": ({"op": "ack", "step": 4},)},)
            sock = comm.writer.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE[0]
            await comm.close()
            with pytest.raises(ConnectionClosed):
                await comm.write({"late": True})
        finally:
            pool.abort_all()
            server.stop()
        with pytest.raises(ConnectionClosed, match="timed out connecting"):
            await pool.request(server.address, "echo", {})  # nobody listens there any more

    asyncio.run(main())


def test_a_pooled_connection_to_a_server_that_went_away_is_not_reused():
    """A trainer process keeps idle connections per address; a service restarted at the same
    address (a fixed scheduler port) must get a new one, not the old server's closed socket."""
    import asyncio

    from distributed.core import Server

    from overlord_dask.trainer.comm import Pool

    def serving(name: str) -> Server:
        async def who(comm=None):
            return name

        return Server({"who": who}, stream_handlers={})

    async def main():
        pool = Pool(timeout=5)
        server = serving("first")
        await server.listen("tcp://127.0.0.1:0")
        address, port = server.address, int(server.address.rsplit(":", 1)[1])
        try:
            assert await pool.request(address, "who", {}) == "first"
            await server.close()  # (its connections too: the pool's idle one sees the end)
            server = serving("restarted")
            await server.listen(f"tcp://127.0.0.1:{port}")
            assert await pool.request(address, "who", {}) == "restarted"
        finally:
            pool.abort_all()
            server.stop()

    asyncio.run(main())


def test_pooled_connections_idle_too_long_are_closed_and_their_addresses_forgotten():
    """A trainer process that talks to workers that come and go (autoscaling) or to one service
    after another (a notebook) keeps no socket per address it stopped using: a connection idle
    longer than ``idle_close_s`` is closed at the next request's sweep, and its address
    forgotten; one in use again within that time is reused, not reopened."""
    import asyncio

    from distributed.core import Server

    from overlord_dask.trainer.comm import Pool

    async def main():
        async def who(comm=None):
            return "here"

        servers = [Server({"who": who}, stream_handlers={}) for _ in range(2)]
        for srv in servers:
            await srv.listen("tcp://127.0.0.1:0")
        gone, kept = (srv.address for srv in servers)
        pool = Pool(timeout=5, idle_close_s=0.4)
        try:
            assert await pool.request(gone, "who", {}) == "here"
            assert await pool.request(kept, "who", {}) == "here"
            assert pool.idle() == {gone: 1, kept: 1}
            ((comm, _),) = pool._idle[kept]
            for _ in range(6):  # in use every 0.1 s: the same connection throughout
                await asyncio.sleep(0.1)
                assert await pool.request(kept, "who", {}) == "here"
            assert pool._idle[kept][0][0] is comm
            assert pool.idle() == {kept: 1}  # the other one idled past 0.4 s: closed, address forgotten
        finally:
            pool.abort_all()
            for srv in servers:
                srv.stop()

    asyncio.run(main())


def test_acknowledgements_of_a_channel_leave_as_one_message_per_chunk():
    """A channel holds its consumers' one-way acknowledgements until every consumer on it has
    acknowledged (or ``HOLD_S`` passed): one ``acks`` message per chunk, a row per consumer with
    its newest step and newest saved step; any other message first sends what is held (the
    scheduler must see an acknowledgement before its consumer's unsubscription)."""
    import asyncio

    from overlord_dask.trainer import ack_merge
    from overlord_dask.trainer.ack_merge import AckMerge, row_of

    def ack(rank, step, durable=False, replica=0):
        return row_of(
            {"op": "ack", "rank": rank, "replica": replica, "generation": 2, "step": step, "durable": durable}
        )

    async def main():
        sent, consumers = [], [3]
        merge = AckMerge(sent.append, lambda: consumers[0])
        merge.add(ack(0, 7, durable=True))
        merge.add(ack(1, 7))
        merge.add(ack(0, 15))  # the same consumer again: merged, newest step, its saved step kept
        assert sent == []
        merge.add(ack(1, 7, replica=1))  # the third consumer: out at once
        assert sent == [
            {
                "op": "acks",
                "rows": [
                    [0, 0, 0, 2, 15, 7, None, None],
                    [1, 0, 0, 2, 7, -1, None, None],
                    [1, 0, 1, 2, 7, -1, None, None],
                ],
            }
        ]
        merge.add(ack(2, 15))  # a consumer alone: the hold ends it
        await asyncio.sleep(ack_merge.HOLD_S * 2)
        assert sent[-1]["rows"] == [[2, 0, 0, 2, 15, -1, None, None]]
        merge.add(ack(2, 23))
        merge.flush()  # (what any other message on the channel does first)
        assert sent[-1]["rows"] == [[2, 0, 0, 2, 23, -1, None, None]] and len(sent) == 3
        merge.add(ack(2, 31))
        merge.drop()  # the channel is gone
        await asyncio.sleep(ack_merge.HOLD_S * 2)
        assert len(sent) == 3

    asyncio.run(main())
