"""Side by side at ε = 1 on PUMS: dpsql's default policy, OpenDP, PipelineDP, Tumult, oracles.

The targets of issue 31 item 7, each library run the way its documentation shows (its best
effort with the public metadata a curator has: income in [0, 500000], educ in 1..16), and
dpsql through ``dpsql.connect`` with the policy ``dpsql init`` drafts minus the hand-set
contribution bounds: column types, declared bounds, public value lists, ``nullable = false``
and the privacy unit, nothing else (no clip, quantile grid, R or G option). The oracle rows
are limits no DP library can reach: a bound chosen on the data itself (not DP) or the exact
error of the optimal mechanism.

Queries and metrics (``--reps`` repetitions each; 200 for published figures):

- ``hist``: COUNT(*) BY educ with the public domain 1..16 on PUMS (one row per person): MAE
  over the 16 cells; oracle: the discrete Laplace optimum 2p / (1 − p²), p = e^−ε (0.851).
- ``avg``: AVG(income) BY educ (public domain): mean relative error over the groups; oracle:
  one clip C and one sum/count split chosen on the data (Laplace sum and count).
- ``median``: MEDIAN(income) BY educ (public domain): mean relative error over the groups.
- ``sum``: SUM(income): MAE; oracle: the best fixed clip chosen on the data at the whole ε.
- ``dup_count`` / ``dup_sum`` / ``dup_hist``: COUNT(*), SUM(income), COUNT(*) BY educ on
  PUMS_dup (1–4 rows per person, unit ``pid``): relative error (mean over groups for the
  histogram). Peers run R = 1..4 rows per person (G = 1) and the table shows each at its best
  R (an oracle choice in their favour); the oracle row picks R (and the clip) on the data.
- ``suppress``: COUNT(*) BY educ with NO public domain at δ = 1e-5: the share of the 16 true
  groups that are not released; floor: the optimal selection of keys alone at the whole (ε, δ)
  (dpsql.privacy.partition.OptimalSelection, exact expectation).

The peers are not project dependencies. Install them in a separate virtualenv (outside the
repository) with dpsql's own base dependencies; dpsql is imported from this checkout:

    python3 -m venv /tmp/peers-venv
    /tmp/peers-venv/bin/pip install "opendp[polars]==0.16.0" pipeline-dp==0.3.1 \\
        tmlt.analytics==0.21.0 "sqlglot>=30.30,<30.31" sqlglotc==30.30.0 duckdb \\
        "pydantic>=2.7,<3" "prompt_toolkit>=3.0.40,<4" "rich>=13.7,<15" "platformdirs>=4,<5"
    # Tumult needs Java 17 (pyspark 3.5)
    /tmp/peers-venv/bin/python bench/bench_utility_peers.py --reps 200 --json out.json

A missing peer is reported as "not installed" and its column left empty; the project's own
venv runs the dpsql and oracle rows alone. ``--libraries`` picks the columns to run and
``--merge a.json b.json`` prints one table from runs made apart (Tumult's Spark queries take
about 2 s each unloaded, ~10 s on a busy machine, so ``--tumult-reps`` caps its repetitions,
``--r-values`` the R it runs and ``--method-match`` the variants). The figures and their
commands are in docs/mechanisms.md, "Side by side with OpenDP, PipelineDP, Tumult".
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EPSILON = 1.0
DELTA = 1e-5
LOWER, UPPER = 0.0, 500_000.0
EDUC = list(range(1, 17))
R_VALUES = (1, 2, 3, 4)
PEER_R: tuple[int, ...] = R_VALUES  # --r-values: the R each peer runs on PUMS_dup
METHOD_MATCH = ""  # --method-match: run only the peer variants whose method names contain it
LIBRARIES = ("oracle", "dpsql", "opendp", "pipelinedp", "tumult")
QUERIES = {
    "hist": ("COUNT(*) BY educ, public keys (PUMS)", "MAE"),
    "avg": ("AVG(income) BY educ, public keys", "mean rel. error"),
    "median": ("MEDIAN(income) BY educ, public keys", "mean rel. error"),
    "sum": ("SUM(income)", "MAE"),
    "dup_count": ("COUNT(*) on PUMS_dup (1-4 rows/person)", "rel. error"),
    "dup_sum": ("SUM(income) on PUMS_dup", "rel. error"),
    "dup_hist": ("COUNT(*) BY educ on PUMS_dup, public keys", "mean rel. error"),
    "suppress": ("educ keys not public, δ = 1e-5", "groups suppressed"),
}


@dataclass
class Result:
    query: str
    library: str
    method: str
    error: float
    reps: int
    note: str = ""


# -- data and truth ---------------------------------------------------------------------------


@dataclass
class Data:
    pums: Path  # PUMS_pid.csv: one row per person
    dup: Path  # PUMS_dup.csv: 1-4 rows per person
    educ: np.ndarray
    income: np.ndarray
    dup_pid: np.ndarray
    dup_educ: np.ndarray
    dup_income: np.ndarray


def load(directory: Path) -> Data:
    if (directory / "pums").is_dir():
        directory = directory / "pums"

    def read(name: str) -> dict[str, np.ndarray]:
        with open(directory / name, newline="") as f:
            rows = list(csv.DictReader(f))
        return {k: np.array([float(r[k]) for r in rows]) for k in rows[0]}

    p, d = read("PUMS_pid.csv"), read("PUMS_dup.csv")
    return Data(
        directory / "PUMS_pid.csv",
        directory / "PUMS_dup.csv",
        p["educ"].astype(int),
        p["income"],
        d["pid"].astype(int),
        d["educ"].astype(int),
        d["income"],
    )


class Truth:
    def __init__(self, data: Data) -> None:
        e, x = data.educ, data.income
        self.hist = {k: float((e == k).sum()) for k in EDUC}
        self.avg = {k: float(x[e == k].mean()) for k in EDUC if (e == k).any()}
        self.median = {k: float(np.median(x[e == k])) for k in EDUC if (e == k).any()}
        self.sum = float(x.sum())
        self.dup_count = float(data.dup_pid.size)
        self.dup_sum = float(data.dup_income.sum())
        self.dup_hist = {k: float((data.dup_educ == k).sum()) for k in EDUC}
        self.keys = {k for k in EDUC if (e == k).any()}


def mae(released: dict, true: dict) -> float:
    return float(np.mean([abs(released.get(k, 0.0) - v) for k, v in true.items()]))


def mean_rel(released: dict, true: dict) -> float:
    """Mean |released − true| / |true| over the true groups (a missing group counts as 0)."""
    rel = [abs(released.get(k, 0.0) - v) / abs(v) for k, v in true.items() if v != 0]
    return float(np.mean(rel))


def rel(value: float, true: float) -> float:
    return abs(value - true) / abs(true)


def suppressed(released: dict, keys: set) -> float:
    return 1 - len(keys & set(released)) / len(keys)


def score(query: str, released: Any, t: Truth) -> float:
    if query == "hist":
        return mae(released, t.hist)
    if query in ("avg", "median"):
        return mean_rel(released, getattr(t, query))
    if query == "sum":
        return abs(float(released) - t.sum)
    if query == "dup_count":
        return rel(float(released), t.dup_count)
    if query == "dup_sum":
        return rel(float(released), t.dup_sum)
    if query == "dup_hist":
        return mean_rel(released, t.dup_hist)
    if query == "suppress":
        return suppressed(released, t.keys)
    raise KeyError(query)


def repeat(query: str, run: Callable[[], Any], t: Truth, reps: int) -> float:
    return float(np.mean([score(query, run(), t) for _ in range(reps)]))


# -- oracles ----------------------------------------------------------------------------------

CLIPS = [UPPER * 2 ** (-i / 4) for i in range(0, 60)]  # a 2^0.25 grid below the bound


def lap_mae(bias: float, scale: float) -> float:
    """E|β + L| for L ~ Laplace(scale): |β| + scale·exp(−|β| / scale)."""
    b = abs(bias)
    return b + scale * math.exp(-b / scale)


def dlap_mae(bias: float, scale: float) -> float:
    """E|β + Z| for Z discrete Laplace (two-sided geometric) with parameter exp(−1/scale)."""
    q = math.exp(-1 / scale)
    z = np.arange(-int(80 * scale) - 5, int(80 * scale) + 6)
    pmf = (1 - q) / (1 + q) * q ** np.abs(z)
    return float((pmf * np.abs(bias + z)).sum())


def oracle_rows(data: Data, t: Truth, reps: int) -> list[Result]:
    """Limits, not DP: bounds chosen on the data, errors as exact expectations where closed."""
    rng = np.random.default_rng(31)
    eps = EPSILON
    out = []
    p = math.exp(-eps)
    out.append(
        Result(
            "hist", "oracle", "discrete Laplace optimum 2p/(1-p^2)", 2 * p / (1 - p * p), 0, "exact"
        )
    )

    # SUM: the clip C minimising E|bias(C) + Laplace(C/ε)| over the data's values and a grid
    x = data.income
    cands = sorted(set(CLIPS) | set(float(v) for v in x if v > 0))

    def sum_err(xs: np.ndarray, c: float, sens: float, total: float) -> float:
        return lap_mae(total - float(np.minimum(xs, c).sum()), sens * c / eps)

    best = min(cands, key=lambda c: sum_err(x, c, 1, t.sum))
    out.append(
        Result(
            "sum",
            "oracle",
            f"clip C={best:.0f} chosen on the data",
            sum_err(x, best, 1, t.sum),
            0,
            "exact",
        )
    )

    # AVG by educ: one clip and one sum share chosen on the data (selection noise apart)
    def avg_error(c: float, share: float, n: int, g: np.random.Generator) -> float:
        errs = []
        for k, true in t.avg.items():
            xs = np.minimum(x[data.educ == k], c)
            s = xs.sum() + g.laplace(0, c / (share * eps), n)
            m = xs.size + g.laplace(0, 1 / ((1 - share) * eps), n)
            est = np.clip(s / np.maximum(m, 1.0), 0, c)
            if true != 0:
                errs.append(np.abs(est - true) / abs(true))
        return float(np.mean(errs))

    sel = np.random.default_rng(7)
    choices = [(c, s) for c in CLIPS[:40] for s in (0.5, 0.6, 0.7, 0.8, 0.9)]
    c_best, s_best = min(choices, key=lambda cs: avg_error(cs[0], cs[1], 400, sel))
    out.append(
        Result(
            "avg",
            "oracle",
            f"clip C={c_best:.0f}, sum share {s_best:.1f}, chosen on the data",
            avg_error(c_best, s_best, 4000, rng),
            4000,
            "Laplace sum and count, released AVG clamped to [0, C]",
        )
    )

    # PUMS_dup: R (and the SUM clip) chosen on the data; each unit keeps R rows at random
    pid, educ, inc = data.dup_pid, data.dup_educ, data.dup_income
    order = np.lexsort((rng.random(pid.size), pid))
    rank = np.empty(pid.size, dtype=int)
    sorted_pid = pid[order]
    first = np.r_[0, np.flatnonzero(np.diff(sorted_pid)) + 1]
    starts = np.repeat(first, np.diff(np.r_[first, pid.size]))
    rank[order] = np.arange(pid.size) - starts  # 0-based rank of each row within its unit

    def best_over(label: str, errs: dict) -> Result:
        r = min(errs, key=lambda k: errs[k][0])
        return Result(
            label, "oracle", f"R={r}{errs[r][1]} chosen on the data", errs[r][0], 0, "exact"
        )

    count_errs, sum_errs, hist_errs = {}, {}, {}
    dup_cands = sorted(set(CLIPS) | set(float(v) for v in inc if v > 0))
    for r in R_VALUES:
        keep = rank < r
        count_errs[r] = (dlap_mae(float(keep.sum()) - t.dup_count, r / eps) / t.dup_count, "")
        xs = inc[keep]
        c = min(dup_cands, key=lambda c: sum_err(xs, c, r, t.dup_sum))
        sum_errs[r] = (sum_err(xs, c, r, t.dup_sum) / t.dup_sum, f", C={c:.0f}")
        cells = [
            dlap_mae(float((keep & (educ == k)).sum()) - v, r / eps) / v
            for k, v in t.dup_hist.items()
            if v
        ]
        hist_errs[r] = (float(np.mean(cells)), "")
    out += [
        best_over("dup_count", count_errs),
        best_over("dup_sum", sum_errs),
        best_over("dup_hist", hist_errs),
    ]
    try:
        from dpsql.privacy.partition import OptimalSelection, expected_suppression

        counts = np.array([t.hist[k] for k in sorted(t.keys)])
        floor = expected_suppression(OptimalSelection(eps, DELTA), counts)
        out.append(
            Result(
                "suppress",
                "oracle",
                "optimal selection of keys alone, whole (ε, δ)",
                float(floor),
                0,
                "exact",
            )
        )
    except Exception as exc:
        out.append(Result("suppress", "oracle", "floor not computed", math.nan, 0, repr(exc)))
    return out


# -- dpsql ------------------------------------------------------------------------------------


def dpsql_policy(data: Data) -> dict:
    """What ``dpsql init`` drafts for these files, without R, G or any option it does not write."""
    educ = {"type": "int", "nullable": False}  # no bounds: an int's bounds are a public domain
    columns = {
        "pid": {"type": "int", "nullable": False},
        "age": {"type": "int", "lower": 0, "upper": 100, "nullable": False},
        "sex": {"type": "int", "lower": 0, "upper": 1, "values": [0, 1], "nullable": False},
        "race": {
            "type": "int",
            "lower": 1,
            "upper": 6,
            "values": list(range(1, 7)),
            "nullable": False,
        },
        "married": {"type": "int", "lower": 0, "upper": 1, "values": [0, 1], "nullable": False},
        # PUMS_pid.csv writes income as 17000.0: init drafts it as a float (PUMS_dup: int)
        "income": {"type": "float", "lower": 0.0, "upper": 500_000.0, "nullable": False},
        "educ": {**educ, "lower": 1, "upper": 16, "values": EDUC},
    }
    return {
        "privacy": {
            "epsilon": EPSILON,
            "delta": DELTA,
            "budget_epsilon": 1e12,
            "budget_delta": 0.5,
        },
        "tables": {
            # PUMS_pid: one row per pid (dpsql init drafts it row-level: pid is a row id);
            # declared the primary key, its R and G are 1 and cut nothing (no bias measure)
            "pums": {
                "source": str(data.pums),
                "privacy_unit": "pid",
                "primary_key": "pid",
                "columns": columns,
            },
            # the suppression query: educ with neither values nor bounds (dpsql.plan.domains)
            "pums_keys": {
                "source": str(data.pums),
                "privacy_unit": "pid",
                "primary_key": "pid",
                "columns": {**columns, "educ": educ},
            },
            "pums_dup": {
                "source": str(data.dup),
                "privacy_unit": "pid",
                "columns": {
                    **columns,
                    "income": {**columns["income"], "type": "int", "lower": 0, "upper": 500_000},
                },
            },
        },
    }


DPSQL_SQL = {
    "hist": "SELECT educ, COUNT(*) FROM pums GROUP BY educ",
    "avg": "SELECT educ, AVG(income) FROM pums GROUP BY educ",
    "median": "SELECT educ, MEDIAN(income) FROM pums GROUP BY educ",
    "sum": "SELECT SUM(income) FROM pums",
    "dup_count": "SELECT COUNT(*) FROM pums_dup",
    "dup_sum": "SELECT SUM(income) FROM pums_dup",
    "dup_hist": "SELECT educ, COUNT(*) FROM pums_dup GROUP BY educ",
    "suppress": "SELECT educ, COUNT(*) FROM pums_keys GROUP BY educ",
}


def dpsql_rows(data: Data, t: Truth, reps: int, queries: list[str]) -> list[Result]:
    import dpsql
    from dpsql.privacy.ledger import MemoryLedger
    from dpsql.privacy.samplers import SeededNoise

    commit = _commit()
    out = []
    with (
        warnings.catch_warnings(),
        dpsql.connect(
            policy=dpsql_policy(data), ledger=MemoryLedger(), cache=False, noise=SeededNoise(31)
        ) as conn,
    ):
        warnings.simplefilter("ignore")
        cur = conn.cursor()
        for q in queries:
            sql = DPSQL_SQL[q]

            def run(sql: str = sql) -> Any:
                cur.execute(sql)
                rows = cur.fetchall()
                if "GROUP BY" in sql:
                    return {int(r[0]): float(r[1]) for r in rows if r[0] is not None}
                return float(rows[0][0])

            try:
                out.append(
                    Result(q, "dpsql", "default policy", repeat(q, run, t, reps), reps, commit)
                )
            except Exception as exc:
                out.append(Result(q, "dpsql", "default policy", math.nan, 0, _short(exc)))
    out += _dpsql_later_rows(data, t, reps, [q for q in queries if q in LATER_QUERIES], commit)
    return out


#: queries whose default clamp range is bought once per analyst and data version
LATER_QUERIES = ("avg", "sum")


@contextlib.contextmanager
def fresh_analyst(policy: dict, rep: int) -> Iterator[Any]:
    """A cursor of a new analyst (new ledger, answer cache on, ``SeededNoise(1000 + rep)``):
    the later rows' repetition ``rep`` (bench/bench_sum_clamp.py uses the same seeds)."""
    import dpsql
    from dpsql.privacy.ledger import MemoryLedger
    from dpsql.privacy.samplers import SeededNoise

    with (
        warnings.catch_warnings(),
        dpsql.connect(
            policy=policy, ledger=MemoryLedger(), cache=True, noise=SeededNoise(1000 + rep)
        ) as conn,
    ):
        warnings.simplefilter("ignore")
        yield conn.cursor()


