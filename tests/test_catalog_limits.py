"""Catalog queries and post-processing cannot take the server from other analysts (issue 10.6).

Catalog SQL (anything naming no private table) may only call the functions client introspection
uses, is capped in rows and bytes while it is fetched, runs under a short statement timeout in a
shadow process with its own memory limits, and queues fairly between analysts. Post-processing
(``SELECT <expr>`` without FROM, expressions over released aggregates) gets the binder's own
function whitelist, result caps and a deadline on the shared scratch connection.
"""

from __future__ import annotations

import pickle
import shutil
import threading
from pathlib import Path

import pytest
import sqlglot
from conftest import fixture_policy

import dpsql
from dpsql.dbapi import connect_service
from dpsql.engine import scratch
from dpsql.engine.limits import LimitExceeded, ResultCaps, Watchdog, fetch_capped
from dpsql.errors import DataError, OperationalError, ProgrammingError
from dpsql.server import catalog
from dpsql.server.catalog import Shadow, load_reply
from dpsql.server.catalog_limits import (
    ALLOWED_FUNCTIONS,
    TABLE_FUNCTIONS,
    CatalogLimits,
    CatalogRefusal,
)
from dpsql.server.catalog_schema import MACROS, TABLE_MACROS
from dpsql.server.catalog_sql import CatalogError, SessionInfo, rewrite
from dpsql.server.server import Server, ServerThread
from dpsql.server.settings import DEFAULTS
from dpsql.server.testing import RawClient
from dpsql.server.users import UserStore, users_path

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "pw"
INFO = SessionInfo("alice", "visits", 7, {"server_version_num": "160000"})
# Small limits, so that every cap is reached quickly and cheaply.
LIMITS = CatalogLimits(
    timeout=0.5,
    max_rows=1000,
    max_bytes=1 << 20,
    memory_limit="64MB",
    address_space=512 << 20,
    processes=2,
    queue=4,
)
# 10 ** 9 bytes from a 10-byte literal: nine levels that each repeat the previous one ten times.
CONCAT_CHAIN = (
    "WITH l0 AS (SELECT 'xxxxxxxxxx' AS s), "
    + ", ".join(
        f"l{i} AS (SELECT {' || '.join(['s'] * 10)} AS s FROM l{i - 1})" for i in range(1, 9)
    )
    + " SELECT length(s) FROM l8"
)


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("limits")
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(ROOT / "fixtures" / name, root / name)
    users = UserStore(users_path(root / "visits.toml"))
    for name in ("alice", "bob"):
        users.add(name, PASSWORD)
    return root / "visits.toml"


@pytest.fixture(scope="module")
def server(policy_path):
    service = dpsql.Service(policy_path, cache=False)

    def make() -> Server:
        srv = Server(service, UserStore(users_path(policy_path)))
        srv.shadow.close()  # the default limits: replaced by the small ones
        srv.shadow = Shadow(srv.policy, srv.dataset, DEFAULTS, LIMITS)
        return srv

    thread = ServerThread(make)
    thread.start()
    yield thread
    thread.stop()
    service.close()


def _client(server, user: str = "alice") -> RawClient:
    c = RawClient("127.0.0.1", server.port)
    assert c.login(user, PASSWORD).status == "I"
    return c


def _error(client: RawClient, sql: str) -> dict[str, str]:
    reply = client.query(sql)
    assert reply.status == "I" and reply.rows() == [], sql
    (err,) = reply.errors()
    return err


# --- the whitelist ---------------------------------------------------------------------------


def _refusal(sql: str, source: str | None = None) -> CatalogRefusal:
    with pytest.raises(CatalogRefusal) as info:
        rewrite(sql, INFO, source=source)
    return info.value


