"""One style for the whole tree: ``ruff format`` and ``ruff check`` (settings in pyproject.toml)
leave nothing to change. Fix with ``ruff format . && ruff check --fix .`` from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff_has_nothing_to_say(command):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
