"""The durable budget ledger and answer cache: one SQLite file, shared by threads and processes.

Why SQLite: it is in the standard library, every transaction is atomic and durable, and the
file lock serialises writers across processes, which is exactly what a budget needs: two
queries racing for the last ε must not both get it. Every charge is ONE ``BEGIN IMMEDIATE``
transaction that re-reads the committed total, checks the budget, appends the log row, updates
the total and stores the released answer. A process killed before ``COMMIT`` leaves nothing
(SQLite rolls the WAL tail back); one killed after keeps the charge and the answer.

Costs are exact rationals (:class:`~dpsql.privacy.accounting.Cost`), stored losslessly as
"numerator/denominator" text next to a REAL copy for people reading the file with ``sqlite3``.
The file and its ``-wal`` / ``-shm`` side files are private to the owner (mode 0600).

Invariant, checked by :meth:`SQLiteLedger.verify`: per (analyst, dataset) the running total is
the sum of the cost columns of the append-only log (a reset is logged as the negated total).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import getpass
import math
import os
import sqlite3
from collections.abc import Callable
from typing import Any

from dpsql.errors import InterfaceError
from dpsql.privacy.accounting import Budget, Cost
from dpsql.privacy.budget_rules import (
    BudgetRules,
    Clock,
    LimitStatus,
    Pool,
    period_of,
    rules_of,
    stale,
    utc_now,
)
from dpsql.privacy.ledger import (
    AnalystStatus,
    Ledger,
    LogEntry,
    MemoryLedger,
    exhausted,
    not_charged,
    refuse_unless_fits,
    validate_cost,
)
from dpsql.privacy.ledger_file import (
    EXACT_COLUMNS,
    LedgerFile,
    exact_texts,
    pool_cost,
    since_reset,
    stored_cost,
)
from dpsql.privacy.ledger_group_commit import GroupCommit
from dpsql.privacy.ledger_standings import CommittedStandings
from dpsql.privacy.ledger_verify import verify_ledger

# One analyst's budget override and total in one statement (SQLiteLedger._standing_in).
_STANDING = (
    "SELECT b.analyst IS NOT NULL, b.epsilon, b.delta, t.analyst IS NOT NULL, t.epsilon, "
    "t.delta, t.rho, t.epsilon_exact, t.delta_exact, t.rho_exact, t.charges, t.zrho_exact, "
    "t.zrho_at, t.updated_at FROM (SELECT 1) "
    "LEFT JOIN budgets AS b ON b.analyst = ? AND b.dataset = ? "
    "LEFT JOIN totals AS t ON t.analyst = ? AND t.dataset = ?"
)


FaultHook = Callable[[str], None]


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")


def _actor(actor: str | None) -> str:
    if actor:
        return actor
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry / no login name (containers)
        return f"uid {os.getuid()}"


def _text(value: str) -> str:
    """Text SQLite can store: a lone surrogate (not UTF-8 encodable) becomes ``\\udc80``.

    Query texts and answers are stored, never matched, so an escape loses nothing, and a
    charge can never fail on the text after the budget was checked.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


