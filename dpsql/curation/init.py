"""``dpsql init SOURCE``: draft a commented policy from a CSV / Parquet file or a DuckDB table.

The draft is read off the private data (DuckDB's DESCRIBE and SUMMARIZE, value counts,
quantiles of rows per unit), so every suggestion in it is marked as the curator's decision:
bounds, public domains and contribution limits become public when the policy is used, and a
maximum or a rare category read off the data can identify someone. The draft loads with
:func:`dpsql.policy.load_policy` and answers queries as it stands; ``dpsql check`` validates
it (or any later edit) against the source.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from dpsql.curation.options import KEEP, MAX_VALUES, RARE
from dpsql.curation.source import (
    Source,
    SourceError,
    duckdb_type_family,
    file_source,
    quote_ident,
)
from dpsql.engine.duckdb_engine import SMALL_ROWS

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")
_ID_NAME = re.compile(r"(^id$|_id$|[a-z0-9]Id$|ID$|^[a-z]{1,4}id$)")


# -- profile ----------------------------------------------------------------------------------


@dataclass
class ColumnProfile:
    name: str
    sql_type: str
    type: str | None  # the policy type, None: no policy type (left out)
    nulls: int = 0
    distinct: int = 0  # approximate (DuckDB's HyperLogLog), exact when values is set
    low: Any = None
    high: Any = None
    quantiles: tuple[Any, ...] = ()  # p1, p50, p99 of numbers
    decimals: int | None = None  # floats: the fewest decimals that write every value
    nonfinite: int = 0  # floats: NaN and infinities (left out of low, high and quantiles)
    values: list[tuple[Any, int, int | None]] | None = None  # (value, rows, units) ascending


@dataclass
class KeyBounds:
    """Contribution of units under GROUP BY ``key`` (None: no GROUP BY, one group)."""

    key: str | None
    groups: tuple[int, ...]  # quantiles p50, p90, max of groups per unit
    rows: tuple[int, ...]  # quantiles p50, p90, max of rows per (unit, group)
    suggest_g: int
    suggest_r: int


@dataclass
class UnitProfile:
    column: str
    units: int
    null_rows: int
    keys: list[KeyBounds] = field(default_factory=list)

    @property
    def suggest_r(self) -> int:
        return self.keys[0].suggest_r

    @property
    def suggest_g(self) -> int:
        return max((k.suggest_g for k in self.keys[1:]), default=1)


@dataclass
class Profile:
    source: Source
    rows: int
    columns: list[ColumnProfile]
    skipped: list[tuple[str, str]]  # (column, why)
    candidates: list[str]  # columns that look like a privacy unit, best first
    row_ids: list[str]  # id-like columns unique per row
    unit: UnitProfile | None = None
    unit_reason: str = ""


def _number(text: Any, col_type: str) -> Any:
    if text is None:
        return None
    if col_type == "int":
        return int(text)
    if col_type == "float":
        return float(text)
    return text


def _smallest_keeping(counts: Sequence[tuple[int, int]], keep: float) -> int:
    """The least bound b with sum(min(n, b) * k) >= keep * sum(n * k) over (n, k) pairs."""
    total = sum(n * k for n, k in counts)
    if total == 0:
        return 1
    for bound in sorted({n for n, _ in counts}):
        if sum(min(n, bound) * k for n, k in counts) >= keep * total:
            return max(1, bound)
    return max(1, max(n for n, _ in counts))


def _quantiles(counts: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """p50, p90 and max of a distribution given as (value, frequency) pairs."""
    if not counts:
        return (0, 0, 0)
    ordered = sorted(counts)
    total = sum(k for _, k in ordered)
    out = []
    for q in (0.5, 0.9):
        seen = 0
        for n, k in ordered:
            seen += k
            if seen >= q * total:
                out.append(n)
                break
    return (*out, ordered[-1][0])


def profile(
    source: Source,
    *,
    max_values: int = MAX_VALUES,
    unit: str | None = None,
    no_unit: bool = False,
    keep: float = KEEP,
) -> Profile:
    """Read the source's columns, types, NULLs, ranges, small domains and unit contributions."""
    con = source.connect()
    try:
        return _profile(con, source, max_values, unit, no_unit, keep)
    finally:
        con.close()


