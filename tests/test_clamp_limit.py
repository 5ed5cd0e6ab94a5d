"""bench/sim_clamp_limit.py's linear program is a lower bound on every ε-DP clamp choice.

docs/mechanisms.md ("SUM: instance-optimal clipping and the information limit") reads the LP's
least as "no ε_h-DP choice of the clamp errs less on PUMS while erring at most the caps on the
family". That holds only if every ε_h-DP choice is a feasible point of it. Checked with one
whose distribution is known exactly on every member: the exponential mechanism over the clamps
with utility −|#{x > C} − k| (sensitivity 1, so p_D(C) ∝ exp(ε u_D(C)/2) is ε-DP), mixed half
and half with the declared bound (a constant: 0-DP; the mixture is still ε-DP), so that its
errors, used as the caps, bind. Its distribution must satisfy every constraint row of the LP
(so the LP's least is at most its error on the base set, and at least the base's oracle, which
it equals where no cap binds), and must violate the LP written with e^(ε/2) for e^ε: a
program whose DP rows were too tight would claim a bound that this mechanism beats.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from sim_clamp_limit import UPPER, bound, errors, family, program  # noqa: E402
from sim_sum_families import Staircase  # noqa: E402

EPS_H = 0.3


def _setup() -> tuple[dict, np.ndarray, Staircase]:
    rng = np.random.default_rng(5)
    x = np.minimum(rng.lognormal(np.log(30_000), 0.9, 300), UPPER)
    members = family(x, 10, 5)
    clamps = np.sort(UPPER * 2 ** (-np.arange(0, 40) / 8))
    return members, clamps, Staircase(1.0)


def _mechanism(xs: np.ndarray, clamps: np.ndarray) -> np.ndarray:
    above = xs.size - np.searchsorted(xs, clamps, side="right")
    w = np.exp(EPS_H * -np.abs(above - 3) / 2)
    constant = (clamps == clamps.max()).astype(np.float64)
    return 0.5 * w / w.sum() + 0.5 * constant


def _exact(members: dict, clamps: np.ndarray, stair: Staircase) -> tuple[np.ndarray, dict]:
    p = np.concatenate([_mechanism(xs, clamps) for xs, _ in members.values()])
    err = {
        n: float(_mechanism(xs, clamps) @ errors(xs, clamps, stair))
        for n, (xs, _) in members.items()
    }
    return p, err


def test_an_exact_dp_choice_is_feasible_and_the_bound_sits_between_oracle_and_it() -> None:
    members, clamps, stair = _setup()
    p, err = _exact(members, clamps, stair)
    _, a_ub, b_ub, a_eq, b_eq = program(members, clamps, EPS_H, stair, err)
    assert np.all(a_ub @ p <= b_ub + 1e-9)
    assert np.allclose(a_eq @ p, b_eq)
    least = bound(members, clamps, EPS_H, stair, err)
    oracle = float(errors(members["pums"][0], clamps, stair).min())
    assert oracle * (1 - 1e-6) <= least <= err["pums"] * (1 + 1e-6)
    assert least > oracle * 1.001  # the caps bind: the check is not vacuous
    loose = bound(members, clamps, EPS_H, stair, {n: 1e12 for n in members})
    assert loose == pytest.approx(oracle, rel=1e-6)


def test_the_feasibility_check_catches_constraints_too_tight() -> None:
    members, clamps, stair = _setup()
    p, err = _exact(members, clamps, stair)
    _, a_ub, b_ub, _, _ = program(members, clamps, EPS_H / 2, stair, err)
    assert not np.all(a_ub @ p <= b_ub + 1e-9)
