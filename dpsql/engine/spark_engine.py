"""The Spark engine: the same compiled plan, run where the data lives (a cluster, a data lake).

Like the DuckDB engine it holds no privacy logic. It registers one temporary view per policy
table (declared columns only, cast to the declared types), runs the compiled plan rendered in
Spark SQL (the keyed hash becomes ``xxhash64(..., secret)``) and returns exact integers; noise
is drawn in Python afterwards. Only per-group aggregates travel to the driver.

Its Spark session is a ``newSession()`` of the given (or built) one, so its views and SQL
settings are isolated from the caller's. ANSI mode is off in that session on purpose: with it
on, a data-dependent runtime error (a division by zero, a failed cast in the analyst's WHERE)
would tell the analyst something about the rows at no privacy cost, since failed queries are
not charged. With it off such expressions give NULL, as in DuckDB.

Every problem is a dpsql error naming what to fix: pyspark or Java missing, the master
unreachable, a source or catalog table missing, a column missing or of the wrong type.
"""

from __future__ import annotations

import contextlib
import decimal
import hashlib
import logging
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import numpy as np
from sqlglot import exp

from dpsql.engine import prepared
from dpsql.engine.api import EngineResult, QueryHandle, canonical_rows, with_extras
from dpsql.engine.versions import file_version
from dpsql.errors import OperationalError, PolicyError
from dpsql.lower.compile import CompiledQuery
from dpsql.policy import FILE_SUFFIXES, Policy, TablePolicy
from dpsql.sources import is_postgres

SPARK_TYPES = {
    "int": "BIGINT",
    "float": "DOUBLE",
    "text": "STRING",
    "bool": "BOOLEAN",
    "date": "DATE",
}

# Spark type names (DataType.typeName()) a typed source may have for each declared type.
_COMPATIBLE = {
    "int": {"byte", "short", "integer", "long"},
    "float": {"byte", "short", "integer", "long", "float", "double", "decimal"},
    "text": {"string", "varchar", "char"},
    "bool": {"boolean"},
    "date": {"date"},
}

# pyspark logs failed queries' messages (which can quote data values) through these loggers.
_QUIET_LOGGERS = ("SQLQueryContextLogger", "DataFrameQueryContextLogger")

_INSTALL_JAVA = (
    "install Java 17 or 21 (Debian: apt-get install openjdk-17-jre-headless) and put it on "
    "PATH, or set JAVA_HOME to its directory"
)


def _pyspark() -> Any:
    try:
        import pyspark.sql
    except ImportError:
        raise OperationalError(
            "the Spark engine needs pyspark, which is not installed",
            sqlstate="08001",
            construct="engine",
            hint="pip install 'dpsql[spark]' (pyspark >= 3.5), or use engine = \"duckdb\"",
        ) from None
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).disabled = True
    return pyspark.sql


def check_java(environ: Mapping[str, str] | None = None) -> str:
    """Path of the java binary pyspark will launch; a clear error if there is none."""
    env = os.environ if environ is None else environ
    home = env.get("JAVA_HOME")
    if home:
        java = Path(home) / "bin" / "java"
        if not os.access(java, os.X_OK):
            raise OperationalError(
                f"JAVA_HOME is {home!r} but {str(java)!r} is not an executable",
                sqlstate="08001",
                construct="JAVA_HOME",
                hint="point JAVA_HOME at a Java 17+ installation, or unset it and " + _INSTALL_JAVA,
            )
        return str(java)
    found = shutil.which("java", path=env.get("PATH"))
    if found is None:
        raise OperationalError(
            "the Spark engine needs Java, and no java is on PATH",
            sqlstate="08001",
            construct="java",
            hint=_INSTALL_JAVA,
        )
    return found


