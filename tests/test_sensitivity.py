"""The sensitivity table of grammar_notes.md, rule by rule, on the plans dpsql builds.

Neighbours: add or remove one privacy unit with all its rows. R = max_rows_per_unit, G =
max_groups_per_unit (1 without GROUP BY, 1 for row-level tables, min(G, bins) for a public
domain). Values are in the plan's integer (fixed-point) units; EXPLAIN shows them × g.
"""

from __future__ import annotations

import math

import pytest
from conftest import table_policy, write_csv

import dpsql
from dpsql.dbapi import connect_service
from dpsql.frontend.bind import parse_statement
from dpsql.pipeline import Settings
from dpsql.plan.annotated import Plan
from dpsql.privacy.accounting import Cost
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.mechanisms import Gaussian, Laplace, analytic_gaussian_sigma

R, G = 3, 4
COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "grp": {"type": "text", "values": ["a", "b", "c", "d", "e", "f"], "nullable": False},
    "flag": {"type": "bool", "nullable": False},
    "maybe": {"type": "bool", "nullable": True},  # false, true, NULL
    # clip "declared": these tests pin the sensitivities at the declared bounds and the split
    # of the query's whole ε (unstated, a SUM/AVG's clamp range is bought first from a share of
    # it: dpsql.service.bounds; that accounting is test_a_pending_clamp_choice_takes_its_share)
    "cost": {"type": "float", "lower": 0.0, "upper": 5000.0, "clip": "declared"},
    "n": {"type": "int", "lower": -5, "upper": 10, "clip": "declared"},
    "name": {"type": "text"},
}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    base = tmp_path_factory.mktemp("sens")
    t = write_csv(base / "t.csv", list(COLUMNS), [(1, "a", True, None, 1.0, 2, "x")])
    r = write_csv(base / "r.csv", ["k", "x"], [("a", 1)])
    policy = table_policy(t, COLUMNS, unit="uid", rows=R, groups=G)
    policy["tables"]["r"] = {
        "source": str(r),
        "columns": {
            "k": {"type": "text", "values": ["a", "b", "c"], "nullable": False},
            "x": {"type": "int", "lower": 0, "upper": 10},
        },
    }
    svc = dpsql.Service(policy, ledger=MemoryLedger())
    yield svc
    svc.close()


def plan_of(service, sql, epsilon=1.0, delta=1e-6, mechanism="laplace", selection="auto") -> Plan:
    settings = Settings(epsilon, delta, mechanism, partition_selection=selection)
    return service.plan(parse_statement(sql, service.policy), settings)


def only(plan: Plan, kind: str, column: str | None = None):
    (m,) = [m for m in plan.measures if m.kind == kind and (column is None or m.column == column)]
    return m


def fixed(service, column: str) -> tuple[int, int, float]:
    """The column's integer range [lo, hi] and granularity g, as the plan must use them."""
    col = service.policy.tables["t"].columns[column]
    g = col.granularity
    return round(col.lower / g), round(col.upper / g), g


# -- COUNT ----------------------------------------------------------------------------------


def test_count_without_group_by(service):
    plan = plan_of(service, "SELECT COUNT(*) FROM t")
    m = only(plan, "rows")
    assert plan.max_rows == R and plan.max_groups == 1
    assert (m.row_bound, m.per_group_bound, m.l1, m.l2) == (1, R, R, R)


def test_count_group_by_public_key(service):
    plan = plan_of(service, "SELECT grp, COUNT(*) FROM t GROUP BY grp")  # 6 bins >= G
    m = only(plan, "rows")
    assert plan.max_groups == G
    # more bins than G (public keys, rescaled): a unit's k groups count G/k each, on a fine
    # grid of 2^20 units per row, rounded per unit back to whole rows (dpsql.plan.values,
    # ROUNDED_KINDS): an integer count with the sampled plan's sensitivities
    assert plan.group_scaling and (m.scale, m.fine) == (1, 2**20)
    assert m.l1 == G * R * m.scale
    assert m.l2 == pytest.approx(math.sqrt(G) * R * m.scale)


