"""Budgets as a curator sets them ([budgets]): group budgets, a dataset-wide cap, renewal.

The same guarantees as the per-analyst filter (tests/test_ledger_concurrency.py): threads and
processes racing for the last ε of a group or of the dataset never overspend it, and the total
equals what the callers were told; a process killed at any point leaves every total equal to
the sum of its log. Renewal runs on an injected clock across a month boundary. The protocol
runs on both ledgers (MemoryLedger, SQLiteLedger).
"""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import random
import signal
import sqlite3
import threading
import time
import warnings
from pathlib import Path

import pytest

import dpsql
from dpsql.admin.page import Reader, render
from dpsql.errors import BudgetExhaustedError, PolicyError
from dpsql.policy import load_policy
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.budget_rules import BudgetRules, Group, PolicyBudget, period_of, rules_of
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.sqlite_ledger import SQLiteLedger

SPAWN = mp.get_context("spawn")
STEP = Cost(epsilon=2.0**-7)  # exact in binary: 64 steps are exactly 0.5
CAPACITY = 64


def rules_budget(
    *,
    own: float = 100.0,
    group: float | None = None,
    members: tuple[str, ...] = ("alice", "bob"),
    dataset: float | None = None,
    renew: str | None = None,
    dataset_renew: str | None = None,
) -> PolicyBudget:
    groups = () if group is None else (Group("clinicians", Budget(group, 0.0), frozenset(members)),)
    cap = None if dataset is None else Budget(dataset, 0.0)
    rules = BudgetRules(groups, cap, renew, dataset_renew)
    return PolicyBudget(own, 0.0, rules=rules)


class Clock:
    def __init__(self, at: dt.datetime) -> None:
        self.at = at

    def __call__(self) -> dt.datetime:
        return self.at


JAN = dt.datetime(2026, 1, 31, 23, 59, 59, tzinfo=dt.UTC)
FEB = dt.datetime(2026, 2, 1, 0, 0, 0, tzinfo=dt.UTC)


@pytest.fixture(params=["memory", "sqlite"])
def make(request, tmp_path: Path):
    opened: list[SQLiteLedger] = []

    def build(clock: Clock | None = None):
        if request.param == "memory":
            return MemoryLedger(clock=clock)
        led = SQLiteLedger(tmp_path / f"l{len(opened)}.sqlite", clock=clock)
        opened.append(led)
        return led

    yield build
    for led in opened:
        assert led.verify() == []
        led.close()


def charge(led, analyst: str, cost: Cost, default: Budget, text: str = "q") -> None:
    led.charge(analyst, "ds", cost, default, query_text=text, plan_hash=text)


# -- the policy ----------------------------------------------------------------------------------


def policy_dict(tmp_path: Path, budgets: dict, **extra) -> dict:
    path = tmp_path / "t.csv"
    path.write_text("x\n" + "".join(f"{i % 5}\n" for i in range(40)), encoding="utf-8")
    return {
        "privacy": {"epsilon": 0.5, "budget_epsilon": 3.0, "budget_delta": 1e-6},
        "access": {"roles": {"clinicians": ["alice", "bob"]}},
        "budgets": budgets,
        "tables": {"t": {"source": str(path), "columns": {"x": {"type": "int"}}}},
        **extra,
    }


def test_policy_reads_groups_by_role_or_members_the_dataset_cap_and_renewal(tmp_path) -> None:
    policy = load_policy(
        policy_dict(
            tmp_path,
            {
                "renew": "monthly",
                "groups": {
                    "clinicians": {"epsilon": 5},
                    "contractors": {"epsilon": 2, "delta": 0, "members": ["dave"]},
                },
                "dataset": {"epsilon": 50, "delta": 1e-5},
            },
        )
    )
    rules = rules_of(policy.budget)
    assert rules is not None and policy.budget.epsilon == 3.0
    by_name = {g.name: g for g in rules.groups}
    assert by_name["clinicians"].members == {"alice", "bob"}
    assert by_name["clinicians"].budget.epsilon == 5 and by_name["clinicians"].budget.delta == 1e-6
    assert by_name["contractors"].members == {"dave"} and by_name["contractors"].budget.delta == 0
    assert rules.dataset is not None and rules.dataset.epsilon == 50
    assert rules.renew == "monthly" and rules.dataset_renew is None  # the cap never renews
    assert [g.name for g in rules.groups_of("alice")] == ["clinicians"]
    # without [budgets] the default is a plain Budget, exactly as before
    plain = policy_dict(tmp_path, {})
    del plain["budgets"]
    assert type(load_policy(plain).budget) is Budget


