"""Authorization: which analysts may query which tables and columns (``[access]`` and ``allow``
/ ``deny`` in the policy). Without any of them every analyst may query everything, as before.

The policy syntax (docs/server.md, "Authorization")::

    [access]
    roles = { clinicians = ["alice", "bob"], auditors = ["carol"] }

    [tables.visits]
    allow = ["clinicians", "carol"]      # who may query the table (analysts or roles)
    deny = ["bob"]                       # ... minus these

    [tables.visits.columns.diagnosis]
    allow = ["clinicians"]               # who, of the table's readers, may use this column

It means what PostgreSQL's ``GRANT SELECT ON visits TO clinicians, carol`` and a column
``GRANT SELECT (diagnosis)`` would, with one simplification: a column's rule can only narrow
the table's (no column is readable on a table that is not). ``allow`` absent: everyone;
``allow = []``: nobody; ``deny`` always wins. A name is an analyst (a login) or a role of
``[access] roles``; roles do not nest.

Enforcement is one check on the parsed statement, in :func:`dpsql.frontend.bind.bind_tree` right
after CTE names are scoped and before anything is bound: every table the statement names
(FROM, JOIN, semi joins, derived tables and CTE bodies, public lookups, table functions'
first argument) and every column reference is checked against the analyst's rights. It is
decided by the statement's text and the policy alone, before any data is read or anything is
charged, so a refusal (SQLSTATE 42501) is free and tells the analyst nothing beyond the policy:
it names the table or column they wrote and the fix. Column references are resolved by name
(conservatively): a column an analyst may not use is refused wherever its name appears in a
statement reading that table, unless it is qualified by another table.

A table reached only through a declared ``unit_path`` (the join dpsql adds to find the privacy
unit) is not checked: the operator declared that path as part of the table the analyst may
query, and nothing of it is released.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlglot import exp

from dpsql.errors import PrivacyError

# The policy's types, by duck typing: dpsql.policy imports this module to validate [access], so
# this one imports no policy module (the import graph stays layered: tests/test_layering.py).
Policy = Any  # dpsql.policy.Policy
TablePolicy = Any  # dpsql.policy.TablePolicy
_Reporter = Any  # dpsql.policy._Reporter

ACCESS_KEYS = {"roles": "role name -> list of analysts, e.g. roles = { clinicians = [...] }"}
#: The keys a table or a column section takes for access (validated here, ignored elsewhere).
RULE_KEYS = {
    "allow": "analysts or roles who may query it (default: everyone)",
    "deny": "analysts or roles who may not, even if allowed",
}


class AccessDenied(PrivacyError):
    """A statement names a table or column the analyst may not query (SQLSTATE 42501)."""

    sqlstate = "42501"


@dataclass(frozen=True)
class Rule:
    """Who may read one table or column: ``allow`` (None: everyone) minus ``deny``."""

    allow: frozenset[str] | None = None
    deny: frozenset[str] = frozenset()

    def permits(self, principals: frozenset[str]) -> bool:
        if self.deny & principals:
            return False
        return self.allow is None or bool(self.allow & principals)


@dataclass(frozen=True)
class AccessPolicy:
    """The policy's access rules: roles, and a rule per table and per (table, column)."""

    roles: Mapping[str, frozenset[str]]
    tables: Mapping[str, Rule]
    columns: Mapping[tuple[str, str], Rule]
    _cache: dict[str, Access | None] = field(
        default_factory=dict, compare=False, repr=False, hash=False
    )
    _lock: threading.Lock = field(
        default_factory=threading.Lock, compare=False, repr=False, hash=False
    )

    def principals(self, analyst: str) -> frozenset[str]:
        """The analyst and every role it belongs to."""
        return frozenset({analyst} | {r for r, members in self.roles.items() if analyst in members})

    def for_analyst(self, analyst: str, table_names: Iterable[str]) -> Access | None:
        """The analyst's rights over ``table_names``, or None when they may read everything."""
        with self._lock:
            if analyst in self._cache:
                return self._cache[analyst]
        who = self.principals(analyst)
        denied_tables = frozenset(
            t for t in table_names if t in self.tables and not self.tables[t].permits(who)
        )
        denied_columns: dict[str, frozenset[str]] = {}
        for (table, column), rule in self.columns.items():
            if table not in denied_tables and not rule.permits(who):
                denied_columns[table] = denied_columns.get(table, frozenset()) | {column}
        # which list keeps the analyst out: the fix each refusal names
        by_deny = frozenset(f"tables.{t}" for t in denied_tables if self.tables[t].deny & who) | {
            f"tables.{t}.columns.{c}"
            for t, cols in denied_columns.items()
            for c in cols
            if self.columns[(t, c)].deny & who
        }
        access = (
            Access(analyst, denied_tables, denied_columns, by_deny)
            if denied_tables or denied_columns
            else None
        )
        with self._lock:
            self._cache[analyst] = access
        return access


