"""The row inputs of dp_rule_list and the regressions are bounded by the query plan's own tree
(dpsql.lower.bounding.unit_rows, row_rank, row_order), their features are trees built from the
policy (dpsql.lower.builders), and they give, for the same secret, exactly the rows the SQL text
written before them gave (copied below as the reference, the features' text included): on the
fixture and on generated data (units over R, NULL units, text/int/float/date/bool columns with
NULLs, a text unit, a table without a unit)."""

from __future__ import annotations

import random
from pathlib import Path

import duckdb
import pytest
import sqlglot

from dpsql.frontend.identifiers import quote_ident as _q
from dpsql.lower import bounding
from dpsql.lower.builders import policy_column
from dpsql.lower.compile import render
from dpsql.lower.hashing import KEYED_HASH, is_keyed_hash, is_secret, with_secret
from dpsql.lower.rows import bound_note, bounded_rows, engine_text, pattern_counts
from dpsql.models.regression_function import plan_regression
from dpsql.policy import TablePolicy, load_policy
from dpsql.rulelist import plan_rule_list

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures"
SECRETS = (1, 2**61 + 12345)


# -- the reference: dpsql/lower/rows.py and RegressionPlan.select_list as written before ------


def old_bounded_rows_sql(table: TablePolicy, select_list: str, secret: int) -> str:
    source = _q(table.name)
    relation = source
    if table.joined is not None:  # a unit_path table: its path joined (private_joins)
        from dpsql.lower import sources
        from dpsql.plan.tree import read_node

        relation = sources.source(read_node(table)).sql(dialect="duckdb")
    if table.privacy_unit is None:
        return f"SELECT {select_list} FROM {relation}"
    columns = ", ".join(_q(c) for c in table.columns)
    return (
        f"SELECT {select_list} FROM (SELECT * FROM {relation} "
        f"WHERE {_q(table.privacy_unit)} IS NOT NULL QUALIFY ROW_NUMBER() OVER "
        f"(PARTITION BY {_q(table.privacy_unit)} ORDER BY {KEYED_HASH}({columns}, {secret})) "
        f"<= {table.max_rows_per_unit}) AS {source}"
    )


def old_pattern_counts_sql(
    table: TablePolicy, select_list: str, columns: list[str], secret: int
) -> str:
    names = ", ".join(columns)
    inner = old_bounded_rows_sql(table, select_list, secret)
    return f"SELECT {names}, COUNT(*) AS __w FROM ({inner}) AS r GROUP BY {names} ORDER BY {names}"


def old_literal(value) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | float):
        return repr(value)
    return "'" + str(value).replace("'", "''") + "'"


def old_term_sql(col) -> list[str]:
    """regression_function.terms_of's text as written before (what a stored model keeps)."""
    q = _q(col.name)
    if col.type == "bool":
        return [f"CASE WHEN {q} IS TRUE THEN 1 ELSE 0 END"]
    if col.values is not None and len(col.values) >= 2:
        return [f"CASE WHEN {q} = {old_literal(v)} THEN 1 ELSE 0 END" for v in col.values[1:]]
    return [q]


def old_scaled_sql(sql: str, lo: float, hi: float) -> str:
    clamped = f"LEAST(GREATEST(COALESCE(CAST({sql} AS DOUBLE), {lo!r}), {lo!r}), {hi!r})"
    factor = 2**10 / (hi - lo)
    return f"CAST(ROUND((2.0 * {clamped} - {lo + hi!r}) * {factor!r}) AS BIGINT)"


def old_regression_select_list(plan, unit: str | None, table: TablePolicy) -> str:
    """RegressionPlan.select_list as written before, from the policy's columns."""
    texts = [s for c in plan_columns(plan, table) for s in old_term_sql(c)]
    assert texts == [t.sql for t in plan.terms]  # the stored model's feature text: unchanged
    cols = [
        f"{old_scaled_sql(s, t.lower, t.upper)} AS f{i}"
        for i, (s, t) in enumerate(zip(texts, plan.terms, strict=True))
    ]
    label = table.columns[plan.label]
    q = _q(label.name)
    if plan.kind == "linear_regression":
        cols.append(f"{old_scaled_sql(q, float(label.lower), float(label.upper))} AS y")
        cols.append(f"CASE WHEN {q} IS NULL THEN 0 ELSE 1 END AS m")
    else:
        cols.append(f"CASE WHEN {q} = {old_literal(plan.positive)} THEN 1 ELSE 0 END AS y")
        cols.append("1 AS m")
    order = _q(unit) if unit else "1"
    rank = "DENSE_RANK()" if unit else "ROW_NUMBER()"
    return ", ".join(cols) + f", {rank} OVER (ORDER BY {order}) AS u"


