"""Budget.remaining's ``_left``: from the exact rationals' integers, the same float as
``float(max(Fraction(0), cap - spent))`` (int / int is correctly rounded), on random
rationals, equal ones, powers of two (the fixture's costs) and non-finite parts."""

from __future__ import annotations

import math
import random
from fractions import Fraction

from dpsql.privacy.accounting import Budget, Cost, _left


def _old(cap: object, spent: object) -> float:
    return float(max(Fraction(0), cap - spent))  # type: ignore[operator]


def test_left_is_the_float_of_the_exact_difference() -> None:
    rng = random.Random(26)
    for _ in range(50_000):
        cap = Fraction(rng.randrange(0, 10 ** rng.randrange(1, 30)), rng.randrange(1, 10**20))
        if rng.random() < 0.5:
            spent = Fraction(rng.randrange(0, 10 ** rng.randrange(1, 30)), 1 << rng.randrange(70))
        else:
            spent = Fraction(rng.randrange(0, 10**25), rng.randrange(1, 10 ** rng.randrange(1, 30)))
        if rng.random() < 0.1:
            spent = cap
        got, want = _left(cap, spent), _old(cap, spent)
        assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


def test_left_of_a_non_finite_part_is_the_old_float() -> None:
    assert _left(Fraction(1), math.nan) == _old(Fraction(1), math.nan)
    assert _left(Fraction(1), math.inf) == _old(Fraction(1), math.inf) == 0.0


def test_remaining_after_charges_as_before() -> None:
    for budget in (Budget(10.0, 1e-5), Budget(1.0, 0.0), Budget(3.0, 1e-6)):
        total = Cost()
        for k in range(200):
            total = total + Cost(Fraction(1, 1 << (k % 20)), Fraction(k % 3, 10**9))
            eps, delta = budget.remaining(total)
            want_eps = 0.0
            if total.exact_rho == 0:
                want_eps = _old(budget.exact_pure_epsilon, total.exact_epsilon)
            if budget.zcdp and total.is_finite:
                left = max(Fraction(0), budget.exact_rho - total.exact_zrho)
                want_eps = max(want_eps, math.sqrt(2 * float(left)))
            assert (eps, delta) == (want_eps, _old(budget.exact_pure_delta, total.exact_delta))
