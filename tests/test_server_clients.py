"""End to end: real clients (psql, psycopg 3, JDBC, SQLAlchemy + pandas) against the real
pipeline on a copy of the shipped fixture. Each client test is skipped, with the reason, only when
its client is not installed (.ci/run installs postgresql-client, libpostgresql-jdbc-java and a JRE).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import dpsql
from dpsql.server.server import Server, ServerThread, tls_context
from dpsql.server.testing import RawClient
from dpsql.server.users import UserStore, users_path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
JDBC_JARS = [Path("/usr/share/java/postgresql.jar"), Path("/usr/share/java/postgresql-jdbc4.jar")]
PASSWORD = "correct horse"
# 1/128: a dyadic epsilon, so sums of charges are exact in any order (no float rounding).
SOAK_EPSILON = 0.0078125

psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is not installed")


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory) -> Path:
    """A private copy of the fixture, so the ledger and users file live in a temp dir."""
    root = tmp_path_factory.mktemp("fixture")
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(FIXTURES / name, root / name)
    users = UserStore(users_path(root / "visits.toml"))
    for name in ("alice", "bob", "carol", "soak", "spender", "describer", "tls", "jdbc"):
        users.add(name, PASSWORD)
    return root / "visits.toml"


@pytest.fixture(scope="module")
def server(policy_path):
    service = dpsql.Service(policy_path, cache=False)
    thread = ServerThread(lambda: Server(service, UserStore(users_path(policy_path))))
    thread.start()
    thread.service = service  # type: ignore[attr-defined]
    yield thread
    thread.stop()
    service.close()


def _dsn(server, user: str = "alice", **extra: str) -> str:
    parts = {
        "host": "127.0.0.1",
        "port": str(server.port),
        "user": user,
        "password": PASSWORD,
        "dbname": "visits",
        **extra,
    }
    return psycopg.conninfo.make_conninfo(**parts)


def _spent(server, analyst: str):
    service = server.service
    return service.ledger.spent(analyst, service.policy.dataset)


# --------------------------------------------------------------------------------------------
# psql


def _psql(server, *commands: str, user: str = "alice") -> subprocess.CompletedProcess:
    psql = shutil.which("psql")
    if psql is None:
        pytest.skip("psql not installed (apt-get install postgresql-client)")
    args = [psql, "-h", "127.0.0.1", "-p", str(server.port), "-U", user, "-d", "visits", "-X"]
    for command in commands:
        args += ["-c", command]
    env = {**os.environ, "PGPASSWORD": PASSWORD, "PGCONNECT_TIMEOUT": "10"}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.client
def test_psql_dp_query_and_catalog(server):
    out = _psql(
        server,
        "SELECT department, COUNT(*) AS n FROM visits GROUP BY department ORDER BY department",
        r"\dt",
        r"\d visits",
        r"\l",
    )
    assert out.returncode == 0, out.stderr
    assert "cardiology" in out.stdout and "(6 rows)" in out.stdout
    assert re.search(r"public\s*\|\s*visits\s*\|\s*table", out.stdout)
    assert re.search(r"patient_id\s*\|\s*bigint", out.stdout)
    assert re.search(r"cost\s*\|\s*double precision", out.stdout)
    assert re.search(r"visit_date\s*\|\s*date", out.stdout)
    assert "charged epsilon=" in out.stderr  # the NOTICE with the cost


@pytest.mark.client
def test_psql_refusal_shows_sqlstate(server):
    out = _psql(server, r"\set VERBOSITY verbose", "SELECT * FROM visits LIMIT 100")
    assert "ERROR:  42501:" in out.stderr
    assert "HINT:" in out.stderr
    assert "LINE 1:" in out.stderr


@pytest.mark.client
def test_psql_wrong_password(server):
    psql = shutil.which("psql")
    if psql is None:
        pytest.skip("psql not installed (apt-get install postgresql-client)")
    env = {**os.environ, "PGPASSWORD": "nope"}
    out = subprocess.run(
        [psql, "-h", "127.0.0.1", "-p", str(server.port), "-U", "alice", "-d", "visits",
         "-c", "SELECT COUNT(*) FROM visits"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert 'password authentication failed for user "alice"' in out.stderr


# --------------------------------------------------------------------------------------------
# psycopg 3


def test_psycopg_simple_params_prepared_binary(server):
    with psycopg.connect(_dsn(server)) as conn:
        (n,) = conn.execute("SELECT COUNT(*) FROM visits").fetchone()
        assert isinstance(n, int) and 10_000 < n < 30_000
        rows = conn.execute(
            "SELECT department, COUNT(*) FROM visits WHERE age >= %s GROUP BY department",
            [40],
        ).fetchall()
        assert {r[0] for r in rows} >= {"cardiology", "oncology"}
        for _ in range(3):  # prepared server-side after the first run (prepare=True)
            cur = conn.execute("SELECT AVG(cost) FROM visits WHERE age < %s", [60], prepare=True)
            (avg,) = cur.fetchone()
            assert 0.0 <= avg <= 5000.0
        cur = conn.cursor(binary=True)
        cur.execute("SELECT smoker, COUNT(*) AS n, SUM(age) FROM visits GROUP BY smoker")
        got = {row[0]: row[1:] for row in cur.fetchall()}
        assert set(got) == {True, False}
        assert all(isinstance(v[0], int) for v in got.values())
        assert [d.type_code for d in cur.description] == [16, 20, 20]
        assert conn.execute("SELECT current_user, current_database()").fetchone() == (
            "alice",
            "visits",
        )


def test_psycopg_catalog_and_session(server):
    with psycopg.connect(_dsn(server)) as conn:
        tables = conn.execute(
            "SELECT table_schema, table_name FROM information_schema.tables "
            "WHERE table_schema = 'public'"
        ).fetchall()
        assert tables == [("public", "visits")]
        cols = conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = 'visits' ORDER BY ordinal_position"
        ).fetchall()
        assert cols[0] == ("patient_id", "bigint") and ("visit_date", "date") in cols
        assert conn.execute("SHOW server_version").fetchone()[0].startswith("16")
        conn.execute("SET application_name = 'dashboard'")
        assert conn.info.parameter_status("application_name") == "dashboard"
        assert conn.execute("SELECT count(*) FROM pg_catalog.pg_type").fetchone()[0] > 10
        schemata = {
            r[0] for r in conn.execute("SELECT schema_name FROM information_schema.schemata")
        }
        assert "public" in schemata
    assert _spent(server, "alice") is not None


def test_catalog_and_describe_spend_nothing(server):
    before = _spent(server, "describer")
    c = RawClient("127.0.0.1", server.port)
    assert c.login("describer", PASSWORD).status == "I"
    c.parse("SELECT department, AVG(age) AS a FROM visits WHERE age > $1 GROUP BY department")
    c.describe("S")
    reply = c.sync()
    assert [name for name, _, _ in reply.columns()] == ["department", "a"]
    assert [oid for _, oid, _ in reply.columns()] == [25, 701]
    c.bind([b"30"])
    c.describe("P")
    reply = c.sync()
    assert [oid for _, oid, _ in reply.columns()] == [25, 701]
    c.query(r"SELECT * FROM pg_catalog.pg_class; SELECT * FROM information_schema.columns")
    c.close()
    assert _spent(server, "describer") == before


def test_zero_row_probes_describe_without_spending(server):
    """BI tools learn columns with LIMIT 0 / WHERE 1 = 0: answered, and nothing is spent."""
    with psycopg.connect(_dsn(server, "describer")) as conn:
        before = _spent(server, "describer")
        cur = conn.execute("SELECT * FROM visits LIMIT 0")
        assert [d.name for d in cur.description][:3] == ["patient_id", "age", "department"]
        assert [d.type_code for d in cur.description][:2] == [20, 20] and cur.fetchall() == []
        cur = conn.execute("SELECT department, AVG(cost) AS c FROM visits GROUP BY 1 LIMIT 0")
        assert [(d.name, d.type_code) for d in cur.description] == [("department", 25), ("c", 701)]
        assert conn.execute("SELECT age FROM visits WHERE 1 = 0").fetchall() == []
        assert _spent(server, "describer") == before


def test_a_column_probe_gets_columns_no_rows_and_a_notice(server):
    """Superset reads a virtual dataset's columns with SELECT * ... LIMIT 1: columns, no row,
    a NOTICE that rows are never released, nothing spent (LIMIT 100 stays a refusal)."""
    with psycopg.connect(_dsn(server, "describer")) as conn:
        notices: list[str] = []
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        before = _spent(server, "describer")
        cur = conn.execute("SELECT * FROM (SELECT * FROM visits WHERE age > 30) AS v LIMIT 1")
        assert [d.name for d in cur.description][:2] == ["patient_id", "age"]
        assert cur.fetchall() == []
        assert any("never releases rows" in n for n in notices)
        assert _spent(server, "describer") == before


def test_budget_exhaustion_is_53400(server):
    with psycopg.connect(_dsn(server, "spender"), autocommit=True) as conn:
        conn.execute("SET epsilon = 6")
        conn.execute("SELECT COUNT(*) FROM visits")
        with pytest.raises(psycopg.errors.lookup("53400")):
            conn.execute("SELECT COUNT(*) FROM visits WHERE age > 10")
        conn.execute("SET epsilon = 0.5")
        conn.execute("SELECT COUNT(*) FROM visits WHERE age > 20")


def test_bi_tool_row_preview_is_refused_clearly(server):
    with psycopg.connect(_dsn(server, "bob")) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as info:
            conn.execute("SELECT * FROM visits LIMIT 100")
        assert info.value.diag.sqlstate == "42501"
        assert info.value.diag.message_hint
        assert _spent(server, "bob").is_zero


def test_syntax_and_unknown_table_errors(server):
    with psycopg.connect(_dsn(server, "bob"), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.lookup("42703")):
            conn.execute("SELECT COUNT(*) FROM visits WHERE nope = 1")
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT COUNT(*) FROM visits WHERE")
        assert info.value.diag.sqlstate == "42601"
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT COUNT(*) FROM nonexistent_table")
        assert info.value.diag.sqlstate == "42P01"


def test_soak_ledger_equals_reported_charges(server):
    """200 mixed queries over 4 connections; the ledger total equals the NOTICE charges."""
    queries = [
        "SELECT COUNT(*) FROM visits WHERE age > {i}",
        "SELECT department, COUNT(*) FROM visits WHERE age >= {i} GROUP BY department",
        "SELECT AVG(cost) FROM visits WHERE age < {j}",
        "SELECT SUM(age) FROM visits WHERE smoker AND age > {i}",
        "SELECT * FROM visits WHERE age = {i}",  # refused: costs nothing
        "SELECT relname FROM pg_catalog.pg_class WHERE relname = 'visits'",  # catalog: free
    ]
    charged: list[float] = []
    lock = threading.Lock()

    def work(worker: int) -> int:
        def on_notice(diag) -> None:
            m = re.search(r"charged epsilon=([0-9.e+-]+)", diag.message_primary or "")
            if m:
                with lock:
                    charged.append(float(m.group(1)))

        done = 0
        with psycopg.connect(_dsn(server, "soak"), autocommit=True) as conn:
            conn.add_notice_handler(on_notice)
            conn.execute(f"SET epsilon = {SOAK_EPSILON}")
            for k in range(50):
                sql = queries[(worker + k) % len(queries)].format(i=k % 90, j=10 + k % 90)
                # refused (free): the SELECT * probe; and, when the four connections' catalog
                # statements meet in the server's small catalog queue, a catalog statement
                # (53200, free too): neither changes what the ledger must equal
                refused = (psycopg.errors.InsufficientPrivilege,)
                if "pg_catalog" in sql:
                    refused += (psycopg.errors.InsufficientResources,)
                with contextlib.suppress(*refused):
                    conn.execute(sql).fetchall()
                done += 1
        return done

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(work, range(4))) == 200
    spent = _spent(server, "soak")
    assert len(charged) > 100
    # Every charge is a dyadic fraction, so both sums are exact: equality, not tolerance.
    assert spent.epsilon == sum(charged)


# --------------------------------------------------------------------------------------------
# SQLAlchemy + pandas


def test_sqlalchemy_inspector_and_pandas(server):
    sa = pytest.importorskip("sqlalchemy", reason="SQLAlchemy is not installed")
    pd = pytest.importorskip("pandas", reason="pandas is not installed")
    engine = sa.create_engine(
        f"postgresql+psycopg://carol:{PASSWORD.replace(' ', '%20')}@127.0.0.1:{server.port}/visits"
    )
    try:
        inspector = sa.inspect(engine)
        assert inspector.get_table_names() == ["visits"]
        columns = {c["name"]: c for c in inspector.get_columns("visits")}
        assert isinstance(columns["age"]["type"], sa.BigInteger)
        assert isinstance(columns["visit_date"]["type"], sa.Date)
        assert columns["cost"]["nullable"] and not columns["age"]["nullable"]
        assert inspector.get_pk_constraint("visits")["constrained_columns"] == []
        assert inspector.get_indexes("visits") == []
        assert inspector.has_table("visits") and not inspector.has_table("nope")
        assert inspector.get_view_names() == [] and inspector.get_foreign_keys("visits") == []
        assert inspector.get_unique_constraints("visits") == []
        assert inspector.get_check_constraints("visits") == []
        table = sa.Table("visits", sa.MetaData(), autoload_with=engine)
        with engine.connect() as conn:
            frame = pd.read_sql(
                "SELECT department, AVG(age) AS mean_age FROM visits GROUP BY department", conn
            )
            assert list(frame.columns) == ["department", "mean_age"]
            assert len(frame) == 6 and frame["mean_age"].between(0, 100).all()
            frame = pd.read_sql(
                sa.text("SELECT COUNT(*) AS n FROM visits WHERE visit_date >= :d"),
                conn,
                params={"d": dt.date(2024, 6, 1)},
            )
            assert frame["n"].iloc[0] >= 0
            query = sa.select(sa.func.count()).select_from(table).where(table.c.age > 40)
            assert conn.execute(query).scalar() > 0
    finally:
        engine.dispose()


# --------------------------------------------------------------------------------------------
# JDBC


@pytest.mark.client
def test_jdbc_metadata_and_dp_query(server):
    java = shutil.which("java")
    jar = next((j for j in JDBC_JARS if j.exists()), None)
    # `java File.java` (single-file source launch) needs the JDK's compiler module
    if java is None or shutil.which("javac") is None or jar is None:
        pytest.skip("a JDK or the PostgreSQL JDBC driver is missing "
                    "(apt-get install default-jdk-headless libpostgresql-jdbc-java)")  # fmt: skip
    source = Path(__file__).parent / "java" / "JdbcSmoke.java"
    url = f"jdbc:postgresql://127.0.0.1:{server.port}/visits"
    out = subprocess.run(
        [java, "-cp", str(jar), str(source), url, "jdbc", PASSWORD],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "TABLE public.visits TABLE" in lines
    assert "COLUMN age int8 -5 NO" in lines
    assert "COLUMN visit_date date 91 NO" in lines
    assert "COLUMN cost float8 8 YES" in lines
    assert sum(1 for line in lines if line.startswith("DP ")) == 6
    assert any(line.startswith("PREPARED int8 ") for line in lines)
    assert "BROWSE schemas=3 catalogs=1 tables=1 pk=0 fk=0 idx=0 types=true procs=0" in lines
    assert "REPEATED 14" in lines
    assert "REFUSAL 42501" in lines
    assert lines[-1] == "DONE"


# --------------------------------------------------------------------------------------------
# TLS


def _self_signed_with_cryptography(root: Path) -> None:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    (root / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (root / "server.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _self_signed_with_openssl(root: Path, openssl: str) -> None:
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(root / "server.key"), "-out", str(root / "server.crt"),
         "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-addext", "basicConstraints=critical,CA:TRUE"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate for localhost / 127.0.0.1 (cryptography, else openssl)."""
    root = tmp_path_factory.mktemp("tls")
    try:
        _self_signed_with_cryptography(root)
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("neither the cryptography package nor the openssl command is available")
        _self_signed_with_openssl(root, openssl)
    return root / "server.crt", root / "server.key"


