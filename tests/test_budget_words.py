"""Budget words: one ε view and one ρ in ``SHOW budget`` (``SHOW budget WIDE`` for every
figure), refusals that name the limit a query would break and by how much, ``plot budget``
against the limit in force at each charge, and no raw Python warning text in the CLI."""

from __future__ import annotations

import itertools
import re
import types
import warnings
from pathlib import Path

import pytest
from conftest import FIXTURE_CSV

import dpsql
from dpsql.cli import main, show_warning
from dpsql.errors import BudgetExhaustedError, BudgetWarning
from dpsql.plots import budget_timeline
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger import EphemeralBudgetWarning, MemoryLedger
from dpsql.privacy.sqlite_ledger import SQLiteLedger

NARROW = [
    "analyst",
    "spent_epsilon",
    "budget_epsilon",
    "remaining_epsilon",
    "spent_delta",
    "budget_delta",
    "remaining_delta",
    "spent_rho",
    "queries_left",
    "binding_limit",
    "period",
]
WIDE = [
    *NARROW,
    "unspent_epsilon",
    "unspent_delta",
    "rho_cap",
    "charged_epsilon",
    "charged_delta",
    "gaussian_rho",
]


def _policy(tmp_path: Path, budget_delta: float) -> Path:
    """A policy of its own dataset (so the in-memory ledger is new, and warns once)."""
    path = tmp_path / "policy.toml"
    path.write_text(
        "[privacy]\nepsilon = 1.0\ndelta = 1e-6\nbudget_epsilon = 3.0\n"
        f'budget_delta = {budget_delta}\nmechanism = "laplace"\ndataset = "{tmp_path.name}"\n'
        f'[tables.visits]\nsource = "{FIXTURE_CSV}"\nprivacy_unit = "patient_id"\n'
        "max_rows_per_unit = 5\n"
        '[tables.visits.columns.patient_id]\ntype = "int"\nnullable = false\n'
        '[tables.visits.columns.age]\ntype = "int"\nlower = 0\nupper = 100\nnullable = false\n'
    )
    return path


def _row(cur: dpsql.Cursor, sql: str) -> dict:
    cur.execute(sql)
    return dict(zip([d[0] for d in cur.description], cur.fetchone(), strict=True))


# -- SHOW budget ------------------------------------------------------------------------------


def test_show_budget_has_one_epsilon_view_and_one_rho(tmp_path: Path) -> None:
    policy = _policy(tmp_path, 1e-5)
    with dpsql.connect(policy=policy, ledger=MemoryLedger(), cache=False) as conn:
        cur = conn.cursor()
        cur.execute("SET bias_estimate = off")  # one measure per query: its ρ is ε²/2
        for cutoff in (20, 40):
            cur.execute(f"SELECT COUNT(*) FROM visits WHERE age > {cutoff}")
        narrow = _row(cur, "SHOW budget")
        assert list(narrow) == NARROW and [d[0] for d in conn.describe("SHOW budget")] == NARROW
        wide = _row(cur, "SHOW budget WIDE")
        assert list(wide) == WIDE and [d[0] for d in conn.describe("SHOW budget wide")] == WIDE
        assert list(_row(cur, "SHOW budget_wide")) == WIDE
    budget, spent = Budget(3.0, 1e-5), Cost(1.0) + Cost(1.0)
    assert {k: wide[k] for k in NARROW} == narrow  # the wide form only adds columns
    # the ε and δ the filter converts the spending to, and the one ρ it compares with its cap
    assert (narrow["spent_epsilon"], narrow["spent_delta"]) == budget.guarantee(spent) == (2, 0)
    assert narrow["spent_rho"] == pytest.approx(2 * 1.0**2 / 2)
    assert narrow["remaining_epsilon"] == pytest.approx(1.0) and narrow["queries_left"] == 1
    assert wide["rho_cap"] == budget.rho and wide["gaussian_rho"] == 0
    assert (wide["charged_epsilon"], wide["charged_delta"]) == (2.0, 0.0)
    assert wide["unspent_epsilon"] == pytest.approx(1.0)


