"""``dp_linear_regression(...)`` and ``dp_logistic_regression(...)``: planning and release.

:func:`plan_regression` validates the call against the table's policy and fixes everything
the cost depends on, reading no data (refusals are free); :func:`run_regression` follows
the rule-list runner (dpsql.rulelist.sql_run) step by step: plan, ledger check, engine SQL
built from the policy (never the analyst's text), reserve, fetch and fit inside
:func:`charged_boundary`, cache by fingerprint, post-process in
:func:`post_processing_boundary`. :func:`explain_regression` shows the calibrated mechanism
and spends nothing. See docs/regression.md.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from sqlglot import exp

from dpsql.errors import PrivacyError, ProgrammingError, UndefinedColumnError
from dpsql.lower.builders import alias, coalesce, flag, literal
from dpsql.lower.hashing import with_secret
from dpsql.lower.row_values import cast, number, quoted
from dpsql.lower.rows import bound_note, bounded_rows
from dpsql.models import dpsgd
from dpsql.models import sufficient_stats as ss
from dpsql.models.regression import SCALE, RegressionModel, unscale
from dpsql.plan.canonical import canonical
from dpsql.policy import ColumnPolicy, TablePolicy
from dpsql.privacy.accounting import Cost
from dpsql.privacy.samplers import NoiseSource
from dpsql.rulelist.table_function import check_model_name, typed_positive
from dpsql.service.table_results import store_model, table_function_result
from dpsql.service.transaction import paid_once
from dpsql.table_functions import REGRESSION_COLUMNS

if TYPE_CHECKING:  # pragma: no cover
    from dpsql.service.protocol import Service
    from dpsql.service.results import Result
    from dpsql.service.settings import Settings

#: Result columns of ``SELECT * FROM dp_linear_regression(...)`` (and the logistic one).
COLUMNS = REGRESSION_COLUMNS  # the schema the binder checks against (dpsql.table_functions)
FUNCTIONS = {
    "dp_linear_regression": "linear_regression",
    "dp_logistic_regression": "logistic_regression",
}
INTERCEPT = "(intercept)"
MAX_FEATURES = 200  # XᵀX has D(D+1)/2 entries; DP-SGD's cost grows with d too

_NUMBER = (int, float)
_ARGUMENTS: dict[str, tuple[tuple[type, ...], str]] = {
    "label": ((str,), "a column name in quotes, e.g. label => 'cost'"),
    "features": ((str, list, tuple), "a list of column names, e.g. features => ['age', 'smoker']"),
    "positive": ((str, int, float, bool), "the positive class, e.g. positive => 'yes'"),
    "epsilon": (_NUMBER, "a number, e.g. epsilon => 1.0"),
    "delta": (_NUMBER, "a number, e.g. delta => 1e-6"),
    "method": ((str,), "'dpsgd' or 'sufficient_stats'"),
    "noise": ((str,), "'gaussian' or 'laplace'"),
    "steps": ((int,), "a whole number, e.g. steps => 1000"),
    "sample_rate": (_NUMBER, "a number in (0, 1], e.g. sample_rate => 0.01"),
    "clip": (_NUMBER, "a number > 0, e.g. clip => 1.0"),
    "learning_rate": (_NUMBER, "a number > 0, e.g. learning_rate => 1.0"),
    "l2": (_NUMBER, "a number >= 0, e.g. l2 => 1e-4"),
    "ridge": (_NUMBER, "a number >= 0, e.g. ridge => 10"),
    "model": ((str,), "a model name in quotes, e.g. model => 'cost_model'"),
}


def _refuse(message: str, construct: str, hint: str, sqlstate: str = "22023") -> ProgrammingError:
    return ProgrammingError(message, sqlstate=sqlstate, construct=construct, hint=hint)


@dataclass(frozen=True)
class Term:
    """One model feature: its display name, its value over the table's columns (a tree built
    from the policy, never text), and public bounds."""

    name: str
    expr: exp.Expression
    lower: float
    upper: float

    @property
    def sql(self) -> str:
        """The feature's text as a stored model keeps it (its predictions read it again,
        dpsql.models.regression): the tree rendered in DuckDB's dialect."""
        return self.expr.sql(dialect="duckdb")

    def scaled(self) -> exp.Expression:
        """The feature clipped to its bounds, mapped to [−1, 1], as an integer multiple of 2⁻¹⁰:
        ``CAST(ROUND((2.0 * LEAST(GREATEST(COALESCE(CAST(x AS DOUBLE), lo), lo), hi) - (lo +
        hi)) * factor) AS BIGINT)``."""
        lo, hi = self.lower, self.upper
        value = coalesce(cast(self.expr.copy(), "DOUBLE"), number(lo))
        # LEAST and GREATEST skip NULLs (DuckDB's and Spark's meaning; COALESCE leaves none)
        at_least = exp.Greatest(this=value, expressions=[number(lo)], ignore_nulls=True)
        clamped = exp.Least(this=at_least, expressions=[number(hi)], ignore_nulls=True)
        centred = exp.Sub(
            this=exp.Mul(this=number(2.0), expression=clamped), expression=number(lo + hi)
        )
        scaled = exp.Mul(this=exp.Paren(this=centred), expression=number(SCALE / (hi - lo)))
        return cast(exp.Round(this=scaled), "BIGINT")