@pytest.fixture(scope="module")
def tls_server(server, policy_path, tls_files):
    cert, key = tls_files
    thread = ServerThread(
        lambda: Server(
            server.service,
            UserStore(users_path(policy_path)),
            ssl_context=tls_context(str(cert), str(key)),
            require_tls=True,
        )
    )
    thread.start()
    yield thread
    thread.stop()


def test_tls_require_and_verify_full(tls_server, tls_files):
    cert, _ = tls_files
    for extra in (
        {"sslmode": "require"},
        {"sslmode": "verify-full", "sslrootcert": str(cert), "host": "localhost"},
    ):
        with psycopg.connect(_dsn(tls_server, "tls", **extra)) as conn:
            assert conn.pgconn.ssl_in_use
            (n,) = conn.execute("SELECT COUNT(*) FROM visits WHERE age > 50").fetchone()
            assert n > 0
    with pytest.raises(psycopg.OperationalError, match="requires TLS"):
        psycopg.connect(_dsn(tls_server, "tls", sslmode="disable"))
    # SCRAM-SHA-256-PLUS is not offered: a client that requires channel binding stops
    with pytest.raises(psycopg.OperationalError, match="channel binding"):
        psycopg.connect(_dsn(tls_server, "tls", sslmode="require", channel_binding="require"))
