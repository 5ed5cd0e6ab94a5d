"""The privacy boundary: typed before it runs, pay before reading, uniform failures after.

Each class of break found in issue 10 has a test here that checks the refusal (message,
SQLSTATE, nothing read, nothing spent) or the charged uniform failure. The differential fuzz
test (tests/test_differential_fuzz.py) checks the same invariants on generated queries.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import EngineSpy, fixture_policy, table_policy, write_csv

import dpsql
from dpsql.boundary import (
    FAILED_AFTER_READ,
    POST_PROCESSING_FAILED,
    ChargedFailure,
    ChargedPostProcessingFailure,
)
from dpsql.dbapi import connect_service
from dpsql.frontend.typecheck import canonical_key_value, key_sort_value
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

WHERE_CASTS = [
    ("diagnosis IS TRUE", "the operand of IS TRUE / IS FALSE", "VARCHAR"),
    ("diagnosis IS NOT FALSE", "the operand of IS TRUE / IS FALSE", "VARCHAR"),
    ("diagnosis", "a WHERE condition", "VARCHAR"),
    ("LOWER(diagnosis)", "a WHERE condition", "VARCHAR"),
    ("COALESCE(diagnosis, 'x')", "a WHERE condition", "VARCHAR"),
    ("visit_date", "a WHERE condition", "DATE"),
    ("NOT diagnosis", "the operand of NOT", "VARCHAR"),
    ("(age OR smoker)", "an operand of OR", "BIGINT"),
    ("CASE WHEN diagnosis THEN true ELSE false END", "a CASE WHEN / IF condition", "VARCHAR"),
    ("TRY_CAST(diagnosis AS VARCHAR)", "a WHERE condition", "VARCHAR"),
]


@pytest.fixture()
def fresh():
    """A fixture service with a memory ledger and exact answers, and a spy on its engine."""
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    spy = EngineSpy(service)
    conn = connect_service(service, "mallory")
    yield service, spy, conn
    conn.close()
    service.close()


def _spent(service: dpsql.Service) -> float:
    return float(service.ledger.spent("mallory", service.policy.dataset).epsilon)


def _refused(fresh, sql: str) -> dpsql.Error:
    service, spy, conn = fresh
    with pytest.raises(dpsql.Error) as info:
        conn.cursor().execute(sql)
    assert spy.calls == 0, "a refusal must not read data"
    assert _spent(service) == 0, "a refusal must not spend budget"
    return info.value


@pytest.mark.parametrize(("condition", "role", "duck_type"), WHERE_CASTS)
def test_non_boolean_conditions_are_refused_before_reading(fresh, condition, role, duck_type):
    sql = f"SELECT COUNT(*) FROM visits WHERE patient_id = 999 AND {condition}"
    error = _refused(fresh, sql)
    assert error.sqlstate == "42804"
    assert f"{role} must be BOOLEAN" in error.message
    assert duck_type in error.message
    assert error.position is not None and error.hint


@pytest.mark.parametrize(
    "condition",
    [
        "smoker",
        "smoker IS TRUE",
        "NOT smoker",
        "(age > 30) IS NOT FALSE",
        "CASE WHEN age > 30 THEN smoker ELSE NOT smoker END",
        "diagnosis IS NULL",
        "NULL",
        "TRY_CAST(diagnosis AS BOOLEAN)",
    ],
)
def test_boolean_conditions_still_run(fresh, condition):
    _service, spy, conn = fresh
    rows = conn.cursor().execute(f"SELECT COUNT(*) FROM visits WHERE {condition}").fetchall()
    assert len(rows) == 1 and spy.calls == 1


@pytest.mark.parametrize(
    ("key", "duck_type"),
    [
        ("CAST('[' || diagnosis || ']' AS VARCHAR[])", "VARCHAR[]"),
        ("CAST(diagnosis AS TIME)", "TIME"),
        ("CAST(diagnosis AS BLOB)", "BLOB"),
        ("CAST(diagnosis AS UUID)", "UUID"),
        ("CAST(diagnosis AS TIMESTAMPTZ)", "TIMESTAMP WITH TIME ZONE"),
    ],
)
def test_group_keys_of_unreleasable_types_are_refused(fresh, key, duck_type):
    sql = f"SELECT {key} AS k, COUNT(*) FROM visits GROUP BY 1"
    error = _refused(fresh, sql)
    assert error.sqlstate == "42804"
    assert f"has type {duck_type}, which cannot be released" in error.message
    assert error.position is not None


def test_dates_past_year_9999_become_the_null_key(tmp_path: Path):
    path = write_csv(
        tmp_path / "t.csv",
        ["uid", "d"],
        [(1, "9999-12-30"), (2, "2020-01-01"), (3, "2020-01-01")],
    )
    cols = {"uid": {"type": "int"}, "d": {"type": "date"}}
    policy = table_policy(path, cols, unit="uid", privacy={"delta": 1e-6, "epsilon": 1e6})
    with dpsql.connect(
        policy=policy, ledger=MemoryLedger(), noise=ZeroNoise(), cache=False
    ) as conn:
        cur = conn.cursor()
        cur.execute("SELECT d + 5 AS k, COUNT(*) FROM t GROUP BY 1 ORDER BY 1")
        keys = [r[0] for r in cur.fetchall()]
    assert all(k is None or k.year <= 9999 for k in keys)


def test_nan_keys_have_one_place_in_the_release_order():
    nan_a, nan_b = float("nan"), float("nan")
    assert canonical_key_value(nan_a) is canonical_key_value(nan_b)
    values = [3.0, nan_a, None, -1.0, float("inf"), nan_b]
    ordered = sorted({canonical_key_value(v) for v in values}, key=key_sort_value)
    assert ordered[:3] == [-1.0, 3.0, float("inf")]
    assert ordered[3] != ordered[3] and ordered[4] is None


def test_nan_and_infinite_keys_are_released_once_each(fresh):
    _, _, conn = fresh
    cur = conn.cursor()
    cur.execute("SELECT CAST(age AS DOUBLE) / 0 AS k, COUNT(*) FROM visits GROUP BY 1")
    keys = [r[0] for r in cur.fetchall()]
    assert keys[0] == float("inf") and keys[1] != keys[1] and len(keys) == 2


def test_decimal_case_keys_match_their_own_public_domain(fresh):
    """CASE with decimal constants: the bins are the engine's values, not pure noise."""
    service, _, conn = fresh
    cur = conn.cursor()
    sql = "SELECT CASE WHEN age < 30 THEN 0.1 ELSE 1.5 END AS k, COUNT(*) FROM visits GROUP BY 1"
    got = dict(cur.execute(sql).fetchall())
    exact = service.engine._con.execute(  # the true (unbounded) counts, for scale only
        "SELECT CASE WHEN age < 30 THEN 0.1 ELSE 1.5 END, COUNT(*) FROM visits GROUP BY 1"
    ).fetchall()
    assert set(got) == {0.1, 1.5}
    for value, count in exact:
        assert 0 < got[float(value)] <= count


