"""dp_rule_list table function: planning from policy domains, release rows, refusals."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from dpsql.errors import PrivacyError, ProgrammingError, UndefinedColumnError
from dpsql.policy import load_policy
from dpsql.privacy.samplers import SeededNoise
from dpsql.rulelist import plan_rule_list, release_rule_list
from dpsql.rulelist.table_function import features_from_column

WORK = ["Private", "Self-emp", "Gov", "Never-worked"]


def _policy(**table_extra):
    table = {
        "source": "people",
        "columns": {
            "pid": {"type": "int"},
            "workclass": {"type": "text", "values": WORK},
            "age": {"type": "int", "lower": 17, "upper": 90},
            "married": {"type": "bool"},
            "score": {"type": "float"},
            "income": {"type": "text", "values": ["<=50K", ">50K"]},
        },
    }
    table.update(table_extra)
    return load_policy({"tables": {"people": table}}).table("people")


def _people(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    work = rng.choice(WORK, n)
    age = rng.integers(17, 91, n)
    married = rng.random(n) < 0.5
    rich = (married & (age >= 35)) | (work == "Self-emp")
    rich = np.where(rng.random(n) < 0.1, ~rich, rich)
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE people (pid INTEGER, workclass VARCHAR, age INTEGER, married BOOLEAN, "
        "score DOUBLE, income VARCHAR)"
    )
    con.executemany(
        "INSERT INTO people VALUES (?, ?, ?, ?, ?, ?)",
        [
            (i, str(w), int(a) if i % 97 else None, bool(m), 0.0, ">50K" if r else "<=50K")
            for i, (w, a, m, r) in enumerate(zip(work, age, married, rich, strict=True))
        ],
    )
    return con


def test_features_come_from_declared_domains_only():
    tp = _policy()
    assert [f.name for f in features_from_column(tp.columns["workclass"])] == [
        f"workclass = '{w}'" for w in WORK
    ]
    ages = features_from_column(tp.columns["age"])
    assert [f.name for f in ages] == ["age >= 36", "age >= 54", "age >= 72"]
    assert ages[0].neg_sql == '"age" < 36 OR "age" IS NULL'
    assert [f.name for f in features_from_column(tp.columns["age"], [30, 50])] == [
        "age >= 30",
        "age >= 50",
    ]
    assert features_from_column(tp.columns["score"]) == []  # no public domain
    assert features_from_column(tp.columns["married"])[0].sql == '"married" IS TRUE'


def test_plan_release_and_predicates_run_in_duckdb():
    tp = _policy()
    con = _people()
    plan = plan_rule_list(
        tp, label="income", positive=">50K", epsilon=2.0, mechanism="monotone_em", max_length=4
    )
    assert plan.cost.epsilon == 2.0 and plan.cost.delta == 0.0
    assert {f.name for f in plan.features} >= {"married", "age >= 36"}
    assert not any("pid" in f.name or "income" in f.name for f in plan.features)
    data = con.sql(f"SELECT {plan.select_list()} FROM people").fetchnumpy()
    X = np.column_stack([data[f"f{i}"] for i in range(len(plan.features))])
    y = data["y"]
    out = release_rule_list(plan, X, y, SeededNoise(5))
    assert out.cost == plan.cost
    assert [c for c, _ in out.columns][:4] == ["position", "rule", "predicate", "prediction"]
    assert [r[0] for r in out.rows] == list(range(1, len(out.rows) + 1))
    assert out.rows[-1][6] is True and out.rows[-1][2] == "TRUE"
    # the predicates are valid SQL and the CASE over raw rows equals predict on the 0/1 matrix
    case = (
        "CASE "
        + " ".join(f"WHEN {r[2]} THEN {int(r[3])}" for r in out.rows[:-1])
        + f" ELSE {int(out.rows[-1][3])} END"
    )
    scored = np.array([r[0] for r in con.sql(f"SELECT {case} FROM people").fetchall()])
    assert np.array_equal(scored, out.rule_list.predict(X))
    assert np.mean(scored == y) > 0.75  # tolerance: non-private ≈ 0.9 on this synthetic table


def test_refusals_before_reading_data():
    tp = _policy()
    with pytest.raises(UndefinedColumnError):
        plan_rule_list(tp, label="salary", positive="x", mechanism="monotone_em")
    with pytest.raises(ProgrammingError, match="positive"):
        plan_rule_list(tp, label="income", mechanism="monotone_em")
    with pytest.raises(ProgrammingError, match="declared values"):
        plan_rule_list(tp, label="income", positive="rich", mechanism="monotone_em")
    with pytest.raises(PrivacyError, match="no declared public domain"):
        plan_rule_list(
            tp, label="income", positive=">50K", features=["score"], mechanism="monotone_em"
        )
    with pytest.raises(UndefinedColumnError):
        plan_rule_list(
            tp, label="income", positive=">50K", features=["nope"], mechanism="monotone_em"
        )
    with pytest.raises(PrivacyError, match="not available through SQL"):
        plan_rule_list(tp, label="income", positive=">50K", mechanism="none")
    with pytest.raises(ProgrammingError, match="needs delta"):
        plan_rule_list(tp, label="income", positive=">50K", mechanism="smooth_laplace")
    with pytest.raises(ProgrammingError, match="epsilon"):
        plan_rule_list(tp, label="income", positive=">50K", epsilon=-1, mechanism="monotone_em")


def test_units_owning_several_rows():
    tp = _policy(privacy_unit="pid", max_rows_per_unit=3)
    with pytest.raises(PrivacyError, match="one row per privacy unit") as info:
        plan_rule_list(tp, label="income", positive=">50K", delta=1e-6, mechanism="smooth_laplace")
    assert "monotone_em" in info.value.hint
    plan = plan_rule_list(tp, label="income", positive=">50K")  # SQL default: monotone_em
    assert plan.params.mechanism == "monotone_em"
    assert plan.params.rows_per_unit == 3  # sensitivities scale with the declared bound
