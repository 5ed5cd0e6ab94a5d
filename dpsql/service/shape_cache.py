"""Per-shape plans: a statement that differs from one planned before only in the numbers its
WHERE compares with reuses that plan and its rendered engine SQL, with its own numbers.

BI tools send one shape many times with new filter values (``age > 40``, ``age > 41``, ...);
each new text costs ~2.4 ms of typing, planning, compiling and rendering, though only the
literals change. Here a *slot* is a plain number literal (``40``, ``12.5``; at most 15 digits
each side, no exponent) that is an operand of a comparison, BETWEEN or IN in the bound WHERE.

Soundness: the statement is still parsed and bound fresh every time, so every decision the
binder takes from a literal value (a key restricted by ``WHERE key IN (...)``, the conditions
on a key's columns, computed columns, HAVING/LIMIT) is compared as a value: the entry is used
only if the fresh bound table, keys, aggregates and post-processing equal the cached ones and
its WHERE equals the cached WHERE with only slot values changed. What a slot's value may still
reach is typing, planning and compiling; so when a shape comes a second time it is planned
and compiled once more with *other* numbers of the same class (random 15-digit sentinels),
and enters the cache only if the plan (cost, measures, keys, threshold) and the rendered SQL
come out equal, the sentinels swapped for the statement's own literal texts. A shape that
fails that check is planned fresh every time.

Never reused: the keyed-hash secret, the budget check and charge, the noise. Keyed, like the
plan cache, by the analyst (a hit is faster than a miss), the settings and the data version.
"""

from __future__ import annotations

import random
import re
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sqlglot import exp

from dpsql.frontend.statements import DIALECT, DPQuery
from dpsql.frontend.treeops import replace_nodes
from dpsql.lower.compile import NEUTRAL, CompiledQuery, compile_plan
from dpsql.plan.annotated import Plan
from dpsql.service.plan_cache import PreparedPlan, SecretTemplate
from dpsql.service.settings import Settings

if TYPE_CHECKING:
    from dpsql.service.protocol import Service

_SLOT = re.compile(r"(0|[1-9]\d{0,14})(\.\d{1,15})?")
_SLOT_PARENTS = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.Between, exp.In)
# Renderings a template keeps (the DuckDB engine's and the neutral one of logs and tests).
_DIALECTS = ("duckdb", NEUTRAL)
_RANDOM = random.SystemRandom()
_SEEN, _ABSENT = object(), object()


def _slot_class(node: exp.Expr) -> str | None:
    """The class of a slot literal ("i" integer, "d" decimal), None for any other node."""
    if not isinstance(node, exp.Literal) or node.is_string:
        return None
    match = _SLOT.fullmatch(str(node.this))
    if match is None:
        return None
    parent = node.parent
    if isinstance(parent, exp.Neg):
        parent = parent.parent
    if not isinstance(parent, _SLOT_PARENTS):
        return None
    return "d" if match.group(2) else "i"


def literal_slots(where: exp.Expression) -> list[tuple[exp.Expr, str]]:
    """The slot literals of ``where`` in walk order, with their class."""
    out = []
    for node in where.walk():
        cls = _slot_class(node)
        if cls is not None:
            out.append((node, cls))
    return out


def with_literal_slots(where: exp.Expression, values: list[exp.Expression]) -> exp.Expression:
    """A copy of ``where`` whose slot literals (walk order) are replaced by ``values``."""
    copy = where.copy()
    nodes = [node for node, _ in literal_slots(copy)]
    replace_nodes(zip(nodes, values, strict=True))  # linear: node.replace re-parents lists
    return copy


#: where each slot literal of a WHERE stands: per slot (walk order), the (arg key, list index or
#: None) of each node on the way down from the WHERE's root (slot_paths)
SlotPaths = tuple[tuple[tuple[str, int | None], ...], ...]


