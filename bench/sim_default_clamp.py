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

Rules (``--rules``; "mse,posterior" unless stated): the two of dpsql.privacy.clipping, and the
instance-optimal clipping of the literature (Huang, Liang & Yi 2021; Fang, Dong & Yi 2022: clip
near the k-th largest |x|, k ≈ c/ε), measured for issue 31 in its seventh session, none shipped:

- ``kth:K``: the top edge of the bin in which the kept histogram's posterior mean counts
  (:func:`posterior_counts`), summed from the top, first reach K (post-processing, free);
- ``kth-raw:K``: the same on the raw noisy counts;
- ``svt:K``: a differently shaped purchase of the same ε_h instead of the histogram:
  AboveThreshold (Lyu, Su & Li 2017, their monotone variant) over q_i = #{|x| >= t_i} for the
  thresholds t_i = U·2^(−i/16) from the top, with noisy threshold K + Laplace(2/ε_h) and
  Laplace(2/ε_h) on each query; C = the first t_i whose noisy count passes. A unit moves every
  q_i by at most 1, all in the same direction, so the scan is ε_h-DP whatever its length.

``--noise staircase`` scores each clamp with the SUM's shipped noise (the discrete staircase's
E|b + X|, as bench/sim_sum_families.py computes it) instead of the Laplace's.

    python bench/sim_default_clamp.py --draws 1000
    python bench/sim_default_clamp.py --draws 600 --ratios 4,8 --shares 0.1,0.2,0.3
    python bench/sim_default_clamp.py --draws 500 --noise staircase \
        --rules posterior,kth-raw:2,kth-raw:10,kth:2,kth:5,kth:10,svt:2,svt:5,svt:10
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dpsql.privacy.clipping import ApproxBounds, LogHistogram, posterior_counts

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


def kth_from_top(counts: np.ndarray, hist: LogHistogram, k: float) -> float:
    """The top edge of the highest bin at which ``counts`` summed from the top reach k (the
    k-th largest |x| lies in it), the lowest bin's if they never do."""
    from_top = np.cumsum(counts[::-1])[::-1]
    hit = np.flatnonzero(from_top >= k)
    return float(hist.edges()[1:][hit[-1] if hit.size else 0])


#: the above-threshold scan's thresholds, from the declared bound down (ratio 2^(1/16))
SCAN = UPPER * 2 ** (-np.arange(0, 400) / 16)


def above_threshold(xs: np.ndarray, eps: float, k: float, rng: np.random.Generator) -> float:
    """AboveThreshold over q_i = #{x >= t_i}, t_i = :data:`SCAN` (descending): the first t_i
    with q_i + Laplace(2/ε) >= k + Laplace(2/ε). The q_i are monotone (a unit moves each by at
    most 1, all up or all down), so the monotone variant's noise is ε-DP (Lyu, Su & Li 2017,
    Alg. 1 with ε₁ = ε₂ = ε/2, query noise 2cΔ/ε₂ halved for monotone queries)."""
    q = xs.size - np.searchsorted(xs, SCAN)
    passed = np.flatnonzero(q + rng.laplace(0, 2 / eps, SCAN.size) >= k + rng.laplace(0, 2 / eps))
    return float(SCAN[passed[0]] if passed.size else SCAN[-1])


def staircase_error(eps_s: float) -> Callable[[float, float], float]:
    """E|b + X| for the SUM's shipped staircase noise at ε_s, X of period C (continuous form,
    bench/sim_sum_families.py: equal to the discrete one's at these periods)."""
    from sim_sum_families import Staircase  # not at the top: that module imports this one

    stair = Staircase(eps_s)
    return lambda b, c: float(stair.mae(b, c))