def probe_master(master: str | None, timeout: float = 5.0) -> None:
    """Fail fast when a standalone / Kubernetes master cannot be reached over TCP.

    Without this, Spark retries registering with an unreachable master for a minute and
    then leaves a stopped context behind.
    """
    if not master:
        return
    if master.startswith("spark://"):
        hosts = master[len("spark://") :].split(",")
        default_port = 7077
    elif master.startswith("k8s://"):
        url = urlsplit(master[len("k8s://") :])
        hosts = [url.netloc or url.path]
        default_port = 443
    else:
        return
    errors = []
    for host_port in hosts:
        host, _, port = host_port.rstrip("/").partition(":")
        try:
            with socket.create_connection((host, int(port or default_port)), timeout=timeout):
                return
        except (OSError, ValueError) as exc:
            errors.append(f"{host_port}: {getattr(exc, 'strerror', None) or exc}")
    raise OperationalError(
        f"cannot reach the Spark master {master!r} ({'; '.join(errors)})",
        sqlstate="08001",
        construct="engine.master",
        hint='start the master or fix engine.master in the policy (e.g. "local[*]" to run '
        "Spark inside this process)",
    )


class _Sessions:
    """Sessions dpsql built itself, stopped when the last engine using them closes."""

    lock = threading.Lock()
    users: ClassVar[dict[int, int]] = {}

    @classmethod
    def acquire(cls, session: Any) -> None:
        with cls.lock:
            cls.users[id(session)] = cls.users.get(id(session), 0) + 1

    @classmethod
    def release(cls, session: Any) -> None:
        with cls.lock:
            if id(session) not in cls.users:  # joined, not built by dpsql: not ours to stop
                return
            left = cls.users[id(session)] - 1
            if left <= 0:
                cls.users.pop(id(session), None)
                session.stop()
            else:
                cls.users[id(session)] = left


def start_session(master: str | None, conf: Mapping[str, Any], app_name: str = "dpsql") -> Any:
    """Build (or join the process's running) SparkSession, with clear errors on failure."""
    sql = _pyspark()
    check_java()
    probe_master(master)
    builder = sql.SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    for key, value in conf.items():
        builder = builder.config(key, str(value).lower() if isinstance(value, bool) else value)
    from pyspark import SparkContext

    joined = SparkContext._active_spark_context is not None  # getOrCreate will reuse it
    try:
        session = builder.getOrCreate()
    except Exception as exc:  # the JVM did not start, or rejected the master/conf
        text = str(exc)
        if "JAVA_GATEWAY_EXITED" in text or "Java gateway process exited" in text:
            raise OperationalError(
                "Spark could not start its Java process",
                sqlstate="08001",
                construct="java",
                hint=_INSTALL_JAVA,
            ) from None
        raise OperationalError(
            f"cannot start Spark with master {master!r}: {_spark_condition(exc)}",
            sqlstate="08001",
            construct="engine.master",
            hint="check engine.master (local[*], spark://host:7077, yarn, k8s://...) "
            "and engine.conf in the policy",
        ) from None
    if not joined or id(session) in _Sessions.users:  # built here, or by an earlier engine
        _Sessions.acquire(session)
    return session


def _spark_condition(exc: BaseException) -> str:
    """An error's class/condition only: Spark messages may quote data values."""
    condition = None
    for getter in ("getCondition", "getErrorClass"):
        if hasattr(exc, getter):
            try:
                condition = getattr(exc, getter)()
            except Exception:  # pragma: no cover - older pyspark
                condition = None
            if condition:
                break
    return condition or type(exc).__name__


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _catalog_name(source: str) -> str:
    """``db.table`` (or ``catalog.db.table``) with every part quoted for Spark SQL."""
    return ".".join(_quote(part) for part in source.split("."))


def _is_uri(source: str) -> bool:
    return "://" in source


def _file_format(source: str) -> str | None:
    name = source.rstrip("/").lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(FILE_SUFFIXES):
        return "csv"
    return None


