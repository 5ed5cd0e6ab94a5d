"""The durable budget ledger and answer cache: one SQLite file, shared by threads and processes.

Why SQLite: it is in the standard library, every transaction is atomic and durable, and the
file lock serialises writers across processes, which is exactly what a budget needs: two
queries racing for the last ε must not both get it. Every charge is ONE ``BEGIN IMMEDIATE``
transaction that re-reads the committed total, checks the budget, appends the log row, updates
the total and stores the released answer. A process killed before ``COMMIT`` leaves nothing
(SQLite rolls the WAL tail back); one killed after keeps the charge and the answer.

Costs are exact rationals (:class:`~dpsql.privacy.accounting.Cost`), stored losslessly as
"numerator/denominator" text next to a REAL copy for people reading the file with ``sqlite3``.
The file and its ``-wal`` / ``-shm`` side files are private to the owner (mode 0600).

Invariant, checked by :meth:`SQLiteLedger.verify`: per (analyst, dataset) the running total is
the sum of the cost columns of the append-only log (a reset is logged as the negated total).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import functools
import getpass
import logging
import math
import os
import secrets
import sqlite3
import stat
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

from dpsql.errors import DatabaseError, InterfaceError, LedgerUnavailableError, OperationalError
from dpsql.privacy.accounting import Budget, Cost, exact
from dpsql.privacy.budget_rules import (
    BudgetRules,
    Clock,
    LimitStatus,
    Pool,
    period_of,
    rules_of,
    stale,
    utc_now,
)
from dpsql.privacy.ledger import (
    AnalystStatus,
    Ledger,
    LogEntry,
    MemoryLedger,
    exhausted,
    not_charged,
    refuse_unless_fits,
    validate_cost,
)

SCHEMA_VERSION = 3
# 2: exact costs as text (epsilon_exact, delta_exact, rho_exact)
# 3: the zCDP sum of each charge and total (zrho, zrho_exact; totals.zrho_at)

# One statement per item (triggers contain ";", so no naive splitting of a script).
_SCHEMA: tuple[str, ...] = (
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
        epsilon_exact TEXT,
        delta_exact TEXT,
        rho_exact TEXT,
        zrho REAL NOT NULL DEFAULT 0,
        zrho_exact TEXT,
        zrho_at TEXT,
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
        plan_hash TEXT NOT NULL,
        epsilon_exact TEXT,
        delta_exact TEXT,
        rho_exact TEXT,
        zrho REAL NOT NULL DEFAULT 0,
        zrho_exact TEXT
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

# Shared and renewing budgets ([budgets] in the policy; dpsql.privacy.budget_rules). Added to
# a version-3 file when it is opened (CREATE ... IF NOT EXISTS; no other table changes), so the
# schema version stays 3. ``pool_totals``: a group's or the dataset's running total per period
# ("" for a budget that never renews); ``charge_pools``: which pool (and period) each charge was
# counted in, so ``verify`` can check every pool total against the log; ``analyst_periods``:
# the period an analyst's renewing total belongs to.
_SHARED_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS pool_totals (
        pool TEXT NOT NULL,
        dataset TEXT NOT NULL,
        period TEXT NOT NULL,
        epsilon REAL NOT NULL DEFAULT 0,
        delta REAL NOT NULL DEFAULT 0,
        rho REAL NOT NULL DEFAULT 0,
        zrho REAL NOT NULL DEFAULT 0,
        epsilon_exact TEXT NOT NULL,
        delta_exact TEXT NOT NULL,
        rho_exact TEXT NOT NULL,
        zrho_exact TEXT NOT NULL,
        charges INTEGER NOT NULL DEFAULT 0,
        updated_at TEXT NOT NULL,
        PRIMARY KEY (pool, dataset, period)
    )""",
    """CREATE TABLE IF NOT EXISTS charge_pools (
        charge_id INTEGER NOT NULL REFERENCES charge_log (id),
        pool TEXT NOT NULL,
        period TEXT NOT NULL,
        PRIMARY KEY (charge_id, pool)
    )""",
    """CREATE TRIGGER IF NOT EXISTS charge_pools_no_update BEFORE UPDATE ON charge_pools
        BEGIN SELECT RAISE(ABORT, 'the charge log is append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS charge_pools_no_delete BEFORE DELETE ON charge_pools
        BEGIN SELECT RAISE(ABORT, 'the charge log is append-only'); END""",
    """CREATE TABLE IF NOT EXISTS analyst_periods (
        analyst TEXT NOT NULL,
        dataset TEXT NOT NULL,
        period TEXT NOT NULL,
        PRIMARY KEY (analyst, dataset)
    )""",
)
_SCHEMA = _SCHEMA + _SHARED_SCHEMA

# Version 1 kept costs as REAL only. Its rows stay readable (an exact column left NULL means
# "the REAL value, read as the decimal it prints as"), and the totals get their exact text from
# the log in the same transaction (see SQLiteLedger._migrate).
_MIGRATE_1_TO_2 = tuple(
    f"ALTER TABLE {table} ADD COLUMN {part}_exact TEXT"
    for table in ("totals", "charge_log")
    for part in ("epsilon", "delta", "rho")
)

# Version 2 had no zCDP sums. Old log rows keep zrho_exact NULL and are read as ρ + ε²/2 of
# their own cost (each was one release, so that is a valid zCDP bound); totals get the exact sum
# of their log rows since the last reset. A total's zrho is trusted only if ``zrho_at`` equals
# its ``updated_at``: a version-2 process still running after the migration updates a total
# without its zrho, and such a total's zrho is recomputed from the log (see _total_zrho).
_MIGRATE_2_TO_3 = (
    "ALTER TABLE totals ADD COLUMN zrho REAL NOT NULL DEFAULT 0",
    "ALTER TABLE totals ADD COLUMN zrho_exact TEXT",
    "ALTER TABLE totals ADD COLUMN zrho_at TEXT",
    "ALTER TABLE charge_log ADD COLUMN zrho REAL NOT NULL DEFAULT 0",
    "ALTER TABLE charge_log ADD COLUMN zrho_exact TEXT",
)

_EXACT = "epsilon_exact, delta_exact, rho_exact"
# One analyst's budget override and total in one statement (SQLiteLedger._standing_in).
_STANDING = (
    "SELECT b.analyst IS NOT NULL, b.epsilon, b.delta, t.analyst IS NOT NULL, t.epsilon, "
    "t.delta, t.rho, t.epsilon_exact, t.delta_exact, t.rho_exact, t.charges, t.zrho_exact, "
    "t.zrho_at, t.updated_at FROM (SELECT 1) "
    "LEFT JOIN budgets AS b ON b.analyst = ? AND b.dataset = ? "
    "LEFT JOIN totals AS t ON t.analyst = ? AND t.dataset = ?"
)

FaultHook = Callable[[str], None]

log = logging.getLogger("dpsql.ledger")

# What to do about a ledger file that exists but cannot be used (named in every refusal).
_RECOVER = (
    "restore it from a backup (dpsql budget restore BACKUP --force), or, if it never held "
    "charges, move it away (a new ledger starts every budget from 0); never delete it to go on"
)


class LedgerPermissionWarning(UserWarning):
    """The ledger file was readable or writable by other users."""


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")


def _actor(actor: str | None) -> str:
    if actor:
        return actor
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry / no login name (containers)
        return f"uid {os.getuid()}"


