"""The compiler builds one sqlglot tree per plan and renders every engine's dialect from it.

No SQL is written as text in dpsql/lower/compile.py (a source scan), the Spark text comes from
the same tree as DuckDB's (no re-parse), the per-query secret is a node of that tree (a new
secret re-renders nothing), and the pieces the compiler lowers itself agree with the functions
that the rest of dpsql uses for the same job (typecheck.lower_key, safety.where_conditions).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import sqlglot
from conftest import fixture_policy
from sqlglot import exp

import dpsql
import dpsql.lower.compile as compile_module
from dpsql.frontend.bind import parse_statement
from dpsql.frontend.safety import guarded, guarded_conditions, where_conditions
from dpsql.frontend.statements import Where
from dpsql.frontend.typecheck import lower_key
from dpsql.lower.bounding import row_conditions, row_filter
from dpsql.lower.compile import (
    NEUTRAL,
    CompiledQuery,
    compile_plan,
    is_keyed_hash,
    lowered_key,
)
from dpsql.lower.hashing import is_secret, keyed_hash, secret_slot
from dpsql.pipeline import Settings
from dpsql.privacy.ledger import MemoryLedger

COMPILE_PY = Path(compile_module.__file__)

# The fixture queries of test_spark_render and bench_core's planning mix, plus computed
# columns, dates, decimals, thresholded keys and conditions that stay under TRY.
QUERIES = [
    "SELECT COUNT(*), SUM(age), VAR_SAMP(cost) FROM visits WHERE smoker",
    "SELECT department, COUNT(*), AVG(cost) FROM visits WHERE NOT (smoker) GROUP BY department",
    "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis",
    "SELECT FLOOR(age / 10) AS d, COUNT(*) FROM visits WHERE age // 3 > 2 GROUP BY d",
    "SELECT COUNT(*) FROM visits",
    "SELECT department, smoker, SUM(cost) AS s FROM visits WHERE age BETWEEN 20 AND 60 "
    "GROUP BY 1, 2 ORDER BY s DESC LIMIT 5",
    "SELECT FLOOR(age / 10) * 10 AS decade, COUNT(DISTINCT patient_id), STDDEV(cost) "
    "FROM visits GROUP BY decade HAVING COUNT(*) > 10",
    "SELECT diagnosis, COUNT(*) FROM visits WHERE department IN ('oncology', 'neurology') "
    "GROUP BY diagnosis",
    "SELECT AVG(age), SUM(cost) FROM visits WHERE smoker AND cost > 100",
    "SELECT visit_date, COUNT(*) FROM visits GROUP BY visit_date",
    "SELECT SUM(age * 2), AVG(LEAST(GREATEST(cost, 50), 100)) FROM visits",
    "SELECT department, SUM(CASE WHEN smoker THEN 1 ELSE 0 END) FROM visits GROUP BY department",
    "SELECT CAST(cost AS DECIMAL(10,2)) AS c, COUNT(*) FROM visits GROUP BY c",
    "SELECT COUNT(*) FROM visits WHERE CAST(diagnosis AS INT) > 3 AND age > 3",
    "SELECT age, COUNT(*) FROM visits WHERE age < 5 GROUP BY age",
]
SECRETS = (0, 1, 12345, 2**62 - 1)


def _row_level_policy() -> dict:
    policy = fixture_policy()
    for key in ("privacy_unit", "max_rows_per_unit", "max_groups_per_unit"):
        policy["tables"]["visits"].pop(key, None)
    return policy


@pytest.fixture(scope="module", params=["unit", "rows"])
def service(request):
    policy = fixture_policy() if request.param == "unit" else _row_level_policy()
    svc = dpsql.Service(policy, ledger=MemoryLedger())
    yield svc
    svc.close()


def _plan(service, sql):
    settings = Settings.from_policy(service.policy)
    settings.delta = 1e-6
    return service.plan(parse_statement(sql, service.policy), settings)


def _plans(service):
    for sql in QUERIES:
        try:
            yield sql, _plan(service, sql)
        except dpsql.Error:  # e.g. COUNT(DISTINCT patient_id) without a privacy unit
            continue


def test_every_fixture_query_renders_for_both_engines_from_one_tree(service, monkeypatch):
    parse = sqlglot.parse_one

    def no_query_parse(text, *args, **kwargs):
        # sqlglot's generators parse type names ('json') for themselves: only queries count
        assert "select" not in str(text).lower(), "rendering parsed the compiled SQL"
        return parse(text, *args, **kwargs)

    hashed = 0
    for sql, plan in _plans(service):
        compiled = compile_plan(plan, 12345)
        tree = compiled.expression
        before = repr(tree)
        monkeypatch.setattr(sqlglot, "parse_one", no_query_parse)
        duck, spark, neutral = (compiled.render(d) for d in ("duckdb", "spark", NEUTRAL))
        monkeypatch.undo()
        assert repr(tree) == before, sql  # rendering leaves the shared tree as it was
        assert "DP_KEYED_HASH" not in duck.upper() and "DP_KEYED_HASH" not in spark.upper()
        assert duck == neutral.replace("DP_KEYED_HASH(", "HASH(")
        if any(is_keyed_hash(n) for n in tree.find_all(exp.Anonymous)):
            hashed += 1
            assert "HASH(" in duck and "XXHASH64(" in spark.upper() and "12345" in spark, sql
        else:
            assert (
                "HASH(" not in duck
                and "12345" not in duck
                and not any(is_secret(n) for n in tree.find_all(exp.Anonymous))
            )
        assert "TRY(" not in spark.upper() and "QUALIFY" not in spark.upper()
        parse(spark, read="spark")  # Spark text is well formed
        service.engine.execute(compiled)  # and DuckDB's runs
    # with a privacy unit, most sampled plans choose rows or groups by keyed hash (rescaled
    # ones only for thresholded keys); without, none
    table = service.policy.tables["visits"]
    if table.privacy_unit is None:
        assert hashed == 0
    else:
        assert hashed > (5 if table.bounding == "sample" else 0)


def test_a_new_secret_renders_nothing_again(service, monkeypatch):
    for _, plan in _plans(service):
        compiled = compile_plan(plan, 7)
        for dialect in ("duckdb", "spark", NEUTRAL):
            compiled.render(dialect)
        calls: list[tuple] = []
        monkeypatch.setattr(compile_module, "_generate", lambda *a, seen=calls: seen.append(a))
        runs = {s: compiled.with_secret(s) for s in SECRETS}
        texts = {(s, d): q.render(d) for s, q in runs.items() for d in ("duckdb", "spark")}
        assert calls == []
        monkeypatch.undo()
        for secret in SECRETS:  # and each is what compiling with that secret gives
            fresh = compile_plan(plan, secret)
            assert runs[secret] == fresh
            for dialect in ("duckdb", "spark"):
                assert texts[(secret, dialect)] == fresh.render(dialect)


def test_secret_digits_are_those_the_generator_prints(service):
    """Joining the cached pieces equals rendering the tree with the secret as a literal."""
    for _, plan in _plans(service):
        compiled = compile_plan(plan, 0)
        for secret in SECRETS:
            literal = compiled.expression.transform(
                lambda n, s=secret: exp.Literal.number(s) if is_secret(n) else n
            )
            for dialect in ("duckdb", "spark"):
                expected = compile_module._generate(literal, dialect)[0]
                assert compiled.with_secret(secret).render(dialect) == expected


def test_a_marker_inside_a_literal_falls_back_to_printing_the_secret():
    marker = compile_module._MARKER
    tree = exp.Select(
        expressions=[
            exp.Alias(
                this=keyed_hash([exp.Literal.string(f"a{marker}b"), secret_slot()]),
                alias=exp.to_identifier("h"),
            )
        ]
    )
    compiled = CompiledQuery(tree, (), ("h",), secret=42)
    assert compiled.render("duckdb") == f"SELECT HASH('a{marker}b', 42) AS h"
    assert compiled.with_secret(5).render("spark") == f"SELECT XXHASH64('a{marker}b', 5) AS h"


def test_the_hash_spelling_inside_a_literal_is_left_as_it_is():
    """DuckDB's text renames DP_KEYED_HASH( in the text only when it stands once per node."""
    text = exp.Literal.string("DP_KEYED_HASH(x)")
    tree = exp.Select(
        expressions=[
            exp.Alias(this=keyed_hash([text, secret_slot()]), alias=exp.to_identifier("h")),
            exp.Alias(this=text.copy(), alias=exp.to_identifier("t")),
        ]
    )
    compiled = CompiledQuery(tree, (), ("h", "t"), secret=3)
    expected = "SELECT HASH('DP_KEYED_HASH(x)', 3) AS h, 'DP_KEYED_HASH(x)' AS t"
    assert compiled.render("duckdb") == expected


