"""The binder's merged walks answer exactly as the separate walks they replace.

- The parsed tree's depth check (dpsql.limits.check_tree, 54001) and the walk that drops
  comments and records the statement's source on each positioned node are one walk
  (``frontend.bind._scrub``), which also counts the tree's node classes: the census
  (dpsql.frontend.census) that lets the passes before and in the binder skip their walks
  for nodes the tree has none of (placeholders, ``$$`` strings, PostgreSQL divisions, a
  nested query, a respelled function, a CTE, a window).
- The post-processing asks of each select item that might be a GROUP BY key whether its
  columns resolve (``Scope.resolved_sql``) instead of building, and catching, the refusal
  of a column that does not (its position and snippet render and tokenize the subtree).
- A bound query's relational nodes are walked once (``DPQuery.nodes``), not per view.

Each query below, and generated ones, is bound both ways: the same bound statement (its
canonical text and its rendered post-processing), or the same refusal (class, SQLSTATE,
message, position).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fuzz_grammar import Query, commented, key_queries, where_queries
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlglot import exp

import dpsql.frontend.bind as bind
from dpsql.errors import Error, ProgrammingError
from dpsql.frontend.bind.scope import Scope
from dpsql.frontend.positions import SOURCE
from dpsql.frontend.statements import DPQuery
from dpsql.limits import DEFAULT_LIMITS, too_deep, tree_depth
from dpsql.plan.canonical import canonical
from dpsql.policy import load_policy

POLICY = load_policy(Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml")

QUERIES = [
    "SELECT COUNT(*) FROM visits",
    "SELECT department, smoker, SUM(cost) AS s FROM visits WHERE age BETWEEN 3 AND 60 "
    "GROUP BY 1, 2 ORDER BY s DESC LIMIT 5",
    "SELECT department AS d, COUNT(*) AS n FROM visits GROUP BY d HAVING n > 3 ORDER BY n",
    "SELECT v.department, COUNT(*) FROM visits AS v GROUP BY v.department ORDER BY 2",
    "SELECT v.department, COUNT(*) FROM visits AS v GROUP BY department",
    "SELECT w.department, COUNT(*) FROM visits AS v GROUP BY department",
    "SELECT department, COUNT(*) FROM visits GROUP BY department ORDER BY nope",
    "SELECT nope, COUNT(*) FROM visits GROUP BY department",
    "SELECT department, age + 1, COUNT(*) FROM visits GROUP BY department",
    'SELECT "Department", COUNT(*) FROM visits GROUP BY department',
    "SELECT DEPARTMENT, COUNT(*) FROM visits GROUP BY department ORDER BY DEPARTMENT",
    "SELECT age / 10 AS b, COUNT(*) FROM visits GROUP BY age / 10 ORDER BY b",
    "SELECT FLOOR(age / 10) * 10 AS decade, COUNT(DISTINCT patient_id), STDDEV(cost) "
    "FROM visits WHERE age > 3 GROUP BY decade HAVING COUNT(*) > 10",
    "SELECT /* note_one */ department, COUNT(*) -- note_two\n"
    "FROM visits /* note_three */ GROUP BY 1",
    "SELECT COUNT(*) FROM visits WHERE age > ? AND department = ?",
    "SELECT COUNT(*) FROM visits WHERE department = 'x' AND age > 'abc'",
    "SELECT AVG(age), SUM(cost) FROM visits WHERE smoker AND cost > 10",
    "SELECT COUNT(*) FROM (SELECT * FROM visits WHERE age > 3) AS v",
    "WITH v AS (SELECT age FROM visits) SELECT COUNT(*) FROM v",
    "SELECT COUNT(*) FROM visits UNION ALL SELECT COUNT(*) FROM visits",
    "EXPLAIN SELECT department, COUNT(*) FROM visits GROUP BY 1",
    "SELECT * FROM visits",
    "SELECT COUNT(*) FROM visits WHERE age > $1",
    "SELECT COUNT(*) FROM visits WHERE department = $$oncology$$",
    "SELECT $$x$$",
    "SELECT SUM(cost / 2), AVG(age / 3) FROM visits WHERE age / 2 > 10",
    "SELECT COUNT(DISTINCT (patient_id)), COUNT(DISTINCT department) FROM visits",
    "SELECT COUNT_IF(smoker), SUM(cost) FILTER (WHERE age > 40) FROM visits",
    "SELECT COUNT(*) FROM visits WHERE visit_date < CURRENT_DATE",
    "WITH visits AS (SELECT age FROM visits WHERE age > 50) SELECT COUNT(*) FROM visits",
    "SELECT department, COUNT(*), SUM(COUNT(*)) OVER (ORDER BY department) FROM visits "
    "GROUP BY department",
    "SELECT SUM(cost) OVER () FROM visits",
    "SELECT COUNT(*) FROM visits WHERE EXISTS (SELECT 1 FROM visits)",
    "SELECT COUNT(*) FROM visits WHERE age IN (SELECT age FROM visits)",
    "SELECT COUNT(*) FROM visits v JOIN visits w ON v.patient_id = w.patient_id",
    "SELECT COUNT(*) FROM visits WHERE visit_date > '2024-01-31T00:00:00Z'",
]


def _chain(n: int) -> str:
    return "SELECT COUNT(*) FROM visits WHERE " + " AND ".join(["age > 1"] * n)


_DEPTH = DEFAULT_LIMITS.tree_depth


def _parens(n: int) -> str:
    return "SELECT COUNT(*) FROM visits WHERE age > " + "(" * n + "1" + ")" * n


DEEP = [_chain(_DEPTH - 6 + i) for i in range(0, 10, 2)] + [
    _parens(_DEPTH - 4 + i) for i in range(0, 8, 2)
]

#: Public clock readings differ between two binds: such texts are left out.
_CLOCK = re.compile(r"now|current_|localtime|statement_timestamp|transaction_timestamp", re.I)


def _outcome(text: str, dialect: str = "duckdb") -> tuple:
    parameters = (30, "oncology") if "?" in text else None
    try:
        bound = bind.parse_statement(text, POLICY, parameters, dialect=dialect)
    except Error as exc:
        return ("refused", type(exc).__name__, exc.sqlstate, str(exc), exc.position)
    post = getattr(bound, "post", None)
    return ("bound", canonical(bound), post.sql() if post is not None else None)


def _old_scrub(tree: exp.Expr, source: bind.Source, limit: int) -> None:
    """The two walks as they were, and no census: every pass walks the tree again."""
    if tree_depth(tree, limit) > limit:
        raise too_deep()
    for node in tree.walk():
        node.comments = None
        if node._meta:
            meta = node._meta = bind.ShallowMeta(node._meta)
            meta[SOURCE] = source


def _old_resolved_sql(self: Scope, node: exp.Expression) -> str | None:
    try:
        return self.normal_sql(node)
    except ProgrammingError:
        return None


def _old_nodes(self: DPQuery) -> tuple:
    out: list = []
    node = self.input
    while True:
        out.append(node)
        if not hasattr(node, "input"):
            return tuple(out)
        node = node.input


def _both(text: str, dialect: str = "duckdb") -> tuple[tuple, tuple]:
    fast = _outcome(text, dialect)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(bind, "_scrub", _old_scrub)
        m.setattr(Scope, "resolved_sql", _old_resolved_sql)
        m.setattr(DPQuery, "nodes", _old_nodes)
        m.setattr(
            DPQuery,
            "node",
            lambda self, kind: next((n for n in self.nodes() if isinstance(n, kind)), None),
        )
        slow = _outcome(text, dialect)
    return fast, slow


@pytest.mark.parametrize("dialect", ["duckdb", "postgres"])
@pytest.mark.parametrize("text", QUERIES + DEEP)
def test_merged_walks_bind_as_the_separate_walks_do(text: str, dialect: str) -> None:
    if _CLOCK.search(text):
        return
    fast, slow = _both(text, dialect)
    assert fast == slow


def test_the_census_counts_the_parsed_tree() -> None:
    """The census the first walk takes is the tree's: each class and its count."""
    text = "SELECT department, COUNT(*) FROM visits WHERE age > 3 AND smoker GROUP BY 1"
    tree = bind._parse(text)[0]
    census = bind._scrub(tree, bind.reading(text, "duckdb"), DEFAULT_LIMITS.tree_depth)
    walked: dict[type, int] = {}
    for node in tree.walk():
        walked[type(node)] = walked.get(type(node), 0) + 1
    assert census.counts == walked and census.root is tree
    assert census.only_root_query() and not census.has(exp.Window, exp.CTE, exp.Join)
    assert census.has(exp.Binary) and census.count(exp.Column) == walked[exp.Column]


