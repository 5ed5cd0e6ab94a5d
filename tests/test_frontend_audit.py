"""Empirical privacy audit of the relational frontend (issue 11, item 6).

The same neighbouring-dataset audit as tests/test_privacy_audit.py (its data, policy, hooks
and estimator: D, D′ = D + one worst-case unit, Laplace at ε = 1, Clopper–Pearson at
``CONFIDENCE`` = 0.999 over all bounds of one audit, fixed seeds), for what the frontend adds:

- a **computed column**: ``SUM(CASE WHEN amount > 10 THEN 2 ELSE 0 END)``, whose range [0, 2]
  comes from interval arithmetic and is enforced by the engine's clamp;
- an **AVG of a per-query clamp**: ``AVG(LEAST(GREATEST(amount, 10), 30))`` (two measures,
  released as their ratio: post-processing, so its loss is at most ε, and smaller);
- a **CTE** phrasing of the computed SUM: the very same plan (fingerprint) and exact engine
  result as the flat query, hence, with the same seed, the very same audit, event for event;
- **post-processing wrappers** over a DP histogram: ``SELECT SUM(n) FROM (...)`` and
  ``SELECT * FROM (...) WHERE n > 2``, audited on what the analyst sees (the outer query
  applied to each bulk release; ``test_end_to_end_equals_release_then_wrapper`` checks that
  this is what the pipeline returns);
- **windows over the released aggregates** (percent of total, running total: issue 27's
  relational post-processing), audited on each department's share and running total as the
  analyst sees them, and tied to the pipeline by ``test_end_to_end_equals_release_then_wrapper``;
- a **broken mechanism**: a plan whose interval arithmetic under-states the computed
  column's range 4x ([0, 2] for a [0, 8] CASE). With the engine clamping to the plan's range
  the release stays DP (the clamp *is* the sensitivity: no violation); with the noise
  calibrated to [0, 2] but the clamp left at [0, 8], the audit must flag it;
- the **DP-subquery composition** (Superset's series limit): a noisy histogram, its top 2
  keys, the histogram over rows with those keys; 2ε in all, audited on the key set and the
  released counts, with the composite's own steps (planned outer, ``bind_released``, the
  engine per key set), tied to the DB-API end to end; and the same with the top 2 ranked by
  exact counts, which the audit must flag;
- **joins** (fixtures/star, one patient removed from every table, R and G binding): every
  exact measure of a unit join, a LEFT join, a unit_path table, a public dimension, public
  groups and a path + unit + public join moves by at most its declared bounds; the unit
  join's release passes the loss audit; a plan whose bounds are divided by R fails both.

Print the measured bounds with ``python -m pytest tests/test_frontend_audit.py -q -s``.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from conftest import as_released, declared_clips
from test_privacy_audit import (
    CONFIDENCE,
    E2E_RUNS,
    EPSILON,
    ERROR_BAR_STUBS,
    EXTRA,
    RUNS,
    RUNS_BROKEN,
    HalfNoise,
    RecordingService,
    bulk_release,
    exact_values,
    policy,
    rows_d,
    shift_and_scale,
    write_csv,
)

import dpsql.frontend.intervals as intervals
import dpsql.lower.compile as compile_module
import dpsql.privacy.release as release_module
import dpsql.service.composite as composite
from dpsql.dbapi import connect_service
from dpsql.engine.api import EngineResult
from dpsql.plan.annotated import Plan
from dpsql.privacy.audit import AuditReport, BufferedNoise, Event, audit, threshold_events
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.mechanisms import Laplace
from dpsql.privacy.release import release
from dpsql.privacy.samplers import NoiseSource, SeededNoise

COMPUTED = "SUM(CASE WHEN amount > 10 THEN 2 ELSE 0 END)"
HISTOGRAM = "SELECT dept, COUNT(*) AS n FROM t GROUP BY dept"
WIDE = "SUM(CASE WHEN amount > 10 THEN 8 ELSE 0 END)"  # [0, 8]; the broken plan says [0, 2]

#: name -> SQL. The wrappers' recorded plan is their inner histogram's (the outer query is
#: post-processing): the bulk audit applies the outer query itself (WRAPPERS).
QUERIES = {
    "computed": f"SELECT {COMPUTED} AS s FROM t",
    "computed-cte": (
        "WITH x AS (SELECT * FROM t), y AS (SELECT CASE WHEN amount > 10 THEN 2 ELSE 0 END AS c, "
        "dept FROM x) SELECT SUM(c) AS s FROM y"
    ),
    "avg-clamp": "SELECT AVG(LEAST(GREATEST(amount, 10), 30)) AS m FROM t",
    "wrapper-sum": f"SELECT SUM(n) AS total FROM ({HISTOGRAM}) AS s",
    "wrapper-where": f"SELECT * FROM ({HISTOGRAM}) AS s WHERE n > 2",
    # windows over the released aggregates (issue 27 item 2): post-processing of one DP query
    "window-share": (
        "SELECT dept, COUNT(*) AS n, COUNT(*) * 100.0 / SUM(COUNT(*)) OVER () AS pct "
        "FROM t GROUP BY dept"
    ),
    "window-running": (
        "SELECT dept, COUNT(*) AS n, SUM(COUNT(*)) OVER (ORDER BY dept) AS running "
        "FROM t GROUP BY dept"
    ),
}
#: The outer query of each wrapper, applied in Python to one release {(dept,): n}.
WRAPPERS: dict[str, Callable[[dict[tuple, float]], list[tuple[Any, ...]]]] = {
    "wrapper-sum": lambda out: [(sum(out.values()),)],
    "wrapper-where": lambda out: [(*k, v) for k, v in out.items() if v > 2],
    "window-share": lambda out: [(*k, v, v * 100.0 / sum(out.values())) for k, v in out.items()],
    "window-running": lambda out: [
        (*k, v, sum(w for j, w in out.items() if j <= k)) for k, v in out.items()
    ],
}
SEEDS = {"D": 41, "D′": 42}


@dataclass
class Recorded:
    name: str
    seed: int
    plan: Plan
    result: EngineResult
    rows: list[tuple[Any, ...]]


def run_queries(
    source: Path,
    seed: int,
    queries: dict[str, str],
    runs: int = E2E_RUNS,
    service: type[RecordingService] = RecordingService,
) -> dict[str, list[Recorded]]:
    """``runs`` executions of each query through the DB-API, with their plans and results."""
    service = service(
        policy(source, "laplace"),
        ledger=MemoryLedger(),
        noise=SeededNoise(seed),
        cache=False,
        plan_cache=0,
    )
    cursor = connect_service(service, "auditor").cursor()
    # the audited measures are the answer's (the bias measures' audit: tests/test_bias.py)
    cursor.execute("SET bias_estimate = off")
    done: list[tuple[str, list]] = []
    for name, sql in queries.items():
        for _ in range(runs):
            done.append((name, cursor.execute(sql).fetchall()))
    out: dict[str, list[Recorded]] = {name: [] for name in queries}
    for (name, rows), plan, result in zip(done, service.plans, service.results, strict=True):
        out[name].append(Recorded(name, seed, plan, result, rows))
    service.close()
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("frontend-audit")
    return {
        "D": write_csv(tmp / "d.csv", rows_d()),
        "D′": write_csv(tmp / "d2.csv", rows_d() + EXTRA),
    }


@pytest.fixture(scope="module")
def runs(sources: dict[str, Path]) -> dict[str, dict[str, list[Recorded]]]:
    return {name: run_queries(path, SEEDS[name], QUERIES) for name, path in sources.items()}


# --- statistics of one release ----------------------------------------------------------


def first_value(out: dict[tuple, float]) -> float:
    (value,) = out.values()
    return value


def releases(
    plan: Plan, result: EngineResult, source: NoiseSource, n: int
) -> Iterator[dict[tuple, float]]:
    return bulk_release(plan, result, BufferedNoise(source), n)


def scalar_audit(
    d: Recorded,
    d2: Recorded,
    statistic: Callable[[dict[tuple, float]], float],
    thresholds: np.ndarray,
    seed: int,
    n: int,
    wrap: Callable[[NoiseSource], NoiseSource] = lambda s: s,
) -> tuple[AuditReport, list[Event]]:
    """Tails and bins of ``statistic`` over ``n`` bulk releases per dataset."""
    stat_d = np.array(
        [statistic(o) for o in releases(d.plan, d.result, wrap(SeededNoise(seed)), n)]
    )
    stat_d2 = np.array(
        [statistic(o) for o in releases(d2.plan, d2.result, wrap(SeededNoise(seed + 50)), n)]
    )
    events = threshold_events("v", stat_d, stat_d2, thresholds)
    report = audit(events, n, n, epsilon=d.plan.epsilon, delta=d.plan.delta, confidence=CONFIDENCE)
    return report, events


def sum_audit(
    d: Recorded, d2: Recorded, seed: int, n: int, wrap: Callable[[NoiseSource], NoiseSource]
) -> tuple[AuditReport, list[Event]]:
    """A one-measure SUM: released − exact on D, on a grid fixed from the plan's own
    (public) sensitivity and scale, as test_privacy_audit.audit_case does."""
    exact = first_value(exact_values(d.plan, d.result))
    shift, scale = shift_and_scale(d.plan)
    grid = np.linspace(-2 * scale, shift + 2 * scale, 21)
    return scalar_audit(d, d2, lambda o: first_value(o) - exact, grid, seed, n, wrap)


def pair(runs: dict[str, dict[str, list[Recorded]]], name: str) -> tuple[Recorded, Recorded]:
    return runs["D"][name][0], runs["D′"][name][0]


# --- the pipeline releases what the bulk audit releases ----------------------------------


def test_end_to_end_equals_release_then_wrapper(runs: dict[str, dict[str, list[Recorded]]]) -> None:
    """Every run of a query has the same plan and exact engine result; replaying release()
    with the pipeline's seed, then the outer query of a wrapper, gives the rows it returned."""
    for side, by_name in runs.items():
        source = SeededNoise(SEEDS[side])  # one stream, consumed in execution order
        for name in QUERIES:
            for e in by_name[name]:
                ref = by_name[name][0]
                assert e.plan.fingerprint() == ref.plan.fingerprint(), (side, name)
                assert e.result.measures == ref.result.measures, (side, name)
                released = release(e.plan, e.result, source)
                out = dict(zip(released.key_values, as_released(e.plan, released), strict=True))
                expected = (
                    WRAPPERS[name](out) if name in WRAPPERS else [(*k, v) for k, v in out.items()]
                )
                assert _normalised(e.rows) == _normalised(_typed_as(e.rows, expected)), (
                    side,
                    name,
                )