def run(
    x: np.ndarray,
    ratio: float,
    eps_h: float,
    eps_s: float,
    draws: int,
    seed: int,
    names: tuple[str, ...] = ("mse", "posterior"),
    noise: str = "laplace",
) -> dict:
    hist = LogHistogram.for_bounds(0, UPPER, resolution=1.0, ratio=ratio)
    xs = np.sort(x)
    csum = np.concatenate([[0.0], np.cumsum(xs)])
    total = float(csum[-1])
    stair = staircase_error(eps_s) if noise == "staircase" else None

    def error(c: float) -> float:
        k = int(np.searchsorted(xs, c))
        b = total - (csum[k] + c * (xs.size - k))
        if stair is not None:
            return stair(b, c)
        s = c / eps_s
        return abs(b) + s * math.exp(-abs(b) / s)

    grid = np.unique(np.concatenate([xs[xs > 0], UPPER * 2 ** (-np.arange(0, 200) / 16)]))
    oracle = min(error(float(c)) for c in grid)
    counts = hist.counts(xs)
    rng = np.random.default_rng(seed)
    scan_rng = np.random.default_rng(seed + 1)  # the above-threshold scans' own noise
    choose = {name: rule(name, hist, eps_h, eps_s, xs, scan_rng) for name in names}
    errors: dict[str, list[float]] = {m: [] for m in names}
    for _ in range(draws):
        noisy = counts + dlap(rng, 1 / eps_h, counts.size)
        for m, pick in choose.items():
            errors[m].append(error(pick(noisy)))
    return {"oracle": oracle, **{m: float(np.mean(v)) for m, v in errors.items()}}


def rule(
    name: str,
    hist: LogHistogram,
    eps_h: float,
    eps_s: float,
    xs: np.ndarray,
    rng: np.random.Generator,
) -> Callable[[np.ndarray], float]:
    """The clamp a rule chooses, as a function of one noisy histogram draw."""
    kind, _, arg = name.partition(":")
    if kind in ("mse", "posterior"):
        chooser = ApproxBounds(hist, eps_h, method=kind, sum_epsilon=eps_s)
        return lambda noisy: chooser.choose(noisy, 0, UPPER).bound
    k = float(arg)
    if kind == "kth":
        return lambda noisy: kth_from_top(posterior_counts(noisy, 1 / eps_h)[0], hist, k)
    if kind == "kth-raw":
        return lambda noisy: kth_from_top(np.asarray(noisy, dtype=np.float64), hist, k)
    if kind == "svt":  # its own purchase: the histogram draw is not read
        return lambda noisy: above_threshold(xs, eps_h, k, rng)
    raise SystemExit(f"unknown rule {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=1000, help="noisy histograms per row")
    ap.add_argument("--shares", default="0.1", help="bounds_share values (ε = 1)")
    ap.add_argument("--ratios", default="4", help="bins per doubling (the default: 4)")
    ap.add_argument("--columns", default="", help="comma-separated subset of the columns")
    ap.add_argument("--rules", default="mse,posterior", help="rules, e.g. posterior,kth:2,svt:5")
    ap.add_argument("--noise", choices=("laplace", "staircase"), default="laplace")
    args = ap.parse_args()
    cols = columns()
    chosen = [c for c in args.columns.split(",") if c] or list(cols)
    names = tuple(r for r in args.rules.split(",") if r)
    print("| column | bins per doubling | share | query | oracle | " + " | ".join(names) + " |")
    print("| --- | ---: | ---: | --- | ---: | " + " | ".join("---:" for _ in names) + " |")
    for name in chosen:
        for per in (int(r) for r in args.ratios.split(",")):
            for share in (float(s) for s in args.shares.split(",")):
                for label, eps_s in (("first", round(1 - share, 6)), ("later", 1.0)):
                    r = run(
                        cols[name], 2 ** (1 / per), share, eps_s, args.draws, 1, names, args.noise
                    )
                    print(
                        f"| {name} | {per} | {share:g} | {label} | {r['oracle']:.3g} | "
                        + " | ".join(f"{r[m]:.3g}" for m in names)
                        + " |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
