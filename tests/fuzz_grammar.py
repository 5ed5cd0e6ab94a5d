"""Hypothesis strategies for SQL in dpsql's accepted grammar, over the visits fixture.

The differential fuzz test (tests/test_differential_fuzz.py) runs what these generate on two
neighbouring datasets. The grammar follows grammar_notes.md and ``dpsql.frontend.bind.SCALAR_NODES``
and is deliberately a little wider: every expression is built for a wanted type (int, float,
text, date, bool), but any sub-expression may be of another type (``diagnosis IS TRUE``,
``WHERE visit_date``, ``LOWER(age)``) and keys may have types no key should have (STRUCT,
LIST, BLOB, UUID, TIME, INTERVAL). Literals lean to the extremes (BIGINT and HUGEINT limits,
1e308, NaN, year 9999, odd but valid Unicode), where data-dependent failures hide. A refusal
is a fine outcome for any of it; the test only asks that both datasets see the same one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import sqlglot
from hypothesis import strategies as st
from sqlglot import exp

Strategy = st.SearchStrategy

TABLE = "visits"
#: The fixture's columns and their policy types (fixtures/visits.toml).
COLUMNS: dict[str, str] = {
    "patient_id": "int",
    "age": "int",
    "cost": "float",
    "department": "text",
    "diagnosis": "text",
    "visit_date": "date",
    "smoker": "bool",
    "readmitted": "bool",
}
#: Columns with a public domain (declared values, bool, bounded int).
PUBLIC_COLUMNS = ("age", "department", "smoker", "readmitted")
TYPES = ("int", "float", "text", "date", "bool")
#: The privacy unit of the extra patient in D′: the analyst knows whom they probe.
EXTRA_UNIT = 9223372036854775807
DEPARTMENTS = ("cardiology", "dermatology", "emergency", "neurology", "oncology", "pediatrics")

INT_LITERALS = (
    "0",
    "1",
    "-1",
    "2",
    "10",
    "100",
    "4752",
    str(EXTRA_UNIT),
    "-9223372036854775808",
    "170141183460469231731687303715884105727",  # HUGEINT max
    "99999999999999999999999999999999999999",
    "CAST(NULL AS INTEGER)",
)
FLOAT_LITERALS = (
    "0.5",
    "0.1",
    "2.7",
    "4999.99",
    "-0.0",
    "1e308",
    "-1e308",
    "2.5e-308",
    "CAST('nan' AS DOUBLE)",
    "CAST('inf' AS DOUBLE)",
    "CAST('-inf' AS DOUBLE)",
)
#: Odd but valid Unicode (no lone surrogates: those belong in comments, see COMMENT_TEXTS).
TEXT_VALUES = (
    "J06",
    "oncology",
    "",
    "true",
    "1",
    "nan",
    "2024-01-01",
    "9999-12-31",
    "[1, 2]",
    "{'a': 1}",
    "it's",
    "%",
    "_",
    "\\",
    "ß",
    "İ",
    "e\u0301",
    "\u202eevil",
    "\u200b",
    "\U0001fa7a",
    "\x00",
    "\ufeff",
    "x" * 300,
)
DATE_LITERALS = (
    "DATE '2024-01-01'",
    "DATE '2025-12-31'",
    "DATE '9999-12-31'",
    "DATE '0001-01-01'",
    "'2024-06-30'",
    "CAST('9999-12-31' AS DATE)",
)
BOOL_LITERALS = ("TRUE", "FALSE", "NULL")

#: Cast targets and the type family of their result ("other": no key or condition type).
CAST_TARGETS: dict[str, str] = {
    "INTEGER": "int",
    "BIGINT": "int",
    "SMALLINT": "int",
    "TINYINT": "int",
    "HUGEINT": "int",
    "UBIGINT": "int",
    "DOUBLE": "float",
    "REAL": "float",
    "DECIMAL(4, 1)": "float",
    "DECIMAL(38, 10)": "float",
    "VARCHAR": "text",
    "BOOLEAN": "bool",
    "DATE": "date",
    "TIMESTAMP": "other",
    "TIME": "other",
    "INTERVAL": "other",
    "BLOB": "other",
    "UUID": "other",
    "VARCHAR[]": "other",
    "INTEGER[]": "other",
}
DATE_PARTS = ("YEAR", "MONTH", "DAY", "QUARTER", "DAYOFWEEK")
#: Comment bodies; '\udc80' (a lone surrogate) makes the text invalid Unicode.
COMMENT_TEXTS = ("", "note", "é☃\U0001fa7a", "\u202e", "*", "--", "\udc80", "a\udc80b", "\ud800")


def quote(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def text_literals() -> Strategy[str]:
    odd = st.text(st.characters(exclude_categories=("Cs",)), max_size=6)
    return st.one_of(st.sampled_from(TEXT_VALUES), odd).map(quote)


def _fmt(template: str) -> Callable[[tuple[str, ...]], str]:
    return lambda parts: template.format(*parts)


@dataclass(frozen=True)
class Grammar:
    """Typed expression strategies over ``columns`` (name -> type), ``depth`` levels deep.

    ``strict``: no sub-expression of another type than wanted and no truth test of a
    non-BOOLEAN value, so that a typed binder answers more of what is generated.
    """

    columns: tuple[tuple[str, str], ...] = tuple(COLUMNS.items())
    strict: bool = False

    def leaf(self, t: str) -> Strategy[str]:
        names = [n for n, ct in self.columns if ct == t]
        literals: Strategy[str] = {
            "int": st.sampled_from(INT_LITERALS),
            "float": st.sampled_from(FLOAT_LITERALS),
            "text": text_literals(),
            "date": st.sampled_from(DATE_LITERALS),
            "bool": st.sampled_from(BOOL_LITERALS),
        }[t]
        if not names:
            return literals
        return st.one_of(st.sampled_from(names), literals)

    @cache  # noqa: B019 - a handful of module-level grammars, kept for the session
    def expr(self, t: str, depth: int) -> Strategy[str]:
        """An expression meant to have type ``t``; now and then one of another type."""
        if depth <= 0:
            return self.leaf(t)
        if self.strict:
            return st.one_of(self.leaf(t), self.typed(t, depth))
        others = [u for u in TYPES if u != t]
        mistyped = st.sampled_from(others).flatmap(lambda u: self.typed(u, depth))
        return st.one_of(self.leaf(t), self.typed(t, depth), mistyped)

    @cache  # noqa: B019
    def typed(self, t: str, depth: int) -> Strategy[str]:
        sub = depth - 1
        e = self.expr
        generic = [
            st.tuples(e(t, sub), e(t, sub)).map(_fmt("COALESCE({}, {})")),
            st.tuples(e(t, sub), e(t, sub)).map(_fmt("NULLIF({}, {})")),
            self.case(t, sub),
            st.tuples(e("bool", sub), e(t, sub), e(t, sub)).map(_fmt("IF({}, {}, {})")),
        ]
        if not self.strict:  # a t cast to anything, whatever its type then is
            generic.append(
                st.tuples(st.sampled_from(list(CAST_TARGETS)), e(t, sub), st.booleans()).map(
                    lambda p: f"{'TRY_CAST' if p[2] else 'CAST'}({p[1]} AS {p[0]})"
                )
            )
        # A cast *to* t from anything: the classic implicit/explicit conversion failures.
        targets = [k for k, v in CAST_TARGETS.items() if v == t]
        if targets:
            any_type = st.sampled_from(TYPES).flatmap(lambda u: e(u, sub))
            generic.append(
                st.tuples(st.sampled_from(targets), any_type, st.booleans()).map(
                    lambda p: f"{'TRY_CAST' if p[2] else 'CAST'}({p[1]} AS {p[0]})"
                )
            )
        if t in ("int", "float", "text", "date"):
            generic.append(
                st.tuples(st.sampled_from(("GREATEST", "LEAST")), e(t, sub), e(t, sub)).map(
                    _fmt("{}({}, {})")
                )
            )
        specific = {
            "int": self._int,
            "float": self._float,
            "text": self._text,
            "date": self._date,
            "bool": self._bool,
        }[t](sub)
        return st.one_of(*specific, *generic)

    def case(self, t: str, sub: int) -> Strategy[str]:
        when = st.tuples(self.expr("bool", sub), self.expr(t, sub)).map(_fmt("WHEN {} THEN {}"))
        default = st.one_of(st.just(""), self.expr(t, sub).map(lambda x: f" ELSE {x}"))
        return st.tuples(st.lists(when, min_size=1, max_size=2), default).map(
            lambda p: f"CASE {' '.join(p[0])}{p[1]} END"
        )

    def _int(self, sub: int) -> list[Strategy[str]]:
        e = self.expr
        ops = st.sampled_from(("+", "-", "*", "//", "%"))
        fields = st.sampled_from(("year", "month", "day", "quarter", "dow"))
        return [
            st.tuples(e("int", sub), ops, e("int", sub)).map(_fmt("({} {} {})")),
            e("int", sub).map(lambda x: f"-({x})"),
            st.tuples(st.sampled_from(("ABS", "SIGN")), e("int", sub)).map(_fmt("{}({})")),
            e("text", sub).map(lambda x: f"LENGTH({x})"),
            st.tuples(st.sampled_from(DATE_PARTS), e("date", sub)).map(_fmt("{}({})")),
            st.tuples(fields, e("date", sub)).map(_fmt("EXTRACT({} FROM {})")),
        ]

    def _float(self, sub: int) -> list[Strategy[str]]:
        e = self.expr
        ops = st.sampled_from(("+", "-", "*", "/"))
        unary = st.sampled_from(("SQRT", "LN", "LOG", "EXP", "FLOOR", "CEIL", "ABS"))
        return [
            st.tuples(e("float", sub), ops, e("float", sub)).map(_fmt("({} {} {})")),
            st.tuples(e("int", sub), e("int", sub)).map(_fmt("({} / {})")),
            st.tuples(unary, e("float", sub)).map(_fmt("{}({})")),
            st.tuples(e("float", sub), e("float", sub)).map(_fmt("POW({}, {})")),
            st.tuples(e("float", sub), st.sampled_from(("0", "1", "2", "-1"))).map(
                _fmt("ROUND({}, {})")
            ),
        ]

    def _text(self, sub: int) -> list[Strategy[str]]:
        e = self.expr
        return [
            st.tuples(st.sampled_from(("LOWER", "UPPER", "TRIM")), e("text", sub)).map(
                _fmt("{}({})")
            ),
            st.tuples(e("text", sub), e("int", sub), e("int", sub)).map(
                _fmt("SUBSTRING({}, {}, {})")
            ),
            st.tuples(e("text", sub), e("text", sub)).map(_fmt("({} || {})")),
            st.tuples(e("text", sub), e("text", sub)).map(_fmt("CONCAT({}, {})")),
        ]

    def _date(self, sub: int) -> list[Strategy[str]]:
        e = self.expr
        parts = st.sampled_from(("'year'", "'month'", "'day'"))
        units = st.sampled_from(("DAY", "MONTH", "YEAR"))
        return [
            st.tuples(parts, e("date", sub)).map(_fmt("DATE_TRUNC({}, {})")),
            st.tuples(e("date", sub), st.sampled_from(("+", "-")), e("int", sub)).map(
                _fmt("({} {} {})")
            ),
            st.tuples(e("date", sub), st.sampled_from(INT_LITERALS[:7]), units).map(
                _fmt("({} + INTERVAL {} {})")
            ),
            st.tuples(e("date", sub), st.sampled_from(("1", "8000", "2147483647")), units).map(
                _fmt("({} + INTERVAL '{}' {})")
            ),
        ]

    def _bool(self, sub: int) -> list[Strategy[str]]:
        e = self.expr
        any_type = st.sampled_from(TYPES).flatmap(lambda u: e(u, sub))
        same = st.sampled_from(TYPES).flatmap(lambda u: st.tuples(e(u, sub), e(u, sub)))
        triple = st.sampled_from(TYPES).flatmap(
            lambda u: st.tuples(e(u, sub), e(u, sub), e(u, sub))
        )
        cmp = st.sampled_from(
            ("=", "<>", "<", "<=", ">", ">=", "IS DISTINCT FROM", "IS NOT DISTINCT FROM")
        )
        is_ = st.sampled_from(
            ("IS TRUE", "IS NOT TRUE", "IS FALSE", "IS NOT FALSE", "IS NULL", "IS NOT NULL")
        )
        likes = st.sampled_from(("LIKE", "ILIKE", "NOT LIKE"))
        in_list = st.sampled_from(TYPES).flatmap(
            lambda u: st.tuples(e(u, sub), st.lists(self.leaf(u), min_size=1, max_size=3))
        )
        truth = st.tuples(e("bool", sub), is_).map(_fmt("({} {})"))
        nulls = st.tuples(any_type, st.sampled_from(("IS NULL", "IS NOT NULL")))
        loose = [
            st.tuples(any_type, is_).map(_fmt("({} {})")),
            any_type,  # a bare expression of any type as a condition
        ]
        return [
            st.tuples(same, cmp).map(lambda p: f"({p[0][0]} {p[1]} {p[0][1]})"),
            *([truth, nulls.map(_fmt("({} {})"))] if self.strict else loose),
            e("bool", sub).map(lambda x: f"NOT ({x})"),
            st.tuples(e("bool", sub), st.sampled_from(("AND", "OR")), e("bool", sub)).map(
                _fmt("({} {} {})")
            ),
            triple.map(lambda p: f"({p[0]} BETWEEN {p[1]} AND {p[2]})"),
            in_list.map(lambda p: f"({p[0]} IN ({', '.join(p[1])}))"),
            st.tuples(e("text", sub), likes, text_literals()).map(_fmt("({} {} {})")),
        ]

    def other(self, sub: int) -> Strategy[str]:
        """Keys of types no GROUP BY key should have: STRUCT, LIST, BLOB, UUID, TIME, ..."""
        e = self.expr
        any_type = st.sampled_from(TYPES).flatmap(lambda u: e(u, sub))
        return st.one_of(
            st.tuples(any_type, any_type).map(_fmt("({}, {})")),  # a row: STRUCT
            st.tuples(any_type, any_type).map(_fmt("{{'a': {}, 'b': {}}}")),
            st.tuples(any_type, any_type).map(_fmt("[{}, {}]")),
            e("text", sub).map(lambda x: f"CAST('[' || {x} || ']' AS VARCHAR[])"),
            e("text", sub).map(lambda x: f"CAST({x} AS BLOB)"),
            e("text", sub).map(lambda x: f"TRY_CAST({x} AS UUID)"),
            e("date", sub).map(lambda x: f"CAST(CAST({x} AS TIMESTAMP) AS TIME)"),
            st.tuples(e("date", sub), e("date", sub)).map(
                _fmt("(CAST({} AS TIMESTAMP) - CAST({} AS TIMESTAMP))")
            ),
            e("date", sub).map(lambda x: f"CAST({x} AS TIMESTAMP)"),
        )


FULL = Grammar()
PUBLIC = Grammar(tuple((n, COLUMNS[n]) for n in PUBLIC_COLUMNS))
STRICT = Grammar(strict=True)
PUBLIC_STRICT = Grammar(PUBLIC.columns, strict=True)
#: Columns a key may use (grouping by the privacy unit is refused, rightly, every time).
KEYED = Grammar(tuple((n, t) for n, t in COLUMNS.items() if n != "patient_id"))
KEYED_STRICT = Grammar(KEYED.columns, strict=True)


# -- query shapes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One generated statement; ``keys`` leading result columns are its GROUP BY keys.

    ``grouped``: it has a GROUP BY (its keys may be left out of the select list).
    ``total_key``: the statement has no WHERE and its one key is a CASE over conditions that
    cannot fail, with constant branches and an ELSE, so every row lands in a declared bin.
    ``rows_vary``: its row count is itself a noisy release (a rule list's length).
    """

    sql: str
    keys: int = 0
    grouped: bool = False
    total_key: bool = False
    rows_vary: bool = False
    #: statements run first on the same connection (``SET epsilon = 1e-12``)
    setup: tuple[str, ...] = ()