def _dir_digest(path: Path) -> str:
    """Version of a directory source (Spark writes Parquet as directories): its file listing."""
    digest = hashlib.sha256()
    for item in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = item.stat()
        digest.update(f"{item.relative_to(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return "dir:" + digest.hexdigest()


class _Cancel:
    """What a QueryHandle interrupts: this query's Spark job group."""

    def __init__(self, context: Any, group: str) -> None:
        self.context = context
        self.group = group

    def interrupt(self) -> None:
        self.context.cancelJobGroup(self.group)


class SparkEngine:
    name = "spark"
    dialect = "spark"

    def __init__(
        self,
        policy: Policy,
        session: Any = None,
        *,
        master: str | None = None,
        conf: Mapping[str, Any] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.policy = policy
        self.versions: dict[str, str] = {}
        config = getattr(policy, "engine", None)
        master = master if master is not None else getattr(config, "master", None)
        settings = dict(getattr(config, "conf", None) or {})
        settings.update(conf or {})
        _pyspark()
        self._built = session is None
        root = start_session(master, settings) if session is None else session
        self._root = root
        try:
            self._spark = root.newSession()
            self._spark.conf.set("spark.sql.ansi.enabled", "false")
            self._views: list[str] = []
            self._persisted: list[Any] = []
            self.stores: list[Any] = []
            # id(tree), literals -> (tree, its Spark store variant or None): see _render
            self._store_plans: dict[tuple[int, Any], tuple[Any, Any]] = {}
            for table in policy.tables.values():
                self._load(table)
            if getattr(config, "prepared", "off") != "off":
                self._prepare(progress)
        except BaseException:
            self.close()
            raise

    # -- loading -----------------------------------------------------------------------------
    def _load(self, table: TablePolicy) -> None:
        where = f"tables.{table.name}.source"
        source = table.source
        if is_postgres(source):
            raise PolicyError(
                f"{where}: the Spark engine does not read a PostgreSQL source",
                construct=where,
                hint='use the DuckDB engine ([engine] name = "duckdb"), or export the table to '
                "Parquet and point source at it",
            )
        fmt = _file_format(source) if (table.source_path or _is_uri(source)) else None
        if table.source_path is not None or _is_uri(source):
            if fmt is None:
                raise PolicyError(
                    f"{where}: cannot tell the format of {source!r}",
                    construct=where,
                    hint="name the file or directory *.parquet or *.csv",
                )
            path = str(table.source_path) if table.source_path is not None else source
            df = self._read_file(path, fmt, where)
            if table.source_path is not None:
                local = table.source_path
                self.versions[table.name] = table.version or (
                    # a file's version is the DuckDB engine's (engine/versions.py), so the
                    # answer cache, keyed by data version, is shared across engines
                    _dir_digest(local) if local.is_dir() else file_version(local)
                )
            else:
                self.versions[table.name] = table.version or ""
        else:
            try:
                exists = self._spark.catalog.tableExists(source)
            except Exception:
                exists = False
            if not exists:
                raise PolicyError(
                    f"{where}: table {source!r} not found in the Spark catalog",
                    construct=where,
                    hint="fix the table name in the policy (db.table), create the table, or "
                    "point source at a *.parquet / *.csv path",
                )
            df = self._spark.table(_catalog_name(source))
            self.versions[table.name] = table.version or ""
        fields = {f.name.lower(): f for f in df.schema.fields}
        missing = [c for c in table.columns if c not in fields]
        if missing:
            raise PolicyError(
                f"{where}: column(s) {', '.join(missing)} declared in the policy are not in "
                f"{source!r}, which has: {', '.join(f.name for f in df.schema.fields)}",
                construct=where,
                hint=f"fix the names under [tables.{table.name}.columns] or the source",
            )
        if fmt == "csv":
            # Parsed text is kept (memory, then disk) like the DuckDB engine's CSV tables, so
            # queries do not re-parse it; the value check below fills the cache.
            df = df.persist(self._storage_level())
            self._persisted.append(df)
            self._check_text_values(df, table, fields, where)
        else:
            for col in table.columns.values():
                found = fields[col.name].dataType
                kind = found.typeName()
                if kind == "decimal" and col.type == "int" and getattr(found, "scale", 1) == 0:
                    continue
                if kind not in _COMPATIBLE[col.type]:
                    raise PolicyError(
                        f"{where}: column {col.name!r} is {found.simpleString()} in the source "
                        f"but declared {col.type!r} in the policy",
                        construct=f"tables.{table.name}.columns.{col.name}.type",
                        hint=f"declare type = {_suggest(kind)!r} or fix the source's schema",
                    )
        selected = df.selectExpr(
            *(
                f"CAST({_quote(fields[c.name].name)} AS {SPARK_TYPES[c.type]}) AS {_quote(c.name)}"
                for c in table.columns.values()
            )
        )
        selected.createOrReplaceTempView(table.name)
        self._views.append(table.name)

    def _prepare(self, progress: Callable[[str], None] | None) -> None:
        """Build or reuse each table's prepared store (dpsql.engine.spark_store); the compiler
        finds them through ``prepared.lookup``."""
        from dpsql.engine import prepared, spark_store

        mode = self.policy.engine.prepared
        directory = prepared.store_directory(self.policy) if mode == "disk" else None
        for table in self.policy.tables.values():
            try:
                made = spark_store.prepare_table(
                    self._spark,
                    table,
                    self.versions.get(table.name, ""),
                    directory=directory,
                    source=table.name,
                    storage_level=self._storage_level(),
                    progress=progress,
                )
            except Exception as exc:
                raise PolicyError(
                    f"tables.{table.name}: cannot build its prepared store "
                    f"({_spark_condition(exc)})",
                    construct=f"tables.{table.name}",
                    hint='set [engine] prepared = "off", or fix the source',
                ) from None
            if made is None:
                continue
            info, cached = made
            self._views.append(info.relation)
            if cached is not None:
                self._persisted.append(cached)
            spark_store.register(info)
            self.stores.append(info)

    def _storage_level(self) -> Any:
        from pyspark import StorageLevel

        return StorageLevel.MEMORY_AND_DISK

    def _read_file(self, path: str, fmt: str, where: str) -> Any:
        reader = self._spark.read
        try:
            if fmt == "parquet":
                return reader.parquet(path)
            # Every column as text, like the DuckDB engine, then cast to the declared type.
            return reader.option("header", True).option("inferSchema", False).csv(path)
        except Exception as exc:
            raise PolicyError(
                f"{where}: cannot read {path!r} ({_spark_condition(exc)})",
                construct=where,
                hint="fix the path in the policy; Spark must be able to read it",
            ) from None

    def _check_text_values(
        self, df: Any, table: TablePolicy, fields: Mapping[str, Any], where: str
    ) -> None:
        """One pass over a CSV source: does every value convert to its declared type?

        Answers one yes/no per column (no counts, no values), as the DuckDB engine does when it
        loads a CSV.
        """
        checks = []
        for col in table.columns.values():
            if col.type == "text":
                continue
            c = _quote(fields[col.name].name)
            bad = f"({c} IS NOT NULL AND CAST({c} AS {SPARK_TYPES[col.type]}) IS NULL)"
            if col.type == "int":  # non-ANSI CAST('1.5' AS BIGINT) truncates; DuckDB refuses
                bad = f"({bad} OR CAST({c} AS DOUBLE) <> CAST({c} AS BIGINT))"
            checks.append(f"MAX(CASE WHEN {bad} THEN 1 ELSE 0 END) AS {_quote(col.name)}")
        if not checks:
            return
        try:
            row = df.selectExpr(*checks).collect()[0]
        except Exception as exc:
            raise PolicyError(
                f"{where}: cannot read {table.source!r} ({_spark_condition(exc)})",
                construct=where,
                hint="fix the path in the policy; Spark must be able to read it",
            ) from None
        for name, flag in row.asDict().items():
            if flag:
                col = table.columns[name]
                raise PolicyError(
                    f"{where}: a value of column {name!r} does not convert to the declared "
                    f"type {col.type!r}",
                    construct=f"tables.{table.name}.columns.{name}.type",
                    hint='fix the declared type (e.g. "text" or "float") or clean the source',
                )

    # -- running -----------------------------------------------------------------------------
    def _run(
        self, query: CompiledQuery, handle: QueryHandle | None, collect: Callable[[Any], Any]
    ) -> Any:
        context = self._spark.sparkContext
        group = f"dpsql-{uuid.uuid4().hex}"
        try:
            context.setJobGroup(group, "dpsql query", interruptOnCancel=True)
            if handle is not None:
                handle.attach(_Cancel(context, group))  # type: ignore[arg-type]
                if handle.interrupted:
                    raise OperationalError("query cancelled", sqlstate="57014")
            return self._collect_staged(query, group, collect)
        except OperationalError:
            raise
        except Exception as exc:
            if handle is not None and handle.interrupted:
                raise OperationalError("query cancelled", sqlstate="57014") from None
            condition = _spark_condition(exc)
            if condition in ("Py4JNetworkError", "Py4JError", "ConnectionRefusedError"):
                raise OperationalError(
                    "the Spark driver is gone (its Java process stopped)",
                    sqlstate="08006",
                    hint="reconnect to start a new Spark session",
                ) from None
            raise OperationalError(
                f"engine error: {condition}",
                hint="please report this query",
            ) from None
        finally:
            if handle is not None:
                handle.attach(None)
            with contextlib.suppress(Exception):  # the JVM may be gone: nothing to clear
                context.setLocalProperty("spark.jobGroup.id", None)

    def _collect_staged(
        self, query: CompiledQuery, group: str, collect: Callable[[Any], Any]
    ) -> Any:
        """Run ``query`` with each CTE it reads more than once computed once (cached).

        Spark inlines CTEs, so a bounding step referenced by three later steps would be
        recomputed (scans and shuffles included) three times; DuckDB materialises such CTEs.
        The cached stages are per query (unique view names) and dropped afterwards.
        """
        stages, final = staged_sql(query, f"__{group.replace('-', '_')}_")
        made: list[tuple[str, Any]] = []
        try:
            for name, body in stages:
                df = self._spark.sql(body).persist(self._storage_level())
                made.append((name, df))
                df.createOrReplaceTempView(name)
                df.count()  # compute it once, here
            return collect(self._spark.sql(final))
        finally:
            for name, df in made:
                with contextlib.suppress(Exception):
                    self._spark.catalog.dropTempView(name)
                with contextlib.suppress(Exception):
                    df.unpersist()

    def execute(self, compiled: CompiledQuery, handle: QueryHandle | None = None) -> EngineResult:
        rows = self._run(self._runnable(compiled), handle, lambda df: df.collect())
        nk = len(compiled.key_columns)
        key_rows = [tuple(_python_key(v) for v in r[:nk]) for r in rows]
        measures = [
            [int(r[nk + j] or 0) for r in rows] for j in range(len(compiled.measure_columns))
        ]
        # Key types come from the policy's typing (the pipeline's scratch DuckDB), so both
        # engines describe results identically.
        main = EngineResult(key_rows, measures, ())
        return with_extras(main, compiled.extras, lambda query: self.execute(query, handle))

    def _render(self, compiled: CompiledQuery) -> str:
        """Spark SQL of ``compiled`` (:meth:`_runnable`), unstaged."""
        return self._runnable(compiled).render(self.dialect)

    def _runnable(self, compiled: CompiledQuery) -> CompiledQuery:
        """``compiled`` as this engine runs it: a prepared-store plan through
        spark_store.spark_tree (rewritten once per tree and literals, then rendered per secret
        like any other)."""
        if not self.stores and not prepared.STORES:
            return compiled
        from dpsql.engine import spark_store

        key = (id(compiled.expression), compiled.swaps)
        hit = self._store_plans.get(key)
        if hit is None or hit[0] is not compiled.expression:
            tree = compiled.expression
            names = spark_store.store_tables(tree)
            for name in names - {info.table for info in self.stores}:
                self._lazy_store(self.policy.tables[name])
            fixed = spark_store.spark_tree(tree, self.policy.tables) if names else None
            variant = (
                None
                if fixed is None
                else replace(compiled, built=fixed, builder=None, _pieces={}, _tree={})
            )
            if len(self._store_plans) >= 256:
                self._store_plans.clear()
            hit = self._store_plans[key] = (tree, variant)
        if hit[1] is None:
            return compiled
        return replace(hit[1], secret=compiled.secret)

    def _lazy_store(self, table: TablePolicy) -> None:
        """A DuckDB store's plan reached this engine, which keeps no store of ``table``: its
        derived rows as a plain view (computed per query, the same values)."""
        from dpsql.engine import spark_store

        view = spark_store.view_name(table)
        if view not in self._views:
            sql = spark_store.build_sql(table, prepared.store_layout(table), table.name)
            try:
                self._spark.sql(sql).createOrReplaceTempView(view)
            except Exception as exc:  # analysis only, no row read: the class is enough
                raise OperationalError(
                    f"engine error: {_spark_condition(exc)}", hint="please report this query"
                ) from None
            self._views.append(view)

    def fetch_matrix(self, query: exp.Expression, handle: QueryHandle | None = None) -> np.ndarray:
        """Rows of a generated integer query (dp_rule_list pattern counts): a tree of
        dpsql.lower.rows with its secret printed, rendered here in Spark SQL, once."""
        # a tree with its secret printed and no literal slots: a query of its own
        rows = self._run(CompiledQuery(query, (), ()), handle, lambda df: df.collect())
        if not rows:
            return np.zeros((0, len(query.expressions)), dtype=np.int64)
        return canonical_rows(np.array([tuple(r) for r in rows], dtype=np.int64))

    def close(self) -> None:
        if getattr(self, "stores", None):
            from dpsql.engine import spark_store

            for info in self.stores:
                spark_store.unregister(info)
            self.stores = []
        spark = getattr(self, "_spark", None)
        if spark is not None:
            for view in getattr(self, "_views", []):
                with contextlib.suppress(Exception):  # the JVM may already be gone
                    spark.catalog.dropTempView(view)
            for df in getattr(self, "_persisted", []):
                with contextlib.suppress(Exception):
                    df.unpersist()
            self._views = []
            self._persisted = []
        if self._built and getattr(self, "_root", None) is not None:
            _Sessions.release(self._root)
            self._root = None


def shared_ctes(tree: exp.Expression) -> set[str]:
    """The CTEs of ``tree``'s outermost WITH that it reads more than once (Spark recomputes
    each read: dpsql.engine.spark_engine stages them), read off the tree, nothing changed."""
    with_ = tree.args.get("with_")
    if with_ is None:
        return set()
    names = {cte.alias for cte in with_.expressions}
    reads = dict.fromkeys(names, 0)
    for table in tree.find_all(exp.Table):
        if table.name in names and not table.db:
            reads[table.name] += 1
    return {name for name, n in reads.items() if n > 1}


def stage_ctes(
    tree: exp.Expression, prefix: str
) -> tuple[list[tuple[str, exp.Expression]], exp.Expression]:
    """Cut a query's tree (changed in place) into (view name, query) stages for the CTEs it
    reads more than once, plus the rest.

    Each stage keeps the CTEs read only once defined before it; reads of staged CTEs name
    their views. Without such CTEs the tree is returned as it is, with no stage.
    """
    staged = shared_ctes(tree)
    if not staged:
        return [], tree
    with_ = tree.args["with_"]
    ctes = list(with_.expressions)
    for table in list(tree.find_all(exp.Table)):
        if table.name in staged and not table.db:
            alias = table.alias or table.name
            table.set("this", exp.to_identifier(prefix + table.name))
            table.set("alias", exp.TableAlias(this=exp.to_identifier(alias)))
    stages: list[tuple[str, exp.Expression]] = []
    inline: list[exp.CTE] = []
    for cte in ctes:
        if cte.alias in staged:
            body = cte.this.copy()
            if inline:
                body.set("with_", exp.With(expressions=[c.copy() for c in inline]))
            stages.append((prefix + cte.alias, body))
        else:
            inline.append(cte)
    if inline:
        with_.set("expressions", inline)
    else:
        tree.set("with_", None)
    return stages, tree


def staged_sql(query: CompiledQuery, prefix: str) -> tuple[list[tuple[str, str]], str]:
    """Spark SQL of ``query`` with each CTE read more than once cut out as a stage (view
    name, its SQL), and the rest: the tree is cut (:func:`stage_ctes`) and each part rendered
    once (CompiledQuery.render_split); a query with no such CTE is its usual rendering."""
    if not shared_ctes(query.expression):
        return [], query.render("spark")
    return query.render_split("spark", lambda tree: stage_ctes(tree, prefix))


def _python_key(value: Any) -> Any:
    """Plain Python values for released keys (Decimal would not survive JSON)."""
    if isinstance(value, decimal.Decimal):
        return float(value)
    return value


def _suggest(spark_type: str) -> str:
    for declared, kinds in _COMPATIBLE.items():
        if spark_type in kinds:
            return declared
    return "text"


__all__ = ["SPARK_TYPES", "SparkEngine", "check_java", "probe_master", "start_session"]
