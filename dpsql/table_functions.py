"""The DP table functions SQL can call in FROM, and their result columns.

A table function (``SELECT … FROM dp_rule_list('visits', label => 'smoker')``) is bound by
:mod:`dpsql.frontend.bind` into a call record, planned without data, charged, then run. This module
is the one list of their names and result schemas, so the binder validates the outer query's
columns without importing the learners (which import their schemas from here: the binder
reaching a learner put 21 modules into one import cycle, tests/test_layering.py).
"""

from __future__ import annotations

#: Names accepted in FROM, lower case.
TABLE_FUNCTIONS: tuple[str, ...] = (
    "dp_rule_list",
    "dp_linear_regression",
    "dp_logistic_regression",
)


#: What dp_rule_list returns: one row per rule, in order, then the default rule.
RULE_LIST_COLUMNS: tuple[tuple[str, str], ...] = (
    ("position", "INTEGER"),
    ("rule", "VARCHAR"),
    ("predicate", "VARCHAR"),
    ("prediction", "BOOLEAN"),
    ("noisy_negative", "DOUBLE"),
    ("noisy_positive", "DOUBLE"),
    ("is_default", "BOOLEAN"),
    ("noisy_support", "DOUBLE"),
    ("positive_rate", "DOUBLE"),
    ("rate_low", "DOUBLE"),
    ("rate_high", "DOUBLE"),
)

#: What dp_linear_regression and dp_logistic_regression return: one row per coefficient.
REGRESSION_COLUMNS: tuple[tuple[str, str], ...] = (
    ("position", "INTEGER"),
    ("feature", "VARCHAR"),
    ("coefficient", "DOUBLE"),
    ("ci_low", "DOUBLE"),
    ("ci_high", "DOUBLE"),
)


def result_columns(function: str) -> tuple[tuple[str, str], ...]:
    """The (name, SQL type) columns that ``function`` returns."""
    if function == "dp_rule_list":
        return RULE_LIST_COLUMNS
    if function in ("dp_linear_regression", "dp_logistic_regression"):
        return REGRESSION_COLUMNS
    raise KeyError(function)
