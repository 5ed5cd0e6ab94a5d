"""The default clamp range (issue 31 item 7; dpsql.service.bounds, kind "clip").

A SUM/AVG/VAR/STDDEV of a number column whose policy states no ``clip`` is clamped to a range
chosen from a DP histogram of |x| on public log bins, bought once per analyst, column and
data version by the first such query (its own ledger entry of ``bounds_share`` · ε) and kept;
later queries choose their range from it free and spend their whole ε. The range is then
the column's bounds in the plan (EXPLAIN shows it; the engine clamps to it).

- charged once per analyst and data version, a new data version buys again;
- a column the query also filters, and ``clip = "declared"``, keep the declared bounds;
- the answer (noise off) is the SUM clamped to the chosen range, shown in EXPLAIN;
- a refusal before the purchase spends and reads nothing (also at an ε whose share underflows);
- EXPLAIN states the purchase's cost beside the query's, and the answer's cost includes it;
- a single total's clamp bias is the kept histogram's estimate (no bias measure, the whole ε
  on the answer); a grouped query keeps its per-group bias measure;
- a neighbouring-dataset audit of the released histogram and the range chosen from it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from conftest import table_policy, write_csv

import dpsql
from dpsql.lower.compile import clamp_histogram_query
from dpsql.privacy.audit import audit, indicator_event, threshold_events
from dpsql.privacy.clipping import ApproxBounds, posterior_candidates, posterior_counts
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise, ZeroNoise
from dpsql.privacy.sqlite_ledger import SQLiteLedger
from dpsql.service.bounds import clamp_histogram

EPS = 1.0
COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "g": {"type": "int", "values": [0, 1, 2, 3], "nullable": False},
    "x": {"type": "int", "lower": 0, "upper": 1000, "nullable": False},
}


def _data(tmp_path: Path, extra: tuple[int, ...] = (), name: str = "t.csv") -> Path:
    """200 units of one row, x small (i % 20) but for two of 900; ``extra`` more units."""
    xs = [900 if i in (7, 99) else i % 20 for i in range(200)] + list(extra)
    rows = [(i + 1, i % 4, x) for i, x in enumerate(xs)]
    return write_csv(tmp_path / name, ["uid", "g", "x"], rows)


def _policy(path: Path, clip: str | None = None, **table: object) -> dict:
    columns = {k: dict(v) for k, v in COLUMNS.items()}
    if clip is not None:
        columns["x"]["clip"] = clip
    policy = table_policy(path, columns, unit="uid", privacy={"epsilon": EPS, "dataset": "d"})
    policy["tables"]["t"].pop("max_rows_per_unit")
    policy["tables"]["t"].pop("max_groups_per_unit")
    policy["tables"]["t"].update({"primary_key": "uid", **table})
    return policy


def _charges(ledger: SQLiteLedger, analyst: str = "alice") -> list:
    return [e for e in ledger.entries("d", analyst=analyst) if e.kind == "charge"]


def _ask(cur, sql: str) -> list:
    cur.execute(sql)
    return cur.fetchall()


def _clamp_in_explain(cur, sql: str) -> float | None:
    text = " ".join(str(r[1]) for r in _ask(cur, f"EXPLAIN {sql}"))
    found = re.search(r"clamp of x to \[0, ([0-9.e+]+)\]", text)
    return float(found.group(1)) if found else None


def test_the_purchase_is_charged_once_per_analyst_and_data_version(tmp_path: Path):
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    path = _data(tmp_path)
    service = dpsql.Service(_policy(path, version="v1"), ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    _ask(cur, "SELECT SUM(x) FROM t")
    choice, query = _charges(ledger)
    assert choice.query_text == "choose clamp ranges: values of t.x at data version v1"
    assert math.isclose(float(choice.cost.epsilon), 0.1 * EPS)
    assert math.isclose(float(choice.cost.epsilon + query.cost.epsilon), EPS)
    # later queries choose from the kept histogram: each charges its own ε only
    _ask(cur, "SELECT AVG(x) FROM t")
    _ask(cur, "SELECT g, SUM(x) FROM t GROUP BY g")
    charges = _charges(ledger)
    assert [c.query_text.startswith("choose") for c in charges] == [True, False, False, False]
    assert all(math.isclose(float(c.cost.epsilon), EPS) for c in charges[2:])
    # another analyst buys their own, once
    bob = service.connect("bob").cursor()
    _ask(bob, "SELECT SUM(x) FROM t")
    _ask(bob, "SELECT AVG(x) FROM t")
    assert [c.query_text.startswith("choose") for c in _charges(ledger, "bob")] == [
        True,
        False,
        False,
    ]
    service.close()
    # a new data version: bought (and charged) again
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    service = dpsql.Service(_policy(path, version="v2"), ledger=ledger, noise=ZeroNoise())
    _ask(service.connect("alice").cursor(), "SELECT AVG(x) FROM t")
    last = _charges(ledger)[-2:]
    assert last[0].query_text == "choose clamp ranges: values of t.x at data version v2"
    assert not last[1].query_text.startswith("choose")
    service.close()
    # the curator widens x's declared bounds at the same data version: other bins, bought again
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    policy = _policy(path, version="v2")
    policy["tables"]["t"]["columns"]["x"]["upper"] = 2000
    service = dpsql.Service(policy, ledger=ledger, noise=ZeroNoise())
    before = len(_charges(ledger))
    _ask(service.connect("alice").cursor(), "SELECT AVG(x) FROM t")
    bought = _charges(ledger)[before:]
    assert bought[0].query_text == "choose clamp ranges: values of t.x at data version v2"
    # (noise off, the same range is chosen: the same plan, whose answer is replayed free)
    assert [c.query_text.startswith("choose") for c in bought] in ([True], [True, False])
    service.close()


def test_declared_clip_a_filtered_column_and_counts_buy_nothing(tmp_path: Path):
    path = _data(tmp_path)
    for policy, sql in [
        (_policy(path, clip="declared"), "SELECT SUM(x) FROM t"),
        (_policy(path), "SELECT SUM(x) FROM t WHERE x < 500"),
        (_policy(path), "SELECT g, COUNT(*) FROM t GROUP BY g"),
        (_policy(path), "SELECT SUM(x), MAX(x) FROM t"),
    ]:
        ledger = SQLiteLedger(tmp_path / f"l{len(sql)}{len(policy['tables']['t']['columns'])}.db")
        service = dpsql.Service(policy, ledger=ledger, noise=ZeroNoise())
        _ask(service.connect("alice").cursor(), sql)
        assert [c.query_text.startswith("choose") for c in _charges(ledger)] == [False], sql
        service.close()


def test_the_chosen_range_is_the_plans_bounds(tmp_path: Path):
    """Noise off: the histogram is exact, the range inside the declared one, EXPLAIN shows it
    as the clamp, and the answer is the SUM clamped to it (the declared clamp gives another)."""
    path = _data(tmp_path)
    xs = np.array([900 if i in (7, 99) else i % 20 for i in range(200)])
    ledger = MemoryLedger()
    service = dpsql.Service(_policy(path), ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    sql = "SELECT SUM(x) FROM t"
    assert _clamp_in_explain(cur, sql) == 1000  # not bought yet: the declared bounds, free
    assert ledger.spent("alice", "d").epsilon == 0
    (first,) = _ask(cur, sql)
    # the paying statement chose from the histogram at its own ε (0.9 of it: a SUM's noise
    # weighs more, so its clamp may be lower); its note states the range it was clamped to
    (first_note,) = [m for _, m in cur.messages if "x clamped to" in m]
    first_clamp = float(re.search(r"x clamped to \[0, ([0-9.e+]+)\]", first_note).group(1))
    later = "SELECT SUM(x) FROM t WHERE uid >= 0"
    clamp = _clamp_in_explain(cur, later)
    assert clamp is not None and 19 <= clamp < 900
    ((answer,),) = _ask(cur, later)
    assert answer == pytest.approx(float(np.minimum(xs, clamp).sum()))
    assert 19 <= first_clamp <= clamp
    assert first[0] == pytest.approx(float(np.minimum(xs, first_clamp).sum()))
    declared = dpsql.Service(
        _policy(path, clip="declared"), ledger=MemoryLedger(), noise=ZeroNoise()
    )
    ((full,),) = _ask(declared.connect("alice").cursor(), sql)
    assert full == pytest.approx(float(xs.sum())) and full > answer
    declared.close()
    service.close()


def test_a_refusal_before_the_purchase_spends_and_reads_nothing(tmp_path: Path):
    policy = _policy(_data(tmp_path))
    policy["privacy"]["budget_epsilon"] = 0.5  # less than the query's ε = 1
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    service = dpsql.Service(policy, ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    with mock.patch.object(service.engine, "execute", wraps=service.engine.execute) as run:
        with pytest.raises(dpsql.Error, match="budget"):
            _ask(cur, "SELECT SUM(x) FROM t")
        cur.execute("EXPLAIN SELECT AVG(x) FROM t")
        assert run.call_count == 0
    assert _charges(ledger) == []
    service.close()


def test_each_charge_comes_before_the_read_it_pays_for(tmp_path: Path):
    """Pay before reading, twice: the purchase is charged before the histogram query reads,
    and the answer's own charge before the query's read."""
    ledger = MemoryLedger()
    service = dpsql.Service(_policy(_data(tmp_path)), ledger=ledger, noise=ZeroNoise())
    events: list[str] = []
    charge, execute = ledger.charge, service.engine.execute

    def charged(*args, **kwargs):
        out = charge(*args, **kwargs)
        events.append("charge: " + kwargs["query_text"].split(":")[0])
        return out

    def read(*args, **kwargs):
        events.append("read")
        return execute(*args, **kwargs)

    with (
        mock.patch.object(ledger, "charge", charged),
        mock.patch.object(service.engine, "execute", read),
    ):
        _ask(service.connect("alice").cursor(), "SELECT SUM(x) FROM t")
    assert events == ["charge: choose clamp ranges", "read", "charge: SELECT SUM(x) FROM t", "read"]
    service.close()


def test_explain_states_the_purchase_and_the_answer_its_whole_cost(tmp_path: Path):
    ledger = MemoryLedger()
    service = dpsql.Service(_policy(_data(tmp_path)), ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    rows = _ask(cur, "EXPLAIN SELECT SUM(x) FROM t")
    (choose,) = [r for r in rows if r[0] == "choose"]
    (total,) = [r for r in rows if r[0] == "total"]
    assert choose[1].startswith("choose clamp ranges: values of t.x at data version ")
    assert choose[6] == pytest.approx(0.1 * EPS) and total[6] == pytest.approx(0.9 * EPS)
    assert ledger.spent("alice", "d").epsilon == 0  # EXPLAIN: free
    _ask(cur, "SELECT SUM(x) FROM t")
    assert float(cur.cost.epsilon) == pytest.approx(EPS)  # the choice and the answer
    assert float(ledger.spent("alice", "d").epsilon) == pytest.approx(EPS)
    rows = _ask(cur, "EXPLAIN SELECT AVG(x) FROM t")
    assert not [r for r in rows if r[0] == "choose"]  # kept: nothing more to buy
    service.close()


def test_an_epsilon_whose_share_underflows_is_refused_free(tmp_path: Path):
    ledger = MemoryLedger()
    service = dpsql.Service(_policy(_data(tmp_path)), ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    cur.execute("SET epsilon = 5e-324")
    with mock.patch.object(service.engine, "execute", wraps=service.engine.execute) as run:
        with pytest.raises(dpsql.Error) as refused:
            _ask(cur, "SELECT SUM(x) FROM t")
        assert run.call_count == 0
    assert refused.value.sqlstate == "22023" and "nothing was spent" in str(refused.value)
    assert ledger.spent("alice", "d").epsilon == 0
    service.close()


def _measures(cur, sql: str) -> list[tuple[str, float]]:
    skip = ("plan", "bounds", "total", "engine_sql")
    return [(r[1], r[6]) for r in _ask(cur, f"EXPLAIN {sql}") if r[0] not in skip]


def test_a_totals_clamp_bias_is_the_kept_histograms_estimate(tmp_path: Path):
    """Once the histogram is kept, a single total spends its whole ε on the SUM (no
    ``clamped`` measure: the histogram it chose from estimates the cut, in the answer's note);
    per group the ``clamped`` measure stays (the whole table's estimate is no group's)."""
    service = dpsql.Service(_policy(_data(tmp_path)), ledger=MemoryLedger(), noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    _ask(cur, "SELECT SUM(x) FROM t")  # buys the histogram (planned without a bias measure)
    total = _measures(cur, "SELECT SUM(x) FROM t WHERE uid >= 0")
    assert [m for m, _ in total] == ["sum(x)"]
    assert dict(total)["sum(x)"] == pytest.approx(EPS)
    _ask(cur, "SELECT SUM(x) FROM t WHERE uid >= 0")
    (note,) = [m for _, m in cur.messages if "chosen privately from a kept DP histogram" in m]
    assert re.search(r"biased towards zero by about [0-9.e+]+", note)
    grouped = [m for m, _ in _measures(cur, "SELECT g, SUM(x) FROM t GROUP BY g")]
    assert "clamped(x)" in grouped
    service.close()


def test_with_r_auto_the_histogram_counts_one_value_per_unit(tmp_path: Path):
    """A table whose R is itself "auto" (not chosen when the clamp histogram is bought): the
    histogram keeps one value per unit (sensitivity 1, not the cap), the clamp is chosen from
    it, and the SUM keeps its ``clamped`` measure (a histogram of units says nothing of the
    rows' cut mass; the note gives no estimate)."""
    rows = [(u, u % 4, 900 if u == 3 else u % 20) for u in range(1, 101) for _ in range(3)]
    path = write_csv(tmp_path / "r.csv", ["uid", "g", "x"], rows)
    policy = table_policy(path, COLUMNS, unit="uid", privacy={"epsilon": EPS, "dataset": "d"})
    policy["tables"]["t"].pop("max_rows_per_unit")  # "auto" (and G)
    policy["tables"]["t"].pop("max_groups_per_unit")
    ledger = MemoryLedger()
    service = dpsql.Service(policy, ledger=ledger, noise=ZeroNoise())
    cur = service.connect("alice").cursor()
    plan = service.plan(dpsql.pipeline.parse_statement("SELECT SUM(x) FROM t", service.policy),
                        cur.connection._settings, "alice")  # fmt: skip
    (clip,) = [m for n, m in zip(*_pending_parts(plan), strict=True) if n.kind == "clip"]
    assert clip.max_values == 1 and clip.mechanism.l1 == 1
    _ask(cur, "SELECT SUM(x) FROM t")
    (kept,) = [v for k, v in ledger._cache.items() if ":clip:" in k[2]]
    assert sum(json.loads(kept)["noisy"]) == 100  # one value per unit (300 rows)
    later = "SELECT SUM(x) FROM t WHERE uid >= 0"
    assert "clamped(x)" in [m for m, _ in _measures(cur, later)]
    _ask(cur, later)
    (note,) = [m for _, m in cur.messages if "kept DP histogram" in m]
    assert "(one per unit)" in note and "biased" not in note
    service.close()


def _pending_parts(plan) -> tuple:
    pending = plan.extra["bounds"].pending
    return pending.needs, pending.mechanisms


# --- neighbouring datasets ----------------------------------------------------------------------

RUNS = 6000


def _counts(tmp_path: Path, extra: tuple[int, ...], name: str) -> tuple[np.ndarray, ApproxBounds]:
    """The engine's clamp histogram of x on a dataset, and the release mechanism (ε = 1)."""
    service = dpsql.Service(_policy(_data(tmp_path, extra, name)), ledger=MemoryLedger())
    try:
        table = service.policy.tables["t"]
        hist = clamp_histogram(table.columns["x"])
        result = service.engine.execute(clamp_histogram_query(table, "x", hist, 5))
        counts = np.zeros(hist.bins, dtype=np.int64)
        for row, c in zip(result.key_rows, result.measures[0], strict=True):
            counts[int(row[0])] += int(c)
        return counts, ApproxBounds(hist, EPS, method="quantile", q=0.9)
    finally:
        service.close()


def _released(mech: ApproxBounds, eps: float, counts: np.ndarray, seed: int) -> np.ndarray:
    lap = ApproxBounds(mech.histogram, eps, method="quantile").mechanism
    noise = lap.sample(SeededNoise(seed), RUNS * counts.size).reshape(RUNS, counts.size)
    return counts[None, :] + noise


def _bounds(mech: ApproxBounds, released: np.ndarray) -> np.ndarray:
    """The bound a single total chooses from each released histogram ("posterior", the
    default, vectorised over runs; checked against ApproxBounds.choose on the first runs):
    argmin over C of (Σ m_b e_b(C))² + Σ v_b e_b(C)² + 2 (C/ε)²."""
    hist = mech.histogram
    mean, var = posterior_counts(released, mech.mechanism.scale)
    cands, excess = posterior_candidates(hist)
    errors = (mean @ excess.T) ** 2 + var @ (excess**2).T + 2 * (cands[None, :] / EPS) ** 2
    bounds = cands[np.argmin(errors, axis=1)]
    chooser = ApproxBounds(hist, EPS, method="posterior", sum_epsilon=EPS)
    for r, b in zip(released[:20], bounds[:20], strict=True):
        assert chooser.choose(r, 0, 1000).bound == pytest.approx(b)
    return bounds


def _events(mech: ApproxBounds, out_d: np.ndarray, out_d2: np.ndarray) -> list:
    top = mech.histogram.bins - 1
    events = threshold_events("top bin", out_d[:, top], out_d2[:, top], [-1, 0, 1, 2, 3])
    c_d, c_d2 = _bounds(mech, out_d), _bounds(mech, out_d2)
    for c in (100, 500, 1000):
        events.append(indicator_event(f"C >= {c}", c_d >= c, c_d2 >= c))
    return events


def test_audit_of_the_purchase_on_neighbouring_datasets(tmp_path: Path):
    """D and D′ = D plus one unit of x = 1000 (the top bin, where one unit moves the chosen
    bound the most): the released histogram and the bound chosen from it stay within e^ε;
    the same audit catches the histogram released with half its noise."""
    d, mech = _counts(tmp_path, (), "d.csv")
    d2, _ = _counts(tmp_path, (1000,), "d2.csv")
    assert (d2 - d).tolist() == [0] * (d.size - 1) + [1]  # one unit, one count
    report = audit(
        _events(mech, _released(mech, EPS, d, 1), _released(mech, EPS, d2, 2)),
        RUNS,
        RUNS,
        epsilon=EPS,
    )
    assert not report.violated, report
    broken = _events(mech, _released(mech, 3 * EPS, d, 3), _released(mech, 3 * EPS, d2, 4))
    assert audit(broken, RUNS, RUNS, epsilon=EPS).violated
