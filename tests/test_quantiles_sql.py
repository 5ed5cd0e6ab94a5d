"""MEDIAN, PERCENTILE_CONT/DISC, QUANTILE_CONT/DISC, MIN and MAX in SQL.

The engine counts bounded values per bin of a public grid (dpsql.lower.compile._histogram) and
the exponential mechanism releases each group's targets (dpsql.privacy.quantiles, whose
mechanism-level audits are in tests/test_quantiles.py). Here: the bin counts are of the very
rows the sums are of (same bounding, same secret), noise-off answers are the data's quantiles,
noisy answers are accurate at large ε and charged exactly, the plan tree's privacy map
matches the charge, and a miscalibrated plan is caught before anything runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import duckdb
import numpy as np
import pytest
from conftest import (
    exact_connect,
    fixture_policy,
    heavy_policy,
    rows_of,
    table_policy,
    write_csv,
)

import dpsql
from dpsql.errors import InternalError, PrivacyError
from dpsql.frontend.bind import parse_statement
from dpsql.lower.compile import compile_plan
from dpsql.pipeline import Settings
from dpsql.plan.check import check_plan
from dpsql.privacy.accounting import Cost
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise


def _plan(service, sql, **settings):
    s = Settings.from_policy(service.policy)
    s.delta = 1e-6
    s.bias_estimate = "off"  # the answer's measures (the bias ones: tests/test_bias.py)
    for k, v in settings.items():
        setattr(s, k, v)
    return service.plan(parse_statement(sql, service.policy), s)


def _per_group(result, nk):
    return {tuple(r): [m[i] for m in result.measures] for i, r in enumerate(result.key_rows)}


def _bins_per_group(hist, nk):
    out: dict[tuple, dict[int, int]] = {}
    for row, c in zip(hist.key_rows, hist.measures[0], strict=True):
        out.setdefault(tuple(row[:nk]), {})[int(row[nk])] = int(c)
    return out


BOUNDED_QUERIES = [
    "SELECT grp, COUNT(val), SUM(val), MEDIAN(val) FROM t GROUP BY grp",
    "SELECT COUNT(val), SUM(val), MAX(val) FROM t",
    "SELECT grp, COUNT(val), SUM(val), MIN(val) FROM t WHERE i < 3 GROUP BY grp",
]


@pytest.mark.parametrize("sql", BOUNDED_QUERIES)
@pytest.mark.parametrize("secret", [0, 1, 99, 2**61 + 3])
def test_bin_counts_are_of_the_rows_the_sums_are_of(tmp_path: Path, sql: str, secret: int):
    """R = 2 and G = 3 both bind (heavy_policy): per group, the histogram holds exactly the
    COUNT(val) values the main query kept, and (unit bins of an int column) their sum."""
    policy, _ = heavy_policy(tmp_path)
    service = dpsql.Service(policy, ledger=MemoryLedger())
    try:
        plan = _plan(service, sql)
        compiled = compile_plan(plan, secret)
        result = service.engine.execute(compiled)
        nk = len(plan.keys)
        main = _per_group(result, nk)
        (hist,) = result.extras
        bins = _bins_per_group(hist, nk)
        count, total = plan.measures[0], plan.measures[1]
        assert count.kind == "values" and total.kind == "sum"
        grid = plan.quantiles[0].grid
        assert grid.integer and grid.lower == 0
        for key, (n, s) in main.items():
            got = bins.get(key, {})
            assert sum(got.values()) == n
            assert sum((b - total.center) * c for b, c in got.items()) == s
        assert set(bins) <= set(main)
    finally:
        service.close()


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT department, COUNT(age), SUM(age), MEDIAN(age) FROM visits GROUP BY department",
        "SELECT diagnosis, COUNT(age), SUM(age), MAX(age) FROM visits GROUP BY diagnosis",
        "SELECT COUNT(age), SUM(age), PERCENTILE_DISC(0.9) WITHIN GROUP (ORDER BY age) "
        "FROM visits WHERE smoker",
    ],
)
@pytest.mark.parametrize("unit", [True, False])
def test_fixture_bin_counts_match_the_main_query(sql: str, unit: bool):
    policy = fixture_policy()
    if not unit:
        for key in ("privacy_unit", "max_rows_per_unit", "max_groups_per_unit"):
            policy["tables"]["visits"].pop(key)
    service = dpsql.Service(policy, ledger=MemoryLedger())
    try:
        plan = _plan(service, sql)
        result = service.engine.execute(compile_plan(plan, 4242))
        nk = len(plan.keys)
        main = _per_group(result, nk)
        bins = _bins_per_group(result.extras[0], nk)
        center = plan.measures[1].center
        for key, measures in main.items():
            n, s = measures[0], measures[1]
            got = bins.get(key, {})
            assert sum(got.values()) == n
            assert sum((b - center) * c for b, c in got.items()) == s
    finally:
        service.close()


def _clean(tmp_path: Path):
    rng = np.random.default_rng(11)
    rows = []
    for uid in range(1, 301):
        grp = ["a", "b", "c"][uid % 3]
        for _ in range(int(rng.integers(1, 3))):  # <= R = 2 rows per unit: bounds never bind
            rows.append((uid, grp, int(rng.integers(0, 91)), round(float(rng.gamma(2, 20)), 2)))
    path = write_csv(tmp_path / "c.csv", ["uid", "grp", "age", "score"], rows)
    cols = {
        "uid": {"type": "int", "nullable": False},
        "grp": {"type": "text", "values": ["a", "b", "c"], "nullable": False},
        "age": {"type": "int", "lower": 0, "upper": 90},
        "score": {"type": "float", "lower": 0.0, "upper": 400.0, "quantile_bins": 4000},
    }
    policy = table_policy(path, cols, unit="uid", rows=2, groups=1)
    ref = duckdb.connect()
    ref.execute(
        "CREATE TABLE t AS SELECT * FROM read_csv(?, header = true, "
        "columns = {'uid': 'BIGINT', 'grp': 'TEXT', 'age': 'BIGINT', 'score': 'DOUBLE'})",
        [str(path)],
    )
    return policy, ref


def test_noise_off_answers_are_the_datas_quantiles(tmp_path: Path):
    """With noise off the EM releases its best bin: MIN/MAX are the data's, a quantile lies
    between the data's quantile_disc at q ∓ 1/n (the bin boundary convention), to the bin."""
    policy, ref = _clean(tmp_path)
    conn = exact_connect(policy)
    got = rows_of(
        conn,
        "SELECT grp, MIN(age), MAX(age), MEDIAN(age), PERCENTILE_CONT(0.9) WITHIN GROUP "
        "(ORDER BY age), QUANTILE_DISC(score, 0.25) FROM t GROUP BY grp ORDER BY grp",
    )
    assert [g for g, *_ in got] == ["a", "b", "c"]
    for grp, lo, hi, med, p90, q25 in got:
        n, true_lo, true_hi = ref.execute(
            "SELECT COUNT(*), MIN(age), MAX(age) FROM t WHERE grp = ?", [grp]
        ).fetchone()
        assert (lo, hi) == (true_lo, true_hi)
        for q, value, column, width in [(0.5, med, "age", 0), (0.9, p90, "age", 0)]:
            low, high = ref.execute(
                f"SELECT quantile_disc({column}, ?), quantile_disc({column}, ?) FROM t "
                "WHERE grp = ?",
                [max(q - 1 / n, 0), min(q + 1 / n, 1), grp],
            ).fetchone()
            assert low - width <= value <= high + width
        low, high = ref.execute(
            "SELECT quantile_disc(score, ?), quantile_disc(score, ?) FROM t WHERE grp = ?",
            [0.25 - 1 / n, 0.25 + 1 / n, grp],
        ).fetchone()
        assert low - 0.1 <= q25 <= high + 0.1  # bin width 0.1: the midpoint of its bin
    conn.close()


