"""The one pipeline every front door calls: text -> bind -> plan -> charge -> release -> rows.

Data flows one way. Refusals happen in bind and plan, before the engine is touched and before
the ledger is written. The budget is checked before the engine runs and charged atomically
(together with the cached answer) before any value leaves this module.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from sqlglot import exp

from dpsql.access import access_for
from dpsql.boundary import (
    STATEMENT_CHARGED,
    ChargedFailure,
    ChargedPostProcessingFailure,
    post_processing_boundary,
    uniform_charged_failure,
)
from dpsql.engine.api import EngineResult, QueryHandle, cancel_check
from dpsql.engine.base import open_engine
from dpsql.engine.scratch import (
    Scratch,
)
from dpsql.errors import (
    Error,
    internal_error,
)
from dpsql.frontend.bind import parse_statement
from dpsql.frontend.statements import (
    CompositeQuery,
    DPQuery,
    ExplainStatement,
    GroupKey,
    PublicSelect,
    ReleasedQuery,
    RuleListCall,
    SettingStatement,
    TransactionStatement,
)
from dpsql.frontend.typecheck import (
    ShadowTypes,
    type_query,
)
from dpsql.limits import check_parameters, check_plan_rows, check_text, too_complex
from dpsql.lower.compile import (
    CompiledQuery,
    compile_plan,
)
from dpsql.lower.domain_query import enumeration
from dpsql.plan.annotated import Plan
from dpsql.plan.domains import key_domain
from dpsql.plan.planner import build_plan
from dpsql.policy import Policy, TablePolicy, load_policy
from dpsql.privacy.ledger import Ledger, MemoryLedger
from dpsql.privacy.release import Released, at_confidence, release
from dpsql.privacy.samplers import NoiseSource, default_source
from dpsql.service import group_clamps
from dpsql.service.auto_clip import clip_and_replan
from dpsql.service.bounds import resolve as resolve_bounds
from dpsql.service.bounds_choice import choose_bounds
from dpsql.service.budget_view import BUDGET_SHOWS, show_budget
from dpsql.service.describe import columns_of
from dpsql.service.drawable import check_drawable, undrawable
from dpsql.service.explain_table import explain_statement, explain_table
from dpsql.service.finish import dry_run_post, finish, key_types
from dpsql.service.plan_cache import CheckedSet, PlanCache, PostPlan, PreparedPlan, SecretTemplate
from dpsql.service.probe import probe
from dpsql.service.results import (
    EXPLAIN_COLUMNS,
    SQL_TYPES_BY_CODE,
    TYPE_CODES,
    Result,
    answer_data,
    decode_answer,
    encode_answer,
    float_values,
    is_output_column,
    jsonable,
    project_rows,
    released_table,
    to_python,
    type_code,
)
from dpsql.service.settings import ResetRequest, Settings, apply_setting, reset_setting
from dpsql.service.shape_cache import ShapeCache
from dpsql.service.table_functions import run_table_function
from dpsql.service.text_shapes import TextShapes
from dpsql.service.transaction import not_cancelled as _not_cancelled
from dpsql.service.transaction import paid_once

_log = logging.getLogger("dpsql.service")

# Re-exported: front doors and tests import these from here.
__all__ = [
    "EXPLAIN_COLUMNS",
    "SQL_TYPES_BY_CODE",
    "TYPE_CODES",
    "CheckedSet",
    "PlanCache",
    "PostPlan",
    "PreparedPlan",
    "ResetRequest",
    "Result",
    "SecretTemplate",
    "Service",
    "Settings",
    "_not_cancelled",
    "apply_setting",
    "decode_answer",
    "encode_answer",
    "float_values",
    "is_output_column",
    "jsonable",
    "project_rows",
    "released_table",
    "reset_setting",
    "to_python",
    "type_code",
]

DOMAIN_CACHE_SIZE = 4096  # (analyst, table, key) entries
#: Below this session ε no noise measure can be drawn (Laplace scale > 2^54 for l1 >= 1).
TINIEST_EPSILON = 2.0**-54


class Service:
    """Loads a policy and its private data once; each door opens analyst sessions on it."""

    def __init__(
        self,
        policy: str | Path | Mapping[str, Any] | Policy,
        database: str = ":memory:",
        *,
        ledger: Ledger | None = None,
        noise: NoiseSource | None = None,
        cache: bool = True,
        engine: str | None = None,
        spark_session: Any = None,
        plan_cache: int = 1024,
    ) -> None:
        self.policy = policy if isinstance(policy, Policy) else load_policy(policy)
        # engine: "duckdb" | "spark" (default: the policy's [engine] name); spark_session: an
        # existing SparkSession to run on.
        self.engine = open_engine(self.policy, database, engine, spark_session)
        self.scratch = Scratch(self.policy)
        self.ledger: Ledger = ledger if ledger is not None else self._default_ledger()
        self.noise = noise if noise is not None else default_source()
        self.cache = cache
        self.shadow = ShadowTypes(self.policy)
        # Per analyst: a warm entry is faster than a cold one, so a shared cache would let one
        # analyst time whether another asked the same shape (docs/threat_model.md).
        self._domain_cache: OrderedDict[
            tuple[str, str, str, tuple | None, tuple[exp.Expression, ...]], tuple | None
        ] = OrderedDict()
        self._post_checked = CheckedSet()
        self._lock = threading.Lock()
        # plan_cache: how many statement texts keep their checked plan (0: none).
        self._plans = PlanCache(plan_cache)
        # the same bound shape with other WHERE numbers: its verified plan and SQL template
        self._shapes = ShapeCache(plan_cache)
        # ... and found from the text alone, without parsing it (dpsql.service.text_shapes)
        self._texts = TextShapes(plan_cache)

    def _default_ledger(self) -> Ledger:
        if self.policy.ledger_path is None:
            return MemoryLedger()
        from dpsql.privacy.sqlite_ledger import SQLiteLedger

        return SQLiteLedger(self.policy.ledger_path)

    def close(self) -> None:
        self.engine.close()
        self.scratch.close()
        self.shadow.close()
        close_ledger = getattr(self.ledger, "close", None)
        if close_ledger is not None:
            close_ledger()

    def _models(self, analyst: str, text: str):
        """The analyst's stored models, for dp_predict (opened only when the text uses it)."""
        if "dp_predict" not in text.lower():
            return None
        from dpsql.models.store import ModelStore

        return ModelStore.for_ledger(self.ledger).lookup(analyst, self.policy.dataset)

    # -- planning ----------------------------------------------------------------------------
    def _domains(self, query: DPQuery, analyst: str) -> list[tuple | None]:
        out = []
        for key in query.keys:
            cache_key = (analyst, query.table.name, key.sql, key.allowed, key.conditions)
            with self._lock:
                known = cache_key in self._domain_cache
                domain = self._domain_cache.get(cache_key)
            if not known:
                domain = key_domain(key, query.table, self.policy.max_bins, self._enumerate)
                with self._lock:
                    self._domain_cache[cache_key] = domain
                    while len(self._domain_cache) > DOMAIN_CACHE_SIZE:
                        self._domain_cache.popitem(last=False)
            out.append(domain)
        return out

    def _enumerate(self, key: GroupKey, table: TablePolicy, limit: int) -> list[tuple]:
        """A key's public values (dpsql.plan.domains.key_domain): its enumeration's tree over
        the public relations of its columns, run on the scratch engine (no private data)."""
        query = enumeration(key, table, limit)
        return [] if query is None else self.scratch.rows(query)

    def plan(self, query: DPQuery, settings: Settings, analyst: str = "") -> Plan:
        """Type the query (refusals are free: schema only), find its domains, plan it.

        Typing reuses only this analyst's own earlier typings of the same expressions (never
        another's), so it takes the same time whoever else asked the same shape before.
        """
        query = type_query(query, self.shadow, analyst)
        return self.plan_typed(query, self._domains(query, analyst), settings, analyst)

    def plan_typed(
        self,
        query: DPQuery,
        domains: list[tuple | None],
        settings: Settings,
        analyst: str | None = None,
    ) -> Plan:
        """Plan a typed query over its key domains at the session's settings: the one call of
        the planner (a DP subquery's outer plan comes here too, dpsql.service.composite).
        "auto" contribution bounds are chosen here from ``analyst``'s kept histograms, or left
        pending for the run to buy (dpsql.service.bounds): free either way."""
        try:
            # a choice's share of a tiny ε may underflow (refused below, as the plan's own)
            query, epsilon, chosen = resolve_bounds(self, query, settings.epsilon, analyst)
            plan = build_plan(
                query,
                domains,
                epsilon=epsilon,
                delta=settings.delta,
                mechanism=settings.mechanism,
                data_version=self.data_version(query.table),
                quantile_method=settings.quantile_method,
                partition_selection=settings.partition_selection,
                engine=self.engine.name,
                store=self.store_of(query.table),
                bias_estimate=settings.bias_estimate == "on",
            )
            if chosen is not None:
                plan.extra["bounds"] = chosen
                plan.extra["bounds_settings"] = (replace(settings), list(domains))
            return plan
        except (ValueError, OverflowError, ZeroDivisionError):
            # Below 2^-54 no noise measure is drawable (a scale above the exact sampler's
            # 2^54): the planner's arithmetic on such an ε (shares that underflow to 0, an
            # infinite scale) is refused free like _check_drawable would, never leaked raw.
            if settings.epsilon >= TINIEST_EPSILON:
                raise
            raise undrawable(f"epsilon = {settings.epsilon:g}", bounds=False) from None

    def store_of(self, table: TablePolicy) -> Any:
        """This engine's own prepared store of ``table`` at its data version, or None: a plan
        compiles against the store its engine holds, never another engine's in the process."""
        version = self.data_version(table)
        for info in getattr(self.engine, "stores", ()):
            if info.table == table.name and info.version == version:
                return info
        return None

    # -- execution ---------------------------------------------------------------------------
    def execute(
        self,
        text: str,
        parameters: Sequence[Any] | None,
        settings: Settings,
        analyst: str,
        handle: QueryHandle | None = None,
    ) -> Result:
        """Run one statement for every door (DB-API, CLI, wire server). Whatever fails with
        an exception that is not dpsql's own reaches the door as one InternalError (XX000)
        that names no value and no internal class; the operator's log has the cause. Before
        the reserve such a failure is decided by the text and the policy; after it, the
        charged boundary has already made it the uniform charged error, and whatever a
        statement kind's own boundary did not wrap becomes that same error here (a statement
        is marked charged by the reserve: dpsql.boundary.STATEMENT_CHARGED)."""
        token = STATEMENT_CHARGED.set(False)
        try:
            return self._execute(text, parameters, settings, analyst, handle)
        except ResetRequest:
            raise
        except (ChargedFailure, ChargedPostProcessingFailure):
            raise
        except Exception as exc:
            if STATEMENT_CHARGED.get():
                raise uniform_charged_failure(exc) from None
            if isinstance(exc, Error):
                raise
            if isinstance(exc, RecursionError):
                raise too_complex() from None
            _log.exception("internal error while processing a statement")
            raise internal_error() from None
        finally:
            STATEMENT_CHARGED.reset(token)

    def _execute(
        self,
        text: str,
        parameters: Sequence[Any] | None,
        settings: Settings,
        analyst: str,
        handle: QueryHandle | None = None,
    ) -> Result:
        check_text(text, self.policy.limits)  # sizes and nesting: before any work (54000/1)
        check_parameters(parameters, self.policy.limits)
        key = self._plans.key(text, parameters, settings, analyst)
        if (prepared := self._lookup(key)) is not None:
            return self._run(prepared, analyst, handle, settings.confidence)
        if (prepared := self._from_text(key, text, parameters, settings, analyst)) is not None:
            return self._run(prepared, analyst, handle, settings.confidence)
        if (found := self._probe(text, parameters, settings, analyst)) is not None:
            return found
        statement = self._parse(text, parameters, analyst, settings.dialect)
        _not_cancelled(handle)  # statement_timeout / cancel reach planning, between its phases
        if isinstance(statement, SettingStatement):
            if statement.action == "show" and statement.name in BUDGET_SHOWS:
                wide = statement.name == "budget_wide"
                return self.show_budget(analyst, settings, wide=wide)
            return apply_setting(statement, settings)
        if isinstance(statement, TransactionStatement):
            return Result(status=statement.kind.upper())
        if isinstance(statement, PublicSelect):
            description, rows = self.scratch.post_process(statement.post, [], [], [])
            return Result([(n, type_code(t)) for n, t in description], rows)
        if isinstance(statement, ExplainStatement):
            return explain_statement(self, statement, settings, analyst)
        if isinstance(statement, RuleListCall):
            return run_table_function(self, statement, settings, analyst, handle)
        if isinstance(statement, CompositeQuery):
            from dpsql.service.composite import run_composite

            return run_composite(self, statement, settings, analyst, handle)
        if isinstance(statement, ReleasedQuery):
            from dpsql.service.composite import run_released

            return run_released(self, statement, settings, analyst, handle)
        assert isinstance(statement, DPQuery)
        prepared = self._prepare(key, statement, settings, analyst, handle)
        result = self._run(prepared, analyst, handle, settings.confidence)
        if prepared.shape_key is not None:
            # served from its shape and run: the next text like it (with its parameters, if
            # any) may skip parse and bind
            self._texts.learn(
                self, text, statement, settings, analyst, prepared.shape_key, parameters
            )
        return result

    def _parse(
        self, text: str, parameters: Sequence[Any] | None, analyst: str, dialect: str = "duckdb"
    ) -> Any:
        """Parse and bind ``text`` for ``analyst`` in ``dialect`` (the session's, chosen by its
        door: dpsql.frontend.dialect): their access rules (dpsql.access) are checked on the parsed
        statement before it is bound, free, like every refusal."""
        models = self._models(analyst, text)
        return parse_statement(
            text, self.policy, parameters, models, access_for(self.policy, analyst), dialect
        )

    def _probe(
        self, text: str, parameters: Sequence[Any] | None, settings: Settings, analyst: str
    ) -> Result | None:
        """A column probe's free answer, or None: not a probe (dpsql.service.probe)."""
        return probe(self, text, parameters, settings, analyst, self._models(analyst, text))

    def _from_text(
        self,
        key: tuple | None,
        text: str,
        parameters: Sequence[Any] | None,
        settings: Settings,
        analyst: str,
    ) -> PreparedPlan | None:
        """A verified shape found from the text and its parameters alone
        (dpsql.service.text_shapes), cached under ``key`` like a planned statement; None:
        parse and bind it."""
        if key is None:
            return None
        prepared = self._texts.lookup(self, text, settings, analyst, parameters)
        if prepared is not None:
            self._plans.offer(key, prepared)  # cheap to rebuild: no LRU churn when full
        return prepared

    def data_version(self, table: TablePolicy) -> str:
        """The version of the data a query over ``table`` reads: a policy table's own, or for
        a private join (or a unit_path table, read through its path) every joined table's, so
        a cached plan or answer is dropped when any of them changes."""
        if table.joined is None:
            return self.engine.versions.get(table.name, "")
        parts = sorted({step.table.name for step in table.joined.steps} | {table.name})
        return "+".join(f"{name}={self.engine.versions.get(name, '')}" for name in parts)

    def _lookup(self, key: tuple | None) -> PreparedPlan | None:
        """The cached statement for ``key``, unless its table's data version changed."""
        prepared = self._plans.get(key) if key is not None else None
        if prepared is None:
            return None
        plan = prepared.plan
        if plan.data_version == self.data_version(plan.query.table):
            return prepared
        self._plans.discard(key)  # type: ignore[arg-type]
        return None

    def _prepare(
        self,
        key: tuple | None,
        statement: DPQuery,
        settings: Settings,
        analyst: str,
        handle: QueryHandle | None = None,
    ) -> PreparedPlan:
        """Plan a bound query (refusals raise here, before anything is stored) and cache it.
        A cancel or statement_timeout of ``handle`` stops it between phases, free."""
        prepared = self._shapes.lookup(self, statement, settings, analyst)
        _not_cancelled(handle)
        if prepared is None:
            prepared = PreparedPlan(self.plan(statement, settings, analyst))
            _not_cancelled(handle)
            if "bounds" not in prepared.plan.extra:  # "auto" bounds: per analyst, no shape
                self._shapes.learn(self, prepared, statement, settings, analyst)
            _not_cancelled(handle)
        if key is not None:
            self._plans.put(key, prepared)
        return prepared

    def run(self, plan: Plan, analyst: str, handle: QueryHandle | None = None) -> Result:
        return self._run(PreparedPlan(plan), analyst, handle)

    def _compiled(self, prepared: PreparedPlan) -> CompiledQuery:
        """Engine query with a fresh secret; a statement's first run compiles its template."""
        if prepared.template is None:
            prepared.template = SecretTemplate.build(prepared.plan)
        prepared.runs += 1
        return prepared.template.with_secret(secrets.randbits(62))

    def _run(
        self,
        prepared: PreparedPlan,
        analyst: str,
        handle: QueryHandle | None,
        confidence: float = 0.95,
    ) -> Result:
        plan = prepared.plan
        if (bounds := plan.extra.get("bounds")) is not None and bounds.pending is not None:
            prepared = choose_bounds(self, prepared, analyst, handle)  # may charge the choice
            plan = prepared.plan
        check_plan_rows(plan, self.policy.limits)  # public bins: decided by text and policy
        if not plan.measures and not plan.quantiles and plan.threshold is None:
            # Public keys only, nothing measured (SELECT DISTINCT dept, GROUP BY dept without
            # an aggregate): the answer is the policy's domain. Nothing is read or charged.
            # a plan that measures nothing has a declared domain for every key
            bins = itertools.product(*(cast(tuple, kp.domain) for kp in plan.keys))
            free = Released(list(bins), [], [], None)
            with post_processing_boundary():
                answer = decode_answer(encode_answer(free, self._key_types(plan)))
                return self._finish(plan, answer, cost=None, cached=False, prepared=prepared)
        fingerprint = prepared.fingerprint
        compiled = None
        run_plan = plan
        clip_notes: list[str] = []
        fresh: dict | None = None  # this run's answer, as its replay would decode it

        def check() -> None:
            nonlocal compiled
            self._check_drawable(plan)
            compiled = self._compiled(prepared)

        def execute() -> tuple[str | None, bool]:
            nonlocal compiled, run_plan, clip_notes, fresh
            assert compiled is not None  # check() ran before the reserve
            if plan.clips:
                # automatic clipping: release the ranges, then run the plan planned with them
                run_plan, clip_notes = clip_and_replan(
                    self.engine, self.noise, plan, compiled.secret, handle
                )
                compiled = compile_plan(run_plan, compiled.secret)
            if group_clamps.planned(run_plan):
                # a grouped AVG's clamp per group, chosen from its released count first
                released, clip_notes = group_clamps.run(
                    self, run_plan, compiled, handle, cancel_check(handle)
                )
            else:
                result: EngineResult = self.engine.execute(compiled, handle)
                released = release(run_plan, result, self.noise, cancel_check(handle))
            # the data moved while it ran: answered, never replayed
            replayable = not self.cache or (
                self.data_version(plan.query.table) == plan.data_version
            )
            key_types = self._key_types(plan)  # from the plan: the same on every dataset
            if not self.cache:  # nothing remembers it: no JSON text (results.answer_data)
                fresh = answer_data(released, key_types)
                return None, replayable
            return encode_answer(released, key_types), replayable

        if not prepared.post_checked:
            # before a replay too: the answer key leaves post-processing out, so a query whose
            # release another query paid for is refused (free) as on a fresh connection, not
            # run on the released values to fail there
            self._dry_run_post(plan, analyst)
            prepared.post_checked = True
        paid = paid_once(
            self, analyst, text=plan.query.text, plan_hash=fingerprint, cost=plan.cost,
            handle=handle, check=check, execute=execute, cache_key=fingerprint,
        )  # fmt: skip
        with post_processing_boundary():
            # Decode what is stored, so a fresh answer and its cached replay look the same.
            answer = fresh if fresh is not None else decode_answer(cast(str, paid.answer))
            if paid.replayed:
                return self._finish(
                    plan,
                    at_confidence(group_clamps.for_intervals(plan), answer, confidence),
                    cost=None,
                    cached=True,
                    prepared=prepared,
                )
            notes: list[str] = []
            notes.extend(group_clamps.bounds_notes(plan))  # the bounds chosen, if any
            notes.extend(clip_notes)
            if paid.note:
                notes.append(paid.note)  # paid for and released: returned with the note
            # the cache keeps the 95% ones
            answer = at_confidence(group_clamps.for_intervals(run_plan), answer, confidence)
            cost = plan.cost
            if (choice := plan.extra.get("bounds_charged")) is not None:
                cost = choice + cost  # the statement's whole charge: its bounds choice too
            out = self._finish(plan, answer, cost=cost, cached=False, prepared=prepared)
            out.notes.extend(notes)
            return out

    def _check_drawable(self, plan: Plan) -> None:
        """Every mechanism of the plan can run at its ε, or a free refusal before anything is
        read (dpsql.service.drawable)."""
        check_drawable(plan, self.noise)

    def _reserve(self, analyst: str, cost: Any, query_text: str, plan_hash: str) -> None:
        """Pay before reading: charge the cost, durably, before the engine reads a row.

        Raises BudgetExhaustedError (nothing written) when another query of the analyst's
        spent the budget since the check. From here on every failure is charged.
        """
        STATEMENT_CHARGED.set(True)  # from here on every failure is charged ...
        try:
            self.ledger.charge(
                analyst,
                self.policy.dataset,
                cost,
                self.policy.budget,
                query_text=query_text,
                plan_hash=plan_hash,
            )
        except Error:
            STATEMENT_CHARGED.set(False)  # ... but the ledger's own refusal wrote nothing
            raise

    def show_budget(
        self, analyst: str, settings: Settings | None = None, *, wide: bool = False
    ) -> Result:
        """``SHOW budget`` (``wide``: ``SHOW budget WIDE``): dpsql.service.budget_view."""
        return show_budget(self, analyst, settings, wide=wide)

    # -- the released table's post-processing (dpsql.service.finish), describe, EXPLAIN --------
    def _key_types(self, plan: Plan) -> list[str]:
        """DB-API type codes of the released keys (dpsql.service.finish)."""
        return key_types(self, plan)

    def describe(
        self,
        text: str,
        settings: Settings,
        parameters: Sequence[Any] | None = None,
        analyst: str = "",
    ) -> list[tuple[str, str]]:
        """Result columns of a statement, without running it or spending anything.

        A DP query is planned (or found) in the plan cache, so that executing it next (the
        wire protocol describes, then executes) does not plan it again.
        """
        check_text(text, self.policy.limits)
        check_parameters(parameters, self.policy.limits)
        key = self._plans.key(text, parameters, settings, analyst)
        prepared = self._lookup(key)
        statement: Any = None  # found in the plan cache: its plan is enough
        if prepared is None:
            if (found := self._probe(text, parameters, settings, analyst)) is not None:
                return found.description
            statement = self._parse(text, parameters, analyst, settings.dialect)
            if isinstance(statement, DPQuery):
                prepared = self._prepare(key, statement, settings, analyst)
            elif isinstance(statement, CompositeQuery):
                from dpsql.service.composite import plan_composite

                prepared = PreparedPlan(plan_composite(self, statement, settings, analyst)[1])
            elif isinstance(statement, ReleasedQuery):
                from dpsql.service.composite import describe_released

                return describe_released(self, statement, settings, analyst)
        return columns_of(
            self, statement, prepared, lambda: self.execute(text, parameters, settings, analyst)
        )

    def _dry_run_post(self, plan: Plan, analyst: str) -> None:
        """Post-processing on a public dummy row before anything is spent (free refusal):
        dpsql.service.finish."""
        dry_run_post(self, plan, analyst)

    def _finish(
        self,
        plan: Plan,
        answer: dict,
        *,
        cost: Any,
        cached: bool,
        prepared: PreparedPlan | None = None,
    ) -> Result:
        """The released table's post-processing (dpsql.service.finish)."""
        return finish(self, plan, answer, cost=cost, cached=cached, prepared=prepared)

    def explain(self, plan: Plan, analyst: str | None = None) -> Result:
        """EXPLAIN (FORMAT TABLE) of a plan: dpsql.service.explain_table."""
        return explain_table(self, plan, analyst)
