"""The whole service on a real LocalCluster of worker processes, with several consumer ranks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord_dask import RankError, Service, ServiceError, SourceError, connect
from overlord_dask.observe.figures import delivered_identities, delivered_record, exactly_once, planned_identities
from overlord_dask.plan import plan_from_dict
from overlord_dask.worker.constructors import check_micro_batch

from . import harness as h
from .harness import run_ranks
from .reference import read_source

ROOT = Path(__file__).resolve().parents[1]


def consume(address: str, ranks: list[int], steps: int) -> dict[int, list[dict]]:
    """Consume ``steps`` steps on each rank, one thread per rank (each with its own client)."""
    out: dict[int, list[dict]] = {}

    def run(rank: int) -> None:
        with connect(address, rank, timeout=120) as stream:
            got = [stream.next_batch() for _ in range(steps)]
            stream.commit()
            out[rank] = got

    run_ranks(run, ranks)
    return out


@pytest.mark.integration
@pytest.mark.parametrize("policy,packing", [("cost", "whole"), ("none", "whole"), ("cost", "cut"), ("none", "cut")])
def test_every_planned_sample_is_delivered_once_with_the_right_tokens(cluster, small_plan, policy, packing):
    plan = small_plan(balance={"policy": policy, "window": 3, "packing": packing})
    steps, dp = 25, plan.topology.dp
    with Service.start(plan, cluster=cluster) as service:
        got = consume(service.address, list(range(dp)), steps)
        service.wait_for_step(steps, timeout=60)
        ledger = service.ledger(0, steps)
        metrics = service.metrics(0, steps)
    cap = plan.topology.tokens_per_micro_batch
    reference = {i: read_source(plan, s.name) for i, s in enumerate(plan.sources)}
    delivered = []
    for rank, batches in got.items():
        for step, batch in enumerate(batches):
            assert batch["step"] == step and batch["rank"] == rank
            assert len(batch["micro_batches"]) == plan.topology.micro_batches
            for mb in batch["micro_batches"]:
                check_micro_batch(mb, cap)
                if packing == "cut":
                    assert mb["num_tokens"] == cap  # no padding
                # tokens equal the files, read directly; a piece's last label is its document's next token
                for k in range(len(mb["sample_ids"])):
                    a, b = mb["cu_seqlens"][k], mb["cu_seqlens"][k + 1]
                    doc = reference[mb["source_ids"][k]][mb["sample_ids"][k]]
                    start = int(mb["piece_starts"][k])
                    np.testing.assert_array_equal(mb["input_ids"][a:b], doc[start : start + (b - a)])
                    after = start + (b - a)
                    assert mb["labels"][b - 1] == (doc[after] if after < len(doc) else -100)
            rec = delivered_record(batch)
            # what this rank got in this step is exactly what the planner assigned to it
            entry = ledger[step]
            mine = entry["slot"][:, 0] == rank
            planned = planned_identities({k: v[mine] for k, v in entry.items() if k in ("pieces", "sample_ids")})
            assert sorted(map(tuple, planned)) == sorted(map(tuple, delivered_identities(rec)))
            delivered.append(delivered_identities(rec))
    duplicates, missing = exactly_once([planned_identities(ledger[s]) for s in range(steps)], delivered)
    assert (duplicates, missing) == (0, 0)
    w = np.array(list(plan.declared_weights().values()))
    if policy == "none":  # exact per-step mix: every source within two pieces of its weight
        for m in metrics:
            err = np.abs(np.array(m["source_tokens"]) - w * m["tokens"])
            assert err.max() <= 2 * m["longest_piece"], m
    else:  # balanced: the mix holds per window, up to the pieces still waiting (bounded)
        tokens = np.sum([m["source_tokens"] for m in metrics], axis=0)
        waiting = max(m["pending"] for m in metrics) * plan.topology.tokens_per_micro_batch
        assert np.abs(tokens - w * tokens.sum()).max() <= waiting + plan.topology.tokens_per_micro_batch
    for m in metrics:
        assert m["imbalance"] >= 1.0 and m["fill"] > 0.8, m
        assert packing == "whole" or m["fill"] == 1.0, m


@pytest.mark.integration
def test_an_in_process_service_runs_its_loaders_as_threads_and_plans_the_same_stream(cluster, small_plan):
    """``in_process``: the scheduler, the planner and the loader workers in this one process
    (threads of one worker, no worker process), reached by trainers over TCP as usual, its
    ``/overlord`` page served without Dask's Bokeh pages; the same plan gives the same pieces to
    the same ranks as on worker processes, cut packing included."""
    plan = small_plan(balance={"packing": "cut"})
    steps, dp = 8, plan.topology.dp
    runs = []
    for kwargs in ({"in_process": True, "n_workers": 2}, {"cluster": cluster}):
        with Service.start(plan, **kwargs) as service:
            got = consume(service.address, list(range(dp)), steps)
            if kwargs.get("in_process"):
                pids = service.client.run(os.getpid)  # one worker of two threads, in this process
                assert list(pids.values()) == [os.getpid()] and sum(service.client.nthreads().values()) == 2
                assert service.address.startswith("tcp://")
                page = service.dashboard  # served without Dask's Bokeh pages (/status)
                assert urllib.request.urlopen(page + ".json", timeout=10).status == 200
                with pytest.raises(urllib.error.HTTPError, match="404"):
                    urllib.request.urlopen(page.rsplit("/", 1)[0] + "/status", timeout=10)
            runs.append({r: [delivered_identities(delivered_record(b)).tolist() for b in got[r]] for r in got})
    assert runs[0] == runs[1]


@pytest.mark.integration
def test_blocks_kept_on_disk_give_the_same_stream_and_leave_no_file(cluster, small_plan, tmp_path, monkeypatch):
    """``loading.block_store: disk``: every block's token ids in a file of its worker's local
    directory while the run holds it (on the workers of another process too, shadows included),
    the blocks' memory a few bytes per document, and the same pieces and tokens at every rank and
    step as blocks in memory; the files are gone once the service is."""
    import dask
    from distributed import Client

    from overlord_dask.sources import block_files

    steps = 6
    runs = []
    with dask.config.set({"temporary-directory": str(tmp_path)}):  # (where an in-process worker keeps its files)
        for store, kwargs in (
            ("memory", {"in_process": True, "n_workers": 2}),
            ("disk", {"in_process": True, "n_workers": 2}),
            ("disk", {"cluster": cluster}),
        ):
            plan = small_plan(loading={"block_store": store})
            with Service.start(plan, **kwargs) as service:
                got = h.consume(service.address, range(plan.topology.dp), steps=steps)
                files = service.client.run(block_files_of)
                held = service.status()["block_bytes"]  # what the blocks hold in the workers' memory
                if store == "disk":
                    assert sum(map(len, files.values())) >= 3, files  # a file per block held (and shadow)
                    assert 0 < held < runs[0].held / 10, (held, runs[0].held)
                else:
                    assert not any(files.values())
                got.held = held
            runs.append(got)
    for other in runs[1:]:
        assert other.ids == runs[0].ids and other.digests == runs[0].digests
    assert not [f for _, _, names in os.walk(tmp_path) for f in names if f.startswith(block_files.PREFIX)]
    with Client(cluster) as client:  # the worker processes the service ran on: their blocks released, files gone
        deadline = time.monotonic() + 30
        while any(client.run(block_files_of).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(client.run(block_files_of).values())


def block_files_of(dask_worker) -> list[str]:
    """The block files in a worker's local directory (``loading.block_store: disk``)."""
    from overlord_dask.sources import block_files

    return [
        f for _, _, names in os.walk(dask_worker.local_directory) for f in names if f.startswith(block_files.PREFIX)
    ]


