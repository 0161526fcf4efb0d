"""A host's trainer processes share one connection to the service through a relay
(``trainer/relay.py``): the service sees one channel for them, they receive the stream they
would without it, and a relay whose process dies is replaced by another process of the host
without a step lost or repeated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from overlord_dask import Service
from overlord_dask.trainer import relay

from .harness import ROOT, consume

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not relay.available(), reason="relays use Linux's abstract Unix sockets"),
]

TRAINER = """
import json, sys, time
from overlord_dask import connect
from tests.harness import identities

address, rank, until, out, pace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
s = connect(address, rank, timeout=120, relay=True)
got = {}
while s.next_step < until:
    b = s.next_batch()
    got[b["step"]] = identities(b)
    with open(out + ".progress", "a") as f:
        f.write(f"{b['step']}\\n")
    time.sleep(pace)
s.commit()
with open(out, "w") as f:
    json.dump({str(k): v for k, v in got.items()}, f)
s.close()
"""


def _start(script, address, rank: int, until: int, out, pace: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), address, str(rank), str(until), str(out), str(pace)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _progress(out) -> list[int]:
    path = f"{out}.progress"
    return [int(x) for x in open(path).read().split()] if os.path.exists(path) else []


def _wait_for(cond, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _received(out) -> dict:
    return {(int(k)): [tuple(i) for i in v] for k, v in json.loads(open(out).read()).items()}


def _setup(cluster, small_plan, tmp_path, until: int):
    """A plan of three ranks, what each (rank, step) receives from it (ranks in this process, no
    relay), the trainer script, and each rank's output file."""
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2}, topology={"dp": 3, "micro_batches": 1})
    with Service.start(plan, cluster=cluster) as service:
        want = consume(service.address, range(plan.topology.dp), until=until, relay=False).ids
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    return plan, want, script, [tmp_path / f"rank{r}.json" for r in range(3)]


def test_a_hosts_processes_share_one_channel_and_receive_the_same_stream(cluster, small_plan, tmp_path):
    until = 8
    plan, want, script, outs = _setup(cluster, small_plan, tmp_path, until)
    with Service.start(plan, cluster=cluster) as service:
        procs = [_start(script, service.address, r, until, outs[r], pace=0.05) for r in range(3)]
        _wait_for(lambda: all(_progress(o) for o in outs), what="every rank's first step")
        st = service.status()
        assert st["channels"] == 1 and st["subscribed"] == 3, st  # three processes, one connection
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
    for r in range(3):
        got = _received(outs[r])
        assert sorted(got) == list(range(until))
        for step, ids in got.items():
            assert ids == want[(r, step)], (r, step)


def test_a_relay_that_dies_is_replaced_without_a_step_lost_or_repeated(cluster, small_plan, tmp_path):
    """Rank 0's process holds the relay; it is killed (SIGKILL) mid-run. Ranks 1 and 2 lose
    their channel, find the service again through a relay one of them starts, and go on; rank 0,
    restarted, goes on from its last acknowledged step. Every rank's steps are the uninterrupted
    stream's, each step once per surviving process."""
    until = 10
    plan, want, script, outs = _setup(cluster, small_plan, tmp_path, until)
    with Service.start(plan, cluster=cluster) as service:
        first = _start(script, service.address, 0, until, outs[0], pace=1.0)  # slow: it holds the others back
        _wait_for(lambda: _progress(outs[0]), what="rank 0's first step (its process binds the relay)")
        others = [_start(script, service.address, r, until, outs[r], pace=0.05) for r in (1, 2)]
        _wait_for(lambda: all(_progress(o) for o in outs[1:]), what="ranks 1 and 2 through the relay")
        assert service.status()["channels"] == 1
        _wait_for(lambda: len(_progress(outs[0])) >= 3, what="rank 0's third step")
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        taken_before = _progress(outs[0])
        os.rename(f"{outs[0]}.progress", f"{outs[0]}.killed")
        again = _start(script, service.address, 0, until, outs[0], pace=0.05)
        for p in [*others, again]:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
        assert service.status()["channels"] <= 1  # (the processes are gone: their relay with them)
    for r in (1, 2):
        assert _progress(outs[r]) == list(range(until)), r  # each step once, none lost, in order
        got = _received(outs[r])
        assert all(got[s] == want[(r, s)] for s in range(until)), r
    resumed = _received(outs[0])
    start = min(resumed)
    assert start <= taken_before[-1] + 1 and sorted(resumed) == list(range(start, until))  # no gap
    assert all(resumed[s] == want[(0, s)] for s in resumed)


