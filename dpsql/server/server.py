"""The asyncio server: accepts connections, owns the thread pool, the shadow and cancel keys."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import socket
import ssl
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from dpsql import gil_gate
from dpsql.server import protocol as p
from dpsql.server.catalog import Shadow
from dpsql.server.connections import (
    TOO_MANY_CLIENTS,
    ConnectionLimits,
    LoginThrottle,
    address_of,
    refuse_after_negotiation,
)
from dpsql.server.fairness import FairnessLimits, FairScheduler
from dpsql.server.pool import Pool
from dpsql.server.session import Session
from dpsql.server.settings import DEFAULTS
from dpsql.server.stream import ClientReader
from dpsql.server.users import UserStore
from dpsql.service.session import Session as ServiceSession

log = logging.getLogger("dpsql.server")

# How often (seconds) CPython makes a thread running Python hand the GIL to one waiting for it;
# 5 ms by default. A server process has 16 query threads and the event loop: a thread coming
# back from DuckDB or SQLite (which run without the GIL), or the loop woken by a socket, waits
# up to one interval for each hand-over, and the ledger's writer makes one per statement of
# its transaction while it holds the write lock every charge queues on (~20 ms a charge was
# seen under load). 0.5 ms keeps those waits short (docs/performance.md, "Small plans").
SWITCH_INTERVAL = 0.0005


def tune_interpreter() -> None:
    """Set the server process's GIL switch interval (a process-wide knob: ``dpsql serve`` and
    its workers call it; an embedding application keeps its own). The environment variable
    ``DPSQL_SWITCH_INTERVAL`` (seconds) overrides it, e.g. to compare with Python's 0.005."""
    value = os.environ.get("DPSQL_SWITCH_INTERVAL")
    try:
        interval = float(value) if value else SWITCH_INTERVAL
    except ValueError:
        interval = SWITCH_INTERVAL
    if not 1e-6 <= interval <= 1.0:
        interval = SWITCH_INTERVAL
    sys.setswitchinterval(interval)


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


