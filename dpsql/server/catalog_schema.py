"""The emulated ``pg_catalog`` and ``information_schema``: table shapes and their rows.

Everything here is built from the policy alone (table names, column names and types, which the
policy declares public), so answering catalog queries can never reveal a private row. Column
types use DuckDB types that map back to the PostgreSQL OIDs clients expect (UINTEGER -> oid,
SMALLINT -> int2, INTEGER -> int4, FLOAT -> float4).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dpsql.server import types as t

PG_CATALOG_NS = 11
PUBLIC_NS = 2200
INFORMATION_SCHEMA_NS = 13000
OWNER_OID = 10
OWNER_NAME = "dpsql"
FIRST_TABLE_OID = 16384

_O = "UINTEGER"  # oid
_N = "VARCHAR"  # name
_C = "VARCHAR"  # "char"
_B = "BOOLEAN"
_I2 = "SMALLINT"
_I4 = "INTEGER"
_TX = "VARCHAR"
_F4 = "FLOAT"

# Columns of each emulated catalog table, in PostgreSQL 16 order (plus a few removed columns old
# drivers still select, such as relhasoids).
# fmt: off
PG_TABLES: dict[str, list[tuple[str, str]]] = {
    "pg_namespace": [("oid", _O), ("nspname", _N), ("nspowner", _O), ("nspacl", _TX)],
    "pg_class": [
        ("oid", _O), ("relname", _N), ("relnamespace", _O), ("reltype", _O), ("reloftype", _O),
        ("relowner", _O), ("relam", _O), ("relfilenode", _O), ("reltablespace", _O),
        ("relpages", _I4), ("reltuples", _F4), ("relallvisible", _I4), ("reltoastrelid", _O),
        ("relhasindex", _B), ("relisshared", _B), ("relpersistence", _C), ("relkind", _C),
        ("relnatts", _I2), ("relchecks", _I2), ("relhasoids", _B), ("relhasrules", _B),
        ("relhastriggers", _B), ("relhassubclass", _B), ("relrowsecurity", _B),
        ("relforcerowsecurity", _B), ("relispopulated", _B), ("relreplident", _C),
        ("relispartition", _B), ("relrewrite", _O), ("relfrozenxid", _O), ("relminmxid", _O),
        ("relacl", _TX), ("reloptions", "VARCHAR[]"), ("relpartbound", _TX),
    ],
    "pg_attribute": [
        ("attrelid", _O), ("attname", _N), ("atttypid", _O), ("attstattarget", _I2),
        ("attlen", _I2), ("attnum", _I2), ("attndims", _I2), ("attcacheoff", _I4),
        ("atttypmod", _I4), ("attbyval", _B), ("attalign", _C), ("attstorage", _C),
        ("attcompression", _C), ("attnotnull", _B), ("atthasdef", _B), ("atthasmissing", _B),
        ("attidentity", _C), ("attgenerated", _C), ("attisdropped", _B), ("attislocal", _B),
        ("attinhcount", _I2), ("attcollation", _O), ("attacl", _TX),
        ("attoptions", "VARCHAR[]"), ("attfdwoptions", "VARCHAR[]"), ("attmissingval", _TX),
    ],
    "pg_type": [
        ("oid", _O), ("typname", _N), ("typnamespace", _O), ("typowner", _O), ("typlen", _I2),
        ("typbyval", _B), ("typtype", _C), ("typcategory", _C), ("typispreferred", _B),
        ("typisdefined", _B), ("typdelim", _C), ("typrelid", _O), ("typsubscript", _TX),
        ("typelem", _O), ("typarray", _O), ("typinput", _TX), ("typoutput", _TX),
        ("typreceive", _TX), ("typsend", _TX), ("typmodin", _TX), ("typmodout", _TX),
        ("typanalyze", _TX), ("typalign", _C), ("typstorage", _C), ("typnotnull", _B),
        ("typbasetype", _O), ("typtypmod", _I4), ("typndims", _I4), ("typcollation", _O),
        ("typdefaultbin", _TX), ("typdefault", _TX), ("typacl", _TX),
    ],
    "pg_database": [
        ("oid", _O), ("datname", _N), ("datdba", _O), ("encoding", _I4),
        ("datlocprovider", _C), ("datistemplate", _B), ("datallowconn", _B),
        ("datconnlimit", _I4), ("datfrozenxid", _O), ("datminmxid", _O),
        ("dattablespace", _O), ("datcollate", _TX), ("datctype", _TX), ("daticulocale", _TX),
        ("daticurules", _TX), ("datcollversion", _TX), ("datacl", _TX),
    ],
    "pg_settings": [
        ("name", _TX), ("setting", _TX), ("unit", _TX), ("category", _TX),
        ("short_desc", _TX), ("extra_desc", _TX), ("context", _TX), ("vartype", _TX),
        ("source", _TX), ("min_val", _TX), ("max_val", _TX), ("enumvals", "VARCHAR[]"),
        ("boot_val", _TX), ("reset_val", _TX), ("sourcefile", _TX), ("sourceline", _I4),
        ("pending_restart", _B),
    ],
    "pg_proc": [
        ("oid", _O), ("proname", _N), ("pronamespace", _O), ("proowner", _O), ("prolang", _O),
        ("procost", _F4), ("prorows", _F4), ("provariadic", _O), ("prosupport", _TX),
        ("prokind", _C), ("prosecdef", _B), ("proleakproof", _B), ("proisstrict", _B),
        ("proretset", _B), ("provolatile", _C), ("proparallel", _C), ("pronargs", _I2),
        ("pronargdefaults", _I2), ("prorettype", _O), ("proargtypes", "UINTEGER[]"),
        ("proallargtypes", "UINTEGER[]"), ("proargmodes", "VARCHAR[]"),
        ("proargnames", "VARCHAR[]"), ("proargdefaults", _TX), ("protrftypes", "UINTEGER[]"),
        ("prosrc", _TX), ("probin", _TX), ("prosqlbody", _TX), ("proconfig", "VARCHAR[]"),
        ("proacl", _TX), ("proisagg", _B), ("proiswindow", _B),
    ],
    "pg_index": [
        ("indexrelid", _O), ("indrelid", _O), ("indnatts", _I2), ("indnkeyatts", _I2),
        ("indisunique", _B), ("indnullsnotdistinct", _B), ("indisprimary", _B),
        ("indisexclusion", _B), ("indimmediate", _B), ("indisclustered", _B),
        ("indisvalid", _B), ("indcheckxmin", _B), ("indisready", _B), ("indislive", _B),
        ("indisreplident", _B), ("indkey", "SMALLINT[]"), ("indcollation", "UINTEGER[]"),
        ("indclass", "UINTEGER[]"), ("indoption", "SMALLINT[]"), ("indexprs", _TX),
        ("indpred", _TX),
    ],
    "pg_description": [
        ("objoid", _O), ("classoid", _O), ("objsubid", _I4), ("description", _TX),
    ],
    "pg_shdescription": [("objoid", _O), ("classoid", _O), ("description", _TX)],
    "pg_attrdef": [("oid", _O), ("adrelid", _O), ("adnum", _I2), ("adbin", _TX)],
    "pg_constraint": [
        ("oid", _O), ("conname", _N), ("connamespace", _O), ("contype", _C),
        ("condeferrable", _B), ("condeferred", _B), ("convalidated", _B), ("conrelid", _O),
        ("contypid", _O), ("conindid", _O), ("conparentid", _O), ("confrelid", _O),
        ("confupdtype", _C), ("confdeltype", _C), ("confmatchtype", _C), ("conislocal", _B),
        ("coninhcount", _I2), ("connoinherit", _B), ("conkey", "SMALLINT[]"),
        ("confkey", "SMALLINT[]"), ("conpfeqop", "UINTEGER[]"), ("conppeqop", "UINTEGER[]"),
        ("conffeqop", "UINTEGER[]"), ("confdelsetcols", "SMALLINT[]"),
        ("conexclop", "UINTEGER[]"), ("conbin", _TX),
    ],
    "pg_inherits": [
        ("inhrelid", _O), ("inhparent", _O), ("inhseqno", _I4), ("inhdetachpending", _B),
    ],
    "pg_am": [("oid", _O), ("amname", _N), ("amhandler", _TX), ("amtype", _C)],
    "pg_roles": [
        ("rolname", _N), ("rolsuper", _B), ("rolinherit", _B), ("rolcreaterole", _B),
        ("rolcreatedb", _B), ("rolcanlogin", _B), ("rolreplication", _B),
        ("rolconnlimit", _I4), ("rolpassword", _TX), ("rolvaliduntil", _TX),
        ("rolbypassrls", _B), ("rolconfig", "VARCHAR[]"), ("oid", _O),
    ],
    "pg_user": [
        ("usename", _N), ("usesysid", _O), ("usecreatedb", _B), ("usesuper", _B),
        ("userepl", _B), ("usebypassrls", _B), ("passwd", _TX), ("valuntil", _TX),
        ("useconfig", "VARCHAR[]"),
    ],
    "pg_auth_members": [
        ("oid", _O), ("roleid", _O), ("member", _O), ("grantor", _O), ("admin_option", _B),
        ("inherit_option", _B), ("set_option", _B),
    ],
    "pg_tablespace": [
        ("oid", _O), ("spcname", _N), ("spcowner", _O), ("spcacl", _TX),
        ("spcoptions", "VARCHAR[]"),
    ],
    "pg_collation": [
        ("oid", _O), ("collname", _N), ("collnamespace", _O), ("collowner", _O),
        ("collprovider", _C), ("collisdeterministic", _B), ("collencoding", _I4),
        ("collcollate", _TX), ("collctype", _TX), ("colliculocale", _TX),
        ("collicurules", _TX), ("collversion", _TX),
    ],
    "pg_extension": [
        ("oid", _O), ("extname", _N), ("extowner", _O), ("extnamespace", _O),
        ("extrelocatable", _B), ("extversion", _TX), ("extconfig", "UINTEGER[]"),
        ("extcondition", "VARCHAR[]"),
    ],
    "pg_enum": [("oid", _O), ("enumtypid", _O), ("enumsortorder", _F4), ("enumlabel", _N)],
    "pg_range": [
        ("rngtypid", _O), ("rngsubtype", _O), ("rngmultitypid", _O), ("rngcollation", _O),
        ("rngsubopc", _O), ("rngcanonical", _TX), ("rngsubdiff", _TX),
    ],
    "pg_trigger": [
        ("oid", _O), ("tgrelid", _O), ("tgparentid", _O), ("tgname", _N), ("tgfoid", _O),
        ("tgtype", _I2), ("tgenabled", _C), ("tgisinternal", _B), ("tgconstrrelid", _O),
        ("tgconstrindid", _O), ("tgconstraint", _O), ("tgdeferrable", _B),
        ("tginitdeferred", _B), ("tgnargs", _I2), ("tgattr", "SMALLINT[]"), ("tgargs", _TX),
        ("tgqual", _TX), ("tgoldtable", _N), ("tgnewtable", _N),
    ],
    "pg_rewrite": [
        ("oid", _O), ("rulename", _N), ("ev_class", _O), ("ev_type", _C), ("ev_enabled", _C),
        ("is_instead", _B), ("ev_qual", _TX), ("ev_action", _TX),
    ],
    "pg_policy": [
        ("oid", _O), ("polname", _N), ("polrelid", _O), ("polcmd", _C), ("polpermissive", _B),
        ("polroles", "UINTEGER[]"), ("polqual", _TX), ("polwithcheck", _TX),
    ],
    "pg_statistic_ext": [
        ("oid", _O), ("stxrelid", _O), ("stxname", _N), ("stxnamespace", _O),
        ("stxowner", _O), ("stxstattarget", _I4), ("stxkeys", "SMALLINT[]"),
        ("stxkind", "VARCHAR[]"), ("stxexprs", _TX),
    ],
    "pg_publication": [
        ("oid", _O), ("pubname", _N), ("pubowner", _O), ("puballtables", _B),
        ("pubinsert", _B), ("pubupdate", _B), ("pubdelete", _B), ("pubtruncate", _B),
        ("pubviaroot", _B),
    ],
    "pg_publication_rel": [
        ("oid", _O), ("prpubid", _O), ("prrelid", _O), ("prqual", _TX),
        ("prattrs", "SMALLINT[]"),
    ],
    "pg_publication_namespace": [("oid", _O), ("pnpubid", _O), ("pnnspid", _O)],
    "pg_partitioned_table": [
        ("partrelid", _O), ("partstrat", _C), ("partnatts", _I2), ("partdefid", _O),
        ("partattrs", "SMALLINT[]"), ("partclass", "UINTEGER[]"),
        ("partcollation", "UINTEGER[]"), ("partexprs", _TX),
    ],
    "pg_foreign_table": [("ftrelid", _O), ("ftserver", _O), ("ftoptions", "VARCHAR[]")],
    "pg_foreign_server": [
        ("oid", _O), ("srvname", _N), ("srvowner", _O), ("srvfdw", _O), ("srvtype", _TX),
        ("srvversion", _TX), ("srvacl", _TX), ("srvoptions", "VARCHAR[]"),
    ],
    "pg_sequence": [
        ("seqrelid", _O), ("seqtypid", _O), ("seqstart", "BIGINT"),
        ("seqincrement", "BIGINT"), ("seqmax", "BIGINT"), ("seqmin", "BIGINT"),
        ("seqcache", "BIGINT"), ("seqcycle", _B),
    ],
    "pg_depend": [
        ("classid", _O), ("objid", _O), ("objsubid", _I4), ("refclassid", _O),
        ("refobjid", _O), ("refobjsubid", _I4), ("deptype", _C),
    ],
    "pg_language": [
        ("oid", _O), ("lanname", _N), ("lanowner", _O), ("lanispl", _B),
        ("lanpltrusted", _B), ("lanplcallfoid", _O), ("laninline", _O),
        ("lanvalidator", _O), ("lanacl", _TX),
    ],
    "pg_cast": [
        ("oid", _O), ("castsource", _O), ("casttarget", _O), ("castfunc", _O),
        ("castcontext", _C), ("castmethod", _C),
    ],
    "pg_operator": [
        ("oid", _O), ("oprname", _N), ("oprnamespace", _O), ("oprowner", _O),
        ("oprkind", _C), ("oprcanmerge", _B), ("oprcanhash", _B), ("oprleft", _O),
        ("oprright", _O), ("oprresult", _O), ("oprcom", _O), ("oprnegate", _O),
        ("oprcode", _TX), ("oprrest", _TX), ("oprjoin", _TX),
    ],
    "pg_opclass": [
        ("oid", _O), ("opcmethod", _O), ("opcname", _N), ("opcnamespace", _O),
        ("opcowner", _O), ("opcfamily", _O), ("opcintype", _O), ("opcdefault", _B),
        ("opckeytype", _O),
    ],
    "pg_event_trigger": [
        ("oid", _O), ("evtname", _N), ("evtevent", _N), ("evtowner", _O), ("evtfoid", _O),
        ("evtenabled", _C), ("evttags", "VARCHAR[]"),
    ],
    "pg_conversion": [
        ("oid", _O), ("conname", _N), ("connamespace", _O), ("conowner", _O),
        ("conforencoding", _I4), ("contoencoding", _I4), ("conproc", _TX), ("condefault", _B),
    ],
    "pg_views": [
        ("schemaname", _N), ("viewname", _N), ("viewowner", _N), ("definition", _TX),
    ],
    "pg_matviews": [
        ("schemaname", _N), ("matviewname", _N), ("matviewowner", _N), ("tablespace", _N),
        ("hasindexes", _B), ("ispopulated", _B), ("definition", _TX),
    ],
    "pg_indexes": [
        ("schemaname", _N), ("tablename", _N), ("indexname", _N), ("tablespace", _N),
        ("indexdef", _TX),
    ],
    "pg_stat_activity": [
        ("datid", _O), ("datname", _N), ("pid", _I4), ("usename", _N),
        ("application_name", _TX), ("state", _TX), ("query", _TX),
    ],
    "pg_available_extensions": [
        ("name", _N), ("default_version", _TX), ("installed_version", _TX), ("comment", _TX),
    ],
    "pg_timezone_names": [
        ("name", _TX), ("abbrev", _TX), ("utc_offset", _TX), ("is_dst", _B),
    ],
}

# fmt: on

# (name, [(params, body), ...]): macros for the PostgreSQL functions the catalog queries of psql,
# JDBC, SQLAlchemy and BI tools call (schema pgc, ahead of DuckDB's own on the search path).
# Overloads share a name.
MACROS: list[tuple[str, list[tuple[str, str]]]] = [
    ("pg_get_userbyid", [("o", f"'{OWNER_NAME}'")]),
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
    ("dp_regrole_oid", [("s", f"CAST({OWNER_OID} AS UINTEGER)")]),
    ("dp_regrole_name", [("o", f"'{OWNER_NAME}'")]),
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

# Table macros (name -> body), called in FROM.
TABLE_MACROS: dict[str, str] = {
    "pg_get_keywords": "SELECT keyword_name AS word, CASE keyword_category WHEN 'reserved' "
    "THEN 'R' WHEN 'unreserved' THEN 'U' WHEN 'type_function' THEN 'T' ELSE 'C' END AS "
    "catcode, true AS barelabel, keyword_category AS catdesc, 'can be bare label' AS baredesc "
    "FROM duckdb_keywords()",
}

# pg_tables is a view over pg_class in PostgreSQL; here a view over ours.
PG_VIEWS = {
    "pg_tables": (
        "SELECT n.nspname AS schemaname, c.relname AS tablename, "
        f"'{OWNER_NAME}' AS tableowner, NULL::VARCHAR AS tablespace, false AS hasindexes, "
        "false AS hasrules, false AS hastriggers, false AS rowsecurity "
        "FROM pgc.pg_class c JOIN pgc.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relkind IN ('r', 'p')"
    ),
}

# Well-known OIDs of catalog relations (clients write e.g. 'pg_class'::regclass).
# fmt: off
_KNOWN_REL_OIDS = {
    "pg_type": 1247, "pg_attribute": 1249, "pg_proc": 1255, "pg_class": 1259,
    "pg_database": 1262, "pg_authid": 1260, "pg_attrdef": 2604, "pg_constraint": 2606,
    "pg_inherits": 2611, "pg_index": 2610, "pg_operator": 2617, "pg_rewrite": 2618,
    "pg_trigger": 2620, "pg_description": 2609, "pg_namespace": 2615, "pg_am": 2601,
    "pg_depend": 2608, "pg_language": 2612, "pg_cast": 2605, "pg_enum": 3501,
    "pg_collation": 3456, "pg_extension": 3079, "pg_tablespace": 1213,
}

FORMAT_TYPE = {
    t.BOOL: "boolean", t.BYTEA: "bytea", t.CHAR: '"char"', t.NAME: "name", t.INT8: "bigint",
    t.INT2: "smallint", t.INT4: "integer", t.TEXT: "text", t.OID: "oid", t.JSON: "json",
    t.FLOAT4: "real", t.FLOAT8: "double precision", t.UNKNOWN: "unknown",
    t.BPCHAR: "character", t.VARCHAR: "character varying", t.DATE: "date",
    t.TIME: "time without time zone", t.TIMESTAMP: "timestamp without time zone",
    t.TIMESTAMPTZ: "timestamp with time zone", t.INTERVAL: "interval", t.NUMERIC: "numeric",
    t.UUID: "uuid",
}


# fmt: on


@dataclass(frozen=True)
class CatalogColumn:
    name: str
    type_oid: int
    nullable: bool


@dataclass(frozen=True)
class CatalogTable:
    oid: int
    name: str
    columns: tuple[CatalogColumn, ...]


def format_type(oid: int) -> str:
    if oid in t.ELEMENT_OF:
        return FORMAT_TYPE.get(t.ELEMENT_OF[oid], "???") + "[]"
    return FORMAT_TYPE.get(oid, "???")


def _io_functions(info: t.PgType) -> tuple[str, str, str, str]:
    """typinput/typoutput/typreceive/typsend (JDBC tells arrays by typinput = array_in)."""
    if info.category == "A":
        return "array_in", "array_out", "array_recv", "array_send"
    return f"{info.name}in", f"{info.name}out", f"{info.name}recv", f"{info.name}send"


def rows_pg_type() -> list[tuple]:
    rows = []
    for oid, info in sorted(t.PG_TYPES.items()):
        elem = t.ELEMENT_OF.get(oid, 0)
        byval = info.size in (1, 2, 4, 8) and oid not in (t.NAME,)
        rows.append(
            (
                oid,
                info.name,
                PG_CATALOG_NS,
                OWNER_OID,
                info.size,
                byval,
                "b",
                info.category,
                oid in (t.BOOL, t.TEXT, t.FLOAT8, t.OID),
                True,
                ",",
                0,
                "array_subscript_handler" if elem else "-",
                elem,
                t.ARRAY_OF.get(oid, 0),
                *_io_functions(info),
                "-",
                "-",
                "-",
                "d" if info.size == 8 else "i",
                "p" if info.size > 0 else "x",
                False,
                0,
                -1,
                0,
                100 if oid in (t.TEXT, t.VARCHAR, t.BPCHAR, t.NAME) else 0,
                None,
                None,
                None,
            )
        )
    return rows


def rows_pg_namespace() -> list[tuple]:
    return [
        (PG_CATALOG_NS, "pg_catalog", OWNER_OID, None),
        (PUBLIC_NS, "public", OWNER_OID, None),
        (INFORMATION_SCHEMA_NS, "information_schema", OWNER_OID, None),
    ]


def _class_row(oid: int, name: str, ns: int, kind: str, natts: int) -> tuple:
    return (
        oid,
        name,
        ns,
        0,
        0,
        OWNER_OID,
        2 if kind == "r" else 0,
        oid,
        0,
        0,
        -1.0,
        0,
        0,
        False,
        False,
        "p",
        kind,
        natts,
        0,
        False,
        False,
        False,
        False,
        False,
        False,
        True,
        "d",
        False,
        0,
        0,
        0,
        None,
        None,
        None,
    )


def rows_pg_class(tables: Iterable[CatalogTable]) -> list[tuple]:
    rows = [_class_row(tb.oid, tb.name, PUBLIC_NS, "r", len(tb.columns)) for tb in tables]
    next_oid = 3000
    for name, cols in sorted(PG_TABLES.items()):
        oid = _KNOWN_REL_OIDS.get(name)
        if oid is None:
            next_oid += 1
            oid = next_oid
        rows.append(_class_row(oid, name, PG_CATALOG_NS, "r", len(cols)))
    return rows


def rows_pg_attribute(tables: Iterable[CatalogTable]) -> list[tuple]:
    rows = []
    for tb in tables:
        for num, col in enumerate(tb.columns, start=1):
            size = t.type_size(col.type_oid)
            rows.append(
                (
                    tb.oid,
                    col.name,
                    col.type_oid,
                    -1,
                    size,
                    num,
                    0,
                    -1,
                    -1,
                    size in (1, 4, 8),
                    "d" if size == 8 else "i",
                    "p" if size > 0 else "x",
                    "",
                    not col.nullable,
                    False,
                    False,
                    "",
                    "",
                    False,
                    True,
                    0,
                    100 if col.type_oid == t.TEXT else 0,
                    None,
                    None,
                    None,
                    None,
                )
            )
    return rows


def rows_pg_database(dataset: str) -> list[tuple]:
    return [
        (
            16383,
            dataset,
            OWNER_OID,
            6,
            "c",
            False,
            True,
            -1,
            0,
            0,
            1663,
            "C.UTF-8",
            "C.UTF-8",
            None,
            None,
            None,
            None,
        )
    ]


def rows_pg_settings(settings: dict[str, str]) -> list[tuple]:
    return [
        (
            name,
            value,
            None,
            "dpsql",
            None,
            None,
            "user",
            "string",
            "default",
            None,
            None,
            None,
            value,
            value,
            None,
            None,
            False,
        )
        for name, value in sorted(settings.items())
    ]


FIXED_ROWS: dict[str, list[tuple]] = {
    "pg_am": [(2, "heap", "heap_tableam_handler", "t"), (403, "btree", "bthandler", "i")],
    "pg_roles": [
        (
            OWNER_NAME,
            False,
            True,
            False,
            False,
            True,
            False,
            -1,
            "********",
            None,
            False,
            None,
            OWNER_OID,
        )
    ],
    "pg_user": [(OWNER_NAME, OWNER_OID, False, False, False, False, "********", None, None)],
    "pg_tablespace": [
        (1663, "pg_default", OWNER_OID, None, None),
        (1664, "pg_global", OWNER_OID, None, None),
    ],
    "pg_collation": [
        (100, "default", PG_CATALOG_NS, OWNER_OID, "d", True, -1, None, None, None, None, None),
        (950, "C", PG_CATALOG_NS, OWNER_OID, "c", True, -1, "C", "C", None, None, None),
    ],
    "pg_language": [
        (12, "internal", OWNER_OID, False, False, 0, 0, 0, None),
        (14, "sql", OWNER_OID, False, True, 0, 0, 0, None),
    ],
}