def test_repeat_is_refused_with_its_name_position_and_a_hint():
    err = _refusal("SELECT 1,\n  repeat('x', 150000000)")
    assert err.sqlstate == "42883" and "repeat()" in err.message
    assert (err.position.line, err.position.column) == (2, 3) and err.hint
    err = _refusal("SELECT pg_catalog.lpad(relname, 1000000000) FROM pg_class")
    assert err.sqlstate == "42883" and "lpad()" in err.message and err.position.column == 19


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM read_blob('/etc/passwd')",
        "SELECT * FROM sniff_csv('/etc/passwd')",
        "SELECT * FROM duckdb_extensions()",
        "SELECT * FROM pragma_version()",
        "SELECT set_config('search_path', 'x', false)",
        "SELECT getvariable('x')",
        "SELECT printf('%1000000000d', 1)",
        "SELECT list_transform([1], x -> x)",
        "SELECT \"repeat\"('x', 3)",
        "SELECT main.repeat('x', 3)",
        "VALUES (repeat('x', 3))",
        "SELECT relname FROM pg_class WHERE relname = repeat('x', 3)",
        "SELECT * FROM pg_class c, LATERAL (SELECT repeat(c.relname, 1000000))",
    ],
)
def test_files_settings_and_unknown_functions_are_refused(sql):
    assert _refusal(sql).sqlstate == "42883"


def test_a_table_named_like_a_path_is_not_a_file_read():
    err = _refusal('SELECT * FROM "/etc/passwd"')
    assert err.sqlstate == "42P01" and "no files" in err.hint


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT len(range(1000000000))",
        "SELECT range(10 ^ 13)",
        "SELECT generate_series(1, 1000000000)",
        "SELECT unnest(generate_series(1, relnatts * 1000000000)) FROM pg_class",
        "SELECT * FROM pg_class, LATERAL generate_series(1, 1000000000) g",
    ],
)
def test_a_series_used_as_a_value_is_bounded(sql):
    err = _refusal(sql)
    assert err.sqlstate == "54000" and "100000 values" in err.message


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT generate_series(1, 10)",
        "SELECT range(5)",
        "SELECT generate_series(0, array_upper(indkey, 1)) FROM pg_index",
        "SELECT count(*) FROM generate_series(1, 10000000000000)",  # streams: the timeout bounds it
        "SELECT pg_catalog.format('%s FROM %s', 'a', 'b')",
    ],
)
def test_bounded_series_and_table_functions_are_accepted(sql):
    rewrite(sql, INFO)


def test_format_takes_no_width():
    assert _refusal("SELECT format('{:>1000000000}', 'x')").sqlstate == "54000"


def test_only_queries_are_accepted():
    for sql in ("CREATE TABLE t (a INT)", "COPY (SELECT 1) TO 'x.csv'", "PRAGMA version"):
        assert _refusal(sql).sqlstate == "25006"


def test_positions_are_in_the_clients_text():
    """Parameters are inlined and OPERATOR(pg_catalog.~) rewritten before the check."""
    source = "SELECT $1, c.relname OPERATOR(pg_catalog.~) 'x', repeat(c.relname, 2) FROM pg_class c"
    text = source.replace("$1", "'a long parameter value'")
    err = _refusal(text, source=source)
    assert err.position.offset == source.index("repeat")


def test_every_shadow_macro_is_allowed():
    assert {name for name, _ in MACROS} <= ALLOWED_FUNCTIONS
    assert set(TABLE_MACROS) <= TABLE_FUNCTIONS