def _typed_as(rows: list[tuple[Any, ...]], expected: list[tuple[Any, ...]]) -> list[tuple]:
    """The expected rows with each number rounded where the released column is an integer
    (SUM of an int column is released as BIGINT: a rescaled sum's fine-grid value rounded)."""
    if not rows or len(rows) != len(expected):
        return expected
    ints = [isinstance(v, int) and not isinstance(v, bool) for v in rows[0]]
    return [
        tuple(round(v) if i and isinstance(v, float) else v for v, i in zip(row, ints, strict=True))
        for row in expected
    ]


def _normalised(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Rows with numbers as floats (COUNT comes out as an int, the release as a float)."""

    def one(v: Any) -> Any:
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v

    return sorted((tuple(one(v) for v in row) for row in rows), key=repr)


def test_a_cte_is_the_flat_query(runs: dict[str, dict[str, list[Recorded]]]) -> None:
    """The CTE phrasing plans the measurement the flat query plans (range, granularity,
    sensitivity, mechanism, cost) over the very same exact aggregates: its released
    distribution, and so its privacy loss, is the flat one's. (The plan fingerprints differ:
    the inlined expression is parenthesised, so the answer cache sees two texts; each is
    charged, so that costs budget, not privacy.)"""
    for side in ("D", "D′"):
        flat, cte = runs[side]["computed"][0], runs[side]["computed-cte"][0]
        assert _measures(cte.plan) == _measures(flat.plan)
        assert cte.plan.cost == flat.plan.cost and cte.plan.keys == flat.plan.keys
        assert cte.result.measures == flat.result.measures


def _measures(plan: Plan) -> list[tuple[Any, ...]]:
    return [
        (m.kind, m.granularity, m.center, m.lo, m.hi, m.l1, m.l2, repr(m.mechanism))
        for m in plan.measures
    ]


@pytest.mark.slow
def test_the_worst_case_unit_moves_the_computed_sum_by_its_sensitivity(
    runs: dict[str, dict[str, list[Recorded]]],
) -> None:
    """After bounding (R rows) and the clamp to [0, 2], the extra unit adds exactly R·2."""
    d, d2 = pair(runs, "computed")
    (m,) = d.plan.measures
    assert (m.lo, m.hi, m.granularity) == (0, 2, 1.0)
    shift, _ = shift_and_scale(d.plan)
    moved = first_value(exact_values(d2.plan, d2.result)) - first_value(
        exact_values(d.plan, d.result)
    )
    assert moved == shift == d.plan.max_rows * 2


# --- audits of the correct release --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["computed", "computed-cte"])
def test_computed_sum_audit_finds_no_violation(
    name: str, runs: dict[str, dict[str, list[Recorded]]]
) -> None:
    """Both phrasings with the flat query's seed: the same counts on every event, no
    violation, and most of ε seen (Laplace tails: ε̂_lo 0.86 here, 0.80–0.88 over ten other
    seeds, hence >= 0.6 ε)."""
    d, d2 = pair(runs, name)
    report, events = sum_audit(d, d2, 500, RUNS, lambda s: s)
    print(f"\n[audit] {name:14s} correct: {report}")
    assert not report.violated, str(report)
    assert report.epsilon_lower >= 0.6 * report.epsilon, str(report)
    if name == "computed-cte":
        flat, flat2 = pair(runs, "computed")
        _, flat_events = sum_audit(flat, flat2, 500, RUNS, lambda s: s)
        assert events == flat_events  # the same loss, event for event


@pytest.mark.slow
def test_computed_sum_audit_catches_half_noise(runs: dict[str, dict[str, list[Recorded]]]) -> None:
    d, d2 = pair(runs, "computed")
    report, _ = sum_audit(d, d2, 510, RUNS_BROKEN, HalfNoise)
    print(f"\n[audit] computed       half-noise: {report}")
    assert report.violated, str(report)


#: AVG of the clamp, released − exact on D, in released units: a grid fixed in advance over
#: [-2, 3] (the extra unit moves the exact AVG by ~+0.9; the noise s.d. is ~1).
AVG_GRID = np.linspace(-2.0, 3.0, 26)


@pytest.mark.slow
def test_avg_of_a_clamp_audit_finds_no_violation(
    runs: dict[str, dict[str, list[Recorded]]],
) -> None:
    """AVG is the ratio of two noisy measures (ε/2 each): post-processing of an ε-DP pair,
    so no event on it may show more than ε. Power: ε̂_lo 0.50 here, 0.46–0.54 over ten other
    seeds, hence >= 0.3 ε."""
    d, d2 = pair(runs, "avg-clamp")
    assert len(d.plan.measures) == 2  # COUNT and the centred SUM of the clamp
    exact = first_value(exact_values(d.plan, d.result))
    report, _ = scalar_audit(d, d2, lambda o: first_value(o) - exact, AVG_GRID, 520, RUNS)
    print(f"\n[audit] avg-clamp      correct: {report}")
    assert not report.violated, str(report)
    assert report.epsilon_lower >= 0.3 * report.epsilon, str(report)


@pytest.mark.slow
def test_wrapper_sum_over_released_rows_audit_finds_no_violation(
    runs: dict[str, dict[str, list[Recorded]]],
) -> None:
    """SUM(n) over the released histogram (4 bins, Laplace scale G·R/ε = 6 each): the extra
    unit moves two bins by R = 3. Post-processing: at most ε; the sum of four noises shows
    part of it: ε̂_lo 0.30 here, 0.23–0.31 over ten other seeds, hence >= 0.15 ε."""
    d, d2 = pair(runs, "wrapper-sum")
    exact = sum(exact_values(d.plan, d.result).values())
    _, scale = shift_and_scale(d.plan)
    spread = 3 * scale * 2  # 3 s.d.-ish of a sum of 4 noises
    grid = np.linspace(-spread, 2 * d.plan.max_rows + spread, 25)
    total = WRAPPERS["wrapper-sum"]
    report, _ = scalar_audit(d, d2, lambda o: total(o)[0][0] - exact, grid, 560, RUNS)
    print(f"\n[audit] wrapper-sum    correct: {report}")
    assert not report.violated, str(report)
    assert report.epsilon_lower >= 0.15 * report.epsilon, str(report)


@pytest.mark.slow
def test_wrapper_where_on_released_values_audit_finds_no_violation(
    runs: dict[str, dict[str, list[Recorded]]],
) -> None:
    """``WHERE n > 2`` over the released histogram: which departments come out (dept d is
    empty on D, 3 rows on D′) and how many. Events: each department present, each row count.
    Power: ε̂_lo 0.42 here (dept d), 0.35–0.41 over ten other seeds, hence >= 0.25 ε."""
    d, d2 = pair(runs, "wrapper-where")
    keep = WRAPPERS["wrapper-where"]
    outs = {
        side: [
            {row[0] for row in keep(o)}
            for o in releases(r.plan, r.result, SeededNoise(570 + 50 * i), RUNS)
        ]
        for i, (side, r) in enumerate((("D", d), ("D′", d2)))
    }
    events = [
        Event(f"{dept} released", *(sum(dept in o for o in outs[s]) for s in ("D", "D′")))
        for dept in "abcd"
    ] + [
        Event(f"{k} rows", *(sum(len(o) == k for o in outs[s]) for s in ("D", "D′")))
        for k in range(5)
    ]
    report = audit(events, RUNS, RUNS, epsilon=d.plan.epsilon, confidence=CONFIDENCE)
    print(f"\n[audit] wrapper-where  correct: {report}")
    assert not report.violated, str(report)
    assert report.epsilon_lower >= 0.25 * report.epsilon, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["window-share", "window-running"])
def test_a_window_over_released_aggregates_audit_finds_no_violation(
    runs: dict[str, dict[str, list[Recorded]]], name: str
) -> None:
    """Windows over a DP histogram's released counts (percent of total, running total):
    the window reads only noisy outputs, so the statement's loss is the histogram's ε at
    most. Audited on what the analyst sees: each department's share (or running total) of
    the released rows, on a grid fixed from the plan's public scale."""
    d, d2 = pair(runs, name)
    window = WRAPPERS[name]
    _, scale = shift_and_scale(d.plan)
    dept = "d"  # empty on D, 3 rows of the extra unit on D′: its share and the running total

    def statistic(out: dict[tuple, float]) -> float:
        return next((r[2] for r in window(out) if r[0] == dept), 0.0)

    if name == "window-share":
        grid = np.linspace(-60.0, 60.0, 25)
    else:  # around the exact running total, wide enough for the unit's move and the noise
        exact = statistic(exact_values(d.plan, d.result))
        grid = exact + np.linspace(-6 * scale, 6 * scale + 2 * d.plan.max_rows, 25)
    report, _ = scalar_audit(d, d2, statistic, grid, 590, RUNS)
    print(f"\n[audit] {name:<14} correct: {report}")
    assert not report.violated, str(report)
    # power: ε̂_lo 0.355 (share) and 0.298 (running total) with these seeds
    assert report.epsilon_lower >= 0.15 * report.epsilon, str(report)


