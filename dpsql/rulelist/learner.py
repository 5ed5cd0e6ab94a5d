"""DP-GreedyRL (Algorithm 1 of Ly et al. 2024) and its variants, vectorised.

One pass per rule position: the (remaining-row) label counts of every candidate come from two
BLAS matrix-vector products over the (n, m) 0/1 candidate matrix, the criterion for all
candidates is one numpy expression, and the selection draws one noise vector.  No Python loop
runs over samples or candidates.

Every random draw goes through a :class:`~dpsql.privacy.samplers.NoiseSource`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpsql.errors import DataError, PrivacyError, ProgrammingError
from dpsql.privacy.accounting import Cost
from dpsql.privacy.mechanisms import analytic_gaussian_sigma
from dpsql.privacy.samplers import NoiseSource
from dpsql.rulelist.candidates import Feature, Rule, RuleCounter
from dpsql.rulelist.gini import (
    gini_scores,
    impurity_mass,
    node_gini,
    smooth_sensitivity,
    support_threshold,
)
from dpsql.rulelist.model import LearnedRule, RuleList

#: The paper's two mechanisms, its three global baselines, non-private GreedyRL and ours.
MECHANISMS = (
    "smooth_laplace",
    "smooth_cauchy",
    "global_laplace",
    "global_gaussian",
    "exponential",
    "monotone_em",
    "none",
)
SMOOTH = ("smooth_laplace", "smooth_cauchy")
#: Global sensitivity of G (and of 1 - G): G lies in [0, 1/2] for binary labels.
G_SENSITIVITY = 0.5
#: Global sensitivity of the un-normalised impurity H = n·G per added/removed row (< 2).
H_SENSITIVITY = 2.0


@dataclass(frozen=True)
class LearnerParams:
    """What the analyst chooses; the same names as the SQL table function's arguments.

    ``delta`` is the TOTAL δ (None: 1/n² where a mechanism needs one).  ``min_support`` is a
    fraction of the rows (< 1) or an absolute row count (≥ 1).  ``rows_per_unit`` is the
    declared bound on rows per privacy unit (input must already be bounded to it).
    """

    epsilon: float = 1.0
    delta: float | None = None
    max_length: int = 5
    min_support: float = 0.05
    mechanism: str = "smooth_laplace"
    confidence: float = 0.99
    strict_sensitivity: bool = True
    rows_per_unit: int = 1

    def validate(self) -> None:
        bad = _bad_param(self)
        if bad is not None:
            name, value, hint = bad
            raise ProgrammingError(
                f"invalid {name} for dp_rule_list: {value!r}",
                sqlstate="22023",
                construct=name,
                hint=hint,
            )
        if self.mechanism in SMOOTH and self.rows_per_unit != 1:
            raise PrivacyError(
                f"mechanism {self.mechanism!r} assumes one row per privacy unit, but a unit "
                f"may own {self.rows_per_unit} rows",
                construct="mechanism",
                hint="use mechanism => 'monotone_em' (its sensitivities scale with the rows "
                "per unit) or declare max_rows_per_unit = 1",
            )


def _bad_param(p: LearnerParams) -> tuple[str, object, str] | None:
    if p.mechanism not in MECHANISMS:
        return "mechanism", p.mechanism, "use one of " + ", ".join(MECHANISMS)
    if p.mechanism != "none" and not (p.epsilon > 0 and math.isfinite(p.epsilon)):
        return "epsilon", p.epsilon, "use a positive number, e.g. epsilon => 1.0"
    if not isinstance(p.max_length, int | np.integer) or p.max_length < 1:
        return "max_length", p.max_length, "count of rules including the default, e.g. 5"
    if not (0 <= p.min_support < 1 or float(p.min_support).is_integer()):
        return "min_support", p.min_support, "a fraction in [0, 1) or a whole row count"
    if not 0.5 <= p.confidence < 1:
        return "confidence", p.confidence, "a probability in [0.5, 1), e.g. 0.99"
    if p.delta is not None and not 0 < p.delta < 1:
        return "delta", p.delta, "a small positive number, e.g. 1e-6"
    if p.rows_per_unit < 1:
        return "rows_per_unit", p.rows_per_unit, "a positive integer"
    return None


@dataclass(frozen=True)
class BudgetPlan:
    """Per-mechanism share of the budget, fixed before any data is read (spec §6.1)."""

    epsilon_node: float
    delta_node: float
    steps: int
    cost: Cost


def plan_budget(params: LearnerParams, n_rows: int | None = None) -> BudgetPlan:
    """Split (ε, δ) over the at most ``steps`` mechanisms one fit runs (basic composition).

    smooth_*: 3L-1 steps of ε/(3L-1) (L-1 × {support check, selection, counts} + final check +
    default counts) and δ/(L-1) per smooth-Laplace selection.  monotone_em, global_*: 2L-1
    (selection + counts per rule, default counts).  exponential: 2L as in the authors' code.
    ``n_rows`` is only used for the paper's default δ = 1/n².
    """
    p = params
    sel = p.max_length - 1
    if p.mechanism == "none":
        return BudgetPlan(math.inf, 0.0, 0, Cost())
    steps = {
        "smooth_laplace": 3 * p.max_length - 1,
        "smooth_cauchy": 3 * p.max_length - 1,
        "exponential": 2 * p.max_length,
    }.get(p.mechanism, 2 * p.max_length - 1)
    if sel == 0:
        steps = 1  # only the default rule's counts
    needs_delta = p.mechanism in ("smooth_laplace", "global_gaussian") and sel > 0
    delta = 0.0
    if needs_delta:
        if p.delta is not None:
            delta = p.delta
        elif n_rows:
            delta = 1.0 / float(n_rows) ** 2
        else:
            raise ProgrammingError(
                f"mechanism {p.mechanism!r} needs delta",
                sqlstate="22023",
                construct="delta",
                hint="pass delta => 1e-6 (it is the total δ of the whole rule list)",
            )
    return BudgetPlan(
        p.epsilon / steps, delta / sel if needs_delta else 0.0, steps, Cost(p.epsilon, delta)
    )


def support_floor(min_support: float, n_estimate: float) -> int:
    """Λ: an absolute count, or ⌊λ·n⌋ from a (noisy) row count; at least 1."""
    if min_support >= 1:
        return int(min_support)
    return max(1, math.floor(min_support * max(n_estimate, 0.0)))


def check_labels(y: np.ndarray) -> np.ndarray:
    """0/1 int labels, or a DataError naming what is wrong (never the private values)."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise DataError("labels must be one-dimensional", sqlstate="22023", construct="label")
    if y.dtype == bool:
        return y.astype(np.int8)
    if y.size and not np.isin(y, (0, 1)).all():
        raise DataError(
            "the label is not binary 0/1",
            sqlstate="22023",
            construct="label",
            hint="encode the positive class as 1 and everything else as 0 "
            "(the SQL function does this with positive => 'value')",
        )
    return y.astype(np.int8)


