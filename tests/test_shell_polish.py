"""Terminal polish from libraries: the shell's prompt_toolkit completion (driven through its
pipe input, respecting access rules), \\x expanded rows, tables fitted to the terminal's width
(rich), and progress on `dpsql prepare` (a bar in a terminal, one line per step otherwise)."""

from __future__ import annotations

import argparse
import io
import re
import threading
from pathlib import Path

import pytest
from conftest import FIXTURE_TOML

from dpsql import cli, shell
from dpsql.service.opening import open_session
from dpsql.terminal import render_expanded, render_fit, step_progress

pt_input = pytest.importorskip("prompt_toolkit.input")
from prompt_toolkit.completion import CompleteEvent  # noqa: E402
from prompt_toolkit.document import Document  # noqa: E402
from prompt_toolkit.output import DummyOutput  # noqa: E402


@pytest.fixture
def conn():
    """The shell's door: eve's session over a service of its own (dpsql.service.opening)."""
    with open_session(str(FIXTURE_TOML), analyst="eve") as session:
        yield session


def _completions(conn, text: str) -> list[str]:
    completer = shell.completer(conn)
    return [c.text for c in completer.get_completions(Document(text), CompleteEvent())]


def test_completion_of_tables_columns_and_functions(conn):
    assert "visits" in _completions(conn, "SELECT COUNT(*) FROM vi")
    assert "department" in _completions(conn, "SELECT depa")
    assert "COUNT" in _completions(conn, "SELECT cou")
    assert "dp_interval_low" in _completions(conn, "SELECT dp_inter")
    assert "cost" in _completions(conn, "SELECT visits.co")
    assert _completions(conn, "SELECT visits.zz") == []


def test_tab_completes_through_prompt_toolkit(conn, tmp_path, monkeypatch):
    monkeypatch.setenv("DPSQL_HISTORY", str(tmp_path / "hist"))
    with pt_input.create_pipe_input() as pipe:
        read = shell.prompt_reader(conn, input=pipe, output=DummyOutput())
        # Tab completes the one column starting so; completion runs as a task: let it finish
        pipe.send_text("SELECT COUNT(*) FROM visits WHERE depa\t")
        threading.Timer(0.5, pipe.send_text, [";\r"]).start()
        assert read("dpsql> ") == "SELECT COUNT(*) FROM visits WHERE department;"
        pipe.send_text("\x04")  # Ctrl-D on an empty line
        with pytest.raises(EOFError):
            read("dpsql> ")
    assert "FROM visits WHERE department;" in (tmp_path / "hist").read_text()