def test_noisy_quantiles_are_accurate_and_charged(tmp_path: Path):
    """At ε = 50 the rank error is a few values; the charge is exactly the query's ε, and
    the interval columns are NULL (the guarantee is in ranks)."""
    policy, ref = _clean(tmp_path)
    ledger = MemoryLedger()
    conn = dpsql.connect(policy=policy, ledger=ledger, noise=SeededNoise(5), cache=False)
    cur = conn.cursor()
    cur.execute("SET epsilon = 50")
    cur.execute("SELECT MEDIAN(age), MEDIAN(age) AS again, MAX(score), COUNT(*) FROM t")
    med, again, top, count = cur.fetchone()
    true_med, third = ref.execute(
        "SELECT median(age), (SELECT score FROM t ORDER BY score DESC LIMIT 1 OFFSET 2) FROM t"
    ).fetchone()
    assert med == again
    assert abs(med - true_med) <= 3
    # MAX's guarantee is in ranks: every bin above the maximum is as near in rank (n), so
    # the release lands near or above the top values, never well inside the data
    assert third - 0.1 <= top <= 400
    assert abs(count - 450) < 50
    spent = ledger.spent(conn.analyst, conn.service.policy.dataset)
    # the query's ε, split in three (the Laplace share rounds as it always has: ~1e-15)
    assert float(spent.exact_epsilon) == pytest.approx(50, rel=1e-12)
    conn.close()


