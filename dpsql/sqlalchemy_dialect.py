"""SQLAlchemy dialect ``dpsql://``: the in-process pipeline behind ``create_engine``.

``create_engine("dpsql:///path/policy.toml?analyst=alice")`` (four slashes for an absolute
path) loads the policy and its data once per engine and hands each pooled connection to the
named analyst, so ``pandas.read_sql``, ``inspect()`` and Core ``select(...)`` work without
``dpsql serve``. Query options: ``analyst`` (default ``default``), ``database`` (a DuckDB file
holding the sources), ``engine`` (``duckdb`` or ``spark``).

Like every in-process front door it trusts its caller to name the analyst; the policy's
``[privacy] analysts`` list restricts the names. Only ``dpsql serve`` authenticates.

It is the one door built on another: a SQLAlchemy dialect's contract is a PEP 249 module, so
its connections are :class:`dpsql.dbapi.Connection` objects (each over its own session of the
service). The wire server and the command line open service sessions directly
(docs/architecture.md, "The doors").
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from sqlalchemy import types as sqltypes
from sqlalchemy.engine import default
from sqlalchemy.engine.url import URL

import dpsql
from dpsql.errors import check_analyst

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import IsolationLevel, ReflectedColumn

_COLUMN_TYPES: dict[str, Any] = {
    "int": sqltypes.BigInteger,
    "float": sqltypes.Float,
    "text": sqltypes.String,
    "bool": sqltypes.Boolean,
    "date": sqltypes.Date,
}


class DpsqlDialect(default.DefaultDialect):
    """The dialect: generic SQL with ``?`` parameters, reflection from the policy."""

    name = "dpsql"
    driver = "dpsql"
    default_paramstyle = "numeric_dollar"
    supports_statement_cache = True
    supports_native_boolean = True
    supports_native_decimal = False
    supports_sane_rowcount = False
    supports_sane_multi_rowcount = False
    supports_alter = False
    supports_sequences = False
    postfetch_lastrowid = False
    returns_native_bytes = False

    def __init__(self, **kwargs: Any) -> None:
        # $1, $2, ...: numbered, so each value lands where it stands in the text (the binder
        # numbers ? placeholders in tree order, which puts LIMIT ? before WHERE x = ?).
        kwargs.setdefault("paramstyle", "numeric_dollar")
        super().__init__(**kwargs)
        self._services: dict[tuple, dpsql.Service] = {}
        self._lock = threading.Lock()

    @classmethod
    def import_dbapi(cls) -> Any:
        return dpsql

    def create_connect_args(self, url: URL) -> tuple[list[Any], dict[str, Any]]:
        if not url.database:
            raise dpsql.InterfaceError(
                "a dpsql URL names a policy file",
                construct="URL",
                hint="create_engine('dpsql:///path/policy.toml?analyst=alice')",
            )
        options = dict(url.query)
        unknown = set(options) - {"analyst", "database", "engine"}
        if unknown:
            raise dpsql.InterfaceError(
                f"unknown dpsql URL option {sorted(unknown)[0]!r}",
                construct="URL",
                hint="options: analyst, database, engine",
            )
        return [], {
            "policy": url.database,
            "analyst": str(options.get("analyst", "default")),
            "database": str(options.get("database", ":memory:")),
            "engine": options.get("engine"),
        }

    # our PEP 249 Connection, which SQLAlchemy's DBAPIConnection protocol types more narrowly
    def connect(self, *cargs: Any, **cparams: Any) -> dpsql.Connection:  # type: ignore[override]
        """A connection of the engine's one Service (the data is loaded once per engine)."""
        key = (cparams["policy"], cparams["database"], cparams["engine"])
        with self._lock:
            service = self._services.get(key)
            if service is None:
                service = dpsql.Service(
                    cparams["policy"], cparams["database"], engine=cparams["engine"]
                )
                self._services[key] = service
        check_analyst(service.policy.analysts, cparams["analyst"], "?analyst=... in the URL")
        from dpsql.dbapi import Connection

        return Connection(service, cparams["analyst"], warn_low_budget=True)

    # -- session ---------------------------------------------------------------------------
    def _get_server_version_info(self, connection: Any) -> tuple[int, ...]:
        return tuple(int(p) for p in dpsql.__version__.split(".") if p.isdigit())

    def _get_default_schema_name(self, connection: Any) -> str:
        return "main"

    def get_isolation_level(self, dbapi_connection: Any) -> IsolationLevel:
        return "AUTOCOMMIT"

    def get_default_isolation_level(self, dbapi_conn: Any) -> IsolationLevel:
        return "AUTOCOMMIT"

    def do_ping(self, dbapi_connection: Any) -> bool:
        dbapi_connection._check_open()
        return True

    # -- reflection: the policy is the catalog (public, spends nothing) ---------------------
    def _policy(self, connection: Any) -> Any:
        return connection.connection.dbapi_connection.service.policy

    def _visible(self, connection: Any) -> dict[str, list[str]]:
        """table -> columns the connection's analyst may query ([access]; all by default)."""
        from dpsql.access import visible_tables

        dbapi_connection = connection.connection.dbapi_connection
        return visible_tables(dbapi_connection.service.policy, dbapi_connection.analyst)

    def get_schema_names(self, connection: Any, **kw: Any) -> list[str]:
        return ["main"]

    def get_table_names(self, connection: Any, schema: str | None = None, **kw: Any) -> list[str]:
        return sorted(self._visible(connection))

    def has_table(
        self, connection: Any, table_name: str, schema: str | None = None, **kw: Any
    ) -> bool:
        return table_name.lower() in self._visible(connection)

    def get_view_names(self, connection: Any, schema: str | None = None, **kw: Any) -> list[str]:
        return []

    def get_columns(
        self, connection: Any, table_name: str, schema: str | None = None, **kw: Any
    ) -> list[ReflectedColumn]:
        from sqlalchemy.exc import NoSuchTableError

        table = self._policy(connection).table(table_name)
        visible = self._visible(connection).get(table_name.lower())
        if table is None or visible is None:
            raise NoSuchTableError(table_name)
        return [
            {
                "name": column.name,
                "type": _COLUMN_TYPES[column.type](),
                "nullable": column.nullable,
                "default": None,
                "autoincrement": False,
            }
            for column in table.columns.values()
            if column.name.lower() in visible
        ]

    def get_pk_constraint(self, connection: Any, table_name: str, schema: str | None = None, **kw):
        return {"constrained_columns": [], "name": None}

    def get_foreign_keys(self, connection: Any, table_name: str, schema: str | None = None, **kw):
        return []

    def get_indexes(self, connection: Any, table_name: str, schema: str | None = None, **kw):
        return []

    def get_unique_constraints(
        self, connection: Any, table_name: str, schema: str | None = None, **kw: Any
    ) -> list[Any]:
        return []

    def get_check_constraints(
        self, connection: Any, table_name: str, schema: str | None = None, **kw: Any
    ) -> list[Any]:
        return []

    def dispose(self) -> None:
        """Close the engine's Services (called by :meth:`Engine.dispose` via the pool)."""
        with self._lock:
            services, self._services = list(self._services.values()), {}
        for service in services:
            service.close()


dialect = DpsqlDialect
