"""A text shape's answer key from its template (dpsql.service.text_shapes._answer_key): the
plan a text shape serves gets the key its full canonical walk gives, for every shape of the
text-shape tests and WHEREs whose conjuncts sort by their numbers; a template whose check
fails is never used (the key is then computed in full)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import dpsql.service.text_shapes as text_shapes
from dpsql.pipeline import Service, Settings
from dpsql.plan.canonical import answer_key
from dpsql.privacy.ledger import MemoryLedger
from dpsql.service import plan_cache

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml"
EPS = 2.0**-10

SHAPES = [
    "SELECT COUNT(*) FROM visits WHERE age > {a}",
    "SELECT department, COUNT(*) FROM visits WHERE age >= {a} GROUP BY department",
    "SELECT AVG(cost) FROM visits WHERE age < {a}.5",
    "SELECT SUM(age) FROM visits WHERE smoker AND age > {a}",
    "SELECT department, smoker, SUM(cost) AS s FROM visits WHERE age BETWEEN {a} AND {b} "
    "GROUP BY 1, 2 ORDER BY s DESC LIMIT 5",
    "SELECT diagnosis, COUNT(*) FROM visits WHERE department IN ('oncology', 'neurology') "
    "AND cost > {b}.25 GROUP BY diagnosis",
    "SELECT AVG(age), SUM(cost) FROM visits WHERE NOT (age < -{a} OR cost >= {b})",
    # top-level conjuncts the canonical text sorts by their numbers' digits
    "SELECT COUNT(*) FROM visits WHERE age > {a} AND age > {b} AND cost = {b}",
    "SELECT SUM(cost) FROM visits WHERE {a} < age AND {b} = age",
]
VALUES = [(20, 60), (35, 7), (41, 99), (7, 1000), (52, 61), (3, 4), (100, 100)]


def _keys(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str | None, str]]:
    """(the key given to each PreparedPlan, its full answer key), as they are made."""
    seen: list[tuple[str | None, str]] = []
    init = plan_cache.PreparedPlan.__init__

    def spy(self: Any, plan: Any, fingerprint: str | None = None) -> None:
        init(self, plan, fingerprint)
        seen.append((fingerprint, answer_key(plan)))

    monkeypatch.setattr(plan_cache.PreparedPlan, "__init__", spy)
    return seen


def _run_all(shape: str) -> Service:
    service = Service(FIXTURE, ledger=MemoryLedger(), cache=False)
    settings = Settings(EPS, service.policy.delta, service.policy.mechanism)
    for a, b in VALUES:
        service.execute(shape.format(a=a, b=b), None, settings, "a")
    return service


@pytest.mark.parametrize("shape", SHAPES)
def test_a_text_shape_key_from_its_template_is_the_full_key(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _keys(monkeypatch)
    _run_all(shape)
    templated = [(given, full) for given, full in seen if given is not None]
    assert templated, "the text shapes served none of these statements from a template"
    assert all(given == full for given, full in templated)


def test_a_template_that_fails_its_check_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A WHERE text the canonical text does not hold where the template expects it (here: a
    WHERE text that never occurs) leaves the key to the full walk."""
    seen = _keys(monkeypatch)
    monkeypatch.setattr(text_shapes, "where_text", lambda where: "\x00absent\x00")
    _run_all(SHAPES[0])
    assert len(seen) > 3
    assert all(given is None for given, _ in seen)
