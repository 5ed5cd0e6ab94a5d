"""The Gini split criterion of DP-GreedyRL and its (local, smooth) sensitivity.

Everything here is a pure function of counts, so the learner can evaluate every candidate rule
of a node in one vectorised step and the privacy arithmetic can be tested in isolation.

Notation (spec §1-§4): at a node ``n`` samples remain, ``n1`` of them positive; a candidate
rule catches ``nc`` of them, ``nc1`` positive. ``G = G_c + G_l`` is the weighted Gini impurity
of the caught / left-over parts; the learner keeps the rule with the *lowest* (noisy) G.
"""

from __future__ import annotations

import math

import numpy as np

#: Smallest β for which the smooth-sensitivity function has no interior maximum (3 - 2√2).
BETA_1 = 3.0 - 2.0 * math.sqrt(2.0)


def impurity_mass(n: np.ndarray | float, n1: np.ndarray | float) -> np.ndarray:
    """``n · gini(part)`` = 2·n1·n0/n for a part of ``n`` samples, ``n1`` positive (0 if empty).

    This un-normalised impurity is what the proven selection mechanism scores: it is monotone
    in the data and has global sensitivity < 2 (docs/rulelist.md, "monotone_em").
    """
    n = np.asarray(n, dtype=np.float64)
    n1 = np.asarray(n1, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        h = 2.0 * n1 * (n - n1) / n
    return np.where(n > 0, h, 0.0)


def gini_scores(
    n: float, n1: float, nc: np.ndarray, nc1: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(G, G_c) for every candidate at a node (spec §2); both 0 when the node is empty."""
    hc = impurity_mass(nc, nc1)
    hl = impurity_mass(n - np.asarray(nc, np.float64), n1 - np.asarray(nc1, np.float64))
    if n <= 0:
        zero = np.zeros_like(hc)
        return zero, zero
    return (hc + hl) / n, hc / n


def node_gini(n: float, n1: float) -> float:
    """Gini impurity 2·ȳ(1-ȳ) of the remaining samples: the "no rule" value (stop rule 3)."""
    if n <= 0:
        return 0.0
    p = n1 / n
    return 2.0 * p * (1.0 - p)


def local_sensitivity_add(n: np.ndarray | float) -> np.ndarray:
    """The paper's LS_G(n) = 2n/(n+1)²: the largest change of G when ONE SAMPLE IS ADDED.

    (Fletcher & Islam 2015; the authors' ``local_sensitivity_gini``.)  LS(0) is defined as 0.
    """
    n = np.asarray(n, dtype=np.float64)
    return 2.0 * n / (n + 1.0) ** 2


def local_sensitivity(n: np.ndarray | float, *, strict: bool = True) -> np.ndarray:
    """Local sensitivity of G at support ``n`` under the chosen neighbour relation.

    ``strict`` (default) is the add/remove-correct bound max(LS(n), LS(n-1)) = LS(max(n-1, 1)):
    removing a sample from (0,0 | 1,1) moves G from 0.5 to 0, more than LS(n) allows (spec §9.1).
    ``strict=False`` is the paper's add-only formula.
    """
    n = np.asarray(n, dtype=np.float64)
    if not strict:
        return local_sensitivity_add(n)
    return local_sensitivity_add(np.maximum(n - 1.0, 1.0))


def _xi(n: int, beta: float, floor: int, k: np.ndarray) -> np.ndarray:
    return np.exp(-beta * k) * local_sensitivity_add(np.maximum(floor, n - k))


def smooth_sensitivity(n: int, beta: float, floor: int, *, strict: bool = True) -> float:
    """S*_β(n; Λ) = max_k e^{-kβ}·LS(max(Λ, n-k)) in O(1) (Theorem 4.1, spec §4.3).

    ``n`` is the remaining support (the learner passes max(|D_rem|, Λ)), ``floor`` = Λ ≥ 1.
    ln ξ(t) has derivative Q(y)/(y(y+1)) in y = n - t with Q(y) = -βy² + (1-β)y - 1, so ξ is
    decreasing, then increasing up to t2 = n - y2, then decreasing: the maximiser over the
    integers k in [0, n-Λ] is 0, n-Λ or an integer neighbour of t2.  With ``strict`` the
    add/remove bound LS(m-1) is used, i.e. the same function at (n-1, Λ-1), both floored at 1.
    """
    if beta <= 0:
        raise ValueError("beta must be > 0")
    floor = max(int(floor), 1)
    n = max(int(n), floor)
    if strict:
        n, floor = max(n - 1, 1), max(floor - 1, 1)
    last = n - floor
    ks = [0, last]
    if beta < BETA_1:
        root = math.sqrt((1.0 - beta) ** 2 - 4.0 * beta)
        y2 = ((1.0 - beta) - root) / (2.0 * beta)
        t2 = n - y2
        for k in (math.floor(t2), math.ceil(t2)):
            if 0 <= k <= last:
                ks.append(k)
    return float(np.max(_xi(n, beta, floor, np.asarray(ks, dtype=np.float64))))


def smooth_sensitivity_bruteforce(n: int, beta: float, floor: int, *, strict: bool = True) -> float:
    """The definition, max over every k in [0, n-Λ] (tests cross-check the closed form)."""
    floor = max(int(floor), 1)
    n = max(int(n), floor)
    k = np.arange(0, n - floor + 1, dtype=np.float64)
    ls = local_sensitivity(np.maximum(floor, n - k), strict=strict)
    return float(np.max(np.exp(-beta * k) * ls))


def support_threshold(epsilon_node: float, confidence: float) -> int:
    """T = 1 + ⌊-(ln 2 + ln(1 - C))/ε_node⌋ (Algorithm 3, spec §6 and §9.3).

    The smallest integer margin with P(Lap(1/ε_node) ≤ T) ≥ C, so a node whose true support is
    below Λ passes the noisy check ``|D_rem| + Lap ≥ Λ + T`` with probability < 1 - C.
    """
    if not 0.5 <= confidence < 1:
        raise ValueError("confidence must be in [0.5, 1)")
    t = -(math.log(2.0) + math.log(1.0 - confidence)) / epsilon_node
    return 1 + math.floor(t)
