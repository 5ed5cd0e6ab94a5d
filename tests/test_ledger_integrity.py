"""Ledger integrity (issue 29, item 6): files that are not a ledger are refused, backup and
restore, SQLSTATEs that tell charged from uncharged, a paid answer survives a failed cache
write, and ledger errors reach the operator's log, never the analyst with a value."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest
from conftest import fixture_policy

import dpsql
from dpsql.boundary import NOT_CACHED, ChargedFailure
from dpsql.cli import main
from dpsql.dbapi import connect_service
from dpsql.errors import LedgerUnavailableError, OperationalError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger_backup import backup_ledger, restore_ledger
from dpsql.privacy.samplers import ZeroNoise
from dpsql.privacy.sqlite_ledger import SQLiteLedger

BUDGET = Budget(epsilon=1000.0, delta=1e-6)
QUERY = "SELECT department, COUNT(*) AS n FROM visits GROUP BY department"


def charge(led: SQLiteLedger, eps: float, analyst: str = "alice", key: str = "p") -> None:
    led.charge(analyst, "ds", Cost(eps), BUDGET, query_text=f"q {key}", plan_hash=key)


def rows(path: Path) -> tuple[list[tuple], list[tuple]]:
    """The charge log and the totals, as stored."""
    conn = sqlite3.connect(path)
    try:
        log = conn.execute(
            "SELECT id, analyst, dataset, kind, epsilon_exact, plan_hash FROM charge_log "
            "ORDER BY id"
        ).fetchall()
        totals = conn.execute(
            "SELECT analyst, dataset, epsilon_exact, charges FROM totals ORDER BY analyst"
        ).fetchall()
    finally:
        conn.close()
    return log, totals


# -- files that are not a ledger are refused, never taken as new -----------------------------


@pytest.mark.parametrize(
    "content, what",
    [
        (b"", "empty file"),
        (b"this is not a database at all" * 64, "not a SQLite database"),
    ],
)
def test_an_empty_or_garbage_ledger_file_is_refused(tmp_path: Path, content: bytes, what: str):
    path = tmp_path / "budget.sqlite"
    path.write_bytes(content)
    with pytest.raises(LedgerUnavailableError) as info:
        SQLiteLedger(path)
    err = info.value
    assert err.sqlstate == "53000" and what in err.message and str(path) in err.message
    assert "restore" in (err.hint or "")
    assert path.read_bytes() == content  # untouched: not turned into an empty ledger
    assert not Path(f"{path}-wal").exists()


def test_a_sqlite_database_without_ledger_tables_is_refused(tmp_path: Path):
    path = tmp_path / "other.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(LedgerUnavailableError, match="without dpsql's ledger tables"):
        SQLiteLedger(path)


def test_budget_commands_refuse_an_emptied_ledger(tmp_path: Path, capsys):
    """The reported case: a 0-byte ledger made every budget 0 and verify said consistent."""
    policy = _policy_file(tmp_path)
    ledger = tmp_path / "budget.sqlite"
    with SQLiteLedger(ledger) as led:
        charge(led, 0.5)
    ledger.write_bytes(b"")
    for path in (f"{ledger}-wal", f"{ledger}-shm"):
        Path(path).unlink(missing_ok=True)
    for command in (["budget"], ["budget", "verify"], ["budget", "log"]):
        assert main([*command, "--policy", str(policy)]) == 1
        err = capsys.readouterr().err
        assert "empty file" in err and "53000" in err
    assert ledger.stat().st_size == 0


def test_a_missing_ledger_beside_its_wal_is_refused(tmp_path: Path):
    path = tmp_path / "budget.sqlite"
    with SQLiteLedger(path) as led:
        charge(led, 0.5)
        shutil.copy(f"{path}-wal", tmp_path / "kept-wal")
    path.unlink()
    shutil.copy(tmp_path / "kept-wal", f"{path}-wal")
    with pytest.raises(LedgerUnavailableError, match="-wal file"):
        SQLiteLedger(path)


def test_a_new_ledger_never_shows_an_empty_file(tmp_path: Path):
    """Many threads creating the same new ledger at once all open it (created whole)."""
    path = tmp_path / "budget.sqlite"
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            with SQLiteLedger(path) as led:
                charge(led, 0.25)
        except BaseException as exc:  # pragma: no cover - the failure reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with SQLiteLedger(path) as led:
        assert led.spent("alice", "ds") == Cost(2.0) and led.verify() == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_creator_that_lost_the_race_uses_the_winners_ledger(tmp_path: Path):
    """A creator that found no ledger, then sees a -wal because another creator linked its
    ledger and charged meanwhile, uses that ledger: it is not an orphaned -wal (CI, 2026-12-06)."""
    path = tmp_path / "budget.sqlite"
    with SQLiteLedger(path) as winner:
        charge(winner, 0.25)
        assert Path(f"{path}-wal").stat().st_size > 0
        winner._create()  # what the loser runs after its lexists() said "no ledger"
        assert winner.spent("alice", "ds") == Cost(0.25)


# -- backup and restore ----------------------------------------------------------------------


def test_a_copy_without_its_wal_loses_charges_a_backup_does_not(tmp_path: Path):
    """Why `cp` is not a backup (docs/ledger.md): the newest charges are in the -wal file."""
    path = tmp_path / "budget.sqlite"
    with SQLiteLedger(path) as led:
        charge(led, 0.5)
        led._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        for i in range(4):
            charge(led, 0.25, key=f"k{i}")
        shutil.copy(path, tmp_path / "copy.sqlite")  # no -wal: the last 4 charges are lost
        backup_ledger(path, tmp_path / "backup.sqlite")
        live = rows(path)
    copied_log, _ = rows(tmp_path / "copy.sqlite")
    assert len(live[0]) - len(copied_log) == 4
    assert rows(tmp_path / "backup.sqlite") == live
    assert oct(os.stat(tmp_path / "backup.sqlite").st_mode & 0o777) == "0o600"


def test_backup_under_concurrent_charges_equals_the_source(tmp_path: Path):
    path = tmp_path / "budget.sqlite"
    SQLiteLedger(path).close()
    stop = threading.Event()
    done = {"n": 0}

    def writer(name: str) -> None:
        with SQLiteLedger(path) as led:
            while not stop.is_set():
                charge(led, 2.0**-10, analyst=name, key=f"{name}{done['n']}")
                done["n"] += 1

    threads = [threading.Thread(target=writer, args=(f"a{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        snapshots = []
        for i in range(3):
            while done["n"] < 20 * (i + 1):
                threading.Event().wait(0.01)
            snapshots.append(backup_ledger(path, tmp_path / f"mid{i}.sqlite"))
    finally:
        stop.set()
        for t in threads:
            t.join()
    live_log, live_totals = rows(path)
    for copy in snapshots:  # each mid-run backup: a consistent prefix of the log
        log, totals = rows(copy.path)
        assert log == live_log[: len(log)] and copy.log_rows == len(log) > 0
        with SQLiteLedger(copy.path) as led:
            assert led.verify() == []
            assert sum(t[3] for t in totals) == len(log)
    final = backup_ledger(path, tmp_path / "final.sqlite")
    assert rows(final.path) == (live_log, live_totals)  # once writers stop: equal


def test_backup_refuses_to_overwrite_without_force(tmp_path: Path):
    path = tmp_path / "budget.sqlite"
    with SQLiteLedger(path) as led:
        charge(led, 0.5)
    dest = tmp_path / "b.sqlite"
    dest.write_text("keep me")
    with pytest.raises(LedgerUnavailableError, match="exists"):
        backup_ledger(path, dest)
    assert dest.read_text() == "keep me"
    backup_ledger(path, dest, force=True)
    assert rows(dest) == rows(path)


def test_restore_into_a_lost_ledger_and_over_a_live_one(tmp_path: Path):
    path = tmp_path / "budget.sqlite"
    with SQLiteLedger(path) as led:
        charge(led, 0.5, key="a")
        backup_ledger(path, tmp_path / "b.sqlite")
        before = rows(path)
        charge(led, 0.25, key="b")
    # the ledger is lost: restore needs no --force
    for side in ("", "-wal", "-shm"):
        Path(f"{path}{side}").unlink(missing_ok=True)
    copy, forgotten = restore_ledger(tmp_path / "b.sqlite", path)
    assert forgotten == 0 and copy.log_rows == 1 and rows(path) == before
    # a live ledger with a newer charge: refused without --force, replaced with it
    with SQLiteLedger(path) as led:
        charge(led, 0.125, key="c")
        with pytest.raises(LedgerUnavailableError, match="exists"):
            restore_ledger(tmp_path / "b.sqlite", path)
        assert led.spent("alice", "ds") == Cost(0.625)
        copy, forgotten = restore_ledger(tmp_path / "b.sqlite", path, force=True)
        assert forgotten == 1
        assert led.spent("alice", "ds") == Cost(0.5)  # an open instance sees the restored state
        assert led.verify() == []
    assert rows(path) == before


def test_restore_moves_an_empty_ledger_aside_and_refuses_a_bad_backup(tmp_path: Path):
    path = tmp_path / "budget.sqlite"
    with SQLiteLedger(path) as led:
        charge(led, 0.5)
    backup_ledger(path, tmp_path / "b.sqlite")
    for side in ("-wal", "-shm"):
        Path(f"{path}{side}").unlink(missing_ok=True)
    path.write_bytes(b"")
    (tmp_path / "bad.sqlite").write_bytes(b"garbage" * 100)
    with pytest.raises(LedgerUnavailableError):
        restore_ledger(tmp_path / "bad.sqlite", path, force=True)
    assert path.stat().st_size == 0  # nothing touched by a refused restore
    restore_ledger(tmp_path / "b.sqlite", path, force=True)
    with SQLiteLedger(path) as led:
        assert led.spent("alice", "ds") == Cost(0.5)
    assert [p.name for p in tmp_path.glob("budget.sqlite.replaced-*")]  # kept, not deleted


def test_backup_and_restore_commands(tmp_path: Path, capsys):
    policy = _policy_file(tmp_path)
    ledger = tmp_path / "budget.sqlite"
    with SQLiteLedger(ledger) as led:
        charge(led, 0.5)
    dest = tmp_path / "backup.sqlite"
    assert main(["budget", "backup", str(dest), "--policy", str(policy)]) == 0
    assert "1 log rows" in capsys.readouterr().out
    assert main(["budget", "restore", str(dest), "--policy", str(policy)]) == 1
    assert "--force" in capsys.readouterr().err
    with SQLiteLedger(ledger) as led:
        charge(led, 0.25, key="later")
    assert main(["budget", "restore", str(dest), "--policy", str(policy), "--force"]) == 0
    out = capsys.readouterr()
    assert "restored" in out.out and "1 log rows of the replaced ledger" in out.err
    assert main(["budget", "verify", "--policy", str(policy)]) == 0


# -- SQLSTATEs: ledger unavailable (nothing charged) vs charged and failed -------------------


@pytest.fixture()
def served(tmp_path: Path):
    service = dpsql.Service(
        fixture_policy(), ledger=SQLiteLedger(tmp_path / "l.sqlite"), noise=ZeroNoise()
    )
    conn = connect_service(service, "mallory")
    yield service, conn
    conn.close()
    service.close()


def _spent(service: dpsql.Service) -> Cost:
    return service.ledger.spent("mallory", service.policy.dataset)


def _sqlite_fails(
    monkeypatch, ledger: SQLiteLedger, statement: str, error: sqlite3.Error, after: str = ""
):
    """Every statement of the ledger starting with ``statement`` raises ``error`` (once a
    statement starting with ``after`` ran, when given)."""
    real = ledger._conn
    seen = {"after": not after}

    class Failing:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self._conn = conn

        def execute(self, sql: str, *args):
            text = sql.lstrip().upper()
            seen["after"] = seen["after"] or text.startswith(after)
            if seen["after"] and text.startswith(statement):
                raise error
            return self._conn.execute(sql, *args)

        def __getattr__(self, name: str):
            return getattr(self._conn, name)

    monkeypatch.setattr(ledger, "_conn", lambda: Failing(real()))


def _full() -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError("database or disk is full")
    exc.sqlite_errorname = "SQLITE_FULL"  # type: ignore[attr-defined]
    return exc


def _ioerr() -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError("disk I/O error")
    exc.sqlite_errorname = "SQLITE_IOERR_FSYNC"  # type: ignore[attr-defined]
    return exc


@pytest.mark.parametrize("step", ["check", "charge", "cached", "spent"])
def test_a_ledger_failure_before_the_charge_is_53000_and_charges_nothing(
    served, monkeypatch, caplog, step
):
    service, conn = served
    ledger = service.ledger
    if step == "check":
        _sqlite_fails(monkeypatch, ledger, "SELECT B.ANALYST", _ioerr())
    elif step == "charge":
        _sqlite_fails(monkeypatch, ledger, "INSERT INTO CHARGE_LOG", _full())
    elif step == "cached":
        _sqlite_fails(monkeypatch, ledger, "SELECT ANSWER", _ioerr())
    else:
        _sqlite_fails(monkeypatch, ledger, "SELECT EPSILON", _ioerr())
    with (
        caplog.at_level(logging.WARNING, logger="dpsql.ledger"),
        pytest.raises(dpsql.Error) as info,
    ):
        conn.cursor().execute("SHOW budget" if step == "spent" else QUERY)
    err = info.value
    assert isinstance(err, LedgerUnavailableError) and err.sqlstate == "53000"
    assert "nothing was charged" in err.message
    assert "l.sqlite" not in str(err) and "SQLITE" not in str(err)  # no path, no internals
    assert any(r.levelno >= logging.ERROR and "disk" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    assert _spent(service) == Cost()


def test_a_busy_ledger_is_53000_and_charges_nothing(tmp_path: Path):
    path = tmp_path / "l.sqlite"
    SQLiteLedger(path).close()
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with SQLiteLedger(path, timeout=0.05) as led:
            with pytest.raises(LedgerUnavailableError) as info:
                charge(led, 0.1)
            assert info.value.sqlstate == "53000" and "nothing was charged" in info.value.message
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


def test_an_io_error_at_the_charge_commit_is_58000_may_have_been_charged(served, monkeypatch):
    """The commit frame may have reached the disk: never told "not charged"."""
    service, conn = served
    _sqlite_fails(monkeypatch, service.ledger, "COMMIT", _ioerr(), after="INSERT INTO CHARGE_LOG")
    with pytest.raises(OperationalError) as info:
        conn.cursor().execute(QUERY)
    assert not isinstance(info.value, LedgerUnavailableError)
    assert info.value.sqlstate == "58000" and "may have" in info.value.message


def test_a_failure_after_the_charge_stays_58000(served, monkeypatch):
    service, conn = served
    monkeypatch.setattr(service.engine, "execute", _raiser(RuntimeError("value 4711")))
    with pytest.raises(ChargedFailure) as info:
        conn.cursor().execute(QUERY)
    assert info.value.sqlstate == "58000" and "4711" not in str(info.value)
    assert _spent(service).epsilon > 0


def test_opening_an_unusable_ledger_is_53000_naming_the_file(tmp_path: Path):
    (tmp_path / "l.sqlite").write_bytes(b"")
    policy = fixture_policy(privacy={"ledger": str(tmp_path / "l.sqlite")})
    with pytest.raises(LedgerUnavailableError) as info:
        dpsql.Service(policy)
    assert info.value.sqlstate == "53000" and str(tmp_path / "l.sqlite") in info.value.message


# -- a paid answer survives a failed cache write ---------------------------------------------


@pytest.mark.parametrize("error", [_full(), RuntimeError("secret 4711")])
def test_a_paid_answer_is_returned_when_caching_it_fails(served, monkeypatch, caplog, error):
    service, conn = served
    expected = connect_service(service, "other").cursor().execute(QUERY).fetchall()
    if isinstance(error, sqlite3.Error):
        _sqlite_fails(monkeypatch, service.ledger, "INSERT OR IGNORE INTO ANSWERS", error)
    else:
        monkeypatch.setattr(service.ledger, "remember", _raiser(error))
    cur = conn.cursor()
    with caplog.at_level(logging.ERROR):
        got = cur.execute(QUERY).fetchall()
    assert got == expected  # the answer, not an error
    notes = [text for _, text in cur.messages]
    assert NOT_CACHED in notes and not any("4711" in n for n in notes)
    assert any("could not be cached" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    entries = [e for e in service.ledger.entries(analyst="mallory") if e.kind == "charge"]
    assert len(entries) == 1  # charged exactly once
    assert service.ledger.verify() == []
    # nothing was cached: running it again is a fresh (charged) run, and now it is cached
    cur.execute(QUERY)
    assert len([e for e in service.ledger.entries(analyst="mallory") if e.kind == "charge"]) == 2


# -- helpers ---------------------------------------------------------------------------------


def _raiser(exc: BaseException):
    def raise_it(*args, **kwargs):
        raise exc

    return raise_it


def _policy_file(tmp_path: Path) -> Path:
    (tmp_path / "visits.csv").write_text("pid,age\n1,30\n2,40\n", encoding="utf-8")
    path = tmp_path / "policy.toml"
    path.write_text(
        '[privacy]\nepsilon = 1.0\nbudget_epsilon = 1000.0\ndataset = "ds"\n'
        'ledger = "budget.sqlite"\n\n[tables.visits]\nsource = "visits.csv"\n'
        'privacy_unit = "pid"\n\n[tables.visits.columns.pid]\ntype = "int"\n',
        encoding="utf-8",
    )
    return path
