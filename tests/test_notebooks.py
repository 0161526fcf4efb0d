"""Notebooks are executed, so they cannot rot, and are committed with their outputs (made by
``scripts/refresh_notebooks.py``) from their current sources, so that they open with results.
Each also runs attached to a service started apart from it, found by its scheduler file, as a
user points it at their own run."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from refresh_notebooks import execute, source_hash  # noqa: E402

from .harness import run_ranks  # noqa: E402

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


def _serve_run(plan, cluster, steps: int, scheduler_file: Path, pace_s: float = 0.0):
    """A run as a user has one: a service, its trainer ranks through ``steps`` committed steps,
    and the scheduler file ``overlord serve --scheduler-file`` would write."""
    from overlord_dask import Service, connect
    from overlord_dask.protocol import write_scheduler_file

    service = Service.start(plan, cluster=cluster)

    def rank(r):
        with connect(service.address, r, timeout=60) as stream:
            for _ in range(steps):
                stream.next_batch()
                time.sleep(pace_s)
            stream.commit()

    run_ranks(rank, range(plan.topology.dp))  # a rank's error fails the test, in its thread
    write_scheduler_file(scheduler_file, service.address, service.run_id, plan.topology.dp, service.dashboard)
    return service


def _outputs(cell) -> str:
    return "".join(
        o.get("text", "") + "".join(str(v) for v in o.get("data", {}).values()) for o in cell.get("outputs", [])
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_attaches_to_a_users_run_by_its_scheduler_file(path, tmp_path, corpus, small_plan):
    """``RUN`` set to a scheduler file: the notebook reads that run (its run id and plan show) and
    changes nothing in it (no new plan version, no step taken)."""
    from overlord_dask.plan import plan_from_dict, plan_to_dict
    from overlord_dask.service.demo import example_plan
    from overlord_dask.service.deploy import local_cluster

    if path.name == "loader_pools.ipynb":  # an autoscaled run: pools that grew
        d = plan_to_dict(example_plan("photos", corpus))
        d["steps"], d["stages"][1]["start_step"] = 40, 20
        d["topology"]["tokens_per_micro_batch"] = 4096
        d["loading"]["autoscale"].update(interval_s=0.25, headroom=4.0)
        plan, workers, pace = plan_from_dict(d, where="pipelines/photos.yaml"), 0, 0.05
    else:
        plan, workers, pace = small_plan(topology={"dp": 2}), 2, 0.0
    file = tmp_path / "scheduler.json"
    with local_cluster(n_workers=workers, threads_per_worker=1) as cluster:
        service = _serve_run(plan, cluster, plan.steps or 12, file, pace)
        try:
            before = service.status()
            nb = execute(path, str(tmp_path), str(tmp_path / "data"), run=str(file))
            after = service.status()
            versions = len(service.timeline().versions)
        finally:
            service.close()
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    assert service.run_id in _outputs(code[1])  # the run's status, shown by the second code cell
    assert after["committed"] == before["committed"] and versions == 1  # read, not changed
