"""Instructions per new-shape plan: a load-independent measure of planning's cost.

Timing planning on this shared 2-core machine moves ±30% with the load (the other sessions'
processes share the cores and their caches), which hides a 10% change. The number of
instructions the CPU retires does not move with the load: this script counts them with
valgrind's callgrind for the path bench_small.py times as ``cold`` (a new shape every time,
every cache off: parse, bind, type, plan, check, answer key, compile), over the fixture's
typical queries (bench_small.TEMPLATES without the computed-key one, whose key domain is a
DuckDB query each time), after one warm-up pass (imports, the policy's domain caches).

Only the planning loop is counted: it runs inside ``functools.reduce``, and callgrind collects
inside that C function alone (``--toggle-collect``). At this machine's ~0.19 ms per million
instructions (2026-12-07), 5.2M is about 1 ms.

    python bench/bench_planning_instructions.py               # this tree
    python bench/bench_planning_instructions.py --tree OTHER  # another tree (a git archive)
    python bench/bench_planning_instructions.py --bias off    # SET bias_estimate = off
    python bench/bench_planning_instructions.py --steps      # and per step (see below)

``--steps`` also counts each step of the same plans on its own, a loop of its own around it
(the statements parsed, the plans planned before): parse and bind (``parse_statement``), type,
domains, bounds and plan with its check (``Service.plan``), the answer key (``answer_key``),
and compiling with the SQL rendered where the plan has no column program. What the ``cold``
path does besides (the plan and text caches asked and told) is the whole less their sum.

Needs valgrind (apt install valgrind); ~1.5 min a run.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _steps(service, settings, texts: list[str]) -> None:
    """Each step's loop (see the module doc): one ``functools.reduce`` each, which callgrind
    dumps apart (``--dump-before``)."""
    import functools

    from dpsql.frontend.bind import parse_statement
    from dpsql.plan.canonical import answer_key
    from dpsql.service.plan_cache import SecretTemplate

    statements = [parse_statement(t, service.policy) for t in texts]
    plans = [service.plan(s, settings, "bench") for s in statements]

    def compiled(plan) -> None:
        query = SecretTemplate.build(plan).with_secret(12345)
        if query.program is None:
            query.render("duckdb")

    functools.reduce(lambda _, t: parse_statement(t, service.policy), texts, None)
    functools.reduce(lambda _, s: service.plan(s, settings, "bench"), statements, None)
    functools.reduce(lambda _, p: answer_key(p), plans, None)
    functools.reduce(lambda _, p: compiled(p), plans, None)


STEPS = (
    "parse and bind",
    "type, domains, bounds, plan, check",
    "answer key",
    "compile",
)


def _child(bias: str, per_template: int, steps: bool = False) -> None:
    import dataclasses
    import functools
    import gc

    sys.path.insert(0, str(Path.cwd() / "bench"))
    sys.path.insert(0, str(Path.cwd()))
    import bench_small as b

    import dpsql
    from dpsql.privacy.ledger import MemoryLedger
    from dpsql.service.settings import Settings

    service = dpsql.Service(b.FIXTURE, ledger=MemoryLedger(), cache=False, plan_cache=0)
    settings = Settings.from_policy(service.policy)
    if bias == "off":
        settings = dataclasses.replace(settings, bias_estimate="off")
    texts = [
        b._text(t, k) for t in b.TEMPLATES if "FLOOR" not in t for k in range(1, per_template + 1)
    ]
    for text in texts:  # warm-up: imports, the policy's domain caches
        b._plan_cpu(service, text + " ", settings)
    gc.collect()
    gc.disable()  # a collection's cost depends on what else the process holds
    if steps:
        _steps(service, settings, texts)
    functools.reduce(lambda _, text: b._plan_cpu(service, text, settings), texts, None)
    print(f"plans {len(texts)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", default=str(ROOT), help="the source tree to measure")
    parser.add_argument("--bias", choices=("on", "off"), default="on")
    parser.add_argument("--per-template", type=int, default=5)
    parser.add_argument("--steps", action="store_true", help="also count each step apart")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.bias, args.per_template, args.steps)
        return 0
    tree = Path(args.tree).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--toggle-collect=functools_reduce",
            *(["--dump-before=functools_reduce"] if args.steps else []),
            f"--callgrind-out-file={out}",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            "--bias",
            args.bias,
            "--per-template",
            str(args.per_template),
            *(["--steps"] if args.steps else []),
        ]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        run = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
        # with --steps: a dump before each reduce, the last (the whole) in ``out`` itself
        dumps = sorted(Path(tmp).glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
        counts = [_total(p) for p in dumps if _total(p)]
        whole = _total(out) if args.steps and out.exists() else 0
    text = run.stdout + run.stderr
    plans = re.search(r"plans (\d+)", text)
    collected = re.search(r"Collected : ([\d,]+)", text)
    if run.returncode != 0 or plans is None or collected is None:
        print(text[-2000:], file=sys.stderr)
        return 1
    # with --steps "Collected" sums every loop: the whole plan's is the last dump's own
    total = whole or int(collected.group(1).replace(",", ""))
    per_plan = total / int(plans.group(1))
    print(f"{tree}: {per_plan / 1e6:.3f} M instructions per new-shape plan (bias {args.bias})")
    if args.steps:
        n = int(plans.group(1))
        for name, count in zip(STEPS, counts[-len(STEPS) :], strict=False):
            print(f"  {name}: {count / n / 1e6:.3f} M")
    return 0


def _total(dump: Path) -> int:
    """The instructions one callgrind dump counted (its ``totals:`` line)."""
    for line in dump.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
