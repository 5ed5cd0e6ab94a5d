"""scikit-learn style DP linear and logistic regression, and the model they release.

``DPLinearRegression`` (noisy sufficient statistics, or DP-SGD on the squared loss) and
``DPLogisticRegression`` (DP-SGD on the logistic loss) follow scikit-learn's conventions
(``get_params`` / ``set_params``, ``fit`` returns self, trailing-underscore fitted attributes)
without importing it, and are clone-able. Features are clipped to their declared ``bounds``
and scaled to [−1, 1]; the linear label likewise to ``label_bounds``. Both must be given: a
default range would clip silently (a [0, 1] default made a fit on raw data predict the majority
class), so a fit without them is refused, free, with the fix; ``bounds="auto"`` buys DP
feature bounds with 10% of ε instead (:mod:`dpsql.models.approx_bounds`). Both land on the
lattice 2⁻¹⁰ the SQL path uses, so the estimator and ``dp_linear_regression`` fit the same
design.

``ledger=`` (a dpsql connection, a Service with ``analyst=``, or a
:class:`~dpsql.privacy.spend.LedgerAccount`) charges the fit's cost before it reads X; without
one the fit emits an :class:`~dpsql.privacy.spend.UnrecordedSpendWarning`. See
docs/regression.md.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpsql.errors import PrivacyError
from dpsql.models import approx_bounds, dpsgd
from dpsql.models import sufficient_stats as ss
from dpsql.privacy import spend
from dpsql.privacy.accounting import Cost
from dpsql.privacy.samplers import NoiseSource, SecureNoise, SeededNoise
from dpsql.terminal import fit_progress

KINDS = ("linear_regression", "logistic_regression")
METHODS = ("sufficient_stats", "dpsgd")
SCALE = 1 << ss.FEATURE_BITS


# --- design: clip, scale to [-1, 1], round to the lattice ---------------------------------


class BoundsRequiredError(PrivacyError, ValueError):
    """A fit without declared bounds: refused before anything is read or spent (42501).
    Also a ValueError, as scikit-learn's callers expect of a bad parameter."""


def _bounds(
    bounds: Any, d: int, what: str = "bounds", example: str = "bounds=([0, 18], [1, 90])"
) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) per feature; refused when not given (no silent default range)."""
    if bounds is None:
        raise BoundsRequiredError(
            f"{what} are required: the fit clips every value to them and they set the "
            "sensitivity, so a default range would clip silently",
            construct=what,
            hint=f"pass {what}=(lower, upper) from public knowledge, not from the data, one "
            f"value or one list entry per column, e.g. {example}"
            + (
                ", or bounds='auto' (10% of epsilon buys DP bounds, docs/regression.md)"
                if what == "bounds"
                else ""
            ),
        )
    try:
        lo_, hi_ = bounds
        lo = np.broadcast_to(np.asarray(lo_, dtype=np.float64), (d,)).copy()
        hi = np.broadcast_to(np.asarray(hi_, dtype=np.float64), (d,)).copy()
    except (TypeError, ValueError):
        raise ValueError(
            f"{what} must be (lower, upper): two numbers, or two lists with one entry per column"
        ) from None
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(hi > lo)):
        raise ValueError(f"{what} must be finite with upper > lower for every feature")
    return lo, hi


def scale_to_lattice(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Clip to [lo, hi], map to [−1, 1], round to multiples of 2⁻¹⁰ (NaN -> lower, as SQL's
    COALESCE(x, lower) does)."""
    x = np.asarray(x, dtype=np.float64)
    x = np.clip(np.where(np.isnan(x), lo, x), lo, hi)
    unit = (2 * x - lo - hi) / (hi - lo)
    return np.clip(np.rint(unit * SCALE), -SCALE, SCALE) / SCALE