class _Noise:
    """The per-node noise of one mechanism, drawn from ``source``."""

    def __init__(self, params: LearnerParams, plan: BudgetPlan, source: NoiseSource) -> None:
        self.p, self.plan, self.src = params, plan, source
        self.k = params.rows_per_unit
        self.smooth = None
        if params.mechanism in SMOOTH and params.max_length > 1:
            from dpsql.privacy.smooth import SmoothCauchy, SmoothLaplace

            if params.mechanism == "smooth_cauchy":
                self.smooth = SmoothCauchy(plan.epsilon_node)
            else:
                self.smooth = SmoothLaplace(plan.epsilon_node, plan.delta_node)

    def counts(self, c0: float, c1: float) -> tuple[float, float]:
        """Algorithm 2: Laplace-noised label counts (integer noise: the counts are released)."""
        if self.p.mechanism == "none":
            return float(c0), float(c1)
        z = self.src.discrete_laplace(self.k / self.plan.epsilon_node, 2)
        return float(c0 + z[0]), float(c1 + z[1])

    def size(self, n: float) -> float:
        """Noisy row count for the support check (never released, only compared)."""
        return n + float(self.src.laplace(1.0 / self.plan.epsilon_node, 1)[0])


def learn(
    X: np.ndarray,
    y: np.ndarray,
    features: Sequence[Feature],
    candidates: Sequence[Rule],
    params: LearnerParams,
    source: NoiseSource,
    *,
    counter: RuleCounter | None = None,
) -> RuleList:
    """Learn a rule list (Algorithm 1 and variants).  ``X`` is (n, len(features)) 0/1.

    The candidate list must not depend on the data for the privacy guarantee to hold (see
    :mod:`dpsql.rulelist.candidates`).  ``counter`` may pass a precomputed
    :class:`RuleCounter` for these X and candidates (benchmarks reuse it across fits).
    """
    params.validate()
    y = check_labels(y)
    X = np.asarray(X)
    if X.ndim != 2 or X.shape[0] != y.shape[0]:
        raise DataError("features and labels have different row counts", sqlstate="22023")
    n = X.shape[0]
    plan = plan_budget(params, n)
    noise = _Noise(params, plan, source)
    rc = RuleCounter(X, candidates) if counter is None else counter
    w = np.ones(n, dtype=rc.dtype)  # 1 = row not caught yet
    yw = y.astype(rc.dtype)
    active = np.ones(len(candidates), dtype=bool)
    mech = params.mechanism
    L = params.max_length
    chosen: list[LearnedRule] = []
    notes: list[str] = []
    stop = "max_length"

    floor = 0
    threshold = 0
    first_size = None
    if mech in SMOOTH and L > 1:
        threshold = support_threshold(plan.epsilon_node, params.confidence)
        first_size = noise.size(float(n))
        # Λ from the first check's noisy count: public post-processing, unlike ⌊λ·n⌋.
        floor = support_floor(params.min_support, first_size)

    while len(chosen) < L - 1:
        rem = float(w.sum())
        rem1 = float(w @ yw)
        if mech in SMOOTH:
            noisy = first_size if not chosen and first_size is not None else noise.size(rem)
            if noisy < floor + threshold:
                stop = "support_check"
                break
        idx = np.flatnonzero(active)
        if idx.size == 0:
            stop = "no_candidates"
            break
        nc, nc1 = rc.counts(w, w * yw)
        nc, nc1 = nc[idx].astype(np.float64), nc1[idx].astype(np.float64)
        pick = _select(mech, rem, rem1, nc, nc1, params, plan, noise, floor)
        if pick is None:
            stop = "no_improvement" if mech not in ("exponential", "monotone_em") else "stop"
            break
        j = int(idx[pick])
        caught = rc.caught(j) & (w > 0)
        c1 = float(yw[caught].sum())
        c0 = float(caught.sum()) - c1
        q0, q1 = noise.counts(c0, c1)
        chosen.append(LearnedRule(tuple(candidates[j]), _predict(q0, q1), (q0, q1)))
        w[caught] = 0
        active[j] = False

    rem = float(w.sum())
    rem1 = float(w @ yw)
    d0, d1 = noise.counts(rem - rem1, rem1)
    chosen.append(LearnedRule((), _predict(d0, d1), (d0, d1)))
    if len(chosen) == 1 and L > 1:
        notes.append(_default_only_note(stop, floor, threshold, plan))
    return RuleList(tuple(features), tuple(chosen), stop, tuple(notes))