def test_quantile_intervals_are_null(tmp_path: Path):
    policy, _ = _clean(tmp_path)
    conn = dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=SeededNoise(1))
    cur = conn.cursor()
    cur.execute("SELECT MEDIAN(age), COUNT(*) FROM t")
    frame = cur.fetch_df()
    assert frame["median_low"].isna().all() and frame["median_high"].isna().all()
    assert not frame["count_low"].isna().any()
    cur.execute("SET confidence = 0.5")
    cur.execute("SELECT MEDIAN(age), COUNT(*) FROM t")
    assert cur.fetch_df()["median_low"].isna().all()
    conn.close()


def test_explain_states_the_mechanism_grid_and_rank_guarantee():
    conn = dpsql.connect(policy=fixture_policy(), ledger=MemoryLedger())
    text = "\n".join(
        r[0]
        for r in rows_of(
            conn,
            "EXPLAIN (FORMAT TEXT) SELECT department, MEDIAN(cost), MAX(age) FROM visits "
            "GROUP BY department",
        )
    )
    # the default grid of a wide non-negative float range: log, 6 bins per e-fold (52 = ⌈6 ln
    # 5001⌉; dpsql.privacy.defaults); an int range of <= 4096 values keeps one bin per value
    assert "52 public bins on [0, 5,000] (log bins)" in text
    assert "101 public bins on [0, 101] (one bin per value)" in text
    assert "utility sensitivity 5 x max(q, 1 − q)" in text
    assert "Quantiles q0 of cost: exponential mechanism" in text
    assert "bin counts of cost (same bounded rows)" in text
    assert conn.service.ledger.spent(conn.analyst, "visits") == Cost()
    conn.close()


def test_several_levels_of_a_column_share_one_measure():
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger())
    plan = _plan(
        service,
        "SELECT MEDIAN(age), PERCENTILE_CONT(0.25) WITHIN GROUP (ORDER BY age), "
        "QUANTILE_CONT(age, 0.75), MIN(age), MAX(age), PERCENTILE_DISC(1) WITHIN GROUP "
        "(ORDER BY age), PERCENTILE_CONT(0.1) WITHIN GROUP (ORDER BY age DESC) FROM visits",
    )
    (qm,) = plan.quantiles
    assert qm.targets == (
        ("min", None),
        ("quantile", 0.25),
        ("quantile", 0.5),
        ("quantile", 0.75),
        ("quantile", 0.9),
        ("max", None),
    )
    assert len(qm.parts) == 3  # MIN, the joint levels, MAX
    assert float(plan.cost.epsilon) == pytest.approx(1.0)
    assert plan.cost.exact_epsilon <= Cost(epsilon=1.0).exact_epsilon
    service.close()


def test_miscalibrated_quantiles_are_caught_before_running():
    """A deliberately broken plan (calibrated for 1 value per unit where R = 5) fails the IR
    check: the bound node lets a unit move each count by 5."""
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger())
    plan = _plan(service, "SELECT MEDIAN(age) FROM visits")
    broken = plan.with_(quantiles=(dataclasses.replace(plan.quantiles[0], max_values=1),))
    with pytest.raises(InternalError, match="calibrated for fewer values"):
        check_plan(broken)
    under_charged = plan.with_(
        quantiles=(dataclasses.replace(plan.quantiles[0], groups=1, max_values=5),),
    )
    check_plan(under_charged)  # G = 1 without GROUP BY: fine
    service.close()


