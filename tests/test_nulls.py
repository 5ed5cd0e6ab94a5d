"""NULL semantics of released aggregates (documented in grammar_notes.md, "NULL semantics").

All with noise switched off, so each value is the exact bounded aggregate.
"""

from __future__ import annotations

import pytest
from conftest import exact_connect, fixture_policy, rows_of, table_policy, write_csv

COLUMNS = {
    "uid": {"type": "int", "nullable": False},
    "grp": {"type": "text", "values": ["a", "b"], "nullable": True},  # NULL: a public bin
    "strict": {"type": "text", "values": ["a", "b"], "nullable": False},
    "age": {"type": "int", "lower": 0, "upper": 9, "nullable": False},
    "v": {"type": "float", "lower": 0.0, "upper": 10.0, "granularity": 0.5},
}
# uid, grp, strict, age, v
ROWS = [
    (1, "a", "a", 1, 2.0),
    (2, "a", "b", 2, None),
    (3, None, "a", 3, 4.0),
    (4, None, None, 4, None),
    (5, "b", "z", 5, 6.0),  # 'z' is outside strict's declared values
    (6, "zz", "b", 42, 8.0),  # 'zz' outside grp's values; 42 outside age's bounds
]


@pytest.fixture(scope="module")
def conn(tmp_path_factory):
    path = write_csv(tmp_path_factory.mktemp("nulls") / "t.csv", list(COLUMNS), ROWS)
    with exact_connect(table_policy(path, COLUMNS, unit="uid", rows=2, groups=2)) as c:
        yield c


def test_count_star_counts_rows_with_nulls(conn):
    assert rows_of(conn, "SELECT COUNT(*) FROM t") == [(6,)]


def test_count_sum_avg_var_ignore_nulls(conn):
    assert rows_of(conn, "SELECT COUNT(v), COUNT(grp), SUM(v), AVG(v) FROM t") == [
        (4, 4, 20.0, 5.0)
    ]
    (var,) = rows_of(conn, "SELECT VAR_POP(v) FROM t")[0]
    assert var == pytest.approx(5.0)  # of 2, 4, 6, 8


def test_all_null_group_releases_zero_sum_and_a_clamped_avg(conn):
    """No non-NULL value: SUM is 0 (not NULL: NULL would reveal emptiness), AVG is never NULL."""
    got = rows_of(conn, "SELECT COUNT(*), COUNT(v), SUM(v), AVG(v) FROM t WHERE v IS NULL")
    ((n, nv, s, avg),) = got
    assert (n, nv, s) == (2, 0, 0.0)
    assert avg is not None and 0.0 <= avg <= 10.0


def test_nullable_public_key_releases_a_null_group(conn):
    got = dict(rows_of(conn, "SELECT grp, COUNT(*) FROM t GROUP BY grp"))
    assert got == {"a": 2, "b": 1, None: 2}  # 'zz' is outside the domain: dropped


def test_non_nullable_key_drops_null_and_unknown_keys(conn):
    got = dict(rows_of(conn, "SELECT strict, COUNT(*) FROM t GROUP BY strict"))
    assert got == {"a": 2, "b": 2}  # the NULL row and the 'z' row are dropped


def test_key_outside_declared_bounds_is_dropped(conn):
    got = dict(rows_of(conn, "SELECT age, COUNT(*) FROM t GROUP BY age"))
    assert list(got) == list(range(10)) and sum(got.values()) == 5  # age 42 dropped
    binned = dict(rows_of(conn, "SELECT FLOOR(age / 5) AS b, COUNT(*) FROM t GROUP BY b"))
    assert binned == {0.0: 4, 1.0: 1}


def test_out_of_domain_rows_still_count_without_group_by(conn):
    """The domain filter belongs to the GROUP BY: a plain COUNT keeps every row."""
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE age > 40") == [(1,)]


def test_where_uses_three_valued_logic(conn):
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE v > 3") == [(3,)]
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE NOT (v > 3)") == [(1,)]
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE grp <> 'a'") == [(2,)]
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE grp IS DISTINCT FROM 'a'") == [(4,)]
    assert rows_of(conn, "SELECT COUNT(*) FROM t WHERE v IS NULL OR grp IS NULL") == [(3,)]


def test_null_rows_count_toward_the_row_bound(tmp_path):
    """A unit's NULL rows use up its R rows: R = 2 over 3 rows keeps 2, NULL or not."""
    path = write_csv(tmp_path / "u.csv", ["uid", "v"], [(1, None), (1, None), (1, None)])
    cols = {"uid": {"type": "int"}, "v": {"type": "int", "lower": 0, "upper": 5}}
    with exact_connect(table_policy(path, cols, unit="uid", rows=2)) as c:
        assert rows_of(c, "SELECT COUNT(*), COUNT(v), SUM(v) FROM t") == [(2, 0, 0)]


def _heavy_null_key(tmp_path, null_units: bool = False):
    """Units with 4 rows each in the NULL group and in 'a' (R = 2 binds)."""
    rows = []
    for uid in range(1, 4):
        rows += [(uid, None)] * 4 + [(uid, "a")] * 4
    if null_units:
        rows += [(None, "a")] * 2  # at most R: kept as if one unit (3 rows would be dropped)
    path = write_csv(tmp_path / "h.csv", ["uid", "grp"], rows)
    cols = {"uid": {"type": "int"}, "grp": {"type": "text", "values": ["a", "b"], "nullable": True}}
    return exact_connect(table_policy(path, cols, unit="uid", rows=2, groups=2))


def test_null_group_of_units_over_the_row_bound_keeps_r_rows(tmp_path):
    """Units over R in the NULL group keep R rows there too (NULL keys match NULL keys)."""
    with _heavy_null_key(tmp_path) as c:
        got = dict(rows_of(c, "SELECT grp, COUNT(*) FROM t GROUP BY grp"))
    assert got == {"a": 6, "b": 0, None: 6}


