"""The cache keys are the canonical tree (dpsql.plan.canonical): a property test.

Generated queries over the fixture policies (fixtures/visits.toml; fixtures/star for joins)
are planned in pairs. A pair one node apart (join key, join kind, CTE body, filter, GROUP BY
key, aggregate argument or kind) must get different answer keys and different canonical
trees; a pair that differs only in spelling (table aliases, qualified or bare columns,
keyword case, blanks, redundant parentheses, ``<>`` or ``!=``, ``INNER JOIN`` or ``JOIN``, the
ON sides, the order of the WHERE's top-level conjuncts, an integer's leading zeros) must get
equal ones. Then, through the DB-API, two different trees never get each other's cached answer
(the second is charged), and an entry of the text-keyed caches (plan cache, shape cache, text
shapes) always holds the tree a fresh bind and plan of that text gives.
"""

from __future__ import annotations

import itertools
import re
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import dpsql
from dpsql.dbapi import connect_service
from dpsql.errors import Error
from dpsql.frontend.bind import parse_statement
from dpsql.frontend.statements import DPQuery
from dpsql.pipeline import Service, Settings
from dpsql.plan.canonical import answer_key, canonical, plan_text
from dpsql.privacy.ledger import MemoryLedger

ROOT = Path(__file__).resolve().parent.parent
STAR = ROOT / "fixtures" / "star"
FAST = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # the same examples on every run: a CI failure reproduces
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _declared(policy: dict) -> dict:
    """Clipping ranges as declared: a range chosen per analyst from a bought histogram makes
    the buying statement's tree differ from the next one's (rightly another key), which is not
    what these tests are about."""
    for table in policy["tables"].values():
        for column in table.get("columns", {}).values():
            if "upper" in column and column.get("type") in ("int", "float"):
                column.setdefault("clip", "declared")
    policy["privacy"]["budget_epsilon"] = 1e6
    return policy


def _visits_policy() -> dict:
    policy = tomllib.loads((ROOT / "fixtures" / "visits.toml").read_text())
    policy["tables"]["visits"]["source"] = str(ROOT / "fixtures" / "visits.csv")
    return _declared(policy)


def _star_policy() -> dict:
    policy = tomllib.loads((STAR / "star.toml").read_text())
    for name, spec in policy["tables"].items():
        spec["source"] = str(STAR / f"{name}.csv")
    return _declared(policy)


@pytest.fixture(scope="module")
def visits():
    service = dpsql.Service(_visits_policy(), ledger=MemoryLedger())
    yield service
    service.close()


@pytest.fixture(scope="module")
def star():
    service = dpsql.Service(_star_policy(), ledger=MemoryLedger())
    yield service
    service.close()


# -- a small query model: its nodes, and how it is spelled --------------------------------------


@dataclass(frozen=True)
class Query:
    """One query as nodes: ``join`` None reads visits alone (visits fixture), else
    (kind, (left column, right column)) joins departments (star fixture)."""

    filters: tuple[tuple, ...]  # top-level conjuncts, each an atom (see _atom)
    key: str | None
    aggregates: tuple[str, ...]  # "COUNT(*)", "SUM({cost})", ... ({col} takes a qualifier)
    cte: tuple[tuple, ...] | None = None  # the CTE body's conjuncts (visits alone)
    join: tuple[str, tuple[str, str]] | None = None


@dataclass(frozen=True)
class Spelling:
    alias: str | None = None  # the fact table's alias (None: none, columns bare)
    dim_alias: str = "d"
    qualify: bool = True  # qualified columns where an alias exists
    case: tuple[bool, ...] = (True,)  # keyword case, cycled per keyword (True: upper)
    blank: str = " "
    parens: bool = False  # each conjunct, and the whole WHERE, in redundant parentheses
    neq: str = "<>"
    inner: bool = False  # INNER JOIN for JOIN
    swap_on: bool = False
    order: tuple[int, ...] | None = None  # a permutation of the WHERE's conjuncts
    zeros: bool = False  # integers with a leading zero (DuckDB reads 040 as INTEGER 40)


