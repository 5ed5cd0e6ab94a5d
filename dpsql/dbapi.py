"""PEP 249 Connection and Cursor over the dpsql pipeline."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpsql import pipeline
from dpsql.errors import (
    BudgetWarning,
    DatabaseError,
    DataError,
    Error,
    IntegrityError,
    InterfaceError,
    InternalError,
    NotSupportedError,
    OperationalError,
    ProgrammingError,
    Warning,
    check_analyst,
    door,
)
from dpsql.frontend.dialect import check_dialect
from dpsql.pipeline import Settings
from dpsql.policy import Policy, load_policy
from dpsql.privacy.ledger import EphemeralBudgetWarning, Ledger, MemoryLedger
from dpsql.service.answer import LOW_BUDGET as LOW_BUDGET
from dpsql.service.answer import Answer, Remaining
from dpsql.service.answer import bias_names as bias_names
from dpsql.service.answer import interval_names as interval_names
from dpsql.service.answer import with_intervals as with_intervals
from dpsql.service.session import Session

apilevel = "2.0"
threadsafety = 1  # threads may share the module, not connections
paramstyle = "qmark"  # ? placeholders; $1, $2 ... are accepted too


# -- PEP 249 type objects and constructors ---------------------------------------------------


class DBAPITypeObject:
    """A PEP 249 type object: equal to each description type code of its kind."""

    def __init__(self, name: str, *codes: str) -> None:
        self.name = name
        self.values = frozenset(codes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DBAPITypeObject):
            return self.values == other.values
        return isinstance(other, str) and other.upper() in self.values

    def __hash__(self) -> int:
        return hash(self.values)

    def __repr__(self) -> str:
        return f"dpsql.{self.name}"


# Description type codes are the strings BIGINT, DOUBLE, VARCHAR, BOOLEAN, DATE, TIMESTAMP.
STRING = DBAPITypeObject("STRING", "VARCHAR")
NUMBER = DBAPITypeObject("NUMBER", "BIGINT", "DOUBLE")
DATETIME = DBAPITypeObject("DATETIME", "DATE", "TIMESTAMP", "TIME")
BINARY = DBAPITypeObject("BINARY", "BLOB")  # dpsql never releases binary values
ROWID = DBAPITypeObject("ROWID", "ROWID")  # nor row ids
BOOLEAN = DBAPITypeObject("BOOLEAN", "BOOLEAN")  # an extension: PEP 249 names no boolean

Date = dt.date
Time = dt.time
Timestamp = dt.datetime
Binary = bytes


def DateFromTicks(ticks: float) -> dt.date:  # PEP 249 names
    return Date(*time.localtime(ticks)[:3])


def TimeFromTicks(ticks: float) -> dt.time:
    return Time(*time.localtime(ticks)[3:6])


def TimestampFromTicks(ticks: float) -> dt.datetime:
    return Timestamp(*time.localtime(ticks)[:6])


class Service(pipeline.Service):
    """``dpsql.Service``: the service (:class:`dpsql.pipeline.Service`: one policy, its data and
    ledger, shared by every session) with the DB-API's door on it. ``connect(analyst)`` opens a
    PEP 249 connection over it; the service itself imports no front door."""

    def connect(self, analyst: str = "default", dialect: str = "duckdb") -> Connection:
        """A DB-API session of ``analyst`` over this service, reading statements in
        ``dialect`` (dpsql.frontend.dialect)."""
        return Connection(self, analyst, dialect=dialect)


class Connection:
    """One analyst's session: their settings and budget, over a shared :class:`Service`."""

    # PEP 249 optional extension: the exception classes as connection attributes.
    Warning = Warning
    Error = Error
    InterfaceError = InterfaceError
    DatabaseError = DatabaseError
    DataError = DataError
    OperationalError = OperationalError
    IntegrityError = IntegrityError
    InternalError = InternalError
    ProgrammingError = ProgrammingError
    NotSupportedError = NotSupportedError

    def __init__(
        self,
        service: pipeline.Service,
        analyst: str,
        *,
        owns_service: bool = False,
        warn_low_budget: bool = False,
        dialect: str = "duckdb",
    ) -> None:
        self._session = Session(service, analyst, dialect=dialect)
        self.analyst = analyst
        self._owns_service = owns_service
        self._closed = False
        self._warn_low_budget = warn_low_budget  # also as a Python warning (in-process users)

    @property
    def service(self) -> pipeline.Service:
        return self._session.service

    @property
    def _service(self) -> pipeline.Service:
        return self._session.service

    @property
    def _settings(self) -> Settings:
        """This session's settings (the service session's)."""
        return self._session.settings

    @property
    def settings(self) -> dict[str, Any]:
        return self._session.settings.shown()

    def _check_open(self) -> None:
        if self._closed:
            raise InterfaceError("connection is closed", hint="open a new connection")

    @door
    def cursor(self) -> Cursor:
        self._check_open()
        return Cursor(self)

    @door
    def commit(self) -> None:
        self._check_open()

    @door
    def rollback(self) -> None:
        self._check_open()

    @door
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._owns_service:
                self._session.service.close()

    def interrupt(self) -> None:
        """Cancel the engine query running for this connection (from another thread)."""
        self._session.interrupt()

    @door
    def describe(self, sql: str, parameters: Sequence[Any] | None = None) -> list[tuple]:
        """PEP 249 description of a statement's result, without running it or spending."""
        self._check_open()
        return _description(self._session.describe(sql, parameters))

    @door
    def execute(self, sql: str, parameters: Sequence[Any] | None = None) -> Cursor:
        return self.cursor().execute(sql, parameters)

    def _run(self, sql: str, parameters: Sequence[Any] | None) -> Answer:
        self._check_open()
        return self._session.execute(sql, parameters)

    def _remaining(self) -> Remaining:
        """What the analyst has left now (read after a charge: SHOW budget's figures)."""
        return self._session.remaining()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _description(columns: Sequence[tuple[str, str]]) -> list[tuple]:
    return [(name, code, None, None, None, None, None) for name, code in columns]