@pytest.mark.parametrize(
    ("budgets", "key", "words"),
    [
        ({"groups": {"nurses": {"epsilon": 1}}}, "budgets.groups.nurses", "not a role"),
        ({"renew": "weekly"}, "budgets.renew", "unknown schedule"),
        ({"dataset": {"epsilon": 1, "renew": "daily"}}, "budgets.dataset.renew", "schedule"),
        ({"groups": {"c": {"epsilon": -1, "members": ["x"]}}}, "budgets.groups.c.epsilon", "> 0"),
        ({"groups": {"c": {"members": ["x"]}}}, "budgets.groups.c.epsilon", "missing"),
        ({"dataset": {"epsilon": 1, "delta": 1}}, "budgets.dataset.delta", "[0, 1)"),
        ({"grups": {}}, "budgets.grups", "unknown key"),
        (
            {"groups": {"clinicians": {"epsilon": 1, "members": ["x"]}}},
            "budgets.groups.clinicians.members",
            "also a role",
        ),
    ],
)
def test_policy_errors_name_the_key_and_the_fix(tmp_path, budgets, key, words) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(policy_dict(tmp_path, budgets))
    assert f"{key}:" in info.value.message and words in info.value.message
    assert info.value.hint


# -- enforcement, on both ledgers ------------------------------------------------------------------


def test_a_group_budget_caps_its_members_together(make) -> None:
    led = make()
    default = rules_budget(group=1.0)
    for who in ("alice", "bob", "alice", "bob"):
        charge(led, who, Cost(0.25), default)
    with pytest.raises(BudgetExhaustedError) as info:
        charge(led, "alice", Cost(0.5), default)
    assert info.value.message.startswith(
        "the group clinicians' budget would be exceeded: spent ε 1 of 1, this query ε 0.5"
    )
    charge(led, "carol", Cost(0.5), default)  # not a member: only her own budget applies
    assert led.spent("alice", "ds") == Cost(0.5)  # the refusal wrote nothing
    limits = led.limits("bob", "ds", default)
    assert [(s.label, s.spent) for s in limits] == [
        ("analyst", Cost(0.5)),
        ("group clinicians", Cost(1.0)),
    ]
    with pytest.raises(BudgetExhaustedError, match="group clinicians"):
        led.check("bob", "ds", Cost(2.0**-20), default)
    assert led.check("carol", "ds", Cost(1.0), default) is None


def test_the_dataset_cap_holds_across_every_analyst(make) -> None:
    led = make()
    default = rules_budget(own=1.0, dataset=1.5)
    charge(led, "alice", Cost(1.0), default)
    charge(led, "zoe", Cost(0.5), default)
    with pytest.raises(BudgetExhaustedError) as info:
        charge(led, "yann", Cost(0.125), default)
    assert "the dataset-wide budget would be exceeded: spent ε 1.5 of 1.5" in info.value.message
    # the analyst's own budget is checked first and keeps its message
    with pytest.raises(BudgetExhaustedError, match="privacy budget exhausted for analyst 'alice'"):
        charge(led, "alice", Cost(0.125), default)
    pools = led.pools("ds", default)
    assert [(p.label, p.spent, p.charges) for p in pools] == [("dataset", Cost(1.5), 2)]


