"""``dpsql init`` drafts a policy that loads and answers queries; ``dpsql check`` validates a
policy against its sources (errors fail, warnings count) and says what each table releases;
``dpsql import-smartnoise`` is registered."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import duckdb
import pytest
from conftest import FIXTURE_CSV, FIXTURE_TOML, ROOT, exact_connect, rows_of

from dpsql.cli import main
from dpsql.curation.init import nice_up, suggested_bounds
from dpsql.policy import load_policy

PUMS_CSV = ROOT / "fixtures" / "pums_sample.csv"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def draft(capsys, tmp_path: Path, *argv: str, name: str = "policy.toml") -> tuple[Path, dict]:
    out = tmp_path / name
    code, _, err = run(capsys, "init", *argv, "-o", out)
    assert code == 0, err
    return out, tomllib.loads(out.read_text())


# -- init -------------------------------------------------------------------------------------


def cols_clip(table: dict) -> dict:
    return {n: c["clip"] for n, c in table["columns"].items() if "clip" in c}


def test_init_visits_drafts_a_policy_that_answers(capsys, tmp_path):
    shutil.copy(FIXTURE_CSV, tmp_path / "visits.csv")
    path, data = draft(capsys, tmp_path, tmp_path / "visits.csv")
    text = path.read_text()
    assert text.startswith("# dpsql policy drafted by `dpsql init`")
    assert "everything in this file becomes PUBLIC" in text.split("[privacy]")[0]
    table = data["tables"]["visits"]
    assert table["source"] == "visits.csv"  # relative to the policy file
    assert table["privacy_unit"] == "patient_id"
    # the bounds are chosen privately at query time; the observed ones are comments
    assert table["max_rows_per_unit"] == table["max_groups_per_unit"] == "auto"
    assert table["bounds_share"] == 0.1
    assert "# decide: R, rows one unit keeps" in text
    assert "chosen privately (or R = " in text and "chosen privately (or G = " in text
    # skewed, but no clip written: the default clamp (a DP range kept per data version) applies
    assert cols_clip(table) == {}
    assert "# no clip stated: SUM/AVG/VAR clamp to a DP range" in text
    cols = table["columns"]
    assert cols["patient_id"] == {"type": "int", "nullable": False}
    assert cols["department"]["values"] == [
        "cardiology",
        "dermatology",
        "emergency",
        "neurology",
        "oncology",
        "pediatrics",
    ]
    assert cols["age"] | {} == {"type": "int", "nullable": False, "lower": 0, "upper": 100}
    assert cols["cost"]["nullable"] is True  # 586 NULLs in the fixture
    assert cols["cost"]["granularity"] == 0.01 and cols["cost"]["lower"] == 0.0
    assert cols["cost"]["upper"] >= 14099.5
    assert "values" not in cols["diagnosis"]  # 73 values: more than --max-values
    assert cols["visit_date"]["type"] == "date" and cols["smoker"]["type"] == "bool"
    # every suggestion is the curator's: each bound, domain and limit is marked "decide:"
    for line in text.splitlines():
        if line.split(" = ")[0] in ("lower", "upper", "max_rows_per_unit", "privacy_unit"):
            assert "# decide:" in line, line
    policy = load_policy(path)
    conn = exact_connect(policy)
    rows = rows_of(conn, "SELECT department, COUNT(*) FROM visits GROUP BY department")
    assert [r[0] for r in rows] == cols["department"]["values"]
    conn.close()


def test_init_pums_and_the_query_command(capsys, tmp_path):
    shutil.copy(PUMS_CSV, tmp_path / "pums_sample.csv")
    path, data = draft(capsys, tmp_path, tmp_path / "pums_sample.csv")
    table = data["tables"]["pums_sample"]
    assert table["privacy_unit"] == "pid"  # the SmartNoise private_id, found by name
    assert table["max_rows_per_unit"] == "auto"  # chosen privately at query time
    # observed: the sample repeats pids up to 3 times
    assert "chosen privately (or R = 3 keeps" in path.read_text()
    assert table["columns"]["sex"]["values"] == [0, 1]
    assert table["columns"]["income"]["upper"] == 500000
    code, out, err = run(
        capsys,
        "query",
        "--policy",
        path,
        "SELECT sex, COUNT(*) AS n FROM pums_sample GROUP BY sex ORDER BY sex",
    )
    assert code == 0, err
    assert out.split()[:2] == ["sex", "n"] and "(2 rows)" in out


def test_init_parquet_with_awkward_columns(capsys, tmp_path):
    src = tmp_path / "people.parquet"
    con = duckdb.connect()
    con.execute(
        'COPY (SELECT i % 40 AS "PersonID", i AS row_id, '
        "CASE WHEN i % 7 = 0 THEN NULL ELSE ['north', 'south', 'east'][i % 3 + 1] END "
        "AS \"home region\", TIMESTAMP '2024-01-01 10:00' + INTERVAL (i) HOUR AS seen, "
        "CAST(i AS DECIMAL(10, 3)) / 8 AS score, [i, i] AS pair, "
        "CASE WHEN i = 5 THEN 'rare' ELSE 'common' END AS kind "
        f"FROM range(400) t(i)) TO '{src}' (FORMAT parquet)"
    )
    con.close()
    path, data = draft(capsys, tmp_path, src)
    text = path.read_text()
    table = data["tables"]["people"]
    assert table["privacy_unit"] == "PersonID"  # repeated id; row_id is unique per row
    assert "row_id" not in table.get("privacy_unit", "")
    cols = table["columns"]
    assert "pair" not in cols and "pair: DuckDB type BIGINT[] has no policy type" in text
    assert cols["home region"]["values"] == ["east", "north", "south"]
    assert cols["home region"]["nullable"] is True
    assert cols["seen"]["type"] == "date" and "time of day is dropped" in text
    assert cols["score"]["type"] == "float" and cols["score"]["granularity"] == 0.001
    assert 'value(s) held by fewer than 10 units: "rare"' in text
    conn = exact_connect(load_policy(path))
    rows = rows_of(
        conn, 'SELECT "home region", COUNT(*) FROM people GROUP BY 1 ORDER BY 1 NULLS LAST'
    )
    assert [r[0] for r in rows] == ["east", "north", "south", None]
    conn.close()


def test_init_database_table_then_check(capsys, tmp_path):
    db = tmp_path / "w.duckdb"
    con = duckdb.connect(str(db))
    con.execute(f"CREATE TABLE visits AS SELECT * FROM read_csv('{FIXTURE_CSV}')")
    con.close()
    path, data = draft(capsys, tmp_path, "--database", db, "--table", "visits", "--no-unit")
    assert data["tables"]["visits"]["source"] == "visits"
    assert "privacy_unit" not in data["tables"]["visits"]
    code, out, _ = run(capsys, "check", path)  # no --database: the source cannot be read
    assert code == 1 and "no --database was given" in out
    code, out, _ = run(capsys, "check", path, "--database", db)
    assert code == 0 and "ok: 0 error(s)" in out and "privacy unit: none" in out


def test_init_edge_cases_still_load(capsys, tmp_path):
    src = tmp_path / "edge.parquet"
    con = duckdb.connect()
    con.execute(
        "COPY (SELECT CASE WHEN i = 1 THEN 'inf'::DOUBLE WHEN i = 2 THEN 'nan'::DOUBLE "
        "ELSE i / 4 END AS f, TIMESTAMP '2024-01-01 10:00' + INTERVAL (i % 3) DAY AS ts, "
        "['a\"q', 'b\\s', 'ü x'][i % 3 + 1] AS s, NULL::VARCHAR AS empty "
        f"FROM range(50) t(i)) TO '{src}' (FORMAT parquet)"
    )
    con.close()
    path, data = draft(capsys, tmp_path, src)
    cols = data["tables"]["edge"]["columns"]
    assert cols["f"]["upper"] == 20.0 and "2 NaN or infinite" in path.read_text()
    assert cols["ts"]["values"] == ["2024-01-01", "2024-01-02", "2024-01-03"]
    assert cols["s"]["values"] == ['a"q', "b\\s", "ü x"]
    assert cols["empty"] == {"type": "text", "nullable": True}
    conn = exact_connect(load_policy(path))
    assert rows_of(conn, "SELECT s, COUNT(*) FROM edge GROUP BY s ORDER BY s")[0][0] == 'a"q'
    conn.close()
    (tmp_path / "empty.csv").write_text("a,b\n")
    _, data = draft(capsys, tmp_path, tmp_path / "empty.csv", name="empty.toml")
    assert set(data["tables"]["empty"]["columns"]) == {"a", "b"}


def test_init_writes_stdout_and_refuses_to_overwrite(capsys, tmp_path):
    code, out, _ = run(capsys, "init", PUMS_CSV, "--name", "People Table", "--unit", "pid")
    assert code == 0
    data = tomllib.loads(out)
    assert Path(data["tables"]["people_table"]["source"]) == PUMS_CSV  # absolute on stdout
    target = tmp_path / "p.toml"
    target.write_text("keep me")
    code, _, err = run(capsys, "init", PUMS_CSV, "-o", target)
    assert code == 1 and "--force" in err and target.read_text() == "keep me"
    code, _, _ = run(capsys, "init", PUMS_CSV, "-o", target, "--force")
    assert code == 0 and target.read_text().startswith("# dpsql policy")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["nowhere.csv"], "no such file"),
        (["data.txt"], "not a CSV/Parquet file"),
        ([], "give SOURCE"),
        ([str(PUMS_CSV), "--unit", "nope"], "--unit 'nope' is not a column"),
        (["--database", "x.duckdb"], "--database FILE --table NAME"),
    ],
)
def test_init_usage_errors(capsys, argv, fragment):
    code, out, err = run(capsys, "init", *argv)
    assert code == 1 and fragment in err and out == ""


def test_bounds_round_outward():
    assert [nice_up(x) for x in (95, 100, 101, 14099.5, 0.3)] == [100, 100, 200, 20000, 0.5]
    from dpsql.curation.init import ColumnProfile

    col = ColumnProfile("x", "DOUBLE", "float", low=-3.2, high=0.0)
    assert suggested_bounds(col) == (-5.0, 0.0)


# -- check ------------------------------------------------------------------------------------


def test_check_shipped_fixture(capsys):
    code, out, _ = run(capsys, "check", FIXTURE_TOML)
    assert code == 0
    assert "table visits:" in out and "privacy unit: patient_id" in out
    assert "R = 5 rows per unit per group, G = 3 groups per unit" in out
    assert "G·R = 15" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("    ")}
    assert "public domain (6 bins)" in lines["department"]
    assert "thresholded" in lines["diagnosis"]
    assert "public domain (2 bins)" in lines["smoker"]
    assert "above upper = 5000: clamped" in out  # the fixture has costs over 5000
    assert out.rstrip().endswith("ok: 0 error(s), 1 warning(s)")


BASE = """\
[privacy]
epsilon = 1.0
delta = 1e-6

