"""The server's hand-offs: a statement to a pool thread and its outcome back to the loop
(dpsql.server.pool), and a connection's stream telling its session that the client hung up
(dpsql.server.stream). The server-level behaviour (cancel, timeout, disconnect) is in
tests/test_server_fake.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dpsql.server import protocol as p
from dpsql.server.pool import Pool
from dpsql.server.stream import ClientReader, reads_to_end


def test_a_call_runs_on_a_pool_thread_and_its_outcome_comes_back():
    pool = Pool(2, name="test-pool")

    def boom() -> None:
        raise ValueError("no")

    async def main() -> None:
        loop_thread = threading.current_thread()
        ok, where = await pool.run(lambda: threading.current_thread())
        assert ok and where is not loop_thread and where.name.startswith("test-pool")
        ok, exc = await pool.run(boom)
        assert not ok and isinstance(exc, ValueError)
        results = await asyncio.gather(*(pool.run(lambda i=i: i * i) for i in range(50)))
        assert results == [(True, i * i) for i in range(50)]

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_a_call_cancelled_before_a_thread_takes_it_never_runs():
    pool = Pool(1, name="test-pool")
    release = threading.Event()
    ran: list[str] = []

    async def main() -> None:
        first = pool.run(lambda: release.wait(10))  # holds the only thread
        second = pool.run(lambda: ran.append("second"))
        second.cancel()
        release.set()
        assert await first == (True, True)
        assert await pool.run(lambda: "third") == (True, "third")  # after the second's turn

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()
    assert ran == []


def test_shutdown_cancels_what_has_not_started_and_waits_for_what_runs():
    pool = Pool(1, name="test-pool")
    release = threading.Event()
    ended: list[str] = []

    def running() -> None:
        release.wait(10)
        ended.append("running")

    async def main() -> None:
        first = pool.run(running)
        await asyncio.sleep(0.05)  # the thread has taken it
        waiting = pool.run(lambda: ended.append("waiting"))
        threading.Timer(0.1, release.set).start()
        pool.shutdown()  # returns once the running call ended
        assert ended == ["running"] and waiting.cancelled()
        with pytest.raises(RuntimeError):
            pool.run(lambda: None)
        assert await first == (True, None)

    asyncio.run(main())
    assert ended == ["running"]
    assert not any(w.is_alive() for w in pool._workers)


def test_a_stream_tells_its_session_the_client_hung_up():
    told: list[bool] = []

    async def main() -> None:
        reader = ClientReader()
        reader.on_lost = told.append
        reader.feed_data(b"abc")
        reader.feed_eof()
        failed = ClientReader()
        failed.on_lost = told.append
        failed.set_exception(ConnectionResetError())
        broken = ClientReader()
        broken.on_lost = lambda error: 1 / 0  # a failure there leaves the stream as it was
        broken.feed_eof()
        assert broken.at_eof()

    asyncio.run(main())
    assert told == [False, True]


def test_reads_to_end_stops_where_a_reader_reading_ahead_stops():
    q = p.message(b"Q", p.cstr("SELECT 1"))
    x = p.message(b"X", b"")
    assert reads_to_end(b"", 1 << 20)
    assert reads_to_end(q + q, 1 << 20)  # every message read, then the end
    assert reads_to_end(q + q[:3], 1 << 20)  # a message cut short: the end is reached
    assert reads_to_end(q + q[:7], 1 << 20)
    assert not reads_to_end(x, 1 << 20)  # a Terminate: the reader stops there
    assert not reads_to_end(q + x + q, 1 << 20)
    assert reads_to_end(q + x[:3], 1 << 20)  # a Terminate cut short is no Terminate
    bad_length = b"Q" + (3).to_bytes(4, "big") + b"xyz"
    assert not reads_to_end(q + bad_length, 1 << 20)  # refused: the reader stops
    assert not reads_to_end(q, 4)  # longer than the server's limit: refused