# --- a broken mechanism: an under-stated range of a computed column --------------------------


def _understated(original: Callable[..., intervals.Range]) -> Callable[..., intervals.Range]:
    """Interval arithmetic that under-states every range 4x (from its lower end)."""

    def value_range(node: Any, table: Any) -> intervals.Range:
        r = original(node, table)
        if not r.finite:
            return r
        return intervals.Range(r.lower, r.lower + (r.upper - r.lower) / 4, r.integral, r.unbounded)

    return value_range


class UnderstatingService(RecordingService):
    """Broken on purpose: the plan states a 4x smaller range for each computed column than
    the one the engine clamps to (sensitivity and noise from [0, 2], clamp at [0, 8]): the
    clamp no longer bounds the value to the range the noise was calibrated for."""

    def plan(self, query: Any, settings: Any, analyst: str = "") -> Plan:
        plan = super().plan(query, settings, analyst)
        table = plan.query.table
        measures = tuple(
            replace(
                m,
                row_bound=m.row_bound // 4,
                per_group_bound=m.per_group_bound // 4,
                l1=m.l1 / 4,
                l2=m.l2 / 4,
                mechanism=Laplace(l1=m.l1 / 4, epsilon=m.epsilon),
            )
            if m.column is not None and table.columns[m.column].expr is not None
            else m
            for m in plan.measures
        )
        broken_plan = plan.with_(measures=measures)
        self.plans[-1] = broken_plan
        return broken_plan


