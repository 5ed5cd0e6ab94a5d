"""Bind analyst SQL to the policy: sqlglot AST -> :class:`BoundQuery`, or a refusal.

Binding is the trust boundary's first half. It accepts exactly the constructs listed in
grammar_notes.md and refuses everything else *before any data is read*, with an error that
names the construct, its position and what to do instead. Nothing here touches an engine.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import sqlglot
from sqlglot import exp
from sqlglot.dialects.duckdb import DuckDB
from sqlglot.errors import ParseError, TokenError
from sqlglot.tokens import Token, TokenType

from dpsql.aggregates import KINDS, QUANTILE_KINDS
from dpsql.errors import (
    DataError,
    Position,
    PrivacyError,
    ProgrammingError,
    SQLSyntaxError,
    UndefinedColumnError,
    UndefinedTableError,
)
from dpsql.frontend.compose import ReleasedFilter, split_released_filter
from dpsql.frontend.inline import Wrapped, compose_post, flatten_relations
from dpsql.frontend.intervals import NotNumeric, Range, value_range
from dpsql.frontend.joins import JOINED, PUBLIC_VALUES, resolve_joins
from dpsql.frontend.logic import conjuncts
from dpsql.frontend.per_unit import groups_by_unit
from dpsql.frontend.private_joins import resolve_private_joins
from dpsql.frontend.released import split_released_tables
from dpsql.frontend.rewrite import normalise, timestamp_literals
from dpsql.frontend.scopes import shadow_policy_tables
from dpsql.limits import check_tree, too_complex
from dpsql.policy import ColumnPolicy, Policy, TablePolicy, default_granularity
from dpsql.sql.dialect import DUCKDB, ColumnTypes, check_dialect, reader, to_engine_semantics
from dpsql.sql.positions import (
    _tokens,
    forget_tokens,
    offset_position,
    position_of,
    reading,
    snippet,
    written_name,
)
from dpsql.sql.statements import (  # the bound tree's values (re-exported for the doors)
    AGGREGATE_KINDS,
    DIALECT,
    ERROR_BAR_FUNCTIONS,
    POST_WINDOW_FUNCTIONS,
    RELEASED,
    SCALAR_NODES,
    AggregateCall,
    BoundQuery,
    CompositeQuery,
    ExplainStatement,
    GroupKey,
    PublicSelect,
    ReleasedQuery,
    RuleListCall,
    SettingStatement,
    Statement,
    TransactionStatement,
    to_literal,
)
from dpsql.table_functions import TABLE_FUNCTIONS, result_columns

logging.getLogger("sqlglot").setLevel(logging.ERROR)

REFUSED_STATEMENTS: dict[type[exp.Expression], str] = {
    exp.Insert: "INSERT",
    exp.Update: "UPDATE",
    exp.Delete: "DELETE",
    exp.Create: "CREATE",
    exp.Drop: "DROP",
    exp.Alter: "ALTER",
    exp.Merge: "MERGE",
    exp.TruncateTable: "TRUNCATE",
    exp.Pragma: "PRAGMA",
    exp.Attach: "ATTACH",
    exp.Detach: "DETACH",
    exp.Copy: "COPY",
    exp.Install: "INSTALL",
    exp.Use: "USE",
    exp.Describe: "DESCRIBE",
}

FILE_READERS = (
    "read_csv",
    "read_csv_auto",
    "read_parquet",
    "parquet_scan",
    "read_json",
    "read_json_auto",
    "read_text",
    "read_blob",
    "glob",
    "sniff_csv",
    "read_ndjson",
    "iceberg_scan",
    "delta_scan",
)


def _refuse(
    cls: type[ProgrammingError], message: str, node: exp.Expr | None, text: str, hint: str
) -> ProgrammingError:
    construct = snippet(node) if node is not None else None
    return cls(message, construct=construct, position=position_of(node, text), hint=hint)


def parse_statement(
    text: str,
    policy: Policy,
    parameters: Sequence[Any] | None = None,
    models: Callable[[str], Any] | None = None,
    access: Any = None,
    dialect: str = DUCKDB,
) -> Statement:
    """Parse and bind one statement of analyst SQL.

    ``dialect`` (dpsql.sql.dialect): the grammar and semantics ``text`` is read in, "duckdb"
    (the DB-API's and CLI's default) or "postgres" (the wire server: ``7 / 2`` is 3).

    ``access`` (dpsql.access.Access): the analyst's restrictions, checked on the parsed tree
    before anything is bound (None: the analyst may query every table and column).

    ``models`` resolves ``dp_predict('name')`` among the analyst's stored models
    (dpsql.models.store); without it dp_predict is an unknown function.
    """
    _check_unicode(text, parameters)
    dialect = check_dialect(dialect)
    forget_tokens()
    reading(text, dialect)  # refusals quote the analyst's own text (dpsql.sql.positions)
    head = _first_word(text)
    if head in ("SHOW", "RESET"):
        return _setting_command(head, text)
    if head == "EXPLAIN":
        start = sqlglot.tokenize(text, read=dialect)[0].end + 1  # after the keyword
        fmt = "table"
        option = _EXPLAIN_OPTION.match(text, start)
        if option is not None:
            fmt = option.group(1).lower()
            start = option.end()
        elif text[start:].lstrip().startswith("("):
            raise SQLSyntaxError(
                "EXPLAIN takes (FORMAT TEXT) or (FORMAT TABLE)",
                construct="EXPLAIN",
                position=offset_position(text, start),
                hint="EXPLAIN (FORMAT TEXT) SELECT ...",
            )
        # Blank out the keyword instead of cutting it, so refusals point into ``text``.
        inner = "".join(c if c == "\n" else " " for c in text[:start]) + text[start:]
        bound = parse_statement(inner, policy, parameters, models, access, dialect)
        if not isinstance(bound, BoundQuery | RuleListCall | CompositeQuery | ReleasedQuery):
            raise ProgrammingError(
                "EXPLAIN takes a DP SELECT query", construct="EXPLAIN", hint="EXPLAIN SELECT ..."
            )
        return ExplainStatement(bound, fmt)
    tree = _statement_tree(text, policy, parameters, models, dialect)
    return bind_tree(tree, text, policy, access)


def _statement_tree(
    text: str,
    policy: Policy,
    parameters: Sequence[Any] | None,
    models: Callable[[str], Any] | None,
    dialect: str,
) -> exp.Expr:
    """The one statement of ``text``, parsed and checked, with its parameters substituted and
    the dialect's meaning made explicit: what :func:`bind_tree` binds."""
    statements: list[exp.Expr] | None
    try:
        statements = _parse(text, dialect)
    except RecursionError:  # a construct the limits do not count (dpsql.limits): 54001, free
        raise too_complex() from None
    except (ParseError, TokenError) as exc:
        statements = _top_statements(text)
        if statements is None:
            raise _syntax_error(exc, text) from None
    if not statements:
        raise SQLSyntaxError("empty query", hint="send one SELECT statement")
    if len(statements) > 1:
        raise _refuse(
            PrivacyError,
            "several statements in one query",
            statements[1],
            text,
            "send one statement at a time",
        )
    tree = statements[0]
    check_tree(tree, policy.limits)  # before the walkers below recurse on it (54001)
    # sqlglot keeps comments on nodes and renders them again: drop them, so no analyst text
    # but validated expressions ever reaches the engine SQL.
    for node in tree.walk():
        node.comments = None
        if node._meta:  # positions: copied with the node (sqlglot deep-copies every meta dict)
            node._meta = ShallowMeta(node._meta)
    if parameters is not None:
        tree = _substitute_parameters(tree, parameters, text)
    elif tree.find(exp.Placeholder, exp.Parameter):
        raise _refuse(
            ProgrammingError,
            "the query has parameter placeholders but no parameters were given",
            tree.find(exp.Placeholder, exp.Parameter),
            text,
            "pass the values as execute(sql, parameters)",
        )
    # the dialect's meaning made explicit (PostgreSQL's integer division: ``//``) before
    # anything is bound, so no later step can lose it (dpsql.sql.dialect)
    tree = to_engine_semantics(tree, dialect, _column_types(policy))
    if models is not None and "dp_predict" in text.lower():
        from dpsql.models.predict import expand_predictions

        # The model is the analyst's own released value: its CASE is query text like any
        # other, bound and checked by the same rules (it reads no data).
        tree = expand_predictions(tree, models, text=text)
    return tree


# -- column probes of a relation ---------------------------------------------------------------

# A top-level LIMIT 0 or LIMIT 1 somewhere in the text: only such texts are parsed as a probe.
_PROBE_LIMIT = re.compile(r"\blimit\s+[01]\b", re.IGNORECASE)
PROBE_ALIAS = "__dpsql_probe"


@dataclass(frozen=True)
class RelationProbe:
    """``<relation> LIMIT 0`` or ``LIMIT 1`` where the relation is row-level and reads private
    rows: a BI tool learning its columns (Superset saving a virtual dataset sends the dataset
    SQL with LIMIT 1). It is answered with its columns and no row, ever: a row would be data.

    ``query`` is ``SELECT COUNT(*)`` over the relation, bound like any query: the probe is
    accepted exactly when that query is (the same access rules, joins, whitelist and typing),
    and each refusal of the relation is the probe's. ``relation`` is the analyst's relation
    with ``LIMIT 0``, in the engine's dialect: the schema-only binder (dpsql.sql.typecheck,
    empty tables) names and types its columns; nothing data-dependent goes into either.
    """

    relation: exp.Select
    query: BoundQuery


