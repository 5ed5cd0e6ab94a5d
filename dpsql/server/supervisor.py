"""``dpsql serve --workers N``: one listening port, N worker processes, one ledger.

Why processes: the Python part of every query (protocol, bind, plan, noise, ledger) holds the
GIL, so one process uses one core however many threads it has. The supervisor owns the port and
nothing else (no DuckDB, no threads): it accepts each connection, peeks at its first 8 bytes and

- for a ``CancelRequest`` (length 16, code 80877102) reads the key itself and forwards it to the
  worker that owns the backend pid (each worker hands out pids from its own range);
- for anything else (startup, SSLRequest, garbage) passes the socket, unread, to the worker with
  the fewest connections over a Unix socket pair (``SCM_RIGHTS``); TLS, SCRAM and the session
  happen in the worker exactly as in a single-process server.

Workers are started with fork+exec (``python -m dpsql.server.worker``), never a bare fork of a
process that has threads or a DuckDB database. A worker that dies is logged and restarted (with
backoff if it keeps dying); its connections are lost, as with a PostgreSQL backend crash, and its
charges are exactly those it committed (each charge is one SQLite transaction). SIGTERM/SIGINT
stop the workers and wait for them; a worker whose supervisor vanishes stops on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from dpsql.server import protocol as p
from dpsql.server.connections import (
    TOO_MANY_CLIENTS,
    ConnectionLimits,
    address_of,
    refuse_socket,
    tls_server_context,
)
from dpsql.server.worker import (
    CANCEL,
    CONFIG,
    CONN,
    DONE,
    FAILED,
    MAX_WORKERS,
    QUIT,
    READY,
    WorkerConfig,
    cancel_message,
    owner,
    parse_cancel,
)

log = logging.getLogger("dpsql.server")

STARTUP_TIMEOUT = 120.0  # building a Service loads the data
STOP_TIMEOUT = 15.0  # a worker gets this long to finish after QUIT before it is killed
_HEAD = struct.Struct("!ii")


def _exit_status(code: int) -> str:
    """``0``, ``1`` ... or the signal's name (``SIGKILL``) for a process killed by one."""
    if code >= 0:
        return str(code)
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class SupervisorError(Exception):
    """The server could not start (a worker failed to build its Service, ...)."""