def test_rows_without_a_privacy_unit_are_dropped(tmp_path):
    with _heavy_null_key(tmp_path, null_units=True) as c:
        assert rows_of(c, "SELECT COUNT(DISTINCT uid) FROM t") == [(3,)]
        assert rows_of(c, "SELECT COUNT(*) FROM t WHERE uid IS NULL") == [(0,)]


def test_rows_on_which_a_key_fails_form_the_null_bin(conn):
    """Keys are evaluated under TRY (in the engine and over the public domain): a failing row
    is counted in the NULL bin rather than failing the query (which would reveal it)."""
    got = dict(rows_of(conn, "SELECT 10 // (age - 3) AS k, COUNT(*) FROM t GROUP BY k"))
    assert got[None] == 1 and sum(got.values()) == 5  # age 3 fails; age 42 is out of domain
    got = dict(rows_of(conn, "SELECT CAST(strict AS INT) AS k, COUNT(*) FROM t GROUP BY k"))
    assert got == {None: 4}


@pytest.mark.parametrize("unit", [None, "uid"])
def test_out_of_domain_public_key_is_dropped_when_thresholded_too(tmp_path, unit):
    """GROUP BY a public and a non-public key: tuples whose public part lies outside its
    declared values are dropped, as without the non-public key (row-level tables too)."""
    rows = [(i, "zz" if i % 3 == 0 else "a", "x") for i in range(300)]
    path = write_csv(tmp_path / "d.csv", ["uid", "grp", "name"], rows)
    cols = {
        "uid": {"type": "int"},
        "grp": {"type": "text", "values": ["a", "b"], "nullable": False},
        "name": {"type": "text"},
    }
    policy = table_policy(path, cols, unit=unit, privacy={"epsilon": 100.0})
    with exact_connect(policy) as c:
        assert rows_of(c, "SELECT grp, name, COUNT(*) FROM t GROUP BY grp, name") == [
            ("a", "x", 200)
        ]


# --- undeclared nullability: never a phantom NULL group (issue 31) ----------------------------


def test_fixture_group_by_undeclared_null_free_column_releases_no_null_group():
    """The shipped fixture with department's nullable = false removed: department holds no
    NULL, and no NULL group is released (it used to be: a noisy count of nothing, AVG 0)."""
    policy = fixture_policy()
    del policy["tables"]["visits"]["columns"]["department"]["nullable"]
    with exact_connect(policy) as c:
        got = rows_of(c, "SELECT department, COUNT(*), AVG(cost) FROM visits GROUP BY department")
        assert len(got) == 6 and None not in {k for k, *_ in got}
        (table,) = [t for t in c.service.policy.tables.values() if t.name == "visits"]
        spec = table.columns["department"]
        assert (spec.nullable, spec.nullable_declared, spec.may_hold_null) == (False, False, True)


def test_undeclared_public_domain_drops_null_keys_and_counts_values(tmp_path):
    """Undeclared, with NULLs in the data: GROUP BY drops the NULL keys (as keys outside the
    domain are: a function of the policy, not of whether NULLs occur) and COUNT(col) still
    counts values, not rows (only a declared nullable = false makes it COUNT(*))."""
    rows = [(1, "a"), (2, None), (3, "b"), (4, None), (5, "a")]
    path = write_csv(tmp_path / "n.csv", ["uid", "grp"], rows)
    cols = {
        "uid": {"type": "int", "nullable": False},
        "grp": {"type": "text", "values": ["a", "b"]},
    }
    with exact_connect(table_policy(path, cols, unit="uid")) as c:
        assert dict(rows_of(c, "SELECT grp, COUNT(*) FROM t GROUP BY grp")) == {"a": 2, "b": 1}
        assert rows_of(c, "SELECT COUNT(grp), COUNT(*) FROM t") == [(3, 5)]
        assert rows_of(c, "SELECT COUNT(*) FROM t WHERE grp IS NULL") == [(2,)]


def test_undeclared_null_free_column_the_same_as_with_nulls(tmp_path):
    """The released groups of an undeclared column do not depend on whether the data holds
    a NULL: neighbours that differ by a unit with a NULL key release the same set of keys."""
    base = [(1, "a"), (2, "b"), (3, "a")]
    cols = {
        "uid": {"type": "int", "nullable": False},
        "grp": {"type": "text", "values": ["a", "b"]},
    }
    keys = []
    for extra in ([], [(4, None)]):
        path = write_csv(tmp_path / f"k{len(extra)}.csv", ["uid", "grp"], base + extra)
        with exact_connect(table_policy(path, cols, unit="uid")) as c:
            keys.append(
                sorted(k for k, _ in rows_of(c, "SELECT grp, COUNT(*) FROM t GROUP BY grp"))
            )
    assert keys[0] == keys[1] == ["a", "b"]


def test_undeclared_free_text_key_keeps_its_thresholded_null_key(tmp_path):
    """Without a public domain a NULL key is thresholded like any key (no phantom: an empty
    key never passes), so an undeclared free-text column keeps it."""
    rows = [(i, None if i % 2 else "x") for i in range(400)]
    path = write_csv(tmp_path / "f.csv", ["uid", "name"], rows)
    cols = {"uid": {"type": "int", "nullable": False}, "name": {"type": "text"}}
    policy = table_policy(path, cols, unit="uid", privacy={"epsilon": 100.0})
    with exact_connect(policy) as c:
        assert dict(rows_of(c, "SELECT name, COUNT(*) FROM t GROUP BY name")) == {
            "x": 200,
            None: 200,
        }