[tables.t]
source = "t.csv"
privacy_unit = "id"
max_rows_per_unit = 2
"""


def _policy(tmp_path: Path, columns: str, csv: str) -> Path:
    (tmp_path / "t.csv").write_text(csv)
    path = tmp_path / "t.toml"
    path.write_text(BASE + columns)
    return path


def test_check_errors_and_warnings(capsys, tmp_path):
    csv = "id,n,x,kind,flag\n1,1,0.5,a,true\n1,2,1.5,b,\n2,x,7,c,false\n,4,2,a,true\n"
    columns = """
[tables.t.columns.id]
type = "int"
[tables.t.columns.n]
type = "int"
[tables.t.columns.x]
type = "int"
[tables.t.columns.kind]
type = "text"
values = ["a", "b"]
nullable = false
[tables.t.columns.flag]
type = "bool"
nullable = false
[tables.t.columns.missing]
type = "text"
"""
    code, out, _ = run(capsys, "check", _policy(tmp_path, columns, csv))
    assert code == 1
    assert "error: tables.t.columns.missing: declared but not in the source" in out
    assert "columns.n: 1 of 4 rows (25.00%) do not convert to int" in out
    assert "the CSV fails to load" in out
    assert "columns.x: 2 of 4 rows (50.00%) are not whole numbers" in out
    assert "columns.kind: 1 of 4 rows (25.00%) hold values outside the declared values" in out
    assert "columns.flag: declared nullable = false, but 1 of 4 rows (25.00%) are NULL" in out
    assert "columns.id: 1 of 4 rows (25.00%) have no privacy unit" in out
    assert "FAILED: 3 error(s), 3 warning(s)" in out


def test_check_warnings_alone_pass_unless_strict(capsys, tmp_path):
    columns = """
