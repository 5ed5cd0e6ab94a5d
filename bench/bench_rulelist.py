"""Memory and time of one rule-list fit over the number of rows and of candidates.

    python bench/bench_rulelist.py                       # default grid, synthetic data
    python bench/bench_rulelist.py --rows 20000,200000 --cards 2,3 --mechanism smooth_laplace
    python bench/bench_rulelist.py --adult /work/shared  # Adult's binarised rows, resampled

Each configuration runs in a fresh Python process, which reports its own peak RSS
(``ru_maxrss``, includes the interpreter and numpy, ≈ 40 MB) and the wall time of: grouping
rows into patterns, building the counter, learning (L = 7, ε = 1).  Synthetic data: 20 binary
features, each 1 with probability 0.1 independently, y = x0 or (x1 and x2) with 10% flipped,
so the number of distinct patterns grows sub-linearly in n.  20 features give 800 candidates
with max_card 2 and 9,920 with max_card 3.  ``BENCH_RULELIST_OLD=1`` with ``PYTHONPATH`` set
to an older checkout times its row-per-sample learner instead.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if not os.environ.get("BENCH_RULELIST_OLD"):
    sys.path.insert(0, str(ROOT))


def synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = np.empty((n, 20), dtype=np.uint8)
    for j in range(20):  # column by column: the generator should not dominate the peak RSS
        X[:, j] = rng.random(n) < 0.1
    y = (X[:, 0] | (X[:, 1] & X[:, 2])).astype(np.int8)
    return X, np.where(rng.random(n) < 0.1, 1 - y, y).astype(np.int8)


def adult(data: Path, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_rulelist_repro import load

    X, y, _ = load(data, "adult")
    idx = np.random.default_rng(seed).integers(0, len(y), n)
    return X[idx], y[idx]


def child(n: int, card: int, mechanism: str, data: str | None) -> None:
    from dpsql.privacy.samplers import SeededNoise

    X, y = synthetic(n) if data is None else adult(Path(data), n)
    if os.environ.get("BENCH_RULELIST_OLD"):  # the pre-pattern learner, for a before figure
        return child_rows(X, y, card, mechanism)
    from dpsql.rulelist.candidates import Feature, Patterns, RuleCounter, public_candidates
    from dpsql.rulelist.learner import LearnerParams, learn_patterns

    feats = [Feature.binary_column(f"x{j}") for j in range(X.shape[1])]
    rules = public_candidates(feats, card)
    t0 = time.perf_counter()
    pats = Patterns.from_rows(X, y)
    t1 = time.perf_counter()
    counter = RuleCounter(pats.X, rules)
    t2 = time.perf_counter()
    params = LearnerParams(epsilon=1.0, delta=1.0 / n**2, max_length=7, mechanism=mechanism)
    rl = learn_patterns(pats, feats, rules, params, SeededNoise(1), counter=counter)
    t3 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "rows": n,
                "features": X.shape[1],
                "patterns": int(pats.X.shape[0]),
                "candidates": len(rules),
                "patterns_s": t1 - t0,
                "counter_s": t2 - t1,
                "learn_s": t3 - t2,
                "rules": len(rl.rules),
                "peak_rss_mb": rss,
            }
        )
    )


def child_rows(X: np.ndarray, y: np.ndarray, card: int, mechanism: str) -> None:
    """Time and peak RSS of a code base whose learner takes one row per sample."""
    from dpsql.privacy.samplers import SeededNoise
    from dpsql.rulelist.candidates import Feature, public_candidates
    from dpsql.rulelist.learner import LearnerParams, learn

    n = X.shape[0]
    feats = [Feature.binary_column(f"x{j}") for j in range(X.shape[1])]
    rules = public_candidates(feats, card)
    t0 = time.perf_counter()
    params = LearnerParams(epsilon=1.0, delta=1.0 / n**2, max_length=7, mechanism=mechanism)
    rl = learn(X, y, feats, rules, params, SeededNoise(1))
    t1 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "rows": n,
                "features": X.shape[1],
                "patterns": n,
                "candidates": len(rules),
                "patterns_s": 0.0,
                "counter_s": 0.0,
                "learn_s": t1 - t0,
                "rules": len(rl.rules),
                "peak_rss_mb": rss,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="20000,200000,2000000")
    ap.add_argument("--cards", default="2,3")
    ap.add_argument("--mechanism", default="monotone_em")
    ap.add_argument("--adult", default=None, help="directory with datasets/rulelist (resampled)")
    ap.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.mechanism, args.adult)
        return
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, {args.mechanism}")
    print("| rows | patterns | candidates | patterns s | counter s | learn s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    from dpsql.terminal import fit_progress

    grid = [(int(card), int(n)) for card in args.cards.split(",") for n in args.rows.split(",")]
    with fit_progress(len(grid), "grid", True) as advance:  # a bar on a terminal's stderr
        for card, n in grid:
            cmd = [sys.executable, __file__, "--child", str(n), str(card)]
            cmd += ["--mechanism", args.mechanism]
            if args.adult:
                cmd += ["--adult", args.adult]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
            print(
                f"| {out['rows']:,} | {out['patterns']:,} | {out['candidates']:,} | "
                f"{out['patterns_s']:.3f} | {out['counter_s']:.3f} | {out['learn_s']:.3f} | "
                f"{out['peak_rss_mb']:.0f} |"
            )
            advance()
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
