"""Notebooks are executed, so they cannot rot, and are committed with their outputs (made by
``scripts/refresh_notebooks.py``) from their current sources, so that they open with results."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from refresh_notebooks import execute, source_hash  # noqa: E402

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _kinds(cell) -> list[str]:
    """The kinds of a cell's outputs: stream names, result and display types (an image, a table)."""
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            out.append(f"stream:{o['name']}")
        elif o["output_type"] in ("execute_result", "display_data"):
            kind = next((k for k in ("image/png", "text/html") if k in o["data"]), "text/plain")
            out.append(f"{o['output_type']}:{kind}")
        else:
            out.append(o["output_type"])
    return [k for k in out if k != "stream:stderr"]  # warnings come and go with the machine


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_its_committed_outputs_are_fresh(path, tmp_path, corpus):
    committed = nbformat.read(path, as_version=4)
    code = [c for c in committed.cells if c.cell_type == "code"]
    stale = [
        i for i, c in enumerate(code) if c.metadata.get("overlord", {}).get("source_hash") != source_hash(c.source)
    ]
    assert not stale, (
        f"{path.name}: code cells {stale} changed since their outputs were made: run scripts/refresh_notebooks.py"
    )
    assert any(c.get("outputs") for c in code) and not any(
        o["output_type"] == "error" for c in code for o in c.get("outputs", [])
    )
    assert any("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", [])), (
        "the committed plots are missing"
    )
    nb = execute(path, str(tmp_path), str(tmp_path / "data"))
    fresh = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in fresh for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert [_kinds(c) for c in fresh] == [_kinds(c) for c in code], (
        "a fresh run gives other outputs than the committed ones"
    )
    assert "matplotlib.use" not in "".join(c.source for c in code)  # the backend is Jupyter's