def _profile(
    con: duckdb.DuckDBPyConnection,
    source: Source,
    max_values: int,
    unit: str | None,
    no_unit: bool,
    keep: float,
) -> Profile:
    relation = source.relation()
    if source.kind == "csv":  # parse the file once
        con.execute(f"CREATE TEMP TABLE data AS SELECT * FROM {relation}")
        relation = "data"
    described = con.execute(f"DESCRIBE SELECT * FROM {relation}").fetchall()
    summary = {r[0]: r for r in con.execute(f"SUMMARIZE SELECT * FROM {relation}").fetchall()}
    row = con.execute(f"SELECT count(*) FROM {relation}").fetchone()
    rows = int(row[0]) if row else 0
    columns: list[ColumnProfile] = []
    skipped: list[tuple[str, str]] = []
    seen: set[str] = set()
    for name, sql_type, *_ in described:
        col_type = duckdb_type_family(sql_type)
        if name.lower() in seen:
            skipped.append((name, "its name differs from another column's only in case"))
            continue
        seen.add(name.lower())
        if col_type is None:
            skipped.append((name, f"DuckDB type {sql_type} has no policy type"))
            continue
        s = summary.get(name)
        col = ColumnProfile(name, sql_type, col_type)
        if s is not None:
            col.distinct = int(s[4] or 0)
            if col_type in ("int", "float"):
                col.low, col.high = _number(s[2], col_type), _number(s[3], col_type)
            elif col_type == "date":
                col.low, col.high = (
                    (None if s[2] is None else str(s[2])[:10]),
                    (None if s[3] is None else str(s[3])[:10]),
                )
        columns.append(col)
    if columns:
        _column_details(con, relation, columns)
    by_name = {c.name: c for c in columns}
    candidates, row_ids = _unit_candidates(columns, rows)
    reason = ""
    chosen: str | None = None
    if no_unit:
        reason = "--no-unit: every row is its own unit"
    elif unit is not None:
        match = [c.name for c in columns if c.name.lower() == unit.lower()]
        if not match:
            raise SourceError(f"--unit {unit!r} is not a column of {source.describe()}")
        chosen, reason = match[0], "chosen with --unit"
    elif candidates:
        chosen, reason = candidates[0], "its name looks like an id and its values repeat"
    else:
        reason = "no column looks like a repeated id"
    for col in columns:
        if col.distinct <= max_values * 2 and col.type != "float":
            _values(con, relation, col, max_values, chosen)
    prof = Profile(source, rows, columns, skipped, candidates, row_ids, None, reason)
    if chosen is not None:
        keys = [
            c.name
            for c in columns
            if c.name != chosen and (c.values is not None or c.type == "bool")
        ]
        prof.unit = _unit_profile(con, relation, by_name[chosen].name, keys, keep)
    return prof


def _column_details(con: duckdb.DuckDBPyConnection, relation: str, columns: list[ColumnProfile]):
    """Exact NULL counts, p1/p50/p99 of numbers, and the decimals floats are written with."""
    parts: list[str] = []
    for col in columns:
        q = quote_ident(col.name)
        parts.append(f"count(*) - count({q})")
        if col.type == "int":
            parts.append(f"quantile_disc({q}, [0.01, 0.5, 0.99])")
        if col.type == "float":
            x = f"CAST({q} AS DOUBLE)"
            finite = f"FILTER (WHERE isfinite({x}))"
            parts.append(f"quantile_disc({x}, [0.01, 0.5, 0.99]) {finite}")
            parts += [f"min({x}) {finite}", f"max({x}) {finite}"]
            parts.append(f"count(*) FILTER (WHERE NOT isfinite({x}))")
            for k in range(7):
                scaled = f"({x} * 1e{k})"
                parts.append(
                    f"count(*) FILTER (WHERE isfinite({x}) AND abs({scaled} - round({scaled})) "
                    f"> 1e-9 * greatest(1, abs({scaled})))"
                )
    row = con.execute(f"SELECT {', '.join(parts)} FROM {relation}").fetchone()
    assert row is not None
    values = list(row)
    for col in columns:
        col.nulls = int(values.pop(0))
        if col.type in ("int", "float"):
            qs = values.pop(0)
            col.quantiles = tuple(qs) if qs is not None else ()
        if col.type == "float":
            col.low, col.high, col.nonfinite = values.pop(0), values.pop(0), int(values.pop(0))
            misses = [values.pop(0) for _ in range(7)]
            col.decimals = next((k for k, m in enumerate(misses) if m == 0), None)