def _dpsql_later_rows(
    data: Data, t: Truth, reps: int, queries: list[str], commit: str
) -> list[Result]:
    """The default policy as an analyst meets it after the first query on the data version:
    with the answer cache on (the default), the clamp range of income is bought once, by the
    first query summing it (its bounds_share of ε), kept, and chosen free by every later
    query (dpsql.service.bounds). Per repetition a fresh analyst (new ledger, so a fresh
    histogram draw) runs the query once (pays), then the same query again with a filter that
    keeps every row (``pid >= 0``: another answer-cache key, so it is measured afresh); the
    second answer is scored. The rows above (cache off) are the first query's figures."""
    out = []
    for q in queries:
        sql = DPSQL_SQL[q]
        later = sql.replace(" FROM pums", " FROM pums WHERE pid >= 0")
        scores = []
        for rep in range(reps):
            with fresh_analyst(dpsql_policy(data), rep) as cur:
                cur.execute(sql)
                cur.fetchall()
                cur.execute(later)
                rows = cur.fetchall()
            got = (
                {int(r[0]): float(r[1]) for r in rows if r[0] is not None}
                if "GROUP BY" in sql
                else float(rows[0][0])
            )
            scores.append(score(q, got, t))
        out.append(
            Result(q, "dpsql", "default policy, later query", float(np.mean(scores)), reps, commit)
        )
    return out