def test_wide_integer_keys_out_of_bigint_range_become_null(fresh):
    _, _, conn = fresh
    cur = conn.cursor()
    cur.execute(
        "SELECT CAST(age AS HUGEINT) * 100000000000000000000 AS k, COUNT(*) FROM visits GROUP BY 1"
    )
    keys = [r[0] for r in cur.fetchall()]
    assert keys == [0, None]
    assert cur.description[0][1] == "BIGINT"


def test_query_text_that_is_not_unicode_is_refused_at_parse(fresh):
    error = _refused(fresh, "SELECT COUNT(*) FROM visits -- \udc80")
    assert error.sqlstate == "22021" and "not valid Unicode" in error.message
    assert error.position is not None and error.position.column == 32
    service, spy, conn = fresh
    with pytest.raises(dpsql.Error) as info:
        conn.cursor().execute("SELECT COUNT(*) FROM visits WHERE diagnosis = ?", ["\udc80"])
    assert info.value.sqlstate == "22021" and spy.calls == 0 and _spent(service) == 0


def _break(monkeypatch, target, name, exc: Exception):
    def broken(*args, **kwargs):
        raise exc

    monkeypatch.setattr(target, name, broken)


# A failed cache write (remember) is not among them: the answer was paid for and is returned
# with a note (tests/test_ledger_integrity.py, issue 29 item 6).
@pytest.mark.parametrize(
    "where",
    ["engine", "release", "encode", "postprocess"],
)
def test_every_failure_after_the_reserve_is_uniform_and_charged(fresh, monkeypatch, where):
    service, _, conn = fresh
    secret = "private-value-4711"
    import dpsql.pipeline as pipeline

    if where == "engine":
        _break(monkeypatch, service.engine, "execute", TypeError(secret))
    elif where == "release":
        _break(monkeypatch, pipeline, "release", ValueError(secret))
    elif where == "encode":  # the remembered text, or the answer built without it
        for step in ("encode_answer", "answer_data"):
            _break(monkeypatch, pipeline, step, UnicodeEncodeError("utf-8", secret, 0, 1, "x"))
    sql = "SELECT department, COUNT(*) * 2 AS c FROM visits GROUP BY department"
    if where == "postprocess":  # after a first run, whose dry run of the post-processing passed
        conn.cursor().execute(sql)
        _break(monkeypatch, service.scratch, "post_process", dpsql.DataError(secret))
    with pytest.raises(dpsql.Error) as info:
        conn.cursor().execute(sql)
    error = info.value
    if where == "postprocess":
        assert isinstance(error, ChargedPostProcessingFailure)
        assert error.sqlstate == "22000" and error.message == POST_PROCESSING_FAILED
    else:
        assert isinstance(error, ChargedFailure)
        assert error.sqlstate == "58000" and error.message == FAILED_AFTER_READ
    assert secret not in str(error) and error.__cause__ is None
    assert _spent(service) == pytest.approx(2.0 if where == "postprocess" else 1.0)


