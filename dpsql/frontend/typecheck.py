"""Every expression typed before it runs: boolean conditions, whitelisted group-key types.

The privacy boundary's first invariant (docs/threat_model.md): before the engine sees a query,
the type of every condition and every GROUP BY key is known from the policy's schema alone.
Types come from DuckDB's own binder run on *empty* copies of the policy's tables, so they are
exactly the types the engine will use, and a refusal depends on the query text and the policy
only (no row is involved, so it is free and the same on every dataset).

What is enforced, and why:

- **Conditions are BOOLEAN.** A WHERE conjunct, an operand of AND / OR / NOT, a CASE WHEN or
  IF condition and the operand of IS [NOT] TRUE / FALSE must have type BOOLEAN. Otherwise the
  engine inserts an implicit VARCHAR -> BOOLEAN (or DATE -> BOOLEAN ...) cast, which fails on
  some rows only: a data-dependent error is a free membership oracle. A non-BOOLEAN condition
  under ``TRY(...)`` would also be cast *outside* the TRY.
- **Group keys are scalars from a short whitelist** (integers, DOUBLE, DECIMAL, VARCHAR,
  BOOLEAN, DATE, TIMESTAMP), lowered so that every value the engine can produce is one the
  release can encode, order and compare: DECIMAL and wide integers become DOUBLE / BIGINT,
  dates and timestamps outside years 1..9999 become NULL (Python cannot represent them),
  and NaN gets one canonical place (:func:`canonical_key_value`).
"""

from __future__ import annotations

import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import replace
from decimal import Decimal
from typing import Any, cast

import duckdb
import sqlglot
from sqlglot import exp

from dpsql.errors import DataError, Position, ProgrammingError
from dpsql.frontend.facts import facts, known_type
from dpsql.frontend.identifiers import quote_ident
from dpsql.frontend.positions import offset_position, position_of, snippet
from dpsql.frontend.safety import conjuncts
from dpsql.frontend.simple_where import declared_type, readable
from dpsql.frontend.statements import DIALECT, DPQuery, GroupKey, duckdb_sql
from dpsql.policy import SQL_TYPES, Policy, TablePolicy

BOOLEAN_TYPES = frozenset({"BOOLEAN", '"NULL"'})

# Key types released as they are (after the lowering below); anything else is refused.
_SMALL_INTEGERS = frozenset({"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT"})
WIDE_INTEGERS = frozenset({"UINTEGER", "UBIGINT", "HUGEINT", "UHUGEINT"})
DECIMAL_PATTERN = re.compile(r"DECIMAL\(\d+,\s*\d+\)")
KEY_TYPES_HINT = "integers, DOUBLE, DECIMAL, VARCHAR, BOOLEAN, DATE or TIMESTAMP"

_DATE_RANGE = ("DATE '0001-01-01'", "DATE '9999-12-31'")
_TIMESTAMP_RANGE = ("TIMESTAMP '0001-01-01 00:00:00'", "TIMESTAMP '9999-12-31 23:59:59.999999'")


def key_type_allowed(duck_type: str) -> bool:
    return (
        duck_type in _SMALL_INTEGERS
        or duck_type in WIDE_INTEGERS
        or duck_type in ("DOUBLE", "FLOAT", "VARCHAR", "BOOLEAN", "DATE", "TIMESTAMP", '"NULL"')
        or DECIMAL_PATTERN.fullmatch(duck_type) is not None
    )


def released_key_type(duck_type: str) -> str:
    """The type a key is released as: what :func:`lower_key` casts it to."""
    if duck_type in _SMALL_INTEGERS or duck_type in WIDE_INTEGERS:
        return "BIGINT"
    if duck_type in ("FLOAT", "DOUBLE") or DECIMAL_PATTERN.fullmatch(duck_type):
        return "DOUBLE"
    if duck_type == '"NULL"':
        return "VARCHAR"
    return duck_type