@dataclass(frozen=True)
class RegressionPlan:
    function: str
    kind: str
    table: str
    label: str
    label_term: Term  # linear: the bounded label; logistic: its 0/1 indicator
    positive: Any
    terms: tuple[Term, ...]
    method: str
    mechanism: dpsgd.DPSGDPlan | ss.StatsPlan
    ridge: float | None
    model: str | None
    cost: Cost

    def expressions(self) -> list[str]:
        """Every generated expression, for the free type check on the empty shadow (the
        shadow's edge: the trees rendered there)."""
        return [t.sql for t in self.terms] + [self.label_term.sql]

    def columns(self) -> list[exp.Expression]:
        """f0 … f{d−1} (scaled integers), y (scaled or 0/1), m (label present), as trees:
        the planner's expressions, checked on the empty shadow."""
        cols: list[exp.Expression] = [alias(t.scaled(), f"f{i}") for i, t in enumerate(self.terms)]
        label = self.label_term
        if self.kind == "linear_regression":
            missing = exp.Is(this=label.expr.copy(), expression=exp.Null())
            zero, one = exp.Literal.number(0), exp.Literal.number(1)
            present = exp.Case(ifs=[exp.If(this=missing, true=zero)], default=one)
            cols += [alias(label.scaled(), "y"), alias(present, "m")]
        else:
            cols += [alias(label.expr.copy(), "y"), alias(exp.Literal.number(1), "m")]
        return cols

    def select_list(self) -> str:
        """:meth:`columns` as DuckDB text (for reading them, and tests that run them alone)."""
        return ", ".join(c.sql(dialect="duckdb") for c in self.columns())

    def items(self, unit: str | None) -> list[exp.Expression]:
        """The engine's select list as trees: :meth:`columns`, then u, the unit's number
        among the bounded rows (DENSE_RANK over the unit; without a unit each row its own,
        ROW_NUMBER): DP-SGD samples and clips per unit by it."""
        return [*self.columns(), alias(unit_number(unit), "u")]


def unit_number(unit: str | None) -> exp.Window:
    """``DENSE_RANK() OVER (ORDER BY unit)``, or ``ROW_NUMBER() OVER (ORDER BY 1)`` without a
    unit: a number per unit (per row), the same for every row of a unit."""
    rank: exp.Expression = exp.DenseRank() if unit else exp.RowNumber()
    order = quoted(unit) if unit else exp.Literal.number(1)
    return exp.Window(
        this=rank, order=exp.Order(expressions=[exp.Ordered(this=order)]), over="OVER"
    )


# --- planning (no data) ------------------------------------------------------------------


def _check_types(function: str, arguments: dict[str, Any]) -> None:
    for name, value in arguments.items():
        if name not in _ARGUMENTS:
            raise _refuse(
                f"{function} has no argument {name!r}",
                name,
                "arguments: " + ", ".join(sorted(_ARGUMENTS)),
                sqlstate="42883",
            )
        types, say = _ARGUMENTS[name]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if ok and name == "features" and not isinstance(value, str):
            ok = all(isinstance(v, str) for v in value)
        if ok and isinstance(value, float):
            ok = math.isfinite(value)
        if not ok:
            raise _refuse(
                f"{function} argument {name} has the wrong type",
                name,
                f"pass {name} => {say}",
                sqlstate="42804",
            )


