"""BI dialect spellings, rewritten to the one form the binder checks.

Each rewrite is a pure function of the query text (and the bind-time clock for CURRENT_DATE
and NOW()), so it can neither read data nor change what a query may reveal: it only lets the
binder see `VAR(x)` as `VAR_SAMP(x)`, `COUNT(*) FILTER (WHERE c)` as
`COUNT(CASE WHEN c THEN 1 END)`, `TO_DATE('2024-01-31')` as `DATE '2024-01-31'`,
`date_part('dow', d)` as `EXTRACT(dow FROM d)`, and so on. grammar_notes.md lists them.
"""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal, InvalidOperation

from sqlglot import exp

from dpsql.errors import DataError
from dpsql.frontend.census import Census
from dpsql.frontend.logic import column_equality, conjuncts
from dpsql.policy import TablePolicy

# Aggregate spellings of SQL Server, MySQL, Tableau and Power BI.
_AGGREGATE_SPELLINGS: dict[str, type[exp.AggFunc]] = {
    "var": exp.Variance,  # SQL Server / Tableau: sample variance
    "varp": exp.VariancePop,
    "stdev": exp.Stddev,  # SQL Server / Tableau: sample standard deviation
    "stdevp": exp.StddevPop,
    "std": exp.StddevPop,  # MySQL: STD is the population standard deviation
}

# Oracle/PostgreSQL format tokens -> strptime, longest first.
_FORMAT_TOKENS = (
    ("YYYY", "%Y"),
    ("HH24", "%H"),
    ("HH12", "%I"),
    ("MM", "%m"),
    ("DD", "%d"),
    ("HH", "%H"),
    ("MI", "%M"),
    ("SS", "%S"),
    ("US", "%f"),  # microseconds (Superset's TO_TIMESTAMP format ends in .US)
    ("MS", "%f"),
    ("MON", "%b"),
    ("AM", "%p"),
    ("PM", "%p"),
)


#: PostgreSQL's and DuckDB's spellings of "the current timestamp" (a public clock).
_CLOCK_FUNCTIONS = ("now", "transaction_timestamp", "statement_timestamp", "get_current_time")


#: The node classes :func:`normalise`'s visitor acts on (a Select is rewritten only for its
#: joins): a tree holding none of them is returned as it is, without the transform's walk.
_RESPELLED = (
    exp.Filter,
    exp.CountIf,
    exp.WithinGroup,
    exp.Quantile,
    exp.Anonymous,
    exp.CurrentDate,
    exp.CurrentTimestamp,
    exp.Localtimestamp,
    exp.UnixToTime,
    exp.StrToTime,
    exp.StrToDate,
    exp.Join,
)


def respells(tree: exp.Expression, census: Census | None = None) -> bool:
    """Whether :func:`normalise` has anything to replace in ``tree``: a node of a class its
    visitor acts on, asked of ``census`` (the classes of ``tree``'s nodes,
    dpsql.frontend.census) when it counts this tree, else found by a walk."""
    if census is not None and census.root is tree:
        return census.has(*_RESPELLED)
    return tree.find(*_RESPELLED) is not None


