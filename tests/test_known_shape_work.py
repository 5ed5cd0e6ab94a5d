"""Work the known-shape DB-API path no longer repeats gives what it gave (issue 26): the
MemoryLedger's charge taking its check's sum, a text shape's WHERE copied with its slots found
by their paths, the plan of a shape made from the keys and outputs it made before, the
drawability check remembered for a plan's very measures, and the noisy measures summed
without object arrays."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import sqlglot
from sqlglot import exp

import dpsql.service.text_shapes as text_shapes
from dpsql.errors import BudgetExhaustedError, DataError
from dpsql.frontend.bind import parse_statement
from dpsql.pipeline import Service, Settings
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise
from dpsql.service import drawable
from dpsql.service.shape_cache import literal_slots, slot_paths, with_literal_slots, with_slots_at

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml"
BUDGET = Budget(epsilon=1.0, delta=1e-6)

WHERES = [
    "age > 40",
    "smoker AND age > 40",
    "age BETWEEN 3 AND -4.5 OR cost = 5",
    "department IN ('a', 'b') AND age IN (1, 2, 3) AND NOT (cost < 7.25 OR age >= 9)",
    "(age > 1 AND (cost < 2 OR (age = 3 AND cost <> 4)))",
    "5 < age AND age <= 60",
]


def _where(text: str) -> exp.Expression:
    return sqlglot.parse_one(f"SELECT 1 FROM t WHERE {text}", read="duckdb").args["where"].this


def _same_tree(a: exp.Expression, b: exp.Expression) -> None:
    assert a == b and a.sql() == b.sql() and repr(a) == repr(b)
    for x, y in zip(a.walk(), b.walk(), strict=True):
        assert type(x) is type(y) and x.arg_key == y.arg_key and x.index == y.index
        assert (x.parent is None) == (y.parent is None)
        assert dict(x._meta or {}) == dict(y._meta or {})


@pytest.mark.parametrize("text", WHERES)
def test_a_where_by_its_slot_paths_is_the_walked_copy(text: str) -> None:
    where = _where(text)
    paths = slot_paths(where)
    assert paths is not None and len(paths) == len(literal_slots(where))
    values = [str(random.randrange(10**6)) for _ in paths]
    walked = with_literal_slots(where, [exp.Literal.number(v) for v in values])
    found = with_slots_at(where, paths, [exp.Literal.number(v) for v in values])
    _same_tree(walked, found)
    assert [str(n.this) for n, _ in literal_slots(found)] == values
    assert where.sql() == _where(text).sql()  # the entry's own WHERE is left as it was


def test_paths_of_another_tree_fall_back_to_the_walk() -> None:
    paths = slot_paths(_where("smoker AND age > 40"))
    assert paths is not None
    other = _where("age > 40")
    out = with_slots_at(other, paths, [exp.Literal.number("7")])
    _same_tree(out, with_literal_slots(other, [exp.Literal.number("7")]))


def test_the_charge_sums_again_after_another_charge() -> None:
    """The check's sum is taken only for the objects it passed with: a charge in between
    (another statement's) makes a new total, and the charge refuses what no longer fits."""
    ledger = MemoryLedger()
    cost = Cost(epsilon=0.6)
    ledger.check("alice", "ds", cost, BUDGET)
    ledger.charge("alice", "ds", Cost(epsilon=0.6), BUDGET, query_text="q", plan_hash="h")
    with pytest.raises(BudgetExhaustedError):
        ledger.charge("alice", "ds", cost, BUDGET, query_text="q", plan_hash="h")
    assert ledger.spent("alice", "ds") == Cost(epsilon=0.6)
    # a checked charge goes through, to the same total as summed afresh
    small = Cost(epsilon=0.25)
    ledger.check("alice", "ds", small, BUDGET)
    ledger.charge("alice", "ds", small, BUDGET, query_text="q", plan_hash="h")
    assert ledger.spent("alice", "ds") == Cost(epsilon=0.6) + Cost(epsilon=0.25)
    with pytest.raises(BudgetExhaustedError):  # the same cost again: refused by its own sum
        ledger.check("alice", "ds", small, BUDGET)


def test_a_refused_budget_check_is_never_remembered() -> None:
    ledger = MemoryLedger()
    big = Cost(epsilon=2.0)
    for _ in range(2):
        with pytest.raises(BudgetExhaustedError):
            ledger.check("alice", "ds", big, BUDGET)
    with pytest.raises(BudgetExhaustedError):
        ledger.charge("alice", "ds", big, BUDGET, query_text="q", plan_hash="h")
    assert ledger.log == []


def test_noisy_measures_are_the_object_array_sums() -> None:
    """float(exact + noise) from Python ints is what the object arrays' astype(float) gave."""
    rng = random.Random(5)
    for _ in range(20_000):
        v = rng.choice([rng.randrange(-(2**70), 2**70), rng.randrange(-(2**54), 2**54)])
        x = rng.randrange(-(2**40), 2**40)
        old = (np.array([v], dtype=object) + np.array([x], dtype=object)).astype(float)
        assert np.array([float(v + x)], dtype=float).tobytes() == old.tobytes()


def test_a_shape_serves_the_answers_it_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """Texts served by a text shape (the WHERE by its paths, the keys and outputs made once
    per shape, the drawability remembered) get the plans, answers and keys of a service that
    plans each of them afresh, under the same noise and secret."""
    monkeypatch.setattr("dpsql.pipeline.secrets.randbits", lambda bits: 424242)
    texts = [
        f"SELECT department, AVG(cost), SUM(age) FROM visits WHERE smoker AND age > {a} "
        f"AND cost < {b}.5 GROUP BY department"
        for a, b in [(20, 900), (31, 1200), (44, 700), (20, 900), (61, 2000), (5, 40), (70, 3)]
    ]
    served = Service(FIXTURE, ledger=MemoryLedger(), cache=False, noise=SeededNoise(3))
    fresh = Service(FIXTURE, ledger=MemoryLedger(), cache=False, noise=SeededNoise(3), plan_cache=0)
    settings = Settings(0.5, served.policy.delta, served.policy.mechanism)
    hits = 0
    lookup = text_shapes.TextShapes.lookup

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal hits
        out = lookup(self, *args, **kwargs)
        hits += out is not None
        return out

    monkeypatch.setattr(text_shapes.TextShapes, "lookup", counted)
    for text in texts * 2:
        a = served.execute(text, None, settings, "a")
        b = fresh.execute(text, None, settings, "a")
        assert (a.rows, a.intervals, a.biases, a.cost) == (b.rows, b.intervals, b.biases, b.cost)
    assert hits >= 3  # the last three texts, from their skeleton
    assert [e[4] for e in served.ledger.log] == [e[4] for e in fresh.ledger.log]


def test_an_undrawable_plan_refuses_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a plan that passed is remembered: one whose mechanism cannot draw refuses again."""
    service = Service(FIXTURE, ledger=MemoryLedger(), cache=False)
    settings = Settings(1.0, service.policy.delta, service.policy.mechanism)
    plan = service.plan(
        parse_statement("SELECT COUNT(*) FROM visits", service.policy), settings, "a"
    )
    drawable.check_drawable(plan, service.noise)  # passes, remembered

    def refuse(mechanism: object, noise: object) -> None:
        raise ValueError("too large")

    monkeypatch.setattr(drawable, "_measure_drawable", refuse)
    drawable.check_drawable(plan, service.noise)  # the very same measures: passed before
    other = service.plan(
        parse_statement("SELECT COUNT(*) FROM visits WHERE age > 3", service.policy), settings, "a"
    )
    for _ in range(2):
        with pytest.raises(DataError):
            drawable.check_drawable(other, service.noise)
