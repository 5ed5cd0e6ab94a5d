"""Bind analyst SQL to the policy: sqlglot AST -> :class:`DPQuery`, or a refusal.

Binding is the trust boundary's first half. It accepts exactly the constructs listed in
grammar_notes.md and refuses everything else *before any data is read*, with an error that
names the construct, its position and what to do instead. Nothing here touches an engine.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import sqlglot
from sqlglot import exp
from sqlglot.dialects.duckdb import DuckDB
from sqlglot.errors import ParseError, TokenError
from sqlglot.parser import Parser
from sqlglot.tokens import Token, Tokenizer, TokenType

from dpsql.errors import (
    PrivacyError,
    ProgrammingError,
    SQLSyntaxError,
    UndefinedColumnError,
)
from dpsql.frontend.bind.calls import AggregateBinder
from dpsql.frontend.bind.keys import GroupByBinder
from dpsql.frontend.bind.post import PostBuilder, is_star_item
from dpsql.frontend.bind.scope import Scope, refusal
from dpsql.frontend.bind.table_calls import public_select, public_table_query, rule_list_call
from dpsql.frontend.census import Census
from dpsql.frontend.compose import ReleasedFilter, split_released_filter
from dpsql.frontend.dialect import DUCKDB, ColumnTypes, check_dialect, reader, to_engine_semantics
from dpsql.frontend.inline import Wrapped, compose_post, flatten_relations
from dpsql.frontend.joins import JOINED, resolve_joins
from dpsql.frontend.per_unit import groups_by_unit
from dpsql.frontend.positions import (
    SOURCE,
    Source,
    forget_tokens,
    offset_position,
    reading,
    source_of,
)
from dpsql.frontend.private_joins import resolve_private_joins
from dpsql.frontend.released import split_released_tables
from dpsql.frontend.rewrite import normalise, respells, timestamp_literals
from dpsql.frontend.scopes import shadow_policy_tables
from dpsql.frontend.statements import (  # the bound tree's values (re-exported for the doors)
    DIALECT,
    AggregateCall,
    CompositeQuery,
    DPQuery,
    ExplainStatement,
    PublicSelect,
    ReleasedQuery,
    RuleListCall,
    SettingStatement,
    Statement,
    TransactionStatement,
    to_literal,
)
from dpsql.limits import too_complex, too_deep
from dpsql.policy import Policy
from dpsql.table_functions import TABLE_FUNCTIONS

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


def parse_statement(
    text: str,
    policy: Policy,
    parameters: Sequence[Any] | None = None,
    models: Callable[[str], Any] | None = None,
    access: Any = None,
    dialect: str = DUCKDB,
) -> Statement:
    """Parse and bind one statement of analyst SQL.

    ``dialect`` (dpsql.frontend.dialect): the grammar and semantics ``text`` is read in, "duckdb"
    (the DB-API's and CLI's default) or "postgres" (the wire server: ``7 / 2`` is 3).

    ``access`` (dpsql.access.Access): the analyst's restrictions, checked on the parsed tree
    before anything is bound (None: the analyst may query every table and column).

    ``models`` resolves ``dp_predict('name')`` among the analyst's stored models
    (dpsql.models.store); without it dp_predict is an unknown function.
    """
    _check_unicode(text, parameters)
    dialect = check_dialect(dialect)
    forget_tokens()
    source = reading(text, dialect)  # refusals quote the analyst's text (frontend.positions)
    head = _first_word(source)
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
        if not isinstance(bound, DPQuery | RuleListCall | CompositeQuery | ReleasedQuery):
            raise ProgrammingError(
                "EXPLAIN takes a DP SELECT query", construct="EXPLAIN", hint="EXPLAIN SELECT ..."
            )
        return ExplainStatement(bound, fmt)
    tree, census = _counted_statement_tree(source, policy, parameters, models)
    return bind_tree(tree, policy, access, census)


def _statement_tree(
    source: Source,
    policy: Policy,
    parameters: Sequence[Any] | None,
    models: Callable[[str], Any] | None,
) -> exp.Expr:
    """The one statement of ``source``, parsed and checked, with its parameters substituted and
    the dialect's meaning made explicit: what :func:`bind_tree` binds. Each node that records
    a position records its source too, so refusals need no text (dpsql.frontend.positions)."""
    return _counted_statement_tree(source, policy, parameters, models)[0]


def _counted_statement_tree(
    source: Source,
    policy: Policy,
    parameters: Sequence[Any] | None,
    models: Callable[[str], Any] | None,
) -> tuple[exp.Expr, Census | None]:
    """:func:`_statement_tree`, with the census of its node classes (dpsql.frontend.census)
    while it is still the tree the first walk counted (None once a step rewrote it)."""
    text, dialect = source.text, source.dialect
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
        raise refusal(
            PrivacyError,
            "several statements in one query",
            statements[1],
            "send one statement at a time",
        )
    tree = statements[0]
    census: Census | None = _scrub(tree, source, policy.limits.tree_depth)
    if parameters is not None:
        tree = _substitute_parameters(tree, parameters)
        census = None  # the values' literals are new nodes
    elif (
        census.has(exp.Placeholder, exp.Parameter)
        if census is not None
        else tree.find(exp.Placeholder, exp.Parameter) is not None
    ):
        raise refusal(
            ProgrammingError,
            "the query has parameter placeholders but no parameters were given",
            tree.find(exp.Placeholder, exp.Parameter),
            "pass the values as execute(sql, parameters)",
        )
    # the dialect's meaning made explicit (PostgreSQL's integer division: ``//``) before
    # anything is bound, so no later step can lose it (dpsql.frontend.dialect)
    tree = to_engine_semantics(tree, dialect, _column_types(policy), census)
    if census is not None and (
        census.has(exp.RawString)
        or (census.has(exp.Distinct) and census.has(exp.Paren))
        or (dialect != DUCKDB and census.has(exp.Div))
    ):
        # maybe rewritten: a $$ string is a literal now, a DISTINCT's parentheses are gone,
        # a division is ``//``
        census = None
    if models is not None and "dp_predict" in text.lower():
        from dpsql.models.predict import expand_predictions

        # The model is the analyst's own released value: its CASE is query text like any
        # other, bound and checked by the same rules (it reads no data).
        tree = expand_predictions(tree, models)
        census = None
    return tree, census


def _scrub(tree: exp.Expr, source: Source, limit: int) -> Census:
    """One walk over a parsed statement: refuse it deeper than ``limit`` (54001, as
    dpsql.limits.check_tree does, before any walker below recurses on it), drop every
    comment (sqlglot keeps comments on nodes and renders them again: no analyst text but
    validated expressions ever reaches the engine SQL), record ``source`` on each node that
    records a position (as positions.mark does, without a call for each node), and count
    the nodes of each class (the census the passes below ask before they walk)."""
    counts: dict[type, int] = {}
    stack = [(tree, 1)]
    pop, push = stack.pop, stack.append
    while stack:
        node, depth = pop()
        if depth > limit:
            raise too_deep()
        node.comments = None
        if node._meta:  # positions: copied with the node (sqlglot deep-copies every meta dict)
            meta = node._meta = ShallowMeta(node._meta)
            meta[SOURCE] = source
        cls = node.__class__
        counts[cls] = counts.get(cls, 0) + 1
        depth += 1
        # the children as iter_expressions yields them, without a generator for each node
        for value in node.args.values():
            if isinstance(value, list):
                for child in value:
                    if isinstance(child, exp.Expr):
                        push((child, depth))
            elif isinstance(value, exp.Expr):
                push((value, depth))
    return Census(tree, counts)


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
    with ``LIMIT 0``, in the engine's dialect: the schema-only binder (dpsql.frontend.typecheck,
    empty tables) names and types its columns; nothing data-dependent goes into either.
    """

    relation: exp.Select
    query: DPQuery


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
    if _PROBE_LIMIT.search(text) is None:
        return None
    dialect = check_dialect(dialect)
    if _first_word(Source(text, dialect)) not in ("SELECT", "WITH"):
        return None
    _check_unicode(text, parameters)
    forget_tokens()
    source = reading(text, dialect)
    tree = _statement_tree(source, policy, parameters, models)
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
        if is_star_item(item):
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
    bound = bind_tree(wrapper, policy, access)
    if not isinstance(bound, DPQuery) or bound.table.public:
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
    copying the node itself. Its values are ints and tuples, lists that are replaced and
    never changed in place, and the statement's Source (shared by its copies), so a shallow
    copy is a deep one."""

    def __deepcopy__(self, memo: dict) -> ShallowMeta:
        return ShallowMeta(self)


_LOCAL = threading.local()


def _duckdb_reader() -> tuple[Tokenizer, Parser]:
    """This thread's DuckDB tokenizer and parser: sqlglot builds both afresh for each call of
    ``Dialect.tokenize`` and ``Dialect.parser`` (their tables copied into new cores), and
    each resets its whole state as it starts, so one of each per thread reads every text."""
    got = getattr(_LOCAL, "reader", None)
    if got is None:
        got = _LOCAL.reader = (_READER.tokenizer(), _READER.parser())
    return got


def _parse(text: str, dialect: str = DUCKDB) -> list[exp.Expr]:
    """The statements of ``text`` in ``dialect``'s grammar, the n-th ``?`` placeholder *in the text*
    read as ``$n`` (the tree's own order visits LIMIT before WHERE, so parameters bind in text
    order). The tokens are renumbered, not the text, so every position stays where it was."""
    if dialect == DUCKDB:
        tokenizer, parser = _duckdb_reader()
    else:
        read = reader(dialect)
        tokenizer, parser = read.tokenizer(), read.parser()
    tokens = tokenizer.tokenize(text)
    if "?" in text and any(t.token_type == TokenType.PLACEHOLDER and t.text == "?" for t in tokens):
        tokens = list(_numbered_placeholders(tokens))
    return [s for s in parser.parse(tokens, text) if s is not None]


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


def _first_word(source: Source) -> str:
    # A text that starts with the word SELECT or WITH needs no tokenizing (~0.15 ms): that
    # word is its first token (the tokenizer has no longer keyword starting with either).
    # Anything else (a comment first, SHOW, INSERT, ...) asks the tokenizer.
    plain = _PLAIN_HEAD.match(source.text)
    if plain is not None and plain.group(1).upper() in ("SELECT", "WITH"):
        return plain.group(1).upper()
    tokens = source.tokens()  # cached: position_of tokenizes the same text again
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


def _substitute_parameters(tree: exp.Expr, params: Sequence[Any]):
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
            raise refusal(
                ProgrammingError,
                f"parameter {index + 1} has no value ({len(params)} given)",
                node,
                "pass one value per placeholder",
            )
        return to_literal(params[index])

    return tree.transform(replace, copy=True)


def bind_tree(
    tree: exp.Expr, policy: Policy, access: Any = None, census: Census | None = None
) -> Statement:
    """Bind one parsed statement. Refusals point at their nodes' positions, and the bound
    statement records the text its nodes were parsed from (dpsql.frontend.positions): no
    text is passed along the rewrites and binders below.

    ``census``: the classes of ``tree``'s nodes (dpsql.frontend.census), when known: the
    passes below that look for nodes it has none of skip their walks."""
    if census is not None and census.root is not tree:
        census = None
    for cls, name in REFUSED_STATEMENTS.items():
        if isinstance(tree, cls):
            raise refusal(
                PrivacyError,
                f"{name} statements are not allowed: dpsql only answers aggregate SELECT queries",
                tree,
                "send a SELECT with COUNT/SUM/AVG; data and configuration cannot be changed",
            )
    if isinstance(tree, exp.Transaction | exp.Commit | exp.Rollback):
        kind = {exp.Transaction: "begin", exp.Commit: "commit", exp.Rollback: "rollback"}
        return TransactionStatement(kind[type(tree)])
    if isinstance(tree, exp.Set):
        return _set_statement(tree)
    if isinstance(tree, exp.Command):
        word = str(tree.this).upper()
        raise refusal(
            PrivacyError,
            f"{word} statements are not allowed",
            tree,
            "dpsql only answers aggregate SELECT queries (and SET/SHOW/RESET of privacy settings)",
        )
    if isinstance(tree, exp.Select | exp.SetOperation):
        released = _released_tables(tree, policy, access, census)
        if released is not None:
            return released
    if isinstance(tree, exp.SetOperation):
        raise refusal(
            PrivacyError,
            f"{type(tree).__name__.upper()} of queries is not supported",
            tree,
            "send each SELECT separately; each is charged on its own",
        )
    if not isinstance(tree, exp.Select):
        # the statement's own keyword: CHECKPOINT parses as a Column, DEALLOCATE as an Alias
        word = _first_word(source_of(tree)) or type(tree).__name__
        raise refusal(
            PrivacyError,
            f"{word} statements are not allowed",
            tree,
            "send an aggregate SELECT query",
        )
    if census is not None and respells(tree, census):
        census = None  # respelled below: new nodes
    tree = normalise(tree, census=census)
    assert isinstance(tree, exp.Select)  # normalise keeps the root: a Select stays a Select
    # names first: a CTE shadows the policy table of its name in every construct below
    if census is None or census.has(exp.CTE):
        tree = cast(exp.Select, shadow_policy_tables(tree, policy))
    if access is not None:  # authorization: decided by the text and the policy (dpsql.access)
        access.check(tree, policy, TABLE_FUNCTIONS)
    if census is not None and not (census.only_root_query() and not census.has(exp.Join)):
        # a join, a derived table, a CTE or a subquery: the steps below may rewrite them
        census = None
    tree, policy = resolve_private_joins(tree, policy)
    tree = resolve_joins(tree, policy)
    split = split_released_filter(tree)
    if split is not None:
        return _composite(split, policy)
    flat, policy = flatten_relations(tree, policy, bind_select)  # + per-unit tables
    if isinstance(flat, Wrapped):
        inner = _Binder(flat.inner, policy).bind()
        if not isinstance(inner, DPQuery):
            raise refusal(
                PrivacyError,
                "the subquery reads no table",
                flat.inner,
                "aggregate a table declared in the policy inside the subquery",
            )
        return replace(inner, post=compose_post(flat.outer, inner.post, flat.alias))
    # One query over one table, no join: the steps above had nothing to rewrite (each
    # returns its input when the tree has no join, derived table, CTE or subquery), so the
    # census still counts ``flat``'s nodes, unless a step built another tree (public
    # tables: dpsql.frontend.joins copies the tree to evaluate semi joins).
    return _Binder(
        flat, policy, census if census is not None and census.root is flat else None
    ).bind()


def _one_query(tree: exp.Expression, census: Census | None = None) -> bool:
    """A SELECT with no query inside it: no subquery, CTE body or set operation."""
    if census is not None and census.root is tree:
        return isinstance(tree, exp.Select) and census.only_root_query()
    return isinstance(tree, exp.Select) and all(q is tree for q in tree.find_all(exp.Query))


def _released_tables(
    tree: exp.Select | exp.SetOperation, policy: Policy, access: Any, census: Census | None = None
) -> ReleasedQuery | None:
    """Several DP queries combined by post-processing (set operations, joins of released
    results, CTE chains, scalar subqueries): each measurement bound on its own (the same
    rules, access included), the post tree kept for the released tables only.

    A SELECT with no query inside it (no subquery, CTE or set operation) is always the
    one-query path: every source is a table, so the classifier finds no DP or released part
    beside the query itself and no scalar subquery; answered without the classifier's walks."""
    if _one_query(tree, census):
        return None
    scoped = shadow_policy_tables(tree, policy)
    split = split_released_tables(scoped, policy)
    if split is None:
        return None
    if access is not None:
        access.check(scoped, policy, TABLE_FUNCTIONS)
    measurements = []
    for select in split.measurements:
        bound = bind_tree(select, policy, access)
        if not isinstance(bound, DPQuery):
            raise refusal(
                PrivacyError,
                "each query combined by post-processing must be a DP query over one table",
                select,
                "SELECT k, COUNT(*) FROM t GROUP BY k (a DP subquery filter or a table "
                "function runs as a query of its own)",
            )
        measurements.append(bound)
    return ReleasedQuery(
        source_of(tree).text, tuple(measurements), split.names, split.post, split.operations
    )


