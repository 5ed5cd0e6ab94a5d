"""Budgets that reconnecting cannot reset: dict policies share one ledger per process."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import dpsql
from dpsql.privacy.accounting import Cost
from dpsql.privacy.ledger import MemoryLedger

QUERY = "SELECT COUNT(*) AS n FROM t"


def policy(tmp_path: Path, name: str = "t.csv", **privacy) -> dict:
    path = tmp_path / name
    if not path.exists():
        path.write_text("x\n" + "".join(f"{i % 5}\n" for i in range(40)), encoding="utf-8")
    base = {"epsilon": 0.5, "budget_epsilon": 1.0, "budget_delta": 1e-6, **privacy}
    return {
        "privacy": base,
        "tables": {"t": {"source": str(path), "columns": {"x": {"type": "int"}}}},
    }


def quiet_connect(*args, **kwargs) -> dpsql.Connection:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpsql.EphemeralBudgetWarning)
        return dpsql.connect(*args, **kwargs)


def spent(conn: dpsql.Connection) -> Cost:
    return conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)


def test_reconnecting_with_the_same_dict_policy_keeps_the_budget(tmp_path: Path) -> None:
    with quiet_connect(policy=policy(tmp_path)) as first:
        cur = first.cursor()
        cur.execute("SET epsilon = 1.0")
        cur.execute(QUERY)  # the whole budget
    with quiet_connect(policy=policy(tmp_path)) as second:
        assert spent(second) == Cost(1.0)
        with pytest.raises(dpsql.BudgetExhaustedError):
            second.cursor().execute("SELECT COUNT(*) FROM t WHERE x > 1")


def test_a_repeated_query_on_a_new_connection_replays_the_cached_answer(tmp_path: Path) -> None:
    with quiet_connect(policy=policy(tmp_path)) as first:
        rows = first.cursor().execute(QUERY).fetchall()
    with quiet_connect(policy=policy(tmp_path)) as second:
        cur = second.cursor().execute(QUERY)
        assert cur.fetchall() == rows
        assert cur.cached and cur.cost is None
        assert spent(second) == Cost(0.5)


def test_other_settings_over_the_same_data_share_the_budget(tmp_path: Path) -> None:
    with quiet_connect(policy=policy(tmp_path)) as first:
        first.cursor().execute(QUERY)
    reworded = policy(tmp_path, epsilon=0.25, budget_epsilon=2.0)  # not a fresh budget
    with quiet_connect(policy=reworded) as second:
        assert spent(second) == Cost(0.5)
    with quiet_connect(policy=policy(tmp_path, name="other.csv")) as third:
        assert spent(third).is_zero  # other data: its own budget
    with quiet_connect(policy=policy(tmp_path), analyst="bob") as bob:
        assert spent(bob).is_zero  # budgets stay per analyst


def test_an_in_memory_budget_warns_once_per_process_and_policy(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dpsql.connect(policy=policy(tmp_path)).close()
        dpsql.connect(policy=policy(tmp_path)).close()
        dpsql.connect(policy=policy(tmp_path), ledger=MemoryLedger()).close()  # caller's choice
        dpsql.connect(policy=policy(tmp_path), ledger=tmp_path / "l.sqlite").close()  # durable
    ours = [w for w in caught if issubclass(w.category, dpsql.EphemeralBudgetWarning)]
    assert len(ours) == 1
    (warning,) = ours
    assert warning.filename == __file__  # points at the caller's connect
    text = str(warning.message)
    assert "only as long as this process" in text and "ledger" in text


def test_a_policy_file_names_a_durable_ledger_and_does_not_warn(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("x\n1\n2\n", encoding="utf-8")
    toml = tmp_path / "p.toml"
    toml.write_text(
        '[privacy]\nbudget_epsilon = 1.0\n[tables.t]\nsource = "t.csv"\n'
        '[tables.t.columns.x]\ntype = "int"\n',
        encoding="utf-8",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", dpsql.EphemeralBudgetWarning)
        with dpsql.connect(policy=str(toml)) as conn:
            conn.cursor().execute(QUERY)
    assert (tmp_path / "p.ledger.sqlite").exists()


def test_ledger_path_keeps_the_budget_and_answers_across_processes(tmp_path: Path) -> None:
    ledger = tmp_path / "budget.ledger.sqlite"
    pol = policy(tmp_path)
    code = (
        "import sys, json, dpsql\n"
        "pol = json.loads(sys.argv[1])\n"
        "with dpsql.connect(policy=pol, ledger=sys.argv[2]) as conn:\n"
        f"    print(json.dumps(conn.cursor().execute({QUERY!r}).fetchall()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code, json.dumps(pol), str(ledger)],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [tuple(r) for r in json.loads(proc.stdout)]
    with dpsql.connect(policy=pol, ledger=str(ledger)) as conn:
        assert spent(conn) == Cost(0.5)
        cur = conn.cursor().execute(QUERY)
        assert cur.cached and cur.fetchall() == rows
        cur.execute("SELECT COUNT(*) FROM t WHERE x > 0")  # the other half of the budget
        with pytest.raises(dpsql.BudgetExhaustedError):
            cur.execute("SELECT COUNT(*) FROM t WHERE x > 1")
    assert ledger.stat().st_mode & 0o777 == 0o600