def test_history_lives_in_the_user_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("DPSQL_HISTORY", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert shell.history_path() == tmp_path / "dpsql" / "shell_history"


def test_completion_respects_access_rules(tmp_path):
    text = Path(FIXTURE_TOML).read_text()
    text = text.replace(
        "[tables.visits.columns.cost]", '[tables.visits.columns.cost]\ndeny = ["eve"]', 1
    )
    policy = tmp_path / "visits.toml"
    policy.write_text(text)
    (tmp_path / "visits.csv").symlink_to(Path(FIXTURE_TOML).parent / "visits.csv")
    with open_session(str(policy), analyst="eve") as eve:
        assert "cost" not in _completions(eve, "SELECT co")
        assert "cost" not in _completions(eve, "SELECT visits.co")
    with open_session(str(policy), analyst="bob") as bob:
        assert "cost" in _completions(bob, "SELECT co")


def test_expanded_rows_toggle_in_the_shell(conn):
    lines = iter(["\\x", "SELECT department, COUNT(*) AS n FROM visits GROUP BY department;"])

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(format="table", intervals=False)
    assert shell.run(conn, args, read, out, err) == 0
    text = out.getvalue()
    assert "Expanded display is on." in text
    assert "-[ RECORD 1 ]" in text and re.search(r"^department \| \w+", text, re.M)
    assert "(6 rows)" in text


def test_expanded_rendering():
    out = io.StringIO()
    render_expanded(["a", "longer_name"], [(1, "x"), (2.5, None)], out, footer=True)
    assert out.getvalue().splitlines() == [
        "-[ RECORD 1 ]---",
        "a           | 1",
        "longer_name | x",
        "-[ RECORD 2 ]---",
        "a           | 2.5",
        "longer_name | NULL",
        "(2 rows)",
    ]


@pytest.mark.parametrize("width", [40, 60, 100])
def test_tables_fit_the_terminal_width(width):
    rows = [(i, "word " * 30, 1234.5678 * i, None) for i in range(4)]
    out = io.StringIO()
    render_fit(["id", "description", "value", "missing"], rows, out, footer=True, width=width)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width
    assert lines[-1] == "(4 rows)"
    assert "description" in lines[0] and "NULL" in out.getvalue() and "3703.7" in out.getvalue()


def test_a_narrow_table_is_not_stretched():
    out = io.StringIO()
    render_fit(["n"], [(3,)], out, width=120)
    assert max(len(line.rstrip()) for line in out.getvalue().splitlines()) < 10


def test_piped_output_keeps_the_plain_style(capsys):
    from dpsql.commands import print_rows

    print_rows(["a", "b"], [(1, "x")], "table", io.StringIO())  # not a terminal: plain
    out = io.StringIO()
    print_rows(["a", "b"], [(1, "x")], "table", out)
    assert out.getvalue() == "a  b\n1  x\n(1 row)\n"


def test_prepare_progress_lines_without_a_terminal():
    err = io.StringIO()
    with step_progress(err, ["t"], terminal=False) as progress:
        progress("t: building the prepared store in memory")
    assert re.fullmatch(
        r"\[\s+\d+\.\d s\] t: building the prepared store in memory\n", err.getvalue()
    )


def test_prepare_progress_bar_in_a_terminal():
    err = io.StringIO()
    with step_progress(err, ["a", "b"], terminal=True) as progress:
        progress("a: building")
        progress("b: building")
    text = err.getvalue()
    assert "a: building" in text and "b: building" in text
    assert "2/2" in text and "done" in text  # the bar ends complete


def test_dpsql_prepare_reports_progress(tmp_path, capsys):
    text = Path(FIXTURE_TOML).read_text()
    policy = tmp_path / "visits.toml"
    policy.write_text(text)
    (tmp_path / "visits.csv").symlink_to(Path(FIXTURE_TOML).parent / "visits.csv")
    assert cli.main(["prepare", "--policy", str(policy), "--memory"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"\[\s+\d+\.\d s\] visits: building the prepared store", captured.err)
    assert captured.out.startswith("visits\tbuilt\t")


def test_fit_progress_is_a_noop_off_a_terminal_and_counts_on_one(monkeypatch):
    """Regression fits (verbose=True) and benchmark grids report progress through
    terminal.fit_progress: nothing when stderr is not a terminal, one advance per step."""
    import io

    import rich.progress

    from dpsql.terminal import fit_progress

    with fit_progress(3, "DP-SGD", True) as advance:  # pytest's stderr is not a terminal
        advance()
    advanced = []
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    monkeypatch.setattr(rich.progress.Progress, "advance", lambda self, task: advanced.append(task))
    with fit_progress(3, "DP-SGD", True) as advance:
        for _ in range(3):
            advance()
    assert len(advanced) == 3
    with fit_progress(3, "DP-SGD", False) as advance:
        advance()
    assert len(advanced) == 3


def test_a_verbose_dpsgd_fit_advances_once_per_step(monkeypatch):
    import numpy as np

    from dpsql import terminal
    from dpsql.models.regression import DPLogisticRegression

    steps = []

    class Bar:
        def __init__(self, total, description, enabled):
            assert total == 7 and enabled

        def __enter__(self):
            return lambda: steps.append(1)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr("dpsql.models.regression.fit_progress", Bar)
    rng = np.random.default_rng(0)
    X = rng.random((200, 2))
    y = (X[:, 0] > 0.5).astype(int)
    model = DPLogisticRegression(
        epsilon=1.0,
        delta=1e-5,
        bounds=([0, 0], [1, 1]),
        steps=7,
        sample_rate=0.1,
        random_state=0,
        verbose=True,
    )
    model.fit(X, y)
    assert len(steps) == 7
    assert terminal.fit_progress is not Bar
