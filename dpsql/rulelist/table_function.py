"""``dp_rule_list(...)``: the pure functions behind the SQL table function.

Two steps, so the pipeline can charge the ledger between them and EXPLAIN can stop after the
first:

1. :func:`plan_rule_list` (no data): validates the arguments against the table's policy,
   builds the public features from declared domains, the candidate rules, the expressions
   the engine must compute per row as sqlglot trees (one 0/1 column per feature, then the 0/1
   label; a feature's text is its tree rendered, for the released rule list), and the
   privacy :class:`~dpsql.privacy.accounting.Cost` to charge.
2. :func:`release_rule_list` (after charging): learns the list from the fetched 0/1 matrix and
   returns the result rows.

See docs/rulelist.md for the wiring and the guarantees.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlglot import exp

from dpsql.errors import DataError, PrivacyError, ProgrammingError, UndefinedColumnError
from dpsql.lower.builders import alias, flag, literal
from dpsql.lower.row_values import cast, quoted
from dpsql.policy import ColumnPolicy, TablePolicy
from dpsql.privacy.accounting import Cost
from dpsql.privacy.samplers import NoiseSource
from dpsql.rulelist.candidates import Feature, Patterns, Rule, public_candidates, quote_ident
from dpsql.rulelist.gini import support_threshold
from dpsql.rulelist.learner import (
    SMOOTH,
    BudgetPlan,
    LearnerParams,
    check_drawable,
    learn_patterns,
    plan_budget,
)
from dpsql.rulelist.model import RuleList
from dpsql.table_functions import RULE_LIST_COLUMNS

#: Result columns of ``SELECT * FROM dp_rule_list(...)``, with SQL types.
COLUMNS = RULE_LIST_COLUMNS  # the schema the binder checks against (dpsql.table_functions)
#: Candidate-set cap: planning enumerates them and each selection scores them all.
MAX_CANDIDATES = 20_000
#: SQL's default mechanism: proven, δ = 0, and valid when a unit owns several rows.
DEFAULT_MECHANISM = "monotone_em"
DEFAULT_CUTS = 3


@dataclass(frozen=True)
class RuleListPlan:
    """Everything decided before data is read: features, candidates, SQL to fetch, cost."""

    table: str
    label: str
    positive: Any
    features: tuple[Feature, ...]
    candidates: tuple[Rule, ...]
    params: LearnerParams
    cost: Cost
    predicates: tuple[exp.Expression, ...]  # each feature's condition, in order
    label_match: exp.Expression  # label = positive (NULL: not a match)
    budget: BudgetPlan | None = None
    model: str | None = None  # store the learned list under this name
    notes: tuple[str, ...] = ()  # decided from the arguments alone (e.g. the δ used)

    def items(self) -> list[exp.Expression]:
        """The engine's select list as trees: f0 ... f{k-1}, then y (all 0/1 integers)."""
        cols = [alias(flag(p.copy()), f"f{i}") for i, p in enumerate(self.predicates)]
        return [*cols, alias(flag(self.label_match.copy()), "y")]

    def expressions(self) -> list[str]:
        """The 0/1 columns as DuckDB text, for the free type check on the empty shadow (the
        shadow's edge: the trees rendered there)."""
        return [item.this.sql(dialect="duckdb") for item in self.items()]

    def select_list(self) -> str:
        """:meth:`items` as DuckDB text (for reading them, and tests that run them alone)."""
        return ", ".join(item.sql(dialect="duckdb") for item in self.items())

    def explain_rows(self) -> list[tuple[Any, ...]]:
        """EXPLAIN rows (the pipeline's 10 columns): the call, then ε_node, δ_node, T and Λ.

        All of it follows from the arguments and the policy; none of it reads data.
        """
        p, b, c = self.params, self.budget, self.cost
        rows: list[tuple[Any, ...]] = [
            (
                f"dp_rule_list({self.table}, label => {self.label})",
                f"{len(self.candidates)} public candidates, max_length {p.max_length}",
                p.mechanism,
                None,
                None,
                None,
                c.epsilon,
                c.delta,
                c.rho,
                None,
            )
        ]
        if b is None or p.max_length < 1:
            return rows

        def row(name: str, text: str, eps: float | None = None, delta: float | None = None):
            rows.append((name, text, None, None, None, None, eps, delta, None, None))

        eps_n, d_n = b.epsilon_node, b.delta_node
        row("epsilon_node", f"epsilon_node = {eps_n:.6g}: {b.steps} steps of epsilon", eps_n)
        row("delta_node", f"delta_node = {d_n:.3g} per selection", None, d_n)
        if p.mechanism in SMOOTH and p.max_length > 1:
            t = support_threshold(eps_n, p.confidence)
            row("T", f"T = {t}: support margin at confidence {p.confidence:g}")
        else:
            row("T", "T = none: no support check")
        if p.min_support >= 1:
            row("Lambda", f"Lambda = {int(p.min_support)} rows")
        elif p.min_support > 0 and p.mechanism in (*SMOOTH, "monotone_em"):
            how = "first support check" if p.mechanism in SMOOTH else "one extra noisy count"
            row("Lambda", f"Lambda = floor({p.min_support:g} x noisy row count, {how})")
        else:
            row("Lambda", "Lambda = none")
        k = p.rows_per_unit
        rows.append(
            (
                "label counts",
                f"discrete Laplace, scale {k / eps_n:.6g} (k = {k} rows per unit)",
                "discrete_laplace",
                float(k),
                None,
                k / eps_n,
                eps_n,
                0.0,
                None,
                None,
            )
        )
        return rows

    def model_payload(self, rl: RuleList) -> dict[str, Any]:
        """What a stored model keeps: the label, its positive value and the list."""
        positive = self.positive if not isinstance(self.positive, np.generic) else None
        return {"label": self.label, "positive": positive, "rule_list": rl.to_dict()}


