"""The SmartNoise metadata importer: every SmartNoise table setting maps to a dpsql policy key
that keeps its guarantee (or is written down as a note), the output loads, and the shipped
fixtures/pums_sample.toml is exactly what the importer writes from fixtures/pums_sample.yaml.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import dpsql
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise
from dpsql.smartnoise_import import (
    MetadataError,
    _mini_yaml,
    build_policy,
    import_file,
    load_yaml,
    main,
    to_toml,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

PUMS_ROW = """
PUMS:
  PUMS:
    PUMS:
      row_privacy: True
      rows: 1000
      age:
        type: int
        lower: 0
        upper: 100
      sex:
        type: string
      income:
        type: int
        lower: 0
        upper: 500000
"""

PUMS_PID = """
"":   # collection without a name
  PUMS:
    PUMS:
      max_ids: 3
      censor_dims: False
      age:
        type: int
        lower: 0
        upper: 100
      score:
        type: float
        lower: -1.5
        upper: 2.5
        nullable: False
      flag:
        type: boolean
      seen:
        type: datetime
      pid:
        type: string
        private_id: True
"""


def test_mini_yaml_reads_smartnoise_metadata():
    meta = _mini_yaml(PUMS_PID)
    table = meta[""]["PUMS"]["PUMS"]
    assert table["max_ids"] == 3 and table["censor_dims"] is False
    assert table["score"] == {"type": "float", "lower": -1.5, "upper": 2.5, "nullable": False}
    assert table["pid"]["private_id"] is True
    assert _mini_yaml("a:\n  b: 'x # y'  # c\n") == {"a": {"b": "x # y"}}


def test_mini_yaml_refuses_what_it_cannot_read():
    with pytest.raises(MetadataError):
        _mini_yaml("a:\n  - 1\n")


def test_row_privacy_table():
    policy, notes = build_policy(load_yaml(PUMS_ROW), "pums.csv", schema_key=True)
    table = policy["tables"]["PUMS"]
    assert "privacy_unit" not in table
    assert table["columns"]["age"] == {"type": "int", "lower": 0, "upper": 100}
    assert table["columns"]["sex"] == {"type": "text"}
    assert policy["privacy"]["dataset"] == "PUMS"
    assert policy["privacy"]["schema"] == "PUMS"
    assert any("rows = 1000" in n for n in notes)


def test_private_id_and_max_ids():
    policy, notes = build_policy(load_yaml(PUMS_PID), "p.csv", privacy={"epsilon": 0.5})
    table = policy["tables"]["PUMS"]
    # max_ids rows per id in the whole table: at most max_ids groups, max_ids rows in each
    assert table["privacy_unit"] == "pid"
    assert table["max_rows_per_unit"] == table["max_groups_per_unit"] == 3
    assert table["columns"]["pid"] == {"type": "text", "nullable": False}
    assert table["columns"]["flag"] == {"type": "bool"}
    assert table["columns"]["seen"] == {"type": "date"}
    assert table["columns"]["score"]["nullable"] is False
    assert policy["privacy"]["epsilon"] == 0.5
    assert any("censor_dims" in n for n in notes)
    assert any("datetime" in n for n in notes)


@pytest.mark.parametrize(
    ("yaml_text", "fragment"),
    [
        ("a:\n  s:\n    t:\n      x:\n        type: unknown\n", "type 'unknown'"),
        ("a:\n  s:\n    t:\n      x:\n        lower: 1\n", "has no type"),
        ("a:\n  s:\n    t:\n      x:\n        type: string\n        lower: 1\n", "bounds"),
        ("a:\n  s:\n    t:\n      x:\n        type: int\n        colour: red\n", "unknown keys"),
        (
            "a:\n  s:\n    t:\n      x:\n        type: int\n        private_id: True\n"
            "      y:\n        type: int\n        private_id: True\n",
            "private_id columns",
        ),
        ("a:\n  s:\n    t:\n      x:\n        type: int\nb:\n  s: {}\n", "collections"),
    ],
)
def test_refusals_name_the_problem(yaml_text, fragment):
    with pytest.raises(MetadataError) as info:
        build_policy(load_yaml(yaml_text), "x.csv")
    assert fragment in str(info.value)
    assert info.value.hint


def test_two_tables_need_a_choice():
    text = PUMS_ROW + "    OTHER:\n      n:\n        type: int\n"
    with pytest.raises(MetadataError, match="--table"):
        build_policy(load_yaml(text), "x.csv")
    policy, _ = build_policy(load_yaml(text), "x.csv", table="PUMS.OTHER")
    assert list(policy["tables"]) == ["OTHER"]


def test_toml_round_trip_loads_as_a_policy(tmp_path):
    csv = tmp_path / "pums.csv"
    csv.write_text("age,sex,income\n30,1,1000\n40,0,2000\n")
    out = tmp_path / "pums.toml"
    policy, _ = import_file(_write(tmp_path / "m.yaml", PUMS_ROW), csv, out)
    assert tomllib.loads(out.read_text()) == policy | {
        "tables": {"PUMS": policy["tables"]["PUMS"] | {"source": "pums.csv"}}
    }
    loaded = load_policy(out)
    (table,) = loaded.tables.values()
    assert table.columns["income"].upper == 500000


def test_imported_policy_answers_schema_qualified_queries(tmp_path):
    csv = tmp_path / "pums.csv"
    csv.write_text("age,sex,income\n30,1,1000\n40,0,2000\n50,1,3000\n")
    policy, _ = build_policy(load_yaml(PUMS_ROW), str(csv))
    # noise off, the exact SUM at the declared bounds (unstated, a clamp range would be chosen
    # from a kept DP histogram first: tests/test_default_clamp.py)
    policy["tables"]["PUMS"]["columns"]["income"]["clip"] = "declared"
    conn = dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*), SUM(income) FROM PUMS.PUMS")
    assert cur.fetchall() == [(3, 6000)]
    conn.close()


def test_shipped_fixture_is_the_importers_output():
    meta = load_yaml((FIXTURES / "pums_sample.yaml").read_text())
    policy, notes = build_policy(meta, "pums_sample.csv", privacy={"dataset": "pums_sample"})
    header = "dpsql policy imported from the SmartNoise metadata pums_sample.yaml"
    assert (FIXTURES / "pums_sample.toml").read_text() == to_toml(policy, notes, header), (
        "regenerate: python -m dpsql.smartnoise_import fixtures/pums_sample.yaml "
        "fixtures/pums_sample.csv --out fixtures/pums_sample.toml --dataset pums_sample --force"
    )


def test_cli(tmp_path, capsys):
    csv = tmp_path / "d.csv"
    csv.write_text("age,sex,income\n30,1,1000\n")
    meta = _write(tmp_path / "m.yaml", PUMS_ROW)
    out = tmp_path / "p.toml"
    assert main([str(meta), str(csv), "--out", str(out), "--epsilon", "0.25"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert tomllib.loads(out.read_text())["privacy"]["epsilon"] == 0.25
    assert main([str(meta), str(csv), "--out", str(out)]) == 1  # exists, no --force
    bad = _write(tmp_path / "bad.yaml", "a:\n  s:\n    t:\n      x:\n        type: nope\n")
    assert main([str(bad), str(csv), "--out", str(tmp_path / "q.toml")]) == 1
    assert "type 'nope'" in capsys.readouterr().err


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