def _values(
    con: duckdb.DuckDBPyConnection,
    relation: str,
    col: ColumnProfile,
    max_values: int,
    unit: str | None,
) -> None:
    q = quote_ident(col.name)
    value = f"CAST(CAST({q} AS DATE) AS VARCHAR)" if col.type == "date" else q
    units = f"count(DISTINCT {quote_ident(unit)})" if unit and unit != col.name else "NULL"
    found = con.execute(
        f"SELECT {value}, count(*), {units} FROM {relation} WHERE {q} IS NOT NULL "
        f"GROUP BY ALL ORDER BY 1 LIMIT {max_values + 1}"
    ).fetchall()
    col.distinct = len(found) if len(found) <= max_values else max(col.distinct, len(found))
    if found and len(found) <= max_values and col.type != "bool":
        col.values = [(v, int(n), None if u is None else int(u)) for v, n, u in found]


def _unit_candidates(columns: list[ColumnProfile], rows: int) -> tuple[list[str], list[str]]:
    """Columns named like an id whose values repeat (best: most distinct), and id-like
    columns unique per row (row identifiers: no unit beyond the row)."""
    repeated, unique = [], []
    for col in columns:
        if col.type not in ("int", "text") or not _ID_NAME.search(col.name):
            continue
        if col.distinct >= rows * 0.97 and col.nulls == 0:
            unique.append(col.name)
        elif col.distinct > 1:
            repeated.append(col)
    repeated.sort(key=lambda c: -c.distinct)
    return [c.name for c in repeated], unique


def _unit_profile(
    con: duckdb.DuckDBPyConnection, relation: str, unit: str, keys: list[str], keep: float
) -> UnitProfile:
    u = quote_ident(unit)
    row = con.execute(
        f"SELECT count(DISTINCT {u}), count(*) FILTER (WHERE {u} IS NULL) FROM {relation}"
    ).fetchone()
    assert row is not None
    prof = UnitProfile(unit, int(row[0]), int(row[1]))
    for key in [None, *keys]:
        if key is None:
            per_unit = con.execute(
                f"SELECT n, count(*) FROM (SELECT count(*) AS n FROM {relation} "
                f"WHERE {u} IS NOT NULL GROUP BY {u}) GROUP BY n"
            ).fetchall()
            prof.keys.append(
                KeyBounds(
                    None,
                    (1, 1, 1),
                    _quantiles(per_unit),
                    1,
                    _smallest_keeping(per_unit, keep),
                )
            )
            continue
        k = quote_ident(key)
        pairs = (
            f"(SELECT {u} AS u, {k} AS k, count(*) AS n FROM {relation} "
            f"WHERE {u} IS NOT NULL GROUP BY ALL)"
        )
        groups = con.execute(
            f"SELECT g, count(*) FROM (SELECT count(*) AS g FROM {pairs} GROUP BY u) GROUP BY g"
        ).fetchall()
        rows = con.execute(f"SELECT n, count(*) FROM {pairs} GROUP BY n").fetchall()
        prof.keys.append(
            KeyBounds(
                key,
                _quantiles(groups),
                _quantiles(rows),
                _smallest_keeping(groups, keep),
                _smallest_keeping(rows, keep),
            )
        )
    return prof


# -- the draft --------------------------------------------------------------------------------


def nice_up(x: float) -> float:
    """The least of 1, 2, 2.5, 5 times a power of ten that is >= x (x > 0)."""
    if x <= 0:
        return 0.0
    power = 10.0 ** math.floor(math.log10(x))
    for step in (1, 2, 2.5, 5, 10):
        if step * power >= x * (1 - 1e-12):
            return step * power
    return 10 * power


def suggested_bounds(col: ColumnProfile) -> tuple[float, float] | None:
    if col.low is None or col.high is None:
        return None
    if col.values is not None and col.type == "int":  # the listed values already show them
        return col.low, col.high
    lower = 0.0 if col.low >= 0 else -nice_up(-col.low)
    upper = 0.0 if col.high <= 0 else nice_up(col.high)
    if col.type == "int":
        return math.floor(lower), math.ceil(upper)
    return lower, upper


