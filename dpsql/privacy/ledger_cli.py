"""``dpsql budget``: show spending, and the administrator commands set / reset / log / verify /
backup / restore.

The administrator boundary is filesystem access to the ledger file: whoever can write it can
change budgets (these commands only make that convenient and logged), so the ledger and its
``-wal`` / ``-shm`` files must be writable by the dpsql service account only, never by analysts.
The ledger creates them with mode 0600 and tightens looser ones when it opens them. Figures are
printed as floats; the ledger keeps and compares them exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dpsql.errors import Error
from dpsql.tables import number, render

if TYPE_CHECKING:
    from dpsql.policy import Policy
    from dpsql.privacy.ledger import AnalystStatus, LogEntry
    from dpsql.privacy.sqlite_ledger import SQLiteLedger

_ADMIN_NOTE = (
    "Administrator command: anyone who can write the ledger file can change budgets, so keep "
    "it (and its -wal/-shm files) writable by the dpsql service account only."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``dpsql budget`` and its subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--policy",
        default=argparse.SUPPRESS,
        metavar="P",
        help="privacy policy (TOML); the ledger is its [privacy] ledger path (required)",
    )
    analyst = argparse.ArgumentParser(add_help=False)
    analyst.add_argument("--analyst", default=argparse.SUPPRESS, metavar="A", help="analyst name")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON instead of a table")

    budget = subparsers.add_parser(
        "budget",
        parents=[common, analyst, as_json],
        help="show and administer privacy budgets",
        description="Show each analyst's spent and remaining privacy budget on the policy's "
        "dataset (epsilon, delta, rho, and the epsilon they amount to). Subcommands change "
        "budgets; see `dpsql budget COMMAND --help`.",
    )
    budget.set_defaults(handler=show)
    sub = budget.add_subparsers(dest="budget_command", metavar="COMMAND")

    p = sub.add_parser(
        "set",
        parents=[common, analyst],
        help="set (raise or lower) an analyst's total budget",
        description="Override the policy's default budget for one analyst. " + _ADMIN_NOTE,
    )
    p.add_argument("--epsilon", type=float, required=True, metavar="E", help="total epsilon > 0")
    p.add_argument(
        "--delta",
        type=float,
        default=None,
        metavar="D",
        help="total delta in [0, 1) (default: keep the current one)",
    )
    p.set_defaults(handler=set_budget)

    p = sub.add_parser(
        "reset",
        parents=[common, analyst],
        help="release an analyst's spending (logged, nothing is deleted)",
        description="Set an analyst's spending back to zero. The reset is appended to the "
        "log as an event carrying the released amount; no log row is deleted, and cached "
        "answers stay (re-running a query still returns its earlier answer). " + _ADMIN_NOTE,
    )
    p.set_defaults(handler=reset)

    p = sub.add_parser(
        "log",
        parents=[common, analyst, as_json],
        help="show the append-only charge log",
        description="Show the most recent charges and administrator events, oldest first.",
    )
    p.add_argument("--limit", type=int, default=20, metavar="N", help="rows to show (default 20)")
    p.set_defaults(handler=show_log)

    p = sub.add_parser(
        "verify",
        parents=[common],
        help="check the ledger's integrity (totals equal the sum of the log)",
        description="Run SQLite's integrity check and check that every running total equals "
        "the sum of its log rows. Exit status 1 if anything is wrong.",
    )
    p.set_defaults(handler=verify)

    p = sub.add_parser(
        "backup",
        parents=[common],
        help="copy the ledger to a file, consistently, while dpsql runs",
        description="Copy the ledger with SQLite's online backup API: one consistent snapshot "
        "(its -wal file included) taken while other processes keep charging, written to a "
        "private (0600) file and verified before it is renamed to DEST. Copying the ledger "
        "file with cp is not a backup: charges not yet checkpointed live in its -wal file.",
    )
    p.add_argument("dest", metavar="DEST", help="the backup file to write")
    p.add_argument("--force", action="store_true", help="replace DEST if it exists")
    p.set_defaults(handler=backup)

    p = sub.add_parser(
        "restore",
        parents=[common],
        help="restore the ledger from a backup (verified first)",
        description="Replace the policy's ledger with a backup written by `dpsql budget "
        "backup`. The backup is copied and verified first. An existing ledger is replaced "
        "only with --force: charges it holds that the backup lacks are forgotten (their "
        "budget is given back), and the command says how many. A file that is not a ledger "
        "is moved aside, never deleted. " + _ADMIN_NOTE,
    )
    p.add_argument("source", metavar="SRC", help="the backup file to restore")
    p.add_argument("--force", action="store_true", help="replace an existing ledger (see above)")
    p.set_defaults(handler=restore)


# -- handlers --------------------------------------------------------------------------------


def show(args: argparse.Namespace) -> int:
    return _run(args, _show)


def set_budget(args: argparse.Namespace) -> int:
    return _run(args, _set_budget, need_analyst=True)


def reset(args: argparse.Namespace) -> int:
    return _run(args, _reset, need_analyst=True)


def show_log(args: argparse.Namespace) -> int:
    return _run(args, _log)


def verify(args: argparse.Namespace) -> int:
    return _run(args, _verify)


def backup(args: argparse.Namespace) -> int:
    return _run(args, _backup)


def restore(args: argparse.Namespace) -> int:
    return _run(args, _restore)


def _run(args: argparse.Namespace, fn: Any, *, need_analyst: bool = False) -> int:
    name = " ".join(filter(None, ["dpsql budget", getattr(args, "budget_command", None)]))
    if getattr(args, "policy", None) is None:
        print(f"{name}: error: --policy is required", file=sys.stderr)
        return 2
    if need_analyst and not getattr(args, "analyst", None):
        print(f"{name}: error: --analyst is required", file=sys.stderr)
        return 2
    from dpsql.policy import load_policy  # pydantic: only once a command runs (not --help)

    try:
        policy = load_policy(args.policy)
        if policy.ledger_path is None:  # only for dict policies; a file always has a default
            print(f"{name}: error: the policy names no ledger", file=sys.stderr)
            return 1
        return int(fn(args, policy))
    except Error as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1


def _open(policy: Policy, *, create: bool) -> SQLiteLedger | None:
    assert policy.ledger_path is not None
    if not create and not policy.ledger_path.exists():
        return None
    from dpsql.privacy.sqlite_ledger import SQLiteLedger

    return SQLiteLedger(policy.ledger_path)


def _show(args: argparse.Namespace, policy: Policy) -> int:
    analyst = getattr(args, "analyst", None)
    ledger = _open(policy, create=False)
    if ledger is None:
        statuses = [] if analyst is None else [_fresh(analyst, policy)]
    else:
        with ledger:
            if analyst is None:
                statuses = ledger.analysts(policy.dataset, policy.budget)
            else:
                statuses = [ledger.status(analyst, policy.dataset, policy.budget)]
    if args.json:
        print(json.dumps([_status_json(s) for s in statuses], indent=2))
        return 0
    print(
        f"ledger {policy.ledger_path}, dataset {policy.dataset!r}, default budget "
        f"epsilon={policy.budget.epsilon:g} delta={policy.budget.delta:g}"
    )
    if not statuses:
        print("no analyst has been charged on this dataset yet")
        return 0
    header = (
        "analyst",
        "charges",
        "spent eps",
        "spent delta",
        "spent rho",
        "eps equiv",
        "budget eps",
        "budget delta",
        "left eps",
        "left delta",
    )
    rows = []
    for s in statuses:
        eps_left, delta_left = s.remaining
        rows.append(
            (
                s.analyst,
                s.charges,
                s.spent.epsilon,
                s.spent.delta,
                s.spent.rho,
                s.epsilon_spent,
                _g(s.budget.epsilon) + "*" if s.overridden else s.budget.epsilon,
                s.budget.delta,
                eps_left,
                delta_left,
            )
        )
    _table(header, rows)
    if any(s.overridden for s in statuses):
        print("* budget set by an administrator (dpsql budget set)")
    return 0


def _set_budget(args: argparse.Namespace, policy: Policy) -> int:
    from dpsql.privacy.accounting import Budget

    ledger = _open(policy, create=True)
    assert ledger is not None
    with ledger:
        current = ledger.budget(args.analyst, policy.dataset, policy.budget)
        delta = current.delta if args.delta is None else args.delta
        if not (math.isfinite(args.epsilon) and args.epsilon > 0 and 0 <= delta < 1):
            print(
                "dpsql budget set: error: need --epsilon > 0 and --delta in [0, 1)",
                file=sys.stderr,
            )
            return 2
        ledger.set_budget(args.analyst, policy.dataset, Budget(args.epsilon, delta))
        status = ledger.status(args.analyst, policy.dataset, policy.budget)
    eps_left, delta_left = status.remaining
    print(
        f"budget of {args.analyst!r} on {policy.dataset!r} set to epsilon={args.epsilon:g} "
        f"delta={delta:g} (was epsilon={current.epsilon:g} delta={current.delta:g}); "
        f"remaining epsilon={_g(eps_left)} delta={_g(delta_left, 3)}"
    )
    return 0


def _reset(args: argparse.Namespace, policy: Policy) -> int:
    ledger = _open(policy, create=True)
    assert ledger is not None
    with ledger:
        released = ledger.reset(args.analyst, policy.dataset)
    print(
        f"spending of {args.analyst!r} on {policy.dataset!r} reset: released "
        f"epsilon={_g(released.epsilon)} delta={_g(released.delta, 3)} rho={_g(released.rho)} "
        "(recorded in the log)"
    )
    return 0


def _log(args: argparse.Namespace, policy: Policy) -> int:
    ledger = _open(policy, create=False)
    entries: list[LogEntry] = []
    if ledger is not None:
        with ledger:
            entries = ledger.entries(
                policy.dataset, analyst=getattr(args, "analyst", None), limit=args.limit
            )
    if args.json:
        print(json.dumps([_entry_json(e) for e in entries], indent=2))
        return 0
    if not entries:
        print(f"the log of dataset {policy.dataset!r} is empty")
        return 0
    header = ("id", "time (UTC)", "analyst", "kind", "eps", "delta", "rho", "plan", "query")
    rows = [
        (
            e.id,
            e.at[:19].replace("T", " "),
            e.analyst,
            e.kind,
            e.cost.epsilon,
            e.cost.delta,
            e.cost.rho,
            e.plan_hash[:12],
            _one_line(e.query_text, 60),
        )
        for e in entries
    ]
    _table(header, rows)
    return 0


def _verify(args: argparse.Namespace, policy: Policy) -> int:
    ledger = _open(policy, create=False)
    if ledger is None:
        print(f"no ledger at {policy.ledger_path} yet: nothing to verify")
        return 0
    with ledger:
        problems = ledger.verify()
    for problem in problems:
        print(problem)
    if problems:
        return 1
    print(f"ledger {policy.ledger_path} is consistent")
    return 0


def _backup(args: argparse.Namespace, policy: Policy) -> int:
    from dpsql.privacy.ledger_backup import backup_ledger

    assert policy.ledger_path is not None
    copy = backup_ledger(policy.ledger_path, args.dest, force=args.force)
    print(
        f"ledger {policy.ledger_path} backed up to {copy.path}: {copy.log_rows} log rows, "
        f"{copy.totals} totals, {copy.answers} cached answers (verified)"
    )
    return 0


def _restore(args: argparse.Namespace, policy: Policy) -> int:
    from dpsql.privacy.ledger_backup import restore_ledger

    assert policy.ledger_path is not None
    copy, forgotten = restore_ledger(args.source, policy.ledger_path, force=args.force)
    print(
        f"ledger {policy.ledger_path} restored from {args.source}: {copy.log_rows} log rows, "
        f"{copy.totals} totals, {copy.answers} cached answers (verified)"
    )
    if forgotten:
        print(
            f"warning: {forgotten} log rows of the replaced ledger were newer than the backup "
            "and are forgotten (their budget is given back)",
            file=sys.stderr,
        )
    return 0


# -- formatting ------------------------------------------------------------------------------


def _fresh(analyst: str, policy: Policy) -> AnalystStatus:
    from dpsql.privacy.accounting import Cost
    from dpsql.privacy.ledger import AnalystStatus

    return AnalystStatus(analyst, policy.dataset, Cost(), policy.budget, False, 0)


def _g(value: float, digits: int = 6) -> str:
    """The number format of every dpsql table and message (``digits`` is kept for callers)."""
    return number(value)


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """The one dpsql table style (:func:`dpsql.tables.render`)."""
    render(header, rows, sys.stdout)


def _status_json(s: AnalystStatus) -> dict[str, Any]:
    eps_left, delta_left = s.remaining
    return {
        "analyst": s.analyst,
        "dataset": s.dataset,
        "charges": s.charges,
        "spent": {"epsilon": s.spent.epsilon, "delta": s.spent.delta, "rho": s.spent.rho},
        "spent_as_epsilon": _finite(s.epsilon_spent),
        "budget": {"epsilon": s.budget.epsilon, "delta": s.budget.delta},
        "budget_overridden": s.overridden,
        "remaining": {"epsilon": eps_left, "delta": delta_left},
    }


def _entry_json(e: LogEntry) -> dict[str, Any]:
    return {
        "id": e.id,
        "at": e.at,
        "analyst": e.analyst,
        "dataset": e.dataset,
        "kind": e.kind,
        "epsilon": e.cost.epsilon,
        "delta": e.cost.delta,
        "rho": e.cost.rho,
        "plan_hash": e.plan_hash,
        "query_text": e.query_text,
    }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no infinity