def test_show_budget_wide_is_a_setting_word_not_any_third_word(tmp_path: Path) -> None:
    with (
        dpsql.connect(policy=_policy(tmp_path, 0.0), ledger=MemoryLedger()) as conn,
        pytest.raises(dpsql.ProgrammingError, match="takes one setting name"),
    ):
        conn.cursor().execute("SHOW budget narrow")


# -- refusals: which limit, by how much ---------------------------------------------------------


def _refusal(budget: Budget, *charges: Cost) -> str:
    ledger = MemoryLedger()
    *before, last = charges
    for cost in before:
        ledger.charge("alice", "ds", cost, budget, query_text="q", plan_hash="h")
    with pytest.raises(BudgetExhaustedError) as info:
        ledger.charge("alice", "ds", last, budget, query_text="q", plan_hash="h")
    with pytest.raises(BudgetExhaustedError) as checked:
        ledger.check("alice", "ds", last, budget)
    assert checked.value.message == info.value.message  # check and charge say the same
    return info.value.message


def test_a_first_query_larger_than_the_whole_pure_budget() -> None:
    assert _refusal(Budget(10.0, 0.0), Cost(20.0)) == (
        "the query does not fit the whole privacy budget of analyst 'alice': this query's "
        "ε 20 is more than the whole budget ε 10; the query needs epsilon=20, delta=0, rho=0; "
        "remaining epsilon=10, delta=0"
    )


def test_a_first_query_larger_than_the_whole_zcdp_budget() -> None:
    budget = Budget(10.0, 1e-5)
    assert f"{budget.rho:.6g}" == "1.53928"
    assert _refusal(budget, Cost(20.0)) == (
        "the query does not fit the whole privacy budget of analyst 'alice': this query's "
        "ε 20 is more than the whole budget ε 10 (δ 1e-05); as zCDP: the cap ρ 1.53928, "
        "this query ρ 200; the query needs epsilon=20, delta=0, rho=0; "
        "remaining epsilon=10, delta=9e-06"
    )  # never "the zCDP budget is spent": nothing is


def test_a_spent_pure_budget_says_how_much_more_the_query_needs() -> None:
    assert _refusal(Budget(10.0, 0.0), Cost(9.8), Cost(0.5)) == (
        "privacy budget exhausted for analyst 'alice': spent ε 9.8 of 10; this query needs "
        "ε 0.5, 0.3 more than the 0.2 left; the query needs epsilon=0.5, delta=0, rho=0; "
        "remaining epsilon=0.2, delta=0"
    )


def test_a_spent_zcdp_budget_says_how_much_more_the_query_needs() -> None:
    budget = Budget(10.0, 1e-5)
    # pure route: the spent 9.8 is one large release, so the zCDP route is long closed
    assert _refusal(budget, Cost(9.8), Cost(0.5)) == (
        "privacy budget exhausted for analyst 'alice': spent ε 9.8 of 10 (δ 1e-05); this "
        "query needs ε 0.5, 0.3 more than the 0.2 left; as zCDP: spent ρ 48.02 of the cap "
        "ρ 1.53928, this query ρ 0.125; the query needs epsilon=0.5, delta=0, rho=0; "
        "remaining epsilon=0.2, delta=9e-06"
    )
    # Gaussian spending: only the zCDP filter, its room counted as one pure-ε release
    spent, cost = Cost(rho=1.5), Cost(rho=0.125)
    assert budget.remaining(spent)[0] == pytest.approx((2 * (budget.rho - 1.5)) ** 0.5)
    assert _refusal(budget, spent, cost) == (
        "privacy budget exhausted for analyst 'alice': spent ε 9.84823 of 10 (δ 1e-05); this "
        "query needs ε 0.5, 0.219719 more than the 0.280281 left; as zCDP: spent ρ 1.5 of the "
        "cap ρ 1.53928, this query ρ 0.125; the query needs epsilon=0, delta=0, rho=0.125; "
        "remaining epsilon=0.280281, delta=9e-06"
    )


