"""Group commit of ledger charges: one write transaction (one fsync) for the charges that
queue while the previous batch commits, each as strict as a transaction of its own."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

from dpsql.errors import InterfaceError
from dpsql.gil_gate import released


def _own_error(exc: Exception) -> Exception:
    """A charge's own failure inside a batch, as :meth:`SQLiteLedger._transaction` would
    raise it for a lone charge."""
    if isinstance(exc, UnicodeEncodeError):  # an analyst, dataset or cache key
        return InterfaceError(
            "a ledger key (analyst, dataset or cache key) is not valid Unicode",
            construct="ledger",
            hint="use names without lone surrogate characters",
        )
    return exc


class _Pending:
    """One charge waiting for its group commit (:meth:`GroupCommit.run`): its
    statements, run by whichever thread leads the batch it lands in, and what became of it."""

    __slots__ = ("error", "finished", "lead", "wake", "work")

    def __init__(self, work: Callable[[sqlite3.Connection], None]) -> None:
        self.work = work
        self.wake = threading.Event()  # set when finished, or when handed the lead
        self.lead = False
        self.finished = False
        self.error: BaseException | None = None


class GroupCommit:
    """Batches this process's charges on one ledger file into shared write transactions."""

    def __init__(self, write: Callable[[], AbstractContextManager[sqlite3.Connection]]) -> None:
        self._write = write  # a BEGIN IMMEDIATE ... COMMIT transaction on the ledger
        self._queue: list[_Pending] = []  # those waiting
        self._queue_lock = threading.Lock()
        self._leading = False  # whether a thread leads a batch

    def run(self, work: Callable[[sqlite3.Connection], None]) -> None:
        """Run one charge's statements (``work``) in a write transaction, committed, when this
        returns, together with the charges other threads of this process queued meanwhile:
        group commit, one ``BEGIN IMMEDIATE`` ... ``COMMIT`` (one fsync) for the batch.

        Nothing is weaker than one transaction a charge: each charge's ``work`` re-reads the
        committed total *and* the batch's earlier charges (the same connection), so the budget
        check is as strict as one charge after another; a charge returns only after the
        ``COMMIT`` that holds it (pay before reading: the caller runs nothing before). A
        charge's own failure (a refusal: budget exhausted) is undone to its savepoint and
        raised to it alone, nothing written for it; an SQLite error, or a failed ``COMMIT``,
        fails every charge of the batch with the error a lone charge would have got ("nothing
        was charged", or "may have been charged" when the COMMIT itself failed). A batch of
        one runs exactly the statements a charge ran before.

        The first thread to queue leads: it takes the queue, runs and commits it, wakes the
        batch, and hands the lead to the first charge queued meanwhile (which then takes the
        queue, and so on), so under load each batch holds the charges that arrived while the
        previous one was being fsynced."""
        item = _Pending(work)
        # Waiting for its batch (and its fsync) needs none of this process's Python: the
        # gate goes to another statement meanwhile (dpsql.gil_gate; a server thread only), so
        # the charges of the statements running still arrive together, one batch.
        with released():
            with self._queue_lock:
                self._queue.append(item)
                if not self._leading:
                    self._leading = item.lead = True
            while not item.lead:
                item.wake.wait()
                if item.finished:
                    break
            if not item.finished:
                self._lead()
        if item.error is not None:
            raise item.error

    def _lead(self) -> None:
        with self._queue_lock:
            batch, self._queue = self._queue, []
        try:
            self._commit_batch(batch)
        finally:
            for item in batch:
                item.finished = True
                item.wake.set()
            with self._queue_lock:
                if self._queue:
                    nxt = self._queue[0]
                    nxt.lead = True
                    nxt.wake.set()
                else:
                    self._leading = False

    def _commit_batch(self, batch: list[_Pending]) -> None:
        lone = len(batch) == 1
        try:
            with self._write() as conn:
                for item in batch:
                    if lone:
                        item.work(conn)
                        continue
                    conn.execute("SAVEPOINT dpsql_charge")
                    try:
                        item.work(conn)
                    except sqlite3.Error:
                        raise  # the batch fails as one
                    except Exception as exc:  # this charge's refusal: nothing of it stays
                        conn.execute("ROLLBACK TO dpsql_charge")
                        item.error = _own_error(exc)
                    conn.execute("RELEASE dpsql_charge")
        except BaseException as exc:
            for item in batch:
                if item.error is None:
                    item.error = exc
