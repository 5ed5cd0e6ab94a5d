"""Kinds as objects (issue 26 item 4): a ratchet on switches over kind names outside the objects.

What differs between measure kinds (dpsql.plan.measure_kinds: ``rows``, ``sum``, ``dropped``
...) and between aggregate kinds (dpsql.aggregates: ``count``, ``sum``, ``avg`` ...) is asked
of each kind's object, including its engine SQL (MeasureKind.row_value / aggregate /
pair_value, built with dpsql.lower.builders) and which bias measures estimate it
(AggregateKind.bias_reads / bias_estimate), and of a per-unit relation's aggregates
(dpsql.frontend.per_unit_kinds: their ranges and engine aggregates). A comparison of a
``kind`` (a name or an attribute) with a kind's name, anywhere in dpsql/, is a switch the
objects should answer.
Those that remain are recorded below per file with their count and why; a new one fails, and
a record larger than the code (a switch moved onto the objects) must shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import fixture_policy
from sqlglot import exp

from dpsql.aggregates import FUNCTIONS, KINDS, quantile_target
from dpsql.engine import clustered
from dpsql.frontend import per_unit_kinds
from dpsql.frontend.bind import parse_statement
from dpsql.plan import bias
from dpsql.plan.measure_kinds import MEASURE_KINDS
from dpsql.policy import load_policy
from dpsql.service import bounds

ROOT = Path(__file__).resolve().parent.parent / "dpsql"
NAMES = frozenset(MEASURE_KINDS) | frozenset(KINDS) | frozenset(per_unit_kinds.KINDS)

#: file -> comparisons of a kind with a kind's name today (may only go down).
RECORDED: dict[str, int] = {
    # values_measure: the values measure a centred sum's count is, picked by name (the
    # measure kinds import this module, through dpsql.plan.bias)
    "dpsql/aggregates/__init__.py": 1,
    # contribution_query's "rows" histogram (rows per unit, not a measure kind)
    "dpsql/lower/compile.py": 1,
    # a quantile target's (min / max) level
    "dpsql/plan/values.py": 2,
    # the exponential mechanism's targets (min, max)
    "dpsql/privacy/quantiles.py": 2,
    # quantile targets; the units measure the τ-threshold selection reads
    "dpsql/privacy/release.py": 2,
    # a contribution histogram's Need kind "rows" (rows per unit), not a measure kind
    "dpsql/service/bounds.py": 2,
}


def _is_kind(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "kind") or (
        isinstance(node, ast.Name) and node.id == "kind"
    )


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {
            e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        }
    return set()


def switches(source: str) -> int:
    """Comparisons of a ``kind`` with a kind's name (or a tuple of them) in ``source``."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_kind(s) for s in sides) and set().union(*map(_strings, sides)) & NAMES:
                count += 1
    return count


def test_no_new_switch_on_a_kind_name():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        n = switches(path.read_text())
        if n:
            found[str(path.relative_to(ROOT.parent))] = n
    grown = {f: n for f, n in found.items() if n > RECORDED.get(f, 0)}
    assert not grown, (
        f"switches on a kind's name outside its object: {grown} (recorded: "
        f"{ {f: RECORDED.get(f, 0) for f in grown} }); ask the kind's object "
        "(dpsql.plan.measure_kinds.MeasureKind, dpsql.aggregates.AggregateKind) instead"
    )
    stale = {f: (n, found.get(f, 0)) for f, n in RECORDED.items() if found.get(f, 0) < n}
    assert not stale, f"stale records (recorded, now): {stale}; lower them in RECORDED"


def test_the_ratchet_sees_a_switch():
    assert switches('if m.kind == "sum":\n    pass\n') == 1
    assert switches('x = kind in ("rows", "units")\n') == 1
    assert switches('if m.kind == "join":\n    pass\n') == 0
    assert switches("if m.measure_kind.counted:\n    pass\n") == 0


