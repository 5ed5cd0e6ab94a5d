"""The node classes of a parsed statement, counted once: which passes have nothing to do.

A flat query's tree (a few dozen nodes) used to be walked whole by a dozen passes before and
during binding, each looking for a construct the common query does not have (a parameter
placeholder, ``$$`` strings, a nested query, a respelled function, a CTE, a window): each
walk of sqlglot's ``find_all`` cost about as much as binding one clause. The binder's first
walk over the parsed tree (dpsql.frontend.bind._scrub, which checks its depth and drops its
comments) counts the classes of its nodes; a pass asks the census whether any node is of
the classes it looks for, and walks the tree only when one is.

A census describes the tree it was counted on (``root``) as it was then. It stays valid
only while that tree is unchanged: each place that hands it on says why the steps before
it changed nothing (none of them applies when the census shows the classes that step
rewrites), and drops it (None: walk as before) otherwise.
"""

from __future__ import annotations

from sqlglot import exp


class Census:
    """How many nodes of each class ``root``'s tree holds."""

    __slots__ = ("counts", "kinds", "root")

    def __init__(self, root: exp.Expr, counts: dict[type, int]) -> None:
        self.root = root
        self.counts = counts
        # every class some node is an instance of: its class and their bases (sqlglot's node
        # classes are plain classes: an instance of C is exactly a node with C in its MRO)
        self.kinds: frozenset[type] = frozenset().union(*(cls.__mro__ for cls in counts))

    def has(self, *classes: type) -> bool:
        """Whether some node is an instance of one of ``classes`` (``tree.find`` is not None)."""
        return not self.kinds.isdisjoint(classes)

    def count(self, *classes: type) -> int:
        """How many nodes are instances of one of ``classes``."""
        return sum(n for cls, n in self.counts.items() if issubclass(cls, classes))

    def only_root_query(self) -> bool:
        """Whether the root is the tree's one query: no subquery, CTE body or set operation
        (every ``exp.Query`` node of the tree is the root, which is one)."""
        return isinstance(self.root, exp.Query) and self.count(exp.Query) == 1