def parse_probe(
    text: str,
    policy: Policy,
    parameters: Sequence[Any] | None = None,
    models: Callable[[str], Any] | None = None,
    access: Any = None,
    dialect: str = DUCKDB,
) -> RelationProbe | None:
    """``text`` as a column probe of an accepted relation over private rows; None when it is
    not one (a DP query, a public query, any other statement: bind it as usual). A probe of
    a relation that would be refused raises that refusal."""
    if _PROBE_LIMIT.search(text) is None or _first_word(text) not in ("SELECT", "WITH"):
        return None
    _check_unicode(text, parameters)
    dialect = check_dialect(dialect)
    forget_tokens()
    reading(text, dialect)
    tree = _statement_tree(text, policy, parameters, models, dialect)
    if isinstance(tree, exp.Select):
        tree = _unwrapped_probe(tree, policy)
    if not isinstance(tree, exp.Select) or not (
        _probe_shape(tree) or _per_unit_probe_shape(tree, policy)
    ):
        return None
    relation = tree.copy()
    for arg in ("limit", "offset", "order"):
        relation.set(arg, None)
    inner = relation.copy()
    with_ = inner.args.get("with_")
    inner.set("with_", None)
    # every column of the relation, named so that it is one (an unnamed expression, two
    # columns of one name in a join): the names answered are the relation's own, below
    items: list[exp.Expr] = []
    for i, item in enumerate(inner.expressions):
        if _is_star_item(item):
            items.append(item)
        else:
            value = item.this if isinstance(item, exp.Alias) else item
            items.append(exp.alias_(value, f"__dpsql_c{i}"))
    inner.set("expressions", items)
    wrapper = exp.Select(expressions=[exp.Count(this=exp.Star())]).from_(
        exp.Subquery(this=inner, alias=exp.TableAlias(this=exp.to_identifier(PROBE_ALIAS)))
    )
    if with_ is not None:
        wrapper.set("with_", with_)
    bound = bind_tree(wrapper, text, policy, access)
    if not isinstance(bound, BoundQuery) or bound.table.public:
        return None  # reads no private row: a public query, answered as one
    relation.set("limit", exp.Limit(expression=exp.Literal.number(0)))
    for table in relation.find_all(exp.Table):  # the shadow's tables have no schema
        if policy.table(table.name) is not None:
            table.set("db", None)
            table.set("catalog", None)
    return RelationProbe(relation, bound)


def _probe_shape(tree: exp.Select) -> bool:
    """A top-level LIMIT 0 or 1 over a relation that aggregates nowhere: a wrapper over a DP
    subquery, a key set (DISTINCT, GROUP BY) or a table function is a DP query, and its LIMIT
    keeps released rows."""
    limit = tree.args.get("limit")
    value = limit.expression if isinstance(limit, exp.Limit) else None
    if not (isinstance(value, exp.Literal) and not value.is_string and value.this in ("0", "1")):
        return False
    if tree.find(exp.AggFunc, exp.Group, exp.Having, exp.Distinct) is not None:
        return False
    return not any(isinstance(t.this, exp.Anonymous) for t in tree.find_all(exp.Table))


def _unwrapped_probe(tree: exp.Select, policy: Policy) -> exp.Select:
    """``SELECT * FROM (<per-unit relation>) AS v LIMIT 0|1`` (a BI tool's probe of a virtual
    dataset, wrapped) is the probe of the relation itself: the same columns, no row. Any other
    statement is returned as it is."""
    source = tree.args.get("from_")
    inner = source.this if isinstance(source, exp.From) else None
    if not (
        isinstance(inner, exp.Subquery)
        and isinstance(inner.this, exp.Select)
        and len(tree.expressions) == 1
        and isinstance(tree.expressions[0], exp.Star)
        and not any(
            tree.args.get(arg)
            for arg in ("joins", "where", "group", "having", "distinct", "with_", "offset")
        )
        and inner.this.args.get("limit") is None
    ):
        return tree
    candidate = inner.this.copy()
    limit = tree.args.get("limit")
    candidate.set("limit", limit.copy() if limit is not None else None)
    return candidate if _per_unit_probe_shape(candidate, policy) else tree


def _per_unit_probe_shape(tree: exp.Select, policy: Policy) -> bool:
    """A top-level LIMIT 0 or 1 over a per-unit relation (a policy table grouped by its
    privacy unit: one private row per unit, dpsql.frontend.per_unit), without CTEs: private
    rows like a row-level relation's (Superset 6.1 saving a virtual dataset of one row per
    patient sends its SQL with LIMIT 1), so its probe is answered with its columns, where a
    DP query's LIMIT is not; wrapped in ``SELECT * FROM (…) AS v LIMIT 0`` too
    (:func:`_unwrapped_probe`)."""
    limit = tree.args.get("limit")
    value = limit.expression if isinstance(limit, exp.Limit) else None
    if not (isinstance(value, exp.Literal) and not value.is_string and value.this in ("0", "1")):
        return False
    if tree.args.get("with_") is not None or tree.args.get("distinct") is not None:
        return False
    relation = tree.copy()
    for arg in ("limit", "offset", "order"):
        relation.set(arg, None)
    return groups_by_unit(relation, policy)


_READER = DuckDB()


def _column_types(policy: Policy) -> ColumnTypes:
    def types(table: str | None, column: str) -> set[str]:
        found = [policy.table(table)] if table is not None else list(policy.tables.values())
        return {t.columns[column].type for t in found if t is not None and column in t.columns}

    return types


class ShallowMeta(dict):
    """A parsed node's meta (its positions, and markers the frontend adds): sqlglot deep-copies
    the meta of every node it copies, through :func:`copy.deepcopy`, which costs more than
    copying the node itself. Its values are ints and tuples, or lists that are replaced and
    never changed in place, so a shallow copy is a deep one."""

    def __deepcopy__(self, memo: dict) -> ShallowMeta:
        return ShallowMeta(self)


def _parse(text: str, dialect: str = DUCKDB) -> list[exp.Expr]:
    """The statements of ``text`` in ``dialect``'s grammar, the n-th ``?`` placeholder *in the text*
    read as ``$n`` (the tree's own order visits LIMIT before WHERE, so parameters bind in text
    order). The tokens are renumbered, not the text, so every position stays where it was."""
    read = _READER if dialect == DUCKDB else reader(dialect)
    tokens = read.tokenize(text)
    if any(t.token_type == TokenType.PLACEHOLDER and t.text == "?" for t in tokens):
        tokens = list(_numbered_placeholders(tokens))
    return [s for s in read.parser().parse(tokens, text) if s is not None]


def _numbered_placeholders(tokens: list[Token]) -> Iterator[Token]:
    n = 0
    for t in tokens:
        if t.token_type == TokenType.PLACEHOLDER and t.text == "?":
            n += 1
            yield Token(TokenType.PARAMETER, "$", t.line, t.col, t.start, t.start)
            yield Token(TokenType.NUMBER, str(n), t.line, t.col, t.start, t.end)
        else:
            yield t


_EXPLAIN_OPTION = re.compile(r"\s*\(\s*(?:FORMAT\s+)?(TEXT|TABLE)\s*\)", re.IGNORECASE)
_TOP = re.compile(r"^\s*SELECT\s+(DISTINCT\s+)?TOP\s*\(?\s*\d+\s*\)?\s", re.IGNORECASE)


def _top_statements(text: str) -> list[exp.Expr] | None:
    """``SELECT TOP n ...`` (SQL Server, Tableau, Power BI): parsed as T-SQL, where TOP is a
    LIMIT; any other text that DuckDB's grammar refuses stays a syntax error."""
    if _TOP.match(text) is None:
        return None
    try:
        statements = [s for s in sqlglot.parse(text, read="tsql") if s is not None]
    except (ParseError, TokenError):
        return None
    if len(statements) != 1 or not isinstance(statements[0], exp.Select):
        return None
    return statements


def _check_unicode(text: str, parameters: Sequence[Any] | None) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate such as U+DC80), before parsing.

    Such text cannot be stored, logged or sent back: if it reached the ledger it would fail
    *after* the engine ran, so it is refused here, where a refusal is free.
    """
    pieces = [("query text", text)]
    pieces += [
        (f"parameter {i + 1}", p) for i, p in enumerate(parameters or ()) if isinstance(p, str)
    ]
    for what, piece in pieces:
        try:
            piece.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SQLSyntaxError(
                f"the {what} is not valid Unicode (a lone surrogate code point)",
                sqlstate="22021",
                construct=what,
                position=offset_position(text, exc.start) if what == "query text" else None,
                hint="send UTF-8 text; remove or replace the invalid character",
            ) from None


def _key_position(item: exp.Expression, text: str) -> Position | None:
    """``position_of(item, text)``, without tokenizing the text for a column or a number: the
    earliest start recorded on it is its first token's own, which position_of keeps."""
    if isinstance(item, exp.Column) or (isinstance(item, exp.Literal) and not item.is_string):
        starts = [
            start
            for node in item.walk()
            if (start := (getattr(node, "_meta", None) or {}).get("start")) is not None
        ]
        if starts:
            return offset_position(text, min(starts))
    return position_of(item, text)


