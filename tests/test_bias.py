"""Issue 31, item 1: every answer from bounded rows says what the bounds cut (docs/bias.md).

The bias measures (dpsql.plan.bias) are estimated by the engine in the same bounded query and
charged in its one reservation. Checked here: the estimate equals what the bounds cut on
generated data (exactly without noise, on average with it), its share is charged and the
total is the query's ε, ``SET bias_estimate = off`` spends nothing on it, a neighbouring
dataset moves each new measure by at most its sensitivity (and an audit of its release finds
no more loss than its share), and every door shows it.
"""

from __future__ import annotations

import io
import math
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import FIXTURE_CSV, exact_connect, fixture_policy, table_policy, write_csv

import dpsql
from dpsql.commands import run_statement
from dpsql.frontend.bind import parse_statement
from dpsql.lower.compile import compile_plan
from dpsql.plan import bias
from dpsql.privacy.accounting import Cost
from dpsql.privacy.audit import audit, threshold_events
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise
from dpsql.server.backend import DpBackend
from dpsql.server.server import Server, ServerThread
from dpsql.server.testing import RawClient
from dpsql.server.users import UserStore, users_path
from dpsql.service.bias_notes import answer_notes
from dpsql.service.session import Session

R = 3
C = bias.cap(R)  # 6: a unit's rows beyond R are counted up to C per group
LOWER, UPPER, G_RAN = 0.0, 50.0, 0.5  # x's declared range and granularity
DEPTS = ["a", "b", "c"]


def generated(seed: int = 7, units: int = 600) -> list[tuple[Any, ...]]:
    """Units of 1 to R + C rows (never more: the cap then cuts nothing), each in one dept
    (G never binds), with x in [-20, 70]: within W = 50 of the bounds (the clip of the
    clamped mass cuts nothing either)."""
    rnd = random.Random(seed)
    rows = []
    for u in range(units):
        dept = DEPTS[u % 3]
        for _ in range(rnd.randint(1, R + C)):
            rows.append((u, dept, round(rnd.uniform(-20.0, 70.0), 1)))
    return rows


def policy(path: Path, **privacy: Any) -> dict:
    cols = {
        "uid": {"type": "int", "nullable": False},
        "dept": {"type": "text", "values": DEPTS, "nullable": False},
        "x": {"type": "float", "lower": LOWER, "upper": UPPER, "granularity": G_RAN},
    }
    return table_policy(path, cols, unit="uid", rows=R, groups=1, privacy=privacy)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[Any, ...]]]:
    rows = generated()
    path = write_csv(tmp_path_factory.mktemp("bias") / "t.csv", ["uid", "dept", "x"], rows)
    return path, rows


def _fixed(x: float) -> float:
    """x on the column's grid, as the engine rounds it (half away from zero)."""
    q = abs(x) / G_RAN
    return math.copysign(math.floor(q + 0.5 + 1e-9), x) * G_RAN


def truth(rows: list[tuple[Any, ...]], dept: str | None = None) -> dict[str, float]:
    """The unbounded COUNT, SUM, AVG of x (of ``dept``) from the rows, each x on the
    column's fixed-point grid (what any DP SUM of it releases at best)."""
    xs = [_fixed(x) for _, d, x in rows if dept is None or d == dept]
    return {"count": len(xs), "sum": sum(xs), "avg": sum(xs) / len(xs)}


# -- the estimate ------------------------------------------------------------------------------


def test_without_noise_the_estimate_is_exactly_what_the_bounds_cut(data) -> None:
    """No noise: released + estimated bias = the true value (COUNT exactly; SUM and AVG
    within 1e-6, the fine grid's truncation), x on its fixed-point grid, here where no unit
    exceeds R + C rows and no x lies more than the range's width beyond a bound. The bounds
    do cut: the released values are far off."""
    path, rows = data
    conn = exact_connect(policy(path))
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*) AS n, SUM(x) AS s, AVG(x) AS m FROM t")
    (n, s, m), (bn, bs, bm) = cur.fetchone(), cur.biases[0]
    true = truth(rows)
    assert true["count"] - n > 0.2 * true["count"]  # R = 3 cuts a lot of rows
    assert n + bn[0] == true["count"]
    assert s + bs[0] == pytest.approx(true["sum"], rel=1e-6)  # the fine grid's truncation
    assert abs(true["sum"] - s) > 1000  # the cut is far larger than that tolerance
    assert m + bm[0] == pytest.approx(true["avg"], rel=1e-6)
    # per group too (public keys)
    cur.execute("SELECT dept, COUNT(*), SUM(x) FROM t GROUP BY dept")
    for (dept, n, s), (_, bn, bs) in zip(cur.fetchall(), cur.biases, strict=True):
        t = truth(rows, dept)
        assert n + bn[0] == t["count"]
        assert s + bs[0] == pytest.approx(t["sum"], rel=1e-6)