def design(X: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The scaled design with the intercept's column of ones first."""
    return np.column_stack([np.ones(len(X)), scale_to_lattice(X, lo, hi)])


def unscale(
    w: np.ndarray, lo: np.ndarray, hi: np.ndarray, label: tuple[float, float] | None
) -> tuple[np.ndarray, np.ndarray]:
    """(intercepts, coefficients) in the original units for rows of scaled weights ``w``."""
    w = np.atleast_2d(w)
    a = 2.0 / (hi - lo)
    b = -(lo + hi) / (hi - lo)
    coef = w[:, 1:] * a
    intercept = w[:, 0] + w[:, 1:] @ b
    if label is not None:
        half, mid = (label[1] - label[0]) / 2, (label[1] + label[0]) / 2
        coef, intercept = coef * half, intercept * half + mid
    return intercept, coef


# --- the released model, as data -----------------------------------------------------------


@dataclass(frozen=True)
class RegressionModel:
    """What a fit releases: enough to predict in Python and in SQL, nothing else."""

    kind: str
    features: tuple[str, ...]  # display names
    feature_sql: tuple[str, ...]  # SQL over the source table, one per feature
    lower: tuple[float, ...]
    upper: tuple[float, ...]
    coefficients: tuple[float, ...]  # original units, applied to clipped features
    intercept: float
    label: str | None = None
    positive: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "features": list(self.features),
            "feature_sql": list(self.feature_sql),
            "lower": list(self.lower),
            "upper": list(self.upper),
            "coefficients": list(self.coefficients),
            "intercept": self.intercept,
            "label": self.label,
            "positive": self.positive,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegressionModel:
        return cls(
            data["kind"],
            tuple(data["features"]),
            tuple(data["feature_sql"]),
            tuple(float(v) for v in data["lower"]),
            tuple(float(v) for v in data["upper"]),
            tuple(float(v) for v in data["coefficients"]),
            float(data["intercept"]),
            data.get("label"),
            data.get("positive"),
        )

    def linear_tree(self) -> Any:
        """intercept + Σ (coef) · LEAST(GREATEST(COALESCE(CAST(feature AS DOUBLE), lo), lo),
        hi): the linear predictor as a sqlglot tree. A stored model keeps each feature as
        text (``feature_sql``, the table function's tree rendered): that text is parsed here,
        once per feature; the rest is built, never spliced."""
        import sqlglot
        from sqlglot import exp

        out = _number(float(self.intercept))
        for sql, lo, hi, c in zip(
            self.feature_sql, self.lower, self.upper, self.coefficients, strict=True
        ):
            lo, hi = float(lo), float(hi)  # plain floats: repr(np.float64) is not SQL
            feature = sqlglot.parse_one(sql, read="duckdb")
            value: exp.Expression = exp.Cast(
                this=feature, to=exp.DataType(this=exp.DataType.Type.DOUBLE)
            )
            value = exp.Coalesce(this=value, expressions=[_number(lo)])
            value = exp.Greatest(this=value, expressions=[_number(lo)], ignore_nulls=True)
            value = exp.Least(this=value, expressions=[_number(hi)], ignore_nulls=True)
            term = exp.Mul(this=exp.Paren(this=_number(float(c))), expression=value)
            out = exp.Add(this=out, expression=term)
        return out

    def predict_tree(self) -> Any:
        """The prediction as a sqlglot tree: the linear predictor, or the positive-class
        probability ``1.0 / (1.0 + EXP(-(linear)))``."""
        from sqlglot import exp

        linear = self.linear_tree()
        if self.kind != "logistic_regression":
            return linear
        exponent = exp.Exp(this=exp.Neg(this=exp.Paren(this=linear)))
        denominator = exp.Paren(this=exp.Add(this=_number(1.0), expression=exponent))
        return exp.Div(this=_number(1.0), expression=denominator, typed=False, safe=False)

    def linear_sql(self) -> str:
        """:meth:`linear_tree` as a DuckDB expression."""
        return str(self.linear_tree().sql(dialect="duckdb"))

    def predict_sql(self) -> str:
        """Prediction in SQL (:meth:`predict_tree` in DuckDB's dialect): the linear predictor,
        or the positive-class probability."""
        return str(self.predict_tree().sql(dialect="duckdb"))


def _number(value: float) -> Any:
    """A float literal spelt as Python prints it (``repr``: every digit), a negative one as
    the negation of its magnitude (as the parser reads ``-2.5e-09``)."""
    from sqlglot import exp

    text = repr(value)
    if text.startswith("-"):
        return exp.Neg(this=exp.Literal(this=text[1:], is_string=False))
    return exp.Literal(this=text, is_string=False)


def predictor(model_json: dict[str, Any]) -> Any:
    """PREDICTORS entry: the model dict -> a sqlglot expression computing the prediction."""
    return RegressionModel.from_dict(model_json).predict_tree()


# --- estimators -----------------------------------------------------------------------------


class _Params:
    """get_params / set_params from the __init__ signature, as scikit-learn's clone expects."""

    # fitted by the subclasses' fit (declared for the shared helpers below; no class value)
    coef_: np.ndarray
    intercept_: float
    bounds_: tuple[np.ndarray, np.ndarray]  # the feature bounds the fit clipped to

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        return {name: getattr(self, name) for name in names}

    def set_params(self, **params: Any) -> _Params:
        valid = self.get_params()
        for name, value in params.items():
            if name not in valid:
                raise ValueError(f"invalid parameter {name!r} for {type(self).__name__}")
            setattr(self, name, value)
        return self

    def __sklearn_tags__(self) -> Any:  # scikit-learn >= 1.6 asks for tags
        from sklearn.utils import ClassifierTags, RegressorTags, Tags, TargetTags

        classifier = self._estimator_type == "classifier"  # type: ignore[attr-defined]
        return Tags(
            estimator_type=self._estimator_type,  # type: ignore[attr-defined]
            target_tags=TargetTags(required=True),
            classifier_tags=ClassifierTags(multi_class=False) if classifier else None,
            regressor_tags=None if classifier else RegressorTags(),
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({args})"

    def _account(self) -> spend.LedgerAccount | None:
        return spend.account(self.ledger, self.analyst)  # type: ignore[attr-defined]

    def _pay(self, account: spend.LedgerAccount | None, cost: Cost) -> None:
        """Charge the fit's cost before it reads X (or warn that no ledger records it)."""
        name = type(self).__name__
        text = spend.params_text(name, self.get_params())
        # fit -> _pay_and_bound -> _pay -> charge: the warning names the caller of fit
        spend.charge(account, cost, f"{name}.fit", text, stacklevel=5)

    def _source(self) -> NoiseSource:
        rs = self.random_state  # type: ignore[attr-defined]
        return SecureNoise() if rs is None else SeededNoise(int(rs))

    def _delta(self, n: int) -> float:
        d = self.delta  # type: ignore[attr-defined]
        return float(d) if d is not None else 1.0 / max(n, 2) ** 2

    def _prepare(self, X: Any, groups: Any) -> tuple[np.ndarray, np.ndarray]:
        """(X as floats, the (units × R) row matrix); declared bounds checked into bounds_."""
        if self.bounds is None:  # type: ignore[attr-defined]
            _bounds(None, 0)  # refused before X is read
        names = [str(c) for c in X.columns] if hasattr(X, "columns") else None
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2:
            raise ValueError("X must be 2-dimensional")
        d = X.shape[1]
        if not self._auto_bounds():
            self.bounds_ = _bounds(self.bounds, d)  # type: ignore[attr-defined]
        rows = dpsgd.unit_rows(groups, len(X), self.rows_per_unit)  # type: ignore[attr-defined]
        self.n_features_in_ = d
        self.feature_names_in_ = names or [f"x{i}" for i in range(d)]
        return X, rows

    def _auto_bounds(self) -> bool:
        bounds = self.bounds  # type: ignore[attr-defined]
        return isinstance(bounds, str) and bounds == "auto"

    def _fit_epsilon(self) -> float:
        """The ε the model's mechanism gets: all of it, or what ``bounds="auto"`` leaves."""
        epsilon = float(self.epsilon)  # type: ignore[attr-defined]
        return epsilon * (1 - approx_bounds.SHARE) if self._auto_bounds() else epsilon

    def _pay_and_bound(
        self,
        account: spend.LedgerAccount | None,
        cost: Cost,
        X: np.ndarray,
        rows: np.ndarray,
        source: NoiseSource,
    ) -> tuple[np.ndarray, np.ndarray, Cost]:
        """Charge the fit (the model's ``cost``, plus the bounds' share under "auto"), then
        the feature bounds: declared, or chosen privately (dpsql.models.approx_bounds)."""
        if not self._auto_bounds():
            self._pay(account, cost)
            return self.bounds_[0], self.bounds_[1], cost
        # exact rationals: the share and the model's part add up to the ε asked for
        share = Cost(float(self.epsilon)) + -Cost(self._fit_epsilon())  # type: ignore[attr-defined]
        total = share + cost
        self._pay(account, total)
        r = int(self.rows_per_unit)  # type: ignore[attr-defined]
        self.bounds_ = approx_bounds.approximate_bounds(X, rows, r, share.epsilon, source)
        self.bounds_cost_ = share
        return self.bounds_[0], self.bounds_[1], total

    def _dpsgd_config(self, delta: float) -> dpsgd.DPSGDConfig:
        return dpsgd.DPSGDConfig(
            epsilon=self._fit_epsilon(),
            delta=delta,
            steps=int(self.steps),  # type: ignore[attr-defined]
            sample_rate=float(self.sample_rate),  # type: ignore[attr-defined]
            clip=float(self.clip),  # type: ignore[attr-defined]
            learning_rate=float(self.learning_rate),  # type: ignore[attr-defined]
            l2=float(self.l2),  # type: ignore[attr-defined]
            rows_per_unit=int(self.rows_per_unit),  # type: ignore[attr-defined]
        )

    def _model(
        self, kind: str, feature_sql: Sequence[str] | None, positive: Any
    ) -> RegressionModel:
        lo, hi = self.bounds_
        names = tuple(self.feature_names_in_)
        return RegressionModel(
            kind,
            names,
            tuple(feature_sql or names),
            tuple(map(float, lo)),
            tuple(map(float, hi)),
            tuple(float(c) for c in self.coef_),
            float(self.intercept_),
            positive=positive,
        )

    def _linear(self, X: Any) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        lo, hi = self.bounds_
        x = np.clip(np.where(np.isnan(X), lo, X), lo, hi)
        return x @ self.coef_ + self.intercept_


class DPLinearRegression(_Params):
    """(ε, δ)-DP linear regression: noisy sufficient statistics (default) or DP-SGD.

    ``bounds=(lower, upper)`` (per feature) and ``label_bounds=(low, high)`` are required:
    they clip the values and set the sensitivity; a fit without them is refused (free).
    ``ledger=`` / ``analyst=``: where the fit's cost is charged (see the module docstring).
    ``noise`` ('gaussian' | 'laplace', sufficient statistics only; laplace is pure ε),
    ``ridge`` (None: about the noise's spectral norm), ``intervals`` (bootstrap, sufficient
    statistics only). Fitted: ``coef_``, ``intercept_``, ``coef_interval_`` (d × 2, or None),
    ``intercept_interval_``, ``cost_``, ``mechanism_`` (the calibrated plan).
    """

    _estimator_type = "regressor"

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float | None = None,
        method: str = "sufficient_stats",
        bounds: Any = None,
        label_bounds: tuple[float, float] | None = None,
        noise: str = "gaussian",
        ridge: float | None = None,
        intervals: bool = True,
        steps: int = 1000,
        sample_rate: float = 0.01,
        clip: float = 1.0,
        learning_rate: float = 1.0,
        l2: float = 1e-4,
        rows_per_unit: int = 1,
        random_state: int | None = None,
        verbose: bool = False,
        ledger: Any = None,
        analyst: str | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.delta = delta
        self.method = method
        self.bounds = bounds
        self.label_bounds = label_bounds
        self.noise = noise
        self.ridge = ridge
        self.intervals = intervals
        self.steps = steps
        self.sample_rate = sample_rate
        self.clip = clip
        self.learning_rate = learning_rate
        self.l2 = l2
        self.rows_per_unit = rows_per_unit
        self.random_state = random_state
        self.verbose = verbose
        self.ledger = ledger
        self.analyst = analyst

    def fit(self, X: Any, y: Any, groups: Any = None) -> DPLinearRegression:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}")
        account = self._account()
        (ylo,), (yhi,) = _bounds(self.label_bounds, 1, "label_bounds", "label_bounds=(0, 5000)")
        X, rows = self._prepare(X, groups)
        keep = rows[rows >= 0]
        ys = scale_to_lattice(np.asarray(y, dtype=np.float64)[:, None], ylo, yhi)[:, 0]
        source = self._source()
        delta = self._delta(len(keep))
        label = (float(ylo), float(yhi))
        self.coef_interval_ = self.intercept_interval_ = None
        plan: ss.StatsPlan | dpsgd.DPSGDPlan
        if self.method == "sufficient_stats":
            plan = ss.plan_sufficient_stats(
                self._fit_epsilon(), delta, X.shape[1], int(self.rows_per_unit), self.noise
            )
            ss.check_drawable(plan)
            lo, hi, cost = self._pay_and_bound(account, plan.cost, X, rows, source)
            released = ss.noisy_statistics(plan, design(X[keep], lo, hi), ys[keep], source)
            ridge = ss.default_ridge(plan) if self.ridge is None else float(self.ridge)
            xtx, xty, _ = ss.unpack(plan, released)
            w = ss.ridge_solve(xtx, xty, ridge)
            if self.intervals:
                sims = ss.bootstrap_draws(plan, released, ridge, source)
                b0, bc = unscale(sims, lo, hi, label)
                self.intercept_interval_ = tuple(np.percentile(b0, [2.5, 97.5]))
                self.coef_interval_ = np.percentile(bc, [2.5, 97.5], axis=0).T
            self.n_noisy_ = float(xtx[0, 0])
        else:
            plan = dpsgd.plan_dpsgd(self._dpsgd_config(delta))
            lo, hi, cost = self._pay_and_bound(account, plan.cost, X, rows, source)
            Z = design(X, lo, hi)
            with fit_progress(plan.config.steps, "DP-SGD", self.verbose) as advance:
                w, self.n_noisy_ = dpsgd.train_dpsgd(
                    plan, "squared", Z, ys, rows, source, check=advance
                )
        b0, bc = unscale(w, lo, hi, label)
        self.intercept_, self.coef_ = float(b0[0]), bc[0]
        self.mechanism_ = plan
        self.cost_ = cost
        return self

    def predict(self, X: Any) -> np.ndarray:
        return self._linear(X)

    def score(self, X: Any, y: Any) -> float:
        """R² of the predictions."""
        y = np.asarray(y, dtype=np.float64)
        resid = y - self.predict(X)
        total = ((y - y.mean()) ** 2).sum()
        return float(1 - (resid @ resid) / total) if total > 0 else 0.0

    def model(self, feature_sql: Sequence[str] | None = None) -> RegressionModel:
        """The released model; ``feature_sql`` names the SQL column of each feature."""
        return self._model("linear_regression", feature_sql, None)


class DPLogisticRegression(_Params):
    """(ε, δ)-DP logistic regression by DP-SGD (Poisson sampling, clipping, RDP accounting).

    ``bounds=(lower, upper)`` (per feature) is required; ``ledger=`` / ``analyst=`` as for
    :class:`DPLinearRegression`. ``y`` takes two classes (any labels); ``classes_[1]`` is the
    positive class. Fitted:
    ``coef_``, ``intercept_``, ``classes_``, ``cost_``, ``mechanism_`` (the calibrated plan:
    ``noise_multiplier``, ``noise_std``), ``n_noisy_``.
    """

    _estimator_type = "classifier"

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float | None = None,
        bounds: Any = None,
        steps: int = 1000,
        sample_rate: float = 0.01,
        clip: float = 1.0,
        learning_rate: float = 1.0,
        l2: float = 1e-4,
        rows_per_unit: int = 1,
        random_state: int | None = None,
        verbose: bool = False,
        ledger: Any = None,
        analyst: str | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.delta = delta
        self.bounds = bounds
        self.steps = steps
        self.sample_rate = sample_rate
        self.clip = clip
        self.learning_rate = learning_rate
        self.l2 = l2
        self.rows_per_unit = rows_per_unit
        self.random_state = random_state
        self.verbose = verbose
        self.ledger = ledger
        self.analyst = analyst

    def fit(self, X: Any, y: Any, groups: Any = None) -> DPLogisticRegression:
        account = self._account()
        X, rows = self._prepare(X, groups)
        y = np.asarray(y)
        classes = np.unique(y)
        if len(classes) != 2:
            raise ValueError("y must have exactly two classes")
        self.classes_ = classes
        y01 = (y == classes[1]).astype(np.float64)
        delta = self._delta(int((rows >= 0).sum()))
        plan = dpsgd.plan_dpsgd(self._dpsgd_config(delta))
        source = self._source()
        lo, hi, cost = self._pay_and_bound(account, plan.cost, X, rows, source)
        with fit_progress(plan.config.steps, "DP-SGD", self.verbose) as advance:
            w, self.n_noisy_ = dpsgd.train_dpsgd(
                plan, "logistic", design(X, lo, hi), y01, rows, source, check=advance
            )
        b0, bc = unscale(w, lo, hi, None)
        self.intercept_, self.coef_ = float(b0[0]), bc[0]
        self.mechanism_ = plan
        self.cost_: Cost = cost
        return self

    def decision_function(self, X: Any) -> np.ndarray:
        return self._linear(X)

    def predict_proba(self, X: Any) -> np.ndarray:
        p = 0.5 * (1.0 + np.tanh(0.5 * self.decision_function(X)))
        return np.column_stack([1 - p, p])

    def predict(self, X: Any) -> np.ndarray:
        return self.classes_[(self.decision_function(X) > 0).astype(int)]

    def score(self, X: Any, y: Any) -> float:
        """Accuracy."""
        return float(np.mean(self.predict(X) == np.asarray(y)))

    def model(self, feature_sql: Sequence[str] | None = None) -> RegressionModel:
        """The released model; ``feature_sql`` names the SQL column of each feature."""
        return self._model("logistic_regression", feature_sql, _plain(self.classes_[1]))


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


__all__ = [
    "BoundsRequiredError",
    "DPLinearRegression",
    "DPLogisticRegression",
    "RegressionModel",
    "predictor",
]
