"""The one pipeline every front door calls: text -> bind -> plan -> charge -> release -> rows.

Data flows one way. Refusals happen in bind and plan, before the engine is touched and before
the ledger is written. The budget is checked before the engine runs and charged atomically
(together with the cached answer) before any value leaves this module.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

import numpy as np
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
    NotPlain,
    Scratch,
)
from dpsql.errors import (
    BudgetExhaustedError,
    DataError,
    Error,
    InternalError,
    ProgrammingError,
    internal_error,
)
from dpsql.limits import check_parameters, check_plan_rows, check_text, too_complex
from dpsql.policy import Policy, TablePolicy, load_policy
from dpsql.privacy.ledger import Ledger, MemoryLedger
from dpsql.privacy.release import Released, at_confidence, release
from dpsql.privacy.samplers import NoiseSource, default_source
from dpsql.service.bias_notes import answer_notes, bounds_lines
from dpsql.service.bounds import buy as buy_bounds
from dpsql.service.bounds import resolve as resolve_bounds
from dpsql.service.plan_cache import _CheckedSet, _PlanCache, _PostPlan, _Prepared, _SecretTemplate
from dpsql.service.results import (
    EXPLAIN_COLUMNS,
    SQL_TYPES_BY_CODE,
    TYPE_CODES,
    Result,
    _convert,
    _decode,
    _encode,
    _floats,
    _is_output,
    _jsonable,
    _project,
    _released_table,
    type_code,
)
from dpsql.service.settings import Settings, _ResetRequest, apply_setting, reset_setting
from dpsql.service.shape_cache import ShapeCache
from dpsql.service.text_shapes import TextShapes
from dpsql.service.transaction import not_cancelled as _not_cancelled
from dpsql.service.transaction import paid_once
from dpsql.sql.bind import parse_probe, parse_statement
from dpsql.sql.compile import (
    CompiledQuery,
    clamp_histogram_query,
    compile_clip_histograms,
    compile_plan,
    contribution_query,
)
from dpsql.sql.domains import key_domain
from dpsql.sql.plan import Plan, QuantileMeasure, build_plan, with_clip_ranges
from dpsql.sql.positions import position_of
from dpsql.sql.statements import (
    DIALECT,
    BoundQuery,
    CompositeQuery,
    ExplainStatement,
    PublicSelect,
    ReleasedQuery,
    RuleListCall,
    SettingStatement,
    TransactionStatement,
)
from dpsql.sql.typecheck import (
    BOOLEAN_TYPES,
    ShadowTypes,
    lower_key,
    relation_types,
    released_key_type,
    type_query,
)

_log = logging.getLogger("dpsql.service")

# What a column probe's answer says (dpsql.sql.bind.parse_probe): its columns, never a row.
PROBE_NOTE = (
    "dpsql never releases rows: this row-level query is answered with its columns only "
    "(aggregate it to see data)"
)

# Re-exported: front doors and tests import these from here.
__all__ = [
    "EXPLAIN_COLUMNS",
    "SQL_TYPES_BY_CODE",
    "TYPE_CODES",
    "Result",
    "Service",
    "Settings",
    "_CheckedSet",
    "_PlanCache",
    "_PostPlan",
    "_Prepared",
    "_ResetRequest",
    "_SecretTemplate",
    "_convert",
    "_decode",
    "_encode",
    "_floats",
    "_is_output",
    "_jsonable",
    "_not_cancelled",
    "_project",
    "_released_table",
    "apply_setting",
    "reset_setting",
    "type_code",
]

DOMAIN_CACHE_SIZE = 4096  # (analyst, table, key) entries
#: Below this session ε no noise measure can be drawn (Laplace scale > 2^54 for l1 >= 1).
TINIEST_EPSILON = 2.0**-54

# SHOW budget: one ε view, one ρ (Service.show_budget); SHOW budget WIDE adds the rest.
BUDGET_SHOWS = ("budget", "budget_wide")
BUDGET_COLUMNS = [
    ("analyst", "VARCHAR"),
    ("spent_epsilon", "DOUBLE"),
    ("budget_epsilon", "DOUBLE"),
    ("remaining_epsilon", "DOUBLE"),
    ("spent_delta", "DOUBLE"),
    ("budget_delta", "DOUBLE"),
    ("remaining_delta", "DOUBLE"),
    ("spent_rho", "DOUBLE"),
    ("queries_left", "BIGINT"),
    ("binding_limit", "VARCHAR"),
    ("period", "VARCHAR"),
]
BUDGET_COLUMNS_WIDE = [
    *BUDGET_COLUMNS,
    ("unspent_epsilon", "DOUBLE"),
    ("unspent_delta", "DOUBLE"),
    ("rho_cap", "DOUBLE"),
    ("charged_epsilon", "DOUBLE"),
    ("charged_delta", "DOUBLE"),
    ("gaussian_rho", "DOUBLE"),
]


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
            tuple[str, str, str, tuple | None, tuple[str, ...]], tuple | None
        ] = OrderedDict()
        self._post_checked = _CheckedSet()
        self._lock = threading.Lock()
        # plan_cache: how many statement texts keep their checked plan (0: none).
        self._plans = _PlanCache(plan_cache)
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
    def _domains(self, query: BoundQuery, analyst: str) -> list[tuple | None]:
        out = []
        for key in query.keys:
            cache_key = (analyst, query.table.name, key.sql, key.allowed, key.conditions)
            with self._lock:
                known = cache_key in self._domain_cache
                domain = self._domain_cache.get(cache_key)
            if not known:
                domain = key_domain(key, query.table, self.policy.max_bins, self.scratch.rows)
                with self._lock:
                    self._domain_cache[cache_key] = domain
                    while len(self._domain_cache) > DOMAIN_CACHE_SIZE:
                        self._domain_cache.popitem(last=False)
            out.append(domain)
        return out

    def plan(self, query: BoundQuery, settings: Settings, analyst: str = "") -> Plan:
        """Type the query (refusals are free: schema only), find its domains, plan it.

        Typing reuses only this analyst's own earlier typings of the same expressions (never
        another's), so it takes the same time whoever else asked the same shape before.
        """
        query = type_query(query, self.shadow, analyst)
        return self.plan_typed(query, self._domains(query, analyst), settings, analyst)

    def plan_typed(
        self,
        query: BoundQuery,
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
            raise _undrawable(f"epsilon = {settings.epsilon:g}", bounds=False) from None

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
        except _ResetRequest:
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
        if (probe := self._probe(text, parameters, settings, analyst)) is not None:
            return probe
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
            description, rows = self.scratch.post_process(
                statement.post.sql(dialect=DIALECT), [], [], []
            )
            return Result([(n, type_code(t)) for n, t in description], rows)
        if isinstance(statement, ExplainStatement):
            if isinstance(statement.query, RuleListCall):
                if statement.query.function != "dp_rule_list":
                    from dpsql.models.regression_function import explain_regression

                    return explain_regression(self, statement.query, settings)
                from dpsql.rulelist.sql_run import explain_rule_list

                return explain_rule_list(self, statement.query, settings)
            if isinstance(statement.query, CompositeQuery):
                from dpsql.service.composite import explain_composite

                return explain_composite(self, statement.query, settings, analyst)
            if isinstance(statement.query, ReleasedQuery):
                from dpsql.service.composite import explain_released

                return explain_released(self, statement.query, settings, analyst, statement.format)
            plan = self.plan(statement.query, settings, analyst)
            if statement.format == "text":
                from dpsql.service.explain import explain_text

                return explain_text(self, plan, analyst)
            return self.explain(plan, analyst)
        if isinstance(statement, RuleListCall):
            return self.run_rule_list(statement, settings, analyst, handle)
        if isinstance(statement, CompositeQuery):
            from dpsql.service.composite import run_composite

            return run_composite(self, statement, settings, analyst, handle)
        if isinstance(statement, ReleasedQuery):
            from dpsql.service.composite import run_released

            return run_released(self, statement, settings, analyst, handle)
        assert isinstance(statement, BoundQuery)
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
        door: dpsql.sql.dialect): their access rules (dpsql.access) are checked on the parsed
        statement before it is bound, free, like every refusal."""
        models = self._models(analyst, text)
        return parse_statement(
            text, self.policy, parameters, models, access_for(self.policy, analyst), dialect
        )

    def _probe(
        self, text: str, parameters: Sequence[Any] | None, settings: Settings, analyst: str
    ) -> Result | None:
        """A column probe of an accepted relation (dpsql.sql.bind.parse_probe: ``<relation>
        LIMIT 0`` or ``LIMIT 1``), answered free: no row, its columns named and typed from
        the text and the schema (the empty shadow tables), no engine read, no charge. None:
        not a probe. A probe of a relation that would be refused is refused the same way."""
        probe = parse_probe(
            text,
            self.policy,
            parameters,
            self._models(analyst, text),
            access_for(self.policy, analyst),
            settings.dialect,
        )
        if probe is None:
            return None
        type_query(probe.query, self.shadow, analyst)  # its WHERE binds and is BOOLEAN
        columns = relation_types(self.shadow, probe.relation.sql(dialect=DIALECT))
        return Result([(name, type_code(t)) for name, t in columns], [], notes=[PROBE_NOTE])

    def _from_text(
        self,
        key: tuple | None,
        text: str,
        parameters: Sequence[Any] | None,
        settings: Settings,
        analyst: str,
    ) -> _Prepared | None:
        """A verified shape found from the text and its parameters alone
        (dpsql.service.text_shapes), cached under ``key`` like a planned statement; None:
        parse and bind it."""
        if key is None:
            return None
        prepared = self._texts.lookup(self, text, settings, analyst, parameters)
        if prepared is not None:
            self._plans.put(key, prepared)
        return prepared

    def data_version(self, table: TablePolicy) -> str:
        """The version of the data a query over ``table`` reads: a policy table's own, or for
        a private join (or a unit_path table, read through its path) every joined table's, so
        a cached plan or answer is dropped when any of them changes."""
        if table.joined is None:
            return self.engine.versions.get(table.name, "")
        parts = sorted({step.table.name for step in table.joined.steps} | {table.name})
        return "+".join(f"{name}={self.engine.versions.get(name, '')}" for name in parts)

    def _lookup(self, key: tuple | None) -> _Prepared | None:
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
        statement: BoundQuery,
        settings: Settings,
        analyst: str,
        handle: QueryHandle | None = None,
    ) -> _Prepared:
        """Plan a bound query (refusals raise here, before anything is stored) and cache it.
        A cancel or statement_timeout of ``handle`` stops it between phases, free."""
        prepared = self._shapes.lookup(self, statement, settings, analyst)
        _not_cancelled(handle)
        if prepared is None:
            prepared = _Prepared(self.plan(statement, settings, analyst))
            _not_cancelled(handle)
            if "bounds" not in prepared.plan.extra:  # "auto" bounds: per analyst, no shape
                self._shapes.learn(self, prepared, statement, settings, analyst)
            _not_cancelled(handle)
        if key is not None:
            self._plans.put(key, prepared)
        return prepared

    def run(self, plan: Plan, analyst: str, handle: QueryHandle | None = None) -> Result:
        return self._run(_Prepared(plan), analyst, handle)

    def _compiled(self, prepared: _Prepared) -> CompiledQuery:
        """Engine query with a fresh secret; a statement's first run compiles its template."""
        if prepared.template is None:
            prepared.template = _SecretTemplate.build(prepared.plan)
        prepared.runs += 1
        return prepared.template.with_secret(secrets.randbits(62))

    def _run(
        self,
        prepared: _Prepared,
        analyst: str,
        handle: QueryHandle | None,
        confidence: float = 0.95,
    ) -> Result:
        plan = prepared.plan
        if (bounds := plan.extra.get("bounds")) is not None and bounds.pending is not None:
            prepared = self._choose_bounds(prepared, analyst, handle)  # may charge the choice
            plan = prepared.plan
        check_plan_rows(plan, self.policy.limits)  # public bins: decided by text and policy
        if not plan.measures and not plan.quantiles and plan.threshold is None:
            # Public keys only, nothing measured (SELECT DISTINCT dept, GROUP BY dept without
            # an aggregate): the answer is the policy's domain. Nothing is read or charged.
            # a plan that measures nothing has a declared domain for every key
            bins = itertools.product(*(cast(tuple, kp.domain) for kp in plan.keys))
            free = Released(list(bins), [], [], None)
            with post_processing_boundary():
                answer = _decode(_encode(free, self._key_types(plan)))
                return self._finish(plan, answer, cost=None, cached=False, prepared=prepared)
        fingerprint = prepared.fingerprint
        compiled = None
        run_plan = plan
        clip_notes: list[str] = []

        def check() -> None:
            nonlocal compiled
            self._check_drawable(plan)
            compiled = self._compiled(prepared)

        def execute() -> tuple[str, bool]:
            nonlocal compiled, run_plan, clip_notes
            assert compiled is not None  # check() ran before the reserve
            if plan.clips:
                # automatic clipping: release the ranges, then run the plan planned with them
                run_plan, clip_notes = self._clip(plan, compiled.secret, handle)
                compiled = compile_plan(run_plan, compiled.secret)
            result: EngineResult = self.engine.execute(compiled, handle)
            released = release(run_plan, result, self.noise, cancel_check(handle))
            # the data moved while it ran: answered, never replayed
            replayable = not self.cache or (
                self.data_version(plan.query.table) == plan.data_version
            )
            key_types = self._key_types(plan)  # from the plan: the same on every dataset
            return _encode(released, key_types), replayable

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
            answer = _decode(paid.answer)
            if paid.replayed:
                return self._finish(
                    plan,
                    at_confidence(plan, answer, confidence),
                    cost=None,
                    cached=True,
                    prepared=prepared,
                )
            notes: list[str] = []
            if (bounds := plan.extra.get("bounds")) is not None:
                notes.extend(bounds.notes())
            notes.extend(clip_notes)
            if paid.note:
                notes.append(paid.note)  # paid for and released: returned with the note
            answer = at_confidence(run_plan, answer, confidence)  # the cache keeps the 95% ones
            cost = plan.cost
            if (choice := plan.extra.get("bounds_charged")) is not None:
                cost = choice + cost  # the statement's whole charge: its bounds choice too
            out = self._finish(plan, answer, cost=cost, cached=False, prepared=prepared)
            out.notes.extend(notes)
            return out

    def _clip(self, plan: Plan, secret: int, handle: QueryHandle | None) -> tuple[Plan, list[str]]:
        """Release each auto-clipped column's range (its histogram of |x|, noised: ε_b) and
        plan the query again with those ranges as bounds. Runs after the reserve: the whole
        query's cost, clipping included, is already charged."""
        ranges: dict[str, tuple[float, float]] = {}
        notes = []
        for clip, query in zip(plan.clips, compile_clip_histograms(plan, secret), strict=True):
            bins = self.engine.execute(query, handle)
            counts = np.zeros(clip.histogram.bins, dtype=np.int64)
            for row, c in zip(bins.key_rows, bins.measures[0], strict=True):
                counts[int(row[-1])] += int(c)
            col = plan.query.table.columns[clip.column]
            got = clip.mechanism.release(counts, self.noise, col.lower, col.upper)  # type: ignore[arg-type]
            ranges[clip.column] = (got.lower, got.upper)
            bias = got.bias()
            notes.append(
                f"{col.expr or clip.column}: clamped to the DP range [{got.lower:g}, "
                f"{got.upper:g}] (ε {clip.epsilon:.3g} of the query's, declared "
                f"[{col.lower:g}, {col.upper:g}]); about {bias.clipped_share:.1%} of its values "
                f"lie beyond it, so SUM/AVG are biased towards zero by about "
                f"{bias.sum_bias:.3g} in total"
            )
        run = with_clip_ranges(plan, ranges)
        spent = run.cost
        for clip in plan.clips:
            spent = spent + clip.cost
        if spent.exact_epsilon > plan.cost.exact_epsilon * (1 + Fraction(1, 10**9)) or (
            spent.exact_rho > plan.cost.exact_rho * (1 + Fraction(1, 10**9))
        ):
            raise InternalError("the clipped plan costs more than was charged", construct="clip")
        return run, notes

    def _choose_bounds(
        self, prepared: _Prepared, analyst: str, handle: QueryHandle | None
    ) -> _Prepared:
        """A query on "auto" bounds whose histogram this analyst has not bought at this data
        version (dpsql.service.bounds): planned again, free, if it was bought since the plan
        was cached; else every free check runs on the placeholder plan, the choice is charged
        as its own ledger entry (share · ε), its histograms released and kept, and the query
        planned with the chosen bounds at the rest of its ε (charged next, in _run)."""
        settings, domains = prepared.plan.extra["bounds_settings"]
        query = prepared.plan.query  # as bound: the placeholder bounds, "auto" still marked
        plan = self.plan_typed(query, domains, settings, analyst)
        pending = plan.extra["bounds"].pending
        if pending is None:
            return _Prepared(plan)

        def check() -> None:
            self._dry_run_post(plan, analyst)
            self._check_drawable(plan)
            for histogram in pending.mechanisms:
                try:
                    histogram.mechanism.sample(self.noise, 0)
                    _ = histogram.threshold
                except (ValueError, OverflowError):
                    raise _undrawable("the contribution bounds' histogram", bounds=False) from None

        def execute() -> tuple[Plan, bool]:
            chosen_query, measured, chosen = buy_bounds(
                self, pending, query, analyst, handle, contribution_query, _clamp_query
            )
            chosen_plan = self.plan_typed(
                chosen_query, domains, replace(settings, epsilon=measured)
            )
            chosen_plan.extra["bounds"] = chosen
            chosen_plan.extra["bounds_charged"] = pending.cost  # reported with the answer's
            return chosen_plan, False  # kept by buy_bounds per analyst and data version

        # its own ledger entry; the budget check asks room for the query that follows it too
        run = paid_once(
            self, analyst, text=pending.describe(), plan_hash=pending.needs[0].cache_key,
            cost=pending.cost, budget_cost=pending.cost + plan.cost, handle=handle,
            check=check, execute=execute,
        ).answer  # fmt: skip
        return _Prepared(run)

    def _check_drawable(self, plan: Plan) -> None:
        """Every mechanism of the plan can run at its ε, or a free refusal before anything is
        read: each measure's noise (the exact sampler's range) and its interval search, each
        quantile release's exponential mechanism (or smooth median), each automatic clipping
        histogram and its τ, and the optimal selection's π table. All decided by the plan's
        public parameters; afterwards no mechanism refuses because of its ε."""
        from dpsql.privacy.quantiles import check_drawable as quantiles_drawable

        for m in plan.measures:
            try:
                m.mechanism.sample(self.noise, 0)
                m.mechanism.interval_halfwidth()
            except (ValueError, OverflowError):
                raise _undrawable(f"{m.kind}({m.column or '*'})") from None
        for qm in plan.quantiles:
            try:
                if not isinstance(qm, QuantileMeasure):
                    qm.check_drawable()  # its own mechanism (MODE's noisy max)
                    continue
                quantiles_drawable(qm.grid, qm.part_epsilon, [len(p) for p in qm.parts], qm.method)
            except (ValueError, OverflowError):
                what = "quantiles" if isinstance(qm, QuantileMeasure) else qm.kind
                raise _undrawable(f"the {what} of {qm.column}", bounds=False) from None
        for clip in plan.clips:
            try:
                approx = clip.mechanism
                approx.mechanism.sample(self.noise, 0)
                if approx.method == "threshold":
                    _ = approx.threshold
            except (ValueError, OverflowError):
                raise _undrawable(f"the clipping range of {clip.column}") from None
        selection = plan.selection
        if selection is not None and selection.mechanism is not None:
            try:
                _ = selection.mechanism.table  # cached per (ε, δ): released from it later
            except (ValueError, OverflowError):
                raise _undrawable("the partition selection", bounds=False) from None

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
        """``SHOW budget`` (``wide``: ``SHOW budget WIDE``): the analyst's own spent and
        remaining budget (costs nothing). The columns: :data:`BUDGET_COLUMNS`.

        One ε view and one ρ: ``spent_epsilon``/``spent_delta`` are the (ε, δ) the spending
        amounts to as the filter converts it (the better of the pure sum and the zCDP
        conversion); ``spent_rho`` the zCDP total Σ zrho the filter compares with its cap;
        ``remaining_epsilon`` the largest ε one more pure-ε release may take;
        ``queries_left`` how many more releases of the session's per-query ε fit (the policy's
        default without a session). Under [budgets], the remaining figures and
        ``queries_left`` are the smallest over every budget the analyst's charges must fit;
        ``binding_limit`` names the one with the least ε left ("analyst", "group NAME",
        "dataset") and ``period`` its current period (NULL: it never renews). The wide form
        adds ``unspent_*`` (the budget minus the guarantee), ``rho_cap`` (the filter's ρ
        cap) and the raw sums of the charges: ``charged_epsilon`` (pure-ε releases),
        ``charged_delta`` and ``gaussian_rho`` (Gaussian releases), which add up charge by
        charge.
        """
        from dpsql.privacy.accounting import Cost
        from dpsql.privacy.budget_rules import rules_of

        dataset = self.policy.dataset
        per_query = Cost(epsilon=settings.epsilon if settings is not None else self.policy.epsilon)
        # Every budget a charge must fit ([budgets]: groups, the dataset-wide cap, renewal),
        # where the ledger can tell: the remaining figures are those of the binding one.
        limits_of = getattr(self.ledger, "limits", None)
        if limits_of is not None and rules_of(self.policy.budget) is not None:
            limits = limits_of(analyst, dataset, self.policy.budget)
            budget, spent = limits[0].budget, limits[0].spent
            lefts = [lim.remaining for lim in limits]
            eps_left, delta_left = min(e for e, _ in lefts), min(d for _, d in lefts)
            bound = min(limits, key=lambda lim: lim.remaining)
            binding, period = bound.label, bound.period or None
            fits = [lim.budget.queries_left(lim.spent, per_query) for lim in limits]
        else:
            budget = self.ledger.budget(analyst, dataset, self.policy.budget)
            spent = self.ledger.spent(analyst, dataset)
            eps_left, delta_left = budget.remaining(spent)
            binding, period = "analyst", None
            fits = [budget.queries_left(spent, per_query)]
        eps_spent, delta_spent = budget.guarantee(spent)
        eps_unspent, delta_unspent = budget.unspent(spent)
        values = {
            "analyst": analyst,
            "spent_epsilon": eps_spent,
            "budget_epsilon": budget.epsilon,
            "remaining_epsilon": eps_left,
            "spent_delta": delta_spent,
            "budget_delta": budget.delta,
            "remaining_delta": delta_left,
            "spent_rho": spent.zrho,
            "queries_left": min(fits) if self.policy.epsilon > 0 else None,
            "binding_limit": binding,
            "period": period,
            "unspent_epsilon": eps_unspent,
            "unspent_delta": delta_unspent,
            "rho_cap": budget.rho,
            "charged_epsilon": spent.epsilon,
            "charged_delta": spent.delta,
            "gaussian_rho": spent.rho,
        }
        columns = BUDGET_COLUMNS_WIDE if wide else BUDGET_COLUMNS
        return Result(columns, [tuple(values[name] for name, _ in columns)], status="SHOW")

    # -- table functions (dp_rule_list: dpsql.rulelist.sql_run; regressions:
    # dpsql.models.regression_function; their shared release: dpsql.service.table_results) --
    def run_rule_list(
        self, call: RuleListCall, settings: Settings, analyst: str, handle: QueryHandle | None
    ) -> Result:
        if call.function != "dp_rule_list":
            from dpsql.models.regression_function import run_regression

            return run_regression(self, call, settings, analyst, handle)
        from dpsql.rulelist.sql_run import run_rule_list

        return run_rule_list(self, call, settings, analyst, handle)

    def table_function_result(
        self, call: RuleListCall, answer: str, cost: Any, columns: Sequence[tuple[str, str]]
    ) -> tuple[Result, dict]:
        from dpsql.service.table_results import table_function_result

        return table_function_result(self, call, answer, cost, columns)

    def store_model(
        self, plan: Any, kind: str, analyst: str, query: str, payload: dict, result: Result
    ) -> None:
        from dpsql.service.table_results import store_model

        store_model(self, plan, kind, analyst, query, payload, result)

    def _key_types(self, plan: Plan) -> list[str]:
        """DB-API type codes of the released keys (as :func:`lower_key` casts them)."""
        if all(k.key.type is not None for k in plan.keys):
            return [type_code(released_key_type(k.key.type)) for k in plan.keys]  # type: ignore[arg-type]
        types = self.shadow.types(plan.query.table.name, [lower_key(k.key) for k in plan.keys])
        return [type_code(t) for t in types]

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
        if prepared is None:
            if (probe := self._probe(text, parameters, settings, analyst)) is not None:
                return probe.description
            statement = self._parse(text, parameters, analyst, settings.dialect)
            if isinstance(statement, BoundQuery):
                prepared = self._prepare(key, statement, settings, analyst)
            elif isinstance(statement, CompositeQuery):
                from dpsql.service.composite import plan_composite

                prepared = _Prepared(plan_composite(self, statement, settings, analyst)[1])
            elif isinstance(statement, ReleasedQuery):
                from dpsql.service.composite import describe_released

                return describe_released(self, statement, settings, analyst)
        if prepared is not None:
            plan = prepared.plan
            empty = {
                "keys": [],
                "key_types": self._key_types(plan),
                "outputs": [],
                "intervals": [],
                "suppressed": None,
            }
            return self._finish(plan, empty, cost=None, cached=False, prepared=prepared).description
        if isinstance(statement, ExplainStatement):
            return EXPLAIN_COLUMNS if statement.format == "table" else [("QUERY PLAN", "VARCHAR")]
        if isinstance(statement, SettingStatement) and statement.action == "show":
            if statement.name in BUDGET_SHOWS:
                return self.show_budget("", wide=statement.name == "budget_wide").description
            return [(statement.name, "VARCHAR")]
        if isinstance(statement, PublicSelect):
            return self.execute(text, parameters, settings, analyst).description
        return []

    def _dry_run_post(self, plan: Plan, analyst: str) -> None:
        """Run post-processing on one fixed, public dummy row before anything is spent.

        The row (NULL keys, every aggregate 1) depends on nothing private, so refusing a
        query whose post-processing fails on it (``CAST(COUNT(*) AS DATE)``) leaks nothing.
        Failures that depend on the noisy values can only surface after the charge, as they
        must.
        """
        post = plan.query.post
        trivial = (
            exp.Column,
            exp.Alias,
            exp.Identifier,
            exp.Literal,
            exp.Ordered,
            exp.Select,
            exp.From,
            exp.Table,
            exp.Order,
            exp.Limit,
            exp.Offset,
            exp.Star,
        )
        if all(isinstance(node, trivial) for node in post.walk()):
            return
        # The same post-processing text reads keys k0.. whose types depend on the GROUP BY.
        key = (
            analyst,
            plan.query.table.name,
            tuple(k.key.sql for k in plan.keys),
            post.sql(DIALECT),
        )
        if key in self._post_checked:
            return
        n = len(plan.outputs)
        answer = {
            "keys": [[None] * len(plan.keys)],
            "key_types": self._key_types(plan),
            "outputs": [[1.0]] * n,
            "intervals": [[[1.0, 1.0]]] * n,
            "suppressed": None,
        }
        try:
            self._finish(plan, answer, cost=None, cached=False)
        except Error as exc:
            raise type(exc)(
                f"the query's post-processing fails before any data is used: {exc.message}",
                sqlstate=exc.sqlstate,
                construct=exc.construct,
                hint="fix the expression over the aggregates; nothing was spent",
            ) from None
        self._check_having_type(plan, answer)
        self._post_checked.add(key)

    def _check_having_type(self, plan: Plan, dummy_answer: dict) -> None:
        """HAVING must be BOOLEAN, like WHERE: its type over the released table's schema
        (the public dummy row), or a free refusal before anything is spent."""
        having = plan.query.post.args.get("where")  # bind rewrites HAVING as the post's WHERE
        if having is None:
            return
        probe = plan.query.post.copy()
        for arg in ("where", "order", "limit", "offset", "distinct"):
            probe.set(arg, None)
        probe.set("expressions", [exp.alias_(having.this.copy(), "__having")])
        columns, types, rows = _released_table(plan, dummy_answer)
        description, _ = self.scratch.post_process(probe.sql(dialect=DIALECT), columns, types, rows)
        duck_type = description[0][1]
        if duck_type not in BOOLEAN_TYPES:
            raise ProgrammingError(
                f"a HAVING condition must be BOOLEAN, but it is {duck_type}",
                sqlstate="42804",
                construct="HAVING",
                position=position_of(having, plan.query.text),
                hint="compare the aggregate with a value, e.g. HAVING COUNT(*) > 10",
            )

    def _finish(
        self,
        plan: Plan,
        answer: dict,
        *,
        cost: Any,
        cached: bool,
        prepared: _Prepared | None = None,
    ) -> Result:
        """Post-processing of the released table only: in Python when the query just picks
        (and renames) released columns, else on the scratch connection; the same result."""
        columns, types, rows = _released_table(plan, answer)
        post = prepared.post if prepared is not None else None
        if post is None:
            post = _PostPlan.of(plan.query.post, columns)
            if prepared is not None:
                prepared.post = post
        if post.projection is not None:
            try:
                out = _project(post.projection, columns, types, rows, cost=cost, cached=cached)
                out.bias_notes = answer_notes(plan, out.description, out.biases, out.intervals)
                return out
            except NotPlain:
                pass  # a value of an unexpected Python type: let DuckDB cast it
        visible = post.visible
        description, out_rows = self.scratch.post_process(
            post.sql or _PostPlan.render(plan.query.post), columns, types, rows
        )
        hidden = {name: i for i, (name, _) in enumerate(description)}
        intervals = []
        for row in out_rows:
            intervals.append(
                tuple(
                    (row[hidden[f"__lo{j}"]], row[hidden[f"__hi{j}"]])
                    if f"__lo{j}" in hidden
                    else None
                    for j in range(visible)
                )
            )
        biases = [
            tuple(
                (row[hidden[f"__b{j}"]], row[hidden[f"__blo{j}"]], row[hidden[f"__bhi{j}"]])
                if f"__b{j}" in hidden and row[hidden[f"__b{j}"]] is not None
                else None
                for j in range(visible)
            )
            for row in out_rows
        ]
        out = Result(
            description=[(n, type_code(t)) for n, t in description[:visible]],
            rows=[tuple(_convert(v) for v in row[:visible]) for row in out_rows],
            intervals=intervals,
            cost=cost,
            cached=cached,
            biases=biases,
        )
        out.bias_notes = answer_notes(plan, out.description, out.biases, out.intervals)
        return out

    def explain(self, plan: Plan, analyst: str | None = None) -> Result:
        rows: list[tuple[Any, ...]] = []
        for o in plan.outputs:
            if not o.measures:  # a quantile (EXPLAIN (FORMAT TEXT) explains its guarantee)
                qm = plan.quantile_of(o)
                quantile = isinstance(qm, QuantileMeasure)
                rows.append(
                    (
                        o.call.label,
                        f"quantiles({qm.column}) on {qm.bins} bins"
                        if quantile
                        else f"mode({qm.column}) over {qm.bins} public values",
                        "exponential_mechanism" if quantile else "report_noisy_max",
                        float(qm.max_values),
                        None,
                        None,
                        float(qm.cost.epsilon),
                        0.0,
                        0.0,
                        None,
                    )
                )
            for name in o.measures:
                m = plan.measure(name)
                g = m.unit  # in the answer's units (a rescaled measure's fine grid divided out)
                rows.append(
                    (
                        o.call.label,
                        f"{m.kind}({m.column or '*'})",
                        m.mechanism.name,
                        float(m.l1 * g),
                        float(m.l2 * g),
                        float(m.mechanism.scale * g),
                        m.epsilon,
                        m.delta,
                        float(m.mechanism.cost.rho),
                        float(m.mechanism.interval_halfwidth() * g),
                    )
                )
        rows.extend(_range_rows(plan, self.policy.budget))
        if plan.threshold is not None:
            m = plan.measure(plan.threshold.measure)
            rows.append(
                (
                    "GROUP BY " + ", ".join(k.key.sql for k in plan.keys),
                    f"units >= tau = {plan.threshold.tau:g}",
                    m.mechanism.name,
                    float(m.l1),
                    float(m.l2),
                    float(m.mechanism.scale),
                    m.epsilon,
                    m.delta + plan.threshold.delta,
                    float(m.mechanism.cost.rho),
                    float(m.mechanism.interval_halfwidth()),
                )
            )
        selection = plan.selection
        if selection is not None and selection.mechanism is not None:
            sel = selection.mechanism
            rows.append(
                (
                    "GROUP BY " + ", ".join(k.key.sql for k in plan.keys),
                    f"optimal partition selection, kept always from n = {sel.saturation}",
                    sel.name,
                    float(sel.max_groups),
                    float(math.sqrt(sel.max_groups)),
                    None,
                    sel.epsilon,
                    sel.delta,
                    0.0,
                    None,
                )
            )
        for m in plan.measures:  # what the bounds cut, measured (dpsql.sql.bias)
            if m.measure_kind.bias:
                g = m.unit
                rows.append(
                    (
                        "bias",
                        f"{m.kind}({m.column or '*'})",
                        m.mechanism.name,
                        float(m.l1 * g),
                        float(m.l2 * g),
                        float(m.mechanism.scale * g),
                        m.epsilon,
                        0.0,
                        0.0,
                        float(m.mechanism.interval_halfwidth() * g),
                    )
                )
        for line in bounds_lines(plan):  # e.g. "R = 5 may drop rows of units with more ..."
            rows.append(("bounds", line, None, None, None, None, None, None, None, None))
        from dpsql.ir.build import plan_tree, tree_lines

        for line in tree_lines(plan_tree(plan)):  # the plan tree, root first
            rows.append(("plan", line, None, None, None, None, None, None, None, None))
        c = plan.cost
        budget = self.policy.budget
        rows.append(
            (
                "total",
                f"R={plan.max_rows} rows/group, G={plan.max_groups} groups/unit",
                plan.mechanism,
                None,
                None,
                None,
                c.epsilon if c.rho == 0 else budget.epsilon_of(c),
                c.delta,
                c.rho,
                None,
            )
        )
        engine_sql = compile_plan(plan, 0).render(self.engine.dialect)
        rows.append(("engine_sql", engine_sql, None, None, None, None, None, None, None, None))
        result = Result(EXPLAIN_COLUMNS, rows, status="EXPLAIN")
        result.notes = self.budget_notes(plan, analyst)
        return result

    def budget_notes(self, plan: Plan, analyst: str | None) -> list[str]:
        """EXPLAIN's warning when running ``plan`` now would be refused for budget (a read of
        the analyst's own budget: free, like SHOW budget)."""
        if analyst is None:
            return []
        try:
            self.ledger.check(analyst, self.policy.dataset, _with_choice(plan), self.policy.budget)
        except BudgetExhaustedError as exc:
            return [f"running this query would be refused: {exc.message}; nothing was spent"]
        return []


