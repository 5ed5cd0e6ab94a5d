"""bench/bench_core.py --quick runs and its reference checks pass (a smoke test, not timed):
every bench plan returns exactly what a hand-written reference query returns for the same
secret, so the figures in docs/performance.md measure the plans dpsql really runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_core_quick_checks_pass(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_core.py"),
            "--quick",
            "--skip-memory",
            "--rows",
            "200000",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = [line for line in proc.stdout.splitlines() if line.strip().startswith("check:")]
    assert any("row-level" in c for c in checks) and sum("unit-level" in c for c in checks) == 3


def test_bench_fast_checks_pass(tmp_path: Path) -> None:
    """bench/bench_fast.py (issue 28's shape, default policy): the store is built, and its
    compiled pass returns the SQL plan's integers for every timed query."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_fast.py"),
            "--rows",
            "20000",
            "--reps",
            "1",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    checks = [line for line in proc.stdout.splitlines() if line.startswith("check:")]
    assert len(checks) == 4