class Cursor:
    """A PEP 249 cursor: the last statement's :class:`~dpsql.service.answer.Answer` (what every
    door shows), fetched row by row."""

    arraysize = 1

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._answer: Answer | None = None
        self._confidence = 0.95
        self._pos = 0
        self._closed = False
        self.arraysize = 1

    lastrowid = None  # PEP 249: dpsql never inserts rows

    @property
    def rownumber(self) -> int | None:
        return None if self._answer is None else self._pos

    @property
    def description(self) -> list[tuple] | None:
        if self._answer is None or not self._answer.description:
            return None
        return _description(self._answer.description)

    @property
    def rowcount(self) -> int:
        if self._answer is None or not self._answer.description:
            return -1
        return len(self._answer.rows)

    @property
    def intervals(self) -> list[tuple[tuple[float, float] | None, ...]] | None:
        """Per row, per column: the noise interval of a released aggregate, else None, at
        :attr:`confidence` (95% unless ``SET confidence = ...``)."""
        return None if self._answer is None else self._answer.intervals

    @property
    def biases(self) -> list[tuple[tuple[float, float, float] | None, ...]] | None:
        """Per row, per column: (estimated bias, low, high) of a released COUNT, SUM or AVG
        computed from bounded rows -- what the contribution bounds and clamps cut from it
        (true value minus released, estimated privately: docs/bias.md) and the interval
        widened by it -- else None (``SET bias_estimate = off``, or a kind not estimated)."""
        return None if self._answer is None else self._answer.biases

    @property
    def bias_notes(self) -> list[str]:
        """What the bounds cut from the last answer, one line per column (docs/bias.md)."""
        return [] if self._answer is None else self._answer.bias_notes

    @property
    def confidence(self) -> float:
        """The level of :attr:`intervals` for the last statement."""
        return self._confidence

    @property
    def interval_description(self) -> list[tuple] | None:
        """:attr:`description` with ``x_low``/``x_high`` after each column with intervals:
        the columns of :meth:`fetchall_intervals`, :meth:`fetch_records` and :meth:`fetch_df`."""
        if self._answer is None or not self._answer.description:
            return None
        return _description(self._answer.interval_description())

    @property
    def cost(self) -> Any:
        """The privacy cost charged for the last statement (None if cached or free)."""
        return None if self._answer is None else self._answer.cost

    @property
    def remaining(self) -> Remaining | None:
        """The analyst's budget left after the last statement's charge (None if nothing was
        charged)."""
        return None if self._answer is None else self._answer.remaining

    @property
    def messages(self) -> list[tuple[type, str]]:
        """PEP 249 extension: notes from the last statement (e.g. why a rule list is short)."""
        if self._answer is None:
            return []
        return [(Warning, note) for note in self._answer.warnings]

    @property
    def cached(self) -> bool:
        return bool(self._answer and self._answer.cached)

    @property
    def statusmessage(self) -> str | None:
        return None if self._answer is None else self._answer.status

    @door
    def execute(self, sql: str, parameters: Sequence[Any] | Mapping | None = None) -> Cursor:
        if self._closed:
            raise InterfaceError("cursor is closed", hint="open a new cursor")
        if isinstance(parameters, Mapping):
            raise ProgrammingError(
                "named parameters are not supported", hint="use ? placeholders and a sequence"
            )
        self._answer = None
        self._confidence = self.connection._settings.confidence
        self._answer = self.connection._run(sql, parameters)
        self._pos = 0
        warning = self._answer.budget_warning
        if warning is not None and self.connection._warn_low_budget:
            warnings.warn(warning, BudgetWarning, stacklevel=2)
        return self

    def callproc(self, procname: str, parameters: Sequence[Any] = ()) -> None:
        raise NotSupportedError(
            "stored procedures are not supported",
            construct="callproc",
            hint="send an aggregate SELECT with execute()",
        )

    def nextset(self) -> None:
        raise NotSupportedError(
            "a statement returns one result set", construct="nextset", hint="call execute() again"
        )

    @door
    def executemany(self, sql: str, seq_of_parameters: Sequence[Sequence[Any]]) -> Cursor:
        for params in seq_of_parameters:
            self.execute(sql, params)
        return self

    def _rows(self) -> list[tuple[Any, ...]]:
        if self._closed:
            raise InterfaceError("cursor is closed", hint="open a new cursor")
        if self._answer is None:
            raise ProgrammingError("no statement executed", hint="call execute() first")
        if not self._answer.description:
            raise ProgrammingError("the last statement returned no rows")
        return self._answer.rows

    @door
    def fetchone(self) -> tuple[Any, ...] | None:
        rows = self._rows()
        if self._pos >= len(rows):
            return None
        self._pos += 1
        return rows[self._pos - 1]

    @door
    def fetchmany(self, size: int | None = None) -> list[tuple[Any, ...]]:
        rows = self._rows()
        n = self.arraysize if size is None else size
        out = rows[self._pos : self._pos + n]
        self._pos += len(out)
        return out

    @door
    def fetchall(self) -> list[tuple[Any, ...]]:
        rows = self._rows()
        out = rows[self._pos :]
        self._pos = len(rows)
        return out

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        while (row := self.fetchone()) is not None:
            yield row

    @door
    def fetchall_intervals(self) -> list[tuple[Any, ...]]:
        """The remaining rows, each released aggregate followed by its interval's low and
        high bound (the columns of :attr:`interval_description`)."""
        start = self._pos
        rows = self.fetchall()
        assert self._answer is not None
        return self._answer.rows_with_intervals(start, start + len(rows))

    @door
    def fetch_records(self) -> list[dict[str, Any]]:
        """The remaining rows as dicts, with ``x_low``/``x_high`` interval fields."""
        rows = self.fetchall_intervals()
        names = [d[0] for d in self.interval_description or []]
        return [dict(zip(names, row, strict=True)) for row in rows]

    @door
    def fetch_df(self, *, intervals: bool = True) -> Any:
        """The remaining rows as a pandas DataFrame, with ``x_low``/``x_high`` columns."""
        try:
            import pandas as pd
        except ModuleNotFoundError:
            raise InterfaceError(
                "fetch_df needs pandas", hint="pip install pandas (or 'dpsql[pandas]')"
            ) from None
        if intervals:
            rows = self.fetchall_intervals()
            names = [d[0] for d in self.interval_description or []]
        else:
            rows = self.fetchall()
            names = [d[0] for d in self.description or []]
        return pd.DataFrame.from_records(rows, columns=names)

    def setinputsizes(self, sizes: Any) -> None:
        """PEP 249: accepted and ignored (parameters are bound as literals)."""

    def setoutputsize(self, size: Any, column: Any = None) -> None:
        """PEP 249: accepted and ignored (results are small and fetched whole)."""

    @door
    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> Cursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_sql(
    sql: str, con: Connection, params: Sequence[Any] | None = None, *, intervals: bool = True
) -> Any:
    """Run a DP query on a dpsql connection and return a pandas DataFrame: the released
    values, each aggregate followed by its ``x_low``/``x_high`` noise interval (at the
    session's confidence). ``pandas.read_sql`` works too, through the SQLAlchemy dialect."""
    with con.cursor() as cur:
        cur.execute(sql, params)
        return cur.fetch_df(intervals=intervals)


