"""Tree edits that stay linear in the tree's size.

sqlglot's ``Expression.replace`` on a node held in a list argument (an IN list's values, a
CASE's WHEN branches, a SELECT's projections) re-parents every element of that list, so
replacing each of n values in turn costs O(n^2): 20,000 replacements in a 10,000-value IN list
took 7.5 s. :func:`replace_nodes` writes each new node into its slot directly.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlglot import exp


def replace_nodes(pairs: Iterable[tuple[exp.Expr, exp.Expr]]) -> None:
    """Replace each ``old`` node of a tree with ``new``, in place; O(1) per pair plus the
    clearing of cached hashes along each parent chain (stopped at the first cleared node)."""
    for old, new in pairs:
        parent = old.parent
        key = old.arg_key
        if parent is None or parent is new or not key:
            continue
        node: exp.Expr | None = parent
        while node is not None and node._hash is not None:
            node._hash = None
            node = node.parent
        index = old.index
        held = parent.args.get(key)
        if (
            index is not None
            and isinstance(held, list)
            and index < len(held)
            and held[index] is old
        ):
            held[index] = new
        elif held is old:
            parent.args[key] = new
            index = None
        else:  # not where it says it is: let sqlglot find it
            old.replace(new)
            continue
        new.parent = parent
        new.arg_key = key
        new.index = index
        old.parent = None
