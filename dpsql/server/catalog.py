"""Catalog and session queries, answered from an empty shadow schema — never from private data.

The shadow (built by :mod:`dpsql.server.catalog_worker`) is an in-memory DuckDB database holding
(a) the policy's tables with the same names, columns and types and zero rows, (b) our own
``pg_catalog`` (schema ``pgc``) and ``information_schema`` (schema ``infs``) tables filled from
the policy, and (c) macros for the PostgreSQL functions clients call (``format_type``,
``pg_get_userbyid``, ...). External access is off and the configuration locked, so a query
routed here can read nothing but the public schema.

Client SQL is translated by :mod:`dpsql.server.catalog_sql` and checked against the function
whitelist of :mod:`dpsql.server.catalog_limits`; only queries are ever executed. Each statement
runs in one of a few shadow *processes* shared by every session of the server, under
:class:`~dpsql.server.catalog_limits.CatalogLimits`: a short statement timeout (the process
interrupts itself; one that does not answer in time is killed and replaced), result caps counted
while fetching, DuckDB's memory limit and an address-space limit. Statements queue for a free
process; a full queue is refused at once, so catalog queries never hold more than
``processes + queue`` of the server's query threads and DP queries keep the rest.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import duckdb

from dpsql.access import access_for
from dpsql.server import catalog_schema as cs
from dpsql.server import types as t
from dpsql.server.backend import inline_parameters
from dpsql.server.catalog_limits import CatalogLimits
from dpsql.server.catalog_sql import CatalogError, SessionInfo, rewrite
from dpsql.server.catalog_worker import INTERRUPT, ShadowSpec

log = logging.getLogger("dpsql.server")

GRACE = 1.0  # seconds past the statement timeout before a silent shadow process is killed


@dataclass(frozen=True)
class CatalogResult:
    columns: tuple[tuple[str, int], ...]  # (name, type OID)
    rows: list[tuple]


class Shadow:
    """The shadow catalog of one server: its shadow processes and their limits."""

    def __init__(
        self,
        policy: object,
        dataset: str,
        settings: Mapping[str, str],
        limits: CatalogLimits | None = None,
    ) -> None:
        self.dataset = dataset
        self.policy = policy
        self.tables = _tables_from_policy(policy)
        self.limits = limits if limits is not None else CatalogLimits()
        self._settings = dict(settings)
        spec = ShadowSpec(tuple(self.tables), dataset, self._settings, self.limits)
        self._pool = _Pool(spec)  # every table: the analysts [access] does not restrict
        # per view (the tables and columns some analysts may query): its own shadow, started
        # on first use, holding nothing else, so no catalog query can show what it lacks
        self._views: dict[tuple, _Pool] = {}
        self._views_lock = threading.Lock()

    def cursor(self) -> ShadowCursor:
        return ShadowCursor(self._pool, self.pool_for)

    def pool_for(self, user: str) -> _Pool:
        """The shadow that answers ``user``: only the tables and columns they may query."""
        access = access_for(self.policy, user) if hasattr(self.policy, "access") else None
        if access is None:
            return self._pool
        tables = tuple(
            cs.CatalogTable(
                table.oid,
                table.name,
                tuple(c for c in table.columns if c.name.lower() not in hidden),
            )
            for table in self.tables
            if access.may_read(table.name)
            for hidden in [access.denied_columns.get(table.name, frozenset())]
        )
        key = tuple((table.name, tuple(c.name for c in table.columns)) for table in tables)
        with self._views_lock:
            pool = self._views.get(key)
            if pool is None:
                spec = ShadowSpec(tables, self.dataset, self._settings, self.limits)
                pool = self._views[key] = _Pool(spec)
        return pool

    def close(self) -> None:
        self._pool.close()
        with self._views_lock:
            views, self._views = list(self._views.values()), {}
        for pool in views:
            pool.close()


class ShadowCursor:
    """One session's handle on the shadow; ``run`` is blocking (call it from a worker thread)."""

    def __init__(self, pool: _Pool, pool_for: Callable[[str], _Pool] | None = None) -> None:
        self._pool = pool
        self._pool_for = pool_for  # the shadow of the analyst's view ([access]), by login
        self._waiting = pool  # the pool the running statement waits in
        self._lock = threading.Lock()
        self._process: _Process | None = None
        self._request = 0
        self._cancelled = False

    def run(self, sql: str, params: Sequence[object] | None, info: SessionInfo) -> CatalogResult:
        text = sql
        if params:
            # Inline bound values as literals, so rewriting sees them (current_setting($1),
            # $1::regclass). Safe here: literals are escaped, and the shadow holds no data.
            text = inline_parameters(sql, params)
        limits = self._pool.limits
        _check_length(text, limits)
        # The statement takes its turn before it is even parsed: rewriting is the costly part
        # of a long text, and it then runs under the same bounds as the statement itself.
        with self._turn(info.user) as process:
            duck_sql = rewrite(text, info, source=sql, max_series=limits.max_series)
            _check_one_query(duck_sql)
            description, rows = self._execute(process, duck_sql)
        columns = tuple((name, _column_oid(name, duck_type)) for name, duck_type in description)
        return CatalogResult(columns, rows)

    def describe(self, sql: str, info: SessionInfo) -> tuple[tuple[str, int], ...]:
        """Result columns of a catalog query, by describing it (it reads no private data)."""
        _check_length(sql, self._pool.limits)
        with self._turn(info.user) as process:
            duck_sql = rewrite(sql, info, max_series=self._pool.limits.max_series)
            _check_one_query(duck_sql)
            _, rows = self._execute(process, f"DESCRIBE {duck_sql}")
        return tuple((str(r[0]), t.duckdb_type_oid(str(r[1]))) for r in rows)

    @contextlib.contextmanager
    def _turn(self, user: str) -> Iterator[_Process]:
        """A shadow process for one statement of ``user``, given back (or replaced) after."""
        pool = self._pool if self._pool_for is None else self._pool_for(user)
        with self._lock:
            self._cancelled = False
            self._waiting = pool
        process = pool.acquire(user, lambda: self._cancelled)
        try:
            yield process
        finally:
            with self._lock:
                self._process = None
            pool.release(process, user)

    def _execute(self, process: _Process, duck_sql: str) -> tuple[list[tuple[str, str]], list]:
        with self._lock:
            self._process, self._request = process, process.next_request()
            if self._cancelled:  # cancelled while it waited for this process
                process.interrupt(self._request)
        limits = self._pool.limits
        reply = process.run(self._request, duck_sql, limits.timeout + GRACE, self._pool.max_reply)
        try:
            return _result(reply, limits)
        except _Unhealthy:
            process.dirty = True
            raise

    def interrupt(self) -> None:
        """Cancel the running statement (called from the event loop: never blocks)."""
        with self._lock:
            if self._process is not None:
                self._process.interrupt(self._request)
            else:
                self._cancelled = True
            waiting = self._waiting
        waiting.wake()

    def close(self) -> None:
        self.interrupt()


