"""The wire protocol against a stand-in service session (fixed rows), byte by byte.

The server opens one session over the service per login (dpsql.service.session.Session) and
renders its answers; the stand-in session makes the protocol testable on its own:
authentication, simple and extended query, portals and row limits, binary formats, transaction
states, cancellation and hostile input.
"""

from __future__ import annotations

import datetime as dt
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpsql import errors
from dpsql.errors import Position
from dpsql.policy import load_policy
from dpsql.server import protocol as p
from dpsql.server import types as t
from dpsql.server.server import Server, ServerThread
from dpsql.server.testing import RawClient, cancel_request, cancel_until_answered
from dpsql.server.users import UserStore
from dpsql.service.answer import Answer
from dpsql.service.results import Result

ROWS = [
    (1, 1.5, "a", True, dt.date(2024, 1, 1)),
    (2, -2.25, "b,c", False, dt.date(2024, 2, 29)),
    (3, 1e20, None, None, None),
]
DESCRIPTION = [
    ("n", "BIGINT", None, None, None, None, None),
    ("x", "DOUBLE", None, None, None, None, None),
    ("s", "VARCHAR", None, None, None, None, None),
    ("b", "BOOLEAN", None, None, None, None, None),
    ("d", "DATE", None, None, None, None, None),
]


def _answer(description: list[tuple], rows: list[tuple], status: str = "SELECT") -> Answer:
    return Answer(Result(description=[(d[0], d[1]) for d in description], rows=rows, status=status))


class FakeSession:
    """Stands in for the service's session (dpsql.service.session.Session) the server opens
    for each analyst: fixed rows, a slow query, a refusal, the parameters it was given."""

    def __init__(self) -> None:
        self.settings = _Shown({"epsilon": 1.0, "delta": 0.0, "mechanism": "laplace"})
        self.log: list = []
        self.started = threading.Event()
        self.interrupted = threading.Event()
        self.closed = False
        self.described: list[str] = []

    def execute(self, sql: str, parameters=None) -> Answer:
        self.log.append((sql, parameters))
        low = sql.lower()
        if low.startswith("set "):
            return _answer([], [], "SET")
        if "slow" in low:
            self.started.set()
            if self.interrupted.wait(20):
                self.interrupted.clear()
                raise errors.OperationalError("query cancelled", sqlstate="57014")
        if "refuse" in low:
            raise errors.PrivacyError(
                "refused for the test",
                position=Position(1, 8, low.index("refuse")),
                hint="ask differently",
            )
        if "params" in low:
            return _answer([("p", "VARCHAR")], [(repr(parameters),)])
        return _answer(DESCRIPTION, list(ROWS))

    def interrupt(self) -> None:
        self.interrupted.set()

    def describe(self, sql: str, parameters=None) -> list[tuple]:
        self.described.append(sql)
        if "params" in sql.lower():
            return [("p", "VARCHAR")]
        return [(d[0], d[1]) for d in DESCRIPTION]

    def close(self) -> None:
        self.closed = True


class _Shown:
    """The session's settings, as far as the server reads them (their names)."""

    def __init__(self, values: dict) -> None:
        self.values = values

    def shown(self) -> dict:
        return dict(self.values)


class FakeService:
    def __init__(self) -> None:
        self.policy = load_policy(
            {
                "privacy": {"dataset": "visits"},
                "tables": {
                    "visits": {
                        "source": "visits_table",
                        "columns": {
                            "age": {"type": "int", "lower": 0, "upper": 100},
                            "department": {"type": "text"},
                        },
                    }
                },
            }
        )
        self.connections: list[FakeSession] = []  # the sessions the server opened


class FakeServer(Server):
    """The real server, opening a stand-in session for each login."""

    def open_session(self, analyst: str) -> FakeSession:
        session = FakeSession()
        session.analyst = analyst  # type: ignore[attr-defined]
        self.service.connections.append(session)
        return session


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    users = UserStore(tmp_path_factory.mktemp("users") / "visits.users.json")
    users.add("alice", "pw-alice")
    users.add("bob", "pw-bob")
    service = FakeService()
    thread = ServerThread(lambda: FakeServer(service, users, max_message=64 * 1024))
    thread.start()
    thread.service = service  # type: ignore[attr-defined]
    yield thread
    thread.stop()


@pytest.fixture
def client(server):
    c = RawClient("127.0.0.1", server.port)
    reply = c.login("alice", "pw-alice")
    assert reply.status == "I", reply.messages
    yield c
    c.sock.close()