def test_monthly_renewal_on_an_injected_clock(make) -> None:
    clock = Clock(JAN)
    led = make(clock)
    default = rules_budget(own=1.0, group=1.5, dataset=3.0, renew="monthly")
    charge(led, "alice", Cost(1.0), default)
    charge(led, "bob", Cost(0.5), default)
    with pytest.raises(BudgetExhaustedError, match="analyst 'alice'"):
        charge(led, "alice", Cost(0.25), default)
    with pytest.raises(BudgetExhaustedError, match=r"group clinicians.* in 2026-01"):
        charge(led, "bob", Cost(0.25), default)
    clock.at = FEB  # one second later: a new month
    assert led.standing("alice", "ds", default)[1] == Cost()  # reads as renewed, writes nothing
    charge(led, "alice", Cost(1.0), default)
    charge(led, "bob", Cost(0.5), default)
    # the dataset-wide cap did not renew: 3 in all, now used up
    with pytest.raises(BudgetExhaustedError, match="dataset-wide budget would be exceeded"):
        charge(led, "carol", Cost(0.25), default)
    limits = led.limits("alice", "ds", default)
    assert [(s.label, s.period, s.spent) for s in limits] == [
        ("analyst", "2026-02", Cost(1.0)),
        ("group clinicians", "2026-02", Cost(1.5)),
        ("dataset", "", Cost(3.0)),
    ]
    clock.at = JAN  # the clock going back never renews anything
    with pytest.raises(BudgetExhaustedError):
        charge(led, "alice", Cost(0.25), default)
    if isinstance(led, SQLiteLedger):
        renewals = [e for e in led.entries("ds", analyst="alice") if e.kind == "reset"]
        assert len(renewals) == 1 and "budget renewed: period 2026-02" in renewals[0].query_text
        assert renewals[0].cost == -Cost(1.0)
        assert [s.spent for s in led.analysts("ds", default) if s.analyst == "alice"] == [Cost(1.0)]


def test_a_dataset_cap_renews_only_when_the_curator_says_so(make) -> None:
    clock = Clock(JAN)
    led = make(clock)
    default = rules_budget(dataset=1.0, renew="monthly", dataset_renew="monthly")
    charge(led, "alice", Cost(1.0), default)
    clock.at = FEB
    charge(led, "bob", Cost(1.0), default)
    assert [(p.period, p.spent) for p in led.pools("ds", default)] == [("2026-02", Cost(1.0))]


def test_period_of_is_the_utc_calendar_month() -> None:
    later = dt.datetime(2026, 3, 1, 0, 30, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert period_of("monthly", later) == "2026-02"  # 22:30 UTC on 28 February
    assert period_of(None, later) == ""


# -- concurrency: threads and processes --------------------------------------------------------

THREADS, PROCESSES, ATTEMPTS = 8, 4, 12  # 144 attempts for 64 slots
MEMBERS = tuple(f"a{k}" for k in range(THREADS + PROCESSES))


def shared(kind: str) -> PolicyBudget:
    if kind == "group":
        return rules_budget(group=0.5, members=MEMBERS)
    return rules_budget(dataset=0.5)


def _attempts(ledger, who: str, default: Budget, start) -> int:
    start.wait(60)
    accepted = 0
    for i in range(ATTEMPTS):
        try:
            ledger.charge(
                who, "ds", STEP, default, query_text=f"{who} #{i}", plan_hash=who,
                cache_key=f"{who}/{i}", answer=f"[{i}]",
            )  # fmt: skip
        except BudgetExhaustedError:
            continue
        accepted += 1
    return accepted


def _process_worker(path: str, who: str, default: Budget, ready, start, results) -> None:
    ledger = SQLiteLedger(path)
    ready.put(who)
    results.put((who, _attempts(ledger, who, default, start)))
    ledger.close()


def _pool_total(path: Path, pool: str) -> tuple[str, int]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(
            "SELECT epsilon_exact, charges FROM pool_totals WHERE pool = ?", (pool,)
        ).fetchone()
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["group", "dataset"])
def test_threads_and_processes_never_overspend_a_shared_budget(tmp_path: Path, kind) -> None:
    path = tmp_path / "shared.ledger.sqlite"
    default = shared(kind)
    ready, results, start = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Event()
    procs = [
        SPAWN.Process(target=_process_worker, args=(str(path), who, default, ready, start, results))
        for who in MEMBERS[THREADS:]
    ]
    for p in procs:
        p.start()
    ledger = SQLiteLedger(path)
    accepted: dict[str, int] = {}
    lock = threading.Lock()

    def thread_worker(who: str) -> None:
        n = _attempts(ledger, who, default, start)
        with lock:
            accepted[who] = n

    threads = [threading.Thread(target=thread_worker, args=(w,)) for w in MEMBERS[:THREADS]]
    for t in threads:
        t.start()
    for _ in procs:
        ready.get(timeout=60)
    start.set()
    for t in threads:
        t.join(60)
    for _ in procs:
        who, n = results.get(timeout=60)
        accepted[who] = n
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(accepted) == len(MEMBERS)
    assert sum(accepted.values()) == CAPACITY  # the shared budget is used up exactly
    for who, n in accepted.items():  # each analyst's total is what they were told
        assert ledger.spent(who, "ds") == Cost(epsilon=n * STEP.epsilon)
    pool = "group:clinicians" if kind == "group" else "dataset"
    assert _pool_total(path, pool) == ("1/2", CAPACITY)
    [status] = [s for s in ledger.limits("a0", "ds", default) if s.kind == kind]
    assert (
        status.spent == Cost(0.5) and default.covers(Cost()) and status.budget.covers(status.spent)
    )
    assert ledger.verify() == []
    ledger.close()