# Real catalog queries of psql 15, pgjdbc 42.7, SQLAlchemy 2, Npgsql (Power BI), asyncpg,
# ActiveRecord, Hibernate, pgcli, Metabase, DBeaver and Tableau shapes: all pass the check.
CLIENT_QUERIES = [
    # psql \d visits, \dt, \l, \df
    "SELECT c.oid, n.nspname, c.relname FROM pg_catalog.pg_class c LEFT JOIN "
    "pg_catalog.pg_namespace n ON n.oid = c.relnamespace WHERE c.relname OPERATOR(pg_catalog.~) "
    "'^(visits)$' COLLATE pg_catalog.default AND pg_catalog.pg_table_is_visible(c.oid) "
    "ORDER BY 2, 3",
    "SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod), (SELECT "
    "pg_catalog.pg_get_expr(d.adbin, d.adrelid, true) FROM pg_catalog.pg_attrdef d WHERE "
    "d.adrelid = a.attrelid AND d.adnum = a.attnum AND a.atthasdef), a.attnotnull, (SELECT "
    "c.collname FROM pg_catalog.pg_collation c, pg_catalog.pg_type t WHERE c.oid = "
    "a.attcollation AND t.oid = a.atttypid AND a.attcollation <> t.typcollation) AS "
    "attcollation, a.attidentity, a.attgenerated FROM pg_catalog.pg_attribute a WHERE "
    "a.attrelid = '16384' AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
    'SELECT n.nspname as "Schema", c.relname as "Name", CASE c.relkind WHEN \'r\' THEN '
    "'table' WHEN 'v' THEN 'view' END as \"Type\", pg_catalog.pg_get_userbyid(c.relowner) as "
    '"Owner" FROM pg_catalog.pg_class c LEFT JOIN pg_catalog.pg_namespace n ON n.oid = '
    "c.relnamespace WHERE c.relkind IN ('r','p','') AND n.nspname <> 'pg_catalog' AND "
    "n.nspname !~ '^pg_toast' AND n.nspname <> 'information_schema' AND "
    "pg_catalog.pg_table_is_visible(c.oid) ORDER BY 1,2",
    'SELECT d.datname as "Name", pg_catalog.pg_get_userbyid(d.datdba) as "Owner", '
    'pg_catalog.pg_encoding_to_char(d.encoding) as "Encoding", pg_catalog.array_to_string('
    "d.datacl, E'\\n') AS \"Access privileges\" FROM pg_catalog.pg_database d ORDER BY 1",
    "SELECT n.nspname, p.proname, pg_catalog.pg_get_function_result(p.oid), "
    "pg_catalog.pg_get_function_arguments(p.oid) FROM pg_catalog.pg_proc p LEFT JOIN "
    "pg_catalog.pg_namespace n ON n.oid = p.pronamespace WHERE "
    "pg_catalog.pg_function_is_visible(p.oid) ORDER BY 1, 2",
    "SELECT pg_catalog.format('%s FROM %s', 'a', pg_catalog.quote_ident('b'))",
    "SELECT s.r FROM pg_catalog.generate_series(0, pg_catalog.array_upper("
    "'{1,2}'::pg_catalog.int2[], 1)) s(r)",
    # pgjdbc DatabaseMetaData
    "SELECT NULL AS TABLE_CAT, n.nspname AS TABLE_SCHEM, c.relname AS TABLE_NAME, CASE n.nspname "
    "~ '^pg_' OR n.nspname = 'information_schema' WHEN true THEN CASE WHEN n.nspname = "
    "'pg_catalog' THEN 'SYSTEM TABLE' END ELSE CASE c.relkind WHEN 'r' THEN 'TABLE' END END AS "
    "TABLE_TYPE, d.description AS REMARKS FROM pg_catalog.pg_namespace n, pg_catalog.pg_class c "
    "LEFT JOIN pg_catalog.pg_description d ON (c.oid = d.objoid AND d.objsubid = 0 and "
    "d.classoid = 'pg_class'::regclass) WHERE c.relnamespace = n.oid AND c.relname LIKE '%' "
    "ORDER BY TABLE_TYPE, TABLE_SCHEM, TABLE_NAME",
    "SELECT * FROM (SELECT n.nspname, c.relname, a.attname, a.atttypid, a.attnotnull OR "
    "(t.typtype = 'd' AND t.typnotnull) AS attnotnull, a.atttypmod, a.attlen, t.typtypmod, "
    "row_number() OVER (PARTITION BY a.attrelid ORDER BY a.attnum) AS attnum, nullif("
    "a.attidentity, '') as attidentity, nullif(a.attgenerated, '') as attgenerated, "
    "pg_catalog.pg_get_expr(def.adbin, def.adrelid) AS adsrc, dsc.description, t.typbasetype, "
    "t.typtype FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_class c ON (c.relnamespace = "
    "n.oid) JOIN pg_catalog.pg_attribute a ON (a.attrelid=c.oid) JOIN pg_catalog.pg_type t ON "
    "(a.atttypid = t.oid) LEFT JOIN pg_catalog.pg_attrdef def ON (a.attrelid=def.adrelid AND "
    "a.attnum = def.adnum) LEFT JOIN pg_catalog.pg_description dsc ON (c.oid=dsc.objoid AND "
    "a.attnum = dsc.objsubid) WHERE c.relkind in ('r','p','v','f','m') and a.attnum > 0 AND NOT "
    "a.attisdropped AND c.relname LIKE 'visits') c WHERE true ORDER BY nspname,c.relname,attnum",
    "SELECT NULL AS TABLE_CAT, n.nspname AS TABLE_SCHEM, ct.relname AS TABLE_NAME, "
    "a.attname AS COLUMN_NAME, (information_schema._pg_expandarray(i.indkey)).n AS KEY_SEQ, "
    "ci.relname AS PK_NAME, information_schema._pg_expandarray(i.indkey) AS KEYS, a.attnum AS "
    "A_ATTNUM FROM pg_catalog.pg_class ct JOIN pg_catalog.pg_attribute a ON (ct.oid = "
    "a.attrelid) JOIN pg_catalog.pg_namespace n ON (ct.relnamespace = n.oid) JOIN "
    "pg_catalog.pg_index i ON ( a.attrelid = i.indrelid) JOIN pg_catalog.pg_class ci ON "
    "(ci.oid = i.indexrelid) WHERE true AND ct.relname = E'visits' AND i.indisprimary",
    "SELECT typinput='pg_catalog.array_in'::regproc as is_array, typtype, typname, "
    "pg_type.oid FROM pg_catalog.pg_type LEFT JOIN (select ns.oid as nspoid, ns.nspname, r.r "
    "from pg_namespace as ns join ( select s.r, (current_schemas(false))[s.r] as nspname from "
    "generate_series(1, array_upper(current_schemas(false), 1)) as s(r) ) as r using ( nspname "
    ") ) as sp ON sp.nspoid = typnamespace WHERE pg_type.oid = 20 ORDER BY sp.r, pg_type.oid "
    "DESC",
    "SELECT string_agg(word, ',') FROM pg_catalog.pg_get_keywords() WHERE word <> ALL "
    "('{a,abs,absolute}'::text[])",
    # SQLAlchemy 2 (PostgreSQL dialect)
    "SELECT pg_catalog.pg_class.relname FROM pg_catalog.pg_class JOIN pg_catalog.pg_namespace "
    "ON pg_catalog.pg_namespace.oid = pg_catalog.pg_class.relnamespace WHERE "
    "pg_catalog.pg_class.relkind = ANY (ARRAY['r', 'p']) AND "
    "pg_catalog.pg_class.relpersistence != 't' AND pg_catalog.pg_table_is_visible("
    "pg_catalog.pg_class.oid) AND pg_catalog.pg_namespace.nspname != 'pg_catalog'",
    "SELECT pg_catalog.pg_attribute.attname AS name, pg_catalog.format_type("
    "pg_catalog.pg_attribute.atttypid, pg_catalog.pg_attribute.atttypmod) AS format_type, "
    "(SELECT pg_catalog.pg_get_expr(pg_catalog.pg_attrdef.adbin, pg_catalog.pg_attrdef.adrelid) "
    "FROM pg_catalog.pg_attrdef WHERE pg_catalog.pg_attrdef.adrelid = "
    "pg_catalog.pg_attribute.attrelid AND pg_catalog.pg_attrdef.adnum = "
    'pg_catalog.pg_attribute.attnum AND pg_catalog.pg_attribute.atthasdef) AS "default", '
    "pg_catalog.pg_attribute.attnotnull AS not_null, pg_catalog.pg_class.relname AS "
    "table_name, pg_catalog.pg_description.description AS comment, "
    "pg_catalog.pg_attribute.attgenerated AS generated, (SELECT json_build_object('always', "
    "pg_catalog.pg_attribute.attidentity = 'a', 'start', pg_catalog.pg_sequence.seqstart) AS "
    "json_build_object_1 FROM pg_catalog.pg_sequence WHERE pg_catalog.pg_attribute.attidentity "
    "!= '' AND pg_catalog.pg_sequence.seqrelid = CAST(CAST(pg_catalog.pg_get_serial_sequence("
    "CAST(CAST(pg_catalog.pg_attribute.attrelid AS REGCLASS) AS TEXT), "
    "pg_catalog.pg_attribute.attname) AS REGCLASS) AS OID)) AS identity_options FROM "
    "pg_catalog.pg_class LEFT OUTER JOIN pg_catalog.pg_attribute ON pg_catalog.pg_class.oid = "
    "pg_catalog.pg_attribute.attrelid AND pg_catalog.pg_attribute.attnum > 0 AND NOT "
    "pg_catalog.pg_attribute.attisdropped LEFT OUTER JOIN pg_catalog.pg_description ON "
    "pg_catalog.pg_description.objoid = pg_catalog.pg_attribute.attrelid AND "
    "pg_catalog.pg_description.objsubid = pg_catalog.pg_attribute.attnum JOIN "
    "pg_catalog.pg_namespace ON pg_catalog.pg_namespace.oid = pg_catalog.pg_class.relnamespace "
    "WHERE pg_catalog.pg_class.relkind = ANY (ARRAY['r', 'p', 'f', 'v', 'm']) AND "
    "pg_catalog.pg_table_is_visible(pg_catalog.pg_class.oid) AND pg_catalog.pg_class.relname "
    "IN ('visits') ORDER BY pg_catalog.pg_class.relname, pg_catalog.pg_attribute.attnum",
    "SELECT attr.conrelid, array_agg(CAST(attr.attname AS TEXT) ORDER BY attr.ord) AS cols, "
    "attr.conname, min(attr.description) AS description, NULL AS extra FROM (SELECT "
    "con.conrelid AS conrelid, con.conname AS conname, con.description AS description, "
    "con.ord AS ord, pg_catalog.pg_attribute.attname AS attname FROM pg_catalog.pg_attribute "
    "JOIN (SELECT pg_catalog.pg_constraint.conrelid AS conrelid, "
    "pg_catalog.pg_constraint.conname AS conname, unnest(pg_catalog.pg_constraint.conkey) AS "
    "attnum, generate_subscripts(pg_catalog.pg_constraint.conkey, 1) AS ord, "
    "pg_catalog.pg_description.description AS description FROM pg_catalog.pg_constraint LEFT "
    "OUTER JOIN pg_catalog.pg_description ON pg_catalog.pg_description.objoid = "
    "pg_catalog.pg_constraint.oid WHERE pg_catalog.pg_constraint.contype = 'p' AND "
    "pg_catalog.pg_constraint.conrelid IN (16384)) AS con ON "
    "pg_catalog.pg_attribute.attnum = con.attnum AND pg_catalog.pg_attribute.attrelid = "
    "con.conrelid) AS attr GROUP BY attr.conrelid, attr.conname ORDER BY attr.conrelid, "
    "attr.conname",
    "SELECT pg_catalog.pg_constraint.conname, pg_catalog.pg_get_constraintdef("
    "pg_catalog.pg_constraint.oid, true) AS condef FROM pg_catalog.pg_constraint WHERE "
    "pg_catalog.pg_constraint.contype = 'c'",
    # Npgsql (Power BI), asyncpg, ActiveRecord, pgcli
    "SELECT ns.nspname, t.oid, t.typname, t.typtype FROM (SELECT typ.oid, typ.typnamespace, "
    "typ.typname, CASE WHEN proc.proname='array_recv' THEN 'a' ELSE typ.typtype END AS "
    "typtype FROM pg_type AS typ LEFT JOIN pg_proc AS proc ON proc.oid = typ.typreceive) AS t "
    "JOIN pg_namespace AS ns ON (ns.oid = typnamespace) ORDER BY CASE WHEN typtype IN ('b', "
    "'e', 'p') THEN 0 END",
    "WITH RECURSIVE typebases(oid, depth) AS (SELECT t2.typbasetype AS oid, 0 AS depth FROM "
    "pg_type t2 WHERE t2.oid = 20 UNION ALL SELECT t2.typbasetype, tb.depth + 1 FROM pg_type "
    "t2, typebases tb WHERE tb.oid = t2.oid AND t2.typbasetype != 0) SELECT oid FROM typebases "
    "ORDER BY depth DESC LIMIT 1",
    "SELECT a.attname FROM (SELECT indrelid, indkey, generate_subscripts(indkey, 1) AS idx "
    "FROM pg_index WHERE indrelid = '\"visits\"'::REGCLASS AND indisprimary) AS i JOIN "
    "pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[i.idx] ORDER BY i.idx",
    "SELECT t2.oid::regclass::text AS to_table, a1.attname FROM pg_constraint c JOIN pg_class "
    "t1 ON c.conrelid = t1.oid JOIN pg_class t2 ON c.confrelid = t2.oid JOIN pg_attribute a1 "
    "ON a1.attnum = c.conkey[1] AND a1.attrelid = t1.oid WHERE c.contype = 'f' AND "
    "t1.relname = 'visits' AND t1.relnamespace = ANY (SELECT oid FROM pg_namespace WHERE "
    "nspname = ANY (current_schemas(false)))",
    # Metabase, DBeaver, Tableau, Power BI (information_schema)
    "SELECT nspname, relname, has_table_privilege(c.oid, 'SELECT') AS s, has_schema_privilege("
    "n.oid, 'USAGE') FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE "
    "relkind = 'r' AND n.nspname !~ '^information_schema|catalog_history|pg_'",
    "SELECT c.oid, c.*, t.relname AS tabrelname, pg_catalog.pg_total_relation_size(c.oid), "
    "pg_catalog.pg_size_pretty(pg_catalog.pg_relation_size(c.oid)), "
    "pg_catalog.obj_description(c.oid, 'pg_class') FROM pg_catalog.pg_class c LEFT OUTER JOIN "
    "pg_catalog.pg_class t ON t.oid = c.reltoastrelid WHERE c.relnamespace = 2200",
    "select i.CONSTRAINT_SCHEMA || '_' || i.CONSTRAINT_NAME as INDEX_NAME, ii.COLUMN_NAME from "
    "INFORMATION_SCHEMA.table_constraints i inner join INFORMATION_SCHEMA.key_column_usage ii "
    "on i.CONSTRAINT_NAME = ii.CONSTRAINT_NAME where i.TABLE_NAME = 'visits'",
    "SELECT CAST(TABLE_SCHEMA AS TEXT), CAST(TABLE_NAME AS TEXT), lower(table_type) FROM "
    "INFORMATION_SCHEMA.TABLES WHERE TABLE_TYPE = 'BASE TABLE'",
    "SELECT version(), current_database(), current_schema(), current_user, "
    "pg_catalog.current_setting('server_version_num'), pg_backend_pid(), "
    "pg_catalog.pg_is_in_recovery(), pg_catalog.pg_postmaster_start_time(), now()",
]