def _alive(server) -> None:
    """Another client can still log in and query: the server keeps serving."""
    c = RawClient("127.0.0.1", server.port)
    assert c.login("bob", "pw-bob").status == "I"
    assert c.query("SELECT n FROM visits").tags() == ["SELECT 3"]
    c.close()


# --------------------------------------------------------------------------------------------
# startup and authentication


def test_login_reports_parameters_and_key(client):
    assert client.params["server_version"].startswith("16")
    assert client.params["client_encoding"] == "UTF8"
    assert client.params["DateStyle"].startswith("ISO")
    assert client.params["integer_datetimes"] == "on"
    assert client.params["standard_conforming_strings"] == "on"
    assert client.params["TimeZone"] == "UTC"
    assert client.params["session_authorization"] == "alice"
    assert client.pid > 0


def test_each_login_is_an_analyst(server, client):
    assert any(getattr(c, "analyst", None) == "alice" for c in server.service.connections)


@pytest.mark.parametrize(
    ("user", "password"), [("alice", "wrong"), ("mallory", "anything"), ("mallory", "pw-alice")]
)
def test_wrong_password_and_unknown_user_look_the_same(server, user, password):
    c = RawClient("127.0.0.1", server.port)
    reply = c.login(user, password)
    (err,) = reply.errors()
    assert err["C"] == "28P01"
    assert err["S"] == "FATAL"
    assert err["M"] == f'password authentication failed for user "{user}"'
    assert c.closed_by_server()


def test_unknown_user_gets_a_stable_fake_salt(server):
    salts = []
    for _ in range(2):
        c = RawClient("127.0.0.1", server.port)
        c.startup("nobody")
        c.recv()
        first = b"n,,n=,r=abcdef"
        c.send(b"p", p.cstr("SCRAM-SHA-256") + struct.pack("!i", len(first)) + first)
        kind, body = c.recv()
        assert kind == b"R"
        salts.append(dict(x.split("=", 1) for x in body[4:].decode().split(","))["s"])
        c.sock.close()
    assert salts[0] == salts[1]


def test_skipping_authentication_is_refused(server):
    c = RawClient("127.0.0.1", server.port)
    c.startup("alice")
    assert c.recv()[0] == b"R"
    reply = c.query("SELECT n FROM visits")
    assert [e["C"] for e in reply.errors()] == ["28000"]
    assert reply.rows() == []
    assert c.closed_by_server()


def test_channel_binding_required_by_client_is_refused(server):
    c = RawClient("127.0.0.1", server.port)
    c.startup("alice")
    c.recv()
    first = b"p=tls-server-end-point,,n=,r=abc"
    c.send(b"p", p.cstr("SCRAM-SHA-256-PLUS") + struct.pack("!i", len(first)) + first)
    reply = c.until_ready()
    assert reply.errors()[0]["C"] == "28000"


def test_missing_user_is_refused(server):
    c = RawClient("127.0.0.1", server.port)
    body = struct.pack("!i", p.PROTOCOL_V3) + p.cstr("database") + p.cstr("visits") + b"\x00"
    c.send_raw(struct.pack("!i", len(body) + 4) + body)
    assert c.until_ready().errors()[0]["C"] == "28000"


def test_ssl_and_gss_requests_answered_n_without_tls(server):
    c = RawClient("127.0.0.1", server.port)
    c.send_raw(struct.pack("!ii", 8, p.GSSENC_REQUEST))
    assert c.sock.recv(1) == b"N"
    c.send_raw(struct.pack("!ii", 8, p.SSL_REQUEST))
    assert c.sock.recv(1) == b"N"
    assert c.login("alice", "pw-alice").status == "I"
    c.close()


# --------------------------------------------------------------------------------------------
# simple query


def test_simple_query_types_and_text_format(client):
    reply = client.query("SELECT * FROM visits")
    assert [(n, oid) for n, oid, _ in reply.columns()] == [
        ("n", t.INT8),
        ("x", t.FLOAT8),
        ("s", t.TEXT),
        ("b", t.BOOL),
        ("d", t.DATE),
    ]
    assert reply.text_rows() == [
        ["1", "1.5", "a", "t", "2024-01-01"],
        ["2", "-2.25", "b,c", "f", "2024-02-29"],
        ["3", "1e+20", None, None, None],
    ]
    assert reply.tags() == ["SELECT 3"]
    assert reply.status == "I"


