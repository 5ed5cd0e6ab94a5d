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
from dpsql.frontend.identifiers import quote_ident


@dataclass(frozen=True)
class Feature:
    """A public boolean predicate over a row, with its negation spelt out.

    ``sql`` must be true exactly on the rows the feature matrix marks 1 and ``neg_sql`` on the
    rows marked 0 (NULLs included), so ``to_sql_case`` scores rows as ``predict`` does.
    ``exclusive`` names a set of features of which at most one holds (the values of one
    categorical column); conjunctions of two of them are always empty and are not generated.
    ``column`` / ``threshold`` mark ``column >= threshold`` features (negation: ``<`` or NULL),
    so conjunctions of cuts of one column can be simplified without data
    (:func:`public_candidates`).
    """

    name: str
    sql: str
    neg_name: str
    neg_sql: str
    exclusive: str | None = None
    column: str | None = None
    threshold: float | None = None

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


def _canonical(combo: Sequence[Literal], features: Sequence[Feature]) -> tuple | None:
    """The set of rows a conjunction selects, in a data-independent normal form; None if empty.

    Only implications valid for every value (NULL included) are used: on one column,
    ``c >= a`` and ``c >= b`` is ``c >= max(a, b)``, ``c < a`` (or NULL) and ``c < b`` is
    ``c < min(a, b)``, ``c >= a and c < b`` is empty when a >= b; ``c = v`` implies every
    ``c IS DISTINCT FROM w`` (w != v).  Other features are kept literally.
    """
    cuts: dict[str, list[float | None]] = {}  # column -> [lower (>=), upper (<)]
    eq: dict[str, int] = {}
    neq: dict[str, set[int]] = {}
    plain: set[tuple[int, bool]] = set()
    for lit in combo:
        f = features[lit.feature]
        if f.column is not None and f.threshold is not None:
            lo_hi = cuts.setdefault(f.column, [None, None])
            t = float(f.threshold)
            if lit.positive:
                lo_hi[0] = t if lo_hi[0] is None else max(lo_hi[0], t)
            else:
                lo_hi[1] = t if lo_hi[1] is None else min(lo_hi[1], t)
        elif f.exclusive is not None:
            if lit.positive:
                eq[f.exclusive] = lit.feature
            else:
                neq.setdefault(f.exclusive, set()).add(lit.feature)
        else:
            plain.add((lit.feature, lit.positive))
    for lo, hi in cuts.values():
        if lo is not None and hi is not None and lo >= hi:
            return None
    for group, j in eq.items():
        if j in neq.get(group, ()):  # c = v and c != v (not generated, kept for safety)
            return None
        neq.pop(group, None)
    return (
        frozenset((c, lo, hi) for c, (lo, hi) in cuts.items()),
        frozenset(eq.items()),
        frozenset((g, frozenset(v)) for g, v in neq.items()),
        frozenset(plain),
    )


def public_candidates(
    features: Sequence[Feature], max_card: int = 2, *, negations: bool = True
) -> list[Rule]:
    """Every distinct, satisfiable conjunction of up to ``max_card`` literals.

    A function of the features only (never of the data).  A conjunction that selects the
    same rows as a shorter (or earlier) one for every possible table, such as
    ``age < 25 and age < 75`` or ``department = 'a' and department != 'b'``, is dropped, and so
    is one that can select no row (``age >= 75 and age < 25``): they would only split the
    selection's probability mass and cost memory.
    """
    if max_card < 1:
        raise ValueError("max_card must be >= 1")
    lits = _literals(len(features), negations)
    rules: list[Rule] = []
    seen: set[tuple] = set()
    for card in range(1, max_card + 1):
        for combo in itertools.combinations(lits, card):
            if not _compatible(combo, features):
                continue
            key = _canonical(combo, features)
            if key is None or key in seen:
                continue
            seen.add(key)
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


@dataclass(frozen=True)
class Patterns:
    """Distinct feature rows with their label counts: the learner's whole view of the data.

    ``X`` is (u, f) 0/1, ``neg`` / ``pos`` the number of rows (or summed integer weights)
    with that feature pattern and label 0 / 1.  Every count the learner takes is a weighted
    sum over these u ≤ min(n, 2^f) rows, so memory and time follow u, not n.
    """

    X: np.ndarray
    neg: np.ndarray
    pos: np.ndarray

    @property
    def total(self) -> float:
        return float(self.neg.sum() + self.pos.sum())

    @staticmethod
    def from_rows(X: np.ndarray, y: np.ndarray, weight: np.ndarray | None = None) -> Patterns:
        """Group rows (and optional integer counts per row) by feature pattern."""
        X = np.asarray(X)
        y = np.asarray(y).astype(np.float64)
        n, f = X.shape
        w = np.ones(n) if weight is None else np.asarray(weight, dtype=np.float64)
        if n == 0:
            return Patterns(np.zeros((0, f), np.uint8), np.zeros(0), np.zeros(0))
        packed = np.packbits(X.astype(bool), axis=1)
        keys = np.ascontiguousarray(packed).view(np.dtype((np.void, packed.shape[1])))
        _, first, inverse = np.unique(keys.ravel(), return_index=True, return_inverse=True)
        u = first.size
        pos = np.bincount(inverse, weights=w * y, minlength=u)
        neg = np.bincount(inverse, weights=w * (1.0 - y), minlength=u)
        return Patterns(X[first].astype(np.uint8), neg, pos)