@contextlib.contextmanager
def understated_intervals() -> Iterator[None]:
    """Interval arithmetic under-stating every range 4x, wherever the binder calls it from:
    the plan's range *and* the engine's clamp follow it."""
    original = intervals.value_range
    with contextlib.ExitStack() as stack:
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("dpsql") and (
                getattr(module, "value_range", None) is original
            ):
                stack.enter_context(
                    mock.patch.object(module, "value_range", _understated(original))
                )
        yield


def broken_runs(sources: dict[str, Path], clamp: bool) -> tuple[Recorded, Recorded]:
    """One run of the [0, 8] CASE on D and D′: with ``clamp``, interval arithmetic says
    [0, 2] and the engine clamps there; without, the plan says [0, 2], the clamp stays [0, 8]."""
    query = {"wide": f"SELECT {WIDE} AS s FROM t"}
    service = RecordingService if clamp else UnderstatingService
    patch = understated_intervals() if clamp else contextlib.nullcontext()
    with patch:
        got = {
            side: run_queries(sources[side], SEEDS[side], query, runs=1, service=service)
            for side in sources
        }
    d, d2 = got["D"]["wide"][0], got["D′"]["wide"][0]
    (m,) = d.plan.measures
    assert m.per_group_bound == d.plan.max_rows * 2 * m.scale, "the range was not under-stated"
    assert (m.lo, m.hi) == ((0, 2) if clamp else (0, 8))
    return d, d2