def test_multi_statement_query_runs_in_order_and_stops_at_first_error(server, client):
    reply = client.query("SELECT n FROM visits; SELECT refuse FROM visits; SELECT n FROM visits")
    assert reply.kinds().count(b"T") == 1
    assert reply.tags() == ["SELECT 3"]
    (err,) = reply.errors()
    assert err["C"] == "42501"
    assert err["H"] == "ask differently"
    # 'P' is 1-based over the whole query string
    assert int(err["P"]) == "SELECT n FROM visits; SELECT refuse FROM visits".index("refuse") + 1
    assert reply.status == "I"


def test_empty_query(client):
    reply = client.query("  ;  -- nothing\n")
    assert reply.kinds() == b"IZ"


def test_catalog_queries_never_reach_the_private_side(server, client):
    conn = server.service.connections[-1]
    before = len(conn.log)
    reply = client.query(
        "SELECT current_user, current_database(), current_schema(), version(); "
        "SELECT relname FROM pg_catalog.pg_class WHERE relnamespace = 2200"
    )
    assert reply.text_rows()[0][:3] == ["alice", "visits", "public"]
    assert reply.text_rows()[0][3].startswith("PostgreSQL 16")
    assert reply.text_rows()[1] == ["visits"]
    assert len(conn.log) == before


def test_catalog_is_read_only_and_sealed(client):
    reply = client.query("CREATE TABLE t (a INT)")
    assert reply.errors()[0]["C"] in ("25006", "42601")
    reply = client.query("SELECT * FROM read_csv('/etc/passwd')")
    assert reply.errors() and reply.rows() == []
    reply = client.query("ATTACH ':memory:' AS other")
    assert reply.errors()[0]["C"] in ("25006", "42601")


def test_set_show_reset_of_pg_settings(client):
    reply = client.query("SET application_name = 'bi tool'")
    assert reply.tags() == ["SET"]
    status = [p.Reader(b) for k, b in reply.messages if k == b"S"]
    assert [(r.cstring(), r.cstring()) for r in status] == [("application_name", "bi tool")]
    assert client.query("SHOW application_name").text_rows() == [["bi tool"]]
    assert client.query("SET extra_float_digits = 3").tags() == ["SET"]
    assert client.query("SHOW TRANSACTION ISOLATION LEVEL").text_rows() == [["read committed"]]
    assert client.query("SET client_encoding = 'LATIN1'").errors()[0]["C"] == "22023"
    assert client.query("RESET application_name").tags() == ["RESET"]
    assert client.query("SHOW application_name").text_rows() == [[""]]
    assert client.query("SELECT current_setting('extra_float_digits')").text_rows() == [["3"]]
    # a misspelt privacy setting is refused, not silently stored
    assert client.query("SET epsilonn = 0.1").errors()[0]["C"] == "42704"
    reply = client.query("SET TIME ZONE 'Europe/Paris'; SHOW timezone")
    assert reply.columns()[0][0] == "TimeZone" and reply.text_rows() == [["Europe/Paris"]]


def test_privacy_settings_go_to_the_dp_connection(server, client):
    conn = server.service.connections[-1]
    assert client.query("SET epsilon = 0.5").tags() == ["SET"]
    assert conn.log[-1][0] == "SET epsilon = 0.5"
    client.query("SET application_name = 'pool'")
    reply = client.query("DISCARD ALL")  # a pool hands the connection on: fresh settings
    assert reply.tags() == ["DISCARD ALL"]
    assert {e[0] for e in conn.log[-3:]} == {"RESET epsilon", "RESET delta", "RESET mechanism"}
    assert client.query("SHOW application_name").text_rows() == [[""]]


def test_explain_of_a_catalog_query_is_not_supported(client):
    assert client.query("EXPLAIN SELECT 1").errors()[0]["C"] == "0A000"


# --------------------------------------------------------------------------------------------
# transactions


def test_transaction_states_and_failed_block(client):
    assert client.query("BEGIN").status == "T"
    assert client.query("SELECT n FROM visits").status == "T"
    reply = client.query("SELECT refuse FROM visits")
    assert reply.status == "E"
    reply = client.query("SELECT n FROM visits")
    assert reply.errors()[0]["C"] == "25P02"
    assert reply.rows() == [] and reply.status == "E"
    reply = client.query("COMMIT")
    assert reply.tags() == ["ROLLBACK"] and reply.status == "I"
    reply = client.query("COMMIT")
    assert reply.notices()[0]["C"] == "25P01" and reply.status == "I"
    assert client.query("BEGIN; SELECT n FROM visits; ROLLBACK").status == "I"


# --------------------------------------------------------------------------------------------
# extended protocol