def test_the_cost_is_reserved_before_the_engine_reads(fresh, monkeypatch):
    service, _, conn = fresh
    seen = []
    original = service.engine.execute

    def spying(compiled, handle=None):
        seen.append(_spent(service))
        return original(compiled, handle)

    monkeypatch.setattr(service.engine, "execute", spying)
    conn.cursor().execute("SELECT COUNT(*) FROM visits")
    assert seen == [pytest.approx(1.0)]


def test_a_kill_after_the_reserve_loses_the_answer_never_the_accounting(tmp_path: Path):
    ledger_path = tmp_path / "ledger.sqlite"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        import dpsql
        from dpsql.dbapi import connect_service
        from dpsql.privacy.sqlite_ledger import SQLiteLedger
        from tests.conftest import fixture_policy
        service = dpsql.Service(fixture_policy(), ledger=SQLiteLedger({str(ledger_path)!r}))
        def killed(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        service.engine.execute = killed
        connect_service(service, "mallory").cursor().execute("SELECT COUNT(*) FROM visits")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    from dpsql.privacy.sqlite_ledger import SQLiteLedger

    ledger = SQLiteLedger(ledger_path)
    try:
        assert float(ledger.spent("mallory", "visits").epsilon) == pytest.approx(1.0)
    finally:
        ledger.close()


def test_rule_list_arguments_are_typed_before_reading(fresh):
    sql = (
        "SELECT * FROM dp_rule_list('visits', label => 'diagnosis', positive => 120, "
        "epsilon => 1.0, mechanism => 'monotone_em')"
    )
    error = _refused(fresh, sql)
    assert error.sqlstate == "42804"
    assert "positive => does not match the type of label column 'diagnosis'" in error.message
    for bad in ("epsilon => 'x'", "max_length => 2.5", "strict_sensitivity => 1"):
        sql = (
            "SELECT * FROM dp_rule_list('visits', label => 'smoker', "
            f"mechanism => 'monotone_em', {bad})"
        )
        error = _refused(fresh, sql)
        assert error.sqlstate == "42804" and "has the wrong type" in error.message
    error = _refused(
        fresh, "SELECT * FROM dp_rule_list('visits', label => 'smoker', epsilon => -'x')"
    )
    assert "name => literal" in error.message


def test_rule_list_failure_after_the_reserve_is_uniform_and_charged(fresh, monkeypatch):
    service, _, conn = fresh
    _break(monkeypatch, service.engine, "fetch_matrix", RuntimeError("private-777"))
    with pytest.raises(ChargedFailure) as info:
        conn.cursor().execute(
            "SELECT * FROM dp_rule_list('visits', label => 'smoker', "
            "mechanism => 'monotone_em', epsilon => 0.5)"
        )
    assert "private-777" not in str(info.value)
    assert _spent(service) == pytest.approx(0.5)


def test_noise_scale_refusal_names_no_long_number():
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger(), cache=False)
    conn = connect_service(service, "mallory")
    cur = conn.cursor()
    cur.execute("SET epsilon = 1e-300")
    with pytest.raises(dpsql.Error) as info:
        cur.execute("SELECT SUM(cost) FROM visits")
    assert not re.search(r"\d{12,}", str(info.value)), str(info.value)
    assert info.value.sqlstate == "22023" and _spent(service) == 0
    service.close()