def _check_length(text: str, limits: CatalogLimits) -> None:
    if len(text) > limits.max_text:
        raise CatalogError(
            f"catalog query text exceeds {limits.max_text} characters",
            "54000",
            hint="client catalog queries are a few kilobytes; split the query or shorten its lists",
        )


def _check_one_query(duck_sql: str) -> None:
    try:
        statements = duckdb.extract_statements(duck_sql)
    except duckdb.Error as exc:
        raise CatalogError(_clean(_first_line(exc)), "42601") from None
    if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
        raise CatalogError(
            "cannot execute this statement: dpsql is read-only",
            "25006",
            hint="only queries are accepted; private tables are answered with "
            "differential privacy, the catalog from the policy",
        )


class _Unhealthy(CatalogError):
    """A failure after which the shadow process is not reused (see ``_Process.dirty``)."""


def _result(reply: Any, limits: CatalogLimits) -> tuple[list[tuple[str, str]], list[tuple]]:
    """A shadow process's reply as (description, rows), or the error it stands for."""
    kind = reply[0] if isinstance(reply, tuple) and reply else None
    if kind == "ok" and len(reply) == 3:
        try:
            description = [(str(name), str(duck_type)) for name, duck_type in reply[1]]
            rows = [tuple(row) for row in reply[2]]
        except (TypeError, ValueError):
            rows, description = [()], []
        if all(len(row) == len(description) for row in rows):
            return description, rows
    elif kind == "limit" and len(reply) == 3:
        rows_cap, bytes_cap = f"{limits.max_rows} rows", _amount(limits.max_bytes)
        raise CatalogError(
            f"catalog query result exceeds {rows_cap if reply[1] == 'rows' else bytes_cap}",
            "54000",
            hint=f"catalog answers are capped at {rows_cap} and {bytes_cap}; add WHERE or LIMIT",
        )
    elif kind == "timeout":
        raise CatalogError(
            "canceling statement due to statement timeout",
            "57014",
            hint=f"catalog statements may run for {limits.timeout:g} s; "
            "narrow the query (client introspection takes milliseconds)",
        )
    elif kind == "cancelled":
        raise CatalogError("canceling statement due to user request", "57014")
    elif kind == "memory":
        raise CatalogError(
            "out of memory in a catalog query",
            "53200",
            hint=f"catalog statements may use {limits.memory_limit}; narrow the query",
        )
    elif kind == "error" and len(reply) == 3:
        message = _clean(str(reply[2]))
        state = {"parser": "42601", "binder": "42703"}.get(str(reply[1]), "XX000")
        if reply[1] == "catalog":
            state = _catalog_state(message)
        raise CatalogError(message, state)
    raise _Unhealthy("internal error in the catalog", "XX000", hint="see the server log")


