"""One client connection: startup, TLS, SCRAM, then the simple and extended query protocols.

Statements are routed by what they reference: anything naming a private table (or a dpsql
privacy setting) goes to the analyst's session over the service (``dpsql.service.session``,
through :class:`~dpsql.server.backend.DpBackend`); everything else — catalog and session
queries — goes to the empty shadow database. Blocking work runs in the server's thread pool so
the event loop keeps serving other clients (dpsql.server.pool); the connection's stream tells the
session when the client hangs up, so a client that disconnects mid-query interrupts it
(dpsql.server.stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import struct
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dpsql.boundary import CHARGED_HINT, CHARGED_STATES, FAILED_AFTER_READ
from dpsql.frontend.sqltext import split_statements
from dpsql.limits import (
    DEFAULT_LIMITS,
    Limits,
    check_size,
    check_text,
)
from dpsql.policy import Policy
from dpsql.server import protocol as p
from dpsql.server.backend import DpBackend, Outcome, placeholder_count
from dpsql.server.catalog import ShadowCursor
from dpsql.server.catalog_sql import SessionInfo
from dpsql.server.connections import ConnectionLimits, address_of
from dpsql.server.extended import LOOP_TEXT, LOOP_VALUES, ExtendedQuery
from dpsql.server.extended import MAX_STATEMENTS as MAX_STATEMENTS
from dpsql.server.extended import encode_rows as _encode_rows
from dpsql.server.extended import row_description as _row_description
from dpsql.server.fairness import Abandoned, FairScheduler
from dpsql.server.handshake import Handshake
from dpsql.server.pool import Pool
from dpsql.server.probes import (
    COLUMN_PROBE_NOTICE,
    probe_decision,
)
from dpsql.server.session_statements import SessionStatements
from dpsql.server.settings import (
    SessionSettings,
)
from dpsql.server.stream import ClientReader, reads_to_end
from dpsql.server.wire_errors import Closed as _Closed
from dpsql.server.wire_errors import SqlError as SqlError
from dpsql.server.wire_errors import as_sql_error as as_sql_error
from dpsql.server.wire_errors import cancelled_waiting, timed_out_running


class Server(Protocol):
    """What a connection reads of the server that accepted it (dpsql.server.server.Server):
    a structural type, so this module does not import the server that imports it."""

    policy: Policy
    dataset: str
    max_message: int
    connections: ConnectionLimits
    pool: Pool
    scheduler: FairScheduler

    def next_pid(self) -> int: ...
    def unregister(self, session: Session) -> None: ...


log = logging.getLogger("dpsql.server")

# Queued reply bytes handed to the transport at once past this size, before the next flush.
_OUT_CHUNK = 64 << 10
# RowDescriptions a connection remembers (forgotten all at once when full)
_DESCRIPTIONS = 64


class Session:
    def __init__(
        self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.address = address_of(peer)
        self.pid = server.next_pid()
        self.secret = secrets.randbelow(1 << 31)
        self.user = ""
        self.database = ""
        self.settings: SessionSettings | None = None
        self.dp: DpBackend | None = None
        self.shadow: ShadowCursor | None = None
        self.tx = "I"
        # its parts: the extended protocol's statements and portals, the statements it answers
        # itself, and its start (dpsql.server.extended, session_statements, handshake)
        self.extended = ExtendedQuery(self)
        self.commands = SessionStatements(self)
        self.handshake = Handshake(self)
        self.skip_to_sync = False
        if isinstance(reader, ClientReader):  # the server's streams (dpsql.server.stream)
            reader.on_lost = self._lost
        self._hung_up = False
        self._interrupt: Callable[[], None] | None = None
        self._cancelled = False
        self._timed_out = False
        self._closing = False
        self._charged = False  # the running statement's cost was charged (dpsql.boundary)
        self._auth_deadline: asyncio.Timeout | None = None
        self._auth_stage = "startup"  # "startup", "tls", "login" (what the timeout ends)
        self.login_counted = ""  # the login counted in server.logins (dpsql.server.connections)
        # messages sent since the last flush, written to the socket together (see send)
        self._out: list[bytes] = []
        self._out_bytes = 0
        # RowDescriptions this connection sent, by (columns, formats): a dashboard's tiles
        # repeat their columns, and building one is ~10 Python calls (dpsql.server.extended)
        self._descriptions: dict[tuple[Any, Any], bytes] = {}

    # ---------------------------------------------------------------------------------------
    # plumbing

    def send(self, data: bytes) -> None:
        """Queue one message; :meth:`flush` writes those queued in one socket write. As
        PostgreSQL does, a reply's messages (NOTICEs, RowDescription, DataRows, CommandComplete,
        ReadyForQuery) leave together: asyncio's transport sent each ``write`` at once, one
        system call (and one client wake-up) per message. Every path that waits for the client
        flushes first (ReadyForQuery, Sync, Flush, authentication, FATAL)."""
        self._out.append(data)
        self._out_bytes += len(data)
        if self._out_bytes >= _OUT_CHUNK:  # a large result: to the transport in chunks
            self._write_out()

    def _write_out(self) -> None:
        if self._out:
            data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
            self._out.clear()
            self._out_bytes = 0
            if not self.writer.is_closing():
                self.writer.write(data)

    async def flush(self) -> None:
        self._write_out()
        try:
            await self.writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            raise _Closed() from exc

    async def fatal(self, sqlstate: str, message: str, hint: str | None = None) -> None:
        self.send(p.error_response(sqlstate, message, severity="FATAL", hint=hint))
        with contextlib.suppress(_Closed):
            await self.flush()

    async def _read_exact(self, n: int) -> bytes:
        try:
            return await self.reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise _Closed() from exc

    async def read_message(self) -> tuple[bytes, bytes]:
        header = await self._read_exact(5)
        kind = header[:1]
        length = struct.unpack("!i", header[1:])[0]
        if length < 4:
            raise p.ProtocolViolation(f"invalid message length {length}")
        if length - 4 > self.server.max_message:
            raise p.ProtocolViolation(
                f"message of {length - 4} bytes exceeds the server's limit of "
                f"{self.server.max_message} bytes",
                sqlstate="54000",
            )
        body = await self._read_exact(length - 4)
        return kind, body

    def cancel(self) -> None:
        """Called on the event loop for a CancelRequest carrying this session's key."""
        self._cancelled = True
        if self._interrupt is not None:
            try:
                self._interrupt()
            except Exception:
                log.debug("interrupt failed", exc_info=True)

    async def _blocking(
        self, fn: Callable[..., Any], *args: Any, interrupt: Any = None, scheduled: bool = True
    ) -> Any:
        """Run ``fn(*args)`` in the thread pool. A ``scheduled`` call (every statement) first
        waits for its turn in the server's fair scheduler (:mod:`dpsql.server.fairness`), which
        also counts its CPU against the analyst; the wait counts against statement_timeout and a
        CancelRequest ends it, as it ends the statement once it runs."""
        loop = asyncio.get_running_loop()
        self._cancelled = False
        timer = None
        timeout = self._statement_timeout() if interrupt is not None else 0.0
        if timeout > 0:
            timer = loop.call_later(timeout, self._time_out)
        turn = None
        ran = False
        try:
            call: Callable[[], Any] = functools.partial(fn, *args)
            if scheduled and self.user:
                turn = self.server.scheduler.enter(self.user)
                self._interrupt = turn.abandon
                abandoned = False
                try:
                    await turn.granted
                except Abandoned:  # a cancel, the timeout, or the client went away
                    abandoned = True
                if abandoned or self._cancelled:  # while it waited: nothing ran
                    raise cancelled_waiting(self._timed_out)
                call = self.server.scheduler.wrap(turn, fn, *args)
            self._interrupt = interrupt
            ran = True
            # the outcome unpacked here, inline: no dpsql function runs between a charged
            # statement's end and its answer's arrival (dpsql.server.pool)
            ok, value = await self.server.pool.run(call)
            if not ok:
                raise value
            return value
        except Exception as exc:
            if ran and self._timed_out:
                raise timed_out_running() from exc
            raise
        finally:
            if turn is not None:
                try:
                    self.server.scheduler.leave(turn)
                except Exception:  # the statement's outcome stands; the slot comes back at
                    turn.finished = True  # the next dispatch (dpsql.server.fairness)
                    log.exception("leaving the scheduler failed")
            self._interrupt = None
            self._timed_out = False
            if timer is not None:
                timer.cancel()

    async def _small(self, size: int, most: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` right here on the event loop when ``size`` is at most ``most``; else
        as the analyst's scheduled work in the pool. Scanning a long text (splitting,
        classifying, counting ``$n``: ~2 µs a character) or encoding a large result (~5 µs a
        value) would otherwise hold the loop every connection shares — 16 connections each
        sending a 600 kB statement held it for ~13 s at once — outside any per-analyst limit."""
        if size <= most:
            return fn(*args)
        return await self._blocking(fn, *args)

    def classify_and_count(self, sql: str) -> tuple[str, int]:
        return self.commands.classify(sql), placeholder_count(sql)

    def _time_out(self) -> None:
        self._timed_out = True
        self.cancel()

    def _statement_timeout(self) -> float:
        """statement_timeout in seconds (PostgreSQL syntax: 500, '500ms', '5s', '1min')."""
        if self.settings is None:
            return 0.0
        text = self.settings.values.get("statement_timeout", "0").strip().lower()
        units = {"ms": 0.001, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
        for unit in ("ms", "min", "s", "h", "d"):
            if text.endswith(unit):
                number, scale = text[: -len(unit)].strip(), units[unit]
                break
        else:
            number, scale = text, 0.001
        try:
            return max(0.0, float(number) * scale)
        except ValueError:
            return 0.0

    # ---------------------------------------------------------------------------------------
    # lifecycle

    async def run(self) -> None:
        try:
            # startup, TLS handshake and login within auth_timeout (dpsql.server.connections)
            self._auth_deadline = asyncio.timeout(self.server.connections.auth_timeout)
            async with self._auth_deadline:
                startup = await self.handshake.startup()
                if startup is None:
                    return
                if not await self.handshake.authenticate(startup):
                    return
            if not await self.handshake.open_backends(startup):
                return
            await self._main_loop()
        except TimeoutError:
            if self._auth_stage == "tls":  # mid-handshake: nothing can be written
                return
            if self._auth_stage == "startup":
                await self.fatal("08P01", "timeout expired waiting for the startup packet")
            else:
                await self.fatal(
                    "28000",
                    "canceling authentication due to timeout",
                    hint=f"log in within {self.server.connections.auth_timeout:g} s",
                )
        except p.ProtocolViolation as exc:
            await self.fatal(exc.sqlstate, exc.message)
        except _Closed:
            pass
        except Exception:
            log.exception("session %s failed", self.pid)
            await self.fatal("XX000", "internal error in dpsql server")
        finally:
            await self._cleanup()

    async def _cleanup(self) -> None:
        self._closing = True
        if self._interrupt is not None:
            with contextlib.suppress(Exception):
                self._interrupt()
        self.server.unregister(self)
        try:
            for backend in (self.dp, self.shadow):
                if backend is not None:
                    with contextlib.suppress(Exception):
                        await self.server.pool.run(backend.close)
        finally:  # also when the server shuts down and cancels this task
            with contextlib.suppress(Exception):
                self._write_out()
                self.writer.close()

    def _lost(self, error: bool) -> None:
        """The client hung up (called by its stream, dpsql.server.stream): a statement running
        or waiting for its turn is interrupted — after an error at once, after an EOF unless a
        Terminate or a refused message comes first in what is left to read (where a reader
        reading ahead stopped, before the end). Once a connection."""
        if self._hung_up or self._interrupt is None or self._closing:
            return
        unread = self.reader._buffer  # type: ignore[attr-defined]
        if not error and not reads_to_end(unread, self.server.max_message):
            return
        self._hung_up = True
        try:
            self._interrupt()
        except Exception:
            log.debug("interrupt failed", exc_info=True)

    async def _main_loop(self) -> None:
        while True:
            kind, body = await self.read_message()
            if kind == b"X":
                return
            if not await self._dispatch(kind, body):
                return

    async def _dispatch(self, kind: bytes, body: bytes) -> bool:
        """Handle one message; False closes the connection."""
        if kind in (b"d", b"c", b"f"):
            return True  # CopyData/CopyDone/CopyFail outside COPY are ignored, as in PostgreSQL
        if kind == b"S":
            self.skip_to_sync = False
            if self.tx == "I":
                self.extended.portals.clear()
            self.send(p.ready_for_query(self.tx))
            await self.flush()
            return True
        if self.skip_to_sync and kind in (b"P", b"B", b"D", b"E", b"C", b"H"):
            return True
        handler = {
            b"Q": self._simple_query,
            b"P": self.extended.parse,
            b"B": self.extended.bind,
            b"D": self.extended.describe,
            b"E": self.extended.execute,
            b"C": self.extended.close,
            b"H": self._flush,
            b"F": self._function_call,
        }.get(kind)
        if handler is None:
            await self.fatal("08P01", f"invalid frontend message type {kind[0]}")
            return False
        self._charged = False
        try:
            await handler(body)
        except _Closed:
            return False
        except Exception as exc:
            err = self._statement_error(exc)
            if err.fatal:
                await self.fatal(err.sqlstate, err.message)
                return False
            self._send_error(err, 0, None)
            if kind not in (b"Q", b"F"):  # extended-protocol errors discard until Sync
                self.skip_to_sync = True
            if self.tx == "T":
                self.tx = "E"
            if kind in (b"Q", b"F"):
                self.send(p.ready_for_query(self.tx))
            await self.flush()
        return True

    def _statement_error(self, exc: Exception) -> SqlError:
        """The error to send for ``exc``: after the statement's charge, a failure that is not
        already one of the charged errors (encoding or sending the paid answer) is the one
        uniform charged error, so the analyst hears that the cost stands."""
        err = as_sql_error(exc)
        if self._charged and not err.fatal and err.sqlstate not in CHARGED_STATES:
            log.error("sending a charged answer failed", exc_info=exc)
            return SqlError("58000", FAILED_AFTER_READ, hint=CHARGED_HINT)
        return err

    def _send_error(self, err: SqlError, offset: int, text: str | None) -> None:
        position = None
        if err.position is not None:
            position = offset + err.position + 1
        self.send(p.error_response(err.sqlstate, err.message, hint=err.hint, position=position))

    # ---------------------------------------------------------------------------------------
    # routing and execution

    def info(self) -> SessionInfo:
        assert self.settings is not None
        return SessionInfo(self.user, self.server.dataset, self.pid, self.settings.lowered())

    @property
    def limits(self) -> Limits:
        """The policy's ``[limits]`` (dpsql.limits)."""
        return getattr(self.server.policy, "limits", DEFAULT_LIMITS)

    async def run_statement(self, sql: str, kind: str, params: Sequence[Any]) -> Outcome:
        self.commands.check_failed_block(sql, kind)
        await self._check_limits(sql)
        if kind == "empty":
            return Outcome(None, [], "")
        if kind == "tx":
            return self.commands.transaction(sql)
        if kind == "set":
            return self.commands.set(sql)
        if kind == "reset":
            return self.commands.reset(sql)
        if kind == "show":
            return self.commands.show(sql)
        if kind == "noop":
            return self.commands.noop(sql)
        if kind == "explain":
            raise SqlError(
                "0A000",
                "EXPLAIN is available for differentially private queries only",
                hint="EXPLAIN SELECT COUNT(*) FROM <private table> shows the noise and the cost",
            )
        if kind == "maybe_probe":
            probe, column = await self._blocking(probe_decision, sql)
            if probe:
                columns = await self.extended.probe_columns(sql, params)
                notices = (("NOTICE", "01000", COLUMN_PROBE_NOTICE),) if column else ()
                return Outcome(columns, [], "SELECT 0", notices)
            kind = "dp"
        if kind == "dp":
            assert self.dp is not None
            outcome = await self._blocking(
                self.dp.execute, sql, list(params) or None, interrupt=self.dp.interrupt
            )
            self._charged = outcome.charged
            return outcome
        assert self.shadow is not None
        result = await self._blocking(
            self.shadow.run, sql, list(params) or None, self.info(), interrupt=self.shadow.interrupt
        )
        return Outcome(result.columns, result.rows, f"SELECT {len(result.rows)}")

    async def _check_limits(self, sql: str) -> None:
        """dpsql.limits.check_text, as the analyst's scheduled work when counts alone do not
        settle it (a statement's first parse, in whichever route, comes after)."""
        if not check_size(sql, self.limits):
            await self._blocking(check_text, sql, self.limits)

    def _row_description(self, columns: Any, formats: tuple[int, ...]) -> bytes:
        """RowDescription of ``columns`` (remembered by this connection: the bytes depend
        only on the columns' names and types and the formats, never on a value)."""
        key = (columns, formats)
        try:
            description = self._descriptions.get(key)
        except TypeError:  # columns in a list (a catalog result): built each time
            return _row_description(columns, formats)
        if description is None:
            description = _row_description(columns, formats)
            if len(self._descriptions) >= _DESCRIPTIONS:
                self._descriptions.clear()
            self._descriptions[key] = description
        return description

    def _send_notices(self, outcome: Outcome) -> None:
        for severity, code, text in outcome.notices:
            self.send(p.notice_response(code, text, severity=severity))

    # ---------------------------------------------------------------------------------------
    # simple query

    async def _simple_query(self, body: bytes) -> None:
        text = p.parse_query(body)
        statements = await self._small(len(text), LOOP_TEXT, split_statements, text)
        if not statements:
            self.send(p.empty_query_response())
        for i, st in enumerate(statements):
            self._charged = False
            try:
                kind = await self._small(len(st.text), LOOP_TEXT, self.commands.classify, st.text)
                outcome = await self.run_statement(st.text, kind, ())
                if outcome.columns is not None:
                    formats = (0,) * len(outcome.columns)
                    size = len(outcome.rows) * len(formats)
                    rows = await self._small(
                        size, LOOP_VALUES, _encode_rows, outcome.columns, outcome.rows, formats
                    )
                    self._send_notices(outcome)
                    self.send(self._row_description(outcome.columns, formats))
                    for row in rows:
                        self.send(row)
                else:
                    self._send_notices(outcome)
                self.send(p.command_complete(outcome.tag))
                if i + 1 < len(statements):  # the last one leaves with ReadyForQuery
                    await self.flush()
            except _Closed:
                raise
            except Exception as exc:
                err = self._statement_error(exc)
                if err.fatal:
                    raise
                self._send_error(err, st.offset, text)
                if self.tx == "T":
                    self.tx = "E"
                break
        self.send(p.ready_for_query(self.tx))
        await self.flush()

    # ---------------------------------------------------------------------------------------
    # extended query

    async def _flush(self, body: bytes) -> None:
        await self.flush()

    async def _function_call(self, body: bytes) -> None:
        raise SqlError("0A000", "the fastpath function call protocol is not supported")
