"""Verified shapes found from the text alone: a statement that differs from one served by the
shape cache (dpsql.service.shape_cache) only in the digits of its WHERE slots skips parse and
bind too (~0.5-0.9 ms of a ~1 ms fixed cost on the fixture).

The text is cut by a conservative scanner into words, single-quoted strings, punctuation and
*number tokens* (``\\d+(\\.\\d+)?`` with no word character or dot on either side); any other
character (a double quote, a backtick, ``$``, ``\\``, a comment, non-ASCII) and the text is
planned the usual way. Its *skeleton* is the text with every number token replaced by a mark
and every run of blanks by one space (none at either end). Two texts with the same skeleton
tokenize alike, token for token, and differ only in the digits of number tokens, so they
parse to the same tree but for those literals' values.

An entry is learned from a statement the shape cache has just served and run: each slot
literal of its bound WHERE (the shape cache's slots) is found at its own number token (the
literal's source offset); the other number tokens (``LIMIT 5``, ``GROUP BY 1``, ``age / 10``)
stay fixed, part of what must be equal. The text is then bound once more with each slot token
replaced by a random 15-digit sentinel of its class, and the entry is kept only if that bound
query equals the fresh one but for the slots' values (the same check the shape cache makes of
planning and compiling: what a slot's value reaches, it reaches for the sentinels too). A
hit builds the bound query from the entry's, its WHERE slots swapped for the text's own
numbers, and takes the plan from the shape cache's live entry (its policy and data version
checked there, as on every shape hit).

A statement with parameters (``$n``, the wire server's extended protocol) is served the same
way when each of its WHERE slots is fed by an integer parameter (0 <= v < 10^15): which
parameter feeds which slot is found by binding the text with distinct sentinel values, then
the text is bound with sentinels in those parameters only and must equal the fresh bind but
for the slots; every other parameter, and every number token of its text, must be equal for
a hit. Anything else (a float or text parameter, a slot written as a number beside a
parameter) is parsed and bound every time.

Keyed, like both other caches, by the analyst (a hit is faster than a miss) and every
setting a plan depends on, the statement dialect included: the wire server reads PostgreSQL
(dpsql.frontend.dialect), where the same text can bind to another query (``7 / 2`` is 3), so a
skeleton is learned, re-bound with its sentinels and served in the dialect it was read in,
and never across dialects. Never reused: the secret, the budget check and charge, the noise.
"""

from __future__ import annotations

import random
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sqlglot import exp

from dpsql.frontend.bind import parse_statement
from dpsql.frontend.statements import DPQuery, to_literal
from dpsql.plan.canonical import answer_text, key_of_text, where_text
from dpsql.service.plan_cache import PreparedPlan
from dpsql.service.settings import Settings
from dpsql.service.shape_cache import SlotPaths, slot_paths, with_slots_at

if TYPE_CHECKING:
    from dpsql.service.protocol import Service

_TOKEN = re.compile(
    r"(?P<ws>\s+)|(?P<str>'(?:[^'\\]|'')*')|(?P<num>(?<![\w.])\d+(?:\.\d+)?(?![\w.]))"
    r"|(?P<word>[A-Za-z_][A-Za-z0-9_]*)|(?P<other>[0-9.(),*=<>!+\-/%;:|&^~\[\]{}])"
)
_SLOT = re.compile(r"(0|[1-9]\d{0,14})(\.\d{1,15})?")
_PLACEHOLDER = re.compile(r"\$[1-9]\d{0,3}(?![\w$])")
_RANDOM = random.SystemRandom()
_MARK = "\x00"


def scan(text: str, placeholders: bool = False) -> tuple[str, list[tuple[int, str]]] | None:
    """(skeleton, number tokens as (offset, text)), or None for text the scanner does not
    accept (it then takes the usual path). ``placeholders``: ``$n`` tokens are accepted too,
    kept in the skeleton as written (a statement with parameters)."""
    if not text.isascii() or "--" in text or "/*" in text:
        return None
    pieces: list[str] = []
    numbers: list[tuple[int, str]] = []
    pos, end = 0, len(text)
    while pos < end:
        m = _TOKEN.match(text, pos)
        if m is None and placeholders and (m := _PLACEHOLDER.match(text, pos)) is not None:
            pieces.append(m.group())
            pos = m.end()
            continue
        if m is None:
            return None
        if m.lastgroup == "num":
            numbers.append((pos, m.group()))
            pieces.append(_MARK)
        elif m.lastgroup == "ws":
            pieces.append(" ")  # any run of blanks separates tokens alike
        else:
            pieces.append(m.group())
        pos = m.end()
    return "".join(pieces).strip(" "), numbers


