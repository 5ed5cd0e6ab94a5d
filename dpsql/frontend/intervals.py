"""Interval arithmetic over declared bounds: the range of an expression inside an aggregate.

``SUM(a * b)``, ``AVG(LEAST(GREATEST(x, 50), 100))``, ``SUM(CASE WHEN smoker THEN 1 ELSE 0
END)``: the per-row range of the aggregated value comes from the columns' declared bounds
(public, never measured), propagated through each operator. Unbounded columns are ±∞, so a
per-query clamp (``LEAST(GREATEST(x, lo), hi)``) bounds even a column without declared bounds.

Soundness does not rest on this module: the compiled query clamps the expression's *value*
to the range found here (dpsql.sql.compile.fixed_point_value), and the sensitivity is that of
the clamp. A range that is too wide only adds noise; this module's job is to find a tight
one, and to refuse an expression whose range is unbounded, naming the bound it lacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlglot import exp

from dpsql.policy import TablePolicy
from dpsql.sql.dialect import INTEGER_TYPES, integer_typed

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

    Raises :class:`NotNumeric` for an expression that is not a number.
    """
    if isinstance(node, exp.Paren):
        return value_range(node.this, table)
    if isinstance(node, exp.Literal):
        if node.is_string:
            raise NotNumeric(node, "a string is not a number")
        value = float(node.this)
        return Range(value, value, value.is_integer() and "." not in node.this.lower())
    if isinstance(node, exp.Boolean):
        raise NotNumeric(node, "a condition is not a number")
    if isinstance(node, exp.Null):
        return Range(INF, -INF, True)  # empty: NULL adds nothing to SUM, AVG or COUNT(expr)
    if isinstance(node, exp.Column):
        col = table.columns.get(node.name.lower())
        if col is None or not col.numeric:
            kind = col.type if col is not None else "unknown"
            raise NotNumeric(node, f"{node.name} is {kind}, not a number")
        lower = col.lower if col.lower is not None else -INF
        upper = col.upper if col.upper is not None else INF
        missing = () if col.bounded else (col.name,)
        return Range(lower, upper, col.type == "int", missing)
    if isinstance(node, exp.Neg):
        r = value_range(node.this, table)
        return _of(-r.upper, -r.lower, r.integral, r)
    if isinstance(node, exp.Add | exp.Sub):
        a, b = value_range(node.this, table), value_range(node.expression, table)
        if isinstance(node, exp.Add):
            return _of(a.lower + b.lower, a.upper + b.upper, a.integral and b.integral, a, b)
        return _of(a.lower - b.upper, a.upper - b.lower, a.integral and b.integral, a, b)
    if isinstance(node, exp.Mul):
        a, b = value_range(node.this, table), value_range(node.expression, table)
        corners = [_product(x, y) for x in (a.lower, a.upper) for y in (b.lower, b.upper)]
        return _of(min(corners), max(corners), a.integral and b.integral, a, b)
    if isinstance(node, exp.IntDiv) and (a_b := _integer_division(node, table)) is not None:
        return a_b
    if isinstance(node, exp.Div | exp.IntDiv):
        a, b = value_range(node.this, table), value_range(node.expression, table)
        if b.lower <= 0 <= b.upper:
            # 1/x near 0 is unbounded; the divisor's range must exclude 0 (DuckDB returns
            # NULL for a zero divisor, but values near it are as large as you like).
            return _of(-INF, INF, False, a, b, Range(0, 0, True, ("the divisor",)))
        corners = [
            x / y for x in (a.lower, a.upper) for y in (b.lower, b.upper) if math.isfinite(y)
        ]
        if not math.isfinite(b.lower) or not math.isfinite(b.upper):
            corners.append(0.0)
        low, high = min(corners), max(corners)
        return _of(low, high, False, a, b)  # DuckDB's // of a non-integer divides (7.0 // 2)
    if isinstance(node, exp.Mod):
        a, b = value_range(node.this, table), value_range(node.expression, table)
        m = max(abs(b.lower), abs(b.upper))
        low = 0.0 if a.lower >= 0 else max(-m, a.lower)
        high = 0.0 if a.upper <= 0 else min(m, a.upper)
        return _of(low, high, a.integral and b.integral, a, b)
    if isinstance(node, exp.Abs):
        r = value_range(node.this, table)
        if r.lower >= 0:
            return r
        if r.upper <= 0:
            return _of(-r.upper, -r.lower, r.integral, r)
        return _of(0.0, max(-r.lower, r.upper), r.integral, r)
    if isinstance(node, exp.Least | exp.Greatest):
        args = [value_range(a, table) for a in [node.this, *node.expressions]]
        pick = min if isinstance(node, exp.Least) else max
        low, high = pick(r.lower for r in args), pick(r.upper for r in args)
        # An end bounded by a literal no longer depends on the unbounded columns.
        unbounded = tuple(
            dict.fromkeys(
                c
                for r in args
                for c in r.unbounded
                if not (math.isfinite(low) and math.isfinite(high))
            )
        )
        return Range(low, high, all(r.integral for r in args), unbounded)
    if isinstance(node, exp.Case):
        branches = [value_range(i.args["true"], table) for i in node.args.get("ifs") or []]
        default = node.args.get("default")
        branches.append(value_range(default, table) if default is not None else _EMPTY)
        return _join(*branches)
    if isinstance(node, exp.If):
        false = node.args.get("false")
        return _join(
            value_range(node.args["true"], table),
            value_range(false, table) if false is not None else _EMPTY,
        )
    if isinstance(node, exp.Coalesce):
        return _join(*(value_range(a, table) for a in [node.this, *node.expressions]))
    if isinstance(node, exp.Nullif):
        return value_range(node.this, table)
    if isinstance(node, exp.Cast | exp.TryCast):
        return _cast_range(node, table)
    if isinstance(node, exp.Floor | exp.Ceil):
        r = value_range(node.this, table)
        if node.args.get("decimals") is not None:
            return _of(r.lower - 1, r.upper + 1, False, r)
        return _of(math.floor(r.lower), math.ceil(r.upper), True, r)
    if isinstance(node, exp.Round):
        r = value_range(node.this, table)
        digits = node.args.get("decimals")
        if digits is None:
            return _of(_round_half_away(r.lower), _round_half_away(r.upper), True, r)
        if not isinstance(digits, exp.Literal) or digits.is_string:
            raise NotNumeric(node, "ROUND's digits must be a number literal")
        half = 0.5 * 10.0 ** -int(float(digits.this))
        return _of(r.lower - half, r.upper + half, False, r)
    if isinstance(node, exp.Sign):
        r = value_range(node.this, table)
        return Range(-1.0 if r.lower < 0 else 0.0, 1.0 if r.upper > 0 else 0.0, True)
    if isinstance(node, exp.Sqrt):
        r = value_range(node.this, table)
        return _of(math.sqrt(max(r.lower, 0.0)), math.sqrt(max(r.upper, 0.0)), False, r)
    if isinstance(node, exp.Exp):
        r = value_range(node.this, table)
        return _of(_safe_exp(r.lower), _safe_exp(r.upper), False, r)
    if isinstance(node, exp.Ln | exp.Log):
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
    if isinstance(node, exp.Pow):
        return _power_range(node, table)
    if isinstance(node, exp.Month | exp.Day | exp.Quarter | exp.DayOfWeek):
        limits = {exp.Month: (1, 12), exp.Day: (1, 31), exp.Quarter: (1, 4), exp.DayOfWeek: (0, 6)}
        low, high = limits[type(node)]
        return Range(low, high, True)
    if isinstance(node, exp.Extract):
        part = node.this.name.lower() if isinstance(node.this, exp.Var | exp.Identifier) else ""
        limits2 = {
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
        if part in limits2:
            low, high = limits2[part]
            return Range(low, high, True)
        return Range(-INF, INF, True, (f"EXTRACT({part.upper()})",))
    if isinstance(node, exp.Year):
        return Range(-INF, INF, True, ("YEAR(...)",))
    raise NotNumeric(node, "no range is known for it")


_EMPTY = Range(INF, -INF, True)


def _integer_division(node: exp.IntDiv, table: TablePolicy) -> Range | None:
    """The range of ``a // b`` for integers a and b (PostgreSQL's ``int / int`` arrives here
    too, dpsql.sql.dialect): the quotient truncated toward zero, as DuckDB and PostgreSQL do.

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