@pytest.mark.slow
def test_an_understated_range_is_still_bounded_by_the_clamp(sources: dict[str, Path]) -> None:
    """The plan says [0, 2] for a [0, 8] CASE; the engine clamps to [0, 2], so the release is
    what it claims (less useful, still DP): the clamp's range is the sensitivity."""
    d, d2 = broken_runs(sources, clamp=True)
    moved = first_value(exact_values(d2.plan, d2.result)) - first_value(
        exact_values(d.plan, d.result)
    )
    assert moved == shift_and_scale(d.plan)[0]
    report, _ = sum_audit(d, d2, 580, RUNS, lambda s: s)
    print(f"\n[audit] understated, clamped: {report}")
    assert not report.violated, str(report)


@pytest.mark.slow
def test_audit_catches_an_understated_range_without_the_clamp(sources: dict[str, Path]) -> None:
    """The plan says [0, 2] but the engine clamps at [0, 8] (as a compiler trusting interval
    arithmetic instead of clamping would): the extra unit moves the sum by R·8 = 24 against a
    stated sensitivity of R·2 = 6. Caught."""
    d, d2 = broken_runs(sources, clamp=False)
    moved = first_value(exact_values(d2.plan, d2.result)) - first_value(
        exact_values(d.plan, d.result)
    )
    assert moved == 4 * shift_and_scale(d.plan)[0]
    report, _ = sum_audit(d, d2, 590, RUNS_BROKEN, lambda s: s)
    print(f"\n[audit] understated, unclamped: {report}")
    assert report.violated, str(report)
    assert report.epsilon_lower > 2 * EPSILON, str(report)


# --- the DP-subquery composition (Superset's series limit) ---------------------------------
#
# SELECT dept, COUNT(*) FROM t JOIN (SELECT dept AS d__, COUNT(*) AS m FROM t GROUP BY dept
# ORDER BY m DESC LIMIT 2) AS s ON dept = d__ GROUP BY dept: M1 (a noisy histogram, ε), its
# top 2 keys S (post-processing), then M2 (the histogram over rows in S, ε): 2ε in all. On D
# the exact counts are a 12, b 10, c 8, d 0; the extra unit of D′ adds R = 3 to c and to d,
# so c (11) overtakes b: a series limit that ranked exact counts would give the unit away.
# The bulk audit runs the composite's own steps (dpsql.service.composite: the planned outer,
# bind_released on the released keys, the engine on each key set) with fresh noise.

SERIES = (
    "SELECT dept, COUNT(*) AS n FROM t JOIN (SELECT dept AS d__, COUNT(*) AS m FROM t "
    "GROUP BY dept ORDER BY m DESC LIMIT 2) AS s ON dept = d__ GROUP BY dept"
)
SERIES_LIMIT = 2
SERIES_RUNS = 4000  # bulk composites per dataset


def rows_series() -> list[tuple[Any, ...]]:
    """30 units of one row: 12 in a, 10 in b, 8 in c."""
    return [(u, "a" if u < 12 else "b" if u < 22 else "c", "x", 10.0) for u in range(30)]


@dataclass
class Composite:
    """One dataset's composite: the service (its engine answers the outer query per key set),
    the inner plan and exact result, the planned outer and its query, and per E2E run the
    released key set, the outer's bound plan and exact result, and the rows returned."""

    service: RecordingService
    inner: Plan
    inner_result: EngineResult
    outer: Plan
    query: Any
    runs: list[tuple[list[Any], Plan, EngineResult, list[tuple[Any, ...]]]]
    _results: dict[tuple, EngineResult]

    def outer_result(self, keys: tuple) -> tuple[Plan, EngineResult]:
        """The bound outer plan and its exact engine result for one released key set."""
        bound = composite.bind_released(self.outer, self.query, list(keys))
        if keys not in self._results:
            compiled = compile_module.compile_plan(bound, 12345)
            self._results[keys] = self.service.engine.execute(compiled, None)
        return bound, self._results[keys]


def run_series(source: Path, seed: int, runs: int = E2E_RUNS) -> Composite:
    """``runs`` series-limit queries through the DB-API, recording the composite's steps."""
    service = RecordingService(
        policy(source, "laplace"), ledger=MemoryLedger(), noise=SeededNoise(seed), cache=False
    )
    bound_calls: list[tuple[Plan, Any, list[Any], Plan]] = []
    original = composite.bind_released

    def recording(outer: Plan, query: Any, values: list[Any]) -> Plan:
        bound = original(outer, query, values)
        bound_calls.append((outer, query, list(values), bound))
        return bound

    cursor = connect_service(service, "auditor").cursor()
    with mock.patch.object(composite, "bind_released", recording):
        rows = [cursor.execute(SERIES).fetchall() for _ in range(runs)]
    # Each composite reads twice (inner, then outer) and binds the released keys twice (to
    # read, then again for the answer's post-processing), both times to the same keys.
    assert len(service.results) == 2 * runs and len(bound_calls) == 2 * runs
    assert all(a[2] == b[2] for a, b in zip(bound_calls[0::2], bound_calls[1::2], strict=True))
    bound_calls = bound_calls[0::2]
    inner_results = service.results[0::2]
    assert all(r.measures == inner_results[0].measures for r in inner_results)
    outer, query = bound_calls[0][0], bound_calls[0][1]
    return Composite(
        service,
        service.plans[0],
        inner_results[0],
        outer,
        query,
        [
            (values, bound, result, got)
            for (_, _, values, bound), result, got in zip(
                bound_calls, service.results[1::2], rows, strict=True
            )
        ],
        {},
    )