def _atom(atom: tuple, col: Any, sp: Spelling) -> str:
    kind = atom[0]
    num = (lambda v: f"0{v}") if sp.zeros else str
    if kind == "cmp":  # (cmp, column, op, integer)
        op = sp.neq if atom[2] == "<>" else atom[2]
        return f"{col(atom[1])} {op} {num(atom[3])}"
    if kind == "cost":  # (cost, op, decimal text)
        return f"{col('cost')} {atom[1]} {atom[2]}"
    if kind == "bool":  # (bool, column, negated)
        return ("NOT " if atom[2] else "") + col(atom[1])
    if kind == "in":  # (in, values)
        return f"{col('department')} IN ({', '.join(repr(v) for v in atom[1])})"
    if kind == "or":  # (or, a, b): an OR is one conjunct, its inside never reordered
        return f"({col('age')} < {num(atom[1])} OR {col('cost')} > {atom[2]})"
    if kind == "between":
        return f"{col('age')} BETWEEN {num(atom[1])} AND {num(atom[2])}"
    raise AssertionError(atom)


def render(q: Query, sp: Spelling = Spelling()) -> str:
    """The query's text in spelling ``sp``."""
    words = itertools.cycle(sp.case)

    def kw(word: str) -> str:
        return word.upper() if next(words) else word.lower()

    fact = sp.alias if q.cte is None else None  # a CTE is read bare
    qualified = sp.qualify and fact is not None

    def col(name: str) -> str:
        if q.join is not None and name in ("name", "region", "beds", "id"):
            return f"{sp.dim_alias}.{name}"
        return f"{fact}.{name}" if qualified else name

    b = sp.blank
    items = ([col(q.key)] if q.key else []) + [
        a.format(cost=col("cost"), age=col("age")) for a in q.aggregates
    ]
    aggs = [kw(i.split("(")[0]) + "(" + i.split("(", 1)[1] if "(" in i else i for i in items]
    text = f"{kw('SELECT')}{b}{(',' + b).join(aggs)}{b}{kw('FROM')}{b}"
    if q.cte is not None:
        body = f"{b}{kw('AND')}{b}".join(_atom(a, str, sp) for a in q.cte)
        text = (
            f"{kw('WITH')} x {kw('AS')} ({kw('SELECT')} * {kw('FROM')} visits {kw('WHERE')}"
            f"{b}{body}){b}" + text + "x"
        )
    else:
        text += "visits" + (f" {fact}" if fact else "")
    if q.join is not None:
        kind, (left, right) = q.join
        words_ = {"INNER": "INNER JOIN" if sp.inner else "JOIN", "LEFT": "LEFT JOIN"}[kind]
        on = (f"{sp.dim_alias}.{right}", f"{fact or 'visits'}.{left}")
        if not sp.swap_on:
            on = on[::-1]
        text += f"{b}{kw(words_)}{b}departments {sp.dim_alias}{b}{kw('ON')}{b}{on[0]} = {on[1]}"
    parts = [_atom(a, col, sp) for a in q.filters]
    if sp.order is not None:
        parts = [parts[i] for i in sp.order]
    if sp.parens:
        parts = [f"({p})" for p in parts]
    if parts:
        where = f"{b}{kw('AND')}{b}".join(parts)
        text += f"{b}{kw('WHERE')}{b}" + (f"({where})" if sp.parens else where)
    if q.key:
        text += f"{b}{kw('GROUP BY')}{b}{col(q.key)}"
    return text


# -- strategies ----------------------------------------------------------------------------------

