"""Prepared-store hygiene (issue 29, item 8): a killed build leaves nothing behind past the next
start, and every file is private (0600 files, 0700 folders) whatever the umask."""

from __future__ import annotations

import dataclasses
import os
import stat
import threading
from pathlib import Path

import pytest
from conftest import fixture_policy

from dpsql.engine import spark_store, store_files
from dpsql.pipeline import Service
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _service(store_dir: Path, version: str = "v1") -> Service:
    policy = load_policy(fixture_policy(table={"version": version}))
    engine = dataclasses.replace(policy.engine, prepared="disk", prepared_dir=str(store_dir))
    return Service(dataclasses.replace(policy, engine=engine), ledger=MemoryLedger())


def _leftovers(store_dir: Path) -> list[Path]:
    """What a `dpsql prepare` killed mid-build leaves: its scratch directory with a half
    written copy of the rows, and (from earlier versions) a <store>.<pid>.<tid>.tmp file."""
    area = store_dir / f"{store_files.BUILD_PREFIX}999999-dead"
    area.mkdir()
    (area / "store.duckdb").write_bytes(b"private rows" * 100)
    (area / "store.duckdb.wal").write_bytes(b"more private rows")
    legacy = store_dir / "visits-0123456789abcdef01234567.duckdb.999999.1234.tmp"
    legacy.write_bytes(b"private rows" * 100)
    os.chmod(legacy, 0o644)
    spark_legacy = store_dir / "visits-0123.spark.parquet.999999.1.tmp"
    spark_legacy.mkdir()
    (spark_legacy / "part-0.parquet").write_bytes(b"rows")
    spill = store_dir / f"{store_files.SPILL_PREFIX}999999-dead"  # DuckDB's spill, owner gone
    spill.mkdir()
    (spill / ".owner.lock").write_bytes(b"")
    (spill / "duckdb_temp_storage_DEFAULT-0.tmp").write_bytes(b"spilled private rows")
    return [area, legacy, spark_legacy, spill]


def test_a_killed_prepare_is_cleaned_at_the_next_start(tmp_path: Path, umask_022, caplog):
    store_dir = tmp_path / "store"
    _service(store_dir).close()
    left = _leftovers(store_dir)
    with caplog.at_level("WARNING", logger="dpsql.store"):
        svc = _service(store_dir)  # the next start (the store itself is reused)
    try:
        assert svc.engine.stores[0].reused
        store = Path(svc.engine.stores[0].path).name
    finally:
        svc.close()
    assert not any(os.path.lexists(p) for p in left)
    assert any("interrupted" in r.getMessage() for r in caplog.records)
    names = sorted(p.name for p in store_dir.iterdir())
    assert [n for n in names if n != store_files.LOCK_NAME and ".spill-" not in n] == [store]


def test_duckdb_spills_go_to_a_private_directory_kept_while_its_process_lives(
    tmp_path: Path, umask_022
):
    store_dir = tmp_path / "store"
    svc = _service(store_dir)
    try:
        spill = Path(
            svc.engine._con.execute("SELECT current_setting('temp_directory')").fetchone()[0]
        )
        assert spill.parent == store_dir and spill.name.startswith(store_files.SPILL_PREFIX)
        assert mode(spill) == 0o700
        store_files.clean_interrupted(store_dir)
        (store_dir / "x.duckdb.1.2.tmp").write_bytes(b"x")  # something to clean
        store_files.clean_interrupted(store_dir)
        assert spill.is_dir()  # its process (this one) holds it: never removed
    finally:
        svc.close()


def test_a_running_build_is_never_cleaned(tmp_path: Path):
    """The clean-up runs only when no build of any process holds the shared lock."""
    store_dir = tmp_path / "store"
    store_files.private_directory(store_dir)
    with store_files.build_area(store_dir) as area:
        (area / "store.duckdb").write_bytes(b"being written")
        stale = store_dir / "t-abc.duckdb.1.2.tmp"
        stale.write_bytes(b"x")
        assert store_files.clean_interrupted(store_dir) == []
        assert (area / "store.duckdb").exists() and stale.exists()
    assert not area.exists()  # a finished build removes its own scratch directory
    assert store_files.clean_interrupted(store_dir) == [stale]