[tables.t.columns.id]
type = "int"
[tables.t.columns.v]
type = "float"
lower = 0.0
upper = 10.0
"""
    path = _policy(tmp_path, columns, "id,v\n1,-1\n1,5\n2,50\n2,3\n2,4\n")
    code, out, _ = run(capsys, "check", path)
    assert code == 0 and "1 rows below lower = 0 and 1 above upper = 10: clamped" in out
    assert "1 have more than max_rows_per_unit = 2 rows" in out
    assert "thresholded" in out
    code, _, _ = run(capsys, "check", path, "--strict")
    assert code == 1


def test_check_parquet_types(capsys, tmp_path):
    src = tmp_path / "t.parquet"
    con = duckdb.connect()
    con.execute(
        "COPY (SELECT 1 AS id, 'abc' AS n, 2.5 AS x UNION ALL SELECT 2, '3', 4.0) "
        f"TO '{src}' (FORMAT parquet)"
    )
    con.close()
    path = tmp_path / "t.toml"
    path.write_text(
        BASE.replace('"t.csv"', '"t.parquet"')
        + '[tables.t.columns.id]\ntype = "int"\n[tables.t.columns.n]\ntype = "int"\n'
        + '[tables.t.columns.x]\ntype = "text"\n'
    )
    code, out, _ = run(capsys, "check", path)
    assert code == 1
    assert "columns.n: 1 of 2 rows (50.00%) do not convert to int" in out
    assert "read as NULL" in out
    assert "note: tables.t.columns.x: source type DECIMAL(2,1) is read as text" in out


def test_check_a_policy_that_does_not_load(capsys, tmp_path):
    path = tmp_path / "bad.toml"
    (tmp_path / "t.csv").write_text("id\n1\n")
    path.write_text(BASE + '[tables.t.columns.id]\ntype = "integer"\n')
    code, out, _ = run(capsys, "check", path)
    assert code == 1 and "unknown or missing type 'integer'" in out and "1 error(s)" in out


# -- import-smartnoise, help ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["init", "check", "import-smartnoise"])
def test_new_commands_have_help(capsys, command):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dpsql {command}")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert command in capsys.readouterr().out


def test_import_smartnoise_is_registered(capsys, tmp_path):
    out = tmp_path / "pums.toml"
    shutil.copy(PUMS_CSV, tmp_path / "pums_sample.csv")
    yaml = ROOT / "fixtures" / "pums_sample.yaml"
    args = [yaml, tmp_path / "pums_sample.csv", "--out", out, "--dataset", "pums_sample"]
    code, stdout, _ = run(capsys, "import-smartnoise", *args)
    assert code == 0 and f"wrote {out}" in stdout
    expected = (ROOT / "fixtures" / "pums_sample.toml").read_text()
    assert out.read_text() == expected
    code, _, err = run(capsys, "import-smartnoise", *args)  # exists, no --force
    assert code == 1 and "--force" in err
    code, out_text, _ = run(capsys, "check", out)
    assert code == 0 and "privacy unit: pid" in out_text


def test_check_public_and_unit_path_tables(capsys):
    code, out, _ = run(capsys, "check", ROOT / "fixtures" / "star" / "star.toml")
    assert code == 0
    assert "public table: 7 rows read at connect" in out
    assert "privacy unit: patient_id, reached by prescriptions -> visits" in out


def test_check_reports_undeclared_nullability(capsys, tmp_path):
    """Issue 31: an undeclared nullable releases no NULL group (a function of the policy);
    check tells the curator what the data holds, so they can declare it."""
    columns = """
[tables.t.columns.id]
type = "int"
nullable = false
[tables.t.columns.kind]
type = "text"
values = ["a", "b"]
[tables.t.columns.level]
type = "int"
lower = 0
upper = 9
[tables.t.columns.name]
type = "text"
[tables.t.columns.flag]
type = "bool"
nullable = true
"""
    csv = "id,kind,level,name,flag\n1,a,1,x,true\n2,b,,y,false\n3,a,2,,true\n"
    code, out, _ = run(capsys, "check", _policy(tmp_path, columns, csv))
    assert code == 0
    assert (
        "warning: tables.t.columns.kind: nullable is not declared; no NULL observed: treated as "
        "not nullable (GROUP BY releases no NULL group)" in out
    )
    assert (
        "warning: tables.t.columns.level: nullable is not declared; 1 of 3 rows (33.33%) are "
        "NULL and GROUP BY level drops them" in out
    )
    assert "note: tables.t.columns.name: nullable is not declared: a NULL key is released" in out
    assert "note: tables.t.columns.flag: declared nullable = true but no NULL observed" in out
    assert "no (not declared)" in out
    code, _, _ = run(capsys, "check", _policy(tmp_path, columns, csv), "--strict")
    assert code == 1
