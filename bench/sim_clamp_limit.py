"""How low can the default clamp's SUM error go on PUMS at ε_h? A linear-programming bound over
every ε_h-DP clamp choice (issue 31 item 7, seventh session, 2026-12-07).

The default clamp of a total is chosen from an ε_h-DP release (the kept histogram, ε_h =
``bounds_share`` · ε); the SUM is then released at ε_s with the staircase noise at that clamp
(dpsql today). Whatever the release and the rule reading it, the clamp C is an ε_h-DP function
of the data: for data sets D, D' differing by one unit (add/remove, R = 1) and every C,
P_D(C) <= e^(ε_h) P_D'(C). Take a family of data sets chained by such neighbours — PUMS income
(1,000 people), PUMS plus k more incomes at the declared bound 500,000 (k = 1..K: a column
top-coded at its bound) and PUMS without its m largest incomes (m = 1..M) — and clamps on a
fine grid (ratio 2^(1/32) from 50,000 to 500,000, plus every income above 50,000: the error's
kinks; a clamp below 50,000 errs more on every member than one at 50,000, and rounding a clamp
to the grid is post-processing). The variables are the choice's distribution p_D(C) on each
member; the constraints are the DP inequalities between chained neighbours (necessary for any
ε_h-DP rule, so the LP's least is a lower bound) and a cap on each other member's expected error
E|bias_D(C) + X_C| (the staircase of period C at ε_s, exact, bench/sim_sum_families.py); the
objective is PUMS's expected error. So the answer reads: *no ε_h-DP choice of the clamp errs
less on PUMS than this while erring at most the cap on every member*.

Caps (``--caps``): ``T+,T-``: T+ times the member's oracle on "PUMS + k at the bound" and T- on
"PUMS minus its top m"; or ``shipped``: the shipped rule's own expected error on each member
(bench/sim_default_clamp.py's "posterior", ``--draws`` simulated histograms each, the same ε_h
and ε_s): the least error on PUMS of any rule at least as good as dpsql's everywhere on the family
(its Monte Carlo error moves this bound: 300 draws a member read 4.28e5 for
PUMS's later query where 2,000 give 4.17e5; the round-number caps are exact).

    python bench/sim_clamp_limit.py                                   # later and first, 0.1
    python bench/sim_clamp_limit.py --caps shipped --draws 2000 --queries later
    python bench/sim_clamp_limit.py --caps 1.35,1.7 --caps 1.5,1.7 --shares 0.1,0.2
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix
from sim_default_clamp import PUMS, UPPER, columns, dlap
from sim_sum_families import Staircase

from dpsql.privacy.clipping import LogHistogram, posterior_candidates, posterior_counts


def family(x: np.ndarray, k_max: int, m_max: int) -> dict[str, tuple[np.ndarray, str | None]]:
    """Members by name: (values, the neighbour it is chained to: one unit away)."""
    xs = np.sort(x)
    out: dict[str, tuple[np.ndarray, str | None]] = {"pums": (xs, None)}
    for k in range(1, k_max + 1):
        out[f"+{k}"] = (np.concatenate([xs, np.full(k, UPPER)]), f"+{k - 1}" if k > 1 else "pums")
    for m in range(1, m_max + 1):
        out[f"-{m}"] = (xs[:-m], f"-{m - 1}" if m > 1 else "pums")
    return out


def errors(xs: np.ndarray, clamps: np.ndarray, stair: Staircase) -> np.ndarray:
    """E|bias(C) + staircase(C/ε_s)| for each clamp C (exact)."""
    csum = np.concatenate([[0.0], np.cumsum(xs)])
    k = np.searchsorted(xs, clamps)
    cut = csum[-1] - (csum[k] + clamps * (xs.size - k))
    return stair.mae(cut, clamps)


def shipped_errors(members: dict, eps_h: float, stair: Staircase, draws: int) -> dict[str, float]:
    """The shipped "posterior" rule's expected error on each member (simulated histograms)."""
    hist = LogHistogram.for_bounds(0, UPPER, resolution=1.0, ratio=2**0.25)
    cands, excess = posterior_candidates(hist)
    out = {}
    for name, (xs, _) in members.items():
        counts = hist.counts(xs).astype(np.float64)
        rng = np.random.default_rng(1)
        chosen = []
        for _ in range(draws):
            m, v = posterior_counts(counts + dlap(rng, 1 / eps_h, counts.size), 1 / eps_h)
            crit = (excess @ m) ** 2 + (excess**2) @ v + 2 * (cands / stair.eps) ** 2
            chosen.append(cands[int(np.argmin(crit))])
        out[name] = float(errors(xs, np.array(chosen), stair).mean())
    return out