def _class(literal: str) -> str | None:
    m = _SLOT.fullmatch(literal)
    if m is None:
        return None
    return "d" if m.group(2) else "i"


def _sentinel(cls: str) -> str:
    if cls == "i":
        return str(_RANDOM.randrange(10**14, 10**15))
    return f"{_RANDOM.randrange(10**6, 10**7)}.{_RANDOM.randrange(10**6, 10**7)}"


def _slots(where: exp.Expression) -> list[exp.Expr]:
    from dpsql.service.shape_cache import literal_slots as shape_slots

    return [node for node, _ in shape_slots(where)]


def _with_slots(where: exp.Expression, values: list[str]) -> exp.Expression:
    from dpsql.service.shape_cache import with_literal_slots as with_slots

    return with_slots(where, [exp.Literal.number(v) for v in values])


def _where_with(where: exp.Expression, values: list[exp.Expression]) -> exp.Expression:
    from dpsql.service.shape_cache import with_literal_slots as with_slots

    return with_slots(where, values)


def _slot_parameters(parameters: Sequence[Any]) -> bool:
    """Every parameter an integer that prints as a slot literal (0 <= v < 10^15): what the
    parameter path serves; anything else is bound every time."""
    return all(type(v) is int and 0 <= v < 10**15 for v in parameters)


