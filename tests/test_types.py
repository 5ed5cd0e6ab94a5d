"""The package type-checks: ``mypy dpsql`` (configured in pyproject.toml) reports nothing.

Types are how the binder, planner and compiler agree on what sqlglot hands them; a new error
is a contract drift to fix where it appears, not to pile up.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_mypy_is_clean() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "dpsql"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize(
    "command",
    [["check", "."], ["format", "--check", "dpsql", "tests", "bench", "fixtures"]],
    ids=["check", "format"],
)
def test_ruff_is_clean(command: list[str]) -> None:
    """The style checks run with the suite, so CI (which runs the suite) enforces them."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