@pytest.mark.integration
def test_a_trainer_fetches_from_a_new_worker_at_the_address_of_one_it_saw_lost(small_plan):
    """A trainer process keeps the addresses of workers the scheduler reported lost, to skip them
    at once. A port is used again: by a worker that replaces a lost one, or by the next service
    the same process (a notebook, a test session) connects to. The new worker's batches are
    fetched: the planner naming it as their holder clears the loss."""
    from overlord_dask.trainer.connection import ProcessIO

    plan = small_plan()
    steps, dp = 3, plan.topology.dp
    with Service.start(plan, in_process=True, n_workers=1) as service:
        (worker,) = service.client.scheduler_info()["workers"]
        io = ProcessIO.get()

        async def an_earlier_worker_there_was_lost():  # what a worker_lost message does
            io.mark_lost(worker)

        io.run(an_earlier_worker_there_was_lost(), timeout=5)
        out = {}

        def run(rank: int) -> None:
            with connect(service.address, rank, timeout=30) as stream:
                out[rank] = [stream.next_batch() for _ in range(steps)]
                stream.commit()

        run_ranks(run, list(range(dp)))
    assert sorted(out) == list(range(dp)) and all(len(b) == steps for b in out.values())


CONSUMER_SCRIPT = """
import json, sys
from overlord_dask import connect
address, rank, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
nbytes = 0
with connect(address, rank, timeout=120) as s:
    for _ in range(steps):
        b = s.next_batch()
        nbytes += sum(v.nbytes for mb in b["micro_batches"] for v in mb.values() if hasattr(v, "nbytes"))
    s.commit()
print(json.dumps({"rank": rank, "bytes": nbytes}))
"""