def normalise(
    tree: exp.Expression,
    *,
    census: Census | None = None,
    today: dt.date | None = None,
    now: dt.datetime | None = None,
) -> exp.Expr:
    """``tree`` with the spellings above replaced (in place: the binder owns the parsed tree).

    The clock is public and read once per statement (``now``, UTC): ``CURRENT_DATE`` is its
    date, ``NOW()`` / ``CURRENT_TIMESTAMP`` / ``LOCALTIMESTAMP`` its timestamp, each a literal
    from here on, so every reference in one statement sees the same instant (PostgreSQL's
    statement-start semantics) and the plan, its fingerprint and the answer cache's key carry
    the instant: a relative filter (``WHERE d > NOW() - INTERVAL '30 days'``) is never
    replayed from another day's answer."""
    if not respells(tree, census):  # no node the visitor below would replace
        return tree
    now = now or dt.datetime.now(dt.UTC)
    today = today or now.date()
    instant = now.astimezone(dt.UTC).replace(tzinfo=None).isoformat(sep=" ")

    def visit(node: exp.Expr) -> exp.Expr:
        if isinstance(node, exp.Filter) and isinstance(node.this, exp.AggFunc):
            return _filtered_aggregate(node)
        if isinstance(node, exp.CountIf):  # COUNT_IF(c) = COUNT(*) FILTER (WHERE c)
            case = exp.Case(ifs=[exp.If(this=node.this.copy(), true=exp.Literal.number(1))])
            return exp.Count(this=case)
        if isinstance(node, exp.WithinGroup) and isinstance(
            node.this, exp.PercentileCont | exp.PercentileDisc
        ):
            return _within_group(node)
        if isinstance(node, exp.Quantile):  # DuckDB's QUANTILE(x, q) is QUANTILE_DISC
            return exp.PercentileDisc(this=node.this, expression=node.args.get("quantile"))
        if isinstance(node, exp.Anonymous):
            name = node.name.lower()
            spelled = _AGGREGATE_SPELLINGS.get(name)
            if spelled is not None and len(node.expressions) == 1:
                return spelled(this=node.expressions[0])
            if name == "to_date":
                return _to_date(node)
            if name in ("date_part", "datepart"):
                return _date_part(node)
        if isinstance(node, exp.CurrentDate):
            return exp.cast(exp.Literal.string(today.isoformat()), exp.DataType.build("DATE"))
        if isinstance(node, exp.CurrentTimestamp | exp.Localtimestamp) or (
            isinstance(node, exp.Anonymous)
            and node.name.lower() in _CLOCK_FUNCTIONS
            and not node.expressions
        ):
            return exp.cast(exp.Literal.string(instant), exp.DataType.build("TIMESTAMP"))
        if isinstance(node, exp.UnixToTime | exp.StrToTime | exp.StrToDate):
            return _to_timestamp(node)
        if isinstance(node, exp.Select) and node.args.get("joins"):
            _join_spellings(node)
        return node

    return tree.transform(visit, copy=False)


def _date_part(node: exp.Anonymous) -> exp.Expression:
    """``date_part('dow', d)`` is ``EXTRACT(dow FROM d)`` (DuckDB's and PostgreSQL's meaning);
    a part that is not a string literal is left for the binder to refuse."""
    part = _literal_text(node.expressions[0]) if len(node.expressions) == 2 else None
    if part is None or not re.fullmatch(r"[A-Za-z_]+", part):
        return node
    return exp.Extract(this=exp.var(part.upper()), expression=node.expressions[1])


def _within_group(node: exp.WithinGroup) -> exp.Expression:
    """``PERCENTILE_CONT(q) WITHIN GROUP (ORDER BY x)`` = ``QUANTILE_CONT(x, q)``; ``ORDER BY x
    DESC`` reads levels from the top, i.e. level 1 − q (exact decimal arithmetic). Anything
    else (no ORDER BY, several sort keys, a non-literal level) is left for the binder to
    refuse with a reason."""
    order = node.expression
    keys = order.expressions if isinstance(order, exp.Order) else []
    level = node.this.this
    if len(keys) != 1 or node.this.args.get("expression") is not None:
        return node
    if keys[0].args.get("desc"):
        flipped = _flip_levels(level)
        if flipped is None:
            return node
        level = flipped
    return type(node.this)(this=keys[0].this.copy(), expression=level.copy())


def _flip_levels(level: exp.Expression) -> exp.Expression | None:
    """1 − q for a numeric literal level (or an array of them); None for anything else."""

    def flip(lit: exp.Expression) -> exp.Expression | None:
        if not (isinstance(lit, exp.Literal) and not lit.is_string):
            return None
        try:
            return exp.Literal.number(format(Decimal(1) - Decimal(lit.this), "f"))
        except InvalidOperation:
            return None

    if isinstance(level, exp.Array):
        items = [flip(e) for e in level.expressions]
        if any(i is None for i in items):
            return None
        return exp.Array(expressions=items)
    return flip(level)


def _filtered_aggregate(node: exp.Filter) -> exp.Expression:
    """``AGG(x) FILTER (WHERE c)`` = ``AGG(CASE WHEN c THEN x END)``: NULL rows add nothing
    to any aggregate, so the two agree on every row (COUNT(*) counts a constant 1)."""
    agg = node.this.copy()
    condition = node.expression.this.copy()
    arg = agg.this
    distinct = isinstance(arg, exp.Distinct)
    value = arg.expressions[0] if distinct and arg.expressions else arg
    if value is None or isinstance(value, exp.Star):
        value = exp.Literal.number(1)
    case = exp.Case(ifs=[exp.If(this=condition, true=value)])
    agg.set("this", exp.Distinct(expressions=[case]) if distinct else case)
    return agg


