"""One thread a connection: a session's statements read, run and answered on a thread of its own.

The event loop (dpsql.server.server) accepts a connection and runs its startup, TLS negotiation
and SCRAM login; then, for a plaintext connection, it hands the socket to a :class:`Door`: a
thread that reads the client's messages with blocking socket calls, runs each through the
session's unchanged protocol code (dpsql.server.session, extended, session_statements: the
same routing, limits, errors and SQLSTATEs), takes the fair scheduler's turn with a thread-safe
wait (dpsql.server.fairness, ``Grant.wait``), runs the statement inline (the GIL gate and the
CPU accounting of ``FairScheduler.wrap`` as before) and writes the reply itself. A statement
then costs no hand-off between the loop, a pool thread and back: under the bench's 16
connections the server's query threads had ~20 context switches a query, mostly those
hand-offs (docs/server.md, "Where the door's millisecond goes").

The session's handlers are coroutines; on a door every awaited step (reading a message,
flushing the reply, running a statement) completes without suspending, so the door drives
each handler with one ``send(None)`` (:func:`drive`), no event loop in the thread.

The loop keeps what needs it: CancelRequests arrive there as new connections and cancel a
door's statement through the same ``Session.cancel`` (the turn's ``abandon`` or the backend's
``interrupt``, both thread-safe); a statement's ``statement_timeout`` is a timer on the loop,
armed by the door (one ``call_soon_threadsafe``, only for a statement that has a timeout);
and a :class:`Watch` looks every :data:`WATCH_EVERY` seconds, with one ``poll``, for a peer
that hung up while its door runs a statement (which it interrupts, as the loop's reader task
did). TLS connections stay on the loop (their TLS state lives in asyncio's transport).

Opt-in (``DPSQL_DOOR=thread``, or ``Server(threaded=True)``): it lowers the door's own cost
(the bench's ``SHOW epsilon`` rounds: ×1.6-3 the queries/s), but side by side under the bench's
DP queries, on this shared 2-core machine, the server got fewer cores with it and its q/s
median was ×1.08, ×0.87 and ×0.86 in three runs (docs/server.md, "One thread a connection").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from dpsql.server import protocol as p
from dpsql.server.wire_errors import Closed, cancelled_waiting, timed_out_running

log = logging.getLogger("dpsql.server")

#: Seconds between the loop's looks for a peer that hung up during a door's statement.
WATCH_EVERY = 0.1
# poll(2) events of a peer that closed or reset its end (POLLRDHUP: Linux)
_HUNG_UP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
_RECV = 1 << 16


def enabled() -> bool:
    """Whether plaintext connections get a thread of their own: ``DPSQL_DOOR`` = ``thread``;
    by default (``loop``) every statement goes through the event loop and the thread pool.
    Not the default: side by side under the bench's DP queries it lowered the CPU a query in
    two runs of three but not the queries/s (docs/server.md, "One thread a connection")."""
    return os.environ.get("DPSQL_DOOR", "loop").strip().lower() == "thread"


def drive(step: Coroutine[Any, Any, Any]) -> Any:
    """Run a session coroutine that never suspends on a door (see the module's docstring)."""
    try:
        step.send(None)
    except StopIteration as stop:
        return stop.value
    step.close()
    raise RuntimeError("a door's step waited on an event loop")


class Door:
    """A session's own thread and socket (``session``: the wire session, typed loosely)."""

    def __init__(
        self,
        session: Any,
        sock: socket.socket,
        buffered: bytes,
        loop: asyncio.AbstractEventLoop,
        done: asyncio.Future[None],
    ) -> None:
        self.session = session
        self.sock = sock
        self._in = bytearray(buffered)
        self.loop = loop
        self.done = done
        self.broken = False  # a send failed: the next flush says the client is gone
        self.busy = False  # running a statement (the watch looks at its socket)
        self.hung_up = False
        # the running statement's timeout: (deadline, token); a timer on the loop fires it
        # only while the token is still this one (the door clears it under the lock)
        self.deadline: object | None = None
        self.lock = threading.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"dpsql-conn-{session.pid}", daemon=True
        )

    # socket ---------------------------------------------------------------------------------
    def recv_exact(self, n: int) -> bytes:
        buf = self._in
        while len(buf) < n:
            try:
                chunk = self.sock.recv(max(_RECV, n - len(buf)))
            except OSError as exc:
                raise Closed() from exc
            if not chunk:
                raise Closed()
            buf += chunk
        data = bytes(buf[:n])
        del buf[:n]
        return data

    def send(self, data: bytes) -> None:
        if self.broken:
            return
        try:
            self.sock.sendall(data)
        except OSError:
            self.broken = True

    def shut(self) -> None:
        """End the connection from outside (the server's close): the door's blocking read or
        write returns at once and its thread ends."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    # statements -----------------------------------------------------------------------------
    def arm(self, timeout: float) -> object:
        """Start the running statement's timeout (see :attr:`deadline`); the token to clear."""
        token = object()
        self.deadline = token
        with contextlib.suppress(RuntimeError):  # the loop is closing: no timeout then
            self.loop.call_soon_threadsafe(self._arm_on_loop, token, timeout)
        return token

    def _arm_on_loop(self, token: object, timeout: float) -> None:
        if self._timer is not None:
            self._timer.cancel()  # the previous statement's, if it is still pending
        self._timer = None
        if self.deadline is token:
            self._timer = self.loop.call_later(timeout, self._fire, token)

    def _fire(self, token: object) -> None:
        with self.lock:
            if self.deadline is token:
                self.session._time_out()

    def disarm(self) -> None:
        with self.lock:
            self.deadline = None

    def call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], interrupt: Any, scheduled: bool
    ) -> Any:
        """``Session._blocking`` on the door's thread: the fair scheduler's turn taken with a
        thread-safe wait, then ``fn(*args)`` run here (no pool, no loop); the same 57014s."""
        s = self.session
        s._cancelled = False
        timeout = s._statement_timeout() if interrupt is not None else 0.0
        token = self.arm(timeout) if timeout > 0 else None
        scheduler = s.server.scheduler
        turn = None
        ran = False
        self.busy = True
        try:
            call: Callable[[], Any] | None = None
            if scheduled and s.user:
                turn = scheduler.enter(s.user, None)
                s._interrupt = turn.abandon
                granted = turn.granted.wait()
                if not granted or s._cancelled:  # while it waited: nothing ran
                    raise cancelled_waiting(s._timed_out)
                call = scheduler.wrap(turn, fn, *args)
            s._interrupt = interrupt
            ran = True
            if s._cancelled and interrupt is not None:  # a cancel between the grant and here
                interrupt()
            return call() if call is not None else fn(*args)
        except Exception as exc:
            if ran and s._timed_out:
                raise timed_out_running() from exc
            raise
        finally:
            self.busy = False
            if turn is not None:
                try:
                    scheduler.leave(turn)
                except Exception:  # the statement's outcome stands; the slot comes back at
                    turn.finished = True  # the next dispatch (dpsql.server.fairness)
                    log.exception("leaving the scheduler failed")
            if token is not None:
                self.disarm()
            s._interrupt = None
            s._timed_out = False

    # the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        s = self.session
        try:
            drive(self._serve())
        except BaseException:
            log.exception("session %s: its thread failed", s.pid)
        finally:
            with contextlib.suppress(Exception):
                s._write_out()
            with contextlib.suppress(OSError):
                self.sock.close()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self.loop.call_soon_threadsafe(_finish, self.done)

    async def _serve(self) -> None:
        """The loop's ``_main_loop``, its reader task and ``Session.run``'s error handling in
        one: read a message, dispatch it, until the client leaves or an error ends it."""
        s = self.session
        try:
            while True:
                kind, body = await s.read_message()
                if kind == b"X" or not await s._dispatch(kind, body):
                    return
        except Closed:
            return
        except p.ProtocolViolation as exc:
            await s.fatal(exc.sqlstate, exc.message)
        except Exception:
            log.exception("session %s failed", s.pid)
            await s.fatal("XX000", "internal error in dpsql server")


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


