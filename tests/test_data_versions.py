"""No answer outlives its data: a replaced Parquet file (while serving) and a changed DuckDB
table (across a restart) are new data versions, so the same query is answered fresh and
charged, never replayed (dpsql/engine/versions.py, docs/threat_model.md "Data versions")."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import duckdb

import dpsql
from dpsql.dbapi import connect_service
from dpsql.engine.versions import SourceVersions, storage_digest_sql
from dpsql.privacy.sqlite_ledger import SQLiteLedger

QUERY = "SELECT COUNT(*) AS n FROM t"
EPS = 0.5


def _write_parquet(path: Path, n: int) -> None:
    tmp = path.with_name(path.name + ".new")
    con = duckdb.connect()
    con.execute(f"COPY (SELECT range AS x FROM range({n})) TO '{tmp}' (FORMAT parquet)")
    con.close()
    os.replace(tmp, path)  # how an export replaces a file: atomically


def _policy(source: str, version: str | None = None) -> dict:
    table: dict = {"source": source, "columns": {"x": {"type": "int", "lower": 0, "upper": 9}}}
    if version is not None:
        table["version"] = version
    return {
        "privacy": {"epsilon": EPS, "dataset": "d", "budget_epsilon": 100},
        "tables": {"t": table},
    }


def _ask(cur) -> tuple[float, bool, float | None]:
    cur.execute(QUERY)
    (n,) = cur.fetchone()
    return n, cur.cached, cur.cost


def test_parquet_replaced_while_serving_is_answered_fresh(tmp_path) -> None:
    data = tmp_path / "t.parquet"
    _write_parquet(data, 10)
    service = dpsql.Service(_policy(str(data)), ledger=SQLiteLedger(tmp_path / "l.sqlite"))
    try:
        cur = connect_service(service, "ann").cursor()
        first, cached, _ = _ask(cur)
        assert not cached
        again, cached, _ = _ask(cur)
        assert cached and again == first  # unchanged data: replayed, free
        _write_parquet(data, 5000)  # replaced while the service is open
        fresh, cached, cost = _ask(cur)
        assert not cached and cost is not None  # fresh and charged
        assert fresh > 1000  # the new file's answer (noise scale 2 at epsilon 0.5)
        replay, cached, _ = _ask(cur)
        assert cached and replay == fresh  # the new version's answer is cached in turn
        assert service.ledger.spent("ann", "d").epsilon == 2 * EPS
    finally:
        service.close()


def test_rewriting_the_same_bytes_is_a_new_version(tmp_path) -> None:
    """The version follows the operator's writes (mtime), not the rows: whether an answer is
    replayed is the operator's act, never a function of the content (threat model)."""
    data = tmp_path / "t.parquet"
    _write_parquet(data, 10)
    versions = SourceVersions()
    before = versions.watch("t", data)
    assert versions.get("t") == before  # unchanged: no new hash
    content = data.read_bytes()
    stat = data.stat()
    data.write_bytes(content)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    after = versions["t"]
    assert after != before and after.split("@")[0] == before.split("@")[0]  # same hash
    data.unlink()
    assert versions.get("t") == "unavailable"