def test_planning_caches_are_per_analyst(fresh):
    """A domain computed for one analyst is not found warm by another (timing channel)."""
    service, _, conn = fresh
    conn.cursor().execute("SELECT age, COUNT(*) FROM visits GROUP BY age")
    assert {k[0] for k in service._domain_cache} == {"mallory"}
    other = connect_service(service, "bob")
    other.cursor().execute("SELECT age, COUNT(*) FROM visits GROUP BY age")
    assert {k[0] for k in service._domain_cache} == {"mallory", "bob"}
    assert os.environ.get("DPSQL_NO_SUCH_FLAG") is None


@pytest.mark.parametrize(
    ("having", "duck_type"), [("COUNT(*)", "BIGINT"), ("department", "VARCHAR")]
)
def test_non_boolean_having_is_refused_before_reading(fresh, having, duck_type):
    sql = f"SELECT department, COUNT(*) FROM visits GROUP BY department HAVING {having}"
    error = _refused(fresh, sql)
    assert error.sqlstate == "42804"
    assert f"a HAVING condition must be BOOLEAN, but it is {duck_type}" in error.message


def test_a_lazily_read_value_that_does_not_fit_its_type_fails_no_query(tmp_path: Path):
    """A Parquet source is read at query time: a dirty value in one unit's row must not make
    the query fail on D' only (it becomes NULL, as on every dataset)."""
    import duckdb

    results = []
    for name, extra in (("d", ""), ("d_prime", ", (999, 'not-a-number')")):
        target = tmp_path / f"{name}.parquet"
        duckdb.execute(
            "COPY (SELECT * FROM (VALUES (1, '30'), (2, '40')" + extra + ") t(uid, age)) "
            f"TO '{target}' (FORMAT parquet)"
        )
        cols = {"uid": {"type": "int"}, "age": {"type": "int", "lower": 0, "upper": 100}}
        policy = table_policy(target, cols, unit="uid")
        with dpsql.connect(policy=policy, ledger=MemoryLedger(), cache=False) as conn:
            cur = conn.cursor()
            cur.execute("SELECT AVG(age), COUNT(age), COUNT(*) FROM t")
            results.append((cur.description, len(cur.fetchall())))
    assert results[0] == results[1]


def test_rule_list_post_processing_functions_are_checked_before_the_charge(fresh):
    error = _refused(
        fresh,
        "SELECT length(repeat(rule, 15000000)) FROM dp_rule_list('visits', label => 'smoker', "
        "mechanism => 'monotone_em')",
    )
    assert error.sqlstate == "42883" and "repeat" in error.message