@pytest.mark.parametrize("bounding", ["scale", "sample"])
def test_with_noise_the_estimate_is_unbiased(tmp_path: Path, bounding: str) -> None:
    """Seeded noise, 60 runs (no cache): the mean of released + estimated bias is within 4
    standard errors of the true value. Tolerance: 4·s/√60 of the runs' own spread (the noise
    is zero-mean and, under sampling, the kept rows a uniform sample of each unit's)."""
    rows = generated(seed=11, units=300)
    path = write_csv(tmp_path / "t.csv", ["uid", "dept", "x"], rows)
    pol = policy(path, epsilon=4.0)
    pol["tables"]["t"]["bounding"] = bounding
    conn = dpsql.connect(policy=pol, ledger=MemoryLedger(), noise=SeededNoise(5), cache=False)
    cur = conn.cursor()
    got: dict[str, list[float]] = {"count": [], "sum": []}
    for _ in range(60):
        cur.execute("SELECT COUNT(*), SUM(x) FROM t")
        (n, s), (bn, bs) = cur.fetchone(), cur.biases[0]
        got["count"].append(n + bn[0])
        got["sum"].append(s + bs[0])
    true = truth(rows)
    for name, values in got.items():
        mean, se = float(np.mean(values)), float(np.std(values, ddof=1)) / math.sqrt(60)
        assert abs(mean - true[name]) <= 4 * se + G_RAN, (name, mean, true[name], se)


def test_the_cap_makes_it_a_lower_bound_and_says_so(tmp_path: Path) -> None:
    """A unit with more than R + C rows in a group: only C of its cut rows are counted (the
    stated bias of the estimate), and the notes and EXPLAIN say up to how many."""
    rows = [(1, "a", 1.0)] * (R + C + 10) + [(2, "a", 1.0)] * 2
    path = write_csv(tmp_path / "t.csv", ["uid", "dept", "x"], rows)
    cur = exact_connect(policy(path)).cursor()
    cur.execute("SELECT COUNT(*) FROM t")
    assert cur.fetchone() == (R + 2,)
    assert cur.biases[0][0][0] == C  # not the C + 10 rows cut: the cap of the sensitivity
    cur.execute("EXPLAIN (FORMAT TEXT) SELECT COUNT(*) FROM t")
    text = "\n".join(r[0] for r in cur.fetchall())
    assert f"rows cut by R (up to {C} per unit and group)" in text


# -- what it costs -------------------------------------------------------------------------


def test_its_share_is_charged_in_the_query_reservation(data) -> None:
    """The bias measures take BIAS_SHARE of ε; the answer the rest; the ledger is charged the
    query's ε once (one reservation), and EXPLAIN shows each bias measure's share."""
    path, _ = data
    conn = exact_connect(policy(path, epsilon=0.5))
    cur = conn.cursor()
    cur.execute("EXPLAIN SELECT COUNT(*), SUM(x) FROM t")
    rows = cur.fetchall()
    shares = [r[6] for r in rows if r[0] == "bias"]
    answer = [r[6] for r in rows if r[0] in ("COUNT(*)", "SUM(x)")]
    assert len(shares) == 3  # dropped, cut(x), clamped(x)
    assert sum(shares) == pytest.approx(bias.share(0.5))
    assert sum(answer) == pytest.approx(0.5 - bias.share(0.5))
    total = next(r for r in rows if r[0] == "total")
    assert total[6] == pytest.approx(0.5)
    service = conn._service
    plan = service.plan(
        parse_statement("SELECT COUNT(*), SUM(x) FROM t", service.policy), conn._settings
    )
    assert sum(m.epsilon for m in plan.measures if m.kind in bias.KINDS) == pytest.approx(
        bias.share(0.5)
    )
    cur.execute("SELECT COUNT(*), SUM(x) FROM t")
    # one charge, the plan's cost, bias measures included: the query's ε (to a float's
    # error: the shares are floats, dpsql.privacy.accounting.exact)
    assert cur.cost == plan.cost and cur.cost.epsilon == pytest.approx(0.5, rel=1e-15)
    assert service.ledger.spent(conn.analyst, service.policy.dataset) == plan.cost


