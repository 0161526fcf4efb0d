"""The layout's rules, checked on the source: one folder per process role with imports that follow
the process boundaries (import-linter contracts in pyproject.toml), explicit surfaces (route names
written once, no private attribute of another object read), and classes of a readable size."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "overlord_dask"
MAX_CLASS_LINES = 250


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _lint_imports(config: Path, cwd: Path, path_first: Path | None = None):
    """import-linter on ``config``, in a process of its own: its command line configures logging
    (disabling the loggers that exist), which must not reach this test process."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    if path_first is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path_first), env.get("PYTHONPATH", "")])
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True))"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    """The contracts in pyproject.toml (trainer, workers, planner, plan; no cycles between
    folders) hold, indirect imports included."""
    out = _lint_imports(ROOT / "pyproject.toml", ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_a_broken_contract_is_caught(tmp_path):
    """The checker itself: in a copy of the layout where one trainer module imports the planner,
    the trainer's contract breaks and the others hold."""
    pkg = tmp_path / "overlord_dask"
    for sub in [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")]:
        (pkg / sub).parent.mkdir(parents=True, exist_ok=True)
        (pkg / sub).write_text("")
    (pkg / "trainer" / "stream.py").write_text("from ..planner import state\n")
    config = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    config.write_text(text[text.index("[tool.importlinter]") : text.index("[tool.pytest.ini_options]")])
    res = _lint_imports(config, tmp_path, path_first=tmp_path)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-2000:]
    out = " ".join(res.stdout.split())
    assert "the trainer side imports nothing of the planner" in out and "Contracts: 5 kept, 1 broken" in out, out


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_shape(path):
    """Every module opens with a docstring; no class is over MAX_CLASS_LINES lines; nothing reads
    another object's private attribute (Dask's included: its internals change between releases)."""
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{path} has no module docstring"
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_CLASS_LINES, f"{path}: class {node.name} has {lines} lines (at most {MAX_CLASS_LINES})"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            assert isinstance(owner, ast.Name) and owner.id in ("self", "cls"), (
                f"{path}:{node.lineno} reads a private attribute of another object: {ast.unparse(node)}"
            )


def test_route_names_are_written_once():
    """Each route's name appears in protocol.Route and nowhere else in the package: the route
    table and the client both use the constants."""
    names = re.findall(r'= "(overlord_[a-z_]+)"', (PACKAGE / "protocol.py").read_text())
    assert len(names) == len(set(names)) >= 16
    for path in _modules():
        if path.name == "protocol.py":
            continue
        text = path.read_text()
        for name in names:
            assert f'"{name}"' not in text and f"'{name}'" not in text, f"{path} writes the route name {name!r} itself"


def test_the_route_table_is_the_clients():
    """Every route the client calls is in the scheduler's table, and the table has no route the
    client cannot call (the worker stream and the worker's fetch aside)."""
    from overlord_dask.client import PlannerClient
    from overlord_dask.protocol import Route
    from overlord_dask.scheduler.routes import Routes

    table = set(Routes(plugin=None).table())
    called = set(re.findall(r"Route\.([A-Z_]+)", (PACKAGE / "client.py").read_text()))
    assert {getattr(Route, c) for c in called} - {Route.LENGTHS, Route.FETCH, Route.CHANNEL} == table - {Route.CHANNEL}
    assert all(hasattr(PlannerClient, name) for name in ("info", "attach", "ack", "where", "work", "status"))