REFUSED = [
    ("SELECT MEDIAN(diagnosis) FROM visits", "not a number", "MEDIAN(diagnosis)"),
    ("SELECT MAX(patient_id) FROM visits", "privacy unit", "MAX(patient_id)"),
    (
        "SELECT PERCENTILE_CONT(1.5) WITHIN GROUP (ORDER BY age) FROM visits",
        "level must be a number from 0 to 1",
        "1.5",
    ),
    ("SELECT PERCENTILE_CONT(0.5) FROM visits", "needs the column it orders", "PERCENTILE"),
    ("SELECT MEDIAN(DISTINCT age) FROM visits", "DISTINCT", "MEDIAN"),
    ("SELECT MIN(age, 3) FROM visits", "takes one argument", "MIN"),
    ("SELECT QUANTILE_CONT(age, 0.5 + 0.1) FROM visits", "level must be a number", "0.5"),
]


@pytest.mark.parametrize("sql, message, at", REFUSED)
def test_refusals_read_nothing_and_spend_nothing(sql: str, message: str, at: str):
    conn = dpsql.connect(policy=fixture_policy(), ledger=MemoryLedger())
    calls = []
    engine = conn.service.engine
    original = engine.execute
    engine.execute = lambda *a, **k: calls.append(a) or original(*a, **k)
    with pytest.raises(PrivacyError) as info:
        rows_of(conn, sql)
    assert message in info.value.message
    assert info.value.position is not None
    assert info.value.position.column == sql.index(at) + 1
    assert calls == []
    assert conn.service.ledger.spent(conn.analyst, "visits") == Cost()
    conn.close()


def test_unbounded_column_is_refused(tmp_path: Path):
    path = write_csv(tmp_path / "u.csv", ["x"], [(1,), (2,)])
    conn = exact_connect(table_policy(path, {"x": {"type": "int"}}))
    with pytest.raises(PrivacyError, match="needs declared bounds"):
        rows_of(conn, "SELECT MEDIAN(x) FROM t")
    conn.close()


@pytest.mark.parametrize("removed", [1, 7, 23])
@pytest.mark.parametrize(
    "sql, target_of, power",
    [
        ("SELECT grp, MEDIAN(val) FROM t GROUP BY grp", ("quantile", 0.5), True),
        # many units share the extreme values here: removing one barely moves MIN/MAX
        ("SELECT grp, MAX(val) FROM t GROUP BY grp", ("max", None), False),
        ("SELECT MIN(val) FROM t", ("min", None), False),
    ],
)
def test_neighbours_output_distributions_are_within_the_charge(
    tmp_path: Path, removed: int, sql: str, target_of, power: bool
):
    """End to end on neighbouring datasets (one unit, with all its rows, removed): the engine's
    bin counts on each, then the EM's exact output distribution per group. The log-ratio,
    summed over the groups (a unit reaches <= G of them), stays within the charged ε; a plan
    calibrated for 1 value per unit (R = 2 here) exceeds it: the check has power."""
    from dpsql.privacy.quantiles import em_probabilities, target

    policy, _ = heavy_policy(tmp_path)
    service = dpsql.Service(policy, ledger=MemoryLedger())
    csv = Path(policy["tables"]["t"]["source"])
    lines = csv.read_text().splitlines()
    neighbour = tmp_path / "n.csv"
    neighbour.write_text(
        "\n".join([lines[0], *[r for r in lines[1:] if r.split(",")[0] != str(removed)]]) + "\n"
    )
    policy2 = {**policy, "tables": {"t": {**policy["tables"]["t"], "source": str(neighbour)}}}
    other = dpsql.Service(policy2, ledger=MemoryLedger())
    try:
        plan = _plan(service, sql)
        (qm,) = plan.quantiles
        kind, q = target_of  # the score SQL uses: CDF for levels, rank for MIN/MAX
        tgt = target(kind, q, score="cdf" if kind == "quantile" else "rank")

        def distributions(svc, values_per_unit):
            hist = svc.engine.execute(compile_plan(_plan(svc, sql), 5)).extras[0]
            nk = len(plan.keys)
            per = _bins_per_group(hist, nk)
            out = {}
            for key in set(per) | {(g,) for g in ["g1", "g2", "g3", "g4", "g5"]}:
                if nk == 0 and key != ():
                    continue
                counts = np.zeros(qm.grid.bins, dtype=np.int64)
                for b, c in per.get(key, {}).items():
                    counts[b] = c
                out[key] = em_probabilities(counts, tgt, qm.part_epsilon, values_per_unit)
            return out

        for calibrated, within in [(qm.max_values, True), (1, False)][: 1 + power]:
            p, q = distributions(service, calibrated), distributions(other, calibrated)
            loss = sum(float(np.max(np.abs(np.log(p[k] / q[k])))) for k in p)
            charged = float(qm.cost.epsilon)
            assert (loss <= charged * (1 + 1e-9)) == within, (calibrated, loss, charged)
    finally:
        service.close()
        other.close()