def toml_key(key: str) -> str:
    return key if _BARE.match(key) else json.dumps(key, ensure_ascii=False)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _line(key: str, value: Any, comment: str = "", width: int = 30) -> str:
    text = f"{toml_key(key)} = {toml_value(value)}"
    return f"{text:<{width}} # {comment}" if comment else text


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


WARNING = """\
WARNING: everything in this file becomes PUBLIC. Analysts may learn every bound, every list
of values and every contribution limit below, and dpsql treats them as facts it never
measured. The suggestions were read off the private data itself: an observed maximum, a rare
category or the largest number of rows of one unit can identify a person. Before serving
this policy, replace each suggestion with a value you would publish without having looked
at the data (a codebook, the range of a form's field, a policy decision), or keep it
knowingly. Lines marked "decide:" are the curator's decisions; the "observed:" comments are
private (do not publish this draft as it stands). Validate with: dpsql check POLICY"""


def draft(
    prof: Profile,
    *,
    table: str,
    source_text: str,
    source_note: str,
    dataset: str,
    keep: float = KEEP,
    rare: int = RARE,
) -> str:
    """The commented TOML policy for a profile."""
    out: list[str] = []
    emit = out.append
    src = prof.source
    emit(f"# dpsql policy drafted by `dpsql init` from {src.describe()}")
    emit("#")
    out += [f"# {line}" if line else "#" for line in WARNING.splitlines()]
    emit("")
    emit("[privacy]")
    emit(_line("epsilon", 1.0, "decide: default per-query epsilon"))
    emit(_line("delta", 1e-6, "decide: per-query delta (thresholding of non-public keys)"))
    emit(_line("mechanism", "laplace", 'decide: "laplace" (pure epsilon) or "gaussian"'))
    emit(_line("budget_epsilon", 10.0, "decide: each analyst's total epsilon on this dataset"))
    emit(_line("budget_delta", 1e-5, "decide: each analyst's total delta"))
    emit(_line("dataset", dataset, "the name of this dataset in the budget ledger"))
    if src.kind == "csv":
        # Pinned here so that which path a query takes is the policy's choice, never a row
        # count one unit could move (docs/threat_model.md, "Which tables run programs").
        held = prof.rows <= SMALL_ROWS
        emit("")
        emit("[engine]")
        emit(
            _line(
                "small_tables",
                "columns" if held else "sql",
                f"decide: {'held in memory for fast column programs' if held else 'run as SQL'}"
                f" (observed: {prof.rows} rows; at most {SMALL_ROWS:,} can be held)",
            )
        )
    emit("")
    emit(f"[tables.{toml_key(table)}]")
    emit(_line("source", source_text, source_note))
    unit = prof.unit
    if prof.skipped:
        emit("# columns left out (queries cannot name them):")
        out += [f"#   {name}: {why}" for name, why in prof.skipped]
    if unit is not None:
        out += _unit_lines(prof, unit, keep)
    else:
        emit(f"# privacy unit: none ({prof.unit_reason}), so every row is its own unit.")
        if prof.row_ids:
            emit(f"#   {', '.join(prof.row_ids)}: unique per row (row identifiers, not a unit)")
        emit("#   If one person can have several rows, name the column identifying the")
        emit("#   person (dpsql init --unit COL) or the guarantee covers single rows only.")
        emit('# decide: privacy_unit = "COLUMN"')
    for col in prof.columns:
        emit("")
        emit(f"[tables.{toml_key(table)}.columns.{toml_key(col.name)}]")
        out += _column_lines(prof, col, unit.column if unit else None, rare)
    return "\n".join(out) + "\n"