def _predict(c0: float, c1: float) -> int:
    """Majority of the (noisy) counts; ties predict 0 (spec §9.11)."""
    return 0 if c0 >= c1 else 1


def _default_only_note(stop: str, floor: int, threshold: int, plan: BudgetPlan) -> str:
    if stop == "support_check":
        return (
            f"only the default rule: the noisy row count was below the support floor "
            f"Λ + T = {floor} + {threshold} at the first position (T grows as 1/epsilon_node, "
            f"epsilon_node = {plan.epsilon_node:.4g}); use more rows, a larger epsilon, a "
            "smaller max_length or confidence, or mechanism => 'monotone_em'"
        )
    if stop in ("no_improvement", "stop"):
        return "only the default rule: no candidate rule was (noisily) better than none"
    return f"only the default rule ({stop})"


def em_log_weights(
    mech: str, n: float, n1: float, nc: np.ndarray, nc1: np.ndarray, eps: float, k: int = 1
) -> np.ndarray:
    """Log-weights of the exponential-mechanism selections; the last entry is "stop".

    monotone_em: -ε·H/(2k), H = n·G the un-normalised impurity (monotone, sensitivity < 2 per
    row, so no factor 2).  exponential (the paper's baseline): ε·(1 - G)/(2·½).
    """
    if mech == "monotone_em":
        h = np.append(
            impurity_mass(nc, nc1) + impurity_mass(n - nc, n1 - nc1), impurity_mass(n, n1)
        )
        return -eps * h / (H_SENSITIVITY * k)
    g, _ = gini_scores(n, n1, nc, nc1)
    u = np.append(1.0 - g, 1.0 - node_gini(n, n1))
    return eps * u / (2.0 * G_SENSITIVITY)


def _select(
    mech: str,
    n: float,
    n1: float,
    nc: np.ndarray,
    nc1: np.ndarray,
    params: LearnerParams,
    plan: BudgetPlan,
    noise: _Noise,
    floor: int,
) -> int | None:
    """Index (into the active candidates) of the rule to add, or None to stop."""
    src, eps = noise.src, plan.epsilon_node
    m = nc.shape[0]
    if mech in ("monotone_em", "exponential"):
        # Gumbel-max: argmax(log-weight + Gumbel(1)) samples the exponential mechanism exactly.
        score = em_log_weights(mech, n, n1, nc, nc1, eps, params.rows_per_unit)
        best = int(np.argmax(score + src.gumbel(1.0, m + 1)))
        return None if best == m else best
    g, gc = gini_scores(n, n1, nc, nc1)
    g0 = node_gini(n, n1)
    if mech == "none":
        # exact ties matter here: round away float noise (G = G_c + G_l vs the node Gini)
        g, gc, g0 = np.round(g, 12), np.round(gc, 12), round(g0, 12)
        order = np.lexsort((gc, g))
        best = int(order[0])
        ok = g[best] < g0 or (g[best] == g0 and gc[best] < g0)
        return best if ok else None
    if mech in SMOOTH:
        sens = smooth_sensitivity(
            max(round(n), floor), noise.smooth.beta, floor, strict=params.strict_sensitivity
        )
        z = np.asarray(noise.smooth.noise(src, sens, size=m + 1), dtype=np.float64)
        g = g + z[:m]
        g0 = g0 + z[m]
    elif mech == "global_laplace":
        g = g + src.laplace(G_SENSITIVITY / eps, m)
    elif mech == "global_gaussian":
        sigma = analytic_gaussian_sigma(G_SENSITIVITY, eps, plan.delta_node)
        g = g + src.gaussian(sigma, m)
    best = int(np.argmin(g))
    return best if g[best] < g0 else None
