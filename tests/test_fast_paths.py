"""Post-processing fast path: a plain projection of released columns is built in Python.

Every result must be identical to the scratch DuckDB's (values and their Python types, column
names and type codes, row order, NULLs, intervals). Each query of the corpus runs through the
DB-API; every post-processing call (including the pre-charge dry run and describe()) is done
both ways on the same released answer and compared.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from pathlib import Path
from typing import Any

import duckdb
import pytest
import sqlglot

import dpsql.pipeline as pipeline
import dpsql.service.plan_cache as plan_cache
from dpsql.dbapi import Service
from dpsql.engine import scratch
from dpsql.engine.scratch import NotPlain, Projection, cast_value, plain_projection
from dpsql.errors import DataError, Error, ProgrammingError
from dpsql.frontend.bind import parse_statement
from dpsql.pipeline import Result, released_table
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import SeededNoise

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "visits.toml"

PLAIN = [
    "SELECT COUNT(*) FROM visits",
    "SELECT department, COUNT(*) FROM visits GROUP BY department",
    'SELECT department AS "Dept", COUNT(*) AS n, AVG(cost) avg_cost FROM visits GROUP BY 1',
    "SELECT COUNT(*) n, department FROM visits GROUP BY 2",
    "SELECT department, department, COUNT(*), COUNT(*) FROM visits GROUP BY department",
    "SELECT smoker, FLOOR(age / 10) * 10 AS decade, SUM(age), SUM(cost) FROM visits GROUP BY 1, 2",
    "SELECT COUNT(DISTINCT patient_id), VAR_SAMP(cost), STDDEV_POP(age), VAR_POP(age), "
    "STDDEV_SAMP(cost), AVG(age) FROM visits",
    "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis",  # thresholded keys
    "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*), SUM(cost) FROM visits GROUP BY 1",
    "SELECT visit_date, COUNT(*) FROM visits GROUP BY visit_date",  # dates; may be empty
    "SELECT cost IS NULL AS missing, COUNT(cost), COUNT(*) FROM visits GROUP BY 1",
    "SELECT age, COUNT(*) FROM visits GROUP BY age",
    "SELECT YEAR(visit_date) AS y, AVG(cost) FROM visits GROUP BY 1",
    "SELECT cost * 1.5 AS c, COUNT(*) FROM visits GROUP BY 1",  # NULL key only
    "SELECT CASE WHEN age < 18 THEN 'minör' ELSE 'adult' END AS grp, COUNT(*) FROM visits "
    "GROUP BY 1",
    "SELECT COUNT(cost), SUM(cost), AVG(cost) FROM visits WHERE age > 200",  # empty input
    "SELECT diagnosis, COUNT(*) FROM visits WHERE age > 200 GROUP BY 1",  # no row released
    'SELECT department, SUM(age) AS "SUM", SUM(age) AS "sum" FROM visits GROUP BY 1',
    # sorted and cut (in Python unless ORDER BY values tie)
    "SELECT department, COUNT(*) FROM visits GROUP BY department ORDER BY department",
    "SELECT department, COUNT(*) FROM visits GROUP BY department LIMIT 2",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY n DESC LIMIT 3 OFFSET 1",
    "SELECT smoker, FLOOR(age / 10) * 10 AS d, AVG(cost) FROM visits GROUP BY 1, 2 "
    "ORDER BY 2 DESC NULLS FIRST, smoker",
    "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis ORDER BY COUNT(*), 1 LIMIT 4",
    "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1 ORDER BY m DESC",
]
NOT_PLAIN = [
    "SELECT department, COUNT(*) FROM visits GROUP BY department HAVING COUNT(*) > 5",
    "SELECT department, COUNT(*) FROM visits GROUP BY 1 ORDER BY COUNT(*) + 1",
    "SELECT COUNT(*) + 1 AS c FROM visits",
    "SELECT DISTINCT department FROM visits GROUP BY department",
    "SELECT department, ROUND(AVG(cost), 1) FROM visits GROUP BY 1",
]


def _canonical(result: Result) -> tuple:
    """Everything a client sees, with exact types (1, 1.0 and True differ; NaN equals NaN)."""

    def cell(v: Any) -> tuple[str, str]:
        return type(v).__name__, repr(v)

    return (
        result.description,
        [[cell(v) for v in row] for row in result.rows],
        [
            [None if iv is None else (cell(iv[0]), cell(iv[1])) for iv in row]
            for row in result.intervals
        ],
        result.cost,
        result.cached,
    )


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Wrap Service._finish: run both paths on every call and require the same result."""
    calls: list[tuple[str, bool]] = []
    original = Service._finish

    def run(self: Service, plan: Any, answer: dict, **kw: Any) -> Result | Error:
        try:
            return original(self, plan, answer, **kw)
        except Error as exc:
            return exc

    def both(self: Service, plan: Any, answer: dict, **kw: Any) -> Result:
        fast = run(self, plan, answer, **kw)
        with monkeypatch.context() as m:
            m.setattr(plan_cache, "plain_projection", lambda *a: None)
            slow = run(self, plan, answer, **kw)
        if isinstance(fast, Error) or isinstance(slow, Error):  # the same error both ways
            assert (type(fast), str(fast)) == (type(slow), str(slow)), plan.query.text
        else:
            assert _canonical(fast) == _canonical(slow), plan.query.text
        columns = released_table(plan, answer)[0]
        calls.append((plan.query.text, plain_projection(plan.query.post, columns) is not None))
        if isinstance(fast, Error):
            raise fast
        return fast

    monkeypatch.setattr(Service, "_finish", both)
    return calls


