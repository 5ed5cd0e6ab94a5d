"""Connections between analysts (dpsql.server.connections): per-login and per-address limits,
the authentication timeout, login throttling, "too many clients" after the SSL negotiation, and
a load test — one analyst flooding with connections and failed logins while another connects
and queries.

Servers run in this process on 127.0.0.1 (ServerThread) or, for ``--workers``, as the real CLI;
timings are compared with a baseline measured in the same test (ratios, no absolute bounds), and
every loop stops by itself.

``python tests/test_server_connections.py [--off]`` prints the load test's figures
(docs/server.md, "Connections: limits, timeouts and throttling").
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import dpsql
from dpsql.policy import load_policy
from dpsql.server import protocol as p
from dpsql.server.connections import (
    ConnectionLimits,
    LoginThrottle,
    server_settings_from_policy_file,
)
from dpsql.server.fairness import FairnessError, FairnessLimits
from dpsql.server.server import Server, ServerThread
from dpsql.server.testing import RawClient
from dpsql.server.users import UserStore, users_path

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "correct horse"
USERS = ("alice", "bob", "mallory")
QUERY = "SET epsilon = 0.001; SELECT COUNT(*) FROM visits WHERE age > 30"


def _make_policy(root: Path) -> Path:
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(ROOT / "fixtures" / name, root / name)
    store = UserStore(users_path(root / "visits.toml"))
    for name in USERS:
        store.add(name, PASSWORD)
    return root / "visits.toml"


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory) -> Path:
    return _make_policy(tmp_path_factory.mktemp("connections"))


@pytest.fixture(scope="module")
def service(policy_path):
    service = dpsql.Service(policy_path, cache=False)
    yield service
    service.close()


def _serve(service, policy_path, max_connections: int = 100, **limits) -> ServerThread:
    users = UserStore(users_path(policy_path))
    connections = ConnectionLimits(**limits)
    return ServerThread(
        lambda: Server(
            service,
            users,
            max_connections=max_connections,
            connections=connections,
            fairness=FairnessLimits(),
        )
    )


def _login(port: int, user: str, password: str = PASSWORD, timeout: float = 30.0):
    c = RawClient("127.0.0.1", port, timeout=timeout)
    return c, c.login(user, password)


def _until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --------------------------------------------------------------------------------------------
# settings


def test_server_section_is_accepted_by_the_policy_and_read_by_the_server(tmp_path):
    policy = _make_policy(tmp_path)
    text = policy.read_text()
    policy.write_text(
        text + "\n[server]\nanalyst_statements = 3\nmax_connections_per_login = 4\n"
        "max_connections_per_address = 9\nauth_timeout = 2\nlogin_delay_max = 1.5\n"
    )
    assert load_policy(policy).server["max_connections_per_login"] == 4
    fairness, connections = server_settings_from_policy_file(policy)
    assert fairness.analyst_statements == 3
    assert connections == ConnectionLimits(
        max_connections_per_login=4,
        max_connections_per_address=9,
        auth_timeout=2.0,
        login_delay_max=1.5,
    )
    assert connections.per_login(100) == 4 and ConnectionLimits().per_login(100) == 25
    assert ConnectionLimits().per_address(100) == 50 and ConnectionLimits().per_login(2) == 1

    policy.write_text(text + "\n[server]\nmax_connection_per_login = 4\n")
    load_policy(policy)  # the policy loader leaves [server] to the server's reader
    with pytest.raises(FairnessError, match=r"server\.max_connection_per_login: unknown key"):
        server_settings_from_policy_file(policy)
    for bad in ("auth_timeout = 0", "max_connections_per_login = -1", "login_delay = 9"):
        policy.write_text(text + f"\n[server]\n{bad}\n")
        with pytest.raises(FairnessError, match=bad.split()[0]):
            server_settings_from_policy_file(policy)
    policy.write_text('server = "fast"\n' + text)
    with pytest.raises(dpsql.Error, match="server: must be a table"):
        load_policy(policy)


def test_throttle_doubles_caps_forgets_and_is_bounded():
    now = [0.0]
    limits = ConnectionLimits(login_delay=0.1, login_delay_max=1.0, login_forget=60.0)
    throttle = LoginThrottle(limits, capacity=50, clock=lambda: now[0])
    delays = [throttle.failed("10.0.0.1", "alice") for _ in range(7)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    # another login from the same address: the address's count decides
    assert throttle.failed("10.0.0.1", "bob") == 1.0
    # the same login from another address: the login's count decides
    assert throttle.failed("10.0.0.2", "alice") == 1.0
    assert throttle.failed("10.0.0.3", "carol") == 0.1
    # a success clears its login, not the address
    throttle.succeeded("alice")
    assert throttle.failures("10.0.0.2") == 1 and throttle.failures("10.0.0.1", "alice") == 8
    now[0] = 61.0  # quiet for longer than login_forget
    assert throttle.failures("10.0.0.1", "alice") == 0
    assert throttle.failed("10.0.0.1", "alice") == 0.1
    for i in range(500):  # a spray of made-up names keeps at most `capacity` entries
        throttle.failed("10.0.0.9", f"user{i}")
    assert len(throttle._failures) <= 50


# --------------------------------------------------------------------------------------------
# each limit over the wire


def test_per_login_limit(service, policy_path):
    with _serve(service, policy_path, max_connections_per_login=2) as th:
        held = [_login(th.port, "alice") for _ in range(2)]
        assert all(r.status == "I" for _, r in held)
        third, reply = _login(th.port, "alice")
        error = reply.errors()[0]
        assert error["C"] == "53300" and error["M"] == 'too many connections for role "alice"'
        assert "max_connections_per_login" in error["H"]
        other, reply = _login(th.port, "bob")  # another login is not affected
        assert reply.status == "I" and not other.query(QUERY).errors()
        held[0][0].close()
        server = th.server
        assert server is not None
        assert _until(lambda: server.logins["alice"] < 2)
        again, reply = _login(th.port, "alice")
        assert reply.status == "I"
        for c in (again, other, held[1][0], third):
            c.close()


def test_per_address_limit_counts_unauthenticated_sockets(service, policy_path):
    with _serve(service, policy_path, max_connections_per_address=3, auth_timeout=30) as th:
        idle = [socket.create_connection(("127.0.0.1", th.port)) for _ in range(3)]
        server = th.server
        assert server is not None
        assert _until(lambda: server.addresses["127.0.0.1"] == 3)
        c, reply = _login(th.port, "bob")
        error = reply.errors()[0]
        assert (
            error["C"] == "53300" and "too many connections from address 127.0.0.1" in (error["M"])
        )
        assert "max_connections_per_address" in error["H"]
        c.close()
        for s in idle:
            s.close()
        assert _until(lambda: server.addresses["127.0.0.1"] == 0)
        c, reply = _login(th.port, "bob")
        assert reply.status == "I"
        c.close()


def _fatal_of(sock: socket.socket) -> dict[str, str] | None:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    if not data.startswith(b"E"):
        return None
    length = struct.unpack("!i", data[1:5])[0]
    return p.parse_error_fields(data[5 : 1 + length])


def test_auth_timeout_closes_idle_and_stalled_logins(service, policy_path):
    with _serve(service, policy_path, auth_timeout=0.5) as th:
        silent = socket.create_connection(("127.0.0.1", th.port), timeout=30)
        stalled = RawClient("127.0.0.1", th.port, timeout=30)
        stalled.startup("alice")  # then never answers the SASL request
        kind, _ = stalled.recv()
        assert kind == b"R"
        start = time.monotonic()
        error = _fatal_of(silent)
        assert error is not None and error["C"] == "08P01" and error["S"] == "FATAL"
        error = stalled.until_ready().errors()[0]
        assert error["C"] == "28000" and "authentication due to timeout" in error["M"]
        assert time.monotonic() - start < 25  # closed by the timeout, not the client's
        server = th.server
        assert server is not None
        assert _until(lambda: not server.sessions)
        c, reply = _login(th.port, "alice")  # a prompt login is unaffected
        assert reply.status == "I"
        c.close()
        silent.close()
        stalled.sock.close()


def test_failed_logins_are_delayed_more_and_more_without_blocking_others(service, policy_path):
    with _serve(service, policy_path, login_delay=0.2, login_delay_max=1.6) as th:
        took = []
        for _ in range(4):
            start = time.monotonic()
            c, reply = _login(th.port, "alice", "wrong")
            took.append(time.monotonic() - start)
            assert reply.errors()[0]["C"] == "28P01"
            c.close()
        # each failure is answered after at least its delay: 0.2, 0.4, 0.8, 1.6 s
        assert all(t >= d for t, d in zip(took, (0.2, 0.4, 0.8, 1.6), strict=True))
        assert took[3] > took[0]
        # an unknown login is throttled the same way (nothing tells who exists)
        start = time.monotonic()
        c, reply = _login(th.port, "nobody", "wrong")
        assert reply.errors()[0]["C"] == "28P01" and time.monotonic() - start >= 1.6
        c.close()
        # while a failure waits its 1.6 s (on the event loop, holding no thread), another
        # analyst logs in and is answered first
        order: list[str] = []

        def fail() -> None:
            c, _ = _login(th.port, "mallory", "wrong")
            order.append("failure answered")
            c.close()

        thread = threading.Thread(target=fail)
        thread.start()
        server = th.server
        assert server is not None
        assert _until(lambda: server.throttle.failures("127.0.0.1", "mallory") >= 1)
        c, reply = _login(th.port, "bob")
        assert reply.status == "I" and not c.query(QUERY).errors()
        order.append("bob served")
        thread.join(30)
        assert order == ["bob served", "failure answered"]
        c.close()
        # a correct password is not delayed, and clears the login's count
        c, reply = _login(th.port, "alice")
        assert reply.status == "I"
        assert server.throttle.failures("::1", "alice") == 0
        c.close()


# --------------------------------------------------------------------------------------------
# "too many clients" after the SSL negotiation (libpq's default sslmode=prefer)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    root = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(root / "server.key"), "-out", str(root / "server.crt"),
         "-days", "2", "-subj", "/CN=localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return root / "server.crt", root / "server.key"


def _psycopg_error(port: int, sslmode: str, user: str = "bob") -> str:
    psycopg = pytest.importorskip("psycopg")
    try:
        conn = psycopg.connect(
            host="127.0.0.1",
            port=port,
            user=user,
            password=PASSWORD,
            dbname="visits",
            sslmode=sslmode,
            connect_timeout=20,
        )
    except psycopg.OperationalError as exc:
        return str(exc)
    conn.close()
    return ""


@pytest.mark.parametrize("tls", [False, True], ids=["no-tls", "tls"])
def test_too_many_clients_is_seen_with_sslmode_prefer(service, policy_path, tls_files, tls):
    from dpsql.server.server import tls_context

    if tls and tls_files is None:
        pytest.skip("openssl is needed for a certificate")
    users = UserStore(users_path(policy_path))
    ctx = tls_context(str(tls_files[0]), str(tls_files[1])) if tls else None
    with ServerThread(lambda: Server(service, users, ssl_context=ctx, max_connections=1)) as th:
        first, reply = _login(th.port, "alice")
        assert reply.status == "I"
        message = _psycopg_error(th.port, "prefer")
        assert "sorry, too many clients already" in message, message
        if tls:  # and inside TLS for clients that require it
            message = _psycopg_error(th.port, "require")
            assert "sorry, too many clients already" in message, message
        first.close()
        server = th.server
        assert server is not None
        assert _until(lambda: not server.sessions)
        assert _psycopg_error(th.port, "prefer") == ""


def test_workers_refuse_after_negotiation_and_count_addresses(policy_path, tls_files):
    """The ``--workers`` supervisor: too many clients and the per-address limit, server-wide,
    answered after the SSL negotiation."""
    pytest.importorskip("psycopg")
    extra = ["--max-connections", "3", "--max-connections-per-address", "2"]
    if tls_files is not None:
        extra += ["--tls-cert", str(tls_files[0]), "--tls-key", str(tls_files[1])]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpsql", "serve", "--policy", str(policy_path), "--port", "0",
         "--workers", "2", "--no-cache", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "serving" in line, line
        port = int(line.rsplit(":", 1)[1])
        held = []
        for user in ("alice", "bob"):
            c, reply = _login(port, user)
            assert reply.status == "I", reply.errors()
            held.append(c)
        message = _psycopg_error(port, "prefer", "mallory")
        assert "too many connections from address 127.0.0.1" in message, message
        for c in held:
            c.close()
        assert _until(lambda: _psycopg_error(port, "prefer") == "", timeout=20)
    finally:
        proc.terminate()
        proc.wait(30)


# --------------------------------------------------------------------------------------------
# load test: one analyst floods, another connects and queries


def _connect_and_query(port: int, user: str = "bob") -> float:
    start = time.perf_counter()
    c, reply = _login(port, user)
    assert reply.status == "I", reply.errors()
    assert not c.query(QUERY).errors()
    c.close()
    return time.perf_counter() - start


class Flood:
    """``mallory`` floods: ``logins`` threads looping valid logins that hold their connection
    (until refused), ``failures`` threads looping wrong passwords, ``idle`` threads opening
    sockets that send nothing. Every loop ends when ``stop`` is set; counts are kept."""

    def __init__(self, port: int, *, logins: int = 8, failures: int = 8, idle: int = 16):
        self.port = port
        self.stop = threading.Event()
        self.counts = {"held": 0, "refused": 0, "failed": 0, "idle": 0}
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=fn, daemon=True)
            for fn, n in ((self._logins, logins), (self._failures, failures), (self._idle, idle))
            for _ in range(n)
        ]

    def _count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def _logins(self) -> None:
        held = []
        while not self.stop.is_set():
            try:
                c, reply = _login(self.port, "mallory", timeout=10)
            except OSError:
                continue
            if reply.status == "I":
                held.append(c)
                self._count("held")
            else:
                self._count("refused")
                c.sock.close()
                self.stop.wait(0.05)
        for c in held:
            c.sock.close()

    def _failures(self) -> None:
        while not self.stop.is_set():
            try:
                c, reply = _login(self.port, "mallory", "wrong", timeout=10)
                c.sock.close()
            except OSError:
                continue
            if reply.errors() and reply.errors()[0]["C"] == "28P01":
                self._count("failed")

    def _idle(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
                    self._count("idle")
                    s.settimeout(0.2)
                    while not self.stop.is_set():  # until the server's auth timeout closes it
                        try:
                            if not s.recv(4096):
                                break
                        except TimeoutError:
                            continue
            except OSError:
                self.stop.wait(0.05)

    def __enter__(self) -> Flood:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def measure(service, policy_path, *, samples: int, warm: float, off: bool = False) -> dict:
    limits = (
        dict(
            max_connections_per_login=1000,
            max_connections_per_address=1000,
            auth_timeout=60.0,
            login_delay=0.0,
            login_delay_max=0.0,
        )
        if off
        else dict(max_connections_per_address=1000, auth_timeout=1.0)
    )
    # all clients share 127.0.0.1: the per-address limit is raised so the others are exercised
    with _serve(service, policy_path, **limits) as th:
        for _ in range(3):
            _connect_and_query(th.port)  # warm
        alone = [_connect_and_query(th.port) for _ in range(samples)]
        with Flood(th.port) as flood:
            flood_start = time.monotonic()
            time.sleep(warm)
            start_counts = dict(flood.counts)
            start = time.monotonic()
            loaded = []
            refused = 0
            for _ in range(samples):
                try:
                    loaded.append(_connect_and_query(th.port))
                except AssertionError:
                    refused += 1
            elapsed = time.monotonic() - start
            counts = {k: flood.counts[k] - start_counts[k] for k in flood.counts}
            flood_seconds = time.monotonic() - flood_start
        totals = dict(flood.counts)
    return {
        "totals": totals,
        "flood_seconds": flood_seconds,
        "alone": alone,
        "loaded": loaded,
        "refused": refused,
        "elapsed": elapsed,
        "counts": counts,
    }


def test_one_analysts_flood_does_not_lock_out_another(service, policy_path):
    result = measure(service, policy_path, samples=10, warm=2.0)
    alone, loaded = result["alone"], result["loaded"]
    assert result["refused"] == 0, result
    # generous: connect + query under the flood within 10 x its median alone + 0.5 s
    bound = 10 * statistics.median(alone) + 0.5
    assert statistics.median(loaded) <= bound, result
    totals = result["totals"]
    assert totals["failed"] > 0 and totals["idle"] > 0 and totals["held"] > 0  # it did run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--warm", type=float, default=5.0)
    parser.add_argument("--off", action="store_true", help="limits, timeout, throttling off")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        policy = _make_policy(Path(tmp))
        service = dpsql.Service(policy, cache=False)
        try:
            r = measure(service, policy, samples=args.samples, warm=args.warm, off=args.off)
        finally:
            service.close()

    def line(name: str, xs: list[float]) -> str:
        xs = sorted(xs)
        if not xs:
            return f"{name}: none"
        p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        return (
            f"{name:<16} median {1000 * statistics.median(xs):8.1f} ms  p90 {1000 * p90:8.1f} ms"
            f"  max {1000 * xs[-1]:8.1f} ms"
        )

    print(line("B alone", r["alone"]))
    print(line("B under flood", r["loaded"]) + f"  ({r['refused']} refused)")
    if r["alone"] and r["loaded"]:
        ratio = statistics.median(r["loaded"]) / statistics.median(r["alone"])
        print(f"ratio of medians {ratio:.1f}")
    seconds = r["elapsed"]
    c = r["counts"]
    print(
        f"A during sampling ({seconds:.1f} s): {c['failed'] / seconds:.1f} failed logins/s, "
        f"{c['held']} held logins, {c['refused']} refused, {c['idle']} idle sockets opened"
    )
    t, seconds = r["totals"], r["flood_seconds"]
    print(
        f"A in all ({seconds:.1f} s): {t['failed'] / seconds:.1f} failed logins/s, "
        f"{t['held']} held logins, {t['refused']} refused, {t['idle']} idle sockets opened"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
