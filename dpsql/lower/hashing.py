"""The keyed hash and the secret slot: the one engine-specific construct in a generated plan.

``DP_KEYED_HASH(values..., DP_SECRET)`` orders rows per unit (which R rows a unit keeps, which
G groups) by a hash keyed with a per-query secret; the tree carries it as plain call nodes, and
each dialect renders them (dpsql.frontend.dialect). Below the compiler and the front end alike, so
that both build these nodes without importing each other (tests/test_layering.py).
"""

from __future__ import annotations

from sqlglot import exp

KEYED_HASH = "DP_KEYED_HASH"
SECRET = "DP_SECRET"


def keyed_hash(expressions: list[exp.Expression]) -> exp.Anonymous:
    """``DP_KEYED_HASH(values..., secret)``: engine-neutral in the tree, so that one tree serves
    every engine; each dialect's rendering maps it to its own fast hash (HASH, XXHASH64).

    A plain call node, not a node class of our own: sqlglot's compiled build (sqlglotc) lets no
    interpreted class inherit from its nodes, parser or generators."""
    return exp.Anonymous(this=KEYED_HASH, expressions=expressions)


def secret_slot() -> exp.Anonymous:
    """Where the per-query secret goes: the tree is built once per plan and rendered once per
    dialect, each run supplying its own secret (:meth:`CompiledQuery.with_secret`)."""
    return exp.Anonymous(this=SECRET, expressions=[])


def is_keyed_hash(node: exp.Expression) -> bool:
    return isinstance(node, exp.Anonymous) and node.name.upper() == KEYED_HASH


def is_secret(node: exp.Expression) -> bool:
    return isinstance(node, exp.Anonymous) and node.name.upper() == SECRET


def with_secret(tree: exp.Expression, secret: int) -> exp.Expression:
    """A copy of ``tree`` with ``secret`` printed where its secret slots stand."""
    return tree.transform(lambda node: exp.Literal.number(int(secret)) if is_secret(node) else node)
