"""The server's gate in front of the GIL (dpsql.gil_gate): one statement thread runs its Python at
a time, the gate is let go while a statement waits for its durable charge (so charges still
batch) or for DuckDB, it is never held twice nor released for another thread, a thread that
waits past its patience runs without it, and a statement run through the gate still pays
durably before the engine reads a row. No timing is asserted: waits are on events, and a wait
that must not end is given a short look only (it can never fail on a slow machine)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import dpsql
from dpsql import gil_gate
from dpsql.dbapi import connect_service
from dpsql.gil_gate import Gate, held, holding, released
from dpsql.policy import load_policy
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.sqlite_ledger import SQLiteLedger

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml"


def _hold_until(gate: Gate, entered: threading.Event, leave: threading.Event) -> threading.Thread:
    def run() -> None:
        with holding(gate):
            entered.set()
            leave.wait(30)

    t = threading.Thread(target=run)
    t.start()
    assert entered.wait(30)
    return t


def test_one_thread_holds_the_gate_and_the_next_enters_when_it_leaves() -> None:
    gate = Gate(patience=30)
    first, leave = threading.Event(), threading.Event()
    holder = _hold_until(gate, first, leave)
    second = threading.Event()
    inside: list[bool] = []

    def run() -> None:
        with holding(gate):
            inside.append(held())
            second.set()

    t = threading.Thread(target=run)
    t.start()
    assert not second.wait(0.05)  # still queued at the gate (a short look, never a timing)
    leave.set()
    holder.join(30)
    assert second.wait(30)
    t.join(30)
    assert inside == [True]
    assert not gate._lock.locked()


def test_a_thread_past_its_patience_runs_without_the_gate_and_never_frees_it() -> None:
    gate = Gate(patience=0.01)
    entered, leave = threading.Event(), threading.Event()
    holder = _hold_until(gate, entered, leave)
    with holding(gate):
        assert not held()  # ran anyway, without it
        with released():  # nothing to let go
            assert not held()
    assert gate._lock.locked()  # still the holder's
    leave.set()
    holder.join(30)
    assert not gate._lock.locked()


def test_released_lets_another_statement_run_and_takes_the_gate_back() -> None:
    gate = Gate(patience=30)
    other = threading.Event()
    seen: list[bool] = []

    def run() -> None:
        with holding(gate):
            seen.append(held())
            other.set()

    with holding(gate):
        assert held()
        with released():
            assert not held()
            t = threading.Thread(target=run)
            t.start()
            assert other.wait(30)  # it entered while this thread waited
            t.join(30)
        assert held()
    assert seen == [True]
    assert not held() and not gate._lock.locked()


def test_a_retake_that_gives_up_leaves_the_new_holder_its_gate() -> None:
    gate = Gate(patience=0.01)
    entered, leave = threading.Event(), threading.Event()
    with holding(gate):
        with released():
            holder = _hold_until(gate, entered, leave)
        assert not held()  # gave up retaking: runs on without it
    assert gate._lock.locked()  # the other thread's, not released by this one
    leave.set()
    holder.join(30)
    assert not gate._lock.locked()


def test_no_gate_and_nested_holds_change_nothing() -> None:
    with holding(None):
        assert not held()
        with released():
            pass
    gate = Gate(patience=30)
    with holding(gate):
        with holding(gate):  # never taken twice (a lock would deadlock here)
            assert held()
        assert held()
    assert not gate._lock.locked()


def test_the_environment_sets_the_slots(monkeypatch) -> None:
    monkeypatch.setenv("DPSQL_GATE", "0")
    assert gil_gate.from_environment() is None
    monkeypatch.setenv("DPSQL_GATE", "3")
    gate = gil_gate.from_environment()
    assert gate is not None and gate.slots == 3
    monkeypatch.delenv("DPSQL_GATE")
    gate = gil_gate.from_environment()
    assert gate is not None and gate.slots == 1


def test_a_charge_waits_for_its_commit_without_the_gate(tmp_path: Path) -> None:
    """While a charge waits for its batch and fsync, another statement takes the gate; the
    charge is committed before it returns, and its thread holds the gate again after."""
    entered = threading.Event()

    def fault(point: str) -> None:
        if point == "logged":  # inside the charge's transaction, before its COMMIT
            assert entered.wait(30), "no other statement could take the gate"

    ledger = SQLiteLedger(tmp_path / "l.sqlite", fault_hook=fault)
    gate = Gate(patience=30)

    def other() -> None:
        with holding(gate):
            entered.set()

    t = threading.Thread(target=other)
    with holding(gate):
        t.start()
        ledger.charge("a", "d", Cost(0.25, 0, 0), Budget(1.0, 1e-5), query_text="q", plan_hash="h")
        assert held()
        reader = SQLiteLedger(tmp_path / "l.sqlite")  # another connection: committed
        assert reader.spent("a", "d").epsilon == 0.25
        reader.close()
    t.join(30)
    ledger.close()


def test_a_gated_statement_pays_durably_before_the_engine_reads(tmp_path: Path) -> None:
    """Through the service, in a gated thread: when the engine reads, the charge is already
    committed (seen from another connection) and the thread holds the gate again."""
    shutil.copy(FIXTURE, tmp_path / FIXTURE.name)
    for table in load_policy(FIXTURE).tables.values():
        if table.source_path is not None:
            shutil.copy(table.source_path, tmp_path / table.source_path.name)
    policy = load_policy(tmp_path / FIXTURE.name)
    assert policy.ledger_path is not None
    service = dpsql.Service(tmp_path / FIXTURE.name, cache=False)
    seen: list[tuple[float, bool]] = []
    execute = service.engine.execute

    def spy(compiled, handle=None):
        reader = SQLiteLedger(policy.ledger_path)
        seen.append((reader.spent("alice", policy.dataset).epsilon, held()))
        reader.close()
        return execute(compiled, handle)

    service.engine.execute = spy  # type: ignore[method-assign]
    gate = Gate(patience=30)
    out: list[object] = []

    def run() -> None:
        with holding(gate):
            cur = connect_service(service, "alice").cursor()
            cur.execute("SET epsilon = 0.25")
            cur.execute("SELECT COUNT(*) FROM visits WHERE age > 40")
            out.append(cur.fetchall())

    try:
        t = threading.Thread(target=run)
        t.start()
        t.join(60)
    finally:
        service.close()
    assert out and seen == [(0.25, True)]
