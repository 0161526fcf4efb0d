"""Faults while trainers stream (issue 10): a worker SIGKILLed mid-run loses nothing and repeats
nothing; with shadows its built batches are served from the copies, and every trainer process is
told at once that the worker is gone (no fetch waits out a connect timeout on a dead address)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
from dask.utils import parse_timedelta

from overlord_dask import Service
from overlord_dask.service.deploy import WORKER_CONFIG
from overlord_dask.testing import browser

from .harness import consume

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')

PEER_CONNECT_S = parse_timedelta(
    WORKER_CONFIG["distributed"]["comm"]["timeouts"]["connect"]
)  # a worker's wait on a dead peer


def _consume(address, steps, waits=None, at_step=None, action=None) -> dict:
    """Each of two ranks takes ``steps`` steps, one step fetched ahead, so the batches built for the
    next steps are still on the workers (``harness.consume``);
    ``action`` runs once when rank 0 reaches ``at_step``; ``waits`` gets each step's wait."""

    def on_batch(rank, batch):
        if rank == 0 and batch["step"] == at_step and action is not None:
            action()

    got = consume(address, range(2), steps=steps, on_batch=on_batch, prefetch_steps=1)
    if waits is not None:
        waits.extend(got.waits)
    return got.ids


def _reference(plan, cluster, steps: int) -> dict:
    """What an uninterrupted run of ``plan`` delivers, per (rank, step)."""
    with Service.start(plan, cluster=cluster) as ref:
        return _consume(ref.address, steps)


@pytest.mark.parametrize("shadows", [1, 0])
def test_worker_killed_mid_run_loses_and_repeats_nothing(cluster, small_plan, shadows):
    plan = small_plan(topology={"dp": 2}, loading={"prefetch_steps": 8, "batch_steps": 2, "shadows": shadows})
    steps = 24
    reference = _reference(plan, cluster, steps)
    with Service.start(plan, cluster=cluster) as service:
        pids = service.client.run(os.getpid)
        victim = sorted(pids)[0]

        def kill():
            time.sleep(0.3)  # the next chunks are built (and shadowed) by now
            os.kill(pids[victim], signal.SIGKILL)

        waits = []
        got = _consume(service.address, steps, waits, at_step=8, action=kill)
        st = service.status()
    assert sorted(got) == sorted(reference)
    for key, ids in reference.items():
        assert got[key] == ids, key  # the same stream, rank by rank, step by step
    if shadows:
        assert st["shadowed"] > 0 and st["blocks_shadowed"] > 0  # built batches and loaded blocks were copied
    # nobody waited out Dask's connect timeout (30 s) or the consumer's own (120 s). Without
    # shadows a constructor whose block was on the killed worker may wait one refused peer
    # connection out first (the workers' connect timeout, deploy.WORKER_CONFIG: 10 s) before the
    # block is reloaded (a full local run once waited 10.01 s against a bound of exactly 10 s)
    print(f"shadows={shadows}: longest wait {max(waits):.3f}s, shadowed {st['shadowed']}")
    assert max(waits) < PEER_CONNECT_S + 5, max(waits)
    _wait_for_workers(cluster, 2)


def _wait_for_workers(cluster, n: int) -> None:
    deadline = time.monotonic() + 60  # the nannies bring the workers back for the next tests
    while len(cluster.scheduler_info["workers"]) < n and time.monotonic() < deadline:
        time.sleep(0.2)