def test_a_process_keeps_none_of_the_relays_it_closed(cluster, small_plan):
    """A relay ends with its run (the service closes its channel): a long-lived process that
    starts a relay for run after run (a notebook, a trainer restarted in place) does not keep
    the closed ones."""
    from overlord_dask import connect
    from overlord_dask.trainer.connection import ProcessIO

    io = ProcessIO.get()
    plan = small_plan(topology={"dp": 1, "micro_batches": 1})
    for _ in range(3):
        with Service.start(plan, cluster=cluster) as service:
            s = connect(service.address, 0, timeout=60, relay=True)
            s.next_batch()
            assert [r.run_id for r in io.relays].count(service.run_id) == 1
            s.close()
        _wait_for(lambda: service.run_id not in {r.run_id for r in io.relays}, 30, "the run's relay to be dropped")
    assert not any(r.closed for r in io.relays)


REPLICA = """
import json, os, sys, time
from overlord_dask import connect
from tests.harness import identities

address, replica, until, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
here = os.path.dirname(out)
s = connect(address, 0, timeout=120, relay=True, replica=replica)
open(f"{out}.ready", "w").close()
while not os.path.exists(f"{here}/go"):
    time.sleep(0.01)
got = {}
while s.next_step < until:
    b = s.next_batch()
    got[b["step"]] = identities(b)
s.commit()
with open(out, "w") as f:
    json.dump({"got": {str(k): v for k, v in got.items()}, "read": s.channel.host_fetches.read}, f)
while not os.path.exists(f"{here}/exit"):
    time.sleep(0.01)
s.close()
"""


def test_a_ranks_replicas_in_several_processes_share_one_fetch_per_chunk(cluster, small_plan, tmp_path):
    """Three tensor-parallel replicas of rank 0, each in a process of its own on one host: once
    they are all attached, the relay fetches each chunk once and hands it over in shared
    memory, so the workers serve one fetch per chunk, not one per replica; each replica
    receives the rank's stream, and no file is left in /dev/shm."""
    from distributed import Client

    until, n = 16, 3
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2}, topology={"dp": 1, "micro_batches": 1})
    with Service.start(plan, cluster=cluster) as service:
        want = consume(service.address, [0], until=until, relay=False).ids
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    outs = [tmp_path / f"replica{k}.json" for k in range(n)]
    before = set(os.listdir("/dev/shm"))
    with Client(cluster) as client, Service.start(plan, cluster=cluster) as service:

        def served() -> int:
            return sum(client.run(lambda dask_worker: dask_worker.plugins["overlord-batch-server"].served).values())

        procs = [_start(script, service.address, k, until, outs[k]) for k in range(n)]
        _wait_for(lambda: all(os.path.exists(f"{o}.ready") for o in outs), what="every replica attached")
        time.sleep(0.3)  # (their subscriptions reach the relay)
        at_start = served()
        (tmp_path / "go").touch()
        _wait_for(lambda: all(os.path.exists(o) for o in outs), what="every replica's steps")
        fetches = served() - at_start
        (tmp_path / "exit").touch()
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
    for k in range(n):
        res = json.loads(open(outs[k]).read())
        got = {int(s): [tuple(i) for i in v] for s, v in res["got"].items()}
        assert sorted(got) == list(range(until)) and all(got[s] == want[(0, s)] for s in got), k
        assert res["read"] > 0, k  # its batches came through the host's shared memory
    # the chunks taken (steps 0-7) and prefetched (to the bound, 4 ahead), 2 steps each: at most
    # one fetch each (the replicas fetching apart: three each)
    assert fetches <= (until + 4) // 2, fetches
    assert not [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("overlord-payload")]


