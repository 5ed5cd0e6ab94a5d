"""One shadow process: the empty catalog database, answering catalog statements one at a time.

Started by :mod:`dpsql.server.catalog` as ``python -m dpsql.server.catalog_worker DATA INTR``
with two socket file descriptors: DATA carries requests and replies (length-prefixed pickles),
INTR carries the ids of statements to interrupt (8 bytes each). The first request is the
:class:`ShadowSpec` to build from.

Catalog SQL is analyst-controlled, and DuckDB neither interrupts a scalar function midway nor
counts every allocation against its ``memory_limit`` (``len(range(10^9))`` ran 50 s and took
20 GB in-process). In a process of its own such a statement costs its own address space
(capped with ``RLIMIT_AS``, so it fails with an out-of-memory error) and at worst its own life
(the server kills a process that outlives the statement timeout): never the server's.
The process holds no private data, and the server trusts nothing it sends back
(:func:`dpsql.server.catalog.load_reply`).
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
import socket
import struct
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import duckdb

from dpsql.engine.limits import LimitExceeded, ResultCaps, Watchdog, fetch_capped
from dpsql.server import catalog_schema as cs
from dpsql.server import types as t
from dpsql.server.catalog_limits import CatalogLimits

INTERRUPT = struct.Struct("!Q")


@dataclass(frozen=True)
class ShadowSpec:
    """What a shadow process is built from: the policy's public schema and the limits."""

    tables: tuple[cs.CatalogTable, ...]
    dataset: str
    settings: Mapping[str, str]
    limits: CatalogLimits


def build(spec: ShadowSpec) -> duckdb.DuckDBPyConnection:
    """The shadow database: empty policy tables, pg_catalog/information_schema, macros; sealed."""
    db = duckdb.connect(":memory:", config={"threads": 1})
    db.execute("CREATE SCHEMA public")
    db.execute("CREATE SCHEMA pgc")
    db.execute("CREATE SCHEMA infs")
    for table in spec.tables:
        cols = ", ".join(f'"{c.name}" {_duck_type(c.type_oid)}' for c in table.columns)
        db.execute(f'CREATE TABLE public."{table.name}" ({cols})')
    _build_pg_catalog(db, spec)
    _build_information_schema(db, spec.tables, spec.dataset)
    # No temp directory: DuckDB would otherwise add it (".tmp" under the working directory,
    # where another DuckDB may spill) to the paths readable despite the lock below.
    db.execute("SET temp_directory = ''")
    db.execute(f"SET memory_limit = '{spec.limits.memory_limit}'")
    db.execute("SET enable_external_access = false")
    db.execute("SET lock_configuration = true")
    return db


def _build_pg_catalog(db: duckdb.DuckDBPyConnection, spec: ShadowSpec) -> None:
    for name, cols in cs.PG_TABLES.items():
        spec_sql = ", ".join(f'"{c}" {ty}' for c, ty in cols)
        db.execute(f"CREATE TABLE pgc.{name} ({spec_sql})")
    rows = {
        "pg_type": cs.rows_pg_type(),
        "pg_namespace": cs.rows_pg_namespace(),
        "pg_class": cs.rows_pg_class(spec.tables),
        "pg_attribute": cs.rows_pg_attribute(spec.tables),
        "pg_database": cs.rows_pg_database(spec.dataset),
        "pg_settings": cs.rows_pg_settings(dict(spec.settings)),
        **cs.FIXED_ROWS,
    }
    for name, data in rows.items():
        if data:
            marks = ", ".join("?" * len(data[0]))
            db.executemany(f"INSERT INTO pgc.{name} VALUES ({marks})", data)
    db.execute("CREATE TABLE pgc.dp_type_names (oid UINTEGER, f VARCHAR)")
    db.executemany(
        "INSERT INTO pgc.dp_type_names VALUES (?, ?)",
        [(oid, cs.format_type(oid)) for oid in t.PG_TYPES],
    )
    for name, body in cs.PG_VIEWS.items():
        db.execute(f"CREATE VIEW pgc.{name} AS {body}")
    for name, overloads in cs.MACROS:
        defs = ", ".join(f"({params}) AS {body}" for params, body in overloads)
        db.execute(f"CREATE MACRO pgc.{name} {defs}")
    for name, body in cs.TABLE_MACROS.items():
        db.execute(f"CREATE MACRO pgc.{name}() AS TABLE {body}")


