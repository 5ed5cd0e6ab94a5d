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


def quote_ident(name: str) -> str:
    """Standard-SQL double-quoted identifier."""
    return '"' + name.replace('"', '""') + '"'


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


def rule_matrix(X: np.ndarray, rules: Sequence[Rule]) -> np.ndarray:
    """(n, m) float32 0/1 matrix: row i caught by rule j.

    Float32 so that the per-node counts are one BLAS matrix-vector product (exact integers up
    to 2**24 rows; float64 above that).  Built by gathering columns of the literal matrix.
    """
    n, f = X.shape
    dtype = np.float32 if n < 2**24 else np.float64
    lits = np.empty((n, 2 * f + 1), dtype=dtype)
    lits[:, 0 : 2 * f : 2] = X
    lits[:, 1 : 2 * f : 2] = 1 - lits[:, 0 : 2 * f : 2]
    lits[:, 2 * f] = 1.0
    if not rules:
        return np.ones((n, 0), dtype=dtype)
    width = max(len(r) for r in rules)
    out: np.ndarray | None = None
    for pos in range(width):
        idx = np.asarray(
            [
                2 * r[pos].feature + (0 if r[pos].positive else 1) if pos < len(r) else 2 * f
                for r in rules
            ]
        )
        cols = lits[:, idx]
        if out is None:
            out = cols
        else:
            out *= cols
    assert out is not None
    return out


def rule_mask(X: np.ndarray, rule: Rule) -> np.ndarray:
    """Boolean vector: rows of ``X`` caught by ``rule``."""
    mask = np.ones(X.shape[0], dtype=bool)
    for lit in rule:
        col = X[:, lit.feature].astype(bool)
        mask &= col if lit.positive else ~col
    return mask