def test_every_measure_kind_builds_its_own_sql():
    """Each measure kind lowers itself: an aggregate over rows, or (a pair-level bias
    measure) a value over a pair's rows; a row value wherever its values are summed."""
    for name, kind in MEASURE_KINDS.items():
        pair = kind.bias and kind.per_pair
        assert (kind.pair_sql is not None) == pair, name
        assert (kind.aggregate_sql is None) == pair, name
        if kind.row_scaled:  # summed from row values: the numpy programs' and bench's value
            assert kind.row_sql is not None, name


def test_bias_reads_name_bias_measures():
    """Which aggregate kinds get a bias estimate is their objects' ``bias_reads``: COUNT the
    rows dropped, SUM the mass cut and clamped, AVG all three; the others none."""
    reads = {name: kind.bias_reads for name, kind in KINDS.items() if kind.bias_reads}
    assert reads == {
        "count": ("dropped",),
        "sum": ("cut", "clamped"),
        "avg": ("dropped", "cut", "clamped"),
    }
    assert all(set(r) <= set(bias.KINDS) for r in reads.values())


def test_every_programmed_kind_says_how_the_engines_compute_it():
    """The numpy programs and the compiled store pass (dpsql.engine.columnar) ask the kind:
    a tally (rows per row, units per pair) has no row value and no kernel code; every other
    programmed kind names one of dpsql.engine.clustered's codes and what of its column a row's
    value reads; a kind the engines do not program names neither."""
    codes = {clustered.VALUES, clustered.SUM, clustered.SUMSQ, clustered.DROPPED, clustered.CUT}
    for name, kind in MEASURE_KINDS.items():
        assert kind.reads in ("", "nulls", "fixed", "excess"), name
        if not kind.programmed or kind.tallied:
            assert kind.kernel is None and not kind.reads, name
            assert not kind.tallied or (kind.counted and kind.row_sql is None), name
            continue
        assert getattr(clustered, kind.kernel or "") in codes, name
        assert (kind.reads == "nulls") == (kind.kernel == "VALUES"), name
        assert (kind.reads == "") == (kind.kernel == "DROPPED"), name
    tallies = {name for name, kind in MEASURE_KINDS.items() if kind.tallied}
    assert tallies == {"rows", "units"}
    # the bounded pairs' columns (dpsql.lower.bounding, dpsql.lower.prepared_plan): a tally per
    # row sums the pairs' __n, one per pair counts the pairs
    assert {n for n in tallies if not MEASURE_KINDS[n].per_pair} == {"rows"}


def test_what_the_service_and_the_plots_ask_of_an_aggregate_kind():
    """dpsql.service.bounds, dpsql.service.group_clamps, EXPLAIN and dpsql.plots ask the kind's
    object: COUNT(col) alone reads no value of its column; AVG is the one sum over a count and
    the one kind clamped per group; SUM the one that adds the centre times a count back."""
    assert {n for n, k in KINDS.items() if not k.reads_values} == {"count"}
    assert {n for n, k in KINDS.items() if k.ratio} == {"avg"}
    assert {n for n, k in KINDS.items() if k.group_clamp} == {"avg"}
    assert {n for n, k in KINDS.items() if k.recentred} == {"sum"}


def test_what_the_binder_asks_of_an_aggregate_kind():
    """dpsql.frontend.bind.calls binds a function's call through its kind's object: COUNT the
    one that counts (COUNT(*), COUNT(1), COUNT(col) of any column, no range); DISTINCT binds
    COUNT to count_distinct (count_units of the privacy unit) and SUM to sum_distinct, and is
    refused elsewhere; PERCENTILE_CONT/DISC state their level, MIN / MAX / MEDIAN are the
    levels 0, 1 and 0.5 of the same quantile object; the kinds of no function bind nothing."""
    bound = {name: KINDS[name] for name in set(FUNCTIONS.values())}
    assert {n for n, k in bound.items() if k.counts} == {"count"}
    assert {n: k.distinct for n, k in bound.items() if k.distinct} == {
        "count": "count_distinct",
        "sum": "sum_distinct",
    }
    assert {n: k.distinct_unit for n, k in bound.items() if k.distinct_unit} == {
        "count": "count_units"
    }
    assert {n for n, k in bound.items() if k.leveled} == {"percentile_cont", "percentile_disc"}
    unbound = [k for n, k in KINDS.items() if n not in bound]
    assert not [k for k in unbound if k.distinct or k.distinct_unit or k.leveled]
    targets = {
        n: quantile_target(SimpleNamespace(kind=n, level=None)) for n in ("min", "max", "median")
    }
    assert targets == {"min": ("min", None), "max": ("max", None), "median": ("quantile", 0.5)}
    levels = {
        q: quantile_target(SimpleNamespace(kind="percentile_cont", level=q)) for q in (0, 0.3, 1)
    }
    assert levels == {0: ("min", None), 0.3: ("quantile", 0.3), 1: ("max", None)}