INTS = st.integers(1, 99)
DECIMAL_TEXTS = ["10.5", "100", "250.25", "1000.0", "4999.99"]
DECIMALS = st.sampled_from(DECIMAL_TEXTS)
OPS = st.sampled_from([">", "<", ">=", "<=", "=", "<>"])
ATOMS = st.one_of(
    st.tuples(st.just("cmp"), st.just("age"), OPS, INTS),
    st.tuples(st.just("cost"), st.sampled_from([">", "<"]), DECIMALS),
    st.tuples(st.just("bool"), st.sampled_from(["smoker", "readmitted"]), st.booleans()),
    st.tuples(
        st.just("in"),
        st.lists(
            st.sampled_from(["oncology", "neurology", "cardiology"]),
            min_size=1,
            max_size=2,
            unique=True,
        ).map(tuple),
    ),
    st.tuples(st.just("or"), INTS, DECIMALS),
    st.tuples(st.just("between"), st.integers(1, 40), st.integers(41, 99)),
)
STAR_ATOMS = st.one_of(
    st.tuples(st.just("cost"), st.sampled_from([">", "<"]), DECIMALS),
)
VISITS_AGGREGATES = ["COUNT(*)", "SUM({cost})", "AVG({age})", "COUNT({cost})", "SUM({age})"]
STAR_AGGREGATES = ["COUNT(*)", "SUM({cost})", "COUNT({cost})"]
JOIN_KEYS = [("dept_id", "id"), ("patient_id", "id"), ("visit_id", "id")]


@st.composite
def visits_queries(draw: Any) -> Query:
    filters = tuple(draw(st.lists(ATOMS, min_size=0, max_size=3, unique=True)))
    key = draw(st.sampled_from([None, "department", "smoker"]))
    aggs = tuple(draw(st.lists(st.sampled_from(VISITS_AGGREGATES), min_size=1, max_size=2)))
    aggs = tuple(dict.fromkeys(aggs))
    cte = None
    if draw(st.booleans()):
        cte = (("cmp", "age", draw(OPS), draw(INTS)),)
    return Query(filters, key, aggs, cte)


@st.composite
def star_queries(draw: Any) -> Query:
    filters = tuple(draw(st.lists(STAR_ATOMS, min_size=0, max_size=1)))
    key = draw(st.sampled_from(["name", "region"]))
    aggs = (draw(st.sampled_from(STAR_AGGREGATES)),)
    join = (draw(st.sampled_from(["INNER", "LEFT"])), draw(st.sampled_from(JOIN_KEYS)))
    return Query(filters, key, aggs, None, join)


def _other(draw: Any, options: list, current: Any) -> Any:
    return draw(st.sampled_from([o for o in options if o != current]))