def terms_of(col: ColumnPolicy) -> list[Term]:
    """Model features of one column from its declared domain: [] when it has none."""
    if col.type == "bool":
        return [
            Term(col.name, flag(exp.Is(this=quoted(col.name), expression=exp.true())), 0.0, 1.0)
        ]
    if col.values is not None and len(col.values) >= 2:
        return [
            Term(
                f"{col.name} = {literal(v).sql(dialect='duckdb')}",
                flag(exp.EQ(this=quoted(col.name), expression=literal(v))),
                0.0,
                1.0,
            )
            for v in col.values[1:]  # the first value is the reference level
        ]
    if col.numeric and col.bounded and float(col.upper) > float(col.lower):  # type: ignore[arg-type]
        return [Term(col.name, quoted(col.name), float(col.lower), float(col.upper))]  # type: ignore[arg-type]
    return []


def _columns(table: TablePolicy, label: ColumnPolicy, features: Any) -> list[ColumnPolicy]:
    cols = {name.lower(): c for name, c in table.columns.items()}
    if features is None:
        skip = {label.name.lower(), (table.privacy_unit or "").lower()}
        return [c for n, c in cols.items() if n not in skip and terms_of(c)]
    if isinstance(features, str):
        features = [f.strip() for f in features.split(",") if f.strip()]
    chosen = []
    for name in features:
        c = cols.get(name.lower())
        if c is None:
            raise UndefinedColumnError(
                f"feature column {name!r} does not exist in table {table.name!r}",
                construct=name,
                hint="name columns of the table in features => [...]",
            )
        if c.name.lower() == label.name.lower():
            raise _refuse("the label cannot be a feature", name, "remove it from features")
        chosen.append(c)
    return chosen


def _terms(table: TablePolicy, cols: Sequence[ColumnPolicy]) -> tuple[Term, ...]:
    terms: list[Term] = []
    for c in cols:
        made = terms_of(c)
        if not made:
            raise PrivacyError(
                f"feature column {c.name!r} has no declared public domain",
                construct=c.name,
                hint='declare lower/upper bounds (numbers), values = [...] or type = "bool" '
                "for it in the policy",
            )
        terms.extend(made)
    if not terms:
        raise PrivacyError(
            f"table {table.name!r} has no column with declared bounds or values to use as a "
            "feature",
            construct=table.name,
            hint="declare bounds or values for some columns in the policy",
        )
    if len(terms) > MAX_FEATURES:
        raise _refuse(
            f"{len(terms)} model features exceed the limit of {MAX_FEATURES}",
            "features",
            "name fewer columns in features => [...]",
            sqlstate="54000",
        )
    return tuple(terms)


def _label(kind: str, lab: ColumnPolicy, positive: Any) -> tuple[Term, Any]:
    if kind == "linear_regression":
        if not (lab.numeric and lab.bounded and float(lab.upper) > float(lab.lower)):  # type: ignore[arg-type]
            raise PrivacyError(
                f"label column {lab.name!r} needs declared numeric bounds",
                construct=lab.name,
                hint="declare lower and upper for it in the policy: they bound the sensitivity",
            )
        if positive is not None:
            raise _refuse(
                "positive => applies to dp_logistic_regression only", "positive", "drop it"
            )
        return Term(lab.name, quoted(lab.name), float(lab.lower), float(lab.upper)), None  # type: ignore[arg-type]
    if positive is None:
        if lab.type != "bool":
            raise _refuse(
                f"label column {lab.name!r} is not boolean: say which value is the positive class",
                "positive",
                f"pass positive => a value of {lab.name}",
            )
        positive = True
    literal = typed_positive(lab, positive)
    if lab.values is not None and positive not in lab.values:
        raise _refuse(
            f"positive => {positive!r} is not among the declared values of {lab.name!r}",
            "positive",
            "use one of: " + ", ".join(map(repr, lab.values)),
        )
    return Term(
        lab.name, flag(exp.EQ(this=quoted(lab.name), expression=literal)), 0.0, 1.0
    ), positive


