"""Limits on every input, checked before any work and refused free.

One analyst's statement must not be able to take a process down or hold its memory: sqlglot's
parser and dpsql's own tree walkers recurse, so 10,000 nested derived tables overflowed the C
stack (a segfault of ``dpsql serve`` and of ``dpsql.connect``), 500 nested parentheses raised a
raw RecursionError, and a 49-byte Parse message declaring ``$50000000`` allocated 400 MB.

So every statement passes three checks, each decided by the text, the parameters and the
policy only (nothing is read, nothing is charged):

1. :func:`check_text` before anything parses it: a linear token scan (regular expressions, no
   recursion) over the text outside string literals, quoted identifiers, comments and dollar
   quotes. It measures the text's size, its nesting depth (parentheses, so subqueries and
   derived tables; ``CASE ... END``; runs of prefix operators such as ``NOT NOT`` or ``- -``,
   which the parser recurses on), its number of terms (the expression count), the longest
   ``IN (...)`` list and the highest parameter number.
2. :func:`check_tree` once sqlglot has parsed it (the parser builds ``a OR b OR c ...`` and
   ``x::t::t ...`` without recursing, but as trees as deep as the chain is long, which the
   walkers that follow recurse on): the tree's depth, measured without recursion.
3. :func:`check_parameters`: how many values, their total size, and values no engine type
   holds (non-finite floats, integers beyond 64 bits) -- refused here, not after the charge.

Refusals carry SQLSTATE 54001 (statement_too_complex) for depth, 54000
(program_limit_exceeded) for sizes and counts, 22003 (numeric_value_out_of_range) for a
parameter value, the construct, its position where there is one, and the policy key that
raises the limit. Every limit is set in the policy's ``[limits]`` table (docs/server.md,
"Limits").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import sqlglot
from sqlglot.errors import TokenError
from sqlglot.tokens import TokenType

from dpsql.errors import DataError, Position, ProgrammingError

#: PostgreSQL's cap on a statement's parameters (the Bind message counts them in 16 bits).
POSTGRES_MAX_PARAMETERS = 65_535
#: Tree depth the parser and dpsql's walkers are known to handle at Python's default recursion
#: limit (tests/test_input_limits.py drives every shape to it); ``max_depth`` may not exceed it.
MAX_TREE_DEPTH = 400
#: Nodes sqlglot may put between two nesting levels the text scan counts (a derived table is
#: Subquery > Select > From > Table ...), so the tree check allows this many per level.
TREE_NODES_PER_LEVEL = 6


@dataclass(frozen=True)
class Limits:
    """The policy's ``[limits]``: what one statement may be (defaults in docs/server.md)."""

    max_query_bytes: int = 4 << 20  # UTF-8 bytes of one statement's text
    max_depth: int = 64  # nesting: parentheses, subqueries, CASE, prefix operator runs
    max_expressions: int = 250_000  # terms (names, literals, operators, parameters)
    max_in_list: int = 100_000  # values of one IN (...) list
    max_parameters: int = POSTGRES_MAX_PARAMETERS  # parameters of one statement
    max_parameter_bytes: int = 16 << 20  # their total size (text and bytes values)
    max_prepared_statements: int = 1000  # named prepared statements of one wire session
    max_result_rows: int = 1_000_000  # rows of one answer (public bins enumerated)

    @property
    def tree_depth(self) -> int:
        """The deepest parsed tree accepted (see :data:`TREE_NODES_PER_LEVEL`)."""
        return min(MAX_TREE_DEPTH, max(32, self.max_depth * TREE_NODES_PER_LEVEL))


DEFAULT_LIMITS = Limits()

#: The ``[limits]`` keys, for the policy loader's "unknown key" hint and the docs.
LIMIT_KEYS = {
    "max_query_bytes": "UTF-8 bytes of one statement's text (default 4194304)",
    "max_depth": "nesting of parentheses, subqueries, CASE and prefix operators (default 64, "
    "at most 64)",
    "max_expressions": "terms of one statement: names, literals, operators (default 250000)",
    "max_in_list": "values of one IN (...) list (default 100000)",
    "max_parameters": "parameters of one statement (default and most 65535, as PostgreSQL)",
    "max_parameter_bytes": "total size of one statement's parameter values (default 16777216)",
    "max_prepared_statements": "named prepared statements of one wire session (default 1000)",
    "max_result_rows": "rows of one answer, checked on its public bins before the charge "
    "(default 1000000)",
}
HIGHEST_LIMITS = {
    "max_depth": 64,
    "max_parameters": POSTGRES_MAX_PARAMETERS,
    "max_result_rows": 1_000_000,
}