def test_extended_unnamed_with_binary_results(client):
    client.parse("SELECT * FROM visits")
    client.bind(result_formats=[1])
    client.describe("P")
    client.execute()
    reply = client.sync()
    assert reply.kinds() == b"12TDDDCZ"
    assert [fmt for _, _, fmt in reply.columns()] == [1] * 5
    first = reply.rows()[0]
    assert struct.unpack("!q", first[0])[0] == 1
    assert struct.unpack("!d", first[1])[0] == 1.5
    assert first[2] == b"a"
    assert first[3] == b"\x01"
    assert struct.unpack("!i", first[4])[0] == (dt.date(2024, 1, 1) - dt.date(2000, 1, 1)).days


def test_extended_mixed_result_formats(client):
    client.parse("SELECT * FROM visits")
    client.bind(result_formats=[0, 1, 0, 1, 0])
    client.execute()
    reply = client.sync()
    row = reply.rows()[1]
    assert row[0] == b"2" and struct.unpack("!d", row[1])[0] == -2.25 and row[3] == b"\x00"


def test_named_statement_describe_runs_nothing(server, client):
    conn = server.service.connections[-1]
    before = len(conn.log)
    client.parse("SELECT n FROM visits WHERE age > $1", name="s1", oids=[t.INT8])
    client.describe("S", "s1")
    reply = client.sync()
    assert reply.kinds() == b"1tTZ"
    (_, desc) = reply.messages[1]
    assert struct.unpack("!hI", desc) == (1, t.INT8)
    assert len(conn.log) == before
    assert conn.described


def test_parameters_text_and_binary(server, client):
    client.parse(
        "SELECT params FROM visits WHERE a = $1 AND b = $2 AND c = $3",
        name="p2",
        oids=[t.INT8, t.TEXT, t.FLOAT8],
    )
    client.bind([b"42", b"x'y", struct.pack("!d", 0.5)], statement="p2", param_formats=[0, 0, 1])
    client.execute()
    reply = client.sync()
    assert reply.text_rows() == [['[42, "x\'y", 0.5]']]
    client.bind([struct.pack("!q", 7), None, b"2.5"], statement="p2", param_formats=[1, 0, 0])
    client.execute()
    assert client.sync().text_rows() == [["[7, None, 2.5]"]]


def test_bad_parameter_is_22p02(client):
    client.parse("SELECT params FROM visits WHERE a = $1", oids=[t.INT8])
    client.bind([b"forty-two"])
    client.execute()
    reply = client.sync()
    assert reply.errors()[0]["C"] == "22P02" and reply.status == "I"


def test_portal_row_limit_suspends(client):
    client.parse("SELECT * FROM visits", name="all")
    client.bind(statement="all", portal="cur")
    client.execute("cur", 2)
    client.execute("cur", 2)
    reply = client.sync()
    assert reply.kinds() == b"12DDsDCZ"
    assert reply.tags() == ["SELECT 1"]


def test_errors_skip_to_sync(client):
    client.parse("SELECT n FROM visits", name="dup")
    client.parse("SELECT n FROM visits", name="dup")
    client.bind(statement="dup")
    client.execute()
    reply = client.sync()
    assert reply.kinds() == b"1EZ"
    assert reply.errors()[0]["C"] == "42P05"
    client.close_object("S", "dup")
    assert client.sync().kinds() == b"3Z"


def test_unknown_statement_and_portal(client):
    client.bind(statement="nope")
    assert client.sync().errors()[0]["C"] == "26000"
    client.execute("nope")
    assert client.sync().errors()[0]["C"] == "34000"


def test_multiple_commands_cannot_be_prepared(client):
    client.parse("SELECT 1; SELECT 2")
    assert client.sync().errors()[0]["C"] == "42601"


def test_flush_sends_without_sync(client):
    client.parse("SELECT n FROM visits")
    client.send(b"H")
    assert client.recv()[0] == b"1"
    client.sync()


def test_failed_block_in_extended_protocol(client):
    client.query("BEGIN")
    client.parse("SELECT refuse FROM visits")
    client.bind()
    client.execute()
    assert client.sync().status == "E"
    client.parse("SELECT n FROM visits")
    client.bind()
    client.execute()
    reply = client.sync()
    assert reply.errors()[0]["C"] == "25P02" and reply.status == "E"
    assert client.query("ROLLBACK").status == "I"


# --------------------------------------------------------------------------------------------
# cancel and disconnect