def test_the_delta_share_for_private_keys_says_its_own_figures() -> None:
    budget = Budget(1.0, 1e-6)
    assert _refusal(budget, Cost(0.1, 8e-7), Cost(0.1, 2e-7)) == (
        "privacy budget exhausted for analyst 'alice': spent δ 8e-07 of the δ for non-public "
        "group keys, 9e-07 of the budget δ 1e-06; this query needs δ 2e-07, 1e-07 more than "
        "the 1e-07 left; the query needs epsilon=0.1, delta=2e-07, rho=0; "
        "remaining epsilon=0.9, delta=1e-07"
    )
    assert _refusal(budget, Cost(0.1, 2e-6)) == (
        "the query does not fit the whole privacy budget of analyst 'alice': this query's "
        "δ 2e-06 is more than all of the δ for non-public group keys, 9e-07 of the budget "
        "δ 1e-06; the query needs epsilon=0.1, delta=2e-06, rho=0; "
        "remaining epsilon=1, delta=9e-07"
    )


def test_gaussian_noise_on_a_pure_budget_keeps_its_fix() -> None:
    message = _refusal(Budget(1.0, 0.0), Cost(rho=0.1))
    assert message.startswith(
        "the query does not fit the whole privacy budget of analyst 'alice': a budget with "
        "delta = 0 admits no Gaussian noise (set budget_delta > 0 in [privacy], or SET "
        "mechanism = 'laplace')"
    )


def test_the_pipeline_refuses_with_the_same_words(tmp_path: Path) -> None:
    with dpsql.connect(policy=_policy(tmp_path, 0.0), ledger=MemoryLedger()) as conn:
        cur = conn.cursor()
        cur.execute("SET epsilon = 5")
        with pytest.raises(BudgetExhaustedError) as info:
            cur.execute("SELECT COUNT(*) FROM visits")
        assert "this query's ε 5 is more than the whole budget ε 3;" in info.value.message
        cur.execute("SET epsilon = 2.5")
        cur.execute("SELECT COUNT(*) FROM visits")
        cur.execute("SET epsilon = 1")
        with pytest.raises(BudgetExhaustedError) as info:
            cur.execute("SELECT COUNT(*) FROM visits WHERE age > 30")
        assert "spent ε 2.5 of 3; this query needs ε 1, 0.5 more than the 0.5 left;" in (
            info.value.message
        )


# -- plot budget: the limit in force at each charge -------------------------------------------


def test_plot_budget_uses_the_limit_in_force_at_each_charge(tmp_path: Path) -> None:
    policy = types.SimpleNamespace(dataset="ds", budget=Budget(10.0, 0.0))
    with SQLiteLedger(tmp_path / "ledger.sqlite") as ledger:

        def charge(analyst: str, eps: float) -> None:
            ledger.charge(analyst, "ds", Cost(eps), policy.budget, query_text="q", plan_hash="h")

        charge("alice", 1.0)
        ledger.set_budget("alice", "ds", Budget(5.0, 0.0), actor="curator")
        charge("alice", 1.0)
        ledger.reset("alice", "ds", actor="curator")
        ledger.set_budget("alice", "ds", Budget(20.0, 0.0), actor="curator")
        charge("alice", 2.0)
        ledger.set_budget("bob", "ds", Budget(3.0, 0.0), actor="curator")
        ledger.set_budget("bob", "ds", Budget(4.0, 0.0), actor="curator")
        charge("bob", 0.5)
        timeline = budget_timeline(policy, ledger)
        times = {e.id: e.at for e in ledger.entries("ds")}
    assert timeline.analysts == ("alice", "bob")
    assert timeline.spent == ((1.0, 2.0, 0.0, 2.0), (0.5,))
    # each charge (and the reset) against the limit of its time, not today's 20 and 4
    assert timeline.limits == ((10.0, 5.0, 5.0, 20.0), (4.0,))
    assert timeline.budgets == (20.0, 4.0)
    (alice, bob) = timeline.steps
    assert [limit for _, limit in alice] == [10.0, 5.0, 20.0, 20.0]
    assert [limit for _, limit in bob] == [10.0, 3.0, 4.0, 4.0]  # from the policy default
    assert alice[0][0] == timeline.times[0][0] and alice[-1][0] == timeline.times[0][-1]
    assert len(times) == 9 and all(a <= b for a, b in itertools.pairwise(alice))


