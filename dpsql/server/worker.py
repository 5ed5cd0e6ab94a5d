"""One worker process of ``dpsql serve --workers N``: its own Service, serving handed-over sockets.

A worker is started by the supervisor (:mod:`dpsql.server.supervisor`) as
``python -m dpsql.server.worker INDEX FD`` with one end of a Unix ``SOCK_SEQPACKET`` socket pair
as FD: the control channel. It builds its own :class:`dpsql.pipeline.Service` (DuckDB engine,
scratch, shadow catalog, thread pool) and serves every client socket the supervisor passes over the
channel with the unchanged :class:`~dpsql.server.session.Session` code (TLS included). All
workers charge the one SQLite ledger, whose ``BEGIN IMMEDIATE`` transactions serialise charges
across processes exactly as across threads.

Control messages (one datagram each; a zero-length read is the peer's end):

- supervisor -> worker: ``I`` + JSON config (first), ``C`` + one file descriptor (a client
  connection), ``K`` + pid, secret (a CancelRequest for a session of this worker), ``Q`` (stop);
- worker -> supervisor: ``R`` (ready), ``F`` + message (startup failed), ``D`` (a connection
  ended), ``K`` + pid, secret (a cancel key this worker does not own, e.g. one that arrived
  inside TLS: the supervisor routes it to the owner).

A worker never outlives its supervisor: the end of the control channel stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import sys
from dataclasses import asdict, dataclass

from dpsql.server.connections import address_of

log = logging.getLogger("dpsql.server")

CONFIG, CONN, CANCEL, QUIT = b"I", b"C", b"K", b"Q"
READY, FAILED, DONE = b"R", b"F", b"D"
_KEY = struct.Struct("!ii")

# Backend pids of worker i are [(i + 1) << PID_SHIFT, (i + 2) << PID_SHIFT): the supervisor
# finds a cancel key's worker from the pid alone. 64 workers keep pids below 2**31.
PID_SHIFT = 20
MAX_WORKERS = 64


def pid_range(index: int) -> tuple[int, int]:
    return (index + 1) << PID_SHIFT, (index + 2) << PID_SHIFT


def owner(pid: int) -> int | None:
    """The worker index whose range holds ``pid`` (None for pids no worker hands out)."""
    index = (pid >> PID_SHIFT) - 1
    return index if 0 <= index < MAX_WORKERS else None


def cancel_message(pid: int, secret: int) -> bytes:
    return CANCEL + _KEY.pack(pid, secret)


def parse_cancel(msg: bytes) -> tuple[int, int] | None:
    return _KEY.unpack(msg[1:]) if len(msg) == 1 + _KEY.size else None


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker needs to build the same server; sent over the channel, not argv."""

    policy: str
    database: str
    engine: str | None
    cache: bool
    users: str
    tls_cert: str | None
    tls_key: str | None
    require_tls: bool
    max_connections: int
    mock_secret: str  # hex; shared so fake SCRAM salts do not depend on the worker
    fairness: dict | None = None  # FairnessLimits' fields (dpsql.server.fairness)
    connections: dict | None = None  # ConnectionLimits' fields (dpsql.server.connections)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> WorkerConfig:
        return cls(**json.loads(data))


async def _serve(server: object, ctrl: socket.socket) -> None:
    """Serve connections from the channel until ``Q``, SIGTERM or the supervisor's end."""
    from dpsql.server.server import Server

    assert isinstance(server, Server)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()
    ctrl.setblocking(False)
    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGTERM, stop.set)

    def send(msg: bytes) -> None:
        try:
            ctrl.send(msg)
        except BlockingIOError:  # the supervisor is behind: queue it rather than drop a count
            task = loop.create_task(loop.sock_sendall(ctrl, msg))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        except OSError:
            stop.set()

    async def serve_fd(fd: int) -> None:
        sock = None
        address = b""  # sent back with DONE: the supervisor counts connections per address
        try:
            sock = socket.socket(fileno=fd)
            with contextlib.suppress(OSError):
                address = address_of(sock.getpeername()).encode()[:200]
            sock.setblocking(False)
            await server.adopt(sock)
        except Exception:
            log.exception("cannot serve a handed-over connection")
            with contextlib.suppress(OSError):
                sock.close() if sock is not None else os.close(fd)
        finally:
            send(DONE + address)

    def on_message() -> None:
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(ctrl, 1 << 16, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                msg, fds = b"", []
            if not msg and not fds:  # the supervisor is gone: never outlive it
                loop.remove_reader(ctrl.fileno())
                stop.set()
                return
            kind = msg[:1]
            if kind == CONN and len(fds) == 1:
                task = loop.create_task(serve_fd(fds[0]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                continue
            for fd in fds:
                os.close(fd)
            if kind == CONN:
                send(DONE)
            elif kind == CANCEL and (key := parse_cancel(msg)) is not None:
                server.cancel(*key)
            elif kind == QUIT:
                stop.set()

    def forward_cancel(pid: int, secret: int) -> None:
        log.info("cancel key for pid %d forwarded to the supervisor", pid)
        send(cancel_message(pid, secret))

    server.forward_cancel = forward_cancel
    loop.add_reader(ctrl.fileno(), on_message)
    send(READY)
    await stop.wait()
    with contextlib.suppress(Exception):
        loop.remove_reader(ctrl.fileno())
    await server.close()
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def run(index: int, ctrl: socket.socket) -> int:
    """The worker's life: read the config, build the Service and Server, serve, clean up."""
    from dpsql.pipeline import Service
    from dpsql.server.connections import ConnectionLimits
    from dpsql.server.fairness import FairnessLimits
    from dpsql.server.server import Server, tls_context, tune_interpreter
    from dpsql.server.users import UserStore

    tune_interpreter()
    msg = ctrl.recv(1 << 20)
    if not msg.startswith(CONFIG):
        return 2
    config = WorkerConfig.from_json(msg[1:])
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(name)s[worker {index}] %(message)s"
    )
    service = None
    try:
        service = Service(config.policy, config.database, cache=config.cache, engine=config.engine)
        ctx = tls_context(config.tls_cert, config.tls_key or "") if config.tls_cert else None
        server = Server(
            service,
            UserStore(config.users),
            ssl_context=ctx,
            require_tls=config.require_tls,
            max_connections=config.max_connections,
            pid_range=pid_range(index),
            mock_secret=bytes.fromhex(config.mock_secret),
            fairness=FairnessLimits(**config.fairness) if config.fairness else None,
            connections=ConnectionLimits(**config.connections) if config.connections else None,
        )
    except Exception as exc:
        if service is not None:
            service.close()
        with contextlib.suppress(OSError):
            ctrl.send(FAILED + str(exc).encode()[:8000])
        return 1
    try:
        asyncio.run(_serve(server, ctrl))
    finally:
        service.close()
        ctrl.close()
    return 0


def main(argv: list[str]) -> int:
    # Ctrl-C in a terminal reaches the whole process group: the supervisor alone decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    index, fd = int(argv[0]), int(argv[1])
    return run(index, socket.socket(fileno=fd))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
