"""The embedded DuckDB engine: loads the policy's sources, then runs compiled plans only.

After loading, the connection is sealed: only the policy's own files stay readable
(``allowed_paths``), every other file, extension or network access is off
(``enable_external_access = false``) and no setting can change again
(``lock_configuration = true``). The analyst's SQL text never reaches it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
from sqlglot import exp

from dpsql.engine import clamp_pass, columnar, postgres_source, prepared
from dpsql.engine.api import EngineResult, QueryHandle, canonical_rows, with_extras
from dpsql.engine.versions import (
    SourceVersions,
    file_version,
    files_version,
    identity,
    storage_digest_sql,
    table_digest_sql,
    table_version,
)
from dpsql.errors import OperationalError, PolicyError
from dpsql.frontend.identifiers import quote_ident as _q
from dpsql.gil_gate import released
from dpsql.lower.builders import count_star, named_table, select, star
from dpsql.lower.compile import CompiledQuery, render
from dpsql.policy import SQL_TYPES, Policy, TablePolicy
from dpsql.sources import (
    display_source,
    glob_files,
    is_glob,
    is_postgres,
    is_remote,
    parse_postgres,
)


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# The size of a small table: under [engine] small_tables = "columns" every CSV source is held
# in memory for column programs and may have at most this many rows (more fails the start);
# under "auto" (the default) a CSV source of more rows runs its SQL instead.
SMALL_ROWS = 200_000
# The most rows of a table whose store (its columns in memory, clustered by unit) is built in
# the background: the capacity every exactness bound of its programs is decided from
# (dpsql.engine.columnar: a constant, never the table's own count).
LARGE_ROWS = 1 << 27
_log = logging.getLogger("dpsql.engine")


class DuckDBEngine:
    name = "duckdb"
    dialect = "duckdb"

    def __init__(
        self,
        policy: Policy,
        database: str = ":memory:",
        *,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = policy
        self._con = duckdb.connect(":memory:")
        # DuckDB spills out-of-core work (copies of private rows) to .tmp in the current
        # directory, with the umask's mode: a private 0700 directory instead, removed on close
        # (a disk store moves it into the store directory: dpsql.engine.store_files)
        self._spill = tempfile.mkdtemp(prefix="dpsql-spill-")
        # removed by close(), or when the engine is collected or the process exits without it
        # (an engine dropped unclosed, or one whose load raised, left an empty directory each)
        self._remove_spill = weakref.finalize(self, shutil.rmtree, self._spill, ignore_errors=True)
        self._con.execute(f"SET temp_directory = '{self._spill.replace(chr(39), chr(39) * 2)}'")
        # table -> data version; Parquet files re-checked on every read (engine/versions.py)
        self._versions = SourceVersions()
        self.versions: dict[str, str] = self._versions
        # every source an eager CSV table (threads = 1 unless set): the policy's source kinds
        self._small = bool(policy.tables)
        self._eager: list[TablePolicy] = []
        self._over_size: set[str] = set()  # CSV tables past SMALL_ROWS under "auto": SQL
        self.stores: list[prepared.StoreInfo] = []
        allowed: list[str] = []
        # what a store's build instance repeats (_build_connection): the ATTACH, each view's
        # CREATE statement (table -> (statement, whether it reads the attached database)),
        # the files it may read
        self._attach: str | None = None
        self._database: str | None = None
        self._views: dict[str, tuple[str, bool]] = {}
        self._allowed = allowed
        self._lock_fd: int | None = None
        attached = False
        if database not in (":memory:", "", None):
            if not Path(database).is_file():
                raise OperationalError(
                    f"database file {database!r} does not exist",
                    construct="database",
                    hint="pass the path of an existing DuckDB file, or ':memory:'",
                )
            self._attach = f"ATTACH {_sql_string(str(database))} AS src (READ_ONLY)"
            self._con.execute(self._attach)
            self._database = str(database)
            attached = True
        for table in policy.tables.values():
            self._load(table, attached, database, allowed)
        if policy.engine.prepared != "off":
            self._prepare(allowed, progress)
        self.columns: dict[str, columnar.ColumnarTable] = self._hold_columns()
        _restrict(self._con, allowed)
        self._con.execute(f"SET perfect_ht_threshold = {int(policy.engine.perfect_hash_bits)}")
        # give memory back to the system after each large query (DuckDB's allocator keeps a
        # query's peak otherwise: a store's build held ~4x its own size at 10M rows)
        self._con.execute("SET allocator_flush_threshold = '32MiB'")
        self._con.execute("SET allocator_background_threads = true")
        threads = policy.engine.threads
        if threads is None and self._small:
            # Small in-memory tables: one thread per query costs ~20% less CPU and the same
            # wall time (a 20k-row plan is mostly DuckDB's per-operator fixed costs).
            threads = 1
        if threads is not None:
            self._con.execute(f"SET threads = {int(threads)}")
        self._con.execute("SET lock_configuration = true")
        self._closed = False
        self._builds: dict[str, threading.Thread] = {}
        self._build_cursors: dict[str, duckdb.DuckDBPyConnection] = {}
        self._build_lock = threading.Lock()
        for table in self._large_tables():
            self._start_build(table)
        if self._builds:
            _BUILDING.add(self)
        if self.columns:
            columnar.warm_up_later()  # compile (or load from numba's cache) the kernels

    # -- the store of a large table: its columns in memory, clustered by unit ------------------

    def _large_tables(self) -> list[TablePolicy]:
        """Tables that get a store built in the background (dpsql.engine.columnar.cluster):
        every table not held at connect, unless ``small_tables = "sql"`` turns column programs
        off; never a public table or one read through a unit path (their plans differ)."""
        if self.policy.engine.small_tables == "sql":
            return []
        return [
            t
            for t in self.policy.tables.values()
            if t.name not in self.columns and not t.public and t.joined is None
        ]

    def _start_build(self, table: TablePolicy) -> None:
        """Build ``table``'s store on a thread of its own, on its own cursor (the connection
        is sealed: the cursor reads what it may read, nothing else), unless one is running."""
        with self._build_lock:
            running = self._builds.get(table.name)
            if self._closed or (running is not None and running.is_alive()):
                return
            thread = threading.Thread(
                target=self._build, args=(table,), name=f"dpsql-store-{table.name}", daemon=True
            )
            self._builds[table.name] = thread
            thread.start()

    def _build(self, table: TablePolicy) -> None:
        """Load, cluster and install the store; dropped if the data version moved meanwhile
        (it is built again at the next query) or the engine closed. A failure only leaves the
        table on its SQL plans (logged for the operator: never an analyst's error)."""
        started = time.perf_counter()
        version = self.versions.get(table.name, "")
        try:
            store = None
            if table.name in self._views:
                with contextlib.suppress(duckdb.Error):  # e.g. over its instance's limit
                    store = self._build_on(table, version, own=True)
            if store is None:  # not a view over files, or its own instance failed
                store = self._build_on(table, version, own=False)
            if store is None:
                return
            columnar.warm_up()
        except Exception as exc:  # the SQL plans stay: the operator's log says why
            if self._closed:
                return
            _log.warning(
                "tables.%s: no in-memory store (%s); its plans run as SQL",
                table.name,
                type(exc).__name__,
            )
            return
        with self._build_lock:
            if self._closed or self.versions.get(table.name, "") != version:
                return
            self.columns[table.name] = store
        _log.info(
            "tables.%s: in-memory store of %d rows built in %.2f s",
            table.name,
            store.rows,
            time.perf_counter() - started,
        )

    def _build_on(
        self, table: TablePolicy, version: str, *, own: bool
    ) -> columnar.ColumnarTable | None:
        """The store, built on an instance of its own (``own``: :func:`_build_connection`)
        or on a cursor of the engine's connection; None when the engine closed first."""
        spill = tempfile.mkdtemp(prefix="build-", dir=self._spill) if own else ""
        with self._build_lock:
            if self._closed:
                return None
            con = (
                _build_connection(self._views[table.name], self._attach, self._allowed,
                                  self.policy.engine.threads, spill)
                if own
                else self._con.cursor()
            )  # fmt: skip
            self._build_cursors[table.name] = con
        try:
            limit = (lambda: _limit(con)) if own else None
            return columnar.load_clustered(con, table, version or "", LARGE_ROWS, limit)
        finally:
            with self._build_lock:
                self._build_cursors.pop(table.name, None)
            con.close()
            if own:
                shutil.rmtree(spill, ignore_errors=True)
                if self._database is not None:
                    self._lock_fd = _relock(self._database, self._lock_fd)

    def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Wait for the background builds (tests, benchmarks, ``dpsql prepare``); True when
        none is still running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in list(self._builds.values()):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(left)
        return not any(t.is_alive() for t in self._builds.values())

    def _hold_columns(self) -> dict[str, columnar.ColumnarTable]:
        """Every CSV table in memory for column programs (dpsql.engine.columnar) under
        ``small_tables = "columns"``, those of at most SMALL_ROWS rows under "auto" (the
        default); none under "sql".

        Which tables run programs is decided by the policy alone (its mode and each source's
        kind), never by the data (issue 25, item 6): the load reads every value of every
        declared type (columnar.load is total), and the table's size is declared, not
        measured — a CSV source of more than SMALL_ROWS rows fails the start (``_load``), as a
        value that does not cast to its type does, instead of silently running its SQL. A
        count one unit can push across a threshold (with R·G rows, or any number of raw rows)
        would otherwise switch every query on the table between ~0.5 ms and ~2-8 ms. What
        still fails here fails the start too, seen by the operator, never by an analyst.

        That holds when the policy declares small_tables. Undeclared ("auto"), a first large
        CSV must still just work, so its size is measured once per data version at connect
        (logged for the operator): the one choice left that a unit can move, by timing only,
        and pinned by declaring the mode (``dpsql init`` writes it)."""
        held: dict[str, columnar.ColumnarTable] = {}
        if self.policy.engine.small_tables == "sql":
            return held
        for table in self._eager:
            if table.name in self._over_size:
                continue
            try:
                # clustered by unit at once (milliseconds here): the compiled pass runs on it
                held[table.name] = columnar.cluster(
                    columnar.load(self._con, table, self.versions.get(table.name, ""), SMALL_ROWS),
                    table,
                )
            except (duckdb.Error, ValueError, OverflowError, TypeError, MemoryError) as exc:
                raise PolicyError(
                    f"tables.{table.name}: cannot hold its columns in memory for column "
                    f"programs ({type(exc).__name__})",
                    construct=f"tables.{table.name}",
                    hint='set [engine] small_tables = "sql" to run its plans as SQL',
                ) from None
        return held

    def _prepare(self, allowed: list[str], progress: Callable[[str], None] | None) -> None:
        """Build or reuse each table's prepared store (dpsql.engine.prepared) before the
        connection is sealed; the compiler finds them through ``prepared.STORES``."""
        directory = (
            prepared.store_directory(self.policy) if self.policy.engine.prepared == "disk" else None
        )
        for table in self.policy.tables.values():
            try:
                info = prepared.prepare_table(
                    self._con,
                    table,
                    self.versions.get(table.name, ""),
                    directory=directory,
                    progress=progress,
                )
            except duckdb.Error as exc:
                raise PolicyError(
                    f"tables.{table.name}: cannot build its prepared store: "
                    f"{_describe_load_error(exc)}",
                    construct=f"tables.{table.name}",
                    hint='set [engine] prepared = "off", or fix the source',
                ) from None
            if info is None:
                continue
            if info.path is not None:
                allowed.append(info.path)
            prepared.register(info)
            self.stores.append(info)

    def _select_list(self, table: TablePolicy, *, lazy: bool) -> str:
        """The declared columns in their declared types.

        A lazily read source (a VIEW over Parquet or an attached table) is cast with TRY_CAST:
        a value that does not fit its declared type becomes NULL instead of failing the query
        that reads it, which would tell D from D' (docs/threat_model.md). An eager TABLE (CSV)
        is cast once at load, where a failure is the operator's and no analyst sees it.
        """
        cast = "TRY_CAST" if lazy else "CAST"
        return ", ".join(
            f"{cast}({_q(c.name)} AS {SQL_TYPES[c.type]}) AS {_q(c.name)}"
            for c in table.columns.values()
        )

    def _remote(self, table: TablePolicy, where: str) -> str:
        """An s3:// or https:// source: read now through DuckDB's httpfs extension into a
        table (after sealing no network is reachable), or refused when httpfs is missing."""
        try:
            self._con.execute("LOAD httpfs")
        except duckdb.Error:
            raise PolicyError(
                f"{where}: {table.source!r} needs DuckDB's httpfs extension, which is not "
                "installed here (DuckDB downloads extensions from the internet)",
                construct=where,
                hint="download the files and point source at them (a glob such as "
                "data/part-*.parquet reads several), or run INSTALL httpfs once in DuckDB "
                "where the network is reachable",
            ) from None
        text = _sql_string(table.source)
        if table.source.lower().rstrip("/").endswith(".parquet"):
            return f"read_parquet({text})"
        return f"read_csv({text}, header = true, all_varchar = true, auto_detect = true)"

    def _load(self, table: TablePolicy, attached: bool, database: str, allowed: list[str]) -> None:
        where = f"tables.{table.name}.source"
        path = table.source_path
        relation: str | None = None  # None: the table is created and filled here
        if is_postgres(table.source):
            # Read now, before the connection is sealed: a snapshot per start, never live.
            self.versions[table.name] = postgres_source.load(
                self._con,
                table.name,
                parse_postgres(table.source),
                [(c.name, SQL_TYPES[c.type]) for c in table.columns.values()],
                where,
                version=table.version,
            )
            kind = "TABLE"
        elif is_remote(table.source):
            relation = self._remote(table, where)
            self.versions[table.name] = table.version or ""  # digest: after the table exists
            kind = "TABLE"
        elif path is None:
            relation, kind = _attached(self._con, table, where, attached, database), "VIEW"
            self.versions[table.name] = table.version or ""  # digest: after the view exists
            self._small = False
        elif is_glob(table.source):
            # A glob: expanded once, here; the files listed now are read (docs/sources.md).
            files = glob_files(path)
            listed = "[" + ", ".join(_sql_string(str(f)) for f in files) + "]"
            if path.name.lower().endswith(".parquet"):
                relation = f"read_parquet({listed}, union_by_name = true)"
                allowed.extend(str(f) for f in files)
                if table.version:
                    self.versions[table.name] = table.version
                else:
                    self._versions.watch_files(table.name, files)  # re-checked on each read
                kind = "VIEW"
                self._small = False
            else:
                relation = (
                    f"read_csv({listed}, header = true, all_varchar = true, "
                    "auto_detect = true, union_by_name = true)"
                )
                self.versions[table.name] = table.version or files_version(
                    files, [identity(f) for f in files]
                )
                kind = "TABLE"
        elif path.name.lower().endswith(".parquet"):
            relation = f"read_parquet({_sql_string(str(path))})"
            allowed.append(str(path))
            if table.version:
                self.versions[table.name] = table.version
            else:
                self._versions.watch(table.name, path)  # replaceable while serving
            kind = "VIEW"
            self._small = False
        else:
            relation = (
                f"read_csv({_sql_string(str(path))}, header = true, all_varchar = true, "
                "auto_detect = true)"
            )
            self.versions[table.name] = table.version or file_version(path)
            kind = "TABLE"
        try:
            if relation is not None:
                create = (
                    f"CREATE {kind} {_q(table.name)} AS SELECT "
                    f"{self._select_list(table, lazy=kind == 'VIEW')} "
                    f"FROM {relation}"
                )
                self._con.execute(create)
                if kind == "VIEW":
                    self._views[table.name] = (create, path is None)
            self._con.execute(render(_columns_only(table.name), "duckdb")).fetchall()
            if relation is not None and path is None and not table.version:
                # an attached table: a digest of its storage metadata at connect (no row
                # read); a remote one (loaded here): of its rows
                if is_remote(table.source):
                    query = table_digest_sql(_q(table.name), [_q(c) for c in table.columns])
                else:
                    stored = f"src.{_q(table.source)}"
                    query = storage_digest_sql(stored, _sql_string(stored))
                digest = self._con.execute(query).fetchone()
                self.versions[table.name] = table_version(
                    table.source if is_remote(table.source) else database, digest or ()
                )
            count = None
            if kind == "TABLE" and self.policy.engine.small_tables != "sql":
                counted = select([count_star()], named_table(table.name))
                count = self._con.execute(render(counted, "duckdb")).fetchone()
        except duckdb.Error as exc:
            raise PolicyError(
                f"{where}: cannot load {display_source(table.source)!r} with the declared "
                f"columns: "
                f"{_describe_load_error(exc)}",
                construct=where,
                hint="check that every declared column exists in the source with that type",
            ) from None
        if _over_size(where, count, self.policy.engine.small_tables):
            self._over_size.add(table.name)
        if kind == "TABLE":
            self._eager.append(table)

    def _run(self, sql: str, handle: QueryHandle | None, fetch: Callable[[Any], Any]) -> Any:
        """Run generated SQL on a fresh cursor that ``handle`` can interrupt.

        Engine errors are reported by class only (their text may quote data); the pipeline
        has charged the query before this runs and turns any error into its one uniform
        charged failure (dpsql.boundary).
        """
        cursor = self._con.cursor()
        try:
            if handle is not None:
                handle.attach(cursor)
                if handle.interrupted:
                    raise OperationalError("query cancelled", sqlstate="57014")
            with released():  # DuckDB runs without the GIL: a server's gate meanwhile
                cursor.execute(sql)  # goes to another statement (dpsql.gil_gate)
            return fetch(cursor)
        except duckdb.InterruptException:
            raise OperationalError("query cancelled", sqlstate="57014") from None
        except duckdb.Error as exc:
            raise OperationalError(
                f"engine error: {type(exc).__name__}",
                hint="please report this query",
            ) from None
        finally:
            if handle is not None:
                handle.attach(None)
            cursor.close()

    def execute(self, compiled: CompiledQuery, handle: QueryHandle | None = None) -> EngineResult:
        counted = clamp_pass.run(self.columns, self.versions, self._con, compiled, handle)
        if counted is not None:  # a clamp histogram, counted over the store
            return counted
        program = compiled.program
        if program is not None and not compiled.extras:
            local = self._run_columns(compiled, handle)
            if local is not None:
                return local
        rows, types = self._run(
            compiled.render(self.dialect),
            handle,
            lambda cur: (cur.fetchall(), tuple(str(d[1]) for d in cur.description or ())),
        )
        nk = len(compiled.key_columns)
        key_rows = [tuple(r[:nk]) for r in rows]
        measures = [
            [int(r[nk + j] or 0) for r in rows] for j in range(len(compiled.measure_columns))
        ]
        main = EngineResult(key_rows, measures, types[:nk])
        return with_extras(main, compiled.extras, lambda query: self.execute(query, handle))

    def _run_columns(
        self, compiled: CompiledQuery, handle: QueryHandle | None
    ) -> EngineResult | None:
        """The compiled query's column program on its table in memory, if the table is held
        and is the policy's own (not a derived or joined relation of the same name); None: run
        the SQL instead (decided before any value is read)."""
        program = compiled.program
        assert program is not None
        table = self.columns.get(program.table)
        policy = self.policy.tables.get(program.table)
        if table is None or policy is None or not program.columns <= table.columns.keys():
            return None
        if table.version != (self.versions.get(program.table) or ""):
            # a new data version (a Parquet file replaced): the store is stale, never read;
            # the SQL runs until the new one is built
            with self._build_lock:
                if self.columns.get(program.table) is table:
                    del self.columns[program.table]
            self._start_build(policy)
            return None
        if handle is not None and handle.interrupted:
            raise OperationalError("query cancelled", sqlstate="57014")
        try:
            return columnar.run(program, table, policy, compiled.swaps)
        except Exception:  # a bug, never data: the same uniform failure as an engine error
            raise OperationalError(
                "engine error: ColumnProgram", hint="please report this query"
            ) from None

    def fetch_matrix(self, query: exp.Expression, handle: QueryHandle | None = None) -> np.ndarray:
        """Rows of a generated integer query (dp_rule_list pattern counts) as an int64 matrix.

        ``query`` is a tree of dpsql.lower.rows with its secret printed, rendered here, once
        (the keyed hash as DuckDB's HASH; a literal spelling DP_KEYED_HASH is left as it is).
        """
        text = render(query, self.dialect)
        columns = self._run(text, handle, lambda cur: cur.fetchnumpy())
        arrays = [np.asarray(columns[name], dtype=np.int64) for name in columns]
        if not arrays:
            return np.zeros((0, 0), dtype=np.int64)
        return canonical_rows(np.column_stack(arrays))

    def _stop_builds(self) -> None:
        """Interrupt the builds still reading and wait for them: DuckDB refuses to close a
        connection one of its cursors is busy on, and a thread inside DuckDB when the
        interpreter exits aborts the process (so this also runs at exit)."""
        with self._build_lock:
            self._closed = True
            for cursor in self._build_cursors.values():
                with contextlib.suppress(duckdb.Error):
                    cursor.interrupt()
        for thread in list(self._builds.values()):
            thread.join()

    def close(self) -> None:
        self._stop_builds()
        for info in self.stores:
            prepared.unregister(info)
        self.stores = []
        self._con.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._remove_spill()


# engines with background builds, stopped at exit (DuckDBEngine._stop_builds)
_BUILDING: weakref.WeakSet[DuckDBEngine] = weakref.WeakSet()


@atexit.register
def _stop_all_builds() -> None:
    for engine in list(_BUILDING):
        engine._stop_builds()


def _describe_load_error(exc: Exception) -> str:
    """Name the failing column/conversion without echoing data values."""
    text = str(exc).splitlines()[0]
    if "Conversion Error" in text or "Could not convert" in text:
        return "a value does not convert to the declared type (" + text.split(":")[0] + ")"
    if "not found" in text.lower() or "Binder Error" in text:
        return text.split("\n")[0][:200]
    return type(exc).__name__


def _attached(con: Any, table: TablePolicy, where: str, attached: bool, database: str) -> str:
    """The relation of a table of the attached database (``connect(database=...)``), read
    through a view, never copied; refused when no database was given or it lacks the table."""
    if not attached:
        raise PolicyError(
            f"{where}: {table.source!r} is not a CSV/Parquet file and no database was given",
            construct=where,
            hint="connect(database='file.duckdb', ...) or point source at a file",
        )
    exists = con.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE database_name = 'src' "
        "AND lower(table_name) = lower(?)",
        [table.source],
    ).fetchone()
    if not exists or not exists[0]:
        raise PolicyError(
            f"{where}: table {table.source!r} not found in database {database!r}",
            construct=where,
            hint="fix the table name in the policy",
        )
    return f"src.{_q(table.source)}"


