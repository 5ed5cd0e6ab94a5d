"""The plan tree: each node's stability, each measurement's privacy map, and the check that
the cost a plan charges equals the sum of those maps (a broken planner is caught)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import exact_connect, fixture_policy

from dpsql.errors import InternalError
from dpsql.frontend.bind import parse_statement
from dpsql.plan.check import check_plan
from dpsql.plan.measures import Measurement
from dpsql.plan.tree import tree_lines
from dpsql.privacy.mechanisms import Gaussian, Laplace

QUERIES = [
    "SELECT COUNT(*) FROM visits",
    "SELECT department, COUNT(*), AVG(age), SUM(cost) FROM visits GROUP BY department",
    "SELECT diagnosis, VARIANCE(cost), COUNT(DISTINCT patient_id) FROM visits GROUP BY 1",
    "SELECT SUM(CASE WHEN smoker THEN 1 ELSE 0 END), AVG(age * 2) FROM visits",
    "WITH v AS (SELECT * FROM visits WHERE age > 40) SELECT smoker, STDDEV(cost) FROM v GROUP BY 1",
]


@pytest.fixture(scope="module")
def conn():
    c = exact_connect(fixture_policy())
    yield c
    c.close()


def _plan(conn, sql, **settings):
    s = conn._settings
    if settings:
        s = dataclasses.replace(s, **settings)
    return conn.service.plan(parse_statement(sql, conn.service.policy), s)


@pytest.mark.parametrize("mechanism", ["laplace", "gaussian"])
@pytest.mark.parametrize("sql", QUERIES)
def test_charged_cost_is_the_sum_of_the_privacy_maps(conn, sql, mechanism):
    plan = _plan(conn, sql, mechanism=mechanism, delta=1e-6)
    release = plan.release
    mapped, charged = release.cost(), plan.cost
    assert mapped.epsilon == pytest.approx(charged.epsilon, rel=1e-9)
    assert mapped.rho == pytest.approx(charged.rho, rel=1e-9)
    assert mapped.delta == pytest.approx(charged.delta, rel=1e-9)
    check_plan(plan)


def test_the_tree_states_each_node(conn):
    plan = _plan(conn, QUERIES[4])
    lines = tree_lines(plan.root)
    heads = [line.strip().split(" ")[0] for line in lines]
    assert heads[0] == "PostProcess" and heads[-1] == "Scan"
    for node in ("Release", "Aggregate", "Bound", "Filter"):
        assert node in heads
    assert all(
        "--" in line for line in lines if not line.strip().startswith(("Measure", "Threshold"))
    )


def test_explain_shows_the_plan_tree(conn):
    cur = conn.cursor()
    cur.execute("EXPLAIN " + QUERIES[1])
    tree = [r[1] for r in cur.fetchall() if r[0] == "plan"]
    assert tree[0].startswith("PostProcess") and tree[-1].strip().startswith("Scan visits")


def test_a_mechanism_calibrated_to_a_smaller_sensitivity_is_caught(conn):
    """A planner bug that noises SUM(cost) as if one unit changed it by one row's range
    (forgetting R and G) must fail the check before any data is read."""
    plan = _plan(conn, "SELECT SUM(cost) FROM visits", bias_estimate="off")
    (m,) = plan.measures
    broken = dataclasses.replace(
        m, l1=m.row_bound, mechanism=Laplace(l1=float(m.row_bound), epsilon=m.epsilon)
    )
    with pytest.raises(InternalError, match="smaller sensitivity"):
        check_plan(plan.with_(measures=(broken,)))


def test_a_cost_that_omits_a_measurement_is_caught(conn):
    plan = _plan(conn, "SELECT COUNT(*), AVG(age) FROM visits")
    cheaper = plan.with_(cost=plan.measures[0].mechanism.cost)
    with pytest.raises(InternalError, match="charges epsilon"):
        check_plan(cheaper)


def test_privacy_maps_of_the_mechanisms():
    lap = Measurement("m", Laplace(l1=6.0, epsilon=0.5), l1=6.0, l2=0.0)
    assert lap.privacy_map().epsilon == pytest.approx(0.5)
    # at half the sensitivity the same noise costs half
    assert dataclasses.replace(lap, l1=3.0).privacy_map().epsilon == pytest.approx(0.25)
    gauss = Gaussian(l2=2.0, epsilon=1.0, delta=1e-6)
    g = Measurement("m", gauss, l1=0.0, l2=2.0)
    assert g.privacy_map().rho == pytest.approx(2.0**2 / (2 * gauss.scale**2))


def test_explain_format_text_is_readable_and_free(conn):
    cur = conn.cursor()
    spent = conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)
    cur.execute("EXPLAIN (FORMAT TEXT) SELECT department, AVG(cost) AS a FROM visits GROUP BY 1")
    assert [d[0] for d in cur.description] == ["QUERY PLAN"]
    text = "\n".join(r[0] for r in cur.fetchall())
    for section in (
        "Released values",
        "Groups",
        "Contribution bounds",
        "Cost",
        "Plan tree",
        "Engine SQL",
    ):
        assert section in text
    assert "the average of a group of n rows" in text and "public domain of 6 values" in text
    assert "values(" not in text.split("Plan tree")[0]  # plain words before the tree
    assert conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset) == spent
    with pytest.raises(Exception, match="FORMAT TEXT"):
        cur.execute("EXPLAIN (FORMAT XML) SELECT COUNT(*) FROM visits")


def test_each_mechanism_states_its_own_privacy_map():
    """The map sits on the mechanism (OpenDP style): evaluated at the sensitivity the nodes
    derive, it is the calibrated cost at the calibrated sensitivity, grows with a larger one,
    and a noiseless mechanism on a query that can change costs infinity."""
    lap = Laplace(l1=4.0, epsilon=0.5)
    assert lap.privacy_map(4.0, 0.0) == lap.cost
    assert lap.privacy_map(8.0, 0.0).epsilon == pytest.approx(1.0)
    assert Laplace(l1=0.0, epsilon=0.5).privacy_map(1.0, 0.0).epsilon == float("inf")
    gauss = Gaussian(l2=2.0, epsilon=1.0, delta=1e-6)
    assert gauss.privacy_map(0.0, 2.0).rho == pytest.approx(gauss.rho)
    assert gauss.privacy_map(0.0, 4.0).rho == pytest.approx(4 * gauss.rho)
    assert Gaussian(l2=0.0, epsilon=1.0, delta=1e-6).privacy_map(0.0, 1.0).rho == float("inf")


def test_the_plan_is_its_tree(conn):
    """The plan's reads are its nodes' fields (no second record), and a changed plan is a new
    tree whose Bound node reads the new query's rows."""
    plan = _plan(conn, "SELECT department, AVG(cost) FROM visits WHERE age > 30 GROUP BY 1")
    bound, aggregate = plan.bound, plan.aggregate
    assert plan.root.input is plan.release and aggregate.input is bound
    assert (plan.max_rows, plan.max_groups, plan.bounding) == (
        bound.max_rows,
        bound.max_groups,
        bound.method,
    )
    assert plan.measures is aggregate.measures and plan.keys is aggregate.keys
    other = _plan(conn, "SELECT department, AVG(cost) FROM visits WHERE age > 40 GROUP BY 1")
    moved = plan.with_(query=other.query)
    assert moved == other and moved.query is other.query
    assert "40" in moved.bound.input.describe() and "30" in bound.input.describe()
    assert moved.fingerprint() != plan.fingerprint()
