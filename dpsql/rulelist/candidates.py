"""Boolean features and the candidate rules built from them.

A *feature* is a public boolean predicate over one row (``workclass = 'Private'``,
``age >= 40``, or a 0/1 column).  A *literal* is a feature or its negation; a candidate rule is a
conjunction of up to ``max_card`` literals.

By default the candidate set depends only on the features (that is, on declared public domains)
and is never filtered by the data, so choosing among the candidates is the only data access and
the privacy proof covers it.  :func:`mined_candidates` reproduces the paper's pre-mining, which
keeps conjunctions whose *training* support lies in [λ, 1-λ]: it reads the data and is NOT
differentially private (spec §9.5); it exists for the reproduction benchmark.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpsql.errors import DataError
from dpsql.sql.identifiers import quote_ident


@dataclass(frozen=True)
class Feature:
    """A public boolean predicate over a row, with its negation spelt out.

    ``sql`` must be true exactly on the rows the feature matrix marks 1 and ``neg_sql`` on the
    rows marked 0 (NULLs included), so ``to_sql_case`` scores rows as ``predict`` does.
    ``exclusive`` names a set of features of which at most one holds (the values of one
    categorical column); conjunctions of two of them are always empty and are not generated.
    """

    name: str
    sql: str
    neg_name: str
    neg_sql: str
    exclusive: str | None = None

    @staticmethod
    def binary_column(column: str) -> Feature:
        """A 0/1 column: ``col = 1`` / ``col = 0``."""
        q = quote_ident(column)
        return Feature(column, f"{q} = 1", f"not {column}", f"{q} = 0")


@dataclass(frozen=True)
class Literal:
    feature: int
    positive: bool = True


#: A candidate rule: a conjunction of literals (sorted, no feature twice).
Rule = tuple[Literal, ...]


def literal_name(lit: Literal, features: Sequence[Feature]) -> str:
    f = features[lit.feature]
    return f.name if lit.positive else f.neg_name


def literal_sql(lit: Literal, features: Sequence[Feature]) -> str:
    f = features[lit.feature]
    return f.sql if lit.positive else f.neg_sql


def rule_name(rule: Rule, features: Sequence[Feature]) -> str:
    return " and ".join(literal_name(lit, features) for lit in rule)


def rule_sql(rule: Rule, features: Sequence[Feature]) -> str:
    parts = [literal_sql(lit, features) for lit in rule]
    return parts[0] if len(parts) == 1 else " AND ".join(f"({p})" for p in parts)


def _literals(n_features: int, negations: bool) -> list[Literal]:
    out: list[Literal] = []
    for j in range(n_features):
        out.append(Literal(j, True))
        if negations:
            out.append(Literal(j, False))
    return out


def _compatible(combo: Sequence[Literal], features: Sequence[Feature]) -> bool:
    """No feature twice, and no two positive literals of one exclusive group (always empty)."""
    seen: set[int] = set()
    groups: set[str] = set()
    for lit in combo:
        if lit.feature in seen:
            return False
        seen.add(lit.feature)
        group = features[lit.feature].exclusive
        if lit.positive and group is not None:
            if group in groups:
                return False
            groups.add(group)
    return True


def public_candidates(
    features: Sequence[Feature], max_card: int = 2, *, negations: bool = True
) -> list[Rule]:
    """Every conjunction of up to ``max_card`` literals: a function of the features only."""
    if max_card < 1:
        raise ValueError("max_card must be >= 1")
    lits = _literals(len(features), negations)
    rules: list[Rule] = []
    for card in range(1, max_card + 1):
        for combo in itertools.combinations(lits, card):
            if _compatible(combo, features):
                rules.append(tuple(combo))
    return rules


def literal_matrix(X: np.ndarray, negations: bool = True) -> np.ndarray:
    """(n, n_literals) float32 0/1 matrix in :func:`_literals` order."""
    Xf = X.astype(np.float32, copy=False)
    if not negations:
        return np.ascontiguousarray(Xf)
    out = np.empty((X.shape[0], 2 * X.shape[1]), dtype=np.float32)
    out[:, 0::2] = Xf
    out[:, 1::2] = 1.0 - Xf
    return out


def mined_candidates(
    X: np.ndarray, min_support: float, max_card: int = 2, *, negations: bool = True
) -> list[Rule]:
    """The paper's data-mined candidates (``utils_greedy.mine_rules_combinations``). NOT DP.

    Literals with training support ≥ λ are building blocks; a conjunction (or literal) is a
    candidate when its support lies in [λ, 1-λ].  Same order as the authors' code, including
    x ∧ ¬x pairs at λ = 0, so tie-breaking matches.
    """
    n = X.shape[0]
    if n == 0:
        raise DataError("cannot mine candidate rules on an empty training set", sqlstate="22023")
    lits = _literals(X.shape[1], negations)
    lm = literal_matrix(X, negations)
    supp = lm.sum(axis=0) / n
    blocks = [i for i in range(len(lits)) if supp[i] >= min_support]
    rules: list[Rule] = [(lits[i],) for i in blocks if supp[i] <= 1 - min_support]
    for card in range(2, max_card + 1):
        combos = list(itertools.combinations(blocks, card))
        if not combos:
            continue
        idx = np.asarray(combos)
        if card == 2:
            co = (lm.T @ lm) / n
            s = co[idx[:, 0], idx[:, 1]]
        else:
            s = np.prod(lm[:, idx], axis=2).sum(axis=0) / n
        keep = (s >= min_support) & (s <= 1 - min_support)
        rules.extend(
            tuple(lits[i] for i in combo) for combo, k in zip(combos, keep, strict=True) if k
        )
    return rules


def _literal_rows(X: np.ndarray) -> np.ndarray:
    """(2f+1, n) 0/1 rows: x_0, not x_0, x_1, ..., and a final all-ones row (empty literal).

    float32 sums of 0/1 values are exact below 2**24 rows; float64 above.
    """
    n, f = X.shape
    dtype = np.float32 if n < 2**24 else np.float64
    lits = np.empty((2 * f + 1, n), dtype=dtype)
    lits[0 : 2 * f : 2] = X.T
    lits[1 : 2 * f : 2] = 1 - lits[0 : 2 * f : 2]
    lits[2 * f] = 1.0
    return lits


def _literal_index(rules: Sequence[Rule], pos: int, n_features: int) -> np.ndarray:
    return np.asarray(
        [
            2 * r[pos].feature + (0 if r[pos].positive else 1) if pos < len(r) else 2 * n_features
            for r in rules
        ],
        dtype=np.int64,
    )


def rule_matrix(X: np.ndarray, rules: Sequence[Rule]) -> np.ndarray:
    """(m, n) 0/1 matrix, rule-major: entry (j, i) = 1 iff rule j catches row i."""
    lits = _literal_rows(X)
    out = np.ones((len(rules), X.shape[0]), dtype=lits.dtype)
    for pos in range(max((len(r) for r in rules), default=0)):
        out *= lits[_literal_index(rules, pos, X.shape[1])]
    return out


class RuleCounter:
    """Per-node label counts of every candidate, and the rows one candidate catches.

    Rules of up to two literals (the paper's ``max_card = 2``) are counted through the literal
    co-occurrence matrix: with L the (2f+1, n) literal rows and w the 0/1 "still uncaught"
    weights, (L·diag(w)·Lᵀ)[i, j] is the count of uncaught rows satisfying literals i and j,
    an O(n f²) BLAS product per node whatever the number of candidates, with no (n, m)
    matrix.  Longer rules fall back to the (m, n) :func:`rule_matrix`.
    """

    def __init__(self, X: np.ndarray, rules: Sequence[Rule]) -> None:
        self.n_rules = len(rules)
        self.lits = _literal_rows(X)
        width = max((len(r) for r in rules), default=1)
        self.pair = width <= 2
        f = X.shape[1]
        self.idx = [_literal_index(rules, pos, f) for pos in range(max(width, 2))]
        self.matrix = None if self.pair else rule_matrix(X, rules)

    @property
    def dtype(self) -> np.dtype:
        return self.lits.dtype

    def counts(self, w: np.ndarray, wy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n_c, n_c1) for every candidate over the rows weighted by w (0/1), wy = w·y."""
        if self.matrix is not None:
            return self.matrix @ w, self.matrix @ wy
        i0, i1 = self.idx[0], self.idx[1]
        co = (self.lits * w) @ self.lits.T
        co1 = (self.lits * wy) @ self.lits.T
        return co[i0, i1], co1[i0, i1]

    def caught(self, j: int) -> np.ndarray:
        """Boolean vector of the rows rule j catches (all rows, caught earlier or not)."""
        if self.matrix is not None:
            return self.matrix[j] > 0
        return (self.lits[self.idx[0][j]] * self.lits[self.idx[1][j]]) > 0


def rule_mask(X: np.ndarray, rule: Rule) -> np.ndarray:
    """Boolean vector: rows of ``X`` caught by ``rule``."""
    mask = np.ones(X.shape[0], dtype=bool)
    for lit in rule:
        col = X[:, lit.feature].astype(bool)
        mask &= col if lit.positive else ~col
    return mask