def test_a_measure_kind_names_the_measure_it_equals():
    """dpsql.plan.sharing.canonical asks the measure kind: a count of a never-NULL column's
    values is the row count; with one row per unit and group, the row count is the units'."""
    assert {n: k.non_null for n, k in MEASURE_KINDS.items() if k.non_null} == {"values": "rows"}
    assert {n: k.one_row for n, k in MEASURE_KINDS.items() if k.one_row} == {"rows": "units"}
    for kind in MEASURE_KINDS.values():
        for other in (kind.non_null, kind.one_row):
            assert other is None or MEASURE_KINDS[other].counted == kind.counted, kind.name


def test_the_bias_measures_are_objects():
    """dpsql.plan.bias's measures own their bound and range (their proofs: that module):
    dropped and cut per kept pair, dropped of no column, cut over the range widened by its
    width, clamped estimated by a chosen clamp's histogram for a single total."""
    kinds = bias.BIAS_KINDS
    assert bias.KINDS == ("dropped", "cut", "clamped")
    assert bias.PAIR_KINDS == ("dropped", "cut") and bias.OF_NO_COLUMN == ("dropped",)
    assert {n for n, k in kinds.items() if k.by_histogram} == {"clamped"}
    assert {n: bias.measure_range(n, -2, 10) for n in kinds} == {
        "dropped": (-2, 10),
        "cut": (-14, 22),
        "clamped": (-2, 10),
    }
    R = 3
    assert {n: bias.row_bound(n, -2, 10, R) for n in kinds} == {
        "dropped": 6,
        "cut": 60,
        "clamped": 12,
    }
    assert bias.row_bound("cut", 0, 0, R) == 6 and bias.row_bound("clamped", 4, 4, R) == 1
    assert {n for n, k in MEASURE_KINDS.items() if k.bias} == set(kinds)


def test_what_a_per_unit_relation_asks_of_its_aggregate_kinds():
    """A per-unit relation's aggregates (dpsql.frontend.per_unit_kinds) are asked, not named,
    by dpsql.frontend.per_unit and dpsql.lower.sources: COUNT and SUM (and their DISTINCT forms)
    read a pair's R kept rows; MIN and MAX keep the column's own policy; COUNT(DISTINCT unit)
    reads no value; SUM(DISTINCT x) is bound as SUM(x); the binder's calls computed are those
    the relation lists, each lowered to its own engine aggregate."""
    kinds = per_unit_kinds.KINDS
    assert {n for n, k in kinds.items() if k.row_bounded} == {
        "count",
        "count_distinct",
        "sum",
        "sum_distinct",
    }
    assert {n for n, k in kinds.items() if k.picks_value} == {"min", "max"}
    assert {n for n, k in kinds.items() if not k.reads_value} == {"count_units"}
    assert set(per_unit_kinds.BOUND) == {
        "count",
        "count_distinct",
        "count_units",
        "sum",
        "avg",
        "min",
        "max",
    }
    assert set(per_unit_kinds.BOUND) <= set(KINDS)  # the binder's kinds (dpsql.aggregates)
    assert {k.name for k in per_unit_kinds.FUNCTIONS.values()} == {
        "count",
        "sum",
        "avg",
        "min",
        "max",
    }
    for kind in kinds.values():
        for other in (kind.distinct, kind.distinct_unit):
            assert other is None or other in kinds, kind.name
        if kind.function is not None:
            assert kind.spelled == kind.name.upper(), kind.name
    column = exp.column("x", quoted=True)
    built = {n: k.aggregate(column.copy()).sql(dialect="duckdb") for n, k in kinds.items()}
    assert built == {
        "count": 'COUNT("x")',
        "count_units": "1",
        "count_distinct": 'COUNT(DISTINCT "x")',
        "sum": 'SUM("x")',
        "sum_distinct": 'SUM(DISTINCT "x")',
        "avg": 'AVG("x")',
        "min": 'MIN("x")',
        "max": 'MAX("x")',
    }
    assert kinds["count"].aggregate(None).sql() == "COUNT(*)"