def _text(value: str) -> str:
    """Text SQLite can store: a lone surrogate (not UTF-8 encodable) becomes ``\\udc80``.

    Query texts and answers are stored, never matched, so an escape loses nothing, and a
    charge can never fail on the text after the budget was checked.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def _exact_texts(cost: Cost) -> tuple[str, str, str]:
    return str(cost.exact_epsilon), str(cost.exact_delta), str(cost.exact_rho)


def _stored_cost(reals: Sequence[Any], texts: Sequence[Any], zrho_text: str | None = None) -> Cost:
    """A cost read back (see :func:`_read_cost`), memoised: a pure function of the stored
    values (Cost is immutable), and a query reads its analyst's total three times (check,
    charge, remaining); parsing the exact fractions was most of the Python a read costs."""
    return _read_cost(tuple(reals), tuple(texts), zrho_text)


@functools.lru_cache(maxsize=1024)
def _read_cost(reals: tuple[Any, ...], texts: tuple[Any, ...], zrho_text: str | None) -> Cost:
    """A cost read back: the exact text, unless it is missing or disagrees with the REAL.

    Missing: a row of schema version 1. Disagreeing: a version-1 process that was already
    running when the file was migrated updated the REAL alone; its value is the newer one.
    ``zrho_text`` is the exact zCDP sum; without it (a row of version 1 or 2) it is ρ + ε²/2
    of the cost read, the bound of a single release.
    """
    parts = []
    for real, text in zip(reals, texts, strict=True):
        real = real or 0.0
        value = None if text is None else Fraction(text)
        if value is None or float(value) != real:
            value = exact(real)
        parts.append(value)
    # every caller passes the three parts (ε, δ, ρ): none of them can fill zrho
    epsilon_delta_rho = cast(tuple[Fraction, Fraction, Fraction], parts)
    return Cost(*epsilon_delta_rho, zrho=None if zrho_text is None else Fraction(zrho_text))


def _private_new_file(path: Path) -> None:
    """Create ``path`` (it must not exist) with mode 0600 whatever the umask.

    SQLite gives the ``-wal`` and ``-shm`` files it creates the main file's mode, so creating
    the main file private first covers them; :func:`_tighten` checks them after opening.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # os.open's mode is masked by the umask
    finally:
        os.close(fd)