def _service() -> Service:
    # Seeded noise: the values cover negative counts clamped to 0, fractions, large sums.
    return Service(FIXTURE, ledger=MemoryLedger(), noise=SeededNoise(3), cache=False)


@pytest.mark.parametrize("delta", [1e-6, 0.0])
def test_corpus_gives_identical_results(compared: list, delta: float) -> None:
    service = _service()
    ran = set()
    for i, text in enumerate(PLAIN + NOT_PLAIN):
        cur = service.connect(f"analyst{i}").cursor()
        cur.execute("SET epsilon = 0.5")
        cur.execute(f"SET delta = {delta}")
        try:
            cur.execute(text)
        except ProgrammingError as exc:  # δ = 0 refuses keys without a public domain
            assert delta == 0 and exc.sqlstate.startswith("42"), text
            continue
        ran.add(text)
        assert cur.description is not None
        described = cur.connection.describe(text)
        assert [d[:2] for d in described] == [d[:2] for d in cur.description]
    fast = {text for text, plain in compared if plain}
    assert fast == ran & set(PLAIN)
    assert len(ran & set(PLAIN)) >= (len(PLAIN) if delta else 10)


@functools.cache
def _shared_service() -> Service:
    return _service()


def _plan(text: str) -> Any:
    service = _shared_service()
    return service, service.plan(
        parse_statement(text, service.policy), pipeline.Settings.from_policy(service.policy)
    )


