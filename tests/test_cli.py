"""``dpsql query`` and ``dpsql explain`` through dpsql.cli.main: output, exit codes, errors."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURE_CSV, ROOT

from dpsql.cli import main

POLICY = f"""\
[privacy]
epsilon = 1.0
delta = 1e-6
budget_epsilon = 3.0
budget_delta = 1e-5
gaussian_share = 0.5

[tables.visits]
source = "{FIXTURE_CSV}"
privacy_unit = "patient_id"
max_rows_per_unit = 5
max_groups_per_unit = 3

[tables.visits.columns.patient_id]
type = "int"
nullable = false

[tables.visits.columns.department]
type = "text"
values = ["cardiology", "dermatology", "emergency", "neurology", "oncology", "pediatrics"]
nullable = false

[tables.visits.columns.cost]
type = "float"
lower = 0.0
upper = 5000.0
"""

DEPARTMENTS = "SELECT department, COUNT(*) AS n FROM visits GROUP BY department"


@pytest.fixture
def policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("argv", [["--help"], ["query", "--help"], ["explain", "--help"]])
def test_help(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dpsql")
    if argv != ["--help"]:
        assert "--policy" in out and "--epsilon" in out and "--format" in out


def test_no_command_prints_help_and_fails(capsys):
    code, out, _ = run(capsys)
    assert code == 2 and "usage: dpsql" in out and "query" in out


def test_missing_policy_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["query", "SELECT COUNT(*) FROM visits"])
    assert info.value.code == 2
    assert "--policy" in capsys.readouterr().err


def test_query_prints_a_table_and_charges(capsys, policy):
    code, out, err = run(capsys, "query", "--policy", policy, DEPARTMENTS)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split(" | ")[0].strip() == "department" and "n" in lines[0]
    assert set(lines[1]) <= {"-", "+"}
    assert len(lines) == 2 + 6 + 1 and lines[-1] == "(6 rows)"
    assert "charged epsilon=1" in err
    # the same query again is answered from the cache at no cost
    code, out2, err2 = run(capsys, "query", "--policy", policy, DEPARTMENTS)
    assert code == 0 and out2 == out and "cached answer" in err2


def test_query_formats_and_settings(capsys, policy):
    sql = "SELECT department, COUNT(*) AS n FROM visits GROUP BY department ORDER BY department"
    code, out, err = run(
        capsys, "query", "--policy", policy, "--epsilon", "0.5", "--format", "csv", sql
    )
    assert code == 0 and "charged epsilon=0.5" in err
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["department", "n"] and len(rows) == 7
    assert rows[1][0] == "cardiology" and int(rows[1][1]) >= 0
    code, out, _ = run(
        capsys, "query", "--policy", policy, "--epsilon", "0.5", "--format", "json", sql
    )
    data = json.loads(out)
    assert [r["department"] for r in data] == [r[0] for r in rows[1:]]
    code, out, _ = run(
        capsys,
        "query",
        "--policy",
        policy,
        "--mechanism",
        "gaussian",
        "--intervals",
        "--format",
        "json",
        "SELECT AVG(cost) FROM visits",
    )
    (row,) = json.loads(out)
    low, high = (float(x) for x in row["ci95"].strip("[]").split(","))
    assert low <= row["avg"] <= high


def test_explain_spends_nothing(capsys, policy):
    code, out, err = run(capsys, "explain", "--policy", policy, "--format", "json", DEPARTMENTS)
    assert code == 0 and "charged" not in err
    rows = json.loads(out)
    assert rows[0]["aggregate"] == "COUNT(*)" and rows[0]["sensitivity_l1"] == 15.0
    assert rows[-1]["aggregate"] == "engine_sql"
    code, out, _ = run(capsys, "query", "--policy", policy, "SHOW budget")
    assert code == 0 and "| 0 " in out.replace("0.0 ", "0 ")


def test_refused_query_exits_1_with_the_error(capsys, policy):
    code, out, err = run(capsys, "query", "--policy", policy, "SELECT * FROM visits")
    assert code == 1 and out == ""
    assert err.startswith("error: [42501] SELECT * would release individual rows")
    assert "line 1, column 8" in err and "Hint:" in err


def test_budget_exhaustion_exits_1(capsys, policy):
    assert run(capsys, "query", "--policy", policy, "SELECT SUM(cost) FROM visits")[0] == 0
    code, _, err = run(
        capsys, "query", "--policy", policy, "--epsilon", "2.5", "SELECT COUNT(cost) FROM visits"
    )
    assert code == 1 and "[53400]" in err and "remaining epsilon=" in err


def test_bad_policy_exits_1(capsys, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(POLICY.replace("nullable = false\n", "nullable = 0\n", 1))
    code, out, err = run(capsys, "query", "--policy", str(path), "SELECT COUNT(*) FROM visits")
    assert code == 1 and out == ""
    assert "[F0000]" in err and str(path) in err and "nullable" in err


def test_python_dash_m(policy):
    proc = subprocess.run(
        [sys.executable, "-m", "dpsql", "explain", "--policy", policy, DEPARTMENTS],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "engine_sql" in proc.stdout