@pytest.mark.parametrize("sql", CLIENT_QUERIES)
def test_real_client_catalog_queries_pass_the_whitelist(sql):
    rewrite(sql, INFO)


# --- over the wire: refused, capped or timed out, quickly ------------------------------------


def test_attacks_are_refused_or_capped(server):
    c = _client(server)
    err = _error(c, "SELECT 1, repeat('x', 150000000)")
    assert err["C"] == "42883" and "repeat()" in err["M"] and err["P"] == "11" and err["H"]
    assert _error(c, "SELECT len(range(1000000000))")["C"] == "54000"
    assert _error(c, "SELECT * FROM read_csv('/etc/passwd')")["C"] == "42883"
    err = _error(c, "SELECT * FROM range(5000)")
    assert err["C"] == "54000" and "1000 rows" in err["M"] and "LIMIT" in err["H"]
    err = _error(c, f"SELECT r, '{'x' * 1200}' AS pad FROM range(999) t(r)")
    assert err["C"] == "54000" and "1 MiB" in err["M"]
    assert c.query("SELECT * FROM range(1000)").tags() == ["SELECT 1000"]
    c.close()


def test_a_long_text_is_refused_before_it_is_parsed(server):
    c = _client(server)
    sql = "SELECT relname FROM pg_class WHERE relname IN (" + ", ".join(["'x'"] * 40_000) + ")"
    err = _error(c, sql)
    assert err["C"] == "54000" and "characters" in err["M"]
    c.close()