@pytest.mark.parametrize(
    ("keys", "bins"),
    [("flag", 2), ("maybe", 3), ("grp, flag", 12), ("CASE WHEN n < 0 THEN 'neg' END", 2)],
)
def test_groups_capped_by_number_of_public_bins(service, keys, bins):
    plan = plan_of(service, f"SELECT COUNT(*) FROM t GROUP BY {keys}")
    assert plan.threshold is None
    assert plan.max_groups == min(G, bins)
    m = only(plan, "rows")
    assert plan.group_scaling == (bins > G) and m.fine == (2**20 if bins > G else 1)
    assert m.scale == 1  # rounded per unit to whole rows
    assert m.l1 == min(G, bins) * R * m.scale
    assert m.l2 == pytest.approx(math.sqrt(min(G, bins)) * R * m.scale)


def test_count_column_has_the_count_sensitivity(service):
    plan = plan_of(service, "SELECT grp, COUNT(cost) FROM t GROUP BY grp")
    m = only(plan, "values", "cost")
    # bounding = "scale": the engine counts in a finer grid of m.scale units (1 if "sample")
    assert (m.row_bound, m.l1) == (1, G * R * m.scale)
    assert m.l2 == pytest.approx(math.sqrt(G) * R * m.scale)


def test_count_distinct_units(service):
    m = only(plan_of(service, "SELECT COUNT(DISTINCT uid) FROM t"), "units")
    assert (m.per_group_bound, m.l1, m.l2) == (1, 1, 1)
    m = only(plan_of(service, "SELECT grp, COUNT(DISTINCT uid) FROM t GROUP BY grp"), "units")
    assert (m.per_group_bound, m.l1) == (m.scale, G * m.scale)  # G/k per group: fine grid
    assert m.l2 == pytest.approx(math.sqrt(G) * m.scale)


def test_row_level_table_has_r_and_g_of_one(service):
    plan = plan_of(service, "SELECT k, COUNT(*), SUM(x) FROM r GROUP BY k")
    assert (plan.max_rows, plan.max_groups) == (1, 1)
    assert only(plan, "rows").l1 == 1
    assert only(plan, "sum").l1 == 10


# -- SUM, AVG, VAR --------------------------------------------------------------------------


def test_sum_alone_is_uncentred(service):
    lo, hi, g = fixed(service, "cost")
    m = only(plan_of(service, "SELECT SUM(cost) FROM t"), "sum")
    assert (m.center, m.lo, m.hi, m.granularity) == (0, lo, hi, g)
    assert m.row_bound == max(abs(lo), abs(hi))
    assert m.l1 == R * max(abs(lo), abs(hi)) * m.scale
    m = only(plan_of(service, "SELECT grp, SUM(n) FROM t GROUP BY grp"), "sum")
    assert m.row_bound == 10 and m.l1 == G * R * 10 * m.scale
    assert m.l2 == pytest.approx(math.sqrt(G) * R * 10 * m.scale)
    # COUNT(*) counts rows, not the column: the sum stays uncentred
    assert only(plan_of(service, "SELECT SUM(n), COUNT(*) FROM t"), "sum").center == 0


def test_sum_is_centred_when_its_count_is_released(service):
    lo, hi, _ = fixed(service, "cost")
    m = only(plan_of(service, "SELECT SUM(cost), COUNT(cost) FROM t"), "sum")
    assert m.center == (lo + hi) // 2
    assert m.row_bound == max(m.center - lo, hi - m.center)
    assert m.l1 == R * m.row_bound * m.scale < R * max(abs(lo), abs(hi)) * m.scale
    m = only(plan_of(service, "SELECT SUM(n), COUNT(n) FROM t"), "sum")
    assert (m.center, m.row_bound, m.l1) == (2, 8, R * 8 * m.scale)  # c = (-5 + 10) // 2


def test_avg_is_a_centred_sum_over_a_count(service):
    plan = plan_of(service, "SELECT grp, AVG(cost) FROM t GROUP BY grp", epsilon=0.8)
    s, n = only(plan, "sum", "cost"), only(plan, "values", "cost")
    lo, hi, _ = fixed(service, "cost")
    assert s.center == (lo + hi) // 2 and s.l1 == G * R * s.row_bound * s.scale
    assert n.l1 == G * R * n.scale
    assert s.epsilon == n.epsilon == pytest.approx(0.4)
    (out,) = plan.outputs
    assert out.measures == (s.name, n.name) and (out.lower, out.upper) == (0.0, 5000.0)