@pytest.mark.parametrize("text", QUERIES)
def test_the_census_answers_as_find_does(text: str) -> None:
    """For every sqlglot node class: the census has one exactly when ``tree.find`` finds one,
    and counts as many as ``find_all``."""
    try:
        tree = bind._parse(text)[0]
    except Exception:  # a text sqlglot does not parse: nothing to count
        return
    census = bind._scrub(tree, bind.reading(text, "duckdb"), DEFAULT_LIMITS.tree_depth)
    classes = [
        c for c in vars(exp).values() if isinstance(c, type) and issubclass(c, exp.Expression)
    ]
    assert len(classes) > 500
    for cls in classes:
        assert census.has(cls) == (tree.find(cls) is not None), cls
        assert census.count(cls) == len(list(tree.find_all(cls))), cls


def test_the_depth_limit_is_reached_by_the_deep_queries() -> None:
    """Not vacuous: some deep queries are refused for their depth, some are not."""
    outcomes = [_outcome(text) for text in DEEP]
    assert any(o[0] == "refused" and o[2] == "54001" for o in outcomes)
    assert any(o[0] == "bound" for o in outcomes)


def test_no_comment_survives_the_walk() -> None:
    bound = bind.parse_statement(QUERIES[13], POLICY)
    # words no hex digest can hold ("c3" was once found inside a hash in the canonical text)
    assert "note_one" not in bound.post.sql() and "note_three" not in canonical(bound)


def test_resolved_sql_is_normal_sql_or_none() -> None:
    """Each subtree of each select item: the text normal_sql gives, or None exactly where
    normal_sql refuses."""
    tree = bind._parse(
        'SELECT v.department, w.age, "Age" + 1, nope, LOWER(department), COUNT(*) FROM visits AS v'
    )[0]
    scope = Scope("", POLICY)
    scope.bind_from(tree.args["from_"].this)
    checked = 0
    for item in tree.expressions:
        for node in item.walk():
            if not isinstance(node, exp.Expression) or isinstance(node, exp.Star):
                continue
            assert scope.resolved_sql(node) == _old_resolved_sql(scope, node)
            checked += 1
    assert checked > 10


_QUERIES = st.one_of(where_queries(), key_queries(), commented(key_queries()))


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(_QUERIES, st.sampled_from(["duckdb", "postgres"]))
def test_merged_walks_on_generated_queries(query: Query, dialect: str) -> None:
    if _CLOCK.search(query.sql):
        return
    fast, slow = _both(query.sql, dialect)
    assert fast == slow