def test_a_long_table_function_scan_times_out(server):
    c = _client(server)
    err = _error(c, "SELECT count(*) FROM range(10000000000000)")
    assert err["C"] == "57014" and "statement timeout" in err["M"] and "0.5 s" in err["H"]
    assert c.query("SELECT 1").text_rows() == [["1"]]
    c.close()


def test_a_memory_blowup_stays_in_its_shadow_process(server):
    """Untracked string growth: DuckDB's memory_limit misses it, the address-space cap not."""
    c = _client(server)
    err = _error(c, CONCAT_CHAIN)
    assert err["C"] in ("53200", "57014")
    assert c.query("SELECT relname FROM pg_class WHERE relname = 'visits'").text_rows() == [
        ["visits"]
    ]
    c.close()


def test_other_analysts_are_answered_while_one_attacks(server):
    """Four connections of one analyst loop on slow and greedy catalog statements; another
    analyst's DP query and catalog query are answered all the same."""
    stop = threading.Event()
    seen: list[str] = []

    def attack(i: int) -> None:
        a = _client(server, "alice")
        sql = CONCAT_CHAIN if i % 2 else "SELECT count(*) FROM range(10000000000000)"
        while not stop.is_set():
            seen.extend(e["C"] for e in a.query(sql).errors())
        a.close()

    attackers = [threading.Thread(target=attack, args=(i,)) for i in range(4)]
    for thread in attackers:
        thread.start()
    try:
        b = _client(server, "bob")
        for _ in range(3):
            reply = b.query("SELECT COUNT(*) FROM visits")
            assert reply.errors() == [] and reply.tags() == ["SELECT 1"]
            reply = b.query("SELECT relname FROM pg_class WHERE relname = 'visits'")
            assert reply.errors() == [] and reply.text_rows() == [["visits"]]
        b.close()
    finally:
        stop.set()
        for thread in attackers:
            thread.join(30)
    assert set(seen) <= {"57014", "53200", "53000"}