def limits_from_section(
    section: Any, fail: Callable[[str, str, str], Exception], unknown: Callable[..., None]
) -> Limits:
    """:class:`Limits` from a policy's ``[limits]`` table. ``fail(key, problem, fix)`` builds
    the policy error; ``unknown(section, given, known)`` refuses keys it does not know."""
    if not isinstance(section, Mapping):
        raise fail("limits", "must be a table", "write a [limits] section, e.g. max_depth = 32")
    unknown("limits", section, LIMIT_KEYS)
    values: dict[str, int] = {}
    for f in fields(Limits):
        if f.name not in section:
            continue
        value = section[f.name]
        highest = HIGHEST_LIMITS.get(f.name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < 1
            or (highest is not None and value > highest)
        ):
            bound = ">= 1" if highest is None else f"from 1 to {highest}"
            raise fail(
                f"limits.{f.name}",
                f"must be an integer {bound}, got {value!r}",
                f"e.g. {f.name} = {getattr(DEFAULT_LIMITS, f.name)} (the default)",
            )
        values[f.name] = value
    return Limits(**values)


# -- 1. the text, before it is parsed ------------------------------------------------------

# The scan reads the text with sqlglot's own tokenizers (a loop, no recursion, linear), in each
# dialect a statement may be parsed in (the pipeline's DuckDB and the server's PostgreSQL for
# catalog statements), so that what it skips as a string, comment or dollar quote is exactly
# what the parser skips: a scan of its own that ended a quote elsewhere (E'\'', $$ ... $$)
# would hide nesting from the check and not from the parser.
SCAN_DIALECTS = ("duckdb", "postgres")
# Keywords and operators in a row with no operand between them are prefixes the parser may
# recurse on (INTERVAL INTERVAL ..., ARRAY ARRAY ..., @ @ ...): a run counts one level for each
# beyond FREE_RUN (ordinary SQL strings a few together: IS NOT DISTINCT FROM, LEFT OUTER JOIN).
FREE_RUN = 4
_OPENERS = frozenset({TokenType.L_PAREN, TokenType.L_BRACKET, TokenType.L_BRACE})
_CLOSERS = frozenset({TokenType.R_PAREN, TokenType.R_BRACKET, TokenType.R_BRACE})
_PUNCTUATION = _OPENERS | _CLOSERS | {TokenType.COMMA, TokenType.SEMICOLON}
_SIGNS = frozenset({TokenType.DASH, TokenType.PLUS, TokenType.TILDE})
# Tokens after which a sign is a binary operator (anything else: a prefix, counted; erring
# that way only over-counts).
_OPERAND_ENDS = _CLOSERS | {
    TokenType.VAR, TokenType.NUMBER, TokenType.STRING, TokenType.IDENTIFIER, TokenType.NULL,
    TokenType.TRUE, TokenType.FALSE, TokenType.STAR, TokenType.END, TokenType.PLACEHOLDER,
    TokenType.HEREDOC_STRING, TokenType.NATIONAL_STRING, TokenType.BYTE_STRING,
    TokenType.HEX_STRING, TokenType.BIT_STRING, TokenType.RAW_STRING,
}  # fmt: skip


@dataclass
class TextMeasure:
    """What :func:`measure_text` found: the largest of each measure, and where."""

    depth: int = 0
    depth_at: int = 0
    terms: int = 0
    in_list: int = 0
    in_list_at: int = 0
    parameter: int = 0  # the highest $n (or the number of ? marks)
    parameter_at: int = 0

    def merge(self, other: TextMeasure) -> None:
        if other.depth > self.depth:
            self.depth, self.depth_at = other.depth, other.depth_at
        self.terms = max(self.terms, other.terms)
        if other.in_list > self.in_list:
            self.in_list, self.in_list_at = other.in_list, other.in_list_at
        if other.parameter > self.parameter:
            self.parameter, self.parameter_at = other.parameter, other.parameter_at


def measure_text(text: str, dialects: Sequence[str] = SCAN_DIALECTS) -> TextMeasure:
    """Nesting depth, terms, longest IN list and highest parameter of ``text``, the largest
    over ``dialects``' tokenizations. Linear and free of recursion; quoted text and comments
    count as nothing. A text a dialect cannot tokenize is measured from its characters
    instead (every bracket, CASE, NOT and sign counted), since parts of it may still be
    parsed."""
    out = TextMeasure()
    for dialect in dialects:
        try:
            tokens = sqlglot.tokenize(text, read=dialect)
        except (TokenError, ValueError):
            out.merge(_measure_characters(text))
            continue
        out.merge(_measure_tokens(tokens))
    return out