PACED_REPLICA = (
    TRAINER.replace(
        "rank, until, out, pace = sys.argv[1], int(sys.argv[2])",
        "replica, until, out, pace = sys.argv[1], int(sys.argv[2])",
    )
    .replace(
        "s = connect(address, rank, timeout=120, relay=True)",
        "s = connect(address, 0, timeout=120, relay=True, replica=replica)",
    )
    .replace("s.commit()\n", "")
)  # (close() acknowledges: what is checked is what each replica took)


def test_a_relay_killed_while_it_shares_its_ranks_payload_is_replaced_without_a_step_lost(
    cluster, small_plan, tmp_path
):
    """Replica 0's process holds the relay, and the payload files it shares with replicas 1 and 2;
    it is killed (SIGKILL) mid-run. The other two go on through a new relay (which sweeps the
    dead one's files from /dev/shm), each step once and the rank's batches; replica 0, restarted,
    joins them at the rank's acknowledged step (a replica that went away stops holding the others
    back, and one that attaches again starts where the rank is: ``scheduler/replicas.py``)."""
    until = 10
    plan = small_plan(loading={"prefetch_steps": 4, "batch_steps": 2}, topology={"dp": 1, "micro_batches": 1})
    with Service.start(plan, cluster=cluster) as service:
        want = consume(service.address, [0], until=until, relay=False).ids
    script = tmp_path / "replica.py"
    script.write_text(PACED_REPLICA)
    outs = [tmp_path / f"replica{k}.json" for k in range(3)]
    with Service.start(plan, cluster=cluster) as service:
        first = _start(script, service.address, 0, until, outs[0], pace=1.0)
        _wait_for(lambda: _progress(outs[0]), what="replica 0's first step (its process binds the relay)")
        others = [_start(script, service.address, k, until, outs[k], pace=0.05) for k in (1, 2)]
        _wait_for(lambda: all(_progress(o) for o in outs[1:]), what="replicas 1 and 2 through the relay")
        _wait_for(lambda: len(_progress(outs[0])) >= 3, what="replica 0's third step")
        dead = f"overlord-payload-{os.getuid()}-{first.pid}-"
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        os.rename(f"{outs[0]}.progress", f"{outs[0]}.killed")
        again = _start(script, service.address, 0, until, outs[0], pace=0.05)
        for p in [*others, again]:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
    for k in (1, 2):
        assert _progress(outs[k]) == list(range(until)), k  # each step once, none lost, in order
        got = _received(outs[k])
        assert all(got[s] == want[(0, s)] for s in range(until)), k
    resumed = _received(outs[0])
    start = min(resumed)
    assert sorted(resumed) == list(range(start, until))  # from where the rank's acknowledgements were, no gap
    assert all(resumed[s] == want[(0, s)] for s in resumed)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(dead)]  # the next relay swept them


def test_a_dead_relays_payload_files_are_swept_even_before_its_parent_reaps_it():
    """A relay that starts removes the payload files of relays whose process is gone, also one
    killed a moment ago that its parent (torchrun, a test) has not waited for yet: a zombie still
    answers ``kill(pid, 0)``; the files of a relay still running stay."""
    from overlord_dask.trainer.host_fetch import SHM, sweep_dead

    if not os.path.isdir(SHM):
        pytest.skip(f"no {SHM} here")
    dead, alive = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    paths = [os.path.join(SHM, f"overlord-payload-{os.getuid()}-{p.pid}-0") for p in (dead, alive)]
    try:
        dead.kill()
        deadline = time.monotonic() + 10
        while open(f"/proc/{dead.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # killed, not reaped
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for path in paths:
            open(path, "wb").close()
        sweep_dead()
        assert [os.path.exists(p) for p in paths] == [False, True]
    finally:
        for p in (dead, alive):
            p.kill()
            p.wait()
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