@st.composite
def one_node_apart(draw: Any, queries: Any) -> tuple[Query, Query, str]:
    """(query, the query with one node changed, which node)."""
    q = draw(queries)
    nodes = ["key", "aggregate argument", "aggregate kind", "filter added"]
    if q.filters:
        nodes += ["filter value", "filter dropped"]
    if q.cte is not None:
        nodes.append("CTE body")
    if q.join is not None:
        nodes += ["join key", "join kind"]
        nodes.remove("aggregate kind")
    node = draw(st.sampled_from(nodes))
    if node == "key":
        keys = ["name", "region"] if q.join else [None, "department", "smoker"]
        return q, replace(q, key=_other(draw, keys, q.key)), node
    if node in ("aggregate argument", "aggregate kind"):
        i = draw(st.integers(0, len(q.aggregates) - 1))
        old = q.aggregates[i]
        if node == "aggregate argument":
            swap = {"{cost}": "{age}", "{age}": "{cost}", "*": "{cost}"}
            new = next((old.replace(a, b) for a, b in swap.items() if a in old), old)
            if q.join is not None:
                new = old.replace("{cost}", "*") if "{cost}" in old else "COUNT({cost})"
        else:
            kinds = {"COUNT": "SUM", "SUM": "AVG", "AVG": "SUM"}
            head = old.split("(")[0]
            new = kinds[head] + old[len(head) :]
            if new == "SUM(*)":
                new = "COUNT({cost})"
        assume(new not in q.aggregates)
        aggs = (*q.aggregates[:i], new, *q.aggregates[i + 1 :])
        return q, replace(q, aggregates=aggs), node
    if node == "filter added":
        atom = draw(STAR_ATOMS if q.join else ATOMS)
        assume(atom not in q.filters)
        return q, replace(q, filters=(*q.filters, atom)), node
    if node == "filter dropped":
        i = draw(st.integers(0, len(q.filters) - 1))
        return q, replace(q, filters=q.filters[:i] + q.filters[i + 1 :]), node
    if node == "filter value":
        i = draw(st.integers(0, len(q.filters) - 1))
        atom = q.filters[i]
        if atom[0] in ("cmp", "or", "between"):
            changed = (*atom[:-1], atom[-1] + 1 if atom[-1] < 99 else atom[-1] - 1)
            if atom[0] == "or":
                changed = (atom[0], atom[1] % 99 + 1, atom[2])
        elif atom[0] == "cost":
            changed = (atom[0], atom[1], _other(draw, DECIMAL_TEXTS, atom[2]))
        elif atom[0] == "bool":
            changed = (atom[0], atom[1], not atom[2])
        else:
            changed = (atom[0], tuple(v for v in ("oncology", "dermatology") if v != atom[1][0]))
        assume(changed not in q.filters)
        filters = (*q.filters[:i], changed, *q.filters[i + 1 :])
        return q, replace(q, filters=filters), node
    if node == "CTE body":
        (_, column, op, value), *_ = q.cte  # type: ignore[misc]
        return q, replace(q, cte=(("cmp", column, op, value % 99 + 1),)), node
    if node == "join key":
        kind, pair = q.join  # type: ignore[misc]
        return q, replace(q, join=(kind, _other(draw, JOIN_KEYS, pair))), node
    kind, pair = q.join  # type: ignore[misc]
    return q, replace(q, join=("LEFT" if kind == "INNER" else "INNER", pair)), node


@st.composite
def spellings(draw: Any, q: Query) -> Spelling:
    n = len(q.filters)
    return Spelling(
        alias=draw(st.sampled_from([None, "v", "w", "visit_rows"])) if q.join is None else "v",
        dim_alias=draw(st.sampled_from(["d", "dep", "departments"])),
        qualify=draw(st.booleans()),
        case=tuple(draw(st.lists(st.booleans(), min_size=1, max_size=4))),
        blank=draw(st.sampled_from([" ", "  ", "\n", " \t "])),
        parens=draw(st.booleans()),
        neq=draw(st.sampled_from(["<>", "!="])),
        inner=draw(st.booleans()),
        swap_on=draw(st.booleans()),
        order=tuple(draw(st.permutations(range(n)))) if n > 1 else None,
        zeros=draw(st.booleans()),
    )


# -- the properties -----------------------------------------------------------------------------


def _plan(
    service: Service, text: str, settings: Settings | None = None, analyst: str = "analyst"
) -> Any:
    settings = settings or Settings.from_policy(service.policy)
    statement = parse_statement(text, service.policy)
    assert isinstance(statement, DPQuery), text
    return service.plan(statement, settings, analyst)


def _planned(service: Service, text: str) -> Any:
    try:
        return _plan(service, text)
    except Error:
        assume(False)  # refused (e.g. a combination the grammar does not take): not a pair


@FAST
@given(data=st.data())
def test_one_node_apart_gives_different_keys(visits, star, data):
    queries = data.draw(st.sampled_from(["visits", "star"]))
    service = visits if queries == "visits" else star
    strategy = visits_queries() if queries == "visits" else star_queries()
    q, other, node = data.draw(one_node_apart(strategy))
    a, b = _planned(service, render(q)), _planned(service, render(other))
    assert answer_key(a) != answer_key(b), (node, render(q), render(other))
    assert plan_text(a) != plan_text(b), node