def program(
    members: dict, clamps: np.ndarray, eps_h: float, stair: Staircase, caps: dict[str, float]
) -> tuple:
    """The LP over p = (p_D(C)) in member order: (objective, A_ub, b_ub, A_eq, b_eq), errors in
    units of 1e5. Rows of A_ub: p_D(C) − e^(ε_h) p_D'(C) <= 0 both ways for chained neighbours,
    then Σ_C p_D(C) err_D(C) <= caps[D] for each D but the base ("pums"); A_eq: Σ_C p_D(C) = 1."""
    names = list(members)
    at = {n: i for i, n in enumerate(names)}
    d, c = len(names), clamps.size
    loss = np.array([errors(members[n][0], clamps, stair) for n in names]) / 1e5
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []
    q = math.exp(eps_h)
    for name, (_, nb) in members.items():
        if nb is None:
            continue
        for a, b in ((at[name], at[nb]), (at[nb], at[name])):
            for j in range(c):
                rows += [len(rhs), len(rhs)]
                cols += [a * c + j, b * c + j]
                vals += [1.0, -q]
                rhs.append(0.0)
    for i, name in enumerate(names[1:], start=1):
        rows += [len(rhs)] * c
        cols += list(range(i * c, (i + 1) * c))
        vals += list(loss[i])
        rhs.append(caps[name] / 1e5)
    a_ub = coo_matrix((vals, (rows, cols)), shape=(len(rhs), d * c)).tocsr()
    a_eq = coo_matrix(
        (np.ones(d * c), (np.repeat(np.arange(d), c), np.arange(d * c))), shape=(d, d * c)
    ).tocsr()
    objective = np.zeros(d * c)
    objective[:c] = loss[0]
    return objective, a_ub, np.array(rhs), a_eq, np.ones(d)


def bound(
    members: dict, clamps: np.ndarray, eps_h: float, stair: Staircase, caps: dict[str, float]
) -> float:
    """The LP's least: E_PUMS[error] over every p in :func:`program`; NaN where infeasible."""
    objective, a_ub, b_ub, a_eq, b_eq = program(members, clamps, eps_h, stair, caps)
    res = linprog(objective, a_ub, b_ub, a_eq, b_eq, bounds=(0, None), method="highs")
    return float(res.fun) * 1e5 if res.status == 0 else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shares", default="0.1", help="ε_h values (ε = 1)")
    ap.add_argument("--queries", default="later,first", help="later (ε_s = 1), first (1 − ε_h)")
    ap.add_argument("--caps", action="append", help="'T+,T-' or 'shipped' (repeatable)")
    ap.add_argument("--draws", type=int, default=1000, help="histograms per member (shipped)")
    ap.add_argument("--k-max", type=int, default=30, help="incomes added at the bound")
    ap.add_argument("--m-max", type=int, default=16, help="top incomes removed")
    args = ap.parse_args()
    if not PUMS.exists():
        raise SystemExit(f"needs {PUMS}")
    members = family(columns()["pums income"], args.k_max, args.m_max)
    xs = members["pums"][0]
    grid = UPPER * 2 ** (-np.arange(0, 110) / 32)
    clamps = np.unique(np.concatenate([grid[grid >= 5e4], xs[xs >= 5e4]]))
    print("| ε_h | query | caps | oracle | shipped rule | least error of any ε_h-DP choice |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for eps_h in (float(s) for s in args.shares.split(",")):
        for query in args.queries.split(","):
            stair = Staircase(1.0 if query == "later" else round(1 - eps_h, 6))
            oracle = {
                n: float(errors(v, np.unique(np.concatenate([grid, v[v > 0]])), stair).min())
                for n, (v, _) in members.items()
            }
            shipped = shipped_errors(members, eps_h, stair, args.draws)
            for spec in args.caps or ["1.35,1.7", "shipped"]:
                if spec == "shipped":
                    caps = shipped
                else:
                    plus, minus = (float(t) for t in spec.split(","))
                    caps = {n: (plus if n[0] == "+" else minus) * o for n, o in oracle.items()}
                worst_plus = max(shipped[n] / oracle[n] for n in members if n[0] == "+")
                worst_minus = max(shipped[n] / oracle[n] for n in members if n[0] == "-")
                least = bound(members, clamps, eps_h, stair, caps)
                print(
                    f"| {eps_h:g} | {query} | {spec} | {oracle['pums']:.3g} | "
                    f"{shipped['pums']:.3g} (worst ratio +k {worst_plus:.2f}, −m "
                    f"{worst_minus:.2f}) | {least:.3g} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