@pytest.fixture(scope="module")
def series(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Composite]]:
    tmp = tmp_path_factory.mktemp("series")
    data = {"D": rows_series(), "D′": rows_series() + EXTRA}
    out = {
        side: run_series(write_csv(tmp / f"{i}.csv", rows), 60 + i)
        for i, (side, rows) in enumerate(data.items())
    }
    yield out
    for c in out.values():
        c.service.close()


def top_keys(released: dict[tuple, float]) -> tuple:
    """The subquery's ORDER BY m DESC LIMIT 2 on its released rows (ties by key)."""
    ranked = sorted(released.items(), key=lambda kv: (-kv[1], kv[0]))
    return tuple(sorted(k[0] for k, _ in ranked[:SERIES_LIMIT]))


def test_series_limit_end_to_end_equals_its_two_releases(series: dict[str, Composite]) -> None:
    """Replaying each run with the pipeline's seed: the inner release ranks the keys the
    composite bound (ties may fall either way), and the outer release of the bound plan on
    the recorded result is what the DB-API returned. Both measurements are charged: 2ε."""
    for side, c in series.items():
        source = SeededNoise(60 + list(series).index(side))
        assert (c.inner.cost + c.outer.cost).epsilon == 2 * EPSILON
        for values, bound, result, rows in c.runs:
            inner = release(c.inner, c.inner_result, source)
            noisy = dict(zip(inner.key_values, as_released(c.inner, inner), strict=True))
            chosen = {(v,) for v in values}
            assert len(chosen) == SERIES_LIMIT
            assert min(noisy[k] for k in chosen) >= max(
                v for k, v in noisy.items() if k not in chosen
            ), (side, noisy, values)
            outer = release(bound, result, source)
            values = as_released(bound, outer)
            expected = [(*k, v) for k, v in zip(outer.key_values, values, strict=True)]
            assert _normalised(rows) == _normalised(expected), side


def series_outputs(
    c: Composite, seed: int, n: int, exact_selection: bool = False
) -> list[dict[str, float]]:
    """``n`` bulk composites: {dept: released outer count} per run. ``exact_selection``
    (broken on purpose): the series limit ranks the exact counts instead of the released."""
    source = BufferedNoise(SeededNoise(seed))
    exact = exact_values(c.inner, c.inner_result)
    out = []
    with contextlib.ExitStack() as stack:
        for name, stub in ERROR_BAR_STUBS.items():  # post-processing; ~10x the release
            if hasattr(release_module, name):
                stack.enter_context(mock.patch.object(release_module, name, stub))
        for _ in range(n):
            inner = release(c.inner, c.inner_result, source)
            noisy = dict(zip(inner.key_values, inner.outputs[0].tolist(), strict=True))
            keys = top_keys(exact if exact_selection else noisy)
            bound, result = c.outer_result(keys)
            outer = release(bound, result, source)
            out.append(
                {k[0]: v for k, v in zip(outer.key_values, outer.outputs[0].tolist(), strict=True)}
            )
    return out


def series_audit(
    series: dict[str, Composite], n: int, exact_selection: bool, seed: int = 700
) -> AuditReport:
    """Events fixed in advance: each key set S; each dept released; the released count of c
    (−inf when c is not released) on a grid of public parameters around its exact values."""
    d, d2 = series["D"], series["D′"]
    outs = {
        side: series_outputs(c, seed + 50 * i, n, exact_selection)
        for i, (side, c) in enumerate(((("D", d)), ("D′", d2)))
    }
    subsets = [("a", "b"), ("a", "c"), ("b", "c"), ("a", "d"), ("b", "d"), ("c", "d")]
    events = [
        Event(f"S = {s}", *(sum(tuple(sorted(o)) == s for o in outs[x]) for x in ("D", "D′")))
        for s in subsets
    ] + [
        Event(f"{k} released", *(sum(k in o for o in outs[x]) for x in ("D", "D′"))) for k in "abcd"
    ]
    _, scale = shift_and_scale(d.inner)
    grid = np.linspace(8 - 2 * scale, 11 + 2 * scale, 13)
    c_counts = {x: np.array([o.get("c", -math.inf) for o in outs[x]]) for x in ("D", "D′")}
    events += threshold_events("n_c", c_counts["D"], c_counts["D′"], grid)
    epsilon = (d.inner.cost + d.outer.cost).epsilon
    return audit(events, n, n, epsilon=epsilon, confidence=CONFIDENCE)


@pytest.mark.slow
def test_series_limit_audit_finds_no_violation(series: dict[str, Composite]) -> None:
    """The composite is 2ε-DP (sequential composition): no event may show more. These data
    show about a quarter of it (the unit moves c by 3 against a noise scale of 6 in each
    stage): ε̂_lo 0.47 here, 0.41–0.51 over eight other seeds, hence >= 0.15 · 2ε."""
    report = series_audit(series, SERIES_RUNS, exact_selection=False)
    print(f"\n[audit] series limit   correct: {report}")
    assert not report.violated, str(report)
    assert report.epsilon_lower >= 0.15 * report.epsilon, str(report)