def _same_value(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class _Entry:
    """One learned skeleton: which number tokens are the WHERE slots (in the slots' walk
    order), the fixed ones' texts, the slots' classes, and the bound query to copy."""

    slot_tokens: tuple[int, ...]
    fixed: tuple[tuple[int, str], ...]
    classes: tuple[str, ...]
    statement: DPQuery
    shape_key: tuple
    # a statement with parameters: the parameter feeding each slot (walk order), and the
    # other parameters' values, which must be equal (none of its number tokens is a slot)
    slot_params: tuple[int, ...] = ()
    fixed_params: tuple[tuple[int, Any], ...] = ()
    # the answer key of the plans it serves, as a template around their WHERE (_answer_key)
    keys: _KeyTemplate = field(default_factory=lambda: _KeyTemplate(), compare=False)
    # where its WHERE's slots stand (_where_for)
    paths: _SlotsHeld = field(default_factory=lambda: _SlotsHeld(), compare=False)


class _KeyTemplate:
    """An entry's answer-key template: (the shape it was cut for, the canonical text before
    the WHERE, after it), the texts None where the check failed (see :func:`_answer_key`)."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: tuple[object, str | None, str | None] | None = None


class _SlotsHeld:
    """An entry's WHERE's slot paths once found: (paths,), paths None when not found again."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: tuple[SlotPaths | None] | None = None


def _where_for(entry: _Entry, values: list[exp.Expression]) -> exp.Expression:
    """The entry's WHERE with ``values`` in its slots (walk order): as :func:`_where_with`,
    the slots found by their paths, taken once per entry, rather than by a walk each time."""
    where = entry.statement.where
    assert where is not None
    held = entry.paths.held
    if held is None:
        held = (slot_paths(where),)
        entry.paths.held = held
    paths = held[0]
    if paths is None:
        return _where_with(where, values)
    return with_slots_at(where, paths, values)


def _answer_key(entry: _Entry, shape: Any, where: exp.Expression) -> str | None:
    """The answer key (dpsql.plan.canonical.answer_key) of the plan ``shape`` serves for
    ``entry``'s statement with ``where``, from a template, or None (computed in full).

    Such a plan is a function of the entry's bound statement, the shape and the WHERE alone,
    and the WHERE is written in one place of its canonical text. The template is that text cut
    around it, for a WHERE with random 15-digit sentinels in its slots, and is used only if
    the sentinels' WHERE text occurs once in it and, filled with a second set of sentinels'
    WHERE text, it equals the second plan's canonical text in full: what a slot's value
    reaches beyond the WHERE, it reaches for the sentinels too (the shape cache's own
    argument). The full key's canonical walk was ~6% of a DB-API query on the fixture."""
    held = entry.keys.held
    if held is None or held[0] is not shape:
        held = (shape, *_key_template(entry, shape))
        entry.keys.held = held
    _, before, after = held
    if before is None or after is None:
        return None
    return key_of_text(before + where_text(where) + after)


def _key_template(entry: _Entry, shape: Any) -> tuple[str | None, str | None]:
    """(canonical text before the WHERE, after it), or (None, None): see :func:`_answer_key`."""
    where = entry.statement.where
    assert where is not None
    first, second = (
        _where_with(where, [exp.Literal.number(_sentinel(cls)) for cls in entry.classes])
        for _ in range(2)
    )
    hole, other = where_text(first), where_text(second)
    text = answer_text(shape.plan_for(entry.statement.with_where(first)))
    if hole == other or text.count(hole) != 1:
        return None, None
    before, after = text.split(hole)
    if before + other + after != answer_text(shape.plan_for(entry.statement.with_where(second))):
        return None, None
    return before, after


class TextShapes:
    """Bounded LRU of skeletons (0: off); entries point into the service's shape cache."""

    def __init__(self, limit: int) -> None:
        self._items: OrderedDict[tuple, _Entry] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    @staticmethod
    def _key(
        skeleton: str, settings: Settings, analyst: str, parameters: Sequence[Any] | None = None
    ) -> tuple:
        return (
            analyst,
            skeleton,
            None if parameters is None else len(parameters),
            repr(settings.epsilon),
            repr(settings.delta),
            settings.mechanism,
            settings.quantile_method,
            settings.partition_selection,
            settings.bias_estimate,
            settings.dialect,  # the same text binds to another query in another dialect
        )

    @staticmethod
    def _usable(service: Service, text: str) -> bool:
        lowered = text.lower()
        # dp_predict reads a stored model the same name can replace; CURRENT_DATE (and the
        # like) is a literal fixed at bind, so the text alone does not say what it binds to.
        return (
            service.engine.dialect == "duckdb"
            and "dp_predict" not in lowered
            and "current" not in lowered
            and "today" not in lowered  # TODAY() is CURRENT_DATE
            and "now" not in lowered
        )

    def lookup(
        self,
        service: Service,
        text: str,
        settings: Settings,
        analyst: str,
        parameters: Sequence[Any] | None = None,
    ):
        """A prepared statement for ``text`` (with ``parameters``) from a learned skeleton,
        or None."""
        if self._limit <= 0 or not self._items or not self._usable(service, text):
            return None
        if parameters is not None and not _slot_parameters(parameters):
            return None
        scanned = scan(text, placeholders=parameters is not None)
        if scanned is None:
            return None
        skeleton, numbers = scanned
        key = self._key(skeleton, settings, analyst, parameters)
        with self._lock:
            entry = self._items.get(key)
            if entry is not None:
                self._items.move_to_end(key)
        if entry is None:
            return None
        if any(numbers[i][1] != value for i, value in entry.fixed):
            return None
        if parameters is None:
            literals = [numbers[i][1] for i in entry.slot_tokens]
            values: list[exp.Expression] = [exp.Literal.number(v) for v in literals]
        else:
            if any(not _same_value(parameters[j], v) for j, v in entry.fixed_params):
                return None
            literals = [str(parameters[j]) for j in entry.slot_params]
            values = [to_literal(parameters[j]) for j in entry.slot_params]  # as bound
        if any(_class(v) != cls for v, cls in zip(literals, entry.classes, strict=True)):
            return None
        shape = service._shapes.verified(service, entry.shape_key, entry.statement.table)
        if shape is None:
            self.discard(key)
            return None
        where = _where_for(entry, values)
        statement = replace(entry.statement.with_where(where), text=text)
        prepared: PreparedPlan = shape.prepared(
            statement, literals, _answer_key(entry, shape, where)
        )
        return prepared

    def learn(
        self,
        service: Service,
        text: str,
        statement: DPQuery,
        settings: Settings,
        analyst: str,
        shape_key: tuple,
        parameters: Sequence[Any] | None = None,
    ) -> None:
        """Remember ``text``'s skeleton, if its slots are number tokens (or, with
        ``parameters``, placeholders) and a sentinel bind agrees (see the module docstring).
        Called after the statement ran from its shape."""
        if self._limit <= 0 or statement.where is None or not self._usable(service, text):
            return
        if parameters is not None and not _slot_parameters(parameters):
            return
        scanned = scan(text, placeholders=parameters is not None)
        if scanned is None:
            return
        skeleton, numbers = scanned
        key = self._key(skeleton, settings, analyst, parameters)
        with self._lock:
            if key in self._items:
                return
        if parameters is None:
            entry = self._entry(service, text, statement, numbers, shape_key, settings.dialect)
        else:
            entry = _parameter_entry(
                service, text, statement, numbers, shape_key, settings.dialect, parameters
            )
        if entry is None:
            return
        with self._lock:
            self._items[key] = entry
            self._items.move_to_end(key)
            while len(self._items) > self._limit:
                self._items.popitem(last=False)

    @staticmethod
    def _entry(
        service: Service,
        text: str,
        statement: DPQuery,
        numbers: list[tuple[int, str]],
        shape_key: tuple,
        dialect: str,
    ) -> _Entry | None:
        assert statement.where is not None
        at = {offset: i for i, (offset, _) in enumerate(numbers)}
        slot_tokens: list[int] = []
        for node in _slots(statement.where):
            start = (node.meta or {}).get("start")
            i = at.get(start) if isinstance(start, int) else None
            if i is None or numbers[i][1] != str(node.this) or i in slot_tokens:
                return None
            slot_tokens.append(i)
        if not slot_tokens:
            return None
        classes = tuple(_class(numbers[i][1]) for i in slot_tokens)
        if any(cls is None for cls in classes):
            return None
        sentinels = [_sentinel(cls) for cls in classes]  # type: ignore[arg-type]
        swap = dict(zip(slot_tokens, sentinels, strict=True))
        pieces, pos = [], 0
        for i, (offset, literal) in enumerate(numbers):
            pieces.append(text[pos:offset])
            pieces.append(swap.get(i, literal))
            pos = offset + len(literal)
        pieces.append(text[pos:])
        try:
            # read in the statement's own dialect: the fresh bind it must equal was
            other = parse_statement("".join(pieces), service.policy, dialect=dialect)
        except Exception:  # the sentinel text is refused: this skeleton is bound every time
            return None
        where = _same_but_where(other, statement)
        if (
            where is None
            or [str(n.this) for n in _slots(where)] != sentinels
            or _with_slots(where, [numbers[i][1] for i in slot_tokens]) != statement.where
        ):
            return None
        fixed = tuple((i, literal) for i, (_, literal) in enumerate(numbers) if i not in swap)
        return _Entry(tuple(slot_tokens), fixed, classes, statement, shape_key)  # type: ignore[arg-type]

    def discard(self, key: tuple) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _same_but_where(other: object, statement: DPQuery) -> exp.Expression | None:
    """The WHERE of ``other`` (the text bound again with sentinels) when ``other`` is the
    fresh ``statement`` in all but its WHERE (same table, keys, aggregates, post-processing
    and joins), else None. Both entries (number tokens, ``$n`` parameters) ask it, then
    compare that WHERE's slots each in its own way."""
    if not isinstance(other, DPQuery) or other.where is None:
        return None
    same = (
        other.table == statement.table
        and other.keys == statement.keys
        and other.aggregates == statement.aggregates
        and other.post == statement.post
        and other.joins == statement.joins
    )
    return other.where if same else None


def _parameter_entry(
    service: Service,
    text: str,
    statement: DPQuery,
    numbers: list[tuple[int, str]],
    shape_key: tuple,
    dialect: str,
    parameters: Sequence[Any],
) -> _Entry | None:
    """The entry of a statement with parameters (``$n``), whose every WHERE slot is fed by a
    parameter: which one is found by binding the text with distinct sentinel values for all of
    them; then the text is bound again with sentinels for the slots' parameters only (the
    others keep their values, which an entry requires equal), and kept only if that bound
    query equals the fresh one but for the slots' values — the same check as for number
    tokens (see the module docstring). The text's number tokens all stay fixed."""
    assert statement.where is not None
    fresh = _slots(statement.where)
    if not fresh:
        return None
    probe = [int(_sentinel("i")) for _ in parameters]
    if len(set(probe)) != len(probe):
        return None
    try:
        other = parse_statement(text, service.policy, probe, dialect=dialect)
    except Exception:  # refused with the sentinels: bound every time
        return None
    if not isinstance(other, DPQuery) or other.where is None:
        return None
    index = {str(v): j for j, v in enumerate(probe)}
    slot_params = [index.get(str(node.this)) for node in _slots(other.where)]
    if len(slot_params) != len(fresh) or any(j is None for j in slot_params):
        return None  # a slot not fed by a parameter (a number token): not served here
    feeds = [j for j in slot_params if j is not None]
    if any(str(n.this) != str(parameters[j]) for n, j in zip(fresh, feeds, strict=True)):
        return None
    sentinels = {j: int(_sentinel("i")) for j in set(feeds)}
    if len(set(sentinels.values())) != len(sentinels):
        return None
    values = [sentinels.get(j, v) for j, v in enumerate(parameters)]
    try:
        other = parse_statement(text, service.policy, values, dialect=dialect)
    except Exception:
        return None
    where = _same_but_where(other, statement)
    if (
        where is None
        or [str(n.this) for n in _slots(where)] != [str(sentinels[j]) for j in feeds]
        or _where_with(where, [to_literal(parameters[j]) for j in feeds]) != statement.where
    ):
        return None
    fixed = tuple((i, literal) for i, (_, literal) in enumerate(numbers))
    fixed_params = tuple((j, v) for j, v in enumerate(parameters) if j not in sentinels)
    classes = ("i",) * len(feeds)
    return _Entry((), fixed, classes, statement, shape_key, tuple(feeds), fixed_params)
