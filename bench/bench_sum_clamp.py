"""SUM(income) on PUMS at ε = 1 through SQL with the default policy (issue 31 item 7, ≤ 4.1e5):
the clamps dpsql really chooses, scored three ways side by side.

Per repetition, as bench/bench_utility_peers.py's "later" rows do (the same seeds): a fresh
analyst (new ledger, answer cache on, ``SeededNoise(1000 + rep)``) runs
``SELECT SUM(income) FROM pums`` (the first query: it buys the kept histogram of |income| with
``bounds_share`` of its ε and releases its SUM at ε_s = 1 − share) and then the same query with
``WHERE pid >= 0`` (a later query: the clamp chosen free from the kept histogram, ε_s = 1).
The clamp each chose is read from the answer's note ("income clamped to [0, C]"). Columns:

- ``measured``: the mean |released − true| (what bench_utility_peers prints; its own noise,
  the staircase since it shipped (docs/mechanisms.md), has a sampling error of about ±2.5e4
  over 200 repetitions);
- ``exact Laplace``: the mean over the chosen clamps of E|bias(C) + Laplace(C/ε_s)| (the
  noise averaged exactly: the choice's error alone, no sampling error from the SUM's noise);
- ``exact staircase``: the same clamps with the staircase noise of least E|noise|
  (bench/sim_sum_families.py ``Staircase``, continuous: what dpsql's discrete staircase
  gives at these periods, their E|X| agreeing to 1e-12 relative).

``--shares`` sets the table's ``bounds_share`` (the policy option; default 0.1).

    python bench/bench_sum_clamp.py --reps 200 --shares 0.1,0.2
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utility_peers as peers
from sim_sum_families import Staircase, lap_mae

CLAMP = re.compile(r"income clamped to \[0, ([0-9.e+]+)\]")


def clamp_of(messages: list) -> float:
    for _, text in messages:
        m = CLAMP.search(str(text))
        if m:
            return float(m.group(1))
    return float(peers.UPPER)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("/work/shared/datasets"))
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--shares", default="0.1", help="bounds_share values")
    args = ap.parse_args()
    data = peers.load(args.data)
    x = np.sort(data.income.astype(np.float64))
    total = float(x.sum())

    def bias(c: float) -> float:
        return total - float(np.minimum(x, c).sum())

    print("| bounds_share | query | measured | exact Laplace | exact staircase | clamps chosen |")
    print("| ---: | --- | ---: | ---: | ---: | --- |")
    for share in (float(s) for s in args.shares.split(",")):
        policy = peers.dpsql_policy(data)
        policy["tables"]["pums"]["bounds_share"] = share
        got: dict[str, list[tuple[float, float]]] = {"first": [], "later": []}
        for rep in range(args.reps):
            with peers.fresh_analyst(policy, rep) as cur:
                for label, sql in (
                    ("first", "SELECT SUM(income) FROM pums"),
                    ("later", "SELECT SUM(income) FROM pums WHERE pid >= 0"),
                ):
                    cur.execute(sql)
                    value = float(cur.fetchall()[0][0])
                    got[label].append((value, clamp_of(cur.messages)))
        for label, eps_s in (("first", 1 - share), ("later", 1.0)):
            stair = Staircase(eps_s)
            values = np.array([v for v, _ in got[label]])
            clamps = np.array([c for _, c in got[label]])
            lap = np.mean([lap_mae(bias(c), c / eps_s) for c in clamps])
            st = np.mean([float(stair.mae(bias(c), c)) for c in clamps])
            tops = np.unique(np.round(clamps), return_counts=True)
            common = sorted(zip(tops[1], tops[0], strict=True), reverse=True)[:4]
            spread = ", ".join(f"{c:.0f}: {n}" for n, c in common)
            print(
                f"| {share:g} | {label} | {np.abs(values - total).mean():.3g} | {lap:.3g} | "
                f"{st:.3g} | {spread} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