def _needs_delta(function: str, delta: float | None, what: str) -> float:
    if delta is None or delta <= 0:
        raise PrivacyError(
            f"{function} with {what} needs delta > 0 (it is (epsilon, delta)-DP)",
            construct="delta",
            hint="SET delta = 1e-6 or pass delta => 1e-6 (within the budget's delta); for pure "
            "epsilon use dp_linear_regression with method => 'sufficient_stats', "
            "noise => 'laplace'",
        )
    if delta >= 1:
        raise _refuse("delta must be < 1", "delta", "pass delta => 1e-6")
    return float(delta)


def plan_regression(
    function: str,
    table: TablePolicy,
    *,
    label: str,
    features: Any = None,
    positive: Any = None,
    epsilon: float = 1.0,
    delta: float | None = None,
    method: str | None = None,
    noise: str = "gaussian",
    steps: int = 1000,
    sample_rate: float = 0.01,
    clip: float = 1.0,
    learning_rate: float = 1.0,
    l2: float = 1e-4,
    ridge: float | None = None,
    model: str | None = None,
) -> RegressionPlan:
    """Validate a call and calibrate its mechanism, reading no data; refusals are free."""
    passed = {k: v for k, v in locals().items() if k not in ("function", "table") and v is not None}
    _check_types(function, passed)
    kind = FUNCTIONS[function]
    method = method or ("sufficient_stats" if kind == "linear_regression" else "dpsgd")
    allowed = ("dpsgd", "sufficient_stats") if kind == "linear_regression" else ("dpsgd",)
    if method not in allowed:
        raise _refuse(
            f"{function} has no method {method!r}", "method", "use one of: " + ", ".join(allowed)
        )
    if not (epsilon > 0):
        raise _refuse("epsilon must be > 0", "epsilon", "pass epsilon => 1.0")
    cols = {name.lower(): c for name, c in table.columns.items()}
    lab = cols.get(label.lower())
    if lab is None:
        raise UndefinedColumnError(
            f"label column {label!r} does not exist in table {table.name!r}",
            construct=label,
            hint="pass label => one of the table's columns",
        )
    label_term, positive = _label(kind, lab, positive)
    terms = _terms(table, _columns(table, lab, features))
    # an "auto" R is chosen on aggregate queries only: its fallback here (dpsql.policy)
    rows_per_unit = 1 if table.row_level else table.unchosen_bounds()[0]
    mechanism: dpsgd.DPSGDPlan | ss.StatsPlan
    if method == "dpsgd":
        config = dpsgd.DPSGDConfig(
            float(epsilon), _needs_delta(function, delta, "method => 'dpsgd'"), steps,
            float(sample_rate), float(clip), float(learning_rate), float(l2), rows_per_unit,
        )  # fmt: skip
        try:
            mechanism = dpsgd.plan_dpsgd(config)
        except ValueError as exc:
            what = str(exc).split()[0]  # the messages start with the parameter's name
            raise _refuse(f"{function}: {exc}", what, f"pass a valid {what}") from None
    else:
        if noise not in ss.NOISES:
            raise _refuse(f"unknown noise {noise!r}", "noise", "use 'gaussian' or 'laplace'")
        if noise == "gaussian":
            delta = _needs_delta(function, delta, "noise => 'gaussian'")
        try:
            mechanism = ss.plan_sufficient_stats(
                float(epsilon), delta or 0.0, len(terms), rows_per_unit, noise
            )
            ss.check_drawable(mechanism)
        except ValueError as exc:
            raise _refuse(f"{function}: {exc}", "epsilon", "raise epsilon (or delta)") from None
    if ridge is not None and not ridge >= 0:
        raise _refuse("ridge must be >= 0", "ridge", "pass ridge => 10, or leave it out")
    if model is not None:
        check_model_name(model)
    return RegressionPlan(
        function, kind, table.name, lab.name, label_term, positive, terms, method, mechanism,
        None if ridge is None else float(ridge), model, mechanism.cost,
    )  # fmt: skip


# --- release (after the charge) --------------------------------------------------------------


