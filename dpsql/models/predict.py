"""``dp_predict('name', ...)``: a stored model applied to rows, as a plain SQL expression.

:func:`expand_predictions` replaces each call by the model's prediction written over the
table's own columns (a rule list becomes ``CASE WHEN p1 THEN q1 ... ELSE q0 END``), so the
rest of the pipeline sees an ordinary scalar expression: typed, bounded and released only
through DP aggregates or group keys like any other.  The model's parameters were released
with DP when it was learned; writing them into a query is post-processing and costs nothing.
Per-row predictions of private rows are never released: the binder treats the expansion as
any other row-level expression.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import sqlglot
from sqlglot import exp

from dpsql.errors import ProgrammingError
from dpsql.frontend.positions import position_of
from dpsql.models.regression import KINDS as REGRESSION_KINDS
from dpsql.models.regression import predictor as regression_prediction
from dpsql.models.store import StoredModel

FUNCTION = "dp_predict"


class UndefinedObjectError(ProgrammingError):
    """A named object (here: a stored model) does not exist."""

    sqlstate = "42704"


def rule_list_prediction(payload: dict[str, Any]) -> exp.Expression:
    """TRUE iff the list predicts the positive label: CASE WHEN p1 THEN q1 ... ELSE q0 END."""
    from dpsql.rulelist.model import RuleList

    rl = RuleList.from_dict(payload["rule_list"])
    default = exp.Boolean(this=bool(rl.default.prediction))
    if len(rl.rules) == 1:
        return default
    case = exp.Case()
    for rule in rl.rules[:-1]:
        condition = sqlglot.parse_one(rl.rule_predicate(rule), read="duckdb")
        case = case.when(condition, exp.Boolean(this=bool(rule.prediction)), copy=False)
    return case.else_(default, copy=False)


#: model kind -> payload (the stored model_json, decoded) -> SQL expression over the columns.
PREDICTORS: dict[str, Callable[[dict], exp.Expression]] = {
    "rule_list": rule_list_prediction,
    **{kind: regression_prediction for kind in REGRESSION_KINDS},
}


def expand_predictions(
    tree: exp.Expr,
    lookup: Callable[[str], StoredModel | None],
) -> exp.Expr:
    """A copy of ``tree`` with every ``dp_predict('name'[, table.*])`` replaced by its model.

    ``lookup`` resolves a name among the analyst's own models on this dataset.  Refusals
    (free, decided from the text and the store): a first argument that is not a quoted
    name, other arguments than ``*`` / ``table.*`` (42883), an unknown name (42704), a model
    learned on another table than the query reads (42809), a kind with no SQL predictor
    (0A000).  Errors carry the call's position in the statement it was parsed from
    (dpsql.frontend.positions).
    """
    tree = tree.copy()
    tables = {t.name.lower() for t in tree.find_all(exp.Table)}
    for call in list(tree.find_all(exp.Anonymous)):
        if str(call.name).lower() != FUNCTION:
            continue
        model = _resolve(call, lookup)
        if tables and model.table.lower() not in tables:
            raise ProgrammingError(
                f"model {model.name!r} was learned on table {model.table!r}, which this "
                "query does not read",
                sqlstate="42809",
                construct=call.sql(dialect="duckdb"),
                position=position_of(call),
                hint=f"apply it in a query FROM {model.table}",
            )
        predictor = PREDICTORS.get(model.kind)
        if predictor is None:
            raise ProgrammingError(
                f"models of kind {model.kind!r} cannot be applied in SQL yet",
                sqlstate="0A000",
                construct=FUNCTION,
                position=position_of(call),
                hint="kinds with a SQL form: " + ", ".join(sorted(PREDICTORS)),
            )
        call.replace(exp.Paren(this=predictor(json.loads(model.model_json))))
    return tree


def _resolve(call: exp.Anonymous, lookup: Callable[[str], StoredModel | None]) -> StoredModel:
    args = call.expressions
    if not args or not (isinstance(args[0], exp.Literal) and args[0].is_string):
        raise ProgrammingError(
            f"{FUNCTION} needs the model name first, in quotes",
            sqlstate="42883",
            construct=FUNCTION,
            position=position_of(call),
            hint=f"{FUNCTION}('model_name') or {FUNCTION}('model_name', table.*)",
        )
    for extra in args[1:]:
        star = isinstance(extra, exp.Star) or (
            isinstance(extra, exp.Column) and isinstance(extra.this, exp.Star)
        )
        if not star:
            raise ProgrammingError(
                f"{FUNCTION} takes the model name and optionally table.*",
                sqlstate="42883",
                construct=extra.sql(dialect="duckdb"),
                position=position_of(extra),
                hint="the model reads the columns it was learned on by name",
            )
    name = args[0].this
    model = lookup(name)
    if model is None:
        raise UndefinedObjectError(
            f"model {name[:70]!r} does not exist",
            construct=name[:70],
            position=position_of(call),
            hint="store one with dp_rule_list(..., model => 'name'); list yours with "
            "`dpsql model list`",
        )
    return model