def _size(path: Path) -> int:
    """A file's size; 0 when it is missing (or was removed while we looked)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _fsync(path: Path) -> None:
    """Flush a file (or a directory's entries) to disk; best effort where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _reason(name: str, text: str) -> str:
    """A failure's kind in words, for the analyst: no path, no SQLite text."""
    if name.startswith("SQLITE_FULL") or "full" in text:
        return "the disk is full"
    if name.startswith("SQLITE_IOERR") or "I/O" in text:
        return "disk I/O error"
    if name.startswith("SQLITE_READONLY") or "readonly" in text:
        return "the ledger is read-only"
    if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")):
        return "the ledger file is damaged"
    if name.startswith(("SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_AUTH")):
        return "the ledger file cannot be opened"
    return "a storage error"


def _tighten(path: Path) -> None:
    """Make an existing ledger file owner-only (0600), with a warning that it was not."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return
    if not mode & 0o077:
        return
    try:
        os.chmod(path, 0o600)
    except OSError:
        warnings.warn(
            f"the budget ledger {str(path)!r} is accessible to other users (mode "
            f"{mode:04o}) and could not be made private: its query texts and answers are "
            "readable by them; chmod 600 it as its owner",
            LedgerPermissionWarning,
            stacklevel=4,
        )
        return
    warnings.warn(
        f"the budget ledger {str(path)!r} was accessible to other users (mode {mode:04o}); "
        "dpsql made it private (0600)",
        LedgerPermissionWarning,
        stacklevel=4,
    )


def _own_error(exc: Exception) -> Exception:
    """A charge's own failure inside a batch, as :meth:`SQLiteLedger._transaction` would
    raise it for a lone charge."""
    if isinstance(exc, UnicodeEncodeError):  # an analyst, dataset or cache key
        return InterfaceError(
            "a ledger key (analyst, dataset or cache key) is not valid Unicode",
            construct="ledger",
            hint="use names without lone surrogate characters",
        )
    return exc


class _Pending:
    """One charge waiting for its group commit (:meth:`SQLiteLedger._grouped`): its
    statements, run by whichever thread leads the batch it lands in, and what became of it."""

    __slots__ = ("error", "finished", "lead", "wake", "work")

    def __init__(self, work: Callable[[sqlite3.Connection], None]) -> None:
        self.work = work
        self.wake = threading.Event()  # set when finished, or when handed the lead
        self.lead = False
        self.finished = False
        self.error: BaseException | None = None


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
        clock: Clock | None = None,
    ) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._fault_hook = fault_hook
        self._clock: Clock = clock or utc_now  # the renewal periods' clock (tests inject one)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        # group commit of charges (:meth:`_grouped`): those waiting, and whether a thread leads
        self._queue: list[_Pending] = []
        self._queue_lock = threading.Lock()
        self._leading = False
        self._handles: weakref.WeakSet[_Handle] = weakref.WeakSet()
        self._closed = False
        self._opened = False  # messages name the file until it is open (operator-facing)
        if str(self.path) in ("", ":memory:"):
            self._init_schema(new=True)
        else:
            if not os.path.lexists(self.path):
                self._create()
            else:
                _tighten(self.path)
            self._check_existing()
            self._init_schema(new=False)
        for side in ("-wal", "-shm"):
            _tighten(Path(f"{self.path}{side}"))
        self._opened = True

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

    def _error(self, exc: sqlite3.Error, *, committing: bool = False) -> DatabaseError:
        """The error a failed ledger operation raises, logged for the operator with its cause.

        Nothing was charged (:class:`LedgerUnavailableError`, SQLSTATE 53000) unless a write's
        ``COMMIT`` itself failed on an I/O error: then the commit frame may have reached the
        disk, and the caller hears 58000, "may have been charged" (never told "not charged"
        for a charge a restart could bring back). The analyst's message gives the kind of
        failure, never the file or SQLite's text; the log has both.
        """
        text = str(exc)
        name = str(getattr(exc, "sqlite_errorname", "") or type(exc).__name__)
        busy = (
            "locked" in text or "busy" in text or name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED"))
        )
        where = f" {str(self.path)!r}" if not self._opened else ""
        log.log(
            logging.WARNING if busy else logging.ERROR,
            "budget ledger %s: %s (%s)%s",
            self.path,
            text,
            name,
            " at COMMIT of a write" if committing else "",
        )
        if busy:
            return LedgerUnavailableError(
                f"the budget ledger{where} stayed busy for {self.timeout:g} s; nothing was charged",
                construct="ledger",
                hint="retry; if it persists, the operator should look for a process holding "
                "the ledger open",
            )
        if str(self.path) not in ("", ":memory:"):
            self._drop_connection()  # a connection after an I/O error starts afresh
        reason = _reason(name, text)
        if committing and not name.startswith("SQLITE_FULL"):
            return OperationalError(
                f"the budget ledger could not confirm a write ({reason}): the query may have "
                "been charged",
                sqlstate="58000",
                construct="ledger",
                hint="SHOW budget tells whether it was; the operator's log has the cause",
            )
        return LedgerUnavailableError(
            f"the budget ledger{where} is unavailable ({reason}); nothing was charged",
            construct="ledger",
            hint="retry later; the operator's log has the cause"
            if self._opened
            else "check that the ledger's directory exists, is on a local disk with free "
            "space and is writable by dpsql",
        )

    def _drop_connection(self) -> None:
        handle: _Handle | None = getattr(self._local, "handle", None)
        if handle is not None and handle.pid == os.getpid():
            self._local.handle = None
            with contextlib.suppress(sqlite3.Error):
                handle.conn.close()

    @contextmanager
    def _transaction(self, mode: str | None) -> Iterator[sqlite3.Connection]:
        """``BEGIN <mode>`` ... ``COMMIT``; any exception rolls back everything written.
        ``None``: the transaction is already begun (:meth:`_begin_immediate`)."""
        conn = self._conn()
        try:
            if mode is not None:
                conn.execute(f"BEGIN {mode}")
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        committing = False
        try:
            yield conn
            committing = mode is None  # a write's COMMIT: it may reach the disk and fail
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise self._error(exc, committing=committing) from None
            if isinstance(exc, UnicodeEncodeError):  # an analyst, dataset or cache key
                raise InterfaceError(
                    "a ledger key (analyst, dataset or cache key) is not valid Unicode",
                    construct="ledger",
                    hint="use names without lone surrogate characters",
                ) from None
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
            self._begin_immediate()
            with self._transaction(None) as conn:
                yield conn
        finally:
            self._write_lock.release()

    def _begin_immediate(self) -> None:
        """``BEGIN IMMEDIATE``, waiting up to ``timeout`` for another process's writer.

        SQLite's own busy handler sleeps 1, 2, 5, 10, ... 100 ms between tries, and this
        process's writers all queue behind the one sleeping (the Python lock above): with two
        ``--workers`` charging at once, one would often stall the other's charges for tens of
        ms. Polled here instead, from 50 us doubling to 2 ms; every other statement keeps the
        connection's busy timeout.
        """
        conn = self._conn()
        deadline = time.monotonic() + self.timeout
        pause = 50e-6
        try:
            conn.execute("PRAGMA busy_timeout = 0")
            try:
                while True:
                    try:
                        conn.execute("BEGIN IMMEDIATE")
                        return
                    except sqlite3.OperationalError as exc:
                        if "locked" not in str(exc) and "busy" not in str(exc):
                            raise
                        if time.monotonic() >= deadline:
                            raise
                    time.sleep(pause)
                    pause = min(pause * 2, 2e-3)
            finally:
                conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise self._error(exc) from None

    def _read(self) -> AbstractContextManager[sqlite3.Connection]:
        # A read transaction sees one consistent snapshot (WAL), e.g. budget and total together.
        return self._transaction("DEFERRED")

    def _create(self) -> None:
        """A new ledger, created whole: the schema is written to a private (0600) file beside
        it, which is then linked into place. So the ledger's name never shows an empty file,
        and an empty or foreign file found there is refused (:meth:`_check_existing`), never
        taken for a new ledger. A ``-wal`` file without its ledger (the ledger was moved or
        deleted without it) is refused too: SQLite would replay it into the new file."""
        wal = Path(f"{self.path}-wal")
        # The -wal is read before the ledger: a -wal only appears once a ledger is linked into
        # place, so a -wal next to a ledger that now exists is another creator's, who won.
        if _size(wal) > 0:
            if os.path.lexists(self.path):
                return
            raise LedgerUnavailableError(
                f"the budget ledger {str(self.path)!r} is missing but its -wal file {str(wal)!r} "
                "is there: the ledger was moved or deleted without it (its newest charges are "
                "in that file)",
                construct="ledger",
                hint="put the ledger back next to its -wal file, or restore it from a backup "
                "(dpsql budget restore BACKUP --force moves the orphaned -wal aside)",
            )
        tmp = self.path.with_name(f".{self.path.name}.new-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            try:
                _private_new_file(tmp)
                conn = sqlite3.connect(tmp, isolation_level=None)
                try:
                    conn.execute("PRAGMA journal_mode = WAL")
                    conn.execute("BEGIN IMMEDIATE")
                    for statement in _SCHEMA:
                        conn.execute(statement)
                    conn.execute(
                        "INSERT INTO meta (key, value) VALUES ('schema_version', ?)",
                        (str(SCHEMA_VERSION),),
                    )
                    conn.execute("COMMIT")
                finally:
                    conn.close()  # checkpoints the WAL into the file and removes it
                _fsync(tmp)
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    pass  # another process created it first: use theirs
                except OSError:  # a filesystem without hard links
                    if not os.path.lexists(self.path):
                        os.rename(tmp, self.path)
                _fsync(self.path.parent)
            except (OSError, sqlite3.Error) as exc:
                cause = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                log.error("cannot create the budget ledger %s: %s", self.path, cause)
                raise LedgerUnavailableError(
                    f"cannot create the budget ledger {str(self.path)!r}: {cause}",
                    construct="ledger",
                    hint="check that the ledger's directory exists and is writable by dpsql",
                ) from None
        finally:
            for name in (str(tmp), f"{tmp}-wal", f"{tmp}-shm", f"{tmp}-journal"):
                with contextlib.suppress(OSError):
                    os.unlink(name)

    def _check_existing(self) -> None:
        """Refuse a file that is not a dpsql ledger: empty (0 bytes and no ``-wal``),
        unreadable, damaged, or a SQLite database without the ledger's ``meta`` table. Taking
        it for a new ledger would start every budget from 0."""
        path = str(self.path)

        def refuse(what: str) -> LedgerUnavailableError:
            log.error("refusing the budget ledger %s: %s", path, what)
            return LedgerUnavailableError(
                f"the budget ledger {path!r} {what}; dpsql will not take it for a new ledger",
                construct="ledger",
                hint=_RECOVER,
            )

        wal_size = _size(Path(f"{path}-wal"))  # another process may remove it meanwhile
        try:
            size = os.stat(path).st_size
        except OSError as exc:
            raise refuse(f"cannot be read ({exc.strerror})") from None
        if not os.path.isfile(path):
            raise refuse("is not a regular file")
        if size == 0 and wal_size == 0:
            raise refuse("is an empty file (0 bytes)")
        if not os.access(path, os.R_OK | os.W_OK):
            raise refuse("cannot be read and written by this user (permission denied)")
        try:
            conn = sqlite3.connect(path, timeout=self.timeout)
            try:
                found = conn.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
                ).fetchone()
                if found is not None:
                    found = conn.execute(
                        "SELECT value FROM meta WHERE key = 'schema_version'"
                    ).fetchone()
            finally:
                conn.close()
        except sqlite3.Error as exc:
            name = str(getattr(exc, "sqlite_errorname", "") or "")
            if "locked" in str(exc) or "busy" in str(exc):
                raise self._error(exc) from None
            if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")):
                raise refuse(f"is not a SQLite database or is damaged ({exc})") from None
            raise refuse(f"cannot be read ({exc})") from None
        if found is None:
            raise refuse("is a SQLite database without dpsql's ledger tables")

    def _init_schema(self, *, new: bool) -> None:
        """Switch to WAL, create the tables on an in-memory ledger, migrate old versions."""
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
        if version is None and new:
            with self._write() as conn:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(
                    "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
            version = self._schema_version()
        if version == "1":
            self._migrate()
            version = self._schema_version()
        if version == "2":
            self._migrate_zrho()
            version = self._schema_version()
        if version != str(SCHEMA_VERSION):
            raise OperationalError(
                f"the budget ledger {str(self.path)!r} has schema version {version}, "
                f"this dpsql reads version {SCHEMA_VERSION}",
                construct="ledger",
                hint="upgrade dpsql, or point the policy's ledger at another file",
            )
        self._add_shared_tables()

    def _add_shared_tables(self) -> None:
        """The shared-budget tables, added to a file made before them (idempotent)."""
        with self._read() as conn:
            present = conn.execute(
                "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' "
                "AND name IN ('pool_totals', 'charge_pools', 'analyst_periods')"
            ).fetchone()[0]
        if present == 3:
            return
        with self._write() as conn:
            for statement in _SHARED_SCHEMA:
                conn.execute(statement)

    def _migrate(self) -> None:
        """Version 1 → 2 in one transaction: add the exact columns, fill the totals' from the log.

        A total becomes the exact sum of its charges since the last reset, i.e. what the
        float total approximated (float sums could drop tiny charges entirely).
        """
        with self._write() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None or row[0] != "1":
                return  # another process migrated it first
            for statement in _MIGRATE_1_TO_2:
                conn.execute(statement)
            self._add_zrho(conn)
            for analyst, dataset in conn.execute("SELECT analyst, dataset FROM totals").fetchall():
                total = _since_reset(conn, analyst, dataset)
                conn.execute(
                    "UPDATE totals SET epsilon = ?, delta = ?, rho = ?, epsilon_exact = ?, "
                    "delta_exact = ?, rho_exact = ? WHERE analyst = ? AND dataset = ?",
                    (total.epsilon, total.delta, total.rho, *_exact_texts(total), analyst, dataset),
                )
            conn.execute(
                "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
            )

    def _migrate_zrho(self) -> None:
        """Version 2 → 3 in one transaction: add the zCDP columns, fill the totals' from the log."""
        with self._write() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None or row[0] != "2":
                return  # another process migrated it first
            self._add_zrho(conn)
            conn.execute(
                "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
            )

    @staticmethod
    def _add_zrho(conn: sqlite3.Connection) -> None:
        """Add the version-3 columns and set every total's zrho to the sum of its log rows."""
        for statement in _MIGRATE_2_TO_3:
            conn.execute(statement)
        rows = conn.execute("SELECT analyst, dataset, updated_at FROM totals").fetchall()
        for analyst, dataset, updated_at in rows:
            total = _since_reset(conn, analyst, dataset)
            conn.execute(
                "UPDATE totals SET zrho = ?, zrho_exact = ?, zrho_at = ? "
                "WHERE analyst = ? AND dataset = ?",
                (total.zrho, str(total.exact_zrho), updated_at, analyst, dataset),
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
            f"SELECT epsilon, delta, rho, {_EXACT}, charges, zrho_exact, zrho_at, updated_at "
            "FROM totals WHERE analyst = ? AND dataset = ?",
            (analyst, dataset),
        ).fetchone()
        if row is None:
            return Cost(), 0
        return _total_cost(conn, analyst, dataset, row[0:6], row[7:10]), row[6]

    @staticmethod
    def _standing_in(
        conn: sqlite3.Connection, analyst: str, dataset: str, default: Budget, *, legacy: bool
    ) -> tuple[Budget, Cost, int] | None:
        """(budget, spent, charges) from one statement (_budget_in and _spent_in joined): a
        single SELECT reads one snapshot even outside a transaction. None when the total's
        zCDP sum must be recomputed from the log and ``legacy`` is False (the caller then
        reads it inside a transaction)."""
        row = conn.execute(_STANDING, (analyst, dataset, analyst, dataset)).fetchone()
        has_budget, b_eps, b_delta, has_total, *parts = row
        budget = _with_share(Budget(b_eps, b_delta) if has_budget else None, default)
        if not has_total:
            return budget, Cost(), 0
        costs, charges, zrho = tuple(parts[0:6]), parts[6], tuple(parts[7:10])
        if not legacy and (zrho[0] is None or zrho[1] != zrho[2]):
            return None
        return budget, _total_cost(conn, analyst, dataset, costs, zrho), charges

    def standing(self, analyst: str, dataset: str, default: Budget) -> tuple[Budget, Cost]:
        """The analyst's budget and total spent, read together (one statement, ~5x cheaper
        than :meth:`budget` then :meth:`spent`, and one snapshot). With a renewing budget
        ([budgets] renew), the total of a period that has ended reads as zero."""
        rules = rules_of(default)
        if rules is not None and rules.renew is not None:
            own = self.limits(analyst, dataset, default)[0]
            return own.budget, own.spent
        try:
            found = self._standing_in(self._conn(), analyst, dataset, default, legacy=False)
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        except UnicodeEncodeError:
            with self._read() as conn:  # the transaction's own error for such a key
                self._standing_in(conn, analyst, dataset, default, legacy=True)
            raise
        if found is None:
            with self._read() as conn:
                found = self._standing_in(conn, analyst, dataset, default, legacy=True)
                assert found is not None
        return found[0], found[1]

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
            f"query_text, plan_hash, {_EXACT}, zrho, zrho_exact) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                _now(),
                analyst,
                dataset,
                kind,
                cost.epsilon,
                cost.delta,
                cost.rho,
                _text(query_text),
                _text(plan_hash),
                *_exact_texts(cost),
                cost.zrho,
                str(cost.exact_zrho),
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    @staticmethod
    def _set_total(
        conn: sqlite3.Connection, analyst: str, dataset: str, total: Cost, charges: int
    ) -> None:
        conn.execute(
            "INSERT INTO totals (analyst, dataset, epsilon, delta, rho, charges, updated_at, "
            f"{_EXACT}, zrho, zrho_exact, zrho_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (analyst, dataset) DO UPDATE SET "
            "epsilon = excluded.epsilon, delta = excluded.delta, rho = excluded.rho, "
            "charges = excluded.charges, updated_at = excluded.updated_at, "
            "epsilon_exact = excluded.epsilon_exact, delta_exact = excluded.delta_exact, "
            "rho_exact = excluded.rho_exact, zrho = excluded.zrho, "
            "zrho_exact = excluded.zrho_exact, zrho_at = excluded.zrho_at",
            (
                analyst,
                dataset,
                total.epsilon,
                total.delta,
                total.rho,
                charges,
                now := _now(),
                *_exact_texts(total),
                total.zrho,
                str(total.exact_zrho),
                now,
            ),
        )

    def _grouped(self, work: Callable[[sqlite3.Connection], None]) -> None:
        """Run one charge's statements (``work``) in a write transaction, committed, when this
        returns, together with the charges other threads of this process queued meanwhile:
        group commit, one ``BEGIN IMMEDIATE`` ... ``COMMIT`` (one fsync) for the batch.

        Nothing is weaker than one transaction a charge: each charge's ``work`` re-reads the
        committed total *and* the batch's earlier charges (the same connection), so the budget
        check is as strict as one charge after another; a charge returns only after the
        ``COMMIT`` that holds it (pay before reading: the caller runs nothing before). A
        charge's own failure (a refusal: budget exhausted) is undone to its savepoint and
        raised to it alone, nothing written for it; an SQLite error, or a failed ``COMMIT``,
        fails every charge of the batch with the error a lone charge would have got ("nothing
        was charged", or "may have been charged" when the COMMIT itself failed). A batch of
        one runs exactly the statements a charge ran before.

        The first thread to queue leads: it takes the queue, runs and commits it, wakes the
        batch, and hands the lead to the first charge queued meanwhile (which then takes the
        queue, and so on), so under load each batch holds the charges that arrived while the
        previous one was being fsynced."""
        item = _Pending(work)
        with self._queue_lock:
            self._queue.append(item)
            if not self._leading:
                self._leading = item.lead = True
        while not item.lead:
            item.wake.wait()
            if item.finished:
                break
        if not item.finished:
            self._lead()
        if item.error is not None:
            raise item.error

    def _lead(self) -> None:
        with self._queue_lock:
            batch, self._queue = self._queue, []
        try:
            self._commit_batch(batch)
        finally:
            for item in batch:
                item.finished = True
                item.wake.set()
            with self._queue_lock:
                if self._queue:
                    nxt = self._queue[0]
                    nxt.lead = True
                    nxt.wake.set()
                else:
                    self._leading = False

    def _commit_batch(self, batch: list[_Pending]) -> None:
        lone = len(batch) == 1
        try:
            with self._write() as conn:
                for item in batch:
                    if lone:
                        item.work(conn)
                        continue
                    conn.execute("SAVEPOINT dpsql_charge")
                    try:
                        item.work(conn)
                    except sqlite3.Error:
                        raise  # the batch fails as one
                    except Exception as exc:  # this charge's refusal: nothing of it stays
                        conn.execute("ROLLBACK TO dpsql_charge")
                        item.error = _own_error(exc)
                    conn.execute("RELEASE dpsql_charge")
        except BaseException as exc:
            for item in batch:
                if item.error is None:
                    item.error = exc

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
        validate_cost(cost)
        rules = rules_of(default)
        if rules is not None:
            with self._read() as conn:
                limits, _ = self._limits_in(conn, analyst, dataset, default, rules, self._clock())
            refuse_unless_fits(limits, cost)
            return
        budget, spent = self.standing(analyst, dataset, default)
        if not budget.covers(spent + cost):
            raise exhausted(analyst, budget, spent, cost)

    def limits(self, analyst: str, dataset: str, default: Budget) -> list[LimitStatus]:
        """Every budget a charge of ``analyst`` must fit, read in one snapshot: their own
        first, then each group they are in, then the dataset-wide cap ([budgets]); each with
        its spending in its current period."""
        rules = rules_of(default)
        with self._read() as conn:
            if rules is None:
                found = self._standing_in(conn, analyst, dataset, default, legacy=True)
                assert found is not None
                budget, spent, charges = found
                return [LimitStatus("analyst", analyst, budget, spent, "", charges)]
            return self._limits_in(conn, analyst, dataset, default, rules, self._clock())[0]

    def pools(self, dataset: str, default: Budget) -> list[LimitStatus]:
        """Every group's and the dataset-wide budget with its spending this period (for the
        curator page); empty without [budgets]."""
        rules = rules_of(default)
        if rules is None:
            return []
        now = self._clock()
        with self._read() as conn:
            return [self._pool_in(conn, pool, dataset, now) for pool in rules.pools()]

    def _limits_in(
        self,
        conn: sqlite3.Connection,
        analyst: str,
        dataset: str,
        default: Budget,
        rules: BudgetRules,
        now: Any,
    ) -> tuple[list[LimitStatus], Cost | None]:
        """The limits of :meth:`limits`, and the total to release first when the analyst's
        own budget has renewed (None when it has not)."""
        found = self._standing_in(conn, analyst, dataset, default, legacy=True)
        assert found is not None
        budget, spent, charges = found
        period = period_of(rules.renew, now)
        released = None
        if rules.renew is not None:
            row = conn.execute(
                "SELECT period FROM analyst_periods WHERE analyst = ? AND dataset = ?",
                (analyst, dataset),
            ).fetchone()
            if stale(None if row is None else row[0], period):
                released, spent, charges = spent, Cost(), 0
        limits = [LimitStatus("analyst", analyst, budget, spent, period, charges)]
        limits += [self._pool_in(conn, pool, dataset, now) for pool in rules.pools(analyst)]
        return limits, released

    @staticmethod
    def _pool_in(conn: sqlite3.Connection, pool: Pool, dataset: str, now: Any) -> LimitStatus:
        period = period_of(pool.renew, now)
        row = conn.execute(
            "SELECT epsilon_exact, delta_exact, rho_exact, zrho_exact, charges FROM pool_totals "
            "WHERE pool = ? AND dataset = ? AND period = ?",
            (pool.key, dataset, period),
        ).fetchone()
        spent, charges = (Cost(), 0) if row is None else (_pool_cost(row[0:4]), row[4])
        return LimitStatus(pool.kind, pool.name, pool.budget, spent, period, charges)

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

        Committed (and, with ``synchronous = FULL``, fsynced) when it returns, with or without
        an answer: the pipeline calls it with ``answer=None`` before the engine runs, then
        :meth:`remember`. Query text that is not valid UTF-8 is stored escaped, never refused.
        If an answer is already cached under ``cache_key`` (two identical queries raced past
        :meth:`cached`), both are charged and the first answer stays cached: every released
        answer is paid for, and later re-runs all see the same one.
        """
        validate_cost(cost)
        rules = rules_of(default)
        if rules is not None:
            self._charge_shared(
                analyst, dataset, cost, default, rules, (query_text, plan_hash, cache_key, answer)
            )
            return

        def work(conn: sqlite3.Connection) -> None:
            found = self._standing_in(conn, analyst, dataset, default, legacy=True)
            assert found is not None
            budget, spent, charges = found
            total = spent + cost
            if not budget.covers(total):
                raise exhausted(analyst, budget, spent, cost)
            charge_id = self._log(conn, analyst, dataset, "charge", cost, query_text, plan_hash)
            self._fault("logged")
            self._set_total(conn, analyst, dataset, total, charges + 1)
            if cache_key is not None and answer is not None:
                self._store(conn, analyst, dataset, cache_key, answer, charge_id)
            self._fault("written")

        self._grouped(work)

    def _charge_shared(
        self,
        analyst: str,
        dataset: str,
        cost: Cost,
        default: Budget,
        rules: BudgetRules,
        query: tuple[str, str, str | None, str | None],
    ) -> None:
        """:meth:`charge` under [budgets]: ONE transaction re-reads the analyst's total, each
        of their groups' and the dataset's, refuses unless the cost fits every one, and then
        records the charge in all of them. A renewed analyst total is released first (a
        logged "reset" row), in the same transaction, so the log still sums to the total."""
        query_text, plan_hash, cache_key, answer = query

        def work(conn: sqlite3.Connection) -> None:
            now = self._clock()
            limits, released = self._limits_in(conn, analyst, dataset, default, rules, now)
            refuse_unless_fits(limits, cost)
            own = limits[0]
            if released is not None and (
                not released.is_zero or self._has_total(conn, analyst, dataset)
            ):
                text = (
                    f"budget renewed: period {own.period} began ([budgets] renew = "
                    f'"{rules.renew}"); released epsilon={released.epsilon:.6g}, '
                    f"delta={released.delta:.3g}, rho={released.rho:.6g}"
                )
                self._log(conn, analyst, dataset, "reset", -released, text, "")
            charge_id = self._log(conn, analyst, dataset, "charge", cost, query_text, plan_hash)
            self._fault("logged")
            self._set_total(conn, analyst, dataset, own.spent + cost, own.charges + 1)
            for pool, status in zip(rules.pools(analyst), limits[1:], strict=True):
                self._add_to_pool(conn, pool.key, dataset, status, cost, charge_id)
            if rules.renew is not None:
                conn.execute(
                    "INSERT INTO analyst_periods (analyst, dataset, period) VALUES (?, ?, ?) "
                    "ON CONFLICT (analyst, dataset) DO UPDATE SET period = excluded.period "
                    "WHERE excluded.period > analyst_periods.period",
                    (analyst, dataset, own.period),
                )
            if cache_key is not None and answer is not None:
                self._store(conn, analyst, dataset, cache_key, answer, charge_id)
            self._fault("written")

        self._grouped(work)

    @staticmethod
    def _has_total(conn: sqlite3.Connection, analyst: str, dataset: str) -> bool:
        row = conn.execute(
            "SELECT charges FROM totals WHERE analyst = ? AND dataset = ?", (analyst, dataset)
        ).fetchone()
        return row is not None and bool(row[0])

    @staticmethod
    def _add_to_pool(
        conn: sqlite3.Connection,
        key: str,
        dataset: str,
        status: LimitStatus,
        cost: Cost,
        charge_id: int,
    ) -> None:
        total = status.spent + cost
        conn.execute(
            "INSERT INTO pool_totals (pool, dataset, period, epsilon, delta, rho, zrho, "
            f"{_EXACT}, zrho_exact, charges, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (pool, dataset, period) DO UPDATE SET "
            "epsilon = excluded.epsilon, delta = excluded.delta, rho = excluded.rho, "
            "zrho = excluded.zrho, epsilon_exact = excluded.epsilon_exact, "
            "delta_exact = excluded.delta_exact, rho_exact = excluded.rho_exact, "
            "zrho_exact = excluded.zrho_exact, charges = excluded.charges, "
            "updated_at = excluded.updated_at",
            (
                key,
                dataset,
                status.period,
                total.epsilon,
                total.delta,
                total.rho,
                total.zrho,
                *_exact_texts(total),
                str(total.exact_zrho),
                status.charges + 1,
                _now(),
            ),
        )
        conn.execute(
            "INSERT INTO charge_pools (charge_id, pool, period) VALUES (?, ?, ?)",
            (charge_id, key, status.period),
        )

    def remember(self, analyst: str, dataset: str, cache_key: str, answer: str) -> None:
        """Cache the answer of a query already charged: one committed write, no cost change.

        The answer is tied to the newest charge of the analyst on the dataset whose plan hash
        is ``cache_key`` (else their newest charge); with no charge at all it is refused, so
        every cached answer belongs to a charge. Idempotent: the first answer stays.
        """
        with self._write() as conn:
            row = (
                conn.execute(
                    "SELECT id FROM charge_log "
                    "WHERE dataset = ? AND analyst = ? AND kind = 'charge' "
                    "AND plan_hash = ? ORDER BY id DESC LIMIT 1",
                    (dataset, analyst, cache_key),
                ).fetchone()
                or conn.execute(
                    "SELECT id FROM charge_log "
                    "WHERE dataset = ? AND analyst = ? AND kind = 'charge' "
                    "ORDER BY id DESC LIMIT 1",
                    (dataset, analyst),
                ).fetchone()
            )
            if row is None:
                raise not_charged(analyst, dataset)
            self._store(conn, analyst, dataset, cache_key, answer, row[0])

    @staticmethod
    def _store(
        conn: sqlite3.Connection,
        analyst: str,
        dataset: str,
        cache_key: str,
        answer: str,
        charge_id: int,
    ) -> None:
        conn.execute(
            "INSERT OR IGNORE INTO answers (analyst, dataset, cache_key, answer, "
            "charge_id, stored_at) VALUES (?, ?, ?, ?, ?, ?)",
            (analyst, dataset, cache_key, _text(answer), charge_id, _now()),
        )

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
            released = -spent
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
                "SELECT a.analyst, t.epsilon, t.delta, t.rho, t.epsilon_exact, t.delta_exact, "
                "t.rho_exact, t.charges, b.epsilon, b.delta, t.zrho_exact, t.zrho_at, "
                "t.updated_at "
                "FROM (SELECT analyst FROM totals WHERE dataset = :d "
                "      UNION SELECT analyst FROM budgets WHERE dataset = :d) AS a "
                "LEFT JOIN totals AS t ON t.analyst = a.analyst AND t.dataset = :d "
                "LEFT JOIN budgets AS b ON b.analyst = a.analyst AND b.dataset = :d "
                "ORDER BY a.analyst",
                {"d": dataset},
            ).fetchall()
            statuses = [_status(conn, dataset, default, row) for row in rows]
            rules = rules_of(default)
            if rules is None or rules.renew is None:
                return statuses
            period = period_of(rules.renew, self._clock())
            periods = dict(
                conn.execute(
                    "SELECT analyst, period FROM analyst_periods WHERE dataset = ?", (dataset,)
                ).fetchall()
            )
        return [
            dataclasses.replace(s, spent=Cost(), charges=0)
            if stale(periods.get(s.analyst), period)
            else s
            for s in statuses
        ]

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
        where: list[str] = []
        params: list[str | int] = []
        if dataset is not None:
            where.append("dataset = ?")
            params.append(dataset)
        if analyst is not None:
            where.append("analyst = ?")
            params.append(analyst)
        sql = "SELECT id, at, analyst, dataset, kind, epsilon, delta, rho, query_text, plan_hash, "
        sql += f"{_EXACT}, zrho_exact FROM charge_log"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(max(0, int(limit)))
        with self._read() as conn:
            rows = conn.execute(sql, params).fetchall()
        return [
            LogEntry(
                r[0], r[1], r[2], r[3], r[4], _stored_cost(r[5:8], r[10:13], r[13]), r[8], r[9]
            )
            for r in reversed(rows)
        ]

    def verify(self) -> list[str]:
        """Consistency problems, empty when sound: SQLite integrity, totals = sum of the log.

        Exact: per (analyst, dataset), every reset row releases exactly what the log had summed
        to, and the total equals the sum since. Rows of schema version 1 (REAL only) were float
        sums, so where they take part the comparison allows a relative 1e-9.
        """
        with self._read() as conn:
            problems = [
                f"integrity: {msg}"
                for (msg,) in conn.execute("PRAGMA integrity_check").fetchall()
                if msg != "ok"
            ]
            totals = {
                (r[0], r[1]): (_stored_cost(r[2:5], r[5:8], r[9] if r[10] == r[11] else None), r[8])
                for r in conn.execute(
                    f"SELECT analyst, dataset, epsilon, delta, rho, {_EXACT}, charges, "
                    "zrho_exact, zrho_at, updated_at FROM totals"
                ).fetchall()
            }
            trusted = {
                (r[0], r[1])
                for r in conn.execute(
                    "SELECT analyst, dataset FROM totals WHERE zrho_exact IS NOT NULL "
                    "AND zrho_at = updated_at"
                ).fetchall()
            }
            log = conn.execute(
                f"SELECT id, analyst, dataset, kind, epsilon, delta, rho, {_EXACT}, zrho_exact "
                "FROM charge_log ORDER BY id"
            ).fetchall()
            pool_rows = conn.execute(
                "SELECT pool, dataset, period, epsilon_exact, delta_exact, rho_exact, "
                "zrho_exact, charges FROM pool_totals"
            ).fetchall()
            pooled = conn.execute(
                "SELECT p.pool, c.dataset, p.period, c.kind, c.epsilon, c.delta, c.rho, "
                f"c.{_EXACT.replace(', ', ', c.')}, c.zrho_exact FROM charge_pools AS p "
                "LEFT JOIN charge_log AS c ON c.id = p.charge_id ORDER BY p.charge_id"
            ).fetchall()
            orphans = conn.execute(
                "SELECT COUNT(*) FROM answers AS a LEFT JOIN charge_log AS c "
                "ON c.id = a.charge_id WHERE c.id IS NULL OR c.analyst != a.analyst "
                "OR c.dataset != a.dataset"
            ).fetchone()[0]
        sums: dict[tuple[str, str], _LogSum] = {}
        for row_id, analyst, dataset, kind, *parts in log:
            cost, legacy = _stored_cost(parts[0:3], parts[3:6], parts[6]), parts[3] is None
            acc = sums.setdefault((analyst, dataset), _LogSum())
            where = f"{analyst!r} on {dataset!r}: {kind} #{row_id}"
            if kind == "charge":
                acc.add(cost, legacy)
            elif kind == "reset":
                zrho = parts[6] is not None  # a version-2 reset row carries no zCDP sum
                problems += acc.differences(-cost, f"{where} released", legacy, zrho=zrho)
                sums[(analyst, dataset)] = _LogSum()
            elif not cost.is_zero:
                problems.append(f"{where} carries a cost {cost!r}")
        for analyst, dataset in sorted(set(totals) | set(sums)):
            total, charges = totals.get((analyst, dataset), (Cost(), 0))
            acc = sums.get((analyst, dataset), _LogSum())
            problems += acc.differences(
                total, f"{analyst!r} on {dataset!r}: total", zrho=(analyst, dataset) in trusted
            )
            if (charges or 0) != acc.charges:
                problems.append(
                    f"{analyst!r} on {dataset!r}: total charges {charges} != log sum {acc.charges}"
                )
        if orphans:
            problems.append(f"{orphans} cached answer(s) without their charge")
        return problems + _verify_pools(pool_rows, pooled)


class _LogSum:
    """The exact sum of log rows since a reset, and whether a float-only (v1) row is in it."""

    def __init__(self) -> None:
        self.cost = Cost()
        self.charges = 0
        self.legacy = False

    def add(self, cost: Cost, legacy: bool) -> None:
        self.cost = self.cost + cost
        self.charges += 1
        self.legacy = self.legacy or legacy

    def differences(
        self, other: Cost, what: str, legacy: bool = False, *, zrho: bool = False
    ) -> list[str]:
        """'<what> epsilon X != log sum Y' for each part where ``other`` differs from the sum
        (the zCDP sum too when ``zrho``)."""
        loose = self.legacy or legacy
        out = []
        names, mine_parts, their_parts = (
            ["epsilon", "delta", "rho"],
            [*self.cost.parts],
            [*other.parts],
        )
        if zrho:
            names.append("zrho")
            mine_parts.append(self.cost.exact_zrho)
            their_parts.append(other.exact_zrho)
        for name, mine, theirs in zip(names, mine_parts, their_parts, strict=True):
            same = (
                math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=1e-15) if loose else mine == theirs
            )
            if not same:
                out.append(f"{what} {name} {float(theirs)!r} != log sum {float(mine)!r}")
        return out


def _pool_cost(texts: tuple[Any, ...]) -> Cost:
    eps, delta, rho, zrho = (Fraction(t) for t in texts)
    return Cost(eps, delta, rho, zrho=zrho)


def _verify_pools(pool_rows: list[Any], pooled: list[Any]) -> list[str]:
    """Each pool total (group or dataset, per period) equals the exact sum of the charges
    recorded in it, and every recorded charge is a charge of the same dataset."""
    problems = []
    sums: dict[tuple[str, str, str], _LogSum] = {}
    for pool, dataset, period, kind, *parts in pooled:
        if kind != "charge":
            problems.append(f"pool {pool!r} ({period or 'never renews'}) counts a {kind} row")
            continue
        cost = _stored_cost(parts[0:3], parts[3:6], parts[6])
        sums.setdefault((pool, dataset, period), _LogSum()).add(cost, parts[3] is None)
    totals = {(r[0], r[1], r[2]): (_pool_cost(r[3:7]), r[7]) for r in pool_rows}
    for key in sorted(set(totals) | set(sums)):
        total, charges = totals.get(key, (Cost(), 0))
        acc = sums.get(key, _LogSum())
        what = f"pool {key[0]!r} on {key[1]!r} ({key[2] or 'never renews'}): total"
        problems += acc.differences(total, what, zrho=True)
        if charges != acc.charges:
            problems.append(f"{what} charges {charges} != log count {acc.charges}")
    return problems


def _fmt_budget(budget: Budget) -> str:
    return f"epsilon={budget.epsilon:.6g} delta={budget.delta:.3g}"


def _with_share(override: Budget | None, default: Budget) -> Budget:
    """An administrator's override keeps the policy's split of the budget (its Gaussian share
    and the δ share reserved for the zCDP conversion)."""
    if override is None:
        return default
    return dataclasses.replace(default, epsilon=override.epsilon, delta=override.delta)


def _status(
    conn: sqlite3.Connection, dataset: str, default: Budget, row: tuple[Any, ...]
) -> AnalystStatus:
    analyst, *costs, charges, b_eps, b_delta, z_text, z_at, updated_at = row
    override = b_eps is not None
    budget = _with_share(Budget(b_eps, b_delta), default) if override else default
    if updated_at is None:  # a budget override without any charge
        spent = Cost()
    else:
        spent = _total_cost(conn, analyst, dataset, tuple(costs), (z_text, z_at, updated_at))
    return AnalystStatus(analyst, dataset, spent, budget, override, charges or 0)


def _total_cost(
    conn: sqlite3.Connection,
    analyst: str,
    dataset: str,
    parts: tuple[Any, ...],
    zrho: tuple[Any, ...],
) -> Cost:
    """A total read back: ``parts`` are its 3 REALs and 3 exact texts, ``zrho`` is
    (zrho_exact, zrho_at, updated_at). A zrho not written with the total's last update (by a
    version-2 process) is recomputed from the log: never an understated zCDP sum."""
    zrho_text, zrho_at, updated_at = zrho
    if zrho_text is None or zrho_at != updated_at:
        zrho_text = str(_since_reset(conn, analyst, dataset).exact_zrho)
    return _stored_cost(parts[0:3], parts[3:6], zrho_text)


def _since_reset(conn: sqlite3.Connection, analyst: str, dataset: str) -> Cost:
    """The exact sum of the charges logged after the analyst's last reset."""
    rows = conn.execute(
        f"SELECT epsilon, delta, rho, {_EXACT}, zrho_exact FROM charge_log "
        "WHERE dataset = ? AND analyst = ? AND kind = 'charge' AND id > COALESCE("
        "(SELECT MAX(id) FROM charge_log WHERE dataset = ? AND analyst = ? AND kind = 'reset'), 0)",
        (dataset, analyst, dataset, analyst),
    ).fetchall()
    total = Cost()
    for row in rows:
        total = total + _stored_cost(row[0:3], row[3:6], row[6])
    return total