AGGREGATES = (
    "COUNT(*)",
    "SUM(cost)",
    "AVG(cost)",
    "SUM(age)",
    "AVG(age)",
    "COUNT(cost)",
    "COUNT(diagnosis)",
    "VARIANCE(age)",
    "STDDEV(cost)",
    "COUNT(DISTINCT patient_id)",
)
#: Conditions a hostile analyst adds to single out the extra unit of D′ (or nobody in D).
PROBES = (
    f"patient_id = {EXTRA_UNIT}",
    f"patient_id >= {EXTRA_UNIT}",
    "age > 100",
    "age < 0",
    "cost > 1e300",
    "visit_date > DATE '9000-01-01'",
    "visit_date < DATE '1000-01-01'",
    "department = 'ONCOLOGY\u200b'",
    "diagnosis IS NULL",
    "smoker IS NULL",
)


TRUTH_TESTS = ("", " IS TRUE", " IS NOT TRUE", " IS FALSE", " IS NOT FALSE")


def conditions(depth: int = 3) -> Strategy[str]:
    """WHERE conditions: BOOLEAN expressions, values of any type used as truth values
    (``diagnosis``, ``LOWER(diagnosis) IS TRUE``), half of them behind a probe that only the
    extra unit passes."""
    typed = st.integers(1, depth).flatmap(lambda d: FULL.expr("bool", d))
    value = st.sampled_from(TYPES).flatmap(lambda t: FULL.expr(t, 1))
    loose = st.tuples(value, st.sampled_from(TRUTH_TESTS)).map(lambda p: f"{p[0]}{p[1]}")
    cond = st.one_of(typed, loose)
    probed = st.tuples(st.sampled_from(PROBES), cond).map(_fmt("{} AND {}"))
    return st.one_of(cond, probed)


def where_clause(typed_only: bool = False) -> Strategy[str]:
    """No WHERE, a well-typed one, or any condition (beside GROUP BY keys and aggregates)."""
    typed = st.integers(1, 2).flatmap(lambda d: STRICT.expr("bool", d))
    options = [st.just(""), typed.map(lambda c: f" WHERE {c}")]
    if not typed_only:
        options.append(conditions(2).map(lambda c: f" WHERE {c}"))
    return st.one_of(*options)


def aggregate_lists() -> Strategy[str]:
    return st.lists(st.sampled_from(AGGREGATES), min_size=1, max_size=2, unique=True).map(", ".join)


