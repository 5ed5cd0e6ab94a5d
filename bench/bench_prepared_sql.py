"""Issue 28 item 2 for the opt-in SQL store: the plan over the store against the plan without
one, the same compiled query side by side, on bench_fast's data and policy.

Only the plan is timed: one service with ``[engine] prepared = "memory"`` (its in-memory
store, the compiled pass, hidden so both sides run SQL) plans each text once (new k every
run, untimed), compiles it twice with the same secret -- over the store and with
``store=False`` -- and times the engine's execution of each (process CPU, DuckDB's threads
included), checking both return the same integers. What a query buys once per analyst and
data version (the default clamp range's histogram, keys ``bounds:...``) is bought by an untimed
first run and kept (bench_fast's ``_Unreplayed`` ledger), so neither side pays it; ``--clip
declared`` states ``clip = "declared"`` on cost instead (the plan's range is the declared one,
the store's fixed-point column). ``--bias on`` keeps the bias measures (the session default;
no store plan computes them, so both sides run the same plan); off by default here, the answer
alone, which is what a store plan serves.

Shapes: row-level (``tr``) and privacy unit with R = 10, with and without a WHERE that changes
every run; ``tu`` G = 1 (every unit in 10 groups: every unit over G), ``tw`` G = 16 (every unit
within G: the store's proven-direct side); ``--bounding sample`` samples R rows of a pair
instead of rescaling it (the default). Interleaved rounds (which side runs first alternates),
medians, ratio store / no store; "plan" says whether the store's plan ran or store_tree left
the shape to the plan without a store (``--unrouted``: the store plan for every shape, as
before that routing, to measure what it would cost).

    python bench/bench_prepared_sql.py --rows 2000000 --reps 5
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_fast as bf  # noqa: E402

from dpsql.dbapi import Service  # noqa: E402
from dpsql.frontend.bind import parse_statement  # noqa: E402
from dpsql.lower.compile import compile_plan  # noqa: E402
from dpsql.pipeline import Settings  # noqa: E402

SHAPES = {  # name: (table, text)
    "row-level, WHERE": ("tr", bf.Q),
    "row-level, no WHERE": ("tr", bf.Q0),
    "unit G=1 (all over G), WHERE": ("tu", bf.Q),
    "unit G=1 (all over G), no WHERE": ("tu", bf.Q0),
    "unit G=16 (all within G), WHERE": ("tw", bf.Q),
    "unit G=16 (all within G), no WHERE": ("tw", bf.Q0),
}


def policy(clip: str, bounding: str = "scale") -> dict:
    pol = copy.deepcopy(bf.policy())
    pol["tables"]["tu"]["bounding"] = bounding
    pol["engine"] = {"prepared": "memory"}
    tw = copy.deepcopy(pol["tables"]["tu"])
    tw["max_groups_per_unit"] = 16
    pol["tables"]["tw"] = tw
    if clip == "declared":
        for table in pol["tables"].values():
            table["columns"]["cost"] = {**table["columns"]["cost"], "clip": "declared"}
    return pol


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bias", choices=["off", "on"], default="off")
    ap.add_argument("--bounding", choices=["scale", "sample"], default="scale")
    ap.add_argument(
        "--unrouted",
        action="store_true",
        help="the two-phase store plan for every shape (as before store_tree's routing)",
    )
    ap.add_argument("--only", default="", help="the shapes whose name contains this")
    ap.add_argument("--clip", choices=["default", "declared"], default="default")
    ap.add_argument("--data-dir", type=Path, default=ROOT / "bench" / "data")
    args = ap.parse_args(argv)
    if args.unrouted:
        from dpsql.lower import prepared_plan

        prepared_plan.two_phase_pays = lambda plan: True  # type: ignore[assignment]
    db = args.data_dir / f"fast_{args.rows}.duckdb"
    bf.generate(db, args.rows)
    shapes = {name: shape for name, shape in SHAPES.items() if args.only in name}
    svc = Service(policy(args.clip, args.bounding), str(db), ledger=bf._Unreplayed())
    svc.engine.wait_for_stores()
    svc.engine.columns.clear()  # SQL plans on both sides
    settings = dataclasses.replace(Settings.from_policy(svc.policy), bias_estimate=args.bias)
    for table, text in shapes.values():  # buys what is kept (the clamp histogram), untimed
        svc.execute(text.format(t=table, k=0), None, settings, "a")
    load = " ".join(map(str, os.getloadavg()))
    opts = f"bias {args.bias}, clip {args.clip}, bounding {args.bounding}, unrouted {args.unrouted}"
    print(f"{args.rows:,} rows; {opts}; load {load}", flush=True)
    ctr = itertools.count(1)
    secrets = itertools.count(12345)

    def side(name: str, table: str, text: str) -> Callable[[bool], tuple[float, float]]:
        def run(store_first: bool) -> tuple[float, float]:
            plan = svc.plan(
                parse_statement(text.format(t=table, k=next(ctr)), svc.policy), settings, "a"
            )
            secret = next(secrets)
            timed: dict[object, float] = {}
            results = []
            for store in (None, False) if store_first else (False, None):
                compiled = dataclasses.replace(
                    compile_plan(plan, secret, store=store), program=None
                )
                c = bf.cpu()
                result = svc.engine.execute(compiled)
                timed[store] = bf.cpu() - c
                results.append(
                    sorted(zip(result.key_rows, *result.measures, strict=True), key=repr)
                )
            if results[0] != results[1]:
                raise SystemExit(f"store plan != plan without one: {name}")
            return timed[None], timed[False]

        return run

    runs = {name: side(name, table, text) for name, (table, text) in shapes.items()}
    chosen = {}  # does the plan read the store (its SQL differs from the plan without one)?
    for name, (table, text) in shapes.items():
        plan = svc.plan(parse_statement(text.format(t=table, k=1), svc.policy), settings, "a")
        sql = [
            dataclasses.replace(compile_plan(plan, 1, store=s), program=None).render(
                svc.engine.dialect
            )
            for s in (None, False)
        ]
        chosen[name] = "store" if sql[0] != sql[1] else "same plan"
    store_t: dict[str, list[float]] = {k: [] for k in runs}
    plain_t: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.reps):
        for name, fn in runs.items():  # alternate which side runs first
            s, p = fn(i % 2 == 0)
            store_t[name].append(s)
            plain_t[name].append(p)
    print(f"{'shape':36s} {'store ms':>9s} {'no store ms':>11s} {'store/none':>10s}  plan")
    for name in runs:
        s, p = statistics.median(store_t[name]), statistics.median(plain_t[name])
        print(f"{name:36s} {s * 1e3:9.1f} {p * 1e3:11.1f} {s / p:10.2f}  {chosen[name]}")
    print(f"load {' '.join(map(str, os.getloadavg()))}")
    svc.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
