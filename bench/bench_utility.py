"""Utility benchmark: error of DP answers on the PUMS sample at ε ∈ {0.1, 1, 10}.

Two kinds of rows:

- ``SQL``: the query through ``dpsql.connect`` as it is today (fresh noise per repetition:
  no answer cache, a seeded exact noise source);
- ``mechanism only, not yet wired through SQL``: the new mechanisms of dpsql/privacy
  (quantiles.py, clipping.py, partition.py) applied directly to counts computed with DuckDB,
  exactly the inputs the engine will compute for them.

Each figure is over ``--reps`` repetitions (200 for the published figures; the default keeps a
run short): the mean relative error |released − true| / |true| (averaged over groups for
grouped queries), the bias (mean signed relative error), and for non-public GROUP BY keys the
share of true groups suppressed.

    python bench/bench_utility.py --reps 200               # the figures in docs/mechanisms.md
    python bench/bench_utility.py --data /path/to/pums     # PUMS_pid.csv in that directory
    python bench/bench_utility.py --reps 200 --sql-only --match educ --epsilons 1
                                   # suppression and AVG by educ through SQL, each selection
    python bench/bench_utility.py --reps 200 --auto-bounds --epsilons 1
                                   # the defaults (R, G, clip "auto") against hand-set bounds
                                   # on the fixture and on PUMS_dup (1-4 rows per pid)

Non-public GROUP BY rows run once per ``partition_selection`` (auto, threshold, optimal);
``--baseline`` runs the SQL rows without that setting (for a tree before it existed: copy
this file into that tree and run it there, to measure "before").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402

import dpsql  # noqa: E402
from dpsql.plan.sharing import threshold_suppression  # noqa: E402
from dpsql.privacy.clipping import ApproxBounds, LogHistogram  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402
from dpsql.privacy.mechanisms import Laplace, threshold_below  # noqa: E402
from dpsql.privacy.partition import (  # noqa: E402
    GaussianSelection,
    OptimalSelection,
    expected_suppression,
)
from dpsql.privacy.quantiles import (  # noqa: E402
    ExponentialQuantile,
    Grid,
    SmoothMedian,
    target,
)
from dpsql.privacy.samplers import SeededNoise  # noqa: E402

EPSILONS = (0.1, 1.0, 10.0)
DELTA = 1e-6
SQL = "SQL"
MECH = "mechanism only, not yet wired through SQL"


@dataclass
class Row:
    query: str
    epsilon: float
    method: str
    path: str
    rel_error: float
    bias: float
    suppressed: float | None
    reps: int


def policy(csv: Path, epsilon: float, delta: float = DELTA) -> dict:
    columns = {
        "pid": {"type": "int", "nullable": False},
        "age": {"type": "int", "lower": 0, "upper": 100, "nullable": False},
        "income": {
            "type": "float",
            "lower": 0,
            "upper": 500_000,
            "nullable": False,
            "quantile_grid": "log",  # skewed: constant relative resolution for MEDIAN
            "quantile_bins": 8192,
        },
        "educ": {"type": "int", "nullable": False},
    }
    declared = dict(columns, educ={"type": "int", "values": list(range(1, 17)), "nullable": False})
    clipped = {**columns, "income": {**columns["income"], "clip": "auto"}}
    declared_clipped = {
        **declared,
        "income": {**clipped["income"], "clip_method": "quantile", "clip_quantile": 0.9},
    }
    return {
        "privacy": {
            "epsilon": epsilon,
            "delta": delta,
            "budget_epsilon": 1e12,
            "budget_delta": 0.5,
        },
        # PUMS_pid has one row per pid: declared primary_key, so R = G = 1 (an unstated bound
        # of a unit with several rows would be "auto", chosen per analyst and data version)
        "tables": {
            name: {"source": str(csv), "privacy_unit": "pid", "primary_key": "pid", "columns": c}
            for name, c in (
                ("pums", columns),
                ("pumsd", declared),
                ("pumsc", clipped),
                ("pumsdc", declared_clipped),
            )
        },
    }


def truth(con: duckdb.DuckDBPyConnection, sql: str) -> dict:
    return {r[0]: float(r[1]) for r in con.execute(sql).fetchall()}


def errors(released: dict, true: dict) -> tuple[float, float, float]:
    """(mean |rel error| over released true groups, mean signed, share of true groups missing)."""
    common = [k for k in true if k in released]
    if not common:
        return math.nan, math.nan, 1.0
    rel = [(released[k] - true[k]) / abs(true[k]) for k in common if true[k] != 0]
    missing = 1 - len(common) / len(true)
    return float(np.mean(np.abs(rel))), float(np.mean(rel)), missing


def summarise(query, eps, method, path, samples, reps, grouped=False) -> Row:
    rel = np.array([s[0] for s in samples], dtype=float)
    bias = np.array([s[1] for s in samples], dtype=float)
    sup = np.array([s[2] for s in samples], dtype=float)
    return Row(
        query,
        eps,
        method,
        path,
        float(np.nanmean(rel)),
        float(np.nanmean(bias)),
        float(sup.mean()) if grouped else None,
        reps,
    )


SQL_QUERIES = [
    ("COUNT(*)", "SELECT 0, COUNT(*) FROM pums", "SELECT 0, COUNT(*) FROM t", False),
    ("SUM(income)", "SELECT 0, SUM(income) FROM pums", "SELECT 0, SUM(income) FROM t", False),
    (
        "AVG(income) BY educ (declared domain)",
        "SELECT educ, AVG(income) FROM pumsd GROUP BY educ",
        "SELECT educ, AVG(income) FROM t GROUP BY educ",
        False,
    ),
    (
        "histogram COUNT(*) BY educ (declared domain)",
        "SELECT educ, COUNT(*) FROM pumsd GROUP BY educ",
        "SELECT educ, COUNT(*) FROM t GROUP BY educ",
        False,
    ),
    ("VAR_SAMP(age)", "SELECT 0, VAR_SAMP(age) FROM pums", "SELECT 0, VAR_SAMP(age) FROM t", False),
    (
        "COUNT(*) BY educ (no domain)",
        "SELECT educ, COUNT(*) FROM pums GROUP BY educ",
        "SELECT educ, COUNT(*) FROM t GROUP BY educ",
        True,
    ),
    (
        "SUM(income), auto clip (10% of ε)",
        "SELECT 0, SUM(income) FROM pumsc",
        "SELECT 0, SUM(income) FROM t",
        False,
    ),
    (
        "AVG(income) BY educ (declared domain), auto clip q = 0.9 (10% of ε)",
        "SELECT educ, AVG(income) FROM pumsdc GROUP BY educ",
        "SELECT educ, AVG(income) FROM t GROUP BY educ",
        False,
    ),
    (
        "MEDIAN(income)",
        "SELECT 0, MEDIAN(income) FROM pums",
        "SELECT 0, MEDIAN(income) FROM t",
        False,
    ),
    (
        "90th percentile of age",
        "SELECT 0, PERCENTILE_CONT(0.9) WITHIN GROUP (ORDER BY age) FROM pums",
        "SELECT 0, quantile_cont(age, 0.9) FROM t",
        False,
    ),
    (
        "AVG(income) BY educ (no domain)",
        "SELECT educ, AVG(income) FROM pums GROUP BY educ",
        "SELECT educ, AVG(income) FROM t GROUP BY educ",
        True,
    ),
    (
        "educ keys only (no domain)",
        "SELECT educ, 1 FROM pums GROUP BY educ",
        "SELECT educ, 1 FROM t GROUP BY educ",
        True,
    ),
]
SELECTIONS = ("auto", "threshold", "optimal")


def sql_rows(
    csv: Path,
    con,
    reps: int,
    epsilons=EPSILONS,
    match: str = "",
    baseline: bool = False,
    delta: float = DELTA,
) -> list[Row]:
    out = []
    for eps in epsilons:
        with (
            warnings.catch_warnings(),
            dpsql.connect(
                policy=policy(csv, eps, delta),
                ledger=MemoryLedger(),
                cache=False,
                noise=SeededNoise(int(eps * 1000)),
            ) as conn,
        ):
            warnings.simplefilter("ignore")
            cur = conn.cursor()
            for name, dp_sql, true_sql, grouped in SQL_QUERIES:
                if match not in name:
                    continue
                true = truth(con, true_sql)
                modes = SELECTIONS if grouped and not baseline else (None,)
                for mode in modes:
                    if mode is not None:
                        cur.execute(f"SET partition_selection = '{mode}'")
                    samples = []
                    for _ in range(reps):
                        cur.execute(dp_sql)
                        samples.append(errors({r[0]: float(r[1]) for r in cur.fetchall()}, true))
                    method = "before (main)" if baseline else "Laplace"
                    if "MEDIAN" in dp_sql or "PERCENTILE" in dp_sql:
                        method = "EM on a public grid, CDF score"
                    if "auto clip" in name:
                        method = "auto clip"
                    if mode is not None:
                        method += f", partition_selection = {mode}"
                    out.append(summarise(name, eps, method, SQL, samples, reps, grouped))
            # the other quantile mechanisms, through SET quantile_method
            if match and match not in "MEDIAN(income)":
                continue
            true = truth(con, "SELECT 0, MEDIAN(income) FROM t")
            for quantile_method, label in (
                ("pf", "permute-and-flip"),
                ("smooth", "smooth sensitivity, Cauchy"),
            ):
                cur.execute(f"SET quantile_method = '{quantile_method}'")
                samples = []
                for _ in range(reps):
                    cur.execute("SELECT 0, MEDIAN(income) FROM pums")
                    samples.append(errors({r[0]: float(r[1]) for r in cur.fetchall()}, true))
                out.append(summarise("MEDIAN(income)", eps, label, SQL, samples, reps))
            cur.execute("RESET quantile_method")
    return out


def quantile_rows(con, reps: int) -> list[Row]:
    income = np.array([r[0] for r in con.execute("SELECT income FROM t").fetchall()])
    age = np.array([r[0] for r in con.execute("SELECT age FROM t").fetchall()])
    inc_grid = Grid(0, 500_000, 8192, scale="log")
    age_grid = Grid.for_column(0, 100, integer=True)
    inc_counts, age_counts = inc_grid.counts(income), age_grid.counts(age)
    # the lower-median / lower-quantile conventions of the released bins
    true_median = float(np.sort(income)[(income.size + 1) // 2 - 1])
    true_p90 = float(np.quantile(age, 0.9, method="lower"))
    out = []
    for eps in EPSILONS:
        source = SeededNoise(int(eps * 100) + 7)
        for method in ("em", "pf"):
            em = ExponentialQuantile(inc_grid, eps, method=method)
            values = [
                em.release(inc_counts, target("quantile", 0.5), source).value for _ in range(reps)
            ]
            out.append(
                _point("MEDIAN(income)", eps, f"{method}, log grid 8192", values, true_median, reps)
            )
            p90 = ExponentialQuantile(age_grid, eps, method=method)
            values = [
                p90.release(age_counts, target("quantile", 0.9), source).value for _ in range(reps)
            ]
            out.append(
                _point("PERCENTILE 0.9 (age)", eps, f"{method}, unit grid", values, true_p90, reps)
            )
        sm = SmoothMedian(inc_grid, eps)
        values = [sm.release(inc_counts, source) for _ in range(reps)]
        out.append(
            _point("MEDIAN(income)", eps, "smooth sensitivity, Cauchy", values, true_median, reps)
        )
        values = np.array(values)
        out.append(
            Row(
                "MEDIAN(income)",
                eps,
                "smooth sensitivity, Cauchy (median of |rel error|)",
                MECH,
                float(np.median(np.abs(values - true_median)) / true_median),
                float(np.median(values - true_median) / true_median),
                None,
                reps,
            )
        )
    return out


def _point(query, eps, method, values, true, reps) -> Row:
    v = np.asarray(values, dtype=float)
    return Row(
        query,
        eps,
        method,
        MECH,
        float(np.mean(np.abs(v - true)) / abs(true)),
        float(np.mean(v - true) / abs(true)),
        None,
        reps,
    )


def clipping_rows(con, reps: int, share: float = 0.1) -> list[Row]:
    income = np.array([r[0] for r in con.execute("SELECT income FROM t").fetchall()])
    educ = np.array([r[0] for r in con.execute("SELECT educ FROM t").fetchall()])
    hist = LogHistogram.for_bounds(0, 500_000, ratio=2**0.25)
    counts = hist.counts(income)
    total = float(income.sum())
    keys = np.unique(educ)
    true_avg = {k: float(income[educ == k].mean()) for k in keys}
    out = []
    for eps in EPSILONS:
        source = SeededNoise(int(eps * 100) + 11)
        eps_b, eps_s = share * eps, (1 - share) * eps
        ab = ApproxBounds(hist, eps_b, method="sum", sum_epsilon=eps_s)
        samples, clips = [], []
        for _ in range(reps):
            clip = ab.release(counts, source, 0, 500_000).upper
            clamped = float(np.minimum(income, clip).sum())
            noisy = clamped + float(Laplace(clip, eps_s).sample(source, 1)[0])
            samples.append(((abs(noisy - total)) / total, (noisy - total) / total, 0.0))
            clips.append(clip)
        row = summarise(
            "SUM(income)",
            eps,
            f"auto clip ({share:.0%} of ε, median C={np.median(clips):.0f})",
            MECH,
            samples,
            reps,
        )
        out.append(row)
        # oracle: the best fixed clip for this data at the whole ε (no ε spent on bounds)
        cands = hist.edges()[1:]
        best = min(cands, key=lambda c: np.maximum(income - c, 0).sum() + c / eps)
        samples = []
        for _ in range(reps):
            noisy = float(np.minimum(income, best).sum()) + float(
                Laplace(best, eps).sample(source, 1)[0]
            )
            samples.append(((abs(noisy - total)) / total, (noisy - total) / total, 0.0))
        out.append(
            summarise(
                "SUM(income)",
                eps,
                f"oracle clip C={best:.0f} (not DP: chosen on the data)",
                MECH,
                samples,
                reps,
            )
        )
        # AVG(income) by educ: bounds share, then sum 0.6 / count 0.3 of ε per group
        eps_sum, eps_cnt = 0.6 * eps, 0.3 * eps
        ab_avg = ApproxBounds(hist, eps_b, method="quantile", q=0.9)
        samples = []
        for _ in range(reps):
            clip = ab_avg.release(counts, source, 0, 500_000).upper
            released = {}
            for k in keys:
                x = np.minimum(income[educ == k], clip)
                s = float(x.sum()) + float(Laplace(clip, eps_sum).sample(source, 1)[0])
                n = x.size + float(Laplace(1.0, eps_cnt).sample(source, 1)[0])
                released[k] = min(max(s / max(n, 1.0), 0.0), clip)
            samples.append(errors(released, true_avg))
        out.append(
            summarise(
                "AVG(income) BY educ (declared domain)",
                eps,
                "auto clip at q=0.9 (10%) + sum 60% + count 30%",
                MECH,
                samples,
                reps,
            )
        )
    return out


def partition_rows(con, reps: int, delta: float = DELTA) -> list[Row]:
    counts = np.array(
        [
            r[1]
            for r in con.execute("SELECT educ, COUNT(DISTINCT pid) FROM t GROUP BY educ").fetchall()
        ]
    )
    out = []
    for eps in EPSILONS:
        source = SeededNoise(int(eps * 100) + 13)
        # the Laplace τ-threshold on the released count itself (R = G = 1: COUNT(*) = units),
        # the integer τ alone and with τ − 1 kept at the fitted probability (all of δ)
        units = Laplace(l1=1.0, epsilon=eps)
        tau = units.threshold(delta, 1)
        below = threshold_below(units, tau, delta, 1)
        for name, b in (
            ("Laplace τ-threshold, integer τ", 0.0),
            ("Laplace τ-threshold, all of δ", below),
        ):
            lost = threshold_suppression(units, tau, b)
            exact = float(np.mean([lost(int(n)) for n in counts]))
            out.append(
                Row(
                    "COUNT(*) BY educ (no domain)",
                    eps,
                    f"{name} (τ = {tau:g}, p(τ − 1) = {b:.3f}); expected {exact:.4f}",
                    MECH,
                    math.nan,
                    math.nan,
                    exact,
                    reps,
                )
            )
        for name, sel in (
            ("optimal (keys only, whole (ε, δ)): the floor", OptimalSelection(eps, delta)),
            ("optimal at (ε/2, δ) + COUNT at ε/2", OptimalSelection(eps / 2, delta)),
            ("Gaussian threshold, counts reused", GaussianSelection(eps, delta)),
        ):
            sup = [1 - float(np.mean(sel.keep(counts, source))) for _ in range(reps)]
            exact = expected_suppression(sel, counts)
            out.append(
                Row(
                    "COUNT(*) BY educ (no domain)",
                    eps,
                    f"{name}; expected {exact:.4f}",
                    MECH,
                    math.nan,
                    math.nan,
                    float(np.mean(sup)),
                    reps,
                )
            )
    return out


# --- "auto" contribution bounds and the defaults (issue 31, item 2) ---------------------------

AUTO_QUERIES = {
    "visits": [
        ("COUNT(*)", "SELECT 0, COUNT(*) FROM visits"),
        ("SUM(cost)", "SELECT 0, SUM(cost) FROM visits"),
        ("AVG(cost)", "SELECT 0, AVG(cost) FROM visits"),
        ("histogram COUNT(*) BY department", "SELECT department, COUNT(*) FROM visits GROUP BY 1"),
        ("AVG(cost) BY department", "SELECT department, AVG(cost) FROM visits GROUP BY 1"),
    ],
    "pums": [
        ("COUNT(*)", "SELECT 0, COUNT(*) FROM pums"),
        ("SUM(income)", "SELECT 0, SUM(income) FROM pums"),
        ("histogram COUNT(*) BY educ", "SELECT educ, COUNT(*) FROM pums GROUP BY educ"),
        ("AVG(income) BY educ", "SELECT educ, AVG(income) FROM pums GROUP BY educ"),
    ],
}


def _fixture_policy(variant: str) -> dict:
    import tomllib

    policy = tomllib.loads((ROOT / "fixtures" / "visits.toml").read_text())
    table = policy["tables"]["visits"]
    table["source"] = str(ROOT / "fixtures" / "visits.csv")
    policy["privacy"].update(budget_epsilon=1e12, budget_delta=0.5)
    if variant == "defaults":  # nothing hand-set: R, G and the clamps unstated (the defaults)
        table.update(max_rows_per_unit="auto", max_groups_per_unit="auto")
        for column in table["columns"].values():
            column.pop("clip", None)
    return policy


def _pums_dup_policy(csv: Path, variant: str) -> dict:
    """PUMS_dup (1-4 rows per pid): "R = 1" and "R = 4" hand-set (income clamped to its
    declared [0, 500000]), "R = 4, auto clip", or "defaults" (R, G auto, no clip stated)."""
    columns = {
        "pid": {"type": "int", "nullable": False},
        "educ": {"type": "int", "values": list(range(1, 17)), "nullable": False},
        "income": {"type": "float", "lower": 0, "upper": 500_000, "nullable": False},
    }
    table: dict = {"source": str(csv), "privacy_unit": "pid", "columns": columns}
    if variant == "defaults":
        table.update(max_rows_per_unit="auto", max_groups_per_unit="auto")
    else:
        table.update(max_rows_per_unit=int(variant.split()[2].rstrip(",")), max_groups_per_unit=1)
    if "clip" in variant:
        columns["income"]["clip"] = "auto"
    elif variant != "defaults":
        columns["income"]["clip"] = "declared"  # hand-set
    privacy = {"epsilon": 1.0, "delta": DELTA, "budget_epsilon": 1e12, "budget_delta": 0.5}
    return {"privacy": privacy, "tables": {"pums": table}}


DEFAULTS = ("defaults", "defaults, choice kept")


def auto_bounds_rows(
    data: Path, reps: int, epsilon: float = 1.0, tables: tuple[str, ...] = ("visits", "pums")
) -> list[Row]:
    """The defaults against hand-set bounds, at ε = ``epsilon`` per query. "defaults": without
    the answer cache, so every repetition is an analyst's first query on the data version and
    pays the choice of R and G (bounds_share, 10% of its ε) out of its own ε. "defaults, choice
    kept": every repetition buys a fresh histogram with another statement first (the same
    query with LIMIT 1000: its own text), then the measured query chooses R and G from it free
    and spends its whole ε on its measures — what every query after an analyst's first sees.
    The clamp of a summed column with no clip stated is chosen the same way (its value
    histogram bought in the same choice, kept with the others: dpsql.service.bounds)."""
    out = []
    cases = [
        ("visits", str(ROOT / "fixtures" / "visits.csv"), ("fixture R = 5, G = 3", *DEFAULTS)),
        ("pums", str(data / "PUMS_dup.csv"), ("R = 1", "R = 4", "R = 4, auto clip", *DEFAULTS)),
    ]
    for table, csv, variants in cases:
        if table not in tables:
            continue
        con = duckdb.connect()
        con.execute(f"CREATE TABLE {table} AS SELECT * FROM read_csv_auto('{csv}')")
        for variant in variants:
            kept = variant == "defaults, choice kept"
            base = "defaults" if kept else variant
            pol = _fixture_policy(base) if table == "visits" else _pums_dup_policy(Path(csv), base)
            ledger = MemoryLedger()
            pol["privacy"]["epsilon"] = epsilon
            with (
                warnings.catch_warnings(),
                dpsql.connect(
                    policy=pol,
                    ledger=ledger,
                    cache=kept,
                    noise=SeededNoise(int(epsilon * 1000) + 17),
                ) as conn,
            ):
                warnings.simplefilter("ignore")
                cur = conn.cursor()
                for name, sql in AUTO_QUERIES[table]:
                    true = truth(con, sql)
                    samples = []
                    for _ in range(reps):
                        if kept:  # a fresh histogram, bought by another statement
                            ledger._cache.clear()
                            cur.execute(sql + " LIMIT 1000")
                            cur.fetchall()
                        cur.execute(sql)
                        samples.append(errors({r[0]: float(r[1]) for r in cur.fetchall()}, true))
                    label = f"{table}_dup" if table == "pums" else table
                    method = variant
                    if variant == "defaults":
                        method = "defaults, first query: R, G and clamp chosen (pays 10% of ε)"
                    elif kept:
                        method = "defaults, later queries: R, G and clamp from the kept histograms"
                    out.append(summarise(f"{label}: {name}", epsilon, method, SQL, samples, reps))
        con.close()
    return out


def markdown(rows: list[Row]) -> str:
    lines = [
        "| query | ε | method | path | rel. error | bias | suppressed |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        sup = "" if r.suppressed is None else f"{r.suppressed:.1%}"
        rel = "" if math.isnan(r.rel_error) else f"{r.rel_error:.2%}"
        bias = "" if math.isnan(r.bias) else f"{r.bias:+.2%}"
        lines.append(
            f"| {r.query} | {r.epsilon:g} | {r.method} | {r.path} | {rel} | {bias} | {sup} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/work/shared/datasets/pums"))
    parser.add_argument("--reps", type=int, default=20, help="repetitions (200 for the docs)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--skip-sql", action="store_true", help="mechanism rows only")
    parser.add_argument("--sql-only", action="store_true", help="SQL rows only")
    parser.add_argument("--match", default="", help="SQL rows whose name contains this")
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS))
    parser.add_argument("--delta", type=float, default=DELTA, help="the policy's δ")
    parser.add_argument(
        "--baseline", action="store_true", help="no partition_selection setting (before)"
    )
    parser.add_argument(
        "--auto-bounds",
        action="store_true",
        help="only the defaults (auto R, G, clip) against hand-set bounds: fixture, PUMS_dup",
    )
    parser.add_argument(
        "--auto-tables",
        nargs="+",
        default=["visits", "pums"],
        help="with --auto-bounds: the tables to run (visits: the fixture, pums: PUMS_dup)",
    )
    args = parser.parse_args(argv)
    csv = args.data / "PUMS_pid.csv"
    con = duckdb.connect()
    con.execute(f"CREATE TABLE t AS SELECT * FROM read_csv_auto('{csv}')")
    load = os.getloadavg()
    start = time.perf_counter()
    rows = (
        auto_bounds_rows(
            args.data,
            args.reps,
            args.epsilons[0] if args.epsilons else 1.0,
            tuple(args.auto_tables),
        )
        if args.auto_bounds
        else []
        if args.skip_sql
        else sql_rows(csv, con, args.reps, args.epsilons, args.match, args.baseline, args.delta)
    )
    if not args.sql_only and not args.auto_bounds:
        rows += (
            quantile_rows(con, args.reps)
            + clipping_rows(con, args.reps)
            + partition_rows(con, args.reps, args.delta)
        )
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(markdown(rows))
    print(
        f"\n{args.reps} repetitions, {elapsed:.0f} s; load average {load[0]:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end; {os.cpu_count()} cores",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
