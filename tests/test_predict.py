"""expand_predictions: dp_predict('name', ...) becomes the model's CASE over the columns.

AST in, AST out; the expanded SQL run on a small DuckDB table scores rows exactly as the
learned list's Python predict; unknown names and bad calls are refused with a SQLSTATE."""

from __future__ import annotations

import json

import duckdb
import numpy as np
import pytest
import sqlglot
from sqlglot import exp

from dpsql.errors import ProgrammingError
from dpsql.models.predict import PREDICTORS, UndefinedObjectError, expand_predictions
from dpsql.models.store import StoredModel
from dpsql.policy import load_policy
from dpsql.privacy.samplers import SeededNoise
from dpsql.rulelist import plan_rule_list, release_rule_list

WORK = ["Private", "Self-emp", "Gov"]


def _table():
    rng = np.random.default_rng(4)
    n = 2000
    work = rng.choice(WORK, n)
    age = rng.integers(17, 91, n)
    married = rng.random(n) < 0.5
    rich = (married & (age >= 40)) | (work == "Self-emp")
    rich = np.where(rng.random(n) < 0.05, ~rich, rich)
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE people (workclass VARCHAR, age INTEGER, married BOOLEAN, rich BOOLEAN)"
    )
    con.executemany(
        "INSERT INTO people VALUES (?, ?, ?, ?)",
        [
            (str(w), int(a) if i % 50 else None, bool(m), bool(r))
            for i, (w, a, m, r) in enumerate(zip(work, age, married, rich, strict=True))
        ],
    )
    policy = load_policy(
        {
            "tables": {
                "people": {
                    "source": "people",
                    "columns": {
                        "workclass": {"type": "text", "values": WORK},
                        "age": {"type": "int", "lower": 17, "upper": 90},
                        "married": {"type": "bool"},
                        "rich": {"type": "bool"},
                    },
                }
            }
        }
    ).table("people")
    return con, policy


@pytest.fixture(scope="module")
def learned():
    con, tp = _table()
    plan = plan_rule_list(tp, label="rich", epsilon=5.0, max_length=5, model="m")
    data = con.sql(f"SELECT {plan.select_list()} FROM people").fetchnumpy()
    X = np.column_stack([data[f"f{i}"] for i in range(len(plan.features))])
    out = release_rule_list(plan, X, data["y"], SeededNoise(2))
    stored = StoredModel(
        "m",
        "rule_list",
        "a",
        "d",
        "people",
        "now",
        5.0,
        0.0,
        0.0,
        "q",
        json.dumps(plan.model_payload(out.rule_list)),
    )
    return con, X, out.rule_list, {"m": stored}


def test_expansion_is_a_case_over_the_columns(learned):
    _, _, rl, models = learned
    tree = sqlglot.parse_one(
        "SELECT dp_predict('m') AS pred, rich, COUNT(*) FROM people GROUP BY 1, 2", read="duckdb"
    )
    out = expand_predictions(tree, models.get)
    assert (
        out is not tree
        and "dp_predict" in tree.sql().lower()
        and "dp_predict" not in out.sql().lower()
    )
    case = out.find(exp.Case)
    assert case is not None and len(case.args["ifs"]) == len(rl.rules) - 1
    assert out.find(exp.Anonymous) is None
    assert set(PREDICTORS) >= {"rule_list"}


def test_expanded_sql_scores_rows_like_predict(learned):
    con, X, rl, models = learned
    for sql in (
        "SELECT dp_predict('m') FROM people",
        "SELECT dp_predict('m', people.*) FROM people",
        "SELECT dp_predict('m', *) FROM people",
    ):
        expanded = expand_predictions(sqlglot.parse_one(sql, read="duckdb"), models.get)
        got = [r[0] for r in con.sql(expanded.sql(dialect="duckdb")).fetchall()]
        assert got == [bool(p) for p in rl.predict(X)]
    # inside an aggregate / group key: a confusion matrix
    expanded = expand_predictions(
        sqlglot.parse_one(
            "SELECT dp_predict('m') AS pred, rich, COUNT(*) FROM people GROUP BY 1, 2",
            read="duckdb",
        ),
        models.get,
    )
    cells = con.sql(expanded.sql(dialect="duckdb")).fetchall()
    assert sum(c[2] for c in cells) == len(X)
    right = sum(c[2] for c in cells if c[0] == c[1])
    assert right / len(X) > 0.8  # tolerance: the rule explains ~95% of labels at ε = 5


def test_refusals(learned):
    _, _, _, models = learned
    text = "SELECT dp_predict('nope') FROM people"
    with pytest.raises(UndefinedObjectError) as info:
        expand_predictions(sqlglot.parse_one(text, read="duckdb"), models.get)
    assert info.value.sqlstate == "42704" and "dpsql model list" in info.value.hint
    assert info.value.position is not None
    for bad in ("SELECT dp_predict(age) FROM people", "SELECT dp_predict('m', age) FROM people"):
        with pytest.raises(ProgrammingError) as info:
            expand_predictions(sqlglot.parse_one(bad, read="duckdb"), models.get)
        assert info.value.sqlstate == "42883"
    with pytest.raises(ProgrammingError) as info:
        expand_predictions(
            sqlglot.parse_one("SELECT dp_predict('m') FROM visits", read="duckdb"), models.get
        )
    assert info.value.sqlstate == "42809"
    other = {"r": StoredModel(**{**models["m"].__dict__, "name": "r", "kind": "linear_regression"})}
    if "linear_regression" not in PREDICTORS:
        with pytest.raises(ProgrammingError) as info:
            expand_predictions(
                sqlglot.parse_one("SELECT dp_predict('r') FROM people", read="duckdb"), other.get
            )
        assert info.value.sqlstate == "0A000"