@pytest.mark.parametrize(
    ("text", "key_types", "keys"),
    [
        (
            "SELECT department AS d, COUNT(*), AVG(cost) FROM visits GROUP BY 1",
            ["VARCHAR"],
            [["oncology"], [None], ["ünïcode ✓"], [""], ["a'b\"c"]],
        ),
        (
            "SELECT age, SUM(cost) AS s, SUM(age) FROM visits GROUP BY age",
            ["BIGINT"],
            [[0], [None], [-(2**63)], [2**63 - 1], [7]],
        ),
        (
            "SELECT FLOOR(age / 10) * 10 AS dec, COUNT(*) FROM visits GROUP BY 1",
            ["DOUBLE"],
            [[0.0], [-0.0], [None], [1e308], [float("nan")], [float("inf")], [3], [2**53]],
        ),
        (
            "SELECT smoker, COUNT(*) FROM visits GROUP BY smoker",
            ["BOOLEAN"],
            [[True], [False], [None]],
        ),
        (
            "SELECT visit_date, COUNT(*) FROM visits GROUP BY visit_date",
            ["DATE"],
            [[dt.date(2024, 2, 29)], [None], [dt.date(1, 1, 1)], [dt.date(9999, 12, 31)]],
        ),
        (
            "SELECT DATE_TRUNC('month', visit_date) AS m, COUNT(*) FROM visits GROUP BY 1",
            ["TIMESTAMP"],
            [[dt.datetime(2024, 1, 1)], [None], [dt.datetime(2024, 1, 1, 12, 30, 1, 5)]],
        ),
    ],
)
def test_edge_values_are_identical(
    compared: list, text: str, key_types: list[str], keys: list[list[Any]]
) -> None:
    service, plan = _plan(text)
    n, outputs = len(keys), len(plan.outputs)
    values = [0.0, -0.0, 2.5, -3.5, 1e15, None, 7, 123456.789, 2.0**70]  # counts are rounded
    bounds = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), -1e-300, 5e-324, 1.5]
    answer = {
        "keys": keys,
        "key_types": key_types,
        "outputs": [[values[(r + i) % len(values)] for r in range(n)] for i in range(outputs)],
        "intervals": [
            [[bounds[(r + i) % 8], bounds[(r + i + 3) % 8]] for r in range(n)]
            for i in range(outputs)
        ],
        "suppressed": None,
    }
    service._finish(plan, answer, cost=None, cached=True)
    assert compared and compared[-1][1]  # the fast path was taken


def test_values_the_fast_path_leaves_to_duckdb(compared: list) -> None:
    """A value whose Python type DuckDB would convert goes the scratch way (same result)."""
    for value, sql_type in [(1.5, "BIGINT"), (True, "BIGINT"), (2**64, "BIGINT"), (3, "VARCHAR"),
                            ("2024-01-01", "DATE"), (dt.datetime(2024, 1, 1), "DATE"),
                            (2**60, "DOUBLE"), (1, "BOOLEAN")]:  # fmt: skip
        with pytest.raises(NotPlain):
            cast_value(value, sql_type)
    service, plan = _plan("SELECT department, COUNT(*) FROM visits GROUP BY 1")
    answer = {
        "keys": [[5], ["x"]],  # an int where text is declared: DuckDB casts it
        "key_types": ["VARCHAR"],
        "outputs": [[1.0, 2.0]],
        "intervals": [[[0.0, 2.0], [1.0, 3.0]]],
        "suppressed": None,
    }
    result = service._finish(plan, answer, cost=None, cached=False)
    assert result.rows == [("5", 1), ("x", 2)]
    answer["outputs"] = [[2.0**70, 1.0]]  # a count beyond BIGINT: DuckDB's error, both ways
    with pytest.raises(DataError, match="out of range"):
        service._finish(plan, answer, cost=None, cached=False)


