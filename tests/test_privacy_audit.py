"""Empirical privacy audit of the whole release path (issue 3, item 6).

For COUNT, SUM (the staircase noise: an ungrouped sum), a public-domain histogram and a
thresholded GROUP BY (Laplace), and COUNT and the thresholded GROUP BY again with the Gaussian
mechanism, we release many times on
neighbouring datasets D and D′ = D + one worst-case privacy unit, and bound the privacy loss of
the released output from below with Clopper–Pearson intervals (dpsql.privacy.audit). A correct
release must show no significant violation of its (ε, δ); the same audit of a deliberately
broken mechanism (half the noise scale, or τ = 1) must show one, so the audit has power.
D″ = D + a unit with keys of its own checks that thresholding releases them with probability
<= δ, and that the order of the released rows does not give them away.

How the samples are drawn:
- End to end: ``E2E_RUNS`` queries per case and dataset through dpsql.Service and the DB-API
  (policy dict, tiny CSV, MemoryLedger, cache off, SeededNoise — the exact samplers fed by a
  seeded byte stream). The engine results and plans are recorded.
- Bulk: ``release(plan, engine_result, source)`` from dpsql.privacy.release, called once per run
  on the recorded plan and engine result, without the error-bar simulation (a deterministic
  function of the noisy values: post-processing that cannot change the audited distribution)
  and with noise served from large batches of the exact sampler (BufferedNoise).
- ``test_end_to_end_equals_release_layer`` ties the two: every engine run returns the same exact
  aggregates, and replaying ``release`` on them with the same seed reproduces the rows the
  pipeline returned, value for value.

Statistics: ``CONFIDENCE`` = 0.999 for all bounds of one audit simultaneously (Bonferroni), so a
correct mechanism fails a given audit with probability <= 0.1% over seeds; seeds are fixed, so
each run here is deterministic. Print the measured bounds with
``PYTHONPATH=. python -m pytest tests/test_privacy_audit.py -q -s``.
"""

from __future__ import annotations

import contextlib
import csv
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import recording
from conftest import as_released
from scipy import stats

import dpsql.privacy.release as release_module
from dpsql.dbapi import connect_service
from dpsql.engine.api import EngineResult
from dpsql.plan.annotated import Plan
from dpsql.privacy.audit import (
    AuditReport,
    BufferedNoise,
    Event,
    audit,
    clopper_pearson,
    indicator_event,
    threshold_events,
)
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.mechanisms import (
    Gaussian,
    Laplace,
    Staircase,
    discrete_gaussian_tail,
    discrete_laplace_tail,
)
from dpsql.privacy.release import release
from dpsql.privacy.samplers import NoiseSource, SeededNoise, ZeroNoise

EPSILON = 1.0  # per query: large, so the tail events that show the loss have mass
DELTA = 0.01  # thresholding and Gaussian; large enough to measure with a few thousand runs
R, G = 3, 2  # max_rows_per_unit, max_groups_per_unit
CONFIDENCE = 0.999  # simultaneous, per audit
RUNS = 6000  # bulk releases per dataset, correct mechanism
RUNS_BROKEN = 2500  # bulk releases per dataset, broken mechanism (the violation is large)
E2E_RUNS = 12  # end-to-end queries per case and dataset

DEPTS = ("a", "b", "c", "d")  # public domain; "d" is empty in D


@dataclass(frozen=True)
class Case:
    name: str
    sql: str
    touched: tuple[tuple[Any, ...], ...]  # groups the extra unit of D′ changes
    mechanism: str = "laplace"
    # Power check for the correct mechanism: ε̂_lo >= tight·ε. Laplace tails have likelihood
    # ratio exactly e^ε, so ε̂_lo falls short of ε only by the confidence margins: over 8 other
    # seeds it ranged 0.68–0.87 (mean ~0.78, s.d. ~0.04), hence 0.6. The Gaussian's worst events
    # have little mass at δ = 0.01: 0.49–0.63 (COUNT) and 0.37–0.43 (thresholded, σ for L2 = √2
    # at δ/2) over 6–8 seeds, hence 0.3 and 0.2.
    tight: float = 0.6
    broken_runs: int = RUNS_BROKEN