def _build_connection(
    view: tuple[str, bool], attach: str | None, allowed: list[str], threads: int | None, spill: str
) -> duckdb.DuckDBPyConnection:
    """A DuckDB instance of its own for the build of a store over files (an attached table,
    Parquet): the blocks of the file it caches and its temporary tables go when it closes
    (they stayed in the engine's instance, whose memory limit is locked: 66 MiB of cached
    blocks at 10M rows, ~10x that at 100M). The same view over the same source (``view``: its
    CREATE statement and whether it reads the attached database, ``attach``), the same seal
    as the engine's connection (only the policy's files, no other file or extension),
    spilling to ``spill``, a private directory of the engine's; a memory limit and the
    configuration locked once the labels are read (:func:`_limit`, before the rows are
    fetched). It runs only the build's SQL."""
    config: dict[str, Any] = {"temp_directory": spill, "allocator_flush_threshold": "32MiB"}
    if threads is not None:
        config["threads"] = int(threads)
    con = duckdb.connect(":memory:", config=config)
    try:
        create, reads_database = view
        if reads_database and attach is not None:
            con.execute(attach)
        con.execute(create)
        _restrict(con, allowed)
    except BaseException:
        con.close()
        raise
    return con


def _relock(database: str, fd: int | None) -> int | None:
    """Take the attached ``database``'s read lock again (on ``fd``, opened for it the first
    time; returned): DuckDB's file locks are POSIX record locks, held by the process and all
    dropped when any descriptor of the file closes, so closing a build instance that opened
    it released the engine's lock too (a writer could then open the file under the engine).
    A writer that slipped in between is logged for the operator."""
    try:
        import fcntl
    except ImportError:  # Windows: a lock belongs to its handle, none was dropped
        return fd
    try:
        if fd is None:
            fd = os.open(database, os.O_RDONLY)
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        _log.warning("database %s: its read lock could not be taken again", database)
    return fd


