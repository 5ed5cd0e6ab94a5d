"""The answer cache survives restarts and is invalidated by a change of data or version."""

from __future__ import annotations

from pathlib import Path

import dpsql
from dpsql.dbapi import connect_service
from dpsql.privacy.sqlite_ledger import SQLiteLedger

QUERY = "SELECT COUNT(*) FROM t"


def _policy(csv: Path, version: str | None = None) -> dict:
    table = {"source": str(csv), "columns": {"x": {"type": "int", "lower": 0, "upper": 9}}}
    if version is not None:
        table["version"] = version
    return {"privacy": {"epsilon": 0.5, "dataset": "d"}, "tables": {"t": table}}


def _ask(policy: dict, ledger_path: Path) -> tuple[tuple, bool]:
    service = dpsql.Service(policy, ledger=SQLiteLedger(ledger_path))
    try:
        cur = connect_service(service, "ann").cursor()
        cur.execute(QUERY)
        return cur.fetchone(), cur.cached
    finally:
        service.close()


def test_cache_survives_a_restart_and_follows_the_file_hash(tmp_path) -> None:
    csv, ledger = tmp_path / "t.csv", tmp_path / "ledger.sqlite"
    csv.write_text("x\n1\n2\n3\n", encoding="utf-8")
    first, cached = _ask(_policy(csv), ledger)
    assert not cached
    again, cached = _ask(_policy(csv), ledger)  # a new process would see the same
    assert cached and again == first
    csv.write_text("x\n1\n2\n3\n4\n", encoding="utf-8")  # the data changed
    _, cached = _ask(_policy(csv), ledger)
    assert not cached
    with SQLiteLedger(ledger) as led:
        assert led.spent("ann", "d").epsilon == 1.0  # two charges, the cached one free


def test_declared_version_decides(tmp_path) -> None:
    csv, ledger = tmp_path / "t.csv", tmp_path / "ledger.sqlite"
    csv.write_text("x\n1\n", encoding="utf-8")
    _ask(_policy(csv, "v1"), ledger)
    csv.write_text("x\n1\n2\n", encoding="utf-8")
    _, cached = _ask(_policy(csv, "v1"), ledger)
    assert cached  # the administrator declared the data unchanged
    _, cached = _ask(_policy(csv, "v2"), ledger)
    assert not cached
