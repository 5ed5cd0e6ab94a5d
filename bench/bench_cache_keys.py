"""What the answer cache's key costs on a shape-cache hit: the hand-written fingerprint it
replaced (its text as of adb6d88~1, copied below) against dpsql.plan.canonical.answer_key, on the
same plans, interleaved, the minimum CPU time of 30 rounds (docs/architecture.md, "Cache keys")::

    python bench/bench_cache_keys.py
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dpsql
from dpsql.frontend.bind import parse_statement
from dpsql.plan.canonical import answer_key
from dpsql.privacy.ledger import MemoryLedger
from dpsql.service.settings import Settings


def old_fingerprint(self) -> str:
    """Plan.fingerprint before the canonical tree (it missed the join)."""
    q = self.query
    parts = [
        q.table.name,
        q.table.joined.identity if q.table.joined is not None else "",
        "|".join(f"{c.name}={c.expr}" for c in q.table.columns.values() if c.expr),
        q.where.sql(dialect="duckdb") if q.where is not None else "",
        "|".join(k.key.sql + repr(k.domain) for k in self.keys),
        "|".join(
            f"{m.name}:{m.kind}:{m.column}:{m.granularity!r}:{m.center}:{m.center2}:"
            f"{m.lo}:{m.hi}:{m.scale}:{m.mechanism!r}"
            for m in self.measures
        ),
        "|".join(f"{o.call.label}:{','.join(o.measures)}" for o in self.outputs),
        repr(self.threshold),
        repr(self.quantiles),
        repr(self.clips),
        f"{self.max_rows}:{self.max_groups}:{self.mechanism}:{self.epsilon!r}:{self.delta!r}",
        f"{self.bounding}:{self.group_scaling}",
        self.data_version,
    ]
    if self.selection is not None:
        parts.append(repr(self.selection))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


ROOT = Path(__file__).resolve().parent.parent
policy = tomllib.loads((ROOT / "fixtures/visits.toml").read_text())
policy["tables"]["visits"]["source"] = str(ROOT / "fixtures/visits.csv")
svc = dpsql.Service(policy, ledger=MemoryLedger())
s = Settings.from_policy(svc.policy)
T = [
    "SELECT COUNT(*) FROM visits WHERE age > {i}",
    "SELECT department, COUNT(*) FROM visits WHERE age >= {i} GROUP BY department",
    "SELECT AVG(cost) FROM visits WHERE age < {i}",
    "SELECT SUM(age) FROM visits WHERE smoker AND age > {i}",
    "SELECT visit_date, COUNT(*) FROM visits WHERE age > {i} GROUP BY visit_date",
    "SELECT COUNT(*) FROM visits WHERE age IN ({big})",
]
big = ",".join(str(i % 101) for i in range(10000))


def main() -> None:
    print(f"load {os.getloadavg()[0]:.1f} (uptime's 1-minute average)")
    for t in T:
        plan = svc.plan(parse_statement(t.format(i=40, big=big), svc.policy), s, "a")
        # what a shape-cache hit builds: the fresh statement, the rest of the plan shared
        hit = plan.with_(query=parse_statement(t.format(i=41, big=big), svc.policy))
        ways = {"old": lambda p=hit: old_fingerprint(p), "new": lambda p=hit: answer_key(p)}
        best = dict.fromkeys(ways, 1e9)
        n = 20 if "IN" in t else 200
        for _ in range(30):
            for name, f in ways.items():
                t0 = time.process_time()
                for _ in range(n):
                    f()
                best[name] = min(best[name], (time.process_time() - t0) / n * 1e6)
        old, new = best["old"], best["new"]
        print(f"{t[:60]:60s} old {old:8.1f} us  new {new:8.1f} us  ratio {new / old:.2f}")


if __name__ == "__main__":
    main()
