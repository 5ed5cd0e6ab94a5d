"""Limits on every input (issue 29, item 1): each limit of the policy's ``[limits]`` is enforced
in every door (DB-API, CLI, SQLAlchemy, the wire server) with its SQLSTATE, before anything is
read or charged; text-decided failures (parameter values, public bins) come before the charge
(item 7); no input crashes a process (deep nesting in a subprocess, a hypothesis fuzz of deep
and wide SQL)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import EngineSpy

import dpsql
from dpsql.cli import main as cli_main
from dpsql.dbapi import connect_service
from dpsql.limits import DEFAULT_LIMITS, Limits, check_text, measure_text, tree_depth
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "correct horse"

# Small limits, so each is reached by a short statement.
LIMITS = """
[limits]
max_query_bytes = 20000
max_depth = 16
max_expressions = 2000
max_in_list = 50
max_parameters = 10
max_parameter_bytes = 1000
max_prepared_statements = 3
max_result_rows = 100
"""

COUNT = "SELECT COUNT(*) FROM visits WHERE "


def _in(n: int, column: str = "age") -> str:
    return f"{column} IN ({', '.join(str(i) for i in range(n))})"


# name -> (SQL, parameters, SQLSTATE, words of the message); each just past its limit.
TEXT_CASES = {
    "query_bytes": (COUNT + "diagnosis = '" + "x" * 20_000 + "'", None, "54000", "bytes long"),
    "depth_parentheses": (COUNT + "(" * 17 + "age > 3" + ")" * 17, None, "54001", "levels deep"),
    "depth_derived": (
        "SELECT COUNT(*) FROM " + "(SELECT * FROM " * 17 + "visits" + ") AS t" * 17,
        None,
        "54001",
        "levels deep",
    ),
    "depth_case": (
        COUNT + "CASE WHEN age > 1 THEN " * 17 + "1" + " ELSE 0 END" * 17 + " = 1",
        None,
        "54001",
        "levels deep",
    ),
    "depth_not": (COUNT + "NOT " * 17 + "age > 3", None, "54001", "levels deep"),
    "depth_chain": (
        COUNT + " OR ".join(f"age = {i}" for i in range(120)),
        None,
        "54001",
        "nest too deeply",
    ),
    "expressions": (
        COUNT + " OR ".join(_in(40) for _ in range(60)),
        None,
        "54001",
        "terms",
    ),
    "in_list": (COUNT + _in(51), None, "54000", "IN list has 51 values"),
    "parameter_number": (COUNT + "age > $11", list(range(11)), "54000", "parameter 11"),
}
PARAMETER_CASES = {
    "parameter_bytes": (COUNT + "diagnosis = ?", ["x" * 1001], "54000", "bytes"),
    "parameter_count": (COUNT + "age > ?", list(range(11)), "54000", "11 parameters"),
    "parameter_inf": (COUNT + "cost > ?", [math.inf], "22003", "not a finite number"),
    "parameter_nan": (COUNT + "cost > ?", [math.nan], "22003", "not a finite number"),
    "parameter_minus_inf": (COUNT + "cost > ?", [-math.inf], "22003", "not a finite number"),
    "parameter_int64": (COUNT + "age > ?", [2**70], "22003", "64-bit integer"),
}
RESULT_CASE = (
    "SELECT department, age, COUNT(*) FROM visits GROUP BY department, age",
    None,
    "54000",
    "public bins",
)
ALL_CASES = {**TEXT_CASES, **PARAMETER_CASES, "result_rows": RESULT_CASE}


@pytest.fixture
def policy(tmp_path) -> Path:
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(ROOT / "fixtures" / name, tmp_path / name)
    path = tmp_path / "visits.toml"
    text = path.read_text().replace("budget_epsilon = 10.0", "budget_epsilon = 1000.0")
    path.write_text(text + LIMITS)
    return path


def _limited_policy() -> dict:
    from conftest import fixture_policy

    policy = fixture_policy(privacy={"budget_epsilon": 1000.0})
    import tomllib

    policy["limits"] = tomllib.loads(LIMITS)["limits"]
    return policy


@pytest.fixture
def fresh():
    """A service under LIMITS with a memory ledger and a spy on its engine."""
    policy = _limited_policy()
    service = dpsql.Service(policy, ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    spy = EngineSpy(service)
    conn = connect_service(service, "mallory")
    yield service, spy, conn
    conn.close()
    service.close()


def _spent(service: dpsql.Service, analyst: str = "mallory") -> float:
    return float(service.ledger.spent(analyst, service.policy.dataset).epsilon)


# -- the DB-API (dpsql.connect / connect_service): every limit, free --------------------------


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_dbapi_refuses_each_limit_free(fresh, name):
    service, spy, conn = fresh
    sql, params, state, words = ALL_CASES[name]
    with pytest.raises(dpsql.Error) as info:
        conn.cursor().execute(sql, params)
    error = info.value
    assert error.sqlstate == state, error
    assert words in error.message
    assert error.hint and "Error" not in error.message  # no internal class name
    assert spy.calls == 0, "a refusal must not read data"
    assert _spent(service) == 0, "a refusal must not spend budget"
    if name != "result_rows":  # the bins are counted on execute, before the reserve
        with pytest.raises(dpsql.Error) as again:  # describe (plan only) refuses the same way
            conn.describe(sql, params)
        assert again.value.sqlstate == state


def test_positions_point_at_the_construct(fresh):
    _service, _spy, conn = fresh
    sql = COUNT + "(" * 17 + "age > 3" + ")" * 17
    with pytest.raises(dpsql.Error) as info:
        conn.cursor().execute(sql)
    assert info.value.position is not None and info.value.position.offset == len(COUNT) + 16
    sql = COUNT + "\n  " + _in(51)
    with pytest.raises(dpsql.Error) as info:
        conn.cursor().execute(sql)
    assert info.value.position is not None and info.value.position.line == 2


def test_just_under_each_limit_runs(fresh):
    service, spy, conn = fresh
    under = [
        COUNT + "(" * 16 + "age > 3" + ")" * 16,
        "SELECT COUNT(*) FROM " + "(SELECT * FROM " * 15 + "visits" + ") AS t" * 15,
        COUNT + "NOT " * 15 + "age > 3",
        COUNT + _in(50),
        COUNT + " OR ".join(f"age = {i}" for i in range(80)),
        COUNT + "diagnosis = '" + "x" * 19_000 + "'",
        "SELECT department, smoker, COUNT(*) FROM visits GROUP BY department, smoker",
    ]
    for sql in under:
        conn.cursor().execute(sql).fetchall()
    conn.cursor().execute(COUNT + "age > ? AND diagnosis <> ?", [3, "x" * 900]).fetchall()
    assert spy.calls == len(under) + 1 and _spent(service) > 0


def test_defaults_and_policy_errors(tmp_path):
    assert Limits() == DEFAULT_LIMITS
    assert DEFAULT_LIMITS.max_parameters == 65_535 and DEFAULT_LIMITS.max_depth == 64
    assert dpsql.Service(_limited_policy()).policy.limits.max_in_list == 50
    from conftest import fixture_policy

    for section, words in [
        ({"max_depth": 0}, "limits.max_depth: must be an integer from 1 to 64"),
        ({"max_depth": 65}, "limits.max_depth"),
        ({"max_parameters": 70_000}, "from 1 to 65535"),
        ({"max_in_list": "many"}, "limits.max_in_list: must be an integer"),
        ({"max_rows": 3}, "limits.max_rows: unknown key"),
    ]:
        with pytest.raises(dpsql.PolicyError) as info:
            dpsql.Service({**fixture_policy(), "limits": section})
        assert words in info.value.message and info.value.hint


def test_scan_ignores_quoted_text_and_comments():
    hidden = "'((((((' \"((((\" -- ((((((\n /* (((( */ $q$ (((((( $q$"
    m = measure_text(f"SELECT {hidden} (1)")
    assert m.depth == 1 and m.in_list == 0
    assert measure_text("SELECT x IN (SELECT a, b FROM t)").in_list == 0
    assert measure_text("SELECT x NOT IN (1, 2, 3)").in_list == 3
    assert measure_text("SELECT a - - - 1").depth == 2  # a binary minus, then two signs
    assert measure_text("SELECT ?, ?, $7").parameter == 7
    small = Limits(max_depth=2, max_expressions=10, max_in_list=2)
    check_text("SELECT (1)", small)
    with pytest.raises(dpsql.Error):
        check_text("SELECT (((1)))", small)


@pytest.mark.parametrize(
    "prefix",
    [
        "$$x$$, ",  # a dollar quote with no tag
        "$q$ (( $q$, ",
        "E'a\\'', ",  # a backslash-escaped quote (the tokenizer's reading, not a regex's)
        "/* /* */ (( */ ",  # nested block comments
        "'it''s', ",
        '"a""b", ',
    ],
)
def test_quoting_hides_no_nesting_from_the_check(fresh, prefix):
    """The scan reads the text with the parser's own tokenizers: quoting it ends elsewhere
    than a regular expression would cannot hide nesting from the check."""
    _service, spy, conn = fresh
    for depth, state in [(17, "54001"), (80, "54001"), (3000, "54001")]:
        sql = "SELECT " + prefix + "(" * depth + "1" + ")" * depth
        with pytest.raises(dpsql.Error) as info:
            conn.cursor().execute(sql)
        assert info.value.sqlstate == state, (prefix, depth, info.value)
    assert spy.calls == 0


@pytest.mark.parametrize("word", ["INTERVAL ", "ARRAY ", "ANY ", "@ ", "@@ ", "CONNECT_BY_ROOT "])
def test_keyword_runs_are_nesting(fresh, word):
    """Keywords and operators in a row, which the parser recurses on, count as nesting."""
    _service, spy, conn = fresh
    for n, states in ((30, None), (1000, {"54001"})):
        with pytest.raises(dpsql.Error) as info:  # 30 in a row: refused for what it is
            conn.cursor().execute(COUNT + "age > " + word * n + "3")
        state = info.value.sqlstate
        assert state in states if states else not state.startswith("XX"), info.value
    assert spy.calls == 0


def test_tree_depth_needs_no_recursion():
    import sqlglot

    tree = sqlglot.parse_one(" OR ".join(f"a = {i}" for i in range(5000)))
    assert tree_depth(tree) > 5000 and tree_depth(tree, stop=10) == 11


# -- the text-decided failures of issue 29 item 7: before the reserve, with default limits ----


@pytest.mark.parametrize(
    ("sql", "params"),
    [
        (COUNT + "cost > ?", [math.inf]),
        (COUNT + "cost > ?", [float("1e999")]),
        (COUNT + "cost > ? OR age > ?", [1.0, math.nan]),
        (COUNT + "age > ?", [-(2**64)]),
        (COUNT + "cost > ?", [__import__("numpy").float64("inf")]),
    ],
)
def test_parameter_values_refused_before_the_charge(sql, params):
    from conftest import fixture_policy

    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    spy = EngineSpy(service)
    conn = connect_service(service, "mallory")
    try:
        with pytest.raises(dpsql.Error) as info:
            conn.cursor().execute(sql, params)
        assert info.value.sqlstate == "22003"
        assert spy.calls == 0 and _spent(service) == 0
        conn.cursor().execute(sql, [1.0 if isinstance(p, float) else 1 for p in params])
        assert spy.calls == 1  # the same statement with finite values runs
    finally:
        conn.close()
        service.close()


def test_too_many_public_bins_refused_before_the_charge():
    """The release enumerates at most 1,000,000 public bins: past that (or max_result_rows)
    the plan is refused before the reserve, not after the charge as before."""
    from conftest import fixture_policy

    policy = fixture_policy(privacy={"max_bins": 1_000_000})
    service = dpsql.Service(policy, ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    spy = EngineSpy(service)
    conn = connect_service(service, "mallory")
    try:
        sql = (
            "SELECT age, FLOOR(cost) AS c, department, COUNT(*) FROM visits "
            "GROUP BY age, FLOOR(cost), department"
        )
        with pytest.raises(dpsql.Error) as info:
            conn.cursor().execute(sql)
        assert info.value.sqlstate == "54000" and "public bins" in info.value.message
        assert spy.calls == 0 and _spent(service) == 0
    finally:
        conn.close()
        service.close()


# -- the CLI: `dpsql query` ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted({**TEXT_CASES, "result_rows": RESULT_CASE}))
def test_cli_refuses_each_text_limit(capsys, policy, name):
    sql, _params, state, words = ALL_CASES[name]  # $11 is refused from the text alone
    code = cli_main(["query", "--policy", str(policy), sql])
    err = capsys.readouterr().err
    assert code == 1 and f"[{state}]" in err and words in err
    assert "Traceback" not in err
    code = cli_main(["query", "--policy", str(policy), "SHOW budget", "--format", "json"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)[0]["spent_epsilon"] == 0


# -- SQLAlchemy in process (dpsql:// URLs) ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_sqlalchemy_refuses_each_limit(policy, name):
    sa = pytest.importorskip("sqlalchemy", reason="SQLAlchemy is not installed")
    sql, params, state, words = ALL_CASES[name]
    engine = sa.create_engine(f"dpsql:///{policy}?analyst=alice")
    try:
        with engine.connect() as conn:
            with pytest.raises(sa.exc.DBAPIError) as info:
                if params is None:
                    conn.exec_driver_sql(sql)
                else:
                    conn.exec_driver_sql(sql, tuple(params))
            assert info.value.orig.sqlstate == state and words in str(info.value.orig)
    finally:
        engine.dispose()
    with dpsql.connect(policy=policy, analyst="alice") as conn:
        assert conn.cursor().execute("SHOW budget").fetchone()[1] == 0


# -- the wire server ----------------------------------------------------------------------------


@pytest.fixture
def server(policy):
    from dpsql.server.server import Server, ServerThread
    from dpsql.server.users import UserStore, users_path

    UserStore(users_path(policy)).add("alice", PASSWORD)
    service = dpsql.Service(policy, cache=False)
    spy = EngineSpy(service)
    thread = ServerThread(lambda: Server(service, UserStore(users_path(policy))))
    thread.start()
    thread.spy = spy  # type: ignore[attr-defined]
    thread.service = service  # type: ignore[attr-defined]
    yield thread
    thread.stop()
    service.close()


def _client(server):
    from dpsql.server.testing import RawClient

    c = RawClient("127.0.0.1", server.port)
    assert not c.login("alice", PASSWORD).errors()
    return c


def _wire_value(value) -> bytes:
    if isinstance(value, float):
        return repr(value).encode() if math.isfinite(value) else str(value).encode()
    return str(value).encode()


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_wire_refuses_each_limit(server, name):
    from dpsql.server import types as t

    sql, params, state, words = ALL_CASES[name]
    if name == "parameter_number":  # the Parse message's declared count is refused first
        words = "declares 11 parameters"
    c = _client(server)
    try:
        if params is None:
            errors = c.query(sql).errors()
        else:
            wire_sql = sql
            for i in range(len(params)):
                wire_sql = wire_sql.replace("?", f"${i + 1}", 1)
            oids = [
                t.FLOAT8 if isinstance(v, float) else t.INT8 if isinstance(v, int) else 0
                for v in params
            ]
            c.parse(wire_sql, oids=oids)
            c.bind([_wire_value(v) for v in params])
            c.execute()
            errors = c.sync().errors()
        assert len(errors) == 1, errors
        assert errors[0]["C"] == state and words in errors[0]["M"], errors
        assert "Traceback" not in errors[0]["M"] and errors[0].get("H")
        assert c.query("SELECT COUNT(*) FROM visits").errors() == []  # the session goes on
    finally:
        c.close()
    assert server.spy.calls == 1  # only the last query read
    assert _spent(server.service, "alice") > 0


def test_wire_parse_with_a_huge_parameter_number_allocates_nothing(server):
    c = _client(server)
    try:
        for i in range(5):  # each named statement used to keep its own ~400 MB
            c.parse("SELECT $50000000", name=f"s{i}")
            errors = c.sync().errors()
            assert errors and errors[0]["C"] == "54000" and "50000000" in errors[0]["M"]
        # a Parse declaring more parameter types than the limit allows, by count
        c.parse("SELECT COUNT(*) FROM visits WHERE age > $1", oids=[0] * 11)
        errors = c.sync().errors()
        assert errors and errors[0]["C"] == "54000"
        assert c.query("SELECT 1").errors() == []
    finally:
        c.close()


def test_wire_prepared_statements_per_session(server):
    c = _client(server)
    try:
        for i in range(3):
            c.parse("SELECT COUNT(*) FROM visits", name=f"s{i}")
        assert c.sync().errors() == []
        c.parse("SELECT COUNT(*) FROM visits", name="s3")
        errors = c.sync().errors()
        assert errors and errors[0]["C"] == "54000" and "max_prepared_statements" in errors[0]["M"]
        c.close_object("S", "s0")
        c.parse("SELECT COUNT(*) FROM visits", name="s3")
        assert c.sync().errors() == []
    finally:
        c.close()


def test_wire_catalog_statements_are_limited_too(server):
    """A statement naming no private table goes to the catalog shadow, past the same check."""
    c = _client(server)
    try:
        for sql, state in [
            ("SELECT " + "(" * 2000 + "1" + ")" * 2000, "54001"),
            ("SELECT 1 WHERE 1 IN (" + ",".join(["1"] * 51) + ")", "54000"),
        ]:
            errors = c.query(sql).errors()
            assert errors and errors[0]["C"] == state
        assert c.query("SELECT 1").errors() == []
    finally:
        c.close()


# -- no input crashes a process ------------------------------------------------------------------

_DEEP_SCRIPT = textwrap.dedent(
    """
    import shutil, sys, tempfile
    from pathlib import Path
    import dpsql
    from dpsql.server.server import Server, ServerThread
    from dpsql.server.testing import RawClient
    from dpsql.server.users import UserStore, users_path

    root = Path(tempfile.mkdtemp())
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(Path(sys.argv[1]) / name, root / name)
    policy = root / "visits.toml"
    UserStore(users_path(policy)).add("alice", "pw")
    texts = [
        "SELECT COUNT(*) FROM " + "(SELECT * FROM " * 10000 + "visits" + ") AS t" * 10000,
        "SELECT COUNT(*) FROM visits WHERE " + "(" * 500 + "age > 3" + ")" * 500,
        "SELECT COUNT(*) FROM visits WHERE " + "NOT " * 100000 + "age > 3",
        "SELECT COUNT(*) FROM visits WHERE " + " OR ".join(f"age = {i}" for i in range(50000)),
        "SELECT " + "(" * 100000 + "1" + ")" * 100000,
    ]
    with dpsql.connect(policy=policy, analyst="alice") as conn:
        for text in texts:
            try:
                conn.cursor().execute(text)
                print("dbapi ok")
            except dpsql.Error as exc:
                print("dbapi", exc.sqlstate)
    service = dpsql.Service(policy)
    thread = ServerThread(lambda: Server(service, UserStore(users_path(policy))))
    thread.start()
    c = RawClient("127.0.0.1", thread.port, timeout=60)
    c.login("alice", "pw")
    for text in texts:
        errors = c.query(text).errors()
        print("wire", errors[0]["C"] if errors else "ok", len(errors[0]["M"]) if errors else 0)
    c.close()
    thread.stop()
    """
)


def test_deep_nesting_does_not_crash_the_dbapi_or_the_server(tmp_path):
    """10,000 nested derived tables segfaulted dpsql.connect and dpsql serve; 500 parentheses
    raised a raw RecursionError (XX000 over the wire with ~10k lines of traceback logged)."""
    script = tmp_path / "deep.py"
    script.write_text(_DEEP_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(ROOT / "fixtures")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.split("\n")
    dbapi = [line.split()[1] for line in lines if line.startswith("dbapi")]
    wire = [line.split() for line in lines if line.startswith("wire")]
    assert dbapi == ["54001"] * 5
    assert [w[1] for w in wire] == ["54001"] * 5
    assert all(int(w[2]) < 300 for w in wire)  # a message, not a traceback
    assert "Traceback" not in run.stderr and "RecursionError" not in run.stderr


# -- fuzz: deep and wide SQL (hypothesis), in a worker process a crash cannot take pytest with ---

_WORKER = textwrap.dedent(
    """
    import json, sys
    import dpsql
    from dpsql.privacy.ledger import MemoryLedger
    from dpsql.privacy.samplers import ZeroNoise
    sys.path.insert(0, sys.argv[1])
    from conftest import fixture_policy
    service = dpsql.Service(fixture_policy(privacy={"budget_epsilon": 1e9}),
                            ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    conn = service.connect("fuzz")
    for line in sys.stdin:
        text = json.loads(line)
        try:
            conn.cursor().execute(text).fetchall()
            out = "ok"
        except dpsql.Error as exc:
            out = exc.sqlstate
        except BaseException as exc:  # noqa: BLE001 -- the fuzz reports any escape
            out = "RAW " + type(exc).__name__
        print(json.dumps(out), flush=True)
    """
)


class _Worker:
    def __init__(self, tmp: Path) -> None:
        script = tmp / "worker.py"
        script.write_text(_WORKER)
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(ROOT / "tests")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def run(self, text: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(text) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
            raise AssertionError(f"the worker died (exit {code}) on {text[:200]!r}: {err}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


_OPENERS = {
    "paren": ("(", ")"),
    "derived": ("(SELECT * FROM ", ") AS t"),
    "case": ("CASE WHEN age > 1 THEN ", " ELSE 0 END"),
    "not": ("NOT ", ""),
    "neg": ("- ", ""),
    "func": ("ABS(", ")"),
    "scalar": ("(SELECT ", ")"),
    "cast": ("CAST(", " AS INT)"),
    # keywords and operators the parser recurses on with no bracket (INTERVAL INTERVAL ...)
    "interval": ("INTERVAL ", ""),
    "array": ("ARRAY ", ""),
    "any": ("ANY ", ""),
    "at": ("@ ", ""),
    "atat": ("@@ ", ""),
    "root": ("CONNECT_BY_ROOT ", ""),
}
_CHAINS = {
    "or": ("age = {i}", " OR "),
    "and": ("age <> {i}", " AND "),
    "plus": ("{i}", " + "),
    "concat": ("'{i}'", " || "),
    "in": ("{i}", ", "),
    "cast": ("", "::INT"),
    "when": ("WHEN age = {i} THEN {i}", " "),
}


def _deep(kinds: list[str], inner: str) -> str:
    opens = "".join(_OPENERS[k][0] for k in kinds)
    closes = "".join(_OPENERS[k][1] for k in reversed(kinds))
    return opens + inner + closes


def _wide(kind: str, n: int) -> str:
    item, sep = _CHAINS[kind]
    if kind == "cast":
        return "age" + sep * n
    body = sep.join(item.format(i=i) for i in range(n))
    if kind == "in":
        return f"age IN ({body})"
    if kind == "when":
        return f"(CASE {body} ELSE 0 END) > 1"
    if kind == "plus":
        return f"age > {body}"
    if kind == "concat":
        return f"diagnosis = {body}"
    return body


def test_fuzz_deep_and_wide_sql_never_crashes(tmp_path):
    hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed")
    st = hypothesis.strategies
    worker = _Worker(tmp_path)
    seen: dict[str, int] = {}

    @hypothesis.settings(
        max_examples=60,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(
        kinds=st.lists(st.sampled_from(sorted(_OPENERS)), min_size=1, max_size=6),
        repeat=st.sampled_from([1, 10, 30, 63, 64, 65, 100, 500, 3000]),
        wide=st.sampled_from(sorted(_CHAINS)),
        width=st.sampled_from([1, 2, 50, 300, 1000, 20_000]),
        where=st.booleans(),
    )
    def run(kinds, repeat, wide, width, where):
        layers = (kinds * repeat)[: max(1, repeat)]
        condition = _wide(wide, width)
        if where:
            sql = "SELECT COUNT(*) FROM visits WHERE " + _deep(
                [k for k in layers if k not in ("derived",)] or ["paren"], condition
            )
            if "derived" in layers or "scalar" in layers:
                sql = sql.replace("SELECT * FROM ", "SELECT * FROM visits WHERE ")
        else:
            sql = (
                "SELECT COUNT(*) FROM "
                + _deep(["derived"] * repeat, "visits")
                + (" WHERE " + condition)
            )
        out = worker.run(sql)
        assert not out.startswith("RAW"), (out, sql[:300])
        assert out == "ok" or (len(out) == 5 and out[:2] != "XX"), (out, sql[:300])
        seen[out] = seen.get(out, 0) + 1

    try:
        run()
    finally:
        worker.close()
    assert "54001" in seen and "ok" in seen, seen


def test_wire_refusal_is_logged_without_a_traceback(server, caplog):
    c = _client(server)
    try:
        with caplog.at_level("DEBUG", logger="dpsql.server"):
            errors = c.query(COUNT + "(" * 500 + "age > 3" + ")" * 500).errors()
        assert errors[0]["C"] == "54001"
    finally:
        c.close()
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text


def test_statements_at_the_default_limits_are_answered():
    """The defaults are inside what the parser and the walkers handle: statements just at
    them are answered (or refused for what they are), never an internal error."""
    from conftest import fixture_policy

    policy = fixture_policy(privacy={"budget_epsilon": 1e6})
    service = dpsql.Service(policy, ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    conn = connect_service(service, "a")
    depth = DEFAULT_LIMITS.max_depth
    chain = DEFAULT_LIMITS.tree_depth - 4
    statements = [
        COUNT + " OR ".join(f"age = {i}" for i in range(chain)),
        COUNT + " AND ".join(f"age <> {i}" for i in range(chain)),
        COUNT + "age > " + " + ".join("1" for _ in range(chain)),
        COUNT + "age > 1" + "::INT" * 30,  # each :: INT is a keyword run (see FREE_RUN)
        "SELECT COUNT(*) FROM " + "(SELECT * FROM " * depth + "visits" + ") AS t" * depth,
        COUNT + "(" * depth + "age > 3" + ")" * depth,
        COUNT + "CASE WHEN age > 1 THEN " * depth + "1" + " ELSE 0 END" * depth + " = 1",
        COUNT + "NOT " * depth + "age > 3",
        "SELECT department, COUNT(*) FROM visits GROUP BY department HAVING "
        + " OR ".join(f"COUNT(*) > {i}" for i in range(chain)),
    ]
    try:
        for sql in statements:
            conn.cursor().execute(sql).fetchall()
            conn.describe(sql)
    finally:
        conn.close()
        service.close()