def test_a_per_unit_kind_ranges_itself():
    """Each kind's range over a pair's R kept rows from the column's declared [L, U] (the
    interval arithmetic of dpsql.frontend.per_unit's docstring): counts [1, R] / [0, R], a
    unit count [1, 1], sums [min(L, R·L), max(U, R·U)], AVG / MIN / MAX [L, U]."""
    column = SimpleNamespace(lower=-2, upper=10, type="int", granularity=1.0, nullable=False)
    column.expr = None
    ranges = {
        n: (r.out, r.type, r.row_clamp)
        for n, k in per_unit_kinds.KINDS.items()
        for r in [k.ranged(column, 5)]
    }
    assert ranges == {
        "count": ((0, 5), "int", None),
        "count_units": ((1, 1), "int", None),
        "count_distinct": ((0, 5), "int", None),
        "sum": ((-10.0, 50.0), "int", (-2.0, 10.0)),
        "sum_distinct": ((-10.0, 50.0), "int", (-2.0, 10.0)),
        "avg": ((-2.0, 10.0), "float", (-2.0, 10.0)),
        "min": ((-2.0, 10.0), "int", (-2.0, 10.0)),
        "max": ((-2.0, 10.0), "int", (-2.0, 10.0)),
    }
    assert per_unit_kinds.KINDS["count"].ranged(None, 5).out == (1, 5)  # COUNT(*)
    assert per_unit_kinds.KINDS["avg"].ranged(column, 5).granularity == 0.001  # 1e-4 of 10


def _default_clamped():
    """The fixture's policy with age and cost clamped by default (no clip stated)."""
    policy = fixture_policy()
    for column in policy["tables"]["visits"]["columns"].values():
        column.pop("clip", None)
    return load_policy(policy)


@pytest.mark.parametrize(
    "aggregates, count, sum_alone, clamped, per_group",
    [
        ("COUNT(*)", 1, 1, (), ()),
        ("SUM(cost)", 2, 1, ("cost",), ()),
        ("AVG(cost)", 2, 2, ("cost",), ("cost",)),
        ("VARIANCE(age)", 3, 3, ("age",), ()),
        ("COUNT(*), COUNT(cost), COUNT(DISTINCT patient_id)", 1, 1, (), ()),
        ("COUNT(*), COUNT(DISTINCT age)", 2, 2, (), ()),
        ("MEDIAN(cost), MIN(cost)", 2, 2, (), ()),
        ("SUM(cost), AVG(cost), VARIANCE(cost)", 3, 3, ("cost",), ()),
        ("SUM(DISTINCT age), SUM(age)", 3, 2, (), ()),
        ("AVG(cost), COUNT(cost)", 2, 2, ("cost",), ()),
        ("AVG(cost), COUNT(DISTINCT cost)", 3, 3, (), ()),
        ("AVG(cost), MEDIAN(cost)", 3, 3, (), ()),
        ("SUM(age), MODE(department)", 3, 2, ("age",), ()),
    ],
)
def test_the_bounds_estimates_read_the_kinds(aggregates, count, sum_alone, clamped, per_group):
    """measure_count (COUNT one measure, SUM its sum and a count, AVG a sum and the count,
    VAR a sum of squares too, every count shared), the columns whose clamp is chosen (COUNT(col)
    reads none of its values) and those chosen per group (AVG only), from the kinds' objects."""
    policy = _default_clamped()
    query = parse_statement(f"SELECT {aggregates} FROM visits GROUP BY department", policy)
    assert bounds.measure_count(query) == count
    assert bounds.measure_count(query, sum_counts=False) == sum_alone
    assert bounds.clamp_columns(query) == clamped
    assert bounds.per_group_columns(query, clamped) == per_group