def open_ledger(ledger_path: str | os.PathLike[str] | None) -> Ledger:
    """The ledger a policy names (``Policy.ledger_path``); in-memory when it names none."""
    return MemoryLedger() if ledger_path is None else SQLiteLedger(ledger_path)


# -- backup and restore ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LedgerCopy:
    """What a backup or restore copied: the log rows, totals and cached answers."""

    path: Path
    log_rows: int
    last_id: int
    totals: int
    answers: int


def _counts(conn: sqlite3.Connection, path: Path) -> LedgerCopy:
    log_rows, last_id = conn.execute(
        "SELECT COUNT(*), COALESCE(MAX(id), 0) FROM charge_log"
    ).fetchone()
    totals = conn.execute("SELECT COUNT(*) FROM totals").fetchone()[0]
    answers = conn.execute("SELECT COUNT(*) FROM answers").fetchone()[0]
    return LedgerCopy(path, log_rows, last_id, totals, answers)


def _copy_error(what: str, path: Path, cause: object, hint: str) -> LedgerUnavailableError:
    log.error("%s %s: %s", what, path, cause)
    return LedgerUnavailableError(f"{what} {str(path)!r}: {cause}", construct="ledger", hint=hint)


def _snapshot(source: sqlite3.Connection, dest: Path) -> None:
    """SQLite's online backup of ``source`` into a new private (0600) file ``dest``.

    One step (``pages=-1``) inside one read transaction: a consistent snapshot of the ledger,
    its ``-wal`` included, while other processes keep charging (WAL readers block no one)."""
    _private_new_file(dest)
    target = sqlite3.connect(dest, isolation_level=None)
    try:
        source.backup(target, pages=-1)
    finally:
        target.close()
    _fsync(dest)


