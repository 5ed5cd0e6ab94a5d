"""Sources beyond one file (docs/sources.md): globs of local CSV/Parquet parts, a PostgreSQL
table read at connect from a real server this module starts, and remote paths refused with
the fix when DuckDB's httpfs extension is not installed.

The PostgreSQL tests start a throwaway cluster (initdb / pg_ctl from /usr/lib/postgresql/*/bin,
as the ``postgres`` user when run as root: the server refuses root) listening on 127.0.0.1 and
a socket in its temporary directory, with a password (scram-sha-256) so that ``password_env``
is exercised; they skip, with the reason, when no PostgreSQL server binaries are installed.
"""

from __future__ import annotations

import datetime as dt
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from conftest import assert_same_rows, exact_connect, rows_of

import dpsql
from dpsql.dbapi import connect_service
from dpsql.errors import PolicyError
from dpsql.policy import load_policy
from dpsql.privacy.samplers import ZeroNoise
from dpsql.privacy.sqlite_ledger import SQLiteLedger
from dpsql.sources import display_source, parse_postgres

EPS = 0.5


def _policy(source: str, columns: dict, version: str | None = None) -> dict:
    table: dict = {"source": source, "columns": columns}
    if version is not None:
        table["version"] = version
    return {
        "privacy": {"epsilon": EPS, "dataset": "d", "budget_epsilon": 100},
        "tables": {"t": table},
    }


# clip "declared": noise off, SUM(x) is the exact sum (unstated, the clamp range is chosen from
# a kept DP histogram first, which noise off may place below the largest x: test_default_clamp)
X = {"x": {"type": "int", "lower": 0, "upper": 1000, "clip": "declared"}}


def _parquet(path: Path, lo: int, hi: int) -> None:
    tmp = path.with_name(path.name + ".new")
    con = duckdb.connect()
    con.execute(f"COPY (SELECT range AS x FROM range({lo}, {hi})) TO '{tmp}' (FORMAT parquet)")
    con.close()
    os.replace(tmp, path)


def _csv(path: Path, values: range) -> None:
    path.write_text("x\n" + "".join(f"{v}\n" for v in values))


# -- globs -----------------------------------------------------------------------------------


def test_parquet_glob_reads_every_part_and_a_rewritten_part_is_a_new_version(tmp_path) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(3):
        _parquet(parts / f"part-{i}.parquet", 10 * i, 10 * i + 10)
    (parts / "other.parquet").write_bytes(b"not matched")  # outside the glob: never read
    service = dpsql.Service(
        _policy(str(parts / "part-*.parquet"), X),
        ledger=SQLiteLedger(tmp_path / "l.sqlite"),
        noise=ZeroNoise(),
    )
    try:
        cur = connect_service(service, "ann").cursor()
        cur.execute("SELECT COUNT(*), SUM(x) FROM t")
        assert cur.fetchone() == (30, sum(range(30)))
        before = service.engine.versions["t"]
        assert before.startswith("glob:3:")
        cur.execute("SELECT COUNT(*), SUM(x) FROM t")
        cur.fetchone()
        assert cur.cached  # unchanged: replayed
        _parquet(parts / "part-1.parquet", 100, 150)  # one part rewritten while serving
        cur.execute("SELECT COUNT(*), SUM(x) FROM t")
        assert cur.fetchone() == (70, sum(range(10)) + sum(range(20, 30)) + sum(range(100, 150)))
        assert not cur.cached and service.engine.versions["t"] != before
        # A part added after connect is not read (the glob was expanded at connect)...
        _parquet(parts / "part-9.parquet", 0, 5)
        cur.execute("SELECT COUNT(*) FROM t")
        assert cur.fetchone() == (70,)
    finally:
        service.close()
    # ...until the next start, where the list, and so the version, differs.
    conn = exact_connect(_policy(str(parts / "part-*.parquet"), X))
    try:
        assert rows_of(conn, "SELECT COUNT(*) FROM t") == [(75,)]
    finally:
        conn.close()


