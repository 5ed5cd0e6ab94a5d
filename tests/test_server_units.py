"""Unit tests of the server's pure parts: codec, types, SCRAM, users store, SQL text, settings,
catalog rewriting; plus the ``dpsql serve`` / ``dpsql user`` commands."""

from __future__ import annotations

import base64
import datetime as dt
import io
import json
import os
import re
import signal
import stat
import struct
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from dpsql.cli import main as cli_main
from dpsql.frontend.sqltext import identifiers, split_statements
from dpsql.server import protocol as p
from dpsql.server import types as t
from dpsql.server.backend import inline_parameters, placeholder_count
from dpsql.server.catalog_sql import SessionInfo, rewrite
from dpsql.server.scram import ScramError, ScramExchange, make_verifier
from dpsql.server.settings import SessionSettings, SettingError, parse_set, set_name_of
from dpsql.server.testing import RawClient
from dpsql.server.users import UserStore, UserStoreError, users_path

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------
# SCRAM: the RFC 7677 test vector


def test_scram_rfc7677_vector():
    salt = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
    verifier = make_verifier("pencil", salt=salt, iterations=4096)
    exchange = ScramExchange(verifier, mock_secret=b"x", user="user")
    exchange.server_nonce = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
    first = exchange.first(b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO")
    assert first == (
        b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    )
    final = exchange.final(
        b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
        b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
    )
    assert final == b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="


def test_scram_rejects_bad_proof_nonce_and_binding():
    verifier = make_verifier("pencil")
    for final, state in [
        (b"c=biws,r={n},p=" + base64.b64encode(b"\0" * 32), "28P01"),
        (b"c=biws,r=other,p=" + base64.b64encode(b"\0" * 32), "08P01"),
        (b"c=eSws,r={n},p=" + base64.b64encode(b"\0" * 32), "08P01"),
        (b"c=biws,r={n}", "08P01"),
    ]:
        ex = ScramExchange(verifier, mock_secret=b"x", user="u")
        ex.first(b"n,,n=,r=abc")
        with pytest.raises(ScramError) as info:
            ex.final(final.replace(b"{n}", ("abc" + ex.server_nonce).encode()))
        assert info.value.sqlstate == state


def test_scram_mock_exchange_always_fails_and_is_stable():
    a = ScramExchange(None, mock_secret=b"k", user="ghost")
    b = ScramExchange(None, mock_secret=b"k", user="ghost")
    assert a.verifier.salt == b.verifier.salt
    a.first(b"n,,n=,r=abc")
    with pytest.raises(ScramError) as info:
        a.final(b"c=biws,r=abc" + a.server_nonce.encode() + b",p=" + base64.b64encode(b"1" * 32))
    assert info.value.sqlstate == "28P01"


# --------------------------------------------------------------------------------------------
# users store and commands


def test_users_store_keeps_only_verifiers(tmp_path):
    store = UserStore(tmp_path / "p.users.json")
    store.add("alice", "s3cret-password")
    raw = store.path.read_text()
    assert "s3cret" not in raw
    entry = json.loads(raw)["users"]["alice"]
    assert set(entry) == {"mechanism", "iterations", "salt", "stored_key", "server_key"}
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    with pytest.raises(UserStoreError):
        store.add("alice", "x")
    store.add("alice", "other", replace=True)
    assert store.get("alice") != make_verifier("s3cret-password")
    with pytest.raises(UserStoreError):
        store.add("bad name!", "x")
    store.remove("alice")
    assert store.names() == [] and store.get("alice") is None
    assert [f.name for f in tmp_path.iterdir()] == ["p.users.json"]  # no temp files left


def test_user_commands(tmp_path, monkeypatch, capsys):
    policy = tmp_path / "visits.toml"
    policy.write_text("")
    monkeypatch.setattr(sys, "stdin", io.StringIO("pw-from-stdin\n"))
    assert cli_main(["user", "add", "carol", "--policy", str(policy), "--password-stdin"]) == 0
    assert users_path(policy) == tmp_path / "visits.users.json"
    assert cli_main(["user", "list", "--policy", str(policy)]) == 0
    assert "carol" in capsys.readouterr().out
    assert cli_main(["user", "remove", "carol", "--policy", str(policy)]) == 0
    assert cli_main(["user", "remove", "carol", "--policy", str(policy)]) == 1


def test_serve_command_starts_and_stops(tmp_path):
    for name in ("visits.toml", "visits.csv"):
        (tmp_path / name).write_bytes((ROOT / "fixtures" / name).read_bytes())
    policy = tmp_path / "visits.toml"
    UserStore(users_path(policy)).add("alice", "pw")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpsql", "serve", "--policy", str(policy), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        port = int(re.search(r":(\d+)\s*$", line).group(1))
        c = RawClient("127.0.0.1", port)
        assert c.login("alice", "pw").status == "I"
        assert c.query("SELECT COUNT(*) FROM visits").tags() == ["SELECT 1"]
        c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


# --------------------------------------------------------------------------------------------
# codec and types


def test_startup_packet_parsing():
    body = struct.pack("!i", p.PROTOCOL_V3) + b"user\0alice\0database\0visits\0\0"
    assert p.parse_startup_packet(body) == p.Startup({"user": "alice", "database": "visits"})
    assert p.parse_startup_packet(struct.pack("!i", p.SSL_REQUEST)) == p.SSL_REQUEST
    assert p.parse_startup_packet(struct.pack("!iii", p.CANCEL_REQUEST, 7, -3)) == p.CancelKey(
        7, -3
    )
    for bad in [b"", struct.pack("!i", p.PROTOCOL_V3) + b"user\0alice", b"\0\0"]:
        with pytest.raises(p.ProtocolViolation):
            p.parse_startup_packet(bad)


def test_bind_parsing_checks_every_length():
    body = b"portal\0stmt\0" + struct.pack("!hh", 1, 1) + struct.pack("!hi", 2, 2) + b"ab"
    body += struct.pack("!i", -1) + struct.pack("!hh", 1, 0)
    bind = p.parse_bind(body)
    assert bind.params == (b"ab", None) and bind.param_formats == (1,)
    for cut in range(len(body)):
        with pytest.raises(p.ProtocolViolation):
            p.parse_bind(body[:cut])
    with pytest.raises(p.ProtocolViolation):
        p.parse_bind(body + b"x")


@pytest.mark.parametrize(
    ("value", "oid", "text"),
    [
        (1.0, t.FLOAT8, b"1"),
        (0.1, t.FLOAT8, b"0.1"),
        (float("inf"), t.FLOAT8, b"Infinity"),
        (float("nan"), t.FLOAT8, b"NaN"),
        (True, t.BOOL, b"t"),
        (dt.date(2024, 2, 29), t.DATE, b"2024-02-29"),
        (["a", None, "b c", ""], 1009, b'{a,NULL,"b c",""}'),
        ([1, 2], 1016, b"{1,2}"),
        (b"\x01\xff", t.BYTEA, b"\\x01ff"),
    ],
)
def test_text_encoding(value, oid, text):
    assert t.encode_text(value, oid) == text


def test_binary_round_trips():
    cases = [
        (-(2**63), t.INT8),
        (2**31 - 1, t.INT4),
        (-3.5, t.FLOAT8),
        (False, t.BOOL),
        (dt.date(1999, 12, 31), t.DATE),
        ("héllo", t.TEXT),
        (4000000000, t.OID),
    ]
    for value, oid in cases:
        assert t.decode_binary_param(t.encode_binary(value, oid), oid) == value
    for text in ["0", "-12345.678", "0.0001", "100000000", "3.14159"]:
        back = t.decode_binary_param(t.encode_binary(Decimal(text), t.NUMERIC), t.NUMERIC)
        assert Decimal(str(back)) == Decimal(text)
    arr = t.encode_binary([1, None, 3], 1016)
    assert struct.unpack("!iiIii", arr[:20]) == (1, 1, t.INT8, 3, 1)


def test_parameter_decoding_errors():
    assert t.decode_param(b"42", t.INT8, 0) == 42
    assert t.decode_param(b"x", 0, 0) == "x"
    # JDBC's untyped setDate() value
    assert t.decode_param(b"2024-03-01 +00", 0, 0) == dt.date(2024, 3, 1)
    assert t.decode_param(b"2024-03-01", 0, 0) == "2024-03-01"
    assert t.decode_param(b"on", t.BOOL, 0) is True
    assert t.decode_param(None, t.INT8, 1) is None
    with pytest.raises(t.ParameterError):
        t.decode_param(b"nope", t.INT4, 0)
    with pytest.raises(t.ParameterError):
        t.decode_param(b"\x00\x01", t.INT8, 1)
    with pytest.raises(t.UnsupportedBinary):
        t.decode_param(b"\x00", 600, 1)


def test_duckdb_type_oids():
    assert t.duckdb_type_oid("BIGINT") == t.INT8
    assert t.duckdb_type_oid("UINTEGER") == t.OID
    assert t.duckdb_type_oid("VARCHAR[]") == 1009
    assert t.duckdb_type_oid("DECIMAL(18,3)") == t.NUMERIC


# --------------------------------------------------------------------------------------------
# SQL text, settings, rewriting


def test_split_statements_respects_quotes_and_comments():
    sql = "SELECT ';' ; SELECT \"a;b\" -- c;\n; /* d; /* e; */ */ SELECT $x$;$x$; ;"
    parts = split_statements(sql)
    assert [s.text.strip() for s in parts] == [
        "SELECT ';'",
        'SELECT "a;b" -- c;',
        "/* d; /* e; */ */ SELECT $x$;$x$",
    ]
    assert sql[parts[1].offset :].startswith(' SELECT "a;b"')


def test_identifiers_ignore_strings_and_comments():
    ids = identifiers("SELECT 'visits' FROM pg_class -- visits\nWHERE \"Visits\" = 1")
    assert "pg_class" in ids and "visits" in ids  # the quoted identifier, not the string
    assert "visits" not in identifiers("SELECT 'visits', $$visits$$ /* visits */")


def test_placeholders_and_inlining():
    sql = "SELECT COUNT(*) FROM t WHERE a > $1 AND b = '$2' AND c = $2"
    assert placeholder_count(sql) == 2
    assert inline_parameters(sql, [1, "o'k"]) == (
        "SELECT COUNT(*) FROM t WHERE a > 1 AND b = '$2' AND c = 'o''k'"
    )
    assert inline_parameters("SELECT $1, $2, $3", [None, True, dt.date(2024, 1, 2)]) == (
        "SELECT NULL, TRUE, DATE '2024-01-02'"
    )


def test_set_parsing_and_validation():
    assert parse_set("SET application_name = 'x y'").value == "x y"
    assert parse_set("SET SESSION TIME ZONE 'UTC'").name == "TimeZone"
    assert parse_set("set datestyle to ISO, MDY").value == "ISO, MDY"
    assert parse_set("SET extra_float_digits TO DEFAULT").value is None
    assert parse_set("SET TRANSACTION ISOLATION LEVEL READ COMMITTED").name is None
    assert set_name_of("SHOW TRANSACTION ISOLATION LEVEL") == "transaction_isolation"
    s = SessionSettings("alice")
    assert s.set("DateStyle", "ISO, DMY") == ["DateStyle"]
    for name, value in [("client_encoding", "LATIN1"), ("DateStyle", "German")]:
        with pytest.raises(SettingError):
            s.set(name, value)
    with pytest.raises(SettingError):
        s.set("server_version", "9")
    with pytest.raises(SettingError):
        s.get("no_such_setting")


def test_rewrite_catalog_sql():
    info = SessionInfo("alice", "visits", 42, {"search_path": "public"})
    sql = rewrite(
        "SELECT c.oid::pg_catalog.regclass, pg_catalog.format_type(20, -1), current_user, "
        "current_setting('search_path'), pg_backend_pid() FROM pg_catalog.pg_class c "
        "WHERE c.relname OPERATOR(pg_catalog.~) '^(v)$' COLLATE pg_catalog.default "
        "AND c.oid = ANY(ARRAY[1, 2]) AND c.oid = 'pg_class'::regclass",
        info,
    )
    assert "pgc.pg_class" in sql and "pg_catalog" not in sql
    assert "'alice'" in sql and "'public'" in sql and "42" in sql
    assert "DP_REGCLASS_NAME" in sql.upper() and "DP_REGCLASS_OID('PG_CLASS')" in sql.upper()
    assert "LIST_CONTAINS" in sql.upper()
    assert '"current_user"' in sql  # PostgreSQL's column name for an unaliased call


def test_array_parameter_decoding():
    assert t.decode_param(b'{a,"b c",NULL,"q\\"x"}', 1009, 0) == ["a", "b c", None, 'q"x']
    assert t.decode_param(b"{1,2}", 1016, 0) == [1, 2]
    assert t.decode_param(t.encode_binary([1, None], 1016), 1016, 1) == [1, None]
    with pytest.raises(t.ParameterError):
        t.decode_param(b"{{1},{2}}", 1016, 0)