class _Worker:
    """The supervisor's view of one worker slot (the process in it changes on restarts)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.ctrl: socket.socket | None = None
        self.active = 0
        self.ready = False
        self.error: str | None = None
        self.started_at = 0.0
        self.failures = 0
        self.handed = 0  # when it was last handed a connection (for ties in _pick)
        self.changed = asyncio.Event()  # set on ready or exit, for start()
        self.watcher: asyncio.Task[None] | None = None
        self.addresses: Counter[str] = Counter()  # its connections from each address

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0


async def _wait_readable(sock: socket.socket, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await asyncio.wait_for(ready, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(sock.fileno())


async def peek(sock: socket.socket, n: int, timeout: float) -> bytes | None:
    """The first ``n`` bytes without consuming them; fewer at EOF, None on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            data = sock.recv(n, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            data = None
        except OSError:
            return b""
        remaining = deadline - loop.time()
        if data is not None and (len(data) >= n or not data):
            return data
        if remaining <= 0:
            return None
        if data is not None:  # part of the header: readable stays true, so poll briefly
            await asyncio.sleep(min(0.01, remaining))
        elif not await _wait_readable(sock, remaining):
            return None


async def _recv_exact(sock: socket.socket, n: int, timeout: float) -> bytes:
    loop = asyncio.get_running_loop()
    out = b""
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(timeout):
            while len(out) < n:
                chunk = await loop.sock_recv(sock, n - len(out))
                if not chunk:
                    break
                out += chunk
    return out


def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address of ``host`` (as asyncio.start_server binds)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _name, addr in infos:
            if (family, addr[0]) in seen:
                continue
            seen.add((family, addr[0]))
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:  # one port for all addresses
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(1024)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


class Supervisor:
    """Owns the port and the worker processes; routes connections and cancel keys."""

    def __init__(
        self,
        config: WorkerConfig,
        workers: int,
        *,
        max_connections: int = 100,
        peek_timeout: float | None = None,
    ) -> None:
        if not 1 <= workers <= MAX_WORKERS:
            raise SupervisorError(f"--workers must be between 1 and {MAX_WORKERS}")
        self.config = config
        self.workers = [_Worker(i) for i in range(workers)]
        self.max_connections = max_connections
        # The per-address limit and the auth timeout hold for the whole server here; a
        # connection over a limit is refused after its SSL negotiation (dpsql.server.connections)
        self.connections = ConnectionLimits(**(config.connections or {}))
        self.per_address = self.connections.per_address(max_connections)
        self.peek_timeout = self.connections.auth_timeout if peek_timeout is None else peek_timeout
        self.ssl_context = (
            tls_server_context(config.tls_cert, config.tls_key or "") if config.tls_cert else None
        )
        self._pending_from: Counter[str] = Counter()
        self._refusing = 0
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending = 0
        self._handoffs = 0
        self._started = False
        self._stopping = False

    @property
    def active(self) -> int:
        """Connections handed to workers and not yet reported ended (server-wide)."""
        return sum(w.active for w in self.workers)

    # lifecycle -------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 5433) -> int:
        """Bind, start every worker and wait until all are ready; returns the port."""
        self._listeners = _listen(host, port)
        for w in self.workers:
            self._spawn(w)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for w in self.workers:
            while not w.ready:
                if w.error is not None or w.watcher is None or w.watcher.done():
                    raise SupervisorError(
                        f"worker {w.index} failed to start: {w.error or 'it exited'}"
                    )
                w.changed.clear()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SupervisorError(f"worker {w.index} did not start in time")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(w.changed.wait(), min(remaining, 1.0))
        self._started = True
        for sock in self._listeners:
            self._track(self._accept_loop(sock))
        return int(self._listeners[0].getsockname()[1])

    async def close(self) -> None:
        """Stop accepting, ask every worker to stop, wait (then kill), leave no process."""
        self._stopping = True
        for sock in self._listeners:
            sock.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.workers:
            if w.ctrl is not None:
                with contextlib.suppress(OSError):
                    w.ctrl.send(QUIT)
        deadline = time.monotonic() + STOP_TIMEOUT
        for w in self.workers:
            if w.proc is None:
                continue
            while w.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if w.proc.poll() is None:
                log.warning("worker %d (pid %d) did not stop; killing it", w.index, w.pid)
                w.proc.kill()
                w.proc.wait()
        for w in self.workers:
            if w.watcher is not None:
                w.watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await w.watcher
            if w.ctrl is not None:
                w.ctrl.close()
                w.ctrl = None

    def _track(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # workers ---------------------------------------------------------------------------------
    def _spawn(self, w: _Worker) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root = str(Path(__file__).resolve().parents[2])
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
        try:
            w.proc = subprocess.Popen(
                [sys.executable, "-m", "dpsql.server.worker", str(w.index), str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        finally:
            child.close()  # only the worker may hold this end: its exit must read as EOF here
        parent.send(CONFIG + self.config.to_json())
        parent.setblocking(False)
        w.ctrl, w.ready, w.error, w.active = parent, False, None, 0
        w.started_at = time.monotonic()
        w.watcher = asyncio.get_running_loop().create_task(self._watch(w, parent))
        log.info("worker %d started (pid %d)", w.index, w.pid)

    async def _watch(self, w: _Worker, ctrl: socket.socket) -> None:
        """Read one worker's channel; on its end, reap the process and restart it."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                msg = await loop.sock_recv(ctrl, 1 << 16)
            except OSError:
                msg = b""
            if not msg:
                break
            kind = msg[:1]
            if kind == DONE:
                w.active = max(0, w.active - 1)
                address = msg[1:].decode(errors="replace")
                if w.addresses[address] > 0:
                    w.addresses[address] -= 1
                    if not w.addresses[address]:
                        del w.addresses[address]
            elif kind == READY:
                w.ready = True
                w.changed.set()
                log.info("worker %d ready (pid %d)", w.index, w.pid)
            elif kind == CANCEL and (key := parse_cancel(msg)) is not None:
                self._route_cancel(*key, sender=w.index)
            elif kind == FAILED:
                w.error = msg[1:].decode(errors="replace")
        lost, w.active, w.ready = w.active, 0, False
        w.addresses.clear()
        if w.ctrl is ctrl:
            w.ctrl = None
        ctrl.close()
        proc = w.proc
        assert proc is not None
        for _ in range(200):  # the channel ends just before the process does
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        w.changed.set()
        if self._stopping or not self._started:
            return
        lived = time.monotonic() - w.started_at
        w.failures = w.failures + 1 if lived < 10 else 0
        delay = min(30.0, 0.5 * 2 ** (w.failures - 1)) if w.failures else 0.0
        log.warning(
            "worker %d (pid %d) exited with %s; %d connection(s) lost; restarting in %.1f s%s",
            w.index,
            proc.pid,
            _exit_status(code),
            lost,
            delay,
            f" ({w.error})" if w.error else "",
        )
        await asyncio.sleep(delay)
        if not self._stopping:
            self._spawn(w)

    def _pick(self) -> _Worker | None:
        """The ready worker with the fewest connections; ties go to the longest unused."""
        ready = [w for w in self.workers if w.ready and w.ctrl is not None]
        return min(ready, key=lambda w: (w.active, w.handed)) if ready else None

    def _route_cancel(self, pid: int, secret: int, sender: int | None = None) -> None:
        index = owner(pid)
        if index is None or index >= len(self.workers) or index == sender:
            return
        w = self.workers[index]
        if w.ctrl is not None:
            with contextlib.suppress(OSError):  # best effort, as in PostgreSQL
                w.ctrl.send(cancel_message(pid, secret))

    async def _hand(self, w: _Worker, conn: socket.socket, address: str = "") -> bool:
        ctrl = w.ctrl
        if ctrl is None:
            return False
        for _ in range(100):
            try:
                socket.send_fds(ctrl, [CONN], [conn.fileno()])
            except BlockingIOError:  # the worker's queue is full: wait a little
                await asyncio.sleep(0.05)
                continue
            except OSError:
                return False
            w.active += 1
            w.addresses[address] += 1
            self._handoffs += 1
            w.handed = self._handoffs
            return True
        return False

    # connections ------------------------------------------------------------------------------
    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. out of file descriptors: keep serving the others
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            self._track(self._route(conn, address_of(peer)))

    def held_from(self, address: str) -> int:
        """Connections from ``address`` held by the workers (server-wide)."""
        return sum(w.addresses[address] for w in self.workers)

    async def _route(self, conn: socket.socket, address: str = "") -> None:
        with conn:  # our copy: the worker holds its own once it is handed over
            if self._pending >= self.max_connections:  # bounds the supervisor's open sockets
                await self._refuse(conn, "53300", TOO_MANY_CLIENTS)
                return
            if self._pending_from[address] >= self.per_address:  # idle sockets of one address
                await self._refuse_negotiated(conn, *self._address_refusal(address))
                return
            self._pending += 1
            self._pending_from[address] += 1
            try:
                head = await peek(conn, 8, self.peek_timeout)
            finally:
                self._pending -= 1
                self._pending_from[address] -= 1
                if not self._pending_from[address]:
                    del self._pending_from[address]
            if head is None:
                await self._refuse(conn, "08P01", "timeout expired waiting for the startup packet")
                return
            if len(head) < 8:
                return
            length, code = _HEAD.unpack(head)
            if length == 16 and code == p.CANCEL_REQUEST:
                body = await _recv_exact(conn, 16, self.peek_timeout)
                if len(body) == 16:
                    self._route_cancel(*_HEAD.unpack(body[8:]))
                return
            if self.active >= self.max_connections:
                await self._refuse_negotiated(conn, TOO_MANY_CLIENTS, None)
                return
            if self.held_from(address) >= self.per_address:
                await self._refuse_negotiated(conn, *self._address_refusal(address))
                return
            for _ in range(len(self.workers)):
                w = self._pick()
                if w is None:
                    break
                if await self._hand(w, conn, address):
                    return
                w.ready = False  # its channel failed: the watcher restarts it
            await self._refuse(
                conn,
                "57P03",
                "the database system is starting up",
                hint="a server process is restarting; retry in a moment",
            )

    def _address_refusal(self, address: str) -> tuple[str, str | None]:
        log.info("connection from %s refused: %d connections already", address, self.per_address)
        return (
            f"too many connections from address {address}",
            f"an address may hold {self.per_address} connections; close some, or raise "
            "[server] max_connections_per_address",
        )

    async def _refuse_negotiated(self, conn: socket.socket, message: str, hint: str | None) -> None:
        """53300 after answering the SSLRequest (libpq's sslmode=prefer), within the auth
        timeout; at most max_connections refusals at once, beyond that at once."""
        if self._refusing >= self.max_connections:
            await self._refuse(conn, "53300", message, hint)
            return
        self._refusing += 1
        try:
            await refuse_socket(
                conn,
                self.ssl_context,
                "53300",
                message,
                hint=hint,
                timeout=self.peek_timeout,
                on_cancel=self._route_cancel,
            )
        except OSError:
            pass
        finally:
            self._refusing -= 1

    async def _refuse(
        self, conn: socket.socket, sqlstate: str, message: str, hint: str | None = None
    ) -> None:
        loop = asyncio.get_running_loop()
        data = p.error_response(sqlstate, message, severity="FATAL", hint=hint)
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(loop.sock_sendall(conn, data), 5)


def serve(
    config: WorkerConfig,
    workers: int,
    *,
    host: str,
    port: int,
    max_connections: int,
    announce: str,
) -> int:
    """Run a supervisor until SIGTERM/SIGINT; prints ``announce`` with the port once ready."""

    async def main() -> int:
        supervisor = Supervisor(config, workers, max_connections=max_connections)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        try:
            starting = loop.create_task(supervisor.start(host, port))
            stopping = loop.create_task(stop.wait())
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not starting.done():  # stopped while the workers were still loading
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError, SupervisorError, OSError):
                    await starting
                return 0
            try:
                bound = starting.result()
            except (SupervisorError, OSError) as exc:
                print(f"dpsql: {exc}", file=sys.stderr)
                return 1
            print(f"{announce}:{bound}", flush=True)
            await stop.wait()
            log.info("stopping %d workers", len(supervisor.workers))
            return 0
        finally:
            await supervisor.close()

    return asyncio.run(main())