def test_csv_glob_is_loaded_at_connect_with_a_version_over_its_files(tmp_path) -> None:
    for i in range(3):
        _csv(tmp_path / f"day-{i}.csv", range(i * 5, i * 5 + 5))
    policy = _policy(str(tmp_path / "day-*.csv"), X)

    def version_and_rows() -> tuple[str, list]:
        conn = exact_connect(policy)
        try:
            rows = rows_of(conn, "SELECT x, COUNT(*) FROM t GROUP BY x")
            rows = [r for r in rows if r[1]]  # x's public domain is 0..1000: the rest are 0
            return conn._service.engine.versions["t"], rows
        finally:
            conn.close()

    v1, rows = version_and_rows()
    assert_same_rows(rows, [(x, 1) for x in range(15)])
    assert v1 == version_and_rows()[0]  # same files: same version across starts
    _csv(tmp_path / "day-1.csv", range(5, 11))  # one part changes
    v2, rows = version_and_rows()
    assert v2 != v1 and sum(n for _, n in rows) == 16
    os.utime(tmp_path / "day-2.csv", ns=(0, 1_000_000_000))  # touched: the mtime counts
    assert version_and_rows()[0] != v2


def test_a_glob_matching_nothing_fails_at_load(tmp_path) -> None:
    with pytest.raises(PolicyError, match="no file matches"):
        load_policy(_policy(str(tmp_path / "none-*.parquet"), X))


def test_remote_paths_are_refused_with_the_fix_without_httpfs(tmp_path) -> None:
    try:
        duckdb.connect().execute("LOAD httpfs")
        pytest.skip("DuckDB's httpfs extension is installed here: remote paths are read")
    except duckdb.Error:
        pass
    for source in ("s3://bucket/visits.parquet", "https://example.org/visits.csv"):
        with pytest.raises(PolicyError) as info:
            exact_connect(_policy(source, X))
        text = str(info.value) + (info.value.hint or "")
        assert "httpfs" in text and "download the files" in text


# -- PostgreSQL: parsing and redaction -----------------------------------------------------------


def test_postgres_source_syntax_and_redaction() -> None:
    src = parse_postgres(
        "postgresql://alice@db.example:6543/clinic?table=care.visits&sslmode=require"
        "&password_env=PG_PW"
    )
    assert (src.schema, src.table, src.password_env) == ("care", "visits", "PG_PW")
    assert "sslmode=require" in src.conninfo and "table=" not in src.conninfo
    assert "password_env" not in src.conninfo
    assert src.display == "postgresql://db.example:6543/clinic table care.visits"
    assert "alice" not in display_source("postgresql://alice@h/db?table=t")
    for bad, words in [
        ("postgresql://alice:s3cret@h/db?table=t", "password"),
        ("postgresql://alice@h/db?table=t&password=s3cret", "password"),
        ("postgresql://alice@h/db", "table"),
        ("postgresql://alice@h/db?table=a.b.c", "schema.name"),
    ]:
        with pytest.raises(PolicyError, match=words) as info:
            load_policy(_policy(bad, X))
        assert "s3cret" not in str(info.value) and "alice" not in str(info.value)


# -- PostgreSQL: a real server -------------------------------------------------------------------