def _checked(path: Path) -> tuple[list[str], LedgerCopy]:
    """Open a copy as a ledger (refusing what is not one), verify it, count its rows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerPermissionWarning)
        copy = SQLiteLedger(path)
    with copy:
        problems = copy.verify()
        with copy._read() as conn:
            counts = _counts(conn, path)
    return problems, counts


def _scratch_name(near: Path, what: str) -> Path:
    return near.with_name(f".{near.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}")


def _remove_copy(path: Path) -> None:
    for name in (str(path), f"{path}-wal", f"{path}-shm", f"{path}-journal"):
        with contextlib.suppress(OSError):
            os.unlink(name)


def backup_ledger(
    ledger: str | os.PathLike[str], dest: str | os.PathLike[str], *, force: bool = False
) -> LedgerCopy:
    """Copy a (possibly live) ledger to ``dest`` with SQLite's online backup API, verified.

    Copying the file with ``cp`` is not a backup: the newest charges live in its ``-wal``
    file until a checkpoint, and a copy without it loses them. The backup reads one
    consistent snapshot through SQLite (``-wal`` included) while writers go on, writes it to a
    private scratch file beside ``dest``, verifies it (integrity, totals = the log's sums) and
    renames it into place. ``dest`` must not exist unless ``force``.
    """
    source_path, dest = Path(ledger), Path(dest)
    if not source_path.exists():
        raise _copy_error(
            "no budget ledger at", source_path, "nothing to back up", "check the policy's ledger"
        )
    if os.path.lexists(dest) and not force:
        raise LedgerUnavailableError(
            f"the backup destination {str(dest)!r} exists",
            construct="ledger",
            hint="choose a new file name, or pass --force to replace it",
        )
    if Path(f"{dest}-wal").exists():
        raise LedgerUnavailableError(
            f"the backup destination {str(dest)!r} has a -wal file: it is a live ledger",
            construct="ledger",
            hint="back up to a file no dpsql process uses",
        )
    scratch = _scratch_name(dest, "backup")
    try:
        with SQLiteLedger(source_path) as live:
            try:
                with live._read() as conn:
                    _snapshot(conn, scratch)
            except (OSError, sqlite3.Error) as exc:
                raise _copy_error(
                    "cannot write the backup",
                    dest,
                    exc.strerror if isinstance(exc, OSError) else exc,
                    "check that the destination's directory exists and has free space",
                ) from None
        problems, counts = _checked(scratch)
        if problems:
            raise _copy_error(
                "the backup of",
                source_path,
                "; ".join(problems[:3]),
                "run dpsql budget verify on the ledger",
            )
        os.replace(scratch, dest)
        _fsync(dest.parent)
    finally:
        _remove_copy(scratch)
    return dataclasses.replace(counts, path=dest)


def restore_ledger(
    backup: str | os.PathLike[str], ledger: str | os.PathLike[str], *, force: bool = False
) -> tuple[LedgerCopy, int]:
    """Restore ``ledger`` from a backup; returns what was restored and how many log rows of
    the ledger it replaced are not in the backup (charges that are forgotten: budget given
    back). The backup is copied (online backup API) to a private scratch file and verified
    before anything is touched.

    - No ledger there: the verified copy is linked into place (an orphaned ``-wal`` left by
      a lost ledger is refused, or moved aside with ``force``).
    - A ledger there: refused without ``force``. With it, a readable ledger is overwritten
      through SQLite's backup API *into* it (safe while dpsql processes have it open: they
      see the restored state at their next transaction); a file that is not a ledger (empty,
      damaged) is moved aside to ``<name>.replaced-<time>`` with its side files, never
      deleted.
    """
    backup_path, target = Path(backup), Path(ledger)
    if not backup_path.is_file() or backup_path.stat().st_size == 0:
        raise _copy_error(
            "no backup at", backup_path, "missing or empty", "name a file dpsql budget backup wrote"
        )
    scratch = _scratch_name(target, "restore")
    try:
        try:
            source = sqlite3.connect(f"file:{backup_path}?mode=ro", uri=True)
            try:
                _snapshot(source, scratch)
            finally:
                source.close()
        except (OSError, sqlite3.Error) as exc:
            raise _copy_error(
                "cannot read the backup",
                backup_path,
                exc.strerror if isinstance(exc, OSError) else exc,
                "name a file dpsql budget backup wrote, readable by this user",
            ) from None
        problems, counts = _checked(scratch)  # refuses a file that is not a ledger
        if problems:
            raise _copy_error(
                "the backup",
                backup_path,
                "is not consistent: " + "; ".join(problems[:3]),
                "use another backup",
            )
        forgotten = 0
        if not os.path.lexists(target):
            if _size(Path(f"{target}-wal")) > 0:
                if not force:
                    raise LedgerUnavailableError(
                        f"the ledger {str(target)!r} is missing but its -wal file is there "
                        "(it holds the newest charges of the lost ledger)",
                        construct="ledger",
                        hint="put the ledger back next to it, or pass --force to move the "
                        "-wal aside and restore the backup",
                    )
                _move_aside(target)
            os.link(scratch, target)
            _fsync(target.parent)
        else:
            if not force:
                raise LedgerUnavailableError(
                    f"the ledger {str(target)!r} exists; restoring would replace it",
                    construct="ledger",
                    hint="pass --force to replace it (charges it has that the backup lacks "
                    "are forgotten), or restore to another path",
                )
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", LedgerPermissionWarning)
                    live: SQLiteLedger | None = SQLiteLedger(target)
            except LedgerUnavailableError:
                live = None  # empty, damaged, not a ledger: moved aside below
            if live is None:
                _move_aside(target)
                os.link(scratch, target)
                _fsync(target.parent)
            else:
                with live:
                    with live._read() as conn:
                        forgotten = conn.execute(
                            "SELECT COUNT(*) FROM charge_log WHERE id > ?", (counts.last_id,)
                        ).fetchone()[0]
                    source = sqlite3.connect(scratch)
                    try:
                        with live._write_lock:
                            source.backup(live._conn(), pages=-1)
                    except sqlite3.Error as exc:
                        raise live._error(exc) from None
                    finally:
                        source.close()
        problems, restored = _checked(target)
        if problems:
            raise _copy_error(
                "the restored ledger", target, "; ".join(problems[:3]), "restore again"
            )
        log.warning(
            "budget ledger %s restored from %s (%d log rows; %d newer rows forgotten)",
            target,
            backup_path,
            restored.log_rows,
            forgotten,
        )
        return restored, forgotten
    finally:
        _remove_copy(scratch)


def _move_aside(path: Path) -> None:
    """Rename a ledger file that cannot be used, and its side files, out of the way."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
    for side in ("", "-wal", "-shm"):
        name = Path(f"{path}{side}")
        if os.path.lexists(name):
            os.rename(name, Path(f"{path}.replaced-{stamp}{side}"))
