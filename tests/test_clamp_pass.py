"""The default clamp's histogram as a pass over the store (dpsql.engine.clamp_pass) against its
SQL (dpsql.lower.compile.clamp_histogram_query).

The released histogram is its exact counts plus noise, so the pass must return the SQL's exact
(pre-noise) counts for the same secret, integer for integer: the same bins and, per privacy
unit, the same R rows (those of smallest keyed hash HASH(stored columns..., secret)). Both run
here on the same engine, on the shipped fixture and on generated data (units over R, a NULL
unit, NULL and NaN values, infinities, negative values, values beyond the bounds, text, bool
and date columns with NULLs in the hash), for several R and secrets, row-level and per unit.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import duckdb
import numpy as np
import pytest
from conftest import table_policy, write_csv
from test_columnar import _loaded

import dpsql
from dpsql.dbapi import Service
from dpsql.engine import clamp_pass
from dpsql.lower.compile import clamp_histogram_query
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger
from dpsql.service.bounds import clamp_histogram

pytestmark = [
    pytest.mark.filterwarnings("error::RuntimeWarning"),
    pytest.mark.skipif(not clamp_pass.available(), reason="numba is not installed"),
]

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml"
SECRETS = (1, 4242, 2**61 + 12345)


def _counts(result, bins: int) -> np.ndarray:
    out = np.zeros(bins, dtype=np.int64)
    for row, c in zip(result.key_rows, result.measures[0], strict=True):
        out[int(row[0])] += int(c)
    return out


def _both(service: Service, table, column: str, secret: int) -> tuple[np.ndarray, np.ndarray]:
    """(the pass's counts, the SQL's counts) of ``column``'s clamp histogram on ``table``."""
    hist = clamp_histogram(table.columns[column])
    query = clamp_histogram_query(table, column, hist, secret)
    assert query.clamp is not None
    engine = service.engine
    passed = clamp_pass.run(engine.columns, engine.versions, engine._con, query, None)
    assert passed is not None, "the pass declined: nothing compared"
    sql = service.engine.execute(dataclasses.replace(query, clamp=None))
    return _counts(passed, hist.bins), _counts(sql, hist.bins)


@pytest.mark.parametrize("column", ["cost", "age"])
def test_the_pass_counts_what_the_sql_counts_on_the_fixture(column):
    service = Service(load_policy(FIXTURE), ledger=MemoryLedger(), cache=False)
    try:
        table = service.policy.tables["visits"]
        for rows in (1, 5):
            counted = dataclasses.replace(table, max_rows_per_unit=rows)
            for secret in SECRETS:
                passed, sql = _both(service, counted, column, secret)
                assert sql.sum() > 0
                assert passed.tolist() == sql.tolist()
    finally:
        service.close()


@pytest.mark.parametrize("unit", [True, False], ids=["unit", "row-level"])
def test_the_pass_counts_what_the_sql_counts_on_generated_data(tmp_path, unit):
    # ~750 units of ~4 rows (2% with a NULL unit: one partition in the SQL, one unit in the
    # store), x with NULL, NaN, +-inf, +-1e300 and negatives beyond [-50, 50], a with
    # negatives and NULLs beyond [0, 100]
    service = Service(_loaded(tmp_path, unit=unit), ledger=MemoryLedger(), cache=False)
    try:
        table = service.policy.tables["t1"]
        for column in ("x", "a"):
            for rows in (1, 2, 3) if unit else (1,):
                counted = dataclasses.replace(table, max_rows_per_unit=rows)
                for secret in SECRETS:
                    passed, sql = _both(service, counted, column, secret)
                    assert passed.tolist() == sql.tolist()
        if unit:  # units over R: the keyed hash chose rows (R = 1 keeps fewer than R = 3)
            one = _both(service, dataclasses.replace(table, max_rows_per_unit=1), "x", 7)[1]
            three = _both(service, dataclasses.replace(table, max_rows_per_unit=3), "x", 7)[1]
            assert one.sum() < three.sum()
    finally:
        service.close()


def test_another_secret_keeps_other_rows(tmp_path):
    """The selection is keyed: two secrets keep other rows of units over R (so a pass that
    ignored the secret, or hashed other values, could not match the SQL above by chance)."""
    service = Service(_loaded(tmp_path, unit=True), ledger=MemoryLedger(), cache=False)
    try:
        table = dataclasses.replace(service.policy.tables["t1"], max_rows_per_unit=1)
        seen = {tuple(_both(service, table, "x", s)[0]) for s in SECRETS}
        assert len(seen) > 1
    finally:
        service.close()


