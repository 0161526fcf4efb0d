"""The documentation: the site builds without a warning, the README stays a first hour's read with
the two set-up commands CI runs, and benchmark results live in one place with their provenance."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')

ROOT = Path(__file__).resolve().parents[1]


def test_docs_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: every page in the nav, every link and every API reference
    resolves (mkdocstrings reads the docstrings), or the build fails."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    page = (tmp_path / "site" / "reference" / "trainer" / "index.html").read_text()
    assert "OverlordDataset" in page and "state_dict" in page  # the API reference is rendered from the code
    assert "Benchmark results" in (tmp_path / "site" / "benchmarks" / "index.html").read_text()


def test_readme_is_short_and_runs_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "scripts/install.sh && .venv/bin/overlord demo" in readme
    test_command = "scripts/install.sh --test && .venv/bin/python -m pytest -q"
    assert test_command in readme and test_command in (ROOT / ".ci" / "run").read_text()
    for history in ("this round", "last round", "measured"):
        assert history not in readme.lower(), f"README.md says {history!r}: run figures belong in benchmarks/RESULTS.md"


def test_benchmark_results_say_where_they_come_from():
    """One section per benchmark script, each with the command, the machine and the date."""
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    sections = re.split(r"^## ", results, flags=re.M)[1:]
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {
        "__init__",
        "output",
        "per_rank",
        "model_trainer",
    }
    named = {re.search(r"benchmarks/(\w+)\.py", s).group(1) for s in sections if re.search(r"benchmarks/(\w+)\.py", s)}
    assert scripts <= named, f"no results for {sorted(scripts - named)}"
    for s in sections:
        title = s.splitlines()[0]
        assert "Command:" in s and "Machine:" in s and re.search(r"Date: \d{4}-\d{2}-\d{2}", s), (
            f"section {title!r} lacks its provenance"
        )