def connect(
    database: str = ":memory:",
    *,
    policy: str | Path | Mapping[str, Any] | Policy,
    analyst: str = "default",
    ledger: Ledger | str | os.PathLike[str] | None = None,
    dialect: str = "duckdb",
    **service_options: Any,
) -> Connection:
    """Open a dpsql connection: load ``policy`` and its data, and act as ``analyst``.

    ``dialect``: the SQL dialect statements are read in, "duckdb" (DuckDB's grammar and
    semantics: ``7 / 2`` is 3.5) or "postgres" (PostgreSQL's, as over the wire: ``7 / 2`` is
    3, ``TO_CHAR``, ``date_part``, ``$$...$$``); see grammar_notes.md, "SQL dialects".

    The budget is spent in ``ledger``: a Ledger object, or the path of a durable SQLite ledger.
    Without one, in the policy's ``[privacy] ledger`` file (a policy file always has one);
    a dict policy without ``ledger`` spends an in-memory budget that every connection of this
    process over the same data shares, so reconnecting never hands out a fresh budget (or
    fresh noise for a repeated query), and warns once that it ends with the process.
    """
    try:
        dialect = check_dialect(dialect)
    except ValueError as exc:
        raise ProgrammingError(str(exc), construct="dialect", hint="dialect='postgres'") from None
    loaded = policy if isinstance(policy, Policy) else load_policy(policy)
    check_analyst(loaded.analysts, analyst, "dpsql.connect(analyst=...)")
    owned = None
    if isinstance(ledger, str | os.PathLike):
        from dpsql.privacy.sqlite_ledger import SQLiteLedger

        ledger = owned = SQLiteLedger(Path(ledger))
    elif ledger is None and loaded.ledger_path is None:
        ledger, first = _process_ledger(loaded)
        if first:
            warnings.warn(
                f"the privacy budget of dataset {loaded.dataset!r} is kept in memory: it lasts "
                "only as long as this process (every connection of the process over the same "
                "data shares it). To keep it across processes, name a ledger file: "
                '[privacy] ledger = "budget.ledger.sqlite" in the policy, or '
                'dpsql.connect(..., ledger="budget.ledger.sqlite")',
                EphemeralBudgetWarning,
                stacklevel=2,
            )
    try:
        service = Service(loaded, database, ledger=ledger, **service_options)
    except BaseException:
        if owned is not None:
            owned.close()
        raise
    return Connection(service, analyst, owns_service=True, warn_low_budget=True, dialect=dialect)


