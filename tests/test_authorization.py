"""Authorization ([access], allow/deny on tables and columns: dpsql/access.py) at every door:
the DB-API, the CLI, SQLAlchemy and the wire server with two logins. Refusals are free
(nothing read, nothing charged), SQLSTATE 42501, name the table or column and the rule to
change, and say nothing the policy does not; each door's catalog shows only what the analyst
may query."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import dpsql
from dpsql.errors import PolicyError
from dpsql.policy import load_policy

ROOT = Path(__file__).resolve().parents[1]

ACCESS = """
[access]
roles = { clinicians = ["alice", "bob"] }
"""

RULES = {
    "[tables.visits]\n": '[tables.visits]\nallow = ["clinicians", "carol"]\n',
    "[tables.visits.columns.diagnosis]\n": (
        '[tables.visits.columns.diagnosis]\nallow = ["clinicians"]\n'
    ),
    "[tables.visits.columns.cost]\n": '[tables.visits.columns.cost]\ndeny = ["bob"]\n',
}

DEPARTMENTS = """
[tables.departments]
source = "departments.csv"
public = true
primary_key = "name"

[tables.departments.columns.name]
type = "text"

[tables.departments.columns.floor]
type = "int"
lower = 0
upper = 10
"""


def write_policy(directory: Path, *, access: bool = True) -> Path:
    """The shipped fixture plus a public departments table; with ``access``: alice and bob
    (clinicians) read everything but bob not cost, carol reads visits without diagnosis and
    not departments, dave reads nothing."""
    shutil.copy(ROOT / "fixtures" / "visits.csv", directory / "visits.csv")
    (directory / "departments.csv").write_text(
        "name,floor\ncardiology,1\ndermatology,2\nemergency,0\nneurology,3\noncology,4\n"
        "pediatrics,5\n",
        encoding="utf-8",
    )
    text = (ROOT / "fixtures" / "visits.toml").read_text(encoding="utf-8")
    text = text.replace('dataset = "visits"', 'dataset = "visits"\nledger = "budget.sqlite"')
    text += DEPARTMENTS
    if access:
        rules = {
            **RULES,
            'primary_key = "name"\n': 'primary_key = "name"\nallow = ["clinicians"]\n',
        }
        for old, new in rules.items():
            assert old in text
            text = text.replace(old, new)
        text = ACCESS + text
    path = directory / "visits.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    return write_policy(tmp_path_factory.mktemp("authz"))


@pytest.fixture(scope="module")
def service(policy):
    svc = dpsql.Service(policy)
    yield svc
    svc.close()


def _refused(service, analyst: str, sql: str) -> dpsql.Error:
    conn = service.connect(analyst)
    before = service.ledger.spent(analyst, service.policy.dataset)
    with pytest.raises(dpsql.Error) as info:
        conn.cursor().execute(sql)
    assert service.ledger.spent(analyst, service.policy.dataset) == before  # free
    return info.value


# -- the policy ---------------------------------------------------------------------------


def test_policy_reads_roles_and_rules(policy) -> None:
    rules = load_policy(policy).access
    assert rules is not None and rules.roles == {"clinicians": frozenset({"alice", "bob"})}
    assert rules.for_analyst("alice", ["visits", "departments"]) is None  # unrestricted
    carol = rules.for_analyst("carol", ["visits", "departments"])
    assert carol.denied_tables == {"departments"}
    assert carol.denied_columns == {"visits": frozenset({"diagnosis"})}


def test_no_access_rules_means_everyone_reads_everything(tmp_path) -> None:
    assert load_policy(write_policy(tmp_path, access=False)).access is None


def _bad(tmp_path: Path, extra: str, replace: tuple[str, str] | None = None) -> PolicyError:
    path = write_policy(tmp_path)
    text = extra + path.read_text(encoding="utf-8")
    if replace is not None:
        assert replace[0] in text
        text = text.replace(*replace)
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return info.value


@pytest.mark.parametrize(
    ("replace", "key", "words"),
    [
        (('allow = ["clinicians", "carol"]', 'allow = "carol"'), "tables.visits.allow", "list"),
        (('deny = ["bob"]', 'deny = ["bob", 3]'), "tables.visits.columns.cost.deny", "list"),
        (('clinicians = ["alice", "bob"]', 'clinicians = "alice"'), "access.roles.clinicians", ""),
        (("roles =", "rolez ="), "access.rolez", "unknown key"),
        (('clinicians = ["alice", "bob"]', 'clinicians = ["alice"], x = ["clinicians"]'),
         "access.roles.x", "do not nest"),
    ],
)  # fmt: skip
def test_policy_errors_name_the_key_and_the_fix(tmp_path, replace, key, words) -> None:
    err = _bad(tmp_path, "", replace)
    assert err.construct == key and words in err.message and err.hint


def test_names_are_checked_against_declared_analysts(tmp_path) -> None:
    declared = '[privacy]\nanalysts = ["alice", "bob", "carol"]\n'
    path = write_policy(tmp_path)
    text = path.read_text(encoding="utf-8").replace("[privacy]\n", declared)
    path.write_text(text, encoding="utf-8")
    assert load_policy(path).access is not None  # roles and declared analysts: valid
    path.write_text(text.replace('allow = ["clinicians", "carol"]', 'allow = ["clinicans"]'))
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    err = info.value
    assert err.construct == "tables.visits.allow" and "'clinicans'" in err.message
    assert err.hint is not None and "clinicians" in err.hint
    path.write_text(text.replace('["alice", "bob"]', '["alice", "eve"]'))
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.construct == "access.roles.clinicians" and "'eve'" in info.value.message


# -- DB-API ---------------------------------------------------------------------------------


def test_dbapi_allowed_analysts_query_as_before(service) -> None:
    cur = service.connect("alice").cursor()
    cur.execute(
        "SELECT COUNT(*) FROM visits v JOIN departments d ON v.department = d.name "
        "WHERE d.floor > 2 AND v.diagnosis <> 'x'"
    )
    assert cur.fetchone()[0] > 0
    cur = service.connect("carol").cursor()
    cur.execute("SELECT department, AVG(cost) FROM visits GROUP BY department")
    assert len(cur.fetchall()) == 6


@pytest.mark.parametrize(
    ("analyst", "sql", "names", "fix"),
    [
        ("dave", "SELECT COUNT(*) FROM visits", "table visits", "tables.visits.allow"),
        # a bind-time failure is not reached: the refusal says nothing the policy does not
        ("dave", "SELECT COUNT(*) FROM visits WHERE no_such_column > 1", "table visits",
         "tables.visits.allow"),
        ("carol", "SELECT COUNT(*) FROM visits WHERE diagnosis = 'flu'",
         "column diagnosis of table visits", "tables.visits.columns.diagnosis.allow"),
        ("carol", "SELECT COUNT(*) FROM visits GROUP BY v.diagnosis".replace("v.", ""),
         "column diagnosis", "tables.visits.columns.diagnosis.allow"),
        ("carol", "SELECT * FROM departments", "table departments", "tables.departments.allow"),
        ("carol", "SELECT COUNT(*) FROM visits WHERE department IN "
         "(SELECT name FROM departments WHERE floor > 2)", "table departments",
         "tables.departments.allow"),
        ("carol", "SELECT COUNT(*) FROM (SELECT diagnosis AS d FROM visits) s",
         "column diagnosis", "tables.visits.columns.diagnosis.allow"),
        ("carol", "EXPLAIN SELECT COUNT(*) FROM visits WHERE diagnosis = 'x'",
         "column diagnosis", "tables.visits.columns.diagnosis.allow"),
        ("carol", "SELECT COUNT(*) FROM (SELECT * FROM visits) s", "columns of table visits",
         "tables.visits.columns"),
        ("carol", "SELECT * FROM dp_rule_list('visits', label => 'smoker')",
         "columns of table visits", "features"),
        ("carol", "SELECT * FROM dp_rule_list('visits', label => 'smoker', "
         "features => ['age', 'diagnosis'])", "column diagnosis",
         "tables.visits.columns.diagnosis.allow"),
        ("bob", "SELECT SUM(cost) FROM visits", "column cost", "tables.visits.columns.cost.deny"),
    ],
)  # fmt: skip
def test_dbapi_refusals_are_free_and_name_the_fix(service, analyst, sql, names, fix) -> None:
    err = _refused(service, analyst, sql)
    assert err.sqlstate == "42501"
    assert names in err.message and fix in (err.hint or "")
    assert "nothing was spent" in (err.hint or "")
    assert "AccessDenied" not in str(err) and "Error" not in err.message


def test_refusal_points_at_the_reference(service) -> None:
    sql = "SELECT COUNT(*)\nFROM visits\nWHERE diagnosis = 'flu'"
    err = _refused(service, "carol", sql)
    assert err.position is not None and (err.position.line, err.position.column) == (3, 7)


def test_a_cte_named_like_a_denied_table_is_not_the_table(service) -> None:
    cur = service.connect("carol").cursor()
    cur.execute(
        "WITH departments AS (SELECT department FROM visits) SELECT COUNT(*) FROM departments"
    )
    assert cur.fetchone()[0] > 0
    # ... but a CTE body reading the table is the table
    _refused(service, "carol", "WITH d AS (SELECT * FROM departments) SELECT COUNT(*) FROM d")


def test_describe_is_refused_too(service) -> None:
    conn = service.connect("carol")
    with pytest.raises(dpsql.Error) as info:
        conn.describe("SELECT name FROM departments")
    assert info.value.sqlstate == "42501"
    assert [d[0] for d in conn.describe("SELECT COUNT(*) AS n FROM visits")] == ["n"]


def test_connect_with_analyst(policy) -> None:
    with dpsql.connect(policy=policy, analyst="dave") as conn, pytest.raises(dpsql.Error) as info:
        conn.cursor().execute("SELECT COUNT(*) FROM visits")
    assert info.value.sqlstate == "42501"


# -- CLI ----------------------------------------------------------------------------------------


def test_cli_query_with_analyst(policy, capsys) -> None:
    from dpsql.cli import main

    code = main(["query", "--policy", str(policy), "--analyst", "carol",
                 "SELECT COUNT(*) FROM visits WHERE diagnosis = 'flu'"])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "42501" in err and "tables.visits.columns.diagnosis.allow" in err
    code = main(["query", "--policy", str(policy), "--analyst", "carol",
                 "SELECT COUNT(*) AS n FROM visits"])  # fmt: skip
    assert code == 0 and "n" in capsys.readouterr().out


def test_shell_lists_only_what_the_analyst_may_query(service) -> None:
    import io

    from dpsql.shell import describe_tables

    out = io.StringIO()
    describe_tables(service.connect("carol"), None, out)
    assert "visits" in out.getvalue() and "departments" not in out.getvalue()
    out = io.StringIO()
    describe_tables(service.connect("carol"), "visits", out)
    assert "department" in out.getvalue() and "diagnosis" not in out.getvalue()
    out = io.StringIO()
    describe_tables(service.connect("carol"), "departments", out)
    assert "no table" in out.getvalue()


# -- SQLAlchemy ---------------------------------------------------------------------------------


def test_sqlalchemy_reflection_and_refusal(policy) -> None:
    sa = pytest.importorskip("sqlalchemy")
    for analyst, tables in (("alice", ["departments", "visits"]), ("carol", ["visits"])):
        engine = sa.create_engine(f"dpsql:///{policy}?analyst={analyst}")
        try:
            inspector = sa.inspect(engine)
            assert inspector.get_table_names() == tables
            columns = [c["name"] for c in inspector.get_columns("visits")]
            assert ("diagnosis" in columns) == (analyst == "alice")
            if analyst == "carol":
                assert not inspector.has_table("departments")
                with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError) as info:
                    conn.execute(sa.text("SELECT COUNT(*) FROM departments"))
                assert info.value.orig.sqlstate == "42501"
        finally:
            engine.dispose()


# -- the wire server: two logins ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(policy, service):
    pytest.importorskip("psycopg", reason="psycopg 3 is not installed")
    from dpsql.server.server import Server, ServerThread
    from dpsql.server.users import UserStore, users_path

    users = UserStore(users_path(policy))
    for name in ("alice", "carol", "dave"):
        users.add(name, "pw")
    thread = ServerThread(lambda: Server(service, UserStore(users_path(policy))))
    thread.start()
    yield thread
    thread.stop()


def _wire(server, user: str):
    import psycopg

    return psycopg.connect(
        host="127.0.0.1", port=server.port, user=user, password="pw", dbname="visits",
        autocommit=True,
    )  # fmt: skip


def _catalog(conn) -> tuple[list[str], list[str]]:
    tables = [r[0] for r in conn.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' "
        "ORDER BY 1").fetchall()]  # fmt: skip
    columns = [r[0] for r in conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'visits' "
        "ORDER BY 1").fetchall()]  # fmt: skip
    return tables, columns


def test_wire_two_logins_see_and_query_only_their_tables(server, service) -> None:
    import psycopg

    with _wire(server, "alice") as alice, _wire(server, "carol") as carol:
        tables, columns = _catalog(alice)
        assert tables == ["departments", "visits"] and "diagnosis" in columns
        tables, columns = _catalog(carol)
        assert tables == ["visits"] and "diagnosis" not in columns and "cost" in columns
        relnames = [r[0] for r in carol.execute(
            "SELECT relname FROM pg_catalog.pg_class WHERE relkind = 'r' ORDER BY 1")]  # fmt: skip
        assert "departments" not in relnames
        # psql's \d: the table does not exist for carol (nothing beyond what she may query)
        with pytest.raises(psycopg.Error):
            carol.execute("SELECT * FROM departments LIMIT 0").fetchall()
        with pytest.raises(psycopg.Error) as info:
            carol.execute("SELECT COUNT(*) FROM departments WHERE floor > 1").fetchall()
        assert info.value.sqlstate == "42501"
        assert "tables.departments.allow" in (info.value.diag.message_hint or "")
        with pytest.raises(psycopg.Error) as info:
            carol.execute("SELECT COUNT(*) FROM visits WHERE diagnosis = %s", ["flu"]).fetchall()
        assert info.value.sqlstate == "42501"
        assert "diagnosis" in (info.value.diag.message_primary or "")
        assert carol.execute("SELECT COUNT(*) FROM visits").fetchone()[0] > 0
        assert alice.execute("SELECT COUNT(*) FROM departments").fetchone() is not None
    with _wire(server, "dave") as dave:
        assert _catalog(dave) == ([], [])
        with pytest.raises(psycopg.Error) as info:
            dave.execute("SELECT COUNT(*) FROM visits").fetchall()
        assert info.value.sqlstate == "42501"
    assert service.ledger.spent("dave", service.policy.dataset).epsilon == 0