def _build_information_schema(
    db: duckdb.DuckDBPyConnection, tables: tuple[cs.CatalogTable, ...], dataset: str
) -> None:
    ds = dataset.replace("'", "''")
    db.execute(
        "CREATE VIEW infs.schemata AS SELECT * FROM (VALUES "
        f"('{ds}', 'public', '{cs.OWNER_NAME}'), "
        f"('{ds}', 'information_schema', '{cs.OWNER_NAME}'), "
        f"('{ds}', 'pg_catalog', '{cs.OWNER_NAME}')) "
        "AS s(catalog_name, schema_name, schema_owner)"
    )
    db.execute(
        "CREATE TABLE infs.tables (table_catalog VARCHAR, table_schema VARCHAR, "
        "table_name VARCHAR, table_type VARCHAR, self_referencing_column_name VARCHAR, "
        "reference_generation VARCHAR, user_defined_type_catalog VARCHAR, "
        "user_defined_type_schema VARCHAR, user_defined_type_name VARCHAR, "
        "is_insertable_into VARCHAR, is_typed VARCHAR, commit_action VARCHAR)"
    )
    if tables:  # an analyst [access] lets query no table sees none
        db.executemany(
            "INSERT INTO infs.tables VALUES (?, 'public', ?, 'BASE TABLE', NULL, NULL, NULL, "
            "NULL, NULL, 'NO', 'NO', NULL)",
            [(dataset, tb.name) for tb in tables],
        )
    db.execute(
        "CREATE TABLE infs.columns (table_catalog VARCHAR, table_schema VARCHAR, "
        "table_name VARCHAR, column_name VARCHAR, ordinal_position INTEGER, "
        "column_default VARCHAR, is_nullable VARCHAR, data_type VARCHAR, "
        "character_maximum_length INTEGER, character_octet_length INTEGER, "
        "numeric_precision INTEGER, numeric_precision_radix INTEGER, "
        "numeric_scale INTEGER, datetime_precision INTEGER, interval_type VARCHAR, "
        "interval_precision INTEGER, character_set_catalog VARCHAR, "
        "character_set_schema VARCHAR, character_set_name VARCHAR, "
        "collation_catalog VARCHAR, collation_schema VARCHAR, collation_name VARCHAR, "
        "domain_catalog VARCHAR, domain_schema VARCHAR, domain_name VARCHAR, "
        "udt_catalog VARCHAR, udt_schema VARCHAR, udt_name VARCHAR, "
        "scope_catalog VARCHAR, scope_schema VARCHAR, scope_name VARCHAR, "
        "maximum_cardinality INTEGER, dtd_identifier VARCHAR, "
        "is_self_referencing VARCHAR, is_identity VARCHAR, identity_generation VARCHAR, "
        "identity_start VARCHAR, identity_increment VARCHAR, identity_maximum VARCHAR, "
        "identity_minimum VARCHAR, identity_cycle VARCHAR, is_generated VARCHAR, "
        "generation_expression VARCHAR, is_updatable VARCHAR)"
    )
    col_rows = [
        _column_row(dataset, tb.name, num, col)
        for tb in tables
        for num, col in enumerate(tb.columns, start=1)
    ]
    if col_rows:
        marks = ", ".join("?" * len(col_rows[0]))
        db.executemany(f"INSERT INTO infs.columns VALUES ({marks})", col_rows)
    for name, cols in _EMPTY_INFORMATION_SCHEMA.items():
        spec = ", ".join(f"{c.strip()} VARCHAR" for c in cols.split(","))
        db.execute(f"CREATE TABLE infs.{name} ({spec})")