@pytest.mark.parametrize("epsilon", [1.0, 0.3, 0.7, 2.2, 0.0142])
def test_the_charge_never_exceeds_the_querys_epsilon(tmp_path: Path, epsilon: float) -> None:
    """The shares are floats: the last bias share absorbs their rounding, so the charge is
    the query's ε or (by < 1e-15 of it) below, never above: a query spending exactly the
    budget that is left is answered, not refused for a rounding."""
    rows = generated(seed=5, units=50)
    path = write_csv(tmp_path / "t.csv", ["uid", "dept", "x"], rows)
    pol = policy(path, epsilon=epsilon, budget_epsilon=epsilon)
    conn = exact_connect(pol)
    service = conn._service
    for sql in ("SELECT SUM(x) FROM t", "SELECT dept, COUNT(*), AVG(x) FROM t GROUP BY dept"):
        plan = service.plan(parse_statement(sql, service.policy), conn._settings)
        assert plan.cost.exact_epsilon <= Cost(epsilon=epsilon).exact_epsilon
        assert plan.cost.epsilon == pytest.approx(epsilon, rel=1e-15)
    cur = conn.cursor()
    cur.execute("SELECT dept, COUNT(*), AVG(x) FROM t GROUP BY dept")  # the whole budget
    assert cur.fetchall() and cur.cost.epsilon == pytest.approx(epsilon, rel=1e-15)


def test_bias_estimate_off_spends_nothing_on_it(data) -> None:
    """SET bias_estimate = off: no bias measure in the plan or its engine SQL, the whole ε on
    the answer (the same charge), no bias column or note."""
    path, _ = data
    conn = exact_connect(policy(path))
    cur = conn.cursor()
    cur.execute("SET bias_estimate = off")
    service = conn._service
    plan = service.plan(
        parse_statement("SELECT COUNT(*), SUM(x) FROM t", service.policy), conn._settings
    )
    assert not [m for m in plan.measures if m.kind in bias.KINDS]
    assert sum(m.epsilon for m in plan.measures) == pytest.approx(1.0)
    assert "v_m2" not in compile_plan(plan, 0).render("duckdb")
    cur.execute("EXPLAIN SELECT COUNT(*), SUM(x) FROM t")
    rows = cur.fetchall()
    assert not [r for r in rows if r[0] == "bias"]
    assert [r[6] for r in rows if r[0] == "COUNT(*)"] == [pytest.approx(0.5)]
    cur.execute("SELECT COUNT(*), SUM(x) FROM t")
    assert cur.cost == Cost(epsilon=1.0)
    assert cur.biases == [(None, None)] and cur.bias_notes == []
    cur.execute("SHOW bias_estimate")
    assert cur.fetchall() == [("off",)]
    cur.execute("RESET bias_estimate")
    cur.execute("SHOW bias_estimate")
    assert cur.fetchall() == [("on",)]


def test_an_unknown_value_is_refused_free(data) -> None:
    path, _ = data
    conn = exact_connect(policy(path))
    with pytest.raises(dpsql.ProgrammingError) as info:
        conn.cursor().execute("SET bias_estimate = maybe")
    assert info.value.sqlstate == "22023" and "bias_estimate = on" in (info.value.hint or "")


# -- neighbouring datasets --------------------------------------------------------------------


def _exact_measures(
    path: Path, sql: str, epsilon: float = 1.0
) -> tuple[Any, dict[str, dict[tuple, int]]]:
    """The plan and each bias measure's exact engine value per group (no noise)."""
    conn = exact_connect(policy(path, epsilon=epsilon))
    service = conn._service
    plan = service.plan(parse_statement(sql, service.policy), conn._settings)
    result = service.engine.execute(compile_plan(plan, 12345))
    out: dict[str, dict[tuple, int]] = {}
    for j, m in enumerate(plan.measures):
        if m.kind in bias.KINDS:
            out[m.kind] = {
                tuple(k): int(v) for k, v in zip(result.key_rows, result.measures[j], strict=True)
            }
    return plan, out


def test_a_worst_case_unit_moves_each_bias_measure_by_at_most_its_sensitivity(
    tmp_path: Path,
) -> None:
    """D′ = D + one unit with far more than R + C rows and x far beyond the bounds: each bias
    measure moves by exactly its per-group bound (tight) and never more (the cap and the
    clip), in the engine's own units."""
    base = generated(seed=3, units=60)
    extra = [(9999, "a", 1e6)] * (R + C + 40)
    p1 = write_csv(tmp_path / "d.csv", ["uid", "dept", "x"], base)
    p2 = write_csv(tmp_path / "d2.csv", ["uid", "dept", "x"], base + extra)
    sql = "SELECT dept, COUNT(*), SUM(x) FROM t GROUP BY dept"
    plan, d = _exact_measures(p1, sql)
    _, d2 = _exact_measures(p2, sql)
    for m in plan.measures:
        if m.kind not in bias.KINDS:
            continue
        moved = {k: d2[m.kind].get(k, 0) - d[m.kind].get(k, 0) for k in d2[m.kind]}
        assert sum(abs(v) for v in moved.values()) <= m.l1, m.kind
        assert max(abs(v) for v in moved.values()) == m.per_group_bound, m.kind


