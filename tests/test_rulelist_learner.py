"""The greedy learner: hand-checked non-private run, stopping rules, mechanisms, refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dpsql.errors import DataError, PrivacyError, ProgrammingError
from dpsql.privacy.samplers import SeededNoise
from dpsql.rulelist.candidates import (
    Feature,
    Literal,
    RuleCounter,
    mined_candidates,
    public_candidates,
    rule_mask,
    rule_matrix,
)
from dpsql.rulelist.learner import MECHANISMS, LearnerParams, learn

# a, b, y — worked by hand in the comments of test_nonprivate_greedy_by_hand
TINY = np.array(
    [[1, 0, 1], [1, 0, 1], [1, 1, 1], [0, 1, 0], [0, 1, 0], [0, 1, 1], [0, 0, 0], [0, 0, 0]]
)
TINY_FEATURES = [Feature.binary_column("a"), Feature.binary_column("b")]


def synthetic(n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """6 binary features; y = (x0 and not x1) or x2, with 10% of labels flipped."""
    rng = np.random.default_rng(seed)
    X = (rng.random((n, 6)) < 0.4).astype(np.uint8)
    y = ((X[:, 0] & (1 - X[:, 1])) | X[:, 2]).astype(np.int8)
    flip = rng.random(n) < 0.1
    return X, np.where(flip, 1 - y, y)


def _fit(X, y, mechanism, *, seed=0, **kw):
    feats = [Feature.binary_column(f"x{j}") for j in range(X.shape[1])]
    params = LearnerParams(mechanism=mechanism, **kw)
    return learn(X, y, feats, public_candidates(feats, 2), params, SeededNoise(seed))


def test_nonprivate_greedy_by_hand():
    """n = 8, 4 positives, node Gini 0.5.

    Position 1: a -> G = (0 + 2·1·4/5)/8 = 0.2, Gc = 0;  not a -> G = 0.2, Gc = 0.2;
                b, not b -> G = 0.5.  Tie on G broken by the smaller Gc: 'a', predicting 1.
    Position 2 (rows 4-8, one positive, Gini 0.32): b -> G = (4/3)/5, Gc = 4/15;
                not b -> same G, Gc = 0 -> 'not b', catching two negatives, predicting 0.
    Position 3 (rows 4-6): 'not a' and 'b' catch everything: G = node Gini, no improvement.
    Default: 2 negatives, 1 positive -> 0.
    """
    X, y = TINY[:, :2], TINY[:, 2]
    cands = public_candidates(TINY_FEATURES, 1)
    p = LearnerParams(mechanism="none", max_length=5)
    rl = learn(X, y, TINY_FEATURES, cands, p, SeededNoise(0))
    got = [(r.antecedent, r.prediction, r.counts) for r in rl.rules]
    assert got == [
        ((Literal(0, True),), 1, (0.0, 3.0)),
        ((Literal(1, False),), 0, (2.0, 0.0)),
        ((), 0, (2.0, 1.0)),
    ]
    assert rl.stop_reason == "no_improvement"
    assert str(rl).splitlines()[0].startswith("if [a] then 1")
    assert list(rl.predict(X)) == [1, 1, 1, 0, 0, 0, 0, 0]

    # stop rule 1: maximum length (L counts the default rule)
    rl2 = learn(
        X, y, TINY_FEATURES, cands, LearnerParams(mechanism="none", max_length=2), SeededNoise(0)
    )
    assert len(rl2.rules) == 2 and rl2.stop_reason == "max_length"
    assert rl2.default.counts == (4.0, 1.0)


def test_stop_when_nothing_improves():
    X, _ = synthetic(200)
    rl = _fit(X, np.zeros(200, dtype=np.int8), "none")
    assert len(rl.rules) == 1 and rl.stop_reason == "no_improvement"
    assert rl.notes and "no candidate" in rl.notes[0]


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("length", [1, 2, 4])
def test_every_mechanism_respects_max_length(mechanism, length):
    X, y = synthetic(500, seed=length)
    rl = _fit(X, y, mechanism, epsilon=1.0, delta=1e-6, max_length=length)
    assert 1 <= len(rl.rules) <= length
    assert rl.rules[-1].is_default and all(not r.is_default for r in rl.rules[:-1])
    assert set(rl.predict(X)) <= {0, 1}


def test_nonprivate_and_monotone_em_recover_the_structure():
    X, y = synthetic(4000)
    exact = _fit(X, y, "none", max_length=4)
    assert np.mean(exact.predict(X) == y) > 0.85
    # proven mechanism at ε = 1 on 4000 rows: close to the non-private list (seeded, fixed)
    accs = [
        np.mean(_fit(X, y, "monotone_em", seed=s, max_length=4).predict(X) == y) for s in range(5)
    ]
    assert np.mean(accs) > 0.82  # tolerance: non-private ≈ 0.90, majority ≈ 0.6


@pytest.mark.parametrize("mechanism", ["smooth_laplace", "smooth_cauchy"])
def test_support_check_stops_small_tables_with_a_note(mechanism):
    """n = 60 rows, ε_node = 0.1/14: T = 548 > n, so the check fails (w.p. ≥ 0.99)."""
    X, y = synthetic(60)
    rl = _fit(X, y, mechanism, epsilon=0.1, delta=1e-6, max_length=5)
    assert len(rl.rules) == 1 and rl.stop_reason == "support_check"
    assert "support floor" in rl.notes[0] and "monotone_em" in rl.notes[0]
    assert rl.rules[-1].is_default


def test_smooth_laplace_approaches_nonprivate_at_large_epsilon():
    X, y = synthetic(4000)
    exact = np.mean(_fit(X, y, "none", max_length=4).predict(X) == y)
    accs = [
        np.mean(_fit(X, y, "smooth_laplace", seed=s, epsilon=20.0, max_length=4).predict(X) == y)
        for s in range(3)
    ]
    assert np.mean(accs) > exact - 0.03  # tolerance: 3 points at ε = 20 on 4000 rows


def test_seeded_runs_are_reproducible():
    X, y = synthetic(800)
    a = _fit(X, y, "monotone_em", seed=3, epsilon=0.5)
    b = _fit(X, y, "monotone_em", seed=3, epsilon=0.5)
    assert a == b


def test_candidate_counts_agree_with_masks():
    X, y = synthetic(300)
    feats = [Feature.binary_column(f"x{j}") for j in range(6)]
    cands = public_candidates(feats, 2)
    # 12 literals, pairs of different features: 12 + (66 - 6) = 72, no data involved
    assert len(cands) == 72
    w = (np.random.default_rng(1).random(300) < 0.7).astype(np.float32)
    for rules in (cands, public_candidates(feats, 3)):
        rc = RuleCounter(X, rules)
        assert rc.width == (2 if rules is cands else 3)
        nc, nc1 = rc.counts(w, w * y)
        C = rule_matrix(X, rules)
        for j in range(0, len(rules), 7):
            mask = rule_mask(X, rules[j])
            assert np.array_equal(C[j] > 0, mask) and np.array_equal(rc.caught(j), mask)
            assert nc[j] == (mask * w).sum() and nc1[j] == (mask * w * y).sum()


def test_mined_candidates_follow_the_papers_support_filter():
    X, _ = synthetic(1000)
    mined = mined_candidates(X, 0.3, 2)
    n = X.shape[0]
    for rule in mined:
        s = rule_mask(X, rule).sum() / n
        assert 0.3 <= s <= 0.7
    # λ = 0 keeps every literal and every pair, x ∧ ¬x included (the authors' 12 + 66)
    assert len(mined_candidates(X, 0.0, 2)) == 12 + 66


def test_refusals():
    X, y = synthetic(100)
    with pytest.raises(DataError, match="not binary"):
        _fit(X, np.arange(100) % 3, "none")
    with pytest.raises(ProgrammingError, match="epsilon"):
        _fit(X, y, "monotone_em", epsilon=0.0)
    with pytest.raises(ProgrammingError, match="mechanism"):
        _fit(X, y, "laplace_please")
    with pytest.raises(ProgrammingError, match="confidence"):
        _fit(X, y, "smooth_laplace", confidence=1.0)
    with pytest.raises(PrivacyError, match="one row per privacy unit") as exc:
        _fit(X, y, "smooth_cauchy", rows_per_unit=3)
    assert exc.value.sqlstate == "42501" and "monotone_em" in (exc.value.hint or "")
    with pytest.raises(DataError, match="row counts"):
        _fit(X, y[:50], "none")


def _log_probs(mech, X, y, rules, eps, k=1):
    from dpsql.rulelist.learner import em_log_weights

    masks = np.array([rule_mask(X, r) for r in rules], dtype=float).reshape(len(rules), len(y))
    nc, nc1 = masks.sum(axis=1), masks @ y
    lw = em_log_weights(mech, float(len(y)), float(y.sum()), nc, nc1, eps, k)
    return lw - np.logaddexp.reduce(lw)


@pytest.mark.parametrize(
    ("mech", "k"), [("monotone_em", 1), ("monotone_em", 2), ("exponential", 1)]
)
def test_em_selection_is_epsilon_dp_on_every_neighbour(mech, k):
    """Exact selection distributions (not samples) on small tables and ALL their neighbours:
    adding k rows (any feature/label pattern) or removing k rows moves log P by at most ε."""
    rng = np.random.default_rng(11)
    feats = [Feature.binary_column(f"x{j}") for j in range(3)]
    rules = public_candidates(feats, 2)
    patterns = [(np.array(b[:3]), b[3]) for b in np.ndindex(2, 2, 2, 2)]
    eps, worst = 0.7, 0.0
    for _ in range(40 if k == 1 else 12):
        n = int(rng.integers(0, 9))
        X = (rng.random((n, 3)) < 0.5).astype(np.uint8)
        y = (rng.random(n) < 0.5).astype(float)
        base = _log_probs(mech, X, y, rules, eps, k)
        neighbours = []
        for pats in itertools.combinations_with_replacement(range(16), k):
            Xa = np.vstack([X, *[patterns[p][0][None, :] for p in pats]]).astype(np.uint8)
            ya = np.concatenate([y, [float(patterns[p][1]) for p in pats]])
            neighbours.append((Xa, ya))
        if n >= k:
            for drop in itertools.combinations(range(n), k):
                keep = np.setdiff1d(np.arange(n), drop)
                neighbours.append((X[keep], y[keep]))
        for Xn, yn in neighbours:
            diff = np.max(np.abs(_log_probs(mech, Xn, yn, rules, eps, k) - base))
            assert diff <= eps * (1 + 1e-9)
            worst = max(worst, diff)
    assert worst > 0.3 * eps  # the bound is not vacuous on these tables


class _CountingNoise:
    """A seeded source that counts calls: each mechanism of a fit is exactly one call."""

    def __init__(self, seed: int) -> None:
        self.inner = SeededNoise(seed)
        self.calls = 0

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


@pytest.mark.parametrize("mechanism", ["smooth_laplace", "smooth_cauchy", "monotone_em"])
def test_mechanisms_run_never_exceed_the_planned_steps(mechanism):
    """The budget is split over the most mechanisms any fit runs (3L-2 for smooth_*), and a
    fit that reaches L-1 rules runs all of them: no share is left unspent."""
    from dpsql.rulelist.learner import plan_budget

    X, y = synthetic(3000)
    feats = [Feature.binary_column(f"x{j}") for j in range(6)]
    cands = public_candidates(feats, 2)
    most = 0
    for L in (2, 3, 5):
        for eps in (0.05, 1.0, 50.0):
            for seed in range(4):
                params = LearnerParams(
                    mechanism=mechanism, epsilon=eps, delta=1e-6, max_length=L, min_support=0.05
                )
                src = _CountingNoise(seed)
                rl = learn(X, y, feats, cands, params, src)
                steps = plan_budget(params).steps
                assert src.calls <= steps
                if len(rl.rules) == L:
                    assert src.calls == steps
                most = max(most, src.calls - steps)
    assert most == 0


def test_pattern_weights_learn_what_rows_learn():
    """Rows, their distinct patterns with counts, and integer sample weights give the very
    same list under the same seed (the counts are exact integers either way)."""
    X, y = synthetic(2000)
    feats = [Feature.binary_column(f"x{j}") for j in range(6)]
    cands = public_candidates(feats, 3)
    params = LearnerParams(mechanism="smooth_laplace", epsilon=2.0, delta=1e-6, max_length=5)
    by_rows = learn(X, y, feats, cands, params, SeededNoise(3))
    keys, counts = np.unique(np.column_stack([X, y]), axis=0, return_counts=True)
    by_weight = learn(
        keys[:, :-1], keys[:, -1], feats, cands, params, SeededNoise(3), sample_weight=counts
    )
    assert by_rows == by_weight
    with pytest.raises(DataError, match="whole numbers"):
        learn(X, y, feats, cands, params, SeededNoise(3), sample_weight=np.full(2000, 0.5))


def test_duplicate_and_empty_candidates_are_not_generated():
    from dpsql.policy import load_policy
    from dpsql.rulelist.table_function import features_from_column

    tp = load_policy(
        {
            "tables": {
                "t": {
                    "source": "t",
                    "columns": {
                        "age": {"type": "int", "lower": 0, "upper": 100},
                        "dept": {"type": "text", "values": ["a", "b", "c"]},
                    },
                }
            }
        }
    ).table("t")
    feats = features_from_column(tp.columns["age"], [25, 50, 75]) + features_from_column(
        tp.columns["dept"]
    )
    names = {" and ".join(sorted(rule_name_of(r, feats))) for r in public_candidates(feats, 2)}
    assert "age < 25 and age < 75" not in names  # = age < 25
    assert "age < 25 and age >= 75" not in names  # empty
    assert "dept != 'b' and dept = 'a'" not in names  # = dept = 'a'
    assert "age < 75 and age >= 25" in names and "dept != 'a' and dept != 'b'" in names
    # 3 cuts x 2 + 3 values x 2 = 12 literals; pairs on age: only [lo, hi) with lo < hi (3)
    assert len(names) == len(public_candidates(feats, 2))


def rule_name_of(rule, feats):
    from dpsql.rulelist.candidates import literal_name

    return [literal_name(lit, feats) for lit in rule]