@dataclass(frozen=True)
class Access:
    """One analyst's restrictions: the tables, and the columns of readable tables, they may
    not query."""

    analyst: str
    denied_tables: frozenset[str]
    denied_columns: Mapping[str, frozenset[str]]
    by_deny: frozenset[str] = frozenset()  # keys of the rules whose deny list names them

    def may_read(self, table: str) -> bool:
        return table.lower() not in self.denied_tables

    def visible_columns(self, table: TablePolicy) -> list[str]:
        hidden = self.denied_columns.get(table.name, frozenset())
        return [c for c in table.columns if c not in hidden]

    # -- the check ---------------------------------------------------------------------------
    def check(
        self, tree: exp.Expression, policy: Policy, table_functions: Iterable[str] = ()
    ) -> None:
        """Refuse (free, 42501) a statement naming a table or column the analyst may not
        query. ``tree`` is the parsed statement after CTE scoping (a policy table's name in it
        always means the table: dpsql.frontend.scopes); ``table_functions``: the names of
        the DP table functions, whose first argument names a table."""
        functions = set(table_functions)
        read: dict[str, str] = {}  # name or alias in the statement -> policy table
        for node in tree.walk():
            if not isinstance(node, exp.Table):
                continue
            call = node.this
            if isinstance(call, exp.Anonymous) and call.name.lower() in functions:
                self._check_table_function(call, policy)
                continue
            table = policy.table(node.name) if isinstance(call, exp.Identifier) else None
            if table is None:
                continue  # a CTE, a derived table's alias, or unknown (the binder says so)
            self._check_table(table.name, node)
            read[node.alias_or_name.lower()] = table.name
            read.setdefault(table.name, table.name)
        hidden = {t: self.denied_columns[t] for t in set(read.values()) if t in self.denied_columns}
        if not hidden:
            return
        for node in tree.walk():
            if isinstance(node, exp.Star):
                self._check_star(node, read, hidden)
            elif isinstance(node, exp.Column) and not isinstance(node.this, exp.Star):
                self._check_column(node.name, node.table, node, read, hidden)
            elif isinstance(node, exp.Join):
                for ident in node.args.get("using") or []:
                    name = ident.name if isinstance(ident, exp.Expression) else str(ident)
                    self._check_column(name, "", ident, read, hidden)

    def _check_table(self, name: str, node: exp.Expression | None) -> None:
        if name in self.denied_tables:
            key = f"tables.{name}"
            raise _denied(f"permission denied for table {name}", node, key, self._fix(key))

    def _check_column(
        self,
        name: str,
        qualifier: str,
        node: exp.Expression,
        read: Mapping[str, str],
        hidden: Mapping[str, frozenset[str]],
    ) -> None:
        column = name.lower()
        owner = read.get(qualifier.lower()) if qualifier else None
        tables = [owner] if owner is not None else sorted(hidden)
        for table in tables:
            if column in hidden.get(table, frozenset()):
                key = f"tables.{table}.columns.{column}"
                raise _denied(
                    f"permission denied for column {column} of table {table}",
                    node,
                    key,
                    self._fix(key),
                )

    def _check_star(
        self,
        node: exp.Star,
        read: Mapping[str, str],
        hidden: Mapping[str, frozenset[str]],
    ) -> None:
        parent = node.parent
        if isinstance(parent, exp.Count | exp.AggFunc):
            return  # COUNT(*) reads no column
        qualifier = parent.table if isinstance(parent, exp.Column) else ""
        owner = read.get(qualifier.lower()) if qualifier else None
        tables = [owner] if owner is not None else sorted(hidden)
        for table in tables:
            if hidden.get(table):
                raise _denied(
                    f"permission denied for some columns of table {table} (* reads them all)",
                    parent if isinstance(parent, exp.Column) else node,
                    f"tables.{table}.columns",
                    hint=f"name the columns you need instead of *; {_fix(table, 'columns')}; "
                    "nothing was spent",
                )

    def _check_table_function(self, call: exp.Anonymous, policy: Policy) -> None:
        args = call.expressions
        if not args or not (isinstance(args[0], exp.Literal) and args[0].is_string):
            return  # the binder refuses it
        table = policy.table(args[0].this)
        if table is None:
            return
        self._check_table(table.name, args[0])
        hidden = self.denied_columns.get(table.name)
        if not hidden:
            return
        named: list[tuple[str, exp.Expression]] = []
        has_features = False
        for arg in args[1:]:
            if not isinstance(arg, exp.Kwarg):
                continue
            key = arg.this.name.lower()
            if key not in ("label", "features"):
                continue
            has_features |= key == "features"
            values = arg.expression.expressions if isinstance(arg.expression, exp.Array) else [arg]
            for value in values:
                literal = value.expression if isinstance(value, exp.Kwarg) else value
                if isinstance(literal, exp.Literal) and literal.is_string:
                    named.extend((n.strip(), literal) for n in literal.this.split(",") if n.strip())
        for name, node in named:
            if name.lower() in hidden:
                column = name.lower()
                key = f"tables.{table.name}.columns.{column}"
                raise _denied(
                    f"permission denied for column {column} of table {table.name}",
                    node,
                    key,
                    self._fix(key),
                )
        if not has_features:
            raise _denied(
                f"permission denied for some columns of table {table.name} (without "
                "features => [...] the function reads them all)",
                call,
                f"tables.{table.name}.columns",
                hint="name the columns you may use in features => [...]; "
                + _fix(table.name, "columns")
                + "; nothing was spent",
            )

    def _fix(self, key: str) -> str:
        if key in self.by_deny:
            return (
                f"ask the operator to take you (and your roles) off {key}.deny; nothing was spent"
            )
        return (
            f"ask the operator to add you (or one of your roles) to {key}.allow; nothing was spent"
        )