def test_plain_projection_shapes() -> None:
    columns = ["k0", "a0", "a0_lo", "a0_hi", "__suppressed"]
    import sqlglot

    def proj(sql: str) -> Any:
        return plain_projection(sqlglot.parse_one(sql, read="duckdb"), columns)

    assert proj('SELECT k0 AS "d", a0 FROM __released') == Projection((("d", 0), ("a0", 1)))
    picked = (("d", 0), ("n", 1))
    base = 'SELECT k0 AS "d", a0 AS "n" FROM __released '
    for tail, order, limit, offset in (
        ("ORDER BY k0", ((0, False, False),), None, 0),
        ("ORDER BY D DESC", ((0, True, False),), None, 0),  # output names: any case
        ("ORDER BY 2 NULLS FIRST, a0_lo", ((1, False, True), (2, False, False)), None, 0),
        ("LIMIT 0 OFFSET 3", (), 0, 3),
        ("OFFSET 2", (), None, 2),
    ):
        assert proj(base + tail) == Projection(picked, order, limit, offset), tail
    for sql in (
        "SELECT k0 FROM __released WHERE a0 > 1",
        "SELECT k0 FROM __released ORDER BY a0 + 1",
        "SELECT k0 FROM __released ORDER BY 2",
        "SELECT k0 FROM __released ORDER BY x",
        "SELECT k0 AS a0, a0 AS n FROM __released ORDER BY a0",  # alias or column: ambiguous
        'SELECT k0 AS "x", a0 AS "X" FROM __released ORDER BY x',
        "SELECT k0 FROM __released LIMIT 1 + 1",
        "SELECT k0 FROM __released LIMIT -1",
        "SELECT k0 FROM __released LIMIT 1.5",
        "SELECT k0 FROM other",
        "SELECT k0 FROM __released AS r",
        "SELECT r.k0 FROM __released",
        "SELECT k9 FROM __released",
        "SELECT a0 + 1 FROM __released",
        'SELECT k0 AS "" FROM __released',
        "SELECT DISTINCT k0 FROM __released",
        "SELECT * FROM __released",
    ):
        assert proj(sql) is None, sql
    assert math.isnan(cast_value(float("nan"), "DOUBLE"))


# --- the scratch path: one typed list per column instead of one parameter per cell -------------

KEY_COLUMNS = {
    "VARCHAR": ["oncology", None, "ünïcode ✓", "", "a'b\"c", "z", "m", "oncology "],
    "BIGINT": [0, None, -(2**63), 2**63 - 1, 7, -1, 3, 2],
    "DOUBLE": [0.0, -0.0, None, 1e308, float("nan"), float("inf"), 3, 2**53],
    "BOOLEAN": [True, False, None, True, False, True, False, None],
    "DATE": [dt.date(2024, 2, 29), None, dt.date(1, 1, 1), dt.date(9999, 12, 31)] * 2,
    "TIMESTAMP": [dt.datetime(2024, 1, 1), None, dt.datetime(2024, 1, 1, 12, 30, 1, 5)] * 2
    + [dt.datetime(1970, 1, 1), dt.datetime(2038, 1, 19, 3, 14, 8)],
}
POSTS = [  # the post-processing queries, parsed below (the scratch connection takes trees)
    'SELECT k0 AS "k", a0 AS "n", a0_lo AS __lo0, a0_hi AS __hi0 FROM __released',
    "SELECT k0, a0 FROM __released ORDER BY k0",
    "SELECT k0, a0 FROM __released ORDER BY a0 DESC NULLS FIRST, k0 LIMIT 3 OFFSET 1",
    "SELECT k0, a0 + 1 AS x, a1 / 2 AS y FROM __released WHERE a0 > 0",
    "SELECT CAST(k0 AS VARCHAR) || '!' AS s, CAST(a1 AS VARCHAR) AS t FROM __released",
    "SELECT COUNT(*) AS c, SUM(a1) AS s FROM __released",
    "SELECT * FROM __released",
    "SELECT CAST(a1 AS INTEGER) AS i FROM __released",  # fails for some rows
]


def _tree(sql: str) -> Any:
    return sqlglot.parse_one(sql, read="duckdb")


def _outcome(run: Any, *args: Any) -> Any:
    """(description, typed cells) of a post-processing run, or the first line of its error."""
    try:
        description, rows = run(*args)
    except Error as exc:
        return exc.message
    except duckdb.Error as exc:
        return f"post-processing failed: {str(exc).splitlines()[0]}"
    return description, [[(type(v).__name__, repr(v)) for v in row] for row in rows]