def test_memory_ledger_threads_never_overspend_a_group() -> None:
    ledger = MemoryLedger()
    default = shared("group")
    start = threading.Event()
    accepted: dict[str, int] = {}

    def worker(who: str) -> None:
        accepted[who] = _attempts(ledger, who, default, start)

    threads = [threading.Thread(target=worker, args=(w,)) for w in MEMBERS]
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join(60)
    assert sum(accepted.values()) == CAPACITY
    [group] = ledger.pools("ds", default)
    assert group.spent == Cost(0.5) and group.charges == CAPACITY


# -- SIGKILL ---------------------------------------------------------------------------------

KILL_DEFAULT = rules_budget(group=1.0, members=("alice", "bob"), dataset=1.5)


def _charge_then_hang(path: str, stage: str | None, ready) -> None:
    def hang(at: str) -> None:
        if at == stage:
            ready.set()
            time.sleep(120)

    ledger = SQLiteLedger(path, fault_hook=hang)
    ledger.charge(
        "bob", "ds", Cost(0.25), KILL_DEFAULT, query_text="doomed", plan_hash="h",
        cache_key="doomed", answer="[1]",
    )  # fmt: skip
    ready.set()
    time.sleep(120)


@pytest.mark.parametrize("stage", ["logged", "written", None])
def test_sigkill_inside_or_after_a_shared_charge(tmp_path: Path, stage) -> None:
    path = tmp_path / "crash.ledger.sqlite"
    with SQLiteLedger(path) as led:
        charge(led, "alice", Cost(0.5), KILL_DEFAULT, "prior")
    ready = SPAWN.Event()
    child = SPAWN.Process(target=_charge_then_hang, args=(str(path), stage, ready))
    child.start()
    try:
        assert ready.wait(60)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(60)
    assert child.exitcode == -signal.SIGKILL
    committed = stage is None
    with SQLiteLedger(path, timeout=10) as led:
        assert led.verify() == []
        limits = led.limits("bob", "ds", KILL_DEFAULT)
        group, dataset = limits[1].spent, limits[2].spent
        extra = Cost(0.25) if committed else Cost()
        assert led.spent("bob", "ds") == extra
        assert group == dataset == Cost(0.5) + extra  # all three totals, or none
        assert (led.cached("bob", "ds", "doomed") == "[1]") is committed
        charge(led, "bob", Cost(0.25), KILL_DEFAULT, "after")  # the lock died with it
        assert led.verify() == []


def _charge_forever(path: str, who: str, ready) -> None:
    ledger = SQLiteLedger(path)
    ready.put(who)
    i = 0
    while True:
        try:
            ledger.charge(who, "ds", STEP, KILL_DEFAULT, query_text=f"{who} {i}", plan_hash=who)
        except BudgetExhaustedError:
            time.sleep(0.001)
        i += 1