def _fix(table: str, what: str = "") -> str:
    where = f"tables.{table}" + (f".{what}" if what else "")
    return f"or ask the operator to add you to the allow list in {where}"


def _denied(message: str, node: exp.Expression | None, key: str, hint: str) -> AccessDenied:
    from dpsql.frontend.positions import position_of

    return AccessDenied(
        message,
        construct=key,
        position=position_of(node) if node is not None else None,
        hint=hint,
    )


# -- the policy's [access] section --------------------------------------------------------


def build_access(
    rep: _Reporter,
    section: Any,
    tables_raw: Mapping[str, Any],
    analysts: frozenset[str] | None,
) -> AccessPolicy | None:
    """Validate ``[access]`` and every ``allow`` / ``deny`` of ``tables_raw``; None when the
    policy has none (everyone may query everything)."""
    roles: dict[str, frozenset[str]] = {}
    if section is not None:
        if not isinstance(section, dict):
            raise rep.fail("access", "must be a table", "write an [access] section")
        rep.unknown_keys("access", section, ACCESS_KEYS)
        raw_roles = section.get("roles", {})
        if not isinstance(raw_roles, dict):
            raise rep.fail(
                "access.roles", "must be a table of lists", 'roles = { clinicians = ["alice"] }'
            )
        for role, members in raw_roles.items():
            key = f"access.roles.{role}"
            if not isinstance(members, list) or not all(isinstance(m, str) and m for m in members):
                raise rep.fail(key, "must be a list of analyst names", f'{role} = ["alice", "bob"]')
            if analysts is not None and role in analysts:
                raise rep.fail(
                    key,
                    f"{role!r} is also an analyst of [privacy] analysts",
                    "give the role a name no analyst has",
                )
            for member in members:
                if member in raw_roles:
                    raise rep.fail(
                        key, f"{member!r} is a role: roles do not nest", "list its analysts"
                    )
                if analysts is not None and member not in analysts:
                    raise rep.fail(
                        key,
                        f"{member!r} is not an analyst of [privacy] analysts",
                        "add it to [privacy] analysts, or fix the name",
                    )
            roles[role] = frozenset(members)
    known = frozenset(roles) | (analysts or frozenset())

    def rule(key: str, spec: Mapping[str, Any]) -> Rule | None:
        if "allow" not in spec and "deny" not in spec:
            return None
        lists = {}
        for word in ("allow", "deny"):
            names = spec.get(word)
            if names is None:
                continue
            if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                raise rep.fail(
                    f"{key}.{word}",
                    "must be a list of analysts or roles",
                    f'{word} = ["clinicians", "carol"]',
                )
            for name in names:
                if analysts is not None and name not in known:
                    raise rep.fail(
                        f"{key}.{word}",
                        f"{name!r} is neither a role of [access] roles nor an analyst of "
                        "[privacy] analysts",
                        "use one of: " + ", ".join(sorted(known)) if known else "declare it",
                    )
            lists[word] = frozenset(names)
        return Rule(lists.get("allow"), lists.get("deny", frozenset()))

    table_rules: dict[str, Rule] = {}
    column_rules: dict[tuple[str, str], Rule] = {}
    for name, spec in tables_raw.items():
        if not isinstance(spec, dict):
            continue
        key = f"tables.{name}"
        if (found := rule(key, spec)) is not None:
            table_rules[name.lower()] = found
        columns = spec.get("columns")
        for column, col_spec in columns.items() if isinstance(columns, dict) else ():
            if isinstance(col_spec, dict):
                found = rule(f"{key}.columns.{column}", col_spec)
                if found is not None:
                    column_rules[(name.lower(), column.lower())] = found
    if not roles and not table_rules and not column_rules:
        return None
    return AccessPolicy(roles, table_rules, column_rules)


def access_for(policy: Policy, analyst: str) -> Access | None:
    """``analyst``'s restrictions under ``policy`` (None: none, the common case)."""
    rules = getattr(policy, "access", None)
    if rules is None:
        return None
    return rules.for_analyst(analyst, policy.tables)


def visible_tables(policy: Policy, analyst: str) -> dict[str, list[str]]:
    """table -> the columns ``analyst`` may query, for every table they may query (the
    catalog each door shows them)."""
    access = access_for(policy, analyst)
    out = {}
    for name, table in policy.tables.items():
        if access is None:
            out[name] = list(table.columns)
        elif access.may_read(name):
            out[name] = access.visible_columns(table)
    return out