@pytest.fixture
def tcp_reads(monkeypatch):
    """Every TCP read in this process (scheduler, driver client, nannies): the bytes in all, and
    the largest single message. A frame may batch many messages (a client's submissions within a
    few milliseconds travel together), so a message's size is its own frames, serialized again."""
    import distributed.comm.tcp as tcp
    from distributed.protocol import dumps

    seen = {"total": 0, "largest_frame": 0, "largest_message": 0, "largest_op": None, "by_op": {}}
    read_bytes, from_frames = tcp.read_bytes_rw, tcp.from_frames

    async def counting(stream, n):
        seen["total"] += n
        seen["largest_frame"] = max(seen["largest_frame"], n)
        return await read_bytes(stream, n)

    async def measuring(frames, **kwargs):
        msg = await from_frames(frames, **kwargs)
        for m in msg if isinstance(msg, (list, tuple)) else [msg]:  # a batch of messages, or one
            size = sum(len(memoryview(f).cast("B")) for f in dumps(m))
            op = (m.get("op") or "reply") if isinstance(m, dict) else type(m).__name__
            count, nbytes = seen["by_op"].get(op, (0, 0))
            seen["by_op"][op] = (count + 1, nbytes + size)  # what the bytes were, should a bound fail
            if size > seen["largest_message"]:
                seen["largest_message"], seen["largest_op"] = size, op
        return msg

    monkeypatch.setattr(tcp, "read_bytes_rw", counting)
    monkeypatch.setattr(tcp, "from_frames", measuring)
    return seen


@pytest.mark.integration
def test_payloads_go_worker_to_trainer_not_through_the_scheduler(cluster, small_plan, tcp_reads):
    """Consumers run in their own processes; the scheduler and the driver live in this one. While
    megabytes of batches are delivered, this process reads a small fraction of that, and never a
    message anywhere near the size of one batch."""
    # one load task per unit: auto-partitioning cuts a unit into more tasks the slower the machine
    # reads it (each task a submission, a report, a release), so the control traffic it adds
    # depends on the machine, not on where the batches go
    plan = small_plan(
        topology={"dp": 2, "micro_batches": 2, "tokens_per_micro_batch": 16384}, loading={"task_seconds": None}
    )
    steps = 40  # enough that the first loads (a whole shuffle block of each source at once) are not most of it
    with Service.start(plan, cluster=cluster) as service:
        service.wait_for_step(0)
        tcp_reads.update(total=0, largest_frame=0, largest_message=0, largest_op=None, by_op={})
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CONSUMER_SCRIPT, service.address, str(r), str(steps)],
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            for r in range(2)
        ]
        outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
        assert all(p.returncode == 0 for p in procs)
    delivered = sum(o["bytes"] for o in outs)
    one_batch = delivered / (2 * steps)
    assert delivered > 20_000_000  # megabytes of batches ...
    assert tcp_reads["total"] < 0.08 * delivered, (tcp_reads, delivered)  # ... the service process saw little
    # and no message anywhere near a batch's size (the largest are a few kB: a task's submission)
    assert tcp_reads["largest_message"] < 0.05 * one_batch, (tcp_reads, one_batch)


@pytest.mark.integration
def test_rank_that_does_not_exist(cluster, small_plan):
    with Service.start(small_plan(), cluster=cluster) as service:
        with pytest.raises(RankError, match=r"rank 3 does not exist: the service at .* has dp=3 ranks \(0..2\)"):
            connect(service.address, 3)
        other_dp = connect(
            service.address, 0, dp=4
        )  # a job back with another dp: its checkpoint re-plans (load_state_dict)
        with pytest.raises(RankError, match="consumer asked for dp=4, but the service at .* runs dp=3"):
            other_dp.next_batch()  # ... without one, its first batch says what is wrong


