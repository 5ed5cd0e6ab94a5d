"""A store over files is built on a DuckDB instance of its own (dpsql.engine.duckdb_engine
DuckDBEngine._build_connection, issue 28 item 3: memory), closed after the build so the file's
cached blocks and its temporary tables go with it. It is sealed as the engine's connection
(only the policy's files, no other file; its configuration locked before a row is fetched), it
answers as the engine's own connection does, the attached database's read lock is held again
after it closes, and a build that fails there runs again on the engine's connection."""

from __future__ import annotations

import subprocess
import sys

import duckdb
import pytest
from test_clustered import QUERIES, _canonical, _large_policy, _measures, _parquet

import dpsql.engine.duckdb_engine as duckdb_engine
from dpsql.dbapi import Service
from dpsql.engine import clustered, columnar
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger

pytestmark = pytest.mark.skipif(not clustered.available(), reason="numba is not installed")


def _database(tmp_path) -> tuple[str, dict]:
    """A DuckDB file holding test_clustered's Parquet rows as table ``t``, and the policy of
    test_clustered's two tables over it (``v`` with a privacy unit, ``vr`` row-level)."""
    parquet, db = tmp_path / "v.parquet", tmp_path / "d.duckdb"
    _parquet(parquet, 4000, 3)
    con = duckdb.connect(str(db))
    con.execute(f"CREATE TABLE t AS SELECT * FROM read_parquet('{parquet}')")
    con.close()
    policy = _large_policy(parquet)
    for table in policy["tables"].values():
        table["source"] = "t"
    return str(db), policy


def _spy_builds(monkeypatch) -> list[tuple[object, bool]]:
    """Each build's connection and whether the engine's own is it; inside, once the labels
    are read, the build's own instance refuses another file and a change of setting."""
    seen: list[tuple[object, bool]] = []
    original = columnar.load_clustered

    def spied(con, table, version, capacity, fetching=None):
        def checked() -> None:
            if fetching is not None:
                fetching()
                with pytest.raises(duckdb.Error, match="disabled"):
                    con.execute("SELECT * FROM read_csv('/etc/hostname')")
                with pytest.raises(duckdb.Error, match="locked"):
                    con.execute("SET threads = 1")

        seen.append((con, fetching is not None))
        return original(con, table, version, capacity, checked)

    monkeypatch.setattr(columnar, "load_clustered", spied)
    return seen


def _same_answers(svc: Service) -> None:
    for t in ("v", "vr"):
        for q in QUERIES:
            local, expected = _measures(svc, q.format(t=t))
            assert local is not None and _canonical(local) == _canonical(expected), q


def test_an_attached_tables_store_is_built_on_its_own_sealed_instance(tmp_path, monkeypatch):
    db, policy = _database(tmp_path)
    seen = _spy_builds(monkeypatch)
    svc = Service(load_policy(policy), db, ledger=MemoryLedger(), cache=False)
    try:
        assert svc.engine.wait_for_stores(120)
        assert {"v", "vr"} <= set(svc.engine.columns)
        assert len(seen) == 2 and all(own for _, own in seen)
        _same_answers(svc)
        # the build instances closed: the engine's read lock on the file is held again (a
        # writer in another process is refused)
        probe = (
            "import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n"
            "    sys.exit(3)\n"
        )
        done = subprocess.run([sys.executable, "-c", probe, db], timeout=60)
        assert done.returncode == 3
    finally:
        svc.close()


def test_a_build_that_fails_on_its_own_instance_runs_on_the_engines(tmp_path, monkeypatch):
    """Over its instance's memory limit (here: made to fail), the build runs again on a
    cursor of the engine's connection: the same store, the same answers."""
    parquet = tmp_path / "v.parquet"
    _parquet(parquet, 3000, 5)
    seen = _spy_builds(monkeypatch)

    def over(con) -> None:
        raise duckdb.OutOfMemoryException("over the build's limit")

    monkeypatch.setattr(duckdb_engine, "_limit", over)
    svc = Service(load_policy(_large_policy(parquet)), ledger=MemoryLedger(), cache=False)
    try:
        assert svc.engine.wait_for_stores(120)
        assert {"v", "vr"} <= set(svc.engine.columns)
        own = sorted(own for _, own in seen)
        assert own == [False, False, True, True]  # each tried on its own, then the engine's
        _same_answers(svc)
    finally:
        svc.close()