@FAST
@given(data=st.data())
def test_respellings_give_equal_keys(visits, star, data):
    queries = data.draw(st.sampled_from(["visits", "star"]))
    service = visits if queries == "visits" else star
    q = data.draw(visits_queries() if queries == "visits" else star_queries())
    sp = data.draw(spellings(q))
    plain, spelled = render(q), render(q, sp)
    a = _planned(service, plain)
    b = _plan(service, spelled)  # a spelling of a query that binds binds too
    assert plan_text(a) == plan_text(b), (plain, spelled)
    assert answer_key(a) == answer_key(b)


def test_the_model_spells_what_it_says(visits, star):
    """The generator's spellings and mutations reach the text (a guard on the test itself)."""
    q = Query((("cmp", "age", "<>", 40), ("cost", ">", "10.5")), "department", ("SUM({cost})",))
    sp = Spelling(alias="w", case=(False,), blank="\n", parens=True, neq="!=", order=(1, 0))
    assert render(q) == (
        "SELECT department, SUM(cost) FROM visits WHERE age <> 40 AND cost > 10.5 "
        "GROUP BY department"
    )
    assert render(q, sp) == (
        "select\nw.department,\nsum(w.cost)\nfrom\nvisits w\nwhere\n((w.cost > 10.5)\nand\n"
        "(w.age != 40))\ngroup by\nw.department"
    )
    j = Query((), "name", ("COUNT(*)",), None, ("INNER", ("dept_id", "id")))
    spelled = render(j, Spelling(alias="v", inner=True, swap_on=True, dim_alias="dep"))
    assert "INNER JOIN departments dep ON dep.id = v.dept_id" in spelled
    assert plan_text(_plan(star, render(j))) == plan_text(_plan(star, spelled))


# -- what the key must and must not hold, deterministic ------------------------------------------

BASE = "SELECT department, COUNT(*), SUM(cost) FROM visits WHERE age > 40 GROUP BY department"


def test_select_list_order_changes_the_tree(visits):
    """A reordered select list is another output order: another tree. The answer cache keeps
    the release (the measured part), replayed through each query's own post-processing, so a
    key moved among the aggregates shares it, and reordered aggregates do not."""
    base = _plan(visits, BASE)
    moved = _plan(visits, BASE.replace("department, COUNT(*)", "COUNT(*), department"))
    swapped = _plan(visits, BASE.replace("COUNT(*), SUM(cost)", "SUM(cost), COUNT(*)"))
    assert plan_text(base) != plan_text(moved) and plan_text(base) != plan_text(swapped)
    assert answer_key(base) == answer_key(moved)
    assert answer_key(base) != answer_key(swapped)


def test_literals_are_typed_values(visits):
    key = lambda text: answer_key(_plan(visits, text))  # noqa: E731
    q = "SELECT COUNT(*) FROM visits WHERE {}"
    assert key(q.format("age > 40")) == key(q.format("age > 040")) == key(q.format("40 < age"))
    # a decimal's digits are its DuckDB type (DECIMAL(4,2) against DECIMAL(3,2)), an exponent
    # makes a DOUBLE: different typed values, different keys
    assert key(q.format("cost > 1.50")) != key(q.format("cost > 1.5"))
    assert key(q.format("cost > 1e2")) == key(q.format("cost > 1E+2"))
    assert key(q.format("cost > 1e2")) != key(q.format("cost > 100"))
    assert key(q.format("diagnosis = 'Flu'")) != key(q.format("diagnosis = 'flu'"))


