"""The ledger's invariant, checked: SQLite's integrity, and every total equal to its log.

Per (analyst, dataset) the running total is the exact sum of the append-only log since the last
reset, each reset releases exactly what the log had summed to, pool totals equal their charges,
and no cached answer lacks its charge. ``dpsql budget verify`` and every backup run it.
"""

from __future__ import annotations

import math
import sqlite3
from typing import Any

from dpsql.privacy.accounting import Cost
from dpsql.privacy.ledger_file import EXACT_COLUMNS, pool_cost, stored_cost


def verify_ledger(conn: sqlite3.Connection) -> list[str]:
    """Consistency problems, empty when sound: SQLite integrity, totals = sum of the log.

    Exact: per (analyst, dataset), every reset row releases exactly what the log had summed
    to, and the total equals the sum since. Rows of schema version 1 (REAL only) were float
    sums, so where they take part the comparison allows a relative 1e-9.
    """
    problems = [
        f"integrity: {msg}"
        for (msg,) in conn.execute("PRAGMA integrity_check").fetchall()
        if msg != "ok"
    ]
    totals = {
        (r[0], r[1]): (stored_cost(r[2:5], r[5:8], r[9] if r[10] == r[11] else None), r[8])
        for r in conn.execute(
            f"SELECT analyst, dataset, epsilon, delta, rho, {EXACT_COLUMNS}, charges, "
            "zrho_exact, zrho_at, updated_at FROM totals"
        ).fetchall()
    }
    trusted = {
        (r[0], r[1])
        for r in conn.execute(
            "SELECT analyst, dataset FROM totals WHERE zrho_exact IS NOT NULL "
            "AND zrho_at = updated_at"
        ).fetchall()
    }
    log = conn.execute(
        f"SELECT id, analyst, dataset, kind, epsilon, delta, rho, {EXACT_COLUMNS}, "
        "zrho_exact "
        "FROM charge_log ORDER BY id"
    ).fetchall()
    pool_rows = conn.execute(
        "SELECT pool, dataset, period, epsilon_exact, delta_exact, rho_exact, "
        "zrho_exact, charges FROM pool_totals"
    ).fetchall()
    pooled = conn.execute(
        "SELECT p.pool, c.dataset, p.period, c.kind, c.epsilon, c.delta, c.rho, "
        f"c.{EXACT_COLUMNS.replace(', ', ', c.')}, c.zrho_exact FROM charge_pools AS p "
        "LEFT JOIN charge_log AS c ON c.id = p.charge_id ORDER BY p.charge_id"
    ).fetchall()
    orphans = conn.execute(
        "SELECT COUNT(*) FROM answers AS a LEFT JOIN charge_log AS c "
        "ON c.id = a.charge_id WHERE c.id IS NULL OR c.analyst != a.analyst "
        "OR c.dataset != a.dataset"
    ).fetchone()[0]
    sums: dict[tuple[str, str], _LogSum] = {}
    for row_id, analyst, dataset, kind, *parts in log:
        cost, legacy = stored_cost(parts[0:3], parts[3:6], parts[6]), parts[3] is None
        acc = sums.setdefault((analyst, dataset), _LogSum())
        where = f"{analyst!r} on {dataset!r}: {kind} #{row_id}"
        if kind == "charge":
            acc.add(cost, legacy)
        elif kind == "reset":
            zrho = parts[6] is not None  # a version-2 reset row carries no zCDP sum
            problems += acc.differences(-cost, f"{where} released", legacy, zrho=zrho)
            sums[(analyst, dataset)] = _LogSum()
        elif not cost.is_zero:
            problems.append(f"{where} carries a cost {cost!r}")
    for analyst, dataset in sorted(set(totals) | set(sums)):
        total, charges = totals.get((analyst, dataset), (Cost(), 0))
        acc = sums.get((analyst, dataset), _LogSum())
        problems += acc.differences(
            total, f"{analyst!r} on {dataset!r}: total", zrho=(analyst, dataset) in trusted
        )
        if (charges or 0) != acc.charges:
            problems.append(
                f"{analyst!r} on {dataset!r}: total charges {charges} != log sum {acc.charges}"
            )
    if orphans:
        problems.append(f"{orphans} cached answer(s) without their charge")
    return problems + _verify_pools(pool_rows, pooled)


class _LogSum:
    """The exact sum of log rows since a reset, and whether a float-only (v1) row is in it."""

    def __init__(self) -> None:
        self.cost = Cost()
        self.charges = 0
        self.legacy = False

    def add(self, cost: Cost, legacy: bool) -> None:
        self.cost = self.cost + cost
        self.charges += 1
        self.legacy = self.legacy or legacy

    def differences(
        self, other: Cost, what: str, legacy: bool = False, *, zrho: bool = False
    ) -> list[str]:
        """'<what> epsilon X != log sum Y' for each part where ``other`` differs from the sum
        (the zCDP sum too when ``zrho``)."""
        loose = self.legacy or legacy
        out = []
        names, mine_parts, their_parts = (
            ["epsilon", "delta", "rho"],
            [*self.cost.parts],
            [*other.parts],
        )
        if zrho:
            names.append("zrho")
            mine_parts.append(self.cost.exact_zrho)
            their_parts.append(other.exact_zrho)
        for name, mine, theirs in zip(names, mine_parts, their_parts, strict=True):
            same = (
                math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=1e-15) if loose else mine == theirs
            )
            if not same:
                out.append(f"{what} {name} {float(theirs)!r} != log sum {float(mine)!r}")
        return out


def _verify_pools(pool_rows: list[Any], pooled: list[Any]) -> list[str]:
    """Each pool total (group or dataset, per period) equals the exact sum of the charges
    recorded in it, and every recorded charge is a charge of the same dataset."""
    problems = []
    sums: dict[tuple[str, str, str], _LogSum] = {}
    for pool, dataset, period, kind, *parts in pooled:
        if kind != "charge":
            problems.append(f"pool {pool!r} ({period or 'never renews'}) counts a {kind} row")
            continue
        cost = stored_cost(parts[0:3], parts[3:6], parts[6])
        sums.setdefault((pool, dataset, period), _LogSum()).add(cost, parts[3] is None)
    totals = {(r[0], r[1], r[2]): (pool_cost(r[3:7]), r[7]) for r in pool_rows}
    for key in sorted(set(totals) | set(sums)):
        total, charges = totals.get(key, (Cost(), 0))
        acc = sums.get(key, _LogSum())
        what = f"pool {key[0]!r} on {key[1]!r} ({key[2] or 'never renews'}): total"
        problems += acc.differences(total, what, zrho=True)
        if charges != acc.charges:
            problems.append(f"{what} charges {charges} != log count {acc.charges}")
    return problems