def _first_word(text: str) -> str:
    # A text that starts with the word SELECT or WITH needs no tokenizing (~0.15 ms): that
    # word is its first token (the tokenizer has no longer keyword starting with either).
    # Anything else (a comment first, SHOW, INSERT, ...) asks the tokenizer.
    plain = _PLAIN_HEAD.match(text)
    if plain is not None and plain.group(1).upper() in ("SELECT", "WITH"):
        return plain.group(1).upper()
    tokens = _tokens(text)  # cached: position_of tokenizes the same text again
    return tokens[0].text.upper() if tokens else ""


_PLAIN_HEAD = re.compile(r"[ \t\r\n]*([A-Za-z_][A-Za-z0-9_]*)(?![A-Za-z0-9_$])")


def _syntax_error(exc: Exception, text: str) -> SQLSyntaxError:
    errors = getattr(exc, "errors", None) or []
    position = None
    description = str(exc).splitlines()[0] if str(exc) else "syntax error"
    if errors:
        first = errors[0]
        description = first.get("description") or description
        line, col = first.get("line"), first.get("col")
        if line and col:
            lines = text.splitlines() or [""]
            offset = sum(len(x) + 1 for x in lines[: line - 1]) + max(col - 1, 0)
            position = offset_position(text, min(offset, len(text)))
    # sqlglot names its classes ("missing for <class 'sqlglot.expressions.And'>"): say the SQL
    description = re.sub(
        r"for <class '[\w.]*?(\w+)'>", lambda m: "after " + m.group(1).upper(), description
    )
    return SQLSyntaxError(
        f"syntax error: {description}",
        construct="SQL text",
        position=position,
        hint="dpsql reads DuckDB/PostgreSQL-style SELECT statements; see `dpsql help grammar`",
    )


def _setting_command(head: str, text: str) -> SettingStatement:
    # tokens, not text.split(): comments are not words
    words = [t.text for t in sqlglot.tokenize(text, read=DIALECT) if t.text != ";"]
    if head.lower() == "show" and [w.lower() for w in words[1:]] == ["budget", "wide"]:
        return SettingStatement("show", "budget_wide")  # SHOW budget WIDE: every figure
    if len(words) != 2:
        raise SQLSyntaxError(
            f"{head} takes one setting name", construct=head, hint=f"{head} epsilon"
        )
    return SettingStatement(head.lower(), words[1].lower())


def _substitute_parameters(tree: exp.Expr, params: Sequence[Any], text: str):
    """Replace ``$n`` placeholders (``?`` is read as ``$n``, see _parse) by literals; values
    never become SQL text unescaped."""

    def replace(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Placeholder):
            index = int(node.this) - 1 if node.this else len(params)
        elif isinstance(node, exp.Parameter):
            inner = node.this.this if isinstance(node.this, exp.Expression) else node.this
            index = int(inner) - 1
        else:
            return node
        if not 0 <= index < len(params):
            raise _refuse(
                ProgrammingError,
                f"parameter {index + 1} has no value ({len(params)} given)",
                node,
                text,
                "pass one value per placeholder",
            )
        return to_literal(params[index])

    return tree.transform(replace, copy=True)


def bind_tree(tree: exp.Expr, text: str, policy: Policy, access: Any = None) -> Statement:
    for cls, name in REFUSED_STATEMENTS.items():
        if isinstance(tree, cls):
            raise _refuse(
                PrivacyError,
                f"{name} statements are not allowed: dpsql only answers aggregate SELECT queries",
                tree,
                text,
                "send a SELECT with COUNT/SUM/AVG; data and configuration cannot be changed",
            )
    if isinstance(tree, exp.Transaction | exp.Commit | exp.Rollback):
        kind = {exp.Transaction: "begin", exp.Commit: "commit", exp.Rollback: "rollback"}
        return TransactionStatement(kind[type(tree)])
    if isinstance(tree, exp.Set):
        return _set_statement(tree, text)
    if isinstance(tree, exp.Command):
        word = str(tree.this).upper()
        raise _refuse(
            PrivacyError,
            f"{word} statements are not allowed",
            tree,
            text,
            "dpsql only answers aggregate SELECT queries (and SET/SHOW/RESET of privacy settings)",
        )
    if isinstance(tree, exp.Select | exp.SetOperation):
        released = _released_tables(tree, text, policy, access)
        if released is not None:
            return released
    if isinstance(tree, exp.SetOperation):
        raise _refuse(
            PrivacyError,
            f"{type(tree).__name__.upper()} of queries is not supported",
            tree,
            text,
            "send each SELECT separately; each is charged on its own",
        )
    if not isinstance(tree, exp.Select):
        raise _refuse(
            PrivacyError,
            # the statement's own keyword: CHECKPOINT parses as a Column, DEALLOCATE as an Alias
            f"{_first_word(text) or type(tree).__name__} statements are not allowed",
            tree,
            text,
            "send an aggregate SELECT query",
        )
    tree = normalise(tree)
    assert isinstance(tree, exp.Select)  # normalise keeps the root: a Select stays a Select
    # names first: a CTE shadows the policy table of its name in every construct below
    tree = cast(exp.Select, shadow_policy_tables(tree, policy))
    if access is not None:  # authorization: decided by the text and the policy (dpsql.access)
        access.check(tree, text, policy, TABLE_FUNCTIONS)
    tree, policy = resolve_private_joins(tree, text, policy)
    tree = resolve_joins(tree, text, policy)
    split = split_released_filter(tree, text)
    if split is not None:
        return _composite(split, text, policy)
    flat, policy = flatten_relations(tree, text, policy, bind_select)  # + per-unit tables
    if isinstance(flat, Wrapped):
        inner = _Binder(flat.inner, text, policy).bind()
        if not isinstance(inner, BoundQuery):
            raise _refuse(
                PrivacyError,
                "the subquery reads no table",
                flat.inner,
                text,
                "aggregate a table declared in the policy inside the subquery",
            )
        return replace(inner, post=compose_post(flat.outer, inner.post, flat.alias))
    return _Binder(flat, text, policy).bind()


def _released_tables(
    tree: exp.Select | exp.SetOperation, text: str, policy: Policy, access: Any
) -> ReleasedQuery | None:
    """Several DP queries combined by post-processing (set operations, joins of released
    results, CTE chains, scalar subqueries): each measurement bound on its own (the same
    rules, access included), the post tree kept for the released tables only."""
    scoped = shadow_policy_tables(tree, policy)
    split = split_released_tables(scoped, text, policy)
    if split is None:
        return None
    if access is not None:
        access.check(scoped, text, policy, TABLE_FUNCTIONS)
    measurements = []
    for select in split.measurements:
        bound = bind_tree(select, text, policy, access)
        if not isinstance(bound, BoundQuery):
            raise _refuse(
                PrivacyError,
                "each query combined by post-processing must be a DP query over one table",
                select,
                text,
                "SELECT k, COUNT(*) FROM t GROUP BY k (a DP subquery filter or a table "
                "function runs as a query of its own)",
            )
        measurements.append(bound)
    return ReleasedQuery(text, tuple(measurements), split.names, split.post, split.operations)


def _composite(split: ReleasedFilter, text: str, policy: Policy) -> CompositeQuery:
    inner = bind_tree(split.inner, text, policy)
    outer = bind_tree(split.outer, text, policy)
    for part, node in ((inner, split.inner), (outer, split.outer)):
        if not isinstance(part, BoundQuery):
            raise _refuse(
                PrivacyError,
                "a DP subquery and the query it filters must each aggregate one table",
                node,
                text,
                "SELECT key, COUNT(*) FROM t JOIN (SELECT key AS k, COUNT(*) ... LIMIT 5) "
                "AS s ON key = k GROUP BY key",
            )
    assert isinstance(inner, BoundQuery) and isinstance(outer, BoundQuery)
    name = split.column.name.lower()
    spec = outer.table.columns.get(name)
    if spec is None or spec.expr is not None or name == outer.table.privacy_unit:
        raise _refuse(
            UndefinedColumnError if spec is None else PrivacyError,
            f"{split.column.sql()!r} must be a column of {outer.table.name!r} other than "
            "the privacy unit",
            split.column,
            text,
            "join the DP subquery's key column to a declared column of the outer table",
        )
    outputs = {item.alias.lower() for item in inner.post.expressions if item.alias}
    if split.output.lower() not in outputs:
        raise _refuse(
            UndefinedColumnError,
            f"the DP subquery has no column {split.output!r}",
            split.inner,
            text,
            "its columns: " + ", ".join(sorted(outputs)),
        )
    return CompositeQuery(text, inner, outer, name, split.output)