CASES = (
    Case("count", "SELECT COUNT(*) AS n FROM t", ((),)),
    Case("sum", "SELECT SUM(amount) AS s FROM t", ((),)),
    Case("histogram", "SELECT dept, COUNT(*) AS n FROM t GROUP BY dept", (("c",), ("d",))),
    Case(
        "thresholded",
        "SELECT diag, COUNT(DISTINCT pid) AS n FROM t GROUP BY diag",
        (("x",), ("y",)),
    ),
    # Half σ: ε̂_lo 1.12–1.61 at 2500 runs over 8 seeds; 1.41–1.73 (δ̂_lo >= 0.07) at RUNS.
    Case(
        "gaussian-count",
        "SELECT COUNT(*) AS n FROM t",
        ((),),
        mechanism="gaussian",
        tight=0.3,
        broken_runs=RUNS,
    ),
    # Half σ: ε̂_lo 1.17–1.54 and δ̂_lo 0.027–0.059 (vs δ = 0.01) over 6 seeds at RUNS.
    Case(
        "gaussian-thresholded",
        "SELECT diag, COUNT(DISTINCT pid) AS n FROM t GROUP BY diag",
        (("x",), ("y",)),
        mechanism="gaussian",
        tight=0.2,
        broken_runs=RUNS,
    ),
)

# --- the estimator on known distributions ---------------------------------------------------


@pytest.mark.parametrize(("hits", "runs"), [(0, 10), (3, 10), (10, 10), (517, 6000)])
def test_clopper_pearson_is_the_exact_interval(hits: int, runs: int) -> None:
    low, high = clopper_pearson(hits, runs, 0.005)
    ci = stats.binomtest(hits, runs).proportion_ci(0.99, method="exact")
    assert low == pytest.approx(ci.low, abs=1e-12)
    assert high == pytest.approx(ci.high, abs=1e-12)


def test_audit_is_calibrated_and_has_power_on_known_probabilities() -> None:
    """Binomial counts of an event whose probabilities differ by exactly e^ε (the worst case a
    correct ε-DP release can show): the audit at confidence 0.9 may flag at most 10% of the
    trials; at e^(2ε) it must flag nearly all. Tolerance: 4.5 binomial s.d. over 600 trials."""
    rng = np.random.default_rng(7)
    trials, n, p = 600, 1000, 0.55
    for ratio, expect_violation in ((math.e, False), (math.e**2, True)):
        hits_d = rng.binomial(n, p, trials)
        hits_d2 = rng.binomial(n, p / ratio, trials)
        flagged = np.mean(
            [
                audit([Event("S", int(a), int(b))], n, n, epsilon=1.0, confidence=0.9).violated
                for a, b in zip(hits_d, hits_d2, strict=True)
            ]
        )
        if expect_violation:
            assert flagged >= 0.99
        else:
            assert flagged <= 0.1 + 4.5 * math.sqrt(0.1 * 0.9 / trials)


def test_audit_accounts_delta() -> None:
    """An event impossible on D with probability 0.3 on D′ is (ε, δ)-DP only for δ >= 0.3."""
    event = Event("key appears", 0, 3000)
    assert not audit([event], 10_000, 10_000, epsilon=1.0, delta=0.3).violated
    report = audit([event], 10_000, 10_000, epsilon=1.0, delta=0.2)
    assert report.violated and report.delta_lower > 0.2
    assert report.witness is not None and report.witness.direction == "D′/D"


def test_threshold_events_count_tails_and_bins() -> None:
    d = np.array([-math.inf, 0.0, 1.0, 2.0])
    d2 = np.array([1.0, 2.0, 3.0, 3.0])
    got = {e.name: (e.hits_d, e.hits_d2) for e in threshold_events("v", d, d2, [0.5, 2.5])}
    assert got == {
        "v <= 0.5": (2, 0),
        "v >= 0.5": (2, 4),
        "v <= 2.5": (4, 2),
        "v >= 2.5": (0, 2),
        "0.5 < v <= 2.5": (2, 2),
    }