def _measure_tokens(tokens: Sequence[Any]) -> TextMeasure:
    m = TextMeasure()
    # the open groups: [kind, commas, is a list] with kind "(" / "in" (an IN list) / "case"
    stack: list[list[Any]] = []
    prefix = 0  # the current run of prefix operators
    run = 0  # the current run of keywords and operators with no operand between them
    previous: Any = None  # the previous token's type
    question_marks = 0
    for i, token in enumerate(tokens):
        kind = token.token_type
        if kind in _OPENERS:
            is_in = previous == TokenType.IN and kind == TokenType.L_PAREN
            stack.append(["in" if is_in else "(", 0, True])
            prefix = 0
        elif kind in _CLOSERS:
            if stack and stack[-1][0] in ("(", "in"):
                group = stack.pop()
                if group[0] == "in" and group[2] and group[1] + 1 > m.in_list:
                    m.in_list, m.in_list_at = group[1] + 1, token.start
            prefix = 0
        elif kind == TokenType.COMMA:
            if stack:
                stack[-1][1] += 1
            prefix = 0
        elif kind != TokenType.SEMICOLON:
            m.terms += 1
            if kind == TokenType.CASE:
                stack.append(["case", 0, False])
            elif kind == TokenType.END and stack and stack[-1][0] == "case":
                stack.pop()
            elif kind == TokenType.SELECT and previous == TokenType.L_PAREN and stack:
                stack[-1][2] = False  # IN (SELECT ...): a subquery, not a list
            elif kind == TokenType.PLACEHOLDER and token.text == "?":
                question_marks += 1
                if question_marks > m.parameter:
                    m.parameter, m.parameter_at = question_marks, token.start
            elif kind == TokenType.PARAMETER and i + 1 < len(tokens):
                following = tokens[i + 1]
                if following.token_type == TokenType.NUMBER and following.text.isdigit():
                    number = int(following.text) if len(following.text) <= 12 else 10**12
                    if number > m.parameter:
                        m.parameter, m.parameter_at = number, token.start
            if kind == TokenType.NOT or (kind in _SIGNS and previous not in _OPERAND_ENDS):
                prefix += 1
            else:
                prefix = 0
            run = 0 if kind in _OPERAND_ENDS else run + 1
        if kind in _PUNCTUATION:
            run = 0
        previous = kind
        depth = len(stack) + max(prefix, run - FREE_RUN)
        if depth > m.depth:
            m.depth, m.depth_at = depth, token.start
    return m


def _measure_characters(text: str) -> TextMeasure:
    """Upper bounds from the characters alone (for a text a tokenizer refuses)."""
    lowered = text.lower()
    depth = (
        text.count("(")
        + text.count("[")
        + text.count("{")
        + lowered.count("case")
        + lowered.count("not")
        + sum(text.count(sign) for sign in "-+~!")
    )
    return TextMeasure(
        depth=depth,
        terms=len(text),
        in_list=text.count(",") + 1,
        parameter=max(text.count("?"), _highest_dollar(text)),
    )


def _highest_dollar(text: str) -> int:
    numbers = [m.group(1) for m in re.finditer(r"\$([0-9]+)", text)]
    return max((int(n) if len(n) <= 12 else 10**12 for n in numbers), default=0)


def check_size(text: str, limits: Limits = DEFAULT_LIMITS) -> bool:
    """Refuse a statement over ``max_query_bytes``; True when character counts alone show it
    within every other limit of :func:`check_text` (microseconds: what the wire server does on
    its event loop, leaving the full scan to the statement's own thread)."""
    check_bytes(text, limits)
    return _surely_within(text, limits)


