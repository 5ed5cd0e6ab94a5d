"""``dpsql query`` and ``dpsql explain`` through dpsql.cli.main: output, exit codes, errors."""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURE_CSV, ROOT

from dpsql.cli import main
from dpsql.plan import bias

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
    assert lines[0].split() == ["department", "n"]
    assert len(lines) == 1 + 6 + 1 and lines[-1] == "(6 rows)"
    assert all(line.split()[1].isdigit() for line in lines[1:-1])
    assert "charged epsilon=1" in err and "remaining epsilon=" in err
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
    assert set(row) == {"avg", "avg_low", "avg_high"}
    assert row["avg_low"] <= row["avg"] <= row["avg_high"]


def test_explain_spends_nothing(capsys, policy):
    code, out, err = run(capsys, "explain", "--policy", policy, "--format", "json", DEPARTMENTS)
    assert code == 0 and "charged" not in err
    rows = json.loads(out)
    assert rows[0]["aggregate"] == "COUNT(*)" and rows[0]["sensitivity_l1"] == 15.0
    assert rows[-1]["aggregate"] == "engine_sql"
    code, out, _ = run(capsys, "query", "--policy", policy, "SHOW budget")
    header, values, _ = out.splitlines()
    assert (
        code == 0 and dict(zip(header.split(), values.split(), strict=True))["spent_epsilon"] == "0"
    )


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
    assert "Engine SQL" in proc.stdout and "Plan tree" in proc.stdout


# -- intervals, confidence, input, the shell, help, trust ------------------------------------


def test_intervals_are_fields_in_every_format(capsys, policy):
    sql = "SELECT department, COUNT(*) AS n FROM visits GROUP BY department ORDER BY department"
    code, out, _ = run(capsys, "query", "--policy", policy, "--intervals", "--format", "csv", sql)
    rows = list(csv.reader(io.StringIO(out)))
    assert code == 0 and rows[0] == ["department", "n", "n_low", "n_high"]
    assert all(float(r[2]) <= int(r[1]) <= float(r[3]) for r in rows[1:])
    code, out, err = run(capsys, "query", "--policy", policy, "--intervals", sql)
    assert out.splitlines()[0].split() == ["department", "n", "n_low", "n_high"]
    assert "cached answer" in err
    code, out, err = run(
        capsys,
        "query",
        "--policy",
        policy,
        "--intervals",
        "--confidence",
        "0.5",
        "--format",
        "json",
        sql,
    )
    narrow = json.loads(out)
    wide = [dict(zip(rows[0], r, strict=True)) for r in rows[1:]]
    assert "cached answer" in err and "intervals at confidence 0.5" in err
    for a, b in zip(narrow, wide, strict=True):
        assert float(b["n_low"]) < a["n_low"] <= a["n"] <= a["n_high"] < float(b["n_high"])


def test_sql_from_a_file_and_stdin(capsys, policy, tmp_path, monkeypatch):
    script = tmp_path / "q.sql"
    script.write_text("SET epsilon = 0.25;\n-- a comment; with a semicolon\n" + DEPARTMENTS + ";\n")
    code, out, err = run(capsys, "query", "--policy", policy, "-f", str(script))
    assert code == 0 and "(6 rows)" in out and "charged epsilon=0.25" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("SHOW epsilon; SHOW budget"))
    code, out, _ = run(capsys, "query", "--policy", policy)
    assert code == 0 and out.splitlines()[:3] == ["epsilon", "1.0", "(1 row)"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("SHOW confidence"))
    code, out, _ = run(capsys, "query", "--policy", policy, "-f", "-", "--confidence", "0.9")
    assert code == 0 and "0.9" in out
    code, _, err = run(capsys, "query", "--policy", policy, "-f", str(tmp_path / "none.sql"))
    assert code == 2 and "cannot read" in err
    code, _, err = run(capsys, "query", "--policy", policy, "-f", str(script), "SHOW epsilon")
    assert code == 2 and "not both" in err