def test_buffered_noise_serves_every_draw_once_in_order() -> None:
    class Counter:
        def __init__(self) -> None:
            self.next = 0

        def discrete_laplace(self, scale: float, size: int) -> np.ndarray:
            self.next += size
            return np.arange(self.next - size, self.next)

    source = BufferedNoise(Counter(), batch=5)  # type: ignore[arg-type]
    served = np.concatenate([source.discrete_laplace(2.0, k) for k in (3, 4, 0, 7, 1)])
    assert served.tolist() == list(range(15))


# --- data: D, D′ (worst case for ε) and D″ (a unit with keys of its own, for δ) ---------------


def rows_d() -> list[tuple[Any, ...]]:
    """30 units of 1–3 rows, each within the bounds (so the exact aggregates are deterministic):
    one department (a, b or c; d stays empty) and one diagnosis (x or y) per unit."""
    return [
        (u, DEPTS[u % 3], "xy"[u % 2], 5.0 + 1.5 * (u % 7))
        for u in range(30)
        for _ in range(1 + u % 3)
    ]


# Worst case for ε: more rows than R in each of G groups, values far above the upper bound. After
# bounding it adds exactly R rows of value `upper` to dept c and to the empty dept d, and one unit
# to diagnoses x and y: every aggregate moves by its full sensitivity.
EXTRA = [(999, "c", "x", 1e6)] * (R + 1) + [(999, "d", "y", 1e6)] * (R + 1)
# Worst case for δ under thresholding: G keys that no other unit has.
NEW_KEYS = ("new1", "new2")
UNIQUE = [(998, "a", NEW_KEYS[0], 10.0)] * R + [(998, "b", NEW_KEYS[1], 10.0)] * R


def write_csv(path: Path, rows: list[tuple[Any, ...]]) -> Path:
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["pid", "dept", "diag", "amount"])
        out.writerows(rows)
    return path


def policy(source: Path, mechanism: str) -> dict[str, Any]:
    return {
        "privacy": {
            "epsilon": EPSILON,
            "delta": DELTA,
            "mechanism": mechanism,
            "budget_epsilon": 1e12,
            "budget_delta": 0.999,
            "dataset": "audit",
        },
        "tables": {
            "t": {
                "source": str(source),
                "privacy_unit": "pid",
                "max_rows_per_unit": R,
                "max_groups_per_unit": G,
                "columns": {
                    "pid": {"type": "int", "nullable": False},
                    "dept": {"type": "text", "values": list(DEPTS), "nullable": False},
                    "diag": {"type": "text", "nullable": False},
                    "amount": {
                        "type": "float",
                        "lower": 0.0,
                        "upper": 50.0,
                        "granularity": 0.5,
                        "nullable": False,
                        # the release audited at the declared clamp and the whole ε (unstated,
                        # a clamp range is bought first from a share of ε and kept: that
                        # purchase's audit is tests/test_default_clamp.py)
                        "clip": "declared",
                    },
                },
            }
        },
    }


# --- test hooks -----------------------------------------------------------------------------