def test_cancel_request_interrupts_the_running_query(server):
    c = RawClient("127.0.0.1", server.port)
    c.login("alice", "pw-alice")
    conn = server.service.connections[-1]
    c.send(b"Q", p.cstr("SELECT slow FROM visits"))
    assert conn.started.wait(10)
    cancel_request("127.0.0.1", server.port, c.pid, c.secret + 1)  # wrong key: ignored
    time.sleep(0.2)
    assert not conn.interrupted.is_set()
    cancel_request("127.0.0.1", server.port, c.pid, c.secret)
    reply = c.until_ready()
    assert reply.errors()[0]["C"] == "57014"
    assert reply.status == "I"
    assert c.query("SELECT n FROM visits").tags() == ["SELECT 3"]
    c.close()


def test_disconnect_mid_query_interrupts_and_server_survives(server):
    c = RawClient("127.0.0.1", server.port)
    c.login("alice", "pw-alice")
    conn = server.service.connections[-1]
    c.send(b"Q", p.cstr("SELECT slow FROM visits"))
    assert conn.started.wait(10)
    c.sock.close()
    deadline = time.monotonic() + 10
    while not conn.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert conn.closed
    _alive(server)


def _hang_up_behind_a_running_query(server, behind: bytes, reset: bool = False) -> FakeSession:
    """A slow query running, then ``behind`` (messages) sent and the socket closed (with a
    reset when ``reset``): the stand-in session of that connection."""
    c = RawClient("127.0.0.1", server.port)
    c.login("alice", "pw-alice")
    conn = server.service.connections[-1]
    c.send(b"Q", p.cstr("SELECT slow FROM visits"))
    assert conn.started.wait(10)
    c.send_raw(behind)
    if reset:
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.sock.close()
    return conn


def _closed(conn: FakeSession, wait: float = 10.0) -> bool:
    deadline = time.monotonic() + wait
    while not conn.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    return conn.closed


def test_hang_up_behind_pipelined_queries_interrupts(server):
    """Complete messages queued behind the running query, then the end of the stream: the
    statement is interrupted (as a reader reading ahead reached the end)."""
    more = p.message(b"Q", p.cstr("SELECT n FROM visits"))
    conn = _hang_up_behind_a_running_query(server, more + more)
    assert _closed(conn)  # (uninterrupted, the stand-in query runs 20 s)
    _alive(server)


def test_hang_up_after_a_terminate_lets_the_query_finish(server):
    """A Terminate queued behind the running query, then the end of the stream: the
    statement is not interrupted (a reader stops at the Terminate, before the end); it runs to
    its end and the session closes after it."""
    conn = _hang_up_behind_a_running_query(server, p.message(b"X", b""))
    time.sleep(0.3)
    assert not conn.interrupted.is_set() and not conn.closed
    conn.interrupt()  # the stand-in query ends (as if it had finished)
    assert _closed(conn)
    _alive(server)


def test_hang_up_with_a_reset_interrupts_even_after_a_terminate(server):
    """A connection reset ends the stream at once, whatever was sent before it."""
    conn = _hang_up_behind_a_running_query(server, p.message(b"X", b""), reset=True)
    assert _closed(conn)
    _alive(server)


# --------------------------------------------------------------------------------------------
# hostile input


def test_garbage_before_startup(server):
    c = RawClient("127.0.0.1", server.port)
    c.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = c.until_ready()
    assert reply.errors()[0]["C"] == "08P01"
    assert c.closed_by_server()
    _alive(server)


def test_unsupported_protocol_version(server):
    c = RawClient("127.0.0.1", server.port)
    c.send_raw(struct.pack("!ii", 8, 2 << 16))
    assert c.until_ready().errors()[0]["C"] == "0A000"


def test_oversized_message_errors_and_disconnects(server, client):
    client.send_raw(b"Q" + struct.pack("!i", 10 << 20))
    reply = client.until_ready()
    assert reply.errors()[0]["C"] == "54000"
    assert client.closed_by_server()
    _alive(server)


def test_lying_length_is_a_protocol_violation(server, client):
    # a Parse whose length word covers only part of its strings
    body = p.cstr("") + p.cstr("SELECT n FROM visits") + struct.pack("!h", 0)
    client.send_raw(b"P" + struct.pack("!i", 4 + 5) + body[:5])
    reply = client.sync()
    assert [e["C"] for e in reply.errors()] == ["08P01"]
    assert client.closed_by_server()
    _alive(server)


def test_length_word_below_four(server, client):
    client.send_raw(b"Q" + struct.pack("!i", 2))
    assert [e["C"] for e in client.until_ready().errors()] == ["08P01"]
    assert client.closed_by_server()