def test_store_files_and_folders_are_private_under_umask_022(tmp_path: Path, umask_022):
    store_dir = tmp_path / "deep" / "store"
    seen: list[int] = []
    real = store_files.build_area

    def spying(directory: Path):
        cm = real(directory)

        class Spy:
            def __enter__(self):
                area = cm.__enter__()
                seen.append(mode(area))
                return area

            def __exit__(self, *exc):
                return cm.__exit__(*exc)

        return Spy()

    store_files.build_area = spying  # type: ignore[assignment]
    try:
        svc = _service(store_dir)
    finally:
        store_files.build_area = real  # type: ignore[assignment]
    try:
        path = Path(svc.engine.stores[0].path)
    finally:
        svc.close()
    assert seen == [0o700]  # the half-written copy was never readable by others
    assert mode(store_dir) == 0o700 and mode(store_dir.parent) == 0o700
    assert mode(path) == 0o600
    assert mode(store_dir / store_files.LOCK_NAME) == 0o600


def test_an_existing_open_store_folder_is_tightened(tmp_path: Path, umask_022):
    store_dir = tmp_path / "dpsql-store"
    store_dir.mkdir(mode=0o755)
    os.chmod(store_dir, 0o755)
    _service(store_dir).close()
    assert mode(store_dir) == 0o700


def test_a_shared_folder_is_left_as_the_operator_made_it(tmp_path: Path, umask_022, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    (shared / "notes.txt").write_text("the operator's")
    with caplog.at_level("WARNING", logger="dpsql.store"):
        store_files.private_directory(shared)
    assert mode(shared) == 0o755 and "accessible to other users" in caplog.text


class _FakeSpark:
    """Writes a Parquet-like directory the way Spark does: files 0644, folders 0755."""

    def __init__(self) -> None:
        self.modes: list[int] = []

    def sql(self, _sql: str):
        return self

    @property
    def write(self):
        return self

    def mode(self, _mode: str):
        return self

    def parquet(self, path: str) -> None:
        target = Path(path)
        self.modes.append(mode(target.parent))  # the build area it writes into
        target.mkdir()
        (target / "part-00000.parquet").write_bytes(b"private rows")
        (target / "_SUCCESS").write_bytes(b"")


def test_spark_store_writes_in_a_private_area(tmp_path: Path, umask_022):
    store_dir = tmp_path / "store"
    store_files.private_directory(store_dir)
    path = store_dir / "visits-abc.spark.parquet"
    fake = _FakeSpark()
    spark_store._write(fake, "SELECT 1", path, "key", "v1")
    assert fake.modes == [0o700]
    assert mode(path) == 0o700
    assert all(mode(p) == 0o600 for p in path.iterdir())
    assert [p.name for p in store_dir.iterdir() if p.name.startswith(".build-")] == []


def test_concurrent_builds_and_cleanups(tmp_path: Path):
    """Builds and start-up clean-ups racing in threads: no running build loses its area."""
    store_dir = tmp_path / "store"
    store_files.private_directory(store_dir)
    errors: list[BaseException] = []

    def build() -> None:
        try:
            for _ in range(20):
                with store_files.build_area(store_dir) as area:
                    (area / "f").write_bytes(b"x")
                    assert (area / "f").read_bytes() == b"x"
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def clean() -> None:
        for _ in range(50):
            store_files.clean_interrupted(store_dir)

    threads = [threading.Thread(target=build) for _ in range(3)]
    threads += [threading.Thread(target=clean) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_the_engine_spills_into_a_private_directory_removed_on_close():
    """Without a disk store too, DuckDB's out-of-core copies of private rows go to a 0700
    directory of their own (not .tmp in the current directory with the umask's mode), removed
    when the engine closes."""
    import os

    from conftest import fixture_policy

    import dpsql
    from dpsql.privacy.ledger import MemoryLedger

    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger())
    engine = service.engine
    spill = engine._spill
    assert os.stat(spill).st_mode & 0o777 == 0o700
    assert engine._con.execute("SELECT current_setting('temp_directory')").fetchone()[0] == spill
    service.close()
    assert not os.path.exists(spill)


def test_an_engine_never_closed_leaves_no_spill_directory(tmp_path: Path, monkeypatch):
    """The engine's own spill directory goes with it: on close, and when an engine nobody
    closed is collected (the test suite once left ~900 empty ones in /tmp per run)."""
    import gc

    from dpsql.engine.duckdb_engine import DuckDBEngine

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    policy = load_policy(fixture_policy())
    closed = DuckDBEngine(policy)
    closed.close()
    dropped = DuckDBEngine(policy)
    del dropped
    gc.collect()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("dpsql-spill-")] == []