def test_a_script_stops_at_its_first_error(capsys, policy):
    code, out, err = run(capsys, "query", "--policy", policy, "SELECT * FROM visits; SHOW budget")
    assert code == 1 and out == "" and err.startswith("error: [42501]")


def test_budget_feedback_and_low_budget_warning(capsys, policy):
    path = Path(policy)
    path.write_text(path.read_text().replace("gaussian_share = 0.5", "gaussian_share = 0"))
    code, _, err = run(
        capsys, "query", "--policy", policy, "--epsilon", "2.8", "SELECT COUNT(*) FROM visits"
    )
    assert code == 0 and "remaining epsilon=0.2 of 3" in err
    assert "warning: less than 10% of the privacy budget remains" in err
    code, _, err = run(
        capsys,
        "explain",
        "--policy",
        policy,
        "--analyst",
        "default",
        "SELECT AVG(cost) FROM visits",
    )
    assert code == 0 and "would be refused" in err and "nothing was spent" in err


def test_explain_explains_each_select_of_a_script(capsys, policy):
    code, out, err = run(
        capsys,
        "explain",
        "--policy",
        policy,
        "--format",
        "json",
        "SET epsilon = 0.5; " + DEPARTMENTS,
    )
    # the first measure's ε: the query's, less the bias estimate's share (docs/bias.md)
    first = json.loads(out)[0]["epsilon"]
    assert code == 0 and first == pytest.approx(0.5 - bias.share(0.5)) and "charged" not in err


def test_shell_runs_statements_and_backslash_commands(policy):
    from dpsql import shell
    from dpsql.service.opening import open_session

    lines = iter(
        [
            "\\d",
            "\\d visits",
            "SELECT COUNT(*)",
            "  AS n FROM visits;  SHOW epsilon;",
            "SELECT nope FROM visits;",
            "SELECT 'a;b' AS s;",
            "\\?",
            "\\q",
            "never read",
        ]
    )

    def read(prompt: str) -> str:
        return next(lines)

    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(format="table", intervals=True)
    with open_session(policy, analyst="eve") as session:  # the shell's door over the service
        assert shell.run(session, args, read, out, err) == 0
    text = out.getvalue()
    assert "visits  patient_id" in text and "[0, 5000]" in text
    assert "n_low" in text and "(1 row)" in text and "a;b" in text and "\\q" in text
    assert "charged epsilon=1" in err.getvalue() and "[42703]" in err.getvalue()
    assert next(lines) == "never read"


def test_shell_keeps_a_history_file(policy, tmp_path, monkeypatch):
    readline = pytest.importorskip("readline")
    monkeypatch.setenv("DPSQL_HISTORY", str(tmp_path / "hist"))
    from dpsql import shell

    with shell._history(True):
        readline.add_history("SHOW budget;")
    assert "SHOW budget;" in (tmp_path / "hist").read_text()


def test_version_help_grammar_and_trust_note(capsys):
    import dpsql

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"dpsql {dpsql.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "`dpsql serve` authenticates" in text and "trust the caller" in text
    code, out, _ = run(capsys, "help", "grammar")
    assert code == 0 and out.startswith("# dpsql grammar notes")
    code, out, _ = run(capsys, "help")
    assert code == 0 and "grammar" in out
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    assert "whose budget to charge" not in capsys.readouterr().out


def test_a_closed_pipe_exits_quietly(policy):
    for _ in range(3):
        assert main(["query", "--policy", policy, "SELECT COUNT(*) FROM visits"]) in (0, 1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpsql", "budget", "log", "--policy", policy, "--limit", "100"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # like head -1
    code = proc.wait(timeout=120)
    assert proc.stderr.read() == b"" and code in (0, 141)


def test_numbers_read_the_same_everywhere():
    from dpsql.tables import number, tidy

    assert number(5797590.3) == "5797590" and number(2747) == "2747"
    assert number(0.1 + 0.2) == "0.3" and number(1e-6) == "1e-06" and number(3.0) == "3"
    assert number(123.456789) == "123.457" and number(float("inf")) == "inf"
    assert tidy(5420280.2700000005) == 5420280.27 and tidy("x") == "x"