def test_truncated_message_then_disconnect(server):
    c = RawClient("127.0.0.1", server.port)
    c.login("alice", "pw-alice")
    c.send_raw(b"Q" + struct.pack("!i", 100) + b"SELECT")
    c.sock.shutdown(socket.SHUT_WR)
    assert c.closed_by_server()
    _alive(server)


def test_unknown_message_type(server, client):
    client.send(b"!", b"junk")
    reply = client.until_ready()
    assert reply.errors()[0]["C"] == "08P01"
    assert client.closed_by_server()
    _alive(server)


def test_bad_bind_format_code(client):
    client.parse("SELECT n FROM visits")
    client.bind(result_formats=[7])
    reply = client.until_ready()
    assert reply.errors()[0]["C"] in ("22023", "08P01")


def test_terminate_closes_cleanly(server):
    c = RawClient("127.0.0.1", server.port)
    c.login("alice", "pw-alice")
    c.send(b"X")
    assert c.closed_by_server()


def test_too_many_connections(tmp_path):
    users = UserStore(tmp_path / "u.json")
    users.add("alice", "pw")
    with ServerThread(lambda: FakeServer(FakeService(), users, max_connections=1)) as th:
        first = RawClient("127.0.0.1", th.port)
        assert first.login("alice", "pw").status == "I"
        second = RawClient("127.0.0.1", th.port)
        # the refusal comes after the startup packet (and any SSL answer), as PostgreSQL's
        # does, so that libpq clients on sslmode=prefer see it
        assert second.login("alice", "pw").errors()[0]["C"] == "53300"
        first.close()


def test_prepared_statement_cap(client):
    from dpsql.server.session import MAX_STATEMENTS

    for i in range(MAX_STATEMENTS):
        client.parse("SELECT n FROM visits", name=f"s{i}")
    client.parse("SELECT n FROM visits", name="one-too-many")
    reply = client.sync()
    assert reply.kinds().count(b"1") == MAX_STATEMENTS
    assert reply.errors()[0]["C"] == "54000"
    assert client.query("DEALLOCATE ALL").tags() == ["DEALLOCATE ALL"]


# --------------------------------------------------------------------------------------------
# protocol fuzzing

KINDS = [b"Q", b"P", b"B", b"D", b"E", b"C", b"H", b"S", b"F", b"d", b"c", b"f", b"p", b"?", b"\0"]


@st.composite
def _message(draw):
    kind = draw(st.sampled_from(KINDS))
    if draw(st.booleans()):
        body = draw(st.binary(max_size=40))
    else:  # structurally plausible bodies with random strings and counts
        body = (
            p.cstr(draw(st.sampled_from(["", "s", "portal"])))
            + p.cstr(draw(st.sampled_from(["SELECT n FROM visits", "SELECT 1", "", "BEGIN"])))
            + struct.pack("!h", draw(st.integers(-2, 3)))
            + draw(st.binary(max_size=12))
        )
    raw = kind + struct.pack("!i", len(body) + 4) + body
    if draw(st.integers(0, 9)) == 0:  # sometimes lie about the length
        raw = kind + struct.pack("!i", draw(st.integers(-5, 200))) + body
    return raw


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_message(), min_size=1, max_size=6))
def test_fuzzed_message_sequences(server, messages):
    c = RawClient("127.0.0.1", server.port)
    assert c.login("alice", "pw-alice").status == "I"
    # a lying length can leave the server (rightly) waiting for more bytes: stop waiting soon
    c.sock.settimeout(0.2)
    try:
        for raw in messages:
            c.send_raw(raw)
        c.send(b"S")
        c.send(b"Q", p.cstr("SELECT n FROM visits"))
        # the server either answers (possibly with errors) or closes the connection cleanly
        for _ in range(2 + len(messages)):
            reply = c.until_ready()
            if reply.status is None:
                break
            for err in reply.errors():
                assert len(err["C"]) == 5
    except OSError:
        pass  # closed mid-write (a clean disconnect), or still waiting for declared bytes
    finally:
        c.sock.close()


def test_server_alive_after_fuzzing(server):
    _alive(server)


def test_psycopg_cancel(server):
    psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
    dsn = f"host=127.0.0.1 port={server.port} user=alice password=pw-alice dbname=visits"
    with psycopg.connect(dsn, autocommit=True) as conn:
        fake = server.service.connections[-1]
        errors_seen: list[BaseException] = []

        def run() -> None:
            try:
                conn.execute("SELECT slow FROM visits")
            except psycopg.Error as exc:
                errors_seen.append(exc)

        worker = threading.Thread(target=run)
        worker.start()
        assert fake.started.wait(10)
        conn.cancel_safe()
        worker.join(20)
        assert isinstance(errors_seen[0], psycopg.errors.QueryCanceled)
        assert conn.execute("SELECT n FROM visits").fetchall()[0][0] == 1


