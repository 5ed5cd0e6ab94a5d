"""The durable budget ledger and answer cache: one SQLite file, shared by threads and processes.

Why SQLite: it is in the standard library, every transaction is atomic and durable, and the
file lock serialises writers across processes, which is exactly what a budget needs: two
queries racing for the last ε must not both get it. Every charge is ONE ``BEGIN IMMEDIATE``
transaction that re-reads the committed total, checks the budget, appends the log row, updates
the total and stores the released answer. A process killed before ``COMMIT`` leaves nothing
(SQLite rolls the WAL tail back); one killed after keeps the charge and the answer.

Invariant, checked by :meth:`SQLiteLedger.verify`: per (analyst, dataset) the running total is
the sum of the cost columns of the append-only log (a reset is logged as the negated total).
"""

from __future__ import annotations

import datetime as _dt
import getpass
import math
import os
import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from dpsql.errors import DatabaseError, InterfaceError, InternalError, OperationalError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger import AnalystStatus, Ledger, LogEntry, MemoryLedger, exhausted

SCHEMA_VERSION = 1

# One statement per item (triggers contain ";", so no naive splitting of a script).
_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS totals (
        analyst TEXT NOT NULL,
        dataset TEXT NOT NULL,
        epsilon REAL NOT NULL DEFAULT 0,
        delta REAL NOT NULL DEFAULT 0,
        rho REAL NOT NULL DEFAULT 0,
        charges INTEGER NOT NULL DEFAULT 0,
        updated_at TEXT NOT NULL,
        PRIMARY KEY (analyst, dataset)
    )""",
    """CREATE TABLE IF NOT EXISTS budgets (
        analyst TEXT NOT NULL,
        dataset TEXT NOT NULL,
        epsilon REAL NOT NULL CHECK (epsilon > 0),
        delta REAL NOT NULL CHECK (delta >= 0 AND delta < 1),
        set_at TEXT NOT NULL,
        PRIMARY KEY (analyst, dataset)
    )""",
    """CREATE TABLE IF NOT EXISTS charge_log (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at TEXT NOT NULL,
        analyst TEXT NOT NULL,
        dataset TEXT NOT NULL,
        kind TEXT NOT NULL CHECK (kind IN ('charge', 'reset', 'budget')),
        epsilon REAL NOT NULL,
        delta REAL NOT NULL,
        rho REAL NOT NULL,
        query_text TEXT NOT NULL,
        plan_hash TEXT NOT NULL
    )""",
    """CREATE INDEX IF NOT EXISTS charge_log_by_analyst
        ON charge_log (dataset, analyst, id)""",
    """CREATE TRIGGER IF NOT EXISTS charge_log_no_update BEFORE UPDATE ON charge_log
        BEGIN SELECT RAISE(ABORT, 'the charge log is append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS charge_log_no_delete BEFORE DELETE ON charge_log
        BEGIN SELECT RAISE(ABORT, 'the charge log is append-only'); END""",
    """CREATE TABLE IF NOT EXISTS answers (
        analyst TEXT NOT NULL,
        dataset TEXT NOT NULL,
        cache_key TEXT NOT NULL,
        answer TEXT NOT NULL,
        charge_id INTEGER NOT NULL REFERENCES charge_log (id),
        stored_at TEXT NOT NULL,
        PRIMARY KEY (analyst, dataset, cache_key)
    )""",
)

FaultHook = Callable[[str], None]


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")


def _actor(actor: str | None) -> str:
    if actor:
        return actor
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry / no login name (containers)
        return f"uid {os.getuid()}"


def _validate_cost(cost: Cost) -> None:
    parts = (cost.epsilon, cost.delta, cost.rho)
    if not all(math.isfinite(p) and p >= 0 for p in parts):
        raise InternalError(
            f"refusing to charge an invalid privacy cost {cost!r}",
            construct="cost",
            hint="every part of a cost must be finite and >= 0; this is a bug in the caller",
        )


class _Handle:
    """Holds one thread's connection (sqlite3.Connection cannot be weakly referenced)."""

    __slots__ = ("__weakref__", "conn", "pid")

    def __init__(self, conn: sqlite3.Connection, pid: int) -> None:
        self.conn = conn
        self.pid = pid


class SQLiteLedger:
    """A :class:`~dpsql.privacy.ledger.Ledger` (and AdminLedger) stored in one SQLite file.

    Safe from many threads (one connection per thread) and many processes (SQLite file locks,
    WAL journal, a busy timeout). Do not share an instance across ``fork``: a forked child
    opens its own connection on first use; prefer the ``spawn`` start method.

    ``fault_hook`` is for crash tests only: it is called inside the open charge transaction
    with "logged" (log row written, total not yet) and "written" (everything but COMMIT).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        timeout: float = 30.0,
        fault_hook: FaultHook | None = None,
    ) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._fault_hook = fault_hook
        self._local = threading.local()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._handles: weakref.WeakSet[_Handle] = weakref.WeakSet()
        self._closed = False
        self._init_schema()

    # -- connections and transactions -------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
            # FULL: a committed charge survives power loss too, not only a process crash.
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        return conn

    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise InterfaceError(
                f"the ledger {str(self.path)!r} is closed",
                construct="ledger",
                hint="open a new SQLiteLedger",
            )
        handle: _Handle | None = getattr(self._local, "handle", None)
        if handle is None or handle.pid != os.getpid():
            handle = _Handle(self._open(), os.getpid())
            self._local.handle = handle
            with self._lock:
                self._handles.add(handle)
        return handle.conn

    def _error(self, exc: sqlite3.Error) -> DatabaseError:
        text = str(exc)
        if "locked" in text or "busy" in text:
            return OperationalError(
                f"the budget ledger {str(self.path)!r} stayed busy for {self.timeout:g} s",
                construct="ledger",
                hint="retry; if it persists, look for a process holding the ledger open",
            )
        return OperationalError(
            f"the budget ledger {str(self.path)!r} failed: {text}",
            construct="ledger",
            hint="check that the ledger's directory exists and is writable by dpsql",
        )

    @contextmanager
    def _transaction(self, mode: str) -> Iterator[sqlite3.Connection]:
        """``BEGIN <mode>`` ... ``COMMIT``; any exception rolls back everything written."""
        conn = self._conn()
        try:
            conn.execute(f"BEGIN {mode}")
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise self._error(exc) from None
            raise

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        # IMMEDIATE takes the write lock up front, so the budget we read cannot change
        # before we commit (a DEFERRED read-then-write could fail or see a stale total).
        # Writers of this process first queue on a Python lock: SQLite's busy handler makes a
        # waiting writer sleep in steps of up to 100 ms, so under contention from many threads
        # a charge could wait far longer than the commits ahead of it take. Other processes
        # still meet SQLite's own lock (and its busy timeout).
        if not self._write_lock.acquire(timeout=self.timeout):
            raise self._error(sqlite3.OperationalError("database is locked"))
        try:
            with self._transaction("IMMEDIATE") as conn:
                yield conn
        finally:
            self._write_lock.release()

    def _read(self) -> AbstractContextManager[sqlite3.Connection]:
        # A read transaction sees one consistent snapshot (WAL), e.g. budget and total together.
        return self._transaction("DEFERRED")

    def _init_schema(self) -> None:
        """Switch to WAL and create the tables, taking the write lock only on a new file."""
        conn = self._conn()
        try:
            mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
            if str(mode).lower() != "wal":
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        if str(mode).lower() != "wal":
            raise OperationalError(
                f"the budget ledger {str(self.path)!r} cannot use WAL mode (got {mode!r})",
                construct="ledger",
                hint="put the ledger on a local filesystem (not a network share)",
            )
        version = self._schema_version()
        if version is None:
            with self._write() as conn:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(
                    "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
            version = self._schema_version()
        if version != str(SCHEMA_VERSION):
            raise OperationalError(
                f"the budget ledger {str(self.path)!r} has schema version {version}, "
                f"this dpsql reads version {SCHEMA_VERSION}",
                construct="ledger",
                hint="upgrade dpsql, or point the policy's ledger at another file",
            )

    def _schema_version(self) -> str | None:
        with self._read() as conn:
            exists = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
            ).fetchone()
            if exists is None:
                return None
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return None if row is None else str(row[0])

    def close(self) -> None:
        """Close every thread's connection. Idempotent."""
        with self._lock:
            self._closed = True
            handles = list(self._handles)
            self._handles = weakref.WeakSet()
        for handle in handles:
            if handle.pid == os.getpid():
                handle.conn.close()

    def __enter__(self) -> SQLiteLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads inside a transaction ----------------------------------------------------------

    @staticmethod
    def _budget_in(conn: sqlite3.Connection, analyst: str, dataset: str) -> Budget | None:
        row = conn.execute(
            "SELECT epsilon, delta FROM budgets WHERE analyst = ? AND dataset = ?",
            (analyst, dataset),
        ).fetchone()
        return None if row is None else Budget(row[0], row[1])

    @staticmethod
    def _spent_in(conn: sqlite3.Connection, analyst: str, dataset: str) -> tuple[Cost, int]:
        row = conn.execute(
            "SELECT epsilon, delta, rho, charges FROM totals WHERE analyst = ? AND dataset = ?",
            (analyst, dataset),
        ).fetchone()
        return (Cost(), 0) if row is None else (Cost(row[0], row[1], row[2]), row[3])

    @staticmethod
    def _log(
        conn: sqlite3.Connection,
        analyst: str,
        dataset: str,
        kind: str,
        cost: Cost,
        query_text: str,
        plan_hash: str,
    ) -> int:
        cur = conn.execute(
            "INSERT INTO charge_log (at, analyst, dataset, kind, epsilon, delta, rho, "
            "query_text, plan_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                _now(),
                analyst,
                dataset,
                kind,
                cost.epsilon,
                cost.delta,
                cost.rho,
                query_text,
                plan_hash,
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    @staticmethod
    def _set_total(
        conn: sqlite3.Connection, analyst: str, dataset: str, total: Cost, charges: int
    ) -> None:
        conn.execute(
            "INSERT INTO totals (analyst, dataset, epsilon, delta, rho, charges, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (analyst, dataset) DO UPDATE SET "
            "epsilon = excluded.epsilon, delta = excluded.delta, rho = excluded.rho, "
            "charges = excluded.charges, updated_at = excluded.updated_at",
            (analyst, dataset, total.epsilon, total.delta, total.rho, charges, _now()),
        )

    def _fault(self, stage: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(stage)

    # -- the Ledger protocol -----------------------------------------------------------------

    def budget(self, analyst: str, dataset: str, default: Budget) -> Budget:
        with self._read() as conn:
            return _with_share(self._budget_in(conn, analyst, dataset), default)

    def spent(self, analyst: str, dataset: str) -> Cost:
        with self._read() as conn:
            return self._spent_in(conn, analyst, dataset)[0]

    def check(self, analyst: str, dataset: str, cost: Cost, default: Budget) -> None:
        _validate_cost(cost)
        with self._read() as conn:
            budget = _with_share(self._budget_in(conn, analyst, dataset), default)
            spent, _ = self._spent_in(conn, analyst, dataset)
        if not budget.covers(spent + cost):
            raise exhausted(analyst, budget, spent, cost)

    def charge(
        self,
        analyst: str,
        dataset: str,
        cost: Cost,
        default: Budget,
        *,
        query_text: str,
        plan_hash: str,
        cache_key: str | None = None,
        answer: str | None = None,
    ) -> None:
        """One transaction: re-check against the committed total, log, add, cache.

        If an answer is already cached under ``cache_key`` (two identical queries raced past
        :meth:`cached`), both are charged and the first answer stays cached: every released
        answer is paid for, and later re-runs all see the same one.
        """
        _validate_cost(cost)
        with self._write() as conn:
            budget = _with_share(self._budget_in(conn, analyst, dataset), default)
            spent, charges = self._spent_in(conn, analyst, dataset)
            total = spent + cost
            if not budget.covers(total):
                raise exhausted(analyst, budget, spent, cost)
            charge_id = self._log(conn, analyst, dataset, "charge", cost, query_text, plan_hash)
            self._fault("logged")
            self._set_total(conn, analyst, dataset, total, charges + 1)
            if cache_key is not None and answer is not None:
                conn.execute(
                    "INSERT OR IGNORE INTO answers (analyst, dataset, cache_key, answer, "
                    "charge_id, stored_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (analyst, dataset, cache_key, answer, charge_id, _now()),
                )
            self._fault("written")

    def cached(self, analyst: str, dataset: str, cache_key: str) -> str | None:
        with self._read() as conn:
            row = conn.execute(
                "SELECT answer FROM answers WHERE analyst = ? AND dataset = ? AND cache_key = ?",
                (analyst, dataset, cache_key),
            ).fetchone()
        return None if row is None else row[0]

    # -- administrator operations ------------------------------------------------------------

    def set_budget(
        self, analyst: str, dataset: str, budget: Budget, *, actor: str | None = None
    ) -> None:
        """Override the default budget (raise or lower it); logged as a "budget" event."""
        if not (math.isfinite(budget.epsilon) and budget.epsilon > 0 and 0 <= budget.delta < 1):
            raise InterfaceError(
                f"invalid budget epsilon={budget.epsilon!r}, delta={budget.delta!r}",
                construct="budget",
                hint="epsilon must be > 0 and delta in [0, 1)",
            )
        with self._write() as conn:
            old = self._budget_in(conn, analyst, dataset)
            was = "the policy default" if old is None else _fmt_budget(old)
            conn.execute(
                "INSERT INTO budgets (analyst, dataset, epsilon, delta, set_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (analyst, dataset) DO UPDATE SET "
                "epsilon = excluded.epsilon, delta = excluded.delta, set_at = excluded.set_at",
                (analyst, dataset, budget.epsilon, budget.delta, _now()),
            )
            text = f"budget set to {_fmt_budget(budget)} (was {was}) by {_actor(actor)}"
            self._log(conn, analyst, dataset, "budget", Cost(), text, "")

    def reset(self, analyst: str, dataset: str, *, actor: str | None = None) -> Cost:
        """Release the analyst's spending; returns what was released.

        Logged as a "reset" row carrying the negated total, so no log row is ever deleted and
        the log still sums to the running total. Cached answers stay: re-running a query
        after a reset still returns the answer already released, at no cost.
        """
        with self._write() as conn:
            spent, _ = self._spent_in(conn, analyst, dataset)
            released = Cost(-spent.epsilon, -spent.delta, -spent.rho)
            text = (
                f"spending reset by {_actor(actor)}: released epsilon={spent.epsilon:.6g}, "
                f"delta={spent.delta:.3g}, rho={spent.rho:.6g}"
            )
            self._log(conn, analyst, dataset, "reset", released, text, "")
            self._set_total(conn, analyst, dataset, Cost(), 0)
        return spent

    def analysts(self, dataset: str, default: Budget) -> list[AnalystStatus]:
        with self._read() as conn:
            rows = conn.execute(
                "SELECT a.analyst, t.epsilon, t.delta, t.rho, t.charges, b.epsilon, b.delta "
                "FROM (SELECT analyst FROM totals WHERE dataset = :d "
                "      UNION SELECT analyst FROM budgets WHERE dataset = :d) AS a "
                "LEFT JOIN totals AS t ON t.analyst = a.analyst AND t.dataset = :d "
                "LEFT JOIN budgets AS b ON b.analyst = a.analyst AND b.dataset = :d "
                "ORDER BY a.analyst",
                {"d": dataset},
            ).fetchall()
        return [_status(dataset, default, row) for row in rows]

    def status(self, analyst: str, dataset: str, default: Budget) -> AnalystStatus:
        """One analyst's status, also when they have never been charged."""
        with self._read() as conn:
            override = self._budget_in(conn, analyst, dataset)
            spent, charges = self._spent_in(conn, analyst, dataset)
        return AnalystStatus(
            analyst, dataset, spent, override or default, override is not None, charges
        )

    def entries(
        self, dataset: str | None = None, *, analyst: str | None = None, limit: int | None = None
    ) -> list[LogEntry]:
        where, params = [], []
        if dataset is not None:
            where.append("dataset = ?")
            params.append(dataset)
        if analyst is not None:
            where.append("analyst = ?")
            params.append(analyst)
        sql = "SELECT id, at, analyst, dataset, kind, epsilon, delta, rho, query_text, plan_hash "
        sql += "FROM charge_log"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(max(0, int(limit)))
        with self._read() as conn:
            rows = conn.execute(sql, params).fetchall()
        return [
            LogEntry(r[0], r[1], r[2], r[3], r[4], Cost(r[5], r[6], r[7]), r[8], r[9])
            for r in reversed(rows)
        ]

    def verify(self) -> list[str]:
        """Consistency problems, empty when sound: SQLite integrity, totals = sum of the log."""
        problems: list[str] = []
        with self._read() as conn:
            problems += [
                f"integrity: {msg}"
                for (msg,) in conn.execute("PRAGMA integrity_check").fetchall()
                if msg != "ok"
            ]
            rows = conn.execute(
                "SELECT k.analyst, k.dataset, t.epsilon, t.delta, t.rho, t.charges, "
                "l.epsilon, l.delta, l.rho, l.charges "
                "FROM (SELECT analyst, dataset FROM totals "
                "      UNION SELECT analyst, dataset FROM charge_log) AS k "
                "LEFT JOIN totals AS t ON t.analyst = k.analyst AND t.dataset = k.dataset "
                "LEFT JOIN (SELECT analyst, dataset, SUM(epsilon) AS epsilon, "
                "           SUM(delta) AS delta, SUM(rho) AS rho, "
                "           SUM(kind = 'charge' AND id > COALESCE((SELECT MAX(id) FROM "
                "               charge_log AS r WHERE r.kind = 'reset' AND r.analyst = "
                "               c.analyst AND r.dataset = c.dataset), 0)) AS charges "
                "           FROM charge_log AS c GROUP BY analyst, dataset) AS l "
                "  ON l.analyst = k.analyst AND l.dataset = k.dataset",
            ).fetchall()
            orphans = conn.execute(
                "SELECT COUNT(*) FROM answers AS a LEFT JOIN charge_log AS c "
                "ON c.id = a.charge_id WHERE c.id IS NULL OR c.analyst != a.analyst "
                "OR c.dataset != a.dataset"
            ).fetchone()[0]
        for analyst, dataset, *vals in rows:
            total = [v or 0 for v in vals[:4]]
            logged = [v or 0 for v in vals[4:]]
            for name, t, s in zip(
                ("epsilon", "delta", "rho", "charges"), total, logged, strict=True
            ):
                if not math.isclose(t, s, rel_tol=1e-9, abs_tol=1e-12):
                    problems.append(
                        f"{analyst!r} on {dataset!r}: total {name} {t!r} != log sum {s!r}"
                    )
        if orphans:
            problems.append(f"{orphans} cached answer(s) without their charge")
        return problems


def _fmt_budget(budget: Budget) -> str:
    return f"epsilon={budget.epsilon:.6g} delta={budget.delta:.3g}"


def _with_share(override: Budget | None, default: Budget) -> Budget:
    """An administrator's override keeps the policy's fixed Gaussian share of the budget."""
    if override is None:
        return default
    return Budget(override.epsilon, override.delta, default.gaussian_share)


def _status(dataset: str, default: Budget, row: tuple[Any, ...]) -> AnalystStatus:
    analyst, eps, delta, rho, charges, b_eps, b_delta = row
    override = b_eps is not None
    budget = _with_share(Budget(b_eps, b_delta), default) if override else default
    return AnalystStatus(
        analyst,
        dataset,
        Cost(eps or 0.0, delta or 0.0, rho or 0.0),
        budget,
        override,
        charges or 0,
    )


def open_ledger(ledger_path: str | os.PathLike[str] | None) -> Ledger:
    """The ledger a policy names (``Policy.ledger_path``); in-memory when it names none."""
    return MemoryLedger() if ledger_path is None else SQLiteLedger(ledger_path)
