"""The plan cache: a statement text's checked plan is reused, nothing privacy-relevant is.

Reused across executions of one text (with the same parameters and settings, on the same data
version): the parse, bind, type check and plan. Never reused: the keyed-hash secret of the
engine SQL, the noise, the budget check and the charge. Refusals are never stored.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest

import dpsql
import dpsql.pipeline as pipeline
from dpsql.dbapi import Service, connect_service
from dpsql.errors import BudgetExhaustedError, Error
from dpsql.frontend.bind import parse_statement
from dpsql.lower.compile import compile_plan
from dpsql.pipeline import SecretTemplate, Settings
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml"
EPS = 2.0**-10  # dyadic: charges add up exactly
# GROUP BY a non-public key: its groups are thresholded, so each unit's G groups are chosen by
# keyed hash under either bounding (the plan holds a secret)
GROUPED = "SELECT diagnosis, COUNT(*), AVG(cost) FROM visits GROUP BY diagnosis"
BY_DEPARTMENT = "SELECT department, COUNT(*), AVG(cost) FROM visits GROUP BY department"


def _service(**options: Any) -> Service:
    options.setdefault("ledger", MemoryLedger())
    options.setdefault("cache", False)
    return Service(FIXTURE, **options)


def _cursor(service: Service, analyst: str = "a"):
    cur = connect_service(service, analyst).cursor()
    cur.execute(f"SET epsilon = {EPS}")
    return cur


def _entry(service: Service, cur: Any) -> Any:
    """The plan-cache entry of GROUPED for this cursor's analyst and settings."""
    conn = cur.connection
    return service._plans.get(service._plans.key(GROUPED, None, conn._settings, conn.analyst))


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = pipeline.parse_statement

    def counting(text: str, *args: Any) -> Any:
        if text.startswith("SELECT"):  # not SET / RESET
            calls.append(text)
        return real(text, *args)

    monkeypatch.setattr(pipeline, "parse_statement", counting)
    return calls


def _record_engine(service: Service) -> list[Any]:
    """Every CompiledQuery the engine is asked to run."""
    seen: list[Any] = []
    inner = service.engine.execute

    def execute(compiled: Any, handle: Any = None) -> Any:
        seen.append(compiled)
        return inner(compiled, handle)

    service.engine.execute = execute  # type: ignore[method-assign]
    return seen


def _spent(service: Service, analyst: str = "a") -> float:
    return service.ledger.spent(analyst, service.policy.dataset).epsilon


def test_same_text_reuses_the_plan_and_still_charges_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = _service()
    cur = _cursor(service)
    parses = _count_parses(monkeypatch)
    cur.execute(GROUPED)
    first = service._plans.get(
        service._plans.key(GROUPED, None, cur.connection._settings, cur.connection.analyst)
    )
    cur.execute(GROUPED)
    second = service._plans.get(
        service._plans.key(GROUPED, None, cur.connection._settings, cur.connection.analyst)
    )
    assert parses == [GROUPED]  # parsed and bound once
    assert first is second and first is not None
    fresh = service.plan(parse_statement(GROUPED, service.policy), cur.connection._settings)
    assert first.fingerprint == fresh.fingerprint() == first.plan.fingerprint()
    assert _spent(service) == 2 * EPS  # both executions charged
    assert cur.cost is not None and not cur.cached


def test_noise_is_fresh_on_every_execution() -> None:
    service = _service()
    cur = _cursor(service)
    values = [cur.execute("SELECT COUNT(*) FROM visits").fetchone()[0] for _ in range(6)]
    # scale 15/2^-10 ≈ 15,000: six equal draws have probability far below 1e-20
    assert len(set(values)) > 1
    assert _spent(service) == 6 * EPS


