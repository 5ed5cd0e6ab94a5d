"""A fresh answer that nothing remembers skips the JSON text (results.answer_data): it must be
exactly what its remembered text would decode to, and a query must answer the same with the
answer cache on and off."""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal

import numpy as np
import pytest

import dpsql
from dpsql.policy import load_policy
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.release import Released
from dpsql.privacy.samplers import SeededNoise
from dpsql.service.results import answer_data, decode_answer, encode_answer
from tests.conftest import FIXTURE_TOML


def _typed(value: object) -> object:
    """A value with its type and, for floats, its bits (NaN == NaN, -0.0 != 0.0)."""
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else value.hex())
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    return (type(value).__name__, value)


RELEASES = [
    Released([], [], [], None, []),
    Released(
        [(1,), (np.int64(2),), (None,)],
        [np.array([1.5, -0.0, np.nan])],
        [np.array([[0.0, 1.0], [-np.inf, np.inf], [2.5, 3.25]])],
        None,
        [None],
    ),
    Released(
        [
            (dt.date(2024, 1, 31), dt.datetime(2024, 1, 31, 12, 30, 5, 17), "é\u2603", True),
            (None, None, "", False),
        ],
        [np.array([0.1, 1e308]), np.array(["a", None], dtype=object)],
        [np.array([[0.0, 0.2], [1e300, 2e300]]), np.array([[np.nan, np.nan]] * 2)],
        np.array([0.25, 1.0]),
        [np.array([[1.0, 2.0], [3.0, 4.0]]), None],
    ),
    Released(
        [(Decimal("1.5"), np.float64(2.25)), (Decimal("-3"), np.float32(0.5))],
        [np.array([np.int64(3), np.int64(4)])],
        [np.array([3.0, 4.0, 5.0, 6.0])],
        np.array([0.0, 0.5]),
        [None],
    ),
]
KEY_TYPES = [[], ["BIGINT"], ["DATE", "TIMESTAMP", "VARCHAR", "BOOLEAN"], ["DOUBLE", "DOUBLE"]]


@pytest.mark.parametrize("released, key_types", list(zip(RELEASES, KEY_TYPES, strict=True)))
def test_answer_data_is_what_the_remembered_text_decodes_to(released, key_types):
    direct = answer_data(released, key_types)
    via_text = decode_answer(encode_answer(released, key_types))
    assert _typed(direct) == _typed(via_text)


def test_a_value_json_cannot_hold_fails_alike():
    released = Released([(b"\x00",)], [np.array([1.0])], [np.array([[0.0, 1.0]])], None, [None])
    with pytest.raises(TypeError):
        encode_answer(released, ["VARCHAR"])
    with pytest.raises(TypeError):
        answer_data(released, ["VARCHAR"])


QUERIES = [
    "SELECT COUNT(*) FROM visits WHERE age > 30",
    "SELECT department, COUNT(*), AVG(cost) FROM visits GROUP BY department",
    "SELECT SUM(age) FROM visits WHERE smoker",
]


@pytest.mark.parametrize("sql", QUERIES)
def test_cache_on_and_off_answer_alike(sql, monkeypatch):
    """The same secret and noise give the same rows, intervals and types either way."""
    rows = {}
    for cache in (True, False):
        monkeypatch.setattr("dpsql.pipeline.secrets.randbits", lambda bits: 12345)
        conn = dpsql.connect(
            policy=load_policy(FIXTURE_TOML),
            ledger=MemoryLedger(),
            cache=cache,
            noise=SeededNoise(7),
        )
        cur = conn.cursor()
        cur.execute(sql)
        rows[cache] = (_typed([list(r) for r in cur.fetchall()]), cur.description)
        conn.close()
    assert rows[True] == rows[False]