def _literal_text(node: exp.Expression | None) -> str | None:
    if isinstance(node, exp.Literal) and node.is_string:
        return node.this
    return None


def _strptime_format(fmt: str) -> str:
    out, i = "", 0
    while i < len(fmt):
        for token, code in _FORMAT_TOKENS:
            if fmt[i : i + len(token)].upper() == token:
                out += code
                i += len(token)
                break
        else:
            out += fmt[i]
            i += 1
    return out


def _parse_when(text: str, fmt: str | None, node: exp.Expression) -> dt.datetime:
    try:
        if fmt is None:
            return parse_iso(text)
        return dt.datetime.strptime(text, _strptime_format(fmt))
    except ValueError:
        raise DataError(
            f"invalid date/time literal {text!r}" + (f" for format {fmt!r}" if fmt else ""),
            sqlstate="22007",
            construct=node.sql(dialect="duckdb")[:80],
            hint="write an ISO-8601 literal such as '2024-01-31' or '2024-01-31T12:00:00Z'",
        ) from None


def _to_date(node: exp.Anonymous) -> exp.Expression:
    """TO_DATE('2024-01-31'[, 'YYYY-MM-DD']) with literal arguments: a DATE literal."""
    args = node.expressions
    text = _literal_text(args[0]) if args else None
    fmt = _literal_text(args[1]) if len(args) > 1 else None
    if text is None or len(args) > 2 or (len(args) == 2 and fmt is None):
        return node  # not a literal: the binder refuses the function, naming it
    when = _parse_when(text, fmt, node)
    return exp.cast(exp.Literal.string(when.date().isoformat()), exp.DataType.build("DATE"))


def _to_timestamp(node: exp.Expression) -> exp.Expression:
    """TO_TIMESTAMP(epoch) / TO_TIMESTAMP('...', 'fmt') with literal arguments: a literal."""
    arg = node.this
    if isinstance(node, exp.UnixToTime) and _literal_text(arg) is not None:
        # DuckDB's parser reads TO_TIMESTAMP('text'[, 'format']) as UnixToTime with the
        # format in ``scale``: PostgreSQL's TO_TIMESTAMP(text, format).
        fmt = _literal_text(node.args.get("scale"))
        if node.args.get("scale") is not None and fmt is None:
            return node
        when = _parse_when(arg.this, fmt, node)
    elif isinstance(node, exp.UnixToTime):
        if not isinstance(arg, exp.Literal) or node.args.get("scale"):
            return node
        when = dt.datetime.fromtimestamp(float(arg.this), tz=dt.UTC).replace(tzinfo=None)
    else:
        text, fmt = _literal_text(arg), _literal_text(node.args.get("format"))
        if text is None:
            return node
        when = (
            _parse_when(text, None, node)
            if fmt is None
            else _parse_when(text, _pg_format(node, fmt), node)
        )
    if isinstance(node, exp.StrToDate):
        return exp.cast(exp.Literal.string(when.date().isoformat()), exp.DataType.build("DATE"))
    return exp.cast(exp.Literal.string(when.isoformat(sep=" ")), exp.DataType.build("TIMESTAMP"))


def _pg_format(node: exp.Expression, fmt: str) -> str:
    """sqlglot stores a parsed format in strftime codes already: map back to tokens."""
    if "%" in fmt:
        reverse = {code: token for token, code in _FORMAT_TOKENS}
        return re.sub(r"%[A-Za-z]", lambda m: reverse.get(m.group(0), m.group(0)), fmt)
    return fmt


_ISO = re.compile(
    r"^\s*(\d{4}-\d{2}-\d{2})(?:[T ](\d{2}:\d{2}(?::\d{2}(?:\.\d{1,9})?)?)"
    r"\s*(Z|[+-]\d{2}(?::?\d{2})?)?)?\s*$"
)