@pytest.mark.integration
def test_a_run_lowers_the_gil_switch_interval_of_the_scheduler_process_and_restores_it(cluster, small_plan):
    """The planner thread must not hold the event loop off the GIL for Python's default 5 ms."""
    import sys

    before = sys.getswitchinterval()
    with Service.start(small_plan(), cluster=cluster):  # this LocalCluster's scheduler runs in this process
        assert sys.getswitchinterval() == pytest.approx(min(0.001, before))
    assert sys.getswitchinterval() == pytest.approx(before)


@pytest.mark.integration
def test_no_service_at_address(cluster):
    with pytest.raises(ServiceError, match="no overlord service at"):
        connect(cluster.scheduler_address, 0, timeout=5)


@pytest.mark.integration
def test_missing_file_fails_before_anything_starts(cluster, small_plan, corpus):
    plan = small_plan()
    bad = plan.model_copy(
        update={"sources": [plan.sources[0].model_copy(update={"url": "web/missing-*.parquet"}), *plan.sources[1:]]}
    )
    with pytest.raises(SourceError, match="source 'web': no files match"):
        Service.start(bad, cluster=cluster)


@pytest.mark.integration
def test_missing_column_fails_before_anything_starts(cluster, small_plan):
    plan = small_plan()
    bad = plan.model_copy(
        update={"sources": [plan.sources[0].model_copy(update={"text_field": "body"}), *plan.sources[1:]]}
    )
    with pytest.raises(
        SourceError,
        match=r"source 'web': column 'body' not found in .*part-000.parquet; available columns: \['id', 'text'\]",
    ):
        Service.start(bad, cluster=cluster)


@pytest.mark.integration
def test_corrupt_shard_fails_the_run_with_the_file_named(cluster, tmp_path):
    good = tmp_path / "a-good.parquet"
    bad = tmp_path / "b-bad.parquet"
    for path in (good, bad):
        texts = [f"{i:05d} " + "lorem ipsum " * 40 for i in range(400)]
        pq.write_table(
            pa.table({"text": texts}),
            path,
            row_group_size=100,
            write_page_checksum=True,
            compression="none",
            use_dictionary=False,
        )
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 256] = b"\xee" * 256
    bad.write_bytes(bytes(raw))
    plan = plan_from_dict(
        {
            "sources": [{"name": "web", "format": "parquet", "url": "*.parquet", "text_field": "text", "weight": 1}],
            "topology": {"dp": 2, "tokens_per_micro_batch": 2048},
            "loading": {"unit_rows": 100, "retries": 1, "units_ahead": 8, "prefetch_steps": 2},
        },
        base_dir=tmp_path,
    )
    with Service.start(plan, cluster=cluster) as service:
        with pytest.raises(ServiceError, match=r"source 'web' unit \d+ \(.*b-bad.parquet, row group \d"):
            with connect(service.address, 0, timeout=60) as stream:
                for _ in range(1000):  # the bad file's units come up within the first epoch
                    stream.next_batch()
        assert "b-bad.parquet" in service.status()["failure"]


