"""Qrlew's and ZetaSQL's documented join shapes over fixtures/star (tests/join_shapes.toml).

Each shape is answered (noise off, bounds that do not bind) with the stated columns and row
count, equal to its DuckDB reference over the CSVs; or refused with its SQLSTATE and message,
reading nothing and spending nothing. ``pending`` shapes are xfail (not strict) with the
feature they wait for; ``test_shape_counts`` prints the tally (pytest -s).
"""

from __future__ import annotations

import tomllib
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
from conftest import EngineSpy, assert_same_rows, exact_connect
from test_private_joins import reference, star_policy

import dpsql

SHAPES_FILE = Path(__file__).resolve().parent / "join_shapes.toml"


@dataclass(frozen=True)
class JoinShape:
    """One documented join shape and what dpsql must do with it."""

    name: str
    source: str
    sql: str
    outcome: str = "rows"
    status: str = "expected"
    feature: str = ""
    why: str = ""
    columns: tuple[str, ...] | None = None
    rows: int | None = None
    reference: str | None = None
    skip_empty: bool = False
    sqlstate: str | None = None
    message: str | None = None

    @property
    def reference_sql(self) -> str | None:
        """The exact-answer SQL: the shape itself unless stated; None for no value check."""
        return self.sql if self.reference is None else (self.reference or None)


def load_shapes(path: Path = SHAPES_FILE) -> list[JoinShape]:
    known = {f.name for f in fields(JoinShape)}
    shapes = []
    for raw in tomllib.loads(path.read_text())["shape"]:
        unknown = set(raw) - known
        assert not unknown, (raw.get("name"), unknown)
        if "columns" in raw:
            raw = {**raw, "columns": tuple(raw["columns"])}
        shapes.append(JoinShape(**raw))
    return shapes


SHAPES = load_shapes()


def _params() -> list[Any]:
    out = []
    for shape in SHAPES:
        marks = []
        if shape.status == "pending":
            marks.append(pytest.mark.xfail(strict=False, reason=shape.feature))
        out.append(pytest.param(shape, id=shape.name, marks=marks))
    return out


@pytest.fixture(scope="module")
def star():
    conn = exact_connect(star_policy())
    ref = reference()
    yield conn, ref
    conn.close()
    ref.close()


def _spent(conn: dpsql.Connection) -> Any:
    return conn.service.ledger.spent(conn.analyst, conn.service.policy.dataset)


@pytest.mark.parametrize("shape", _params())
def test_join_shape(star, shape: JoinShape) -> None:
    conn, ref = star
    cur = conn.cursor()
    if shape.outcome == "refused":
        spy = EngineSpy(conn.service)
        before = _spent(conn)
        try:
            with pytest.raises(dpsql.Error) as info:
                cur.execute(shape.sql)
        finally:
            conn.service.engine.execute = spy.original
        assert info.value.sqlstate == shape.sqlstate, str(info.value)
        assert shape.message and shape.message in str(info.value), str(info.value)
        assert info.value.hint, "a refusal names the fix"
        assert spy.calls == 0 and _spent(conn) == before
        return
    cur.execute(shape.sql)
    got = cur.fetchall()
    if shape.columns is not None:
        assert [d[0] for d in cur.description or []] == list(shape.columns)
    if shape.rows is not None:
        assert len(got) == shape.rows, got
    if shape.reference_sql is not None:
        expected = ref.execute(shape.reference_sql).fetchall()
        if shape.skip_empty:  # keys without rows have no exact counterpart
            keys = {row[0] for row in expected}
            got = [row for row in got if row[0] in keys]
        assert_same_rows(got, expected)


def test_shape_file_is_well_formed() -> None:
    """Every shape names its source; pending ones their feature; refusals their reason."""
    names = [s.name for s in SHAPES]
    assert len(names) == len(set(names))
    for s in SHAPES:
        assert s.source and s.status in ("expected", "pending"), s.name
        assert s.outcome in ("rows", "refused"), s.name
        assert s.name.startswith(("qrlew_", "zetasql_")), s.name
        if s.status == "pending":
            assert s.feature, s.name
        if s.outcome == "refused":
            assert s.sqlstate and s.message and s.why in ("unsafe", "unsupported"), s.name
    tally = Counter(
        "pending"
        if s.status == "pending"
        else "answered"
        if s.outcome == "rows"
        else f"refused ({s.why})"
        for s in SHAPES
    )
    print(f"\n[join shapes] {len(SHAPES)}: {dict(sorted(tally.items()))}")
