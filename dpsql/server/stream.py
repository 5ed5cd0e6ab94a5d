"""A connection's stream, read by its session's own task, and told when the client hangs up.

A session used to keep a second task reading ahead into an ``asyncio.Queue``, so that a client
that disconnects while its statement runs interrupts it: each message crossed two tasks and the
queue (~25 Python calls and one more turn of the event loop a statement,
``bench/bench_server_calls.py``). Now the session reads its messages itself, and the stream
calls ``on_lost`` when the connection ends (EOF or an error) — the moment the reader task saw
it: the session interrupts a statement that is running or waiting for its turn, unless the
reader task would have stopped before the end (:func:`reads_to_end`: a Terminate or a message
the server refuses comes first), as before. One difference: the reader task stopped reading
ahead once 8 messages were queued, so a client that pipelined more than that behind a running
statement and then hung up did not interrupt it; it now does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("dpsql.server")


class ClientReader(asyncio.StreamReader):
    """A ``StreamReader`` that calls ``on_lost(error)`` when its connection ends (``error``:
    the connection failed, rather than the client closing its side)."""

    on_lost: Callable[[bool], None] | None = None

    def feed_eof(self) -> None:
        super().feed_eof()
        self._tell(False)

    def set_exception(self, exc: Exception) -> None:
        super().set_exception(exc)
        self._tell(True)

    def _tell(self, error: bool) -> None:
        # inside the protocol's own eof_received / connection_lost: a failure here must not
        # cut their clean-up short (the session still ends at its next read)
        if self.on_lost is not None:
            try:
                self.on_lost(error)
            except Exception:
                log.exception("telling a session its client hung up failed")


def reads_to_end(buffer: bytes | bytearray, max_message: int) -> bool:
    """Whether a reader reading the messages in ``buffer`` one after another would reach its
    end (and so hear that the client hung up): False when a Terminate (``X``) or a message the
    server refuses (a bad length) comes first, where a reader stops."""
    at, end = 0, len(buffer)
    while end - at >= 5:
        length = int.from_bytes(buffer[at + 1 : at + 5], "big", signed=True)
        if length < 4 or length - 4 > max_message:
            return False
        if end - at < 1 + length:
            return True  # a message cut short by the hang-up
        if buffer[at] == 0x58:  # b"X"
            return False
        at += 1 + length
    return True
