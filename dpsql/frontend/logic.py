"""Boolean structure of conditions, shared by the binder, the WHERE safety check and the
DP-subquery filter (one definition, no import cycle)."""

from __future__ import annotations

from sqlglot import exp


def conjuncts(node: exp.Expression) -> list[exp.Expression]:
    """The top-level AND operands of ``node`` (parentheses looked through)."""
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.And):
        return conjuncts(node.this) + conjuncts(node.expression)
    return [node]