# Catalog columns PostgreSQL types as ``name`` (OID 19); DuckDB has no such type, so a VARCHAR
# result column with one of these names is described as ``name``, as PostgreSQL would.
_NAME_COLUMNS = {
    "relname", "attname", "typname", "nspname", "datname", "proname", "conname", "rolname",
    "usename", "collname", "spcname", "amname", "extname", "lanname", "tgname", "rulename",
    "polname", "stxname", "pubname", "enumlabel", "evtname", "srvname", "opcname", "oprname",
    "schemaname", "tablename", "indexname", "viewname", "matviewname",
}  # fmt: skip


def _column_oid(name: str, duck_type: str) -> int:
    oid = t.duckdb_type_oid(duck_type)
    return t.NAME if oid == t.TEXT and name.lower() in _NAME_COLUMNS else oid


def _catalog_state(text: str) -> str:
    if "Table with name" in text or ("does not exist" in text and "Table" in text):
        return "42P01"
    if "Function" in text:
        return "42883"
    return "42704"


def _clean(text: str) -> str:
    for prefix in ("Catalog Error: ", "Binder Error: ", "Parser Error: ", "Conversion Error: "):
        text = text.removeprefix(prefix)
    return text.replace("pgc.", "pg_catalog.").replace("infs.", "information_schema.")


def _tables_from_policy(policy: object) -> list[cs.CatalogTable]:
    tables = []
    policy_tables = getattr(policy, "tables", {})
    for i, (name, table) in enumerate(sorted(policy_tables.items())):
        cols = tuple(
            cs.CatalogColumn(
                col.name,
                t.POLICY_TYPE_OIDS.get(col.type, t.TEXT),
                bool(getattr(col, "nullable", True)),
            )
            for col in table.columns.values()
        )
        tables.append(cs.CatalogTable(cs.FIRST_TABLE_OID + 2 * i, name, cols))
    return tables