def plan_columns(plan, table: TablePolicy) -> list:
    """The feature columns of a regression plan, in order (each term names its column)."""
    out: list = []
    for t in plan.terms:
        name = t.name.split(" = ")[0]
        if not out or out[-1].name != name:
            out.append(table.columns[name])
    return out


def old_rule_list_select_list(plan) -> str:
    """RuleListPlan.select_list as written before: from each feature's text (a bool label),
    that text as features_from_column wrote it before (the released rule list's CASE)."""
    for f in plan.features:
        if f.threshold is not None:
            old = f"{_q(f.column)} >= {f.name.split(' >= ')[1]}"
        elif f.exclusive is not None:
            old = f"{_q(f.exclusive)} = {f.name.split(' = ', 1)[1]}"
        else:
            old = f"{_q(f.name)} IS TRUE"
        assert f.sql == old
    cols = [f"CASE WHEN {f.sql} THEN 1 ELSE 0 END AS f{i}" for i, f in enumerate(plan.features)]
    y = f"CASE WHEN {_q(plan.label)} = {old_literal(plan.positive)} THEN 1 ELSE 0 END AS y"
    return ", ".join([*cols, y])


def new_bounded_rows_sql(table: TablePolicy, names: list[str], secret: int) -> str:
    return engine_text(bounded_rows(table, [policy_column(n) for n in names]), secret)


def new_pattern_counts_sql(table: TablePolicy, plan, columns: list[str], secret: int) -> str:
    return engine_text(pattern_counts(table, plan.items(), columns), secret)


def quoted_list(names: list[str]) -> str:
    return ", ".join(_q(n) for n in names)


# -- data ----------------------------------------------------------------------------------


def run(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple]:
    """As the engine runs it (DuckDBEngine.fetch_matrix): parsed, the keyed hash rendered."""
    return con.execute(render(sqlglot.parse_one(sql, read="duckdb"), "duckdb")).fetchall()


def key(row: tuple) -> tuple:
    return tuple((v is None, str(type(v)), v if v is not None else 0) for v in row)


def same(con, old: str, new: str) -> int:
    """Both queries' rows, exactly equal as multisets (the bounded rows have no order)."""
    a, b = run(con, old), run(con, new)
    assert sorted(a, key=key) == sorted(b, key=key)
    return len(a)


@pytest.fixture(scope="module")
def visits():
    table = load_policy(FIXTURE / "visits.toml").table("visits")
    con = duckdb.connect()
    con.execute(f"CREATE TABLE visits AS SELECT * FROM read_csv('{FIXTURE / 'visits.csv'}')")
    yield table, con
    con.close()


def generated_policy(unit: str | None, unit_type: str = "int") -> TablePolicy:
    columns = {
        "t": {"type": "text", "values": ["a", "b", "c"]},
        "i": {"type": "int", "lower": 0, "upper": 100},
        "f": {"type": "float", "lower": -10.0, "upper": 10.0},
        "d": {"type": "date", "lower": "2024-01-01", "upper": "2024-12-31"},
        "b": {"type": "bool"},
    }
    table: dict = {"source": "gen", "columns": columns}
    if unit is not None:
        columns = {unit: {"type": unit_type}, **columns}
        table.update(columns=columns, privacy_unit=unit, max_rows_per_unit=3)
    return load_policy({"tables": {"gen": table}}).table("gen")


def generated(unit_type: str = "int", n_units: int = 60, seed: int = 5):
    """Units of 1..12 rows (R = 3: most over R), every 9th row without a unit, duplicate rows,
    NULLs in every value column."""
    rng = random.Random(seed)
    rows = []
    for u in range(n_units):
        for _ in range(rng.randint(1, 12)):
            unit = None if rng.random() < 0.11 else (u if unit_type == "int" else f"u{u:03d}")
            row = (
                unit,
                rng.choice(["a", "b", "c", None]),
                rng.choice([rng.randint(0, 100), None]),
                rng.choice([round(rng.uniform(-12, 12), 3), None, -0.0]),
                f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                rng.choice([True, False, None]),
            )
            rows.append(row)
            if rng.random() < 0.1:
                rows.append(row)  # a duplicate: the same hash, the same output
    con = duckdb.connect()
    kind = "INTEGER" if unit_type == "int" else "VARCHAR"
    con.execute(f"CREATE TABLE gen (u {kind}, t VARCHAR, i INTEGER, f DOUBLE, d DATE, b BOOLEAN)")
    con.executemany("INSERT INTO gen VALUES (?, ?, ?, ?, ?, ?)", rows)
    return con