PASSWORD = "dpsql-test-Secret-1"


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Cluster:
    def __init__(self, bindir: Path) -> None:
        self.bin = bindir
        self.root = Path(tempfile.mkdtemp(prefix="dpsql-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.prefix: list[str] = []
        if os.geteuid() == 0:  # the server refuses to run as root
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                shutil.rmtree(self.root)
                pytest.skip("running as root and there is no postgres user to run the server")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self.prefix = ["runuser", "-u", "postgres", "--"]
            self.uid, self.gid = user.pw_uid, user.pw_gid
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self.prefix:
            os.chown(pwfile, self.uid, self.gid)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "dpsql",
            "--auth=scram-sha-256",
            f"--pwfile={pwfile}",
            "--no-sync",
            "-E",
            "UTF8",
        )
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.root / "log"),
            "-w",
            "-t",
            "20",
            "start",
        )

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.prefix, str(self.bin / tool), *args],
            check=True,
            capture_output=True,
            timeout=60,
            cwd=self.root,
        )

    def url(self, table: str, extra: str = "") -> str:
        return (
            f"postgresql://dpsql@127.0.0.1:{self.port}/postgres?table={table}"
            f"&password_env=DPSQL_TEST_PG_PW{extra}"
        )

    def execute(self, *statements: str) -> None:
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="dpsql", dbname="postgres", password=PASSWORD
        ) as pg:
            for statement in statements:
                pg.execute(statement)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def pg() -> Iterator[_Cluster]:
    pytest.importorskip("psycopg")
    bindir = _pg_bin()
    if bindir is None or not (bindir / "pg_ctl").exists():
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): apt-get install postgresql")
    cluster = _Cluster(bindir)
    try:
        cluster.execute(
            "CREATE SCHEMA care",
            "CREATE TABLE care.visits (patient_id int NOT NULL, age int, dept text, "
            "cost numeric(8,2), seen date, urgent boolean, note text)",
            "INSERT INTO care.visits VALUES "
            "(1, 34, 'cardiology', 120.50, '2024-01-03', true, 'private note'), "
            "(1, 34, 'oncology', 80.00, '2024-02-10', false, NULL), "
            "(2, 71, 'cardiology', 300.25, '2024-01-20', NULL, 'x'), "
            "(3, NULL, 'neurology', NULL, NULL, false, 'y'), "
            "(4, 15, NULL, 42.00, '2023-12-31', true, 'z')",
        )
        yield cluster
    finally:
        cluster.stop()


VISIT_COLUMNS = {
    "patient_id": {"type": "int", "nullable": False},
    "age": {"type": "int", "lower": 0, "upper": 100},
    # a NULL dept is a group of its own only when declared (an undeclared nullable with a
    # public domain has no NULL group: grammar_notes.md, NULLs)
    "dept": {
        "type": "text",
        "values": ["cardiology", "neurology", "oncology", "pediatrics"],
        "nullable": True,
    },
    "cost": {"type": "float", "lower": 0.0, "upper": 1000.0, "granularity": 0.01},
    "seen": {"type": "date"},
    "urgent": {"type": "bool"},
}

ROWS = [
    (1, 34, "cardiology", 120.5, dt.date(2024, 1, 3), True),
    (1, 34, "oncology", 80.0, dt.date(2024, 2, 10), False),
    (2, 71, "cardiology", 300.25, dt.date(2024, 1, 20), None),
    (3, None, "neurology", None, None, False),
    (4, 15, None, 42.0, dt.date(2023, 12, 31), True),
]


@pytest.fixture
def pg_password(monkeypatch) -> None:
    monkeypatch.setenv("DPSQL_TEST_PG_PW", PASSWORD)


def _visits_policy(url: str, version: str | None = None) -> dict:
    policy = _policy(url, VISIT_COLUMNS, version)
    policy["tables"]["t"]["privacy_unit"] = "patient_id"
    policy["tables"]["t"]["max_rows_per_unit"] = 2
    policy["tables"]["t"]["max_groups_per_unit"] = 2
    return policy


