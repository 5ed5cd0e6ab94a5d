"""Pay before reading, then fail uniformly: the second privacy-boundary invariant.

Once a query's cost is reserved and the engine may have read a row, what reaches the analyst
is either the released answer or one fixed error that names no value, whose cost stands.
Anything else (an engine error, a Python TypeError on an odd value, a failed ledger write)
could depend on the data and would be an oracle: the error text, its class or its SQLSTATE
would differ between neighbouring datasets. The operator still sees the cause in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from dpsql.errors import DataError, OperationalError

log = logging.getLogger("dpsql.boundary")

FAILED_AFTER_READ = "the query failed after it started reading data; its cost was charged"
POST_PROCESSING_FAILED = (
    "post-processing of the released (noisy) values failed; the query's cost was charged"
)
CANCELLED_AFTER_READ = "query cancelled after it started reading data; its cost was charged"
CANCELLED = "57014"
CHARGED_HINT = (
    "no detail is given, since it could depend on the data; re-running it costs "
    "again; if it keeps failing, report the query to the operator"
)
# the SQLSTATEs a statement can end with after its cost was charged (every door keeps them)
CHARGED_STATES = frozenset({"58000", "22000", CANCELLED})
NOT_CACHED = (
    "this answer was charged and is returned, but it could not be stored in the answer cache "
    "(a ledger write failed): re-running the same query will cost again"
)


class ChargedFailure(OperationalError):
    """The one error a query can end with after its cost was charged (SQLSTATE 58000)."""

    sqlstate = "58000"


class ChargedPostProcessingFailure(DataError):
    """Post-processing (HAVING, ORDER BY, expressions over the aggregates) failed on the
    released values. Those are already private, so saying *that* it was post-processing is
    safe; the engine's text (which quotes the noisy values) is still not passed on."""


@contextmanager
def post_processing_boundary() -> Iterator[None]:
    """Post-processing failures after the charge: one fixed message (SQLSTATE 22000)."""
    try:
        yield
    except Exception:
        log.info("post-processing failed after the query's cost was charged", exc_info=True)
        raise ChargedPostProcessingFailure(
            POST_PROCESSING_FAILED,
            construct="SELECT list / HAVING / ORDER BY",
            hint="check casts, divisions and overflows in expressions over the aggregates; "
            "re-running the same query replays the same released values at no cost",
        ) from None


@contextmanager
def charged_boundary() -> Iterator[None]:
    """Turn every failure inside the block into :class:`ChargedFailure` (a cancel stays 57014)."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, OperationalError) and exc.sqlstate == CANCELLED:
            raise ChargedFailure(
                CANCELLED_AFTER_READ,
                sqlstate=CANCELLED,
                hint="the budget for this query was spent; re-running it costs again",
            ) from None
        log.info("query failed after its cost was charged", exc_info=True)
        raise ChargedFailure(FAILED_AFTER_READ, hint=CHARGED_HINT) from None


STATEMENT_CHARGED: ContextVar[bool] = ContextVar("dpsql_statement_charged", default=False)
"""Whether the running statement's cost is (or may be) charged. The service sets it False
when a statement starts and True before the ledger is asked to charge (a ledger that fails
with anything but its own refusal may have committed: the analyst is told it was charged);
read and set inline, never through a function that could itself fail between the charge and
the mark."""


def uniform_charged_failure(exc: BaseException) -> ChargedFailure:
    """The error of a statement that failed after its charge, outside the narrower
    boundaries (a step the release transaction of its kind did not wrap): the same fixed
    error as :func:`charged_boundary`, so where the failure happened cannot tell the
    analyst anything either."""
    log.info("statement failed after its cost was charged", exc_info=exc)
    return ChargedFailure(FAILED_AFTER_READ, hint=CHARGED_HINT)


def remember_paid(
    ledger: Any, analyst: str, dataset: str, cache_key: str, answer: str
) -> str | None:
    """Cache an answer already charged; a failed cache write never discards it.

    The answer was paid for (the reserve committed) and released, so it is returned whatever
    happens to the cache: a failure is logged for the operator with its cause and comes back
    as a note for the analyst (None when the answer was stored). The note says only *that*
    caching failed, a fact about the ledger's disk, not about the data.
    """
    try:
        ledger.remember(analyst, dataset, cache_key, answer)
    except Exception:
        log.error(
            "a charged answer could not be cached (returned to the analyst anyway)",
            exc_info=True,
        )
        return NOT_CACHED
    return None
