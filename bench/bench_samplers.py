"""Speed of the exact CSPRNG samplers beside numpy's inexact ones, measured in the same run.

For each scale: best-of-R wall time (time.perf_counter) of N draws from
- SecureNoise().discrete_laplace / discrete_gaussian (exact, bits from os.urandom), and
- numpy's geometric difference / rounded normal from a PCG64 Generator (inexact, not a CSPRNG),
then prints seconds and the ratio exact / numpy (wall clock), plus the CPU seconds of each.

    python bench/bench_samplers.py                 # 1,000,000 draws, best of 3
    python bench/bench_samplers.py --n 200000 --repeats 5 --scales 1 1000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dpsql.privacy.samplers import SecureNoise


def best_of(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best wall time (perf_counter) and best CPU time (process_time) over ``repeats`` runs;
    the CPU figure shows how much of the wall time was lost to other processes."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def numpy_laplace(rng: np.random.Generator, scale: float, n: int) -> np.ndarray:
    p = -np.expm1(-1.0 / scale)
    return rng.geometric(p, n) - rng.geometric(p, n)


def numpy_gaussian(rng: np.random.Generator, sigma: float, n: int) -> np.ndarray:
    return np.rint(rng.normal(0.0, sigma, n)).astype(np.int64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="draws per timing")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument(
        "--scales",
        type=float,
        nargs="+",
        default=[0.5, 1.0, 30.0, 1000.0, 1e6],
        help="Laplace scales and Gaussian sigmas, in noise units",
    )
    args = parser.parse_args(argv)
    secure = SecureNoise()
    rng = np.random.default_rng()
    secure.discrete_laplace(1.0, 1000)  # warm caches (Bernoulli tables)
    print(f"{args.n:,} draws, best of {args.repeats}; exact = SecureNoise (os.urandom)")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(
        f"{'sampler':<18}{'scale':>10}{'exact s':>10}{'numpy s':>10}{'ratio':>8}"
        f"{'exact cpu s':>13}{'numpy cpu s':>13}"
    )
    for name, exact, inexact in (
        ("discrete_laplace", secure.discrete_laplace, numpy_laplace),
        ("discrete_gaussian", secure.discrete_gaussian, numpy_gaussian),
    ):
        for scale in args.scales:
            t_exact, c_exact = best_of(lambda e=exact, s=scale: e(s, args.n), args.repeats)
            t_numpy, c_numpy = best_of(lambda f=inexact, s=scale: f(rng, s, args.n), args.repeats)
            print(
                f"{name:<18}{scale:>10g}{t_exact:>10.3f}{t_numpy:>10.3f}"
                f"{t_exact / t_numpy:>8.1f}{c_exact:>13.3f}{c_numpy:>13.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