def _unit_lines(prof: Profile, unit: UnitProfile, keep: float) -> list[str]:
    out = [
        _line(
            "privacy_unit",
            unit.column,
            f"decide: whose presence is protected ({prof.unit_reason})",
        ),
    ]
    others = [c for c in prof.candidates if c != unit.column]
    if others:
        out.append(f"# other id-like columns with repeated values: {', '.join(others)}")
    # "auto": chosen privately from the data at query time (dpsql.privacy.contribution: the
    # analyst's first query on a data version pays bounds_share of its ε), so the published
    # policy reveals nothing the curator read off the data; the observed R and G are comments
    out.append(
        _line(
            "max_rows_per_unit",
            "auto",
            f"decide: R, rows one unit keeps in each group: chosen privately (or R = "
            f"{unit.suggest_r} keeps >= {keep:.0%} of rows, observed)",
        )
    )
    out.append(
        _line(
            "max_groups_per_unit",
            "auto",
            f"decide: G, groups one unit keeps (COUNT sensitivity is G·R): chosen privately "
            f"(or G = {unit.suggest_g}, observed)",
        )
    )
    out.append(
        _line(
            "bounds_share",
            0.1,
            'decide: share of a query\'s ε choosing "auto" bounds (once per data version)',
        )
    )
    out.append(f"# observed: {unit.units} units over {prof.rows} rows")
    if unit.null_rows:
        out.append(f"# observed: {unit.null_rows} rows have a NULL {unit.column}")
    out.append("# observed contributions (p50 / p90 / max); a unit over the bounds is scaled down")
    out.append(
        f"#   {'GROUP BY':<18} {'groups per unit':<18} {'rows per unit, group':<22} "
        f"least G, R keeping {keep:.0%}"
    )
    for k in unit.keys:
        name = "(no GROUP BY)" if k.key is None else k.key
        groups = "1" if k.key is None else " / ".join(map(str, k.groups))
        rows = " / ".join(map(str, k.rows))
        least = f"R = {k.suggest_r}" if k.key is None else f"G = {k.suggest_g}, R = {k.suggest_r}"
        out.append(f"#   {name:<18} {groups:<18} {rows:<22} {least}")
    return out


def _column_lines(prof: Profile, col: ColumnProfile, unit: str | None, rare: int) -> list[str]:
    out: list[str] = []
    facts = [f"{col.sql_type}", f"{col.nulls} NULLs of {prof.rows} rows"]
    if col.values is not None:
        facts.append(f"{len(col.values)} distinct")
    elif col.type != "bool":
        facts.append(f"~{col.distinct} distinct")
    if col.low is not None:
        facts.append(f"min {_show(col.low)}, max {_show(col.high)}")
    if col.nonfinite:
        facts.append(f"{col.nonfinite} NaN or infinite (not in the range)")
    if len(col.quantiles) == 3:
        p1, p50, p99 = col.quantiles
        facts.append(f"p1 {_show(p1)}, p50 {_show(p50)}, p99 {_show(p99)}")
    out.append("# observed: " + "; ".join(facts))
    if col.sql_type.upper().startswith("TIMESTAMP"):
        out.append("# read as a date: the time of day is dropped")
    out.append(_line("type", col.type))
    if col.name == unit:
        out.append(_line("nullable", False, "the privacy unit"))
        return out
    if prof.rows and col.nulls == prof.rows:
        out.append("# observed: only NULLs (the type is DuckDB's guess)")
    if col.nulls == 0:
        out.append(
            _line("nullable", False, "decide: no NULL observed; false: no NULL group is released")
        )
    else:
        out.append(_line("nullable", True, f"{col.nulls} NULLs observed"))
    bounds = suggested_bounds(col) if col.type in ("int", "float") else None
    if bounds is not None:
        lower, upper = bounds
        out.append(_line("lower", lower, f"decide: public bound (observed min {_show(col.low)})"))
        out.append(_line("upper", upper, f"decide: public bound (observed max {_show(col.high)})"))
        out.append("# values outside [lower, upper] are clamped; SUM noise grows with the bound")
        if len(col.quantiles) == 3 and col.quantiles[2] and upper and col.quantiles[2] < upper / 4:
            out.append(
                f"# (the p99 is {_show(col.quantiles[2])}: a bound near it clamps ~1% of rows "
                f"and cuts SUM/AVG noise ~{upper / col.quantiles[2]:.0f}x)"
            )
            # skewed: no clip is written, so the default applies (dpsql.service.bounds: the
            # clamp range chosen from a DP histogram of |x| bought once per analyst and data
            # version); clip = "auto" would buy one with every query's ε
            out.append(
                "# no clip stated: SUM/AVG/VAR clamp to a DP range inside [lower, upper] chosen "
                'once per data version (clip = "declared": to the bounds)'
            )
    if col.type == "float" and bounds is not None:
        from dpsql.policy import default_granularity

        fallback = default_granularity("float", *bounds)
        magnitude = max(abs(bounds[0]), abs(bounds[1]), 1e-12)
        if col.decimals is not None and magnitude / 10.0**-col.decimals <= 1e7:
            step = float(f"1e-{col.decimals}")
            note = f"decide: fixed-point step of sums (values have {col.decimals} decimals)"
        else:
            step, note = fallback, "decide: fixed-point step of sums (~1e-4 of the bound)"
        out.append(_line("granularity", step, note))
    if col.values is not None:
        shown = [v for v, _, _ in col.values]
        out.append(_line("values", shown, "", 0))
        out.append("# decide: the public domain above was read off the data: GROUP BY releases")
        out.append("# every value listed (and no other); list the full public codebook instead")
        few = [v for v, n, units in col.values if (units if units is not None else n) < rare]
        if few:
            what = "units" if unit else "rows"
            shown_few = ", ".join(toml_value(v) for v in few[:10])
            more = f" and {len(few) - 10} more" if len(few) > 10 else ""
            out.append(
                f"# observed: {len(few)} value(s) held by fewer than {rare} {what}: "
                f"{shown_few}{more}"
            )
            out.append("# (listing a value reveals that someone has it)")
    elif col.type in ("text", "date") or (col.type == "int" and bounds is None):
        out.append(f"# no public domain: GROUP BY {col.name} releases only keys whose noisy count")
        out.append("# passes a threshold (costs delta); declare values = [...] from a public list")
    return out


