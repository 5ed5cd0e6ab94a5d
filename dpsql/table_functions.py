"""The DP table functions SQL can call in FROM, and their result columns.

A table function (``SELECT … FROM dp_rule_list('visits', label => 'smoker')``) is bound by
:mod:`dpsql.sql.bind` into a call record, planned without data, charged, then run. This module
is the one list of their names and result schemas, so the binder validates the outer query's
columns without importing the learners.
"""

from __future__ import annotations

#: Names accepted in FROM, lower case.
TABLE_FUNCTIONS: tuple[str, ...] = (
    "dp_rule_list",
    "dp_linear_regression",
    "dp_logistic_regression",
)


def result_columns(function: str) -> tuple[tuple[str, str], ...]:
    """The (name, SQL type) columns that ``function`` returns."""
    if function == "dp_rule_list":
        from dpsql.rulelist.table_function import COLUMNS

        return COLUMNS
    if function in ("dp_linear_regression", "dp_logistic_regression"):
        from dpsql.models.regression_function import COLUMNS as REGRESSION_COLUMNS

        return REGRESSION_COLUMNS
    raise KeyError(function)