@dataclass(frozen=True)
class RuleListRelease:
    rows: tuple[tuple[Any, ...], ...]
    cost: Cost
    notes: tuple[str, ...]
    rule_list: RuleList
    columns: tuple[tuple[str, str], ...] = COLUMNS


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | float):
        return repr(value)
    return "'" + str(value).replace("'", "''") + "'"


_NUMBER = (int, float)
# Python types each SQL argument may take (after binding); bool is never a number here.
_ARGUMENT_TYPES: dict[str, tuple[tuple[type, ...], str, bool]] = {
    # name: (types, what to say, may be None)
    "label": ((str,), "a column name in quotes, e.g. label => 'income'", False),
    "features": ((str, list, tuple), "a quoted list of column names, e.g. 'age, sex'", True),
    "epsilon": (_NUMBER, "a number, e.g. epsilon => 1.0", False),
    "delta": (_NUMBER, "a number, e.g. delta => 1e-6", True),
    "max_length": ((int,), "a whole number, e.g. max_length => 5", False),
    "min_support": (_NUMBER, "a number, e.g. min_support => 0.05", False),
    "mechanism": ((str,), "a quoted name, e.g. mechanism => 'smooth_laplace'", False),
    "confidence": (_NUMBER, "a number, e.g. confidence => 0.99", False),
    "max_card": ((int,), "a whole number, e.g. max_card => 2", False),
    "strict_sensitivity": ((bool,), "true or false", False),
    "cut_points": ((str, dict), "'age: 18, 40, 65; cost: 100, 1000'", True),
    "model": ((str,), "a quoted name, e.g. model => 'smoker_v1'", True),
}


def _check_argument_types(**arguments: Any) -> None:
    """Each argument has the Python type its use expects, or a refusal naming it.

    A mistyped argument would otherwise surface later as a Python error, or as an engine
    cast that fails only on some rows (after data was read).
    """
    for name, value in arguments.items():
        types, say, optional = _ARGUMENT_TYPES[name]
        if value is None and optional:
            continue
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if ok and name == "features" and not isinstance(value, str):
            ok = all(isinstance(v, str) for v in value)
        if not ok:
            raise ProgrammingError(
                f"dp_rule_list argument {name} has the wrong type",
                sqlstate="42804",
                construct=name,
                hint=f"pass {name} => {say}",
            )