def _composite(split: ReleasedFilter, policy: Policy) -> CompositeQuery:
    inner = bind_tree(split.inner, policy)
    outer = bind_tree(split.outer, policy)
    for part, node in ((inner, split.inner), (outer, split.outer)):
        if not isinstance(part, DPQuery):
            raise refusal(
                PrivacyError,
                "a DP subquery and the query it filters must each aggregate one table",
                node,
                "SELECT key, COUNT(*) FROM t JOIN (SELECT key AS k, COUNT(*) ... LIMIT 5) "
                "AS s ON key = k GROUP BY key",
            )
    assert isinstance(inner, DPQuery) and isinstance(outer, DPQuery)
    name = split.column.name.lower()
    spec = outer.table.columns.get(name)
    if spec is None or spec.expr is not None or name == outer.table.privacy_unit:
        raise refusal(
            UndefinedColumnError if spec is None else PrivacyError,
            f"{split.column.sql()!r} must be a column of {outer.table.name!r} other than "
            "the privacy unit",
            split.column,
            "join the DP subquery's key column to a declared column of the outer table",
        )
    outputs = {item.alias.lower() for item in inner.post.expressions if item.alias}
    if split.output.lower() not in outputs:
        raise refusal(
            UndefinedColumnError,
            f"the DP subquery has no column {split.output!r}",
            split.inner,
            "its columns: " + ", ".join(sorted(outputs)),
        )
    return CompositeQuery(outer.text, inner, outer, name, split.output)