def test_one_analyst_cannot_hold_every_shadow_process():
    shadow = Shadow(_policy(), "visits", DEFAULTS, LIMITS)
    pool = shadow._pool
    try:
        held = pool.acquire("alice", lambda: False)
        with pytest.raises(CatalogError) as info:  # alice's second must wait (and gives up)
            pool.acquire("alice", lambda: True)
        assert info.value.sqlstate == "57014"
        other = pool.acquire("bob", lambda: False)  # while bob is served
        pool.release(other, "bob")
        pool.release(held, "alice")
    finally:
        shadow.close()


def test_a_process_that_does_not_answer_is_replaced():
    limits = CatalogLimits(timeout=30.0, processes=1)
    shadow = Shadow(_policy(), "visits", DEFAULTS, limits)
    try:
        process = shadow._pool.acquire("alice", lambda: False)
        with pytest.raises(CatalogError) as info:
            process.run(1, "SELECT count(*) FROM range(10000000000000)", 0.2, 1 << 20)
        assert info.value.sqlstate == "57014"
        shadow._pool.release(process, "alice")
        assert process._popen.poll() is not None  # killed: its reply could still come
        result = shadow.cursor().run("SELECT 1 AS one", None, INFO)
        assert result.rows == [(1,)]
    finally:
        shadow.close()