def typed_positive(label: ColumnPolicy, positive: Any) -> exp.Expression:
    """``positive`` as a literal of the label column's own type (a tree), or a refusal.

    The comparison ``label = positive`` must not need an implicit cast: a cast of the column
    could fail on some rows only, after data was read.
    """
    wanted = {
        "text": ((str,), "a quoted string"),
        "int": ((int,), "a whole number"),
        "float": (_NUMBER, "a number"),
        "bool": ((bool,), "true or false"),
        "date": ((str,), "a date in quotes, 'YYYY-MM-DD'"),
    }[label.type]
    types, say = wanted
    ok = isinstance(positive, types) and not (isinstance(positive, bool) and bool not in types)
    if ok and label.type == "float":
        ok = np.isfinite(float(positive))
    if ok and label.type == "date":
        try:
            dt.date.fromisoformat(positive)
            ok = len(positive) == 10
        except ValueError:
            ok = False
    if not ok:
        raise ProgrammingError(
            f"positive => does not match the type of label column {label.name!r} ({label.type})",
            sqlstate="42804",
            construct="positive",
            hint=f"pass positive => {say}",
        )
    if label.type == "date":
        return cast(exp.Literal.string(positive), "DATE")
    if label.type == "float":
        return cast(literal(float(positive)), "DOUBLE")
    return literal(positive)


def _fmt_num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"


def features_from_column(
    col: ColumnPolicy, cuts: Sequence[float] | None = None, n_cuts: int = DEFAULT_CUTS
) -> list[Feature]:
    """Public boolean features of one column, from its declared domain only.

    bool: the column itself; ``values``: one ``col = v`` per value (mutually exclusive);
    bounded numbers: ``col >= c`` for declared ``cuts`` or ``n_cuts`` evenly spaced interior
    cut points of [lower, upper].  Negations are true on NULL so the 0/1 matrix, the predicate
    and the CASE export agree row by row.  Other columns have no public domain: [] .
    """
    return [f for f, _ in column_features(col, cuts, n_cuts)]


def column_features(
    col: ColumnPolicy, cuts: Sequence[float] | None = None, n_cuts: int = DEFAULT_CUTS
) -> list[tuple[Feature, exp.Expression]]:
    """:func:`features_from_column`, each feature with its condition as a tree: what the
    engine computes, and (rendered) the feature's ``sql``, so the two never differ."""
    q = quote_ident(col.name)
    column = quoted(col.name)
    if col.type == "bool":
        true = exp.Is(this=column, expression=exp.true())
        return [(Feature(col.name, _text(true), f"not {col.name}", f"{q} IS NOT TRUE"), true)]
    if col.values is not None:
        out: list[tuple[Feature, exp.Expression]] = []
        for v in col.values:
            equal = exp.EQ(this=quoted(col.name), expression=literal(v))
            text = _literal(v)
            negation = f"{q} IS DISTINCT FROM {text}"
            name, neg_name = f"{col.name} = {text}", f"{col.name} != {text}"
            out.append((Feature(name, _text(equal), neg_name, negation, exclusive=col.name), equal))
        return out
    if col.numeric and (cuts is not None or col.bounded):
        if cuts is None:
            lo, hi = float(col.lower), float(col.upper)  # type: ignore[arg-type]
            cuts = [lo + (hi - lo) * i / (n_cuts + 1) for i in range(1, n_cuts + 1)]
        if col.type == "int":
            cuts = sorted({float(np.ceil(c)) for c in cuts})
        out = []
        for c in cuts:
            s = _fmt_num(c)
            at_least = exp.GTE(this=quoted(col.name), expression=exp.Literal.number(s))
            neg = f"{q} < {s}" + (f" OR {q} IS NULL" if col.may_hold_null else "")
            feature = Feature(
                f"{col.name} >= {s}",
                _text(at_least),
                f"{col.name} < {s}",
                neg,
                column=col.name,
                threshold=float(c),
            )
            out.append((feature, at_least))
        return out
    return []


def _text(condition: exp.Expression) -> str:
    """A feature's condition as the released rule list spells it (its CASE export)."""
    return condition.sql(dialect="duckdb")