# --- automatic clipping -------------------------------------------------------------------------


def _auto(policy: dict, column: str = "cost", **extra) -> dict:
    policy["tables"]["visits"]["columns"][column].update(clip="auto", **extra)
    return policy


def test_auto_clip_sums_clamp_to_the_released_range(tmp_path: Path):
    """Noise off, bounds that never bind: the histogram is exact, the range is chosen from it
    (well inside [0, 400] for this skewed column), and SUM/AVG are of the values clamped to
    that range; the answer's note states the range and the estimated bias."""
    import re

    policy, ref = _clean(tmp_path)
    policy["tables"]["t"]["columns"]["score"]["clip"] = "auto"
    conn = exact_connect(policy)
    cur = conn.cursor()
    cur.execute("SELECT SUM(score), COUNT(score), AVG(score) FROM t")
    total, count, mean = cur.fetchone()
    note = next(text for _, text in cur.messages if "DP range" in text)
    lo, hi = (float(x) for x in re.search(r"range \[([^,]+), ([^\]]+)\]", note).groups())
    assert lo == 0 and 0 < hi < 400
    g = conn.service.policy.tables["t"].columns["score"].granularity
    ref_sum, n = ref.execute("SELECT SUM(LEAST(score, ?)), COUNT(*) FROM t", [hi]).fetchone()
    assert count == n
    assert abs(total - ref_sum) <= n * g / 2 + 1e-6
    assert abs(mean - total / count) < 1e-9 * max(1.0, abs(mean))
    assert "biased towards zero" in note
    conn.close()


def test_auto_clip_charges_the_query_epsilon_and_explains_itself():
    ledger = MemoryLedger()
    conn = dpsql.connect(policy=_auto(fixture_policy()), ledger=ledger, noise=SeededNoise(3))
    rows = rows_of(conn, "EXPLAIN (FORMAT TEXT) SELECT SUM(cost) FROM visits")
    text = "\n".join(r[0] for r in rows)
    assert "Automatic clipping" in text and "ε 0.1 buys a noisy histogram" in text
    assert "Clipping range of cost: laplace noise of scale 50" in text  # R·G = 5 / 0.1
    assert ledger.spent(conn.analyst, "visits") == Cost()
    rows_of(conn, "SELECT department, SUM(cost), AVG(cost) FROM visits GROUP BY department")
    spent = ledger.spent(conn.analyst, "visits")
    assert float(spent.epsilon) == pytest.approx(1.0, rel=1e-12)
    conn.close()


def test_auto_clip_plan_costs_add_up_and_a_miscalibrated_clip_is_caught():
    service = dpsql.Service(_auto(fixture_policy()), ledger=MemoryLedger())
    plan = _plan(service, "SELECT department, AVG(cost) FROM visits GROUP BY department")
    (clip,) = plan.clips
    assert clip.max_values == plan.max_rows * plan.max_groups == 15
    assert float(clip.epsilon) == pytest.approx(0.1)
    from dpsql.plan.planner import with_clip_ranges

    run = with_clip_ranges(plan, {"cost": (0.0, 812.5)})
    assert run.query.table.columns["cost"].upper == 812.5 and not run.clips
    assert float((run.cost + clip.cost).epsilon) == pytest.approx(float(plan.cost.epsilon))
    broken = plan.with_(clips=(dataclasses.replace(clip, max_values=5),))
    with pytest.raises(InternalError):
        check_plan(broken)
    service.close()


