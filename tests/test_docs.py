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
        "peer_pipelines",  # (peers.py's compositions)
    }
    named = {re.search(r"benchmarks/(\w+)\.py", s).group(1) for s in sections if re.search(r"benchmarks/(\w+)\.py", s)}
    assert scripts <= named, f"no results for {sorted(scripts - named)}"
    for s in sections:
        title = s.splitlines()[0]
        assert "Command:" in s and "Machine:" in s and re.search(r"Date: \d{4}-\d{2}-\d{2}", s), (
            f"section {title!r} lacks its provenance"
        )


DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:overlord_dask|pipelines|examples|benchmarks|cluster|notebooks|docs|tests|scripts|\.ci)"
    r"/[\w.*/-]*[\w*])"
)


def _code(text: str) -> list[str]:
    """The code a page shows: its fenced blocks' lines and its inline code spans."""
    out = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        out += block.splitlines()
    out += re.findall(r"`([^`\n]+)`", re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S))
    return out


def test_docs_name_only_files_commands_and_options_that_exist():
    """Every repository path the docs name exists (globs match something), and every ``overlord``
    command they show is a real subcommand with real options: a renamed file or flag fails
    here, not in a reader's terminal."""
    from overlord_dask.service import cli, slurm_job

    commands = {
        name: {s for a in p._actions for s in a.option_strings}
        for name, p in next(a for a in cli.parser()._actions if a.choices).choices.items()
    }
    commands["slurm"] = {s for a in slurm_job.parser()._actions for s in a.option_strings}
    missing = []
    for page in DOCS:
        rel = page.relative_to(ROOT)
        text = page.read_text()
        for path in set(REPO_PATH.findall(text)):
            if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                missing.append(f"{rel}: no file {path}")
        for line in _code(text):
            line = line.split(" #")[0]
            shell = re.match(r"\s*(\$ )?(\.venv/bin/overlord|overlord|python -m overlord_dask|python cluster/)", line)
            for m in re.finditer(r"(\boverlord|-m overlord_dask|cluster/slurm\.py)\s+([a-z][\w-]*)(.*)", line):
                name, rest = ("slurm", m.group(3)) if m.group(1) == "cluster/slurm.py" else (m.group(2), m.group(3))
                if name not in commands:
                    if shell:  # (prose in code, "the overlord service", is not a command line)
                        missing.append(f"{rel}: `overlord {name}` is no command ({line.strip()})")
                    continue
                for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest.split("&&")[0].split("|")[0]):
                    if flag not in commands[name]:
                        missing.append(f"{rel}: `overlord {name}` has no option {flag}")
    assert not missing, "\n".join(sorted(set(missing)))
