"""Empirical privacy audit: a statistical lower bound on the privacy loss of a release.

Run a release many times on neighbouring datasets D and D′, count how often each pre-declared
event S (a set of outputs) occurs under each, and bound the probabilities with Clopper–Pearson
intervals. If the release is (ε, δ)-DP then for every S, in both directions,

    P_D(S) <= e^ε P_D′(S) + δ,

so ``ln((P_lo(S) − δ) / Q_hi(S))``, with P_lo a lower confidence bound on one side and Q_hi an
upper confidence bound on the other, is a lower confidence bound on the true ε. An audit
reports the largest such bound over all events and both directions; a value above the claimed ε
is a statistically significant violation.

All bounds hold *simultaneously* at the stated confidence (Bonferroni over every bound computed,
whether or not its event had enough mass to matter), so picking the best event after looking at
the counts is allowed. A correct mechanism fails an audit with probability <= 1 − confidence.
The bound is only as tight as the best event: use events where the likelihood ratio is
largest (for additive noise, the tails beyond the shift) and enough runs to give them mass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from dpsql.privacy.samplers import NoiseSource


def clopper_pearson(hits: int, runs: int, alpha: float) -> tuple[float, float]:
    """One-sided Clopper–Pearson bounds (lower, upper) on a binomial proportion, each holding
    with probability >= 1 − ``alpha`` (exact: computed from the beta distribution)."""
    if runs <= 0 or not 0 <= hits <= runs:
        raise ValueError(f"need 0 <= hits <= runs and runs > 0, got {hits}/{runs}")
    if not 0 < alpha < 1:
        raise ValueError("alpha must be in (0, 1)")
    lower = 0.0 if hits == 0 else float(stats.beta.ppf(alpha, hits, runs - hits + 1))
    upper = 1.0 if hits == runs else float(stats.beta.ppf(1 - alpha, hits + 1, runs - hits))
    return lower, upper


@dataclass(frozen=True)
class Event:
    """A set of outputs and how many runs on D and on D′ fell in it."""

    name: str
    hits_d: int
    hits_d2: int


def indicator_event(name: str, in_d: np.ndarray, in_d2: np.ndarray) -> Event:
    """An event from per-run booleans (one array per dataset)."""
    return Event(name, int(np.count_nonzero(in_d)), int(np.count_nonzero(in_d2)))


def threshold_events(
    name: str, stat_d: np.ndarray, stat_d2: np.ndarray, thresholds: Sequence[float]
) -> list[Event]:
    """Tails {stat <= t}, {stat >= t} and bins {t_i < stat <= t_i+1} of a scalar statistic.

    ``thresholds`` must be fixed before the runs (from public parameters such as the noise scale
    and the sensitivity), never from the observed values. ±inf is allowed in the statistic
    (e.g. −inf for a suppressed group) and falls in the tails.
    """
    ts = np.sort(np.asarray(thresholds, dtype=float))
    events = []
    for i, t in enumerate(ts):
        events.append(indicator_event(f"{name} <= {t:g}", stat_d <= t, stat_d2 <= t))
        events.append(indicator_event(f"{name} >= {t:g}", stat_d >= t, stat_d2 >= t))
        if i:
            lo = ts[i - 1]
            events.append(
                indicator_event(
                    f"{lo:g} < {name} <= {t:g}",
                    (stat_d > lo) & (stat_d <= t),
                    (stat_d2 > lo) & (stat_d2 <= t),
                )
            )
    return events


@dataclass(frozen=True)
class Witness:
    """The event and direction giving an audit's largest lower bound on ε."""

    event: str
    direction: str  # "D/D′" (P = D, Q = D′) or "D′/D"
    p_hits: int
    q_hits: int
    p_lower: float
    q_upper: float
    epsilon_lower: float


@dataclass(frozen=True)
class AuditReport:
    """Result of :func:`audit`: the best simultaneous lower bounds on ε (at the claimed δ) and
    on δ (at the claimed ε), and whether either shows a violation."""

    epsilon: float
    delta: float
    confidence: float
    runs_d: int
    runs_d2: int
    bounds: int  # number of one-sided confidence bounds the confidence is split over
    epsilon_lower: float  # −inf when no event has P_lo > δ
    delta_lower: float  # max over events of P_lo − e^ε Q_hi (<= δ unless violated)
    witness: Witness | None

    @property
    def violated(self) -> bool:
        return self.epsilon_lower > self.epsilon or self.delta_lower > self.delta

    def __str__(self) -> str:
        w = self.witness
        where = "no event with P_lo > δ"
        if w is not None:
            p_runs, q_runs = (
                (self.runs_d, self.runs_d2)
                if w.direction == "D/D′"
                else (self.runs_d2, self.runs_d)
            )
            where = (
                f"{w.event} [{w.direction}: {w.p_hits}/{p_runs} vs {w.q_hits}/{q_runs}, "
                f"P_lo={w.p_lower:.4g}, Q_hi={w.q_upper:.4g}]"
            )
        verdict = "VIOLATION" if self.violated else "ok"
        return (
            f"ε={self.epsilon:g} δ={self.delta:g}: ε̂_lo={self.epsilon_lower:.3f} "
            f"δ̂_lo={self.delta_lower:.3g} at {self.confidence:g} over {self.bounds} bounds, "
            f"{self.runs_d}+{self.runs_d2} runs, {verdict}; best: {where}"
        )