@pytest.mark.slow
def test_audit_catches_a_series_limit_ranking_exact_counts(series: dict[str, Composite]) -> None:
    """Broken on purpose: the top 2 taken from the exact counts. c is in S on D′ always and
    on D never: an unbounded loss."""
    report = series_audit(series, RUNS_BROKEN, exact_selection=True)
    print(f"\n[audit] series limit   exact ranking: {report}")
    assert report.violated, str(report)


# --- joins (fixtures/star): one patient removed from every table ---------------------------
#
# D is the star fixture, D′ the same with patient 50 removed from every table (their 9 visits
# in 6 departments, their patient row, the 17 prescriptions of their visits in 4 drugs), with
# R = 3 and G = 2, so both bounds bind for that patient. The keyed-hash secret is fixed, so the
# other patients keep the same rows on both sides. Each exact measure the engine returns may
# move by at most what the plan declares: per group its per_group_bound, over all groups its
# l1 (and l2). Then an empirical privacy-loss audit of a join's release (Laplace, ε = 1), and a
# broken plan (bounds taken as if the join kept one row per patient) that both checks catch.

JOIN_DROPPED = 50
JOIN_R, JOIN_G = 3, 2
JOIN_QUERIES = {
    "unit-join": "SELECT p.sex, COUNT(*), SUM(v.cost), AVG(p.age) FROM visits v "
    "JOIN patients p ON v.patient_id = p.patient_id GROUP BY p.sex",
    "unit-join-total": "SELECT COUNT(*) FROM visits v JOIN patients p "
    "ON v.patient_id = p.patient_id",
    "left-join": "SELECT p.sex, COUNT(*), COUNT(v.visit_id), SUM(v.cost) FROM patients p "
    "LEFT JOIN visits v ON v.patient_id = p.patient_id GROUP BY p.sex",
    "unit-path": "SELECT drug, COUNT(*), SUM(dose) FROM prescriptions GROUP BY drug",
    "public-dimension": "SELECT d.region, COUNT(*), SUM(v.cost) FROM visits v "
    "JOIN departments d ON v.dept_id = d.id GROUP BY d.region",
    "public-groups": "SELECT d.name, COUNT(v.visit_id), SUM(v.cost) FROM departments d "
    "LEFT JOIN visits v ON v.dept_id = d.id GROUP BY d.name",
    "path-unit-public": "SELECT d.name, COUNT(*), SUM(r.dose) FROM prescriptions r "
    "JOIN visits v ON r.visit_id = v.visit_id JOIN patients p ON v.patient_id = p.patient_id "
    "JOIN departments d ON v.dept_id = d.id WHERE p.sex = 'f' GROUP BY d.name",
}
#: where the dropped patient meets the declared L1 of the first COUNT: the total moves by
#: exactly R; per drug, R in each of G = 2 of their 4 drugs (they have >= 3 prescriptions of
#: two). Per department they have at most 2 visits in each, so there it is not met.
JOIN_TIGHT = {
    "unit-join-total": JOIN_R,
    "unit-path": JOIN_G * JOIN_R,
    "path-unit-public": JOIN_G * JOIN_R,
}


def star_audit_policy(tmp: Path | None) -> dict[str, Any]:
    from test_private_joins import star_policy

    drop = None if tmp is None else JOIN_DROPPED
    doc = star_policy(rows=JOIN_R, groups=JOIN_G, drop_patient=drop, tmp=tmp)
    doc["privacy"].update(epsilon=EPSILON, mechanism="laplace", budget_epsilon=1e12)
    # the joins' measures audited at the declared clamps, one engine read per query (unstated,
    # a SUM/AVG's clamp range is bought first from a kept histogram: test_default_clamp.py)
    return declared_clips(doc)


class ShrunkJoinService(RecordingService):
    """Broken on purpose: every measure's bound divided by R, as if the join kept one row per
    patient (the bounds of patients, primary_key patient_id, instead of visits'); the noise is
    calibrated to that, the engine still keeps R rows per patient."""

    def plan(self, query: Any, settings: Any, analyst: str = "") -> Plan:
        plan = super().plan(query, settings, analyst)
        r = plan.max_rows
        measures = tuple(
            replace(
                m,
                per_group_bound=m.per_group_bound // r,
                l1=m.l1 / r,
                l2=m.l2 / r,
                mechanism=Laplace(l1=m.l1 / r, epsilon=m.epsilon),
            )
            for m in plan.measures
        )
        self.plans[-1] = plan.with_(measures=measures)
        return self.plans[-1]


def run_star(
    doc: dict[str, Any], seed: int, service: type[RecordingService] = RecordingService
) -> dict[str, Recorded]:
    """One run of each join query through the DB-API, with its plan and exact result."""
    svc = service(doc, ledger=MemoryLedger(), noise=SeededNoise(seed), cache=False, plan_cache=0)
    cursor = connect_service(svc, "auditor").cursor()
    rows = [cursor.execute(sql).fetchall() for sql in JOIN_QUERIES.values()]
    assert len(svc.plans) == len(svc.results) == len(JOIN_QUERIES)
    out = {
        name: Recorded(name, seed, plan, result, got)
        for name, plan, result, got in zip(JOIN_QUERIES, svc.plans, svc.results, rows, strict=True)
    }
    svc.close()
    return out


def star_runs(
    tmp: Path, service: type[RecordingService] = RecordingService
) -> dict[str, dict[str, Recorded]]:
    import dpsql.pipeline

    with mock.patch.object(dpsql.pipeline.secrets, "randbits", lambda bits: 12345):
        return {
            "D": run_star(star_audit_policy(None), 81, service),
            "D′": run_star(star_audit_policy(tmp), 82, service),
        }