def slot_paths(where: exp.Expression) -> SlotPaths | None:
    """The paths of ``where``'s slot literals (see :data:`SlotPaths`), or None where a slot is
    not found again from the root by its path (the tree's links are not what they say)."""
    paths = []
    for slot, _ in literal_slots(where):
        path: list[tuple[str, int | None]] = []
        node: exp.Expr | None = slot
        while node is not where:
            if node is None or node.parent is None or not node.arg_key:
                return None
            held = node.parent.args.get(node.arg_key)
            path.append((node.arg_key, node.index if isinstance(held, list) else None))
            node = node.parent
        paths.append(tuple(reversed(path)))
        if _at(where, paths[-1]) is not slot:
            return None
    return tuple(paths)


def _at(root: exp.Expression, path: tuple[tuple[str, int | None], ...]) -> exp.Expr | None:
    node: Any = root
    for key, index in path:
        held = node.args.get(key)
        if index is None:
            node = held
        elif isinstance(held, list) and index < len(held):
            node = held[index]
        else:
            return None
        if not isinstance(node, exp.Expr):
            return None
    return node


def with_slots_at(
    where: exp.Expression, paths: SlotPaths, values: list[exp.Expression]
) -> exp.Expression:
    """:func:`with_literal_slots` of ``where`` whose :func:`slot_paths` are ``paths``: the
    copy's slots found by their paths (the copy has the tree's shape) rather than by a walk
    that tests every node. The copy is sqlglot's deep copy (``copy.deepcopy`` calls the same
    ``__deepcopy__``; called directly, without its memo's bookkeeping for the root)."""
    copy = where.__deepcopy__({})
    assert isinstance(copy, exp.Expression)  # a copy of where's own class
    nodes = [_at(copy, path) for path in paths]
    if not all(isinstance(node, exp.Literal) for node in nodes):
        return with_literal_slots(where, values)  # not the tree the paths were taken from
    replace_nodes(zip(nodes, values, strict=True))  # type: ignore[arg-type]
    return copy


def _sentinel(cls: str) -> str:
    if cls == "i":
        return str(_RANDOM.randrange(10**14, 10**15))
    return f"{_RANDOM.randrange(10**6, 10**7)}.{_RANDOM.randrange(10**6, 10**7)}"


class _Shape:
    """One verified shape: its plan, the bound parts compared by value, its SQL template."""

    __slots__ = (
        "compiled",
        "parts",
        "plan",
        "policy",
        "sentinels",
        "served",
        "statement",
        "version",
    )

    def __init__(
        self, plan: Plan, statement: DPQuery, compiled: CompiledQuery, sentinels: list[str]
    ) -> None:
        self.plan = plan
        self.statement = statement  # untyped, as bound: compared with each fresh one
        self.compiled = compiled  # the tree with sentinel numbers, rendered in _DIALECTS
        self.sentinels = sentinels
        self.version = plan.data_version
        self.policy: object = None  # the Service policy it was verified under
        # the first statement served from it: its post-processing (equal for every statement
        # of the shape, see matches) is planned and dry-run once, then shared
        self.served: PreparedPlan | None = None
        # the keys and aggregates plan_for last typed (as given), and what it made of them
        self.parts: tuple[tuple, tuple, tuple, tuple, tuple] | None = None

    def matches(self, statement: DPQuery) -> bool:
        old = self.statement
        return (
            (statement.table is old.table or statement.table == old.table)
            and statement.keys == old.keys
            and statement.aggregates == old.aggregates
            and statement.post == old.post
        )

    def plan_for(self, statement: DPQuery) -> Plan:
        """The plan of ``statement``: this shape's, with the statement's own query. Its typed
        keys, key plans and outputs are made from the statement's keys and aggregates alone,
        so they are made again only when those are other objects than last time (a text
        shape's statements share their entry's: dpsql.service.text_shapes)."""
        parts = self.parts
        if parts is None or parts[0] is not statement.keys or parts[1] is not statement.aggregates:
            keys = tuple(
                replace(fresh, type=typed.type)
                for fresh, typed in zip(statement.keys, self.plan.query.keys, strict=True)
            )
            key_plans = tuple(
                replace(kp, key=k) for kp, k in zip(self.plan.keys, keys, strict=True)
            )
            outputs = tuple(
                replace(o, call=c)
                for o, c in zip(self.plan.outputs, statement.aggregates, strict=True)
            )
            parts = (statement.keys, statement.aggregates, keys, key_plans, outputs)
            self.parts = parts
        _, _, keys, key_plans, outputs = parts
        return self.plan.with_(query=statement.with_keys(keys), keys=key_plans, outputs=outputs)

    def prepared(
        self, statement: DPQuery, literals: list[str], fingerprint: str | None = None
    ) -> PreparedPlan:
        """The prepared statement of ``statement``: :meth:`plan_for`, its SQL template with
        the statement's ``literals``, and the shape's shared post-processing. ``fingerprint``:
        its plan's answer key, where the caller knows it (dpsql.service.text_shapes)."""
        prepared = PreparedPlan(self.plan_for(statement), fingerprint)
        swaps = tuple(zip(self.sentinels, literals, strict=True))
        prepared.template = SecretTemplate(self.compiled.with_literals(swaps))
        served = self.served
        if served is None:
            self.served = prepared
        else:
            prepared.post = served.post
            prepared.post_checked = served.post_checked
        return prepared