class RecordingService(recording.RecordingService):
    """Records each plan and exact engine result (tests/recording.py), and can break τ on
    purpose."""

    def __init__(self, *args: Any, tau: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tau = tau

    def adjust(self, plan: Plan) -> Plan:
        if self.tau is not None and plan.threshold is not None:
            plan = plan.with_(threshold=replace(plan.threshold, tau=self.tau))
        return plan


class HalfNoise:
    """Broken on purpose: draws noise at half the scale the mechanism asked for."""

    def __init__(self, inner: NoiseSource) -> None:
        self.inner = inner

    def discrete_laplace(self, scale: float, size: int) -> np.ndarray:
        return self.inner.discrete_laplace(scale / 2, size)

    def discrete_gaussian(self, sigma: float, size: int) -> np.ndarray:
        return self.inner.discrete_gaussian(sigma / 2, size)

    def discrete_staircase(self, epsilon: float, period: int, step: int, size: int) -> np.ndarray:
        return self.inner.discrete_staircase(epsilon, max(1, period // 2), step // 2, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Execution:
    case: str
    seed: int  # of the SeededNoise of the Service that ran it (one per dataset and mechanism)
    plan: Plan
    result: EngineResult
    rows: list[tuple[Any, ...]]


SEED = {"D": 11, "D′": 12, "D″": 13}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("audit")
    datasets = {"D": rows_d(), "D′": rows_d() + EXTRA, "D″": UNIQUE + rows_d()}
    return {
        name: write_csv(tmp / f"{i}.csv", rows) for i, (name, rows) in enumerate(datasets.items())
    }


@pytest.fixture(scope="module")
def pipeline_runs(sources: dict[str, Path]) -> dict[str, list[Execution]]:
    """E2E_RUNS queries per case through the DB-API, on each dataset, with recorded internals.

    One Service per dataset and mechanism, each with the policy's default mechanism, so each
    is charged on the budget its policy reserves for that mechanism.
    """
    runs: dict[str, list[Execution]] = {}
    for name, source in sources.items():
        runs[name] = []
        for mechanism in ("laplace", "gaussian"):
            seed = SEED[name] + (0 if mechanism == "laplace" else 100)
            service = RecordingService(
                policy(source, mechanism),
                ledger=MemoryLedger(),
                noise=SeededNoise(seed),
                cache=False,
                plan_cache=0,  # record every plan(), including repeated texts
            )
            cursor = connect_service(service, "auditor").cursor()
            # the answer's mechanism at the whole ε: the audit observes the first output only,
            # so a bias estimate's share of ε (on by default, dpsql.plan.bias; audited in
            # tests/test_bias.py) would leave that output a part of ε and the audit blind to an
            # overspend of up to that part
            cursor.execute("SET bias_estimate = off")
            out: list[tuple[str, list]] = []
            for case in CASES:
                if case.mechanism == mechanism:
                    for _ in range(E2E_RUNS):
                        out.append((case.name, cursor.execute(case.sql).fetchall()))
            runs[name] += [
                Execution(c, seed, p, r, rows)
                for (c, rows), p, r in zip(out, service.plans, service.results, strict=True)
            ]
            service.close()
    return runs


def first(runs: list[Execution], case: str) -> Execution:
    return next(e for e in runs if e.case == case)


# --- the bulk release ----------------------------------------------------------------------


def _no_error_bars(output: Any, plan: Plan, noisy: dict, value: np.ndarray) -> np.ndarray:
    return np.zeros((len(value), 2))


def _no_simulation(mech: Any, rng: Any, size: int) -> np.ndarray:
    return np.zeros(size)


# The error bars and suppression probabilities are simulated from the *noisy* values with a fixed
# generator (post-processing) and cost ~10x the release itself; the bulk runs skip them.
ERROR_BAR_STUBS = {"_interval": _no_error_bars, "_approximate_noise": _no_simulation}


def bulk_release(
    plan: Plan, result: EngineResult, source: NoiseSource, runs: int
) -> Iterator[dict[tuple, float]]:
    """``runs`` releases of ``plan`` on ``result``: per run, {group: first output value}."""
    with contextlib.ExitStack() as stack:
        for name, stub in ERROR_BAR_STUBS.items():
            if hasattr(release_module, name):  # only slower, never wrong, if renamed
                stack.enter_context(mock.patch.object(release_module, name, stub))
        for _ in range(runs):
            released = release(plan, result, source)
            yield dict(zip(released.key_values, released.outputs[0].tolist(), strict=True))


def exact_values(plan: Plan, result: EngineResult) -> dict[tuple, float]:
    """The exact released values (no noise) per group, from the release layer itself."""
    released = release(plan, result, ZeroNoise())
    return dict(zip(released.key_values, released.outputs[0].tolist(), strict=True))


def shift_and_scale(plan: Plan) -> tuple[float, float]:
    """Per-group sensitivity and noise scale of the first output, in released units."""
    m = plan.measure(plan.outputs[0].measures[0])
    return m.per_group_bound * m.unit, m.mechanism.scale * m.unit


def statistics(
    releases: Iterator[dict[tuple, float]], touched: tuple[tuple, ...], exact: dict[tuple, float]
) -> dict[str, np.ndarray]:
    """Per run, over the groups the extra unit changes, the differences (released − exact on D),
    −inf for a group not released, summarised three ways. {max <= t} and {min >= t} are product
    events, where independent Laplace noise per group shows the whole loss; the sum is the
    likelihood-ratio statistic of equal-σ Gaussian noise, where the Gaussian shows it."""
    diffs = np.array(
        [[out.get(k, -math.inf) - exact.get(k, 0.0) for k in touched] for out in releases]
    )
    return {"max(v−n)": diffs.max(axis=1), "min(v−n)": diffs.min(axis=1), "sum(v−n)": diffs.sum(1)}


def audit_case(
    case: Case,
    runs: dict[str, list[Execution]],
    wrap: Callable[[NoiseSource], NoiseSource],
    n: int,
    seed: int | None = None,
) -> AuditReport:
    d, d2 = first(runs["D"], case.name), first(runs["D′"], case.name)
    exact = exact_values(d.plan, d.result)
    shift, scale = shift_and_scale(d.plan)
    # Thresholds fixed from public parameters only: 2 scales below the exact value on D to
    # 2 scales above the exact value on D′ (3·√k scales for a sum of k groups).
    thresholds = np.linspace(-2 * scale, shift + 2 * scale, 21)
    if seed is None:
        seed = 100 + [c.name for c in CASES].index(case.name)
    stats_d = statistics(
        bulk_release(d.plan, d.result, BufferedNoise(wrap(SeededNoise(seed))), n),
        case.touched,
        exact,
    )
    stats_d2 = statistics(
        bulk_release(d2.plan, d2.result, BufferedNoise(wrap(SeededNoise(seed + 50))), n),
        case.touched,
        exact,
    )
    k = len(case.touched)
    spread = 3 * scale * math.sqrt(k)
    sum_thresholds = np.linspace(-spread, k * shift + spread, 25)
    events: list[Event] = []
    for name in stats_d if k > 1 else ("max(v−n)",):  # one group: all three are the same
        grid = sum_thresholds if name == "sum(v−n)" else thresholds
        events += threshold_events(name, stats_d[name], stats_d2[name], grid)
    return audit(events, n, n, epsilon=d.plan.epsilon, delta=d.plan.delta, confidence=CONFIDENCE)


# --- tests ----------------------------------------------------------------------------------


def test_end_to_end_equals_release_layer(pipeline_runs: dict[str, list[Execution]]) -> None:
    """The bulk shortcut releases what the pipeline releases: same exact aggregates every run,
    and the same rows when release() is replayed with the pipeline's seed."""
    for name, runs in pipeline_runs.items():
        sources: dict[int, SeededNoise] = {}
        for e in runs:
            source = sources.setdefault(e.seed, SeededNoise(e.seed))
            reference = first(runs, e.case).result
            as_map = {k: [m[i] for m in e.result.measures] for i, k in enumerate(e.result.key_rows)}
            ref_map = {
                k: [m[i] for m in reference.measures] for i, k in enumerate(reference.key_rows)
            }
            assert as_map == ref_map, (name, e.case)
            assert e.plan.fingerprint() == first(runs, e.case).plan.fingerprint()
            released = release(e.plan, e.result, source)
            replayed = [
                (*key, value)
                for key, value in zip(
                    released.key_values, as_released(e.plan, released), strict=True
                )
            ]
            assert sorted(e.rows, key=repr) == sorted(replayed, key=repr), (name, e.case)


def test_the_sum_case_audits_the_staircase(pipeline_runs: dict[str, list[Execution]]) -> None:
    """The ungrouped SUM is released with the staircase noise (one group per unit: its map is
    ε at the period, dpsql.privacy.mechanisms.Staircase), so the audits below of the "sum"
    case audit it; the counts keep the discrete Laplace."""
    for name in ("D", "D′"):
        plan = first(pipeline_runs[name], "sum").plan
        assert isinstance(plan.measure(plan.outputs[0].measures[0]).mechanism, Staircase)
        plan = first(pipeline_runs[name], "count").plan
        assert isinstance(plan.measure(plan.outputs[0].measures[0]).mechanism, Laplace)


def test_worst_case_unit_moves_every_aggregate_by_its_sensitivity(
    pipeline_runs: dict[str, list[Execution]],
) -> None:
    """The extra unit of D′ is a worst case: after bounding and clamping it changes each touched
    group by the full per-group sensitivity (else the audit below would not be tight)."""
    for case in CASES:
        d, d2 = first(pipeline_runs["D"], case.name), first(pipeline_runs["D′"], case.name)
        shift, _ = shift_and_scale(d.plan)
        exact, exact2 = exact_values(d.plan, d.result), exact_values(d2.plan, d2.result)
        for key in case.touched:
            assert exact2[key] - exact.get(key, 0.0) == shift, case.name
        assert len(case.touched) == d.plan.max_groups


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_audit_finds_no_violation(case: Case, pipeline_runs: dict[str, list[Execution]]) -> None:
    report = audit_case(case, pipeline_runs, lambda s: s, RUNS)
    print(f"\n[audit] {case.name:12s} correct: {report}")
    assert not report.violated, str(report)
    # Power check: the audit is sharp enough to see most of the loss (see Case.tight).
    assert report.epsilon_lower >= case.tight * report.epsilon, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_audit_catches_half_noise(case: Case, pipeline_runs: dict[str, list[Execution]]) -> None:
    """Half the noise scale doubles the privacy loss: the same audit must call it a violation."""
    report = audit_case(case, pipeline_runs, HalfNoise, case.broken_runs)
    print(f"\n[audit] {case.name:12s} half-noise: {report}")
    assert report.violated, str(report)


def new_key_release_rate(plan: Plan, result: EngineResult, seed: int, n: int) -> np.ndarray:
    return np.array(
        [
            any(k in out for k in ((key,) for key in NEW_KEYS))
            for out in bulk_release(plan, result, BufferedNoise(SeededNoise(seed)), n)
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case_name", "tau"),
    [("thresholded", None), ("gaussian-thresholded", None), ("thresholded", 1.0)],
    ids=["laplace-planned-tau", "gaussian-planned-tau", "laplace-broken-tau-1"],
)
def test_threshold_releases_a_units_own_keys_with_probability_at_most_delta(
    case_name: str, tau: float | None, pipeline_runs: dict[str, list[Execution]]
) -> None:
    """D″ adds a unit whose G keys nobody else has. Its keys may appear with probability at
    most the δ the plan gives thresholding (all of δ for Laplace, half for Gaussian; τ from the
    same mechanism object, union bound over G keys); τ = 1 must be caught."""
    d, d3 = first(pipeline_runs["D"], case_name), first(pipeline_runs["D″"], case_name)
    plan_d, plan_d3 = d.plan, d3.plan
    assert plan_d3.threshold is not None
    if tau is not None:
        plan_d = plan_d.with_(threshold=replace(plan_d3.threshold, tau=tau))
        plan_d3 = plan_d3.with_(threshold=replace(plan_d3.threshold, tau=tau))
    n = RUNS if tau is None else RUNS_BROKEN
    seed = 300 + 2 * [c.name for c in CASES].index(case_name)
    in_d = new_key_release_rate(plan_d, d.result, seed, n)
    in_d3 = new_key_release_rate(plan_d3, d3.result, seed + 1, n)
    assert not in_d.any()  # D has no such keys: they can never appear
    report = audit(
        [indicator_event("a key of the extra unit is released", in_d, in_d3)],
        n,
        n,
        epsilon=plan_d.epsilon,
        delta=plan_d.delta,
        confidence=CONFIDENCE,
    )
    hits = int(in_d3.sum())
    low, high = clopper_pearson(hits, n, (1 - CONFIDENCE) / 2)
    budget = plan_d3.threshold.delta
    print(
        f"\n[audit] {case_name} τ={plan_d3.threshold.tau:g}: own key released {hits}/{n}, "
        f"P in [{low:.4g}, {high:.4g}] at {CONFIDENCE:g}, thresholding δ={budget:g}; {report}"
    )
    if tau is None:
        # The planned τ: at most δ, and exactly the rate its tail formula predicts.
        mech = plan_d3.measure(plan_d3.threshold.measure).mechanism
        m = int(plan_d3.threshold.tau) - 1  # a key of one unit is released iff 1 + X >= τ
        one = (
            discrete_gaussian_tail(mech.scale, m)
            if isinstance(mech, Gaussian)
            else discrete_laplace_tail(mech.scale, m)
        )
        expected = 1 - (1 - one) ** len(NEW_KEYS)
        assert expected <= budget
        assert low <= expected <= high
        assert low <= budget
        assert not report.violated, str(report)
    else:
        assert low > budget
        assert report.violated, str(report)


@pytest.mark.slow
def test_broken_tau_leaks_a_units_own_keys_end_to_end(sources: dict[str, Path]) -> None:
    """τ = 1 injected into the pipeline's plan (RecordingService hook): the extra unit's own
    keys come out of the DB-API in most queries (P ≈ 0.86 ≫ δ; Clopper–Pearson at 0.999)."""
    service = RecordingService(
        policy(sources["D″"], "laplace"),
        ledger=MemoryLedger(),
        noise=SeededNoise(21),
        cache=False,
        tau=1.0,
    )
    cursor = connect_service(service, "auditor").cursor()
    sql = next(c.sql for c in CASES if c.name == "thresholded")
    runs = 30
    hits = sum(
        any(row[0] in NEW_KEYS for row in cursor.execute(sql).fetchall()) for _ in range(runs)
    )
    service.close()
    low, _ = clopper_pearson(hits, runs, 1 - CONFIDENCE)
    print(f"\n[audit] thresholded  τ=1 end to end: own key released {hits}/{runs}, P >= {low:.3f}")
    assert low > DELTA


# --- row order ------------------------------------------------------------------------------

ORDER_KEYS = tuple(f"k{i:02d}" for i in range(15))
ORDER_RUNS = 80  # per dataset, end to end


@pytest.mark.slow
def test_row_order_does_not_reveal_a_suppressed_unit(tmp_path: Path) -> None:
    """Without ORDER BY the rows come out in some order, and that order is released too: it
    must not depend on keys that thresholding suppressed. D: 15 keys of 30 units each; D″ adds
    a unit with G keys of its own (released with probability <= δ). Events, fixed in advance:
    "the first row is key k", for each k; the same (ε, δ) audit as above.

    This audit found a leak: rows came in the engine's hash-table order, which changed with the
    suppressed keys (one key first in 74/80 runs on D′, 0/80 on D: ε̂_lo = 1.73). The release
    now sorts thresholded groups (release.group_index)."""
    base = [(u, "a", ORDER_KEYS[u % len(ORDER_KEYS)], 5.0) for u in range(30 * len(ORDER_KEYS))]
    firsts: dict[str, np.ndarray] = {}
    delta = 0.0
    for i, (name, rows) in enumerate((("D", base), ("D″", base + UNIQUE))):
        service = RecordingService(
            policy(write_csv(tmp_path / f"{i}.csv", rows), "laplace"),
            ledger=MemoryLedger(),
            noise=SeededNoise(31 + i),
            cache=False,
        )
        cursor = connect_service(service, "auditor").cursor()
        sql = next(c.sql for c in CASES if c.name == "thresholded")
        firsts[name] = np.array(
            [
                next(row[0] for row in cursor.execute(sql).fetchall() if row[0] in ORDER_KEYS)
                for _ in range(ORDER_RUNS)
            ]
        )
        delta = service.plans[0].delta
        service.close()
    events = [
        indicator_event(f"first row is {k}", firsts["D"] == k, firsts["D″"] == k)
        for k in ORDER_KEYS
    ]
    report = audit(
        events, ORDER_RUNS, ORDER_RUNS, epsilon=EPSILON, delta=delta, confidence=CONFIDENCE
    )
    print(f"\n[audit] row order    thresholded: {report}")
    assert not report.violated, str(report)