def audit(
    events: Sequence[Event],
    runs_d: int,
    runs_d2: int,
    *,
    epsilon: float,
    delta: float = 0.0,
    confidence: float = 0.999,
) -> AuditReport:
    """Lower confidence bounds on the privacy loss shown by ``events``, both directions.

    Every event gives two ratio tests (P = D, Q = D′ and the reverse), each needing a lower
    bound on P and an upper bound on Q: 4·len(events) one-sided bounds share 1 − confidence.
    """
    if not events:
        raise ValueError("an audit needs at least one event")
    bounds = 4 * len(events)
    alpha = (1 - confidence) / bounds
    best: Witness | None = None
    eps_lower = -math.inf
    delta_lower = -math.inf
    for ev in events:
        d_lo, d_hi = clopper_pearson(ev.hits_d, runs_d, alpha)
        d2_lo, d2_hi = clopper_pearson(ev.hits_d2, runs_d2, alpha)
        for direction, p_hits, q_hits, p_lo, q_hi in (
            ("D/D′", ev.hits_d, ev.hits_d2, d_lo, d2_hi),
            ("D′/D", ev.hits_d2, ev.hits_d, d2_lo, d_hi),
        ):
            delta_lower = max(delta_lower, p_lo - math.exp(epsilon) * q_hi)
            if p_lo <= delta:
                continue
            value = math.log((p_lo - delta) / q_hi)
            if value > eps_lower:
                eps_lower = value
                best = Witness(ev.name, direction, p_hits, q_hits, p_lo, q_hi, value)
    return AuditReport(
        epsilon=epsilon,
        delta=delta,
        confidence=confidence,
        runs_d=runs_d,
        runs_d2=runs_d2,
        bounds=bounds,
        epsilon_lower=eps_lower,
        delta_lower=delta_lower,
        witness=best,
    )


class BufferedNoise:
    """Serves integer noise from large pre-drawn batches of an inner source.

    For audits that release thousands of times: the exact samplers cost ~1 ms of fixed
    overhead per call, so one call per release would dominate. Draws are i.i.d., so serving
    them in a different grouping leaves the joint distribution of every release unchanged.
    """

    def __init__(self, inner: NoiseSource, batch: int = 1 << 16) -> None:
        self.inner = inner
        self.batch = batch
        self._buffers: dict[tuple[str, float | tuple], tuple[np.ndarray, int]] = {}

    def _take(self, kind: str, parameter: float | tuple, size: int) -> np.ndarray:
        buffer, used = self._buffers.get((kind, parameter), (np.zeros(0, np.int64), 0))
        if used + size > buffer.size:
            draw = getattr(self.inner, kind)
            args = parameter if isinstance(parameter, tuple) else (parameter,)
            fresh = draw(*args, max(self.batch, size))
            buffer, used = np.concatenate([buffer[used:], fresh]), 0
        self._buffers[(kind, parameter)] = (buffer, used + size)
        return buffer[used : used + size]

    def discrete_laplace(self, scale: float, size: int) -> np.ndarray:
        return self._take("discrete_laplace", scale, size)

    def discrete_gaussian(self, sigma: float, size: int) -> np.ndarray:
        return self._take("discrete_gaussian", sigma, size)

    def discrete_staircase(self, epsilon: float, period: int, step: int, size: int) -> np.ndarray:
        return self._take("discrete_staircase", (epsilon, period, step), size)

    def uniform(self, size: int) -> np.ndarray:
        return self.inner.uniform(size)

    def laplace(self, scale: float, size: int) -> np.ndarray:
        return self.inner.laplace(scale, size)

    def gaussian(self, sigma: float, size: int) -> np.ndarray:
        return self.inner.gaussian(sigma, size)

    def cauchy(self, size: int) -> np.ndarray:
        return self.inner.cauchy(size)

    def gumbel(self, scale: float, size: int) -> np.ndarray:
        return self.inner.gumbel(scale, size)
