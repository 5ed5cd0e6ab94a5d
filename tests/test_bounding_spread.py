"""The G-groups-per-unit bound is chosen per unit (keyed hash of unit and key).

Ranking groups by a hash of the key alone would make every unit keep the same G groups, so
the same groups would lose every unit's contribution: a systematic bias, not noise.
"""

from __future__ import annotations

import dpsql
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

GROUPS = ["a", "b", "c", "d", "e", "f"]


def test_each_unit_keeps_its_own_groups(tmp_path) -> None:
    path = tmp_path / "t.csv"
    lines = ["uid,grp"] + [f"{u},{g}" for u in range(300) for g in GROUPS]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    policy = {
        "privacy": {"epsilon": 1.0},
        "tables": {
            "t": {
                "source": str(path),
                "privacy_unit": "uid",
                "max_rows_per_unit": 1,
                "max_groups_per_unit": 3,
                "columns": {"uid": {"type": "int"}, "grp": {"type": "text", "values": GROUPS}},
            }
        },
    }
    with dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=ZeroNoise(), cache=False) as c:
        cur = c.cursor()
        cur.execute("SELECT grp, COUNT(*) FROM t GROUP BY grp")
        counts = dict(cur.fetchall())
    assert sum(counts.values()) == 300 * 3  # every unit keeps exactly G groups
    # Each group is kept by each unit with probability 1/2: 150 ± 3σ (σ ≈ 8.7).
    assert all(120 <= counts[g] <= 180 for g in GROUPS), counts


def test_count_only_plan_caps_pairs_without_sampling(tmp_path) -> None:
    """COUNT(*) alone: each (unit, group) pair counts min(n, R) — the same as any R rows."""
    path = tmp_path / "t.csv"
    lines = ["uid,grp,v"] + [f"{u},a,{i}" for u in range(10) for i in range(u + 1)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    policy = {
        "tables": {
            "t": {
                "source": str(path),
                "privacy_unit": "uid",
                "max_rows_per_unit": 4,
                "columns": {
                    "uid": {"type": "int"},
                    "grp": {"type": "text", "values": ["a"], "nullable": False},
                    "v": {"type": "int", "lower": 0, "upper": 20},
                },
            }
        },
    }
    with dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=ZeroNoise(), cache=False) as c:
        cur = c.cursor()
        cur.execute("EXPLAIN SELECT grp, COUNT(*) FROM t GROUP BY grp")
        engine_sql = cur.fetchall()[-1][1]
        assert "sampled" not in engine_sql and "ROW_NUMBER" not in engine_sql.upper()
        cur.execute("SELECT grp, COUNT(*) FROM t GROUP BY grp")
        assert cur.fetchall() == [("a", sum(min(u + 1, 4) for u in range(10)))]
        # With a value measure the rows themselves are sampled, and counts agree.
        cur.execute("SELECT grp, COUNT(*), SUM(v) FROM t GROUP BY grp")
        (_, count, _total) = cur.fetchone()
        assert count == sum(min(u + 1, 4) for u in range(10))
