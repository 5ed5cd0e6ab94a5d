"""DP-GreedyRL (Algorithm 1 of Ly et al. 2024) and its variants, vectorised.

The data enters as :class:`~dpsql.rulelist.candidates.Patterns` (distinct feature rows with
label counts), so memory and time follow the number of patterns, not of rows.  One pass per
rule position: the remaining label counts of every candidate come from a few BLAS products
over the weighted literal rows (:class:`~dpsql.rulelist.candidates.RuleCounter`), the
criterion for all candidates is one numpy expression, and the selection draws one noise
vector.  No Python loop runs over samples or candidates.

Every random draw goes through a :class:`~dpsql.privacy.samplers.NoiseSource`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from dpsql.errors import DataError, PrivacyError, ProgrammingError
from dpsql.privacy.accounting import Cost
from dpsql.privacy.mechanisms import analytic_gaussian_sigma
from dpsql.privacy.samplers import NoiseSource
from dpsql.rulelist.candidates import Feature, Patterns, Rule, RuleCounter
from dpsql.rulelist.gini import (
    gini_scores,
    impurity_mass,
    node_gini,
    smooth_sensitivity,
    support_threshold,
)
from dpsql.rulelist.model import LearnedRule, RuleList

if TYPE_CHECKING:
    from dpsql.privacy.smooth import SmoothCauchy, SmoothLaplace

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
    ``paper_budget`` splits ε as the authors' code does (3L-1 shares for smooth_*, 2L for
    exponential), one more share than a fit can spend; the default gives it to the nodes.
    """

    epsilon: float = 1.0
    delta: float | None = None
    max_length: int = 5
    min_support: float = 0.05
    mechanism: str = "smooth_laplace"
    confidence: float = 0.99
    strict_sensitivity: bool = True
    rows_per_unit: int = 1
    paper_budget: bool = False

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

    smooth_*: 3L-2 steps of ε/(3L-2).  A fit runs L-1 × {support check, selection, counts}
    + the default counts when it reaches L-1 rules, and fewer when it stops early (a failed
    check at position j < L-1 ends it after 3j+2 steps, a rejected selection after 3j+3), so
    the paper's 3L-1 shares leave one unspent; ``paper_budget`` keeps that split.  δ/(L-1) per
    smooth-Laplace selection.  monotone_em, global_*, exponential: 2L-1 (selection + counts
    per rule, default counts; the authors' exponential baseline splits in 2L), plus one
    noisy row count for monotone_em's fractional minimum support (:func:`needs_row_count`).
    ``n_rows`` is only used for the paper's default δ = 1/n².
    """
    p = params
    sel = p.max_length - 1
    if p.mechanism == "none":
        return BudgetPlan(math.inf, 0.0, 0, Cost())
    extra = 1 if p.paper_budget else 0
    steps = {
        "smooth_laplace": 3 * p.max_length - 2 + extra,
        "smooth_cauchy": 3 * p.max_length - 2 + extra,
        "exponential": 2 * p.max_length - 1 + extra,
    }.get(p.mechanism, 2 * p.max_length - 1)
    if needs_row_count(p):
        steps += 1
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


def check_drawable(params: LearnerParams, plan: BudgetPlan) -> None:
    """ValueError unless every mechanism a fit may run can run at ``plan.epsilon_node``:
    the label counts' discrete Laplace (k/ε_node, the exact sampler's range), the smooth
    mechanisms' β and support margin T, global_gaussian's σ. Decided by the arguments alone,
    in O(1), before the charge; afterwards no draw refuses because of its ε."""
    from dpsql.privacy.samplers import check_laplace_drawable

    if params.mechanism == "none":
        return
    eps = plan.epsilon_node
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError("epsilon_node is 0: epsilon is too small for this max_length")
    check_laplace_drawable(params.rows_per_unit / eps)
    if params.max_length < 2:
        return
    if params.mechanism in SMOOTH:
        from dpsql.privacy.smooth import SmoothCauchy, SmoothLaplace

        smooth = (
            SmoothCauchy(eps)
            if params.mechanism == "smooth_cauchy"
            else SmoothLaplace(eps, plan.delta_node)
        )
        if not (smooth.beta > 0 and smooth.alpha > 0):
            raise ValueError("epsilon_node is too small for the smooth sensitivity's beta")
        support_threshold(eps, params.confidence)
    elif params.mechanism == "global_gaussian":
        if not math.isfinite(analytic_gaussian_sigma(G_SENSITIVITY, eps, plan.delta_node)):
            raise ValueError("epsilon_node is too small for the Gaussian's sigma")
    elif params.mechanism == "global_laplace":
        check_laplace_drawable(G_SENSITIVITY / eps)


def needs_row_count(p: LearnerParams) -> bool:
    """monotone_em with a fractional minimum support spends one share on a noisy row count.

    Λ = ⌊λ·ñ⌋ needs a row count and n is private; the smooth mechanisms take ñ from their
    first support check, monotone_em has none, so it pays for one (an absolute
    ``min_support >= 1`` or 0 needs nothing).
    """
    return p.mechanism == "monotone_em" and 0 < p.min_support < 1 and p.max_length > 1


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
        self.smooth: SmoothCauchy | SmoothLaplace | None = None
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

    def count(self, n: float) -> float:
        """One noisy count (discrete Laplace k/ε_node), e.g. monotone_em's row count."""
        return float(n + self.src.discrete_laplace(self.k / self.plan.epsilon_node, 1)[0])

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
    sample_weight: np.ndarray | None = None,
) -> RuleList:
    """Learn a rule list from rows: ``X`` is (n, len(features)) 0/1, ``y`` 0/1.

    ``sample_weight`` are non-negative integer counts (a row of weight 3 is three rows: the
    guarantee is per unit of weight).  The rows are grouped into :class:`Patterns` first.
    """
    y = check_labels(y)
    X = np.asarray(X)
    if X.ndim != 2 or X.shape[0] != y.shape[0]:
        raise DataError("features and labels have different row counts", sqlstate="22023")
    weight = None if sample_weight is None else check_counts(sample_weight, X.shape[0])
    return learn_patterns(
        Patterns.from_rows(X, y, weight), features, candidates, params, source, counter=counter
    )