def _set_statement(tree: exp.Set, text: str) -> SettingStatement:
    items = tree.expressions
    if len(items) != 1 or not isinstance(items[0], exp.SetItem):
        raise _refuse(SQLSyntaxError, "SET takes one setting", tree, text, "SET epsilon = 0.5")
    item = items[0].this
    if not isinstance(item, exp.EQ) or not isinstance(item.this, exp.Column | exp.Identifier):
        raise _refuse(SQLSyntaxError, "SET needs name = value", tree, text, "SET epsilon = 0.5")
    name = item.this.name.lower()
    value_node = item.expression
    if isinstance(value_node, exp.Literal):
        value: Any = value_node.this if value_node.is_string else float(value_node.this)
    elif isinstance(value_node, exp.Neg) and isinstance(value_node.this, exp.Literal):
        value = -float(value_node.this.this)
    elif isinstance(value_node, exp.Column | exp.Identifier | exp.Var):
        value = value_node.name
    elif isinstance(value_node, exp.Boolean):
        value = value_node.this
    else:
        raise _refuse(
            SQLSyntaxError, "SET value must be a literal", value_node, text, "SET epsilon = 0.5"
        )
    return SettingStatement("set", name, value)


def bind_select(tree: exp.Select, text: str, policy: Policy) -> BoundQuery:
    """Bind one flat SELECT over a private table (the inliner's trial binds: a per-unit
    relation, dpsql.frontend.inline)."""
    bound = _Binder(tree, text, policy).bind()
    assert isinstance(bound, BoundQuery)  # a private table's FROM, checked before
    return bound


