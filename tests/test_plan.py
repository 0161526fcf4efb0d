"""Plan validation: every error names the file, the field path (and source) and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from overlord_dask import Plan, PlanError, Source, Topology, load_plan, plan_from_dict
from overlord_dask.plan import plan_to_dict
from overlord_dask.service.demo import PLAN_FILE, demo_plan

ROOT = Path(__file__).resolve().parents[1]


def _base() -> dict:
    return {
        "name": "t",
        "sources": [
            {"name": "web", "format": "parquet", "url": "w/*.parquet", "text_field": "text", "weight": 1.0},
            {"name": "books", "format": "zarr", "url": "b.zarr", "weight": 1.0},
        ],
        "topology": {"dp": 2, "tokens_per_micro_batch": 1024},
    }


def _error(data, tmp_path, name="plan.yaml") -> str:
    f = tmp_path / name
    f.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    with pytest.raises(PlanError) as exc:
        load_plan(f)
    return str(exc.value)


@pytest.mark.parametrize("path", sorted((ROOT / "pipelines").glob("*.yaml")))
def test_example_plans_load(path):
    plan = load_plan(path)
    assert plan.sources and plan.topology.dp >= 1
    assert abs(sum(plan.declared_weights().values()) - 1.0) < 1e-12


def test_yaml_and_python_plans_are_the_same():
    from_yaml = plan_from_dict(yaml.safe_load(PLAN_FILE.read_text()))
    in_python = Plan(
        name="demo",
        seed=1234,
        sources=[
            Source(name="web", format="parquet", url="web/*.parquet", text_field="text", weight=0.5),
            Source(name="chat", format="parquet", url="chat/*.parquet", tokens_field="input_ids", weight=0.2),
            Source(name="books", format="zarr", url="books.zarr", weight=0.3),
        ],
        topology=Topology(dp=4, micro_batches=2, tokens_per_micro_batch=16384),
        loading={"prefetch_steps": 64, "units_ahead": 2},
        balance={"policy": "cost", "sync": "micro_batch", "window": 8},
    )
    assert from_yaml == in_python
    assert plan_from_dict(plan_to_dict(in_python)) == in_python  # round trip


def test_pipelines_demo_matches_packaged_demo_plan():
    a = plan_to_dict(load_plan(ROOT / "pipelines" / "demo.yaml"))
    b = plan_to_dict(demo_plan(ROOT / "demo-data"))
    for d in (a, b):
        d.pop("base_dir")
        for s in d["sources"]:
            s["url"] = s["url"].removeprefix("../demo-data/")
    assert a == b


def test_unknown_field_names_file_source_and_field(tmp_path):
    data = _base()
    data["sources"][0]["txt_field"] = "text"
    msg = _error(data, tmp_path)
    assert "plan.yaml" in msg and "sources[0](web).txt_field" in msg and "unknown field" in msg


def test_unknown_format_lists_the_registered_ones(tmp_path):
    data = _base()
    data["sources"][1]["format"] = "csv"
    msg = _error(data, tmp_path)
    assert "sources[1](books).format" in msg and "'csv'" in msg
    assert "['arrow', 'jsonl', 'megatron', 'parquet', 'webdataset', 'zarr']" in msg and "module:Class" in msg


def test_missing_required_and_out_of_range(tmp_path):
    data = _base()
    del data["topology"]["tokens_per_micro_batch"]
    data["topology"]["dp"] = 0
    msg = _error(data, tmp_path)
    assert "topology.tokens_per_micro_batch: required field is missing" in msg
    assert "topology.dp" in msg and "greater than or equal to 1" in msg


def test_weights(tmp_path):
    data = _base()
    data["sources"][0]["weight"] = -0.5
    msg = _error(data, tmp_path)
    assert "sources[0](web).weight" in msg and msg.count("(got ") == 1, msg  # the value named once
    data = _base()
    for s in data["sources"]:
        s["weight"] = 0
    assert "no source is active at step 0" in _error(data, tmp_path)


def test_parquet_needs_exactly_one_field(tmp_path):
    data = _base()
    data["sources"][0]["tokens_field"] = "ids"
    msg = _error(data, tmp_path)
    assert "sources[0](web)" in msg and "exactly one of text_field, tokens_field or messages_field" in msg


def test_duplicate_source_names(tmp_path):
    data = _base()
    data["sources"][1]["name"] = "web"
    assert "duplicate source name 'web'" in _error(data, tmp_path)


def test_piece_must_fit_micro_batch(tmp_path):
    data = _base()
    data["topology"]["max_doc_tokens"] = 4096
    assert "max_doc_tokens=4096 exceeds tokens_per_micro_batch=1024" in _error(data, tmp_path)


def test_malformed_yaml_names_line(tmp_path):
    msg = _error("sources:\n  - name: web\n    url: [unclosed\ntopology: {dp: 1}\n", tmp_path, "broken.yaml")
    assert "broken.yaml:" in msg and "not valid YAML" in msg


def test_a_key_given_twice_names_it_and_both_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second ``sources:`` would drop the first list."""
    text = "sources:\n  - {name: web, url: a.parquet}\ntopology: {dp: 1}\nsources:\n  - {name: b, url: b.parquet}\n"
    msg = _error(text, tmp_path, "twice.yaml")
    assert "twice.yaml:4:1: not valid YAML: key 'sources' given twice (first at line 1)" in msg, msg
    nested = "sources:\n  - name: web\n    weight: 1\n    url: a.parquet\n    weight: 2\ntopology: {dp: 1}\n"
    assert "twice.yaml:5:5: not valid YAML: key 'weight' given twice (first at line 3)" in _error(
        nested, tmp_path, "twice.yaml"
    )
    merged = "base: &b {format: parquet, weight: 1}\nsources:\n  - {<<: *b, name: web, url: a.parquet, weight: 2}\n"
    assert "given twice" not in _error(merged + "topology: {dp: 0}\n", tmp_path, "ok.yaml")  # a merge may repeat keys


def test_not_a_mapping_and_missing_file(tmp_path):
    assert "a plan must be a mapping" in _error("- just\n- a list\n", tmp_path)
    with pytest.raises(PlanError, match="plan file not found"):
        load_plan(tmp_path / "nope.yaml")


def test_relative_urls_resolve_against_plan_folder(tmp_path):
    f = tmp_path / "sub" / "p.yaml"
    f.parent.mkdir()
    f.write_text(yaml.safe_dump(_base()))
    assert load_plan(f).base_dir == str(f.parent.resolve())