async def serve_on_thread(session: Any, watch: Watch) -> bool:
    """Hand a logged-in plaintext session's socket to a :class:`Door` and wait for its thread
    to end; False (nothing done) for a TLS connection or one whose output is still queued,
    which the loop serves as before."""
    writer = session.writer
    transport = writer.transport
    raw = writer.get_extra_info("socket")
    if (
        writer.get_extra_info("ssl_object") is not None
        or raw is None
        or transport.get_write_buffer_size()
    ):
        return False
    transport.pause_reading()
    reader = session.reader
    buffered = bytes(reader._buffer)  # what the client sent after its login, already read
    reader._buffer.clear()
    sock = socket.socket(fileno=os.dup(raw.fileno()))  # the connection outlives the transport
    sock.setblocking(True)
    transport.abort()
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    door = Door(session, sock, buffered, loop, done)
    session.door = door
    watch.add(door)
    try:
        door.thread.start()
        await done
    finally:
        watch.discard(door)
    return True


class Watch:
    """The loop's look at doors running a statement: a peer that hung up interrupts it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.doors: set[Door] = set()
        self._handle: asyncio.TimerHandle | None = None

    def add(self, door: Door) -> None:
        self.doors.add(door)
        if self._handle is None:
            self._handle = self.loop.call_later(WATCH_EVERY, self._look)

    def discard(self, door: Door) -> None:
        self.doors.discard(door)

    def _look(self) -> None:
        self._handle = None
        busy = [d for d in self.doors if d.busy and not d.hung_up]
        if busy:
            poller = select.poll()
            by_fd: dict[int, Door] = {}
            for door in busy:
                with contextlib.suppress(OSError, ValueError):
                    fd = door.sock.fileno()
                    if fd >= 0:
                        poller.register(fd, _HUNG_UP)
                        by_fd[fd] = door
            with contextlib.suppress(OSError):
                for fd, events in poller.poll(0):
                    gone = by_fd.get(fd)
                    if gone is not None and events & _HUNG_UP and gone.busy:
                        gone.hung_up = True
                        interrupt: Callable[[], None] | None = gone.session._interrupt
                        if interrupt is not None:
                            try:
                                interrupt()
                            except Exception:
                                log.debug("interrupt failed", exc_info=True)
        if self.doors:
            self._handle = self.loop.call_later(WATCH_EVERY, self._look)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