def _column_row(dataset: str, table: str, num: int, col: cs.CatalogColumn) -> tuple:
    """One information_schema.columns row, in that view's column order."""
    prec, radix, scale = {t.INT8: (64, 2, 0), t.FLOAT8: (53, 2, None)}.get(
        col.type_oid, (None, None, None)
    )
    return (
        dataset, "public", table, col.name, num, None, "YES" if col.nullable else "NO",
        cs.format_type(col.type_oid), None, 1073741824 if col.type_oid == t.TEXT else None,
        prec, radix, scale, 0 if col.type_oid == t.DATE else None,
        None, None, None, None, None, None, None, None, None, None, None,
        dataset, "pg_catalog", t.PG_TYPES[col.type_oid].name,
        None, None, None, None, str(num), "NO", "NO", None, None, None, None, None,
        "NO", "NEVER", None, "NO",
    )  # fmt: skip


_EMPTY_INFORMATION_SCHEMA = {
    "views": "table_catalog, table_schema, table_name, view_definition, check_option, "
    "is_updatable, is_insertable_into, is_trigger_updatable, is_trigger_deletable, "
    "is_trigger_insertable_into",
    "table_constraints": "constraint_catalog, constraint_schema, constraint_name, "
    "table_catalog, table_schema, table_name, constraint_type, is_deferrable, "
    "initially_deferred, enforced, nulls_distinct",
    "key_column_usage": "constraint_catalog, constraint_schema, constraint_name, "
    "table_catalog, table_schema, table_name, column_name, ordinal_position, "
    "position_in_unique_constraint",
    "referential_constraints": "constraint_catalog, constraint_schema, "
    "constraint_name, unique_constraint_catalog, unique_constraint_schema, "
    "unique_constraint_name, match_option, update_rule, delete_rule",
    "constraint_column_usage": "table_catalog, table_schema, table_name, column_name, "
    "constraint_catalog, constraint_schema, constraint_name",
    "routines": "specific_catalog, specific_schema, specific_name, routine_catalog, "
    "routine_schema, routine_name, routine_type, data_type",
    "parameters": "specific_catalog, specific_schema, specific_name, ordinal_position, "
    "parameter_mode, parameter_name, data_type",
    "sequences": "sequence_catalog, sequence_schema, sequence_name, data_type",
    "triggers": "trigger_catalog, trigger_schema, trigger_name, event_manipulation, "
    "event_object_catalog, event_object_schema, event_object_table",
}


def _duck_type(oid: int) -> str:
    return {
        t.INT8: "BIGINT",
        t.FLOAT8: "DOUBLE",
        t.TEXT: "VARCHAR",
        t.BOOL: "BOOLEAN",
        t.DATE: "DATE",
        t.INT4: "INTEGER",
    }.get(oid, "VARCHAR")