class Server:
    """A PostgreSQL v3 front door to one service (:class:`dpsql.pipeline.Service`).

    ``users`` maps logins to SCRAM verifiers; each login is the analyst charged in the ledger.
    """

    def __init__(
        self,
        service: Any,
        users: UserStore | Any,
        *,
        policy: Any = None,
        ssl_context: ssl.SSLContext | None = None,
        require_tls: bool = False,
        max_message: int = p.DEFAULT_MAX_MESSAGE,
        max_connections: int = 100,
        workers: int | None = None,
        pid_range: tuple[int, int] | None = None,
        mock_secret: bytes | None = None,
        fairness: FairnessLimits | None = None,
        connections: ConnectionLimits | None = None,
    ) -> None:
        self.service = service
        self.users = users
        self.policy = policy if policy is not None else service.policy
        self.dataset = str(getattr(self.policy, "dataset", "dpsql"))
        self.private_names = {str(name).lower() for name in self.policy.tables}
        self.shadow = Shadow(self.policy, self.dataset, DEFAULTS)
        self.ssl_context = ssl_context
        self.require_tls = require_tls
        self.max_message = max_message
        self.max_connections = max_connections
        # per-login and per-address limits, auth timeout, login throttling
        # (dpsql.server.connections)
        self.connections = connections if connections is not None else ConnectionLimits()
        self.throttle = LoginThrottle(self.connections)
        self.addresses: Counter[str] = Counter()  # connections from each address
        self.logins: Counter[str] = Counter()  # authenticated sessions of each login
        self.refusing = 0  # connections being refused after their SSL negotiation
        threads = workers or min(32, (os.cpu_count() or 2) * 4 + 8)
        # the statement threads (dpsql.server.pool: one queue in, one post back to the loop)
        self.pool = Pool(threads, name="dpsql-query")
        # Statements wait for their turn here, fairly between analysts, before they take a
        # thread; two threads stay free for logins and clean-up (dpsql.server.fairness).
        self.fairness = fairness if fairness is not None else FairnessLimits()
        # ... and, once running, queue for the interpreter at one gate (dpsql.gil_gate)
        self.scheduler = FairScheduler(
            self.fairness, slots=max(1, threads - 2), gate=gil_gate.from_environment()
        )
        # One secret for every worker of a --workers server: an unknown user's fake SCRAM salt
        # must not depend on which process answers (that would reveal who exists).
        self.mock_secret = mock_secret if mock_secret is not None else os.urandom(32)
        self.sessions: dict[int, Session] = {}
        # pid_range [first, end): a worker's disjoint share of backend pids, so the supervisor
        # can route a CancelRequest to the process that owns the session.
        self.pid_range = pid_range
        start = 1000 + int.from_bytes(os.urandom(2), "big")
        self._pids = itertools.count(0 if pid_range else start)
        # Set by a worker: forwards a cancel key this process does not own to the supervisor.
        self.forward_cancel: Callable[[int, int], None] | None = None
        self._server: asyncio.base_events.Server | None = None

    # called by sessions -------------------------------------------------------------------
    def next_pid(self) -> int:
        if self.pid_range is None:
            return next(self._pids) & 0x7FFFFFFF
        first, end = self.pid_range
        while True:  # skip pids still in use after the counter wraps around
            pid = first + next(self._pids) % (end - first)
            if pid not in self.sessions:
                return pid

    def open_session(self, analyst: str) -> Any:
        """The analyst's session over the service (dpsql.service.session), which the wire
        session runs its DP statements on: the server is a door over the service, not over
        the DB-API. PostgreSQL clients mean PostgreSQL: 7 / 2 is 3, TO_CHAR, date_part
        (dpsql.frontend.dialect)."""
        return ServiceSession(self.service, analyst, dialect="postgres")

    def unregister(self, session: Session) -> None:
        if self.sessions.get(session.pid) is session:
            del self.sessions[session.pid]
            self.addresses[session.address] -= 1
            if self.addresses[session.address] <= 0:
                del self.addresses[session.address]
        if login := session.login_counted:
            session.login_counted = ""
            self.logins[login] -= 1
            if self.logins[login] <= 0:
                del self.logins[login]

    def admit_login(self, session: Session, user: str) -> tuple[str, str] | None:
        """Count an authenticated session of ``user``; (message, hint) when the login already
        holds ``max_connections_per_login`` sessions (in this process)."""
        most = self.connections.per_login(self.max_connections)
        if self.logins[user] >= most:
            log.info("login %r from %s refused: %d connections already", user, session.peer, most)
            return (
                f'too many connections for role "{user}"',
                f"a login may hold {most} connections; close some, or raise "
                "[server] max_connections_per_login",
            )
        self.logins[user] += 1
        session.login_counted = user
        return None

    def cancel(self, pid: int, secret: int) -> None:
        session = self.sessions.get(pid)
        if session is None:
            # e.g. a TLS-encrypted CancelRequest (libpq >= 17) that reached another worker
            owned = self.pid_range is not None and self.pid_range[0] <= pid < self.pid_range[1]
            if self.forward_cancel is not None and not owned:
                self.forward_cancel(pid, secret)
            return
        if hmac.compare_digest(
            secret.to_bytes(4, "big", signed=True), session.secret.to_bytes(4, "big", signed=True)
        ):
            session.cancel()

    # lifecycle -----------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 5433) -> int:
        loop = asyncio.get_running_loop()

        def factory() -> asyncio.StreamReaderProtocol:  # as asyncio.start_server's
            return asyncio.StreamReaderProtocol(ClientReader(loop=loop), self._accept, loop=loop)

        self._server = await loop.create_server(factory, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = address_of(writer.get_extra_info("peername"))
        refusal: tuple[str, str | None] | None = None
        if len(self.sessions) >= self.max_connections:
            refusal = (TOO_MANY_CLIENTS, None)
        elif self.addresses[address] >= (
            most := self.connections.per_address(self.max_connections)
        ):
            refusal = (
                f"too many connections from address {address}",
                f"an address may hold {most} connections; close some, or raise "
                "[server] max_connections_per_address",
            )
        if refusal is not None:
            await self._refuse(reader, writer, *refusal)
            return
        session = Session(self, reader, writer)
        self.sessions[session.pid] = session
        self.addresses[session.address] += 1
        with contextlib.suppress(asyncio.CancelledError):  # the server is shutting down
            await session.run()

    async def _refuse(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        message: str,
        hint: str | None,
    ) -> None:
        """53300 after the SSL negotiation (so libpq's sslmode=prefer shows it), within the
        auth timeout; at most max_connections refusals at once, beyond that at once."""
        if self.refusing >= self.max_connections:
            writer.write(p.error_response("53300", message, severity="FATAL", hint=hint))
            with contextlib.suppress(Exception):
                await writer.drain()
                writer.close()
            return
        self.refusing += 1
        try:
            await refuse_after_negotiation(
                reader,
                writer,
                self.ssl_context,
                "53300",
                message,
                hint=hint,
                timeout=self.connections.auth_timeout,
                on_cancel=self.cancel,
            )
        finally:
            self.refusing -= 1

    async def adopt(self, sock: socket.socket) -> None:
        """Serve one connection accepted by another process (the ``--workers`` supervisor).

        Same protocol factory as ``asyncio.start_server``, so ``start_tls`` runs server-side.
        Returns when the session ends.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await self._accept(reader, writer)
            finally:
                if not done.done():
                    done.set_result(None)

        def factory() -> asyncio.StreamReaderProtocol:
            return asyncio.StreamReaderProtocol(ClientReader(loop=loop), run, loop=loop)

        await loop.connect_accepted_socket(factory, sock)
        await done

    async def serve_forever(self) -> None:
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for session in list(self.sessions.values()):
            session.cancel()
            with contextlib.suppress(Exception):
                session.writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        self.pool.shutdown()
        self.shadow.close()


class ServerThread:
    """Runs a :class:`Server` on its own event loop in a background thread (tests, bench)."""

    def __init__(self, factory: Callable[[], Server], host: str = "127.0.0.1", port: int = 0):
        self._factory = factory
        self.host = host
        self.port = port
        self.server: Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> int:
        self._thread = threading.Thread(target=self._run, name="dpsql-server", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self.port

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self.server = self._factory()
            self.port = loop.run_until_complete(self.server.start(self.host, self.port))
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self.server.close())
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