class SQLiteLedger(LedgerFile):
    """A :class:`~dpsql.privacy.ledger.Ledger` (and AdminLedger) stored in one SQLite file.

    Safe from many threads (one connection per thread) and many processes (SQLite file locks,
    WAL journal, a busy timeout). Do not share an instance across ``fork``: a forked child
    opens its own connection on first use; prefer the ``spawn`` start method.

    ``fault_hook`` is for crash tests only: it is called inside the open charge transaction
    with "logged" (log row written, total not yet) and "written" (everything but COMMIT).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        timeout: float = 30.0,
        fault_hook: FaultHook | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._fault_hook = fault_hook
        self._clock: Clock = clock or utc_now  # the renewal periods' clock (tests inject one)
        super().__init__(path, timeout=timeout)
        # group commit of charges: one BEGIN IMMEDIATE ... COMMIT for those queued together
        self._group_commit = GroupCommit(self._write)
        self._grouped = self._group_commit.run
        # the figures this process's charges committed (dpsql.privacy.ledger_standings)
        self._standings = CommittedStandings()

    # -- reads inside a transaction ----------------------------------------------------------

    def standing(self, analyst: str, dataset: str, default: Budget) -> tuple[Budget, Cost]:
        """The analyst's budget and total spent, read together (one statement, ~5x cheaper
        than :meth:`budget` then :meth:`spent`, and one snapshot). With a renewing budget
        ([budgets] renew), the total of a period that has ended reads as zero."""
        rules = rules_of(default)
        if rules is not None and rules.renew is not None:
            own = self.limits(analyst, dataset, default)[0]
            return own.budget, own.spent
        try:
            found = _standing_in(self._conn(), analyst, dataset, default, legacy=False)
        except sqlite3.Error as exc:
            raise self._error(exc) from None
        except UnicodeEncodeError:
            with self._read() as conn:  # the transaction's own error for such a key
                _standing_in(conn, analyst, dataset, default, legacy=True)
            raise
        if found is None:
            with self._read() as conn:
                found = _standing_in(conn, analyst, dataset, default, legacy=True)
                assert found is not None
        return found[0], found[1]

    @staticmethod
    def _log(
        conn: sqlite3.Connection,
        analyst: str,
        dataset: str,
        kind: str,
        cost: Cost,
        query_text: str,
        plan_hash: str,
    ) -> int:
        cur = conn.execute(
            "INSERT INTO charge_log (at, analyst, dataset, kind, epsilon, delta, rho, "
            f"query_text, plan_hash, {EXACT_COLUMNS}, zrho, zrho_exact) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                _now(),
                analyst,
                dataset,
                kind,
                cost.epsilon,
                cost.delta,
                cost.rho,
                _text(query_text),
                _text(plan_hash),
                *exact_texts(cost),
                cost.zrho,
                str(cost.exact_zrho),
            ),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    @staticmethod
    def _set_total(
        conn: sqlite3.Connection, analyst: str, dataset: str, total: Cost, charges: int
    ) -> None:
        conn.execute(
            "INSERT INTO totals (analyst, dataset, epsilon, delta, rho, charges, updated_at, "
            f"{EXACT_COLUMNS}, zrho, zrho_exact, zrho_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (analyst, dataset) DO UPDATE SET "
            "epsilon = excluded.epsilon, delta = excluded.delta, rho = excluded.rho, "
            "charges = excluded.charges, updated_at = excluded.updated_at, "
            "epsilon_exact = excluded.epsilon_exact, delta_exact = excluded.delta_exact, "
            "rho_exact = excluded.rho_exact, zrho = excluded.zrho, "
            "zrho_exact = excluded.zrho_exact, zrho_at = excluded.zrho_at",
            (
                analyst,
                dataset,
                total.epsilon,
                total.delta,
                total.rho,
                charges,
                now := _now(),
                *exact_texts(total),
                total.zrho,
                str(total.exact_zrho),
                now,
            ),
        )

    def _fault(self, stage: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(stage)

    # -- the Ledger protocol -----------------------------------------------------------------

    def budget(self, analyst: str, dataset: str, default: Budget) -> Budget:
        with self._read() as conn:
            return _with_share(_budget_in(conn, analyst, dataset), default)

    def spent(self, analyst: str, dataset: str) -> Cost:
        with self._read() as conn:
            return _spent_in(conn, analyst, dataset)[0]

    def check(self, analyst: str, dataset: str, cost: Cost, default: Budget) -> None:
        validate_cost(cost)
        rules = rules_of(default)
        if rules is not None:
            with self._read() as conn:
                limits, _ = self._limits_in(conn, analyst, dataset, default, rules, self._clock())
            refuse_unless_fits(limits, cost)
            return
        if self._standings.fits(analyst, dataset, default, cost):
            return  # a pass only: the charge re-checks the committed total
        budget, spent = self.standing(analyst, dataset, default)
        self._standings.read(analyst, dataset, default, budget, spent)
        if not budget.covers(spent + cost):
            raise exhausted(analyst, budget, spent, cost)

    def limits(self, analyst: str, dataset: str, default: Budget) -> list[LimitStatus]:
        """Every budget a charge of ``analyst`` must fit, read in one snapshot: their own
        first, then each group they are in, then the dataset-wide cap ([budgets]); each with
        its spending in its current period."""
        rules = rules_of(default)
        with self._read() as conn:
            if rules is None:
                found = _standing_in(conn, analyst, dataset, default, legacy=True)
                assert found is not None
                budget, spent, charges = found
                return [LimitStatus("analyst", analyst, budget, spent, "", charges)]
            return self._limits_in(conn, analyst, dataset, default, rules, self._clock())[0]

    def pools(self, dataset: str, default: Budget) -> list[LimitStatus]:
        """Every group's and the dataset-wide budget with its spending this period (for the
        curator page); empty without [budgets]."""
        rules = rules_of(default)
        if rules is None:
            return []
        now = self._clock()
        with self._read() as conn:
            return [_pool_in(conn, pool, dataset, now) for pool in rules.pools()]

    def _limits_in(
        self,
        conn: sqlite3.Connection,
        analyst: str,
        dataset: str,
        default: Budget,
        rules: BudgetRules,
        now: Any,
    ) -> tuple[list[LimitStatus], Cost | None]:
        """The limits of :meth:`limits`, and the total to release first when the analyst's
        own budget has renewed (None when it has not)."""
        found = _standing_in(conn, analyst, dataset, default, legacy=True)
        assert found is not None
        budget, spent, charges = found
        period = period_of(rules.renew, now)
        released = None
        if rules.renew is not None:
            row = conn.execute(
                "SELECT period FROM analyst_periods WHERE analyst = ? AND dataset = ?",
                (analyst, dataset),
            ).fetchone()
            if stale(None if row is None else row[0], period):
                released, spent, charges = spent, Cost(), 0
        limits = [LimitStatus("analyst", analyst, budget, spent, period, charges)]
        limits += [_pool_in(conn, pool, dataset, now) for pool in rules.pools(analyst)]
        return limits, released

    def charge(
        self,
        analyst: str,
        dataset: str,
        cost: Cost,
        default: Budget,
        *,
        query_text: str,
        plan_hash: str,
        cache_key: str | None = None,
        answer: str | None = None,
    ) -> None:
        """One transaction: re-check against the committed total, log, add, cache.

        Committed (and, with ``synchronous = FULL``, fsynced) when it returns, with or without
        an answer: the pipeline calls it with ``answer=None`` before the engine runs, then
        :meth:`remember`. Query text that is not valid UTF-8 is stored escaped, never refused.
        If an answer is already cached under ``cache_key`` (two identical queries raced past
        :meth:`cached`), both are charged and the first answer stays cached: every released
        answer is paid for, and later re-runs all see the same one.
        """
        validate_cost(cost)
        rules = rules_of(default)
        if rules is not None:
            self._charge_shared(
                analyst, dataset, cost, default, rules, (query_text, plan_hash, cache_key, answer)
            )
            return

        def work(conn: sqlite3.Connection) -> None:
            found = _standing_in(conn, analyst, dataset, default, legacy=True)
            assert found is not None
            budget, spent, charges = found
            total = spent + cost
            if not budget.covers(total):
                raise exhausted(analyst, budget, spent, cost)
            charge_id = self._log(conn, analyst, dataset, "charge", cost, query_text, plan_hash)
            self._fault("logged")
            self._set_total(conn, analyst, dataset, total, charges + 1)
            if cache_key is not None and answer is not None:
                self._store(conn, analyst, dataset, cache_key, answer, charge_id)
            self._fault("written")
            after[:] = [(budget, total)]

        after: list[tuple[Budget, Cost]] = []
        self._standings.forget_thread()
        try:
            self._grouped(work)  # returns once the COMMIT holding the charge is done
        except BaseException:
            self._standings.drop(analyst, dataset)  # the next check reads the ledger
            raise
        self._standings.committed(analyst, dataset, default, after[0])

    def committed_standing(self, analyst: str, dataset: str) -> tuple[Budget, Cost] | None:
        """The budget and total that this thread's last :meth:`charge` committed for
        ``(analyst, dataset)``, once (then forgotten), or None: what :meth:`standing` would
        read right after that COMMIT, without the read (a budget with renewal periods is
        never kept here). Other sessions' charges committed since are not in it."""
        return self._standings.take(analyst, dataset)

    def _charge_shared(
        self,
        analyst: str,
        dataset: str,
        cost: Cost,
        default: Budget,
        rules: BudgetRules,
        query: tuple[str, str, str | None, str | None],
    ) -> None:
        """:meth:`charge` under [budgets]: ONE transaction re-reads the analyst's total, each
        of their groups' and the dataset's, refuses unless the cost fits every one, and then
        records the charge in all of them. A renewed analyst total is released first (a
        logged "reset" row), in the same transaction, so the log still sums to the total."""
        query_text, plan_hash, cache_key, answer = query

        def work(conn: sqlite3.Connection) -> None:
            now = self._clock()
            limits, released = self._limits_in(conn, analyst, dataset, default, rules, now)
            refuse_unless_fits(limits, cost)
            own = limits[0]
            if released is not None and (
                not released.is_zero or _has_total(conn, analyst, dataset)
            ):
                text = (
                    f"budget renewed: period {own.period} began ([budgets] renew = "
                    f'"{rules.renew}"); released epsilon={released.epsilon:.6g}, '
                    f"delta={released.delta:.3g}, rho={released.rho:.6g}"
                )
                self._log(conn, analyst, dataset, "reset", -released, text, "")
            charge_id = self._log(conn, analyst, dataset, "charge", cost, query_text, plan_hash)
            self._fault("logged")
            self._set_total(conn, analyst, dataset, own.spent + cost, own.charges + 1)
            for pool, status in zip(rules.pools(analyst), limits[1:], strict=True):
                self._add_to_pool(conn, pool.key, dataset, status, cost, charge_id)
            if rules.renew is not None:
                conn.execute(
                    "INSERT INTO analyst_periods (analyst, dataset, period) VALUES (?, ?, ?) "
                    "ON CONFLICT (analyst, dataset) DO UPDATE SET period = excluded.period "
                    "WHERE excluded.period > analyst_periods.period",
                    (analyst, dataset, own.period),
                )
            if cache_key is not None and answer is not None:
                self._store(conn, analyst, dataset, cache_key, answer, charge_id)
            self._fault("written")

        self._grouped(work)

    @staticmethod
    def _add_to_pool(
        conn: sqlite3.Connection,
        key: str,
        dataset: str,
        status: LimitStatus,
        cost: Cost,
        charge_id: int,
    ) -> None:
        total = status.spent + cost
        conn.execute(
            "INSERT INTO pool_totals (pool, dataset, period, epsilon, delta, rho, zrho, "
            f"{EXACT_COLUMNS}, zrho_exact, charges, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (pool, dataset, period) DO UPDATE SET "
            "epsilon = excluded.epsilon, delta = excluded.delta, rho = excluded.rho, "
            "zrho = excluded.zrho, epsilon_exact = excluded.epsilon_exact, "
            "delta_exact = excluded.delta_exact, rho_exact = excluded.rho_exact, "
            "zrho_exact = excluded.zrho_exact, charges = excluded.charges, "
            "updated_at = excluded.updated_at",
            (
                key,
                dataset,
                status.period,
                total.epsilon,
                total.delta,
                total.rho,
                total.zrho,
                *exact_texts(total),
                str(total.exact_zrho),
                status.charges + 1,
                _now(),
            ),
        )
        conn.execute(
            "INSERT INTO charge_pools (charge_id, pool, period) VALUES (?, ?, ?)",
            (charge_id, key, status.period),
        )

    def remember(self, analyst: str, dataset: str, cache_key: str, answer: str) -> None:
        """Cache the answer of a query already charged: one committed write, no cost change.

        The answer is tied to the newest charge of the analyst on the dataset whose plan hash
        is ``cache_key`` (else their newest charge); with no charge at all it is refused, so
        every cached answer belongs to a charge. Idempotent: the first answer stays.
        """
        with self._write() as conn:
            row = (
                conn.execute(
                    "SELECT id FROM charge_log "
                    "WHERE dataset = ? AND analyst = ? AND kind = 'charge' "
                    "AND plan_hash = ? ORDER BY id DESC LIMIT 1",
                    (dataset, analyst, cache_key),
                ).fetchone()
                or conn.execute(
                    "SELECT id FROM charge_log "
                    "WHERE dataset = ? AND analyst = ? AND kind = 'charge' "
                    "ORDER BY id DESC LIMIT 1",
                    (dataset, analyst),
                ).fetchone()
            )
            if row is None:
                raise not_charged(analyst, dataset)
            self._store(conn, analyst, dataset, cache_key, answer, row[0])

    @staticmethod
    def _store(
        conn: sqlite3.Connection,
        analyst: str,
        dataset: str,
        cache_key: str,
        answer: str,
        charge_id: int,
    ) -> None:
        conn.execute(
            "INSERT OR IGNORE INTO answers (analyst, dataset, cache_key, answer, "
            "charge_id, stored_at) VALUES (?, ?, ?, ?, ?, ?)",
            (analyst, dataset, cache_key, _text(answer), charge_id, _now()),
        )

    def cached(self, analyst: str, dataset: str, cache_key: str) -> str | None:
        with self._read() as conn:
            row = conn.execute(
                "SELECT answer FROM answers WHERE analyst = ? AND dataset = ? AND cache_key = ?",
                (analyst, dataset, cache_key),
            ).fetchone()
        return None if row is None else row[0]

    # -- administrator operations ------------------------------------------------------------

    def set_budget(
        self, analyst: str, dataset: str, budget: Budget, *, actor: str | None = None
    ) -> None:
        """Override the default budget (raise or lower it); logged as a "budget" event."""
        if not (math.isfinite(budget.epsilon) and budget.epsilon > 0 and 0 <= budget.delta < 1):
            raise InterfaceError(
                f"invalid budget epsilon={budget.epsilon!r}, delta={budget.delta!r}",
                construct="budget",
                hint="epsilon must be > 0 and delta in [0, 1)",
            )
        with self._write() as conn:
            old = _budget_in(conn, analyst, dataset)
            was = "the policy default" if old is None else _fmt_budget(old)
            conn.execute(
                "INSERT INTO budgets (analyst, dataset, epsilon, delta, set_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (analyst, dataset) DO UPDATE SET "
                "epsilon = excluded.epsilon, delta = excluded.delta, set_at = excluded.set_at",
                (analyst, dataset, budget.epsilon, budget.delta, _now()),
            )
            text = f"budget set to {_fmt_budget(budget)} (was {was}) by {_actor(actor)}"
            self._log(conn, analyst, dataset, "budget", Cost(), text, "")

    def reset(self, analyst: str, dataset: str, *, actor: str | None = None) -> Cost:
        """Release the analyst's spending; returns what was released.

        Logged as a "reset" row carrying the negated total, so no log row is ever deleted and
        the log still sums to the running total. Cached answers stay: re-running a query
        after a reset still returns the answer already released, at no cost.
        """
        with self._write() as conn:
            spent, _ = _spent_in(conn, analyst, dataset)
            released = -spent
            text = (
                f"spending reset by {_actor(actor)}: released epsilon={spent.epsilon:.6g}, "
                f"delta={spent.delta:.3g}, rho={spent.rho:.6g}"
            )
            self._log(conn, analyst, dataset, "reset", released, text, "")
            self._set_total(conn, analyst, dataset, Cost(), 0)
        return spent

    def analysts(self, dataset: str, default: Budget) -> list[AnalystStatus]:
        with self._read() as conn:
            rows = conn.execute(
                "SELECT a.analyst, t.epsilon, t.delta, t.rho, t.epsilon_exact, t.delta_exact, "
                "t.rho_exact, t.charges, b.epsilon, b.delta, t.zrho_exact, t.zrho_at, "
                "t.updated_at "
                "FROM (SELECT analyst FROM totals WHERE dataset = :d "
                "      UNION SELECT analyst FROM budgets WHERE dataset = :d) AS a "
                "LEFT JOIN totals AS t ON t.analyst = a.analyst AND t.dataset = :d "
                "LEFT JOIN budgets AS b ON b.analyst = a.analyst AND b.dataset = :d "
                "ORDER BY a.analyst",
                {"d": dataset},
            ).fetchall()
            statuses = [_status(conn, dataset, default, row) for row in rows]
            rules = rules_of(default)
            if rules is None or rules.renew is None:
                return statuses
            period = period_of(rules.renew, self._clock())
            periods = dict(
                conn.execute(
                    "SELECT analyst, period FROM analyst_periods WHERE dataset = ?", (dataset,)
                ).fetchall()
            )
        return [
            dataclasses.replace(s, spent=Cost(), charges=0)
            if stale(periods.get(s.analyst), period)
            else s
            for s in statuses
        ]

    def status(self, analyst: str, dataset: str, default: Budget) -> AnalystStatus:
        """One analyst's status, also when they have never been charged."""
        with self._read() as conn:
            override = _budget_in(conn, analyst, dataset)
            spent, charges = _spent_in(conn, analyst, dataset)
        return AnalystStatus(
            analyst, dataset, spent, override or default, override is not None, charges
        )

    def entries(
        self, dataset: str | None = None, *, analyst: str | None = None, limit: int | None = None
    ) -> list[LogEntry]:
        where: list[str] = []
        params: list[str | int] = []
        if dataset is not None:
            where.append("dataset = ?")
            params.append(dataset)
        if analyst is not None:
            where.append("analyst = ?")
            params.append(analyst)
        sql = "SELECT id, at, analyst, dataset, kind, epsilon, delta, rho, query_text, plan_hash, "
        sql += f"{EXACT_COLUMNS}, zrho_exact FROM charge_log"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(max(0, int(limit)))
        with self._read() as conn:
            rows = conn.execute(sql, params).fetchall()
        return [
            LogEntry(r[0], r[1], r[2], r[3], r[4], stored_cost(r[5:8], r[10:13], r[13]), r[8], r[9])
            for r in reversed(rows)
        ]

    def verify(self) -> list[str]:
        """Consistency problems, empty when sound: integrity, and totals equal to the log
        (:func:`~dpsql.privacy.ledger_verify.verify_ledger`)."""
        with self._read() as conn:
            return verify_ledger(conn)


