"""One thread a connection (dpsql.server.door): the hand-over from the event loop after the
login, the grant a connection's thread waits for, and what the loop keeps (TLS is in
test_server_clients.py; cancel, disconnect, timeouts and errors run on both doors in
test_server_fake.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from test_server_fake import FakeServer, FakeService

from dpsql.server import protocol as p
from dpsql.server.door import drive
from dpsql.server.fairness import Abandoned, FairnessLimits, FairScheduler, Grant
from dpsql.server.server import ServerThread
from dpsql.server.testing import RawClient
from dpsql.server.users import UserStore


@pytest.fixture
def users(tmp_path):
    store = UserStore(tmp_path / "visits.users.json")
    store.add("alice", "pw-alice")
    return store


def _wait(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_grant_is_waited_for_on_a_thread_and_settled_once():
    grant = Grant()
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(grant.wait()))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive() and not grant.done()  # it waits, holding nothing
    grant.set_result(None)
    waiter.join(5)
    assert results == [True] and grant.done()
    grant.set_exception(Abandoned())  # settled once: a late abandon changes nothing
    assert grant.wait()

    abandoned = Grant()
    abandoned.set_exception(Abandoned())
    abandoned.set_result(None)
    assert not abandoned.wait()
    cancelled = Grant()
    cancelled.cancel()
    assert not cancelled.wait()
    with pytest.raises(RuntimeError):  # a thread's grant has no loop to await on
        asyncio.run(_await(Grant()))


async def _await(grant: Grant) -> None:
    await grant


def test_a_loop_turn_granted_from_a_connections_thread_wakes_the_loop():
    """A dispatch on a connection's thread grants a statement that waits on the event loop (a
    TLS connection's): the loop hears of it through call_soon_threadsafe."""

    async def main() -> None:
        s = FairScheduler(FairnessLimits(analyst_statements=1, statements=1), slots=1)
        holder: list = []
        t = threading.Thread(target=lambda: holder.append(s.enter("a")))
        t.start()
        t.join(5)
        (first,) = holder
        assert first.granted.wait()
        on_loop = s.enter("b")  # no slot: it waits, on the loop
        assert not on_loop.granted.done()
        threading.Thread(target=s.leave, args=(first,)).start()  # the leave on a thread
        await asyncio.wait_for(on_loop.granted, 5)
        s.leave(on_loop)
        waiting_on_loop = s.enter("c")
        blocker = s.enter("d")
        assert waiting_on_loop.granted.done() and not blocker.granted.done()
        threading.Thread(target=blocker.abandon).start()  # a cancel from another thread
        with pytest.raises(Abandoned):
            await asyncio.wait_for(blocker.granted, 5)
        s.leave(blocker)
        s.leave(waiting_on_loop)
        assert s._running == 0 and not s._waiting

    asyncio.run(main())


def test_drive_refuses_a_step_that_would_wait_on_a_loop():
    async def finishes() -> int:
        return 7

    async def suspends() -> None:
        await asyncio.sleep(0)

    assert drive(finishes()) == 7
    with pytest.raises(RuntimeError, match="waited on an event loop"):
        drive(suspends())


def test_a_logged_in_connection_is_served_on_its_own_thread(users):
    service = FakeService()
    with ServerThread(lambda: FakeServer(service, users, threaded=True)) as th:
        assert th.server is not None and th.server.threaded
        c = RawClient("127.0.0.1", th.port)
        # a query sent right behind the login's last message, read by the loop before the
        # hand-over, is answered by the connection's thread
        send = c.send

        def send_with_a_query(kind: bytes, body: bytes) -> None:
            send(kind, body)
            if kind == b"p" and body.startswith(b"c=biws"):
                send(b"Q", p.cstr("SELECT n FROM visits"))

        c.send = send_with_a_query  # type: ignore[method-assign]
        assert c.login("alice", "pw-alice").status == "I"
        c.send = send  # type: ignore[method-assign]
        assert c.until_ready().tags() == ["SELECT 3"]
        session = th.server.sessions[c.pid]
        assert session.door is not None
        thread = session.door.thread
        assert thread.name == f"dpsql-conn-{c.pid}" and thread.is_alive()
        assert c.query("SELECT n FROM visits").tags() == ["SELECT 3"]
        c.close()
        assert _wait(lambda: not thread.is_alive() and c.pid not in th.server.sessions)
        assert service.connections[-1].closed


def test_closing_the_server_ends_a_connections_running_statement(users):
    service = FakeService()
    th = ServerThread(lambda: FakeServer(service, users, threaded=True))
    th.start()
    c = RawClient("127.0.0.1", th.port)
    assert c.login("alice", "pw-alice").status == "I"
    assert th.server is not None
    door = th.server.sessions[c.pid].door
    assert door is not None
    c.send(b"Q", p.cstr("SELECT slow FROM visits"))
    assert service.connections[-1].started.wait(10)
    start = time.monotonic()
    th.stop()  # the statement is interrupted and the thread ends before the server is closed
    assert not door.thread.is_alive()
    assert time.monotonic() - start < 15  # not the 20 s the slow statement waits otherwise
    assert c.closed_by_server()