def test_concurrent_readers_see_one_version(tmp_path) -> None:
    data = tmp_path / "t.parquet"
    _write_parquet(data, 10)
    versions = SourceVersions()
    versions.watch("t", data)
    _write_parquet(data, 20)
    seen: list[str | None] = []
    threads = [threading.Thread(target=lambda: seen.append(versions.get("t"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 1


def _database(path: Path, n: int) -> None:
    con = duckdb.connect(str(path))
    con.execute(f"CREATE OR REPLACE TABLE src_t AS SELECT range AS x FROM range({n})")
    con.close()


def _restart_ask(policy: dict, database: Path, ledger: Path) -> tuple[float, bool]:
    service = dpsql.Service(policy, str(database), ledger=SQLiteLedger(ledger))
    try:
        n, cached, _ = _ask(connect_service(service, "ann").cursor())
        return n, cached
    finally:
        service.close()


def test_duckdb_table_changed_across_a_restart_is_answered_fresh(tmp_path) -> None:
    db, ledger = tmp_path / "data.duckdb", tmp_path / "l.sqlite"
    _database(db, 10)
    policy = _policy("src_t")
    first, cached = _restart_ask(policy, db, ledger)
    assert not cached
    again, cached = _restart_ask(policy, db, ledger)
    assert cached and again == first  # same table, another process: replayed
    _database(db, 5000)
    fresh, cached = _restart_ask(policy, db, ledger)
    assert not cached and fresh > 1000
    with SQLiteLedger(ledger) as led:
        assert led.spent("ann", "d").epsilon == 2 * EPS


def test_declared_version_is_the_operators_word(tmp_path) -> None:
    db, ledger = tmp_path / "data.duckdb", tmp_path / "l.sqlite"
    _database(db, 10)
    _restart_ask(_policy("src_t", "v1"), db, ledger)
    _database(db, 5000)
    _, cached = _restart_ask(_policy("src_t", "v1"), db, ledger)
    assert cached  # declared unchanged: no digest, the operator decides
    _, cached = _restart_ask(_policy("src_t", "v2"), db, ledger)
    assert not cached


def test_duckdb_table_updated_in_place_is_a_new_version_and_a_new_store(
    tmp_path, monkeypatch
) -> None:
    """An attached table's version is its file's identity and a digest of its storage
    metadata (issue 28: no row is read for it; the rows' digest never runs): one value
    UPDATEd, the row count the same and the file's mtime put back, is still a new version,
    so the answer is fresh and charged, and the background store is the new data's."""
    import dpsql.engine.duckdb_engine as duckdb_engine

    def no_row_digest(*args, **kwargs):
        raise AssertionError("an attached table's version read its rows")

    monkeypatch.setattr(duckdb_engine, "table_digest_sql", no_row_digest)
    db, ledger = tmp_path / "data.duckdb", tmp_path / "l.sqlite"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE src_t AS SELECT range % 9 AS x, range // 3 AS u FROM range(3000)")
    con.close()
    policy = _policy("src_t")
    policy["tables"]["t"]["columns"]["u"] = {"type": "int", "nullable": False}
    policy["tables"]["t"].update(privacy_unit="u", max_rows_per_unit=3, max_groups_per_unit=1)
    policy["engine"] = {"small_tables": "columns"}

    def start() -> tuple[dpsql.Service, str]:
        service = dpsql.Service(policy, str(db), ledger=SQLiteLedger(ledger))
        service.engine.wait_for_stores()
        held = service.engine.columns["t"]
        assert held.version == service.engine.versions["t"]  # its store: this version's
        return service, held.version

    service, first = start()
    try:
        _, cached, _ = _ask(connect_service(service, "ann").cursor())
        assert not cached
    finally:
        service.close()
    service, again = start()
    try:
        assert again == first
        _, cached, _ = _ask(connect_service(service, "ann").cursor())
        assert cached  # same table, another process: replayed
    finally:
        service.close()

    def metadata() -> tuple:
        con = duckdb.connect()
        con.execute(f"ATTACH '{db}' AS src (READ_ONLY)")
        row = con.execute(storage_digest_sql('src."src_t"', "'src.\"src_t\"'")).fetchone()
        con.close()
        return tuple(row or ())

    before, digest = os.stat(db), metadata()
    con = duckdb.connect(str(db))
    con.execute("UPDATE src_t SET x = (x + 1) % 9 WHERE u = 7")
    con.close()
    os.utime(db, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime put back
    assert metadata()[0] == digest[0] == 3000 and metadata()[1] != digest[1]
    service, changed = start()
    try:
        assert changed != first
        _, cached, _ = _ask(connect_service(service, "ann").cursor())
        assert not cached
    finally:
        service.close()
    with SQLiteLedger(ledger) as led:
        assert led.spent("ann", "d").epsilon == 2 * EPS
