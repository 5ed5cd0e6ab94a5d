"""Composition under fully adaptive querying: the ledger's filter against adaptive analysts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from dpsql.errors import BudgetExhaustedError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.sqlite_ledger import SQLiteLedger


def _adaptive_transcripts(budget: Budget, runs: int, seed: int) -> np.ndarray:
    """Privacy losses of stopped transcripts of an analyst who adapts to the answers.

    Each query is randomized response at its ε (the worst ε-DP pair: loss ±ε). The analyst
    watches the loss so far (an adversary knowing D and D′ can): while it looks like D it
    keeps asking many small queries (the zCDP route); when it does not, it asks for larger
    ones, trying to push a favourable run over the line. The ledger's rule decides every
    charge, as ``Budget.covers`` does in charge()."""
    rng = np.random.default_rng(seed)
    out = np.empty(runs)
    for r in range(runs):
        total, loss = Cost(), 0.0
        for _ in range(5000):
            eps = 0.05 if loss > 0 else 0.3
            nxt = total + Cost(eps)
            if not budget.covers(nxt):
                eps = 0.05
                nxt = total + Cost(eps)
                if not budget.covers(nxt):
                    break
            total = nxt
            p = math.exp(eps) / (1 + math.exp(eps))
            loss += eps if rng.random() < p else -eps
        out[r] = loss
    return out


def test_adaptive_analyst_stays_within_the_budget() -> None:
    """δ(E) = E[(1 − e^(E − L))₊] of the stopped transcript, estimated on 500 runs, stays
    below the budget's δ (plus 4 standard errors)."""
    budget = Budget(2.0, 1e-2)
    loss = _adaptive_transcripts(budget, 500, seed=1)
    hockey = np.maximum(0.0, 1 - np.exp(budget.epsilon - loss))
    bound = hockey.mean() + 4 * hockey.std() / math.sqrt(hockey.size)
    assert bound <= budget.delta
    assert loss.max() > budget.epsilon * 0.5  # the runs did spend a real budget


def test_without_the_filter_an_adaptive_analyst_overspends() -> None:
    """The broken variant: adding pure-ε charges to the zCDP sum as ε (not ε²/2) would be
    safe; charging nothing for them is not — the same analyst then runs on and the loss
    exceeds E with probability far above δ."""

    class Free(Budget):
        def covers(self, total: Cost) -> bool:  # forgets the pure charges' zCDP
            return Budget.covers(self, Cost(delta=total.exact_delta, zrho=0)) and (
                total.epsilon <= 40
            )

    loss = _adaptive_transcripts(Free(2.0, 1e-2), 100, seed=2)
    hockey = np.maximum(0.0, 1 - np.exp(2.0 - loss))
    assert hockey.mean() > 1e-2


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_ledgers_accept_exactly_what_the_filter_covers(kind: str, tmp_path: Path) -> None:
    """A random mix of pure, Gaussian and thresholding charges: each ledger accepts a charge
    iff Budget.covers(spent + cost), and its totals are the exact sums (ε, δ, ρ, zrho)."""
    budget = Budget(3.0, 1e-5)
    ledger = MemoryLedger() if kind == "memory" else SQLiteLedger(tmp_path / "l.sqlite")
    rng = np.random.default_rng(7)
    expected = Cost()
    for _ in range(300):
        pick = rng.integers(3)
        cost = (
            Cost(float(rng.choice([0.01, 0.05, 0.5])))
            if pick == 0
            else Cost(rho=float(rng.choice([1e-4, 1e-3])))
            if pick == 1
            else Cost(0.1, 1e-6)
        )
        fits = budget.covers(expected + cost)
        try:
            ledger.charge("a", "d", cost, budget, query_text="q", plan_hash="p")
            accepted = True
        except BudgetExhaustedError:
            accepted = False
        assert accepted == fits
        if accepted:
            expected = expected + cost
    spent = ledger.spent("a", "d")
    assert spent == expected and spent.exact_zrho == expected.exact_zrho
    eps, delta = budget.guarantee(spent)
    assert eps <= budget.epsilon * (1 + 1e-9) and delta <= budget.delta
    if kind == "sqlite":
        assert ledger.verify() == []
        ledger.close()
