"""Interval arithmetic over declared bounds: the range of an expression inside an aggregate.

``SUM(a * b)``, ``AVG(LEAST(GREATEST(x, 50), 100))``, ``SUM(CASE WHEN smoker THEN 1 ELSE 0
END)``: the per-row range of the aggregated value comes from the columns' declared bounds
(public, never measured), propagated through each operator. Unbounded columns are ±∞, so a
per-query clamp (``LEAST(GREATEST(x, lo), hi)``) bounds even a column without declared bounds.

Soundness does not rest on this module: the compiled query clamps the expression's *value*
to the range found here (dpsql.lower.compile.fixed_point_value), and the sensitivity is that of
the clamp. A range that is too wide only adds noise; this module's job is to find a tight
one, and to refuse an expression whose range is unbounded, naming the bound it lacks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql.frontend.dialect import INTEGER_TYPES, integer_typed
from dpsql.frontend.facts import UNSET, facts
from dpsql.policy import TablePolicy

INF = math.inf


@dataclass(frozen=True)
class Range:
    """The values one row's expression can take: [lower, upper] (±∞ when unbounded),
    whether they are integers, and which unbounded columns made an end infinite."""

    lower: float
    upper: float
    integral: bool
    unbounded: tuple[str, ...] = ()

    @property
    def finite(self) -> bool:
        return math.isfinite(self.lower) and math.isfinite(self.upper)


class NotNumeric(Exception):
    """The expression is not a number (a string, a date, a condition): it has no range."""

    def __init__(self, node: exp.Expression, why: str) -> None:
        super().__init__(why)
        self.node = node
        self.why = why


def _join(*ranges: Range) -> Range:
    """The smallest range containing all of ``ranges`` (CASE branches, COALESCE args)."""
    return Range(
        min(r.lower for r in ranges),
        max(r.upper for r in ranges),
        all(r.integral for r in ranges),
        tuple(dict.fromkeys(c for r in ranges for c in r.unbounded)),
    )


def _of(lower: float, upper: float, integral: bool, *sources: Range) -> Range:
    unbounded = tuple(dict.fromkeys(c for r in sources for c in r.unbounded))
    if math.isnan(lower) or math.isnan(upper):  # inf - inf, 0 * inf
        lower, upper = -INF, INF
    return Range(lower, upper, integral, unbounded)


def _product(a: float, b: float) -> float:
    if a == 0 or b == 0:
        return 0.0  # 0 * inf is 0 here: a bounded zero factor keeps the product at zero
    return a * b


def value_range(node: exp.Expression, table: TablePolicy) -> Range:
    """The range of ``node`` (columns unqualified, lower case) over ``table``'s rows.

    Raises :class:`NotNumeric` for an expression that is not a number. One step per node kind
    (``_STEPS``, looked up along the node's class hierarchy, most specific first), computed
    once per node and table: the range (or why there is none) is a fact kept on the node
    (dpsql.frontend.facts), and the steps reach each operand through this function.
    """
    record = facts(node, table)
    found = record.range
    if found is UNSET:  # the step runs in this frame: one frame per level, as deep as before
        step = _STEP_OF.get(type(node)) or _step_of(type(node))
        try:
            found = step(node, table)
        except NotNumeric as exc:
            found = (exc.node, exc.why)
        record.range = found
    if type(found) is not Range:
        raise NotNumeric(*found)
    return found


def _unknown(node: exp.Expression, table: TablePolicy) -> Range:
    raise NotNumeric(node, "no range is known for it")


def _step_of(cls: type) -> Callable[[Any, TablePolicy], Range]:
    """The step of a node class (the most specific along its hierarchy), remembered."""
    step = next((_STEPS[c] for c in cls.__mro__ if c in _STEPS), _unknown)
    _STEP_OF[cls] = step
    return step


_STEP_OF: dict[type, Callable[[Any, TablePolicy], Range]] = {}


_EMPTY = Range(INF, -INF, True)


def _paren(node: exp.Paren, table: TablePolicy) -> Range:
    return value_range(node.this, table)


def _literal(node: exp.Literal, table: TablePolicy) -> Range:
    if node.is_string:
        raise NotNumeric(node, "a string is not a number")
    value = float(node.this)
    return Range(value, value, value.is_integer() and "." not in node.this.lower())


def _boolean(node: exp.Boolean, table: TablePolicy) -> Range:
    raise NotNumeric(node, "a condition is not a number")


def _null(node: exp.Null, table: TablePolicy) -> Range:
    return Range(INF, -INF, True)  # empty: NULL adds nothing to SUM, AVG or COUNT(expr)


def _column(node: exp.Column, table: TablePolicy) -> Range:
    """A column's declared bounds (±∞ for an end it does not declare, named as missing)."""
    col = table.columns.get(node.name.lower())
    if col is None or not col.numeric:
        kind = col.type if col is not None else "unknown"
        raise NotNumeric(node, f"{node.name} is {kind}, not a number")
    lower = col.lower if col.lower is not None else -INF
    upper = col.upper if col.upper is not None else INF
    missing = () if col.bounded else (col.name,)
    return Range(lower, upper, col.type == "int", missing)


def _neg(node: exp.Neg, table: TablePolicy) -> Range:
    r = value_range(node.this, table)
    return _of(-r.upper, -r.lower, r.integral, r)


def _add(node: exp.Add, table: TablePolicy) -> Range:
    a, b = value_range(node.this, table), value_range(node.expression, table)
    return _of(a.lower + b.lower, a.upper + b.upper, a.integral and b.integral, a, b)


def _sub(node: exp.Sub, table: TablePolicy) -> Range:
    a, b = value_range(node.this, table), value_range(node.expression, table)
    return _of(a.lower - b.upper, a.upper - b.lower, a.integral and b.integral, a, b)


def _mul(node: exp.Mul, table: TablePolicy) -> Range:
    a, b = value_range(node.this, table), value_range(node.expression, table)
    corners = [_product(x, y) for x in (a.lower, a.upper) for y in (b.lower, b.upper)]
    return _of(min(corners), max(corners), a.integral and b.integral, a, b)


def _int_div(node: exp.IntDiv, table: TablePolicy) -> Range:
    """``a // b``: truncated for integers, otherwise (DuckDB's ``7.0 // 2``) a division."""
    found = _integer_division(node, table)
    return found if found is not None else _div(node, table)


def _div(node: exp.Div | exp.IntDiv, table: TablePolicy) -> Range:
    a, b = value_range(node.this, table), value_range(node.expression, table)
    if b.lower <= 0 <= b.upper:
        # 1/x near 0 is unbounded; the divisor's range must exclude 0 (DuckDB returns
        # NULL for a zero divisor, but values near it are as large as you like).
        return _of(-INF, INF, False, a, b, Range(0, 0, True, ("the divisor",)))
    corners = [x / y for x in (a.lower, a.upper) for y in (b.lower, b.upper) if math.isfinite(y)]
    if not math.isfinite(b.lower) or not math.isfinite(b.upper):
        corners.append(0.0)
    low, high = min(corners), max(corners)
    return _of(low, high, False, a, b)  # DuckDB's // of a non-integer divides (7.0 // 2)


def _mod(node: exp.Mod, table: TablePolicy) -> Range:
    a, b = value_range(node.this, table), value_range(node.expression, table)
    m = max(abs(b.lower), abs(b.upper))
    low = 0.0 if a.lower >= 0 else max(-m, a.lower)
    high = 0.0 if a.upper <= 0 else min(m, a.upper)
    return _of(low, high, a.integral and b.integral, a, b)


def _abs(node: exp.Abs, table: TablePolicy) -> Range:
    r = value_range(node.this, table)
    if r.lower >= 0:
        return r
    if r.upper <= 0:
        return _of(-r.upper, -r.lower, r.integral, r)
    return _of(0.0, max(-r.lower, r.upper), r.integral, r)


def _least_greatest(node: exp.Least | exp.Greatest, table: TablePolicy) -> Range:
    """A clamp: an end bounded by a literal no longer depends on the unbounded columns."""
    args = [value_range(a, table) for a in [node.this, *node.expressions]]
    pick = min if isinstance(node, exp.Least) else max
    low, high = pick(r.lower for r in args), pick(r.upper for r in args)
    unbounded = tuple(
        dict.fromkeys(
            c for r in args for c in r.unbounded if not (math.isfinite(low) and math.isfinite(high))
        )
    )
    return Range(low, high, all(r.integral for r in args), unbounded)


def _case(node: exp.Case, table: TablePolicy) -> Range:
    branches = [value_range(i.args["true"], table) for i in node.args.get("ifs") or []]
    default = node.args.get("default")
    branches.append(value_range(default, table) if default is not None else _EMPTY)
    return _join(*branches)


def _if(node: exp.If, table: TablePolicy) -> Range:
    false = node.args.get("false")
    return _join(
        value_range(node.args["true"], table),
        value_range(false, table) if false is not None else _EMPTY,
    )


def _coalesce(node: exp.Coalesce, table: TablePolicy) -> Range:
    return _join(*(value_range(a, table) for a in [node.this, *node.expressions]))


def _nullif(node: exp.Nullif, table: TablePolicy) -> Range:
    return value_range(node.this, table)


def _floor_ceil(node: exp.Floor | exp.Ceil, table: TablePolicy) -> Range:
    r = value_range(node.this, table)
    if node.args.get("decimals") is not None:
        return _of(r.lower - 1, r.upper + 1, False, r)
    return _of(math.floor(r.lower), math.ceil(r.upper), True, r)


def _round(node: exp.Round, table: TablePolicy) -> Range:
    r = value_range(node.this, table)
    digits = node.args.get("decimals")
    if digits is None:
        return _of(_round_half_away(r.lower), _round_half_away(r.upper), True, r)
    if not isinstance(digits, exp.Literal) or digits.is_string:
        raise NotNumeric(node, "ROUND's digits must be a number literal")
    half = 0.5 * 10.0 ** -int(float(digits.this))
    return _of(r.lower - half, r.upper + half, False, r)


def _sign(node: exp.Sign, table: TablePolicy) -> Range:
    r = value_range(node.this, table)
    return Range(-1.0 if r.lower < 0 else 0.0, 1.0 if r.upper > 0 else 0.0, True)


def _sqrt(node: exp.Sqrt, table: TablePolicy) -> Range:
    r = value_range(node.this, table)
    return _of(math.sqrt(max(r.lower, 0.0)), math.sqrt(max(r.upper, 0.0)), False, r)


def _exp(node: exp.Exp, table: TablePolicy) -> Range:
    r = value_range(node.this, table)
    return _of(_safe_exp(r.lower), _safe_exp(r.upper), False, r)


def _log(node: exp.Ln | exp.Log, table: TablePolicy) -> Range:
    """LN(x), LOG(x) and LOG(base, x): unbounded below when x's range reaches 0."""
    arg = node.expression if isinstance(node, exp.Log) and node.expression else node.this
    r = value_range(arg, table)
    if r.lower <= 0:
        return _of(
            -INF, _safe_log(r.upper), False, r, Range(0, 0, True, ("a logarithm's argument",))
        )
    scale = 1.0
    if isinstance(node, exp.Log) and node.expression is not None:
        base = node.this
        if not isinstance(base, exp.Literal) or base.is_string or float(base.this) <= 1:
            raise NotNumeric(node, "LOG's base must be a number literal above 1")
        scale = math.log(float(base.this))
    return _of(math.log(r.lower) / scale, _safe_log(r.upper) / scale, False, r)


_DATE_PARTS: dict[type[exp.Expression], tuple[int, int]] = {
    exp.Month: (1, 12),
    exp.Day: (1, 31),
    exp.Quarter: (1, 4),
    exp.DayOfWeek: (0, 6),
}
_EXTRACT_PARTS = {
    "month": (1, 12),
    "day": (1, 31),
    "quarter": (1, 4),
    "dow": (0, 6),
    "isodow": (1, 7),
    "doy": (1, 366),
    "hour": (0, 23),
    "minute": (0, 59),
    "second": (0, 60),
    "week": (1, 53),
}


def _date_part(node: exp.Expression, table: TablePolicy) -> Range:
    low, high = _DATE_PARTS[type(node)]
    return Range(low, high, True)


def _extract(node: exp.Extract, table: TablePolicy) -> Range:
    part = node.this.name.lower() if isinstance(node.this, exp.Var | exp.Identifier) else ""
    if part in _EXTRACT_PARTS:
        low, high = _EXTRACT_PARTS[part]
        return Range(low, high, True)
    return Range(-INF, INF, True, (f"EXTRACT({part.upper()})",))


def _year(node: exp.Year, table: TablePolicy) -> Range:
    return Range(-INF, INF, True, ("YEAR(...)",))


def _integer_division(node: exp.IntDiv, table: TablePolicy) -> Range | None:
    """The range of ``a // b`` for integers a and b (PostgreSQL's ``int / int`` arrives here
    too, dpsql.frontend.dialect): the quotient truncated toward zero, as DuckDB and PostgreSQL do.

    Truncation is monotone in the exact quotient, so the ends are the truncated ends of its
    range. A divisor whose range holds 0 never makes the quotient large: a non-zero integer
    divisor has |b| >= 1, so |a // b| <= |a| (b = 0 fails, and runs under TRY: NULL).
    None when an operand is not an integer (DuckDB's ``//`` then divides).
    """

    def types(_table: str | None, column: str) -> set[str]:
        spec = table.columns.get(column)
        return {spec.type} if spec is not None and spec.expr is None else set()

    if not (integer_typed(node.this, types) and integer_typed(node.expression, types)):
        return None  # FLOOR(x) // 2 is DOUBLE // INTEGER: a division
    a, b = value_range(node.this, table), value_range(node.expression, table)
    if b.lower <= 0 <= b.upper:
        m = max(abs(a.lower), abs(a.upper))
        return _of(-m, m, True, a)
    corners = [x / y for x in (a.lower, a.upper) for y in (b.lower, b.upper) if math.isfinite(y)]
    if not math.isfinite(b.lower) or not math.isfinite(b.upper):
        corners.append(0.0)
    low, high = min(corners), max(corners)
    return _of(_truncate(low), _truncate(high), True, a, b)


def _truncate(x: float) -> float:
    return float(math.trunc(x)) if math.isfinite(x) else x


def _round_half_away(x: float) -> float:
    if not math.isfinite(x):
        return x
    return float(math.copysign(math.floor(abs(x) + 0.5), x))


def _safe_exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return INF


def _safe_log(x: float) -> float:
    return math.log(x) if x > 0 else -INF


def _cast_range(node: exp.Cast | exp.TryCast, table: TablePolicy) -> Range:
    to = node.args["to"]
    inner = node.this
    if to.this in INTEGER_TYPES and isinstance(inner, exp.Column):
        col = table.columns.get(inner.name.lower())
        if col is not None and col.type == "bool":
            return Range(0.0, 1.0, True)  # CAST(flag AS INT)
    if to.is_type(*exp.DataType.NUMERIC_TYPES):
        try:
            r = value_range(inner, table)
        except NotNumeric:
            # CAST(text AS INT): any number (or NULL under TRY); a clamp around it bounds it
            shown = node.sql(dialect="duckdb")
            return Range(-INF, INF, to.this in INTEGER_TYPES, (shown,))
        if to.this in INTEGER_TYPES:
            return _of(_round_half_away(r.lower), _round_half_away(r.upper), True, r)
        return r
    raise NotNumeric(node, f"a cast to {to.sql(dialect='duckdb')} is not a number")


def _power_range(node: exp.Pow, table: TablePolicy) -> Range:
    exponent = node.expression
    if not isinstance(exponent, exp.Literal) or exponent.is_string:
        raise NotNumeric(node, "a power needs a number literal as its exponent")
    n = float(exponent.this)
    r = value_range(node.this, table)
    if n < 0 or not n.is_integer():
        if r.lower <= 0:
            return _of(-INF, INF, False, r, Range(0, 0, True, ("a power's base",)))
        values = [r.lower**n, r.upper**n if math.isfinite(r.upper) else (INF if n > 0 else 0.0)]
        return _of(min(values), max(values), False, r)
    k = int(n)

    def power(x: float) -> float:
        try:
            return x**k
        except OverflowError:
            return INF if x > 0 or k % 2 == 0 else -INF

    values = [power(r.lower), power(r.upper)]
    if r.lower < 0 < r.upper:
        values.append(0.0)
    return _of(min(values), max(values), r.integral, r)


#: One step per node kind; value_range looks a node's class up along its hierarchy.
_STEPS: dict[type[exp.Expression], Callable[[Any, TablePolicy], Range]] = {
    exp.Paren: _paren,
    exp.Literal: _literal,
    exp.Boolean: _boolean,
    exp.Null: _null,
    exp.Column: _column,
    exp.Neg: _neg,
    exp.Add: _add,
    exp.Sub: _sub,
    exp.Mul: _mul,
    exp.IntDiv: _int_div,
    exp.Div: _div,
    exp.Mod: _mod,
    exp.Abs: _abs,
    exp.Least: _least_greatest,
    exp.Greatest: _least_greatest,
    exp.Case: _case,
    exp.If: _if,
    exp.Coalesce: _coalesce,
    exp.Nullif: _nullif,
    exp.Cast: _cast_range,
    exp.TryCast: _cast_range,
    exp.Floor: _floor_ceil,
    exp.Ceil: _floor_ceil,
    exp.Round: _round,
    exp.Sign: _sign,
    exp.Sqrt: _sqrt,
    exp.Exp: _exp,
    exp.Ln: _log,
    exp.Log: _log,
    exp.Pow: _power_range,
    **dict.fromkeys(_DATE_PARTS, _date_part),
    exp.Extract: _extract,
    exp.Year: _year,
}
