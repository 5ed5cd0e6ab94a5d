"""One statement's Python at a time in a server process: a gate in front of the GIL.

A server process (``dpsql serve``, each ``--workers`` worker) runs up to ~14 statements at once
in its thread pool, so that the ledger's group commit can batch their charges while one batch is
fsynced. Only one thread can run Python at a time (the GIL), so most of those threads, once past
their charge, queue for the GIL; every time the running one lets it go (a numpy pass over the
rows, an SQLite call, the switch interval) another wakes, takes it for a few microseconds, and
is preempted again. Measured under the bench (``bench/bench_server_ab.py``, 16 connections,
``--workers 2``, load ~10), those hand-offs kept the server at 1.1-1.2 of the machine's 2 cores.

The gate puts the queue in front of the GIL instead: a statement thread holds it while it runs
(:func:`holding`, taken by the fair scheduler's wrapper of every statement), and lets it go
while it waits on something that needs no Python of this process (:func:`released`): the
ledger's durable charge (so charges still arrive together and are committed as one batch) and
the fair scheduler's pause. The gate never decides what runs or what it computes — the charge
still comes before any read of the data, answers are the same — only which of the process's
running statements has the interpreter next.

It can never hold a statement for long: a thread that cannot take the gate within
:data:`PATIENCE` seconds runs without it (as every statement did before), so a long statement
(a large DuckDB scan holding it), or a wait on another thread that the gate would otherwise
deadlock, delays the others by at most that much. Outside a gated thread (the DB-API, the CLI,
tests) :func:`released` does nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: Seconds a statement thread waits for the gate before it runs without it.
PATIENCE = 0.05

#: Per thread: ``gate``, the gate the thread holds now (None or absent: none).
state = threading.local()


class Gate:
    """At most ``slots`` statement threads of this process hold the gate at once."""

    def __init__(self, slots: int = 1, patience: float = PATIENCE) -> None:
        if slots < 1:
            raise ValueError("a gate needs at least one slot")
        # a plain lock (C, no Python-level condition) when one slot, as by default
        self._lock: threading.Lock | threading.Semaphore = (
            threading.Lock() if slots == 1 else threading.Semaphore(slots)
        )
        self.slots = slots
        self.patience = patience
        #: gives the gate back: the lock's own release, no function of dpsql, so that the
        #: statement's wrapper can call it after a charged answer and nothing of ours can fail
        #: there (tests/test_fault_walk.py fails every dpsql function in turn)
        self.give = self._lock.release

    def enter(self) -> bool:
        """Take the gate for this thread, waiting at most its patience; True when taken (give
        it back with :func:`leave`, or inline as the fair scheduler does). False when this
        thread already holds one (never twice) or the patience ran out (run without it)."""
        if getattr(state, "gate", None) is not None:
            return False
        if not self._lock.acquire(timeout=self.patience):
            return False
        state.gate = self
        return True


def leave(gate: Gate) -> None:
    """Give back the gate :meth:`Gate.enter` took, unless a :func:`released` block gave it up
    meanwhile (its retake ran out of patience: the gate is another thread's now)."""
    if getattr(state, "gate", None) is gate:
        state.gate = None
        gate.give()


def from_environment(default: int = 1) -> Gate | None:
    """The server's gate: ``DPSQL_GATE`` slots (0: no gate, every statement runs as soon as it
    has a thread), else ``default``; for comparing the two in a benchmark."""
    value = os.environ.get("DPSQL_GATE", "")
    try:
        slots = int(value) if value else default
    except ValueError:
        slots = default
    return Gate(slots) if slots > 0 else None


@contextmanager
def holding(gate: Gate | None) -> Iterator[None]:
    """Run the block holding ``gate`` (None: no gate), or without it after its patience."""
    took = gate is not None and gate.enter()
    try:
        yield
    finally:
        if took:
            assert gate is not None
            leave(gate)


@contextmanager
def released() -> Iterator[None]:
    """Let this thread's gate go while the block waits (a durable charge, a pause), and take
    it again after (within its patience, as :meth:`Gate.enter`). Nothing when the thread holds
    none."""
    gate: Gate | None = getattr(state, "gate", None)
    if gate is None:
        yield
        return
    state.gate = None
    gate.give()
    try:
        yield
    finally:
        gate.enter()


def held() -> bool:
    """Whether this thread holds a gate now (tests)."""
    return getattr(state, "gate", None) is not None