@pytest.mark.integration
def test_dashboard_page_in_a_browser_and_prometheus_gauges_over_http(cluster, small_plan, tmp_path):
    """/overlord loaded in headless Chromium (its script fetches /overlord.json and draws the
    page), checked against the JSON; overlord_* gauges on Dask's /metrics; all over loopback
    HTTP from the scheduler's dashboard server while trainers stream."""
    import urllib.request

    from overlord_dask import connect
    from overlord_dask.testing import browser

    plan = small_plan(topology={"dp": 2})
    with Service.start(plan, cluster=cluster) as service:
        streams = [connect(service.address, r, timeout=60) for r in range(2)]
        for _ in range(8):
            for s in streams:
                s.next_batch()
        for s in streams:
            s.commit()
        base = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the view refreshes every half second
            snap = json.loads(urllib.request.urlopen(f"{base}/overlord.json", timeout=10).read())
            if snap["committed"] >= 8 and snap["rates"]["tokens_per_s"] is not None:
                break
            time.sleep(0.2)
        page = browser.shown(browser.dom(f"{base}/overlord"))  # what a person sees, once the page's script ran
        shot = browser.screenshot(f"{base}/overlord", str(tmp_path / "page.png"))
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        dask_page = urllib.request.urlopen(f"{base}/status", timeout=30).read().decode()  # Dask's own, linked
        for s in streams:
            s.close()
    assert "Dask needs bokeh" not in dask_page and "<html" in dask_page.lower()  # bokeh: the service extra
    assert '<a href="overlord">Overlord</a>' in dask_page  # and Dask's own pages link to the run's
    assert '<a href="status">status</a>' in page  # the page links to Dask's own dashboard
    assert snap["run_id"] == service.run_id and snap["committed"] == 8 and len(snap["rank_lag"]) == 2
    assert {s["source"] for s in snap["sources"]} == {"web", "chat", "books"} and snap["imbalance"] >= 1.0
    cards = dict(re.findall(r'id="v-([\w-]+)">([^<]*)<', page))
    assert re.search(rf'id="run-id">{service.run_id}<', page) and 'data-committed="8"' in page
    assert cards["state"] == "running" and cards["mix-error"] == f"{100 * snap['mix_error']:.2f}%"
    assert f"long pieces go dp at a time, a group up to {100 * snap['mix_grain']:.2f}%" in page  # the error's scale
    assert cards["imbalance"] == f"{snap['imbalance']:.3f}" and cards["max-lag"] == f"{max(snap['rank_lag'])} steps"
    assert cards["tokens-s"] not in ("", "–") and cards["worst-wait-share"].endswith("%")
    assert "8 committed" in page and all(f"<td>{n}</td>" in page for n in ("web", "chat", "books"))
    assert page.count("<svg") >= 4 and "<path" in page  # the charts were drawn
    assert os.path.getsize(shot) > 10_000
    assert f'overlord_steps_committed_total{{run="{service.run_id}"}} 8.0' in metrics
    assert f'overlord_tokens_committed_total{{run="{service.run_id}"}} {float(snap["tokens_committed"])}' in metrics
    _check_grafana_dashboard(metrics)
    assert f'overlord_source_weight{{run="{service.run_id}",source="books"}}' in metrics
    assert "overlord_rank_lag_steps" in metrics and "overlord_imbalance" in metrics
    assert set(snap["rank_wait_share"]) == {"0", "1"} and all(0 <= v <= 1 for v in snap["rank_wait_share"].values())
    assert (
        'overlord_rank_wait_share{rank="0",run=' in metrics
        or f'overlord_rank_wait_share{{run="{service.run_id}",rank="0"}}' in metrics
    )


def _check_grafana_dashboard(metrics: str) -> None:
    """Every metric the shipped Grafana dashboard queries is one the service serves, and every
    panel not in a collapsed row (those are for plans with optional features) has data."""
    import re
    from importlib import resources

    dash = json.loads(resources.files("overlord_dask.observe").joinpath("grafana-dashboard.json").read_text())
    sampled = set(re.findall(r"^(overlord_[a-z_]+)[{ ]", metrics, re.M))
    served = set(sampled)  # samples, and families that have none yet:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for name, kind in re.findall(r"^# TYPE (overlord_[a-z_]+) (\w+)$", metrics, re.M):
        served |= {name + s for s in suffixes.get(kind, ("",))}
    panels = [q for p in dash["panels"] for q in (p.get("panels", []) if p["type"] == "row" else [p])]
    queried = {name for p in panels for t in p["targets"] for name in re.findall(r"overlord_[a-z_]+", t["expr"])}
    queried |= set(re.findall(r"overlord_[a-z_]+", json.dumps(dash["templating"])))
    assert queried and queried <= served, (
        f"the dashboard queries metrics the service does not serve: {sorted(queried - served)}"
    )
    for p in dash["panels"]:
        names = {n for t in p.get("targets", []) for n in re.findall(r"overlord_[a-z_]+", t["expr"])}
        if p["type"] != "row":
            assert names & sampled, f"panel {p['title']!r} would be empty: no sample of {sorted(names)}"
    count = re.search(r'^overlord_trainer_wait_seconds_count\{run="[^"]+"\} (\S+)$', metrics, re.M)
    assert count and float(count.group(1)) > 0
    steps = re.search(r'^overlord_step_seconds_count\{run="[^"]+"\} (\S+)$', metrics, re.M)
    assert steps and float(steps.group(1)) > 0


