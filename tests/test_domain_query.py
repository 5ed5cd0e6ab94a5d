"""A key's public-domain enumeration is a tree (dpsql.lower.domain_query), not text spliced.

The references are the texts dpsql.plan.domains spliced before (issue 26 item 2): the tree
renders to what DuckDB's parser reads from them, for every kind of public domain (declared
values with a quote in one, an empty one, a bool, an int range under a name that needs
quoting, a date range, float grids), NULL added where the column is nullable, and for a
derived key over two columns with WHERE conjuncts. The domains the scratch engine returns
from them are the ones the old texts gave.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import duckdb
import pytest
import sqlglot

from dpsql.frontend.statements import GroupKey
from dpsql.lower.domain_query import column_relation, enumeration
from dpsql.plan.domains import column_size, key_domain, ordered_values
from dpsql.policy import load_policy

_CSV = Path(__file__).resolve().parent.parent / "fixtures" / "visits.csv"  # never read
_COLUMNS = {
    "v": {"type": "text", "values": ["a", "it's"], "nullable": True},
    "b": {"type": "bool", "nullable": True},
    "Mixed Case": {"type": "int", "lower": -3, "upper": 4, "nullable": False},
    "d": {"type": "date", "lower": "2024-01-01", "upper": "2024-02-29", "nullable": True},
    "f": {"type": "float", "lower": -5, "upper": 2.5, "granularity": 0.5, "nullable": True},
    "g": {"type": "float", "lower": 0, "upper": 1e6, "nullable": False},
    "n": {"type": "int", "lower": -3, "upper": 4, "nullable": False},
}

#: What dpsql.plan.domains.column_relation spliced for each column (its relation, its size).
_OLD = {
    "v": (
        "SELECT CAST('a' AS TEXT) AS v UNION ALL SELECT CAST('it''s' AS TEXT) AS v "
        "UNION ALL SELECT CAST(NULL AS VARCHAR) AS v",
        3,
    ),
    "b": (
        "SELECT CAST(b AS BOOLEAN) AS b FROM (VALUES (false), (true)) t(b) "
        "UNION ALL SELECT CAST(NULL AS BOOLEAN) AS b",
        3,
    ),
    "mixed case": ('SELECT CAST(range AS BIGINT) AS "mixed case" FROM range(-3, 5)', 8),
    "d": (
        "SELECT CAST(DATE '2024-01-01' + CAST(range AS INTEGER) AS DATE) AS d "
        "FROM range(0, 60) UNION ALL SELECT CAST(NULL AS DATE) AS d",
        61,
    ),
    "f": (
        "SELECT CAST(-5.0 + (7.5) * range / 15 AS DOUBLE) AS f FROM range(0, 16) "
        "UNION ALL SELECT CAST(NULL AS DOUBLE) AS f",
        17,
    ),
    "g": (
        "SELECT CAST(0.0 + (1000000.0) * range / 10000 AS DOUBLE) AS g FROM range(0, 10001)",
        10001,
    ),
    "n": ("SELECT CAST(range AS BIGINT) AS n FROM range(-3, 5)", 8),
}
_EMPTY = 'SELECT CAST(NULL AS BIGINT) AS "mixed case" WHERE false'
_ENUMERATION = (
    'SELECT DISTINCT TRY("v" || CAST("n" % 3 AS TEXT)) FROM (SELECT CAST(\'a\' AS TEXT) AS v '
    "UNION ALL SELECT CAST('it''s' AS TEXT) AS v UNION ALL SELECT CAST(NULL AS VARCHAR) AS v) "
    "AS t0 CROSS JOIN (SELECT CAST(range AS BIGINT) AS n FROM range(-3, 5)) AS t1 "
    'WHERE TRY("n" > -2) AND TRY("v" <> \'a\') LIMIT 51'
)


@pytest.fixture(scope="module")
def table():
    raw = {
        "privacy": {"epsilon": 1.0, "delta": 1e-6, "dataset": "d"},
        "tables": {"t": {"source": str(_CSV), "columns": _COLUMNS}},
    }
    return load_policy(raw).tables["t"]


def _parsed(text: str) -> str:
    return sqlglot.parse_one(text, read="duckdb").sql(dialect="duckdb")


def _rows(text: str) -> list[tuple]:
    return duckdb.connect().execute(text).fetchall()


def test_each_relation_is_the_old_text_as_a_tree(table):
    for name, (text, size) in _OLD.items():
        col = table.columns[name]
        tree = column_relation(col)
        assert tree is not None and tree.sql(dialect="duckdb") == _parsed(text), name
        assert column_size(col) == size == len(_rows(tree.sql(dialect="duckdb"))), name
        assert _rows(tree.sql(dialect="duckdb")) == _rows(text), name
    empty = dataclasses.replace(table.columns["mixed case"], values=())
    assert column_relation(empty).sql(dialect="duckdb") == _parsed(_EMPTY)  # type: ignore[union-attr]
    assert column_size(empty) == 0


def test_a_column_without_a_public_domain_has_no_relation(table):
    unbounded = dataclasses.replace(table.columns["n"], lower=None, upper=None)
    assert column_size(unbounded) is None and column_relation(unbounded) is None


def test_the_enumeration_is_the_old_text_as_a_tree(table):
    expr = sqlglot.parse_one('"v" || CAST("n" % 3 AS VARCHAR)', read="duckdb")
    conditions = tuple(sqlglot.parse_one(c, read="duckdb") for c in ('"n" > -2', "\"v\" <> 'a'"))
    key = GroupKey(expr, ("v", "n"), type="VARCHAR", conditions=conditions)
    tree = enumeration(key, table, 51)
    assert tree is not None and tree.sql(dialect="duckdb") == _parsed(_ENUMERATION)
    con = duckdb.connect()
    ran: list[str] = []

    def evaluate(k: GroupKey, t, limit: int) -> list[tuple]:
        query = enumeration(k, t, limit)
        assert query is not None
        ran.append(query.sql(dialect="duckdb"))
        return con.execute(ran[-1]).fetchall()

    domain = key_domain(key, table, 50, evaluate)
    want = ordered_values([r[0] for r in con.execute(_ENUMERATION).fetchall()])
    assert ran == [tree.sql(dialect="duckdb")] and domain == want and len(want) == 4
