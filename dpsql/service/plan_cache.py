"""What a statement text reuses across runs: its checked plan, its post-processing, the bounded
LRU of prepared statements (keyed by everything binding depends on, the analyst included)."""

from __future__ import annotations

import datetime as dt
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlglot import exp

from dpsql.engine.scratch import (
    Projection,
    plain_projection,
)
from dpsql.lower.compile import CompiledQuery, compile_plan
from dpsql.plan.annotated import Plan
from dpsql.plan.canonical import answer_key
from dpsql.service.results import is_output_column
from dpsql.service.settings import Settings


class CheckedSet:
    """Thread-safe set of statement shapes already checked; cleared when it grows large."""

    def __init__(self, limit: int = 4096) -> None:
        self._items: set[Any] = set()
        self._limit = limit
        self._lock = threading.Lock()

    def __contains__(self, key: Any) -> bool:
        with self._lock:
            return key in self._items

    def add(self, key: Any) -> None:
        with self._lock:
            if len(self._items) >= self._limit:
                self._items.clear()
            self._items.add(key)


class PreparedPlan:
    """What one statement text reuses across executions: its checked plan and fingerprint,
    and its compiled engine query (one tree, rendered once; each run prints its own secret).

    Never reused: the keyed-hash secret, the budget check and charge, the noise.
    """

    __slots__ = ("fingerprint", "plan", "post", "post_checked", "runs", "shape_key", "template")

    def __init__(self, plan: Plan, fingerprint: str | None = None) -> None:
        self.plan = plan
        # the answer cache's key: the plan's canonical measured tree (dpsql.plan.canonical);
        # ``fingerprint``: that key, already known (a text shape's key template, checked)
        self.fingerprint = answer_key(plan) if fingerprint is None else fingerprint
        self.template: SecretTemplate | None = None
        self.post: PostPlan | None = None  # how its post-processing runs (first use)
        self.post_checked = False  # the free dry run of its post-processing has passed
        self.runs = 0  # engine runs so far (the template is built by the first)
        self.shape_key: tuple | None = None  # the shape cache entry it came from, if any


@dataclass(frozen=True)
class PostPlan:
    """How a statement's post-processing runs: a plain projection in Python, or SQL on the
    scratch connection (with hidden ``__lo{j}``/``__hi{j}`` interval columns)."""

    projection: Projection | None
    query: exp.Select | None  # None for a plain projection (built only if a value needs DuckDB)
    visible: int

    @classmethod
    def of(cls, post: exp.Select, columns: Sequence[str]) -> PostPlan:
        projection = plain_projection(post, columns)
        query = None if projection is not None else cls.render(post)
        return cls(projection, query, len(post.expressions))

    @staticmethod
    def render(post: exp.Select) -> exp.Select:
        """The post-processing query, plus the interval bounds of each picked aggregate (a
        tree: dpsql.engine.scratch puts the released table in its FROM and renders it)."""
        post = post.copy()
        for j, item in enumerate(list(post.expressions)):
            inner = item.this if isinstance(item, exp.Alias) else item
            if isinstance(inner, exp.Column) and is_output_column(inner.name):
                post = post.select(
                    exp.alias_(exp.column(f"{inner.name}_lo"), f"__lo{j}"),
                    exp.alias_(exp.column(f"{inner.name}_hi"), f"__hi{j}"),
                    exp.alias_(exp.column(f"{inner.name}_bias"), f"__b{j}"),
                    exp.alias_(exp.column(f"{inner.name}_blo"), f"__blo{j}"),
                    exp.alias_(exp.column(f"{inner.name}_bhi"), f"__bhi{j}"),
                    copy=False,
                )
            elif (bounds := _window_interval(inner) or _sum_interval(post, inner)) is not None:
                low, high = bounds
                post = post.select(
                    exp.alias_(low, f"__lo{j}"), exp.alias_(high, f"__hi{j}"), copy=False
                )
        return post