# -- command ----------------------------------------------------------------------------------


def table_name(text: str) -> str:
    name = re.sub(r"[^a-z0-9_]+", "_", text.lower()).strip("_") or "data"
    return name if name[0].isalpha() else f"t_{name}"


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".csv.gz", ".csv", ".tsv", ".parquet"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def source_from_args(args: argparse.Namespace) -> tuple[Source, str]:
    """The source and a default table name."""
    if args.database is not None:
        if args.source is not None or args.table is None:
            raise SourceError("give either SOURCE (a file) or --database FILE --table NAME")
        db = Path(args.database).resolve()
        return Source(table=args.table, database=db), table_name(args.table)
    if args.source is None:
        raise SourceError("give SOURCE (a CSV/Parquet file) or --database FILE --table NAME")
    if args.table is not None:
        raise SourceError("--table names a table of --database; for a file use --name")
    src = file_source(args.source)
    return src, table_name(_stem(src.path or Path(args.source)))


def validate(text: str, source: Source, table: str) -> None:
    """The draft must load with dpsql's policy loader (paths made absolute here)."""
    from dpsql.policy import load_policy

    data = tomllib.loads(text)
    if source.path is not None:
        data["tables"][table]["source"] = str(source.path)
    load_policy(data)


def run(args: argparse.Namespace) -> int:
    from dpsql.errors import PolicyError

    out = Path(args.output) if args.output else None
    if out is not None and out.exists() and not args.force:
        print(f"error: {out} exists (use --force to overwrite it)", file=sys.stderr)
        return 1
    try:
        source, default_name = source_from_args(args)
        table = table_name(args.name) if args.name else default_name
        prof = profile(
            source,
            max_values=args.max_values,
            unit=args.unit,
            no_unit=args.no_unit,
            keep=args.keep,
        )
    except (SourceError, duckdb.Error) as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    if source.path is None:
        source_text = source.table or ""
        note = f"a table of --database {args.database} (give it to query/serve/check)"
    elif out is not None:
        source_text = os.path.relpath(source.path, out.resolve().parent)
        note = "relative to this file"
    else:
        source_text = str(source.path)
        note = "absolute (dpsql init -o FILE writes it relative to FILE)"
    text = draft(
        prof,
        table=table,
        source_text=source_text,
        source_note=note,
        dataset=args.dataset or table,
        keep=args.keep,
        rare=args.rare,
    )
    try:
        validate(text, source, table)
    except PolicyError as exc:  # a bug in the draft, never the curator's
        print(f"error: the drafted policy does not load: {exc}", file=sys.stderr)
        return 1
    if out is None:
        sys.stdout.write(text)
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}: review every 'decide:' line, then run dpsql check {out}", file=sys.stderr)
    return 0