def parse_iso(text: str) -> dt.datetime:
    """An ISO-8601 date or timestamp (``Z`` or an offset converted to UTC, then naive)."""
    match = _ISO.match(text)
    if match is None:
        raise ValueError(text)
    day, clock, zone = match.groups()
    if clock is None:
        return dt.datetime.fromisoformat(day)
    if "." in clock:
        head, frac = clock.split(".")
        clock = f"{head}.{(frac + '000000')[:6]}"
    when = dt.datetime.fromisoformat(f"{day} {clock}")
    if zone and zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        digits = zone[1:].replace(":", "")
        offset = dt.timedelta(hours=int(digits[:2]), minutes=int(digits[2:4] or 0))
        when = when - sign * offset
    return when


def timestamp_literals(tree: exp.Expression, table: TablePolicy) -> exp.Expression:
    """String literals compared with a DATE column that are ISO-8601 *timestamps*
    (Grafana's ``'2024-01-31T00:00:00Z'``) become TIMESTAMP literals in UTC, so the
    comparison means what it says instead of failing to convert."""
    dates = {name for name, c in table.columns.items() if c.type == "date"}

    def is_date_column(node: exp.Expression | None) -> bool:
        return isinstance(node, exp.Column) and node.name.lower() in dates

    def convert(node: exp.Expression | None) -> exp.Expression | None:
        text = _literal_text(node)
        if text is None or ("T" not in text.upper() and ":" not in text):
            return None
        try:
            when = parse_iso(text)
        except ValueError:
            return None
        return exp.cast(
            exp.Literal.string(when.isoformat(sep=" ")), exp.DataType.build("TIMESTAMP")
        )

    comparisons = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)
    for node in list(tree.find_all(*comparisons, exp.Between, exp.In)):
        if isinstance(node, exp.Between | exp.In):
            if not is_date_column(node.this):
                continue
            others = (
                [("low", node.args.get("low")), ("high", node.args.get("high"))]
                if isinstance(node, exp.Between)
                else []
            )
            for arg, value in others:
                new = convert(value)
                if new is not None:
                    node.set(arg, new)
            if isinstance(node, exp.In):
                node.set("expressions", [convert(v) or v for v in node.expressions])
            continue
        for side, other in (("expression", node.this), ("this", node.expression)):
            if is_date_column(other):
                new = convert(node.args.get(side))
                if new is not None:
                    node.set(side, new)
    return tree


def _join_spellings(select: exp.Select) -> None:
    """Two spellings of an inner join on an equality, written as ``JOIN … ON a.k = b.k`` (in
    place) so the join lowerings see one form; every other join is left as written:

    - ``FROM a x JOIN b y USING (k)`` (the first join, one column): ``ON x.k = y.k``. With an
      inner or left join the two columns are equal wherever both exist, so the merged column
      USING would expose is either side's.
    - ``FROM a, b WHERE a.k = b.k AND …``: a comma join whose top-level WHERE holds an equality
      of a column of ``b`` with one of a table before it (both qualified): that conjunct moves
      into ``ON``. A comma join without one stays a cross join (and is refused as one).
    """
    from_ = select.args.get("from_") or select.args.get("from")
    if from_ is None:
        return
    names = [from_.this.alias_or_name.lower()]
    for i, join in enumerate(select.args["joins"]):
        right = join.this.alias_or_name.lower()
        using = join.args.get("using")
        if using and i == 0 and len(using) == 1 and join.args.get("on") is None:
            column = using[0].name
            join.set("using", None)
            join.set(
                "on",
                exp.EQ(this=exp.column(column, names[0]), expression=exp.column(column, right)),
            )
        elif _is_comma_join(join):
            where = select.args.get("where")
            found = None
            if where is not None:
                for part in conjuncts(where.this):
                    if _links(part, set(names), right):
                        found = part
                        break
            if where is not None and found is not None:
                rest = [c for c in conjuncts(where.this) if c is not found]
                join.set("on", found.copy())
                select.set("where", exp.Where(this=exp.and_(*rest)) if rest else None)
        names.append(right)


def _is_comma_join(join: exp.Join) -> bool:
    return not any(join.args.get(k) for k in ("kind", "side", "on", "using", "method"))


def _links(node: exp.Expression, before: set[str], right: str) -> bool:
    """``before_table.col = right.col`` (either order), both columns qualified."""
    eq = column_equality(node)
    if eq is None:
        return False
    tables = {eq.this.table.lower(), eq.expression.table.lower()}
    return right in tables and bool(tables & before) and "" not in tables and len(tables) == 2
