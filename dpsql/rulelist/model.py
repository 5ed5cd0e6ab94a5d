"""A learned rule list: prediction, text, JSON and SQL forms.

Everything here is post-processing of what the learner released (the chosen antecedents, the
noisy label counts and the predictions derived from them), so none of it costs privacy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dpsql.rulelist.candidates import Feature, Literal, Rule, rule_mask, rule_name, rule_sql


@dataclass(frozen=True)
class LearnedRule:
    """One rule ``antecedent -> prediction``; the default rule has an empty antecedent.

    ``counts`` = (negative, positive) label counts of the rows the rule caught during training,
    noisy for private mechanisms and clamped at 0 (post-processing).
    """

    antecedent: Rule
    prediction: int
    counts: tuple[float, float]

    @property
    def is_default(self) -> bool:
        return not self.antecedent

    def proba(self) -> float:
        """P(y = 1) from the (noisy) counts, clamped at 0 with a +½ prior: post-processing."""
        c0, c1 = (max(float(c), 0.0) for c in self.counts)
        return (c1 + 0.5) / (c0 + c1 + 1.0)


@dataclass(frozen=True)
class RuleList:
    """An ordered rule list; the first rule whose antecedent holds decides."""

    features: tuple[Feature, ...]
    rules: tuple[LearnedRule, ...]
    stop_reason: str = "max_length"
    notes: tuple[str, ...] = field(default=())
    #: Scale of the discrete Laplace noise on each released count (0: exact counts).
    count_scale: float = 0.0

    @property
    def default(self) -> LearnedRule:
        return self.rules[-1]

    def _first_match(self, X: np.ndarray) -> np.ndarray:
        """Index of the rule deciding each row (vectorised over rows)."""
        X = np.asarray(X)
        decided = np.full(X.shape[0], len(self.rules) - 1, dtype=np.int64)
        open_ = np.ones(X.shape[0], dtype=bool)
        for i, rule in enumerate(self.rules[:-1]):
            hit = open_ & rule_mask(X, rule.antecedent)
            decided[hit] = i
            open_ &= ~hit
        return decided

    def predict(self, X: np.ndarray) -> np.ndarray:
        preds = np.asarray([r.prediction for r in self.rules], dtype=np.int64)
        return preds[self._first_match(X)]

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        p1 = np.asarray([r.proba() for r in self.rules])[self._first_match(X)]
        return np.column_stack([1.0 - p1, p1])

    def rule_text(self, rule: LearnedRule) -> str:
        return "True" if rule.is_default else rule_name(rule.antecedent, self.features)

    def rule_predicate(self, rule: LearnedRule) -> str:
        return "TRUE" if rule.is_default else rule_sql(rule.antecedent, self.features)

    def describe(self, labels: Sequence[Any] = (0, 1)) -> str:
        """Readable list, one rule per line, predictions shown as ``labels[q]``."""
        lines = []
        for i, r in enumerate(self.rules):
            head = "else" if r.is_default else ("if" if i == 0 else "else if")
            cond = "" if r.is_default else f" [{self.rule_text(r)}]"
            counts = ", ".join(_fmt(c) for c in r.counts)
            lines.append(f"{head}{cond} then {labels[r.prediction]}   (counts: {counts})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def to_sql_case(self, labels: Sequence[Any] = (0, 1)) -> str:
        """The list as ``CASE WHEN p1 THEN q1 ... ELSE q0 END``; ``labels`` map 0/1 to literals."""
        lit = [_sql_literal(v) for v in labels]
        parts = ["CASE"]
        for r in self.rules[:-1]:
            parts.append(f"WHEN {self.rule_predicate(r)} THEN {lit[r.prediction]}")
        parts.append(f"ELSE {lit[self.default.prediction]} END")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "features": [asdict(f) for f in self.features],
            "rules": [
                {
                    "antecedent": [[lit.feature, lit.positive] for lit in r.antecedent],
                    "prediction": r.prediction,
                    "counts": list(r.counts),
                }
                for r in self.rules
            ],
            "stop_reason": self.stop_reason,
            "notes": list(self.notes),
            "count_scale": self.count_scale,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> RuleList:
        features = tuple(Feature(**f) for f in data["features"])
        rules = tuple(
            LearnedRule(
                antecedent=tuple(Literal(int(j), bool(p)) for j, p in r["antecedent"]),
                prediction=int(r["prediction"]),
                counts=(float(r["counts"][0]), float(r["counts"][1])),
            )
            for r in data["rules"]
        )
        return RuleList(
            features,
            rules,
            data.get("stop_reason", ""),
            tuple(data.get("notes", ())),
            float(data.get("count_scale", 0.0)),
        )

    def rule_stats(self, rule: LearnedRule, alpha: float = 0.05) -> RuleStats:
        """Noisy support, positive rate and its 1-α interval: post-processing of the counts."""
        return rule_stats(rule.counts, self.count_scale, alpha)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @staticmethod
    def from_json(text: str) -> RuleList:
        return RuleList.from_dict(json.loads(text))


@dataclass(frozen=True)
class RuleStats:
    """What a rule's released counts say: support, positive rate and its interval.

    The interval covers the rate among the training rows the rule caught, against the DP
    noise only (each count within ±t with probability 1 - α/2, a union bound over the two);
    sampling error of the training set is not included.
    """

    support: float
    rate: float | None
    low: float
    high: float


def count_margin(scale: float, alpha: float) -> int:
    """Smallest t with P(|Z| > t) <= α/2 for the sampler's discrete Laplace at ``scale``.

    P(|Z| > t) = 2·P(Z >= t + 1), so t = m − 1 for the smallest m with P(Z >= m) <= α/4.
    The closed form m ≈ r·(ln(4/α) − ln(1 + q)) (q = e^(−1/r), r the realised scale) is where
    the exact search starts; it gallops and bisects from there
    (:func:`dpsql.privacy.mechanisms.smallest_m`), so the number of tail evaluations is
    O(log) of the guess's error and never grows with the scale. This runs after the charge
    at any ε the plan accepted (docs/threat_model.md, "Bounded work after the charge").
    """
    if scale <= 0:
        return 0
    from dpsql.privacy.mechanisms import discrete_laplace_tail, smallest_m
    from dpsql.privacy.samplers import laplace_scale

    target = alpha / 4.0
    r = float(laplace_scale(scale))
    guess = max(0, math.ceil(r * (-math.log(target) - math.log1p(math.exp(-1.0 / r)))))
    return max(smallest_m(lambda m: discrete_laplace_tail(scale, m), target, guess) - 1, 0)


def rule_stats(counts: tuple[float, float], scale: float, alpha: float = 0.05) -> RuleStats:
    c0, c1 = (max(float(c), 0.0) for c in counts)
    support = c0 + c1
    rate = c1 / support if support > 0 else None
    t = count_margin(scale, alpha)
    lo1, hi1 = max(c1 - t, 0.0), c1 + t
    lo0, hi0 = max(c0 - t, 0.0), c0 + t
    low = lo1 / (lo1 + hi0) if lo1 + hi0 > 0 else 0.0
    high = hi1 / (hi1 + lo0) if hi1 + lo0 > 0 else 1.0
    return RuleStats(support, rate, low, high)


def _fmt(c: float) -> str:
    return str(int(c)) if float(c).is_integer() else f"{c:.1f}"


def _sql_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | float | np.integer | np.floating):
        return repr(value.item() if isinstance(value, np.generic) else value)
    return "'" + str(value).replace("'", "''") + "'"