def test_replies_are_decoded_as_data_only():
    import datetime as dt
    import decimal
    import os
    import uuid

    values = [dt.datetime(2024, 1, 1, tzinfo=dt.UTC), decimal.Decimal("1.5"), uuid.uuid4()]
    assert load_reply(pickle.dumps(("ok", [], [tuple(values)]))) == ("ok", [], [tuple(values)])
    with pytest.raises(pickle.UnpicklingError):
        load_reply(pickle.dumps(os.getcwd))


def _policy():
    from dpsql.policy import load_policy

    return load_policy(ROOT / "fixtures" / "visits.toml")


# --- post-processing on the scratch connection ------------------------------------------------


@pytest.fixture(scope="module")
def service():
    svc = dpsql.Service(fixture_policy(), cache=False)
    yield svc
    svc.close()


def _tree(sql: str) -> sqlglot.exp.Expression:
    """A post-processing query as the scratch connection takes it (a tree)."""
    return sqlglot.parse_one(sql, read="duckdb")


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT repeat('x', 150000000) AS s",
        "SELECT len(range(1000000000)) AS n",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT lpad(k0, 1000000000) AS s FROM __released",
    ],
)
def test_post_processing_calls_only_what_the_binder_accepts(service, sql):
    with pytest.raises(ProgrammingError) as info:
        service.scratch.post_process(_tree(sql), ["k0"], ["VARCHAR"], [("a",)])
    assert info.value.sqlstate == "42883" and info.value.hint