@st.composite
def where_queries(draw: st.DrawFn) -> Query:
    """``SELECT <aggregates> FROM visits WHERE <condition>``."""
    aggs = draw(aggregate_lists())
    return Query(f"SELECT {aggs} FROM {TABLE} WHERE {draw(conditions())}")


SAFE_CONDITIONS = (
    "age > 50",
    "age <= 17",
    "cost < 100",
    "cost >= 1000.5",
    "department = 'oncology'",
    "department IN ('cardiology', 'neurology')",
    "smoker",
    "NOT smoker",
    "visit_date < DATE '2025-01-01'",
    "diagnosis = 'J06'",
    "diagnosis LIKE 'Z%'",
)
#: Branch constants of one type family each; decimals that are not binary fractions included.
CASE_CONSTANTS = (
    ("0.1", "0.3", "2.7", "-0.25", "1.5"),
    ("0", "1", "2", "-7", "100"),
    ("'child'", "'adult'", "'é'", "''"),
    ("TRUE", "FALSE"),
    ("CAST('nan' AS DOUBLE)", "CAST('inf' AS DOUBLE)", "-0.0", "0.5", "1e308"),
)


@st.composite
def constant_case(draw: st.DrawFn) -> str:
    """A total CASE key: conditions that cannot fail, constant branches, an ELSE."""
    family = draw(st.sampled_from(CASE_CONSTANTS))
    n = draw(st.integers(1, 2))
    conds = draw(st.lists(st.sampled_from(SAFE_CONDITIONS), min_size=n, max_size=n))
    consts = draw(st.lists(st.sampled_from(family), min_size=n + 1, max_size=n + 1))
    whens = " ".join(f"WHEN {c} THEN {v}" for c, v in zip(conds, consts, strict=False))
    return f"CASE {whens} ELSE {consts[-1]} END"


#: Coarse numeric bins (few values, so thresholding releases some) and special doubles.
COARSE = (
    "FLOOR(age / 10)",
    "ROUND(cost, -3)",
    "CAST(YEAR(visit_date) AS DOUBLE)",
    "SQRT(age - 50)",
    "LN(age)",
)
SPECIAL_DOUBLES = (
    "CAST('nan' AS DOUBLE)",
    "CAST('inf' AS DOUBLE)",
    "-0.0",
    "0.1",
    "1e308",
    "NULL",
)


@st.composite
def coarse_case(draw: st.DrawFn) -> str:
    """``CASE WHEN <condition> THEN <special double> ELSE <coarse bin> END`` (NaN keys), over
    columns without a public domain mostly, so that the groups are thresholded."""
    private = st.sampled_from([c for c in SAFE_CONDITIONS if "diagnosis" in c or "date" in c])
    cond = draw(st.one_of(private, st.sampled_from(SAFE_CONDITIONS), FULL.expr("bool", 1)))
    then = draw(st.sampled_from(SPECIAL_DOUBLES + COARSE))
    other = draw(st.sampled_from(COARSE + SPECIAL_DOUBLES))
    return f"CASE WHEN {cond} THEN {then} ELSE {other} END"


#: Keys whose values no release should have to handle: a STRUCT with a NULL field in some
#: groups, dates pushed past 9999, lists, BLOB, UUID, TIME, INTERVAL, TIMESTAMP.
ODD_KEYS = (
    "({public}, NULLIF({text}, {literal}))",
    "({text}, {public})",
    "(visit_date + {days})",
    "(visit_date - {days})",
    "(DATE_TRUNC('year', visit_date) + INTERVAL {days} DAY)",
    "CAST('[' || {text} || ']' AS VARCHAR[])",
    "CAST({text} AS BLOB)",
    "TRY_CAST({text} AS UUID)",
    "CAST(CAST(visit_date AS TIMESTAMP) AS TIME)",
    "(CAST(visit_date AS TIMESTAMP) - CAST(DATE '2024-01-01' AS TIMESTAMP))",
    "CAST(visit_date AS TIMESTAMP)",
)


@st.composite
def odd_keys(draw: st.DrawFn) -> str:
    """One of ODD_KEYS over columns (mostly bare, so that the extra unit's NULL row and its
    dates at the ends of the calendar reach the key) or small text expressions."""
    template = draw(st.sampled_from(ODD_KEYS))
    columns = st.sampled_from(("diagnosis", "department"))
    return template.format(
        public=draw(st.sampled_from(PUBLIC_COLUMNS)),
        text=draw(st.one_of(columns, KEYED.expr("text", 1))),
        literal=draw(st.one_of(st.sampled_from(("'J06'", "'oncology'")), text_literals())),
        days=draw(st.sampled_from(("1", "365", "-1", "3000000"))),
    )


PUBLIC_KEYS = (
    "department",
    "smoker",
    "age",
    "FLOOR(age / 10) * 10",
    "age // 10",
    "LOWER(department)",
    "UPPER(SUBSTRING(department, 1, 3))",
    "CASE WHEN age < 18 THEN 'child' ELSE 'adult' END",
)


def _mentions_column(sql: str) -> bool:
    return any(name in sql for name in COLUMNS)


def group_keys() -> Strategy[str]:
    """Public keys, functions of public columns, arbitrary expressions, odd-typed keys."""
    return st.one_of(
        st.sampled_from(PUBLIC_KEYS),
        constant_case(),
        coarse_case(),
        odd_keys(),
        st.sampled_from(TYPES).flatmap(lambda t: PUBLIC_STRICT.expr(t, 2)).filter(_mentions_column),
        st.sampled_from(TYPES).flatmap(lambda t: PUBLIC.expr(t, 2)).filter(_mentions_column),
        st.sampled_from(TYPES).flatmap(lambda t: KEYED_STRICT.expr(t, 2)).filter(_mentions_column),
        st.sampled_from(TYPES).flatmap(lambda t: KEYED.expr(t, 2)).filter(_mentions_column),
        KEYED.other(1).filter(_mentions_column),
    )


def typed_keys() -> Strategy[str]:
    """Well-typed keys a typed binder should answer: public ones and typed expressions."""
    return st.one_of(
        st.sampled_from(PUBLIC_KEYS),
        st.sampled_from(TYPES).flatmap(lambda t: PUBLIC_STRICT.expr(t, 2)).filter(_mentions_column),
        st.sampled_from(TYPES).flatmap(lambda t: KEYED_STRICT.expr(t, 2)).filter(_mentions_column),
    )


def special_keys() -> Strategy[str]:
    """Keys aimed at the release: odd types and values, NaN bins."""
    return st.one_of(odd_keys(), coarse_case())


def _is_row(sql: str) -> bool:
    """Whether a key is a row ``(a, b)``: the binder takes those in GROUP BY only."""
    try:
        return isinstance(sqlglot.parse_one(sql, read="duckdb"), exp.Tuple)
    except sqlglot.errors.SqlglotError:
        return False


@st.composite
def key_queries(
    draw: st.DrawFn, keys_of: Callable[[], Strategy[str]] = group_keys, typed_only: bool = False
) -> Query:
    """``SELECT [keys,] <aggregates> FROM visits [WHERE ...] GROUP BY <ordinals | keys>``."""
    keys = draw(st.lists(keys_of(), min_size=1, max_size=2))
    where = draw(where_clause(typed_only))
    aggs = draw(aggregate_lists())
    form = draw(st.sampled_from(("ordinal", "expression", "hidden")))
    if any(_is_row(k) for k in keys):
        form = "hidden"
    items = ", ".join(f"{k} AS k{i}" for i, k in enumerate(keys))
    if form == "hidden":  # GROUP BY keys that are not selected
        sql = f"SELECT {aggs} FROM {TABLE}{where} GROUP BY {', '.join(keys)}"
        return Query(sql, grouped=True)
    if form == "ordinal":
        group = ", ".join(str(i + 1) for i in range(len(keys)))
    else:
        group = ", ".join(keys)
    sql = f"SELECT {items}, {aggs} FROM {TABLE}{where} GROUP BY {group}"
    return Query(sql, keys=len(keys), grouped=True)


@st.composite
def total_key_queries(draw: st.DrawFn) -> Query:
    """``SELECT <constant CASE> AS k0, COUNT(*) FROM visits GROUP BY 1``: every row in a bin."""
    key = draw(constant_case())
    sql = f"SELECT {key} AS k0, COUNT(*) AS n FROM {TABLE} GROUP BY 1"
    return Query(sql, keys=1, grouped=True, total_key=True)


AGG_FUNCTIONS = (
    "COUNT",
    "SUM",
    "AVG",
    "VARIANCE",
    "VAR_POP",
    "STDDEV",
    "STDDEV_POP",
    "MIN",
    "MAX",
    "MEDIAN",
)

QUANTILE_LEVELS = (
    "0",
    "0.1",
    "0.5",
    "0.9",
    "1",
    "1.5",
    "-0.2",
    "1e-20",  # more significant digits than the release's integer arithmetic holds
    "0.123456789012345678901234567",
)
#: Session epsilons down to the smallest a SET accepts: mechanisms that cannot draw at such a
#: scale must refuse before the reserve, never fail after it.
TINY_EPSILONS = ("1e-12", "2.3e-10", "1e-9")