def release_regression(
    plan: RegressionPlan,
    matrix: np.ndarray,
    source: NoiseSource,
    check: Callable[[], None] | None = None,
) -> dict:
    """Fit on the fetched integer matrix (f…, y, m, u) and return the released answer.

    Only released values leave: coefficients, bootstrap intervals from the released
    statistics (sufficient statistics), the noisy row count. ``check`` (the query's cancel
    check) runs before each DP-SGD step and each bootstrap draw.
    """
    d = len(plan.terms)
    matrix = matrix.reshape(-1, d + 3)
    matrix = matrix[matrix[:, d + 1] == 1]  # rows whose label is present
    Z = np.column_stack([np.ones(len(matrix)), matrix[:, :d] / SCALE])
    lo = np.array([t.lower for t in plan.terms])
    hi = np.array([t.upper for t in plan.terms])
    linear = plan.kind == "linear_regression"
    y = matrix[:, d] / SCALE if linear else matrix[:, d].astype(np.float64)
    label = (plan.label_term.lower, plan.label_term.upper) if linear else None
    low = high = None
    mech = plan.mechanism
    if isinstance(mech, ss.StatsPlan):
        released = ss.noisy_statistics(mech, Z, y, source)
        ridge = ss.default_ridge(mech) if plan.ridge is None else plan.ridge
        xtx, xty, _ = ss.unpack(mech, released)
        w = ss.ridge_solve(xtx, xty, ridge)
        sims = ss.bootstrap_draws(mech, released, ridge, source, check=check)
        b0, bc = unscale(sims, lo, hi, label)
        sims = np.column_stack([b0, bc])
        low, high = np.percentile(sims, [2.5, 97.5], axis=0)
        noisy_n = float(xtx[0, 0])
    else:
        rows = dpsgd.unit_rows(matrix[:, d + 2], len(matrix), mech.config.rows_per_unit)
        loss = "squared" if linear else "logistic"
        w, noisy_n = dpsgd.train_dpsgd(mech, loss, Z, y, rows, source, check=check)
    b0, bc = unscale(w, lo, hi, label)
    coefficients = [float(b0[0]), *map(float, bc[0])]
    names = [INTERCEPT, *(t.name for t in plan.terms)]
    out = []
    for i, (name, c) in enumerate(zip(names, coefficients, strict=True)):
        interval = (None, None) if low is None else (float(low[i]), float(high[i]))  # type: ignore[index]
        out.append([i, name, c, *interval])
    model = RegressionModel(
        plan.kind, tuple(t.name for t in plan.terms), tuple(t.sql for t in plan.terms),
        tuple(lo), tuple(hi), tuple(coefficients[1:]), coefficients[0], plan.label, plan.positive,
    )  # fmt: skip
    notes = [f"noisy row count {noisy_n:.0f} (a released value)"]
    return {"rows": out, "notes": notes, "model": model.to_dict()}


# --- the pipeline's dispatch ---------------------------------------------------------------


def _plan_call(service: Service, call: Any, settings: Settings) -> RegressionPlan:
    from dpsql.frontend.typecheck import check_binds

    if call.function not in FUNCTIONS:
        raise _refuse(f"unknown table function {call.function!r}", call.function, "", "42883")
    arguments = dict(call.arguments)
    arguments.setdefault("epsilon", settings.epsilon)
    if "delta" not in arguments and settings.delta > 0:
        arguments["delta"] = settings.delta
    known = set(inspect.signature(plan_regression).parameters) - {"function", "table"}
    if "label" not in arguments:
        raise _refuse(f"{call.function} needs label => 'column'", "label", "", "42883")
    for name in arguments:  # before the call, so an unknown name is a refusal, not a TypeError
        if name not in known:
            _check_types(call.function, {name: arguments[name]})
    plan = plan_regression(call.function, call.table, **arguments)
    check_binds(service.shadow, call.table.name, plan.expressions())
    return plan


def _fingerprint(service: Service, call: Any, settings: Settings) -> str:
    return hashlib.sha256(
        repr(
            (
                call.function,
                call.table.name,
                canonical(call.table),  # the table as declared: a policy edit is another fit
                # model => only names where the release is kept: naming it re-uses the fit
                sorted((k, v) for k, v in call.arguments.items() if k != "model"),
                settings.as_dict(),
                service.data_version(call.table),
            )
        ).encode()
    ).hexdigest()


