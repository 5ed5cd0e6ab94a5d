"""`[engine] perfect_hash_bits` and `threads`: checked by the policy, set before the lock."""

from __future__ import annotations

import pytest
from conftest import exact_connect, fixture_policy, rows_of

import dpsql.pipeline as pipeline_module
from dpsql.errors import PolicyError
from dpsql.policy import load_policy


def test_default_is_duckdbs_own_threshold() -> None:
    assert load_policy(fixture_policy()).engine.perfect_hash_bits == 12


@pytest.mark.parametrize(
    ("engine", "key"),
    [
        ({"perfect_hash_bits": 25}, "engine.perfect_hash_bits"),
        ({"perfect_hash_bits": -1}, "engine.perfect_hash_bits"),
        ({"perfect_hash_bits": 20.0}, "engine.perfect_hash_bits"),
        ({"perfect_hash_bits": True}, "engine.perfect_hash_bits"),
        ({"name": "spark", "perfect_hash_bits": 20}, "engine.perfect_hash_bits"),
        ({"threads": 0}, "engine.threads"),
        ({"threads": "2"}, "engine.threads"),
        ({"name": "spark", "threads": 2}, "engine.threads"),
    ],
)
def test_bad_values_are_policy_errors(engine: dict, key: str) -> None:
    policy = fixture_policy()
    policy["engine"] = engine
    with pytest.raises(PolicyError) as err:
        load_policy(policy)
    assert err.value.construct == key
    assert err.value.hint


def test_the_engine_runs_with_it_and_results_do_not_change(monkeypatch) -> None:
    # The same keyed-hash secret both times, so the same rows and groups are kept.
    monkeypatch.setattr(pipeline_module.secrets, "randbits", lambda bits: 4242)
    query = "SELECT department, COUNT(*), SUM(cost) FROM visits GROUP BY department"
    expected = rows_of(exact_connect(fixture_policy()), query)
    policy = fixture_policy()
    policy["engine"] = {"perfect_hash_bits": 20, "threads": 1}
    conn = exact_connect(policy)
    setting = conn.service.engine._con.execute(
        "SELECT current_setting('perfect_ht_threshold'), current_setting('threads')"
    ).fetchone()
    assert setting == (20, 1)
    assert rows_of(conn, query) == expected