def test_settings_data_version_clock_and_policy_are_in_the_key(visits):
    base = Settings.from_policy(visits.policy)
    text = "SELECT department, SUM(cost) FROM visits WHERE age > 40 GROUP BY department"
    keys = {
        "base": answer_key(_plan(visits, text, base)),
        "epsilon": answer_key(_plan(visits, text, replace(base, epsilon=base.epsilon / 2))),
        "mechanism": answer_key(_plan(visits, text, replace(base, mechanism="gaussian"))),
        "bias": answer_key(_plan(visits, text, replace(base, bias_estimate="off"))),
    }
    assert len(set(keys.values())) == len(keys), keys
    # δ reaches a plan that spends it (here: unit counts thresholded; with public keys and
    # Laplace noise a plan spends none, and its release does not depend on the setting)
    grouped = "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis"
    half = replace(base, delta=base.delta / 2, partition_selection="threshold")
    threshold = replace(base, partition_selection="threshold")
    assert answer_key(_plan(visits, grouped, half)) != answer_key(_plan(visits, grouped, threshold))
    assert answer_key(_plan(visits, grouped, threshold)) != answer_key(_plan(visits, grouped, base))
    assert answer_key(_plan(visits, text, replace(base, delta=base.delta / 2))) == keys["base"]
    # post-processing settings do not change the release
    same = replace(base, confidence=0.5, bias_interval="on")
    assert answer_key(_plan(visits, text, same)) == keys["base"]
    # the data version
    old = visits.engine.versions.get("visits", "")
    try:
        visits.engine.versions["visits"] = "v-other"
        assert answer_key(_plan(visits, text, base)) != keys["base"]
    finally:
        visits.engine.versions["visits"] = old
    # the public clock's instant is a literal of the tree
    clocked = "SELECT COUNT(*) FROM visits WHERE visit_date > NOW() - INTERVAL '90 days'"
    first = _plan(visits, clocked)
    time.sleep(0.002)
    second = _plan(visits, clocked)
    assert first.query.where != second.query.where  # two instants
    assert answer_key(first) != answer_key(second)
    # the policy as the tree reads it: another declared range of cost, another key
    policy = _visits_policy()
    policy["tables"]["visits"]["columns"]["cost"]["upper"] = 4000.0
    other = dpsql.Service(policy, ledger=MemoryLedger())
    try:
        assert answer_key(_plan(other, text, base)) != keys["base"]
    finally:
        other.close()


def test_the_serialisation_is_deterministic_and_holds_no_object_identity(visits, star):
    texts = [
        (visits, BASE),
        (visits, "SELECT diagnosis, AVG(cost), MEDIAN(age) FROM visits GROUP BY diagnosis"),
        (
            star,
            "SELECT d.region, COUNT(*) FROM visits v LEFT JOIN departments d ON v.dept_id = d.id "
            "GROUP BY d.region",
        ),
        (
            star,
            "SELECT p.sex, COUNT(*) FROM visits v JOIN patients p "
            "ON v.patient_id = p.patient_id GROUP BY p.sex",
        ),
    ]
    for service, text in texts:
        a, b = _plan(service, text), _plan(service, text)
        assert a is not b and canonical(a) == canonical(b)
        assert not re.search(r"<[\w.]+@\d+>", plan_text(a))  # no unknown object by its id


# -- end to end: the DB-API and the text-keyed caches --------------------------------------------

_analysts = itertools.count()

APART = [
    (BASE, BASE.replace("age > 40", "age > 41")),  # filter
    (BASE, BASE.replace("GROUP BY department", "AND smoker GROUP BY department")),
    (BASE, BASE.replace("SUM(cost)", "SUM(age)")),  # aggregate argument
    (BASE, BASE.replace("department", "smoker")),  # key
    (
        "WITH x AS (SELECT * FROM visits WHERE age > 30) SELECT COUNT(*) FROM x",
        "WITH x AS (SELECT * FROM visits WHERE age > 31) SELECT COUNT(*) FROM x",
    ),  # CTE body
]


