"""Pictures for choosing ε and watching a budget: ``dpsql plot error`` and ``dpsql plot budget``.

``error`` re-plans the query at a range of ε and reads each released value's noise off the
plan's (public) mechanisms: no data is read and nothing is spent. ``budget`` draws an analyst's
spent ε over time from the ledger's append-only log, against the limit in force at each time.
The data functions need nothing beyond dpsql; drawing needs matplotlib
(``pip install 'dpsql[plot]'``), PNG or SVG by file name.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpsql.errors import Error, InterfaceError, ProgrammingError


@dataclass(frozen=True)
class Series:
    label: str
    halfwidths: tuple[float, ...]  # one per epsilon, in the released value's units


@dataclass(frozen=True)
class ErrorCurves:
    """Per released value (or part of one), the noise half-width at each ε."""

    epsilons: tuple[float, ...]
    series: tuple[Series, ...]
    session_epsilon: float
    confidence: float
    query: str


def error_curves(
    service: Any,
    sql: str,
    settings: Any,
    analyst: str = "",
    epsilons: Sequence[float] | None = None,
    rows_per_group: float | None = None,
) -> ErrorCurves:
    """Re-plan ``sql`` at each ε (default: 1/30 to 30 times the session's, 31 points) and
    take each measure's half-width at ``settings.confidence`` in released units.

    A single-measure value (COUNT, SUM) is one curve: its exact error. A formula (AVG, VAR,
    centred SUM) is one curve per measure (its sum, its count, ...): its error depends on the
    group's true size, which only a charged query may look at. Given a public guess of that
    size, ``rows_per_group``, an AVG is one curve instead: its sum's noise over the rows
    (exact when the mean sits at the midpoint of the declared bounds, where the sum is
    centred; the count's noise adds a little elsewhere).
    """
    from dataclasses import replace

    from dpsql.frontend.bind import parse_statement
    from dpsql.frontend.statements import DPQuery, ExplainStatement

    statement = parse_statement(sql, service.policy)
    if isinstance(statement, ExplainStatement):
        statement = statement.query
    if not isinstance(statement, DPQuery):
        raise ProgrammingError(
            "plot error takes an aggregate SELECT over a policy table",
            construct="SQL",
            hint="e.g. SELECT department, COUNT(*) FROM visits GROUP BY department",
        )
    base = settings.epsilon
    grid = (
        tuple(float(e) for e in epsilons)
        if epsilons is not None
        else tuple(base * 10 ** (-1.5 + 0.1 * i) for i in range(31))
    )
    labels: list[str] = []
    values: dict[str, list[float]] = {}
    for eps in grid:
        plan = service.plan(statement, replace(settings, epsilon=eps), analyst)
        for label, half in _halfwidths(plan, settings.confidence, rows_per_group):
            if label not in values:
                labels.append(label)
                values[label] = []
            values[label].append(half)
    series = tuple(Series(label, tuple(values[label])) for label in labels)
    return ErrorCurves(grid, series, base, settings.confidence, " ".join(sql.split()))


def _halfwidths(
    plan: Any, confidence: float, rows_per_group: float | None = None
) -> list[tuple[str, float]]:
    from dpsql.aggregates import kind_of, values_measure  # numba and scipy: not for --help

    out = []
    for o in plan.outputs:
        parts = [plan.measure(name) for name in o.measures]
        kind = kind_of(o)  # a sum over a count (AVG), a recentred sum (SUM): its object says
        if kind.ratio and rows_per_group:
            m = parts[0]
            half = m.mechanism.interval_halfwidth(confidence) * m.unit / rows_per_group
            out.append((f"{o.call.label} at {rows_per_group:g} rows per group", float(half)))
            continue
        if kind.recentred and parts[0].center:
            count = values_measure(plan, parts[0])  # COUNT(col) or the shared count
            out.append((o.call.label, _centred_sum_halfwidth(parts[0], count, confidence)))
            continue
        for m in parts:
            label = o.call.label if len(parts) == 1 else f"{o.call.label}: {_words(m)}"
            out.append((label, float(m.mechanism.interval_halfwidth(confidence) * m.unit)))
    if plan.threshold is not None:
        m = plan.measure(plan.threshold.measure)
        label = "GROUP BY " + ", ".join(k.key.sql for k in plan.keys) + ": its unit count (τ)"
        out.append((label, float(m.mechanism.interval_halfwidth(confidence))))
    return out


def _centred_sum_halfwidth(total: Any, count: Any, confidence: float) -> float:
    """A centred SUM is g (S + c N): its noise g (e_S + c e_N), simulated from the public
    mechanisms as its released interval is (dpsql.privacy.release)."""
    import numpy as np

    from dpsql.privacy.release import simulated_noise

    e_sum, e_count = simulated_noise(12345, (total.mechanism, count.mechanism), 20_000)
    error = total.granularity * (e_sum / total.scale + total.center * e_count / count.scale)
    return float(np.quantile(np.abs(error), confidence))


def _words(measure: Any) -> str:
    # what each measure's noise is, in words: its kind's object says (dpsql.plan.measure_kinds)
    return "noise in " + (measure.measure_kind.shown or measure.kind)


@dataclass(frozen=True)
class BudgetTimeline:
    """Per analyst, the ε spent (ε-equivalent of the running total) after each charge or reset,
    and the ε limit in force then.

    ``limits[i][j]`` is the budget ε in force at event ``times[i][j]`` (an administrator's
    change, a "budget" row of the log, applies from its own time on); ``steps[i]`` is the
    limit as a step line, (time, ε) at the analyst's first log row, at every change, and at
    the last row; ``budgets`` the limit in force today.
    """

    analysts: tuple[str, ...]
    times: tuple[tuple[dt.datetime, ...], ...]
    spent: tuple[tuple[float, ...], ...]
    budgets: tuple[float, ...]
    dataset: str
    limits: tuple[tuple[float, ...], ...] = ()
    steps: tuple[tuple[tuple[dt.datetime, float], ...], ...] = ()


# A "budget" log row's text (SQLiteLedger.set_budget): the new budget and the one it replaced.
_BUDGET_SET = re.compile(
    r"budget set to epsilon=(\S+) delta=(\S+) "
    r"\(was (?:epsilon=(\S+) delta=(\S+)|the policy default)\)"
)


def _changed(default: Any, text: str) -> tuple[Any, Any] | None:
    """(the budget before, the budget after) a "budget" row, or None if it does not parse.

    An override keeps the policy's split of its δ (as SQLiteLedger reads it back)."""
    found = _BUDGET_SET.match(text)
    if found is None:
        return None
    new_eps, new_delta, old_eps, old_delta = found.groups()
    after = dataclasses.replace(default, epsilon=float(new_eps), delta=float(new_delta))
    if old_eps is None:
        return default, after
    return dataclasses.replace(default, epsilon=float(old_eps), delta=float(old_delta)), after


def _at(entry: Any) -> dt.datetime:
    return dt.datetime.fromisoformat(entry.at.replace("Z", "+00:00"))


def budget_timeline(policy: Any, ledger: Any, analyst: str | None = None) -> BudgetTimeline:
    """From the ledger's log: charges add, a reset releases everything spent before it, and a
    "budget" row changes the limit from then on (the ε spent is converted under the budget in
    force at each charge, whose δ the zCDP conversion uses)."""
    from dpsql.privacy.accounting import Cost

    entries = ledger.entries(policy.dataset, analyst=analyst, limit=10**9)
    names = sorted({e.analyst for e in entries}) if analyst is None else [analyst]
    times, spent, budgets, limits, steps = [], [], [], [], []
    for name in names:
        own = [e for e in entries if e.analyst == name]
        changes = [
            c for e in own if e.kind == "budget" and (c := _changed(policy.budget, e.query_text))
        ]
        # before the first recorded change: the budget it replaced (else the policy default)
        budget = changes[0][0] if changes else ledger.budget(name, policy.dataset, policy.budget)
        total, at, eps, limit = Cost(), [], [], []
        step = [(_at(own[0]), float(budget.epsilon))] if own else []
        for e in own:
            if e.kind == "charge":
                total = total + e.cost
            elif e.kind == "reset":
                total = Cost()
            elif e.kind == "budget" and (change := _changed(policy.budget, e.query_text)):
                budget = change[1]
                step.append((_at(e), float(budget.epsilon)))
                continue
            else:
                continue
            at.append(_at(e))
            eps.append(float(budget.epsilon_of(total)))
            limit.append(float(budget.epsilon))
        if own:
            step.append((_at(own[-1]), float(budget.epsilon)))
        times.append(tuple(at))
        spent.append(tuple(eps))
        limits.append(tuple(limit))
        steps.append(tuple(step))
        budgets.append(float(ledger.budget(name, policy.dataset, policy.budget).epsilon))
    return BudgetTimeline(
        tuple(names),
        tuple(times),
        tuple(spent),
        tuple(budgets),
        policy.dataset,
        tuple(limits),
        tuple(steps),
    )


# -- drawing --------------------------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise InterfaceError(
            "drawing needs matplotlib", hint="pip install 'dpsql[plot]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _check_suffix(path: Path) -> None:
    if path.suffix.lower() not in (".png", ".svg"):
        raise InterfaceError(
            f"cannot draw {path.name}: PNG and SVG only", hint="name the file *.png or *.svg"
        )


def draw_error(curves: ErrorCurves, path: str | Path) -> Path:
    path = Path(path)
    _check_suffix(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    for i, s in enumerate(curves.series):
        line, marker = styles[i % len(styles)]
        ax.plot(curves.epsilons, s.halfwidths, linestyle=line, marker=marker, ms=3, label=s.label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axvline(curves.session_epsilon, color="grey", linestyle="--")
    ax.annotate(
        f"session ε = {curves.session_epsilon:g}",
        (curves.session_epsilon, 1),
        xycoords=("data", "axes fraction"),
        xytext=(4, -14),
        textcoords="offset points",
        color="grey",
    )
    ax.set_xlabel("ε of the query (log)")
    ax.set_ylabel(f"±error, {curves.confidence:.0%} of noise draws (log)")
    title = curves.query if len(curves.query) <= 90 else curves.query[:89] + "…"
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.savefig(path)
    plt.close(fig)
    return path


def draw_budget(timeline: BudgetTimeline, path: str | Path) -> Path:
    path = Path(path)
    _check_suffix(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    for name, at, eps, step in zip(
        timeline.analysts, timeline.times, timeline.spent, timeline.steps, strict=True
    ):
        (line,) = ax.step(at, eps, where="post", marker=".", label=f"{name} spent")
        if step:  # the limit in force at each time, not today's over the past
            when, limit = zip(*step, strict=True)
            ax.step(when, limit, where="post", color=line.get_color(), linestyle="--", alpha=0.6)
    ax.set_xlabel("time (UTC)")
    ax.set_ylabel("ε spent (dashed: the budget in force)")
    ax.set_title(f"privacy budget spent on {timeline.dataset!r}", fontsize=9)
    ax.grid(True, alpha=0.3)
    if timeline.analysts:
        ax.legend(fontsize=8)
    fig.autofmt_xdate()
    fig.savefig(path)
    plt.close(fig)
    return path


# -- the command --------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    plot = sub.add_parser(
        "plot",
        help="draw error against epsilon for a query, or a budget over time (PNG/SVG)",
        description="Pictures that need matplotlib (pip install 'dpsql[plot]').",
    )
    kinds = plot.add_subparsers(dest="plot_command", metavar="KIND", required=True)
    p = kinds.add_parser(
        "error",
        help="each released value's noise against epsilon (spends nothing, reads no data)",
        description="Re-plan the query over a range of epsilon and draw each released "
        "value's noise half-width on log axes, marking the session's epsilon.",
    )
    p.add_argument("sql", help="the query (quote it)")
    p.add_argument("--policy", required=True, help="privacy policy (TOML)")
    p.add_argument("--analyst", default="default", help="whose session settings to use")
    p.add_argument("--epsilon", type=float, help="the session's epsilon (default: policy's)")
    p.add_argument("--delta", type=float)
    p.add_argument("--mechanism", choices=("laplace", "gaussian"))
    p.add_argument("--confidence", type=float, default=0.95, help="interval level")
    p.add_argument(
        "--rows-per-group",
        type=float,
        metavar="N",
        help="a public guess of the rows per group: draws an AVG's own error at that size",
    )
    p.add_argument("-o", "--output", default="error.png", help="PNG or SVG file")
    p.set_defaults(handler=_plot_error)
    p = kinds.add_parser(
        "budget",
        help="an analyst's spent epsilon over time, from the ledger's log",
        description="Draw the running epsilon spent after each charge (resets drop it to 0).",
    )
    p.add_argument("--policy", required=True, help="privacy policy (TOML)")
    p.add_argument("--analyst", help="one analyst (default: everyone in the log)")
    p.add_argument("-o", "--output", default="budget.png", help="PNG or SVG file")
    p.set_defaults(handler=_plot_budget)


def _plot_error(args: argparse.Namespace) -> int:
    from dpsql.pipeline import Settings
    from dpsql.service.opening import open_session

    try:
        with open_session(args.policy, analyst=args.analyst) as session:
            service = session.service
            settings = Settings.from_policy(service.policy)
            for name in ("epsilon", "delta", "mechanism", "confidence"):
                if getattr(args, name) is not None:
                    setattr(settings, name, getattr(args, name))
            curves = error_curves(
                service, args.sql, settings, args.analyst, rows_per_group=args.rows_per_group
            )
        path = draw_error(curves, args.output)
    except Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    n = len(curves.series)
    print(f"wrote {path} ({n} curve{'' if n == 1 else 's'}, nothing spent)")
    return 0


def _plot_budget(args: argparse.Namespace) -> int:
    from dpsql.policy import load_policy
    from dpsql.privacy.sqlite_ledger import SQLiteLedger

    try:
        policy = load_policy(args.policy)
        if policy.ledger_path is None or not policy.ledger_path.exists():
            print(f"error: no ledger at {policy.ledger_path} yet: nothing spent", file=sys.stderr)
            return 1
        with SQLiteLedger(policy.ledger_path) as ledger:
            timeline = budget_timeline(policy, ledger, args.analyst)
        path = draw_budget(timeline, args.output)
    except Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    events = sum(len(s) for s in timeline.spent)
    print(f"wrote {path} ({events} event{'' if events == 1 else 's'} in the log)")
    return 0
