"""Name scopes: a CTE shadows the policy table of the same name, in every construct.

In PostgreSQL ``WITH patients AS (SELECT * FROM patients WHERE age > 200) SELECT ... FROM
visits v JOIN patients p ...`` joins the CTE, not the table: a name resolves to the innermost
CTE that defines it, and only then to a table. dpsql's join lowerings, public lookups and semi
joins look names up in the policy; had each of them to remember the query's CTEs first, a new
construct could forget it and silently drop the CTE's filter (it did: the join counted every
patient). So scoping is decided once, here, before any of them runs: every CTE whose name a
policy table also has is renamed, with every reference in its scope, to a name no policy table
can have. After this pass a policy-table name in the tree always means the policy table.

Scope rules (PostgreSQL's, without RECURSIVE, which dpsql.frontend.inline refuses): a CTE is
visible in the CTEs after it in the same WITH and in the query body, not in its own body nor
in the ones before it; an inner WITH shadows an outer one. A reference keeps its spelling as a
qualifier: ``FROM patients`` becomes ``FROM "patients (CTE)" AS patients``.

>>> import sqlglot
>>> from types import SimpleNamespace
>>> policy = SimpleNamespace(tables={"patients": None})
>>> tree = sqlglot.parse_one(
...     "WITH patients AS (SELECT * FROM patients WHERE age > 200) SELECT COUNT(*) FROM patients"
... )
>>> print(shadow_policy_tables(tree, policy).sql(pretty=True))
WITH "patients (CTE)" AS (
  SELECT
    *
  FROM patients
  WHERE
    age > 200
)
SELECT
  COUNT(*)
FROM "patients (CTE)" AS patients
"""

from __future__ import annotations

from typing import Any

from sqlglot import exp

CTE_SUFFIX = " (CTE)"


def display_name(name: str) -> str:
    """A CTE's name as the analyst wrote it (for messages)."""
    return name.removesuffix(CTE_SUFFIX)


def shadow_policy_tables(tree: exp.Expression, policy: Any) -> exp.Expression:
    """``tree`` with each CTE named like a policy table renamed in its whole scope (a copy;
    ``tree`` itself when no CTE shadows a table, the common case)."""
    tables = {name.lower() for name in policy.tables}
    if not any(
        cte.alias_or_name.lower() in tables for cte in tree.find_all(exp.CTE) if cte.alias_or_name
    ):
        return tree
    tree = tree.copy()
    _walk(tree, {}, tables)
    return tree


def _with_of(node: exp.Expression) -> exp.With | None:
    return node.args.get("with_") or node.args.get("with")


def _walk(node: exp.Expression, visible: dict[str, str], tables: set[str]) -> None:
    """Rename in ``node`` the references to the CTEs ``visible`` maps (lower name -> new name),
    entering each WITH with the scope rules of the module docstring."""
    with_ = _with_of(node) if isinstance(node, exp.Query) else None
    if with_ is not None:
        scope = dict(visible)
        for cte in with_.expressions:
            _walk(cte.this, scope, tables)  # a CTE's body sees the CTEs before it only
            name = cte.alias_or_name.lower()
            if name in tables:
                new = cte.alias_or_name + CTE_SUFFIX
                alias = cte.args.get("alias")
                ident = exp.Identifier(this=new, quoted=True)
                if alias is not None and alias.this is not None:
                    ident.meta.update(alias.this.meta)
                    alias.set("this", ident)
                scope[name] = new
            else:
                scope.pop(name, None)  # a CTE of a new name hides an outer one of that name
        visible = scope
    for key, value in node.args.items():
        if key in ("with_", "with"):
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, exp.Table):
                _rename_reference(child, visible)
            elif isinstance(child, exp.Expression):
                _walk(child, visible, tables)


def _rename_reference(table: exp.Table, visible: dict[str, str]) -> None:
    if not isinstance(table.this, exp.Identifier) or table.args.get("db"):
        return
    new = visible.get(table.name.lower())
    if new is None:
        return
    original = table.this
    ident = exp.Identifier(this=new, quoted=True)
    ident.meta.update(original.meta)
    table.set("this", ident)
    if not table.alias:
        table.set("alias", exp.TableAlias(this=exp.Identifier(this=original.this, quoted=False)))