def plan_rule_list(
    table: TablePolicy,
    *,
    label: str,
    positive: Any = None,
    features: Sequence[str] | None = None,
    epsilon: float = 1.0,
    delta: float | None = None,
    max_length: int = 5,
    min_support: float = 0.05,
    mechanism: str = DEFAULT_MECHANISM,
    confidence: float = 0.99,
    max_card: int = 2,
    cut_points: Mapping[str, Sequence[float]] | str | None = None,
    strict_sensitivity: bool = True,
    model: str | None = None,
) -> RuleListPlan:
    """Validate a ``dp_rule_list`` call and fix its cost, reading no data.

    ``features`` (column names) defaults to every column with a public domain except the label
    and the privacy unit.  Refusals: unknown columns, a named feature without a declared
    domain, ``mechanism => 'none'``, smooth mechanisms on tables whose unit may own several
    rows, missing δ for smooth_laplace / global_gaussian (n is private, so the paper's 1/n²
    default is not available here), and candidate sets too large to hold in memory.
    ``cut_points`` ('col: c1, c2; col2: ...' or a mapping) replaces a numeric column's
    default cuts and makes a numeric column without bounds usable; naming a column that is
    not numeric or not a feature of the call is refused.  ``model`` names the stored model.
    """
    _check_argument_types(
        label=label,
        features=features,
        epsilon=epsilon,
        delta=delta,
        max_length=max_length,
        min_support=min_support,
        mechanism=mechanism,
        confidence=confidence,
        max_card=max_card,
        strict_sensitivity=strict_sensitivity,
        cut_points=cut_points,
        model=model,
    )
    if model is not None:
        check_model_name(model)
    cols = {name.lower(): c for name, c in table.columns.items()}
    lab, positive, positive_value = _label(table, cols, label, positive)
    if mechanism == "none":
        raise PrivacyError(
            "mechanism => 'none' (non-private GreedyRL) is not available through SQL",
            construct="mechanism",
            hint="choose a private mechanism, e.g. 'smooth_laplace' or 'monotone_em'",
        )
    params, budget = _learner_budget(
        table, epsilon, delta, max_length, min_support, mechanism, confidence, strict_sensitivity
    )
    cost = budget.cost

    made = _features(table, cols, lab, features, cut_points)
    feats = [f for f, _ in made]
    rules = _candidate_rules(feats, max_card)
    return RuleListPlan(
        table.name,
        lab.name,
        positive,
        tuple(feats),
        tuple(rules),
        params,
        cost,
        tuple(p for _, p in made),
        exp.EQ(this=quoted(lab.name), expression=positive_value),
        budget,
        model,
    )


def _label(
    table: TablePolicy, cols: dict[str, ColumnPolicy], label: str, positive: Any
) -> tuple[ColumnPolicy, Any, exp.Expression]:
    """The label column, its positive class (TRUE for a boolean label) and that value as a
    literal tree; refused when the column does not exist or the class is not among its values."""
    lab = cols.get(label.lower())
    if lab is None:
        raise UndefinedColumnError(
            f"label column {label!r} does not exist in table {table.name!r}",
            construct=label,
            hint="pass label => one of the table's columns",
        )
    if positive is None:
        if lab.type != "bool":
            raise ProgrammingError(
                f"label column {lab.name!r} is not boolean: say which value is the positive class",
                sqlstate="22023",
                construct="positive",
                hint=f"pass positive => a value of {lab.name}",
            )
        positive = True
    positive_value = typed_positive(lab, positive)
    if lab.values is not None and positive not in lab.values:
        raise ProgrammingError(
            f"positive => {positive!r} is not among the declared values of {lab.name!r}",
            sqlstate="22023",
            construct="positive",
            hint="use one of: " + ", ".join(map(repr, lab.values)),
        )
    return lab, positive, positive_value


