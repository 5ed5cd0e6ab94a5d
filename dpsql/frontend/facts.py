"""What is known of one expression node, kept on the node: computed once, read by every rule.

Typing without the binder (dpsql.frontend.simple_where), interval arithmetic
(dpsql.frontend.intervals) and the totality whitelist (dpsql.frontend.safety) each used to walk
the same sqlglot subtree and re-derive its facts; a WHERE was walked once for its totality, and
twice more to learn whether it is simple (typing, then the column programs). Now each rule's
entry point asks :func:`facts` for the node's record and fills its own field the first time:
the recursion reaches a child through the same entry point, so every fact of every node is
computed at most once per (node, table), and a second question is a look-up.

The record lives on the node's sqlglot meta (key :data:`FACTS`), as positions do
(dpsql.frontend.positions). It is only valid for the node it was computed on and the table it
was computed over: it holds both, and :func:`facts` starts a new record when either differs.
That makes copies safe: a copy of a node shares (or deep-copies) the meta, but it is another
object, so it computes its own facts (a copy may be changed in place: the text shapes swap the
literals of a copied WHERE, dpsql.service.shape_cache). A bound tree is not changed in place.

The facts of a condition that follow its connectives (totality, readability: through AND, OR,
NOT and parentheses a condition's fact is its operands') share one walk, :func:`condition_fact`.
Each field is :data:`UNSET` until its rule fills it; :mod:`dpsql.frontend.typed` reads all of
them at once (one frozen record), for callers that want every fact of a node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlglot import exp

from dpsql.policy import TablePolicy

FACTS = "dp_facts"  # the meta key of a node's :class:`ExprFacts`


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


#: A fact not computed yet (None is a fact: "no type known without the binder").
UNSET: Any = _Unset()


class ExprFacts:
    """The facts of one node over one table, each filled once by the rule that owns it.

    - ``type``: its DuckDB type: known without DuckDB's binder (a stored column's declared
      type, BOOLEAN for a simple condition: dpsql.frontend.simple_where.declared_type, None
      when only the binder knows), or what the shadow binder answered for the node
      (dpsql.frontend.typecheck.type_query records it; the checks there read it back).
    - ``range``: its per-row value range (dpsql.frontend.intervals.Range), or, for a value that
      is not a number, the ``(node, why)`` that says so (dpsql.frontend.intervals).
    - ``total``: as a condition, it can never raise on any row (dpsql.frontend.safety).
    - ``readable``: as a condition, the column programs evaluate it as DuckDB does
      (dpsql.frontend.simple_where).
    - ``nullable``: it can be NULL on some row (False only when it never is where it does
      not raise: dpsql.frontend.nullability).
    """

    __slots__ = ("node", "nullable", "range", "readable", "table", "total", "type")

    def __init__(self, node: exp.Expr, table: TablePolicy) -> None:
        self.node = node
        self.table = table
        self.type: Any = UNSET
        self.range: Any = UNSET
        self.total: Any = UNSET
        self.readable: Any = UNSET
        self.nullable: Any = UNSET

    def __deepcopy__(self, memo: dict) -> ExprFacts:
        return self  # a copied node's meta may carry it; the copy is another node (facts)

    def __reduce__(self) -> tuple:
        return (_unbound, ())  # a pickled tree computes its facts again


def _unbound() -> None:
    return None


class _FactsMeta(dict):
    """The meta this module gives a node that had none (operators carry no position): a
    copy of the node starts without facts (sqlglot deep-copies a node's meta)."""

    def __deepcopy__(self, memo: dict) -> _FactsMeta:
        copy = _FactsMeta(self)  # one C-level copy: safe against a key added meanwhile
        copy.pop(FACTS, None)
        return copy


def facts(node: exp.Expr, table: TablePolicy) -> ExprFacts:
    """The facts record of ``node`` over ``table``: the one kept on the node, or a new one
    (kept there) when it has none, or one of another node (a copy's) or another table."""
    meta = node._meta
    if meta is None:
        meta = node._meta = _FactsMeta()
    else:
        found = meta.get(FACTS)
        if found is not None and found.node is node and found.table is table:
            return found
    record = meta[FACTS] = ExprFacts(node, table)
    return record


def known_type(node: exp.Expr, table: TablePolicy) -> Any:
    """The type fact of ``node`` over ``table`` as it stands, computing nothing: a DuckDB type
    (from the policy's declarations, dpsql.frontend.simple_where.declared_type, or from the
    shadow binder, dpsql.frontend.typecheck.type_query), None (not known without the binder,
    or the binder could not type it alone), or :data:`UNSET` (not asked yet)."""
    meta = node._meta
    found = meta.get(FACTS) if meta is not None else None
    if found is not None and found.node is node and found.table is table:
        return found.type
    return UNSET


def condition_fact(
    node: exp.Expr, table: TablePolicy, field: str, leaf: Callable[[Any, TablePolicy], bool]
) -> bool:
    """A condition's fact that follows its connectives (totality, readability): through
    parentheses and NOT it is the operand's, through AND and OR both operands' (each read
    from, or kept on, the operand's record); ``leaf`` decides it for any other node. The
    connectives recurse in this frame: one frame per level of the tree."""
    record = facts(node, table)
    found = getattr(record, field)
    if found is not UNSET:
        return bool(found)
    if isinstance(node, exp.Paren | exp.Not):
        found = condition_fact(node.this, table, field, leaf)
    elif isinstance(node, exp.And | exp.Or):
        found = condition_fact(node.this, table, field, leaf) and condition_fact(
            node.expression, table, field, leaf
        )
    else:
        found = leaf(node, table)
    setattr(record, field, found)
    return bool(found)
