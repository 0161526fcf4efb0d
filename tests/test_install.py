"""A trainer node's install (issue "Plug into real training jobs"): ``pip install overlord-dask``
without the ``service`` extra brings no pyarrow, zarr, numba or pydantic, Dask within a range, and
a trainer process runs without any of them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from overlord_dask import Service

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("pyarrow", "zarr", "numba", "pydantic", "PIL", "prometheus_client", "tqdm")


def test_the_base_install_is_a_trainers_and_dask_is_a_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = [d.split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in project["dependencies"]]
    assert not {"pyarrow", "zarr", "numba", "pydantic", "pillow"} & set(base), base
    dask = [d for d in project["dependencies"] if d.startswith(("dask", "distributed"))]
    assert dask and all(">=" in d and "<" in d and "==" not in d for d in dask), dask
    assert {"pyarrow", "zarr", "numba", "pydantic"} <= {
        d.split(">")[0].lower() for d in project["optional-dependencies"]["service"]
    }


def test_a_trainer_process_runs_without_the_service_extra(cluster, small_plan):
    """A trainer process where importing any of the service's libraries fails consumes batches
    through ``OverlordDataset`` (torch) as usual."""
    script = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {HEAVY!r}:
                    raise ModuleNotFoundError(
                        f"No module named {{name!r}} (blocked: a trainer-only install)", name=name
                    )
        sys.meta_path.insert(0, Block())
        from overlord_dask import OverlordDataset
        ds = OverlordDataset(sys.argv[1], rank=0, dp=1)
        steps = [mb["step"] for _, mb in zip(range(4), ds)]
        ds.close()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print(steps, loaded)
    """)
    with Service.start(small_plan(topology={"dp": 1}), cluster=cluster) as service:
        out = subprocess.run(
            [sys.executable, "-c", script, service.address], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[0, 0, 1, 1] []"


def test_the_overlord_command_says_which_extra_a_trainer_only_install_lacks():
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "pyarrow":
                    raise ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow")
        sys.meta_path.insert(0, Block())
        from overlord_dask.service.cli import main
        sys.exit(main(["validate", "pipelines/demo.yaml"]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "pip install 'overlord-dask[service]' (missing: pyarrow)" in out.stderr, out.stderr


def test_the_wheel_ships_what_notebooks_and_operators_read(tmp_path):
    """The example plans (``pipelines/``, linked into the package), the Grafana dashboard and the
    demo plan are in the wheel, so that notebooks and ``example_plan`` work after ``pip install``."""
    import zipfile

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"overlord_dask/pipelines/{p.name}" for p in (ROOT / "pipelines").glob("*.yaml")}
    assert shipped and shipped <= names
    assert {
        "overlord_dask/observe/grafana-dashboard.json",
        "overlord_dask/service/demo_plan.yaml",
        "overlord_dask/observe/templates/overlord.html",
    } <= names