# -- tests ---------------------------------------------------------------------------------


def test_fixture_rule_list_and_regression_inputs_are_the_old_ones(visits):
    table, con = visits
    rule_list = plan_rule_list(
        table, label="readmitted", epsilon=1.0, mechanism="monotone_em", max_length=3
    )
    columns = [f"f{i}" for i in range(len(rule_list.predicates))] + ["y"]
    linear = plan_regression(
        "dp_linear_regression",
        table,
        label="cost",
        features=["age", "smoker", "department"],
        delta=1e-6,
    )
    regression_items = linear.items(table.privacy_unit)
    regression_old = old_regression_select_list(linear, table.privacy_unit, table)
    for secret in SECRETS:
        every = ["patient_id", "age", "cost", "visit_date", "diagnosis"]
        old = old_bounded_rows_sql(table, quoted_list(every), secret)
        n = same(con, old, new_bounded_rows_sql(table, every, secret))
        assert 0 < n < 20000  # bounded: patients over R lost rows
        old = old_pattern_counts_sql(table, old_rule_list_select_list(rule_list), columns, secret)
        new = new_pattern_counts_sql(table, rule_list, columns, secret)
        assert run(con, old) == run(con, new)  # sorted by the query itself
        old = old_bounded_rows_sql(table, regression_old, secret)
        new = engine_text(bounded_rows(table, regression_items), secret)
        assert same(con, old, new) == n


@pytest.mark.parametrize("unit_type", ["int", "text"])
def test_generated_tables_bound_exactly_as_before(unit_type):
    table = generated_policy("u", unit_type)
    con = generated(unit_type)
    rule_list = plan_rule_list(table, label="b", epsilon=1.0, mechanism="monotone_em", max_length=2)
    columns = [f"f{i}" for i in range(len(rule_list.predicates))] + ["y"]
    linear = plan_regression(
        "dp_linear_regression", table, label="f", features=["i", "t", "b"], delta=1e-6
    )
    logistic = plan_regression(
        "dp_logistic_regression", table, label="b", features=["i", "f"], sample_rate=0.1, delta=1e-6
    )
    total = run(con, "SELECT COUNT(*) FROM gen WHERE u IS NOT NULL")[0][0]
    for secret in SECRETS:
        every = ["u", "t", "i", "f", "d", "b"]
        old = old_bounded_rows_sql(table, quoted_list(every), secret)
        n = same(con, old, new_bounded_rows_sql(table, every, secret))
        units = engine_text(bounded_rows(table, [sqlglot.exp.column("u")]), secret)
        per_unit = run(con, f"SELECT MAX(c) FROM (SELECT COUNT(*) c FROM ({units}) GROUP BY u)")
        assert per_unit[0][0] == 3 and n < total  # units over R were cut to R
        old = old_pattern_counts_sql(table, old_rule_list_select_list(rule_list), columns, secret)
        new = new_pattern_counts_sql(table, rule_list, columns, secret)
        assert run(con, old) == run(con, new)
        for plan in (linear, logistic):
            old = old_bounded_rows_sql(table, old_regression_select_list(plan, "u", table), secret)
            new = engine_text(bounded_rows(table, plan.items("u")), secret)
            assert same(con, old, new) == n
    con.close()


def test_a_table_without_a_unit_reads_every_row():
    table = generated_policy(None)
    con = generated()
    con.execute("ALTER TABLE gen DROP COLUMN u")
    linear = plan_regression(
        "dp_linear_regression", table, label="f", features=["i", "t"], delta=1e-6
    )
    old = old_bounded_rows_sql(table, old_regression_select_list(linear, None, table), 7)
    new = engine_text(bounded_rows(table, linear.items(None)), 7)
    a, b = run(con, old), run(con, new)
    # u is ROW_NUMBER() OVER (ORDER BY 1) in both: one number per row, in the engine's order
    assert sorted(r[:-1] for r in a) == sorted(r[:-1] for r in b)
    assert sorted(r[-1] for r in b) == list(range(1, len(a) + 1))
    assert "HASH" not in new and len(b) == run(con, "SELECT COUNT(*) FROM gen")[0][0]
    con.close()


