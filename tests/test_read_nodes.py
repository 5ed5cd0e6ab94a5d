"""The read under a plan's rows is a relational node that carries what its lowering needs
(issue 26 item 2): a private join's sides, kinds and ON condition trees, a unit_path table's
path, a per-unit relation's spec, guarded WHERE and stored columns, a public table's rows.
The compiler and the row inputs lower the FROM from that node (dpsql.lower.sources), so a
change to the node is a change to the engine's FROM; a computed column is lowered from the
tree it carries, never from its text."""

from __future__ import annotations

import dataclasses

import pytest
from sqlglot import exp
from test_private_joins import star_policy

from dpsql.frontend.bind import parse_statement
from dpsql.lower import sources
from dpsql.lower.compile import compile_plan, render
from dpsql.lower.row_values import column_value
from dpsql.pipeline import Service, Settings
from dpsql.plan.relational import JoinedRows, PerUnit, Scan
from dpsql.plan.tree import read_node
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger

JOIN = (
    "SELECT p.sex, COUNT(*) FROM patients p LEFT JOIN visits v "
    "ON v.patient_id = p.patient_id GROUP BY p.sex"
)


@pytest.fixture(scope="module")
def service():
    svc = Service(load_policy(star_policy()), ledger=MemoryLedger())
    yield svc
    svc.close()


def _plan(service, sql):
    statement = parse_statement(sql, service.policy, None)
    return service.plan(statement, Settings.from_policy(service.policy))


def test_a_private_join_is_on_its_scan_node(service) -> None:
    plan = _plan(service, JOIN)
    read = sources.read_of(plan.bound.input)
    assert isinstance(read, Scan) and isinstance(read.source, JoinedRows)
    first, second = read.source.sides
    assert first.on is None and first.kind == ""
    assert second.kind == "LEFT" and isinstance(second.on, exp.EQ)
    assert read.describe() == f"Scan {plan.query.table.name}"  # EXPLAIN as before
    assert read == read_node(plan.query.table)
    assert sources.stored_scan(plan.bound.input) is None  # no column program, no store


def test_the_from_is_lowered_from_the_node(service) -> None:
    """An INNER side instead of the LEFT one on the node, and the FROM says INNER: the
    lowering reads the node, not the policy's join record."""
    plan = _plan(service, JOIN)
    read = sources.read_of(plan.bound.input)
    assert isinstance(read, Scan) and read.source is not None
    text = render(sources.source(read), "duckdb")
    assert " LEFT JOIN " in text
    first, second = read.source.sides
    inner = dataclasses.replace(read.source, sides=(first, dataclasses.replace(second, kind="")))
    changed = render(sources.source(dataclasses.replace(read, source=inner)), "duckdb")
    assert " LEFT JOIN " not in changed and " JOIN " in changed
    # the node's ON tree is placed as a copy: lowering twice gives the same text
    assert render(sources.source(read), "duckdb") == text
    assert second.on is not None and second.on.parent is None
    assert text in compile_plan(plan, 1, store=False).render("duckdb")


def test_a_unit_path_table_reads_its_path_from_the_node(service) -> None:
    table = parse_statement(
        "SELECT drug, COUNT(*) FROM prescriptions GROUP BY drug", service.policy, None
    ).table
    node = read_node(table)
    assert isinstance(node, Scan) and node.source is not None
    assert [s.rows.table for s in node.source.sides] == [s.table.name for s in table.joined.steps]


def test_a_per_unit_relation_carries_its_spec_and_guarded_where(service) -> None:
    sql = (
        "SELECT AVG(n) FROM (SELECT patient_id, COUNT(*) AS n FROM visits "
        "WHERE cost / dept_id > 1 AND cost > 30 GROUP BY patient_id) t"
    )
    table = parse_statement(sql, service.policy, None).table
    node = read_node(table)
    assert isinstance(node, PerUnit) and node.spec is table.joined.spec
    assert [total for _, total in node.where] == [False, True]
    text = render(sources.per_unit(node), "duckdb")
    assert "WHERE (cost > 30) AND TRY((cost / dept_id > 1)) AND NOT" in text.replace('"', "")


def test_a_computed_column_is_lowered_from_its_tree(service) -> None:
    """The binder keeps a copy of the expression's tree on the computed column; the lowering
    places a copy of that tree (a different tree than its text says is what runs)."""
    plan = _plan(service, "SELECT SUM(cost * 2) FROM visits")
    (col,) = [c for c in plan.query.table.columns.values() if c.expr is not None]
    assert isinstance(col.tree, exp.Expression) and col.tree.sql(dialect="duckdb") == col.expr
    assert column_value(col).sql(dialect="duckdb") == f"TRY({col.expr})"
    other = dataclasses.replace(col, tree=exp.column("cost", quoted=True))
    assert column_value(other).sql(dialect="duckdb") == 'TRY("cost")'
    assert column_value(col).this is not col.tree  # a copy each time
