"""PEP 249 Connection and Cursor over the dpsql pipeline."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpsql.engine.duckdb_engine import QueryHandle
from dpsql.errors import InterfaceError, ProgrammingError, Warning
from dpsql.pipeline import Result, Service, Settings, _ResetRequest, reset_setting
from dpsql.policy import Policy, load_policy
from dpsql.privacy.ledger import EphemeralBudgetWarning, Ledger, MemoryLedger

apilevel = "2.0"
threadsafety = 1  # threads may share the module, not connections
paramstyle = "qmark"  # ? placeholders; $1, $2 ... are accepted too


class Connection:
    """One analyst's session: their settings and budget, over a shared :class:`Service`."""

    def __init__(self, service: Service, analyst: str, *, owns_service: bool = False) -> None:
        self._service = service
        self.analyst = analyst
        self._defaults = Settings.from_policy(service.policy)
        self._settings = Settings.from_policy(service.policy)
        self._owns_service = owns_service
        self._closed = False
        self._handle = QueryHandle()
        self._lock = threading.Lock()

    @property
    def service(self) -> Service:
        return self._service

    @property
    def settings(self) -> dict[str, Any]:
        return self._settings.as_dict()

    def _check_open(self) -> None:
        if self._closed:
            raise InterfaceError("connection is closed", hint="open a new connection")

    def cursor(self) -> Cursor:
        self._check_open()
        return Cursor(self)

    def commit(self) -> None:
        self._check_open()

    def rollback(self) -> None:
        self._check_open()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._owns_service:
                self._service.close()

    def interrupt(self) -> None:
        """Cancel the engine query running for this connection (from another thread)."""
        self._handle.interrupt()

    def describe(self, sql: str, parameters: Sequence[Any] | None = None) -> list[tuple]:
        """PEP 249 description of a statement's result, without running it or spending."""
        self._check_open()
        return _description(
            self._service.describe(sql, self._settings, parameters, analyst=self.analyst)
        )

    def execute(self, sql: str, parameters: Sequence[Any] | None = None) -> Cursor:
        return self.cursor().execute(sql, parameters)

    def _run(self, sql: str, parameters: Sequence[Any] | None) -> Result:
        self._check_open()
        with self._lock:
            self._handle = QueryHandle()
            try:
                return self._service.execute(
                    sql, parameters, self._settings, self.analyst, self._handle
                )
            except _ResetRequest as reset:
                return reset_setting(self._settings, self._defaults, reset.name)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _description(columns: Sequence[tuple[str, str]]) -> list[tuple]:
    return [(name, code, None, None, None, None, None) for name, code in columns]


class Cursor:
    arraysize = 1

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._result: Result | None = None
        self._pos = 0
        self._closed = False
        self.arraysize = 1

    @property
    def description(self) -> list[tuple] | None:
        if self._result is None or not self._result.description:
            return None
        return _description(self._result.description)

    @property
    def rowcount(self) -> int:
        if self._result is None or not self._result.description:
            return -1
        return len(self._result.rows)

    @property
    def intervals(self) -> list[tuple[tuple[float, float] | None, ...]] | None:
        """Per row, per column: the 95% noise interval of a released aggregate, else None."""
        return None if self._result is None else self._result.intervals

    @property
    def cost(self) -> Any:
        """The privacy cost charged for the last statement (None if cached or free)."""
        return None if self._result is None else self._result.cost

    @property
    def messages(self) -> list[tuple[type, str]]:
        """PEP 249 extension: notes from the last statement (e.g. why a rule list is short)."""
        if self._result is None:
            return []
        return [(Warning, note) for note in self._result.notes]

    @property
    def cached(self) -> bool:
        return bool(self._result and self._result.cached)

    @property
    def statusmessage(self) -> str | None:
        return None if self._result is None else self._result.status

    def execute(self, sql: str, parameters: Sequence[Any] | Mapping | None = None) -> Cursor:
        if self._closed:
            raise InterfaceError("cursor is closed", hint="open a new cursor")
        if isinstance(parameters, Mapping):
            raise ProgrammingError(
                "named parameters are not supported", hint="use ? placeholders and a sequence"
            )
        self._result = None
        self._result = self.connection._run(sql, parameters)
        self._pos = 0
        return self

    def executemany(self, sql: str, seq_of_parameters: Sequence[Sequence[Any]]) -> Cursor:
        for params in seq_of_parameters:
            self.execute(sql, params)
        return self

    def _rows(self) -> list[tuple[Any, ...]]:
        if self._closed:
            raise InterfaceError("cursor is closed", hint="open a new cursor")
        if self._result is None:
            raise ProgrammingError("no statement executed", hint="call execute() first")
        if not self._result.description:
            raise ProgrammingError("the last statement returned no rows")
        return self._result.rows

    def fetchone(self) -> tuple[Any, ...] | None:
        rows = self._rows()
        if self._pos >= len(rows):
            return None
        self._pos += 1
        return rows[self._pos - 1]

    def fetchmany(self, size: int | None = None) -> list[tuple[Any, ...]]:
        rows = self._rows()
        n = self.arraysize if size is None else size
        out = rows[self._pos : self._pos + n]
        self._pos += len(out)
        return out

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows = self._rows()
        out = rows[self._pos :]
        self._pos = len(rows)
        return out

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        while (row := self.fetchone()) is not None:
            yield row

    def setinputsizes(self, sizes: Any) -> None:
        pass

    def setoutputsize(self, size: Any, column: Any = None) -> None:
        pass

    def close(self) -> None:
        self._closed = True


def connect(
    database: str = ":memory:",
    *,
    policy: str | Path | Mapping[str, Any] | Policy,
    analyst: str = "default",
    ledger: Ledger | str | os.PathLike[str] | None = None,
    **service_options: Any,
) -> Connection:
    """Open a dpsql connection: load ``policy`` and its data, and act as ``analyst``.

    The budget is spent in ``ledger``: a Ledger object, or the path of a durable SQLite ledger.
    Without one, in the policy's ``[privacy] ledger`` file (a policy file always has one);
    a dict policy without ``ledger`` spends an in-memory budget that every connection of this
    process over the same data shares, so reconnecting never hands out a fresh budget (or
    fresh noise for a repeated query), and warns once that it ends with the process.
    """
    loaded = policy if isinstance(policy, Policy) else load_policy(policy)
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
    return Connection(service, analyst, owns_service=True)


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