def test_the_token_cache_is_not_shared_across_statements():
    """Another analyst's recent text must not parse faster (a timing channel)."""
    from dpsql.frontend import positions
    from dpsql.frontend.bind import parse_statement

    policy = dpsql.Service(fixture_policy(), ledger=MemoryLedger()).policy
    parse_statement("SELECT COUNT(*) FROM visits WHERE age > 1", policy)
    positions.Source("SELECT COUNT(*) FROM visits WHERE age > 1", "duckdb").tokens()
    parse_statement("SELECT COUNT(*) FROM visits WHERE age > 2", policy)
    assert "SELECT COUNT(*) FROM visits WHERE age > 1" not in {
        args[0] for args in _cached_texts(positions)
    }


def _cached_texts(positions) -> list[tuple]:
    """Texts in the token cache (by probing its hit counter; lru_cache hides its keys)."""
    info = positions._tokens_cached.cache_info()
    before = info.hits
    positions._tokens_cached("SELECT COUNT(*) FROM visits WHERE age > 1")
    hit = positions._tokens_cached.cache_info().hits > before
    return [("SELECT COUNT(*) FROM visits WHERE age > 1",)] if hit else []


def test_a_huge_max_card_is_refused_without_enumerating(fresh):
    error = _refused(
        fresh,
        "SELECT * FROM dp_rule_list('visits', label => 'smoker', "
        "mechanism => 'monotone_em', max_card => 1e308)",
    )
    assert error.sqlstate == "54000"


def test_explain_at_a_huge_noise_scale_computes_its_intervals():
    """The interval / threshold searches bracket and bisect: a tiny epsilon (scale ~1e305)
    used to step by one forever in a free EXPLAIN, pinning a thread."""
    service = dpsql.Service(fixture_policy(), ledger=MemoryLedger(), cache=False)
    cur = connect_service(service, "mallory").cursor()
    cur.execute("SET epsilon = 1e-300")
    cur.execute("EXPLAIN SELECT diagnosis, SUM(cost) FROM visits GROUP BY diagnosis")
    rows = cur.fetchall()
    assert any("tau" in str(r[1]) for r in rows)
    assert all(r[-1] is None or r[-1] > 1e290 for r in rows[:2])
    service.close()


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT COUNT(*) FROM visits WHERE DP_SECRET() > 0",
        "SELECT dp_secret() AS s, COUNT(*) FROM visits GROUP BY 1",
        "SELECT DP_KEYED_HASH(age, 1) AS h, COUNT(*) FROM visits GROUP BY 1",
    ],
)
def test_the_compilers_own_calls_are_refused_in_analyst_sql(fresh, sql):
    """The compiled tree spells the per-query secret DP_SECRET() and the keyed hash
    DP_KEYED_HASH(...) as plain calls (dpsql.lower.compile): an analyst's own are refused like
    any unlisted function, so the secret can never be printed into their expression."""
    error = _refused(fresh, sql)
    assert error.sqlstate == "42501"
    assert "is not allowed" in error.message and error.position is not None


def test_a_literal_spelling_the_secret_slot_is_only_a_literal(fresh):
    _, _, conn = fresh
    cur = conn.cursor()
    cur.execute("SELECT COUNT(*) FROM visits WHERE diagnosis = 'DP_SECRET()'")
    assert cur.fetchall() == [(0,)]


def test_a_literal_spelling_the_keyed_hash_reaches_the_engine_unchanged(tmp_path):
    """The engine runs the rendered text as it is: a WHERE literal that spells the keyed hash's
    placeholder is compared as written (the engine used to rewrite it in the text)."""
    from conftest import exact_connect, rows_of

    path = write_csv(
        tmp_path / "t.csv",
        ["uid", "label"],
        [(i, "DP_KEYED_HASH(1)" if i % 3 else "x") for i in range(30)],
    )
    columns = {"uid": {"type": "int"}, "label": {"type": "text"}}
    for unit in (None, "uid"):
        conn = exact_connect(table_policy(path, columns, unit=unit, rows=1, groups=1))
        try:
            got = rows_of(conn, "SELECT COUNT(*) FROM t WHERE label = 'DP_KEYED_HASH(1)'")
            assert got == [(20,)]
        finally:
            conn.close()