@pytest.fixture(scope="module")
def star_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Recorded]]:
    return star_runs(tmp_path_factory.mktemp("star-neighbour"))


@dataclass(frozen=True)
class Moved:
    """How far one exact measure moved between D and D′, against what the plan declares."""

    name: str
    per_group: int
    l1: int
    l2: float
    per_group_bound: int
    declared_l1: float
    declared_l2: float

    @property
    def within(self) -> bool:
        return (
            self.per_group <= self.per_group_bound
            and self.l1 <= self.declared_l1 + 1e-9
            and self.l2 <= self.declared_l2 + 1e-9
        )


def measure_moves(d: Recorded, d2: Recorded) -> list[Moved]:
    """Per measure of the plan: the change of its exact engine value, per group and summed."""
    assert _measures(d.plan) == _measures(d2.plan), "a plan reads nothing private"
    out = []
    for i, m in enumerate(d.plan.measures):
        a = dict(zip(d.result.key_rows, d.result.measures[i], strict=True))
        b = dict(zip(d2.result.key_rows, d2.result.measures[i], strict=True))
        diffs = [abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b)]
        out.append(
            Moved(
                m.name,
                max(diffs, default=0),
                sum(diffs),
                math.sqrt(sum(x * x for x in diffs)),
                m.per_group_bound,
                m.l1,
                m.l2,
            )
        )
    return out


def test_the_dropped_patient_exceeds_both_bounds() -> None:
    """Patient 50 has 9 visits (> R) in 6 departments (> G) and 17 prescriptions in 4 drugs."""
    import duckdb
    from test_private_joins import STAR

    con = duckdb.connect()
    visits, depts = con.execute(
        f"SELECT COUNT(*), COUNT(DISTINCT dept_id) FROM read_csv('{STAR / 'visits.csv'}') "
        f"WHERE patient_id = {JOIN_DROPPED}"
    ).fetchone()
    assert visits > JOIN_R and depts > JOIN_G
    con.close()


@pytest.mark.parametrize("name", list(JOIN_QUERIES))
def test_join_measures_move_within_their_declared_sensitivity(
    name: str, star_pair: dict[str, dict[str, Recorded]]
) -> None:
    """Every exact measure of each join kind moves by at most its declared bounds."""
    d, d2 = star_pair["D"][name], star_pair["D′"][name]
    moves = measure_moves(d, d2)
    shown = "; ".join(f"{m.name}: {m.l1}/{m.declared_l1:g}" for m in moves)
    print(f"\n[audit] {name:16s} {shown}")
    assert all(m.within for m in moves), moves
    assert any(m.l1 > 0 for m in moves), "the dropped patient is seen"
    if name in JOIN_TIGHT:  # the bound binds, and is met: it is not a loose one
        count = moves[0]
        m = d.plan.measures[0]
        if d.plan.group_scaling:
            # rescaled over public keys the patient's k > G groups each count G/k: its rows
            # reach R·G only when every group it is in holds R of them; here it moves the
            # count by a share of that, within the bound
            assert 0 < count.l1 <= count.declared_l1 == JOIN_TIGHT[name] * m.scale, count
        else:
            assert count.l1 == JOIN_TIGHT[name] == count.declared_l1, count


def join_count_audit(d: Recorded, d2: Recorded, seed: int, n: int) -> AuditReport:
    """The released total count of the unit join, released − exact on D, on a grid fixed from
    the plan's own (public) sensitivity and scale on both sides of it."""
    exact = first_value(exact_values(d.plan, d.result))
    shift, scale = shift_and_scale(d.plan)
    grid = np.linspace(-shift - 2 * scale, 2 * scale, 21)
    report, _ = scalar_audit(d, d2, lambda o: first_value(o) - exact, grid, seed, n)
    return report


@pytest.mark.slow
def test_unit_join_release_audit_finds_no_violation(
    star_pair: dict[str, dict[str, Recorded]],
) -> None:
    """COUNT(*) of visits ⋈ patients: the dropped patient moves it by R = 3 against a Laplace
    scale of R/ε: no violation, and most of ε seen (Laplace tails)."""
    d, d2 = star_pair["D"]["unit-join-total"], star_pair["D′"]["unit-join-total"]
    report = join_count_audit(d, d2, 600, RUNS)
    print(f"\n[audit] unit join      correct: {report}")
    assert not report.violated, str(report)
    assert report.epsilon_lower >= 0.5 * report.epsilon, str(report)


@pytest.mark.slow
def test_audit_catches_join_bounds_taken_from_the_one_row_table(tmp_path: Path) -> None:
    """Broken on purpose (ShrunkJoinService): the plans declare a third of the bounds. The
    sensitivity check sees measures move beyond them, and the release audit a loss above ε."""
    broken = star_runs(tmp_path, ShrunkJoinService)
    caught = [
        name
        for name in JOIN_QUERIES
        if not all(m.within for m in measure_moves(broken["D"][name], broken["D′"][name]))
    ]
    assert set(JOIN_TIGHT) <= set(caught), caught
    d, d2 = broken["D"]["unit-join-total"], broken["D′"]["unit-join-total"]
    report = join_count_audit(d, d2, 610, RUNS_BROKEN)
    print(f"\n[audit] unit join      bounds / R: {report}")
    assert report.violated, str(report)
    assert report.epsilon_lower > 1.5 * EPSILON, str(report)
