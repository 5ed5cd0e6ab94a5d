"""The policy's published schema (dpsql.policy_schema): the JSON Schema shipped in the package
is the one the model generates, `dpsql schema` prints it, the shipped policies validate, and a
value the model refuses is reported as the loader always did: the key, the problem, the fix."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest

from dpsql import cli, policy_schema
from dpsql.errors import PolicyError
from dpsql.policy import load_policy

ROOT = Path(__file__).resolve().parent.parent


def test_the_shipped_schema_is_the_generated_one():
    shipped = (ROOT / "dpsql" / "policy.schema.json").read_text(encoding="utf-8")
    assert shipped == policy_schema.schema_text(), (
        "dpsql/policy.schema.json is stale: regenerate it with "
        "`dpsql schema > dpsql/policy.schema.json` (or python -m dpsql.policy_schema)"
    )
    assert policy_schema.shipped_schema_text() == shipped  # what the installed package reads


def test_the_schema_is_package_data():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["dpsql"]
    assert any(fnmatch.fnmatch("policy.schema.json", p) for p in patterns)
    deps = " ".join(pyproject["project"]["dependencies"])
    assert "pydantic>=2" in deps and "<3" in deps


def test_dpsql_schema_prints_it(capsys):
    assert cli.main(["schema"]) == 0
    printed = capsys.readouterr().out
    schema = json.loads(printed)
    assert schema == policy_schema.json_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    assert schema["additionalProperties"] is False and "tables" in schema["required"]
    table = schema["$defs"]["TableSpec"]
    assert set(table["required"]) == {"source", "columns"}
    assert "default: everyone" in table["properties"]["allow"]["description"]
    column = schema["$defs"]["ColumnSpec"]["properties"]
    assert column["type"]["enum"] == ["int", "float", "text", "bool", "date"]
    assert '"default": null' not in printed  # left out means computed, not a TOML null


@pytest.mark.parametrize(
    "path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "fixtures").glob("*.toml"))
)
def test_the_shipped_policies_validate(path):
    data = tomllib.loads((ROOT / path).read_text(encoding="utf-8"))
    if "tables" not in data:  # a file of queries, not a policy
        pytest.skip("not a policy")
    policy_schema.PolicyDocument.model_validate(data)


def test_a_schema_directive_is_a_comment(tmp_path):
    """Editors read `#:schema` (taplo); TOML sees a comment."""
    text = (ROOT / "fixtures" / "visits.toml").read_text(encoding="utf-8")
    path = tmp_path / "visits.toml"
    path.write_text(f"#:schema {ROOT / 'dpsql' / 'policy.schema.json'}\n{text}")
    (tmp_path / "visits.csv").symlink_to(ROOT / "fixtures" / "visits.csv")
    assert load_policy(path).tables["visits"].privacy_unit == "patient_id"


def test_the_keys_listed_in_unknown_key_hints_are_the_models():
    assert set(policy_schema.COLUMN_KEYS) >= {"type", "lower", "upper", "values", "allow"}
    with pytest.raises(PolicyError) as info:
        load_policy(_policy(engine={"nam": "duckdb"}))
    assert info.value.construct == "engine.nam"
    assert info.value.hint == "remove it or use one of: " + ", ".join(
        sorted(policy_schema.ENGINE_KEYS)
    )


def _policy(**sections) -> dict:
    base: dict = {
        "tables": {"t": {"source": "t_db_table", "columns": {"x": {"type": "int"}}}},
    }
    for name, value in sections.items():
        if name == "column":
            base["tables"]["t"]["columns"]["x"].update(value)
        elif name == "table":
            base["tables"]["t"].update(value)
        else:
            base[name] = value
    return base


# Values the model refuses that tests/test_policy.py does not try: (sections, key, problem, fix)
SHAPES = [
    (
        {"engine": {"threads": 0}},
        "engine.threads",
        "must be an integer from 1 to 1024, got 0",
        "e.g. threads = 1, or remove it",
    ),
    (
        {"engine": {"conf": {"a": [1]}}},
        "engine.conf",
        "plain values",
        'e.g. conf = { "spark.sql.shuffle.partitions" = 400 }',
    ),
    (
        {"engine": {"name": "sqlite"}},
        "engine.name",
        "unknown engine 'sqlite'",
        'use "duckdb" or "spark"',
    ),
    (
        {"engine": "spark"},
        "engine",
        "must be a table",
        'write an [engine] section with name = "spark"',
    ),
    (
        {"privacy": {"schema": "  "}},
        "privacy.schema",
        "must be a non-empty string",
        'e.g. schema = "pums"',
    ),
    (
        {"privacy": {"analysts": ["a", ""]}},
        "privacy.analysts",
        "must be a list of names",
        'e.g. analysts = ["alice", "bob"]',
    ),
    (
        {"privacy": {"gaussian_share": 2}},
        "privacy.gaussian_share",
        "must be in [0, 1]",
        "e.g. gaussian_share = 0.5",
    ),
    (
        {"access": {"roles": {"r": "alice"}}},
        "access.roles.r",
        "must be a list of analyst names",
        'r = ["alice", "bob"]',
    ),
    (
        {"access": {"roles": ["r"]}},
        "access.roles",
        "must be a table of lists",
        'roles = { clinicians = ["alice"] }',
    ),
    (
        {"limits": {"max_depth": 65}},
        "limits.max_depth",
        "must be an integer from 1 to 64, got 65",
        "e.g. max_depth = 64 (the default)",
    ),
    (
        {"table": {"unit_path": []}},
        "tables.t.unit_path",
        "must be a list of foreign-key steps",
        'unit_path = ["encounter_id -> encounters.encounter_id"]',
    ),
    (
        {"table": {"unique": [1]}},
        "tables.t.unique",
        "must be a list of column names",
        'unique = ["code"]',
    ),
    (
        {"table": {"privacy_unit": 3}},
        "tables.t.privacy_unit",
        "3 is not a declared column",
        "declare it under [tables.t.columns.3] or fix the name",
    ),
    (
        {"table": {"allow": "carol"}},
        "tables.t.allow",
        "must be a list of analysts or roles",
        'allow = ["clinicians", "carol"]',
    ),
    (
        {"column": {"clip_share": 1.5}},
        "tables.t.columns.x.clip_share",
        "must be a number in (0, 1)",
        "e.g. clip_share = 0.1",
    ),
    (
        {"column": {"quantile_bins": 1}},
        "tables.t.columns.x.quantile_bins",
        "from 2 to 131072, got 1",
        "e.g. quantile_bins = 4096",
    ),
    (
        {"column": {"clip_method": "max"}},
        "tables.t.columns.x.clip_method",
        "unknown method 'max'",
        'use "auto", "sum", "quantile" or "threshold"',
    ),
    (
        {"column": {"lower": "zero", "upper": 1}},
        "tables.t.columns.x.lower",
        "expected a number, got 'zero'",
        "write a plain number",
    ),
    (
        {"column": {"values": [1, [2]]}},
        "tables.t.columns.x.values",
        "[2] is not a int",
        "list int values only",
    ),
]


@pytest.mark.parametrize(("sections", "key", "problem", "fix"), SHAPES, ids=[s[1] for s in SHAPES])
def test_refusals_name_the_key_the_problem_and_the_fix(sections, key, problem, fix):
    with pytest.raises(PolicyError) as info:
        load_policy(_policy(**sections))
    err = info.value
    assert err.construct == key and f"policy: {key}: " in err.message
    assert problem in err.message
    assert err.hint == fix


def test_the_file_is_named(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(
        '[engine]\nthreads = "many"\n[tables.t]\nsource = "t"\n[tables.t.columns.x]\ntype = "int"\n'
    )
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.message.startswith(f"policy file {str(path)!r}: engine.threads: ")