def _sum_interval(
    post: exp.Select, node: exp.Expression
) -> tuple[exp.Expression, exp.Expression] | None:
    """``SUM(n)`` over a DP query's released rows (``SELECT SUM(n) FROM (SELECT k0 AS d, a0 AS
    n FROM __released) AS s``, how an outer query over a DP subquery is composed): the sum of
    the picked aggregate's bounds, exposed by the subquery (in ``post``, a copy) as hidden
    columns. It holds whenever every summed value's interval does; a row without an interval
    makes it NULL. None for anything else (a star or DISTINCT outside, DISTINCT inside)."""
    if not isinstance(node, exp.Sum) or node.args.get("expression") is not None:
        return None
    column = node.this
    source = post.args.get("from_")
    sub = source.this if isinstance(source, exp.From) else None
    if (
        not isinstance(column, exp.Column)
        or not isinstance(sub, exp.Subquery)
        or not isinstance(sub.this, exp.Select)
        or column.table not in ("", sub.alias_or_name)
        or post.args.get("joins")
        or post.args.get("distinct")
        or sub.this.args.get("distinct")
        or any(
            isinstance(e, exp.Star) or (isinstance(e, exp.Column) and isinstance(e.this, exp.Star))
            for e in post.expressions
        )
    ):
        return None
    inner = sub.this
    picked = None
    for item in inner.expressions:
        if isinstance(item, exp.Alias) and item.alias.lower() == column.name.lower():
            picked = item.this
    if not isinstance(picked, exp.Column) or not is_output_column(picked.name):
        return None
    bounds = []
    for suffix in ("lo", "hi"):
        hidden = f"__{suffix}__{column.name}"
        if not any(isinstance(e, exp.Alias) and e.alias == hidden for e in inner.expressions):
            inner.select(
                exp.alias_(exp.column(f"{picked.name}_{suffix}"), hidden, quoted=True), copy=False
            )
        ref = exp.column(hidden, table=column.table or None, quoted=True)
        same_rows = exp.EQ(
            this=exp.Count(this=column.copy()), expression=exp.Count(this=ref.copy())
        )
        bounds.append(exp.Case(ifs=[exp.If(this=same_rows, true=exp.Sum(this=ref))]))
    return bounds[0], bounds[1]


# Window functions whose interval follows from their argument's: a pick of another released
# row keeps that row's interval; a sum of released values has the sum of the bounds (it holds
# whenever every summed value's own interval does). Others (ranks, ratios, averages): NULL.
_PICKING_WINDOWS = (exp.Lag, exp.Lead, exp.FirstValue, exp.LastValue)


def _window_interval(node: exp.Expression) -> tuple[exp.Expression, exp.Expression] | None:
    """The interval bounds of ``SUM(aN) OVER (...)`` / ``LAG(aN ...) OVER (...)`` as the same
    window over aN_lo and aN_hi; None for any other expression."""
    if not isinstance(node, exp.Window) or not isinstance(node.this, (exp.Sum, *_PICKING_WINDOWS)):
        return None
    column = node.this.this
    if not isinstance(column, exp.Column) or column.table or not is_output_column(column.name):
        return None
    if isinstance(node.this, exp.Sum) and node.this.args.get("expression") is not None:
        return None

    def over(suffix: str) -> exp.Expression:
        window = node.copy()
        window.this.set("this", exp.column(f"{column.name}_{suffix}"))
        if not isinstance(node.this, exp.Sum):
            return window
        # a NULL bound (no interval for that row) makes the sum's bound NULL, not smaller
        counts = [node.copy(), node.copy()]
        for count, name in zip(counts, (column.name, f"{column.name}_{suffix}"), strict=True):
            count.set("this", exp.Count(this=exp.column(name)))
        return exp.Case(
            ifs=[exp.If(this=exp.EQ(this=counts[0], expression=counts[1]), true=window)]
        )

    return over("lo"), over("hi")


@dataclass(frozen=True)
class SecretTemplate:
    """A statement's compiled tree, reused by every run with that run's own secret.

    The tree holds a secret slot where the keyed-hash secret goes (dpsql.lower.compile), so
    ``with_secret(fresh)`` is what ``compile_plan(plan, fresh)`` gives, without compiling or
    rendering again (the renderings are shared; only the secret's digits differ).
    """

    compiled: CompiledQuery

    @classmethod
    def build(cls, plan: Plan) -> SecretTemplate:
        return cls(compile_plan(plan, 0))

    def with_secret(self, secret: int) -> CompiledQuery:
        return self.compiled.with_secret(secret)


