"""The `overlord` command as a user runs it: a real subprocess, a real LocalCluster, trainer processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
OVERLORD = [sys.executable, "-m", "overlord_dask"]


@pytest.mark.integration
def test_demo_prints_a_summary_with_exactly_once(tmp_path):
    out = subprocess.run(
        [
            *OVERLORD,
            "demo",
            "--dp",
            "2",
            "--steps",
            "16",
            "--scale",
            "0.05",
            "--data",
            str(tmp_path / "data"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "steps",
        "dp",
        "tokens",
        "tokens_per_s",
        "imbalance_p50",
        "imbalance_p99",
        "mix_error_max",
        "duplicates",
        "missing",
    ):
        assert key in summary, key
    assert summary["steps"] == 16 and summary["dp"] == 2 and summary["tokens"] > 0
    assert (
        summary["steady_from_step"] == 8 and summary["tokens_per_s"] > 0
    )  # half the run: 16 steps < the demo's prefetch
    assert summary["duplicates"] == 0 and summary["missing"] == 0
    assert summary["imbalance_p50"] >= 1.0 and summary["mix_error_max"] < 0.05
    assert (tmp_path / "data" / "CORPUS.json").exists()  # the corpus was generated because it was missing


@pytest.mark.integration
def test_the_steady_state_window_skips_warm_up_and_prefetched_steps():
    from overlord_dask.service.cli import steady_from

    assert steady_from(600, 64) == 150  # a quarter into the run, past the 64 prefetched steps
    assert steady_from(200, 64) == 64  # past the prefetched steps
    assert steady_from(100, 64) == 50  # at most half the run
    assert steady_from(2, 64) == 1 and steady_from(1, 64) == 0  # a one-step run: from its first batch


@pytest.mark.integration
def test_validate_and_bad_plan_exit_codes(tmp_path, corpus):
    plan = yaml.safe_load((ROOT / "overlord_dask" / "service" / "demo_plan.yaml").read_text())
    for s in plan["sources"]:
        s["url"] = str(Path(corpus) / s["url"])
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(plan))
    out = subprocess.run([*OVERLORD, "validate", str(good)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report["sources"]) == {"web", "chat", "books"} and report["sources"]["books"]["documents"] > 0
    assert report["warnings"] == []  # the demo corpus chunks books at its units' size

    plan["loading"]["unit_tokens"] = 65536  # units a quarter of the zarr chunks: valid, but each load decompresses 4x
    small = tmp_path / "small_units.yaml"
    small.write_text(yaml.safe_dump(plan))
    out = subprocess.run([*OVERLORD, "validate", str(small)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    (warning,) = json.loads(out.stdout)["warnings"]
    assert "source 'books'" in warning and "chunks of 262,144 tokens" in warning and "up to 4x" in warning
    assert warning in out.stderr

    copied = {**plan, "sources": [*plan["sources"], {**plan["sources"][0], "name": "web2"}]}  # a copied block
    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump(copied))
    out = subprocess.run([*OVERLORD, "validate", str(twice)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    shared = [w for w in json.loads(out.stdout)["warnings"] if "same files" in w]
    assert len(shared) == 1 and "sources 'web' and 'web2' read " in shared[0] and "once per source" in shared[0]

    plan["topology"]["dp"] = "four"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(plan))
    out = subprocess.run([*OVERLORD, "validate", str(bad)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert "bad.yaml: topology.dp" in out.stderr and "valid integer" in out.stderr


def _serve(plan_file: Path, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [*OVERLORD, "serve", str(plan_file), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )


def _cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*OVERLORD, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.integration
def test_serve_status_update_stop_and_resume_through_a_scheduler_file(tmp_path, corpus):
    """A service's life from the command line: serve (for the trainers' world size, announcing
    itself in a scheduler file), trainers that find it by the file, status, a plan update, a
    clean stop (last snapshot written), and a restart that resumes exactly where it stopped."""
    from overlord_dask import connect
    from overlord_dask.observe.figures import delivered_identities, delivered_record

    plan = yaml.safe_load((ROOT / "overlord_dask" / "service" / "demo_plan.yaml").read_text())
    for s in plan["sources"]:
        s["url"] = str(Path(corpus) / s["url"])
    plan["topology"].update(tokens_per_micro_batch=4096)
    plan["checkpoint"] = {"url": str(tmp_path / "ck"), "base_every_steps": 1}
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan))
    sf = tmp_path / "scheduler.json"

    proc = _serve(plan_file, "--dp", "2", "--scheduler-file", str(sf), "--set", "topology.micro_batches=1")
    try:
        hello = json.loads(proc.stdout.readline())
        announced = json.loads(sf.read_text())
        assert hello["dp"] == 2 and announced["address"] == hello["address"]
        assert hello["dashboard"].endswith("/overlord") and announced["dashboard"] == hello["dashboard"]
        streams = [connect(str(sf), r, timeout=60) for r in range(2)]  # found through the file
        got = {}
        for _ in range(6):
            for r, s in enumerate(streams):
                b = s.next_batch()
                assert len(b["micro_batches"]) == 1  # --set topology.micro_batches=1
                got[(r, b["step"])] = delivered_identities(delivered_record(b)).tolist()
        for s in streams:
            s.commit()
            s.close()
        status = json.loads(_cli("status", str(sf), "--json").stdout)
        assert status["committed"] >= 5 and status["dp"] == 2 and set(status["rank_lag"]) == {"0", "1"}
        assert set(status["rank_wait_share"]) == {"0", "1"}  # each trainer's own count, sent with its acks
        assert status["imbalance"] >= 1.0 and status["mix_error"] is not None and status["failure"] is None
        assert 0 < status["mix_grain"] <= 1  # (policy cost: long pieces go dp at a time)
        assert status["dashboard"] == hello["dashboard"] and status["tokens_committed"] > 0
        assert status["status"]["committed"] == status["committed"]  # --json: Service.status() too
        text = _cli("status", str(sf)).stdout  # for a person: labelled lines
        assert f"dashboard   {hello['dashboard']}" in text and f"{status['committed']} committed" in text
        assert "rank 0" in text and "imbalance" in text and "{" not in text
        assert "long pieces go dp at a time: one such group is up to" in text
        update = dict(plan, sources=[{**s, "weight": 1.0 if s["name"] == "books" else 0.1} for s in plan["sources"]])
        (tmp_path / "update.yaml").write_text(yaml.safe_dump(update))
        out = _cli("update", str(sf), str(tmp_path / "update.yaml"))  # the file lacks the service's --set
        assert out.returncode == 2 and "topology differ(s)" in out.stderr and "the same --set" in out.stderr
        out = _cli("update", str(sf), str(tmp_path / "update.yaml"), "--set", "topology.micro_batches=1")
        assert out.returncode == 0, out.stderr
        at = json.loads(out.stdout)["at_step"]
        out = _cli("stop", str(sf))
        assert out.returncode == 0, out.stderr
        assert not sf.exists()  # stop returns once the service is gone: its file is the last thing it removes
        assert proc.wait(timeout=10) == 0
        err = proc.stderr.read()
        assert "event=plan_update" in err
        assert "Traceback" not in err and "No handler" not in err and "WARNING" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    # the same plan again: the snapshot brings back the committed position and the update
    proc = _serve(plan_file, "--dp", "2", "--scheduler-file", str(sf), "--set", "topology.micro_batches=1")
    try:
        json.loads(proc.stdout.readline())
        status = json.loads(_cli("status", str(sf), "--json").stdout)
        assert (
            status["committed"] == 6 and status["last_snapshot"]["committed"] == 6
        )  # resumed, and a first base written
        with connect(str(sf), 0, timeout=60) as s:
            assert s.next_batch()["step"] == 6  # exactly after the last step every rank consumed
        assert at >= 6
    finally:
        _cli("stop", str(sf))
        if proc.wait(timeout=60) is None:
            proc.kill()


def test_serve_set_overrides_a_plan_setting_and_names_a_bad_one():
    from overlord_dask.errors import PlanError
    from overlord_dask.plan import load_plan
    from overlord_dask.service.cli import _with_settings

    path = str(ROOT / "pipelines" / "demo.yaml")
    plan = load_plan(path)
    got = _with_settings(
        plan, ["topology.tokens_per_micro_batch=1024", "sources.1.weight=0.4", "loading.prefetch_steps=8"], path
    )
    assert got.topology.tokens_per_micro_batch == 1024 and got.loading.prefetch_steps == 8
    assert got.sources[1].weight == 0.4 and got.sources[0] == plan.sources[0] and got.base_dir == plan.base_dir
    for bad, says in (
        ("topology.tokens_per_micro_batch", "expected KEY=VALUE"),
        ("topology.micro_batches=zero", "topology.micro_batches"),
        ("topolgy.dp=2", "topolgy"),
        ("sources.9.weight=1", "sources.9 is not in the plan"),
        ("sources.weight=1", "sources is a list"),
        ("name.x=1", "name is a value"),
    ):
        with pytest.raises(PlanError, match=says) as err:
            _with_settings(plan, [bad], path)
        assert "--set" in str(err.value)


def test_the_anneal_example_is_an_update_the_demo_plan_accepts():
    """pipelines/anneal.yaml is what the docs give `overlord update` for a run of demo.yaml."""
    from overlord_dask.plan import load_plan
    from overlord_dask.plan.versions import check_update

    demo, anneal = (load_plan(str(ROOT / "pipelines" / f"{n}.yaml")) for n in ("demo", "anneal"))
    check_update(demo, anneal, 5000)
    assert [s.weight for s in anneal.sources] != [s.weight for s in demo.sources]
    assert [s.model_copy(update={"weight": 0}) for s in anneal.sources] == [
        s.model_copy(update={"weight": 0}) for s in demo.sources
    ]


def test_demo_dp_applies_to_a_plan_given_with_plan(corpus):
    from overlord_dask.service.cli import demo_run_plan

    path = str(ROOT / "pipelines" / "demo.yaml")
    assert demo_run_plan(corpus, path, 8).topology.dp == 8  # was silently the plan's dp
    assert demo_run_plan(corpus, path, None).topology.dp == 4
    assert demo_run_plan(corpus, None, None).topology.dp == 4 and demo_run_plan(corpus, None, 3).topology.dp == 3


def test_every_command_shows_its_defaults_in_help():
    import re

    for cmd in ("demo", "serve", "status", "update", "explain", "stop", "preview", "plan-report"):
        out = _cli(cmd, "--help", timeout=60)
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())
        for opt, default in re.findall(r"(--[\w-]+) \S+ .*?\(default: ([^)]*)\)", text):
            assert default not in ("None", ""), (cmd, opt)
    text = " ".join(_cli("serve", "--help").stdout.split())
    assert "(default: 2)" in text and "(default: logfmt)" in text and "--dashboard-port" in text


def test_status_text_reads_as_a_person_would():
    from overlord_dask.observe.figures import mix_grain
    from overlord_dask.service.status_text import render

    # what one group of dp long pieces weighs in a window: dp × its longest piece over its tokens
    assert mix_grain([{"tokens": 100, "longest_piece": 10}, {"tokens": 100, "longest_piece": 30}], 4, "cost") == 0.6
    assert mix_grain([], 4, "cost") is None
    assert mix_grain([{"tokens": 100, "longest_piece": 10}], 4, "none") is None  # (pieces not placed dp at a time)
    assert mix_grain(None, 4, "cost") is None  # (no metrics: the service stopped while it was asked)

    s = {
        "run_id": "demo-1",
        "name": "demo",
        "dp": 3,
        "sources": ["web", "books"],
        "dashboard": "http://127.0.0.1:8787/overlord",
        "planned": 80,
        "committed": 64,
        "durable": 48,
        "tokens_committed": 2_500_000,
        "rank_lag": {0: 0, 1: 2, 2: 0},
        "rank_wait_share": {"0": 0.01, "1": 0.4, "2": 0.02},
        "imbalance": 1.0213,
        "mb_imbalance": 1.05,
        "mix_error": 0.0126,
        "mix_grain": 0.025,
        "starved_on": None,
        "pools": {},
        "last_snapshot": {"kind": "delta", "bytes": 3300, "seconds": 0.01, "committed": 48, "time": 1000.0},
        "snapshot_error": None,
        "loop_block_max_ms": 4.1,
        "failure": None,
        "stop_requested": False,
    }
    text = render(s, previous=(1000.0, {**s, "committed": 44, "tokens_committed": 1_500_000}), now=1010.0)
    lines = dict(line.split(None, 1) for line in text.splitlines())
    assert lines["steps"].startswith("64 committed") and "80 planned" in lines["steps"]
    assert lines["rate"].startswith("2.00 steps/s, 100k tokens/s")
    assert lines["lag"] == "rank 1: 2 steps behind the leader"
    assert lines["waiting"].startswith("rank 1 40.0%") and "starve" in lines["waiting"]
    assert lines["mix"].startswith("error 1.26%") and "snapshot" in lines and "10 s ago" in lines["snapshot"]
    assert lines["mix"].endswith("(long pieces go dp at a time: one such group is up to 2.50% of them)")
    assert "group" not in dict(line.split(None, 1) for line in render({**s, "mix_grain": None}).splitlines())["mix"]
    assert lines["dashboard"] == s["dashboard"] and lines["tokens"].startswith("2.5M")
    quiet = render(
        {**s, "committed": 0, "imbalance": None, "mb_imbalance": None, "mix_error": None, "last_snapshot": None}
    )
    assert "no committed step yet" in quiet and "mix" not in dict(line.split(None, 1) for line in quiet.splitlines())


@pytest.mark.integration
def test_a_script_without_a_main_guard_is_told_what_to_do(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from overlord_dask import Service\nfrom overlord_dask.service.demo import demo_plan\n"
        f"service = Service.start(demo_plan({str(tmp_path)!r}))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    assert f"{script}:3 starts a service at module level" in out.stderr and 'if __name__ == "__main__":' in out.stderr
    assert "Nanny failed to start" not in out.stderr


def test_a_service_started_in_a_spawned_child_is_not_taken_for_a_module_level_one(tmp_path):
    """A child process that multiprocessing spawned runs its own bootstrap as ``__main__`` (one
    line of ``-c`` code); a service its function starts is inside the script's guard, not at
    the script's line 1."""
    script = tmp_path / "launch.py"
    script.write_text(
        '"""A launcher: each service runs in a child process."""\n'
        "import multiprocessing as mp\n\n\n"
        "def child(q):\n"
        "    from overlord_dask.service.service import _check_main_guard\n\n"
        "    try:\n"
        "        _check_main_guard()\n"
        "        q.put('ok')\n"
        "    except Exception as err:\n"
        "        q.put(repr(err))\n\n\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn')\n"
        "    q = ctx.Queue()\n"
        "    p = ctx.Process(target=child, args=(q,))\n"
        "    p.start()\n"
        "    print(q.get(timeout=60))\n"
        "    p.join()\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok", out.stdout


def _demo_plan_file(tmp_path, corpus, **changes) -> Path:
    plan = yaml.safe_load((ROOT / "overlord_dask" / "service" / "demo_plan.yaml").read_text())
    for s in plan["sources"]:
        s["url"] = str(Path(corpus) / s["url"])
    plan.update(changes)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


@pytest.mark.integration
def test_plan_report_counts_tokens_and_epochs_without_a_cluster(tmp_path, corpus):
    """Each source's tokens up to a step are its declared share of the steps' budget; a pass
    read whole gives its exact tokens, and epochs are the ratio; the plot is written."""
    from overlord_dask.plan import load_plan
    from overlord_dask.service.cli import main
    from overlord_dask.sources import discover_units, read_unit

    path = _demo_plan_file(
        tmp_path,
        corpus,
        stages=[
            {"name": "base", "start_step": 0},
            {"name": "late", "start_step": 300, "weights": {"web": 1.0, "chat": 0.0, "books": 0.0}},
        ],
    )
    out = subprocess.run(
        [
            *OVERLORD,
            "plan-report",
            str(path),
            "--steps",
            "500",
            "--sample-units",
            "1000",
            "--plot",
            str(tmp_path / "r.png"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    plan = load_plan(path)
    budget = plan.topology.step_tokens * plan.balance.step_fill
    by = {s["source"]: s for s in report["sources"]}
    assert abs(sum(s["tokens"] for s in by.values()) - 500 * budget) / (500 * budget) < 0.01
    w = plan.declared_weights(0)
    assert (
        abs(by["chat"]["tokens"] - 300 * budget * w["chat"]) / (300 * budget * w["chat"]) < 0.02
    )  # none after step 300
    src = plan.source("books")
    tokens = sum(int(read_unit(src, plan, u).block.lengths().sum()) for u in discover_units(src, plan))
    assert by["books"]["pass_exact"] and by["books"]["tokens_per_pass"] == tokens
    assert abs(by["books"]["epochs"] - by["books"]["tokens"] / tokens) < 1e-3
    assert report["stages"] == [{"name": "base", "start_step": 0}, {"name": "late", "start_step": 300}]
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert main(["plan-report", str(path)]) == 2  # no steps in the plan and none given: told so


@pytest.mark.integration
def test_preview_shows_decoded_documents_and_the_trained_part(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from overlord_dask.service.chat_demo import llama3_style_tokenizer
    from overlord_dask.service.cli import main

    tok = llama3_style_tokenizer(tmp_path / "tok")
    msgs = [[{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}]]
    pq.write_table(pa.table({"messages": msgs, "text": ["data loaders"]}), tmp_path / "c.parquet")
    (tmp_path / "p.yaml").write_text(
        yaml.safe_dump(
            {
                "tokenizer": str(tok),
                "topology": {"dp": 1, "tokens_per_micro_batch": 1024},
                "sources": [
                    {"name": "chat", "format": "parquet", "url": "c.parquet", "messages_field": "messages"},
                    {"name": "text", "format": "parquet", "url": "c.parquet", "text_field": "text"},
                ],
            }
        )
    )
    assert main(["preview", str(tmp_path / "p.yaml"), "--source", "chat", "-n", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (
        doc["text"].startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
        and doc["trained_text"] == "sat on the mat<|eot_id|>"
    )
    assert main(["preview", str(tmp_path / "p.yaml"), "--source", "text"]) == 0
    assert "<|begin_of_text|>data loaders<|end_of_text|>" in capsys.readouterr().out


def test_schema_validates_every_example_plan_and_catches_a_typo(tmp_path):
    import jsonschema

    out = _cli("schema")
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    for path in sorted((ROOT / "pipelines").glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    plan = yaml.safe_load((ROOT / "pipelines" / "demo.yaml").read_text())
    plan["topology"]["micro_batchs"] = 2
    with pytest.raises(jsonschema.ValidationError, match="micro_batchs"):
        jsonschema.validate(plan, schema)
    undescribed = [  # an editor shows each field's description (the plan models' attribute docstrings)
        f"{model}.{name}"
        for model, d in [("Plan", schema), *schema["$defs"].items()]
        for name, prop in d.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert len(schema["$defs"]) > 10 and not undescribed, undescribed


@pytest.mark.integration
def test_status_watch_follows_a_service_until_it_is_gone(tmp_path, corpus):
    path = _demo_plan_file(tmp_path, corpus)
    proc = _serve(path, "--dp", "1", "--scheduler-file", str(tmp_path / "run.json"))
    try:
        json.loads(proc.stdout.readline())  # serving
        watch = subprocess.Popen(
            [*OVERLORD, "status", str(tmp_path / "run.json"), "--watch", "0.3", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        lines = [json.loads(watch.stdout.readline()) for _ in range(3)]
        assert all("committed" in line for line in lines)
        assert _cli("stop", str(tmp_path / "run.json")).returncode == 0
        rest, err = watch.communicate(timeout=60)
        assert watch.returncode == 0, err
        assert json.loads(rest.strip().splitlines()[-1]) == {"gone": True}
    finally:
        proc.kill()
