"""Accuracy and R² of dpsql's DP regressions against ε, next to non-private fits and diffprivlib.

    python bench/bench_regression.py               # fixture + synthetic (+ Adult if found)
    python bench/bench_regression.py --data /work/shared/datasets/rulelist/adult_binarized.csv
    python bench/bench_regression.py --reps 10 --epsilons 0.5,1,2,8 --json out.json

Datasets:

- **Adult** (``--data``, binarised: 24 0/1 features, label ``income``): classification accuracy
  on a held-out 20%, for DP-SGD logistic regression, a linear-probability classifier from
  noisy sufficient statistics (predict 1 iff the fitted value >= 0.5), non-private logistic
  regression (scikit-learn, default C = 1) and diffprivlib's LogisticRegression
  (``data_norm = √24``, the largest norm of a 0/1 row; ε-DP).
- **fixture** (``fixtures/visits.csv``): R² of cost ~ age + smoker + department (cost bounds
  [0, 5000] and the rest as declared in ``fixtures/visits.toml``). The synthetic fixture has no
  signal (cost is drawn independently), so the non-private R² is ≈ 0 and the figure measures
  how much the noise costs. Two privacy units: a row (as diffprivlib) and a patient with up
  to 5 visits (as the SQL function charges it).
- **synthetic** (100,000 rows, y = 3 + 2x₀ − 4x₁ + 0.5x₂ + N(0, 1)): R² and fit time at the
  size the issue asks about.

Every DP method is (ε, δ = 1e-6) for dpsql and ε-DP for diffprivlib (it spends no δ). Each
cell is the mean ± standard deviation over ``--reps`` splits/seeds. Install diffprivlib with
``pip install diffprivlib`` (not a dependency of dpsql); without it its columns are skipped.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpsql.models.regression import DPLinearRegression, DPLogisticRegression  # noqa: E402
from dpsql.privacy.spend import UnrecordedSpendWarning  # noqa: E402

# The bench fits on public benchmark data and charges no analyst: its spend is not a ledger's.
warnings.simplefilter("ignore", UnrecordedSpendWarning)

DELTA = 1e-6
DEFAULT_ADULT = Path("/work/shared/datasets/rulelist/adult_binarized.csv")


def _import_diffprivlib():
    """diffprivlib.models, or None. Its forest module does not import under scikit-learn >= 1.8
    (sklearn.tree._tree.DOUBLE is gone), and the package imports it eagerly: a stub stands in
    for the forest, which this bench does not use."""
    import types

    try:
        import diffprivlib.models as models  # type: ignore[import-not-found]

        return models
    except ImportError:
        pass
    stub = types.ModuleType("diffprivlib.models.forest")
    stub.RandomForestClassifier = stub.DecisionTreeClassifier = None  # type: ignore[attr-defined]
    sys.modules["diffprivlib.models.forest"] = stub
    try:
        import diffprivlib.models as models  # type: ignore[import-not-found]

        models.LogisticRegression(epsilon=1.0, data_norm=1.0)  # TypeError on scikit-learn >= 1.8
        return models
    except (ImportError, TypeError):  # pragma: no cover - optional
        return None


dpl = _import_diffprivlib()
DPL_PYTHON: str | None = None  # --diffprivlib-python: fit diffprivlib in that interpreter

# Run by --diffprivlib-python: diffprivlib 0.6 needs scikit-learn < 1.6 (it passes
# multi_class, removed in 1.8, to LogisticRegression), so it lives in its own venv.
_REMOTE = """
import json, sys, warnings
import numpy as np
import diffprivlib.models as dpl
d = np.load(sys.argv[1])
task, X, y, bounds_lo, bounds_hi, ylo, yhi = (str(d["task"]), d["X"], d["y"], d["lo"], d["hi"],
                                             float(d["ylo"]), float(d["yhi"]))
