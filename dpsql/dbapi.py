"""PEP 249 Connection and Cursor over the dpsql pipeline."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpsql.engine.duckdb_engine import QueryHandle
from dpsql.errors import InterfaceError, ProgrammingError, Warning
from dpsql.pipeline import Result, Service, Settings, _ResetRequest, reset_setting

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
    policy: str | Path | Mapping[str, Any],
    analyst: str = "default",
    **service_options: Any,
) -> Connection:
    """Open a dpsql connection: load ``policy`` and its data, and act as ``analyst``."""
    service = Service(policy, database, **service_options)
    return Connection(service, analyst, owns_service=True)
