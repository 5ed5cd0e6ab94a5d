"""``DPGreedyRuleList``: the learner as a scikit-learn-style classifier (no sklearn import).

Follows the estimator conventions by hand (constructor only stores parameters, ``get_params`` /
``set_params``, fitted attributes end in ``_``, ``fit`` returns ``self``) so it works in
``sklearn.model_selection.cross_val_score`` when scikit-learn is installed, without depending
on it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpsql.errors import DataError, ProgrammingError
from dpsql.privacy.accounting import Cost
from dpsql.privacy.samplers import NoiseSource, SecureNoise, SeededNoise
from dpsql.rulelist.candidates import Feature, mined_candidates, public_candidates
from dpsql.rulelist.learner import LearnerParams, learn, plan_budget
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


class NotFittedError(ProgrammingError, AttributeError):
    """predict / export before fit (an AttributeError too, like scikit-learn's)."""

    sqlstate = "55000"


class DPGreedyRuleList:
    """Differentially private greedy rule list (DP-GreedyRL, Ly et al. 2024).

    ``candidates="public"`` (default) builds every conjunction of up to ``max_card`` feature
    literals without looking at the data; ``"mined"`` uses the paper's support-filtered
    pre-mining, which reads the training data and is NOT differentially private.
    ``strict_sensitivity=False`` uses the paper's add-only local sensitivity.
    After ``fit``: ``rule_list_``, ``classes_``, ``n_features_in_``, ``feature_names_in_``,
    ``cost_`` (the (ε, δ) the fit spent).
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

    def fit(self, X: Any, y: Any, feature_names: Sequence[str] | None = None) -> DPGreedyRuleList:
        Xa, names = _features_matrix(X, feature_names)
        y_enc, classes = _encode_labels(y)
        if Xa.shape[0] != y_enc.shape[0]:
            raise DataError("X and y have different numbers of rows", sqlstate="22023")
        params = self._params()
        params.validate()
        features = [Feature.binary_column(name) for name in names]
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
        self.rule_list_ = learn(Xa, y_enc, features, rules, params, noise_source(self.random_state))
        self.cost_: Cost = plan_budget(params, Xa.shape[0]).cost
        self.classes_ = classes
        self.n_features_in_ = Xa.shape[1]
        self.feature_names_in_ = np.asarray(names, dtype=object)
        return self

    # -- prediction -----------------------------------------------------------------------
    def _check(self, X: Any) -> np.ndarray:
        if not hasattr(self, "rule_list_"):
            raise NotFittedError(
                "this DPGreedyRuleList is not fitted yet", hint="call fit(X, y) first"
            )
        Xa, _ = _features_matrix(X, None)
        if Xa.shape[1] != self.n_features_in_:
            raise DataError(
                f"X has {Xa.shape[1]} features, the model was fitted on {self.n_features_in_}",
                sqlstate="22023",
            )
        return Xa

    def predict(self, X: Any) -> np.ndarray:
        Xa = self._check(X)
        return self.classes_[self.rule_list_.predict(Xa)]

    def predict_proba(self, X: Any) -> np.ndarray:
        return self.rule_list_.predict_proba(self._check(X))

    def score(self, X: Any, y: Any) -> float:
        return float(np.mean(self.predict(X) == np.asarray(y)))

    def to_sql_case(self) -> str:
        """The fitted list as a SQL ``CASE`` over the feature columns (0/1), yielding classes_."""
        self._check(np.zeros((0, self.n_features_in_)))
        return self.rule_list_.to_sql_case(tuple(self.classes_.tolist()))

    # -- persistence ----------------------------------------------------------------------
    def to_json(self) -> str:
        self._check(np.zeros((0, self.n_features_in_)))
        params = self.get_params()
        if not isinstance(params["random_state"], int | type(None)):
            params["random_state"] = None
        return json.dumps(
            {
                "params": params,
                "classes": self.classes_.tolist(),
                "cost": [self.cost_.epsilon, self.cost_.delta],
                "rule_list": self.rule_list_.to_dict(),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> DPGreedyRuleList:
        data = json.loads(text)
        est = cls(**data["params"])
        est.rule_list_ = RuleList.from_dict(data["rule_list"])
        est.classes_ = np.asarray(data["classes"])
        est.cost_ = Cost(*data["cost"])
        est.n_features_in_ = len(est.rule_list_.features)
        est.feature_names_in_ = np.asarray([f.name for f in est.rule_list_.features], object)
        return est


def _features_matrix(X: Any, names: Sequence[str] | None) -> tuple[np.ndarray, list[str]]:
    """0/1 uint8 matrix and feature names from an array or a DataFrame."""
    columns = getattr(X, "columns", None)
    arr = np.asarray(X.to_numpy() if hasattr(X, "to_numpy") else X)
    if arr.ndim != 2:
        raise DataError("X must be a 2-D 0/1 matrix", sqlstate="22023", construct="X")
    if arr.dtype != bool:
        try:
            ok = np.isin(arr, (0, 1)).all()
        except TypeError:
            ok = False
        if not ok:
            raise DataError(
                "X must contain only 0/1 (or boolean) values",
                sqlstate="22023",
                construct="X",
                hint="binarise the features first (one column per public value or threshold)",
            )
    if names is None:
        names = (
            [str(c) for c in columns]
            if columns is not None
            else [f"x{j}" for j in range(arr.shape[1])]
        )
    if len(names) != arr.shape[1]:
        raise DataError("feature_names does not match the number of columns", sqlstate="22023")
    return arr.astype(np.uint8), list(names)


def _encode_labels(y: Any) -> tuple[np.ndarray, np.ndarray]:
    """(0/1 codes, classes_): 0/1 or boolean labels keep classes [0, 1]."""
    ya = np.asarray(y.to_numpy() if hasattr(y, "to_numpy") else y)
    if ya.ndim != 1:
        raise DataError("y must be one-dimensional", sqlstate="22023", construct="y")
    if ya.dtype == bool:
        return ya.astype(np.int8), np.asarray([False, True])
    classes = np.unique(ya)
    if classes.size <= 2 and np.isin(classes, (0, 1)).all():
        return ya.astype(np.int8), np.asarray([0, 1])
    if classes.size != 2:
        raise DataError(
            f"y must have exactly two classes, found {classes.size}",
            sqlstate="22023",
            construct="y",
            hint="rule lists here are binary: encode one class against the rest",
        )
    return (ya == classes[1]).astype(np.int8), classes