def test_keys_are_lowered_as_typecheck_lowers_them(service):
    for _, plan in _plans(service):
        for kp in plan.keys:
            mine = lowered_key(kp.key).sql(dialect="duckdb")
            theirs = sqlglot.parse_one(lower_key(kp.key), read="duckdb").sql(dialect="duckdb")
            assert mine == theirs, kp.key.sql


def test_where_trees_are_the_text_of_where_conditions(service):
    table = service.policy.tables["visits"]
    for _, plan in _plans(service):
        where = plan.query.where
        if where is None:
            continue
        trees = guarded_conditions(where, table)
        texts = where_conditions(where, table, "duckdb")
        assert [t.sql(dialect="duckdb") for t in trees] == texts
        assert all(t is not where and t.this is not where for t in trees)  # copies


def test_the_rows_where_is_read_off_the_relational_nodes(service):
    """row_conditions visits the Bound node's input (Project over Filter over the read) for the
    WHERE: the same guarded conjuncts, byte for byte, as reading the bound query's Where node
    (its cached conjuncts and their totality), and none for rows without a Filter."""
    queries = [*QUERIES, "SELECT SUM(c2) FROM (SELECT cost * 2 AS c2 FROM visits WHERE age > 3) t"]
    filtered = 0
    for sql in queries:
        try:
            plan = _plan(service, sql)
        except dpsql.Error:
            continue
        condition = row_filter(plan.bound.input)
        where = plan.query.node(Where)
        assert (condition is None) == (where is None), sql
        if where is None:
            continue
        filtered += 1
        assert condition is where.condition
        old = guarded([(c.expr, c.total) for c in where.conjuncts])
        now = row_conditions(plan)[: len(old)]
        assert [t.sql(dialect="duckdb") for t in now] == [t.sql(dialect="duckdb") for t in old]
    assert filtered >= 8


