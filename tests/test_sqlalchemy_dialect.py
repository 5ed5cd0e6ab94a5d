"""SQLAlchemy in process (``dpsql:///policy.toml?analyst=...``) and, over ``dpsql serve``,
SQLAlchemy's bound LIMIT/OFFSET (psycopg 3 sends ``LIMIT $1::INTEGER``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import dpsql
from dpsql.server.backend import inline_limits

sa = pytest.importorskip("sqlalchemy", reason="SQLAlchemy is not installed")
pd = pytest.importorskip("pandas", reason="pandas is not installed")

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "correct horse"


@pytest.fixture
def policy(tmp_path) -> Path:
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(ROOT / "fixtures" / name, tmp_path / name)
    return tmp_path / "visits.toml"


@pytest.fixture
def engine(policy):
    engine = sa.create_engine(f"dpsql:///{policy}?analyst=alice")
    yield engine
    engine.dispose()


def _spent(policy: Path, analyst: str) -> float:
    with dpsql.connect(policy=policy, analyst=analyst) as conn:
        cur = conn.cursor()
        cur.execute("SHOW budget")
        return cur.fetchone()[1]


def test_url_entry_point_and_inspect(engine):
    assert engine.dialect.name == "dpsql"
    inspector = sa.inspect(engine)
    assert inspector.get_table_names() == ["visits"]
    assert inspector.has_table("visits") and not inspector.has_table("nope")
    columns = {c["name"]: c for c in inspector.get_columns("visits")}
    assert isinstance(columns["age"]["type"], sa.BigInteger)
    assert isinstance(columns["visit_date"]["type"], sa.Date)
    assert isinstance(columns["smoker"]["type"], sa.Boolean)
    assert not columns["age"]["nullable"] and columns["cost"]["nullable"]
    assert inspector.get_pk_constraint("visits")["constrained_columns"] == []
    assert inspector.get_foreign_keys("visits") == [] and inspector.get_indexes("visits") == []
    with pytest.raises(sa.exc.NoSuchTableError):
        inspector.get_columns("nope")


def test_core_select_limit_and_pandas(engine, policy):
    table = sa.Table("visits", sa.MetaData(), autoload_with=engine)
    query = (
        sa.select(table.c.department, sa.func.count().label("n"))
        .where(table.c.age >= 18)
        .group_by(table.c.department)
        .order_by(table.c.department)
    )
    with engine.connect() as conn:
        everything = conn.execute(query).fetchall()
        assert len(everything) == 6
        # The bound LIMIT/OFFSET land where they stand (not in WHERE age >= ...).
        page = conn.execute(query.limit(3).offset(1)).fetchall()
        assert page == everything[1:4]
        assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() > 0
        frame = pd.read_sql(
            "SELECT department, AVG(age) AS mean_age FROM visits GROUP BY department", conn
        )
        assert list(frame.columns) == ["department", "mean_age"] and len(frame) == 6
        frame = pd.read_sql(
            sa.text("SELECT COUNT(*) AS n FROM visits WHERE age > :a"), conn, params={"a": 30}
        )
        assert frame["n"].iloc[0] > 0
    frame = pd.read_sql("SELECT COUNT(*) AS n FROM visits", engine)  # an Engine works too
    assert list(frame.columns) == ["n"]
    # Charged to alice, the URL's analyst: four distinct aggregations (the LIMIT page and the
    # second COUNT(*) replay cached answers for free).
    assert _spent(policy, "alice") == 4.0


def test_refusals_keep_their_sqlstate(engine):
    with engine.connect() as conn, pytest.raises(sa.exc.ProgrammingError) as info:
        conn.execute(sa.text("SELECT age FROM visits"))
    assert info.value.orig.sqlstate == "42501"


def test_url_errors_and_the_analysts_list(policy, tmp_path):
    with pytest.raises(dpsql.InterfaceError, match="unknown dpsql URL option"):
        sa.create_engine(f"dpsql:///{policy}?user=alice").connect()
    text = policy.read_text().replace("[privacy]\n", '[privacy]\nanalysts = ["alice"]\n', 1)
    policy.write_text(text)
    engine = sa.create_engine(f"dpsql:///{policy}?analyst=mallory")
    try:
        with pytest.raises(sa.exc.DBAPIError, match="not in the policy's analysts list"):
            engine.connect()
    finally:
        engine.dispose()


# -- over the server ----------------------------------------------------------------------------


def test_inline_limits():
    assert inline_limits("SELECT a FROM t LIMIT $1::INTEGER OFFSET $2", [5, "3"]) == (
        "SELECT a FROM t LIMIT 5 OFFSET 3"
    )
    assert inline_limits("SELECT 1 WHERE x = $1 LIMIT CAST($2 AS INTEGER)", ["a", 7]) == (
        "SELECT 1 WHERE x = $1 LIMIT 7"
    )
    assert inline_limits("SELECT a FROM t LIMIT $1::INTEGER", None).strip() == "SELECT a FROM t"
    assert inline_limits("SELECT a FROM t LIMIT $1", [None]).strip() == "SELECT a FROM t"
    # Quoted text is left alone; a negative or non-integer count is left for the binder.
    assert inline_limits("SELECT 'LIMIT $1' LIMIT $1", [-1]) == "SELECT 'LIMIT $1' LIMIT $1"
    assert inline_limits("SELECT a LIMIT $1", [2.5]) == "SELECT a LIMIT $1"


@pytest.fixture
def server(policy):
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
    from dpsql.server.server import Server, ServerThread
    from dpsql.server.users import UserStore, users_path

    UserStore(users_path(policy)).add("alice", PASSWORD)
    service = dpsql.Service(policy)
    thread = ServerThread(lambda: Server(service, UserStore(users_path(policy))))
    thread.start()
    yield thread
    thread.stop()
    service.close()


def test_server_sqlalchemy_limit_and_budget_notices(server):
    import psycopg

    url = f"postgresql+psycopg://alice:{PASSWORD.replace(' ', '%20')}@127.0.0.1:{server.port}/v"
    engine = sa.create_engine(url)
    try:
        table = sa.Table("visits", sa.MetaData(), autoload_with=engine)
        query = (
            sa.select(table.c.department, sa.func.count().label("n"))
            .group_by(table.c.department)
            .order_by(table.c.department)
        )
        with engine.connect() as conn:
            rows = conn.execute(query).fetchall()
            assert conn.execute(query.limit(2).offset(1)).fetchall() == rows[1:3]
            assert len(pd.read_sql(query.limit(4), conn)) == 4
    finally:
        engine.dispose()
    notices: list[str] = []
    dsn = f"host=127.0.0.1 port={server.port} user=alice password='{PASSWORD}' dbname=v"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        shown = conn.execute("SHOW budget")
        names = [c.name for c in shown.description]
        left = dict(zip(names, shown.fetchone(), strict=True))["remaining_epsilon"]
        conn.execute(f"SET epsilon = {left - 0.5}")
        conn.execute("SELECT AVG(age) FROM visits").fetchall()
        conn.execute("SET confidence = 0.9")
        conn.execute("SHOW confidence").fetchall()
    charged = [n for n in notices if n.startswith("dpsql: charged")]
    assert charged and "remaining epsilon=0.5 of 10" in charged[-1]
    assert any("less than 10% of the privacy budget remains" in n for n in notices)