out = {}
warnings.simplefilter("ignore")
for eps in d["eps"]:
    scores = []
    for tr, te in zip(d["train"], d["test"]):
        if task == "logistic":
            m = dpl.LogisticRegression(epsilon=float(eps), data_norm=float(np.sqrt(X.shape[1])))
            scores.append(float(m.fit(X[tr], y[tr]).score(X[te], y[te])))
        else:
            m = dpl.LinearRegression(epsilon=float(eps), bounds_X=(bounds_lo, bounds_hi),
                                     bounds_y=(ylo, yhi)).fit(X[tr], y[tr])
            p = m.predict(X[te])
            scores.append(float(1 - ((y[te] - p) ** 2).sum() / ((y[te] - y[te].mean()) ** 2).sum()))
    out[repr(float(eps))] = scores
print(json.dumps(out))
"""


def diffprivlib_scores(task: str, X, y, bounds, label_bounds, epsilons, reps) -> dict | None:
    """{ε: [score per rep]} from diffprivlib in --diffprivlib-python, or None without it."""
    if DPL_PYTHON is None:
        return None
    import subprocess
    import tempfile

    splits = [split(len(y), rep) for rep in range(reps)]
    lo, hi = bounds if bounds is not None else (np.zeros(X.shape[1]), np.ones(X.shape[1]))
    ylo, yhi = label_bounds if label_bounds is not None else (0.0, 1.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.npz"
        np.savez(
            path, task=task, X=X, y=y, lo=np.asarray(lo, float), hi=np.asarray(hi, float),
            ylo=ylo, yhi=yhi, eps=np.asarray(epsilons, float),
            train=np.array([t for t, _ in splits]), test=np.array([t for _, t in splits]),
        )  # fmt: skip
        done = subprocess.run(
            [DPL_PYTHON, "-c", _REMOTE, str(path)], capture_output=True, text=True, check=True
        )
    return {float(k): v for k, v in json.loads(done.stdout).items()}


def load_adult(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd

    df = pd.read_csv(path)
    y = df.pop("income").to_numpy(dtype=np.float64)
    return df.to_numpy(dtype=np.float64), y


def load_fixture() -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple, tuple]:
    import pandas as pd

    df = pd.read_csv(ROOT / "fixtures" / "visits.csv").dropna(subset=["cost"])
    departments = sorted(df.department.unique())
    dummies = np.column_stack([(df.department == d).to_numpy(float) for d in departments[1:]])
    X = np.column_stack([df.age.to_numpy(float), df.smoker.astype(float).to_numpy(), dummies])
    bounds = ([0.0, 0.0] + [0.0] * dummies.shape[1], [100.0, 1.0] + [1.0] * dummies.shape[1])
    return X, df.cost.to_numpy(float), df.patient_id.to_numpy(), bounds, (0.0, 5000.0)


def synthetic(n: int = 100_000, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = np.column_stack([rng.uniform(0, 10, n), rng.integers(0, 2, n), rng.uniform(-5, 5, n)])
    y = np.clip(3 + 2 * X[:, 0] - 4 * X[:, 1] + 0.5 * X[:, 2] + rng.normal(0, 1, n), -20, 40)
    return X, y, ([0, 0, -5], [10, 1, 5]), (-20.0, 40.0)


def r2(y: np.ndarray, pred: np.ndarray) -> float:
    return float(1 - np.sum((y - pred) ** 2) / np.sum((y - y.mean()) ** 2))


def split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(seed).permutation(n)
    cut = int(0.8 * n)
    return idx[:cut], idx[cut:]


def cell(values: list[float]) -> str:
    return f"{np.mean(values):.4f} ± {np.std(values):.4f}"


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def bench_adult(path: Path, epsilons: list[float], reps: int) -> dict:
    from sklearn.linear_model import LogisticRegression

    X, y = load_adult(path)
    out: dict = {"rows": len(y), "features": X.shape[1], "non_private": [], "cells": {}}
    for rep in range(reps):
        tr, te = split(len(y), rep)
        out["non_private"].append(
            LogisticRegression(max_iter=1000).fit(X[tr], y[tr]).score(X[te], y[te])
        )
    for eps in epsilons:
        res: dict[str, list[float]] = {"dpsgd": [], "sufficient_stats": [], "diffprivlib": []}
        times: dict[str, list[float]] = {k: [] for k in res}
        for rep in range(reps):
            tr, te = split(len(y), rep)
            start = time.perf_counter()
            # Adult's features are 0/1 indicators: [0, 1] is their public range
            sgd = DPLogisticRegression(epsilon=eps, delta=DELTA, bounds=(0, 1)).fit(X[tr], y[tr])
            times["dpsgd"].append(time.perf_counter() - start)
            res["dpsgd"].append(sgd.score(X[te], y[te]))
            start = time.perf_counter()
            lin = DPLinearRegression(
                epsilon=eps, delta=DELTA, bounds=(0, 1), label_bounds=(0, 1), intervals=False
            )
            lin.fit(X[tr], y[tr])
            times["sufficient_stats"].append(time.perf_counter() - start)
            res["sufficient_stats"].append(float(np.mean((lin.predict(X[te]) >= 0.5) == y[te])))
            if dpl is not None and DPL_PYTHON is None:
                start = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    clf = dpl.LogisticRegression(epsilon=eps, data_norm=float(np.sqrt(X.shape[1])))
                    clf.fit(X[tr], y[tr])
                times["diffprivlib"].append(time.perf_counter() - start)
                res["diffprivlib"].append(float(clf.score(X[te], y[te])))
        out["cells"][eps] = {
            k: {
                "mean": float(np.mean(v)),
                "std": float(np.std(v)),
                "fit_s": float(np.mean(times[k])),
            }
            for k, v in res.items()
            if v
        }
    remote = diffprivlib_scores("logistic", X, y, None, None, epsilons, reps)
    for eps, scores in (remote or {}).items():
        out["cells"][eps]["diffprivlib"] = {
            "mean": float(np.mean(scores)),
            "std": float(np.std(scores)),
        }
    print("[adult] done", file=sys.stderr)
    return out


def _linear_methods(X, y, groups, bounds, label_bounds, eps: float, tr, te) -> dict[str, float]:
    got: dict[str, float] = {}
    for name, method, R in (
        ("sufficient_stats", "sufficient_stats", 1),
        ("dpsgd", "dpsgd", 1),
        ("sufficient_stats_R5", "sufficient_stats", 5),
        ("dpsgd_R5", "dpsgd", 5),
    ):
        if R > 1 and groups is None:
            continue
        est = DPLinearRegression(
            epsilon=eps, delta=DELTA, method=method, bounds=bounds, label_bounds=label_bounds,
            rows_per_unit=R, intervals=False,
        )  # fmt: skip
        est.fit(X[tr], y[tr], groups=None if R == 1 else groups[tr])
        got[name] = r2(y[te], est.predict(X[te]))
    if dpl is not None and DPL_PYTHON is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lr = dpl.LinearRegression(
                epsilon=eps,
                bounds_X=(np.asarray(bounds[0], float), np.asarray(bounds[1], float)),
                bounds_y=label_bounds,
            ).fit(X[tr], y[tr])
        got["diffprivlib"] = r2(y[te], lr.predict(X[te]))
    return got


def bench_linear(name: str, data, epsilons: list[float], reps: int) -> dict:
    from sklearn.linear_model import LinearRegression

    X, y, groups, bounds, label_bounds = data
    out: dict = {"rows": len(y), "non_private": [], "cells": {}, "fit_s": {}}
    for rep in range(reps):
        tr, te = split(len(y), rep)
        out["non_private"].append(r2(y[te], LinearRegression().fit(X[tr], y[tr]).predict(X[te])))
    for eps in epsilons:
        acc: dict[str, list[float]] = {}
        for rep in range(reps):
            tr, te = split(len(y), rep)
            for k, v in _linear_methods(X, y, groups, bounds, label_bounds, eps, tr, te).items():
                acc.setdefault(k, []).append(v)
        out["cells"][eps] = {
            k: {"mean": float(np.mean(v)), "std": float(np.std(v))} for k, v in acc.items()
        }
    remote = diffprivlib_scores("linear", X, y, bounds, label_bounds, epsilons, reps)
    for eps, scores in (remote or {}).items():
        out["cells"][eps]["diffprivlib"] = {
            "mean": float(np.mean(scores)),
            "std": float(np.std(scores)),
        }
    # Fit time on all rows at ε = 1, one fit each (and a logistic fit on y > median).
    fits = {
        "sufficient_stats": DPLinearRegression(
            epsilon=1.0, delta=DELTA, bounds=bounds, label_bounds=label_bounds
        ),
        "dpsgd": DPLinearRegression(
            epsilon=1.0, delta=DELTA, method="dpsgd", bounds=bounds, label_bounds=label_bounds
        ),
        "dpsgd_logistic": DPLogisticRegression(epsilon=1.0, delta=DELTA, bounds=bounds),
    }
    for key, est in fits.items():
        target = y > np.median(y) if key == "dpsgd_logistic" else y
        start = time.perf_counter()
        est.fit(X, target)
        out["fit_s"][key] = time.perf_counter() - start
    print(f"[{name}] done", file=sys.stderr)
    return out


def report(results: dict, epsilons: list[float]) -> str:
    lines = []
    if "adult" in results:
        a = results["adult"]
        lines.append(
            f"Adult ({a['rows']} rows, {a['features']} features): test accuracy, "
            f"non-private logistic {cell(a['non_private'])}"
        )
        lines.append("| ε | DP-SGD logistic | suff. stats (linear prob.) | diffprivlib LR |")
        lines.append("|---|---|---|---|")
        for eps in epsilons:
            c = a["cells"][eps]
            row = [f"{c[k]['mean']:.4f} ± {c[k]['std']:.4f}" if k in c else "—"
                   for k in ("dpsgd", "sufficient_stats", "diffprivlib")]  # fmt: skip
            lines.append(f"| {eps:g} | " + " | ".join(row) + " |")
        c1 = a["cells"][epsilons[0]]
        lines.append(
            "fit time (s, mean): "
            + ", ".join(f"{k} {v['fit_s']:.3f}" for k, v in c1.items() if "fit_s" in v)
        )
    for name in ("fixture", "synthetic"):
        if name not in results:
            continue
        r = results[name]
        lines.append("")
        lines.append(
            f"{name} ({r['rows']} rows): test R², non-private OLS {cell(r['non_private'])}"
        )
        keys = list(next(iter(r["cells"].values())))
        lines.append("| ε | " + " | ".join(keys) + " |")
        lines.append("|---|" + "---|" * len(keys))
        for eps in epsilons:
            c = r["cells"][eps]
            lines.append(
                f"| {eps:g} | "
                + " | ".join(f"{c[k]['mean']:.4f} ± {c[k]['std']:.4f}" for k in keys)
                + " |"
            )
        lines.append(
            "fit time on all rows at ε = 1 (s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["fit_s"].items())
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="Adult's binarised CSV")
    parser.add_argument("--epsilons", default="0.5,1,2,8")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip", default="", help="comma list of adult,fixture,synthetic")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--diffprivlib-python", default=None, help="a Python with diffprivlib (own venv)"
    )
    args = parser.parse_args(argv)
    global DPL_PYTHON
    DPL_PYTHON = args.diffprivlib_python
    epsilons = [float(e) for e in args.epsilons.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    data = args.data or (DEFAULT_ADULT if DEFAULT_ADULT.exists() else None)
    results: dict = {}
    load = os.getloadavg()
    if data is not None and "adult" not in skip:
        results["adult"] = bench_adult(data, epsilons, args.reps)
    if "fixture" not in skip:
        results["fixture"] = bench_linear("fixture", load_fixture(), epsilons, args.reps)
    if "synthetic" not in skip:
        X, y, bounds, lb = synthetic()
        results["synthetic"] = bench_linear(
            "synthetic", (X, y, None, bounds, lb), epsilons, args.reps
        )
    results["load_before"] = load
    results["load_after"] = os.getloadavg()
    print(report(results, epsilons))
    print(f"\nload average before {load[0]:.2f}, after {results['load_after'][0]:.2f} "
          f"(1 min); diffprivlib {DPL_PYTHON or ('in process' if dpl else 'absent')}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