def _learner_budget(
    table: TablePolicy,
    epsilon: float,
    delta: float | None,
    max_length: int,
    min_support: float,
    mechanism: str,
    confidence: float,
    strict_sensitivity: bool,
) -> tuple[LearnerParams, BudgetPlan]:
    """The learner's parameters and its budget over its steps; refused (free) when δ is
    needed and missing, or when a step's ε is too small for its noise to be drawn."""
    params = LearnerParams(
        epsilon=epsilon,
        delta=delta,
        max_length=max_length,
        min_support=min_support,
        mechanism=mechanism,
        confidence=confidence,
        strict_sensitivity=strict_sensitivity,
        # an "auto" R is chosen on aggregate queries only: its fallback (dpsql.policy)
        rows_per_unit=1 if table.row_level else table.unchosen_bounds()[0],
    )
    params.validate()
    budget = plan_budget(params, None)  # raises when δ is needed and missing
    try:
        check_drawable(params, budget)
    except (ValueError, OverflowError):
        raise DataError(
            f"epsilon => {epsilon:g} is too small for dp_rule_list: each of its "
            f"{budget.steps} steps gets epsilon_node = {budget.epsilon_node:.3g}, and its "
            "noise cannot be drawn at that scale",
            sqlstate="22023",
            construct="epsilon",
            hint="raise epsilon, or lower max_length (it splits epsilon over 2 or 3 steps "
            "per rule); nothing was spent",
        ) from None
    return params, budget


def _features(
    table: TablePolicy,
    cols: dict[str, ColumnPolicy],
    lab: ColumnPolicy,
    features: Sequence[str] | None,
    cut_points: Mapping[str, Sequence[float]] | str | None,
) -> list[tuple[Feature, exp.Expression]]:
    """The rule literals' features, each with its condition as a tree: the named columns
    (every column with a public domain but the label and the privacy unit by default), each
    cut by its public domain or its ``cut_points``; refused when a named column has no
    public domain or does not exist."""
    skip = {lab.name.lower(), (table.privacy_unit or "").lower()}
    cut_points = parse_cut_points(cut_points, cols)
    chosen: list[ColumnPolicy] = []
    if features is None:
        chosen = [c for n, c in cols.items() if n not in skip]
    else:
        for name in features:
            c = cols.get(name.lower())
            if c is None:
                raise UndefinedColumnError(
                    f"feature column {name!r} does not exist in table {table.name!r}",
                    construct=name,
                    hint="name columns of the table in features => '...'",
                )
            chosen.append(c)
    feats: list[tuple[Feature, exp.Expression]] = []
    for c in chosen:
        made = column_features(c, cut_points.get(c.name.lower()))
        if not made and features is not None:
            raise PrivacyError(
                f"feature column {c.name!r} has no declared public domain",
                construct=c.name,
                hint='declare values = [...] (categorical), type = "bool", or lower/upper '
                "bounds (numbers) for it in the policy, or pass cut_points",
            )
        feats.extend(made)
    unused = set(cut_points) - {c.name.lower() for c in chosen}
    if unused:
        name = sorted(unused)[0]
        raise ProgrammingError(
            f"cut_points names column {cols[name].name!r}, which is not a feature of this call",
            sqlstate="22023",
            construct="cut_points",
            hint="name it in features => [...] too, or drop it from cut_points "
            "(the label and the privacy unit are never features)",
        )
    if not feats:
        raise PrivacyError(
            f"table {table.name!r} has no column with a public domain to build rules from",
            construct=table.name,
            hint="declare values or bounds for some columns in the policy",
        )
    return feats


def _candidate_rules(feats: list[Feature], max_card: int) -> list[Rule]:
    """The public candidate rules (conjunctions of at most ``max_card`` literals), refused
    free when there would be more than MAX_CANDIDATES."""
    if max_card < 1:
        raise ProgrammingError("max_card must be >= 1", sqlstate="22023", construct="max_card")
    # A conjunction holds at most one literal per feature: a larger max_card adds nothing,
    # and bounding it (and the count below) keeps a free refusal from running unbounded.
    max_card = min(max_card, len(feats))
    literals = 2 * len(feats)
    if sum(math.comb(literals, k) for k in range(1, max_card + 1)) > 50 * MAX_CANDIDATES:
        raise ProgrammingError(
            f"the candidate rules would exceed the limit of {MAX_CANDIDATES}",
            sqlstate="54000",
            construct="features",
            hint="name fewer columns in features => '...' or use max_card => 1",
        )
    rules = public_candidates(feats, max_card)
    if len(rules) > MAX_CANDIDATES:
        raise ProgrammingError(
            f"{len(rules)} candidate rules exceed the limit of {MAX_CANDIDATES}",
            sqlstate="54000",
            construct="features",
            hint="name fewer columns in features => '...' or use max_card => 1",
        )
    return rules


