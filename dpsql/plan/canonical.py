"""The canonical serialisation of an annotated plan: the one text every cache key derives from.

Two plans share a cached answer if and only if this text of their measured part is equal, so
it must (1) contain everything that decides the released distribution and (2) contain nothing
the analyst merely *spelled*. It is built generically from the plan's frozen values, so a
field added to a plan node is part of the key without anyone remembering to add it (the old
hand-written fingerprint missed the join; docs/architecture.md, "Cache keys").

What it contains: every field that takes part in the value's equality (``compare=True``) of
every frozen dataclass reachable from the plan: the bound relation (policy tables with their
columns, bounds, units and R/G as this query reads them; a private join's steps, kinds and ON
pairs; a public table's rows as a digest), the WHERE, the keys and their public domains, each
measure with its range, centre, granularity and mechanism, the outputs, the threshold, the
selection, quantile and clipping estimators, ε, δ, the mechanism, the bounding, the engine and
the data version (the answer key leaves out the engine: see :data:`_POST`). Under
``compare=False`` sit only what the analyst wrote (source positions,
an aggregate's text as shown), bookkeeping derived from compared fields (a cost's zCDP total)
and caches of the plan (its engine store, ``extra``): a new field that must stay out of the key
is declared so.

What it leaves out, because it is spelling: the statement's text; parentheses (the tree's shape
already says what they grouped); comments and source positions (not sqlglot arguments); the
order of the WHERE's top-level conjuncts (see :func:`_where`); ``x < y`` against ``y > x`` and
the two sides of ``=`` and ``<>`` (see :data:`_MIRRORED`); table aliases, keyword case, ``<>``
against ``!=`` and ``INNER JOIN`` against ``JOIN`` are already gone from the bound tree.
Literals become typed values: an integer is its value (DuckDB types an integer literal by its
value: ``0100`` is INTEGER 100), an exponent number its DOUBLE value (``1e2`` = ``1E+2``); a
decimal keeps its digits, because DuckDB types ``01.50`` as DECIMAL(4,2) and ``1.50`` as
DECIMAL(3,2) (and casts either to text as written), so they are different typed values.

Only the standard library and sqlglot are imported here: every layer may call it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
import threading
from collections.abc import Mapping
from decimal import Decimal
from fractions import Fraction
from pathlib import PurePath
from typing import Any

from sqlglot import exp

# Fields that are spelling, not meaning, though they take part in equality: the statement's
# text (its tree is serialised instead).
_SPELLING = {("DPQuery", "text")}
# compare=False fields that still decide which rows a query reads: a public table's rows (held
# as public facts, joined as those rows); serialised as a digest.
_ROWS = {("TablePolicy", "rows")}
# Fields whose tuple is a set: the order carries no meaning, so it is sorted. A key's
# conditions are each evaluated under their own TRY on the public values and ANDed
# (dpsql.plan.domains.key_domain): the bins they keep do not depend on their order.
_SETS = {("GroupKey", "conditions")}

_fields_lock = threading.Lock()
_FIELDS: dict[type, tuple[tuple[str, str], ...]] = {}  # class -> (field name, how)
# Memoised by identity (an entry holds its object, so the id cannot be reused while cached):
# values that hold no sqlglot tree (those are mutable) and that plans share: the policy tables
# every plan reads, and what a shape-cache hit keeps of its plan (measures, estimators).
_MEMO: dict[tuple[int, frozenset], tuple[object, str]] = {}
_MEMO_LIMIT = 4096
_MEMOISED = frozenset(
    {
        "TablePolicy",
        "ColumnPolicy",
        "JoinedSource",
        "Measure",
        "QuantileMeasure",
        "ClipEstimate",
        "Threshold",
        "Selection",
        "Cost",
        "OutputAggregate",
    }
)
_ONCE_PER_CALL = frozenset({"GroupKey", "AggregateCall"})
# tuples this long of plain values (public domains, IN lists' values) are memoised too
_LONG = 4
_FLAT = frozenset({type(None), bool, int, float, str, dt.date, dt.datetime, Decimal})
_SCALARS = frozenset({type(None), bool, int, str})


def _fields(cls: type) -> tuple[tuple[str, str], ...]:
    got = _FIELDS.get(cls)
    if got is None:
        name = cls.__name__
        out = []
        for f in dataclasses.fields(cls):
            where = (name, f.name)
            if where in _ROWS:
                out.append((f.name, "rows"))
            elif where == ("Where", "condition"):
                out.append((f.name, "where"))
            elif f.compare and where not in _SPELLING:
                out.append((f.name, "set" if where in _SETS else "value"))
        got = tuple(out)
        with _fields_lock:
            _FIELDS[cls] = got
    return got


def canonical(value: Any, *, skip: frozenset[tuple[str, str]] = frozenset()) -> str:
    """The canonical text of a plan (or any part of one): deterministic, and equal for two
    values exactly when they are equal up to spelling (see the module docstring). ``skip``:
    further (class name, field) pairs to leave out (the answer key leaves out the
    post-processing, which runs afresh on every replay)."""
    out: list[str] = []
    _write(value, out, _Ctx(skip))
    return "".join(out)


class _Ctx:
    """One serialisation: the fields it skips, and the values that may hold a sqlglot tree
    already written in it (a GroupKey sits in the query and in its KeyPlan; an aggregate call
    in the query and in its output): written once per call, never memoised across calls."""

    __slots__ = ("seen", "skip")

    def __init__(self, skip: frozenset[tuple[str, str]]) -> None:
        self.skip = skip
        self.seen: dict[int, tuple[object, str]] = {}


_PLAIN = _Ctx(frozenset())  # for a sqlglot node's plain arguments (never a plan value)


def _write(value: Any, out: list[str], ctx: _Ctx) -> None:
    cls = value.__class__
    if cls in _SCALARS:
        out.append(repr(value))  # bool and int apart: True and 1 differ
    elif cls is float:
        out.append(f"f{value!r}")  # repr is exact (round-trips); -0.0 and 0.0 differ
    elif cls is tuple or cls is list:
        if cls is tuple and len(value) >= _LONG:  # a public domain: shared by a shape's plans
            hit = _MEMO.get((id(value), ctx.skip))
            if hit is not None and hit[0] is value:
                out.append(hit[1])
                return
        start = len(out)
        out.append("(")
        for item in value:
            _write(item, out, ctx)
            out.append(",")
        out.append(")")
        if cls is tuple and len(value) >= _LONG and all(v.__class__ in _FLAT for v in value):
            _remember(value, ctx.skip, out, start)  # immutable all the way down
    elif cls in _FIELDS or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        _dataclass(value, out, ctx)
    elif isinstance(value, exp.Expression):
        _expression(value, out)
    elif isinstance(value, (bool, int, str)):
        out.append(f"{cls.__name__}({value!r})")
    elif isinstance(value, float):
        out.append(f"f{float(value)!r}")
    elif isinstance(value, tuple):
        _write(tuple(value), out, ctx)
    elif isinstance(value, Mapping):
        out.append("{")
        for k, v in value.items():  # insertion order: the same tree builds it alike
            _write(k, out, ctx)
            out.append(":")
            _write(v, out, ctx)
            out.append(",")
        out.append("}")
    elif isinstance(value, (set, frozenset)):
        out.append("{" + ",".join(sorted(canonical(v, skip=ctx.skip) for v in value)) + "}")
    elif isinstance(value, (Fraction, Decimal, dt.date, dt.datetime, dt.time, dt.timedelta)):
        out.append(f"{cls.__name__}({value!s})")
    elif isinstance(value, enum.Enum):
        out.append(f"{cls.__name__}.{value.name}")
    elif isinstance(value, PurePath):
        out.append(f"path({value!s})")
    elif isinstance(value, bytes):
        out.append(f"bytes({hashlib.sha256(value).hexdigest()})")
    else:
        # Not a plan value we know: never shared with another object (a key only this very
        # object can match), so an unknown type can cost a cache hit, never give a wrong one.
        out.append(f"<{cls.__qualname__}@{id(value)}>")


def _dataclass(value: Any, out: list[str], ctx: _Ctx) -> None:
    cls = type(value)
    name = cls.__name__
    memo = name in _MEMOISED
    local = name in _ONCE_PER_CALL
    if memo or local:
        hit = ctx.seen.get(id(value)) if local else _MEMO.get((id(value), ctx.skip))
        if hit is not None and hit[0] is value:
            out.append(hit[1])
            return
        start = len(out)
    writer = _WRITERS.get((cls, ctx.skip)) or _writer(cls, ctx.skip)
    writer(value, out, ctx)
    if memo:
        _remember(value, ctx.skip, out, start)
    elif local:
        text = "".join(out[start:])
        del out[start:]
        out.append(text)
        ctx.seen[id(value)] = (value, text)


# (class, skipped fields) -> the function writing such a value's fields (see _writer)
_WRITERS: dict[tuple[type, frozenset], Any] = {}


def _writer(cls: type, skip: frozenset) -> Any:
    """The writer of ``cls``'s fields as the generic loop would write them, generated once
    per class and skip set: one straight-line function (a plain field's scalar written in
    place), since a plan key writes a few dozen dataclasses and the loop's per-field
    dispatch was most of its cost. Each field is written as ``name=<value>;``, in field
    order, between ``Class(`` and ``)``."""
    name = cls.__name__
    lines = ["def write(value, out, ctx):", f"    out.append({name + '('!r})"]
    for field_name, how in _FIELDS.get(cls) or _fields(cls):
        if (name, field_name) in skip:
            continue
        label = field_name + "="
        lines.append(f"    item = value.{field_name}")
        if how == "value":
            lines += [
                "    kind = item.__class__",
                "    if kind in _SCALARS:",
                f"        out.append({label!r} + repr(item) + ';')",
                "    elif kind is float:",
                f"        out.append({label + 'f'!r} + repr(item) + ';')",
                "    else:",
                f"        out.append({label!r})",
                "        _write(item, out, ctx)",
                "        out.append(';')",
            ]
            continue
        lines.append(f"    out.append({label!r})")
        if how == "rows":
            lines.append("    out.append('None' if item is None else _digest(repr(item)))")
        elif how == "set":
            lines += [
                "    if isinstance(item, tuple):",
                "        parts = sorted(canonical(v, skip=ctx.skip) for v in item)",
                "        out.append('(' + ','.join(parts) + ')')",
                "    else:",
                "        _write(item, out, ctx)",
            ]
        elif how == "where":
            lines += [
                "    if isinstance(item, exp.Expression):",
                "        _where(item, out)",
                "    else:",
                "        _write(item, out, ctx)",
            ]
        else:
            lines.append("    _write(item, out, ctx)")
        lines.append("    out.append(';')")
    lines.append("    out.append(')')")
    namespace: dict[str, Any] = {
        "_SCALARS": _SCALARS,
        "_write": _write,
        "_digest": _digest,
        "_where": _where,
        "canonical": canonical,
        "exp": exp,
    }
    exec("\n".join(lines), namespace)  # code built from the class's own field names only
    writer = namespace["write"]
    with _fields_lock:
        _WRITERS[(cls, skip)] = writer
    return writer


def _remember(value: object, skip: frozenset, out: list[str], start: int) -> None:
    """Join what ``value`` wrote (from ``start``) into one piece and memoise it."""
    text = "".join(out[start:])
    if type(value).__name__ == "TablePolicy":  # kilobytes, in every key that reads it
        text = f"TablePolicy#{_digest(text)}"
    del out[start:]
    out.append(text)
    if len(_MEMO) >= _MEMO_LIMIT:
        _MEMO.clear()
    _MEMO[(id(value), skip)] = (value, text)


# OpenSSL 3 looks the algorithm up by name for each ``hashlib.sha256(...)`` (~60,000
# instructions, a tenth of an answer key's cost); a copy of one made here skips the look-up.
_SHA256 = hashlib.sha256()


def _digest(text: str) -> str:
    digest = _SHA256.copy()
    digest.update(text.encode())
    return digest.hexdigest()


def _conjuncts(node: exp.Expression) -> list[exp.Expression]:
    """The top-level AND operands (parentheses looked through), iteratively (a long chain of
    ANDs nests as deep as it is long)."""
    out, stack = [], [node]
    while stack:
        item = stack.pop()
        while isinstance(item, exp.Paren):
            item = item.this
        if isinstance(item, exp.And):
            stack.append(item.expression)
            stack.append(item.this)
        else:
            out.append(item)
    return out


def _where(where: exp.Expression, out: list[str]) -> None:
    """The WHERE as the sorted multiset of its top-level conjuncts.

    Why the order of top-level conjuncts carries no meaning (and nothing deeper is reordered):
    the compiled scan keeps a row iff every conjunct is TRUE. Conjuncts that cannot fail run
    bare, the others ANDed inside one TRY (dpsql.frontend.safety.guarded_conditions, which splits
    the WHERE at these very operands); a row on which some conjunct is FALSE or NULL is dropped
    whether or not the engine evaluates the others (short-circuit or not), and a row on which
    one errors is dropped by the TRY (NULL) unless a conjunct evaluated before it was already
    FALSE (dropped again). So the kept rows, and with them every measure, are the same in any
    order. Inside a conjunct (an AND under an OR or NOT) evaluation order can decide whether an
    error is reached before a TRUE, so nothing there is reordered.
    """
    parts = []
    for part in _conjuncts(where):
        text: list[str] = []
        _expression(part, text)
        parts.append("".join(text))
    if len(parts) == 1:
        out.append(parts[0])
        return
    parts.sort()
    out.append("AND*(" + ",".join(parts) + ")")


def _literal(node: exp.Literal) -> str:
    text = str(node.this)
    if node.is_string:
        return f"s{text!r}"
    if text.isdigit():
        return f"i{int(text)}"  # DuckDB types an integer literal by its value
    if "e" in text.lower():
        try:
            return f"d{float(text)!r}"  # an exponent makes a DOUBLE
        except ValueError:
            pass
    return f"n{text}"  # a decimal is DECIMAL(digits, scale): its digits are its type


def _expression(root: exp.Expression, out: list[str]) -> None:
    """One sqlglot tree, iteratively (no recursion limit on deep trees): each node its class
    and its arguments in name order; parentheses dropped; literals typed (:func:`_literal`);
    identifiers by name (quoting only stops case folding, which binding has done); empty,
    None and False arguments left out (the generators treat a missing flag as unset)."""
    # ("t", text): written as is; ("v", value): a node or a plain argument, serialised
    stack: list[tuple[str, Any]] = [("v", root)]
    while stack:
        what, node = stack.pop()
        if what == "t":
            out.append(node)
        elif isinstance(node, exp.Paren):
            stack.append(("v", node.this))
        elif isinstance(node, exp.Literal):
            out.append(_literal(node))
        elif isinstance(node, exp.Identifier):
            out.append(f"id{str(node.this)!r}")
        elif type(node) in _MIRRORED and set(node.args) == {"this", "expression"}:
            out.append(_comparison(node))
        elif isinstance(node, exp.Expression):
            out.append(type(node).__name__ + "(")
            stack.append(("t", ")"))
            for key in sorted(node.args, reverse=True):
                arg = node.args[key]
                if arg is None or arg is False or (isinstance(arg, list) and not arg):
                    continue
                stack.append(("t", ";"))
                if isinstance(arg, list):
                    stack.append(("t", "]"))
                    for item in reversed(arg):
                        stack.append(("t", ","))
                        stack.append(("v", item))
                    stack.append(("t", f"{key}=["))
                else:
                    stack.append(("v", arg))
                    stack.append(("t", f"{key}="))
        else:
            _write(node, out, _PLAIN)  # a plain argument: a string, bool, enum, number


# x < y is y > x, x <= y is y >= x: both operands are evaluated either way, so the mirrored
# spelling is the same comparison (each is written as its ">" form); = and <> are symmetric
# (both sides are coerced to one common type whichever side is which), so their operands are
# written in a fixed order.
_MIRRORED: dict[type, tuple[str, bool]] = {
    exp.GT: ("GT", False),
    exp.LT: ("GT", True),
    exp.GTE: ("GTE", False),
    exp.LTE: ("GTE", True),
    exp.EQ: ("EQ", False),
    exp.NEQ: ("NEQ", False),
}


def _comparison(node: exp.Expression) -> str:
    name, swap = _MIRRORED[type(node)]
    left: list[str] = []
    right: list[str] = []
    _expression(node.this, left)
    _expression(node.expression, right)
    a, b = "".join(left), "".join(right)
    if swap or (name in ("EQ", "NEQ") and b < a):
        a, b = b, a
    return f"{name}({a},{b})"


def plan_text(plan: Any) -> str:
    """The whole annotated plan, post-processing included (what the plan cache and text
    shapes must re-derive for a text they serve)."""
    return canonical(plan)


# The post-processing over the released table runs afresh on every replay of an answer
# (it is free), so two queries that measure alike share the release whatever they do with it.
# The engine that runs a plan is not part of its answer either: DuckDB and Spark compute the
# same exact aggregates for the same secret (tests/test_spark_engine.py, test_spark_store.py
# check them equal), so the released distribution is the same and an answer paid on one
# engine replays on the other at the same data version.
_POST = frozenset({("DPQuery", "post"), ("Plan", "engine")})


def answer_key(plan: Any) -> str:
    """The answer cache's key of ``plan``: a digest of its canonical measured tree. The plan
    holds the data version, the policy tables as it reads them, ε, δ, the mechanism, the
    bias and clipping estimators and the public clock's instant (a literal), so no other part
    is needed (docs/architecture.md, "Cache keys")."""
    return _digest(canonical(plan, skip=_POST))


def answer_text(plan: Any) -> str:
    """The canonical text :func:`answer_key` digests (what a key template is cut from)."""
    return canonical(plan, skip=_POST)


def key_of_text(text: str) -> str:
    """:func:`answer_key` of a plan whose :func:`answer_text` is ``text``."""
    return _digest(text)


def where_text(where: exp.Expression) -> str:
    """The text a WHERE condition takes in a plan's canonical text (its sorted conjuncts)."""
    out: list[str] = []
    _where(where, out)
    return "".join(out)
