"""Offline simulation of the default clamp of a single total (issue 31 item 7).

The default clamp of SUM(x) with no ``clip`` stated is chosen from a kept DP histogram of |x|
(dpsql.service.bounds): public log bins, discrete Laplace noise of scale R/ε_h per bin,
ε_h = bounds_share · ε of the query that bought it. This script draws many such noisy
histograms of a column and, for each rule, the clamp C it chooses, then averages the exact
expected error of the SUM released at ε_s with that clamp, E|bias(C) + Laplace(C/ε_s)| =
|b| + s·exp(−|b|/s) (no Monte Carlo in the SUM's noise): the rules side by side on the same
draws, far tighter than the end-to-end bench's 200 repetitions (whose own SUM noise has a
±2.5e4 sampling error on PUMS).

Columns: PUMS income (../shared/datasets/pums/PUMS_pid.csv, 1,000 people, declared [0,
500000]; ten incomes above 325,000, eight top-coded at 325,000) and synthetic ones on the
same declared range (a seeded lognormal of 1,000 and 10,000 values, a Pareto tail, values far
below the bound). R = 1. "first": the query that pays (ε_s = 1 − share); "later": ε_s = 1.

    python bench/sim_default_clamp.py --draws 1000
    python bench/sim_default_clamp.py --draws 600 --ratios 4,8 --shares 0.1,0.2,0.3
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np

from dpsql.privacy.clipping import ApproxBounds, LogHistogram

UPPER = 500_000.0
ROOT = Path(__file__).resolve().parent.parent
PUMS = ROOT.parent / "shared" / "datasets" / "pums" / "PUMS_pid.csv"


def columns() -> dict[str, np.ndarray]:
    g = np.random.default_rng(7)
    out = {}
    if PUMS.exists():
        with open(PUMS, newline="") as f:
            out["pums income"] = np.array([float(r["income"]) for r in csv.DictReader(f)])
    out["lognormal 1k"] = np.minimum(g.lognormal(math.log(30_000), 1.0, 1000), UPPER)
    out["lognormal 10k"] = np.minimum(g.lognormal(math.log(30_000), 1.0, 10_000), UPPER)
    out["pareto 1k"] = np.minimum(20_000 * (1 + g.pareto(1.5, 1000)), UPPER)
    out["small 1k"] = np.minimum(g.lognormal(math.log(2_000), 0.7, 1000), UPPER)
    return out


def dlap(rng: np.random.Generator, scale: float, size: int) -> np.ndarray:
    p = 1 - math.exp(-1 / scale)
    return rng.geometric(p, size) - rng.geometric(p, size)


def run(x: np.ndarray, ratio: float, eps_h: float, eps_s: float, draws: int, seed: int) -> dict:
    hist = LogHistogram.for_bounds(0, UPPER, resolution=1.0, ratio=ratio)
    xs = np.sort(x)
    csum = np.concatenate([[0.0], np.cumsum(xs)])
    total = float(csum[-1])

    def error(c: float) -> float:
        k = int(np.searchsorted(xs, c))
        b = total - (csum[k] + c * (xs.size - k))
        s = c / eps_s
        return abs(b) + s * math.exp(-abs(b) / s)

    grid = np.unique(np.concatenate([xs[xs > 0], UPPER * 2 ** (-np.arange(0, 200) / 16)]))
    oracle = min(error(float(c)) for c in grid)
    rules = {
        m: ApproxBounds(hist, eps_h, method=m, sum_epsilon=eps_s) for m in ("mse", "posterior")
    }
    counts = hist.counts(xs)
    rng = np.random.default_rng(seed)
    errors: dict[str, list[float]] = {m: [] for m in rules}
    for _ in range(draws):
        noisy = counts + dlap(rng, 1 / eps_h, counts.size)
        for m, rule in rules.items():
            errors[m].append(error(rule.choose(noisy, 0, UPPER).bound))
    return {"oracle": oracle, **{m: float(np.mean(v)) for m, v in errors.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=1000, help="noisy histograms per row")
    ap.add_argument("--shares", default="0.1", help="bounds_share values (ε = 1)")
    ap.add_argument("--ratios", default="4", help="bins per doubling (the default: 4)")
    ap.add_argument("--columns", default="", help="comma-separated subset of the columns")
    args = ap.parse_args()
    cols = columns()
    chosen = [c for c in args.columns.split(",") if c] or list(cols)
    print("| column | bins per doubling | share | query | oracle | mse | posterior |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for name in chosen:
        for per in (int(r) for r in args.ratios.split(",")):
            for share in (float(s) for s in args.shares.split(",")):
                for label, eps_s in (("first", round(1 - share, 6)), ("later", 1.0)):
                    r = run(cols[name], 2 ** (1 / per), share, eps_s, args.draws, seed=1)
                    print(
                        f"| {name} | {per} | {share:g} | {label} | {r['oracle']:.3g} | "
                        f"{r['mse']:.3g} | {r['posterior']:.3g} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