def test_window_figures_span_a_live_update_that_added_a_source():
    """``overlord status`` and the dashboard page read the last steps' mix; steps planned before
    an update that added a source carry one entry fewer per source (once, the status crashed)."""
    from overlord_dask.observe.figures import window_figures

    before = {
        "source_tokens": [300, 100],
        "weights": [0.75, 0.25],
        "tokens": 400,
        "imbalance": 1.0,
        "mb_imbalance": 1.1,
    }
    after = {
        "source_tokens": [200, 100, 100],
        "weights": [0.5, 0.25, 0.25],
        "tokens": 400,
        "imbalance": 1.2,
        "mb_imbalance": 1.3,
    }
    w = window_figures([before, after], 3)
    assert w["delivered_share"].tolist() == [500 / 800, 200 / 800, 100 / 800] and w["mix_error"] == 0.0
    assert w["imbalance"] == pytest.approx(1.1) and w["mb_imbalance"] == pytest.approx(1.2)
    assert window_figures([], 3)["mix_error"] is None


def test_trainer_wait_and_step_time_histograms():
    """A rank's wait since its previous acknowledgement is spread over the steps it acknowledges;
    a repeat or a new attachment (its total starts again) observes nothing; step time is the time
    between advances of the committed step, per step."""
    from overlord_dask.scheduler.timings import Timings

    t = Timings()
    t.acked((0, 0, 0), 3, 0.5)  # the first: only a reference point
    t.acked((0, 0, 0), 7, 0.9)  # 0.4 s over 4 steps: 0.1 s each
    t.acked((0, 0, 0), 7, 0.9)  # a repeat
    t.acked((0, 0, 0), 9, 0.01)  # attached again: its total restarted
    t.acked((0, 0, 0), 10, 0.0104)  # 0.4 ms
    w = t.snapshot()["trainer_wait_seconds"]
    assert w["count"] == 5 and abs(w["sum"] - 0.4004) < 1e-9
    assert {str(le): c for le, c in w["buckets"]}["0.0005"] == 1 and {str(le): c for le, c in w["buckets"]}["0.1"] == 5
    t.committed(4, now=100.0)
    t.committed(6, now=101.0)  # 2 steps in 1 s
    s = t.snapshot()["step_seconds"]
    assert s["count"] == 2 and s["sum"] == 1.0 and {str(le): c for le, c in s["buckets"]}["0.5"] == 2
    # a value on a bound counts in that bound's bucket (le), one above every bound (or NaN) in +Inf
    from overlord_dask.scheduler.timings import Histogram

    h = Histogram((0.1, 1.0))
    for v in (0.1, 0.2, 1.0, 5.0, float("nan")):
        h.observe(v)
    assert [c for _, c in h.as_dict()["buckets"]] == [1, 3, 5]


@pytest.mark.integration
def test_a_service_balancing_in_a_process_of_its_own_delivers_the_same_stream(cluster, small_plan, monkeypatch):
    """With the balancer in its own process (``balancer_process``; forced here, where the steps
    are small) the service delivers, piece for piece, what it delivers balancing in the planner
    thread; its status names the process and the windows it placed. The process killed mid-run:
    the planner thread places the rest, the same stream."""
    import signal

    from overlord_dask.planner.policies import balancer_process

    plan = small_plan(balance={"window": 3})
    steps, dp = 20, plan.topology.dp
    streams, balancers = [], []
    for setting, kill_at in (("0", None), ("1", None), ("1", 8)):
        monkeypatch.setenv(balancer_process.ENV, setting)
        with Service.start(plan, cluster=cluster) as service:
            deadline = time.monotonic() + 120
            while setting == "1" and not service.status()["balancer"]["ready"]:  # (the first windows: the thread's)
                assert time.monotonic() < deadline, "the balancer process did not start"
                time.sleep(0.1)
            pid = service.status()["balancer"]["pid"] if kill_at is not None else None

            def kill(rank, batch, pid=pid, kill_at=kill_at):
                if pid is not None and rank == 0 and batch["step"] == kill_at:
                    os.kill(pid, signal.SIGKILL)

            streams.append(h.consume(service.address, range(dp), steps=steps, timeout=60, on_batch=kill).digests)
            balancers.append(service.status()["balancer"])
    assert streams[0] == streams[1] == streams[2] and len(streams[0]) == steps * dp
    assert balancers[0] is None
    assert balancers[1]["ready"] and balancers[1]["windows_in_process"] > 0, balancers[1]
    assert not balancers[2]["ready"] and balancers[2]["windows_here"] > 0, balancers[2]  # (killed: the thread's)
