"""SUM(income) <= 4.1e5 on PUMS at ε = 1 (issue 31 item 7): mechanism families not tried before,
measured side by side with the shipped rule (fourth session, 2026-12-07). None shipped.

Two kinds of rows, both exact expectations over the SUM's own noise (no Monte Carlo there
except where stated):

*Oracles of a family* (the data known, only the release's noise random): the least error any
rule of that family could reach, so a family whose oracle is above the single clamp's oracle
(or above 4.1e5) is out, whatever rule chooses its parameters:

- ``oracle``: one clamp C, the SUM with Laplace(C/ε) (what bench_utility_peers prints);
- ``oracle stair``: one clamp C, the SUM with the staircase noise of Geng & Viswanath
  (the ε-DP noise of least E|noise| for sensitivity Δ = C; γ = 1/(1 + e^(ε/2)));
- ``two-level``: clamp at C (ε₁) plus a separately noised sum of min((x − C)⁺, C₂ − C)
  (ε₂ = ε − ε₁), C < C₂ <= U and ε₁ all chosen on the data (brief idea 3);
- ``tail fix``: clamp at C (ε₁) plus a noisy histogram of the values above C (the kept
  histogram's 2^¼ bins above C, ε₂, one bin a value: parallel composition) whose counts times
  each bin's mean excess are added back: an estimate of the cut mass charged in the same
  query (brief idea 2; Monte Carlo over 2,000 draws of the tail noise);
- ``layers``: value layers [2^k, 2^(k+1)) (each value in one: parallel composition, each
  layer's sum at the whole ε with sensitivity its top edge), every layer above the oracle's
  cut dropped (a lower bound on any rule that keeps a layer where its noisy sum is
  significant: brief idea 4; Monte Carlo over 4,000 draws).

*Rules on the kept histogram* (draws of the ε_h = share·ε histogram, 4 bins per doubling,
as bench/sim_default_clamp.py):

- ``shipped``: the "posterior" clamp, Laplace noise (dpsql today);
- ``stair, same C``: the shipped clamp, the SUM released with staircase noise instead;
- ``stair rule``: the shipped criterion with the staircase's variance (its clamp for that
  noise) and staircase noise;
- ``stair mae``: the clamp minimising the expected |error| under the staircase (bias
  ~ Normal(posterior mean, posterior variance), 24-point Gauss-Hermite), staircase noise;
- ``noise-free``: the shipped rule fed the exact counts (no histogram noise): the
  resolution limit of 4 candidates a bin, what a larger share could at most buy.

First query: the share is paid from the query (ε_s = 1 − share); ``--shares 0.05`` gives
brief idea 1 (a smaller share for the choice on the first query).

    PYTHONPATH=bench python bench/sim_sum_families.py --draws 300
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from sim_default_clamp import UPPER, dlap
from sim_sum_correction import arguments, print_table

from dpsql.privacy.clipping import LogHistogram, posterior_candidates, posterior_counts


def lap_mae(bias: np.ndarray | float, scale: np.ndarray | float) -> np.ndarray:
    """E|β + Laplace(s)| = |β| + s·exp(−|β|/s)."""
    b = np.abs(bias)
    return b + scale * np.exp(-b / scale)


def two_lap_mae(bias: float, s1: float, s2: float) -> float:
    """E|β + L₁ + L₂| for independent Laplace(s₁), Laplace(s₂): the density of the sum is
    w₁·Lap(s₁) − w₂·Lap(s₂) with w_i = s_i²/(s₁² − s₂²) (w₁ − w₂ = 1), so the expectation
    is |β| + (s₁³ e^(−|β|/s₁) − s₂³ e^(−|β|/s₂)) / (s₁² − s₂²)."""
    if abs(s1 - s2) < 1e-4 * max(s1, s2):
        s2 = s1 * (1 + 1e-4)
    b = abs(bias)
    return b + (s1**3 * math.exp(-b / s1) - s2**3 * math.exp(-b / s2)) / (s1 * s1 - s2 * s2)


class Staircase:
    """The staircase noise for sensitivity 1 at ε (Geng & Viswanath 2016): density a·b^k on
    |x| in [k, k + γ) and a·b^(k+1) on [k + γ, k + 1), b = e^(−ε). It is non-increasing in |x|
    and f(|x| + 1) = b·f(|x|), so f(x)/f(x + d) <= e^ε for |d| <= 1: ε-DP at sensitivity 1
    (scale by Δ). E|noise| at ε = 1: 0.9595 against the Laplace's 1."""

    def __init__(self, eps: float, periods: int = 80) -> None:
        self.eps = eps
        g = 1 / (1 + math.exp(eps / 2))
        b = math.exp(-eps)
        k = np.arange(periods, dtype=np.float64)
        a = (1 - b) / (2 * (g + b * (1 - g)))
        self.lo = np.concatenate([k, k + g])
        self.hi = np.concatenate([k + g, k + 1])
        self.w = np.concatenate([a * b**k, a * b ** (k + 1)])
        grid = np.linspace(-60, 60, 24001)
        self.grid = grid
        self.table = self._mae(grid)
        self.var = float(2 * (self.w * (self.hi**3 - self.lo**3) / 3).sum())

    def _mae(self, u: np.ndarray) -> np.ndarray:
        def f(t: np.ndarray) -> np.ndarray:
            return t * np.abs(t) / 2

        u = u[:, None]
        pos = f(u + self.hi) - f(u + self.lo)
        neg = f(u - self.lo) - f(u - self.hi)
        return ((pos + neg) * self.w).sum(axis=1)

    def mae(self, bias: np.ndarray | float, delta: np.ndarray | float) -> np.ndarray:
        """E|β + Δ·S| for S the unit staircase: Δ·g(β/Δ), g tabulated (|u| beyond the table:
        |u|, the staircase's mass there is below e^-60)."""
        u = np.asarray(bias) / np.asarray(delta)
        inside = np.interp(np.clip(u, -60, 60), self.grid, self.table)
        return np.asarray(delta) * np.where(np.abs(u) >= 60, np.abs(u), inside)


