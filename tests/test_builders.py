"""The public node constructors every lowering builds engine SQL from (dpsql.lower.builders).

Their doctests show each one's rendering in DuckDB: names the policy gives (tables, columns,
attached catalogs) come out quoted by the builder, never spliced into text.
"""

from __future__ import annotations

import doctest

import dpsql.lower.builders


def test_the_builders_doctests():
    failures, tried = doctest.testmod(dpsql.lower.builders)
    assert failures == 0
    assert tried >= 6