@st.composite
def quantile_queries(draw: st.DrawFn) -> Query:
    """Quantiles (every spelling, levels in and out of [0, 1]), MIN/MAX and COUNT(DISTINCT
    col), with or without a GROUP BY (public or thresholded keys) and a WHERE."""
    arg = draw(
        st.one_of(
            st.sampled_from(list(COLUMNS)),
            st.sampled_from(("int", "float")).flatmap(lambda t: FULL.expr(t, 1)),
        )
    )
    level = draw(st.sampled_from(QUANTILE_LEVELS))
    desc = draw(st.sampled_from(("", " DESC")))
    calls = st.sampled_from(
        (
            f"MEDIAN({arg})",
            f"MIN({arg})",
            f"MAX({arg})",
            f"PERCENTILE_CONT({level}) WITHIN GROUP (ORDER BY {arg}{desc})",
            f"PERCENTILE_DISC({level}) WITHIN GROUP (ORDER BY {arg}{desc})",
            f"QUANTILE_CONT({arg}, {level})",
            f"COUNT(DISTINCT {arg})",
            "COUNT(*)",
            "AVG(cost)",
        )
    )
    items = ", ".join(draw(st.lists(calls, min_size=1, max_size=3)))
    where = draw(where_clause())
    key = draw(st.sampled_from(("", "department", "diagnosis", "smoker")))
    tiny = draw(st.sampled_from((None, None, None, *TINY_EPSILONS)))
    setup = (f"SET epsilon = {tiny}",) if tiny else ()
    if not key:
        return Query(f"SELECT {items} FROM {TABLE}{where}", setup=setup)
    return Query(
        f"SELECT {key}, {items} FROM {TABLE}{where} GROUP BY {key}",
        keys=1,
        grouped=True,
        setup=setup,
    )


def aggregate_queries() -> Strategy[Query]:
    """Aggregates over bounded columns, and over any column or expression (mostly refused)."""
    arg = st.one_of(
        st.sampled_from(list(COLUMNS)),
        st.sampled_from(list(COLUMNS)).map(lambda c: f"DISTINCT {c}"),
        st.sampled_from(("int", "float")).flatmap(lambda t: FULL.expr(t, 1)),
    )
    call = st.tuples(st.sampled_from(AGG_FUNCTIONS), arg).map(_fmt("{}({})"))
    items = st.one_of(aggregate_lists(), call)
    return st.tuples(items, where_clause()).map(
        lambda p: Query(f"SELECT {p[0]} FROM {TABLE}{p[1]}")
    )


def _mistyped_values() -> Strategy[str]:
    return st.one_of(
        st.sampled_from(INT_LITERALS[:9]),
        st.sampled_from(("1.0", "0.5", "1.5", "1e308", "1e-308", "-1.0")),
        st.sampled_from(("TRUE", "FALSE")),
        st.sampled_from(("oncology", "J06", "2024-01-01", "x", "")).map(quote),
        text_literals(),
    )


#: Rule-list labels and a positive class of the right type for each (None: a bool label).
LABELS: dict[str, str | None] = {
    "smoker": None,
    "readmitted": None,
    "department": "'oncology'",
    "diagnosis": "'J06'",
    "age": "30",
    "cost": "100.5",
    "visit_date": "DATE '2024-01-01'",
}
#: Arguments with a well-typed value, each of which the generator may replace by any literal.
RULE_LIST_DEFAULTS: dict[str, tuple[str, ...]] = {
    "epsilon": ("1.0", "0.5", "1e-8", "1e-12"),
    "max_length": ("2", "3"),
    "features": ("'age, department'", "'smoker, department'", "'diagnosis'", "'nope'"),
    "delta": ("1e-6",),
    "min_support": ("0.05",),
    "max_card": ("1", "2"),
    "mechanism": ("'monotone_em'", "'smooth_laplace'", "'none'"),
}


@st.composite
def rule_list_queries(draw: st.DrawFn) -> Query:
    """``SELECT * FROM dp_rule_list('visits', label => ..., positive => ..., ...)``: a valid
    call with some arguments given values of the wrong type."""
    mistyped = _mistyped_values()
    label = draw(st.sampled_from(list(LABELS)))
    args: dict[str, str] = {"label": quote(label)}
    if LABELS[label] is not None or draw(st.booleans()):
        args["positive"] = draw(st.one_of(st.just(LABELS[label] or "TRUE"), mistyped))
    args["mechanism"] = "'monotone_em'"
    args["max_length"] = "2"
    for name in draw(st.lists(st.sampled_from(sorted(RULE_LIST_DEFAULTS)), max_size=2)):
        args[name] = draw(st.one_of(st.sampled_from(RULE_LIST_DEFAULTS[name]), mistyped))
    if draw(st.integers(0, 9)) == 0:
        args["label"] = draw(st.one_of(mistyped, st.just("'nope'")))
    if "DATE" in args.get("positive", ""):  # arguments are literals: keep the text form
        args["positive"] = args["positive"].replace("DATE ", "")
    text = ", ".join(f"{k} => {v}" for k, v in args.items())
    return Query(f"SELECT * FROM dp_rule_list('{TABLE}', {text})", rows_vary=True)


REGRESSION_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "epsilon": ("1.0", "0.1", "1e-8", "1e-12", "0", "-1", "'x'"),
    "method": ("'sufficient_stats'", "'dpsgd'", "'nope'"),
    "noise": ("'gaussian'", "'laplace'"),
    "steps": ("1", "3", "2.5", "0"),
    "sample_rate": ("0.1", "1", "1.5"),
    "ridge": ("0", "1.0", "1e308"),
    "clip": ("1.0", "1e-300", "0"),
}


@st.composite
def regression_queries(draw: st.DrawFn) -> Query:
    """``dp_linear_regression`` / ``dp_logistic_regression`` calls with arguments at the
    extremes (tiny and refused epsilons, DP-SGD, mistyped values): work after the charge is
    bounded by the text, and what the text decides is refused before it."""
    logistic = draw(st.booleans())
    if logistic:
        head = "dp_logistic_regression('visits', label => 'smoker'"
    else:
        head = "dp_linear_regression('visits', label => 'cost'"
    features = draw(st.sampled_from(("'age, smoker'", "'age, department'", "'smoker'", "'nope'")))
    args = {"features": features}
    for name in draw(st.lists(st.sampled_from(sorted(REGRESSION_ARGUMENTS)), max_size=3)):
        args[name] = draw(st.sampled_from(REGRESSION_ARGUMENTS[name]))
    if args.get("method") == "'dpsgd'":
        args["steps"] = draw(st.sampled_from(("1", "3")))  # keep the fuzz test quick
    text = "".join(f", {k} => {v}" for k, v in args.items())
    return Query(f"SELECT * FROM {head}{text})")


def comments() -> Strategy[str]:
    return st.one_of(st.sampled_from(COMMENT_TEXTS), st.text(max_size=4))


@st.composite
def commented(draw: st.DrawFn, queries: Strategy[Query]) -> Query:
    """``queries`` with block or line comments at the start, after FROM, or at the end."""
    query = draw(queries)
    sql = query.sql
    where = draw(st.sampled_from(("start", "from", "end", "line")))
    body = draw(comments()).replace("*/", "* /")
    if where == "start":
        sql = f"/* {body} */ {sql}"
    elif where == "from":
        sql = sql.replace(f"FROM {TABLE}", f"FROM {TABLE} /* {body} */", 1)
    elif where == "end":
        sql = f"{sql} -- {body}".replace("\n", " ")
    else:
        sql = f"-- {body.replace(chr(10), ' ')}\n{sql}"
    return Query(sql, query.keys, query.grouped, query.total_key, query.rows_vary)


def simple_queries() -> Strategy[Query]:
    """Small statements to carry comments: each shape, shallow."""
    return st.one_of(
        st.just(Query(f"SELECT COUNT(*) FROM {TABLE}")),
        st.just(Query(f"SELECT department AS k0, COUNT(*) FROM {TABLE} GROUP BY 1", 1, True)),
        st.just(Query(f"SELECT diagnosis AS k0, SUM(cost) FROM {TABLE} GROUP BY 1", 1, True)),
        conditions(1).map(lambda c: Query(f"SELECT AVG(age) FROM {TABLE} WHERE {c}")),
        st.just(
            Query(
                f"SELECT * FROM dp_rule_list('{TABLE}', label => 'smoker', "
                "mechanism => 'monotone_em', max_length => 2)",
                rows_vary=True,
            )
        ),
    )


# -- the relational frontend (issue 11): derived tables, CTEs, wrappers, expressions ----------
#
# A row-level relation is a chain of layers over visits, each a derived table or a CTE whose
# columns are passed through, renamed or computed; the outer query (keys, WHERE, aggregates)
# is drawn over the last layer's columns. A DP aggregate query may be wrapped by an outer
# query that reads its released columns (post-processing). Every name a layer introduces
# comes from a small fixed pool, so the cached per-column grammars stay few.

