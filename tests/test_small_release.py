"""Release-path shortcuts give exactly what they replace (dpsql.privacy.release)."""

from __future__ import annotations

import numpy as np
import pytest

from dpsql.privacy.release import error_quantiles


@pytest.mark.parametrize("draws", [200, 201, 999, 2000])
def test_error_quantiles_equal_numpys(draws: int) -> None:
    rng = np.random.default_rng(draws)
    for trial in range(40):
        n = int(rng.integers(1, 6))
        error = rng.normal(size=(draws, n)) * 10 ** int(rng.integers(-3, 4))
        if trial % 4 == 1:
            error = np.round(error)  # ties
        if trial % 4 == 2:
            error[rng.integers(0, draws), rng.integers(0, n)] = np.nan
        if trial % 4 == 3:
            error[rng.integers(0, draws), rng.integers(0, n)] = np.inf
            error[rng.integers(0, draws), rng.integers(0, n)] = -np.inf
        lower, upper = error_quantiles(error)
        want_lower = np.quantile(error, 0.025, axis=0, method="lower")
        want_upper = np.quantile(error, 0.975, axis=0, method="higher")
        np.testing.assert_array_equal(lower, want_lower)
        np.testing.assert_array_equal(upper, want_upper)
