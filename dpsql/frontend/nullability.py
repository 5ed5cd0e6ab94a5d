"""Whether an expression can be NULL on some row: a fact of its node, kept with its type,
range and totality (dpsql.frontend.facts), from the policy's ``nullable`` declarations and
the operators.

The claim that matters is the negative one: :func:`may_be_null` says False only when, on
every row where evaluating the node does not raise, its value is not NULL. A wrong "never
NULL" could drop a NULL group a key has or count NULLs as rows (COUNT(col) read as COUNT(*),
dpsql.plan.sharing), so every rule errs towards True: an operator not listed here, a function,
a division, NULLIF, TRY_CAST, a CASE without ELSE, a column the policy does not declare
``nullable = false``, a qualified or computed column.

Errors are not NULLs here: an expression evaluated under ``TRY`` (a non-total WHERE, a
computed key) is NULL on a row where it raises, and a caller in that position asks the
totality too (dpsql.frontend.safety.cannot_fail for a condition). tests/test_typed_facts.py
checks the rules against DuckDB evaluating generated expressions on rows with NULLs, and that
a rule made to claim "never NULL" wrongly is caught.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlglot import exp

from dpsql.frontend.facts import UNSET, facts
from dpsql.policy import ColumnPolicy, TablePolicy


def may_be_null(node: exp.Expression, table: TablePolicy) -> bool:
    """Whether ``node`` can be NULL on some row of ``table`` (see the module docstring): a
    fact computed once per node and table, operands reached through this same function."""
    record = facts(node, table)
    found = record.nullable
    if found is UNSET:
        rule = _RULES.get(type(node))
        found = True if rule is None else rule(node, table)
        record.nullable = found
    return bool(found)


def column_may_be_null(spec: ColumnPolicy) -> bool:
    """A policy column can hold NULL unless declared ``nullable = false``; a computed column
    (an expression inside an aggregate) is taken to be nullable."""
    return spec.expr is not None or spec.may_hold_null


def _column(node: exp.Column, table: TablePolicy) -> bool:
    if node.table:  # a qualified name: which source it reads is the binder's business
        return True
    spec = table.columns.get(node.name.lower())
    return spec is None or column_may_be_null(spec)


def _never(node: exp.Expression, table: TablePolicy) -> bool:
    return False


def _operand(node: exp.Expression, table: TablePolicy) -> bool:
    return may_be_null(node.this, table)


def _any_operand(node: exp.Expression, table: TablePolicy) -> bool:
    """NULL if an operand is (strict operators: arithmetic that cannot divide, comparisons,
    AND / OR read conservatively, functions that map non-NULL to non-NULL)."""
    return any(may_be_null(child, table) for child in _operands(node))


def _operands(node: exp.Expression) -> list[exp.Expression]:
    out = []
    for key in ("this", "expression", "low", "high", "decimals"):
        child = node.args.get(key)
        if isinstance(child, exp.Expression):
            out.append(child)
    out.extend(node.expressions)
    return out


def _division(node: exp.Expression, table: TablePolicy) -> bool:
    """``a / b``, ``a // b``, ``a % b``: NULL when b is 0 (DuckDB), so never-NULL only by a
    non-zero number literal divisor."""
    divisor = node.expression
    literal = isinstance(divisor, exp.Literal) and not divisor.is_string
    if not literal:
        return True
    try:
        zero = float(divisor.this) == 0
    except ValueError:
        return True
    return zero or may_be_null(node.this, table)


def _in(node: exp.In, table: TablePolicy) -> bool:
    if node.args.get("query") is not None or node.args.get("unnest") is not None:
        return True
    if node.args.get("field") is not None or not node.expressions:
        return True
    return _any_operand(node, table)


def _coalesce(node: exp.Coalesce, table: TablePolicy) -> bool:
    """NULL only if every argument can be."""
    return all(may_be_null(child, table) for child in [node.this, *node.expressions])


def _case(node: exp.Case, table: TablePolicy) -> bool:
    """NULL without an ELSE (no branch may match), or when a branch's value can be."""
    default = node.args.get("default")
    if default is None or may_be_null(default, table):
        return True
    return any(may_be_null(branch.args["true"], table) for branch in node.args.get("ifs") or [])


def _if(node: exp.If, table: TablePolicy) -> bool:
    false = node.args.get("false")
    return false is None or may_be_null(false, table) or may_be_null(node.args["true"], table)


_Rule = Callable[[exp.Expression, TablePolicy], bool]

_RULES: dict[type[exp.Expression], _Rule] = {
    exp.Column: _column,  # type: ignore[dict-item]
    exp.Literal: _never,
    exp.Boolean: _never,
    exp.Is: _never,  # IS [NOT] NULL / TRUE / FALSE
    exp.NullSafeEQ: _never,  # IS NOT DISTINCT FROM
    exp.NullSafeNEQ: _never,
    exp.Paren: _operand,
    exp.Neg: _operand,
    exp.Not: _operand,
    exp.Cast: _operand,  # TRY_CAST (exp.TryCast) is not listed: NULL where it cannot cast
    exp.Add: _any_operand,
    exp.Sub: _any_operand,
    exp.Mul: _any_operand,
    exp.EQ: _any_operand,
    exp.NEQ: _any_operand,
    exp.GT: _any_operand,
    exp.GTE: _any_operand,
    exp.LT: _any_operand,
    exp.LTE: _any_operand,
    exp.Like: _any_operand,
    exp.ILike: _any_operand,
    exp.Between: _any_operand,
    exp.And: _any_operand,
    exp.Or: _any_operand,
    exp.Abs: _any_operand,
    exp.Floor: _any_operand,
    exp.Ceil: _any_operand,
    exp.Round: _any_operand,
    exp.Upper: _any_operand,
    exp.Lower: _any_operand,
    exp.Length: _any_operand,
    exp.Div: _division,
    exp.IntDiv: _division,
    exp.Mod: _division,
    exp.In: _in,  # type: ignore[dict-item]
    exp.Coalesce: _coalesce,  # type: ignore[dict-item]
    exp.Case: _case,  # type: ignore[dict-item]
    exp.If: _if,  # type: ignore[dict-item]
}