def lower_key(key: GroupKey) -> str:
    """Engine SQL of a key, such that every value it yields can be released.

    Non-column keys run under TRY (a failing row gets the NULL key instead of failing the
    query). Wide integers and decimals are cast (under TRY: a value out of BIGINT's range
    becomes NULL) to the released type; dates and timestamps outside years 1..9999 (DuckDB
    has them, Python does not; 'infinity' too) become NULL. The same function lowers a key
    for the engine and for its public-domain enumeration, so both see the same values.
    """
    sql = key.sql
    guarded = sql if isinstance(key.expr, exp.Column) else f"TRY({sql})"
    duck_type = key.type
    if duck_type is None:
        return guarded
    if duck_type in WIDE_INTEGERS:
        return f"TRY_CAST({guarded} AS BIGINT)"
    if DECIMAL_PATTERN.fullmatch(duck_type) or duck_type == "FLOAT":
        return f"CAST({guarded} AS DOUBLE)"
    if duck_type == '"NULL"':
        return f"CAST({guarded} AS VARCHAR)"
    bounds = {"DATE": _DATE_RANGE, "TIMESTAMP": _TIMESTAMP_RANGE}.get(duck_type)
    if bounds is not None:
        return f"CASE WHEN ({guarded}) BETWEEN {bounds[0]} AND {bounds[1]} THEN ({guarded}) END"
    return guarded


CANONICAL_NAN = float("nan")


def canonical_key_value(value: Any) -> Any:
    """One Python value per released key value: NaN is one object (so dict look-ups and
    set membership find it), DECIMAL is a float (as :func:`lower_key` releases it)."""
    if isinstance(value, float) and math.isnan(value):
        return CANONICAL_NAN
    if isinstance(value, Decimal):
        number = float(value)
        return CANONICAL_NAN if math.isnan(number) else number
    return value


def key_sort_value(value: Any) -> tuple:
    """A total order over one key column's values: numbers (NaN above every number),
    then NULL last; any other type by its own order."""
    if value is None:
        return (2, 0)
    if isinstance(value, float) and math.isnan(value):
        return (1, 0)
    return (0, value)


class ShadowTypes:
    """DuckDB's binder over empty copies of the policy's tables: types, never rows.

    It has its own connection (no other work shares it), with external access off and its
    configuration locked. Every query through it is ``... LIMIT 0`` over tables that hold
    no row, so what it answers depends on the schema only.
    """

    def __init__(self, policy: Policy) -> None:
        self._con = duckdb.connect(":memory:")
        for table in policy.tables.values():
            self._con.execute(_empty_table_sql(table))
        self._con.execute("SET threads = 1")
        self._con.execute("SET enable_external_access = false")
        self._con.execute("SET lock_configuration = true")
        self._lock = threading.Lock()
        # (owner, table, expressions) -> types: a pure function of the schema. Kept per owner
        # (the analyst): a hit is faster than a binder call, so a shared entry would tell one
        # analyst, by timing, which expressions another typed. Failures are never kept.
        self._known: OrderedDict[tuple, list[str]] = OrderedDict()

    _KNOWN_LIMIT = 4096

    def types(self, table: str, expressions: Sequence[str], owner: str | None = None) -> list[str]:
        """DuckDB types of ``expressions`` over the empty ``table``; raises duckdb.Error.
        ``owner`` (an analyst) keeps the answer for that owner's later calls."""
        if not expressions:
            return []
        key = (owner, table, tuple(expressions)) if owner is not None else None
        with self._lock:  # one connection, no cursor per call (a cursor costs ~0.2 ms)
            if key is not None and key in self._known:
                self._known.move_to_end(key)
                return list(self._known[key])
            columns = ", ".join(f"({e})" for e in expressions)
            sql = f"SELECT {columns} FROM {quote_ident(table)} LIMIT 0"
            # bound, not run: a relation's description is the binder's (~0.1 ms less than
            # executing the LIMIT 0 query; the same types and the same binder errors)
            description = self._con.sql(sql).description
            out = [str(d[1]) for d in description]
            if key is not None:
                self._known[key] = out
                while len(self._known) > self._KNOWN_LIMIT:
                    self._known.popitem(last=False)
            return list(out)

    def relation(self, sql: str) -> list[tuple[str, str]]:
        """Names and DuckDB types of a relation's columns over the empty tables (bound, not
        run: a column probe's answer depends on the schema only); raises duckdb.Error."""
        with self._lock:
            description = self._con.sql(sql).description
        return [(str(d[0]), str(d[1])) for d in description]

    def declare(self, table: TablePolicy) -> None:
        """An empty table for a virtual one (a join of private tables, named by its tables
        and join kinds, so a name always has the same columns), created on first use."""
        with self._lock:
            self._con.execute(_empty_table_sql(table))

    def close(self) -> None:
        self._con.close()


def _empty_table_sql(table: TablePolicy) -> str:
    """``CREATE TABLE IF NOT EXISTS`` the table's declared columns, with no row."""
    cols = ", ".join(f"{quote_ident(c.name)} {SQL_TYPES[c.type]}" for c in table.columns.values())
    return f"CREATE TABLE IF NOT EXISTS {quote_ident(table.name)} ({cols})"