def test_every_worker_killed_at_once_loses_and_repeats_nothing(cluster, small_plan):
    """Both workers SIGKILLed together (shadows cannot help: every copy is gone): their nannies
    restart them, everything is rebuilt, and trainers wait seconds, not a connect timeout."""
    plan = small_plan(topology={"dp": 2}, loading={"prefetch_steps": 8, "batch_steps": 2})
    steps = 20
    reference = _reference(plan, cluster, steps)
    with Service.start(plan, cluster=cluster) as service:
        pids = service.client.run(os.getpid)

        def kill_all():
            for pid in pids.values():
                os.kill(pid, signal.SIGKILL)

        waits = []
        got = _consume(service.address, steps, waits, at_step=6, action=kill_all)
    assert got == reference  # the same stream, rank by rank, step by step
    print(f"all workers killed: longest wait {max(waits):.3f}s")
    assert max(waits) < 20, max(waits)  # was 60 s: every rank waited out connect timeouts
    _wait_for_workers(cluster, 2)


def test_a_rank_that_waits_is_told_why():
    """The error after a rank's timeout names the cause its service's status shows, and the step."""
    from overlord_dask.trainer.stalls import why_waiting

    base = {"next_step": 72, "committed": 40, "acked": [45, 46]}
    far = why_waiting(base, 0, 1_000_000, 600)
    assert far.startswith("rank 0: no batch for step 1,000,000 within 600s: the service has planned steps up to 71")
    assert "999,929 steps beyond them: a consumer state of another run" in far
    slow = why_waiting({**base, "acked": [69, 12, 12]}, 0, 70, 30)
    assert "ranks 1, 2 consumed only up to step 12: the service plans at most loading.prefetch_steps ahead" in slow
    assert "planned steps up to" not in slow
    starved = why_waiting({**base, "starved_on": "books"}, 1, 50, 30)
    assert "planning waits on source 'books': its next units are still loading" in starved
    quarantined = [{"source": "web", "unit": 7, "step": 44, "reason": "loading ...: ArrowInvalid: bad page"}]
    told = why_waiting({**base, "quarantined": quarantined}, 0, 50, 30)
    assert "unit 7 of source 'web' was quarantined at step 44 (loading ...: ArrowInvalid: bad page)" in told
    assert why_waiting({**base, "failure": "boom"}, 0, 50, 30) == "the overlord service failed: boom"
    assert "its status shows no cause" in why_waiting(base, 1, 47, 30)


def test_what_the_next_step_waits_on_is_named_in_words():
    """``HeldBatches.blocker``: the load a step's batches wait for (its unit and source, where it
    runs, the retries it used, the workers that died running it), or the build itself."""
    from types import SimpleNamespace as NS

    from overlord_dask.scheduler.held import HeldBatches

    class Task(NS):  # hashable, as the scheduler's TaskState is
        __hash__ = object.__hash__

    w = NS(address="tcp://10.0.0.7:4000")
    load = Task(
        key="overlord-load-r1-web-main-e0-u12-n40", state="processing", processing_on=w, retries=0, suspicious=1
    )
    build = Task(key="b1", state="waiting", processing_on=None, retries=0, suspicious=0, dependencies=[load])
    done = NS(key="b0", state="memory", who_has=[w], dependencies=[])
    sched = NS(tasks={"b0": done, "b1": build}, workers={})
    held = HeldBatches(sched, 0, False, "overlord-load-r1-", retries=2)
    held.add("b0", [10, 11], 0, 2)
    held.add("b1", [12, 13], 0, 2)
    held.stored("b0")
    assert held.blocker(11) is None  # built
    assert held.blocker(20) is None  # not handed out yet: the planner's causes apply
    assert held.blocker(13) == (
        "the batches of step 13 (ranks 0-1) wait for unit 12 of source 'web-main' (epoch 0), on "
        "tcp://10.0.0.7:4000; retried 2 of 2 times after errors, 1 worker died running it"
    )
    queued = Task(key="overlord-load-r1-books-e1-u3-n41", state="processing")
    w.processing = [build, queued, load]  # the build waits on the worker behind a load (of another step)
    w.executing = {load: 14.2}  # ... the one running there (the other is queued too)
    load.state = "memory"
    build.state, build.processing_on = "processing", w
    assert held.blocker(12) == (
        "the batches of step 12 (ranks 0-1) are on tcp://10.0.0.7:4000, behind the load of unit 12 of source "
        "'web-main' (epoch 0) running there"
    )
    build.state = "no-worker"
    assert "waiting for a worker that can run it" in held.blocker(12)