@pytest.mark.slow
def test_audit_of_the_bias_release_finds_no_more_loss_than_its_share(tmp_path: Path) -> None:
    """The rows-cut measure released on D and on D′ (the worst-case unit above), 4000 times
    each with its own mechanism: the audit finds no loss above the measure's share, and sees
    at least half of it (the estimator's power check, as in test_privacy_audit)."""
    base = generated(seed=3, units=60)
    extra = [(9999, "a", 1e6)] * (R + C + 40)
    p1 = write_csv(tmp_path / "d.csv", ["uid", "dept", "x"], base)
    p2 = write_csv(tmp_path / "d2.csv", ["uid", "dept", "x"], base + extra)
    sql = "SELECT COUNT(*) FROM t"
    # ε = 10: the measure's share (1.0) moves the tails enough for the audit to see it
    plan, d = _exact_measures(p1, sql, epsilon=10.0)
    _, d2 = _exact_measures(p2, sql, epsilon=10.0)
    m = next(m for m in plan.measures if m.kind == "dropped")
    n = 4000
    on_d = d["dropped"][()] + m.mechanism.sample(SeededNoise(1), n).astype(float)
    on_d2 = d2["dropped"][()] + m.mechanism.sample(SeededNoise(2), n).astype(float)
    scale, shift = m.mechanism.scale, m.per_group_bound
    base_value = d["dropped"][()]
    grid = np.linspace(base_value - 2 * scale, base_value + shift + 2 * scale, 21)
    report = audit(
        threshold_events("dropped", on_d, on_d2, grid),
        n,
        n,
        epsilon=m.epsilon,
        delta=0.0,
        confidence=0.999,
    )
    assert not report.violated, str(report)
    assert report.epsilon_lower >= 0.5 * m.epsilon, str(report)


# -- every door -------------------------------------------------------------------------------


def test_the_dbapi_gives_each_value_its_bias_and_widened_interval() -> None:
    """The issue's example: COUNT(*) on the shipped fixture. The bias column holds the
    estimate and the interval widened by it; bias_interval = on adds them to the interval
    columns; the note says it in words."""
    conn = exact_connect(fixture_policy(privacy={"budget_epsilon": 1e9}))
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*) AS n FROM visits")
    (n,), [((low, high),)], [((b, blo, bhi),)] = cur.fetchone(), cur.intervals, cur.biases
    assert 4000 < b < 5172  # 5,172 rows are cut; C = 10 per patient counts 4,307 of them
    assert blo == low and bhi >= high + b
    assert cur.bias_notes and "n is computed from bounded rows" in cur.bias_notes[0]
    assert [d[0] for d in cur.interval_description] == ["n", "n_low", "n_high"]
    cur.execute("SET bias_interval = on")
    cur.execute("SELECT COUNT(*) AS n FROM visits")
    names = [d[0] for d in cur.interval_description]
    assert names == ["n", "n_low", "n_high", "n_bias", "n_bias_low", "n_bias_high"]
    assert cur.fetchall_intervals() == [(n, low, high, b, blo, bhi)]


def test_the_cli_prints_the_bias_beside_the_charge() -> None:
    conn = exact_connect(fixture_policy(privacy={"budget_epsilon": 1e9}))
    out, err = io.StringIO(), io.StringIO()
    session = Session(conn.service, "default")  # the CLI's door: a session over the service
    session.execute("SET bias_interval = on")
    run_statement(
        session,
        "SELECT COUNT(*) AS n FROM visits",
        analyst="default",
        fmt="csv",
        intervals=True,
        out=out,
        err=err,
    )
    assert out.getvalue().splitlines()[0] == "n,n_low,n_high,n_bias,n_bias_low,n_bias_high"
    assert "-- bias: n is computed from bounded rows" in err.getvalue()


def test_the_wire_protocol_sends_a_notice() -> None:
    conn = exact_connect(fixture_policy(privacy={"budget_epsilon": 1e9}))
    session = Session(conn.service, "default", dialect="postgres")  # as the server opens it
    outcome = DpBackend(session).execute("SELECT COUNT(*) AS n FROM visits", None)
    texts = [text for severity, code, text in outcome.notices if severity == "NOTICE"]
    assert any(t.startswith("dpsql: bias: n is computed from bounded rows") for t in texts)