#: Computed columns: (template, type); {int} {float} {text} {bool} {date} name a column of
#: that type in the layer below. Some fail on some rows (CAST of text), some are unbounded.
COMPUTED: tuple[tuple[str, str], ...] = (
    ("{int} * 2", "int"),
    ("{int} + 1", "int"),
    ("-{int}", "int"),
    ("{int} // 10", "int"),
    ("CASE WHEN {int} > 50 THEN 1 ELSE 0 END", "int"),
    ("CASE WHEN {bool} THEN 1 ELSE 0 END", "int"),
    ("CASE WHEN {int} < 18 THEN 'child' ELSE 'adult' END", "text"),
    ("CASE WHEN {bool} THEN 'y' ELSE 'n' END", "text"),
    ("CASE WHEN {text} = 'J06' THEN {int} END", "int"),
    ("LEAST(GREATEST({float}, 10), 1000)", "float"),
    ("{float} / 2", "float"),
    ("{int} * {float}", "float"),
    ("COALESCE({float}, 0)", "float"),
    ("CAST({text} AS INT)", "int"),
    ("TRY_CAST({text} AS DOUBLE)", "float"),
    ("LOWER({text})", "text"),
    ("UPPER(SUBSTRING({text}, 1, 3))", "text"),
    ("{text} || '!'", "text"),
    ("YEAR({date})", "int"),
    ("{date} + 1", "date"),
    ("NOT {bool}", "bool"),
    ("{int} > 40", "bool"),
)
#: Names a layer may give its columns, per type (renames and computed columns).
NAME_POOL: dict[str, tuple[str, ...]] = {
    "int": ("a2", "n", "years"),
    "float": ("amount", "x"),
    "text": ("c", "d", "dept"),
    "date": ("day",),
    "bool": ("flag",),
}
LAYER_NAMES = ("q1", "q2", "q3")


@dataclass(frozen=True)
class Relation:
    """A row-level relation over visits: its FROM text, its columns (name, type) in order,
    and the CTE definitions it needs (``name AS (SELECT ...)``, in order)."""

    source: str
    columns: tuple[tuple[str, str], ...]
    ctes: tuple[str, ...] = ()

    def names(self, t: str) -> list[str]:
        return [n for n, ct in self.columns if ct == t]

    def with_clause(self) -> str:
        return f"WITH {', '.join(self.ctes)} " if self.ctes else ""


BASE = Relation(TABLE, tuple(COLUMNS.items()))


@st.composite
def computed_column(draw: st.DrawFn, below: Relation) -> tuple[str, str] | None:
    """One COMPUTED template filled with columns of ``below`` (None if it lacks a type)."""
    template, t = draw(st.sampled_from(COMPUTED))
    fills: dict[str, str] = {}
    for kind in TYPES:
        if "{" + kind + "}" in template:
            names = below.names(kind)
            if "patient_id" in names and len(names) > 1 and draw(st.integers(0, 7)):
                names.remove("patient_id")  # an expression of the unit: refused, now and then
            if not names:
                return None
            fills[kind] = draw(st.sampled_from(names))
    return template.format(**fills), t


@st.composite
def layer(draw: st.DrawFn, below: Relation, name: str, as_cte: bool) -> Relation:
    """``SELECT <kept, renamed and computed columns> FROM below [WHERE ...]`` as a derived
    table or CTE called ``name``. The privacy unit is kept (probes need it) most of the time."""
    items: list[str] = []
    columns: dict[str, str] = {}
    if below is BASE and draw(st.integers(0, 4)) == 0:
        items.append("*")
        columns.update(below.columns)
    else:
        for col, t in below.columns:
            if draw(st.integers(0, 3)) == 0 and col != "patient_id":
                continue  # dropped
            new = col
            if draw(st.integers(0, 4)) == 0:
                new = draw(st.sampled_from(NAME_POOL[t]))
            if new in columns:
                new = col
            if new in columns:
                continue
            items.append(col if new == col else f"{col} AS {new}")
            columns[new] = t
    for _ in range(draw(st.integers(0, 3))):
        made = draw(computed_column(below))
        if made is None:
            continue
        text, t = made
        free = [n for n in NAME_POOL[t] if n not in columns]
        if not free:
            continue
        columns[free[0]] = t
        items.append(f"{text} AS {free[0]}")
    if not items:
        items, columns = [below.columns[0][0]], dict(below.columns[:1])
    where = ""
    choice = draw(st.integers(0, 5))
    below_grammar = Grammar(below.columns, strict=True)
    if choice == 0:
        where = f" WHERE {draw(below_grammar.expr('bool', 1))}"
    elif choice == 1 and "patient_id" in dict(below.columns):
        where = f" WHERE {draw(st.sampled_from(PROBES[:2]))}"
    elif choice == 2:
        where = f" WHERE {draw(Grammar(below.columns).expr('bool', 1))}"  # any condition
    body = f"SELECT {', '.join(items)} FROM {below.source}{where}"
    if as_cte:
        return Relation(name, tuple(columns.items()), (*below.ctes, f"{name} AS ({body})"))
    return Relation(f"({body}) AS {name}", tuple(columns.items()), below.ctes)


@st.composite
def relations(draw: st.DrawFn, ctes: bool | None = None, max_depth: int = 3) -> Relation:
    """A chain of 1..max_depth layers over visits; ``ctes``: all CTEs (True), all derived
    tables (False) or a mix (None). A CTE is never defined inside a derived table."""
    relation = BASE
    depth = draw(st.sampled_from(range(max_depth, 0, -1)))  # deepest first
    cte_phase = True
    for i in range(depth):
        if ctes is None:
            as_cte = cte_phase and draw(st.booleans())
            cte_phase = as_cte
        else:
            as_cte = ctes
        relation = draw(layer(relation, LAYER_NAMES[i], as_cte))
    return relation


def _aggregates_over(relation: Relation) -> list[Strategy[str]]:
    """Aggregate calls over the relation's columns, expressions inside aggregates included
    (the most telling first: a draw shrinks toward the start of the list)."""
    names = dict(relation.columns)
    numeric = [n for n, t in relation.columns if t in ("int", "float") and n != "patient_id"]
    texts, bools = relation.names("text"), relation.names("bool")
    grammar = Grammar(relation.columns, strict=True)
    out: list[Strategy[str]] = []
    if numeric:
        num = st.sampled_from(numeric)
        out += [
            st.tuples(st.sampled_from(("AVG", "SUM")), num, st.sampled_from(("0", "10", "50"))).map(
                lambda p: f"{p[0]}(LEAST(GREATEST({p[1]}, {p[2]}), 100))"
            ),
            st.tuples(num, num).map(_fmt("SUM({} * {})")),
        ]
    if texts:  # fails on most rows: under the clamp it must not fail the query
        out.append(
            st.sampled_from(texts).map(lambda c: f"SUM(LEAST(GREATEST(CAST({c} AS INT), 0), 5))")
        )
    out += [
        st.just("SUM(1)"),
        st.sampled_from(("COUNT(1)", "SUM(CAST(1 AS BIGINT))", "COUNT(*)")),
        grammar.expr("bool", 1).map(lambda c: f"SUM(CASE WHEN {c} THEN 1 ELSE 0 END)"),
        grammar.expr("bool", 1).map(lambda c: f"COUNT(*) FILTER (WHERE {c})"),
        st.sampled_from(list(names)).map(lambda c: f"COUNT({c})"),
    ]
    if bools:
        out.append(st.sampled_from(bools).map(lambda c: f"SUM(CASE WHEN {c} THEN 1 ELSE 0 END)"))
    if "patient_id" in names:
        out.append(st.just("COUNT(DISTINCT patient_id)"))
    if numeric:
        out += [
            st.tuples(st.sampled_from(("SUM", "AVG", "VARIANCE", "STDDEV")), num).map(
                _fmt("{}({})")
            ),
            st.tuples(num, grammar.expr("bool", 1)).map(
                lambda p: f"SUM({p[0]}) FILTER (WHERE {p[1]})"
            ),
            st.sampled_from(("int", "float"))
            .flatmap(lambda t: grammar.expr(t, 1))
            .map(lambda e: f"SUM(LEAST(GREATEST({e}, -5), 5))"),
        ]
    return out


def aggregate_items(relation: Relation) -> Strategy[str]:
    """One or two aggregates, each from a uniformly drawn kind, aliased v0, v1."""
    kinds = _aggregates_over(relation)
    one = st.sampled_from(range(len(kinds))).flatmap(lambda i: kinds[i])
    return st.lists(one, min_size=1, max_size=2).map(
        lambda xs: ", ".join(f"{x} AS v{i}" for i, x in enumerate(xs))
    )


@st.composite
def queries_over(draw: st.DrawFn, relation: Relation) -> Query:
    """``[WITH ...] SELECT [keys,] <aggregates> FROM relation [WHERE] [GROUP BY]``."""
    grammar = Grammar(relation.columns, strict=True)
    keyable = [n for n, t in relation.columns if n != "patient_id" and t != "float"]
    keys: list[str] = []
    if keyable:
        key = st.one_of(
            st.sampled_from(keyable),
            st.sampled_from(("int", "text", "bool"))
            .flatmap(lambda t: grammar.expr(t, 1))
            .filter(lambda k: any(n in k for n in keyable)),
        )
        keys = draw(st.lists(key, max_size=2))
    where = draw(
        st.one_of(
            st.just(""),
            grammar.expr("bool", 1).map(lambda c: f" WHERE {c}"),
            st.just(f" WHERE {PROBES[0]}")
            if "patient_id" in dict(relation.columns)
            else st.just(""),
        )
    )
    aggs = draw(aggregate_items(relation))
    head = relation.with_clause()
    if not keys:
        return Query(f"{head}SELECT {aggs} FROM {relation.source}{where}")
    items = ", ".join(f"{k} AS k{i}" for i, k in enumerate(keys))
    group = ", ".join(str(i + 1) for i in range(len(keys)))
    sql = f"{head}SELECT {items}, {aggs} FROM {relation.source}{where} GROUP BY {group}"
    return Query(sql, keys=len(keys), grouped=True)


