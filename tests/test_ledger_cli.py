"""``dpsql budget``: show, set, reset, log, verify, through dpsql.cli.main."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from dpsql.cli import main
from dpsql.policy import load_policy
from dpsql.privacy.accounting import Budget, Cost, zcdp_epsilon
from dpsql.privacy.sqlite_ledger import SQLiteLedger

POLICY = """\
[privacy]
epsilon = 1.0
delta = 1e-6
budget_epsilon = 2.0
budget_delta = 1e-5
dataset = "visits"
ledger = "state/budget.sqlite"

[tables.visits]
source = "visits.csv"
privacy_unit = "pid"

[tables.visits.columns.pid]
type = "int"

[tables.visits.columns.age]
type = "int"
lower = 0
upper = 100
"""


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    (tmp_path / "visits.csv").write_text("pid,age\n1,30\n2,40\n", encoding="utf-8")
    (tmp_path / "state").mkdir()
    path = tmp_path / "policy.toml"
    path.write_text(POLICY, encoding="utf-8")
    return path


def ledger_of(policy: Path) -> SQLiteLedger:
    loaded = load_policy(policy)
    assert loaded.ledger_path == (policy.parent / "state" / "budget.sqlite").resolve()
    return SQLiteLedger(loaded.ledger_path)


def spend(policy: Path, analyst: str, cost: Cost, query: str = "SELECT COUNT(*) FROM visits"):
    with ledger_of(policy) as led:
        led.charge(
            analyst,
            "visits",
            cost,
            Budget(2.0, 1e-5, 0.5 if cost.rho else 0.0),
            query_text=query,
            plan_hash="f00d",
        )


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_show_before_anything_was_charged_creates_no_file(policy: Path, capsys) -> None:
    code, out, _ = run(capsys, "budget", "--policy", str(policy))
    assert code == 0
    assert "no analyst has been charged" in out and "epsilon=2 delta=1e-05" in out
    assert not (policy.parent / "state" / "budget.sqlite").exists()


def test_show_lists_spent_and_remaining_per_analyst(policy: Path, capsys) -> None:
    spend(policy, "alice", Cost(0.5, 1e-7))
    spend(policy, "alice", Cost(0.25))
    spend(policy, "bob", Cost(rho=0.01))
    code, out, _ = run(capsys, "budget", "--policy", str(policy))
    assert code == 0
    lines = out.splitlines()
    header = lines[1].split()
    assert header[:2] == ["analyst", "charges"]
    alice = next(line.split() for line in lines if line.startswith("alice"))
    assert alice[:4] == ["alice", "2", "0.75", "1e-07"]
    assert alice[-2:] == ["1.25", "8.9e-06"]  # remaining epsilon, delta (9/10 of it)
    bob = next(line.split() for line in lines if line.startswith("bob"))
    assert bob[4] == "0.01"  # rho
    # the tight zCDP conversion at the tenth of delta reserved for it
    assert float(bob[5]) == pytest.approx(zcdp_epsilon(0.01, 1e-6))
    assert float(bob[5]) < 0.01 + 2 * (0.01 * 13.815510557964274) ** 0.5


def test_show_one_analyst_as_json(policy: Path, capsys) -> None:
    spend(policy, "alice", Cost(0.5))
    code, out, _ = run(capsys, "budget", "--policy", str(policy), "--analyst", "carol", "--json")
    assert code == 0
    (carol,) = json.loads(out)
    assert carol["analyst"] == "carol" and carol["charges"] == 0
    assert carol["remaining"] == {"epsilon": 2.0, "delta": pytest.approx(9e-6)}
    code, out, _ = run(capsys, "budget", "--policy", str(policy), "--analyst", "alice", "--json")
    (alice,) = json.loads(out)
    assert alice["spent"]["epsilon"] == 0.5 and alice["spent_as_epsilon"] == 0.5
    assert alice["remaining"]["epsilon"] == 1.5 and alice["budget_overridden"] is False


def test_set_raises_and_lowers_a_budget(policy: Path, capsys) -> None:
    spend(policy, "alice", Cost(1.5))
    code, out, _ = run(
        capsys, "budget", "set", "--policy", str(policy), "--analyst", "alice", "--epsilon", "5"
    )
    assert code == 0
    assert "set to epsilon=5 delta=1e-05" in out and "remaining epsilon=3.5" in out
    with ledger_of(policy) as led:
        assert led.budget("alice", "visits", Budget(2.0, 1e-5)) == Budget(5.0, 1e-5)
        assert led.budget("bob", "visits", Budget(2.0, 1e-5)) == Budget(2.0, 1e-5)
    code, out, _ = run(capsys, "budget", "--policy", str(policy))
    assert "5*" in out and "set by an administrator" in out
    # The parent's --policy works too, and lowering below the spending leaves nothing.
    code, out, _ = run(
        capsys, "budget", "--policy", str(policy), "set", "--analyst", "alice",
        "--epsilon", "1", "--delta", "0",
    )  # fmt: skip
    assert code == 0 and "remaining epsilon=0 delta=0" in out


def test_set_refuses_invalid_values(policy: Path, capsys) -> None:
    code, _, err = run(
        capsys, "budget", "set", "--policy", str(policy), "--analyst", "a", "--epsilon", "-1"
    )
    assert code == 2 and "--epsilon > 0" in err


def test_reset_is_logged_and_releases_the_spending(policy: Path, capsys) -> None:
    spend(policy, "alice", Cost(0.75, 1e-7))
    code, out, _ = run(capsys, "budget", "reset", "--policy", str(policy), "--analyst", "alice")
    assert code == 0 and "released epsilon=0.75 delta=1e-07" in out
    with ledger_of(policy) as led:
        assert led.spent("alice", "visits") == Cost()
        assert [e.kind for e in led.entries()] == ["charge", "reset"]


def test_log_shows_recent_rows_oldest_first(policy: Path, capsys) -> None:
    for i in range(4):
        spend(policy, "alice", Cost(0.125), query=f"SELECT COUNT(*)\n  FROM visits -- {i}")
    spend(policy, "bob", Cost(0.125), query="SELECT AVG(age) FROM visits")
    code, out, _ = run(capsys, "budget", "log", "--policy", str(policy), "--limit", "3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["id", "time", "(UTC)"]
    assert len(lines) == 4
    assert "SELECT COUNT(*) FROM visits -- 2" in lines[1]  # one line per query
    assert "bob" in lines[3] and "f00d" in lines[3]
    code, out, _ = run(
        capsys, "budget", "log", "--policy", str(policy), "--analyst", "bob", "--json"
    )
    (row,) = json.loads(out)
    assert row["query_text"] == "SELECT AVG(age) FROM visits" and row["kind"] == "charge"


def test_log_of_a_new_ledger_is_empty(policy: Path, capsys) -> None:
    code, out, _ = run(capsys, "budget", "log", "--policy", str(policy))
    assert code == 0 and "is empty" in out


def test_verify_reports_consistency_and_tampering(policy: Path, capsys) -> None:
    spend(policy, "alice", Cost(0.5))
    code, out, _ = run(capsys, "budget", "verify", "--policy", str(policy))
    assert code == 0 and "is consistent" in out
    conn = sqlite3.connect(load_policy(policy).ledger_path)
    conn.execute("UPDATE totals SET epsilon = 0")
    conn.commit()
    conn.close()
    code, out, _ = run(capsys, "budget", "verify", "--policy", str(policy))
    assert code == 1 and "log sum" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["budget"],
        ["budget", "log"],
        ["budget", "reset", "--analyst", "a"],
    ],
)
def test_missing_policy_is_a_usage_error(capsys, argv) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and "--policy is required" in err


def test_admin_commands_need_an_analyst(policy: Path, capsys) -> None:
    code, _, err = run(capsys, "budget", "reset", "--policy", str(policy))
    assert code == 2 and "--analyst is required" in err


def test_bad_policy_is_reported_not_raised(tmp_path: Path, capsys) -> None:
    code, _, err = run(capsys, "budget", "--policy", str(tmp_path / "missing.toml"))
    assert code == 1 and "cannot read policy file" in err


@pytest.mark.parametrize("sub", [[], ["set"], ["reset"], ["log"], ["verify"]])
def test_help_everywhere(capsys, sub) -> None:
    with pytest.raises(SystemExit) as info:
        main(["budget", *sub, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--policy" in out
    if sub in (["set"], ["reset"]):
        assert "service account" in out  # the administrator boundary is documented
