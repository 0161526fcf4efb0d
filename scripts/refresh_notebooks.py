"""Execute the notebooks and save them with their outputs, so that they open with results.

    .venv/bin/python scripts/refresh_notebooks.py            # every notebook in notebooks/
    .venv/bin/python scripts/refresh_notebooks.py notebooks/inspect_mix.ipynb

Each code cell records the hash of the source its outputs came from (``metadata.overlord``);
``tests/test_notebooks.py`` fails when a cell's source changed without this script being run
again, or when a fresh run no longer gives outputs of the same kinds. The plotting backend is
Jupyter's own (inline figures), as a user opening the notebook gets it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def execute(path: Path, workdir: str, data: str, run: str | None = None):
    """The notebook at ``path`` executed in ``workdir`` over the demo corpus in ``data``: on a
    demo run of its own, or attached to the service ``run`` names (its ``RUN`` cell reads
    ``OVERLORD_RUN``). The committed outputs are always the demo run's."""
    import nbformat
    from nbclient import NotebookClient

    env = {"OVERLORD_DEMO_DATA": data, "OVERLORD_RUN": run}
    saved = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():  # the kernel inherits this process's environment
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": workdir}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def refresh(path: Path, data: str) -> None:
    import nbformat

    with tempfile.TemporaryDirectory() as work:
        nb = execute(path, work, data)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.metadata["overlord"] = {"source_hash": source_hash(cell.source)}
            cell.metadata.pop("execution", None)  # timings: noise in a diff
    nbformat.write(nb, path)
    print(f"refreshed {path.relative_to(ROOT)}")


def main(argv: list[str]) -> int:
    paths = [Path(p).resolve() for p in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    data = os.environ.get("OVERLORD_DEMO_DATA") or os.path.join(tempfile.gettempdir(), "overlord-notebook-data")
    for p in paths:
        refresh(p, data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