@pytest.mark.parametrize("key_type", sorted(KEY_COLUMNS))
def test_unnested_released_table_equals_one_parameter_per_cell(key_type: str) -> None:
    """post_process (UNNEST of typed lists) gives what VALUES with one CAST(? AS type) per cell
    gives: the same values, types, order and errors; and the list form is the one taken."""
    sc = _service().scratch
    keys = KEY_COLUMNS[key_type]
    a0 = [5, 0, None, -3, 12, 7, 1, 2]
    a1 = [2.5, -0.0, float("nan"), None, 1e300, -7.25, 3.0, 4e9]
    rows = [
        (k, a0[i], None if a0[i] is None else a0[i] - 0.5, 9.5, a1[i], None)
        for i, k in enumerate(keys)
    ]
    columns = ["k0", "a0", "a0_lo", "a0_hi", "a1", "__suppressed"]
    types = [key_type, "BIGINT", "DOUBLE", "DOUBLE", "DOUBLE", "DOUBLE"]
    for post in map(_tree, POSTS):
        for data in (rows, rows[:1], []):
            want = _outcome(sc._run_post, post, *scratch._values_source(columns, types, data))
            assert _outcome(sc.post_process, post, columns, types, data) == want, (post, data)
            if data and not isinstance(want, str):
                listed = scratch._unnest_source(columns, types, data)
                assert _outcome(sc._run_post, post, *listed) == want, (post, data)


def test_values_duckdb_will_not_list_fall_back_to_one_parameter_per_cell() -> None:
    service = _service()
    columns, types = ["k0", "a0"], ["VARCHAR", "BIGINT"]
    rows = [(5, 1.5), ("x", 2)]  # an int among texts, a float among ints: cast one by one
    post = _tree("SELECT k0, a0 FROM __released")
    assert service.scratch.post_process(post, columns, types, rows)[1] == [("5", 2), ("x", 2)]
    with pytest.raises(DataError, match="out of range"):
        service.scratch.post_process(post, columns, types, [("x", 2**70)])


ORDERED = [
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY department",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY department DESC",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY 1 NULLS FIRST",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY 1 DESC NULLS FIRST",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY 2 DESC, 1",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY n LIMIT 3",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY department LIMIT 2 OFFSET 1",
    "SELECT department, AVG(cost) AS m FROM visits GROUP BY 1 ORDER BY m DESC NULLS LAST, 1",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 LIMIT 0",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY 1 OFFSET 10",
    "SELECT department, COUNT(*) AS n FROM visits GROUP BY 1 ORDER BY COUNT(*) DESC, 1",
    "SELECT department AS a0, COUNT(*) AS k0 FROM visits GROUP BY 1 ORDER BY k0, a0",
]


@pytest.mark.parametrize("key_type", sorted(KEY_COLUMNS))
@pytest.mark.parametrize("text", ORDERED)
def test_sorting_and_cutting_match_duckdb(compared: list, text: str, key_type: str) -> None:
    """ORDER BY / LIMIT / OFFSET in Python give DuckDB's rows in DuckDB's order, for every
    key type with NULL, NaN, -0.0, extremes; tied ORDER BY values are left to DuckDB."""
    service, plan = _plan(text)
    # -0.0 and 0.0 tie (left to DuckDB): keep one, so that NaN and inf are sorted here
    keys = [-2.0 if k == 0 and str(k) == "-0.0" else k for k in KEY_COLUMNS[key_type]]
    n = len(keys)
    for counts in ([3, 1, 4, 15, 9, 2, 6, 5], [1, 1, 2, 2, 0, 0, 7, 7]):  # distinct; ties
        order = [(5 * r + 3) % n for r in range(n)]  # a fixed shuffle of the released rows
        averages = [1.5, None, float("nan"), -0.0, 2.5, float("inf"), 0.25, -1e300]
        answer = {
            "keys": [[keys[i]] for i in order],
            "key_types": [key_type],
            "outputs": [[float(counts[i]) for i in order]]
            + [[averages[i] for i in order]] * (len(plan.outputs) - 1),
            "intervals": [[[0.5 * i, 2.0 * i] for i in order]] * len(plan.outputs),
            "suppressed": None,
        }
        service._finish(plan, answer, cost=None, cached=False)
        assert compared[-1][1] == ("AS k0" not in text)  # an alias named like a column: DuckDB