def test_the_tree_is_the_query_plans_bounding():
    """No SQL text: the keyed hash is dpsql.lower.bounding.row_order's, with the secret slot
    until a run prints its secret; the window is row_rank's, as the query plan's."""
    table = generated_policy("u")
    tree = bounded_rows(table, [sqlglot.exp.column("i")])
    (window,) = list(tree.find_all(sqlglot.exp.Window))
    assert window == bounding.row_rank(table, [sqlglot.exp.column("u", quoted=True)])
    (hashed,) = [n for n in tree.find_all(sqlglot.exp.Anonymous) if is_keyed_hash(n)]
    assert hashed == bounding.row_order(table) and is_secret(hashed.expressions[-1])
    assert tree.find(sqlglot.exp.Qualify).this.expression.this == "3"  # R
    assert ", 42)) <= 3" in engine_text(tree, 42)
    note = bound_note(table)
    assert "Bound per u: <= 3 rows" in note and "a unit changes" in note


def test_explain_notes_the_bound_node_and_spends_nothing():
    import dpsql
    from dpsql.dbapi import connect_service
    from dpsql.privacy.ledger import MemoryLedger
    from dpsql.privacy.samplers import SeededNoise

    service = dpsql.Service(FIXTURE / "visits.toml", ledger=MemoryLedger(), noise=SeededNoise(1))
    try:
        cur = connect_service(service, "bound-explain").cursor()
        for call in (
            "dp_rule_list('visits', label => 'smoker', max_length => 2)",
            "dp_linear_regression('visits', label => 'cost', features => ['age'], delta => 1e-6)",
        ):
            cur.execute(f"EXPLAIN SELECT * FROM {call}")
            notes = [m for _, m in cur.messages]
            assert any("Bound per patient_id: <= 5 rows" in m for m in notes), notes
        assert service.ledger.spent("bound-explain", service.policy.dataset).is_zero
    finally:
        service.close()


def test_a_unit_path_table_is_bounded_through_its_path_as_before():
    """prescriptions reach their patient through visits (fixtures/star): the same rows."""
    star = FIXTURE / "star"
    table = load_policy(star / "star.toml").table("prescriptions")
    assert table.joined is not None
    con = duckdb.connect()
    for name in ("prescriptions", "visits"):
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM read_csv('{star / (name + '.csv')}')")
    every = ["patient_id", "prescription_id", "visit_id", "drug", "dose"]
    for secret in SECRETS:
        old, new = (
            old_bounded_rows_sql(table, quoted_list(every), secret),
            new_bounded_rows_sql(table, every, secret),
        )
        n = same(con, old, new)
        total = run(con, "SELECT COUNT(*) FROM prescriptions")[0][0]
        assert 0 < n < total and 'JOIN "visits"' in new  # patients over R lost rows
    con.close()


@pytest.mark.parametrize("dialect", ["duckdb", "spark"])
def test_each_engine_runs_the_very_text_it_ran_before(visits, dialect):
    """fetch_matrix takes the tree and renders it once; before, it parsed the old text and
    rendered that: both engines' text is the same, byte for byte (Spark needs no session)."""

    def before(text: str) -> str:
        return render(sqlglot.parse_one(text, read="duckdb"), dialect)

    def now(tree) -> str:
        return render(with_secret(tree, 7), dialect)

    cases = [  # table, a bool label, a number target, its features, the label's features
        (visits[0], "readmitted", "cost", ["age", "smoker", "department"], ["age", "cost"]),
        (generated_policy("u"), "b", "f", ["i", "t", "b"], ["i", "f"]),
        (generated_policy(None), "b", "f", ["i", "t", "b"], ["i", "f"]),
    ]
    for table, label, target, features, of_label in cases:
        rules = plan_rule_list(table, label=label, epsilon=1.0, mechanism="monotone_em")
        columns = [f"f{i}" for i in range(len(rules.predicates))] + ["y"]
        old = old_pattern_counts_sql(table, old_rule_list_select_list(rules), columns, 7)
        assert before(old) == now(pattern_counts(table, rules.items(), columns))
        linear = plan_regression(
            "dp_linear_regression", table, label=target, features=features, delta=1e-6
        )
        logistic = plan_regression(
            "dp_logistic_regression", table, label=label, features=of_label, delta=1e-6
        )
        for plan in (linear, logistic):
            unit = table.privacy_unit
            old = old_bounded_rows_sql(table, old_regression_select_list(plan, unit, table), 7)
            assert before(old) == now(bounded_rows(table, plan.items(unit)))