def hold_while(table, flag: str):
    """A batch prepare step (``tests.test_faults:hold_while``) that holds a load while ``flag`` exists."""
    while os.path.exists(flag):
        time.sleep(0.05)
    return table


def test_a_stalled_step_is_named_in_status_summary_and_the_trainers_error(cluster, small_plan, tmp_path):
    """The web source's loads hang (a prepare step held by a flag file) while a rank runs:
    ``status()["waiting"]`` names the step it needs, the source and unit planning waits for and
    the worker loading it; ``overlord status`` shows it, the page's state card says "blocked"
    with it, and the rank that times out is told the same; all of it gone once the loads go on."""
    from overlord_dask import connect
    from overlord_dask.errors import ServiceError
    from overlord_dask.service.status_text import render

    flag = tmp_path / "hold"
    from overlord_dask.plan import plan_from_dict, plan_to_dict

    base = small_plan(topology={"dp": 1}, loading={"prefetch_steps": 2})
    d = plan_to_dict(base)
    d["sources"][0]["prepare"] = [{"batch": "tests.test_faults:hold_while", "kwargs": {"flag": str(flag)}}]
    plan = plan_from_dict(d, base_dir=base.base_dir)
    with Service.start(plan, cluster=cluster) as service:
        told = None
        with connect(service.address, 0, timeout=8) as s:
            s.next_batch()
            flag.touch()
            try:
                for _ in range(500):
                    s.next_batch()
            except ServiceError as err:
                told = str(err)
            step = s.next_step
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # (which load runs where comes with the workers' heartbeats)
                w = service.status()["waiting"]
                if w is not None and "of source 'web'" in w["cause"]:
                    break
                time.sleep(0.2)
            base = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the page's view refreshes every half second
                snap = json.loads(urllib.request.urlopen(f"{base}/overlord.json", timeout=10).read())
                seen = snap.get("waiting") or {}
                if seen.get("since_s", 0) >= 2 and "of source 'web'" in seen.get("cause", ""):
                    break
                time.sleep(0.2)
            page = browser.shown(browser.dom(f"{base}/overlord"))
            text = render(service.summary())
        flag.unlink()
        assert snap["waiting"]["step"] == step and "of source 'web'" in snap["waiting"]["cause"], snap["waiting"]
        state = page[page.find('data-key="state"') :][:600]
        assert "blocked" in state and f"step {step} for " in state, state
        assert told is not None and w is not None and w["step"] == step, (told, w)
        # (planning starved on web's loads, or a build queued behind one on its worker: either way, named)
        assert "unit " in w["cause"] and "of source 'web' (epoch " in w["cause"], w
        assert f"step {step}" in w["cause"] and " on tcp://127.0.0.1:" in w["cause"], w
        # the rank was told at its timeout (what it waited on then: the same source's loads)
        assert f"no batch for step {step} within 8s" in told and "of source 'web' (epoch " in told, told
        assert f"blocked    step {step}" in text.replace("blocked     ", "blocked    "), text
        with connect(service.address, 0, timeout=60) as s:
            s.load_state_dict({"version": 1, "next_step": step})
            s.next_batch()
            s.commit()
        after = service.status()["waiting"]  # (the next step may be on its way, never the one that was held)
        assert after is None or after["step"] > step, after


