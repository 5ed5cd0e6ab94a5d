"""A query never waits for numba: until this process's kernels are loaded
(dpsql.engine.kernel_readiness) the column programs run in numpy or as SQL, with the same
answer, and the compiled passes are chosen once they are."""

from __future__ import annotations

import pytest
from conftest import exact_connect, fixture_policy, rows_of
from test_clustered import _spy

import dpsql
from dpsql.engine import clamp_pass, clustered, columnar, kernel_readiness
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

QUERIES = [
    "SELECT department, COUNT(*), SUM(cost), AVG(cost) FROM visits GROUP BY department",
    "SELECT COUNT(*), AVG(age) FROM visits WHERE age > 40",
]


@pytest.fixture()
def kernel_calls(monkeypatch) -> list[str]:
    yield _spy(monkeypatch)  # each run of a kernel
    columnar.warm_up()  # loaded again (from numba's cache) for the tests after this one


@pytest.mark.skipif(not clustered.available(), reason="numba is not installed")
@pytest.mark.parametrize("bias", ["on", "off"])
def test_before_the_kernels_load_a_query_runs_without_them_and_answers_alike(
    kernel_calls, monkeypatch, bias
):
    monkeypatch.setattr(columnar, "warm_up_later", lambda: None)  # nothing loads them
    kernel_readiness.forget()
    conn = exact_connect(fixture_policy())
    try:
        conn.cursor().execute(f"SET bias_estimate = {bias}")
        before = [rows_of(conn, q) for q in QUERIES]
        assert kernel_calls == []  # answered without a kernel
        columnar.warm_up()
        assert kernel_readiness.ready()
        after = [rows_of(conn, q) for q in QUERIES]
        assert kernel_calls  # and with them once loaded
    finally:
        conn.close()
    assert before == after  # the same secret, the same exact integers either way


@pytest.mark.skipif(not clustered.available(), reason="numba is not installed")
def test_the_clamp_histograms_pass_waits_for_its_kernels_too(monkeypatch):
    """The default clamp's histogram (bought by the first SUM / AVG of a column that states
    no clip) runs as its SQL until then."""
    passes: list[int] = []
    original = clamp_pass.counts
    monkeypatch.setattr(clamp_pass, "counts", lambda *a, **k: passes.append(1) or original(*a, **k))
    monkeypatch.setattr(columnar, "warm_up_later", lambda: None)
    kernel_readiness.forget()
    try:
        conn = dpsql.connect(
            policy=fixture_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False
        )
        try:
            assert rows_of(conn, "SELECT SUM(cost) FROM visits")
        finally:
            conn.close()
        assert passes == []
    finally:
        columnar.warm_up()
