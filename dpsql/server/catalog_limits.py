"""What a catalog query may call, and how much it may cost.

Catalog queries are any SQL that names no private table, so an analyst can send anything there.
The shadow holds no private row, but it shares the server with every other analyst: one
``SELECT repeat('x', 150000000)`` used to cost 690 MiB, one ``range(10^13)`` a query thread for
30 s. So a catalog statement may only call the functions that client introspection actually uses
(psql's ``\\d`` family, JDBC ``DatabaseMetaData``, SQLAlchemy's PostgreSQL dialect, Npgsql,
asyncpg, DBeaver, Metabase, Tableau and Power BI shapes) plus common SQL functions, and it runs
under :class:`CatalogLimits` in a shadow process of its own (:mod:`dpsql.server.catalog`).

The check walks the sqlglot tree that is rendered for DuckDB (after the PostgreSQL rewrites of
:mod:`dpsql.server.catalog_sql`), so what is checked is what runs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError
from sqlglot.tokens import TokenType

from dpsql.errors import Position, ProgrammingError
from dpsql.frontend.positions import offset_position
from dpsql.server.catalog_schema import MACROS, TABLE_MACROS


@dataclass(frozen=True)
class CatalogLimits:
    """Resource bounds of the shadow catalog (one set per server)."""

    timeout: float = 2.0  # seconds a catalog statement may run before it is interrupted
    max_rows: int = 100_000  # rows one catalog statement may return
    max_bytes: int = 16 << 20  # bytes (roughly counted) one catalog statement may return
    memory_limit: str = "256MB"  # DuckDB's own limit in each shadow process
    address_space: int = 1 << 30  # bytes a shadow process may map beyond its size at start
    processes: int = 2  # shadow processes: catalog statements that run at the same time
    queue: int = 4  # statements that may wait for a free process; more are refused at once
    max_series: int = 100_000  # values of a generate_series/range used as a value (a list)
    start_timeout: float = 60.0  # seconds to wait for a shadow process to start
    max_text: int = 128 << 10  # characters of statement text (parsing is the cost of a long one)

    def __post_init__(self) -> None:
        if self.processes < 1 or self.queue < 0 or not self.timeout > 0:
            raise ValueError("catalog limits need processes >= 1, queue >= 0 and timeout > 0")


class CatalogRefusal(ProgrammingError):
    """A catalog statement refused before it runs (its position is in the client's text)."""


# sqlglot classes a catalog statement may contain (PostgreSQL/DuckDB functions sqlglot knows).
ALLOWED_CLASSES: tuple[type[exp.Func], ...] = (
    # logic, conditionals and casts
    exp.And, exp.Or, exp.Xor, exp.Case, exp.If, exp.Cast, exp.TryCast, exp.Coalesce,
    exp.Nullif, exp.Collate, exp.Exists, exp.Greatest, exp.Least,
    # session and time
    exp.CurrentDate, exp.CurrentTimestamp, exp.CurrentTime, exp.Localtime, exp.Localtimestamp,
    exp.CurrentSchemas, exp.CurrentUser, exp.SessionUser, exp.CurrentRole, exp.CurrentSchema,
    exp.CurrentDatabase, exp.CurrentCatalog, exp.CurrentVersion,
    exp.Extract, exp.TimestampTrunc, exp.DateTrunc, exp.TimeToStr, exp.StrToTime,
    exp.UnixToTime, exp.Date, exp.DateAdd, exp.DateSub, exp.DateDiff, exp.Year, exp.Month,
    exp.Day, exp.Quarter, exp.DayOfWeek,
    # aggregates and window functions
    exp.Count, exp.Sum, exp.Min, exp.Max, exp.Avg, exp.ArrayAgg, exp.GroupConcat,
    exp.LogicalAnd, exp.LogicalOr, exp.JSONArrayAgg, exp.Stddev, exp.StddevPop,
    exp.StddevSamp, exp.Variance, exp.VariancePop, exp.AnyValue,
    exp.RowNumber, exp.Rank, exp.DenseRank, exp.Lag, exp.Lead, exp.FirstValue, exp.LastValue,
    exp.NthValue, exp.PercentRank, exp.CumeDist, exp.Ntile,
    # strings
    exp.Lower, exp.Upper, exp.Length, exp.Substring, exp.Trim, exp.Concat, exp.ConcatWs,
    exp.Left, exp.Right, exp.SplitPart, exp.StrPosition, exp.Replace, exp.RegexpReplace,
    exp.RegexpLike, exp.RegexpILike, exp.StartsWith, exp.Initcap, exp.Translate, exp.Reverse,
    exp.Chr, exp.Ascii, exp.MD5, exp.Format,
    # numbers
    exp.Abs, exp.Round, exp.Floor, exp.Ceil, exp.Trunc, exp.Pow, exp.Sign, exp.Sqrt, exp.Ln,
    exp.Log, exp.Exp,
    # arrays (sizes bounded by their inputs), JSON
    exp.Array, exp.Struct, exp.ArraySize, exp.ArrayAppend, exp.ArrayPrepend, exp.ArrayConcat,
    exp.ArrayPosition, exp.ArrayRemove, exp.ArrayContains, exp.ArrayToString,
    exp.StringToArray, exp.Unnest, exp.Explode, exp.JSONObject,
    # series: bounded when used as a value, see _check_series
    exp.ExplodingGenerateSeries, exp.GenerateSeries,
)  # fmt: skip

# Functions sqlglot does not know (exp.Anonymous), by lowercase name: the shadow's macros, what
# the rewrite produces, and PostgreSQL functions clients call that DuckDB provides.
ALLOWED_FUNCTIONS: frozenset[str] = frozenset(
    {name for name, _ in MACROS}
    | {
        # produced by dpsql.server.catalog_sql (regclass casts, = ANY, renames)
        "dp_regclass_oid", "dp_regclass_name", "dp_regtype_oid", "dp_regtype_name",
        "dp_regnamespace_oid", "dp_regnamespace_name", "dp_regproc_oid", "dp_regproc_name",
        "dp_regrole_oid", "dp_regrole_name", "list_contains", "json_object",
        "json_group_array", "current_setting", "dp_current_setting", "version",
        "pg_backend_pid",
        # PostgreSQL functions in client catalog queries
        "array_to_string", "array_length", "cardinality", "generate_subscripts",
        "regexp_matches", "row_to_json", "to_json", "octet_length", "char_length",
        "bit_length", "getdatabaseencoding", "pg_client_encoding", "date_part", "age",
        "string_agg", "listagg", "bool_and", "bool_or", "every", "any", "all", "strpos",
        "substr", "btrim", "ltrim", "rtrim", "current_schemas", "format",
        # series, bounded when used as a value, see _check_series
        "range", "generate_series",
    }
)  # fmt: skip

# Table functions (in FROM): they stream their rows, so the statement timeout and the result
# caps bound them.
TABLE_FUNCTIONS: frozenset[str] = frozenset(
    set(TABLE_MACROS)
    | {
        "generate_series", "range", "generate_subscripts", "unnest", "_pg_expandarray",
        "pg_timezone_names",
        # read-only view of the shadow's own (locked) DuckDB settings, to audit the seal
        "duckdb_settings",
    }
)  # fmt: skip
TABLE_CLASSES: tuple[type[exp.Func], ...] = (
    exp.ExplodingGenerateSeries,
    exp.GenerateSeries,
    exp.Unnest,
    exp.Explode,
)

_SERIES_NAMES = frozenset({"range", "generate_series"})
# Calls whose value is an array's length: a series up to one of these is bounded by an array.
_ARRAY_BOUNDS = frozenset({"array_upper", "array_length", "cardinality", "len", "length"})
_FILE_LIKE = ("/", "\\", ":", ".")
READ_ONLY_HINT = (
    "only queries are accepted; private tables are answered with differential privacy, the "
    "catalog from the policy"
)
FUNCTION_HINT = (
    "catalog queries may call the PostgreSQL catalog functions clients use (format_type, "
    "pg_get_expr, has_table_privilege, ...) and common SQL functions; see docs/server.md"
)


def check_statement(
    tree: exp.Expression,
    text: str,
    source: str | None = None,
    *,
    max_series: int = CatalogLimits.max_series,
) -> None:
    """Refuse a catalog statement that is not a query or calls anything off the whitelist.

    ``tree`` is the statement as it will be rendered for DuckDB, parsed from ``text``;
    ``source`` is the client's own text (before parameters were inlined and PostgreSQL
    operators rewritten), where positions are reported.
    """
    if not isinstance(tree, exp.Query | exp.Values):
        raise CatalogRefusal(
            "cannot execute this statement: dpsql is read-only",
            sqlstate="25006",
            hint=READ_ONLY_HINT,
        )
    where = _Locator(text, source if source is not None else text)
    for node in tree.walk():
        if isinstance(node, exp.Table):
            _check_table(node, where)
        if not isinstance(node, exp.Func):
            continue
        if _in_from(node):
            _check_table_function(node, where)
        elif isinstance(node, exp.Anonymous):
            if node.name.lower() not in ALLOWED_FUNCTIONS:
                raise _refuse_function(node, where)
        elif not isinstance(node, ALLOWED_CLASSES):
            raise _refuse_function(node, where)
        if not _in_from(node):
            _check_series(node, where, max_series)
        if isinstance(node, exp.Format) or (
            isinstance(node, exp.Anonymous) and node.name.lower() == "format"
        ):
            _check_format(node, where)


def _in_from(node: exp.Expr) -> bool:
    """Whether ``node`` is called as a table function (FROM f(...), JOIN f(...))."""
    parent = node.parent
    if isinstance(parent, exp.Table):
        return parent.this is node
    return isinstance(parent, exp.From | exp.Join) and parent.this is node


def _name(node: exp.Func, where: _Locator) -> str:
    """The function's name as the client wrote it (else sqlglot's name for it)."""
    typed = where.typed_name(node)
    if typed:
        return typed
    if isinstance(node, exp.Anonymous):
        return node.name.lower()
    return node.sql_name().lower()


def _refuse_function(node: exp.Func, where: _Locator) -> CatalogRefusal:
    name = _name(node, where)
    return CatalogRefusal(
        f"function {name}() is not available in catalog queries",
        sqlstate="42883",
        construct=name,
        position=where.position(node),
        hint=FUNCTION_HINT,
    )


def _check_table_function(node: exp.Func, where: _Locator) -> None:
    name = node.name.lower() if isinstance(node, exp.Anonymous) else ""
    if name in TABLE_FUNCTIONS or isinstance(node, TABLE_CLASSES):
        return
    typed = _name(node, where)
    hint = (
        "catalog queries read pg_catalog and information_schema; the table functions they "
        "may use are generate_series, unnest, generate_subscripts and pg_get_keywords"
    )
    if name == "dp_rule_list":
        hint = "dp_rule_list is answered through the Python DB-API (dpsql.connect) for now"
    raise CatalogRefusal(
        f"table function {typed}() is not available in catalog queries",
        sqlstate="42883",
        construct=typed,
        position=where.position(node),
        hint=hint,
    )


def _check_table(node: exp.Table, where: _Locator) -> None:
    """A table named like a path would be a file read (DuckDB's replacement scans)."""
    if not isinstance(node.this, exp.Identifier):
        return
    name = node.this.name
    if any(mark in name for mark in _FILE_LIKE):
        raise CatalogRefusal(
            f'relation "{name}" does not exist',
            sqlstate="42P01",
            construct=name,
            position=where.offset_of(node.this),
            hint="catalog queries read pg_catalog and information_schema tables; dpsql serves "
            "no files",
        )


def _series_args(node: exp.Func) -> list[exp.Expression] | None:
    if isinstance(node, exp.ExplodingGenerateSeries | exp.GenerateSeries):
        args = [node.args.get("start"), node.args.get("end"), node.args.get("step")]
        return [a for a in args if a is not None]
    if isinstance(node, exp.Anonymous) and node.name.lower() in _SERIES_NAMES:
        return list(node.expressions)
    return None


def _check_series(node: exp.Func, where: _Locator, limit: int) -> None:
    """A series used as a value is built as one list in memory, past any interrupt: only
    literal bounds with at most ``max_series`` values, or an array's bounds, are allowed."""
    args = _series_args(node)
    if args is None:
        return
    if len(args) >= 2 and _array_bound(args[1]):
        return
    count = _series_count(node, args)
    if count is not None and count <= limit:
        return
    name = _name(node, where)
    raise CatalogRefusal(
        f"{name}() used as a value in a catalog query may produce at most {limit} values",
        sqlstate="54000",
        construct=name,
        position=where.position(node),
        hint="give it literal bounds, or an array's bounds such as array_upper(a, 1); as a "
        "table function (FROM generate_series(...)) it runs under the catalog timeout",
    )


def _array_bound(node: exp.Expression) -> bool:
    node = _strip(node)
    if isinstance(node, exp.ArraySize):
        return True
    if isinstance(node, exp.Anonymous) and node.name.lower() in _ARRAY_BOUNDS:
        return True
    if isinstance(node, exp.Add | exp.Sub) and _constant(node.expression) is not None:
        return _array_bound(node.this)  # array_upper(a, 1) - 1
    return False


def _series_count(node: exp.Func, args: list[exp.Expression]) -> float | None:
    values = [_constant(a) for a in args]
    if any(v is None for v in values) or not values:
        return None
    nums = [float(v) for v in values if v is not None]
    exclusive = isinstance(node, exp.Anonymous) and node.name.lower() == "range"
    if len(nums) == 1:
        start, end, step = (0.0, nums[0], 1.0) if exclusive else (1.0, nums[0], 1.0)
    else:
        start, end = nums[0], nums[1]
        step = nums[2] if len(nums) > 2 else 1.0
    if step == 0 or not all(map(math.isfinite, (start, end, step))):
        return None
    return max(0.0, math.floor((end - start) / step) + 1)


def _strip(node: exp.Expression) -> exp.Expression:
    while isinstance(node, exp.Paren | exp.Cast):
        node = node.this
    return node


def _constant(node: exp.Expression) -> float | None:
    """The value of a numeric expression built from literals only, else None."""
    node = _strip(node)
    try:
        if isinstance(node, exp.Literal) and not node.is_string:
            return float(node.this)
        if isinstance(node, exp.Neg):
            inner = _constant(node.this)
            return None if inner is None else -inner
        if isinstance(node, exp.Add | exp.Sub | exp.Mul | exp.Pow):
            left, right = _constant(node.this), _constant(node.expression)
            if left is None or right is None:
                return None
            if isinstance(node, exp.Add):
                return left + right
            if isinstance(node, exp.Sub):
                return left - right
            if isinstance(node, exp.Mul):
                return left * right
            return math.pow(left, right) if abs(right) < 400 else math.inf
    except (ValueError, OverflowError):
        return math.inf
    return None


def _check_format(node: exp.Func, where: _Locator) -> None:
    """DuckDB's format() pads to any width ('{:>1000000000}'): only PostgreSQL-style format
    strings (%s, %I, %L), which DuckDB copies as they are, are allowed."""
    pattern = node.this if isinstance(node, exp.Format) else next(iter(node.expressions), None)
    if isinstance(pattern, exp.Literal) and pattern.is_string and "{" not in pattern.this:
        return
    raise CatalogRefusal(
        "format() in a catalog query takes a literal format string without '{'",
        sqlstate="54000",
        construct="format",
        position=where.position(node),
        hint="write the format string as a literal, e.g. format('%I.%I', nspname, relname)",
    )


class _Locator:
    """Maps a node of the parsed (rewritten) text to the client's own text."""

    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source

    def typed_name(self, node: exp.Expr) -> str | None:
        meta = getattr(node, "_meta", None) or {}
        start, end = meta.get("start"), meta.get("end")
        if start is None or end is None:
            return None
        return self.text[start : end + 1].lower() or None

    def position(self, node: exp.Expr) -> Position | None:
        name = self.typed_name(node)
        start = (getattr(node, "_meta", None) or {}).get("start")
        if name is None or start is None:
            return None
        if self.text == self.source:
            return offset_position(self.source, start)
        # The k-th call of this name in the parsed text is the k-th in the client's text:
        # rewriting and inlining parameters change the text around calls, never the calls.
        ours = _calls(self.text, name)
        theirs = _calls(self.source, name)
        if start in ours and ours.index(start) < len(theirs):
            return offset_position(self.source, theirs[ours.index(start)])
        return None

    def offset_of(self, node: exp.Expression) -> Position | None:
        start = (getattr(node, "_meta", None) or {}).get("start")
        if start is None:
            return None
        if self.text == self.source:
            return offset_position(self.source, start)
        end = (getattr(node, "_meta", None) or {}).get("end", start)
        found = self.source.find(self.text[start : end + 1])
        return offset_position(self.source, found) if found >= 0 else None


def _calls(text: str, name: str) -> list[int]:
    """Offsets of ``name(`` calls in ``text`` (outside strings and comments)."""
    try:
        tokens = sqlglot.tokenize(text, read="postgres")
    except (TokenError, ParseError):
        return []
    return [
        tok.start
        for tok, after in itertools.pairwise(tokens)
        if tok.text.lower() == name and after.token_type == TokenType.L_PAREN
    ]