def _fmt_budget(budget: Budget) -> str:
    return f"epsilon={budget.epsilon:.6g} delta={budget.delta:.3g}"


def _with_share(override: Budget | None, default: Budget) -> Budget:
    """An administrator's override keeps the policy's split of the budget (its Gaussian share
    and the δ share reserved for the zCDP conversion)."""
    if override is None:
        return default
    return dataclasses.replace(default, epsilon=override.epsilon, delta=override.delta)


def _status(
    conn: sqlite3.Connection, dataset: str, default: Budget, row: tuple[Any, ...]
) -> AnalystStatus:
    analyst, *costs, charges, b_eps, b_delta, z_text, z_at, updated_at = row
    override = b_eps is not None
    budget = _with_share(Budget(b_eps, b_delta), default) if override else default
    if updated_at is None:  # a budget override without any charge
        spent = Cost()
    else:
        spent = _total_cost(conn, analyst, dataset, tuple(costs), (z_text, z_at, updated_at))
    return AnalystStatus(analyst, dataset, spent, budget, override, charges or 0)


def _total_cost(
    conn: sqlite3.Connection,
    analyst: str,
    dataset: str,
    parts: tuple[Any, ...],
    zrho: tuple[Any, ...],
) -> Cost:
    """A total read back: ``parts`` are its 3 REALs and 3 exact texts, ``zrho`` is
    (zrho_exact, zrho_at, updated_at). A zrho not written with the total's last update (by a
    version-2 process) is recomputed from the log: never an understated zCDP sum."""
    zrho_text, zrho_at, updated_at = zrho
    if zrho_text is None or zrho_at != updated_at:
        zrho_text = str(since_reset(conn, analyst, dataset).exact_zrho)
    return stored_cost(parts[0:3], parts[3:6], zrho_text)


