"""What the service's parts need of the service (``dpsql.pipeline.Service``), as a Protocol.

The statement kinds the service runs (DP subqueries, EXPLAIN, the table functions, the shape
caches) are modules below ``dpsql.pipeline``: the pipeline imports them and passes itself in.
They name the service by this Protocol instead of importing ``dpsql.pipeline``, which made
the pipeline and its parts one import cycle (issue 26 item 6). mypy checks that
``dpsql.pipeline.Service`` satisfies it wherever the pipeline passes ``self``.

Only modules below every part are imported here, so any part may import this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dpsql.engine.scratch import Scratch
    from dpsql.frontend.statements import DPQuery
    from dpsql.frontend.typecheck import ShadowTypes
    from dpsql.plan.annotated import Plan
    from dpsql.policy import Policy, TablePolicy
    from dpsql.privacy.ledger import Ledger
    from dpsql.privacy.samplers import NoiseSource
    from dpsql.service.results import Result
    from dpsql.service.settings import Settings


class Service(Protocol):
    """The service one door opens sessions on: its policy, engine, ledger and noise, the
    planner at a session's settings, and the steps a statement kind shares with a query."""

    policy: Policy
    engine: Any
    scratch: Scratch
    ledger: Ledger
    noise: NoiseSource
    cache: bool
    shadow: ShadowTypes
    #: the verified shapes (dpsql.service.shape_cache.ShapeCache)
    _shapes: Any
    #: post-processing texts already checked on the public dummy row
    _post_checked: Any

    def plan(self, query: DPQuery, settings: Settings, analyst: str = "") -> Plan: ...

    def plan_typed(
        self,
        query: DPQuery,
        domains: list[tuple | None],
        settings: Settings,
        analyst: str | None = None,
    ) -> Plan: ...

    def data_version(self, table: TablePolicy) -> str: ...

    def explain(self, plan: Plan, analyst: str | None = None) -> Result: ...

    def _reserve(self, analyst: str, cost: Any, query_text: str, plan_hash: str) -> None: ...

    def _domains(self, query: DPQuery, analyst: str) -> list[tuple | None]: ...

    def _key_types(self, plan: Plan) -> list[str]: ...

    def _check_drawable(self, plan: Plan) -> None: ...

    def _dry_run_post(self, plan: Plan, analyst: str) -> None: ...

    def _finish(
        self, plan: Plan, answer: dict, *, cost: Any, cached: bool, prepared: Any = None
    ) -> Result: ...