@pytest.mark.parametrize("first, second", APART + [(b, a) for a, b in APART[:2]])
def test_different_trees_never_share_a_cached_answer(visits, first, second):
    analyst = f"keys-{next(_analysts)}"
    conn = connect_service(visits, analyst)
    try:
        cur = conn.cursor()
        cur.execute(first)
        cur.fetchall()
        assert not cur.cached
        spent = visits.ledger.spent(analyst, visits.policy.dataset)
        cur.execute(second)
        cur.fetchall()
        assert not cur.cached
        after = visits.ledger.spent(analyst, visits.policy.dataset)
        assert after.exact_epsilon > spent.exact_epsilon  # charged again
        cur.execute(first.lower())  # a respelling of the first replays it, free
        cur.fetchall()
        assert cur.cached
    finally:
        conn.close()


def _entries_hold_fresh_trees(visits: Service, q: Query) -> list[Any]:
    """Run ``q`` four times with its WHERE numbers shifted, then once more; after each, the
    plan-cache entry of the text must hold the canonical tree of a fresh bind and plan."""
    settings = Settings.from_policy(visits.policy)
    analyst = f"texts-{next(_analysts)}"
    texts = []
    for shift in range(4):  # seen, verified, served from the shape, then from the text
        filters = tuple(
            (*a[:-1], a[-1] + shift) if a[0] in ("cmp", "between") else a for a in q.filters
        )
        texts.append(render(replace(q, filters=filters)))
    texts.append(texts[-1])  # the plan cache's own text
    entries = []
    for text in texts:
        try:
            visits.execute(text, None, settings, analyst)
        except Error:
            assume(False)
        key = visits._plans.key(text, None, settings, analyst)
        got = visits._plans.get(key)  # type: ignore[arg-type]
        assert got is not None
        fresh = _plan(visits, text, settings, analyst)
        assert plan_text(got.plan) == plan_text(fresh), text
        assert got.fingerprint == answer_key(fresh)
        entries.append(got)
    return entries


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(q=visits_queries().filter(lambda q: q.cte is None and len(q.filters) >= 1))
def test_text_keyed_entries_hold_the_tree_a_fresh_plan_gives(visits, q):
    """Plan cache (the same text), shape cache (other WHERE numbers) and text shapes (other
    digits in the same text): what each serves is the tree a fresh bind and plan gives."""
    _entries_hold_fresh_trees(visits, q)


def test_the_shape_caches_are_exercised(visits):
    """A guard on the test above: a WHERE number is a slot, so the third text is served by the
    shape cache and the fourth from the text alone, each with the fresh tree."""
    q = Query((("cmp", "age", ">", 40), ("bool", "smoker", False)), "department", ("COUNT(*)",))
    texts_before = len(visits._texts)
    entries = _entries_hold_fresh_trees(visits, q)
    assert entries[2].shape_key is not None  # from the verified shape
    assert len(visits._texts) == texts_before + 1  # learned, then served the fourth text
    assert entries[4] is entries[3]  # the same text: the plan cache's entry


LEARNERS = [
    "SELECT * FROM dp_linear_regression('visits', label => 'cost', "
    "features => ['age', 'smoker'], epsilon => 1.0)",
    "SELECT * FROM dp_rule_list('visits', label => 'smoker', epsilon => 1.0, max_length => 2)",
]


@pytest.mark.parametrize("query", LEARNERS, ids=["regression", "rule list"])
def test_a_policy_edit_of_the_table_is_another_model(query):
    """Rule lists and regressions key their releases by their call, not a plan tree; the table
    as the policy declares it (canonical text) is part of that key, so a curator's edit of it
    (here age's range) is not answered with the model fitted under the old declaration."""
    ledger = MemoryLedger()  # one ledger behind both services: a restart on an edited policy
    edited = _visits_policy()
    edited["tables"]["visits"]["columns"]["age"]["upper"] = 90
    services = [
        dpsql.Service(_visits_policy(), ledger=ledger),
        dpsql.Service(edited, ledger=ledger),
    ]
    try:
        cached = []
        for service in (*services, services[1]):
            cur = connect_service(service, "learner").cursor()
            cur.execute(query)
            cur.fetchall()
            cached.append(cur.cached)
        assert cached == [False, False, True]
    finally:
        for service in services:
            service.close()