def test_a_pending_clamp_choice_takes_its_share(tmp_path):
    """Unstated clip (the default): a plan whose clamp range is not bought yet leaves
    ``bounds_share`` of the query's ε to the choice (its own ledger entry, charged before the
    query reads: dpsql.service.bounds) and splits the rest over its measures as above: the two
    add up to the query's ε exactly (charged once per data version: test_default_clamp.py)."""
    columns = {k: {kk: vv for kk, vv in v.items() if kk != "clip"} for k, v in COLUMNS.items()}
    t = write_csv(tmp_path / "t.csv", list(columns), [(1, "a", True, None, 1.0, 2, "x")])
    svc = dpsql.Service(
        table_policy(t, columns, unit="uid", rows=R, groups=G), ledger=MemoryLedger()
    )
    try:
        plan = plan_of(svc, "SELECT grp, AVG(cost) FROM t GROUP BY grp", epsilon=0.8)
        pending = plan.extra["bounds"].pending
        share = svc.policy.tables["t"].bounds_share
        assert [n.kind for n in pending.needs] == ["clip"]
        assert pending.cost.epsilon == pytest.approx(0.8 * share)
        s, n = only(plan, "sum", "cost"), only(plan, "values", "cost")
        assert s.epsilon == n.epsilon == pytest.approx(0.8 * (1 - share) / 2)
        assert float(pending.cost.exact_epsilon + plan.cost.exact_epsilon) == pytest.approx(0.8)
    finally:
        svc.close()


def test_variance_uses_sum_of_centred_squares(service):
    plan = plan_of(service, "SELECT VAR_SAMP(n) FROM t")
    s, n, q = only(plan, "sum", "n"), only(plan, "values", "n"), only(plan, "sumsq", "n")
    assert {m.name for m in plan.measures} == {s.name, n.name, q.name}
    span = s.row_bound**2  # centred values lie in [-8, 8]: squares in [0, 64]
    assert (span, q.center2) == (64, 32)
    assert q.row_bound == max(q.center2, span - q.center2) == 32
    assert q.l1 == R * 32 * q.scale
    assert q.granularity == s.granularity**2


# -- budget split and mechanisms ------------------------------------------------------------


def test_epsilon_is_split_to_minimise_the_error(service):
    # Issue 17: ε_i ∝ C_i^(1/3) (dpsql.plan.sharing.split) instead of ε/k for every measure
    # (this test pinned the equal split before). Sum and count of AVG(n) weigh the same (the
    # minimax weights: equal shares); COUNT(*) and the uncentred SUM(cost) weigh 1 each
    # (count: X/N; SUM over [0, M]: X·M/(N·M)).
    plan = plan_of(service, "SELECT COUNT(*), SUM(cost), AVG(n) FROM t", epsilon=2.0)
    assert [m.kind for m in plan.measures] == ["rows", "sum", "sum", "values"]
    rows, cost_sum, n_sum, n_count = (m.epsilon for m in plan.measures)
    assert rows == pytest.approx(cost_sum) and n_sum == pytest.approx(n_count)
    h, m = 8, 10  # n in [-5, 10], centred on 2: per-row bound 8, scale 10
    assert n_sum / rows == pytest.approx(((h / m) ** 2) ** (1 / 3))
    assert sum(m.epsilon for m in plan.measures) <= 2.0
    assert plan.cost == Cost(epsilon=pytest.approx(2.0))
    # a measure shared by two outputs is drawn once and charged once
    shared = plan_of(service, "SELECT AVG(cost), COUNT(cost), SUM(cost) FROM t")
    assert len(shared.measures) == 2
    total, count = shared.measures  # the count serves AVG, COUNT and the centred SUM
    assert count.epsilon > total.epsilon and total.epsilon + count.epsilon == pytest.approx(1)


def test_laplace_scale_is_l1_over_epsilon_share(service):
    plan = plan_of(service, "SELECT grp, COUNT(*), SUM(n) FROM t GROUP BY grp", epsilon=0.5)
    for m in plan.measures:
        assert isinstance(m.mechanism, Laplace)
        assert m.mechanism.l1 == m.l1 and m.mechanism.epsilon == 0.25
        assert m.mechanism.scale == pytest.approx(m.l1 / 0.25)
        assert m.delta == 0
    assert plan.cost == Cost(epsilon=0.5)


