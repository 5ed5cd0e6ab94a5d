"""Policy validation: every bad policy fails at connect with a PolicyError naming the file, the
key and a fix."""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FIXTURE_TOML, exact_connect, rows_of, write_csv

import dpsql
from dpsql.errors import PolicyError
from dpsql.policy import load_policy

GOOD: dict = {
    "privacy": {"epsilon": 1.0, "delta": 1e-6, "budget_epsilon": 5.0, "budget_delta": 1e-5},
    "tables": {
        "t": {
            "source": "t.csv",
            "privacy_unit": "uid",
            "max_rows_per_unit": 2,
            "max_groups_per_unit": 2,
            "columns": {
                "uid": {"type": "int", "nullable": False},
                "age": {"type": "int", "lower": 0, "upper": 100},
                "cost": {"type": "float", "lower": 0.0, "upper": 10.0, "granularity": 0.5},
                "dept": {"type": "text", "values": ["a", "b"]},
                "name": {"type": "text"},
                "day": {"type": "date"},
                "ok": {"type": "bool"},
            },
        }
    },
}


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dt.date):  # a TOML date (or local date-time)
        return v.isoformat()
    return json.dumps(v)


def to_toml(data: dict, prefix: str = "") -> str:
    """Enough TOML for policies: scalars and lists first, then one [section] per sub-table."""
    scalars = [f"{k} = {_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    out = (f"[{prefix}]\n" if prefix and scalars else "") + "".join(s + "\n" for s in scalars)
    for k, v in data.items():
        if isinstance(v, dict):
            out += "\n" + to_toml(v, f"{prefix}.{k}" if prefix else k)
    return out


@pytest.fixture
def write(tmp_path: Path) -> Callable[[dict], Path]:
    write_csv(
        tmp_path / "t.csv",
        ["uid", "age", "cost", "dept", "name", "day", "ok"],
        [(1, 30, 2.5, "a", "x", "2024-01-01", True), (2, 40, None, "b", "y", "2024-01-02", False)],
    )

    def write_policy(policy: dict) -> Path:
        path = tmp_path / "policy.toml"
        path.write_text(to_toml(policy))
        return path

    return write_policy


def test_good_policy_loads_and_answers(write):
    path = write(GOOD)
    policy = load_policy(path)
    table = policy.tables["t"]
    assert table.source_path == path.parent / "t.csv"
    assert (table.privacy_unit, table.max_rows_per_unit, table.max_groups_per_unit) == ("uid", 2, 2)
    assert table.columns["cost"].granularity == 0.5
    assert table.columns["dept"].values == ("a", "b")
    assert policy.dataset == "policy" and policy.ledger_path == path.parent / "policy.ledger.sqlite"
    with exact_connect(str(path)) as conn:
        assert rows_of(conn, "SELECT COUNT(*) FROM t") == [(2,)]


def test_source_is_relative_to_the_policy_file(write, tmp_path, monkeypatch):
    path = write(GOOD)
    monkeypatch.chdir(tmp_path.parent)
    assert load_policy(os.path.relpath(path)).tables["t"].source_path == tmp_path / "t.csv"


def test_shipped_fixture_policy_loads():
    policy = load_policy(FIXTURE_TOML)
    assert policy.tables["visits"].privacy_unit == "patient_id"


def _set(path: str, value):
    def mutate(p: dict) -> None:
        *parents, last = path.split(".")
        node = p
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DELETE:
            node.pop(last)
        else:
            node[last] = value

    return mutate


_DELETE = object()
T = "tables.t"
C = "tables.t.columns"

# (id, mutation, key the error must name, fragment of the problem)
BAD = [
    ("unknown top-level key", _set("extra", 1), "extra", "unknown key"),
    ("unknown privacy key", _set("privacy.epsilom", 1.0), "privacy.epsilom", "unknown key"),
    ("unknown table key", _set(f"{T}.max_row_per_unit", 1), f"{T}.max_row_per_unit", "unknown"),
    ("unknown column key", _set(f"{C}.age.upper_bound", 1), f"{C}.age.upper_bound", "unknown"),
    ("lower > upper", _set(f"{C}.age.lower", 200), f"{C}.age.lower", "lower (200) > upper"),
    ("missing source", _set(f"{T}.source", _DELETE), f"{T}.source", "missing source"),
    ("source file missing", _set(f"{T}.source", "nope.csv"), f"{T}.source", "does not exist"),
    ("unit not a column", _set(f"{T}.privacy_unit", "pid"), f"{T}.privacy_unit", "not a declared"),
    ("unknown type", _set(f"{C}.age.type", "integer"), f"{C}.age.type", "type"),
    ("missing type", _set(f"{C}.age.type", _DELETE), f"{C}.age.type", "type"),
    ("epsilon zero", _set("privacy.epsilon", 0), "privacy.epsilon", "> 0"),
    ("epsilon negative", _set("privacy.epsilon", -1.0), "privacy.epsilon", "> 0"),
    ("epsilon text", _set("privacy.epsilon", "1"), "privacy.epsilon", "number"),
    ("epsilon infinite", _set("privacy.epsilon", math.inf), "privacy.epsilon", "finite"),
    ("epsilon nan", _set("privacy.epsilon", math.nan), "privacy.epsilon", "number"),
    ("delta one", _set("privacy.delta", 1.0), "privacy.delta", "[0, 1)"),
    ("delta negative", _set("privacy.delta", -1e-6), "privacy.delta", "[0, 1)"),
    ("unknown mechanism", _set("privacy.mechanism", "exponential"), "privacy.mechanism", "unknown"),
    ("budget zero", _set("privacy.budget_epsilon", 0.0), "privacy.budget_epsilon", "> 0"),
    ("budget inf", _set("privacy.budget_epsilon", math.inf), "privacy.budget_epsilon", "finite"),
    ("budget delta 2", _set("privacy.budget_delta", 2.0), "privacy.budget_delta", "[0, 1)"),
    ("max_bins fraction", _set("privacy.max_bins", 0.5), "privacy.max_bins", "integer"),
    ("ledger not a path", _set("privacy.ledger", 3), "privacy.ledger", "path"),
    ("rows zero", _set(f"{T}.max_rows_per_unit", 0), f"{T}.max_rows_per_unit", "integer >= 1"),
    ("rows fraction", _set(f"{T}.max_rows_per_unit", 2.5), f"{T}.max_rows_per_unit", "integer"),
    ("groups bool", _set(f"{T}.max_groups_per_unit", True), f"{T}.max_groups_per_unit", "integer"),
    ("bounds on text", _set(f"{C}.name.lower", 0), f"{C}.name", "only for int, float and date"),
    ("one date bound", _set(f"{C}.day.upper", "2024-12-31"), f"{C}.day", "both lower and upper"),
    (
        "date bound a number",
        lambda p: p["tables"]["t"]["columns"]["day"].update(lower=3, upper="2024-12-31"),
        f"{C}.day.lower",
        "ISO date",
    ),
    (
        "date bound not a day",
        lambda p: p["tables"]["t"]["columns"]["day"].update(lower="2024-01-01", upper="2024-02-30"),
        f"{C}.day.upper",
        "ISO date",
    ),
    (
        "date bound a time",
        lambda p: p["tables"]["t"]["columns"]["day"].update(
            lower="2024-01-01", upper=dt.datetime(2024, 3, 1, 12)
        ),
        f"{C}.day.upper",
        "ISO date",
    ),
    (
        "date lower > upper",
        lambda p: p["tables"]["t"]["columns"]["day"].update(lower="2025-01-01", upper="2024-01-01"),
        f"{C}.day.lower",
        "lower (2025-01-01) > upper (2024-01-01)",
    ),
    ("one bound", _set(f"{C}.age.upper", _DELETE), f"{C}.age", "both lower and upper"),
    ("int bounds fractional", _set(f"{C}.age.upper", 99.5), f"{C}.age", "integers"),
    ("infinite bound", _set(f"{C}.cost.upper", math.inf), f"{C}.cost.upper", "finite"),
    ("nan bound", _set(f"{C}.cost.lower", math.nan), f"{C}.cost.lower", "number"),
    ("bool bound", _set(f"{C}.age.lower", False), f"{C}.age.lower", "number"),
    ("values of wrong type", _set(f"{C}.dept.values", [1, 2]), f"{C}.dept.values", "not a text"),
    ("duplicate values", _set(f"{C}.dept.values", ["a", "a"]), f"{C}.dept.values", "duplicate"),
    ("empty values", _set(f"{C}.dept.values", []), f"{C}.dept.values", "non-empty"),
    ("bad date value", _set(f"{C}.day.values", ["2024-13-01"]), f"{C}.day.values", "ISO date"),
    ("nullable text", _set(f"{C}.age.nullable", "no"), f"{C}.age.nullable", "true or false"),
    ("granularity on int", _set(f"{C}.age.granularity", 0.1), f"{C}.age.granularity", "float"),
    ("granularity negative", _set(f"{C}.cost.granularity", -1.0), f"{C}.cost.granularity", "> 0"),
    ("column not a table", _set(f"{C}.age", 3), f"{C}.age", "must be a table"),
    ("no columns", _set(f"{T}.columns", _DELETE), f"{T}.columns", "no columns"),
    ("no tables", _set("tables", _DELETE), "tables", "no tables"),
    (
        "gaussian without delta",
        lambda p: p["privacy"].update(mechanism="gaussian", delta=0.0),
        "privacy.delta",
        "Gaussian",
    ),
    (
        "rows bound without unit",
        lambda p: p["tables"]["t"].update(privacy_unit=_DROP, max_groups_per_unit=1),
        f"{T}.max_rows_per_unit",
        "privacy_unit",
    ),
    (
        "groups bound without unit",
        lambda p: p["tables"]["t"].update(privacy_unit=_DROP, max_rows_per_unit=1),
        f"{T}.max_groups_per_unit",
        "privacy_unit",
    ),
    (
        "two tables differing in case",
        lambda p: p["tables"].update(T=copy.deepcopy(p["tables"]["t"])),
        "tables.T",
        "duplicate",
    ),
    (
        "two columns differing in case",
        lambda p: p["tables"]["t"]["columns"].update(AGE={"type": "int"}),
        f"{C}.AGE",
        "duplicate",
    ),
]
_DROP = object()


def _apply(mutation) -> dict:
    policy = copy.deepcopy(GOOD)
    mutation(policy)
    for table in policy.get("tables", {}).values():
        if isinstance(table, dict):
            for key in [k for k, v in table.items() if v is _DROP]:
                del table[key]
    return policy


@pytest.mark.parametrize(
    ("mutation", "key", "problem"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_policy_file_fails_at_connect(write, mutation, key, problem):
    path = write(_apply(mutation))
    with pytest.raises(PolicyError) as info:
        dpsql.connect(policy=str(path))
    err = info.value
    assert err.sqlstate == "F0000"
    assert str(path) in err.message  # names the file
    assert err.construct == key and f": {key}:" in err.message  # names the key
    assert problem in err.message
    assert err.hint  # says what to do


@pytest.mark.parametrize(
    ("mutation", "key", "problem"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_policy_dict_fails_too(tmp_path, mutation, key, problem):
    write_csv(tmp_path / "t.csv", ["uid"], [(1,)])
    policy = _apply(mutation)
    for table in policy.get("tables", {}).values():
        if isinstance(table, dict) and table.get("source") == "t.csv":
            table["source"] = str(tmp_path / "t.csv")
    with pytest.raises(PolicyError) as info:
        load_policy(policy)
    assert info.value.construct == key and problem in info.value.message


def test_bad_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[privacy]\nepsilon = 1.0\n[tables.t\nsource = "t.csv"\n')
    with pytest.raises(PolicyError) as info:
        dpsql.connect(policy=str(path))
    assert str(path) in info.value.message and "line 3" in info.value.message
    assert info.value.construct == str(path) and "TOML" in info.value.hint


def test_missing_policy_file(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy file") as info:
        dpsql.connect(policy=str(tmp_path / "none.toml"))
    assert info.value.hint


def test_declared_column_missing_from_the_source(write):
    policy = copy.deepcopy(GOOD)
    policy["tables"]["t"]["columns"]["income"] = {"type": "float"}
    with pytest.raises(PolicyError) as info:
        dpsql.connect(policy=str(write(policy)))
    assert info.value.construct == "tables.t.source" and "income" in info.value.message
    assert info.value.hint


def test_value_not_matching_its_declared_type(write, tmp_path):
    (tmp_path / "t.csv").write_text("uid,age,cost,dept,name,day,ok\n1,old,1,a,x,2024-01-01,true\n")
    with pytest.raises(PolicyError) as info:
        dpsql.connect(policy=str(write(GOOD)))
    assert info.value.construct == "tables.t.source" and "old" not in info.value.message