class _Binder:
    """Binds one SELECT; instance state is scratch space for a single pure binding."""

    def __init__(self, tree: exp.Select, text: str, policy: Policy) -> None:
        self.tree = tree
        self.text = text
        self.policy = policy
        self.table: TablePolicy | None = None
        self.qualifiers: set[str] = set()
        # computed columns of aggregated expressions, by their SQL (see _computed_column)
        self.computed: dict[str, ColumnPolicy] = {}

    # -- helpers -----------------------------------------------------------------------------
    def refuse(self, message: str, node: exp.Expr | None, hint: str) -> PrivacyError:
        return _refuse(PrivacyError, message, node, self.text, hint)  # type: ignore[return-value]

    def bind(self) -> BoundQuery | PublicSelect | RuleListCall:
        tree = self.tree
        if not tree.expressions:
            raise _refuse(
                SQLSyntaxError,
                "SELECT without a select list",
                tree,
                self.text,
                "name what to select, e.g. SELECT COUNT(*) FROM <table>",
            )
        if tree.args.get("with_") or tree.args.get("with"):
            raise self.refuse(
                "WITH (common table expressions) is not supported yet",
                tree.args.get("with_") or tree.args.get("with"),
                "write one SELECT over one table",
            )
        for arg in ("joins", "laterals", "windows", "qualify", "into", "locks", "sample"):
            if tree.args.get(arg):
                node = tree.args[arg]
                node = node[0] if isinstance(node, list) else node
                word = {
                    "joins": "JOIN",
                    "laterals": "LATERAL",
                    "windows": "WINDOW",
                    "qualify": "QUALIFY",
                    "into": "INTO",
                    "locks": "FOR UPDATE",
                    "sample": "TABLESAMPLE",
                }[arg]
                raise self.refuse(
                    f"{word} is not supported (one private table per query, for now)",
                    node,
                    "query one table; join public facts in your own tool after release",
                )
        for sub in tree.find_all(exp.Subquery, exp.Select):
            if sub is not tree:
                raise self.refuse(
                    "subqueries are not supported (for now)",
                    sub,
                    "rewrite as one SELECT over one table",
                )
        self._check_windows(tree)
        from_ = tree.args.get("from_") or tree.args.get("from")
        if from_ is None:
            return self._public_select()
        source = from_.this
        if (
            isinstance(source, exp.Table)
            and isinstance(source.this, exp.Anonymous)
            and source.this.name.lower() in TABLE_FUNCTIONS
        ):
            return self._rule_list(source.this)
        self._bind_from(from_.this)
        assert self.table is not None
        if self.table.public:
            return self._public_table_query()
        if any(isinstance(e, exp.Star) for e in tree.expressions) or any(
            isinstance(e, exp.Column) and isinstance(e.this, exp.Star) for e in tree.expressions
        ):
            star = next(e for e in tree.expressions if isinstance(e, exp.Star | exp.Column))
            raise self.refuse(
                "SELECT * would release individual rows",
                star,
                "select aggregates, e.g. SELECT COUNT(*) FROM " + self.table.name,
            )
        timestamp_literals(tree, self.table)
        self._distinct_as_group_by(tree)
        for unchecked in tree.meta.get("dp_unchecked", []):
            self._check_scalar(unchecked, "a derived table")
        where = tree.args.get("where")
        where_expr = None
        if where is not None:
            self._check_scalar(where.this, "WHERE")
            where_expr = self._normalise_columns(where.this)
            self._check_literal_types(where.this)
        keys, key_nodes = self._bind_group_by()
        if where_expr is not None:
            keys = [self._restrict_key(k, where_expr) for k in keys]
        aggregates: list[AggregateCall] = []
        post = self._build_post(keys, key_nodes, aggregates)
        if not aggregates and not keys:
            raise self.refuse(
                "the query has no aggregate",
                tree.expressions[0] if tree.expressions else tree,
                "use COUNT(*), COUNT(col), SUM(col), AVG(col) or GROUP BY",
            )
        table = self.table
        if self.computed:
            columns = {**table.columns, **{c.name: c for c in self.computed.values()}}
            table = replace(table, columns=columns)
        return BoundQuery(
            text=self.text,
            table=table,
            where=where_expr,
            keys=tuple(keys),
            aggregates=tuple(aggregates),
            post=post,
            joins=tuple(tree.meta.get(JOINED, ())),
        )

    def _check_windows(self, tree: exp.Select) -> None:
        """Window functions are post-processing of a DP query's released rows, or refused.

        ``SUM(COUNT(*)) OVER (ORDER BY month)`` reads the released counts only, so it costs
        nothing beyond the measurement. A window in a query that aggregates nothing would read
        private rows (``SUM(cost) OVER ()``), and one in WHERE, GROUP BY or HAVING runs before
        (or beside) the aggregation: those are refused, free."""
        windows = list(tree.find_all(exp.Window))
        if not windows:
            return
        example = "SELECT k, COUNT(*), SUM(COUNT(*)) OVER (ORDER BY k) FROM t GROUP BY k"
        aggregates = any(
            node.find_ancestor(exp.Window) is None
            for item in (*tree.expressions, tree.args.get("having"), tree.args.get("order"))
            if item is not None
            for node in item.find_all(exp.AggFunc)
            if not isinstance(node.parent, exp.Window)
        )
        if tree.args.get("group") is None and not aggregates:
            raise self.refuse(
                "window functions over private rows are not allowed: a window may only read "
                "a DP query's released aggregates and GROUP BY keys",
                windows[0],
                "aggregate first and window over the aggregates: " + example,
            )
        for clause in ("where", "group", "having"):
            node = tree.args.get(clause)
            window = node.find(exp.Window) if node is not None else None
            if window is not None:
                word = {"where": "WHERE", "group": "GROUP BY", "having": "HAVING"}[clause]
                raise self.refuse(
                    f"window functions are not allowed in {word}",
                    window,
                    "use a window in the SELECT list or ORDER BY, or filter its result in an "
                    "outer query: SELECT * FROM (" + example + ") AS s WHERE ...",
                )

    def _post_window(
        self, window: exp.Window, rewrite: Callable[[exp.Expression], exp.Expression]
    ) -> exp.Window:
        """``window`` over the released table: its function's arguments, PARTITION BY, ORDER
        BY and frame rewritten by ``rewrite`` (aggregates to a0.., keys to k0.., anything
        else refused), the function itself one of :data:`POST_WINDOW_FUNCTIONS`."""
        func = window.this
        hint = (
            "over released aggregates use SUM/AVG/MIN/MAX/COUNT, RANK, DENSE_RANK, ROW_NUMBER, "
            "PERCENT_RANK, CUME_DIST, NTILE, LAG, LEAD, FIRST_VALUE or LAST_VALUE"
        )
        if type(func) not in POST_WINDOW_FUNCTIONS:
            name = written_name(func).upper()
            raise self.refuse(f"window function {name} is not supported", window, hint)
        if window.args.get("alias") is not None or func.find(exp.Distinct) is not None:
            raise self.refuse(
                "named windows and DISTINCT inside a window function are not supported",
                window,
                "write the window inline: SUM(COUNT(*)) OVER (ORDER BY k)",
            )
        for inner in window.find_all(exp.Window):
            if inner is not window:
                raise self.refuse("window functions cannot be nested", inner, hint)
        out = window.copy()
        new_func = out.this
        try:
            for name, value in list(new_func.args.items()):
                if isinstance(value, exp.Expression) and not isinstance(value, exp.Star):
                    new_func.set(name, rewrite(value))
                elif isinstance(value, list):
                    new_func.set(
                        name, [rewrite(v) if isinstance(v, exp.Expression) else v for v in value]
                    )
            partition = out.args.get("partition_by")
            if partition:
                out.set("partition_by", [rewrite(p) for p in partition])
            for name in ("order", "spec"):
                if out.args.get(name) is not None:
                    out.set(name, rewrite(out.args[name]))
        except PrivacyError as exc:
            raise self.refuse(
                f"a window may only read released aggregates and GROUP BY keys: {exc.message}",
                window,
                "window over an aggregate (SUM(SUM(y)) OVER (...)) or a key in GROUP BY",
            ) from None
        return out

    def _restrict_key(self, key: GroupKey, where: exp.Expression) -> GroupKey:
        """What the WHERE says about a key's values, from the text alone.

        Conjuncts over the key's columns only filter its public domain as they filter rows
        (``conditions``). A bare-column key that a conjunct pins to literals (``col IN ('a',
        'b')``, ``col = 'a'``) has those values as its public set (``allowed``): released
        without thresholding, or intersected with its declared domain."""
        own = tuple(
            part.sql(dialect=DIALECT)
            for part in conjuncts(where)
            if {c.name for c in part.find_all(exp.Column)} <= set(key.columns)
            and part.find(exp.Column) is not None
        )
        if own:
            key = replace(key, conditions=own)
        if not isinstance(key.expr, exp.Column):
            return key
        assert self.table is not None
        col = self.table.columns[key.columns[0]]
        allowed: set | None = None
        for part in conjuncts(where):
            values = None
            if isinstance(part, exp.In) and _same_column(part.this, key.expr):
                if part.args.get("query") is None and not part.args.get("unnest"):
                    values = part.expressions
            elif isinstance(part, exp.EQ):
                if _same_column(part.this, key.expr):
                    values = [part.expression]
                elif _same_column(part.expression, key.expr):
                    values = [part.this]
            if values is None:
                continue
            typed = [_typed_literal(v, col.type) for v in values]
            if any(t is _NOT_LITERAL for t in typed):
                continue
            found = {t for t in typed if t is not None}  # NULL never equals: no bin
            allowed = found if allowed is None else allowed & found
        if allowed is None:
            return key
        return replace(key, allowed=tuple(sorted(allowed)))

    def _distinct_as_group_by(self, tree: exp.Select) -> None:
        """``SELECT DISTINCT a, b FROM t`` (no aggregate) is ``... GROUP BY a, b``: a key set,
        answered from the policy at no cost when the keys have a public domain, else
        released by thresholding like any GROUP BY."""
        if not tree.args.get("distinct") or tree.args.get("group") is not None:
            return
        if any(item.find(exp.AggFunc) for item in tree.expressions):
            return
        if tree.args["distinct"].args.get("on") is not None:
            raise self.refuse("DISTINCT ON is not supported", tree.args["distinct"], "use GROUP BY")
        keys = [item.unalias().copy() for item in tree.expressions]
        tree.set("group", exp.Group(expressions=keys))

    def _rule_list(self, call: exp.Anonymous) -> RuleListCall:
        function = call.name.lower()
        args = call.expressions
        if not args or not (isinstance(args[0], exp.Literal) and args[0].is_string):
            raise self.refuse(
                f"{function} needs the table name first",
                call,
                f"{function}('table', label => 'column', epsilon => 1.0, ...)",
            )
        table = self.policy.table(args[0].this)
        if table is None:
            raise _refuse(
                UndefinedTableError,
                f"unknown table {args[0].this!r}",
                args[0],
                self.text,
                "use a table declared in the policy: " + ", ".join(sorted(self.policy.tables)),
            )
        arguments: dict[str, Any] = {}
        for arg in args[1:]:
            if (
                isinstance(arg, exp.Kwarg)
                and isinstance(arg.expression, exp.Array)
                and all(
                    isinstance(e, exp.Literal) and e.is_string for e in arg.expression.expressions
                )
            ):
                # features => ['age', 'smoker']: a list of names
                arguments[arg.this.name.lower()] = [e.this for e in arg.expression.expressions]
                continue
            if not isinstance(arg, exp.Kwarg) or not isinstance(
                arg.expression, exp.Literal | exp.Boolean | exp.Neg
            ):
                raise self.refuse(
                    f"{function} arguments are name => literal",
                    arg,
                    "e.g. label => 'income', epsilon => 1.0, features => ['age', 'smoker']",
                )
            value_node = arg.expression
            if isinstance(value_node, exp.Neg) and not (
                isinstance(value_node.this, exp.Literal) and not value_node.this.is_string
            ):
                raise self.refuse(
                    f"{function} arguments are name => literal",
                    arg,
                    "a negative argument is a minus sign before a number, e.g. -1.5",
                )
            if isinstance(value_node, exp.Boolean):
                value: Any = value_node.this
            elif isinstance(value_node, exp.Neg):
                value = -float(value_node.this.this)
            elif value_node.is_string:
                value = value_node.this
            else:
                number = float(value_node.this)
                value = (
                    int(number) if number.is_integer() and "." not in value_node.this else number
                )
            arguments[arg.this.name.lower()] = value
        if "label" not in arguments:
            raise _refuse(
                ProgrammingError,
                f"{function} needs label => 'column'",
                call,
                self.text,
                f"{function}('{table.name}', label => 'column', epsilon => 1.0)",
            )
        for clause in ("group", "having"):
            if self.tree.args.get(clause):
                raise self.refuse(
                    f"{clause.upper()} is not supported on {function}",
                    self.tree.args[clause],
                    "select its columns, filter with WHERE, sort with ORDER BY",
                )
        names = [c for c, _ in result_columns(function)]
        post = self.tree.copy()
        post.set("from_", exp.From(this=exp.to_table(RELEASED)))
        for col in post.find_all(exp.Column):
            if col.name.lower() not in names and not any(
                isinstance(e, exp.Alias) and e.alias.lower() == col.name.lower()
                for e in self.tree.expressions
            ):
                raise _refuse(
                    UndefinedColumnError,
                    f"{function} has no column {col.name!r}",
                    col,
                    self.text,
                    "its columns: " + ", ".join(names),
                )
            col.set("table", None)
        for node in post.walk():
            if isinstance(node, exp.AggFunc | exp.Window | exp.Anonymous | exp.Subquery):
                raise self._not_allowed(node, f"{function} query")
        return RuleListCall(self.text, table, arguments, post, function)

    def _public_table_query(self) -> PublicSelect:
        """A query over a public table alone reads public data: answered exactly, free (its
        rows are evaluated here, in the policy's copy of the public table)."""
        assert self.table is not None
        allowed: tuple[type[exp.Expr], ...] = (
            exp.Select, exp.From, exp.Where, exp.Group, exp.Having, exp.Order, exp.Ordered,
            exp.Limit, exp.Offset, exp.Table, exp.TableAlias, exp.Alias, exp.Star, exp.Distinct,
            exp.Min, exp.Max, exp.Count, exp.Sum, exp.Avg, *SCALAR_NODES,
        )  # fmt: skip
        outputs = {e.alias.lower() for e in self.tree.expressions if isinstance(e, exp.Alias)}
        for node in self.tree.walk():
            if isinstance(node, exp.Rand | exp.Anonymous) or not isinstance(node, allowed):
                raise self._not_allowed(node, f"a query over public table {self.table.name!r}")
            if (
                isinstance(node, exp.Column)
                and not isinstance(node.this, exp.Star)
                and not (not node.table and node.name.lower() in outputs)
            ):
                self._column_name(node)
        from dpsql.frontend.joins import public_rows

        query = self.tree.copy()
        query.set("from_", exp.From(this=exp.to_table(self.table.name)))
        for column in query.find_all(exp.Column):
            column.set("table", None)
        query.set(
            "expressions",
            [
                e if isinstance(e, exp.Alias) or _is_star_item(e)
                else exp.alias_(e, _default_name(e, i), quoted=True)
                for i, e in enumerate(query.expressions)
            ],
        )  # fmt: skip
        names, types, rows = public_rows(self.table, query, self.text)
        index = exp.to_identifier("__i")
        selects = [
            exp.select(
                *(
                    exp.alias_(exp.cast(to_literal(v), t), n, quoted=True)
                    for v, t, n in zip(row, types, names, strict=True)
                ),
                exp.alias_(exp.Literal.number(i), index),
            )
            for i, row in enumerate(rows)
        ] or [
            exp.select(
                *(
                    exp.alias_(exp.cast(exp.Null(), t), n, quoted=True)
                    for t, n in zip(types, names, strict=True)
                ),
                exp.alias_(exp.Literal.number(0), index),
            ).where(exp.false())
        ]
        union: exp.Expression = selects[0]
        for part in selects[1:]:
            union = exp.union(union, part, distinct=False)
        post = exp.select(*(exp.column(n, quoted=True) for n in names)).from_(
            exp.Subquery(this=union, alias=exp.TableAlias(this=exp.to_identifier("__p")))
        )
        post = post.order_by(exp.column(index))
        return PublicSelect(self.text, post)

    def _public_select(self) -> PublicSelect:
        for node in self.tree.walk():
            if isinstance(node, exp.Column):
                raise self.refuse(
                    f"unknown column {node.sql()!r} (no FROM clause)",
                    node,
                    "add FROM <table>",
                )
            if isinstance(node, exp.AggFunc):
                raise self.refuse("aggregate without FROM", node, "add FROM <table>")
        for item in self.tree.expressions:
            self._check_scalar(item.unalias() if isinstance(item, exp.Alias) else item, "SELECT")
        return PublicSelect(self.text, self.tree.copy())

    def _bind_from(self, source: exp.Expression) -> None:
        if isinstance(source, exp.Table) and source.args.get("sample") is not None:
            raise self.refuse(
                "TABLESAMPLE is not supported",
                source.args["sample"],
                "filter rows with WHERE; sampling would need its own privacy analysis",
            )
        if isinstance(source, exp.Table):
            # Anything but [db.]name [AS alias] (time travel AT (...), hints, ONLY, column
            # aliases) would be silently ignored by the compiled query: refuse it instead.
            plain = ("this", "db", "catalog", "alias")
            extra = [k for k, v in source.args.items() if v and k not in plain]
            alias = source.args.get("alias")
            if extra or (alias is not None and alias.columns):
                node = source.args[extra[0]] if extra else alias
                node = node[0] if isinstance(node, list) else node
                raise self.refuse(
                    "table modifiers and column aliases are not supported",
                    node if isinstance(node, exp.Expression) else source,
                    f"write FROM {source.name} [AS alias] and name the policy's columns",
                )
        if isinstance(source, exp.Subquery):
            raise self.refuse(
                "subqueries are not supported (for now)", source, "query one table directly"
            )
        if not isinstance(source, exp.Table) or not isinstance(source.this, exp.Identifier):
            name = snippet(source)
            reader = any(r in name.lower() for r in FILE_READERS)
            raise self.refuse(
                ("file readers are not allowed" if reader else "table functions are not allowed")
                + f": {name}",
                source,
                "query a table declared in the privacy policy by its name",
            )
        schema = source.args.get("db")
        catalog = source.args.get("catalog")
        schemas = {"main", "public"} | (
            {self.policy.schema.lower()} if self.policy.schema else set()
        )
        if (catalog is not None and catalog.name.lower() != self.policy.dataset.lower()) or (
            schema is not None and schema.name.lower() not in schemas
        ):
            raise _refuse(
                UndefinedTableError,
                f"unknown table {source.sql()!r}",
                source,
                self.text,
                "query a table declared in the policy: " + ", ".join(sorted(self.policy.tables)),
            )
        table = self.policy.table(source.name)
        if table is None:
            raise _refuse(
                UndefinedTableError,
                f"unknown table {source.name!r}",
                source,
                self.text,
                "query a table declared in the policy: " + ", ".join(sorted(self.policy.tables)),
            )
        self.table = table
        self.qualifiers = {source.name.lower()}
        if schema is not None:  # SELECT pums.age FROM pums.pums: both spellings qualify
            self.qualifiers.add(f"{schema.name.lower()}.{source.name.lower()}")
        if source.alias:
            self.qualifiers.add(source.alias.lower())

    def _column_name(self, col: exp.Column) -> str:
        assert self.table is not None
        if col.table and col.table.lower() not in self.qualifiers:
            raise _refuse(
                UndefinedColumnError,
                f"unknown table or alias {col.table!r} in {col.sql()!r}",
                col,
                self.text,
                f"qualify columns with {self.table.name!r} or its alias, or not at all",
            )
        name = col.name.lower()
        if name not in self.table.columns:
            raise _refuse(
                UndefinedColumnError,
                f"unknown column {col.name!r} in table {self.table.name!r}",
                col,
                self.text,
                "columns declared in the policy: " + ", ".join(self.table.columns),
            )
        return name

    def _normalise_columns(self, node: exp.Expression) -> exp.Expression:
        """Copy of ``node`` with columns unqualified and lower-cased."""

        def fix(n: exp.Expression) -> exp.Expression:
            if isinstance(n, exp.Column):
                return exp.column(self._column_name(n))
            return n

        return node.transform(fix, copy=True)

    def _normal_sql(self, node: exp.Expression) -> str:
        """The DuckDB text of :meth:`_normalise_columns` (``node``); without the copy when its
        columns are already as that would make them (unqualified, unquoted, lower-case,
        declared): the same text, and no deep copy of the subtree and its positions."""
        assert self.table is not None
        for col in node.find_all(exp.Column):
            ident = col.this
            if (
                col.table
                or not isinstance(ident, exp.Identifier)
                or ident.quoted
                or ident.name != ident.name.lower()
                or ident.name not in self.table.columns
            ):
                return self._normalise_columns(node).sql(dialect=DIALECT)
        return node.sql(dialect=DIALECT)

    def _check_scalar(self, node: exp.Expr, clause: str) -> None:
        for sub in node.walk():
            if isinstance(sub, exp.AggFunc):
                raise self.refuse(
                    f"aggregate {snippet(sub)} is not allowed in {clause}",
                    sub,
                    "filter groups on noisy aggregates with HAVING",
                )
            if isinstance(sub, exp.Column):
                if self.table is not None:
                    self._column_name(sub)
                continue
            if isinstance(sub, exp.Rand | exp.Anonymous) or not isinstance(sub, SCALAR_NODES):
                raise self._not_allowed(sub, clause)
            if isinstance(sub, exp.TimeToStr) and self.table is not None:
                self._check_date_format(sub)

    def _check_date_format(self, node: exp.TimeToStr) -> None:
        """TO_CHAR / strftime formats a date or timestamp: PostgreSQL's TO_CHAR of a number
        (``TO_CHAR(cost, '999')``) is another function, refused by the name it was written."""
        assert self.table is not None
        try:
            value_range(node.this, self.table)
        except NotNumeric:
            return
        raise self.refuse(
            f"{written_name(node)} of a number is not supported",
            node,
            "TO_CHAR formats a date or timestamp here; CAST a number AS VARCHAR, or ROUND it",
        )

    def _check_literal_types(self, node: exp.Expression) -> None:
        """A string literal compared with a non-text column must convert to its type.

        The engine evaluates WHERE under TRY, so a bad literal would otherwise filter out
        every row silently; this error depends on the query text and policy only.
        """
        assert self.table is not None
        for cmp in node.find_all(
            exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE, exp.In, exp.Between
        ):
            column = cmp.this if isinstance(cmp.this, exp.Column) else None
            if isinstance(cmp, exp.In | exp.Between):
                others = cmp.expressions or [cmp.args.get("low"), cmp.args.get("high")]
            else:
                others = [cmp.expression]
                if column is None and isinstance(cmp.expression, exp.Column):
                    column, others = cmp.expression, [cmp.this]
            if column is None or column.name.lower() not in self.table.columns:
                continue
            spec = self.table.columns[column.name.lower()]
            for other in others:
                if (
                    isinstance(other, exp.Literal)
                    and other.is_string
                    and not _converts(other.this, spec.type)
                ):
                    raise DataError(
                        f"invalid {spec.type} value {other.this!r} for column {column.name!r}",
                        sqlstate="22P02",
                        construct=snippet(other),
                        position=position_of(other, self.text),
                        hint=f"compare {column.name} with a literal of type {spec.type}",
                    )

    def _not_allowed(self, node: exp.Expr, clause: str) -> PrivacyError:
        # the function's name as the analyst wrote it (TO_CHAR, not the DuckDB it maps to)
        name = written_name(node) if isinstance(node, exp.Func) else ""
        kind = "function" if isinstance(node, exp.Func) else "construct"
        lowered = name.lower()
        if lowered in FILE_READERS:
            return self.refuse(
                f"file reader {name} is not allowed", node, "query tables declared in the policy"
            )
        if isinstance(node, exp.Rand | exp.CurrentDate | exp.CurrentTimestamp) or lowered in (
            "now",
            "random",
            "uuid",
            "gen_random_uuid",
            "current_setting",
            "setseed",
        ):
            return self.refuse(
                f"non-deterministic or system function {snippet(node)} is not allowed in {clause}",
                node,
                "use literal values (e.g. DATE '2025-01-01') instead",
            )
        label = name or f"`{snippet(node)}`"
        return self.refuse(
            f"{kind} {label} is not allowed in {clause}",
            node,
            "see `dpsql help grammar` for the accepted functions and operators",
        )

    # -- GROUP BY ----------------------------------------------------------------------------
    def _bind_group_by(self) -> tuple[list[GroupKey], list[exp.Expression]]:
        group = self.tree.args.get("group")
        if group is None:
            return [], []
        sets = exp.Rollup | exp.Cube | exp.GroupingSets
        grouping = next((e for e in group.expressions if isinstance(e, sets)), None)
        if (
            grouping is not None
            or group.args.get("rollup")
            or group.args.get("cube")
            or group.args.get("grouping_sets")
        ):
            raise self.refuse(
                "ROLLUP/CUBE/GROUPING SETS are not supported",
                grouping or group,
                "send one query per grouping",
            )
        aliases = {
            e.alias.lower(): e.this for e in self.tree.expressions if isinstance(e, exp.Alias)
        }
        keys: list[GroupKey] = []
        nodes: list[exp.Expression] = []
        assert self.table is not None
        for item in group.expressions:
            resolved = item
            if isinstance(item, exp.Literal) and not item.is_string:
                if not str(item.this).isdigit():  # GROUP BY .7, 1.5, 1e0: no position
                    raise _refuse(
                        SQLSyntaxError,
                        f"GROUP BY {item.this} is not a select-list position",
                        item,
                        self.text,
                        "GROUP BY a column, an expression, or a whole position such as 1",
                    )
                index = int(item.this) - 1
                if not 0 <= index < len(self.tree.expressions):
                    raise self.refuse(
                        f"GROUP BY position {item.this} is out of range",
                        item,
                        "GROUP BY a column or a select-list position",
                    )
                resolved = self.tree.expressions[index]
                resolved = resolved.this if isinstance(resolved, exp.Alias) else resolved
            elif (
                isinstance(item, exp.Column)
                and not item.table
                and item.name.lower() not in self.table.columns
                and item.name.lower() in aliases
            ):
                resolved = aliases[item.name.lower()]
            if resolved.find(exp.AggFunc):
                raise self.refuse(
                    "GROUP BY an aggregate is not allowed", item, "group by columns or bins"
                )
            self._check_scalar(resolved, "GROUP BY")
            expr = self._normalise_columns(resolved)
            columns = tuple(sorted({c.name for c in expr.find_all(exp.Column)}))
            if not columns:
                raise self.refuse("GROUP BY a constant", item, "group by a column or a bin")
            if self.table.privacy_unit in columns:
                raise self.refuse(
                    f"GROUP BY the privacy unit {self.table.privacy_unit!r} would release "
                    "one group per person",
                    item,
                    "group by other columns; COUNT(DISTINCT "
                    f"{self.table.privacy_unit}) counts units",
                )
            key = GroupKey(expr=expr, columns=columns, position=_key_position(item, self.text))
            looked_up = resolved
            while isinstance(looked_up, exp.Paren):
                looked_up = looked_up.this
            if PUBLIC_VALUES in looked_up.meta:
                # A public table's column (dpsql.frontend.joins): its values are public.
                key = replace(key, allowed=looked_up.meta[PUBLIC_VALUES])
            if any(k.sql == key.sql for k in keys):
                continue
            keys.append(key)
            nodes.append(resolved)
        return keys, nodes

    # -- SELECT list, HAVING, ORDER BY -> post-processing query ------------------------------
    def _aggregate(self, node: exp.AggFunc, aggregates: list[AggregateCall]) -> AggregateCall:
        assert self.table is not None
        kind = AGGREGATE_KINDS.get(type(node))
        if kind is None:
            name = written_name(node)  # as written: string_agg, not sqlglot's LISTAGG
            raise self.refuse(
                f"aggregate {name} is not supported",
                node,
                "use COUNT, SUM, AVG, VARIANCE, STDDEV, MEDIAN, PERCENTILE_CONT/DISC, "
                "QUANTILE_CONT/DISC, MIN, MAX or MODE",
            )
        level = None
        if kind in ("percentile_cont", "percentile_disc"):
            level = self._quantile_level(node)
        arg = node.this
        distinct = isinstance(arg, exp.Distinct)
        if distinct:
            inner = arg.expressions
            if len(inner) != 1 or not isinstance(inner[0], exp.Column):
                raise self.refuse(
                    "DISTINCT takes one column", node, "COUNT(DISTINCT <privacy unit>)"
                )
            arg = inner[0]
        # COUNT(1), COUNT('x'), COUNT(true): a non-NULL constant counts rows, like COUNT(*)
        constant = isinstance(arg, exp.Literal | exp.Boolean)
        if kind == "count" and (arg is None or isinstance(arg, exp.Star) or constant):
            if distinct:
                raise self.refuse("COUNT(DISTINCT *) is not supported", node, "COUNT(*)")
            return AggregateCall("count", None)
        if len(node.expressions) > 0 or (kind in ("min", "max") and node.args.get("count")):
            raise self.refuse(
                f"{kind.upper()} takes one argument",
                node,
                f"{kind.upper()}(column) or {kind.upper()}(expression)",
            )
        if not isinstance(arg, exp.Column):
            if distinct:
                raise self.refuse(
                    "DISTINCT takes one column", node, "COUNT(DISTINCT <privacy unit>)"
                )
            if not KINDS[kind].takes_expressions:
                raise self.refuse(
                    f"{kind.upper()} takes a column, not an expression",
                    node,
                    f"{kind.upper()}(column) of a column with a public domain",
                )
            return self._expression_aggregate(kind, node, arg, level)
        column = self._column_name(arg)
        spec = self.table.columns[column]
        if distinct and kind not in ("count", "sum"):
            raise self.refuse(
                f"{snippet(node)}: DISTINCT is only supported in COUNT(DISTINCT column)"
                " and SUM(DISTINCT column)",
                node,
                f"{kind.upper()}({column}), or COUNT(DISTINCT {column})",
            )
        if distinct and kind == "count":
            if column == self.table.privacy_unit:
                return AggregateCall("count_units", column)
            return AggregateCall("count_distinct", column)
        if kind == "count":
            return AggregateCall("count", column)
        if column == self.table.privacy_unit:
            raise self.refuse(
                f"{kind.upper()} of the privacy unit is meaningless",
                node,
                f"COUNT(DISTINCT {column}) counts units",
            )
        problem = KINDS[kind].column_problem(kind.upper(), spec, self.table.name)
        if problem is not None:  # each kind says what it can aggregate (dpsql.aggregates)
            raise self.refuse(problem[0], node, problem[1])
        if distinct:  # SUM(DISTINCT x): the distinct fixed-point values of x (bounded rows)
            return AggregateCall("sum_distinct", column)
        return AggregateCall(kind, column, level=level)

    def _quantile_level(self, node: exp.AggFunc) -> float:
        """The level of PERCENTILE_CONT/DISC or QUANTILE_CONT/DISC: a literal number in [0, 1]
        (public, from the query text); an array of levels is refused (one call per level)."""
        name = "PERCENTILE_CONT" if isinstance(node, exp.PercentileCont) else "PERCENTILE_DISC"
        level = node.args.get("expression")
        if level is None:
            raise self.refuse(
                f"{name}(q) needs the column it orders",
                node,
                f"{name}(0.5) WITHIN GROUP (ORDER BY column), or QUANTILE_CONT(column, 0.5)",
            )
        if isinstance(level, exp.Array):
            raise self.refuse(
                f"{name} with an array of levels is not supported",
                node,
                f"write one {name} per level: the levels of a column are released jointly",
            )
        text = level.this if isinstance(level, exp.Literal) and not level.is_string else None
        try:
            value = float(text) if text is not None else math.nan
        except ValueError:
            value = math.nan
        if not 0 <= value <= 1:
            raise self.refuse(
                f"{name}: the level must be a number from 0 to 1",
                level,
                f"e.g. {name}(0.9) WITHIN GROUP (ORDER BY column)",
            )
        return value

    def _expression_aggregate(
        self, kind: str, node: exp.AggFunc, arg: exp.Expression, level: float | None = None
    ) -> AggregateCall:
        """SUM(a * b), AVG(LEAST(GREATEST(x, 50), 100)), COUNT(CASE WHEN ... END): an
        aggregate of a computed column whose range comes from interval arithmetic over the
        declared bounds (dpsql.frontend.intervals). COUNT needs no range."""
        assert self.table is not None
        self._check_scalar(arg, f"{kind.upper()}(...)")
        self._check_literal_types(arg)
        expr = self._normalise_columns(arg)
        shown = snippet(arg)
        if kind == "count":
            return AggregateCall("count", self._computed_column(expr, None).name, shown)
        if any(c.name == self.table.privacy_unit for c in expr.find_all(exp.Column)):
            raise self.refuse(
                f"{kind.upper()} of an expression of the privacy unit is not allowed",
                node,
                f"COUNT(DISTINCT {self.table.privacy_unit}) counts units",
            )
        try:
            found = value_range(expr, self.table)
        except NotNumeric as exc:
            raise self.refuse(
                f"{kind.upper()}({shown}): {snippet(exc.node)} — {exc.why}",
                node,
                f"{kind.upper()} a number: a bounded column or an arithmetic expression of them",
            ) from None
        if not found.finite:
            lacking = ", ".join(found.unbounded) or "a bound"
            raise self.refuse(
                f"{kind.upper()}({shown}) is unbounded: it needs a bound on {lacking}",
                node,
                "declare lower and upper for the columns it uses in the policy, or clamp "
                "per query: LEAST(GREATEST(expr, low), high)",
            )
        return AggregateCall(kind, self._computed_column(expr, found).name, shown, level)

    def _computed_column(self, expr: exp.Expression, found: Range | None) -> ColumnPolicy:
        """The computed column for ``expr`` (one per distinct expression in the query)."""
        assert self.table is not None
        sql = expr.sql(dialect=DIALECT)
        known = self.computed.get(sql)
        if known is not None and (found is None or known.bounded):
            return known
        name = known.name if known is not None else f"__e{len(self.computed)}"
        if found is None:
            column = ColumnPolicy(name=name, type="float", nullable=True, expr=sql)
        else:
            lower, upper = (found.lower, found.upper) if found.lower <= found.upper else (0, 0)
            floats = [
                self.table.columns[c.name].granularity
                for c in expr.find_all(exp.Column)
                if self.table.columns[c.name].type == "float"
            ]
            integral = found.integral
            granularity = 1.0 if integral else (min(floats) if floats else None)
            if granularity is None:
                granularity = default_granularity("float", lower, upper)
            column = ColumnPolicy(
                name=name,
                type="int" if integral else "float",
                lower=float(lower),
                upper=float(upper),
                nullable=True,
                granularity=granularity,
                expr=sql,
            )
        self.computed[sql] = column
        return column

    def _build_post(
        self,
        keys: list[GroupKey],
        key_nodes: list[exp.Expression],
        aggregates: list[AggregateCall],
    ) -> exp.Select:
        key_sql = {self._normal_sql(n): i for i, n in enumerate(key_nodes)}
        key_sql.update({k.sql: i for i, k in enumerate(keys)})
        # a subtree can only render as a key if it is of a key's node class: others are not
        # rendered at all (rendering every subtree was a tenth of planning)
        key_classes = {type(n) for n in key_nodes} | {type(k.expr) for k in keys}

        def rewrite(node: exp.Expression, clause: str) -> exp.Expression:
            def visit(n: exp.Expression) -> exp.Expression:
                if isinstance(n, exp.Anonymous) and n.name.lower() in ERROR_BAR_FUNCTIONS:
                    return self._error_bar(n, aggregates, aliases)
                if isinstance(n, exp.Window):
                    return self._post_window(n, lambda e: rewrite(e, clause))
                if isinstance(n, exp.AggFunc):
                    call = self._aggregate(n, aggregates)
                    if call not in aggregates:
                        aggregates.append(call)
                    return exp.column(f"a{aggregates.index(call)}")
                # Keys hold no aggregate: skip copying and rendering such subtrees.
                if (
                    type(n) in key_classes
                    and isinstance(n, exp.Column | exp.Func | exp.Binary | exp.Case | exp.Paren)
                    and not n.find(exp.AggFunc)
                ):
                    try:
                        normal = self._normal_sql(n)
                    except ProgrammingError:
                        normal = None
                    if normal in key_sql:
                        return exp.column(f"k{key_sql[normal]}")
                if isinstance(n, exp.Column):
                    if clause == "ORDER BY" and not n.table and n.name.lower() in output_aliases:
                        return n
                    name = self._column_name(n)
                    raise self.refuse(
                        f"column {name!r} is used outside an aggregate and not in GROUP BY",
                        n,
                        f"aggregate it (e.g. COUNT({name})) or add it to GROUP BY",
                    )
                return n

            return node.transform(visit, copy=True)

        output_aliases = {
            e.alias.lower() for e in self.tree.expressions if isinstance(e, exp.Alias)
        }
        aliases = {
            e.alias.lower(): e.this for e in self.tree.expressions if isinstance(e, exp.Alias)
        }
        post = exp.Select()
        for i, item in enumerate(self.tree.expressions):
            inner = item.this if isinstance(item, exp.Alias) else item
            self._check_post(inner, "SELECT")
            name = item.alias if isinstance(item, exp.Alias) else _default_name(inner, i)
            post = post.select(exp.alias_(rewrite(inner, "SELECT"), name, quoted=True), copy=False)
        # a built From (a string would be parsed: ~0.1 ms)
        released = exp.From(this=exp.Table(this=exp.Identifier(this=RELEASED, quoted=False)))
        post = post.from_(released, copy=False)
        having = self.tree.args.get("having")
        if having is not None:
            self._check_post(having.this, "HAVING")
            condition = having.this
            table_columns = self.table.columns if self.table is not None else {}

            def unalias(n: exp.Expression) -> exp.Expression:
                # HAVING may name a select alias (as DuckDB and PostgreSQL-style tools allow).
                if (
                    isinstance(n, exp.Column)
                    and not n.table
                    and n.name.lower() in aliases
                    and n.name.lower() not in table_columns
                ):
                    return aliases[n.name.lower()].copy()
                return n

            condition = condition.transform(unalias, copy=True)
            post = post.where(rewrite(condition, "HAVING"), copy=False)
        order = self.tree.args.get("order")
        if order is not None:
            ordered = []
            for o in order.expressions:
                self._check_post(o.this, "ORDER BY")
                ordered.append(rewrite(o, "ORDER BY"))
            post.set("order", exp.Order(expressions=ordered))
        if self.tree.args.get("distinct"):
            post.set("distinct", exp.Distinct())
        for arg in ("limit", "offset"):
            node = self.tree.args.get(arg)
            if node is not None:
                post.set(arg, self._row_count(arg, node))
        return post

    def _row_count(self, arg: str, node: exp.Expression) -> exp.Expression:
        """LIMIT/OFFSET n: a whole, non-negative number (``CAST(5 AS INTEGER)``, as drivers
        bind ``LIMIT $1::INTEGER``, is 5)."""
        value = node.expression if node.expression is not None else node.this
        if isinstance(value, exp.Cast | exp.TryCast) and value.to.is_type(
            *exp.DataType.INTEGER_TYPES
        ):
            value = value.this
        negative = isinstance(value, exp.Neg)
        number = value.this if negative else value
        whole = (
            isinstance(number, exp.Literal)
            and not number.is_string
            and float(number.this).is_integer()
        )
        if not whole or negative:
            # PostgreSQL's classes: a negative row count (2201W), not a number (42804)
            raise ProgrammingError(
                f"{arg.upper()} must be a whole number >= 0",
                sqlstate="2201W" if whole else "42804",
                construct=snippet(node),
                position=position_of(node, self.text),
                hint=f"{arg.upper()} 10",
            )
        out = node.copy()
        out.set("expression" if node.expression is not None else "this", value.copy())
        return out

    def _error_bar(
        self,
        node: exp.Anonymous,
        aggregates: list[AggregateCall],
        aliases: dict[str, exp.Expression],
    ) -> exp.Expression:
        """dp_interval_low/high(agg or alias) and dp_suppression_probability()."""
        name = node.name.lower()
        if name == "dp_suppression_probability":
            if node.expressions:
                raise self.refuse(f"{name}() takes no argument", node, f"{name}()")
            return exp.column("__suppressed")
        args = node.expressions
        target = args[0] if len(args) == 1 else None
        if isinstance(target, exp.Column) and not target.table:
            target = aliases.get(target.name.lower(), target)
        if not isinstance(target, exp.AggFunc):
            raise self.refuse(
                f"{name} takes one aggregate or the alias of one",
                node,
                f"{name}(COUNT(*)) or {name}(n) where n is an aggregate's alias",
            )
        call = self._aggregate(target, aggregates)
        if call not in aggregates:
            aggregates.append(call)
        suffix = "lo" if name == "dp_interval_low" else "hi"
        return exp.column(f"a{aggregates.index(call)}_{suffix}")

    def _check_post(self, node: exp.Expression, clause: str) -> None:
        """Post-processing may use aggregates, keys and deterministic scalar functions."""
        for sub in node.walk():
            if isinstance(sub, exp.AggFunc | exp.Star | exp.Distinct | exp.Column):
                continue
            if isinstance(sub, exp.Anonymous) and sub.name.lower() in ERROR_BAR_FUNCTIONS:
                continue
            if isinstance(sub, exp.Window):
                continue  # its function and clauses: _post_window
            if sub.find_ancestor(exp.Window) is not None and (
                isinstance(sub, exp.Order | exp.Ordered | exp.WindowSpec)
                or (isinstance(sub, POST_WINDOW_FUNCTIONS) and isinstance(sub.parent, exp.Window))
            ):
                continue
            if isinstance(sub, exp.Rand | exp.Anonymous) or not isinstance(sub, SCALAR_NODES):
                parent = sub.parent
                if isinstance(parent, exp.AggFunc | exp.Distinct) and isinstance(
                    sub, exp.Column | exp.Star
                ):
                    continue
                raise self._not_allowed(sub, clause)