def test_every_execution_gets_a_fresh_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine SQL of each run is exactly compile_plan(plan, that run's own secret)."""
    service = _service(noise=ZeroNoise())
    cur = _cursor(service)
    seen = _record_engine(service)
    drawn: list[int] = []
    rng = random.Random(7)

    class Secrets:
        @staticmethod
        def randbits(k: int) -> int:
            drawn.append(rng.getrandbits(k))
            return drawn[-1]

    monkeypatch.setattr(pipeline, "secrets", Secrets)
    for _ in range(4):
        cur.execute(GROUPED)
    plan = service.plan(parse_statement(GROUPED, service.policy), cur.connection._settings)
    # each run draws its own secret, and nothing else draws one (the tree has a secret node)
    used = drawn
    assert len(used) == 4
    assert [c.sql for c in seen] == [compile_plan(plan, s).sql for s in used]
    assert len({c.sql for c in seen}) == 4
    assert all(str(s) in c.sql for s, c in zip(used, seen, strict=True))


def test_template_equals_compiling_with_the_secret() -> None:
    service = _service()
    settings = Settings.from_policy(service.policy)
    for text in (
        GROUPED,
        "SELECT COUNT(*) FROM visits WHERE age > 3",
        "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis",
        "SELECT smoker, FLOOR(age / 10) * 10, SUM(age) FROM visits GROUP BY 1, 2",
        "SELECT AVG(cost), VAR_SAMP(age) FROM visits WHERE department = 'oncology'",
    ):
        plan = service.plan(parse_statement(text, service.policy), settings)
        template = SecretTemplate.build(plan)
        assert template is not None
        for secret in (0, 1, 2**62 - 1, random.Random(text).getrandbits(62)):
            assert template.with_secret(secret) == compile_plan(plan, secret)


def test_a_literal_equal_to_the_secret_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A literal with the very digits of a run's secret: only the secret node changes."""
    marker = (1 << 61) + 12345
    text = f"SELECT diagnosis, AVG(cost) FROM visits WHERE patient_id <> {marker} GROUP BY 1"
    service = _service()
    cur = _cursor(service)
    seen = _record_engine(service)
    values = iter([marker, (1 << 61) + 999, 7])
    monkeypatch.setattr(pipeline.secrets, "randbits", lambda k: next(values))
    for _ in range(3):
        cur.execute(text)
    plan = service.plan(parse_statement(text, service.policy), cur.connection._settings)
    assert [c.sql for c in seen] == [
        compile_plan(plan, s).sql for s in (marker, (1 << 61) + 999, 7)
    ]
    assert all(f"<> {marker}" in c.sql for c in seen) and len({c.sql for c in seen}) == 3


def test_changed_settings_and_parameters_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    service = _service()
    cur = _cursor(service)
    parses = _count_parses(monkeypatch)
    text = "SELECT COUNT(*) FROM visits WHERE age > ?"
    for params in ([30], [30], [30.0], [True], [31], [30]):
        cur.execute(text, params)
    assert len(parses) == 4  # 30, 30.0, True, 31 — the repeats of [30] hit
    cur.execute(f"SET epsilon = {2 * EPS}")
    cur.execute(text, [30])
    assert len(parses) == 5
    cur.execute("SET delta = 0.0001")
    cur.execute(text, [30])
    assert len(parses) == 6
    cur.execute("RESET delta")
    cur.execute(text, [30])
    assert len(parses) == 6  # back to a setting seen before: a hit, same plan as then


def test_settings_are_per_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sessions with different epsilon never share a plan (and so never a cost)."""
    service = _service()
    a, b = _cursor(service, "a"), _cursor(service, "b")
    b.execute(f"SET epsilon = {4 * EPS}")
    for _ in range(2):
        a.execute("SELECT COUNT(*) FROM visits")
        b.execute("SELECT COUNT(*) FROM visits")
    assert _spent(service, "a") == 2 * EPS and _spent(service, "b") == 8 * EPS


def test_refusals_are_not_cached_and_spend_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    service = _service()
    cur = _cursor(service)
    parses = _count_parses(monkeypatch)
    for text in ("SELECT * FROM visits", "SELECT diagnosis, COUNT(*) FROM visits GROUP BY 1"):
        cur.execute("SET delta = 0")
        for _ in range(2):
            with pytest.raises(Error):
                cur.execute(text)
    assert len(parses) == 4  # every refused run is parsed again
    assert len(service._plans) == 0
    assert _spent(service) == 0


def test_budget_is_checked_on_every_hit() -> None:
    service = _service()
    cur = connect_service(service, "a").cursor()
    cur.execute("SET epsilon = 6")  # budget 10: the second run would overspend
    cur.execute("SELECT COUNT(*) FROM visits")
    with pytest.raises(BudgetExhaustedError):
        cur.execute("SELECT COUNT(*) FROM visits")
    assert _spent(service) == 6


def test_a_new_data_version_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    service = _service()
    cur = _cursor(service)
    parses = _count_parses(monkeypatch)
    cur.execute(GROUPED)
    service.engine.versions["visits"] = "2099-01"
    cur.execute(GROUPED)
    assert len(parses) == 2
    entry = service._plans.get(
        service._plans.key(GROUPED, None, cur.connection._settings, cur.connection.analyst)
    )
    assert entry is not None and entry.plan.data_version == "2099-01"


def test_the_answer_cache_still_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    service = _service(cache=True)
    cur = _cursor(service)
    first = cur.execute(GROUPED).fetchall()
    again = cur.execute(GROUPED).fetchall()
    assert cur.cached and cur.cost is None and again == first
    assert _spent(service) == EPS


def test_the_cache_is_bounded_and_can_be_off() -> None:
    service = _service(plan_cache=2)
    cur = _cursor(service)
    for i in range(5):
        cur.execute(f"SELECT COUNT(*) FROM visits WHERE age > {i}")
    assert len(service._plans) == 2
    off = _service(plan_cache=0)
    _cursor(off).execute("SELECT COUNT(*) FROM visits")
    assert len(off._plans) == 0


def test_plan_cache_zero_plans_every_call() -> None:
    class Recording(Service):
        def plan(self, query: Any, settings: Settings, analyst: str = "") -> Any:
            self.calls = getattr(self, "calls", 0) + 1
            return super().plan(query, settings, analyst)

    service = Recording(FIXTURE, ledger=MemoryLedger(), cache=False, plan_cache=0)
    cur = _cursor(service)
    for _ in range(3):
        cur.execute("SELECT COUNT(*) FROM visits")
    assert service.calls == 3


def test_concurrent_executions_of_one_text_each_charge() -> None:
    service = _service()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            cur = _cursor(service, "shared")
            for _ in range(10):
                rows = cur.execute(BY_DEPARTMENT).fetchall()
                assert len(rows) == 6
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _spent(service, "shared") == 60 * EPS


def test_dbapi_connect_accepts_plan_cache() -> None:
    with dpsql.connect(policy=FIXTURE, ledger=MemoryLedger(), plan_cache=0) as conn:
        assert len(conn.service._plans) == 0
        conn.execute("SELECT COUNT(*) FROM visits")
        assert len(conn.service._plans) == 0


def test_keys_follow_every_setting_and_parameter_type() -> None:
    cache = pipeline.PlanCache(8)
    base = Settings(1.0, 1e-6, "laplace")
    keys = {
        cache.key("q", None, base, "a"),
        cache.key("q", None, Settings(0.5, 1e-6, "laplace"), "a"),
        cache.key("q", None, Settings(1.0, 0.0, "laplace"), "a"),
        cache.key("q", None, Settings(1.0, -0.0, "laplace"), "a"),
        cache.key("q", None, Settings(1.0, 1e-6, "gaussian"), "a"),
        cache.key("q ", None, base, "a"),
        cache.key("q", [], base, "a"),
        cache.key("q", [0.0], base, "a"),
        cache.key("q", [-0.0], base, "a"),
        cache.key("q", [0], base, "a"),
        cache.key("q", [False], base, "a"),
        cache.key("q", ["0"], base, "a"),
        cache.key("q", [None], base, "a"),
    }
    keys.add(cache.key("q", None, base, "b"))  # another analyst: another entry
    assert len(keys) == 14
    assert cache.key("q", [object()], base, "a") is None  # unknown parameter types: not cached


def test_describe_then_execute_plans_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wire protocol describes a statement, then executes it: one parse and plan."""
    service = _service()
    cur = _cursor(service)
    parses = _count_parses(monkeypatch)
    text = "SELECT department, COUNT(*) AS n FROM visits WHERE age > ? GROUP BY 1"
    described = cur.connection.describe(text, [40])
    assert _spent(service) == 0  # describing spends nothing
    cur.execute(text, [40])
    assert [d[:2] for d in described] == [d[:2] for d in cur.description]
    assert parses == [text] and _spent(service) == EPS
    with pytest.raises(Error):  # a refusal is described as a refusal, and not stored
        cur.connection.describe("SELECT * FROM visits")
    assert len(service._plans) == 1


def test_analysts_do_not_share_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit is faster than a miss: a shared entry would tell one analyst, by timing, that
    another ran the same text. Each analyst plans their own."""
    service = _service()
    parses = _count_parses(monkeypatch)
    first = connect_service(service, "alice").cursor()
    second = connect_service(service, "bob").cursor()
    for cur in (first, second, first, second):
        cur.execute(f"SET epsilon = {EPS}")
        cur.execute(GROUPED)
    assert parses == [GROUPED, GROUPED]