# -- no SQL written as text --------------------------------------------------------------------

_SQL_WORDS = re.compile(
    r"\b(SELECT|FROM|WHERE|GROUP\s+BY|ORDER\s+BY|HAVING|QUALIFY|JOIN|UNION|WITH|CASE|WHEN|"
    r"THEN|ELSE|END|CAST|TRY|SUM|COUNT|LEAST|ROUND|BETWEEN|IS\s+NULL|NOT|AND|OR|AS|IN|OVER|"
    r"PARTITION|ROW_NUMBER|HASH|XXHASH64)\b|[<>=]",
    re.IGNORECASE,
)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (they may quote SQL)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_compile_py_writes_no_sql_as_text():
    """No f-string in compile.py holds SQL (they only name columns: k0, v_m1), nor does any
    other string constant outside docstrings (names of nodes, tables and dialects only)."""
    tree = ast.parse(COMPILE_PY.read_text())
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if _SQL_WORDS.search(text):
                offenders.append((node.lineno, text))
    docstrings = _docstrings(tree)
    allowed = {"DP_KEYED_HASH", "DP_SECRET", "HASH", "XXHASH64", "OVER", "SEMI", "ANTI"}
    allowed |= {"rows", "values", "units", "sum", "sumsq"}  # measure kinds
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and node.value not in allowed
            and _SQL_WORDS.search(node.value)
        ):
            offenders.append((node.lineno, node.value))
    assert offenders == []