def derived_table_queries() -> Strategy[Query]:
    """Aggregates over derived tables nested 1-3 deep (renamed and computed columns)."""
    return relations(ctes=False).flatmap(queries_over)


def cte_queries() -> Strategy[Query]:
    """Aggregates over several chained CTEs, or CTEs under derived tables."""
    return st.one_of(relations(ctes=True), relations(ctes=None)).flatmap(queries_over)


def expression_aggregate_queries() -> Strategy[Query]:
    """Expressions inside aggregates over visits itself, probes and GROUP BY included."""
    return st.one_of(
        queries_over(BASE),
        st.tuples(aggregate_items(BASE), st.sampled_from(PROBES)).map(
            lambda p: Query(f"SELECT {p[0]} FROM {TABLE} WHERE {p[1]}")
        ),
    )


#: GROUP BY keys and literal lists that restrict their released keys (a public key set).
KEY_LISTS: dict[str, tuple[str, ...]] = {
    "department": ("'oncology'", "'cardiology'", "'ONCOLOGY\u200b'", "'nope'", "''"),
    "diagnosis": ("'J06'", "'E11'", "'q999\u2603\u202e'", "'true'", "'x'", "NULL"),
    "age": ("0", "30", "100", "101", "-1", str(EXTRA_UNIT)),
    "smoker": ("TRUE", "FALSE"),
}


@st.composite
def key_restriction_queries(draw: st.DrawFn) -> Query:
    """``WHERE key IN (...)`` / ``= ...`` / ``BETWEEN`` restricting a GROUP BY key's bins,
    on public and non-public keys, bare or renamed in a derived table; the lists hold
    values only the extra unit has and values no row has."""
    column = draw(st.sampled_from(sorted(KEY_LISTS)))
    values = draw(st.lists(st.sampled_from(KEY_LISTS[column]), min_size=1, max_size=4))
    name = column
    source = TABLE
    if draw(st.booleans()):
        name = "k"
        source = f"(SELECT {column} AS k, patient_id, age AS years, cost FROM {TABLE}) AS q1"
    form = draw(st.sampled_from(("in", "in", "eq", "between")))
    if form == "eq":
        cond = f"{name} = {values[0]}"
    elif form == "between" and column == "age":
        low, high = sorted(
            draw(st.lists(st.sampled_from(("0", "30", "33", "100")), min_size=2, max_size=2)),
            key=int,
        )
        cond = f"{name} BETWEEN {low} AND {high}"
    else:
        cond = f"{name} IN ({', '.join(values)})"
    extra = draw(st.sampled_from(("", " AND cost > 100", f" AND patient_id = {EXTRA_UNIT}")))
    aggs = draw(
        st.lists(
            st.sampled_from(("COUNT(*)", "SUM(cost)", "COUNT(DISTINCT patient_id)", "SUM(1)")),
            min_size=1,
            max_size=2,
            unique=True,
        )
    )
    sql = f"SELECT {name}, {', '.join(aggs)} FROM {source} WHERE {cond}{extra} GROUP BY {name}"
    return Query(sql, keys=1, grouped=True)


DISTINCT_ITEMS = (
    "department",
    "smoker",
    "age",
    "diagnosis",
    "visit_date",
    "department, smoker",
    "readmitted, department",
)


@st.composite
def distinct_queries(draw: st.DrawFn) -> Query:
    """``SELECT DISTINCT cols FROM visits|derived [WHERE ...]``: a key set (free when public)."""
    items = draw(st.sampled_from(DISTINCT_ITEMS))
    where = draw(
        st.sampled_from(
            (
                "",
                " WHERE age > 50",
                f" WHERE patient_id = {EXTRA_UNIT}",
                " WHERE diagnosis IN ('J06', 'q999\u2603\u202e')",
                " WHERE department IN ('oncology', 'nope')",
            )
        )
    )
    source = TABLE
    if draw(st.booleans()):
        source = f"(SELECT * FROM {TABLE}) AS q1"
    sql = f"SELECT DISTINCT {items} FROM {source}{where}"
    return Query(sql, keys=items.count(",") + 1, grouped=True)


@st.composite
def wrapper_queries(draw: st.DrawFn) -> Query:
    """An outer query over a DP aggregate subquery (post-processing of its released rows):
    ``SELECT *``, column picks, WHERE on released columns, SUM over the released rows."""
    relation = draw(st.one_of(st.just(BASE), relations(max_depth=2)))
    inner = draw(queries_over(relation))
    # The CTEs the inner query reads stay in front of the outer query.
    head = relation.with_clause()
    inner_sql = inner.sql[len(head) :]
    n_aggs = inner_sql.count(" AS v")
    keys = inner.keys
    key_names = [f"k{i}" for i in range(keys)]
    value = draw(st.sampled_from([f"v{i}" for i in range(max(n_aggs, 1))]))
    form = draw(st.sampled_from(("star", "pick", "where_value", "where_key", "sum", "order")))
    s = f"({inner_sql}) AS s"
    if form == "star":
        return Query(f"{head}SELECT * FROM {s}", keys, inner.grouped)
    if form == "pick":
        cols = ", ".join([*key_names, value])
        return Query(f"{head}SELECT {cols}, {value} * 2 AS twice FROM {s}", keys, inner.grouped)
    if form == "where_value":
        threshold = draw(st.sampled_from(("0", "10", "1000", "-1e308")))
        return Query(
            f"{head}SELECT * FROM {s} WHERE {value} > {threshold}", 0, inner.grouped, rows_vary=True
        )
    if form == "where_key" and keys:
        return Query(f"{head}SELECT * FROM {s} WHERE k0 IS NOT NULL", keys, inner.grouped)
    if form == "order":
        return Query(
            f"{head}SELECT * FROM {s} ORDER BY {value} DESC LIMIT 3",
            0,
            inner.grouped,
            rows_vary=True,
        )
    return Query(f"{head}SELECT SUM({value}) AS total, COUNT(*) AS released FROM {s}")


#: Keys a series limit ranks, and the measure it ranks them by.
SERIES_KEYS = ("department", "diagnosis", "age", "smoker", "FLOOR(age / 10) * 10")
SERIES_MEASURES = ("COUNT(*)", "SUM(cost)", "COUNT(DISTINCT patient_id)", "AVG(age)", "SUM(1)")


@st.composite
def series_limit_queries(draw: st.DrawFn) -> Query:
    """A DP subquery whose released values filter the outer DP query (Superset's series
    limit): ``JOIN (SELECT key AS d__, agg AS m ... ORDER BY m DESC LIMIT n) ON key = d__``
    or ``WHERE key IN (SELECT key ... LIMIT n)``. Which keys come out is a release of the
    subquery, so only the outcome, the messages, the types and the charge must agree."""
    key = draw(st.sampled_from(SERIES_KEYS))
    measure = draw(st.sampled_from(SERIES_MEASURES))
    limit = draw(st.sampled_from(("1", "3", "5", "100")))
    inner_where = draw(st.sampled_from(("", f" WHERE {PROBES[0]}", " WHERE age > 50")))
    order = draw(st.sampled_from((" ORDER BY m DESC", " ORDER BY m", "")))
    inner = (
        f"SELECT {key} AS d__, {measure} AS m FROM {TABLE}{inner_where} GROUP BY {key}"
        f"{order} LIMIT {limit}"
    )
    aggs = draw(aggregate_lists())
    outer_where = draw(st.sampled_from(("", f" WHERE {PROBES[1]}", " WHERE smoker")))
    if draw(st.booleans()):
        join = draw(st.sampled_from(("JOIN", "INNER JOIN")))
        on = draw(st.sampled_from((f"{key} = d__", f"d__ = {key}", f"{key} = series_limit.d__")))
        sql = (
            f"SELECT {key} AS k0, {aggs} FROM {TABLE} {join} ({inner}) AS series_limit "
            f"ON {on}{outer_where} GROUP BY {key}"
        )
    else:
        one = inner.replace(f", {measure} AS m", "").replace(" ORDER BY m", f" ORDER BY {measure}")
        glue = " AND " if outer_where else " WHERE "
        sql = (
            f"SELECT {key} AS k0, {aggs} FROM {TABLE}{outer_where}{glue}{key} IN ({one}) "
            f"GROUP BY {key}"
        )
    return Query(sql, grouped=True, rows_vary=True)


#: Windows over a DP query's released aggregates (``{a}``: the aggregate, ``{k}``: the key).
POST_WINDOWS = (
    "SUM({a}) OVER (ORDER BY {k})",
    "{a} * 100.0 / NULLIF(SUM({a}) OVER (), 0)",
    "RANK() OVER (ORDER BY {a} DESC)",
    "LAG({a}) OVER (ORDER BY {k})",
    "ROW_NUMBER() OVER (ORDER BY {k})",
    "NTILE(2) OVER (ORDER BY {a})",
    "AVG({a}) OVER (ORDER BY {k} ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)",
)
SET_OPERATIONS = ("UNION ALL", "UNION", "INTERSECT", "EXCEPT")


