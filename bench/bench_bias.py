"""Issue 31 item 1 figures (docs/bias.md): what the bounds cut on the shipped fixture, and the
time the bias measures cost.

    python bench/bench_bias.py

Prints the fixture's COUNT(*) and SUM/AVG(cost) at ε = 1 with seeded noise (SeededNoise(1), no
answer cache): the released value, its 95% interval, the bias estimate, the interval widened by
it and the notes; then, side by side in one run, the median time of 20 interleaved runs per
mode (bias_estimate on / off, after 3 warm-ups) of three queries. Run with `uptime` beside it:
on a loaded machine single figures move, ratios less.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import fixture_policy  # noqa: E402

import dpsql  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402
from dpsql.privacy.samplers import SeededNoise  # noqa: E402

TIMED = (
    "SELECT COUNT(*) FROM visits",
    "SELECT department, COUNT(*), AVG(cost) FROM visits GROUP BY 1",
    "SELECT SUM(cost), AVG(age) FROM visits WHERE age > 30",
)


def main() -> None:
    policy = fixture_policy(privacy={"budget_epsilon": 1e9})
    conn = dpsql.connect(policy=policy, ledger=MemoryLedger(), noise=SeededNoise(1), cache=False)
    cur = conn.cursor()
    for sql in (
        "SELECT COUNT(*) AS n FROM visits",
        "SELECT SUM(cost) AS s, AVG(cost) AS m FROM visits",
    ):
        cur.execute(sql)
        print(sql, cur.fetchall(), "intervals", cur.intervals, "biases", cur.biases)
        for note in cur.bias_notes:
            print("  ", note)
    cur.execute("SET bias_estimate = off")
    cur.execute("SELECT COUNT(*) AS n FROM visits")
    print("bias_estimate = off:", cur.fetchall(), cur.intervals)
    for sql in TIMED:
        times: dict[str, list[float]] = {"on": [], "off": []}
        for mode in times:
            cur.execute(f"SET bias_estimate = {mode}")
            for _ in range(3):
                cur.execute(sql)
        for _ in range(20):
            for mode, got in times.items():
                cur.execute(f"SET bias_estimate = {mode}")
                start = time.perf_counter()
                cur.execute(sql)
                cur.fetchall()
                got.append(time.perf_counter() - start)
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"{sql}: on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, ratio {on / off:.2f}")


if __name__ == "__main__":
    main()
