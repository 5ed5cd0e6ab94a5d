"""Post-processing overhead (issue 27, item 2): a UNION ALL of two DP queries against the two
run separately, and windows over a DP query's aggregates against the same query without them
(fixture visits, 20 000 rows; answer cache off; medians of 30 interleaved runs; each text run
once first, so plan caches are warm).

    python bench/bench_postprocess.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import fixture_policy

import dpsql
from dpsql.privacy.ledger import MemoryLedger

svc = dpsql.Service(
    fixture_policy(privacy={"budget_epsilon": 1e9}), ledger=MemoryLedger(), cache=False
)
c = svc.connect("bench")
A = "SELECT department, COUNT(*) AS n FROM visits GROUP BY department"
B = "SELECT 'TOTAL', COUNT(*) FROM visits"
U = A + " UNION ALL " + B
W = (
    "SELECT department, COUNT(*) AS n, SUM(COUNT(*)) OVER (ORDER BY department) AS run, "
    "COUNT(*) * 100.0 / SUM(COUNT(*)) OVER () AS pct FROM visits GROUP BY department"
)


def t(sql):
    s = time.perf_counter()
    c.cursor().execute(sql)
    return time.perf_counter() - s


for sql in (A, B, U, W):
    t(sql)
sep, uni, plain, win = [], [], [], []
for _ in range(30):
    sep.append(t(A) + t(B))
    uni.append(t(U))
    plain.append(t(A))
    win.append(t(W))
m = statistics.median
ms = 1e3
print(f"two DP queries separately {m(sep) * ms:.1f} ms, as one UNION ALL {m(uni) * ms:.1f} ms:")
print(f"  ratio {m(uni) / m(sep):.2f}")
print(f"a DP query {m(plain) * ms:.1f} ms, with two windows {m(win) * ms:.1f} ms:")
print(f"  ratio {m(win) / m(plain):.2f}")
