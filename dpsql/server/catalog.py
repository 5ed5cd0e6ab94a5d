"""Catalog and session queries, answered from an empty shadow schema — never from private data.

The shadow is a separate in-memory DuckDB database holding (a) the policy's tables with the same
names, columns and types and zero rows, (b) our own ``pg_catalog`` (schema ``pgc``) and
``information_schema`` (schema ``infs``) tables filled from the policy, and (c) macros for the
PostgreSQL functions clients call (``format_type``, ``pg_get_userbyid``, ...). External access is
off and the configuration locked, so a query routed here can read nothing but the public schema.

Client SQL is translated by :mod:`dpsql.server.catalog_sql`; only SELECT-type statements are
ever executed here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import duckdb

from dpsql.server import catalog_schema as cs
from dpsql.server import types as t
from dpsql.server.backend import inline_parameters
from dpsql.server.catalog_sql import (
    CatalogError,
    SessionInfo,
    rewrite,
)

SHADOW_TIMEOUT = 30.0  # seconds before a catalog query is interrupted
SHADOW_MAX_ROWS = 100_000  # catalog answers are small; this bounds a session's memory

# (name, params, body): PostgreSQL functions the catalog queries of psql, JDBC, SQLAlchemy and
# BI tools call. Overloads share a name.
_MACROS: list[tuple[str, list[tuple[str, str]]]] = [
    ("pg_get_userbyid", [("o", f"'{cs.OWNER_NAME}'")]),
    ("pg_table_is_visible", [("o", "true")]),
    ("pg_type_is_visible", [("o", "true")]),
    ("pg_function_is_visible", [("o", "true")]),
    ("pg_collation_is_visible", [("o", "true")]),
    ("pg_opclass_is_visible", [("o", "true")]),
    ("pg_operator_is_visible", [("o", "true")]),
    ("pg_conversion_is_visible", [("o", "true")]),
    ("pg_ts_config_is_visible", [("o", "true")]),
    ("pg_statistics_obj_is_visible", [("o", "true")]),
    (
        "format_type",
        [("o, m", "coalesce((SELECT f FROM pgc.dp_type_names WHERE oid = o), '???')")],
    ),
    (
        "dp_regtype_name",
        [("o", "coalesce((SELECT f FROM pgc.dp_type_names WHERE oid = o), CAST(o AS VARCHAR))")],
    ),
    (
        "dp_regtype_oid",
        [
            (
                "s",
                "(SELECT min(oid) FROM pgc.pg_type WHERE typname = s OR oid IN "
                "(SELECT oid FROM pgc.dp_type_names WHERE f = s))",
            )
        ],
    ),
    (
        "dp_regclass_oid",
        [
            (
                "s",
                "(SELECT min(oid) FROM pgc.pg_class WHERE relname = "
                "regexp_replace(replace(s, '\"', ''), '^.*\\.', ''))",
            )
        ],
    ),
    (
        "dp_regclass_name",
        [
            (
                "o",
                "coalesce((SELECT min(relname) FROM pgc.pg_class WHERE "
                "oid = o), CAST(o AS VARCHAR))",
            )
        ],
    ),
    ("dp_regnamespace_oid", [("s", "(SELECT min(oid) FROM pgc.pg_namespace WHERE nspname = s)")]),
    ("dp_regnamespace_name", [("o", "(SELECT min(nspname) FROM pgc.pg_namespace WHERE oid = o)")]),
    # regproc columns (typinput, ...) hold function names here, so a regproc is its name
    ("dp_regproc_oid", [("s", "regexp_replace(s, '^pg_catalog\\.', '')")]),
    ("dp_regproc_name", [("o", "CAST(o AS VARCHAR)")]),
    ("dp_regrole_oid", [("s", f"CAST({cs.OWNER_OID} AS UINTEGER)")]),
    ("dp_regrole_name", [("o", f"'{cs.OWNER_NAME}'")]),
    ("obj_description", [("o", "CAST(NULL AS VARCHAR)"), ("o, c", "CAST(NULL AS VARCHAR)")]),
    ("col_description", [("o, n", "CAST(NULL AS VARCHAR)")]),
    ("shobj_description", [("o, c", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_expr", [("e, r", "CAST(NULL AS VARCHAR)"), ("e, r, p", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_indexdef", [("o", "CAST(NULL AS VARCHAR)"), ("o, c, p", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_constraintdef", [("o", "CAST(NULL AS VARCHAR)"), ("o, p", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_viewdef", [("o", "CAST(NULL AS VARCHAR)"), ("o, p", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_triggerdef", [("o", "CAST(NULL AS VARCHAR)"), ("o, p", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_ruledef", [("o", "CAST(NULL AS VARCHAR)"), ("o, p", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_functiondef", [("o", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_function_arguments", [("o", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_function_identity_arguments", [("o", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_function_result", [("o", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_partkeydef", [("o", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_partition_constraintdef", [("o", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_statisticsobjdef_columns", [("o", "CAST(NULL AS VARCHAR)")]),
    ("pg_get_serial_sequence", [("a, b", "CAST(NULL AS VARCHAR)")]),
    ("pg_encoding_to_char", [("e", "'UTF8'")]),
    ("pg_char_to_encoding", [("e", "6")]),
    ("has_table_privilege", [("a, b", "true"), ("a, b, c", "true")]),
    ("has_schema_privilege", [("a, b", "true"), ("a, b, c", "true")]),
    ("has_database_privilege", [("a, b", "true"), ("a, b, c", "true")]),
    ("has_column_privilege", [("a, b, c", "true"), ("a, b, c, d", "true")]),
    ("has_any_column_privilege", [("a, b", "true"), ("a, b, c", "true")]),
    ("has_function_privilege", [("a, b", "true"), ("a, b, c", "true")]),
    ("has_sequence_privilege", [("a, b", "true"), ("a, b, c", "true")]),
    ("pg_has_role", [("a, b", "true"), ("a, b, c", "true")]),
    ("pg_is_in_recovery", [("", "false")]),
    ("pg_size_pretty", [("x", "CAST(x AS VARCHAR) || ' bytes'")]),
    ("pg_relation_size", [("x", "CAST(0 AS BIGINT)"), ("x, f", "CAST(0 AS BIGINT)")]),
    ("pg_total_relation_size", [("x", "CAST(0 AS BIGINT)")]),
    ("pg_table_size", [("x", "CAST(0 AS BIGINT)")]),
    ("pg_indexes_size", [("x", "CAST(0 AS BIGINT)")]),
    ("pg_database_size", [("x", "CAST(0 AS BIGINT)")]),
    ("pg_tablespace_location", [("x", "''")]),
    ("pg_is_other_temp_schema", [("x", "false")]),
    ("pg_my_temp_schema", [("", "CAST(0 AS UINTEGER)")]),
    ("to_regclass", [("s", "pgc.dp_regclass_oid(s)")]),
    ("to_regtype", [("s", "pgc.dp_regtype_oid(s)")]),
    ("current_schemas", [("b", "['pg_catalog', 'public']")]),
    (
        "_pg_expandarray",
        [
            (
                "a",
                "unnest(list_transform(range(1, len(a) + 1), "
                "lambda i: struct_pack(x := a[i], n := i)))",
            )
        ],
    ),
    ("array_lower", [("a, d", "CASE WHEN len(a) > 0 THEN 1 END")]),
    ("array_upper", [("a, d", "CASE WHEN len(a) > 0 THEN len(a) END")]),
    ("txid_current", [("", "CAST(1 AS BIGINT)")]),
    ("pg_postmaster_start_time", [("", "TIMESTAMPTZ '2000-01-01 00:00:00+00'")]),
    ("inet_server_addr", [("", "CAST(NULL AS VARCHAR)")]),
    ("inet_server_port", [("", "CAST(NULL AS INTEGER)")]),
    ("inet_client_addr", [("", "CAST(NULL AS VARCHAR)")]),
    ("row_security_active", [("x", "false")]),
    ("pg_relation_is_publishable", [("x", "false")]),
    (
        "quote_ident",
        [
            (
                "x",
                "CASE WHEN regexp_full_match(x, '[a-z_][a-z0-9_$]*') THEN x "
                "ELSE '\"' || replace(x, '\"', '\"\"') || '\"' END",
            )
        ],
    ),
]


@dataclass(frozen=True)
class CatalogResult:
    columns: tuple[tuple[str, int], ...]  # (name, type OID)
    rows: list[tuple]


class Shadow:
    """The shadow database: one per server, a DuckDB cursor per session."""

    def __init__(self, policy: object, dataset: str, settings: Mapping[str, str]) -> None:
        self.dataset = dataset
        self._db = duckdb.connect(":memory:", config={"threads": 1})
        self._lock = threading.Lock()
        self.tables = _tables_from_policy(policy)
        self._build(settings)
        # No temp directory: DuckDB would otherwise add it (".tmp" under the working directory,
        # where another DuckDB may spill) to the paths readable despite the lock below.
        self._db.execute("SET temp_directory = ''")
        self._db.execute("SET memory_limit = '256MB'")
        self._db.execute("SET enable_external_access = false")
        self._db.execute("SET lock_configuration = true")

    def _build(self, settings: Mapping[str, str]) -> None:
        db = self._db
        db.execute("CREATE SCHEMA public")
        db.execute("CREATE SCHEMA pgc")
        db.execute("CREATE SCHEMA infs")
        for table in self.tables:
            cols = ", ".join(f'"{c.name}" {_duck_type(c.type_oid)}' for c in table.columns)
            db.execute(f'CREATE TABLE public."{table.name}" ({cols})')
        for name, cols in cs.PG_TABLES.items():
            spec = ", ".join(f'"{c}" {ty}' for c, ty in cols)
            db.execute(f"CREATE TABLE pgc.{name} ({spec})")
        rows = {
            "pg_type": cs.rows_pg_type(),
            "pg_namespace": cs.rows_pg_namespace(),
            "pg_class": cs.rows_pg_class(self.tables),
            "pg_attribute": cs.rows_pg_attribute(self.tables),
            "pg_database": cs.rows_pg_database(self.dataset),
            "pg_settings": cs.rows_pg_settings(dict(settings)),
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
        for name, overloads in _MACROS:
            defs = ", ".join(f"({params}) AS {body}" for params, body in overloads)
            db.execute(f"CREATE MACRO pgc.{name} {defs}")
        self._build_functions()
        self._build_information_schema()

    def _build_functions(self) -> None:
        self._db.execute(
            "CREATE MACRO pgc.pg_get_keywords() AS TABLE SELECT keyword_name AS word, "
            "CASE keyword_category WHEN 'reserved' THEN 'R' WHEN 'unreserved' THEN 'U' "
            "WHEN 'type_function' THEN 'T' ELSE 'C' END AS catcode, true AS barelabel, "
            "keyword_category AS catdesc, 'can be bare label' AS baredesc "
            "FROM duckdb_keywords()"
        )

    def _build_information_schema(self) -> None:
        db = self._db
        ds = self.dataset.replace("'", "''")
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
        db.executemany(
            "INSERT INTO infs.tables VALUES (?, 'public', ?, 'BASE TABLE', NULL, NULL, NULL, "
            "NULL, NULL, 'NO', 'NO', NULL)",
            [(self.dataset, tb.name) for tb in self.tables],
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
        precision = {t.INT8: (64, 2, 0), t.FLOAT8: (53, 2, None)}
        col_rows = []
        for tb in self.tables:
            for num, col in enumerate(tb.columns, start=1):
                prec, radix, scale = precision.get(col.type_oid, (None, None, None))
                col_rows.append(
                    (
                        self.dataset,
                        "public",
                        tb.name,
                        col.name,
                        num,
                        None,
                        "YES" if col.nullable else "NO",
                        cs.format_type(col.type_oid),
                        None,
                        1073741824 if col.type_oid == t.TEXT else None,
                        prec,
                        radix,
                        scale,
                        0 if col.type_oid == t.DATE else None,
                        None,
                        None,
                        None,
                        None,
                        None,
                        None,
                        None,
                        None,
                        None,
                        None,
                        None,
                        self.dataset,
                        "pg_catalog",
                        t.PG_TYPES[col.type_oid].name,
                        None,
                        None,
                        None,
                        None,
                        str(num),
                        "NO",
                        "NO",
                        None,
                        None,
                        None,
                        None,
                        None,
                        "NO",
                        "NEVER",
                        None,
                        "NO",
                    )
                )
        if col_rows:
            marks = ", ".join("?" * len(col_rows[0]))
            db.executemany(f"INSERT INTO infs.columns VALUES ({marks})", col_rows)
        for name, cols in {
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
        }.items():
            spec = ", ".join(f"{c.strip()} VARCHAR" for c in cols.split(","))
            db.execute(f"CREATE TABLE infs.{name} ({spec})")

    def cursor(self) -> ShadowCursor:
        with self._lock:
            cur = self._db.cursor()
        cur.execute("SET search_path = 'pgc,public'")
        return ShadowCursor(cur)

    def close(self) -> None:
        self._db.close()


class ShadowCursor:
    """One session's handle on the shadow; ``run`` is blocking (call it from a worker thread)."""

    def __init__(self, cursor: duckdb.DuckDBPyConnection) -> None:
        self._cur = cursor

    def run(self, sql: str, params: Sequence[object] | None, info: SessionInfo) -> CatalogResult:
        if params:
            # Inline bound values as literals, so rewriting sees them (current_setting($1),
            # $1::regclass). Safe here: literals are escaped, and the shadow holds no data.
            sql = inline_parameters(sql, params)
        duck_sql = rewrite(sql, info)
        try:
            statements = duckdb.extract_statements(duck_sql)
        except duckdb.Error as exc:
            raise CatalogError(_clean(exc), "42601") from None
        if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
            raise CatalogError(
                "cannot execute this statement: dpsql is read-only",
                "25006",
                hint="only queries are accepted; private tables are answered with "
                "differential privacy, the catalog from the policy",
            )
        watchdog = threading.Timer(SHADOW_TIMEOUT, self._cur.interrupt)
        watchdog.daemon = True
        watchdog.start()
        try:
            rel = self._cur.execute(duck_sql)
            description = rel.description or []
            rows = rel.fetchmany(SHADOW_MAX_ROWS + 1)
        except duckdb.InterruptException:
            raise CatalogError("canceling statement due to user request", "57014") from None
        except duckdb.CatalogException as exc:
            raise CatalogError(_clean(exc), _catalog_state(exc)) from None
        except duckdb.ParserException as exc:
            raise CatalogError(_clean(exc), "42601") from None
        except duckdb.BinderException as exc:
            raise CatalogError(_clean(exc), "42703") from None
        except duckdb.Error as exc:
            raise CatalogError(_clean(exc), "XX000") from None
        finally:
            watchdog.cancel()
        if len(rows) > SHADOW_MAX_ROWS:
            raise CatalogError(f"catalog query returned more than {SHADOW_MAX_ROWS} rows", "54000")
        columns = tuple((d[0], _column_oid(d[0], str(d[1]))) for d in description)
        return CatalogResult(columns, rows)

    def describe(self, sql: str, info: SessionInfo) -> tuple[tuple[str, int], ...]:
        """Result columns of a catalog query, by running it (it reads no private data)."""
        duck_sql = rewrite(sql, info)
        try:
            rel = self._cur.execute(f"DESCRIBE {duck_sql}")
            return tuple((r[0], t.duckdb_type_oid(str(r[1]))) for r in rel.fetchall())
        except duckdb.Error as exc:
            raise CatalogError(_clean(exc), "42601") from None

    def interrupt(self) -> None:
        self._cur.interrupt()

    def close(self) -> None:
        with contextlib.suppress(duckdb.Error):
            self._cur.close()


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


def _catalog_state(exc: Exception) -> str:
    text = str(exc)
    if "Table with name" in text or ("does not exist" in text and "Table" in text):
        return "42P01"
    if "Function" in text:
        return "42883"
    return "42704"


def _clean(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for prefix in ("Catalog Error: ", "Binder Error: ", "Parser Error: ", "Conversion Error: "):
        text = text.removeprefix(prefix)
    return text.replace("pgc.", "pg_catalog.").replace("infs.", "information_schema.")


def _duck_type(oid: int) -> str:
    return {
        t.INT8: "BIGINT",
        t.FLOAT8: "DOUBLE",
        t.TEXT: "VARCHAR",
        t.BOOL: "BOOLEAN",
        t.DATE: "DATE",
        t.INT4: "INTEGER",
    }.get(oid, "VARCHAR")


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