def test_an_acknowledgement_cut_by_a_service_restart_is_sent_again_for_the_new_attachment():
    """``state_dict()`` or ``commit()`` while the service is killed: the request breaks under it
    (the chaos run's job died of it at a checkpoint); it waits for the stream to find the service
    again and sends it anew, under the new attachment's generation."""
    import asyncio
    from types import SimpleNamespace as NS

    from overlord_dask.errors import ConnectionClosed
    from overlord_dask.trainer.prefetch import RankIO

    async def scenario():
        io = object.__new__(RankIO)
        io.hand, io._max_seen = NS(consumed=41), 45
        io.options = NS(reconnect_timeout=5)
        io.rank, io.cp_rank, io.replica, io.generation = 1, None, 0, 3
        io.connected = asyncio.Event()
        io.connected.set()
        sent = []

        async def reconnect():
            await asyncio.sleep(0.5)
            io.generation, io.hand.consumed = 4, 42
            io.connected.set()

        async def ack(**msg):
            sent.append(dict(msg))
            if len(sent) == 1:  # the service dies under the request; the channel notices
                io.connected.clear()
                asyncio.ensure_future(reconnect())
                raise ConnectionClosed("connection to tcp://127.0.0.1:8786 closed: ConnectionResetError")
            return {"error": None, "committed": 40}

        io.planner = NS(ack=ack)
        resp = await io._ack_request({"step": 41, "durable": True})
        return resp, sent

    resp, sent = asyncio.run(scenario())
    assert resp == {"error": None, "committed": 40}
    assert [(m["generation"], m["step"]) for m in sent] == [(3, 41), (4, 42)]


def test_a_fetch_given_up_for_a_shadow_leaves_no_unretrieved_error():
    """A hung holder's fetch is abandoned for a shadow after the hedge time; when it fails later
    (the connect timed out), nothing logs "Task exception was never retrieved" in the trainer."""
    import asyncio
    import gc
    import logging

    from overlord_dask.trainer.fetch import fetch_shared

    records = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Catch()
    logging.getLogger("asyncio").addHandler(handler)
    try:

        async def scenario():
            class IO:
                inflight, fetches_shared = {}, 0

                async def call_worker(self, address, call, abort=None):
                    await asyncio.sleep(0.2)
                    raise OSError(f"Timed out trying to connect to {address} after 5 s")

            io = IO()
            try:
                await asyncio.wait_for(fetch_shared(io, "tcp://10.0.0.2:1", ("k",), None), 0.05)
            except asyncio.TimeoutError:
                pass  # gone to the shadow
            await asyncio.sleep(0.4)  # the abandoned fetch fails meanwhile
            assert io.inflight == {}

        asyncio.run(scenario())
        gc.collect()
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert not [r for r in records if "never retrieved" in r], records


def test_a_rank_whose_fetches_fail_says_what_they_met():
    """Batches built on a worker this rank cannot fetch from (the scheduler still names it, the
    connection fails): the rank's timeout error says which steps, how often and the last failure,
    not only that the service's status shows no cause; a fetch that succeeds clears it. The rank
    asks the planner where the batch is less and less often, not in a tight loop."""
    import asyncio

    from overlord_dask.errors import ServiceError
    from overlord_dask.trainer.fetch import fetch_batches
    from overlord_dask.trainer.stalls import FetchTrouble

    told = []

    class IO:
        inflight, fetches_shared = {}, 0

        def __init__(self, fail: bool):
            self.fail = fail

        async def call_worker(self, address, call, abort=None):
            if self.fail:
                raise OSError(f"Timed out trying to connect to {address} after 5 s")
            return {"status": "OK", "payload": Payload([pack_batch({"step": 7})])}

        def found(self, addresses, asked_at):
            pass

    class Planner:
        async def where(self, key, timeout, run_id=None):
            return {"error": None, "workers": ["tcp://10.0.0.2:1"]}  # (at once: the task is in memory there)

    from overlord_dask.wire import Payload, pack_batch

    desc = {"key": "build-7", "workers": ["tcp://10.0.0.2:1"], "steps": [7, 8]}

    async def fetch(io, timeout):
        return await fetch_batches(
            io,
            Planner(),
            desc,
            [7, 8],
            rank=0,
            cp_rank=None,
            timeout=timeout,
            abort=asyncio.Event(),
            address="tcp://127.0.0.1:8786",
            trouble=told.append,
        )

    with pytest.raises(ServiceError, match="could not be fetched"):
        asyncio.run(fetch(IO(fail=True), 0.3))
    assert 2 < len(told) < 20, len(told)  # not a request to the scheduler per loop turn: pauses that double
    assert told[-1] == "worker tcp://10.0.0.2:1: OSError: Timed out trying to connect to tcp://10.0.0.2:1 after 5 s"
    trouble = FetchTrouble()
    for text in told:
        trouble.tell([7, 8], text)
    n, since = len(told), trouble.since
    assert (
        trouble.text(now=since + 12.4) == f"this rank's fetch of steps 7-8 failed {n:,} times in 12 s, last: {told[-1]}"
    )
    trouble.tell([9], "worker tcp://10.0.0.3:1 did not answer within 2 s")  # another fetch: counted anew
    assert trouble.text(now=trouble.since).startswith("this rank's fetch of step 9 failed 1 time in 0 s, last: worker")
    trouble.tell([9], None)
    assert trouble.text() is None  # it came
    assert asyncio.run(fetch(IO(fail=False), 5)) == [{"step": 7}] and told[-1] is None


