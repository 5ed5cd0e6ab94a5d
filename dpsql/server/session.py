"""One client connection: startup, TLS, SCRAM, then the simple and extended query protocols.

Statements are routed by what they reference: anything naming a private table (or a dpsql
privacy setting) goes to the analyst's session over the service (``dpsql.service.session``,
through :class:`~dpsql.server.backend.DpBackend`); everything else — catalog and session
queries — goes to the empty shadow database. Blocking work runs in the server's thread pool so
the event loop keeps serving other clients; a reader task keeps reading while a query runs, so a
client that disconnects mid-query interrupts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpsql import errors as dperr
from dpsql.boundary import CHARGED_HINT, CHARGED_STATES, FAILED_AFTER_READ
from dpsql.limits import (
    DEFAULT_LIMITS,
    Limits,
    check_parameter_count,
    check_size,
    check_text,
)
from dpsql.server import protocol as p
from dpsql.server import types as t
from dpsql.server.backend import DpBackend, Outcome, placeholder_count
from dpsql.server.catalog import ShadowCursor
from dpsql.server.catalog_sql import SessionInfo
from dpsql.server.connections import address_of
from dpsql.server.failures import ClientError
from dpsql.server.fairness import Abandoned
from dpsql.server.probes import (
    COLUMN_PROBE_NOTICE,
    may_be_probe,
    probe_decision,
    relation_probe,
)
from dpsql.server.scram import MECHANISM, ScramError, ScramExchange
from dpsql.server.settings import (
    REPORTED,
    SessionSettings,
    SettingError,
    canonical,
    parse_set,
    set_name_of,
)
from dpsql.sql.sqltext import identifiers, keywords, split_statements

if TYPE_CHECKING:
    from dpsql.server.server import Server

log = logging.getLogger("dpsql.server")

MAX_STATEMENTS = 1000
MAX_PREPARED_BYTES = 16 << 20
QUEUE_DEPTH = 8
# Work done on the event loop itself only when it is this small (see Session._small): statement
# text up to LOOP_TEXT characters (~8 ms to scan at most), results up to LOOP_VALUES values.
LOOP_TEXT = 4096
LOOP_VALUES = 1024
# Queued reply bytes handed to the transport at once past this size, before the next flush.
_OUT_CHUNK = 64 << 10

_TX_WORDS = {"begin", "start", "commit", "end", "rollback", "abort", "savepoint", "release"}
_NOOP_WORDS = {"discard", "deallocate", "listen", "unlisten", "close", "checkpoint"}


class SqlError(Exception):
    """An error reported to the client; ``position`` is a 0-based offset in the statement."""

    def __init__(
        self,
        sqlstate: str,
        message: str,
        *,
        hint: str | None = None,
        position: int | None = None,
        fatal: bool = False,
    ) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.message = message
        self.hint = hint
        self.position = position
        self.fatal = fatal


class _Closed(Exception):
    """The client went away."""


def as_sql_error(exc: BaseException) -> SqlError:
    if isinstance(exc, SqlError):
        return exc
    if isinstance(exc, dperr.Error):
        pos = exc.position.offset if exc.position is not None else None
        return SqlError(exc.sqlstate, exc.message, hint=exc.hint, position=pos)
    if isinstance(exc, ClientError):
        return SqlError(exc.sqlstate, exc.message, hint=exc.hint)
    if isinstance(exc, t.ParameterError):
        return SqlError("22P02", str(exc))
    if isinstance(exc, t.UnsupportedBinary):
        return SqlError("0A000", str(exc), hint="request text format for this column")
    if isinstance(exc, p.ProtocolViolation):
        return SqlError(exc.sqlstate, exc.message, fatal=True)
    log.exception("internal error", exc_info=exc)
    return SqlError("XX000", "internal error in dpsql server", hint="see the server log")


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


def _formats_for(formats: Sequence[int], count: int) -> tuple[int, ...]:
    if not formats:
        return (0,) * count
    if len(formats) == 1:
        return (formats[0],) * count
    if len(formats) != count:
        raise SqlError(
            "08P01", f"bind message has {len(formats)} result formats but query has {count} columns"
        )
    return tuple(formats)


def _encode_rows(
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


def _row_description(columns: Sequence[tuple[str, int]], formats: Sequence[int]) -> bytes:
    return p.row_description(
        [
            p.Field(name, oid, t.type_size(oid), -1, 0, 0, fmt)
            for (name, oid), fmt in zip(columns, formats, strict=True)
        ]
    )


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
        self.statements: dict[str, Prepared] = {}
        self.prepared_bytes = 0
        self.portals: dict[str, Portal] = {}
        self.skip_to_sync = False
        self.queue: asyncio.Queue[Any] = asyncio.Queue(QUEUE_DEPTH)
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
                    raise SqlError(
                        "57014",
                        "canceling statement due to statement timeout"
                        if self._timed_out
                        else "canceling statement due to user request",
                        hint="it was still waiting for its turn to run (the analyst's other "
                        "statements, or the server's, were running); nothing ran or was spent",
                    )
                call = self.server.scheduler.wrap(turn, fn, *args)
            self._interrupt = interrupt
            ran = True
            return await loop.run_in_executor(self.server.executor, call)
        except Exception as exc:
            if ran and self._timed_out:
                raise SqlError(
                    "57014",
                    "canceling statement due to statement timeout",
                    hint="raise statement_timeout (SET statement_timeout = '60s') or simplify",
                ) from exc
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

    def _classify_and_count(self, sql: str) -> tuple[str, int]:
        return self.classify(sql), placeholder_count(sql)

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
                startup = await self._startup()
                if startup is None:
                    return
                if not await self._authenticate(startup):
                    return
            if not await self._open_backends(startup):
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
        loop = asyncio.get_running_loop()
        try:
            for backend in (self.dp, self.shadow):
                if backend is not None:
                    with contextlib.suppress(Exception):
                        await loop.run_in_executor(self.server.executor, backend.close)
        finally:  # also when the server shuts down and cancels this task
            with contextlib.suppress(Exception):
                self._write_out()
                self.writer.close()

    async def _startup(self) -> p.Startup | None:
        tls_done = False
        while True:
            header = await self._read_exact(4)
            length = struct.unpack("!i", header)[0]
            if length < 8 or length > p.STARTUP_MAX:
                await self.fatal("08P01", "invalid length of startup packet")
                return None
            msg = p.parse_startup_packet(await self._read_exact(length - 4))
            if msg == p.SSL_REQUEST:
                if tls_done or self.server.ssl_context is None:
                    self.send(b"N")
                    await self.flush()
                    continue
                if self.reader._buffer:  # type: ignore[attr-defined]
                    # Plaintext bytes sent after SSLRequest would be trusted as if encrypted
                    # (CVE-2021-23214): refuse.
                    await self.fatal("08P01", "received unencrypted data after SSL request")
                    return None
                self.send(b"S")
                await self.flush()
                self._auth_stage = "tls"
                await self.writer.start_tls(self.server.ssl_context)
                self._auth_stage = "startup"
                tls_done = True
                continue
            if msg == p.GSSENC_REQUEST:
                self.send(b"N")
                await self.flush()
                continue
            if isinstance(msg, p.CancelKey):
                self.server.cancel(msg.pid, msg.secret)
                return None
            assert isinstance(msg, p.Startup)
            if self.server.require_tls and not tls_done:
                await self.fatal(
                    "28000", "this server requires TLS", hint="connect with sslmode=require"
                )
                return None
            return msg

    async def _authenticate(self, startup: p.Startup) -> bool:
        user = startup.params.get("user", "")
        if not user:
            await self.fatal("28000", "no PostgreSQL user name specified in startup packet")
            return False
        self._auth_stage = "login"
        failed = f'password authentication failed for user "{user}"'
        try:
            verifier = self.server.users.get(user)
        except Exception:
            log.exception("cannot read the users file")
            verifier = None
        exchange = ScramExchange(verifier, mock_secret=self.server.mock_secret, user=user)
        self.send(p.authentication_sasl([MECHANISM]))
        await self.flush()
        try:
            kind, body = await self.read_message()
            if kind != b"p":
                await self.fatal("28000", "authentication required: expected a SASL response")
                return False
            mechanism, data = p.parse_sasl_initial(body)
            if mechanism != MECHANISM:
                await self.fatal(
                    "28000",
                    f"SASL mechanism {mechanism!r} is not supported",
                    hint="use SCRAM-SHA-256",
                )
                return False
            self.send(p.authentication_sasl_continue(exchange.first(data)))
            await self.flush()
            kind, body = await self.read_message()
            if kind != b"p":
                await self.fatal("28000", "authentication required: expected a SASL response")
                return False
            final = exchange.final(body)
        except ScramError as exc:
            # the log (not the client) says whether the user exists
            log.info(
                "login failed for %r from %s: %s",
                user,
                self.peer,
                "unknown user" if exchange.mock else exc.message,
            )
            # answered after a delay growing with the address's and the login's failures
            # (dpsql.server.connections.LoginThrottle): no thread held, the slot kept
            delay = self.server.throttle.failed(self.address, user)
            if self._auth_deadline is not None:
                self._auth_deadline.reschedule(None)
            await asyncio.sleep(delay)
            if exc.sqlstate == "28P01":
                await self.fatal("28P01", failed)
            else:
                await self.fatal(exc.sqlstate, exc.message)
            return False
        self.server.throttle.succeeded(user)
        refusal = self.server.admit_login(self, user)
        if refusal is not None:
            await self.fatal("53300", *refusal)
            return False
        self.send(p.authentication_sasl_final(final))
        self.send(p.authentication_ok())
        self.user = user
        self.database = startup.params.get("database") or user
        log.info("analyst %r connected from %s (pid %d)", user, self.peer, self.pid)
        return True

    async def _open_backends(self, startup: p.Startup) -> bool:
        try:
            opened = await self._blocking(self.server.open_session, self.user, scheduled=False)
        except Exception as exc:
            err = as_sql_error(exc)
            await self.fatal(err.sqlstate, err.message, err.hint)
            return False
        self.dp = DpBackend(opened)
        self.shadow = await self._blocking(self.server.shadow.cursor, scheduled=False)
        self.settings = SessionSettings(self.user, startup.params.get("application_name", ""))
        for key, value in _startup_options(startup.params).items():
            with contextlib.suppress(SettingError):
                self.settings.set(key, value)
        for name in REPORTED:
            self.send(p.parameter_status(name, self.settings.values[name]))
        self.send(p.backend_key_data(self.pid, self.secret))
        self.send(p.ready_for_query(self.tx))
        await self.flush()
        return True

    async def _reader_task(self) -> None:
        try:
            while True:
                kind, body = await self.read_message()
                await self.queue.put((kind, body))
                if kind == b"X":
                    return
        except _Closed:
            if self._interrupt is not None:
                with contextlib.suppress(Exception):
                    self._interrupt()
            await self.queue.put(None)
        except p.ProtocolViolation as exc:
            await self.queue.put(exc)
        except Exception:  # the main loop must hear of it, or the session waits forever
            log.exception("session %s: reading a message failed", self.pid)
            await self.queue.put(SqlError("XX000", "internal error in dpsql server", fatal=True))

    async def _main_loop(self) -> None:
        reader = asyncio.create_task(self._reader_task())
        try:
            while True:
                item = await self.queue.get()
                if item is None:
                    return
                if isinstance(item, p.ProtocolViolation | SqlError):
                    await self.fatal(item.sqlstate, item.message)
                    return
                kind, body = item
                if kind == b"X":
                    return
                if not await self._dispatch(kind, body):
                    return
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def _dispatch(self, kind: bytes, body: bytes) -> bool:
        """Handle one message; False closes the connection."""
        if kind in (b"d", b"c", b"f"):
            return True  # CopyData/CopyDone/CopyFail outside COPY are ignored, as in PostgreSQL
        if kind == b"S":
            self.skip_to_sync = False
            if self.tx == "I":
                self.portals.clear()
            self.send(p.ready_for_query(self.tx))
            await self.flush()
            return True
        if self.skip_to_sync and kind in (b"P", b"B", b"D", b"E", b"C", b"H"):
            return True
        handler = {
            b"Q": self._simple_query,
            b"P": self._parse,
            b"B": self._bind,
            b"D": self._describe,
            b"E": self._execute_portal,
            b"C": self._close,
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

    def classify(self, sql: str) -> str:
        # every statement, catalog ones too, before any parse: its size here, and the full scan
        # (tokenizing: up to ~1 s near the message cap) in its own thread, see run_statement
        check_size(sql, self.limits)
        words = keywords(sql, 3)
        if not words:
            return "empty"
        head = words[0]
        if head in _TX_WORDS:
            return "tx"
        if head in ("set", "show", "reset"):
            name = set_name_of(sql)
            assert self.dp is not None
            if name is not None and (name in self.dp.setting_names or name.startswith("dpsql.")):
                return "dp"
            if head == "show" and name not in ("all", None) and not self._pg_setting(name):
                return "dp"  # e.g. SHOW budget: the pipeline answers or says it is unknown
            return head
        if head in _NOOP_WORDS:
            return "noop"
        if head == "explain" and not identifiers(sql) & self.server.private_names:
            return "explain"
        if identifiers(sql) & self.server.private_names:
            # Whether it is a zero-row probe takes a parse: run_statement decides that as the
            # analyst's scheduled work, not here on the event loop (may_be_probe is a regex).
            return "maybe_probe" if head in ("select", "with") and may_be_probe(sql) else "dp"
        return "catalog"

    def _pg_setting(self, name: str) -> bool:
        assert self.settings is not None
        try:
            self.settings.get(name)
        except SettingError:
            return False
        return True

    def _check_failed_block(self, sql: str, kind: str) -> None:
        if self.tx != "E":
            return
        words = keywords(sql, 1)
        if kind == "tx" and words and words[0] in ("commit", "end", "rollback", "abort"):
            return
        raise SqlError(
            "25P02",
            "current transaction is aborted, commands ignored until end of transaction block",
            hint="send ROLLBACK (or COMMIT) to end the failed transaction block",
        )

    async def run_statement(self, sql: str, kind: str, params: Sequence[Any]) -> Outcome:
        self._check_failed_block(sql, kind)
        await self._check_limits(sql)
        if kind == "empty":
            return Outcome(None, [], "")
        if kind == "tx":
            return self._transaction(sql)
        if kind == "set":
            return self._set(sql)
        if kind == "reset":
            return self._reset(sql)
        if kind == "show":
            return self._show(sql)
        if kind == "noop":
            return self._noop(sql)
        if kind == "explain":
            raise SqlError(
                "0A000",
                "EXPLAIN is available for differentially private queries only",
                hint="EXPLAIN SELECT COUNT(*) FROM <private table> shows the noise and the cost",
            )
        if kind == "maybe_probe":
            probe, column = await self._blocking(probe_decision, sql)
            if probe:
                columns = await self._probe_columns(sql, params)
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

    async def describe_statement(
        self, stmt: Prepared, params: Sequence[Any] | None
    ) -> tuple[tuple[str, int], ...] | None:
        """Result columns without running a DP query (it runs nothing, spends nothing)."""
        await self._check_limits(stmt.sql)
        kind = stmt.kind
        if kind == "show":
            name = set_name_of(stmt.sql) or ""
            if name == "all":
                return (("name", t.TEXT), ("setting", t.TEXT), ("description", t.TEXT))
            return ((name, t.TEXT),)
        if kind in ("tx", "set", "reset", "noop", "empty", "explain"):
            return None
        if kind == "maybe_probe":
            probe, _column = await self._blocking(probe_decision, stmt.sql)
            if probe:
                return await self._probe_columns(stmt.sql, params)
            kind = "dp"
        if kind == "dp":
            assert self.dp is not None
            words = keywords(stmt.sql, 1)
            if words and words[0] in ("set", "reset"):
                return None
            cols = await self._blocking(self.dp.describe, stmt.sql, params)
            return cols or None
        assert self.shadow is not None
        values = list(params) if params is not None else [None] * len(stmt.param_oids)
        result = await self._blocking(self.shadow.run, stmt.sql, values or None, self.info())
        return result.columns

    async def _probe_columns(
        self, sql: str, params: Sequence[Any] | None
    ) -> tuple[tuple[str, int], ...]:
        """Columns of a zero-row probe: the planned DP columns, else the shadow's (public)."""
        assert self.dp is not None and self.shadow is not None
        try:
            columns = await self._blocking(self.dp.describe, sql, params)
        except dperr.Error:
            # a probe of a row-level relation is answered from its plan or refused with the
            # relation's own reason (dpsql.sql.bind.parse_probe), never from the catalog
            if await self._blocking(relation_probe, sql):
                raise
            columns = ()
        if columns:
            return columns
        values = list(params) if params else None
        result = await self._blocking(
            self.shadow.run, sql, values, self.info(), interrupt=self.shadow.interrupt
        )
        return result.columns

    def _transaction(self, sql: str) -> Outcome:
        words = keywords(sql, 3)
        head = words[0]
        notices: list[tuple[str, str, str]] = []
        if head in ("begin", "start"):
            if self.tx != "I":
                notices.append(("WARNING", "25001", "there is already a transaction in progress"))
            self.tx = "T"
            return Outcome(
                None, [], "BEGIN" if head == "begin" else "START TRANSACTION", tuple(notices)
            )
        if head in ("commit", "end"):
            tag = "ROLLBACK" if self.tx == "E" else "COMMIT"
            if self.tx == "I":
                notices.append(("WARNING", "25P01", "there is no transaction in progress"))
            self.tx = "I"
            return Outcome(None, [], tag, tuple(notices))
        if head in ("rollback", "abort"):
            if "to" in words[1:3]:
                if self.tx == "I":
                    raise SqlError(
                        "25P01", "ROLLBACK TO SAVEPOINT can only be used in transaction blocks"
                    )
                self.tx = "T"
                return Outcome(None, [], "ROLLBACK")
            if self.tx == "I":
                notices.append(("WARNING", "25P01", "there is no transaction in progress"))
            self.tx = "I"
            return Outcome(None, [], "ROLLBACK", tuple(notices))
        if self.tx == "I":
            raise SqlError("25P01", f"{head.upper()} can only be used in transaction blocks")
        return Outcome(None, [], head.upper())

    def _set(self, sql: str) -> Outcome:
        assert self.settings is not None
        cmd = parse_set(sql)
        if cmd.name is not None:
            for name in self.settings.set(cmd.name, cmd.value):
                self.send(p.parameter_status(name, self.settings.values[name]))
        return Outcome(None, [], "SET")

    def _reset(self, sql: str) -> Outcome:
        assert self.settings is not None and self.dp is not None
        name = set_name_of(sql)
        if name == "all":
            for changed in self.settings.reset_all():
                self.send(p.parameter_status(changed, self.settings.values[changed]))
            for dp_name in sorted(self.dp.setting_names):
                self.dp.execute(f"RESET {dp_name}", None)
        elif name:
            for changed in self.settings.set(name, None):
                self.send(p.parameter_status(changed, self.settings.values[changed]))
        return Outcome(None, [], "RESET")

    def _show(self, sql: str) -> Outcome:
        assert self.settings is not None
        name = set_name_of(sql) or ""
        if name == "all":
            rows = [(k, v, "") for k, v in sorted(self.settings.values.items())]
            cols = (("name", t.TEXT), ("setting", t.TEXT), ("description", t.TEXT))
            return Outcome(cols, rows, "SHOW")
        value = self.settings.get(name)
        return Outcome(((canonical(name), t.TEXT),), [(value,)], "SHOW")

    def _noop(self, sql: str) -> Outcome:
        words = keywords(sql, 3)
        head = words[0]
        if head == "discard":
            what = words[1] if len(words) > 1 else "all"
            if what == "all":  # what connection pools send: back to a fresh session
                self._reset("RESET ALL")
            if what in ("all", "plans"):
                self.statements.clear()
                self.portals.clear()
                self.prepared_bytes = 0
            return Outcome(None, [], "DISCARD " + what.upper())
        if head == "deallocate":
            rest = [w for w in words[1:] if w != "prepare"]
            if rest and rest[0] == "all":
                self.statements = {k: v for k, v in self.statements.items() if k == ""}
                return Outcome(None, [], "DEALLOCATE ALL")
            if rest:
                self.statements.pop(rest[0], None)
            return Outcome(None, [], "DEALLOCATE")
        if head == "close":
            return Outcome(None, [], "CLOSE CURSOR")
        return Outcome(None, [], head.upper())

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
                kind = await self._small(len(st.text), LOOP_TEXT, self.classify, st.text)
                outcome = await self.run_statement(st.text, kind, ())
                if outcome.columns is not None:
                    formats = (0,) * len(outcome.columns)
                    size = len(outcome.rows) * len(formats)
                    rows = await self._small(
                        size, LOOP_VALUES, _encode_rows, outcome.columns, outcome.rows, formats
                    )
                    self._send_notices(outcome)
                    self.send(_row_description(outcome.columns, formats))
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

    async def _parse(self, body: bytes) -> None:
        msg = p.parse_parse(body)
        parts = await self._small(len(msg.query), LOOP_TEXT, split_statements, msg.query)
        if len(parts) > 1:
            raise SqlError("42601", "cannot insert multiple commands into a prepared statement")
        if msg.name and msg.name in self.statements:
            raise SqlError("42P05", f'prepared statement "{msg.name}" already exists')
        most = self.limits.max_prepared_statements
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
        kind, holders = await self._small(len(sql), LOOP_TEXT, self._classify_and_count, sql)
        count = max(holders, len(msg.param_oids))
        check_parameter_count(count, self.limits)
        oids = tuple(msg.param_oids) + (0,) * (count - len(msg.param_oids))
        self.statements[msg.name] = Prepared(msg.name, sql, oids, kind)
        self.prepared_bytes = used
        self.send(p.parse_complete())

    async def _bind(self, body: bytes) -> None:
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
        fmts = _formats_for(msg.param_formats, len(msg.params))
        values = tuple(
            t.decode_param(data, oid, fmt)
            for data, oid, fmt in zip(msg.params, stmt.param_oids, fmts, strict=True)
        )
        self.portals[msg.portal] = Portal(stmt, values, msg.result_formats)
        self.send(p.bind_complete())

    async def _describe(self, body: bytes) -> None:
        msg = p.parse_describe(body)
        if msg.kind == "S":
            stmt = self.statements.get(msg.name)
            if stmt is None:
                raise SqlError("26000", f'prepared statement "{msg.name}" does not exist')
            self._check_failed_block(stmt.sql, stmt.kind)
            if not stmt.described:
                stmt.columns = await self.describe_statement(stmt, None)
                stmt.described = True
            self.send(p.parameter_description([o or t.TEXT for o in stmt.param_oids]))
            if stmt.columns:
                self.send(_row_description(stmt.columns, (0,) * len(stmt.columns)))
            else:
                self.send(p.no_data())
            return
        portal = self.portals.get(msg.name)
        if portal is None:
            raise SqlError("34000", f'portal "{msg.name}" does not exist')
        self._check_failed_block(portal.statement.sql, portal.statement.kind)
        if portal.columns is None and portal.outcome is None:
            portal.columns = await self.describe_statement(portal.statement, portal.params)
        columns = portal.outcome.columns if portal.outcome is not None else portal.columns
        if columns:
            self.send(_row_description(columns, _formats_for(portal.formats, len(columns))))
        else:
            self.send(p.no_data())

    async def _execute_portal(self, body: bytes) -> None:
        msg = p.parse_execute(body)
        portal = self.portals.get(msg.portal)
        if portal is None:
            raise SqlError("34000", f'portal "{msg.portal}" does not exist')
        if portal.outcome is None:
            stmt = portal.statement
            if stmt.kind == "empty":
                self._check_failed_block(stmt.sql, stmt.kind)
                self.send(p.empty_query_response())
                portal.outcome = Outcome(None, [], "")
                return
            outcome = await self.run_statement(stmt.sql, stmt.kind, portal.params)
            columns = outcome.columns or ()
            formats = _formats_for(portal.formats, len(columns))
            size = len(outcome.rows) * len(columns)
            portal.encoded = (
                await self._small(size, LOOP_VALUES, _encode_rows, columns, outcome.rows, formats)
                if columns
                else []
            )
            portal.outcome = outcome
            self._send_notices(outcome)
        elif portal.outcome.tag == "":
            self.send(p.empty_query_response())
            return
        outcome = portal.outcome
        limit = msg.max_rows if msg.max_rows > 0 else len(portal.encoded)
        chunk = portal.encoded[portal.pos : portal.pos + limit]
        for row in chunk:
            self.send(row)
        portal.pos += len(chunk)
        if outcome.columns is not None and portal.pos < len(portal.encoded):
            self.send(p.portal_suspended())
            return
        if outcome.columns is not None and msg.max_rows > 0:
            self.send(p.command_complete(f"SELECT {len(chunk)}"))
        else:
            self.send(p.command_complete(outcome.tag))
        portal.encoded = []

    async def _close(self, body: bytes) -> None:
        msg = p.parse_close(body)
        if msg.kind == "S":
            old = self.statements.pop(msg.name, None)
            if old is not None:
                self.prepared_bytes -= len(old.sql)
        else:
            self.portals.pop(msg.name, None)
        self.send(p.close_complete())

    async def _flush(self, body: bytes) -> None:
        await self.flush()

    async def _function_call(self, body: bytes) -> None:
        raise SqlError("0A000", "the fastpath function call protocol is not supported")


def _startup_options(params: dict[str, str] | Any) -> dict[str, str]:
    """``options=-c key=value ...`` plus plain startup parameters such as DateStyle."""
    out: dict[str, str] = {}
    for key, value in params.items():
        if key in ("user", "database", "options", "replication", "application_name"):
            continue
        out[key] = value
    options = params.get("options", "")
    tokens = options.replace("--", "-c ").split()
    for i, tok in enumerate(tokens):
        if tok == "-c" and i + 1 < len(tokens) and "=" in tokens[i + 1]:
            key, _, value = tokens[i + 1].partition("=")
            out[key] = value
        elif tok.startswith("-c") and "=" in tok[2:]:
            key, _, value = tok[2:].partition("=")
            out[key] = value
    return out