class Runner:
    """Runs one statement at a time on the shadow, under the limits; replies are plain tuples.

    Replies: ``("ok", [(name, duckdb type)], rows)``, ``("limit", "rows"|"bytes", limit)``,
    ``("timeout",)``, ``("cancelled",)``, ``("memory",)``, ``("error", kind, message)``.
    """

    def __init__(self, db: duckdb.DuckDBPyConnection, limits: CatalogLimits) -> None:
        self._cur = db.cursor()
        self._cur.execute("SET search_path = 'pgc,public'")
        self._limits = limits
        self._caps = ResultCaps(limits.max_rows, limits.max_bytes)
        self._watchdog = Watchdog()
        self._lock = threading.Lock()
        self._running: int | None = None
        self._cancelled = -1  # the latest statement id the server asked to interrupt

    def interrupt(self, request: int) -> None:
        """Interrupt statement ``request`` if it runs, or as soon as it starts."""
        with self._lock:
            self._cancelled = max(self._cancelled, request)
            if self._running == request:
                self._cur.interrupt()

    def run(self, request: int, sql: str) -> tuple:
        with self._lock:
            if self._cancelled >= request:
                return ("cancelled",)
            self._running = request
        try:
            with self._watchdog.deadline(self._limits.timeout, self._cur.interrupt) as deadline:
                try:
                    return self._execute(sql)
                except duckdb.InterruptException:
                    return ("timeout",) if deadline.expired else ("cancelled",)
        finally:
            with self._lock:
                self._running = None

    def _execute(self, sql: str) -> tuple:
        try:
            self._cur.execute(sql)
            description = [(str(d[0]), str(d[1])) for d in self._cur.description or []]
            rows = fetch_capped(self._cur, self._caps)
        except LimitExceeded as exc:
            return ("limit", exc.kind, exc.limit)
        except (duckdb.OutOfMemoryException, MemoryError):
            return ("memory",)
        except duckdb.InterruptException:
            raise
        except duckdb.Error as exc:
            return ("error", _error_kind(exc), _first_line(exc))
        return ("ok", description, [_plain_row(row) for row in rows])


def _error_kind(exc: duckdb.Error) -> str:
    for cls, kind in (
        (duckdb.CatalogException, "catalog"),
        (duckdb.ParserException, "parser"),
        (duckdb.BinderException, "binder"),
    ):
        if isinstance(exc, cls):
            return kind
    return "other"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:1000] if text else type(exc).__name__


# Values that may hold something the server does not unpickle (a zoneinfo time zone).
_CONVERTED = frozenset({dt.datetime, dt.time, list, tuple, dict})


def _plain_row(row: tuple) -> tuple:
    if not any(type(v) in _CONVERTED for v in row):
        return row
    return tuple(_plain(v) for v in row)


def _plain(value: Any) -> Any:
    """``value`` with only types the server unpickles: time zones become fixed offsets."""
    if isinstance(value, dt.datetime | dt.time) and value.tzinfo is not None:
        offset = value.utcoffset()
        zone = dt.UTC if offset is None else dt.timezone(offset)
        return value.replace(tzinfo=zone)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


def _limit_address_space(headroom: int) -> None:
    """Cap this process's address space at its current size plus ``headroom`` (Linux)."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError):
        return
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, size + headroom))


def _listen(intr: socket.socket, runner: Runner) -> None:
    """Interrupt requests from the server; the end of the socket is the server's end."""
    buffer = b""
    while True:
        data = intr.recv(4096)
        if not data:
            os._exit(0)
        buffer += data
        while len(buffer) >= INTERRUPT.size:
            (request,) = INTERRUPT.unpack_from(buffer)
            buffer = buffer[INTERRUPT.size :]
            runner.interrupt(request)


def serve(conn: Connection, intr: socket.socket) -> int:
    spec: ShadowSpec = pickle.loads(conn.recv_bytes())  # from the server, which started us
    try:
        runner = Runner(build(spec), spec.limits)
    except Exception as exc:  # reported to the server, which logs it
        conn.send_bytes(pickle.dumps(("failed", f"{type(exc).__name__}: {exc}")))
        return 1
    _limit_address_space(spec.limits.address_space)
    threading.Thread(target=_listen, args=(intr, runner), daemon=True).start()
    conn.send_bytes(pickle.dumps(("ready",)))
    while True:
        try:
            request, sql = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return 0
        try:
            reply = pickle.dumps(
                (request, runner.run(request, sql)), protocol=pickle.HIGHEST_PROTOCOL
            )
        except MemoryError:
            reply = pickle.dumps((request, ("memory",)))
        conn.send_bytes(reply)


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    intr = socket.socket(fileno=int(argv[2]))
    try:
        return serve(conn, intr)
    except (EOFError, OSError):  # the server closed our sockets: it stopped, or gave up on us
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