def test_the_hash_and_bins_agree_with_duckdb_on_the_probe_rows(tmp_path):
    """The process-wide probe itself: this DuckDB's HASH and bin SQL on literal rows of every
    column type (NULL, NaN, -0.0, infinities, bin edges and one ulp either side)."""
    service = Service(_loaded(tmp_path, unit=True), ledger=MemoryLedger(), cache=False)
    try:
        table = service.policy.tables["t1"]
        con = duckdb.connect()
        for column in ("x", "a"):
            spec = clamp_histogram_query(table, column, clamp_histogram(table.columns[column]), 3)
            assert spec.clamp is not None
            assert clamp_pass._probe(con, spec.clamp)
    finally:
        service.close()


def test_the_probe_runs_the_histogram_querys_own_bin_tree(tmp_path):
    """The spec carries the compiler's bin as a tree (no text read back): the probe's SQL holds
    it rendered exactly as the histogram query holds it, and the spec's tree is a copy, so
    the probe's query never re-parents a node of the histogram's."""
    service = Service(_loaded(tmp_path, unit=True), ledger=MemoryLedger(), cache=False)
    try:
        table = service.policy.tables["t1"]
        for column in ("x", "a"):
            query = clamp_histogram_query(table, column, clamp_histogram(table.columns[column]), 3)
            assert query.clamp is not None
            bin_sql = query.clamp.bin_of.sql(dialect="duckdb")
            before = query.render("duckdb")
            assert bin_sql in before
            assert bin_sql in clamp_pass._probe_query(query.clamp, 5).sql(dialect="duckdb")
            assert query.clamp.bin_of.parent is None and query.render("duckdb") == before
    finally:
        service.close()


def test_a_probe_that_differs_runs_the_sql(tmp_path, monkeypatch, caplog):
    """A DuckDB whose hash the pass does not reproduce: the SQL runs (same counts), logged."""
    service = Service(_loaded(tmp_path, unit=True), ledger=MemoryLedger(), cache=False)
    try:
        table = service.policy.tables["t1"]
        hist = clamp_histogram(table.columns["x"])
        query = clamp_histogram_query(table, "x", hist, 11)
        monkeypatch.setattr(clamp_pass, "_checked", {})
        monkeypatch.setattr(clamp_pass, "NULL_HASH", 1)  # not DuckDB's any more
        monkeypatch.setattr(clamp_pass, "_probe", lambda *a: False)
        with caplog.at_level(logging.WARNING, logger="dpsql.engine"):
            engine = service.engine
            assert clamp_pass.run(engine.columns, engine.versions, engine._con, query, None) is None
        assert "its SQL runs" in caplog.text
        sql = service.engine.execute(query)  # falls back to the SQL
        assert _counts(sql, hist.bins).sum() > 0
    finally:
        service.close()


def test_a_first_query_buys_its_clamp_histogram_with_the_pass(tmp_path, monkeypatch):
    """Through the service: a SUM of a column with no clip stated buys its histogram once, and
    on a held table the pass computes it (the SQL is not run for it)."""
    rows = [(i // 3, i % 4, (i * 37) % 1000) for i in range(600)]
    path = write_csv(tmp_path / "t.csv", ["uid", "g", "x"], rows)
    columns = {
        "uid": {"type": "int", "nullable": False},
        "g": {"type": "int", "values": [0, 1, 2, 3], "nullable": False},
        "x": {"type": "int", "lower": 0, "upper": 1000, "nullable": False},
    }
    policy = table_policy(path, columns, unit="uid", privacy={"epsilon": 1.0, "dataset": "d"})
    calls: list[int] = []
    original = clamp_pass.counts

    def spied(store, spec, secret, text_hashes):
        calls.append(secret)
        return original(store, spec, secret, text_hashes)

    monkeypatch.setattr(clamp_pass, "counts", spied)
    con = dpsql.connect(policy=policy, ledger=MemoryLedger())
    try:
        cur = con.cursor()
        cur.execute("SELECT SUM(x) FROM t")
        cur.fetchall()
        cur.execute("SELECT SUM(x) FROM t WHERE g = 1")
        cur.fetchall()
    finally:
        con.close()
    assert len(calls) == 1  # bought once, by the first query; kept for the second
