"""The `overlord` command as a user runs it: a real subprocess, a real LocalCluster, trainer processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OVERLORD = [sys.executable, "-m", "overlord_dask.cli"]


def test_demo_prints_a_summary_with_exactly_once(tmp_path):
    out = subprocess.run(
        [*OVERLORD, "demo", "--dp", "2", "--steps", "16", "--scale", "0.05", "--data", str(tmp_path / "data"), "--quiet"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("steps", "dp", "tokens", "tokens_per_s", "imbalance_p50", "imbalance_p99", "mix_error_max", "duplicates", "missing"):
        assert key in summary, key
    assert summary["steps"] == 16 and summary["dp"] == 2 and summary["tokens"] > 0
    assert summary["duplicates"] == 0 and summary["missing"] == 0
    assert summary["imbalance_p50"] >= 1.0 and summary["mix_error_max"] < 0.05
    assert (tmp_path / "data" / "CORPUS.json").exists()  # the corpus was generated because it was missing


def test_validate_and_bad_plan_exit_codes(tmp_path, corpus):
    plan = yaml.safe_load((ROOT / "overlord_dask" / "demo_plan.yaml").read_text())
    for s in plan["sources"]:
        s["url"] = str(Path(corpus) / s["url"])
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(plan))
    out = subprocess.run([*OVERLORD, "validate", str(good)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report["sources"]) == {"web", "chat", "books"} and report["sources"]["books"]["documents"] > 0

    plan["topology"]["dp"] = "four"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(plan))
    out = subprocess.run([*OVERLORD, "validate", str(bad)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert "bad.yaml: topology.dp" in out.stderr and "valid integer" in out.stderr