def test_a_loss_reported_after_the_planner_was_asked_stays_marked():
    """The planner's answer clears the loss of an address it names only where the loss was
    reported before the question (an earlier worker there): a worker that died while the answer
    was on its way is still skipped at once, not retried for the whole connect timeout."""
    import asyncio
    import time

    from overlord_dask.trainer.connection import ProcessIO

    io = ProcessIO.get()
    earlier, meanwhile = "tcp://10.9.9.9:1", "tcp://10.9.9.9:2"

    async def scenario():
        io.mark_lost(earlier)
        await asyncio.sleep(0.002)
        asked = time.monotonic()
        await asyncio.sleep(0.002)
        io.mark_lost(meanwhile)
        io.found([earlier, meanwhile], asked)
        out = (io.lost(earlier).is_set(), io.lost(meanwhile).is_set())
        for a in (earlier, meanwhile):
            io.lost_workers.pop(a, None), io.lost_at.pop(a, None)
        return out

    assert io.run(scenario(), timeout=5) == (False, True)


def test_a_rank_back_on_a_restored_service_acknowledges_steps_it_is_still_replaying():
    """A service restored from its snapshot at step R replays from its window start up to R;
    meanwhile a reconnected rank (its replica entry starts at R - 1, as the restore says) sends
    what it consumed: no "only steps < N were planned" (the chaos run's job died of it), and
    steps beyond R count as planning catches up."""
    from types import SimpleNamespace as NS

    from overlord_dask.plan import plan_from_dict
    from overlord_dask.planner.state import PlannerState
    from overlord_dask.scheduler.trainer_routes import TrainerRoutes

    from .test_feedback import IDS, plan_dict, run

    plan = plan_from_dict(plan_dict())
    first = PlannerState(plan, IDS)
    run(first, None, 30)
    state = first.get_state()
    st = PlannerState(plan, IDS, state=state)  # restored: nothing re-planned yet
    r = st.replay_until
    assert r > 0 and st.next_step < r
    p = NS(
        thread=NS(state=st, release=lambda keys: None),
        channels=NS(current=lambda consumer, gen: True),
        snapshots_loop=None,
        held=NS(release_before=lambda committed: []),
    )
    routes = TrainerRoutes(p)
    routes.replicas.attach((0, 0, 0), r - 1, r - 1)
    assert routes.ack(0, r - 1, durable=True)["error"] is None  # consumed before the restore
    assert routes.ack(0, r + 2, durable=True)["error"] is None  # ... and beyond: counted as planning goes
    assert routes.early[(0, 0, 0)][0] == r + 2