def type_query(query: DPQuery, shadow: ShadowTypes, owner: str | None = None) -> DPQuery:
    """``query`` with every key's type known, or a refusal (free: text and schema only).
    ``owner``: the analyst whose earlier typings of the same expressions may be reused."""
    table = query.table.name
    # aggregate arguments over computed columns (SUM(CASE WHEN c THEN x END), the rewritten
    # AGG(x) FILTER (WHERE c) and COUNT_IF(c)): typed as the WHERE is, their conditions BOOLEAN
    computed = [c.expr for c in query.table.columns.values() if c.expr]
    declared = declared_key_types(query)
    if declared is not None and not computed:  # nothing to ask the binder: declared_key_types
        known = zip(query.keys, declared, strict=True)
        return _typed(query, tuple(_with_type(k, t) for k, t in known))
    if query.table.joined is not None:
        shadow.declare(query.table)
    policy = query.table
    keys = [k.sql for k in query.keys]
    where = [duckdb_sql(query.where)] if query.where is not None else []
    contexts = list(_boolean_contexts(query.where)) if query.where is not None else []
    located = len(contexts)  # conditions after these are re-parsed (no source position)
    for sql in computed:
        contexts += _boolean_contexts(_parsed(sql), top=False)
    whole = where + computed
    # each condition node asked once (a WHERE conjunct is an operand of AND too), and not at
    # all when its type is already a fact of the node (typed before, or declared)
    unique = {id(node): node for node, _ in contexts}.values()
    asked = [node for node in unique if not isinstance(known_type(node, policy), str)]
    sqls = keys + [duckdb_sql(node) for node in asked]
    try:  # one binder call in the common case: the keys and every condition together
        types: list[str | None] = list(shadow.types(table, keys + whole + sqls[len(keys) :], owner))
        del types[len(keys) : len(keys) + len(whole)]
    except duckdb.Error:
        check_binds(shadow, table, keys + whole)  # raises the refusal for the whole query
        types = _types_or_none(shadow, table, sqls)
    # the binder's answers become facts of their nodes, which the checks below read
    for key, duck_type in zip(query.keys, types, strict=False):
        facts(key.expr, policy).type = duck_type
    for node, duck_type in zip(asked, types[len(keys) :], strict=True):
        facts(node, policy).type = duck_type
    for i, (node, role) in enumerate(contexts):
        duck_type = known_type(node, policy)
        if duck_type is not None and duck_type not in BOOLEAN_TYPES:
            at = position_of(node) if i < located else _found_at(node, query.text)
            raise ProgrammingError(
                f"{role} must be BOOLEAN, but {snippet(node)} is {duck_type}",
                sqlstate="42804",
                construct=snippet(node),
                position=at,
                hint="compare it with a value (e.g. col = 'x', col IS NOT NULL), or cast it "
                "explicitly with TRY_CAST(... AS BOOLEAN)",
            )
    return _typed(query, tuple(_with_type(k, known_type(k.expr, policy)) for k in query.keys))


def _with_type(key: GroupKey, duck_type: str | None) -> GroupKey:
    """``key`` with its type: the same expression, so its text rendered once already (the
    binder asks ``key.sql``) is the new key's too, not rendered again."""
    typed = replace(key, type=duck_type)
    if "sql" in key.__dict__:  # functools.cached_property's slot: the same expr, the same text
        typed.__dict__["sql"] = key.__dict__["sql"]
    return typed


def declared_key_types(query: DPQuery) -> list[str] | None:
    """The key types of a simple query without DuckDB's binder (~0.4 ms a call): every key a
    bare stored column (its declared type, as the shadow table declares it) and the WHERE
    simple (dpsql.frontend.simple_where: every condition BOOLEAN, nothing that fails to bind).
    None: ask the binder. tests/test_columnar.py checks both agree."""
    table = query.table
    if table.joined is not None or (query.where is not None and not readable(query.where, table)):
        return None
    out = []
    for key in query.keys:  # a column's type is a fact of its node (simple_where.declared_type)
        duck_type = declared_type(key.expr, table) if isinstance(key.expr, exp.Column) else None
        if duck_type is None:
            return None
        out.append(duck_type)
    return out


def _typed(query: DPQuery, keys: tuple[GroupKey, ...]) -> DPQuery:
    """``query`` with its keys typed, or the refusal of the first whose type cannot be
    released."""
    for key in keys:
        duck_type = key.type
        if duck_type is None or not key_type_allowed(duck_type):
            shown = duck_type or "an unknown type"
            raise ProgrammingError(
                f"GROUP BY key {snippet(key.expr)} has type {shown}, which cannot be released",
                sqlstate="42804",
                construct=snippet(key.expr),
                position=key.position,
                hint=f"group by a scalar of type {KEY_TYPES_HINT} (CAST it explicitly)",
            )
    return query.with_keys(keys)