def _pending_choice(plan: Plan) -> Any:
    """The bounds choice (dpsql.service.bounds.Pending) the run of ``plan`` buys first, or None:
    contribution bounds or clamp ranges not yet bought by this analyst at this data version."""
    bounds = plan.extra.get("bounds")
    return None if bounds is None else bounds.pending


def _with_choice(plan: Plan) -> Any:
    """What running ``plan`` now charges: its cost, and first the bounds choice it buys."""
    pending = _pending_choice(plan)
    return plan.cost if pending is None else pending.cost + plan.cost


def _clamp_query(table: TablePolicy, column: str, hist: Any) -> CompiledQuery:
    """The engine query of a clamp range's histogram, with a fresh secret (its rows per unit
    are chosen by keyed hash): dpsql.service.bounds.buy runs it after the charge."""
    return clamp_histogram_query(table, column, hist, secrets.randbits(62))


def _range_rows(plan: Plan, budget: Any) -> list[tuple[Any, ...]]:
    """EXPLAIN's rows of what buys a range before the query's measures: each automatic clip
    (its ε inside the total) and a pending bounds choice, bought first as its own ledger entry
    (charged beside the total; once per analyst and data version with the answer cache on)."""
    rows: list[tuple[Any, ...]] = [
        (
            f"clip({clip.column})",
            f"|{clip.column}| on {clip.histogram.bins} log bins",
            "laplace",
            float(clip.max_values),
            None,
            float(clip.mechanism.mechanism.scale),
            clip.epsilon,
            0.0,
            0.0,
            None,
        )
        for clip in plan.clips
    ]
    if (pending := _pending_choice(plan)) is not None:
        p = pending.cost
        epsilon = p.epsilon if p.rho == 0 else budget.epsilon_of(p)
        rows.append(("choose", pending.describe(), "laplace", None, None, None, epsilon, p.delta,
                     p.rho, None))  # fmt: skip
    return rows


def _undrawable(what: str, *, bounds: bool = True) -> DataError:
    """The free refusal of a mechanism that cannot run at the plan's ε (SQLSTATE 22023)."""
    fix = ", or narrow the column's declared bounds" if bounds else ""
    return DataError(
        f"cannot draw noise for {what}: the noise scale is too large for the exact sampler "
        "at this epsilon",
        sqlstate="22023",
        construct="epsilon",
        hint=f"raise epsilon (SET epsilon = ...){fix}; nothing was spent",
    )