def test_plot_budget_on_a_ledger_with_no_changes_keeps_one_limit(tmp_path: Path) -> None:
    policy = types.SimpleNamespace(dataset="ds", budget=Budget(10.0, 1e-6))
    with SQLiteLedger(tmp_path / "ledger.sqlite") as ledger:
        for _ in range(3):
            ledger.charge("a", "ds", Cost(0.5), policy.budget, query_text="q", plan_hash="h")
        timeline = budget_timeline(policy, ledger)
    assert timeline.spent == ((0.5, 1.0, 1.5),) and timeline.limits == ((10.0, 10.0, 10.0),)
    assert [limit for _, limit in timeline.steps[0]] == [10.0, 10.0]


# -- the CLI's own warning lines ----------------------------------------------------------------


def test_cli_prints_its_own_warning_lines_and_no_python_warning_text(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    from dpsql import commands

    connect = commands._connect

    def connect_and_warn(args):  # any other warning a command meets: one line of its own
        warnings.warn("the budget is kept\n  in memory", EphemeralBudgetWarning, stacklevel=1)
        return connect(args)

    monkeypatch.setattr(commands, "_connect", connect_and_warn)
    policy = str(_policy(tmp_path, 1e-5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(
            [
                "query",
                "--policy",
                policy,
                "--epsilon",
                "2.8",
                "--bias-estimate",  # its note's figures are noisy: these lines are exact
                "off",
                "SELECT COUNT(*) FROM visits",
            ]
        )
    err = capsys.readouterr().err
    assert code == 0 and caught == []  # nothing reached Python's warning display
    assert err.splitlines() == [
        "warning: the budget is kept in memory",
        "-- charged epsilon=2.8 delta=0 rho=0 to 'default'; remaining epsilon=0.2 of 3, "
        "delta=9e-06 of 1e-05",
        "-- warning: less than 10% of the privacy budget remains: remaining epsilon=0.2 of 3, "
        "delta=9e-06 of 1e-05",
    ]
    assert "BudgetWarning" not in err and ".py:" not in err


def test_show_warning_is_one_line_and_skips_the_budget_warning(capsys) -> None:
    show_warning(EphemeralBudgetWarning("kept\n  in memory"), EphemeralBudgetWarning, "f.py", 3)
    show_warning(BudgetWarning("low"), BudgetWarning, "f.py", 4)
    assert capsys.readouterr().err == "warning: kept in memory\n"


def test_the_curator_page_draws_the_limit_in_force_too(tmp_path: Path) -> None:
    from dpsql.admin.page import budget_svg

    policy = types.SimpleNamespace(dataset="ds", budget=Budget(10.0, 0.0))
    with SQLiteLedger(tmp_path / "ledger.sqlite") as ledger:
        ledger.charge("a", "ds", Cost(1.0), policy.budget, query_text="q", plan_hash="h")
        ledger.set_budget("a", "ds", Budget(5.0, 0.0), actor="curator")
        ledger.charge("a", "ds", Cost(1.0), policy.budget, query_text="q", plan_hash="h")
        svg = budget_svg(budget_timeline(policy, ledger))
    (dashed,) = re.findall(r"<path d='([^']*)' fill='none' stroke='[^']*' stroke-dasharray", svg)
    heights = [float(v) for v in re.findall(r"(?:^M[\d.]+,|V)([\d.]+)", dashed)]
    assert heights[0] < heights[1]  # 10 then 5: a step down at the change, in SVG's y