@st.composite
def released_queries(draw: st.DrawFn) -> Query:
    """Relational post-processing over released tables (issue 27, item 2): a window over a DP
    query's aggregates, a set operation of two DP queries (or one and a constant row), a join
    of two released CTEs, a scalar subquery over one, a CTE ranking another; and what stays
    refused (a window or a set operation over private rows). Which rows come out depends on
    the released values, so only the outcome, the messages, the types and the charge (all the
    measurements, in one reservation) must agree."""
    key = draw(st.sampled_from(SERIES_KEYS))
    a, b = draw(st.lists(st.sampled_from(SERIES_MEASURES), min_size=2, max_size=2))
    wheres = ("", f" WHERE {PROBES[0]}", " WHERE age > 50", f" WHERE {PROBES[2]}")
    w1, w2 = draw(st.lists(st.sampled_from(wheres), min_size=2, max_size=2))
    first = f"SELECT {key} AS k0, {a} AS v FROM {TABLE}{w1} GROUP BY {key}"
    second = f"SELECT {key} AS k0, {b} AS v FROM {TABLE}{w2} GROUP BY {key}"
    form = draw(
        st.sampled_from(
            ("window", "setop", "total", "join", "scalar", "dp_scalar", "rank", "refused")
        )
    )
    if form == "window":
        window = draw(st.sampled_from(POST_WINDOWS)).format(a=a, k=key)
        sql = f"SELECT {key} AS k0, {a} AS v, {window} AS w FROM {TABLE}{w1} GROUP BY {key}"
    elif form == "setop":
        sql = f"{first} {draw(st.sampled_from(SET_OPERATIONS))} {second}"
    elif form == "total":
        sql = f"{first} UNION ALL SELECT NULL, {b} FROM {TABLE}{w2}"
    elif form == "join":
        side = draw(st.sampled_from(("JOIN", "LEFT JOIN")))
        sql = (
            f"WITH a AS ({first}), b AS ({second}) SELECT a.k0, a.v, b.v AS w FROM a {side} b "
            "ON a.k0 = b.k0"
        )
    elif form == "scalar":
        sql = f"WITH a AS ({first}) SELECT k0, v, v - (SELECT AVG(v) FROM a) AS d FROM a"
    elif form == "dp_scalar":
        sql = (
            f"SELECT {key} AS k0, {a} AS v, {a} - (SELECT {b} FROM {TABLE}{w2}) AS d "
            f"FROM {TABLE}{w1} GROUP BY {key} HAVING {a} >= (SELECT {b} FROM {TABLE}) - 1e300"
        )
    elif form == "rank":
        sql = (
            f"WITH a AS ({first}), r AS (SELECT k0, v, RANK() OVER (ORDER BY v DESC) AS rk "
            "FROM a) SELECT k0, v FROM r WHERE rk <= 3"
        )
    else:
        column = draw(st.sampled_from(("cost", "age", "department", "patient_id")))
        sql = draw(
            st.sampled_from(
                (
                    f"SELECT {column}, COUNT({column}) OVER () FROM {TABLE}",
                    f"SELECT {column}, RANK() OVER (ORDER BY {column}) FROM {TABLE}{w1}",
                    f"SELECT {column} AS k0, 1 AS v FROM {TABLE} UNION ALL {first}",
                    f"WITH a AS ({first}) SELECT * FROM a JOIN {TABLE} t ON a.k0 = t.{column}",
                )
            )
        )
    return Query(sql, grouped=True, rows_vary=True)


#: Private tables joined with visits (tests/test_differential_fuzz.py writes them): ``people``,
#: one row per patient (primary_key patient_id), and ``labs``, whose unit is reached along
#: ``unit_path = ["patient_ref -> people.patient_id"]``.
PEOPLE_COLUMNS = {"patient_id": "int", "sex": "text", "score": "float", "region": "text"}
LABS_COLUMNS = {"lab_id": "int", "patient_ref": "int", "value": "float"}
#: a public table (the same on both datasets) with a text key and an integer key
REGIONS_COLUMNS = {"region": "text", "rid": "int", "label": "text", "beds": "int"}
#: (FROM clause, aggregates, keys with a public domain, thresholded keys, probes) per join;
#: the last ones are refused whatever the data.
JOIN_SOURCES = (
    (
        "visits v JOIN people p ON v.patient_id = p.patient_id",
        ("COUNT(*)", "SUM(v.cost)", "AVG(p.score)", "COUNT(DISTINCT v.patient_id)", "SUM(age)"),
        ("p.sex", "v.department", "smoker"),
        ("p.region", "diagnosis"),
        (
            f"p.patient_id = {EXTRA_UNIT}",
            "p.score > 1e300",
            "p.region = 'q999\u2603'",
            "p.region IN (SELECT region FROM regions WHERE beds > 15)",
        ),
    ),
    (
        "people p LEFT JOIN visits v ON v.patient_id = p.patient_id",
        ("COUNT(*)", "COUNT(v.cost)", "SUM(p.score)", "AVG(v.age)"),
        ("p.sex", "v.department"),
        ("p.region",),
        (f"p.patient_id = {EXTRA_UNIT}", "v.cost IS NULL", "p.sex NOT IN ('f', 'm')"),
    ),
    (
        "labs l JOIN people p ON l.patient_ref = p.patient_id",
        ("COUNT(*)", "SUM(l.value)", "AVG(p.score)", "COUNT(DISTINCT p.patient_id)"),
        ("p.sex",),
        ("p.region",),
        (f"l.patient_ref = {EXTRA_UNIT}", "l.value > 9", "l.value IS NULL"),
    ),
    (
        "labs",
        ("COUNT(*)", "SUM(value)", "AVG(value)", "VARIANCE(value)"),
        ("value > 5",),
        ("lab_id",),
        (f"patient_ref = {EXTRA_UNIT}", "value > 9", "lab_id > 100000"),
    ),
    (
        "visits v JOIN people p ON v.patient_id = p.patient_id JOIN labs l "
        "ON l.patient_ref = p.patient_id",
        ("COUNT(*)", "SUM(l.value)", "SUM(v.cost)"),
        ("p.sex",),
        (),
        (f"v.patient_id = {EXTRA_UNIT}",),
    ),
    (
        "people p JOIN regions r ON p.region = r.region",
        ("COUNT(*)", "SUM(p.score)", "AVG(r.beds)"),
        ("r.label", "p.sex"),
        ("p.region",),
        (
            f"p.patient_id = {EXTRA_UNIT}",
            "p.score > 1e300",
            "r.rid > 0",
            "p.region IN (SELECT region FROM regions WHERE rid < 2)",
        ),
    ),
    (
        "people p LEFT JOIN regions r ON p.score = r.rid",  # float and int: one family
        ("COUNT(*)", "COUNT(r.label)"),
        ("r.label",),
        (),
        (f"p.patient_id = {EXTRA_UNIT}", "p.sex = 'f'"),
    ),
    (
        "people p JOIN regions r USING (region)",
        ("COUNT(*)", "AVG(p.score)"),
        ("r.label",),
        (),
        (f"p.patient_id = {EXTRA_UNIT}",),
    ),
    (
        "people p",
        ("COUNT(*)", "SUM(p.score)"),
        ("p.sex",),
        (),
        (
            "p.region IN (SELECT region FROM regions WHERE rid > 0)",
            "p.region IN (SELECT rid FROM regions)",  # text IN (integers): never fails
            f"p.patient_id = {EXTRA_UNIT} AND p.region IN (SELECT rid FROM regions)",
        ),
    ),
    # Declared types that differ: a text column against an integer key (the predicate
    # oracle: the engine's cast fails on exactly the rows the WHERE lets reach the join).
    (
        "people p JOIN regions r ON p.region = r.rid",
        ("COUNT(*)",),
        ("r.label",),
        (),
        (f"p.patient_id = {EXTRA_UNIT}", f"p.patient_id <> {EXTRA_UNIT}"),
    ),
    (
        "people p LEFT JOIN regions r ON p.patient_id = r.region",
        ("COUNT(*)",),
        (),
        (),
        (f"p.patient_id = {EXTRA_UNIT}",),
    ),
    (
        "visits v JOIN regions r ON v.diagnosis = r.rid",
        ("COUNT(*)", "SUM(v.cost)"),
        ("v.department",),
        (),
        (f"v.patient_id = {EXTRA_UNIT}",),
    ),
    ("people p, regions r WHERE p.region = r.rid", ("COUNT(*)",), (), (), ()),
    (
        "people p WHERE p.region IN (SELECT region FROM regions WHERE beds > 15)",
        ("COUNT(*)", "AVG(p.score)"),
        ("p.sex",),
        ("p.region",),
        (f"p.patient_id = {EXTRA_UNIT}",),
    ),
    (
        "visits WHERE diagnosis IN (SELECT rid FROM regions)",  # text IN (integers)
        ("COUNT(*)", "SUM(cost)"),
        ("department",),
        (),
        (f"patient_id = {EXTRA_UNIT}",),
    ),
    ("visits v JOIN people p ON v.age = p.patient_id", ("COUNT(*)",), ("p.sex",), (), ()),
    ("visits v JOIN labs l ON v.patient_id = l.patient_ref", ("COUNT(*)",), (), (), ()),
    ("visits a JOIN visits b ON a.patient_id = b.patient_id", ("COUNT(*)",), (), (), ()),
    ("visits v CROSS JOIN people p", ("COUNT(*)",), ("p.sex",), (), ()),
    ("visits v RIGHT JOIN people p ON v.patient_id = p.patient_id", ("COUNT(*)",), (), (), ()),
)