def test_shadow_reads_no_files_not_even_its_temp_directory(client, tmp_path):
    secret = tmp_path / "secret.csv"
    secret.write_text("a,b\n1,2\n")
    reply = client.query(f"SELECT * FROM read_csv('{secret}')")
    assert reply.errors() and reply.rows() == []
    reply = client.query(
        "SELECT value FROM duckdb_settings() WHERE name IN ('allowed_directories', "
        "'allowed_paths', 'temp_directory', 'enable_external_access', 'lock_configuration') "
        "ORDER BY name"
    )
    assert reply.text_rows() == [["[]"], ["[]"], ["false"], ["true"], [""]]


def test_client_that_never_reads_cannot_grow_server_buffers(server):
    """Backpressure: once its replies are unread, the server stops reading that client."""
    c = RawClient("127.0.0.1", server.port)
    c.login("alice", "pw-alice")
    chunk = p.message(b"Q", p.cstr("SELECT n FROM visits")) * 2000  # ~60 KB of queries
    c.sock.settimeout(2.0)
    sent = 0
    limit = 256 << 20
    try:
        while sent < limit:
            sent += c.sock.send(chunk)
    except TimeoutError:
        pass
    # The kernel's socket buffers hold a few MB; the server itself holds at most a queue of
    # 8 messages and one transport buffer. Without backpressure this would reach the limit.
    assert sent < 64 << 20
    c.sock.close()
    _alive(server)


def test_cancel_a_long_catalog_query(server):
    c = RawClient("127.0.0.1", server.port)
    c.login("alice", "pw-alice")
    c.send(b"Q", p.cstr("SELECT count(*) FROM range(1000000000000)"))
    reply = cancel_until_answered(c, "127.0.0.1", server.port)
    assert reply.errors()[0]["C"] == "57014" and reply.status == "I"
    c.close()


def test_function_call_is_not_supported_and_needs_no_sync(client):
    client.send(b"F", struct.pack("!I", 1234) + struct.pack("!hhh", 0, 0, 0))
    reply = client.until_ready()
    assert reply.errors()[0]["C"] == "0A000" and reply.status == "I"
    assert client.query("SELECT n FROM visits").tags() == ["SELECT 3"]


BROWSING_QUERIES = [
    # DBeaver / Metabase / DataGrip style catalog reads (shapes taken from those tools)
    "SELECT db.oid, db.* FROM pg_catalog.pg_database db WHERE datallowconn AND NOT "
    "datistemplate OR db.datname = 'visits' ORDER BY db.datname",
    "SELECT n.oid, n.*, d.description FROM pg_catalog.pg_namespace n LEFT OUTER JOIN "
    "pg_catalog.pg_description d ON d.objoid = n.oid AND d.objsubid = 0 AND "
    "d.classoid = 'pg_namespace'::regclass ORDER BY nspname",
    "SELECT c.relname, a.*, pg_catalog.pg_get_expr(ad.adbin, ad.adrelid, true) AS def_value, "
    "dsc.description, dep.objid FROM pg_catalog.pg_attribute a INNER JOIN pg_catalog.pg_class c "
    "ON (a.attrelid = c.oid) LEFT OUTER JOIN pg_catalog.pg_attrdef ad ON (a.attrelid = "
    "ad.adrelid AND a.attnum = ad.adnum) LEFT OUTER JOIN pg_catalog.pg_description dsc ON "
    "(c.oid = dsc.objoid AND a.attnum = dsc.objsubid) LEFT OUTER JOIN pg_depend dep ON "
    "dep.refobjid = a.attrelid AND dep.deptype = 'i' AND dep.refobjsubid = a.attnum WHERE NOT "
    "a.attisdropped AND c.relkind NOT IN ('i','I','c') AND c.oid = 16384 ORDER BY a.attnum",
    "SELECT t.oid, t.*, c.relkind, format_type(nullif(t.typbasetype, 0), t.typtypmod) AS "
    "base_type_name FROM pg_catalog.pg_type t LEFT OUTER JOIN pg_catalog.pg_type et ON "
    "et.oid = t.typelem LEFT OUTER JOIN pg_catalog.pg_class c ON c.oid = t.typrelid",
    "SELECT string_agg(word, ',') FROM pg_catalog.pg_get_keywords() WHERE word <> ALL "
    "('{a,abs,absolute}'::text[])",
    "SELECT c.relname FROM pg_class c WHERE c.relname = ANY('{visits,other}')",
    "SELECT r.oid, r.* FROM pg_catalog.pg_roles r",
    "SELECT pg_catalog.pg_is_in_recovery(), pg_catalog.current_schemas(false)",
    "SELECT setting FROM pg_catalog.pg_settings WHERE name = 'max_index_keys'",
    "SELECT * FROM information_schema.key_column_usage",
    "SELECT has_table_privilege('visits', 'SELECT'), obj_description(16384, 'pg_class')",
]