#: Most cut points one column may have (each adds two literals).
MAX_CUTS = 32
_MODEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,62}")


def check_model_name(name: str) -> None:
    if not _MODEL_NAME.fullmatch(name):
        raise ProgrammingError(
            f"invalid model name {name[:70]!r}",
            sqlstate="42602",
            construct="model",
            hint="a letter or _, then up to 62 letters, digits, _, . or -",
        )


def parse_cut_points(
    value: Mapping[str, Sequence[float]] | str | None, cols: Mapping[str, ColumnPolicy]
) -> dict[str, list[float]]:
    """Public cut points per numeric column: ``'age: 18, 40, 65; cost: 100'`` or a mapping.

    Refused (22023, before any data is read): unknown or non-numeric columns, values that
    are not finite numbers, more than :data:`MAX_CUTS` per column.
    """
    if value is None:
        return {}
    items: list[tuple[str, Sequence[Any]]]
    if isinstance(value, str):
        items = []
        for part in (p.strip() for p in value.split(";")):
            if not part:
                continue
            name, sep, rest = part.partition(":")
            if not sep:
                raise _bad_cuts(f"no ':' after column {name.strip()[:40]!r}")
            items.append((name.strip(), [v.strip() for v in rest.split(",") if v.strip()]))
    else:
        items = list(value.items())
    out: dict[str, list[float]] = {}
    for name, raw in items:
        col = cols.get(str(name).lower())
        if col is None:
            raise UndefinedColumnError(
                f"cut_points names column {str(name)[:40]!r}, which does not exist",
                construct="cut_points",
                hint="name numeric columns of the table",
            )
        if not col.numeric:
            raise ProgrammingError(
                f"cut_points for column {col.name!r}, which is not numeric ({col.type})",
                sqlstate="22023",
                construct="cut_points",
                hint="cut points apply to int / float columns; categorical columns use "
                "their declared values",
            )
        try:
            cuts = sorted({float(v) for v in raw})
        except (TypeError, ValueError):
            raise _bad_cuts(f"a cut point of {col.name!r} is not a number") from None
        if not cuts or not all(math.isfinite(c) for c in cuts) or len(cuts) > MAX_CUTS:
            raise _bad_cuts(f"column {col.name!r} needs 1 to {MAX_CUTS} finite cut points")
        out[col.name.lower()] = cuts
    return out


def _bad_cuts(message: str) -> ProgrammingError:
    return ProgrammingError(
        f"invalid cut_points: {message}",
        sqlstate="22023",
        construct="cut_points",
        hint="cut_points => 'age: 18, 40, 65; cost: 100, 1000'",
    )


def release_rule_list(
    plan: RuleListPlan,
    X: np.ndarray,
    y: np.ndarray,
    source: NoiseSource,
    weights: np.ndarray | None = None,
    check: Callable[[], None] | None = None,
) -> RuleListRelease:
    """Learn from the fetched rows (columns as in ``plan.select_list()``) and format the rows.

    ``weights``: the engine's count of each fetched row (pattern counts); None = one each.
    Call only after ``plan.cost`` has been charged.  The rows contain only released values
    (chosen antecedents, noisy counts, predictions and statistics derived from them).
    ``check`` (the query handle's cancel check) runs before each rule position.
    """
    data = Patterns.from_rows(np.asarray(X), np.asarray(y), weights)
    rl = learn_patterns(data, plan.features, plan.candidates, plan.params, source, check=check)
    return release_rows(rl, plan.cost, plan.notes)


def release_rows(rl: RuleList, cost: Cost, notes: Sequence[str] = ()) -> RuleListRelease:
    rows = []
    for i, r in enumerate(rl.rules):
        st = rl.rule_stats(r)
        rows.append(
            (
                i + 1,
                rl.rule_text(r),
                rl.rule_predicate(r),
                bool(r.prediction),
                float(r.counts[0]),
                float(r.counts[1]),
                r.is_default,
                st.support,
                st.rate,
                st.low,
                st.high,
            )
        )
    return RuleListRelease(tuple(rows), cost, (*notes, *rl.notes), rl)