@st.composite
def join_queries(draw: st.DrawFn) -> Query:
    """``SELECT [key,] <aggregates> FROM <private join> [WHERE probe] [GROUP BY key]``: joins
    on the unit, along a unit_path, and refused ones (off the unit, cross, RIGHT)."""
    source, aggs, public_keys, thresholded, probes = draw(st.sampled_from(JOIN_SOURCES))
    chosen = draw(st.lists(st.sampled_from(aggs), min_size=1, max_size=2, unique=True))
    joiner = " AND " if " WHERE " in source else " WHERE "
    where = draw(st.sampled_from(("", *(f"{joiner}{p}" for p in probes))))
    keys = draw(st.sampled_from(((), *((k,) for k in public_keys + thresholded))))
    if not keys:
        return Query(f"SELECT {', '.join(chosen)} FROM {source}{where}")
    sql = f"SELECT {keys[0]} AS k0, {', '.join(chosen)} FROM {source}{where} GROUP BY 1"
    return Query(sql, keys=1, grouped=True)


#: (CTE named like a policy table, the query over it): the CTE shadows the table in every
#: construct, so each must behave exactly as with the CTE renamed (SHADOWED -> RENAMED).
SHADOWED = "people"
RENAMED = "people_cte"
SHADOW_CTES = (
    f"people AS (SELECT * FROM people WHERE patient_id = {EXTRA_UNIT})",
    "people AS (SELECT * FROM people WHERE score > 1000)",
    "people AS (SELECT patient_id, sex FROM people WHERE sex = 'f')",
)
SHADOW_BODIES = (
    "SELECT COUNT(*) FROM people",
    "SELECT COUNT(*), SUM(v.cost) FROM visits v JOIN people p ON v.patient_id = p.patient_id",
    "SELECT p.sex AS k0, COUNT(*) FROM people p JOIN regions r ON p.region = r.region GROUP BY 1",
    "SELECT COUNT(*) FROM labs l JOIN people p ON l.patient_ref = p.patient_id",
    "SELECT COUNT(*) FROM visits WHERE patient_id IN (SELECT patient_id FROM people)",
    "SELECT COUNT(*) FROM people p WHERE p.region IN (SELECT region FROM regions)",
)


@st.composite
def cte_shadow_queries(draw: st.DrawFn) -> tuple[Query, Query]:
    """A query whose CTE is named like a policy table, and the same query with the CTE
    renamed: PostgreSQL's scoping makes them one query, so their outcomes must be equal."""
    cte = draw(st.sampled_from(SHADOW_CTES))
    body = draw(st.sampled_from(SHADOW_BODIES))
    if draw(st.booleans()):
        cte = cte.replace("people AS", "regions AS").replace("FROM people", "FROM regions")
        cte = cte.replace("patient_id", "rid").replace("score", "beds").replace("sex", "label")
        shadowed, renamed = "regions", "regions_cte"
    else:
        shadowed, renamed = SHADOWED, RENAMED
    sql = f"WITH {cte} {body}"
    keys = 1 if "GROUP BY" in body else 0
    head, rest = sql.split(" AS (", 1)
    defn, query = rest.split(") ", 1)
    renamed_sql = (
        head.replace(f"WITH {shadowed}", f"WITH {renamed}")
        + " AS ("
        + defn
        + ") "
        + re.sub(rf"\b(FROM|JOIN) {shadowed}\b", rf"\1 {renamed}", query)
    )
    return (
        Query(sql, keys=keys, grouped=bool(keys)),
        Query(renamed_sql, keys=keys, grouped=bool(keys)),
    )


def lone_surrogate(text: str) -> bool:
    """Whether ``text`` is not valid Unicode (holds an unpaired surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


__all__: Sequence[str] = (
    "EXTRA_UNIT",
    "Query",
    "aggregate_queries",
    "commented",
    "join_queries",
    "key_queries",
    "lone_surrogate",
    "rule_list_queries",
    "simple_queries",
    "total_key_queries",
    "where_queries",
)


# -- public time domains (visit_date's declared days; used by tests/test_time_domains.py) --------

TIME_KEYS = (
    "visit_date",
    "DATE_TRUNC('{grain}', visit_date)",
    "EXTRACT({part} FROM visit_date)",
    "date_part('{part}', visit_date)",
    "CAST(visit_date AS DATE)",
    "strftime(visit_date, '%Y-%m')",
    "DATE_TRUNC('week', visit_date + INTERVAL 1 DAY) - INTERVAL 1 DAY",
    "FLOOR(EXTRACT(epoch FROM visit_date) / 604800)",
)
TIME_WHERES = (
    "",
    " WHERE visit_date BETWEEN '2025-03-01' AND '2025-06-30'",
    " WHERE visit_date >= DATE '2025-12-15'",
    " WHERE visit_date < DATE '2024-01-03' OR visit_date > DATE '9000-01-01'",
    " WHERE EXTRACT(year FROM visit_date) = 2025 AND department = 'oncology'",
    f" WHERE patient_id = {EXTRA_UNIT}",
)


@st.composite
def time_key_queries(draw: st.DrawFn) -> Query:
    """``SELECT <time key>[, department], <aggregates> FROM visits [WHERE on the date]
    GROUP BY ...``: every key a public time domain over the declared days."""
    key = draw(st.sampled_from(TIME_KEYS)).format(
        grain=draw(st.sampled_from(("day", "week", "month", "quarter", "year"))),
        part=draw(st.sampled_from(("year", "quarter", "month", "day", "dow", "doy"))),
    )
    keys = [key, *draw(st.sampled_from(([], ["department"], ["smoker"])))]
    items = ", ".join(f"{k} AS k{i}" for i, k in enumerate(keys))
    group = ", ".join(str(i + 1) for i in range(len(keys)))
    where = draw(st.sampled_from(TIME_WHERES))
    sql = f"SELECT {items}, {draw(aggregate_lists())} FROM {TABLE}{where} GROUP BY {group}"
    return Query(sql, keys=len(keys), grouped=True)


#: Per-unit aggregates (dpsql.frontend.per_unit) and whether each is a number (else a date).
PER_UNIT_AGGREGATES: tuple[tuple[str, bool], ...] = (
    ("COUNT(*)", True),
    ("SUM(cost)", True),
    ("AVG(age)", True),
    ("MIN(age)", True),
    ("MAX(cost)", True),
    ("COUNT(DISTINCT diagnosis)", True),
    ("COUNT(cost)", True),
    ("LEAST(GREATEST(SUM(cost), 0), 1000)", True),
    ("MAX(age * 2 - 1)", True),
    ("SUM(CASE WHEN smoker THEN 1 ELSE 0 END)", True),
    ("MIN(DATE_TRUNC('month', visit_date))", False),
    ("MAX(visit_date)", False),
)
PER_UNIT_WHERES = (
    "",
    " WHERE age > 50",
    f" WHERE patient_id = {EXTRA_UNIT}",
    " WHERE cost IS NULL",
)
PER_UNIT_HAVINGS = ("", " HAVING COUNT(*) >= 2", " HAVING SUM(cost) > 1000")


@st.composite
def per_unit_queries(draw: st.DrawFn) -> Query:
    """An outer DP query over a per-unit relation (a derived table or CTE grouped by the
    privacy unit, optionally with an extra key): COUNT/AVG/COUNT(DISTINCT) over the per-unit
    values, bins of them (a public domain from their derived range), a month of a per-unit
    date, the extra key; and the privacy unit as an outer key (refused)."""
    agg, numeric = draw(st.sampled_from(PER_UNIT_AGGREGATES))
    extra = draw(st.sampled_from(("", "department", "smoker")))
    where = draw(st.sampled_from(PER_UNIT_WHERES))
    having = draw(st.sampled_from(PER_UNIT_HAVINGS))
    cols = ", ".join(["patient_id", *([extra] if extra else []), f"{agg} AS p"])
    group = ", ".join(["patient_id", *([extra] if extra else [])])
    inner = f"SELECT {cols} FROM {TABLE}{where} GROUP BY {group}{having}"
    as_cte = draw(st.booleans())
    head, source = (f"WITH u AS ({inner}) ", "u") if as_cte else ("", f"({inner}) AS u")
    forms = ["count", "distinct", "unit_key"]
    forms += ["avg", "bins"] if numeric else ["month"]
    forms += ["extra"] if extra else []
    form = draw(st.sampled_from(forms))
    if form == "count":
        return Query(f"{head}SELECT COUNT(*) AS n FROM {source}")
    if form == "distinct":
        return Query(f"{head}SELECT COUNT(DISTINCT p) AS d FROM {source}")
    if form == "unit_key":
        return Query(f"{head}SELECT patient_id AS k0, COUNT(*) FROM {source} GROUP BY 1", 1, True)
    if form == "avg":
        return Query(f"{head}SELECT AVG(p) AS a, SUM(p) AS s, COUNT(*) AS n FROM {source}")
    if form == "bins":
        return Query(
            f"{head}SELECT FLOOR(p / 100) * 100 AS k0, COUNT(*) AS n FROM {source} GROUP BY 1",
            1,
            True,
        )
    if form == "month":
        return Query(
            f"{head}SELECT DATE_TRUNC('month', p) AS k0, COUNT(*) AS n FROM {source} GROUP BY 1",
            1,
            True,
        )
    agg_outer = "AVG(p)" if numeric else "COUNT(p)"
    return Query(
        f"{head}SELECT {extra} AS k0, {agg_outer} AS a, COUNT(*) AS n FROM {source} GROUP BY 1",
        1,
        True,
    )
