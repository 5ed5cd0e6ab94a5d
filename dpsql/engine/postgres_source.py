"""A PostgreSQL table as a source: read at connect, in one snapshot, into a DuckDB table.

The engine's connection is sealed after loading (no file, extension or network access), so a
PostgreSQL table cannot be read live: it is copied once, when the engine starts, through
psycopg (the ``dpsql[postgres]`` extra) in batches of text values, each cast to its declared
type as a CSV's values are (a value that does not convert fails the start, seen by the
operator). The read is one ``REPEATABLE READ, READ ONLY`` transaction: the table as of one
instant. Its data version (unless the policy declares ``version``) is a digest of the location
and of the loaded rows, computed at connect: it changes when any row of the declared columns
changes, and is fixed until the next start (docs/sources.md).

Messages name the host, port, database and table only, never the user or a password, and an
error of the driver is reported by its class and SQLSTATE (its text can quote a role name or a
value).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import duckdb
import numpy as np

from dpsql.engine.versions import table_digest_sql
from dpsql.errors import PolicyError
from dpsql.frontend.identifiers import quote_ident as _q
from dpsql.sources import PostgresSource

#: Rows fetched per round trip and inserted into DuckDB at once.
BATCH_ROWS = 50_000


def _driver() -> Any:
    try:
        import psycopg
    except ImportError:
        return None
    return psycopg


def load(
    con: duckdb.DuckDBPyConnection,
    name: str,
    src: PostgresSource,
    columns: Sequence[tuple[str, str]],
    where: str,
    *,
    version: str | None = None,
) -> str:
    """Create table ``name`` in ``con`` with ``columns`` ((name, DuckDB type), declared) from
    the PostgreSQL table ``src``; returns its data version (``version`` if declared)."""
    psycopg = _driver()
    if psycopg is None:
        raise PolicyError(
            f"{where}: reading a PostgreSQL table needs psycopg",
            construct=where,
            hint="pip install 'dpsql[postgres]'",
        )
    kwargs: dict[str, Any] = {"application_name": "dpsql", "connect_timeout": 10}
    if src.password_env is not None:
        password = os.environ.get(src.password_env)
        if password is None:
            raise PolicyError(
                f"{where}: the environment variable {src.password_env} (password_env) is not set",
                construct=where,
                hint=f"export {src.password_env} before starting dpsql, or use PGPASSWORD or a "
                "passfile",
            )
        kwargs["password"] = password
    con.execute(
        f"CREATE TABLE {_q(name)} ("
        + ", ".join(f"{_q(col)} {sql_type}" for col, sql_type in columns)
        + ")"
    )
    try:
        with psycopg.connect(src.conninfo, **kwargs) as pg:
            pg.read_only = True
            pg.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            _copy(psycopg, pg, con, name, src, columns, where)
    except psycopg.Error as exc:
        state = getattr(exc, "sqlstate", None)
        raise PolicyError(
            f"{where}: cannot read the PostgreSQL table {src.display} ({type(exc).__name__}"
            + (f", SQLSTATE {state}" if state else "")
            + ")",
            construct=where,
            hint="check that the server is up at that host and port, that the login (user, "
            "PGPASSWORD, passfile or password_env) is accepted, and that it may SELECT the table",
        ) from None
    if version:
        return version
    digest = con.execute(table_digest_sql(_q(name), [_q(c) for c, _ in columns])).fetchone()
    text = repr((src.display, tuple(str(v) for v in digest or ())))
    return "pg:" + hashlib.sha256(text.encode()).hexdigest()


def _copy(
    psycopg: Any,
    pg: Any,
    con: duckdb.DuckDBPyConnection,
    name: str,
    src: PostgresSource,
    columns: Sequence[tuple[str, str]],
    where: str,
) -> None:
    sql = psycopg.sql
    relation = sql.SQL(".").join(sql.Identifier(p) for p in src.qualified())
    with pg.cursor() as cur:
        cur.execute("SET LOCAL DateStyle = ISO")  # dates as YYYY-MM-DD, cast as a CSV's are
        cur.execute("SELECT to_regclass(%s)", [relation.as_string(pg)])
        found = cur.fetchone()
        if not found or found[0] is None:
            raise PolicyError(
                f"{where}: no table {'.'.join(src.qualified())} in {src.display.split()[0]}",
                construct=where,
                hint="fix table= in the source (schema.name, as stored: lowercase unless "
                "created quoted), or grant the login USAGE on its schema",
            )
        cur.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) "
            "AND attnum > 0 AND NOT attisdropped",
            [relation.as_string(pg)],
        )
        present = {row[0] for row in cur.fetchall()}
    missing = [c for c, _ in columns if c not in present]
    if missing:
        raise PolicyError(
            f"{where}: declared column {missing[0]!r} is not a column of {src.display}",
            construct=where,
            hint="declare the table's columns (names as stored in PostgreSQL: lowercase unless "
            "created quoted)",
        )
    select = sql.SQL("SELECT {} FROM {}").format(
        sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c)) for c, _ in columns),
        relation,
    )
    names = [f"c{i}" for i in range(len(columns))]
    insert = (
        f"INSERT INTO {_q(name)} SELECT "
        + ", ".join(f"CAST({n} AS {t})" for n, (_, t) in zip(names, columns, strict=True))
        + " FROM dpsql_pg_batch"
    )
    with pg.cursor(name="dpsql_load") as cur:  # a server-side cursor: batches, not all rows
        cur.itersize = BATCH_ROWS
        cur.execute(select)
        while rows := cur.fetchmany(BATCH_ROWS):
            values = list(zip(*rows, strict=True))
            batch = {n: np.array(v, dtype=object) for n, v in zip(names, values, strict=True)}
            con.register("dpsql_pg_batch", batch)
            try:
                con.execute(insert)
            finally:
                con.unregister("dpsql_pg_batch")