def test_sigkill_at_random_points_never_overspends(tmp_path: Path) -> None:
    """Rounds of processes charging as fast as they can, each SIGKILLed at a random moment
    (inside a transaction, between them, anywhere): after every round the ledger verifies,
    every shared total equals the sum of its members' logged charges and fits its cap."""
    path = tmp_path / "kills.ledger.sqlite"
    SQLiteLedger(path).close()
    rng = random.Random(7)
    for _ in range(4):
        ready = SPAWN.Queue()
        procs = [
            SPAWN.Process(target=_charge_forever, args=(str(path), who, ready))
            for who in ("alice", "bob", "carol")
        ]
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=60)
        for p in procs:
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(60)
        with SQLiteLedger(path, timeout=10) as led:
            assert led.verify() == []
            logged: dict[str, Cost] = {}
            for e in led.entries("ds"):
                if e.kind == "charge":
                    logged[e.analyst] = logged.get(e.analyst, Cost()) + e.cost
            _, group, dataset = led.limits("alice", "ds", KILL_DEFAULT)
            members = logged.get("alice", Cost()) + logged.get("bob", Cost())
            assert group.spent == members and group.budget.covers(group.spent)
            assert dataset.spent == members + logged.get("carol", Cost())
            assert dataset.budget.covers(dataset.spent)
    with SQLiteLedger(path) as led:  # filled up after the kills: exactly the cap, no more
        while True:
            try:
                charge(led, "carol", STEP, KILL_DEFAULT, "fill")
            except BudgetExhaustedError:
                break
        assert led.limits("carol", "ds", KILL_DEFAULT)[-1].spent == Cost(1.5)
        assert led.verify() == []


# -- SHOW budget and the curator page --------------------------------------------------------------


def test_show_budget_names_the_binding_limit(tmp_path: Path) -> None:
    policy = policy_dict(
        tmp_path, {"groups": {"clinicians": {"epsilon": 1.0}}, "dataset": {"epsilon": 10}}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpsql.EphemeralBudgetWarning)
        conn = dpsql.connect(policy=policy, analyst="alice", ledger=MemoryLedger())
    with conn:
        cur = conn.cursor()

        def show() -> dict:
            cur.execute("SHOW budget")
            names = [d[0] for d in cur.description]
            return dict(zip(names, cur.fetchone(), strict=True))

        row = show()
        assert row["binding_limit"] == "group clinicians"  # 1 < 3 (own) < 10 (dataset)
        assert row["remaining_epsilon"] == 1.0 and row["budget_epsilon"] == 3.0
        assert row["queries_left"] == 2 and row["period"] is None
        cur.execute("SET epsilon = 0.75")
        cur.execute("SELECT COUNT(*) FROM t")
        row = show()
        assert row["binding_limit"] == "group clinicians"
        assert row["remaining_epsilon"] == pytest.approx(0.25) and row["queries_left"] == 0
        with pytest.raises(dpsql.BudgetExhaustedError, match="group clinicians' budget"):
            cur.execute("SELECT COUNT(*) FROM t WHERE x > 1")


def test_the_curator_page_shows_group_and_dataset_spend(tmp_path: Path) -> None:
    data = policy_dict(
        tmp_path,
        {"renew": "monthly", "groups": {"clinicians": {"epsilon": 5}}, "dataset": {"epsilon": 50}},
    )
    data["privacy"]["ledger"] = str(tmp_path / "page.ledger.sqlite")
    policy = load_policy(data)
    with SQLiteLedger(policy.ledger_path) as led:
        led.charge("alice", policy.dataset, Cost(1.5), policy.budget, query_text="q", plan_hash="h")
        led.charge("carol", policy.dataset, Cost(2.0), policy.budget, query_text="q", plan_hash="g")
    reader = Reader(policy)
    try:
        snap = reader.snapshot()
        page = render(snap)
    finally:
        reader.close()
    assert [(p.label, p.spent) for p in snap.pools] == [
        ("group clinicians", Cost(1.5)),
        ("dataset", Cost(3.5)),
    ]
    assert "Shared and renewing budgets" in page
    assert "<td>group clinicians</td><td>alice, bob</td>" in page
    assert "<td>dataset</td><td>every analyst</td><td>never renews</td>" in page
    assert "renew: monthly" in page