def test_public_selects_and_released_rows_still_post_process(service):
    conn = connect_service(service, "alice")
    cur = conn.cursor()
    cur.execute("SELECT 1 + 1 AS two, upper('a') AS u, CAST(2 AS DOUBLE) / 4 AS q")
    assert cur.fetchall() == [(2, "A", 0.5)]
    rows = [("a", 3), ("b", 1)]
    got = service.scratch.post_process(
        _tree("SELECT k0, ROUND(a0 * 1.5, 1) AS x FROM __released ORDER BY a0"),
        ["k0", "a0"],
        ["VARCHAR", "BIGINT"],
        rows,
    )[1]
    assert got == [("b", 1.5), ("a", 4.5)]


def test_post_processing_output_is_capped(service, monkeypatch):
    monkeypatch.setattr(scratch, "POST_CAPS", ResultCaps(max_rows=10, max_bytes=1 << 20))
    rows = [(f"k{i}", i) for i in range(20)]
    with pytest.raises(DataError) as info:
        service.scratch.post_process(
            _tree("SELECT k0 FROM __released"), ["k0", "a0"], ["VARCHAR", "BIGINT"], rows
        )
    assert info.value.sqlstate == "54000" and "10 rows" in info.value.message
    monkeypatch.setattr(scratch, "POST_CAPS", ResultCaps(max_rows=10, max_bytes=100))
    with pytest.raises(DataError):
        service.scratch.post_process(
            _tree("SELECT k0 FROM __released"), ["k0"], ["VARCHAR"], [("x" * 200,)]
        )


def test_post_processing_is_interrupted_at_its_deadline(service, monkeypatch):
    monkeypatch.setattr(scratch, "POST_TIMEOUT", 0.2)
    with pytest.raises(OperationalError) as info:
        endless = _tree("SELECT count(*) AS n FROM range(10000000000000)")
        service.scratch._run_post(endless, sqlglot.exp.Select(), [])
    assert info.value.sqlstate == "57014"


# --- the generic pieces ---------------------------------------------------------------------


class _EndlessCursor:
    def __init__(self) -> None:
        self.description = [("s", "VARCHAR")]
        self.fetched = 0

    def fetchmany(self, n: int) -> list[tuple]:
        self.fetched += n
        return [("x" * 100,)] * n


def test_results_are_capped_while_fetching_not_after():
    cursor = _EndlessCursor()
    with pytest.raises(LimitExceeded) as info:
        fetch_capped(cursor, ResultCaps(max_rows=1000, max_bytes=1 << 30, chunk=100))
    assert info.value.kind == "rows" and cursor.fetched <= 1100
    cursor = _EndlessCursor()
    with pytest.raises(LimitExceeded) as info:
        fetch_capped(cursor, ResultCaps(max_rows=10**9, max_bytes=10_000, chunk=10))
    assert info.value.kind == "bytes" and cursor.fetched <= 110


def test_the_watchdog_interrupts_a_statement_past_its_deadline():
    fired = threading.Event()
    with Watchdog().deadline(0.05, fired.set) as deadline:
        assert fired.wait(10)
    assert deadline.expired


def test_default_limits():
    limits = CatalogLimits()
    assert (limits.timeout, limits.max_rows, limits.max_bytes) == (2.0, 100_000, 16 << 20)
    assert catalog.GRACE > 0  # the server waits a little past the timeout, then kills