def test_postgres_table_is_loaded_typed_and_answers_as_its_rows(pg, pg_password) -> None:
    conn = exact_connect(_visits_policy(pg.url("care.visits")))
    try:
        got = rows_of(conn, "SELECT dept, COUNT(*) AS n, SUM(cost) AS c FROM t GROUP BY dept")
        expected: dict = {}
        for _, _, dept, cost, _, _ in ROWS:
            n, c = expected.get(dept, (0, 0.0))
            expected[dept] = (n + 1, c + (cost or 0.0))
        assert_same_rows(
            [(d, n, c) for d, n, c in got if n],  # pediatrics: declared, no rows
            [(d, n, c) for d, (n, c) in expected.items()],
        )
        assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE urgent") == [(2,)]
        assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE seen >= DATE '2024-01-15'") == [(2,)]
        assert rows_of(conn, "SELECT SUM(age) FROM t") == [(34 * 2 + 71 + 15,)]
        engine = conn._service.engine
        assert engine.versions["t"].startswith("pg:")
        loaded = engine._con.execute("SELECT * FROM t").fetchall()
        assert_same_rows(loaded, ROWS)  # every declared column, typed; `note` never read
        with pytest.raises(duckdb.Error):  # sealed after loading, as for every source
            engine._con.execute("SET enable_external_access = true")
    finally:
        conn.close()


def test_postgres_version_changes_when_a_row_changes(pg, pg_password) -> None:
    pg.execute("CREATE TABLE public.v AS SELECT * FROM care.visits")

    def version(declared: str | None = None) -> str:
        conn = exact_connect(_visits_policy(pg.url("v"), declared))
        try:
            return conn._service.engine.versions["t"]
        finally:
            conn.close()

    first = version()
    assert version() == first  # same rows: the same digest across starts
    pg.execute("UPDATE public.v SET cost = 120.51 WHERE cost = 120.50")
    second = version()
    assert second != first
    pg.execute("UPDATE public.v SET note = 'changed'")  # an undeclared column is never read
    assert version() == second
    assert version("2025-06") == "2025-06"  # declared: the operator's word


def test_postgres_errors_never_show_the_password_or_the_user(pg, monkeypatch) -> None:
    monkeypatch.setenv("DPSQL_TEST_PG_PW", "wrong-" + PASSWORD)
    with pytest.raises(PolicyError) as info:
        exact_connect(_visits_policy(pg.url("care.visits")))
    text = str(info.value) + (info.value.hint or "")
    assert "cannot read the PostgreSQL table" in text
    assert PASSWORD not in text and "dpsql@" not in text
    assert f"127.0.0.1:{pg.port}/postgres table care.visits" in text
    monkeypatch.delenv("DPSQL_TEST_PG_PW")
    with pytest.raises(PolicyError, match="DPSQL_TEST_PG_PW"):
        exact_connect(_visits_policy(pg.url("care.visits")))


def test_postgres_missing_table_and_column_are_named(pg, pg_password) -> None:
    with pytest.raises(PolicyError, match=r"no table care\.nope"):
        exact_connect(_visits_policy(pg.url("care.nope")))
    policy = _visits_policy(pg.url("care.visits"))
    policy["tables"]["t"]["columns"]["ward"] = {"type": "text"}
    with pytest.raises(PolicyError, match="'ward' is not a column"):
        exact_connect(policy)


def test_dpsql_check_loads_a_glob_and_a_postgres_source_through_the_engine(
    tmp_path, pg, pg_password
) -> None:
    from dpsql.curation.check import check_policy

    for i in range(2):
        _parquet(tmp_path / f"part-{i}.parquet", i * 10, i * 10 + 10)
    policy = tmp_path / "p.toml"
    policy.write_text(
        '[privacy]\nepsilon = 1.0\n\n[tables.parts]\nsource = "part-*.parquet"\n'
        '[tables.parts.columns.x]\ntype = "int"\n\n'
        f'[tables.pgt]\nsource = "{pg.url("care.visits")}"\n'
        '[tables.pgt.columns.age]\ntype = "int"\n'
    )
    report = check_policy(policy)
    assert report.errors == 0, report.findings
    notes = " ".join(str(t.findings) for t in report.tables)
    assert "a glob of files" in notes and "a PostgreSQL table" in notes
    assert "dpsql@" not in notes