def _commit() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "dpsql"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return f"commit {head}" + (" + uncommitted dpsql/ changes" if dirty else "")
    except Exception:
        return "commit unknown"


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"


# -- OpenDP (polars Context API) --------------------------------------------------------------


def opendp_rows(data: Data, t: Truth, reps: int, queries: list[str]) -> list[Result]:
    import opendp.prelude as dp
    import polars as pl

    dp.enable_features("contrib")
    version = "opendp " + _version("opendp")
    schema = {"pid": pl.Int64, "educ": pl.Int64, "income": pl.Float64}
    pums = pl.read_csv(data.pums, schema_overrides=schema).lazy()
    dup = pl.read_csv(data.dup, schema_overrides=schema).lazy()
    keys = pl.LazyFrame({"educ": EDUC}, schema={"educ": pl.Int64})
    income = pl.col("income").fill_null(0.0)
    lin = [float(c) for c in np.linspace(LOWER, UPPER, 101)]
    log = [0.0] + [float(c) for c in np.geomspace(100, UPPER, 100)]
    # a loose public bound on any group's size (needed for float sums)
    margins = [
        dp.polars.Margin(by=[], max_length=1_000_000),
        dp.polars.Margin(by=["educ"], max_length=1_000_000),
    ]

    def release(frame, build, loss=None, unit=None) -> Callable[[], Any]:
        ctx = dp.Context.compositor(
            data=frame,
            privacy_unit=unit or dp.unit_of(contributions=1),
            privacy_loss=loss or dp.loss_of(epsilon=EPSILON),
            split_evenly_over=1,
            margins=margins,
        )
        meas = build(ctx.query()).resolve()  # the measurement once; invoked per repetition
        return lambda: meas(frame).collect()

    def grouped(df) -> dict:
        cols = df.columns
        return {
            int(r[0]): float(r[1])
            for r in df.select(cols[0], cols[1]).iter_rows()
            if r[1] is not None
        }

    def scalar(df) -> float:
        return float(df.row(0)[0])

    plans: dict[str, list[tuple[str, Callable[[], Any]]]] = {}

    def add(q: str, method: str, make: Callable[[], Callable[[], Any]], post: Callable) -> None:
        if q in queries:
            plans.setdefault(q, []).append((method, lambda make=make, post=post: _lazy(make, post)))

    add(
        "hist",
        "len, public keys (with_keys)",
        lambda: release(pums, lambda q: q.group_by("educ").agg(dp.len()).with_keys(keys)),
        grouped,
    )
    add(
        "avg",
        "dp.mean(bounds=(0, 500000))",
        lambda: release(
            pums, lambda q: q.group_by("educ").agg(income.dp.mean((LOWER, UPPER))).with_keys(keys)
        ),
        grouped,
    )
    add(
        "median",
        "dp.median, 101 linear candidates",
        lambda: release(
            pums, lambda q: q.group_by("educ").agg(income.dp.median(lin)).with_keys(keys)
        ),
        grouped,
    )
    add(
        "median",
        "dp.median, 101 log candidates",
        lambda: release(
            pums, lambda q: q.group_by("educ").agg(income.dp.median(log)).with_keys(keys)
        ),
        grouped,
    )
    add(
        "sum",
        "dp.sum(bounds=(0, 500000))",
        lambda: release(pums, lambda q: q.select(income.dp.sum((LOWER, UPPER)))),
        scalar,
    )

    def two_step(alpha: float, second: Callable[[Any, float], Any]) -> Callable[[], Any]:
        """A DP quantile of income on 10% of ε as the clip, then the query on the other 90%."""

        def run() -> Any:
            ctx = dp.Context.compositor(
                data=pums,
                privacy_unit=dp.unit_of(contributions=1),
                privacy_loss=dp.loss_of(epsilon=EPSILON),
                split_by_weights=[0.1, 0.9],
                margins=margins,
            )
            clip = scalar(ctx.query().select(income.dp.quantile(alpha, log)).release().collect())
            return second(ctx.query(), max(clip, log[1])).release().collect()

        return run

    add(
        "avg",
        "dp.quantile(0.9) clip (10% of ε), then dp.mean",
        lambda: two_step(
            0.9,
            lambda q, c: q.group_by("educ").agg(income.dp.mean((LOWER, c))).with_keys(keys),
        ),
        grouped,
    )
    add(
        "sum",
        "dp.quantile(0.99) clip (10% of ε), then dp.sum",
        lambda: two_step(0.99, lambda q, c: q.select(income.dp.sum((LOWER, c)))),
        scalar,
    )
    unit = dp.unit_of(contributions=1, identifier="pid")
    for r in PEER_R:
        add(
            "dup_count",
            f"truncate_per_group({r}), len",
            lambda r=r: release(dup, lambda q: q.truncate_per_group(r).select(dp.len()), unit=unit),
            scalar,
        )
        add(
            "dup_sum",
            f"truncate_per_group({r}), dp.sum",
            lambda r=r: release(
                dup,
                lambda q: q.truncate_per_group(r).select(income.dp.sum((LOWER, UPPER))),
                unit=unit,
            ),
            scalar,
        )
        add(
            "dup_hist",
            f"truncate_per_group({r}), len by educ",
            lambda r=r: release(
                dup,
                lambda q: q.truncate_per_group(r).group_by("educ").agg(dp.len()).with_keys(keys),
                unit=unit,
            ),
            grouped,
        )
    add(
        "suppress",
        "group_by without keys (its threshold)",
        lambda: release(
            pums,
            lambda q: q.group_by("educ").agg(dp.len()),
            loss=dp.loss_of(epsilon=EPSILON, delta=DELTA),
        ),
        grouped,
    )
    return _run_plans("opendp", version, plans, t, reps)


