"""Shortcuts on the small-query path give exactly what they replace (release intervals, the
first word of a statement)."""

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


def test_the_first_word_shortcut_agrees_with_the_tokenizer() -> None:
    import sqlglot
    from sqlglot.dialects.duckdb import DuckDB

    from dpsql.frontend import bind
    from dpsql.frontend.positions import Source

    keys = DuckDB.tokenizer_class.KEYWORDS
    assert not [k for k in keys if " " in k and k.split()[0] in ("SELECT", "WITH")]
    texts = [
        "SELECT 1",
        "  select\n\tCOUNT(*) FROM t",
        "WITH x AS (SELECT 1) SELECT * FROM x",
        "with_x",
        "SELECTx FROM t",
        "SELECT$1",
        "-- c\nSELECT 1",
        "/* c */ SHOW epsilon",
        "(SELECT 1)",
        "INSERT INTO t VALUES (1)",
        "",
    ]
    for text in texts:
        tokens = sqlglot.tokenize(text, read="duckdb") if text else []
        first = bind._first_word(Source(text, "duckdb"))
        assert first == (tokens[0].text.upper() if tokens else ""), text


def test_group_key_positions_equal_position_of() -> None:
    import sqlglot
    from sqlglot import exp

    from dpsql.frontend.bind.keys import key_position
    from dpsql.frontend.positions import Source, mark, position_of

    texts = [
        "SELECT department, COUNT(*) FROM visits GROUP BY department",
        "SELECT department, smoker, SUM(cost) FROM visits GROUP BY 1, 2",
        'SELECT "Department", COUNT(*) FROM visits AS v GROUP BY v.department, "smoker"',
        "SELECT a FROM t GROUP BY\n  x.y.z, 3, FLOOR(age / 10), (age), age + 1, 'k', age",
        "SELECT a FROM t GROUP BY department, department",
    ]
    checked = 0
    for text in texts:
        tree = sqlglot.parse_one(text, read="duckdb")
        source = Source(text, "duckdb")  # as the parse records it (dpsql.frontend.bind)
        for node in tree.walk():
            if node._meta:
                mark(node, source)
        for item in tree.args["group"].expressions:
            assert key_position(item) == position_of(item), (text, item)
            checked += isinstance(item, exp.Column | exp.Literal)
    assert checked >= 10
