"""The server's statement threads: a call handed to a thread, its outcome handed back to the loop.

``loop.run_in_executor`` over a ``ThreadPoolExecutor`` made each statement cross two futures: a
``concurrent.futures.Future`` (its condition variable taken and notified five times in Python:
``threading.py``'s ``__enter__``/``__exit__``, ``notify``, ``notify_all``) chained both ways to
an asyncio future (``wrap_future``, ``_chain_future``, ``_copy_future_state``), plus the pool's
idle-thread semaphore at each submit: ~45 Python calls of the standard library a statement
(``bench/bench_server_calls.py``). This pool hands the same call over with none of it:

- the loop puts ``(loop, future, call)`` on a ``queue.SimpleQueue`` (C; a blocked thread is
  woken inside it, no Python call);
- a thread (started with the pool, so none starts in the middle of a statement) runs the call
  and posts its outcome with one ``loop.call_soon_threadsafe`` of asyncio's own
  ``_set_result_unless_cancelled``: the future's result is ``(True, value)`` or ``(False,
  exception)``, unpacked inline by the awaiting session (``Session._blocking``), so no dpsql
  function runs between a charged statement's end and the session's reading of its answer.

What runs, in which thread, and when, is unchanged: a call whose future was cancelled before a
thread took it never runs (as an executor's pending future is cancelled with its asyncio
wrapper); once running, it runs to its end and its outcome is dropped if nobody waits any more;
:meth:`Pool.shutdown` cancels the calls not yet started and waits for the running ones. No
function of dpsql runs in a thread between a statement's end and its outcome's post (the fault
walk, tests/test_fault_walk.py, fails every dpsql function in turn: a helper there that failed
would leave the session waiting for ever).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from asyncio import futures as _futures
from collections.abc import Callable
from typing import Any

#: asyncio's own: sets a future's result unless it was cancelled meanwhile (no dpsql function)
_settle = _futures._set_result_unless_cancelled  # type: ignore[attr-defined]


class Pool:
    """``threads`` threads running calls handed over by one or more event loops."""

    def __init__(self, threads: int, name: str = "dpsql-query") -> None:
        self.threads = max(1, threads)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()

    def run(self, call: Callable[[], Any]) -> asyncio.Future[Any]:
        """On an event loop: ``call()`` in a thread; the future's result is ``(True, value)``
        or ``(False, exception)``."""
        if self._closed:
            raise RuntimeError("cannot schedule new statements after shutdown")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.put((future, call))
        return future

    def _work(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is None:
                return
            future, call = item
            item = None
            if future.cancelled():  # cancelled before it started: never runs
                future = call = None
                continue
            try:
                done = (True, call())
            except BaseException as exc:  # handed to the loop, as an executor's future does
                done = (False, exc)
            call = None
            try:  # noqa: SIM105 (contextlib.suppress: three more Python calls a statement)
                future.get_loop().call_soon_threadsafe(_settle, future, done)
            except RuntimeError:  # the loop closed meanwhile: nobody waits
                pass
            future = None
            done = (False, None)  # let the outcome go

    def shutdown(self) -> None:
        """No new calls; those not started are cancelled (call on their loop); waits for the
        running ones to end."""
        self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            if worker is not threading.current_thread():
                worker.join()