def test_gaussian_splits_delta_and_uses_the_analytic_sigma(service):
    plan = plan_of(
        service, "SELECT grp, COUNT(*), AVG(n) FROM t GROUP BY grp", 0.9, 3e-6, "gaussian"
    )
    k = len(plan.measures)
    assert k == 3
    rho = 0.0
    for m in plan.measures:
        assert isinstance(m.mechanism, Gaussian)
        assert m.delta == pytest.approx(1e-6)  # δ is split equally, ε by dpsql.plan.sharing
        sigma = analytic_gaussian_sigma(m.l2, m.epsilon, 1e-6)
        assert m.mechanism.scale == pytest.approx(sigma)
        assert m.mechanism.cost.rho == pytest.approx(m.l2**2 / (2 * sigma**2))
        rho += m.mechanism.cost.rho
    assert plan.cost.epsilon == 0 and plan.cost.delta == 0
    assert plan.cost.rho == pytest.approx(rho)
    assert sum(m.epsilon for m in plan.measures) == pytest.approx(0.9)


# -- thresholding ---------------------------------------------------------------------------


def test_laplace_threshold_takes_delta_and_keeps_g(service):
    plan = plan_of(
        service, "SELECT name, COUNT(*) FROM t GROUP BY name", 1.0, 1e-6, "laplace", "threshold"
    )
    assert plan.max_groups == G  # no public domain to cap G
    units = only(plan, "units")  # added for the threshold though not asked for
    assert [m.kind for m in plan.measures] == ["rows", "units"]
    assert units.l1 == G
    rows = only(plan, "rows")  # R > 1: the row count is not the unit count
    assert units.epsilon + rows.epsilon == pytest.approx(1.0)
    th = plan.threshold
    assert th.measure == units.name and th.delta == 1e-6
    assert th.tau == units.mechanism.threshold(1e-6, G)
    # P(1 + X >= tau) <= delta / G for the discrete Laplace noise of the units measure
    q = math.exp(-1 / units.mechanism.scale)
    assert q ** (th.tau - 1) / (1 + q) <= 1e-6 / G < q ** (th.tau - 2) / (1 + q)
    assert plan.cost == Cost(epsilon=pytest.approx(1.0), delta=1e-6)


def test_gaussian_threshold_takes_half_of_delta(service):
    plan = plan_of(
        service, "SELECT name, COUNT(*) FROM t GROUP BY name", 1.0, 4e-6, "gaussian", "threshold"
    )
    th = plan.threshold
    assert th.delta == pytest.approx(2e-6)
    assert all(m.delta == pytest.approx(1e-6) for m in plan.measures)  # (4e-6 / 2) / 2
    units = only(plan, "units")
    assert th.tau == units.mechanism.threshold(2e-6, G)
    assert plan.cost.delta == pytest.approx(2e-6) and plan.cost.rho > 0


def test_public_and_non_public_keys_together_are_thresholded(service):
    plan = plan_of(service, "SELECT grp, name, COUNT(*) FROM t GROUP BY grp, name")
    assert plan.selection is not None and plan.max_groups == G  # auto: optimal here
    threshold = plan_of(
        service, "SELECT grp, name, COUNT(*) FROM t GROUP BY grp, name", selection="threshold"
    )
    assert threshold.threshold is not None and threshold.max_groups == G
    assert [k.domain is None for k in plan.keys] == [False, True]


# -- EXPLAIN shows the plan -----------------------------------------------------------------


def test_explain_rows_match_the_plan(service):
    sql = "SELECT name, COUNT(*), AVG(cost) FROM t GROUP BY name"
    plan = plan_of(service, sql, 0.6, 1e-6, "laplace", "threshold")
    conn = connect_service(service, "explainer")
    cur = conn.cursor()
    cur.execute("SET epsilon = 0.6")
    cur.execute("SET partition_selection = 'threshold'")
    cur.execute("SET bias_estimate = off")  # plan_of's split (the bias rows: test_bias.py)
    cur.execute("EXPLAIN " + sql)
    rows = cur.fetchall()
    measures = [plan.measure(name) for o in plan.outputs for name in o.measures]
    for row, m in zip(rows, measures, strict=False):
        g = m.unit  # the answer's units (a rescaled measure's fine grid divided out)
        assert row[2] == "laplace"
        assert row[3] == pytest.approx(m.l1 * g) and row[4] == pytest.approx(m.l2 * g)
        assert row[5] == pytest.approx(m.mechanism.scale * g)
        assert row[6] == pytest.approx(m.epsilon)
        assert row[9] == pytest.approx(m.mechanism.interval_halfwidth() * g)
    tau_row = rows[len(measures)]
    assert tau_row[1] == f"units >= tau = {plan.threshold.tau:g}"
    assert tau_row[7] == pytest.approx(1e-6)
    total = next(r for r in rows if r[0] == "total")
    assert total[1] == f"R={R} rows/group, G={G} groups/unit"
    assert total[6] == pytest.approx(0.6) and total[7] == pytest.approx(1e-6)
    assert service.ledger.spent("explainer", service.policy.dataset) == Cost()