def _lazy(make: Callable[[], Callable[[], Any]], post: Callable) -> Callable[[], Any]:
    run = make()
    return lambda: post(run())


def _run_plans(library: str, version: str, plans: dict, t: Truth, reps: int) -> list[Result]:
    out = []
    for q, variants in plans.items():
        for method, prepare in variants:
            if METHOD_MATCH not in method:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    run = prepare()
                    err = repeat(q, run, t, reps)
                out.append(Result(q, library, method, err, reps, version))
            except Exception as exc:
                out.append(Result(q, library, method, math.nan, 0, _short(exc)))
            print(f"  {library} {q} {method}: {out[-1].error:.4g}", file=sys.stderr, flush=True)
    return out


# -- PipelineDP (LocalBackend) ----------------------------------------------------------------


def pipelinedp_rows(data: Data, t: Truth, reps: int, queries: list[str]) -> list[Result]:
    import pipeline_dp

    version = "pipeline-dp " + _version("pipeline-dp")
    pums = list(zip(range(data.educ.size), data.educ.tolist(), data.income.tolist(), strict=True))
    dup = list(
        zip(data.dup_pid.tolist(), data.dup_educ.tolist(), data.dup_income.tolist(), strict=True)
    )
    by_educ = pipeline_dp.DataExtractors(
        privacy_id_extractor=lambda r: r[0],
        partition_extractor=lambda r: r[1],
        value_extractor=lambda r: r[2],
    )
    whole = pipeline_dp.DataExtractors(
        privacy_id_extractor=lambda r: r[0],
        partition_extractor=lambda r: 0,
        value_extractor=lambda r: r[2],
    )
    M = pipeline_dp.Metrics

    def release(rows, metric, extractors, public, delta=0.0, **params) -> Callable[[], Any]:
        def run() -> Any:
            acc = pipeline_dp.NaiveBudgetAccountant(total_epsilon=EPSILON, total_delta=delta)
            engine = pipeline_dp.DPEngine(acc, pipeline_dp.LocalBackend())
            agg = pipeline_dp.AggregateParams(
                noise_kind=pipeline_dp.NoiseKind.LAPLACE, metrics=[metric], **params
            )
            res = engine.aggregate(rows, agg, extractors, public_partitions=public)
            acc.compute_budgets()
            values = {k: float(v[0]) for k, v in res}
            return values if extractors is by_educ else values[0]

        return run

    one = {"max_partitions_contributed": 1, "max_contributions_per_partition": 1}
    clip = {"min_value": LOWER, "max_value": UPPER}
    plans: dict[str, list] = {}

    def add(q: str, method: str, make: Callable[[], Callable[[], Any]]) -> None:
        if q in queries:
            plans.setdefault(q, []).append((method, make))

    add("hist", "COUNT, public partitions", lambda: release(pums, M.COUNT, by_educ, EDUC, **one))
    add(
        "avg",
        "MEAN, min/max_value (0, 500000)",
        lambda: release(pums, M.MEAN, by_educ, EDUC, **one, **clip),
    )
    add(
        "median",
        "PERCENTILE(50), min/max_value (0, 500000)",
        lambda: release(pums, M.PERCENTILE(50), by_educ, EDUC, **one, **clip),
    )
    add(
        "sum",
        "SUM, min/max_value (0, 500000)",
        lambda: release(pums, M.SUM, whole, [0], **one, **clip),
    )
    for r in PEER_R:
        rg = {"max_partitions_contributed": 1, "max_contributions_per_partition": r}
        add("dup_count", f"COUNT, R={r}", lambda rg=rg: release(dup, M.COUNT, whole, [0], **rg))
        add("dup_sum", f"SUM, R={r}", lambda rg=rg: release(dup, M.SUM, whole, [0], **rg, **clip))
        add(
            "dup_hist",
            f"COUNT by educ, R={r}",
            lambda rg=rg: release(dup, M.COUNT, by_educ, EDUC, **rg),
        )
    add(
        "suppress",
        "PRIVACY_ID_COUNT, post_aggregation_thresholding",
        lambda: release(
            pums,
            M.PRIVACY_ID_COUNT,
            by_educ,
            None,
            DELTA,
            **one,
            post_aggregation_thresholding=True,
        ),
    )
    add(
        "suppress",
        "COUNT, default selection (truncated geometric)",
        lambda: release(pums, M.COUNT, by_educ, None, DELTA, **one),
    )
    return _run_plans("pipelinedp", version, plans, t, reps)


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