def run(
    x: np.ndarray,
    share: float,
    eps_s: float,
    draws: int,
    seed: int = 1,
    families: bool = True,
    per_doubling: int = 4,
) -> dict[str, float]:
    hist = LogHistogram.for_bounds(0, UPPER, resolution=1.0, ratio=2 ** (1 / per_doubling))
    cands, excess = posterior_candidates(hist)
    xs = np.sort(x)
    csum = np.concatenate([[0.0], np.cumsum(xs)])
    total = float(csum[-1])

    def cut_at(c: np.ndarray) -> np.ndarray:
        k = np.searchsorted(xs, c)
        return total - (csum[k] + c * (xs.size - k))

    cut = cut_at(cands)
    lap_scale = cands / eps_s
    stair = Staircase(eps_s)
    out: dict[str, float] = {}

    # -- oracles of each family (data known) --
    grid = np.unique(np.concatenate([xs[xs > 0], UPPER * 2 ** (-np.arange(0, 200) / 16)]))
    out["oracle"] = float(lap_mae(cut_at(grid), grid / eps_s).min())
    out["oracle stair"] = float(stair.mae(cut_at(grid), grid).min())
    if families:  # the slow oracles of the other families
        coarse = UPPER * 2 ** (-np.arange(95, -1, -1) / 8)  # ascending 2^⅛ grid, U/4096 to U
        best = math.inf
        for e1 in np.arange(0.05, 1.0, 0.05):
            e1 = float(e1) * eps_s
            e2 = eps_s - e1
            for i, c in enumerate(coarse):
                for c2 in coarse[i + 1 :]:
                    best = min(best, two_lap_mae(float(cut_at(c2)), c / e1, (c2 - c) / e2))
        out["two-level"] = best
        out["tail fix"] = tail_fix_oracle(xs, hist, cut_at, eps_s, np.random.default_rng(seed))
        out["layers"] = layers_oracle(xs, eps_s, np.random.default_rng(seed))

    # -- rules on the kept histogram --
    counts = hist.counts(xs).astype(np.float64)
    scale = 1 / share
    gh_x, gh_w = np.polynomial.hermite_e.hermegauss(24)
    gh_w = gh_w / gh_w.sum()
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "shipped",
            "stair, same C",
            "stair rule",
            "stair mae",
            "bound bin",
            "stair, bound bin",
        )
    }
    # a histogram with one more bin, the values at the declared bound (where the engine's
    # clamp piles those beyond it), the top bin's own values log-uniform in it: each value
    # still in one bin (the same ε_h)
    at_bound = float((xs >= UPPER).sum())
    counts_b = np.concatenate([counts, [at_bound]])
    counts_b[-2] -= at_bound
    edges = hist.edges()
    t = (np.arange(8) + 0.5) / 8
    top_pts = edges[-2] * (edges[-1] / edges[-2]) ** t
    excess_b = np.concatenate([excess, (UPPER - cands)[:, None]], axis=1)
    excess_b[:, -2] = np.maximum(top_pts[None, :] - cands[:, None], 0.0).mean(axis=1)
    rng = np.random.default_rng(seed)
    rng_b = np.random.default_rng(seed + 1)  # the extra bin's noise only
    for _ in range(draws):
        y = counts + dlap(rng, scale, counts.size)
        m, v = posterior_counts(y, scale)
        bias2 = (excess @ m) ** 2 + (excess**2) @ v
        i = int(np.argmin(bias2 + 2 * lap_scale**2))
        rows["shipped"].append(float(lap_mae(cut[i], lap_scale[i])))
        rows["stair, same C"].append(float(stair.mae(cut[i], cands[i])))
        j = int(np.argmin(bias2 + stair.var * cands**2))
        rows["stair rule"].append(float(stair.mae(cut[j], cands[j])))
        mu = -(excess @ m)
        sd = np.sqrt((excess**2) @ v)
        b = mu[:, None] + sd[:, None] * gh_x[None, :]
        e = stair.mae(b, cands[:, None]) @ gh_w
        k = int(np.argmin(e))
        rows["stair mae"].append(float(stair.mae(cut[k], cands[k])))
        yb = counts_b + np.concatenate([y - counts, dlap(rng_b, scale, 1)])  # same draws
        mb, vb = posterior_counts(yb, scale)
        bias2 = (excess_b @ mb) ** 2 + (excess_b**2) @ vb
        i = int(np.argmin(bias2 + 2 * lap_scale**2))
        rows["bound bin"].append(float(lap_mae(cut[i], lap_scale[i])))
        j = int(np.argmin(bias2 + stair.var * cands**2))
        rows["stair, bound bin"].append(float(stair.mae(cut[j], cands[j])))
    for name, vals in rows.items():
        out[name] = float(np.mean(vals))
    m, v = posterior_counts(counts, scale)
    i = int(np.argmin((excess @ m) ** 2 + (excess**2) @ v + 2 * lap_scale**2))
    out["noise-free"] = float(lap_mae(cut[i], lap_scale[i]))
    return out


