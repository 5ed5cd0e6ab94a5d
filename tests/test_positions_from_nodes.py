"""A refusal's position comes from its node (dpsql.frontend.positions): each positioned node
records the statement it was parsed from as the parse ends, every copy keeps it (the CTE and
derived-table inliners copy bodies), and it is read without the text wherever the refusal is
raised, even after another statement was read on the same thread (a cached plan's check)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlglot import exp

from dpsql.errors import ProgrammingError
from dpsql.frontend.bind import _statement_tree, parse_statement
from dpsql.frontend.positions import SOURCE, position_of, reading, snippet
from dpsql.policy import load_policy

POLICY = load_policy(Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml")
TEXT = "SELECT department,\n  COUNT(*) FROM visits WHERE cost > 10 GROUP BY department"


def tree_of(text: str) -> exp.Expr:
    return _statement_tree(reading(text, "duckdb"), POLICY, None, None)


def condition(tree: exp.Expr) -> exp.Expr:
    where = tree.args["where"]
    assert isinstance(where, exp.Where)
    return where.this


def test_every_positioned_node_records_its_statement() -> None:
    recorded = [n for n in tree_of(TEXT).walk() if n._meta and "start" in n._meta]
    assert recorded
    assert all(n._meta[SOURCE].text == TEXT for n in recorded)


def test_a_copy_keeps_the_position() -> None:
    where = condition(tree_of(TEXT))
    at = position_of(where)
    assert at is not None and (at.line, at.column) == (2, 30)  # "cost" on line 2
    assert position_of(where.copy()) == at
    assert position_of(where.transform(lambda n: n, copy=True)) == at


def test_a_node_points_into_its_own_statement_after_another_is_read() -> None:
    where = condition(tree_of(TEXT))
    before = (position_of(where), snippet(where))
    tree_of("SELECT 1\n\n\n")  # another statement read on this thread since
    assert (position_of(where), snippet(where)) == before
    assert before[1] == "cost > 10"


def test_a_refusal_in_a_cte_body_points_into_the_text() -> None:
    text = "WITH v AS (SELECT * FROM visits\n WHERE nosuch > 1)\nSELECT COUNT(*) FROM v"
    with pytest.raises(ProgrammingError) as info:
        parse_statement(text, POLICY)
    at = info.value.position
    assert at is not None and (at.line, at.column) == (2, 8)  # "nosuch"