def test_auto_clip_policy_errors_and_composite_refusal(tmp_path: Path):
    bad = _auto(fixture_policy(), "diagnosis")
    with pytest.raises(dpsql.Error, match="automatic clipping needs a number column"):
        dpsql.connect(policy=bad, ledger=MemoryLedger())
    bad = _auto(fixture_policy(), clip_share=1.5)
    with pytest.raises(dpsql.Error, match="clip_share"):
        dpsql.connect(policy=bad, ledger=MemoryLedger())
    conn = dpsql.connect(policy=_auto(fixture_policy()), ledger=MemoryLedger())
    with pytest.raises(dpsql.Error, match="automatic clipping is not supported"):
        rows_of(
            conn,
            "SELECT department, SUM(cost) FROM visits WHERE department IN (SELECT department "
            "FROM visits GROUP BY department ORDER BY COUNT(*) DESC LIMIT 2) GROUP BY department",
        )
    assert conn.service.ledger.spent(conn.analyst, "visits") == Cost()
    conn.close()


# --- COUNT(DISTINCT col) of a column other than the unit ----------------------------------------


@pytest.mark.parametrize("secret", [0, 7, 2**60 + 1])
def test_count_distinct_is_of_the_bounded_rows(tmp_path: Path, secret: int):
    """R = 2, G = 3 bind: per group, COUNT(DISTINCT i) is the number of distinct values among
    the rows the other measures keep (the bins of MEDIAN(i): unit bins, no clamping)."""
    policy, _ = heavy_policy(tmp_path)
    service = dpsql.Service(policy, ledger=MemoryLedger())
    try:
        plan = _plan(service, "SELECT grp, COUNT(DISTINCT i), MEDIAN(i) FROM t GROUP BY grp")
        assert [m.kind for m in plan.measures] == ["distinct"]
        result = service.engine.execute(compile_plan(plan, secret))
        from dpsql.privacy.release import group_index

        groups, exact = group_index(plan, result)
        bins = _bins_per_group(result.extras[0], 1)
        for g, row in zip(groups, exact, strict=True):
            assert row[0] == len(bins.get(g, {}))
    finally:
        service.close()


def test_count_distinct_matches_the_data_when_bounds_do_not_bind(tmp_path: Path):
    policy, ref = _clean(tmp_path)
    conn = exact_connect(policy)
    got = rows_of(
        conn, "SELECT grp, COUNT(DISTINCT age), COUNT(DISTINCT score) FROM t GROUP BY grp"
    )
    want = ref.execute(
        "SELECT grp, COUNT(DISTINCT age), COUNT(DISTINCT score) FROM t GROUP BY grp ORDER BY grp"
    ).fetchall()
    assert sorted(got) == want
    conn.close()


@pytest.mark.parametrize("removed", [2, 13, 40])
def test_count_distinct_moves_by_at_most_r_per_group_on_neighbours(tmp_path: Path, removed: int):
    """Same secret on D and D' (one unit removed): each group's exact distinct count moves by
    <= R and the total by <= R·G, the sensitivity it is noised for (L1 = G·R)."""
    policy, _ = heavy_policy(tmp_path)
    csv = Path(policy["tables"]["t"]["source"])
    lines = csv.read_text().splitlines()
    neighbour = tmp_path / "n.csv"
    neighbour.write_text(
        "\n".join([lines[0], *[r for r in lines[1:] if r.split(",")[0] != str(removed)]]) + "\n"
    )
    policy2 = {**policy, "tables": {"t": {**policy["tables"]["t"], "source": str(neighbour)}}}
    from dpsql.privacy.release import group_index

    sql = "SELECT grp, COUNT(DISTINCT i) FROM t GROUP BY grp"
    values = []
    for p in (policy, policy2):
        service = dpsql.Service(p, ledger=MemoryLedger())
        plan = _plan(service, sql)
        groups, exact = group_index(plan, service.engine.execute(compile_plan(plan, 99)))
        values.append(dict(zip(groups, (int(r[0]) for r in exact), strict=True)))
        service.close()
    (m,) = plan.measures
    assert m.l1 == plan.max_groups * plan.max_rows
    diffs = [abs(values[0][g] - values[1].get(g, 0)) for g in values[0]]
    assert max(diffs) <= plan.max_rows
    assert sum(diffs) <= plan.max_rows * plan.max_groups


