"""The budget ledger's file: created whole, checked, migrated, and opened once per thread.

What :class:`LedgerFile` guarantees, below the ledger's meaning (dpsql.privacy.sqlite_ledger):
a new ledger's name never shows an empty file (it is written aside and linked into place); an
empty, foreign or damaged file, or a ``-wal`` without its ledger, is refused, never taken for a
new ledger; each thread has its own connection; every transaction either commits whole or rolls
back, and a failure reaches the analyst as "nothing was charged" (53000) unless a write's COMMIT
itself failed ("may have been charged", 58000). The file and its side files are private (0600).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import sqlite3
import stat
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from fractions import Fraction
from pathlib import Path
from typing import Any, Self, cast

from dpsql.errors import DatabaseError, InterfaceError, LedgerUnavailableError, OperationalError
from dpsql.privacy.accounting import Cost, exact

SCHEMA_VERSION = 3


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


log = logging.getLogger("dpsql.ledger")


# What to do about a ledger file that exists but cannot be used (named in every refusal).
_RECOVER = (
    "restore it from a backup (dpsql budget restore BACKUP --force), or, if it never held "
    "charges, move it away (a new ledger starts every budget from 0); never delete it to go on"
)


class LedgerPermissionWarning(UserWarning):
    """The ledger file was readable or writable by other users."""


def private_new_file(path: Path) -> None:
    """Create ``path`` (it must not exist) with mode 0600 whatever the umask.

    SQLite gives the ``-wal`` and ``-shm`` files it creates the main file's mode, so creating
    the main file private first covers them; :func:`_tighten` checks them after opening.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # os.open's mode is masked by the umask
    finally:
        os.close(fd)


def file_size(path: Path) -> int:
    """A file's size; 0 when it is missing (or was removed while we looked)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def fsync_path(path: Path) -> None:
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
            stacklevel=5,
        )
        return
    warnings.warn(
        f"the budget ledger {str(path)!r} was accessible to other users (mode {mode:04o}); "
        "dpsql made it private (0600)",
        LedgerPermissionWarning,
        stacklevel=5,
    )


class _Handle:
    """Holds one thread's connection (sqlite3.Connection cannot be weakly referenced)."""

    __slots__ = ("__weakref__", "conn", "pid")

    def __init__(self, conn: sqlite3.Connection, pid: int) -> None:
        self.conn = conn
        self.pid = pid


EXACT_COLUMNS = "epsilon_exact, delta_exact, rho_exact"


def exact_texts(cost: Cost) -> tuple[str, str, str]:
    return str(cost.exact_epsilon), str(cost.exact_delta), str(cost.exact_rho)


def stored_cost(reals: Sequence[Any], texts: Sequence[Any], zrho_text: str | None = None) -> Cost:
    """A cost read back (see :func:`read_cost`), memoised: a pure function of the stored
    values (Cost is immutable), and a query reads its analyst's total three times (check,
    charge, remaining); parsing the exact fractions was most of the Python a read costs."""
    return read_cost(tuple(reals), tuple(texts), zrho_text)


@functools.lru_cache(maxsize=1024)
def read_cost(reals: tuple[Any, ...], texts: tuple[Any, ...], zrho_text: str | None) -> Cost:
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


def pool_cost(texts: tuple[Any, ...]) -> Cost:
    eps, delta, rho, zrho = (Fraction(t) for t in texts)
    return Cost(eps, delta, rho, zrho=zrho)


def since_reset(conn: sqlite3.Connection, analyst: str, dataset: str) -> Cost:
    """The exact sum of the charges logged after the analyst's last reset."""
    rows = conn.execute(
        f"SELECT epsilon, delta, rho, {EXACT_COLUMNS}, zrho_exact FROM charge_log "
        "WHERE dataset = ? AND analyst = ? AND kind = 'charge' AND id > COALESCE("
        "(SELECT MAX(id) FROM charge_log WHERE dataset = ? AND analyst = ? AND kind = 'reset'), 0)",
        (dataset, analyst, dataset, analyst),
    ).fetchall()
    total = Cost()
    for row in rows:
        total = total + stored_cost(row[0:3], row[3:6], row[6])
    return total


class LedgerFile:
    """One SQLite ledger file: its creation, checks, schema, per-thread connections and
    transactions. :class:`~dpsql.privacy.sqlite_ledger.SQLiteLedger` gives it its meaning."""

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 30.0) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
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
        if file_size(wal) > 0:
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
                private_new_file(tmp)
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
                fsync_path(tmp)
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    pass  # another process created it first: use theirs
                except OSError:  # a filesystem without hard links
                    if not os.path.lexists(self.path):
                        os.rename(tmp, self.path)
                fsync_path(self.path.parent)
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

        wal_size = file_size(Path(f"{path}-wal"))  # another process may remove it meanwhile
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
                total = since_reset(conn, analyst, dataset)
                conn.execute(
                    "UPDATE totals SET epsilon = ?, delta = ?, rho = ?, epsilon_exact = ?, "
                    "delta_exact = ?, rho_exact = ? WHERE analyst = ? AND dataset = ?",
                    (total.epsilon, total.delta, total.rho, *exact_texts(total), analyst, dataset),
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
            total = since_reset(conn, analyst, dataset)
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