def open_ledger(ledger_path: str | os.PathLike[str] | None) -> Ledger:
    """The ledger a policy names (``Policy.ledger_path``); in-memory when it names none."""
    return MemoryLedger() if ledger_path is None else SQLiteLedger(ledger_path)


def _budget_in(conn: sqlite3.Connection, analyst: str, dataset: str) -> Budget | None:
    row = conn.execute(
        "SELECT epsilon, delta FROM budgets WHERE analyst = ? AND dataset = ?",
        (analyst, dataset),
    ).fetchone()
    return None if row is None else Budget(row[0], row[1])


def _spent_in(conn: sqlite3.Connection, analyst: str, dataset: str) -> tuple[Cost, int]:
    row = conn.execute(
        f"SELECT epsilon, delta, rho, {EXACT_COLUMNS}, charges, zrho_exact, zrho_at, "
        "updated_at "
        "FROM totals WHERE analyst = ? AND dataset = ?",
        (analyst, dataset),
    ).fetchone()
    if row is None:
        return Cost(), 0
    return _total_cost(conn, analyst, dataset, row[0:6], row[7:10]), row[6]


def _standing_in(
    conn: sqlite3.Connection, analyst: str, dataset: str, default: Budget, *, legacy: bool
) -> tuple[Budget, Cost, int] | None:
    """(budget, spent, charges) from one statement (_budget_in and _spent_in joined): a
    single SELECT reads one snapshot even outside a transaction. None when the total's
    zCDP sum must be recomputed from the log and ``legacy`` is False (the caller then
    reads it inside a transaction)."""
    row = conn.execute(_STANDING, (analyst, dataset, analyst, dataset)).fetchone()
    has_budget, b_eps, b_delta, has_total, *parts = row
    budget = _with_share(Budget(b_eps, b_delta) if has_budget else None, default)
    if not has_total:
        return budget, Cost(), 0
    costs, charges, zrho = tuple(parts[0:6]), parts[6], tuple(parts[7:10])
    if not legacy and (zrho[0] is None or zrho[1] != zrho[2]):
        return None
    return budget, _total_cost(conn, analyst, dataset, costs, zrho), charges


def _pool_in(conn: sqlite3.Connection, pool: Pool, dataset: str, now: Any) -> LimitStatus:
    period = period_of(pool.renew, now)
    row = conn.execute(
        "SELECT epsilon_exact, delta_exact, rho_exact, zrho_exact, charges FROM pool_totals "
        "WHERE pool = ? AND dataset = ? AND period = ?",
        (pool.key, dataset, period),
    ).fetchone()
    spent, charges = (Cost(), 0) if row is None else (pool_cost(row[0:4]), row[4])
    return LimitStatus(pool.kind, pool.name, pool.budget, spent, period, charges)


def _has_total(conn: sqlite3.Connection, analyst: str, dataset: str) -> bool:
    row = conn.execute(
        "SELECT charges FROM totals WHERE analyst = ? AND dataset = ?", (analyst, dataset)
    ).fetchone()
    return row is not None and bool(row[0])