def check_counts(weight: np.ndarray, n: int) -> np.ndarray:
    """Integer, non-negative, finite counts of length n, or a DataError (no values named)."""
    w = np.asarray(weight, dtype=np.float64)
    if w.shape != (n,):
        raise DataError(
            "sample_weight must have one entry per row", sqlstate="22023", construct="sample_weight"
        )
    if not (np.isfinite(w).all() and (w >= 0).all() and (w == np.round(w)).all()):
        raise DataError(
            "sample_weight must hold non-negative whole numbers (counts of identical rows)",
            sqlstate="22023",
            construct="sample_weight",
            hint="the guarantee is per unit of weight: repeat rows rather than scale them",
        )
    return w


def learn_patterns(
    data: Patterns,
    features: Sequence[Feature],
    candidates: Sequence[Rule],
    params: LearnerParams,
    source: NoiseSource,
    *,
    counter: RuleCounter | None = None,
    check: Callable[[], None] | None = None,
) -> RuleList:
    """Learn a rule list (Algorithm 1 and variants) from weighted feature patterns.

    The candidate list must not depend on the data for the privacy guarantee to hold (see
    :mod:`dpsql.rulelist.candidates`).  ``counter`` may pass a precomputed
    :class:`RuleCounter` for ``data.X`` and these candidates (benchmarks reuse it).
    ``check`` runs before each rule position (min(max_length − 1, candidates) of them, each
    O(patterns × candidates) numpy work): a cancel or statement timeout stops the fit there.
    """
    params.validate()
    n = data.total
    plan = plan_budget(params, round(n))
    noise = _Noise(params, plan, source)
    rc = RuleCounter(data.X, candidates) if counter is None else counter
    w = (data.neg + data.pos).astype(np.float64)  # remaining weight of each pattern
    wy = data.pos.astype(np.float64).copy()
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
    elif mech == "monotone_em" and L > 1 and params.min_support > 0:
        # a fraction needs ñ: one noisy count, included in the budget (needs_row_count)
        size = noise.count(float(n)) if needs_row_count(params) else 0.0
        floor = support_floor(params.min_support, size)
    dropped = 0

    for position in range(L - 1):
        if check is not None:
            check()
        rem = float(w.sum())
        rem1 = float(wy.sum())
        if mech in SMOOTH:
            noisy = first_size if position == 0 and first_size is not None else noise.size(rem)
            if noisy < floor + threshold:
                stop = "support_check"
                break
        idx = np.flatnonzero(active)
        if idx.size == 0:
            stop = "no_candidates"
            break
        nc, nc1 = rc.counts(w, wy)
        nc, nc1 = nc[idx].astype(np.float64), nc1[idx].astype(np.float64)
        pick = _select(mech, rem, rem1, nc, nc1, params, plan, noise, floor)
        if pick is None:
            stop = "no_improvement" if mech not in ("exponential", "monotone_em") else "stop"
            break
        j = int(idx[pick])
        caught = rc.caught(j) & (w > 0)
        c1 = float(wy[caught].sum())
        c0 = float(w[caught].sum()) - c1
        q0, q1 = noise.counts(c0, c1)
        active[j] = False
        if mech == "monotone_em" and q0 + q1 < floor:
            # post-processing of the released counts: a rule whose noisy support is below
            # Λ is not kept and its rows stay; the position's budget is spent all the same
            dropped += 1
            continue
        chosen.append(LearnedRule(tuple(candidates[j]), _predict(q0, q1), _clamped(q0, q1)))
        w[caught] = 0
        wy[caught] = 0

    rem = float(w.sum())
    rem1 = float(wy.sum())
    d0, d1 = noise.counts(rem - rem1, rem1)
    chosen.append(LearnedRule((), _predict(d0, d1), _clamped(d0, d1)))
    if dropped:
        notes.append(
            f"{dropped} selected rule(s) had a noisy support below the minimum support "
            f"Λ = {floor} and were not kept (lower min_support or raise epsilon to keep "
            "smaller rules)"
        )
    if len(chosen) == 1 and L > 1:
        notes.append(_default_only_note(stop, floor, threshold, plan))
    scale = 0.0 if mech == "none" else params.rows_per_unit / plan.epsilon_node
    return RuleList(tuple(features), tuple(chosen), stop, tuple(notes), scale)


def _clamped(c0: float, c1: float) -> tuple[float, float]:
    """Released counts clamped at 0 (post-processing; the prediction uses the raw pair)."""
    return max(c0, 0.0), max(c1, 0.0)


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
    if stop == "max_length":
        return "only the default rule: every selected rule was below the minimum support"
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
        assert noise.smooth is not None  # set for every smooth mechanism that selects rules
        sens = smooth_sensitivity(
            max(round(n), floor), noise.smooth.beta, floor, strict=params.strict_sensitivity
        )
        z = np.asarray(noise.smooth.noise(src, sens, size=m + 1), dtype=np.float64)
        g = g + z[:m]
        g0 = g0 + cast(float, z[m])  # a numpy scalar; the stubs say ndarray
    elif mech == "global_laplace":
        g = g + src.laplace(G_SENSITIVITY / eps, m)
    elif mech == "global_gaussian":
        sigma = analytic_gaussian_sigma(G_SENSITIVITY, eps, plan.delta_node)
        g = g + src.gaussian(sigma, m)
    best = int(np.argmin(g))
    return best if g[best] < g0 else None