_PROCESS_LEDGERS: dict[str, MemoryLedger] = {}
_PROCESS_LOCK = threading.Lock()


def _process_ledger(policy: Policy) -> tuple[MemoryLedger, bool]:
    """The in-memory ledger this process keeps for ``policy``'s data; True if it is new."""
    key = data_identity(policy)
    with _PROCESS_LOCK:
        ledger = _PROCESS_LEDGERS.get(key)
        if ledger is not None:
            return ledger, False
        ledger = _PROCESS_LEDGERS[key] = MemoryLedger()
        return ledger, True


def data_identity(policy: Policy) -> str:
    """A canonical hash of what a policy protects: its dataset name and each table's source.

    Only these count: a policy that changes a bound, the default ε or the budget's size over
    the same data must not get a fresh budget. (The answer cache is keyed by plan and data
    version, so sharing the ledger never replays an answer for another query.)
    """
    tables = sorted(
        (name, table.source, str(table.source_path or "")) for name, table in policy.tables.items()
    )
    text = json.dumps([policy.dataset, tables], ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def connect_service(
    service: pipeline.Service, analyst: str = "default", dialect: str = "duckdb"
) -> Connection:
    """A connection (one analyst's session) over an existing service: the front door
    depends on the service, never the other way."""
    return Connection(service, analyst, dialect=dialect)