class ShapeCache:
    """Bounded LRU of verified shapes (0: off)."""

    def __init__(self, limit: int) -> None:
        # None: a shape whose numbers reach the bound query or the plan (planned fresh);
        # _SEEN: met once (a shape is verified when it comes again, so that statements seen
        # only once never pay for the second planning)
        self._items: OrderedDict[tuple, _Shape | object | None] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def _key(
        self,
        service: Service,
        statement: DPQuery,
        settings: Settings,
        analyst: str,
    ) -> tuple[tuple, list[str]] | None:
        """The shape key of ``statement`` and its slot literals' texts, or None (no slot)."""
        if self._limit <= 0 or statement.where is None or service.engine.dialect != "duckdb":
            return None
        if "dp_predict" in statement.text.lower():  # a stored model the name can replace
            return None
        slots = literal_slots(statement.where)
        if not slots:
            return None
        marked = with_literal_slots(statement.where, [exp.Placeholder() for _ in slots])
        key = (
            analyst,
            statement.table.name,
            marked.sql(dialect=DIALECT),
            tuple(cls for _, cls in slots),
            repr(settings.epsilon),
            repr(settings.delta),
            settings.mechanism,
            settings.quantile_method,  # both reach the plan (MEDIAN's mechanism, selection)
            settings.partition_selection,
            settings.bias_estimate,
        )
        return key, [str(node.this) for node, _ in slots]

    def lookup(
        self, service: Service, statement: DPQuery, settings: Settings, analyst: str
    ) -> PreparedPlan | None:
        """A prepared statement from a verified shape, or None (plan it fresh)."""
        found = self._key(service, statement, settings, analyst)
        if found is None:
            return None
        key, literals = found
        with self._lock:
            shape = self._items.get(key)
            if key in self._items:
                self._items.move_to_end(key)
        if not isinstance(shape, _Shape):
            return None
        if shape.policy is not service.policy or shape.version != service.data_version(
            statement.table
        ):
            self.discard(key)
            return None
        if not shape.matches(statement):
            self._put(key, None)  # e.g. WHERE age > 5 GROUP BY age: the key holds the number
            return None
        prepared = shape.prepared(statement, literals)
        prepared.shape_key = key
        return prepared

    def verified(self, service: Service, key: tuple, table: Any) -> _Shape | None:
        """The live verified shape under ``key`` (dpsql.service.text_shapes), if its policy
        and data version are still the service's; None otherwise."""
        with self._lock:
            shape = self._items.get(key)
            if isinstance(shape, _Shape):
                self._items.move_to_end(key)
        if not isinstance(shape, _Shape):
            return None
        if shape.policy is not service.policy or shape.version != service.data_version(table):
            self.discard(key)
            return None
        return shape

    def _put(self, key: tuple, shape: _Shape | object | None) -> None:
        with self._lock:
            self._items[key] = shape
            self._items.move_to_end(key)
            while len(self._items) > self._limit:
                self._items.popitem(last=False)

    def learn(
        self,
        service: Service,
        prepared: PreparedPlan,
        statement: DPQuery,
        settings: Settings,
        analyst: str,
    ) -> None:
        """Verify ``statement``'s shape with sentinel numbers and keep it if it holds.

        ``prepared`` is the statement's fresh plan; its template is built here (the first run
        would build it anyway), so the comparison is with what this run executes.
        """
        found = self._key(service, statement, settings, analyst)
        if found is None or statement.where is None:
            return
        key, literals = found
        with self._lock:
            known = self._items.get(key, _ABSENT)
        if known is None:
            return  # known not to hold
        if known is _ABSENT:
            self._put(key, _SEEN)
            return
        shape = self._verified(service, prepared, statement, settings, analyst, key, literals)
        self._put(key, shape)

    def _verified(
        self,
        service: Service,
        prepared: PreparedPlan,
        statement: DPQuery,
        settings: Settings,
        analyst: str,
        key: tuple,
        literals: list[str],
    ) -> _Shape | None:
        """The shape of ``statement`` if a second planning with sentinels agrees, else None."""
        assert statement.where is not None
        plan = prepared.plan
        classes = key[3]
        sentinels = [_sentinel(cls) for cls in classes]
        try:
            where = with_literal_slots(statement.where, [exp.Literal.number(s) for s in sentinels])
            other = service.plan(statement.with_where(where), settings, analyst)
            if other.with_(query=plan.query, keys=plan.keys, outputs=plan.outputs) != plan:
                return None  # a slot's value reached the plan: this shape is planned fresh
            if prepared.template is None:
                prepared.template = SecretTemplate.build(plan)
            concrete = prepared.template.compiled
            template = compile_plan(other, 0)
            for dialect in _DIALECTS:
                text, shown = concrete.render(dialect), template.render(dialect)
                if any(s in text for s in sentinels) or not all(s in shown for s in sentinels):
                    return None
            swaps = tuple(zip(sentinels, literals, strict=True))
            swapped = template.with_literals(swaps)
            same = (
                swapped.key_columns == concrete.key_columns
                and swapped.measure_columns == concrete.measure_columns
                and all(swapped.render(d) == concrete.render(d) for d in _DIALECTS)
                and all(swapped._pieces[d] == concrete._pieces[d] for d in _DIALECTS)
                # the quantiles' and distinct counts' queries read the same WHERE
                and len(swapped.extras) == len(concrete.extras)
                and all(
                    a.render(d) == b.render(d)
                    for a, b in zip(swapped.extras, concrete.extras, strict=True)
                    for d in _DIALECTS
                )
            )
        except Exception:  # the sentinel statement was refused or failed: no template
            return None
        if not same:
            return None
        shape = _Shape(plan, statement, template, sentinels)
        shape.policy = service.policy
        return shape

    def discard(self, key: tuple) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        """How many shapes are verified (tests)."""
        with self._lock:
            return sum(isinstance(v, _Shape) for v in self._items.values())


def shape_of(prepared: PreparedPlan) -> Any:
    """What a cached and a fresh plan must share (tests): SQL, cost, fingerprint."""
    compiled = prepared.template.compiled if prepared.template else compile_plan(prepared.plan, 0)
    return (compiled.with_secret(7).render("duckdb"), prepared.plan.cost, prepared.fingerprint)
