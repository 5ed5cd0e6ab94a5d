"""The extended query protocol of one wire session: prepared statements and portals (Parse,
Bind, Describe, Execute, Close), and describing a statement's columns without running it.

One object per connection (:class:`ExtendedQuery`), holding the session's named statements and
portals; the statement itself runs through the session (routing, fair scheduling, limits) like a
simple query. The row encoders are shared with the simple protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dpsql import errors as dperr
from dpsql.frontend.sqltext import keywords, split_statements
from dpsql.limits import check_parameter_count
from dpsql.server import protocol as p
from dpsql.server import types as t
from dpsql.server.backend import Outcome
from dpsql.server.probes import probe_decision, relation_probe
from dpsql.server.settings import set_name_of
from dpsql.server.wire_errors import SqlError

MAX_STATEMENTS = 1000
MAX_PREPARED_BYTES = 16 << 20
# Work done on the event loop itself only when it is this small (see Session._small): statement
# text up to LOOP_TEXT characters (~8 ms to scan at most), results up to LOOP_VALUES values.
LOOP_TEXT = 4096
LOOP_VALUES = 1024


@dataclass
class Prepared:
    name: str
    sql: str
    param_oids: tuple[int, ...]
    kind: str
    columns: tuple[tuple[str, int], ...] | None = None
    described: bool = False


@dataclass
class Portal:
    statement: Prepared
    params: tuple[Any, ...]
    formats: tuple[int, ...]
    outcome: Outcome | None = None
    pos: int = 0
    columns: tuple[tuple[str, int], ...] | None = None
    encoded: list[bytes] = field(default_factory=list)


def formats_for(formats: Sequence[int], count: int) -> tuple[int, ...]:
    if not formats:
        return (0,) * count
    if len(formats) == 1:
        return (formats[0],) * count
    if len(formats) != count:
        raise SqlError(
            "08P01", f"bind message has {len(formats)} result formats but query has {count} columns"
        )
    return tuple(formats)


def encode_rows(
    columns: Sequence[tuple[str, int]], rows: Sequence[Sequence[Any]], formats: Sequence[int]
) -> list[bytes]:
    out = []
    for row in rows:
        values: list[bytes | None] = []
        for (_, oid), fmt, value in zip(columns, formats, row, strict=True):
            if value is None:
                values.append(None)
            elif fmt == 1:
                values.append(t.encode_binary(value, oid))
            else:
                values.append(t.encode_text(value, oid))
        out.append(p.data_row(values))
    return out


def row_description(columns: Sequence[tuple[str, int]], formats: Sequence[int]) -> bytes:
    return p.row_description(
        [
            p.Field(name, oid, t.type_size(oid), -1, 0, 0, fmt)
            for (name, oid), fmt in zip(columns, formats, strict=True)
        ]
    )


class ExtendedQuery:
    """Parse/Bind/Describe/Execute/Close for one session (``session``: the wire session,
    :class:`dpsql.server.session.Session`, typed loosely so this module does not import it)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.statements: dict[str, Prepared] = {}
        self.prepared_bytes = 0
        self.portals: dict[str, Portal] = {}

    async def parse(self, body: bytes) -> None:
        s = self.session
        msg = p.parse_parse(body)
        parts = await s._small(len(msg.query), LOOP_TEXT, split_statements, msg.query)
        if len(parts) > 1:
            raise SqlError("42601", "cannot insert multiple commands into a prepared statement")
        if msg.name and msg.name in self.statements:
            raise SqlError("42P05", f'prepared statement "{msg.name}" already exists')
        most = s.limits.max_prepared_statements
        if msg.name and len(self.statements) >= most:
            raise SqlError(
                "54000",
                f"too many prepared statements (limit {most}, limits.max_prepared_statements)",
                hint="close statements you no longer need",
            )
        sql = parts[0].text if parts else ""
        old = self.statements.get(msg.name)
        used = self.prepared_bytes - (len(old.sql) if old else 0) + len(sql)
        if used > MAX_PREPARED_BYTES:
            raise SqlError(
                "54000",
                "prepared statements use too much memory",
                hint="close statements you no longer need",
            )
        # the limits first: $n past max_parameters allocates nothing
        kind, holders = await s._small(len(sql), LOOP_TEXT, s.classify_and_count, sql)
        count = max(holders, len(msg.param_oids))
        check_parameter_count(count, s.limits)
        oids = tuple(msg.param_oids) + (0,) * (count - len(msg.param_oids))
        self.statements[msg.name] = Prepared(msg.name, sql, oids, kind)
        self.prepared_bytes = used
        s.send(p.parse_complete())

    async def bind(self, body: bytes) -> None:
        s = self.session
        msg = p.parse_bind(body)
        stmt = self.statements.get(msg.statement)
        if stmt is None:
            raise SqlError("26000", f'prepared statement "{msg.statement}" does not exist')
        if len(msg.params) != len(stmt.param_oids):
            raise SqlError(
                "08P01",
                f"bind message supplies {len(msg.params)} parameters, but prepared statement "
                f'"{stmt.name}" requires {len(stmt.param_oids)}',
            )
        if msg.portal and msg.portal in self.portals:
            raise SqlError("42P03", f'cursor "{msg.portal}" already exists')
        if len(self.portals) >= MAX_STATEMENTS:
            raise SqlError("54000", "too many open portals", hint="close portals or Sync")
        fmts = formats_for(msg.param_formats, len(msg.params))
        values = tuple(
            t.decode_param(data, oid, fmt)
            for data, oid, fmt in zip(msg.params, stmt.param_oids, fmts, strict=True)
        )
        self.portals[msg.portal] = Portal(stmt, values, msg.result_formats)
        s.send(p.bind_complete())

    async def describe(self, body: bytes) -> None:
        s = self.session
        msg = p.parse_describe(body)
        if msg.kind == "S":
            stmt = self.statements.get(msg.name)
            if stmt is None:
                raise SqlError("26000", f'prepared statement "{msg.name}" does not exist')
            s.commands.check_failed_block(stmt.sql, stmt.kind)
            if not stmt.described:
                stmt.columns = await self.describe_statement(stmt, None)
                stmt.described = True
            s.send(p.parameter_description([o or t.TEXT for o in stmt.param_oids]))
            if stmt.columns:
                s.send(row_description(stmt.columns, (0,) * len(stmt.columns)))
            else:
                s.send(p.no_data())
            return
        portal = self.portals.get(msg.name)
        if portal is None:
            raise SqlError("34000", f'portal "{msg.name}" does not exist')
        s.commands.check_failed_block(portal.statement.sql, portal.statement.kind)
        if portal.columns is None and portal.outcome is None:
            portal.columns = await self.describe_statement(portal.statement, portal.params)
        columns = portal.outcome.columns if portal.outcome is not None else portal.columns
        if columns:
            s.send(row_description(columns, formats_for(portal.formats, len(columns))))
        else:
            s.send(p.no_data())

    async def execute(self, body: bytes) -> None:
        s = self.session
        msg = p.parse_execute(body)
        portal = self.portals.get(msg.portal)
        if portal is None:
            raise SqlError("34000", f'portal "{msg.portal}" does not exist')
        if portal.outcome is None:
            stmt = portal.statement
            if stmt.kind == "empty":
                s.commands.check_failed_block(stmt.sql, stmt.kind)
                s.send(p.empty_query_response())
                portal.outcome = Outcome(None, [], "")
                return
            outcome = await s.run_statement(stmt.sql, stmt.kind, portal.params)
            columns = outcome.columns or ()
            formats = formats_for(portal.formats, len(columns))
            size = len(outcome.rows) * len(columns)
            portal.encoded = (
                await s._small(size, LOOP_VALUES, encode_rows, columns, outcome.rows, formats)
                if columns
                else []
            )
            portal.outcome = outcome
            s._send_notices(outcome)
        elif portal.outcome.tag == "":
            s.send(p.empty_query_response())
            return
        outcome = portal.outcome
        limit = msg.max_rows if msg.max_rows > 0 else len(portal.encoded)
        chunk = portal.encoded[portal.pos : portal.pos + limit]
        for row in chunk:
            s.send(row)
        portal.pos += len(chunk)
        if outcome.columns is not None and portal.pos < len(portal.encoded):
            s.send(p.portal_suspended())
            return
        if outcome.columns is not None and msg.max_rows > 0:
            s.send(p.command_complete(f"SELECT {len(chunk)}"))
        else:
            s.send(p.command_complete(outcome.tag))
        portal.encoded = []

    async def close(self, body: bytes) -> None:
        s = self.session
        msg = p.parse_close(body)
        if msg.kind == "S":
            old = self.statements.pop(msg.name, None)
            if old is not None:
                self.prepared_bytes -= len(old.sql)
        else:
            self.portals.pop(msg.name, None)
        s.send(p.close_complete())

    async def describe_statement(
        self, stmt: Prepared, params: Sequence[Any] | None
    ) -> tuple[tuple[str, int], ...] | None:
        """Result columns without running a DP query (it runs nothing, spends nothing)."""
        s = self.session
        await s._check_limits(stmt.sql)
        kind = stmt.kind
        if kind == "show":
            name = set_name_of(stmt.sql) or ""
            if name == "all":
                return (("name", t.TEXT), ("setting", t.TEXT), ("description", t.TEXT))
            return ((name, t.TEXT),)
        if kind in ("tx", "set", "reset", "noop", "empty", "explain"):
            return None
        if kind == "maybe_probe":
            probe, _column = await s._blocking(probe_decision, stmt.sql)
            if probe:
                return await self.probe_columns(stmt.sql, params)
            kind = "dp"
        if kind == "dp":
            assert s.dp is not None
            words = keywords(stmt.sql, 1)
            if words and words[0] in ("set", "reset"):
                return None
            cols = await s._blocking(s.dp.describe, stmt.sql, params)
            return cols or None
        assert s.shadow is not None
        values = list(params) if params is not None else [None] * len(stmt.param_oids)
        result = await s._blocking(s.shadow.run, stmt.sql, values or None, s.info())
        return result.columns

    async def probe_columns(
        self, sql: str, params: Sequence[Any] | None
    ) -> tuple[tuple[str, int], ...]:
        """Columns of a zero-row probe: the planned DP columns, else the shadow's (public)."""
        s = self.session
        assert s.dp is not None and s.shadow is not None
        try:
            columns = await s._blocking(s.dp.describe, sql, params)
        except dperr.Error:
            # a probe of a row-level relation is answered from its plan or refused with the
            # relation's own reason (dpsql.frontend.bind.parse_probe), never from the catalog
            if await s._blocking(relation_probe, sql):
                raise
            columns = ()
        if columns:
            return columns
        values = list(params) if params else None
        result = await s._blocking(
            s.shadow.run, sql, values, s.info(), interrupt=s.shadow.interrupt
        )
        return result.columns
