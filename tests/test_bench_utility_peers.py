"""bench/bench_utility_peers.py runs without any peer library (a smoke test, not timed).

The side-by-side table in docs/mechanisms.md is printed by this script; in the project's own
venv OpenDP, PipelineDP and Tumult are absent, and the script must still run dpsql's default
policy and the oracle limits, print "not installed" for an absent peer, and merge runs made
apart into one table."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PUMS = Path("/work/shared/datasets/pums")


@pytest.mark.skipif(not (PUMS / "PUMS_dup.csv").exists(), reason="PUMS files not at hand")
def test_peers_bench_runs_dpsql_and_oracles_without_peers(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_utility_peers.py"),
            "--reps",
            "1",
            "--libraries",
            "oracle,dpsql,opendp",
            "--queries",
            "hist,dup_count,suppress",
            "--data",
            str(PUMS),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    rows = {(r["query"], r["library"]): r for r in payload["results"]}
    # the limits: the discrete Laplace optimum at ε = 1 and the optimal selection's floor
    assert rows["hist", "oracle"]["error"] == pytest.approx(0.851, abs=1e-3)
    assert rows["suppress", "oracle"]["error"] == pytest.approx(0.0076, abs=5e-4)
    for q in ("hist", "dup_count", "suppress"):
        assert math.isfinite(rows[q, "dpsql"]["error"]), rows[q, "dpsql"]
    if importlib.util.find_spec("opendp") is None:
        assert payload["absent"] == {"opendp": "not installed"}
        assert "not installed" in proc.stdout

    merged = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_utility_peers.py"), "--merge", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert "| COUNT(*) BY educ, public keys (PUMS) | MAE | 0.851 |" in merged.stdout
