"""``DPGreedyRuleList``: the learner as a scikit-learn-style classifier (no sklearn import).

Follows the estimator conventions by hand (constructor only stores parameters, ``get_params`` /
``set_params``, fitted attributes end in ``_``, ``fit`` returns ``self``) so it works in
``sklearn.model_selection.cross_val_score`` when scikit-learn is installed, without depending
on it.

``ledger=`` (a dpsql connection, a Service with ``analyst=``, or a
:class:`~dpsql.privacy.spend.LedgerAccount`) charges the fit's (ε, δ) before it reads X;
without one the fit emits one :class:`~dpsql.privacy.spend.UnrecordedSpendWarning`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpsql.errors import DataError, ProgrammingError
from dpsql.privacy import spend
from dpsql.privacy.accounting import Cost
from dpsql.privacy.samplers import NoiseSource, SecureNoise, SeededNoise
from dpsql.rulelist.candidates import (
    Feature,
    Patterns,
    mined_candidates,
    public_candidates,
    quote_ident,
)
from dpsql.rulelist.learner import LearnerParams, check_counts, learn_patterns, plan_budget
from dpsql.rulelist.model import RuleList

_PARAMS = (
    "epsilon",
    "delta",
    "max_length",
    "min_support",
    "mechanism",
    "confidence",
    "max_card",
    "random_state",
    "candidates",
    "strict_sensitivity",
    "cut_points",
    "ledger",
    "analyst",
)


def noise_source(random_state: Any) -> NoiseSource:
    """None: OS CSPRNG; an int: a seeded source (tests, reproducible experiments)."""
    if random_state is None:
        return SecureNoise()
    if isinstance(random_state, int | np.integer) and not isinstance(random_state, bool):
        return SeededNoise(int(random_state))
    if hasattr(random_state, "discrete_laplace"):
        return random_state
    raise ProgrammingError(
        f"random_state must be None, an int or a NoiseSource, got {type(random_state).__name__}",
        sqlstate="22023",
        construct="random_state",
    )


try:  # scikit-learn's own class when it is installed, so its checks and callers catch it
    from sklearn.exceptions import NotFittedError as _SklearnNotFitted
except ImportError:  # pragma: no cover - without scikit-learn

    class _SklearnNotFitted(ValueError, AttributeError):  # type: ignore[no-redef]
        pass


class NotFittedError(ProgrammingError, _SklearnNotFitted):
    """predict / export before fit (scikit-learn's NotFittedError when it is installed)."""

    sqlstate = "55000"


class InputError(DataError, ValueError):
    """Bad X / y / sample_weight: a DataError (SQLSTATE 22023) that is also a ValueError."""

    sqlstate = "22023"


class InputTypeError(DataError, TypeError):
    """X holds values that are not numbers (a TypeError, as numpy and scikit-learn raise)."""

    sqlstate = "22023"


class DPGreedyRuleList:
    """Differentially private greedy rule list (DP-GreedyRL, Ly et al. 2024).

    ``candidates="public"`` (default) builds every conjunction of up to ``max_card`` feature
    literals without looking at the data; ``"mined"`` uses the paper's support-filtered
    pre-mining, which reads the training data and is NOT differentially private.
    ``strict_sensitivity=False`` uses the paper's add-only local sensitivity.
    ``cut_points`` (public thresholds, see :class:`DPBinarizer`) lets X hold numbers: each
    column becomes ``col >= c`` features; None requires a 0/1 X.
    After ``fit``: ``rule_list_``, ``classes_``, ``n_features_in_``, ``feature_names_in_``,
    ``cost_`` (the (ε, δ) the fit spent). ``ledger=`` / ``analyst=``: where that is charged
    (see the module docstring).
    """

    _estimator_type = "classifier"

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float | None = None,
        max_length: int = 5,
        min_support: float = 0.05,
        mechanism: str = "smooth_laplace",
        confidence: float = 0.99,
        max_card: int = 2,
        random_state: Any = None,
        candidates: str = "public",
        strict_sensitivity: bool = True,
        cut_points: Any = None,
        ledger: Any = None,
        analyst: str | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.delta = delta
        self.max_length = max_length
        self.min_support = min_support
        self.mechanism = mechanism
        self.confidence = confidence
        self.max_card = max_card
        self.random_state = random_state
        self.candidates = candidates
        self.strict_sensitivity = strict_sensitivity
        self.cut_points = cut_points
        self.ledger = ledger
        self.analyst = analyst

    # -- scikit-learn protocol ------------------------------------------------------------
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _PARAMS}

    def set_params(self, **params: Any) -> DPGreedyRuleList:
        for name, value in params.items():
            if name not in _PARAMS:
                raise ProgrammingError(
                    f"unknown parameter {name!r}",
                    sqlstate="22023",
                    construct=name,
                    hint="use one of " + ", ".join(_PARAMS),
                )
            setattr(self, name, value)
        return self

    def __sklearn_tags__(self) -> Any:  # scikit-learn >= 1.6 asks for tags
        from sklearn.utils import ClassifierTags, Tags, TargetTags

        return Tags(
            estimator_type="classifier",
            target_tags=TargetTags(required=True),
            classifier_tags=ClassifierTags(multi_class=False),
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in _PARAMS)
        return f"DPGreedyRuleList({args})"

    def __str__(self) -> str:
        if not hasattr(self, "rule_list_"):
            return repr(self) + " (not fitted)"
        return self.rule_list_.describe(tuple(self.classes_.tolist()))

    # -- fitting --------------------------------------------------------------------------
    def _params(self) -> LearnerParams:
        return LearnerParams(
            epsilon=float(self.epsilon),
            delta=self.delta,
            max_length=int(self.max_length),
            min_support=float(self.min_support),
            mechanism=self.mechanism,
            confidence=float(self.confidence),
            strict_sensitivity=bool(self.strict_sensitivity),
        )

    def fit(
        self,
        X: Any,
        y: Any,
        feature_names: Sequence[str] | None = None,
        *,
        sample_weight: Any = None,
    ) -> DPGreedyRuleList:
        """Learn the list.  ``sample_weight``: whole-number counts (a row of weight 3 counts as
        three rows; the guarantee is per unit of weight)."""
        account = spend.account(self.ledger, self.analyst)
        Xv, names, from_frame = _validate_X(X, feature_names)
        y_enc, classes = _encode_labels(y)
        if Xv.shape[0] != y_enc.shape[0]:
            raise InputError("X and y have different numbers of rows", construct="y")
        binarizer = DPBinarizer(self.cut_points).fit(Xv, feature_names=names)
        Xa = binarizer.transform(Xv)
        weight = None
        if sample_weight is not None:
            try:
                weight = check_counts(np.asarray(sample_weight), Xa.shape[0])
            except DataError as exc:
                raise InputError(exc.message, construct="sample_weight", hint=exc.hint) from None
            if weight.sum() == 0:
                raise InputError("sample weights sum to zero", construct="sample_weight")
        params = self._params()
        params.validate()
        features = binarizer.features_
        if self.candidates == "public":
            rules = public_candidates(features, int(self.max_card))
        elif self.candidates == "mined":
            lam = params.min_support if params.min_support < 1 else 0.0
            rules = mined_candidates(Xa, lam, int(self.max_card))
        else:
            raise ProgrammingError(
                f"candidates must be 'public' or 'mined', got {self.candidates!r}",
                sqlstate="22023",
                construct="candidates",
            )
        data = Patterns.from_rows(Xa, y_enc, weight)
        cost = plan_budget(params, round(data.total)).cost
        text = spend.params_text("DPGreedyRuleList", self.get_params())
        spend.charge(account, cost, "DPGreedyRuleList.fit", text)  # before learning
        self.rule_list_ = learn_patterns(
            data, features, rules, params, noise_source(self.random_state)
        )
        self.cost_: Cost = cost
        self.classes_ = classes
        self.n_features_in_ = Xv.shape[1]
        if from_frame or feature_names is not None:
            self.feature_names_in_ = np.asarray(names, dtype=object)
        self.binarizer_ = binarizer
        return self

    # -- prediction -----------------------------------------------------------------------
    def _fitted(self) -> None:
        if not hasattr(self, "rule_list_"):
            raise NotFittedError(
                "this DPGreedyRuleList is not fitted yet", hint="call fit(X, y) first"
            )

    def _check(self, X: Any) -> np.ndarray:
        """X as the fitted 0/1 feature matrix; a DataFrame is aligned by column name."""
        self._fitted()
        names = getattr(self, "feature_names_in_", None)
        if names is not None and hasattr(X, "columns"):
            X = _align(X, [str(n) for n in names])
        Xv, _, _ = _validate_X(X, None)
        if Xv.shape[1] != self.n_features_in_:
            raise InputError(
                f"X has {Xv.shape[1]} features, but DPGreedyRuleList is expecting "
                f"{self.n_features_in_} features as input",
                construct="X",
            )
        return self.binarizer_.transform(Xv)

    def predict(self, X: Any) -> np.ndarray:
        Xa = self._check(X)
        return self.classes_[self.rule_list_.predict(Xa)]

    def predict_proba(self, X: Any) -> np.ndarray:
        Xa = self._check(X)
        return self.rule_list_.predict_proba(Xa)

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        hit = self.predict(X) == np.asarray(y)
        if sample_weight is None:
            return float(np.mean(hit))
        return float(np.average(hit, weights=np.asarray(sample_weight, dtype=np.float64)))

    def to_sql_case(self) -> str:
        """The fitted list as a SQL ``CASE`` over the input columns, yielding classes_."""
        self._fitted()
        return self.rule_list_.to_sql_case(tuple(self.classes_.tolist()))

    # -- rendering ------------------------------------------------------------------------
    def _table(self) -> list[tuple[str, str, str, str, str]]:
        self._fitted()
        rl, labels = self.rule_list_, self.classes_.tolist()
        out = []
        for i, r in enumerate(rl.rules):
            st = rl.rule_stats(r)
            rate = "–" if st.rate is None else f"{st.rate:.3f}"
            out.append(
                (
                    str(i + 1),
                    "else" if r.is_default else rl.rule_text(r),
                    str(labels[r.prediction]),
                    f"{st.support:.0f}",
                    f"{rate} [{st.low:.3f}, {st.high:.3f}]",
                )
            )
        return out

    def to_markdown(self) -> str:
        """The list as a Markdown table: rule, prediction, noisy support, rate and 95% CI."""
        head = "| # | if | then | noisy support | positive rate [95% CI] |\n|---|---|---|---|---|"
        rows = [
            "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self._table()
        ]
        return "\n".join([head, *rows])

    def to_html(self) -> str:
        """An HTML table with a bar per rule: width = share of the noisy support, shade =
        positive rate (all post-processing of released counts)."""
        import html

        rows = self._table()
        stats = [self.rule_list_.rule_stats(r) for r in self.rule_list_.rules]
        total = sum(s.support for s in stats) or 1.0
        body = []
        for row, st in zip(rows, stats, strict=True):
            width = 100.0 * st.support / total
            shade = 0.0 if st.rate is None else st.rate
            bar = (
                f'<div style="width:{width:.1f}%;height:0.8em;'
                f'background:rgba(200,60,40,{0.15 + 0.85 * shade:.2f})"></div>'
            )
            cells = "".join(f"<td>{html.escape(c)}</td>" for c in row)
            body.append(f"<tr>{cells}<td style='min-width:8em'>{bar}</td></tr>")
        head = (
            "<tr><th>#</th><th>if</th><th>then</th><th>noisy support</th>"
            "<th>positive rate [95% CI]</th><th>support / rate</th></tr>"
        )
        return f"<table>{head}{''.join(body)}</table>"

    def _repr_html_(self) -> str:  # notebooks
        return self.to_html() if hasattr(self, "rule_list_") else html_escape(repr(self))

    # -- persistence ----------------------------------------------------------------------
    def to_json(self) -> str:
        self._fitted()
        params = self.get_params()
        if not isinstance(params["random_state"], int | type(None)):
            params["random_state"] = None
        params["ledger"] = None  # where a fit was charged is not part of the model
        names = getattr(self, "feature_names_in_", None)
        return json.dumps(
            {
                "params": params,
                "classes": self.classes_.tolist(),
                "cost": [self.cost_.epsilon, self.cost_.delta],
                "rule_list": self.rule_list_.to_dict(),
                "n_features_in": int(self.n_features_in_),
                "feature_names_in": None if names is None else [str(n) for n in names],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> DPGreedyRuleList:
        data = json.loads(text)
        est = cls(**data["params"])
        est.rule_list_ = RuleList.from_dict(data["rule_list"])
        est.classes_ = np.asarray(data["classes"])
        est.cost_ = Cost(*data["cost"])
        names = data.get("feature_names_in")
        est.n_features_in_ = int(data.get("n_features_in", len(est.rule_list_.features)))
        if names is not None:
            est.feature_names_in_ = np.asarray(names, dtype=object)
        default = names or [f"x{j}" for j in range(est.n_features_in_)]
        est.binarizer_ = DPBinarizer(est.cut_points).fit(
            np.zeros((0, est.n_features_in_)), feature_names=default
        )
        return est


class DPBinarizer:
    """Numbers to 0/1 features at PUBLIC cut points: ``col >= c`` for each given c.

    ``cut_points``: None (every column must already be 0/1), a sequence of numbers (the same
    cuts for every column) or a mapping from column name or index to its cuts (unnamed
    columns must be 0/1).  ``fit`` reads only the shape and column names, never the values,
    so the features stay public and the rule learner's guarantee covers them.  NaN is
    refused (scikit-learn's ``allow_nan`` is False); SQL NULLs count as "not >= c" in the
    exported predicates.
    """

    def __init__(self, cut_points: Any = None) -> None:
        self.cut_points = cut_points

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return {"cut_points": self.cut_points}

    def set_params(self, **params: Any) -> DPBinarizer:
        for name, value in params.items():
            if name != "cut_points":
                raise ProgrammingError(f"unknown parameter {name!r}", sqlstate="22023")
            self.cut_points = value
        return self

    def fit(self, X: Any, y: Any = None, feature_names: Sequence[str] | None = None):
        Xv, names, _ = _validate_X(X, feature_names, empty_ok=True)
        cuts = _resolve_cuts(self.cut_points, names)
        self.n_features_in_ = Xv.shape[1]
        self.feature_names_in_ = np.asarray(names, dtype=object)
        self.columns_: list[tuple[int, float | None]] = []
        feats: list[Feature] = []
        for j, name in enumerate(names):
            column_cuts = cuts.get(j)
            if column_cuts is None:
                self.columns_.append((j, None))
                feats.append(Feature.binary_column(name))
                continue
            q = quote_ident(name)
            for c in column_cuts:
                text = f"{c:g}"
                self.columns_.append((j, c))
                feats.append(
                    Feature(
                        f"{name} >= {text}",
                        f"{q} >= {text}",
                        f"{name} < {text}",
                        f"{q} < {text} OR {q} IS NULL",
                        column=name,
                        threshold=c,
                    )
                )
        self.features_ = feats
        return self

    def transform(self, X: Any) -> np.ndarray:
        if not hasattr(self, "columns_"):
            raise NotFittedError("this DPBinarizer is not fitted yet", hint="call fit(X) first")
        Xv, _, _ = _validate_X(X, None, empty_ok=True)
        out = np.empty((Xv.shape[0], len(self.columns_)), dtype=np.uint8)
        plain = [j for j, c in self.columns_ if c is None]
        if plain and not np.isin(Xv[:, plain], (0, 1)).all():
            raise InputError(
                "X must contain only 0/1 values in the columns without cut points",
                construct="X",
                hint="pass cut_points (public thresholds) for numeric columns",
            )
        for k, (j, c) in enumerate(self.columns_):
            out[:, k] = Xv[:, j] if c is None else Xv[:, j] >= c
        return out

    def fit_transform(self, X: Any, y: Any = None, **kw: Any) -> np.ndarray:
        return self.fit(X, y, **kw).transform(X)

    def get_feature_names_out(self, input_features: Any = None) -> np.ndarray:
        return np.asarray([f.name for f in self.features_], dtype=object)


def html_escape(text: str) -> str:
    import html

    return html.escape(text)


def _resolve_cuts(cut_points: Any, names: Sequence[str]) -> dict[int, list[float] | None]:
    """Column index -> sorted finite cuts, or None for a 0/1 column."""
    if cut_points is None:
        return {}
    if isinstance(cut_points, Mapping):
        index = {n: j for j, n in enumerate(names)}
        out: dict[int, list[float] | None] = {}
        for key, cuts in cut_points.items():
            j = key if isinstance(key, int | np.integer) else index.get(str(key))
            if j is None or not 0 <= int(j) < len(names):
                raise InputError(
                    f"cut_points names column {str(key)[:40]!r}, which X does not have",
                    construct="cut_points",
                )
            out[int(j)] = _cuts(cuts)
        return out
    shared = _cuts(cut_points)
    return dict.fromkeys(range(len(names)), shared)


def _cuts(values: Any) -> list[float]:
    try:
        cuts = sorted({float(v) for v in np.atleast_1d(np.asarray(values, dtype=np.float64))})
    except (TypeError, ValueError):
        cuts = []
    if not cuts or not all(math.isfinite(c) for c in cuts):
        raise InputError(
            "cut points must be one or more finite numbers",
            construct="cut_points",
            hint="e.g. cut_points={'age': [30, 50]} or cut_points=[0.5]",
        )
    return cuts


def _align(X: Any, names: list[str]) -> Any:
    """The DataFrame's columns in the fitted order, or a refusal naming what differs."""
    columns = [str(c) for c in X.columns]
    if columns == names:
        return X
    missing = [n for n in names if n not in columns]
    extra = [c for c in columns if c not in names]
    if missing or extra:
        raise InputError(
            "X's columns differ from those seen in fit"
            + (f"; missing: {', '.join(missing[:5])}" if missing else "")
            + (f"; unexpected: {', '.join(extra[:5])}" if extra else ""),
            construct="X",
            hint="pass the columns the model was fitted on (any order)",
        )
    return X[names]  # same names, another order: realigned, never predicted by position


def _validate_X(
    X: Any, names: Sequence[str] | None, *, empty_ok: bool = False
) -> tuple[np.ndarray, list[str], bool]:
    """(finite float64 2-D array, column names, whether the names came from a DataFrame)."""
    if X is None:
        raise InputError("X is None", construct="X")
    if hasattr(X, "toarray") or type(X).__module__.startswith("scipy.sparse"):
        raise InputError(
            "A sparse matrix was passed, but dense data is required",
            construct="X",
            hint="call X.toarray() first",
        )
    columns = getattr(X, "columns", None)
    raw = np.asarray(X.to_numpy() if hasattr(X, "to_numpy") else X)
    if np.iscomplexobj(raw):
        raise InputError("Complex data not supported", construct="X")
    try:
        arr = raw.astype(np.float64)
    except (TypeError, ValueError) as exc:
        raise InputTypeError(str(exc), construct="X", hint="X must hold numbers") from None
    if arr.ndim != 2:
        raise InputError(
            f"Expected a 2-D array, got {arr.ndim}-D. Reshape your data, e.g. with "
            "X.reshape(1, -1) for one sample",
            construct="X",
        )
    if not empty_ok and (arr.shape[0] == 0 or arr.shape[1] == 0):
        raise InputError(
            f"Found array with {arr.shape[0]} sample(s) and {arr.shape[1]} feature(s) "
            f"(shape={arr.shape}) while a minimum of 1 is required.",
            construct="X",
        )
    if not np.isfinite(arr).all():
        raise InputError(
            "X contains NaN or infinity",
            construct="X",
            hint="impute or drop missing values first",
        )
    from_frame = columns is not None and names is None
    if names is None:
        names = (
            [str(c) for c in columns]
            if columns is not None
            else [f"x{j}" for j in range(arr.shape[1])]
        )
    if len(names) != arr.shape[1]:
        raise InputError("feature_names does not match the number of columns", construct="X")
    return arr, list(names), from_frame


def _encode_labels(y: Any) -> tuple[np.ndarray, np.ndarray]:
    """(0/1 codes, classes_): 0/1 or boolean labels keep classes [0, 1]."""
    if y is None:
        raise InputError(
            "DPGreedyRuleList requires y to be passed, but the target y is None", construct="y"
        )
    ya = np.asarray(y.to_numpy() if hasattr(y, "to_numpy") else y)
    if ya.ndim == 2 and ya.shape[1] == 1:
        _warn_column_vector()
        ya = ya.ravel()
    if ya.ndim != 1:
        raise InputError("y should be a 1d array", construct="y")
    if ya.dtype == bool:
        return ya.astype(np.int8), np.asarray([False, True])
    if ya.dtype.kind == "f":
        if not np.isfinite(ya).all():
            raise InputError("y contains NaN or infinity", construct="y")
        if not (ya == np.round(ya)).all():
            raise InputError(
                "Unknown label type: continuous (a rule list predicts one of two classes)",
                construct="y",
            )
    classes = np.unique(ya)
    if classes.size <= 2 and np.isin(classes, (0, 1)).all():
        return ya.astype(np.int8), np.asarray([0, 1])
    if classes.size != 2:
        raise InputError(
            f"y must have exactly two classes, found {classes.size}. Only binary "
            "classification is supported",
            construct="y",
            hint="rule lists here are binary: encode one class against the rest",
        )
    return (ya == classes[1]).astype(np.int8), classes


def _warn_column_vector() -> None:
    import warnings

    try:
        from sklearn.exceptions import DataConversionWarning as category
    except ImportError:  # pragma: no cover
        category = UserWarning  # type: ignore[assignment]
    warnings.warn(
        "A column-vector y was passed when a 1d array was expected", category, stacklevel=3
    )
