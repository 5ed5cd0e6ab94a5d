"""The doors' lexical helpers (dpsql.frontend.sqltext) take a one-pass form for text without
quotes, dollars or comments: it must give exactly what the general scanner gives."""

from __future__ import annotations

import random

import pytest

from dpsql.frontend import sqltext

ALPHABET = "ab_Z09 ;\n\t(),.*-/<>=é$'\"x1"
FIXED = [
    "SELECT COUNT(*) FROM visits WHERE age > 40",
    "select 1; select 2;; ;",
    "SELECT a-b/c FROM t; SHOW epsilon",
    "1abc é_x _y9 a1b2",
    "",
    ";",
    "SELECT x FROM t -- c",
    "SELECT 'a;b' FROM \"T\"; /* x */ SELECT $$q$$",
]


def _texts() -> list[str]:
    rng = random.Random(20261201)
    out = list(FIXED)
    for _ in range(3000):
        out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 30))))
    return out


@pytest.mark.parametrize("helper", ["strip_comments", "split_statements", "identifiers"])
def test_the_one_pass_forms_equal_the_scanner(helper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = _texts()
    assert sum(map(sqltext._plain, texts)) > 300  # the one-pass forms are exercised
    fast = [getattr(sqltext, helper)(t) for t in texts]
    monkeypatch.setattr(sqltext, "_plain", lambda sql: False)
    slow = [getattr(sqltext, helper)(t) for t in texts]
    assert fast == slow