_NOT_LITERAL = object()


def _same_column(node: exp.Expression, column: exp.Expression) -> bool:
    return isinstance(node, exp.Column) and node.name.lower() == column.name.lower()


def _typed_literal(node: exp.Expression, col_type: str) -> Any:
    """The value a literal compares equal to in a column of ``col_type`` (None for NULL or a
    value no row can hold), or _NOT_LITERAL for anything else."""
    if isinstance(node, exp.Null):
        return None
    if isinstance(node, exp.Boolean):
        return node.this if col_type == "bool" else _NOT_LITERAL
    if isinstance(node, exp.Cast) and isinstance(node.this, exp.Literal):
        node = node.this
    if not isinstance(node, exp.Literal):
        return _NOT_LITERAL
    text = node.this
    try:
        if col_type == "text":
            return text if node.is_string else _NOT_LITERAL
        if col_type == "int":
            number = float(text)
            return int(number) if number.is_integer() else None
        if col_type == "float":
            return float(text)
        if col_type == "date":
            return dt.date.fromisoformat(text.strip())
        if col_type == "bool":
            return {"true": True, "false": False, "t": True, "f": False}.get(text.lower())
    except ValueError:
        return _NOT_LITERAL
    return _NOT_LITERAL


def _converts(text: str, col_type: str) -> bool:
    """Whether a string literal converts to a column type (as DuckDB's implicit cast would)."""
    value = text.strip()
    try:
        if col_type == "int":
            return float(value).is_integer()
        if col_type == "float":
            float(value)
        elif col_type == "date":
            dt.date.fromisoformat(value)
        elif col_type == "bool":
            return value.lower() in ("true", "false", "t", "f", "1", "0", "yes", "no", "y", "n")
    except ValueError:
        return False
    return True


def _is_star_item(node: exp.Expression) -> bool:
    return isinstance(node, exp.Star) or (
        isinstance(node, exp.Column) and isinstance(node.this, exp.Star)
    )


def _default_name(node: exp.Expression, index: int) -> str:
    if isinstance(node, exp.Column):
        return node.name.lower()
    if isinstance(node, exp.AggFunc):
        kind = AGGREGATE_KINDS.get(type(node))
        return kind if kind in QUANTILE_KINDS else type(node).__name__.lower()
    return f"col{index + 1}"
