"""The release transaction: the one way a statement that reads private data pays and releases.

Every statement kind that measures (a query, a statement of several measurements, a rule list,
a regression, the purchase of automatic contribution bounds) runs through :func:`paid_once`:

1. **replay**: a stored answer for this analyst and cache key is returned free;
2. **check**: the budget check and the statement's own free refusals (typing of its
   post-processing, every mechanism drawable at its ε, ...), before anything is read;
3. **reserve**: the whole cost is charged, durably, once (``Service._reserve``; from here on
   every failure is charged and uniform, ``dpsql.boundary``);
4. **execute**: the engine reads and the mechanisms release, inside the charged boundary;
5. **remember**: the released answer is stored for replay, unless the statement says it may
   not be (its data moved while it ran); a failed write returns the paid answer with a note.

One function, so the order of these steps (pay before reading, nothing data-dependent before
the charge, the answer kept once paid) is written once and tested once for every statement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from dpsql.boundary import charged_boundary, remember_paid
from dpsql.errors import OperationalError

if TYPE_CHECKING:
    from dpsql.engine.api import QueryHandle

T = TypeVar("T")


class Service(Protocol):
    """What the transaction needs of the service (``dpsql.pipeline.Service``): the policy's
    dataset and budget, the ledger, whether answers are kept, and the durable charge."""

    policy: Any
    ledger: Any
    cache: bool

    def _reserve(self, analyst: str, cost: Any, query_text: str, plan_hash: str) -> None: ...


@dataclass(frozen=True)
class Paid(Generic[T]):
    """The outcome of one release transaction."""

    #: the answer: fresh from ``execute``, or the stored one when replayed
    answer: T
    #: the cost charged by this statement; None when the answer was replayed free
    charged: Any | None
    #: the note of a failed cache write (the answer was paid for and is returned anyway)
    note: str | None = None

    @property
    def replayed(self) -> bool:
        return self.charged is None


def paid_once(
    service: Service,
    analyst: str,
    *,
    text: str,
    plan_hash: str,
    cost: Any,
    handle: QueryHandle | None,
    execute: Callable[[], tuple[T, bool]],
    check: Callable[[], None] = lambda: None,
    cache_key: str | None = None,
    before_budget: Callable[[], None] = lambda: None,
    budget_cost: Any = None,
) -> Paid[T]:
    """Replay, or check -> reserve ``cost`` once -> ``execute`` under the charged boundary ->
    remember.

    ``execute`` returns the answer and whether it may be replayed later; with a ``cache_key``
    (and the service's cache on) the answer must be the stored text. ``before_budget`` runs
    the refusals that must win over the budget's, ``check`` those after it; ``budget_cost``
    is what the budget check asks room for when it is more than this charge (the bounds'
    purchase checks room for the query that follows it too). Nothing here reads data before
    the reserve, and nothing the statement's data decides can fail after it uncharged.
    """
    dataset = service.policy.dataset
    key = cache_key if service.cache else None
    if key is not None:
        stored = service.ledger.cached(analyst, dataset, key)
        if stored is not None:
            return Paid(cast(T, stored), None)
    before_budget()
    service.ledger.check(
        analyst, dataset, cost if budget_cost is None else budget_cost, service.policy.budget
    )
    check()
    not_cancelled(handle)
    service._reserve(analyst, cost, text, plan_hash)
    with charged_boundary():
        answer, replayable = execute()
    if key is None or not replayable:
        return Paid(answer, cost)
    stored_text = cast(str, answer)  # with a cache key the answer is the stored text
    note = remember_paid(service.ledger, analyst, dataset, key, stored_text)
    return Paid(answer, cost, note)


def not_cancelled(handle: QueryHandle | None) -> None:
    """A statement cancelled before its cost is reserved has read nothing: a free refusal."""
    if handle is not None and handle.interrupted:
        raise OperationalError(
            "query cancelled before it ran", sqlstate="57014", hint="nothing was spent"
        )
