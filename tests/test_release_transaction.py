"""One release transaction (issue 26): every statement that reads private data pays through
``dpsql.service.transaction.paid_once``, so "replay, or check -> reserve -> execute under the
charged boundary -> remember" is written once. A structural test keeps it so; the behavioural
tests pin the order on a fake service (what runs before the charge, what after)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dpsql.boundary import STATEMENT_CHARGED, ChargedFailure
from dpsql.errors import OperationalError, ProgrammingError
from dpsql.service.transaction import paid_once

ROOT = Path(__file__).resolve().parent.parent / "dpsql"


def _calls(name: str) -> list[str]:
    """Modules (and lines) that call ``name`` as a function or method, or enter it as a
    context manager."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called == name:
                    found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return found


def test_only_the_transaction_charges_and_enters_the_charged_boundary() -> None:
    where = "dpsql/service/transaction.py"
    for name in ("_reserve", "charged_boundary"):
        calls = _calls(name)
        assert calls and all(c.startswith(where + ":") for c in calls), (
            f"{name} is called outside the release transaction: {calls}; run the statement "
            "through dpsql.service.transaction.paid_once"
        )


@dataclass
class _Ledger:
    stored: dict[str, str] = field(default_factory=dict)
    budget_ok: bool = True
    fail_write: bool = False

    def cached(self, analyst: str, dataset: str, key: str) -> str | None:
        return self.stored.get(key)

    def check(self, analyst: str, dataset: str, cost: Any, budget: Any) -> None:
        if not self.budget_ok:
            raise ProgrammingError("over budget")

    def remember(self, analyst: str, dataset: str, key: str, answer: str) -> None:
        if self.fail_write:
            raise OSError("disk full")
        self.stored[key] = answer


@dataclass
class _Policy:
    dataset: str = "d"
    budget: Any = None


@dataclass
class _Service:
    ledger: _Ledger = field(default_factory=_Ledger)
    policy: _Policy = field(default_factory=_Policy)
    cache: bool = True
    charged: list[Any] = field(default_factory=list)

    def _reserve(self, analyst: str, cost: Any, query_text: str, plan_hash: str) -> None:
        STATEMENT_CHARGED.set(True)
        self.charged.append(cost)


def _run(service: _Service, steps: list[str], execute=None, **kw: Any):
    def default_execute() -> tuple[str, bool]:
        steps.append("execute")
        return "answer", True

    return paid_once(
        service,
        "alice",
        text="q",
        plan_hash="h",
        cost=1,
        handle=None,
        execute=execute or default_execute,
        check=lambda: steps.append("check"),
        before_budget=lambda: steps.append("before_budget"),
        cache_key="k",
        **kw,
    )


def test_order_and_replay() -> None:
    service, steps = _Service(), []
    paid = _run(service, steps)
    assert (paid.answer, paid.charged, paid.replayed) == ("answer", 1, False)
    assert steps == ["before_budget", "check", "execute"] and service.charged == [1]
    again: list[str] = []
    replay = _run(service, again)
    assert replay.replayed and replay.answer == "answer" and again == [] and service.charged == [1]


def test_a_refusal_before_the_charge_is_free() -> None:
    service, steps = _Service(), []
    service.ledger.budget_ok = False
    with pytest.raises(ProgrammingError):
        _run(service, steps)
    assert steps == ["before_budget"] and service.charged == []


def test_a_failure_after_the_charge_is_uniform_and_charged() -> None:
    service, steps = _Service(), []

    def execute() -> tuple[str, bool]:
        raise ValueError("a value of the data")

    with pytest.raises(ChargedFailure) as got:
        _run(service, steps, execute=execute)
    assert service.charged == [1] and "a value of the data" not in str(got.value)


def test_an_answer_that_may_not_be_replayed_is_not_remembered() -> None:
    service = _Service()
    paid = _run(service, [], execute=lambda: ("moved", False))
    assert paid.answer == "moved" and service.ledger.stored == {}


def test_a_failed_cache_write_returns_the_paid_answer_with_a_note() -> None:
    service = _Service()
    service.ledger.fail_write = True
    paid = _run(service, [])
    assert paid.answer == "answer" and paid.charged == 1 and paid.note


def test_cancelled_before_the_charge_is_free() -> None:
    class Handle:
        interrupted = True

    service = _Service()
    with pytest.raises(OperationalError) as got:
        paid_once(
            service, "a", text="q", plan_hash="h", cost=1, handle=Handle(),  # type: ignore[arg-type]
            execute=lambda: ("x", True),
        )  # fmt: skip
    assert got.value.sqlstate == "57014" and service.charged == []