# CURRENT_DATE and TODAY() (the same node in sqlglot) become the date at bind
_DATED = re.compile(r"current_date|today", re.IGNORECASE)
# NOW(), CURRENT_TIMESTAMP and the like become the instant at bind (dpsql.frontend.rewrite):
# a plan bound a moment ago is not this statement's, so such a text is never a plan-cache key
_CLOCKED = re.compile(
    r"\b(now|current_timestamp|localtimestamp|transaction_timestamp|statement_timestamp"
    r"|get_current_time)\b",
    re.IGNORECASE,
)


# Once the plan cache is full, one text-shape hit in this many takes a place (PlanCache.offer).
ADMIT_WHEN_FULL = 16
_ADMIT = random.Random()


class PlanCache:
    """Bounded LRU of prepared statements, keyed by everything that binding depends on.

    The key is the analyst, the exact text, the parameters (type and repr, so 1, 1.0, True and
    -0.0 differ), and the session's settings (repr). The policy is fixed per Service; the
    table's data version is checked on every hit. A statement that is refused is never stored.

    Why an entry keyed by text holds the tree a fresh bind and plan of that text would give
    (so two different canonical trees, dpsql.plan.canonical, never share an entry): binding and
    planning are functions of the text, the parameters, the policy, the analyst (access
    rules), the dialect, the settings they read (epsilon, delta, mechanism, quantile_method,
    partition_selection, bias_estimate; confidence and bias_interval only post-process), the
    data version and the clock. All but the clock are in the key or checked on a hit; the
    clock reaches a plan only as a literal: CURRENT_DATE keys by the date, NOW() and the like
    are never keyed, and dp_predict (a model the same name can replace) never. A plan on
    "auto" bounds is planned again at run time with the bounds bought (dpsql.service.bounds),
    and keys its answer by that plan. Tested by
    tests/test_canonical_keys.py (entries against fresh plans, by canonical tree).
    """

    _PARAMETER_TYPES = (type(None), bool, int, float, str, dt.date, dt.datetime)

    def __init__(self, limit: int) -> None:
        self._items: OrderedDict[tuple, PreparedPlan] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def key(
        self, text: str, parameters: Sequence[Any] | None, settings: Settings, analyst: str
    ) -> tuple | None:
        # dp_predict reads a stored model, which the same name can replace: never cached.
        if self._limit <= 0 or "dp_predict" in text.lower() or _CLOCKED.search(text):
            return None
        params = None
        if parameters is not None:
            if not all(type(v) in self._PARAMETER_TYPES for v in parameters):
                return None
            params = tuple((type(v), repr(v)) for v in parameters)
        # The analyst is part of the key: a hit is faster than a miss, so a shared entry would
        # tell one analyst, by timing, that another ran the very same text.
        return (
            analyst,
            text,
            params,
            # CURRENT_DATE is a literal fixed at bind: a plan bound yesterday is not today's
            dt.datetime.now(dt.UTC).date() if _DATED.search(text) else None,
            repr(settings.epsilon),
            repr(settings.delta),
            settings.mechanism,
            settings.quantile_method,
            settings.partition_selection,
            settings.bias_estimate,
            settings.dialect,  # the same text means another query in another dialect
        )

    def get(self, key: tuple) -> PreparedPlan | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: tuple, item: PreparedPlan) -> None:
        with self._lock:
            self._store(key, item)

    def _store(self, key: tuple, item: PreparedPlan) -> None:
        """Keep ``item`` as the most recently used, evicting the least recent past the limit
        (the caller holds the lock)."""
        self._items[key] = item
        self._items.move_to_end(key)
        while len(self._items) > self._limit:
            self._items.popitem(last=False)

    def offer(self, key: tuple, item: PreparedPlan) -> None:
        """:meth:`put` for an entry that is cheap to rebuild (a text-shape hit: ~0.15 ms,
        against ~2.4 ms to plan a text afresh): stored while the cache has room; once it is
        full, only one offer in :data:`ADMIT_WHEN_FULL` evicts the least recently used entry.

        Why: texts that come back in a cycle longer than the cache (a dashboard fleet asking
        more (analyst, text) pairs than it holds, in turn) evict each other under plain LRU
        before any comes back, so none ever hits; admitting a few keeps most of them. The
        choice is random, not keyed by anything an analyst sends, and an entry's use never
        depends on it (a miss takes the text-shape path, which gives the same plan)."""
        with self._lock:
            full = key not in self._items and len(self._items) >= self._limit
            if full and _ADMIT.randrange(ADMIT_WHEN_FULL):
                return
            self._store(key, item)

    def discard(self, key: tuple) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)
