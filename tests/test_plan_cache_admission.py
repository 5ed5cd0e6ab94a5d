"""PlanCache.offer: text-shape hits (cheap to rebuild) take a place in a full plan cache only
one time in ADMIT_WHEN_FULL, so texts that come back in a cycle longer than the cache still
hit instead of evicting each other (plain LRU: never a hit)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dpsql.service import plan_cache
from dpsql.service.plan_cache import ADMIT_WHEN_FULL, PlanCache


def _entry(name: str) -> Any:
    return name  # the cache never looks inside an entry


@pytest.fixture(autouse=True)
def _seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_cache, "_ADMIT", random.Random(11))


def test_offers_are_stored_while_there_is_room_and_replace_their_own_key() -> None:
    cache = PlanCache(3)
    for k in ("a", "b", "c"):
        cache.offer((k,), _entry(k))
    assert len(cache) == 3 and cache.get(("a",)) == "a"
    cache.offer(("a",), _entry("a2"))  # its own key: always updated, nothing evicted
    assert len(cache) == 3 and cache.get(("a",)) == "a2"


def test_a_full_cache_admits_few_offers_and_stays_bounded() -> None:
    cache = PlanCache(4)
    for k in range(4):
        cache.put((k,), _entry(str(k)))
    for k in range(4, 4 + 40 * ADMIT_WHEN_FULL):
        cache.offer((k,), _entry(str(k)))
        assert len(cache) == 4
    kept = sum(cache.get((k,)) is not None for k in range(4))
    admitted = sum(cache.get((k,)) is not None for k in range(4, 4 + 40 * ADMIT_WHEN_FULL))
    assert kept + admitted == 4 and admitted >= 1  # some were admitted, one place each


def test_a_cycle_longer_than_the_cache_still_hits() -> None:
    """Six texts in turn through four places: LRU never hits; offers do, most of the time."""
    for store in ("put", "offer"):
        cache = PlanCache(4)
        hits = 0
        for i in range(600):
            key = (i % 6,)
            if cache.get(key) is not None:
                hits += 1
            else:
                getattr(cache, store)(key, _entry(str(i % 6)))
        if store == "put":
            assert hits == 0
        else:
            assert hits > 300


def test_put_still_evicts_the_least_recently_used() -> None:
    cache = PlanCache(2)
    cache.put(("a",), _entry("a"))
    cache.put(("b",), _entry("b"))
    cache.get(("a",))
    cache.put(("c",), _entry("c"))  # a fresh plan: always stored
    assert cache.get(("b",)) is None and cache.get(("a",)) == "a" and cache.get(("c",)) == "c"