def test_public_keys_alone_have_nothing_to_noise(service):
    """SELECT grp ... GROUP BY grp releases the declared domain: public, so it costs nothing."""
    plan = plan_of(service, "SELECT grp FROM t GROUP BY grp")
    assert plan.measures == () and plan.cost == Cost()
    conn = connect_service(service, "keys-only")
    cur = conn.cursor()
    cur.execute("SELECT grp FROM t GROUP BY grp")
    assert cur.fetchall() == [(g,) for g in "abcdef"]
    assert service.ledger.spent("keys-only", service.policy.dataset) == Cost()


def test_ranges_that_overflow_64_bit_squares_are_refused(tmp_path):
    """Squares of values over 2**31.5 overflow BIGINT in the engine; an overflow that only some
    rows trigger would be a data-dependent error, so VAR/STDDEV refuse such columns up front."""
    from conftest import EngineSpy, exact_connect

    path = write_csv(tmp_path / "o.csv", ["uid", "x", "y"], [(1, 999999.0, 10**10)])
    cols = {
        "uid": {"type": "int"},
        "x": {"type": "float", "lower": 0, "upper": 1e6, "granularity": 1e-4},
        "y": {"type": "int", "lower": 0, "upper": 10**10},
    }
    with exact_connect(table_policy(path, cols, unit="uid")) as conn:
        spy = EngineSpy(conn.service)
        for sql in ("SELECT VAR_POP(x) FROM t", "SELECT STDDEV(y) FROM t WHERE uid = 1"):
            with pytest.raises(dpsql.NotSupportedError, match="too large") as info:
                conn.cursor().execute(sql)
            assert "granularity" in info.value.hint
        assert spy.calls == 0
        assert conn.cursor().execute("SELECT SUM(x), SUM(y) FROM t").fetchall() == [
            (999999.0, 10**10)
        ]


def test_rescaled_measures_count_in_a_fine_grid_of_at_least_2_to_20_units_per_row():
    """bounding = "scale": a measure summed from row values is computed in m.scale units per
    integer, the smallest power of two putting a row's largest value at >= 2^20 units (the
    truncation of a pair's R/n share then loses < 2^-20 of a row); row counts stay exact."""
    from dpsql.plan.values import rescale_factor

    assert [rescale_factor(b) for b in (1, 2, 3, 1 << 20, (1 << 20) + 1, 1 << 40)] == [
        1 << 20,
        1 << 19,
        1 << 19,
        1,
        1,
        1,
    ]
    for bound in range(1, 5000, 7):
        scale = rescale_factor(bound)
        assert scale * bound >= 1 << 20 and (scale == 1 or scale * bound < 1 << 21)


def test_sampled_and_rescaled_plans_have_the_same_sensitivity_in_released_units(service):
    sql = "SELECT grp, COUNT(*), SUM(cost), AVG(n), VAR_POP(n) FROM t GROUP BY grp"
    scaled = plan_of(service, sql)
    policy = service.policy
    table = policy.tables["t"]
    import dataclasses

    sampled_policy = dataclasses.replace(
        policy, tables={**policy.tables, "t": dataclasses.replace(table, bounding="sample")}
    )
    sampled_service = dpsql.Service(sampled_policy, ledger=MemoryLedger())
    try:
        sampled = plan_of(sampled_service, sql)
    finally:
        sampled_service.close()
    assert (scaled.bounding, sampled.bounding) == ("scale", "sample")
    for a, b in zip(scaled.measures, sampled.measures, strict=True):
        assert b.scale == 1 and a.scale >= 1
        assert a.l1 / a.scale == b.l1 and a.l2 / a.scale == pytest.approx(b.l2)
        assert a.per_group_bound == b.per_group_bound * a.scale
        assert a.mechanism.scale / a.scale == pytest.approx(b.mechanism.scale)
    assert scaled.cost == sampled.cost