def tail_fix_oracle(xs, hist, cut_at, eps, rng, draws: int = 2000) -> float:
    """Clamp at C (ε₁) + Σ_{bins above C} ŷ_b ē_b(C) from a noisy tail histogram (ε₂):
    the least E|error| over C (the bins' candidates) and ε₁, chosen on the data."""
    edges = hist.edges()
    counts = hist.counts(xs).astype(np.float64)
    t = (np.arange(8) + 0.5) / 8
    best = math.inf
    for b0 in range(1, hist.bins):  # C = a bin's lower edge
        c = float(edges[b0])
        if c <= 0:
            continue
        ebar = []
        for b in range(b0, hist.bins):
            lo, hi = edges[b], edges[b + 1]
            ebar.append(float(np.maximum(lo * (hi / lo) ** t - c, 0).mean()))
        ebar_a = np.array(ebar)
        model_err = float(cut_at(np.array([c]))[0] - counts[b0:] @ ebar_a)
        for e1 in np.arange(0.1, 1.0, 0.1):
            e1 = float(e1) * eps
            z = rng.laplace(0, c / e1, draws)
            tail = dlap(rng, 1 / (eps - e1), draws * ebar_a.size).reshape(draws, -1) @ ebar_a
            best = min(best, float(np.abs(model_err + z + tail).mean()))
    return best


def layers_oracle(xs, eps, rng, draws: int = 4000) -> float:
    """Value layers [2^k, 2^(k+1)) ∩ [0, U], each released at ε with sensitivity its top
    edge, the layers above the oracle's cut dropped: the least E|error| over the cut."""
    edges = np.concatenate([[0.0], 2.0 ** np.arange(0, 19), [UPPER]])
    edges = np.unique(np.minimum(edges, UPPER))
    sums = np.array([xs[(xs >= lo) & (xs < hi)].sum() for lo, hi in itertools.pairwise(edges)])
    sums[-1] += xs[xs >= UPPER].sum()
    noise = rng.laplace(0, 1, (draws, edges.size - 1)) * (edges[1:] / eps)[None, :]
    best = math.inf
    for j in range(1, edges.size):  # keep layers 0..j-1
        dropped = float(sums[j:].sum())
        best = min(best, float(np.abs(dropped + noise[:, :j].sum(axis=1)).mean()))
    return best


def main() -> None:
    ap = arguments(__doc__, 300)
    ap.add_argument("--rules-only", action="store_true", help="skip the families' oracles")
    ap.add_argument("--bins", type=int, default=4, help="bins per doubling (the default: 4)")
    args = ap.parse_args()

    def rows(x: np.ndarray, share: float, eps_s: float, draws: int) -> dict[str, float]:
        return run(x, share, eps_s, draws, families=not args.rules_only, per_doubling=args.bins)

    print_table(rows, args)


if __name__ == "__main__":
    main()