def _set_statement(tree: exp.Set) -> SettingStatement:
    items = tree.expressions
    if len(items) != 1 or not isinstance(items[0], exp.SetItem):
        raise refusal(SQLSyntaxError, "SET takes one setting", tree, "SET epsilon = 0.5")
    item = items[0].this
    if not isinstance(item, exp.EQ) or not isinstance(item.this, exp.Column | exp.Identifier):
        raise refusal(SQLSyntaxError, "SET needs name = value", tree, "SET epsilon = 0.5")
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
        raise refusal(
            SQLSyntaxError, "SET value must be a literal", value_node, "SET epsilon = 0.5"
        )
    return SettingStatement("set", name, value)


def bind_select(tree: exp.Select, policy: Policy) -> DPQuery:
    """Bind one flat SELECT over a private table (the inliner's trial binds: a per-unit
    relation, dpsql.frontend.inline), as part of the statement it was parsed from."""
    bound = _Binder(tree, policy).bind()
    assert isinstance(bound, DPQuery)  # a private table's FROM, checked before
    return bound


class _Binder:
    """Binds one flat SELECT: its scope (dpsql.frontend.bind.scope), GROUP BY (keys), aggregate
    calls (calls) and post-processing (post), or a table function's call or a public query
    (table_calls). Instance state is scratch space for a single pure binding."""

    def __init__(self, tree: exp.Select, policy: Policy, census: Census | None = None) -> None:
        self.tree = tree
        self.scope = Scope(source_of(tree).text, policy)  # the statement's, for its record
        # the classes of the tree's nodes, when known (dpsql.frontend.census)
        self.census = census if census is not None and census.root is tree else None

    def bind(self) -> DPQuery | PublicSelect | RuleListCall:
        tree = self.tree
        if not tree.expressions:
            raise refusal(
                SQLSyntaxError,
                "SELECT without a select list",
                tree,
                "name what to select, e.g. SELECT COUNT(*) FROM <table>",
            )
        if tree.args.get("with_") or tree.args.get("with"):
            raise self.scope.refuse(
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
                raise self.scope.refuse(
                    f"{word} is not supported (one private table per query, for now)",
                    node,
                    "query one table; join public facts in your own tool after release",
                )
        census = self.census
        nested = census is None or census.count(exp.Subquery, exp.Select) > 1
        for sub in tree.find_all(exp.Subquery, exp.Select) if nested else ():
            if sub is not tree:
                raise self.scope.refuse(
                    "subqueries are not supported (for now)",
                    sub,
                    "rewrite as one SELECT over one table",
                )
        post = PostBuilder(self.scope, tree, AggregateBinder(self.scope))
        if census is None or census.has(exp.Window):
            post.check_windows(tree)
        from_ = tree.args.get("from_") or tree.args.get("from")
        if from_ is None:
            return public_select(self.scope, tree)
        source = from_.this
        if (
            isinstance(source, exp.Table)
            and isinstance(source.this, exp.Anonymous)
            and source.this.name.lower() in TABLE_FUNCTIONS
        ):
            return rule_list_call(self.scope, tree, source.this)
        self.scope.bind_from(from_.this)
        table = self.scope.table
        assert table is not None
        if table.public:
            return public_table_query(self.scope, tree)
        if any(isinstance(e, exp.Star) for e in tree.expressions) or any(
            isinstance(e, exp.Column) and isinstance(e.this, exp.Star) for e in tree.expressions
        ):
            star = next(e for e in tree.expressions if isinstance(e, exp.Star | exp.Column))
            raise self.scope.refuse(
                "SELECT * would release individual rows",
                star,
                "select aggregates, e.g. SELECT COUNT(*) FROM " + table.name,
            )
        timestamp_literals(tree, table)
        keys_binder = GroupByBinder(self.scope, tree)
        keys_binder.distinct_as_group_by(tree)
        for unchecked in tree.meta.get("dp_unchecked", []):
            self.scope.check_scalar(unchecked, "a derived table")
        where = tree.args.get("where")
        where_expr = None
        if where is not None:
            self.scope.check_scalar(where.this, "WHERE")
            where_expr = self.scope.normalise_columns(where.this)
            self.scope.check_literal_types(where.this)
        keys, key_nodes = keys_binder.bind()
        if where_expr is not None:
            keys = [keys_binder.restrict(k, where_expr) for k in keys]
        aggregates: list[AggregateCall] = []
        released = post.build(keys, key_nodes, aggregates)
        if not aggregates and not keys:
            raise self.scope.refuse(
                "the query has no aggregate",
                tree.expressions[0] if tree.expressions else tree,
                "use COUNT(*), COUNT(col), SUM(col), AVG(col) or GROUP BY",
            )
        computed = post.calls.computed
        if computed:
            columns = {**table.columns, **{c.name: c for c in computed.values()}}
            table = replace(table, columns=columns)
        # The tree: GroupBy(Compute(Where(Read))), the computed columns (a derived table's,
        # an aggregate's argument) in the Compute node (DPQuery.build).
        return DPQuery.build(
            self.scope.text,
            table,
            where_expr,
            tuple(keys),
            tuple(aggregates),
            released,
            tuple(tree.meta.get(JOINED, ())),
        )