def check_binds(shadow: ShadowTypes, table: str, expressions: Sequence[str]) -> None:
    """The whole keys and WHERE bind over the schema, or a refusal naming the problem."""
    try:
        shadow.types(table, expressions)
    except duckdb.ConversionException as exc:
        raise DataError(
            f"invalid value for the column's type: {_first_line(exc)}",
            sqlstate="22P02",
            construct="literal",
            hint="compare columns with literals of their declared type",
        ) from None
    except duckdb.Error as exc:
        raise ProgrammingError(
            f"type error: {_first_line(exc)}",
            sqlstate="42804",
            construct="expression",
            hint="check the operand types against the policy's column types",
        ) from None


def relation_types(shadow: ShadowTypes, sql: str) -> list[tuple[str, str]]:
    """:meth:`ShadowTypes.relation`, or the refusal naming why it does not bind."""
    try:
        return shadow.relation(sql)
    except duckdb.Error as exc:
        raise ProgrammingError(
            f"type error: {_first_line(exc)}",
            sqlstate="42804",
            construct="expression",
            hint="check the operand types against the policy's column types",
        ) from None


def _types_or_none(shadow: ShadowTypes, table: str, sqls: Sequence[str]) -> list[str | None]:
    """Types of sub-expressions, one binder call; one by one if a piece does not bind alone."""
    try:
        return list(shadow.types(table, sqls))
    except duckdb.Error:
        pass
    out: list[str | None] = []
    for sql in sqls:
        try:
            out.append(shadow.types(table, [sql])[0])
        except duckdb.Error:
            out.append(None)
    return out


# Nodes DuckDB types BOOLEAN whatever their operands (once the whole WHERE binds): a context
# that is one of them needs no binder call of its own. Skipping them keeps typing linear: each
# operand of an AND/OR chain is the whole chain before it, so rendering every one was O(n^2)
# (a 5,000-branch CASE or OR chain took seconds).
_ALWAYS_BOOLEAN = (
    exp.And, exp.Or, exp.Not, exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.In,
    exp.Between, exp.Like, exp.ILike, exp.Is, exp.Exists, exp.Boolean, exp.NullSafeEQ,
    exp.NullSafeNEQ,
)  # fmt: skip


def _parsed(sql: str) -> exp.Expression:
    """A computed column's expression (the binder keeps its DuckDB text only)."""
    return cast(exp.Expression, sqlglot.parse_one(sql, read=DIALECT))


def _found_at(node: exp.Expression, text: str) -> Position | None:
    """Where a re-parsed condition (a computed column's) is written in ``text``, when it is
    written as it renders; else None."""
    bare = node.transform(
        lambda n: exp.to_identifier(n.name) if isinstance(n, exp.Identifier) else n
    )
    offset = text.lower().find(bare.sql(dialect=DIALECT).lower())
    return None if offset < 0 else offset_position(text, offset)


def _boolean_contexts(
    where: exp.Expression, top: bool = True
) -> Iterator[tuple[exp.Expression, str]]:
    """Every sub-expression the engine evaluates as a condition, with its role (those typed
    BOOLEAN by their own node, :data:`_ALWAYS_BOOLEAN`, left out). ``top`` False: ``where``
    is a value (an aggregate's argument), only the conditions inside it."""

    def needs_type(node: exp.Expression) -> bool:
        while isinstance(node, exp.Paren):
            node = node.this
        return not isinstance(node, _ALWAYS_BOOLEAN)

    for part in conjuncts(where) if top else ():
        if needs_type(part):
            yield part, "a WHERE condition"
    for node in where.walk():
        if isinstance(node, exp.And | exp.Or):
            word = "AND" if isinstance(node, exp.And) else "OR"
            for operand in (node.this, node.expression):
                if needs_type(operand):
                    yield operand, f"an operand of {word}"
        elif isinstance(node, exp.Not) and needs_type(node.this):
            yield node.this, "the operand of NOT"
        elif isinstance(node, exp.If) and needs_type(node.this):
            yield node.this, "a CASE WHEN / IF condition"
        elif (
            isinstance(node, exp.Is)
            and isinstance(node.expression, exp.Boolean)
            and needs_type(node.this)
        ):
            yield node.this, "the operand of IS TRUE / IS FALSE"


def _first_line(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else "error"
    return text[:300]