def _literal_rows(X: np.ndarray) -> np.ndarray:
    """(2f+1, u) float32 0/1 rows: x_0, not x_0, x_1, ..., and a final all-ones row."""
    u, f = X.shape
    lits = np.empty((2 * f + 1, u), dtype=np.float32)
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
    """(m, n) 0/1 matrix, rule-major: entry (j, i) = 1 iff rule j catches row i (tests)."""
    lits = _literal_rows(X)
    out = np.ones((len(rules), X.shape[0]), dtype=lits.dtype)
    for pos in range(max((len(r) for r in rules), default=0)):
        out *= lits[_literal_index(rules, pos, X.shape[1])]
    return out


#: Float entries per temporary block (16 MB of float32): bounds memory whatever m and u.
BLOCK = 1 << 22


class RuleCounter:
    """Per-node label counts of every candidate, over weighted feature patterns.

    With L the (2f+1, u) literal rows and w the remaining weight of each pattern:
    rules of up to two literals read the co-occurrence matrix L·diag(w)·Lᵀ (one
    O(u f²) product); rules of three read the tensor T[a,b,c] = Σ_p w_p L_a L_b L_c, built
    by blocks of patterns as one (L², block) × (block, 2L) product; longer rules multiply
    their literal rows by blocks of candidates.  Only patterns with weight left are used, no
    (candidates × rows) matrix exists, and temporaries are bounded by :data:`BLOCK`.
    Sums of integer weights are exact in float32 below 2^24, in float64 above.
    """

    def __init__(self, X: np.ndarray, rules: Sequence[Rule]) -> None:
        self.n_rules = len(rules)
        self.lits = _literal_rows(np.asarray(X))
        self.width = max((len(r) for r in rules), default=1)
        f = np.asarray(X).shape[1]
        self.idx = [_literal_index(rules, pos, f) for pos in range(max(self.width, 2))]
        n_lit = self.lits.shape[0]
        self.flat = self.idx[0] * n_lit + self.idx[1]

    def counts(self, w: np.ndarray, wy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n_c, n_c1) for every candidate; ``w`` = remaining weight per pattern, wy = w·y."""
        live = np.flatnonzero(w)
        dtype = np.float32 if float(np.sum(w)) < 2**24 else np.float64
        lits: np.ndarray = self.lits[:, live].astype(dtype, copy=False)
        w = np.asarray(w, dtype)[live]
        wy = np.asarray(wy, dtype)[live]
        if self.width <= 2:
            co = (lits * w) @ lits.T
            co1 = (lits * wy) @ lits.T
            return co.ravel()[self.flat], co1.ravel()[self.flat]
        if self.width == 3:
            return self._triples(lits, w, wy)
        return self._blocks(lits, w, wy)

    def _triples(self, lits: np.ndarray, w: np.ndarray, wy: np.ndarray):
        n_lit, u = lits.shape
        tensor = np.zeros((n_lit * n_lit, 2 * n_lit), dtype=lits.dtype)
        step = max(1, BLOCK // (n_lit * n_lit))
        for a in range(0, u, step):
            part = lits[:, a : a + step]
            pairs = (part[:, None, :] * part[None, :, :]).reshape(n_lit * n_lit, -1)
            tensor += pairs @ np.vstack([part * w[a : a + step], part * wy[a : a + step]]).T
        i2 = self.idx[2]
        return tensor[self.flat, i2], tensor[self.flat, n_lit + i2]

    def _blocks(self, lits: np.ndarray, w: np.ndarray, wy: np.ndarray):
        u = lits.shape[1]
        nc = np.empty(self.n_rules, dtype=lits.dtype)
        nc1 = np.empty(self.n_rules, dtype=lits.dtype)
        step = max(1, BLOCK // max(u, 1))
        for a in range(0, self.n_rules, step):
            block = lits[self.idx[0][a : a + step]].copy()
            for pos in range(1, self.width):
                block *= lits[self.idx[pos][a : a + step]]
            nc[a : a + step] = block @ w
            nc1[a : a + step] = block @ wy
        return nc, nc1

    def caught(self, j: int) -> np.ndarray:
        """Boolean vector of the patterns rule j catches (caught earlier or not)."""
        mask = self.lits[self.idx[0][j]] > 0
        for pos in range(1, self.width):
            mask &= self.lits[self.idx[pos][j]] > 0
        return mask


def rule_mask(X: np.ndarray, rule: Rule) -> np.ndarray:
    """Boolean vector: rows of ``X`` caught by ``rule``."""
    mask = np.ones(X.shape[0], dtype=bool)
    for lit in rule:
        col = X[:, lit.feature].astype(bool)
        mask &= col if lit.positive else ~col
    return mask