def _limit(con: Any) -> None:
    """The build instance's memory limit lowered (its cached blocks evicted, its temporary
    tables spilled) and its configuration locked, before the rows are fetched: the cache of
    the file's blocks is held under it while they are (each range of units scans the table
    again), not the whole file (66 MiB at 10M rows). 16 MiB and 8 more a thread: what a
    range's query pins (at 10M rows, 2 threads, 16 MiB failed to pin a block; 32 held).
    Reading the labels (a DISTINCT of every unit, numbered) needs more (at 100M rows a
    256 MiB limit failed it) and runs before any store array is written
    (dpsql.engine.columnar.load_clustered). Over the limit the build fails and runs again
    on the engine's own connection (DuckDBEngine._build)."""
    threads = con.execute("SELECT current_setting('threads')").fetchone()
    con.execute("SET memory_limit = ?", [f"{16 + 8 * int(threads[0])}MiB"])
    con.execute("SET lock_configuration = true")


def _restrict(con: Any, allowed: list[str]) -> None:
    """Only the policy's own files readable (``allowed``), every other file, extension and
    network access off: the seal of every connection the engine runs SQL on (its
    configuration locked after)."""
    con.execute("SET allowed_paths = [" + ", ".join(_sql_string(p) for p in allowed) + "]")
    con.execute("SET enable_external_access = false")


