"""``dpsql serve --workers 2``: one port, two worker processes, one ledger.

The real CLI is started as a subprocess on a free port (a copy of the shipped fixture, answer
cache off), driven with the protocol-level RawClient (and psycopg for a TLS cancel). A backend
pid names its worker (pid >> 20 is worker index + 1), which is how the tests see where each
connection landed.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpsql.policy import load_policy
from dpsql.privacy.accounting import Budget
from dpsql.privacy.sqlite_ledger import SQLiteLedger
from dpsql.server import protocol as p
from dpsql.server.probes import may_be_probe, parsed_probe
from dpsql.server.testing import RawClient, cancel_request, cancel_until_answered
from dpsql.server.users import UserStore, users_path
from dpsql.server.worker import owner, pid_range

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "correct horse"
EPS = 0.0078125  # 1/128: dyadic, so sums of charges are exact in any order
LONG_CATALOG_QUERY = "SELECT count(*) FROM range(1000000000000)"
USERS = ("alice", "spender", "racer", "killer", "full", "tls")


class Served:
    """A ``dpsql serve --workers N`` subprocess and its log (stderr, read by a thread)."""

    def __init__(self, policy: Path, workers: int, *extra: str) -> None:
        cmd = [sys.executable, "-m", "dpsql", "serve", "--policy", str(policy), "--port", "0",
               "--workers", str(workers), *extra]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
        )
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r":(\d+)\s*$", line)
        if not m:
            self.proc.kill()
            raise AssertionError(f"server did not start: {line!r}\n{''.join(self.log)}")
        self.port = int(m.group(1))
        self.wait_log(r"worker \d+ ready", count=workers)

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def ready_workers(self) -> dict[int, int]:
        """Worker index -> OS pid of its latest process, from the supervisor's log."""
        out = {}
        for line in list(self.log):
            m = re.search(r"worker (\d+) ready \(pid (\d+)\)", line)
            if m:
                out[int(m.group(1))] = int(m.group(2))
        return out

    def wait_log(self, pattern: str, count: int = 1, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while sum(bool(re.search(pattern, line)) for line in list(self.log)) < count:
            assert time.monotonic() < deadline, f"no {pattern!r} in the log:\n{''.join(self.log)}"
            time.sleep(0.05)

    def client(self, user: str = "alice") -> RawClient:
        for _ in range(100):  # 53300 until the connections of a previous test have ended
            c = RawClient("127.0.0.1", self.port)
            reply = c.login(user, PASSWORD)
            if reply.status == "I" or reply.errors()[0]["C"] != "53300":
                break
            c.sock.close()
            time.sleep(0.05)
        assert reply.status == "I", reply.errors()
        return c

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for a parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _wait_gone(pids, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _worker_of(c: RawClient) -> int | None:
    return owner(c.pid)


def _clients_on_both(served: Served, user: str, n: int = 2) -> list[RawClient]:
    """n connections spread over both workers (least connections puts them alternately)."""
    seen = []
    for _ in range(50):  # connections of earlier tests end asynchronously: retry until balanced
        clients = [served.client(user) for _ in range(n)]
        seen.append([_worker_of(c) for c in clients])
        if set(seen[-1]) == {0, 1}:
            return clients
        for c in clients:
            c.close()
        time.sleep(0.1)
    raise AssertionError(f"connections were not spread over both workers: {seen}")


def _charged(reply) -> float:
    total = 0.0
    for notice in reply.notices():
        m = re.search(r"charged epsilon=([0-9.e+-]+)", notice.get("M", ""))
        if m:
            total += float(m.group(1))
    return total


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("workers")
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(ROOT / "fixtures" / name, root / name)
    store = UserStore(users_path(root / "visits.toml"))
    for name in USERS:
        store.add(name, PASSWORD)
    return root / "visits.toml"


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


@pytest.fixture(scope="module")
def served(policy_path, tls_files):
    extra = ["--no-cache", "--max-connections", "12"]
    # one login and one address (127.0.0.1) may fill the server here
    extra += ["--max-connections-per-login", "12", "--max-connections-per-address", "12"]
    if tls_files is not None:  # TLS offered, not required: plaintext RawClients still connect
        extra += ["--tls-cert", str(tls_files[0]), "--tls-key", str(tls_files[1])]
    server = Served(policy_path, 2, *extra)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ledger(policy_path):
    policy = load_policy(policy_path)
    assert policy.ledger_path is not None
    led = SQLiteLedger(policy.ledger_path)
    led.dataset = policy.dataset  # type: ignore[attr-defined]
    yield led
    led.close()


def test_pid_ranges_are_disjoint_and_name_their_worker():
    for index in (0, 1, 63):
        first, end = pid_range(index)
        assert owner(first) == owner(end - 1) == index
        assert end <= 2**31
    assert owner(999) is None and owner(pid_range(63)[1]) is None


_LITERALS = ["1", "0", "1.5", ".5", "1e3", "1_000", "'a'", "'b'", "E'a'", "$$a$$", "TRUE", "FALSE"]
_SPACE = st.sampled_from(["", " ", "  ", "\n", "/* c */"])


@st.composite
def _probe_like(draw) -> str:
    def term() -> str:
        left = draw(st.sampled_from([*_LITERALS, "a", "age"]))
        right = draw(st.sampled_from([*_LITERALS, "a", "-1"]))
        op = draw(st.sampled_from(["=", "<>", "!=", "<", ">="]))
        atom = draw(st.sampled_from([f"{left}{draw(_SPACE)}{op}{draw(_SPACE)}{right}", left]))
        return f"({atom})" if draw(st.booleans()) else atom

    sql = f"SELECT {draw(st.sampled_from(['*', 'a', 'COUNT(*)', 'department, COUNT(*)']))}"
    sql += " FROM visits"
    if draw(st.booleans()):
        glue = draw(st.sampled_from([" AND ", " OR ", " and "]))
        sql += " WHERE " + glue.join(term() for _ in range(draw(st.integers(1, 3))))
    if draw(st.booleans()):
        sql += " GROUP BY department"
    if draw(st.booleans()):
        sql += f" LIMIT{draw(_SPACE) or ' '}{draw(st.sampled_from(['0', '1', '00', '0 OFFSET 2']))}"
    return sql.lower() if draw(st.booleans()) else sql


@settings(max_examples=400, deadline=None)
@given(_probe_like())
def test_the_text_filter_never_hides_a_probe(sql):
    """The cheap filter that keeps sqlglot off the event loop for DP queries is a superset."""
    assert may_be_probe(sql) or not parsed_probe(sql)


def test_common_dp_queries_are_not_parsed_on_the_event_loop():
    for sql in [
        "SELECT COUNT(*) FROM visits WHERE age > 30",
        "SELECT department, AVG(cost) FROM visits WHERE smoker GROUP BY department",
        "SELECT SUM(age) FROM visits WHERE age = 40 AND department = 'oncology'",
    ]:
        assert not may_be_probe(sql)


def test_connections_are_served_by_both_worker_processes(served):
    workers = served.ready_workers()
    assert sorted(workers) == [0, 1] and len(set(workers.values())) == 2
    assert all(_parent(pid) == served.proc.pid for pid in workers.values())
    clients = [served.client() for _ in range(4)]
    assert sorted(_worker_of(c) for c in clients) == [0, 0, 1, 1]  # least connections
    for c in clients:
        reply = c.query(f"SET epsilon = {EPS}; SELECT COUNT(*) FROM visits WHERE age > 40")
        assert not reply.errors() and int(reply.text_rows()[0][0]) > 0
        reply = c.query("SELECT relname FROM pg_catalog.pg_class WHERE relname = 'visits'")
        assert reply.text_rows() == [["visits"]]
        c.close()


def _server_first(port: int, user: str) -> str:
    """The SCRAM server-first message (salt, iterations) the server sends for ``user``."""
    c = RawClient("127.0.0.1", port)
    c.startup(user)
    assert c.recv()[0] == b"R"
    first = b"n,,n=,r=abcdefghijklmnop"
    c.send(b"p", p.cstr("SCRAM-SHA-256") + len(first).to_bytes(4, "big") + first)
    kind, body = c.recv()
    assert kind == b"R"
    server_first = body[4:].decode()
    nonce = re.search(r"r=([^,]*)", server_first)
    assert nonce is not None
    c.send(b"p", f"c=biws,r={nonce.group(1)},p={base64.b64encode(bytes(32)).decode()}".encode())
    assert c.until_ready().errors()[0]["C"] == "28P01"  # a wrong proof, as for a real user
    c.sock.close()
    return server_first.replace(nonce.group(0), "")  # the nonce differs per connection


def test_unknown_user_looks_the_same_on_every_worker(served):
    # A fake salt that depended on the worker would tell an unknown user from a real one.
    firsts = {_server_first(served.port, "nobody") for _ in range(4)}
    assert len(firsts) == 1
    served.wait_log(r"worker 0\] login failed for 'nobody'")
    served.wait_log(r"worker 1\] login failed for 'nobody'")


def test_charges_from_both_workers_sum_exactly_in_the_ledger(served, ledger):
    before = ledger.spent("spender", ledger.dataset).epsilon
    clients = _clients_on_both(served, "spender", 6)

    def run(c: RawClient) -> float:
        c.query(f"SET epsilon = {EPS}")
        total = 0.0
        for k in range(5):
            reply = c.query(f"SELECT COUNT(*) FROM visits WHERE age > {k}")
            assert not reply.errors()
            total += _charged(reply)
        c.close()
        return total

    with ThreadPoolExecutor(len(clients)) as pool:
        reported = sum(pool.map(run, clients))
    assert reported == 30 * EPS
    assert ledger.spent("spender", ledger.dataset).epsilon - before == reported
    assert ledger.verify() == []


def test_two_workers_racing_for_the_last_epsilon_only_one_wins(served, ledger):
    a, b = _clients_on_both(served, "racer")
    for c in (a, b):
        c.query(f"SET epsilon = {EPS}")
    query = p.cstr("SELECT COUNT(*) FROM visits WHERE smoker")
    rounds = 4
    for r in range(1, rounds + 1):
        ledger.set_budget("racer", ledger.dataset, Budget(r * EPS, 1e-5))  # room for one more
        a.send(b"Q", query)
        b.send(b"Q", query)
        codes = sorted(e["C"] for c in (a, b) for e in c.until_ready().errors())
        assert codes == ["53400"]  # exactly one of the two was refused: budget exhausted
    assert ledger.spent("racer", ledger.dataset).epsilon == rounds * EPS
    assert ledger.status("racer", ledger.dataset, Budget(1, 0)).charges == rounds
    a.close()
    b.close()


def _cancel_long_query(served: Served, c: RawClient) -> dict[str, str]:
    c.send(b"Q", p.cstr(LONG_CATALOG_QUERY))
    reply = cancel_until_answered(c, "127.0.0.1", served.port)
    assert reply.status == "I"
    return reply.errors()[0]


def test_cancel_request_reaches_the_worker_that_owns_the_session(served):
    a, b = _clients_on_both(served, "alice")
    for c in (b, a):
        # a wrong secret is routed too, and ignored
        cancel_request("127.0.0.1", served.port, c.pid, c.secret + 1)
        assert _cancel_long_query(served, c)["C"] == "57014"
        assert c.query("SELECT 1").text_rows() == [["1"]]
        c.close()


def test_tls_cancel_inside_another_worker_is_forwarded(served, tls_files):
    """libpq >= 17 sends CancelRequest inside TLS; the worker that decrypts it forwards it."""
    psycopg = pytest.importorskip("psycopg")
    if tls_files is None or psycopg.pq.version() < 170000:
        pytest.skip("needs openssl and libpq >= 17 (encrypted cancel requests)")
    dsn = (f"host=127.0.0.1 port={served.port} user=tls password='{PASSWORD}' dbname=visits "
           "sslmode=require")  # fmt: skip
    pins = _clients_on_both(served, "alice")
    with psycopg.connect(dsn) as conn:
        assert conn.pgconn.ssl_in_use
        backend = conn.info.backend_pid
        mine = owner(backend)
        # Leave the other worker idle, so that least connections sends the cancel there.
        for pin in pins:
            if _worker_of(pin) != mine:
                pin.close()
        time.sleep(0.5)
        result: list[BaseException] = []

        def run() -> None:
            try:
                conn.execute(LONG_CATALOG_QUERY)
            except BaseException as exc:
                result.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 20
        while thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
            conn.cancel_safe()
        thread.join(5)
        assert result and isinstance(result[0], psycopg.errors.QueryCanceled)
    for pin in pins:
        pin.close()
    served.wait_log(rf"worker {1 - mine}\] cancel key for pid {backend} forwarded")


def test_max_connections_counts_the_whole_server(served):
    for _ in range(40):  # connections of earlier tests end asynchronously: retry until idle
        held, refused = [], None
        for _ in range(13):
            c = RawClient("127.0.0.1", served.port)
            reply = c.login("full", PASSWORD)
            if reply.status == "I":
                held.append(c)
            else:
                refused = reply.errors()[0]
                break
        if len(held) == 12 or refused is None:
            break
        for c in held:
            c.close()
        time.sleep(0.1)
    assert len(held) == 12 and refused is not None
    assert refused["C"] == "53300"
    assert {_worker_of(c) for c in held} == {0, 1}
    # a cancel request still gets through when the server is full
    assert _cancel_long_query(served, held[0])["C"] == "57014"
    for c in held:
        c.close()


def test_a_killed_worker_loses_its_connections_not_its_charges(served, ledger):
    before = ledger.spent("killer", ledger.dataset).epsilon
    a, b = _clients_on_both(served, "killer")
    victim = _worker_of(b)
    os_pid = served.ready_workers()[victim]
    reported = 0.0
    for c in (a, b):
        c.query(f"SET epsilon = {EPS}")
        for k in range(3):
            reported += _charged(c.query(f"SELECT COUNT(*) FROM visits WHERE age > {k}"))
    b.send(b"Q", p.cstr("SELECT COUNT(*) FROM visits WHERE age > 50"))
    os.kill(os_pid, signal.SIGKILL)  # in the middle of (or just after) a charged query
    lost = b.until_ready()
    reported += _charged(lost)
    assert b.closed_by_server()
    reply = a.query("SELECT COUNT(*) FROM visits WHERE age > 60")  # the other worker serves on
    assert not reply.errors()
    reported += _charged(reply)
    served.wait_log(rf"worker {victim} \(pid {os_pid}\) exited with SIGKILL")
    served.wait_log(rf"worker {victim} ready", count=2)
    assert _wait_gone([os_pid])  # reaped
    clients = _clients_on_both(served, "killer")  # the restarted worker serves again
    for c in [*clients, a]:
        c.close()
    spent = ledger.spent("killer", ledger.dataset).epsilon - before
    # the in-flight query was either committed before the kill or not at all; never twice
    assert spent in (reported, reported + EPS)
    assert ledger.verify() == []


def test_sigterm_stops_every_worker(served):
    workers = list(served.ready_workers().values())
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(30) == 0
    assert _wait_gone(workers)


@pytest.fixture(scope="module")
def cached(policy_path):
    """Two workers with the answer cache on (the policy's default)."""
    server = Served(policy_path, 2)
    yield server
    server.stop()


def test_the_answer_cache_is_shared_by_the_workers(cached):
    # A re-run on another worker must return the released answer, not a fresh noise draw that
    # could be averaged with it.
    a, b = _clients_on_both(cached, "alice")
    sql = "SELECT COUNT(*) FROM visits WHERE age BETWEEN 20 AND 29"
    first = a.query(sql)
    again = b.query(sql)
    assert first.text_rows() == again.text_rows()
    assert _charged(first) > 0 and _charged(again) == 0
    # (the bias NOTICE, docs/bias.md, comes before the charge's)
    assert any("cached answer" in n["M"] for n in again.notices())
    a.close()
    b.close()


def test_workers_do_not_outlive_a_killed_supervisor(cached):
    workers = list(cached.ready_workers().values())
    assert len(workers) == 2
    cached.proc.kill()
    cached.proc.wait()
    assert _wait_gone(workers)


def test_a_worker_that_cannot_start_fails_the_server(policy_path):
    cmd = [sys.executable, "-m", "dpsql", "serve", "--policy", str(policy_path), "--port", "0",
           "--workers", "2", "--database", str(policy_path.parent / "missing.duckdb")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1
    assert "failed to start" in out.stderr and "does not exist" in out.stderr
    pids = [int(pid) for pid in re.findall(r"started \(pid (\d+)\)", out.stderr)]
    assert len(pids) == 2 and _wait_gone(pids)