def test_a_wire_client_gets_the_notice_end_to_end(tmp_path: Path) -> None:
    """Over the real PostgreSQL protocol (RawClient, SCRAM login): the NOTICE arrives with
    the rows, and SET bias_estimate = off over the wire removes it."""
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(FIXTURE_CSV.parent / name, tmp_path / name)
    policy_path = tmp_path / "visits.toml"
    users = UserStore(users_path(policy_path))
    users.add("alice", "pw")
    service = dpsql.Service(policy_path, cache=False, ledger=MemoryLedger())
    thread = ServerThread(lambda: Server(service, UserStore(users_path(policy_path))))
    thread.start()
    try:
        client = RawClient("127.0.0.1", thread.port)
        assert client.login("alice", "pw").status == "I"
        reply = client.query("SELECT COUNT(*) AS n FROM visits")
        said = [n.get("M", "") for n in reply.notices()]
        assert any(m.startswith("dpsql: bias: n is computed from bounded rows") for m in said)
        assert any(m.startswith("dpsql: charged") for m in said)
        client.query("SET bias_estimate = off")
        reply = client.query("SELECT COUNT(*) AS n FROM visits")
        assert not [n for n in reply.notices() if "bias:" in n.get("M", "")]
        client.sock.close()
    finally:
        thread.stop()
        service.close()


def test_explain_says_beforehand_what_the_bounds_may_cut() -> None:
    conn = exact_connect(fixture_policy(privacy={"budget_epsilon": 1e9}))
    cur = conn.cursor()
    cur.execute("EXPLAIN SELECT department, COUNT(*), AVG(cost) FROM visits GROUP BY 1")
    said = [r[1] for r in cur.fetchall() if r[0] == "bounds"]
    assert (
        "R = 5 may drop rows of units (patient_id) with more than 5 rows of visits in a group"
        in said
    )
    assert any(s.startswith("G = 3 may drop groups") for s in said)
    assert any(s.startswith("the clamp of cost to [0, 5000]") for s in said)
    cur.execute("EXPLAIN (FORMAT TEXT) SELECT COUNT(*) FROM visits")
    text = "\n".join(r[0] for r in cur.fetchall())
    assert "What the bounds may cut" in text and "R = 5 may drop rows" in text
    assert cur.cost is None  # EXPLAIN spends nothing


def test_a_grouped_note_says_what_a_negative_estimate_means():
    """Per group the estimate is the true value minus the answer, with noise: "cut -7,847"
    alone read as nonsense; below 0 the note says what it can mean."""
    table = SimpleNamespace(privacy_unit=None, unit_is_row=True)
    plan = SimpleNamespace(query=SimpleNamespace(table=table, keys=["k"]), max_groups=1)
    described = [("k", "text"), ("a", "float")]
    mixed = answer_notes(plan, described, [[None, (-7847.0, -1, 1)], [None, (3324.0, -1, 1)]])
    said = "-7,847 to 3,324 per group (each noisy; one below 0 means little was cut there"
    assert said in mixed[0]
    cut = answer_notes(plan, described, [[None, (10.0, -1, 1)], [None, (3324.0, -1, 1)]])
    assert "10 to 3,324 per group over its 2 groups" in cut[0] and "below 0" not in cut[0]


def test_a_grouped_note_tells_estimates_within_their_noise_apart():
    """The quick start's AVG(cost) in [0, 5000] was said to be cut by "-8,855 to 4,423 per
    group": every one of those estimates lay within its own noise. Such estimates are
    counted and their noise said; the range is of the estimates that stand out of it."""
    table = SimpleNamespace(privacy_unit=None, unit_is_row=True)
    plan = SimpleNamespace(query=SimpleNamespace(table=table, keys=["k"]), max_groups=1)
    described = [("k", "text"), ("a", "float")]
    # noise interval [100, 200]; (b, widened low, widened high) = b ± h added to its ends
    noise = [(None, (100.0, 200.0))] * 2
    within = [[None, (-50.0, 100 - 80.0, 200 + 30.0)], [None, (500.0, 100 - 100.0, 200 + 1100.0)]]
    said = answer_notes(plan, described, within, noise)[0]
    assert "each within their own noise in all 2 groups (up to ±600 at 95%)" in said
    assert "too noisy to tell" in said and "an estimated" not in said
    mixed = [[None, (-50.0, 100 - 80.0, 200 + 30.0)], [None, (900.0, 100.0, 200 + 1000.0)]]
    said = answer_notes(plan, described, mixed, noise)[0]
    assert "an estimated 900 in 1 of its 2 groups" in said
    assert "in the other 1, each estimate is within its own noise" in said