def check_bytes(text: str, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a statement over ``max_query_bytes`` (the part of :func:`check_size` that a
    scan of the text, e.g. the wire server's classification, must come after)."""
    size = len(text)
    if size * 4 > limits.max_query_bytes:  # only then can its UTF-8 form be too long
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limits.max_query_bytes:
            raise ProgrammingError(
                f"the statement is {size} bytes long, more than the limit of "
                f"{limits.max_query_bytes}",
                sqlstate="54000",
                construct="statement",
                hint="send a shorter statement (e.g. put a long IN list into a public table "
                "or use ranges), or ask the operator to raise limits.max_query_bytes",
            )


def check_text(text: str, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a statement whose text is past a limit, before anything parses it."""
    if check_size(text, limits):
        return
    m = measure_text(text)
    if m.depth > limits.max_depth:
        raise ProgrammingError(
            f"the statement nests more than {limits.max_depth} levels deep (parentheses, "
            "subqueries, CASE, or prefix operators and keywords in a row)",
            sqlstate="54001",
            construct="nesting",
            position=_position(text, m.depth_at),
            hint="flatten the statement (join or use WITH instead of nesting subqueries, "
            "combine conditions with AND/OR), or ask the operator to raise limits.max_depth",
        )
    if m.in_list > limits.max_in_list:
        raise ProgrammingError(
            f"an IN list has {m.in_list} values, more than the limit of {limits.max_in_list}",
            sqlstate="54000",
            construct="IN",
            position=_position(text, m.in_list_at),
            hint="use ranges (BETWEEN) or a public table of the values, or ask the operator "
            "to raise limits.max_in_list",
        )
    if m.terms > limits.max_expressions:
        raise ProgrammingError(
            f"the statement has {m.terms} terms, more than the limit of {limits.max_expressions}",
            sqlstate="54001",
            construct="statement",
            hint="send a simpler statement, or ask the operator to raise limits.max_expressions",
        )
    if m.parameter > limits.max_parameters:
        raise ProgrammingError(
            f"the statement uses parameter {m.parameter}, more than the limit of "
            f"{limits.max_parameters} parameters",
            sqlstate="54000",
            construct="parameter",
            position=_position(text, m.parameter_at),
            hint=f"use at most {limits.max_parameters} parameters (PostgreSQL's cap is "
            f"{POSTGRES_MAX_PARAMETERS})",
        )


def _surely_within(text: str, limits: Limits) -> bool:
    """Bounds from counts alone (~6 us for a typical statement, against ~90 us for the two
    tokenizations): nesting is at most the opening brackets and CASEs plus the longer of every
    NOT and sign together and the longest run of keywords and operators; an IN list at most the
    commas plus one; terms at most the characters."""
    if len(text) > limits.max_expressions or text.count(",") >= limits.max_in_list:
        return False
    if "$" in text or text.count("?") > limits.max_parameters:
        return False
    lowered = text.lower()
    room = limits.max_depth - (
        text.count("(") + text.count("[") + text.count("{") + lowered.count("case")
    )
    if room < 0 or lowered.count("not") + sum(text.count(sign) for sign in "-+~!") > room:
        return False
    most = room + FREE_RUN
    return len(_CRUDE.findall(text)) <= most or _longest_run(text) <= most  # runs <= pieces


_CRUDE = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*|[0-9]+|[(),\[\]{};]|[^\sA-Za-z0-9_]")


def _longest_run(text: str) -> int:
    """At least the longest run of keywords and operators the tokenizers find: every word
    that some dialect's tokenizer knows as a keyword, and every symbol, counts; only other
    words, numbers and closing brackets end a run (brackets and commas reset it)."""
    pieces = _CRUDE.findall(text)
    if len(pieces) <= FREE_RUN:
        return len(pieces)
    keywords = _keywords()
    longest = run = 0
    for piece in pieces:
        first = piece[0]
        if (
            first in "([{,;)]}"
            or first.isdigit()
            or ((first.isalpha() or first == "_") and piece.upper() not in keywords)
        ):
            run = 0
        else:
            run += 1
            if run > longest:
                longest = run
    return longest


_KEYWORD_WORDS: frozenset[str] | None = None


def _keywords() -> frozenset[str]:
    """Every word of the scan dialects' tokenizer keywords (built once)."""
    global _KEYWORD_WORDS
    if _KEYWORD_WORDS is None:
        from sqlglot.dialects.dialect import Dialect

        words: set[str] = set()
        for name in SCAN_DIALECTS:
            for key in Dialect.get_or_raise(name).tokenizer_class.KEYWORDS:
                words.update(part.upper() for part in key.split())
        _KEYWORD_WORDS = frozenset(words)
    return _KEYWORD_WORDS


def _position(text: str, offset: int) -> Position:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return Position(line, column, offset)


# -- 2. the parsed tree ----------------------------------------------------------------------


def tree_depth(tree: Any, stop: int | None = None) -> int:
    """The depth of a sqlglot tree, without recursion; stops counting past ``stop``."""
    deepest = 0
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if stop is not None and deepest > stop:
                return deepest
        for child in node.iter_expressions():
            stack.append((child, depth + 1))
    return deepest


def check_tree(tree: Any, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a parsed statement deeper than the walkers that follow handle."""
    limit = limits.tree_depth
    if tree_depth(tree, limit) > limit:
        raise too_deep()


def too_deep() -> ProgrammingError:
    """The refusal of a parsed statement deeper than ``limits.tree_depth`` (:func:`check_tree`;
    the binder's first walk over a parsed tree checks the depth as it goes, the same test)."""
    return ProgrammingError(
        "the statement is too complex: its expressions nest too deeply (a long chain of "
        "AND/OR, arithmetic or casts counts one level per operator)",
        sqlstate="54001",
        construct="statement",
        hint="shorten the chain: use IN (...) instead of many ORs, BETWEEN instead of "
        "ANDed comparisons, or ask the operator to raise limits.max_depth",
    )


# -- 3. parameter values ---------------------------------------------------------------------

_INT64 = (-(2**63), 2**63 - 1)


def check_parameters(parameters: Sequence[Any] | None, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse too many parameters, too many bytes of them, or values no engine type holds."""
    if parameters is None:
        return
    if isinstance(parameters, Mapping):
        parameters = list(parameters.values())
    count = len(parameters)
    if count > limits.max_parameters:
        raise ProgrammingError(
            f"{count} parameters, more than the limit of {limits.max_parameters}",
            sqlstate="54000",
            construct="parameters",
            hint=f"pass at most {limits.max_parameters} values (PostgreSQL's cap is "
            f"{POSTGRES_MAX_PARAMETERS})",
        )
    total = 0
    for i, value in enumerate(parameters, 1):
        if isinstance(value, str | bytes | bytearray | memoryview):
            total += len(value)
        else:
            total += 16
        if isinstance(value, float) and not math.isfinite(value):  # numpy's floats too
            raise DataError(
                f"parameter {i} is {value!r}, not a finite number",
                sqlstate="22003",
                construct=f"parameter {i}",
                hint="pass a finite number (a float parameter cannot be infinite or NaN; "
                "'1e999' bound as a float is infinite)",
            )
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not _INT64[0] <= value <= _INT64[1]
        ):
            raise DataError(
                f"parameter {i} is out of range for a 64-bit integer",
                sqlstate="22003",
                construct=f"parameter {i}",
                hint="pass an integer between -2^63 and 2^63-1",
            )
    if total > limits.max_parameter_bytes:
        raise ProgrammingError(
            f"the parameters take {total} bytes, more than the limit of "
            f"{limits.max_parameter_bytes}",
            sqlstate="54000",
            construct="parameters",
            hint="pass smaller values, or ask the operator to raise limits.max_parameter_bytes",
        )


# -- result size -----------------------------------------------------------------------------


def check_plan_rows(plan: Any, limits: Limits = DEFAULT_LIMITS) -> None:
    """Before the reserve: a GROUP BY over public domains only releases every bin of their
    product, a number the text and the policy decide; past ``max_result_rows`` (at most the
    1,000,000 bins the release enumerates) it is refused free, not after the charge."""
    if not plan.keys or plan.threshold is not None or getattr(plan, "selection", None):
        return
    sizes = [len(kp.domain) for kp in plan.keys if kp.domain is not None]
    if len(sizes) != len(plan.keys):
        return
    rows = math.prod(sizes)
    if rows > limits.max_result_rows:
        raise ProgrammingError(
            f"the GROUP BY has {rows} public bins, more than the limit of "
            f"{limits.max_result_rows} rows in one answer",
            sqlstate="54000",
            construct="GROUP BY",
            hint="use coarser bins or fewer keys, or ask the operator to raise "
            "limits.max_result_rows (at most 1000000)",
        )


def check_parameter_count(count: int, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse a statement that declares more parameters than the limit (a wire Parse message
    with ``$50000000``), before anything is allocated per parameter."""
    if count > limits.max_parameters:
        raise ProgrammingError(
            f"the statement declares {count} parameters, more than the limit of "
            f"{limits.max_parameters}",
            sqlstate="54000",
            construct="parameters",
            hint=f"use at most {limits.max_parameters} parameters (PostgreSQL's cap is "
            f"{POSTGRES_MAX_PARAMETERS})",
        )


def too_complex() -> ProgrammingError:
    """The refusal for a statement that still ran out of Python's recursion (a construct the
    checks above do not count): decided by the text, free, and logged without a traceback."""
    return ProgrammingError(
        "the statement is too complex to process (it nests too deeply)",
        sqlstate="54001",
        construct="statement",
        hint="flatten the statement (fewer nested subqueries, functions or operators)",
    )