# -- Tumult Analytics (Spark) -----------------------------------------------------------------


def tumult_rows(data: Data, t: Truth, reps: int, queries: list[str]) -> list[Result]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    import pandas as pd
    from pyspark.sql import SparkSession

    scratch = tempfile.mkdtemp(prefix="bench-peers-spark-")
    spark = (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.sql.warehouse.dir", scratch + "/warehouse")
        .config("spark.local.dir", scratch)
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    from tmlt.analytics import (
        AddOneRow,
        AddRowsWithID,
        ApproxDPBudget,
        KeySet,
        MaxGroupsPerID,
        MaxRowsPerGroupPerID,
        MaxRowsPerID,
        PureDPBudget,
        QueryBuilder,
        Session,
    )

    version = "tmlt.analytics " + _version("tmlt.analytics")
    cols = ["pid", "educ", "income"]
    pums = spark.createDataFrame(pd.read_csv(data.pums)[cols].astype({"income": float})).cache()
    dup = spark.createDataFrame(pd.read_csv(data.dup)[cols].astype({"income": float})).cache()
    big = 1e9
    row_sess = Session.from_dataframe(PureDPBudget(big), "pums", pums, protected_change=AddOneRow())
    id_sess = Session.from_dataframe(
        PureDPBudget(big), "dup", dup, protected_change=AddRowsWithID("pid")
    )
    approx_sess = Session.from_dataframe(
        ApproxDPBudget(big, 0.5), "pums", pums, protected_change=AddOneRow()
    )
    keys = KeySet.from_dict({"educ": EDUC})
    pure = PureDPBudget(EPSILON)

    def grouped(df, col) -> dict:
        return {int(k): float(v) for k, v in zip(df["educ"], df[col], strict=True) if v == v}

    def ev(sess, query, budget=pure):
        return sess.evaluate(query, budget).toPandas()

    def bounded(column_query: Callable, share: float = 0.1) -> Callable[[], Any]:
        """get_bounds on share·ε, then the query with (max(0, lower), upper) on the rest."""

        def run() -> Any:
            bounds = QueryBuilder("pums").get_bounds("income", "lo", "hi")
            b = ev(row_sess, bounds, PureDPBudget(share * EPSILON))
            lo, hi = max(LOWER, float(b["lo"][0])), min(UPPER, float(b["hi"][0]))
            return column_query(lo, max(hi, lo + 1), PureDPBudget((1 - share) * EPSILON))

        return run

    plans: dict[str, list] = {}

    def add(q: str, method: str, run: Callable[[], Any]) -> None:
        if q in queries:
            plans.setdefault(q, []).append((method, lambda run=run: run))

    add(
        "hist",
        "groupby(KeySet).count()",
        lambda: grouped(ev(row_sess, QueryBuilder("pums").groupby(keys).count()), "count"),
    )
    add(
        "avg",
        "average(low=0, high=500000)",
        lambda: grouped(
            ev(
                row_sess,
                QueryBuilder("pums").groupby(keys).average("income", LOWER, UPPER, name="v"),
            ),
            "v",
        ),
    )
    add(
        "avg",
        "get_bounds (10% of ε), then average",
        bounded(
            lambda lo, hi, b: grouped(
                ev(
                    row_sess,
                    QueryBuilder("pums").groupby(keys).average("income", lo, hi, name="v"),
                    b,
                ),
                "v",
            )
        ),
    )
    add(
        "median",
        "median(low=0, high=500000)",
        lambda: grouped(
            ev(
                row_sess,
                QueryBuilder("pums").groupby(keys).median("income", LOWER, UPPER, name="v"),
            ),
            "v",
        ),
    )
    add(
        "sum",
        "sum(low=0, high=500000)",
        lambda: float(
            ev(row_sess, QueryBuilder("pums").sum("income", LOWER, UPPER, name="v"))["v"][0]
        ),
    )
    add(
        "sum",
        "get_bounds (10% of ε), then sum",
        bounded(
            lambda lo, hi, b: float(
                ev(row_sess, QueryBuilder("pums").sum("income", lo, hi, name="v"), b)["v"][0]
            )
        ),
    )
    for r in PEER_R:
        add(
            "dup_count",
            f"MaxRowsPerID({r}).count()",
            lambda r=r: float(
                ev(id_sess, QueryBuilder("dup").enforce(MaxRowsPerID(r)).count())["count"][0]
            ),
        )
        add(
            "dup_sum",
            f"MaxRowsPerID({r}).sum(0, 500000)",
            lambda r=r: float(
                ev(
                    id_sess,
                    QueryBuilder("dup")
                    .enforce(MaxRowsPerID(r))
                    .sum("income", LOWER, UPPER, name="v"),
                )["v"][0]
            ),
        )
        add(
            "dup_hist",
            f"MaxGroupsPerID(1), MaxRowsPerGroupPerID({r}), count",
            lambda r=r: grouped(
                ev(
                    id_sess,
                    QueryBuilder("dup")
                    .enforce(MaxGroupsPerID("educ", 1))
                    .enforce(MaxRowsPerGroupPerID("educ", r))
                    .groupby(keys)
                    .count(),
                ),
                "count",
            ),
        )
    add(
        "suppress",
        "get_groups at (ε, δ) (keys alone)",
        lambda: {
            int(k): 1.0
            for k in ev(
                approx_sess,
                QueryBuilder("pums").get_groups(["educ"]),
                ApproxDPBudget(EPSILON, DELTA),
            )["educ"]
        },
    )
    try:
        return _run_plans("tumult", version, plans, t, reps)
    finally:
        spark.stop()
        shutil.rmtree(scratch, ignore_errors=True)


# -- table ------------------------------------------------------------------------------------


def fmt(query: str, v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if query == "hist":
        return f"{v:.3f}"
    if query == "sum":
        return f"{v:.3g}"
    return f"{v:.2%}"


def best_of(results: list[Result], query: str, library: str) -> Result | None:
    mine = [
        r for r in results if r.query == query and r.library == library and not math.isnan(r.error)
    ]
    return min(mine, key=lambda r: r.error) if mine else None


def table(results: list[Result], absent: dict[str, str]) -> str:
    heads = ["oracle / floor", "dpsql default", "OpenDP", "PipelineDP", "Tumult"]
    lines = [
        "| query | metric | " + " | ".join(heads) + " |",
        "| --- | --- |" + " ---: |" * len(heads),
    ]
    for q, (label, metric) in QUERIES.items():
        cells = []
        for lib in LIBRARIES:
            if lib in absent:
                cells.append(absent[lib])
                continue
            b = best_of(results, q, lib)
            if b is None:
                tried = [r for r in results if r.query == q and r.library == lib]
                cells.append("refused" if tried else "")
                continue
            r_note = ""
            if q.startswith("dup_") and lib in ("opendp", "pipelinedp", "tumult"):
                r_note = " (" + next((w for w in _r_words(b.method)), "") + ")"
            cells.append(fmt(q, b.error) + r_note)
        lines.append(f"| {label} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _r_words(method: str) -> list[str]:
    import re

    # the last number in the method is R ("MaxGroupsPerID(1), MaxRowsPerGroupPerID(4)")
    found = re.findall(r"R=(\d)\b|\((\d)\)", method)
    return [f"R={found[-1][0] or found[-1][1]}"] if found else []


def detail(results: list[Result]) -> str:
    lines = [
        "| query | library | method | error | reps | note |",
        "| --- | --- | --- | ---: | ---: | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r.query} | {r.library} | {r.method} | {fmt(r.query, r.error)} "
            f"| {r.reps} | {r.note} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        default=Path("/work/shared/datasets"),
        help="PUMS directory (or its parent)",
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions (200 for the docs)")
    parser.add_argument(
        "--tumult-reps",
        type=int,
        default=None,
        help="cap Tumult's repetitions (Spark: ~2 s a query)",
    )
    parser.add_argument(
        "--libraries",
        default=",".join(LIBRARIES),
        help="comma-separated subset of " + ",".join(LIBRARIES),
    )
    parser.add_argument(
        "--queries",
        default=",".join(QUERIES),
        help="comma-separated subset of " + ",".join(QUERIES),
    )
    parser.add_argument(
        "--r-values",
        default=",".join(map(str, R_VALUES)),
        help="rows per person each peer runs on PUMS_dup (its best is shown)",
    )
    parser.add_argument("--method-match", default="", help="peer variants whose method has this")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="print one table from earlier --json files (later files win)",
    )
    parser.add_argument(
        "--detail", action="store_true", help="also print every variant (each R, each method)"
    )
    args = parser.parse_args(argv)

    absent: dict[str, str] = {}
    if args.merge:
        merged: dict[tuple[str, str, str], Result] = {}
        for path in args.merge:
            payload = json.loads(path.read_text())
            for row in payload["results"]:
                r = Result(**row)
                merged[(r.query, r.library, r.method)] = r
            absent.update(payload.get("absent", {}))
        results = list(merged.values())
        for lib in {r.library for r in results}:
            absent.pop(lib, None)
        print(table(results, absent))
        if args.detail:
            print("\n" + detail(results))
        return 0

    global PEER_R, METHOD_MATCH
    PEER_R = tuple(int(r) for r in args.r_values.split(",") if r)
    METHOD_MATCH = args.method_match
    data = load(args.data)
    truth = Truth(data)
    queries = [q for q in args.queries.split(",") if q]
    wanted = [lib for lib in args.libraries.split(",") if lib]
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    results: list[Result] = []
    runners = {"opendp": opendp_rows, "pipelinedp": pipelinedp_rows, "tumult": tumult_rows}
    modules = {"opendp": "opendp", "pipelinedp": "pipeline_dp", "tumult": "tmlt.analytics"}
    if "oracle" in wanted:
        results += [r for r in oracle_rows(data, truth, args.reps) if r.query in queries]
    for lib in ("opendp", "pipelinedp", "tumult"):
        if lib not in wanted:
            continue
        try:
            __import__(modules[lib])
        except ImportError as exc:
            absent[lib] = "not installed"
            print(f"{lib}: not installed ({exc})", file=sys.stderr)
            continue
        reps = (
            min(args.reps, args.tumult_reps) if lib == "tumult" and args.tumult_reps else args.reps
        )
        results += runners[lib](data, truth, reps, queries)
    if "dpsql" in wanted:  # last: other work moves its defaults; its figures are the newest
        results += dpsql_rows(data, truth, args.reps, queries)
    elapsed = time.perf_counter() - start
    print(table(results, absent))
    if args.detail:
        print("\n" + detail(results))
    footer = (
        f"{args.reps} repetitions, ε = {EPSILON}, δ = {DELTA}; {elapsed:.0f} s; load average "
        f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end; {os.cpu_count()} cores"
    )
    print("\n" + footer, file=sys.stderr)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "results": [asdict(r) for r in results],
                    "absent": absent,
                    "run": footer,
                    "libraries": wanted,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