@pytest.mark.parametrize("sql", BROWSING_QUERIES)
def test_bi_tool_browsing_queries(server, client, sql):
    conn = server.service.connections[-1]
    before = len(conn.log)
    reply = client.query(sql)
    assert reply.errors() == [] and reply.tags()[0].startswith("SELECT")
    assert len(conn.log) == before  # answered from the shadow


def test_array_parameters_in_catalog_queries(client):
    client.parse("SELECT relname FROM pg_class WHERE relname = ANY($1)", oids=[1009])
    client.bind([b'{visits,"x y"}'])
    client.execute()
    assert client.sync().text_rows() == [["visits"]]
    client.parse("SELECT relname FROM pg_class WHERE relname = ANY($1)")  # untyped, as psycopg
    client.bind([b"{visits}"])
    client.execute()
    assert client.sync().text_rows() == [["visits"]]


def test_catalog_column_types_match_postgresql(client):
    reply = client.query("SELECT oid, relname, relnatts, reltuples, relkind FROM pg_class LIMIT 1")
    assert [oid for _, oid, _ in reply.columns()] == [t.OID, t.NAME, t.INT2, t.FLOAT4, t.TEXT]
    client.parse("SELECT oid, relname FROM pg_class WHERE relname = 'visits'")
    client.bind(result_formats=[1])
    client.execute()
    row = client.sync().rows()[0]
    assert struct.unpack("!I", row[0])[0] == 16384 and row[1] == b"visits"


def test_statement_timeout_interrupts(server):
    c = RawClient("127.0.0.1", server.port)
    c.login("alice", "pw-alice")
    assert c.query("SET statement_timeout = 'soon'").errors()[0]["C"] == "22023"
    assert c.query("SET statement_timeout = '200ms'").tags() == ["SET"]
    reply = c.query("SELECT slow FROM visits")
    err = reply.errors()[0]
    assert err["C"] == "57014" and "statement timeout" in err["M"]
    assert c.query("SET statement_timeout = 0; SELECT n FROM visits").tags() == ["SET", "SELECT 3"]
    c.close()


def test_zero_row_probes_run_nothing(server, client):
    conn = server.service.connections[-1]
    before = len(conn.log)
    for sql in ["SELECT * FROM visits LIMIT 0", "SELECT n FROM (SELECT * FROM visits) v LIMIT 0"]:
        reply = client.query(sql)
        assert reply.errors() == [] and reply.rows() == [] and reply.tags() == ["SELECT 0"]
        assert [c[0] for c in reply.columns()] == ["n", "x", "s", "b", "d"]  # planned columns
    assert len(conn.log) == before


def test_probe_recognition():
    from dpsql.server.probes import is_zero_row_probe

    for sql in [
        "SELECT * FROM visits LIMIT 0",
        "SELECT a FROM visits WHERE 1 = 0",
        "SELECT a FROM visits WHERE (1 <> 1) AND a > 3",
        "SELECT department, COUNT(*) FROM visits GROUP BY department LIMIT 0",
        "SELECT a FROM visits WHERE false",
        "SELECT * FROM visits LIMIT 1",  # a column probe: columns, no rows, and a NOTICE
    ]:
        assert is_zero_row_probe(sql), sql
    for sql in [
        "SELECT * FROM (SELECT department, COUNT(*) AS n FROM visits GROUP BY 1) s LIMIT 3",
        "SELECT DISTINCT department FROM visits LIMIT 3",
        "SELECT * FROM dp_rule_list('visits', label => 'smoker') LIMIT 2",
        "SELECT COUNT(*) FROM visits WHERE 1 = 0",  # one (noisy) row, not zero
        "SELECT department, COUNT(*) FROM visits WHERE false GROUP BY department",
        "SELECT a FROM visits WHERE 1 = 0 OR a > 1",
        "SELECT * FROM (SELECT * FROM visits LIMIT 0) v",
        "SELECT a FROM visits WHERE '1' = 1",
    ]:
        assert not is_zero_row_probe(sql), sql