def _amount(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 and size % (1 << 20) == 0 else f"{size} bytes"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --------------------------------------------------------------------------------------------
# shadow processes

# The only classes a reply may contain besides builtins: what DuckDB returns for catalog values
# (after the process turned time zones into fixed offsets). A shadow process runs analyst SQL;
# its replies are decoded as data, never as code.
_REPLY_CLASSES = {
    ("datetime", "date"),
    ("datetime", "datetime"),
    ("datetime", "time"),
    ("datetime", "timedelta"),
    ("datetime", "timezone"),
    ("decimal", "Decimal"),
    ("uuid", "UUID"),
}


class _ReplyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _REPLY_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a catalog reply")


def load_reply(data: bytes) -> Any:
    """A shadow process's reply; only plain values and the date, decimal and UUID types."""
    return _ReplyUnpickler(io.BytesIO(data)).load()


class _Process:
    """One running shadow process and its two sockets."""

    def __init__(self, popen: subprocess.Popen, conn: Connection, intr: socket.socket) -> None:
        self._popen = popen
        self._conn = conn
        self._intr = intr
        self._requests = itertools.count(1)
        self.dirty = False  # a request is in flight or its reply was not read: never reuse

    @classmethod
    def start(cls, spec: ShadowSpec) -> _Process:
        data, data_child = socket.socketpair()
        intr, intr_child = socket.socketpair()
        fds = (data_child.fileno(), intr_child.fileno())
        try:
            popen = subprocess.Popen(
                [sys.executable, "-m", "dpsql.server.catalog_worker", *map(str, fds)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=_child_environment(),
            )
        finally:
            data_child.close()
            intr_child.close()
        intr.setblocking(False)
        process = cls(popen, Connection(data.detach()), intr)
        try:
            process._conn.send_bytes(pickle.dumps(spec))
            if not process._conn.poll(spec.limits.start_timeout):
                raise RuntimeError(f"no answer within {spec.limits.start_timeout:g} s")
            reply = load_reply(process._conn.recv_bytes(1 << 16))
        except BaseException:
            process.kill()
            raise
        if reply != ("ready",):
            process.kill()
            raise RuntimeError(str(reply[1]) if isinstance(reply, tuple) else repr(reply))
        return process

    def next_request(self) -> int:
        return next(self._requests)

    def run(self, request: int, sql: str, wait: float, max_reply: int) -> Any:
        """The reply to one statement; raises :class:`_Unhealthy` if none comes in time."""
        self.dirty = True
        try:
            self._conn.send_bytes(pickle.dumps((request, sql)))
            if not self._conn.poll(wait):
                raise _Unhealthy(
                    "canceling statement due to statement timeout",
                    "57014",
                    hint="the catalog statement did not stop when interrupted; narrow it",
                )
            answered, reply = load_reply(self._conn.recv_bytes(max_reply))
            if answered != request:
                raise ValueError(f"reply to statement {answered} instead of {request}")
            self.dirty = False
            return reply
        except (EOFError, OSError, pickle.UnpicklingError, ValueError, TypeError) as exc:
            log.warning("shadow process %s failed: %s", self._popen.pid, exc)
            raise _Unhealthy(
                "the catalog query failed", "XX000", hint="see the server log"
            ) from None

    def interrupt(self, request: int) -> None:
        with contextlib.suppress(OSError):  # gone, or a full buffer of earlier interrupts
            self._intr.send(INTERRUPT.pack(request))

    def kill(self) -> None:
        for closing in (self._conn.close, self._intr.close, self._popen.kill):
            with contextlib.suppress(OSError):
                closing()
        try:
            self._popen.wait(5)
        except subprocess.TimeoutExpired:
            log.warning("shadow process %s did not exit", self._popen.pid)


def _child_environment() -> dict[str, str]:
    """The server's environment, with this copy of dpsql importable first."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@dataclass(eq=False)
class _Ticket:
    """A statement waiting for a shadow process, and whose it is."""

    user: str


class _Pool:
    """The shadow processes of a server, handed out in arrival order, fairly between analysts.

    No analyst may run on every process at once (``processes - 1`` each, at least one) or hold
    more than half of the queue, so one analyst's statements never lock out another's
    ``\\d``; when the queue is full a statement is refused at once instead of holding a
    query thread.
    """

    def __init__(self, spec: ShadowSpec) -> None:
        self.spec = spec
        self.limits = spec.limits
        # a reply's pickle: up to 4 bytes per counted character, plus per-value overhead
        self.max_reply = 4 * spec.limits.max_bytes + (16 << 20)
        self._per_user = max(1, self.limits.processes - 1)
        self._per_user_queue = max(1, self.limits.queue // 2)
        self._cond = threading.Condition()
        self._idle: list[_Process] = []
        self._running: dict[str, int] = {}
        self._busy = 0
        self._starting = 0
        self._ready_once = False
        self._failure: str | None = None
        self._waiting: deque[_Ticket] = deque()
        self._closed = False
        for _ in range(self.limits.processes):
            self._spawn()

    def _spawn(self) -> None:
        """Start a process in the background (called with the lock held or at construction)."""
        self._starting += 1
        threading.Thread(target=self._start_one, name="dpsql-shadow-start", daemon=True).start()

    def _start_one(self) -> None:
        process: _Process | None = None
        try:
            process = _Process.start(self.spec)
        except Exception as exc:
            log.error("a shadow catalog process failed to start: %s", exc)
            failure: str | None = str(exc)
        else:
            failure = None
        with self._cond:
            self._starting -= 1
            self._failure = failure
            if process is not None and self._closed:
                process.kill()
            elif process is not None:
                self._ready_once = True
                self._idle.append(process)
            self._cond.notify_all()

    def acquire(self, user: str, cancelled: Callable[[], bool]) -> _Process:
        """A free process for ``user``'s statement, waiting in line for one; refused at once
        when the line (or the analyst's share of it) is full."""
        ticket = _Ticket(user)
        with self._cond:
            if self._closed:
                raise CatalogError("the server is shutting down", "57P01")
            if self._idle and self._eligible(ticket) and self._first_eligible() is None:
                return self._take(ticket)
            mine = sum(1 for waiting in self._waiting if waiting.user == user)
            if len(self._waiting) >= self.limits.queue or mine >= self._per_user_queue:
                raise self._busy_error()
            self._waiting.append(ticket)
            try:
                return self._wait_for_turn(ticket, cancelled)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()

    def _eligible(self, ticket: _Ticket) -> bool:
        return self._running.get(ticket.user, 0) < self._per_user

    def _first_eligible(self) -> _Ticket | None:
        return next((w for w in self._waiting if self._eligible(w)), None)

    def _wait_for_turn(self, ticket: _Ticket, cancelled: Callable[[], bool]) -> _Process:
        limits = self.limits
        patience = limits.timeout * (1 + limits.queue / limits.processes) + GRACE
        deadline = time.monotonic() + (patience if self._ready_once else limits.start_timeout)
        while True:
            if self._closed:
                raise CatalogError("the server is shutting down", "57P01")
            if cancelled():
                raise CatalogError("canceling statement due to user request", "57014")
            if self._idle and self._first_eligible() is ticket:
                return self._take(ticket)
            if not (self._idle or self._busy or self._starting):
                if self._failure is not None:
                    self._failure = None  # the next statement tries to start one again
                    raise CatalogError(
                        "the catalog is not available",
                        "58000",
                        hint="a shadow catalog process failed to start; see the server log",
                    )
                self._spawn()
                deadline = max(deadline, time.monotonic() + limits.start_timeout)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._busy_error()
            self._cond.wait(remaining)

    def _take(self, ticket: _Ticket) -> _Process:
        self._busy += 1
        self._running[ticket.user] = self._running.get(ticket.user, 0) + 1
        return self._idle.pop()

    def _busy_error(self) -> CatalogError:
        return CatalogError(
            "too many catalog queries at once",
            "53000",
            hint=f"the server runs {self.limits.processes} catalog statements at a time "
            f"(each analyst at most {self._per_user}) and queues {self.limits.queue}; "
            "try again in a moment",
        )

    def release(self, process: _Process, user: str) -> None:
        healthy = not process.dirty
        with self._cond:
            self._busy -= 1
            left = self._running.pop(user, 1) - 1
            if left:
                self._running[user] = left
            keep = healthy and not self._closed
            if keep:
                self._idle.append(process)
            elif not self._closed:
                self._spawn()
            self._cond.notify_all()
        if not keep:
            process.kill()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for process in idle:
            process.kill()