def _check_budget_delta(service: Service, plan: RegressionPlan, analyst: str) -> None:
    budget = service.ledger.budget(analyst, service.policy.dataset, service.policy.budget)
    if plan.cost.exact_delta > 0 and budget.exact_pure_delta == 0:
        raise PrivacyError(
            f"{plan.function} spends delta = {plan.cost.delta:.3g}, and this budget has no delta",
            construct="delta",
            hint="ask the operator for a budget with delta > 0; for pure epsilon use "
            "dp_linear_regression with method => 'sufficient_stats', noise => 'laplace'",
        )


def run_regression(
    service: Service, call: Any, settings: Settings, analyst: str, handle: Any
) -> Result:
    """dpsql.rulelist.sql_run.run_rule_list's order, for the regression table functions."""
    from dpsql.engine.api import cancel_check
    from dpsql.engine.scratch import check_post
    from dpsql.frontend.statements import DIALECT

    plan = _plan_call(service, call, settings)
    check_post(call.post.sql(dialect=DIALECT), call.post)
    fingerprint = _fingerprint(service, call, settings)
    table = call.table
    query = with_secret(bounded_rows(table, plan.items(table.privacy_unit)), secrets.randbits(62))

    def execute() -> tuple[str, bool]:
        matrix = service.engine.fetch_matrix(query, handle)
        return json.dumps(
            release_regression(plan, matrix, service.noise, cancel_check(handle))
        ), True

    paid = paid_once(
        service, analyst, text=call.text, plan_hash=fingerprint, cost=plan.cost, handle=handle,
        execute=execute, cache_key="regression:" + fingerprint,
        before_budget=lambda: _check_budget_delta(service, plan, analyst),
    )  # fmt: skip
    answer, cost, not_cached = paid.answer, paid.charged, paid.note
    result, data = table_function_result(service, call, answer, cost, COLUMNS)
    if not_cached:
        result.notes.append(not_cached)
    if plan.model is not None:
        store_model(service, plan, plan.kind, analyst, call.text, data["model"], result)
    return result


def explain_rows(plan: RegressionPlan) -> list[tuple[Any, ...]]:
    """EXPLAIN rows in the pipeline's EXPLAIN columns; their costs sum to ``plan.cost``."""
    head = f"{plan.function}({plan.table}, label => {plan.label})"
    mech = plan.mechanism
    if isinstance(mech, ss.StatsPlan):
        ridge = "auto" if plan.ridge is None else f"{plan.ridge:g}"
        what = (
            f"sufficient statistics XtX, Xty, yty ({mech.size} values, {len(plan.terms)} "
            f"features + intercept), rows per unit {mech.rows_per_unit}, ridge {ridge}"
        )
        kind = f"discrete_{mech.noise}"
        return [
            (head, what, kind, mech.l1, mech.l2, mech.scale, mech.epsilon, mech.delta, 0.0, None)
        ]
    c = mech.config
    count = (
        head, "noisy row count (normalises the gradient)", "discrete_laplace",
        float(c.rows_per_unit), None, mech.count_scale, mech.count_epsilon, 0.0, 0.0, None,
    )  # fmt: skip
    sgd = (
        head,
        f"DP-SGD: steps {c.steps}, sample rate q {c.sample_rate:g}, clip C {c.clip:g}, "
        f"rows per unit R {c.rows_per_unit}, noise multiplier z {mech.noise_multiplier:.4g}, "
        f"sigma {mech.noise_std:.4g} (std on the clipped sum, z*R*C), learning rate "
        f"{c.learning_rate:g}; accountant epsilon {mech.accounted_epsilon:.4g}",
        "poisson_subsampled_gaussian (RDP, improved conversion)",
        None, float(c.rows_per_unit * c.clip), mech.noise_std,
        mech.sgd_epsilon, c.delta, 0.0, None,
    )  # fmt: skip
    cost = plan.cost
    total = (
        "total", "the call's cost: both measurements, charged once before reading", None,
        None, None, None, float(cost.epsilon), float(cost.delta), float(cost.rho or 0.0), None,
    )  # fmt: skip
    return [total, count, sgd]


def explain_regression(service: Service, call: Any, settings: Settings) -> Result:
    from dpsql.service.results import EXPLAIN_COLUMNS, Result

    plan = _plan_call(service, call, settings)
    result = Result(EXPLAIN_COLUMNS, explain_rows(plan), status="EXPLAIN")
    result.notes = [bound_note(call.table)]  # the row input's bounding (dpsql.lower.rows)
    return result