def test_quantile_method_setting(tmp_path: Path):
    """SET quantile_method: 'pf' and 'smooth' answer at the same charge; smooth is MEDIAN only
    (refused, free, otherwise); unknown methods are a 22023; the setting is part of the plan."""
    policy, ref = _clean(tmp_path)
    ledger = MemoryLedger()
    conn = dpsql.connect(policy=policy, ledger=ledger, noise=SeededNoise(9), cache=False)
    cur = conn.cursor()
    cur.execute("SET epsilon = 20")
    true_med = ref.execute("SELECT median(age) FROM t").fetchone()[0]
    for method in ("em", "pf", "smooth"):
        cur.execute(f"SET quantile_method = '{method}'")
        cur.execute("SHOW quantile_method")
        assert cur.fetchone() == (method,)
        cur.execute("SELECT MEDIAN(age) FROM t")
        (med,) = cur.fetchone()
        assert abs(med - true_med) <= 5, method
    assert float(ledger.spent(conn.analyst, "default").epsilon) == pytest.approx(60)
    with pytest.raises(dpsql.Error, match="smooth-sensitivity mechanism releases MEDIAN only"):
        cur.execute("SELECT MAX(age) FROM t")
    assert float(ledger.spent(conn.analyst, "default").epsilon) == pytest.approx(60)
    with pytest.raises(dpsql.Error, match="unknown quantile_method") as info:
        cur.execute("SET quantile_method = 'magic'")
    assert info.value.sqlstate == "22023"
    cur.execute("RESET quantile_method")
    cur.execute("SHOW quantile_method")
    assert cur.fetchone() == ("em",)
    service = conn.service
    s = Settings.from_policy(service.policy)
    s.quantile_method = "pf"
    pf = service.plan(parse_statement("SELECT MEDIAN(age) FROM t", service.policy), s)
    em = _plan(service, "SELECT MEDIAN(age) FROM t")
    assert pf.fingerprint() != em.fingerprint() and pf.cost == em.cost
    conn.close()


def test_extreme_values_never_fail_the_bin_queries(tmp_path: Path):
    """NaN, ±inf, −0, denormals, huge values and NULLs: every bin expression clamps first, so
    no row can make the engine fail (a failure only on D′ would reveal the row)."""
    values = ["nan", "inf", "-inf", "-0.0", "0", "5e-324", "1e308", "-1e308", "", "3.5", "399.99"]
    rows = [(i, v) for i, v in enumerate(values, start=1)]
    path = write_csv(tmp_path / "x.csv", ["uid", "x"], rows)
    cols = {
        "uid": {"type": "int", "nullable": False},
        "x": {"type": "float", "lower": 0.0, "upper": 400.0, "clip": "auto"},
    }
    for unit in ("uid", None):
        conn = exact_connect(table_policy(path, cols, unit=unit, rows=1, groups=1))
        got = rows_of(
            conn,
            "SELECT MEDIAN(x), MIN(x), MAX(x), QUANTILE_CONT(x, 0.9), COUNT(DISTINCT x), "
            "SUM(x), AVG(x) FROM t",
        )
        assert len(got) == 1 and all(v is not None for v in got[0][:5])
        conn.close()
    cols["x"]["quantile_grid"] = "log"
    conn = exact_connect(table_policy(path, cols, unit="uid", rows=1, groups=1))
    assert len(rows_of(conn, "SELECT MEDIAN(x), SUM(x) FROM t")) == 1
    conn.close()


@pytest.mark.parametrize("secret", [3, 2**62 - 1])
def test_bin_counts_match_a_store_backed_main_query(tmp_path: Path, secret: int):
    """With the prepared store on, the main query runs over the store (dpsql.lower.prepared_plan)
    and the bin counts over the table: both bound the same rows for the same secret."""
    from test_prepared_store import _with_store

    policy, _ = heavy_policy(tmp_path)
    service = dpsql.Service(_with_store(policy), ledger=MemoryLedger())
    try:
        plan = _plan(service, "SELECT grp, COUNT(val), SUM(val), MEDIAN(val) FROM t GROUP BY grp")
        compiled = compile_plan(plan, secret)
        assert "__dp_store_t" in compiled.render()  # the main query reads the store
        result = service.engine.execute(compiled)
        main = _per_group(result, 1)
        bins = _bins_per_group(result.extras[0], 1)
        center = plan.measures[1].center
        for key, (n, s) in main.items():
            got = bins.get(key, {})
            assert sum(got.values()) == n
            assert sum((b - center) * c for b, c in got.items()) == s
    finally:
        service.close()