def _over_size(where: str, count: Any, small_tables: str) -> bool:
    """Whether a table's row ``count`` is over SMALL_ROWS with small_tables undeclared: it
    runs its SQL (logged). Declared small (held for column programs), the start fails."""
    if count is not None and count[0] > SMALL_ROWS and small_tables == "auto":
        # Undeclared: a large CSV runs its SQL. The choice is made here, once per data
        # version, and logged for the operator; one unit can move a table across the
        # limit, so a timing difference can show which side it is on (docs/threat_model.md,
        # "Column programs"): declaring small_tables pins it (dpsql init writes it).
        _log.warning(
            "%s: more than %s rows: not held at connect, its plans run as SQL until its "
            "store is built in the background; declare "
            '[engine] small_tables = "sql" (or "columns") to pin the path',
            where,
            f"{SMALL_ROWS:,}",
        )
        return True
    elif count is not None and count[0] > SMALL_ROWS:
        # Declared small (held for column programs): more rows fail the start, seen by the
        # operator, rather than switch the table's path on a count one unit can move.
        raise PolicyError(
            f"{where}: more than {SMALL_ROWS:,} rows, the most a table held in memory "
            "for column programs may have",
            construct="engine.small_tables",
            hint='set [engine] small_tables = "sql" (and threads for a large table)',
        )
    return False


def _columns_only(table: str) -> exp.Select:
    """``SELECT * FROM table LIMIT 0``: the table's columns, no row (a load's check)."""
    return select([star()], named_table(table)).limit(0, copy=False)
