"""Load and validate the privacy policy (TOML file or dict).

The policy is the only source of public facts: which tables exist, what their privacy unit is,
how much one unit may contribute, and each column's type, bounds and public domain. Anything
here is assumed public; nothing in it may be measured on the private data.

Every problem is reported at connect time as a :class:`PolicyError` naming the file, the key
and the fix, so a bad policy never reaches a query.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dpsql.errors import PolicyError, ProgrammingError
from dpsql.limits import DEFAULT_LIMITS, Limits, limits_from_section
from dpsql.policy_schema import (  # noqa: F401 (re-exported)
    BOUNDINGS,
    COLUMN_TYPES,
    ENGINE_NAMES,
    MECHANISMS,
    PRIVACY_KEYS,
)
from dpsql.policy_schema import check as check_shape
from dpsql.privacy.accounting import Budget
from dpsql.sources import (
    SourceSyntaxError,
    glob_files,
    is_glob,
    is_postgres,
    is_remote,
    parse_postgres,
)

_PRIVACY_KEYS = PRIVACY_KEYS  # dpsql.smartnoise_import reads it

# The comparison families of the declared types: two values compare without a cast that could
# fail exactly when their families are equal (int and float compare as numbers; text against a
# number or a date would make the engine cast one side, and that cast fails on some values).
# The one rule for every comparison the engine runs without TRY: WHERE conditions
# (dpsql.frontend.safety), join conditions (JoinStep below), the privacy units that tables share.
TYPE_FAMILY = {"int": "number", "float": "number", "text": "text", "bool": "bool", "date": "date"}
#: Each policy column type as the SQL type every engine and generated statement casts it to.
SQL_TYPES = {
    "int": "BIGINT",
    "float": "DOUBLE",
    "text": "VARCHAR",
    "bool": "BOOLEAN",
    "date": "DATE",
}


def comparable(a: str, b: str) -> bool:
    """True if values of declared types ``a`` and ``b`` compare without a failing cast."""
    return TYPE_FAMILY.get(a) is not None and TYPE_FAMILY.get(a) == TYPE_FAMILY.get(b)


FILE_SUFFIXES = (".csv", ".csv.gz", ".tsv", ".parquet")

BOUNDING_DEFAULT = "scale"

# the largest bound an "auto" max_rows_per_unit / max_groups_per_unit may be chosen as (the
# last candidate of dpsql.privacy.contribution): planned with it where nothing is chosen
AUTO_CAP = 64

# A public table is read whole at connect (joins inline its rows as lookups): at most this
# many rows, or privacy.max_bins if larger.
PUBLIC_ROWS = 10_000


@dataclass(frozen=True)
class ColumnPolicy:
    name: str
    type: str
    lower: float | None = None
    upper: float | None = None
    values: tuple[Any, ...] | None = None
    # NULL is a value of the column's public domain: GROUP BY releases a NULL group. A policy
    # that does not declare it gets False where the domain is public (values, bool, bounds, a
    # date range: a NULL bin there would be released whether or not any row is NULL, the
    # phantom group of issue 31) and True elsewhere (a NULL key is thresholded like any key).
    nullable: bool = True
    # whether the policy said so (nullable = true/false); an undeclared column may hold NULLs
    nullable_declared: bool = True
    granularity: float = 1.0
    # A computed column (an expression inside an aggregate, e.g. SUM(a * b)): its SQL over
    # the table's stored columns, and the range derived from their declared bounds. None for
    # a column stored in the source.
    expr: str | None = None
    # the same expression as a tree (a sqlglot node: a copy of the binder's, never changed),
    # which the lowerings place copies of (dpsql.lower.row_values.column_value) instead of
    # parsing ``expr`` back; ``expr`` stays its rendering, for the cache keys and EXPLAIN
    tree: Any = field(default=None, compare=False, repr=False)
    # the public grid of its quantiles (dpsql.privacy.quantiles): "auto" is chosen from the
    # declared range (dpsql.privacy.defaults: log for a wide non-negative one), bins None its
    # default count
    quantile_grid: str = "auto"
    quantile_bins: int | None = None
    # "auto": a DP clipping range per query (dpsql.privacy.clipping); "default" (unstated): a
    # range chosen once per analyst and data version (dpsql.service.bounds); "declared"
    clip: str = "default"
    clip_share: float = 0.1
    clip_method: str = "auto"  # "sum" for a total, "quantile" per group (docs/mechanisms.md)
    clip_quantile: float = 0.9
    # A date column's declared first and last day (lower/upper in the policy): its public
    # range, whose days every date key enumerates (dpsql.plan.domains). Kept apart from the
    # numeric lower/upper, which mean clamping bounds of sums.
    date_range: tuple[_dt.date, _dt.date] | None = None

    @property
    def may_hold_null(self) -> bool:
        """False only when declared ``nullable = false`` (then COUNT(col) is COUNT(*))."""
        return self.nullable or not self.nullable_declared

    @property
    def bounded(self) -> bool:
        return self.lower is not None and self.upper is not None

    @property
    def numeric(self) -> bool:
        return self.type in ("int", "float")


@dataclass(frozen=True)
class JoinStep:
    """One source of a private join (dpsql.frontend.private_joins): a policy table under an
    internal alias, joined (``kind`` INNER or LEFT; "" for the first) ON equalities
    ``(alias, column, alias, column)`` with the steps before it."""

    table: TablePolicy
    alias: str
    kind: str = ""
    on: tuple[tuple[str, str, str, str], ...] = ()


def declared_type(table: TablePolicy, column: str) -> str | None:
    """The declared type of ``column`` of ``table``, through a private join's outputs (a
    unit_path table's unit is its owner's column); None if it is not declared."""
    spec = table.columns.get(column)
    if spec is not None:
        return spec.type
    if table.joined is not None:
        for name, alias, source in table.joined.outputs:
            if name == column:
                step = next(s for s in table.joined.steps if s.alias == alias)
                return declared_type(step.table, source)
    return None


@dataclass(frozen=True)
class JoinedSource:
    """A relation of private tables joined so that every output row belongs to one unit: on
    the privacy unit, or along declared foreign keys (unit_path). ``outputs`` names its
    columns: (name, alias, column). Compiled as a real JOIN in the engine's FROM."""

    steps: tuple[JoinStep, ...]
    outputs: tuple[tuple[str, str, str], ...]
    description: str

    @functools.cached_property
    def identity(self) -> str:
        """Everything that decides which rows the join yields, canonically: each step's table,
        alias, kind and ON pairs, the output columns, and a digest of the public rows a step
        holds (public tables are joined as those rows). Two joins with equal identities read
        the same relation, so plan fingerprints and cache keys include it (a key that named
        only the tables returned one join's answer for another)."""
        parts = []
        for step in self.steps:
            table = step.table
            rows = ""
            if table.public and table.rows is not None:
                rows = hashlib.sha256(repr(table.rows).encode()).hexdigest()
            inner = table.joined.identity if table.joined is not None else ""
            parts.append(f"{table.name}:{step.alias}:{step.kind}:{step.on!r}:{rows}:{inner}")
        parts.append(repr(self.outputs))
        return "\n".join(parts)

    def __post_init__(self) -> None:
        # Totality by construction: every ON equality the engine will run compares two
        # declared columns of one comparison family, so the join cannot fail on any value (a
        # text id against an integer key would cast, and fail on the rows that reach it:
        # a predicate oracle). The frontend refuses such joins with a hint first; this is
        # the invariant no construct building a join can forget. Raised at bind time,
        # before anything is read or charged.
        tables = {s.alias: s.table for s in self.steps}
        for step in self.steps:
            for a, ca, b, cb in step.on:
                ta, tb = declared_type(tables[a], ca), declared_type(tables[b], cb)
                if ta is None or tb is None or not comparable(ta, tb):
                    raise ProgrammingError(
                        f"join condition {ca} = {cb} compares "
                        f"{ta or 'an undeclared column'} with {tb or 'an undeclared column'}",
                        sqlstate="42804",
                        construct=f"{ca} = {cb}",
                        hint="join columns of the same declared type",
                    )


@dataclass(frozen=True)
class TablePolicy:
    name: str
    source: str
    source_path: Path | None
    columns: Mapping[str, ColumnPolicy]
    privacy_unit: str | None = None
    max_rows_per_unit: int = 1
    max_groups_per_unit: int = 1
    # the bounds declared "auto" ("rows", "groups"): their int fields above hold the largest
    # value the choice may return (dpsql.privacy.contribution), the fallback of any path that
    # plans without a choice; dpsql.service.bounds replaces them per query with the chosen ones
    auto_bounds: tuple[str, ...] = ()
    bounds_share: float = 0.1  # the share of a query's ε that pays for a choice
    version: str | None = None
    # how a (unit, group) over R rows is bounded: "scale" (R/n of every row) or "sample"
    # (R rows by keyed hash); dpsql.plan.values's docstring states both
    # the bounds planned where an "auto" one is never chosen (a private join on the unit, a
    # per-unit relation): the cap for a declared "auto"; 1 for a bound the policy left
    # unstated (its default "auto" is chosen on single-table queries only, so these paths
    # keep the former default rather than plan at the cap)
    unchosen_fallback: tuple[int, int] = (AUTO_CAP, AUTO_CAP)
    # set by dpsql.service.bounds on the statement that paid for its "auto" bounds' histogram:
    # its one overhead share bought the histogram, whose estimate of what R cuts stands for
    # the per-query bias measures (dpsql.plan.bias.bias_specs plans none)
    bias_by_histogram: bool = False
    bounding: str = BOUNDING_DEFAULT
    # A public table: no privacy unit, never charged; its rows (typed, in file order) are
    # public facts read at connect, like declared values (dpsql.frontend.joins).
    public: bool = False
    unique_keys: tuple[str, ...] = ()  # declared primary_key / unique columns
    rows: tuple[tuple[Any, ...], ...] | None = field(default=None, compare=False, repr=False)
    # unit_path: (column, target table, target key) steps to the table owning the unit; such a
    # table's privacy_unit is the owner's unit column, read through ``joined``.
    unit_path: tuple[tuple[str, str, str], ...] = ()
    # Not None: the table is a private join (a unit_path table, or a query's join of private
    # tables on the unit), rendered as a JOIN in the engine (dpsql.frontend.private_joins).
    joined: JoinedSource | None = field(default=None, repr=False)

    @property
    def row_level(self) -> bool:
        """Each row is its own privacy unit."""
        return self.privacy_unit is None

    @property
    def unit_is_row(self) -> bool:
        """A unit has at most one row: none is declared, or it is the primary_key / unique
        (the declaration is trusted for what the bounds may cut, never for privacy: R = 1
        bounds a unit's rows whatever the data holds)."""
        return self.privacy_unit is None or (
            self.privacy_unit in self.unique_keys
            and self.max_rows_per_unit == 1
            and self.max_groups_per_unit == 1
        )

    def unchosen_bounds(self) -> tuple[int, int]:
        """(R, G) where "auto" bounds are not chosen: :attr:`unchosen_fallback` for each."""
        rows, groups = self.max_rows_per_unit, self.max_groups_per_unit
        if "rows" in self.auto_bounds:
            rows = self.unchosen_fallback[0]
        if "groups" in self.auto_bounds:
            groups = self.unchosen_fallback[1]
        return rows, groups


@dataclass(frozen=True)
class EngineConfig:
    """Which engine runs the compiled plans, and (for Spark) how to reach it."""

    name: str = "duckdb"
    master: str | None = None
    conf: Mapping[str, Any] = field(default_factory=dict)
    # DuckDB's perfect_ht_threshold. 20 makes a per-unit aggregate over an integer unit with a
    # range of up to 2^20 ~3x cheaper, but every such aggregate then allocates and clears a
    # 2^bits table per thread, which costs more than it saves on small tables with sparse ids.
    perfect_hash_bits: int = 12
    # DuckDB's threads; None = one per core. With many small concurrent queries (the wire
    # server) 1 avoids the cost of splitting each query across a shared pool.
    threads: int | None = None
    # DuckDB: the prepared store (dpsql.engine.prepared): "off", "memory" or "disk", and
    # where disk stores go (None: the ledger's directory).
    prepared: str = "off"
    prepared_dir: str | None = None
    # DuckDB: plans on small eager tables run on their columns in memory (dpsql.engine.columnar)
    # where dpsql.lower.local_plan can mirror them ("columns"), or always as SQL ("sql")
    small_tables: str = "auto"


@dataclass(frozen=True)
class Policy:
    path: Path | None
    tables: Mapping[str, TablePolicy]
    epsilon: float = 1.0
    delta: float = 0.0
    mechanism: str = "laplace"
    budget: Budget = field(default_factory=lambda: Budget(10.0, 1e-6))
    ledger_path: Path | None = None
    dataset: str = "default"
    max_bins: int = 10_000
    schema: str | None = None  # accepted as a table qualifier, besides main and public
    engine: EngineConfig = field(default_factory=EngineConfig)
    analysts: frozenset[str] | None = None  # None: in-process callers may name any analyst
    access: Any = field(default=None, compare=False)  # dpsql.access.AccessPolicy; None: all
    limits: Limits = DEFAULT_LIMITS  # [limits]: what one statement may be (dpsql.limits)
    # [server]: the wire server's settings, as written; `dpsql serve` validates them
    server: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def table(self, name: str) -> TablePolicy | None:
        return self.tables.get(name.lower())


def load_policy(policy: str | Path | Mapping[str, Any]) -> Policy:
    """Read a policy from a TOML path or an already-parsed mapping, validating every key."""
    if isinstance(policy, Mapping):
        return _build(dict(policy), None)
    path = Path(policy)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(
            f"cannot read policy file {str(path)!r}: {exc.strerror}",
            construct=str(path),
            hint="pass the path of a TOML privacy policy to connect(policy=...)",
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(
            f"policy file {str(path)!r} is not valid TOML: {exc}",
            construct=str(path),
            hint="fix the TOML syntax at the line given",
        ) from None
    return _build(data, path)


class _Reporter:
    """Formats policy errors with the file and the dotted key."""

    def __init__(self, path: Path | None) -> None:
        self.where = f"policy file {str(path)!r}" if path else "policy"

    def fail(self, key: str, problem: str, fix: str) -> PolicyError:
        return PolicyError(f"{self.where}: {key}: {problem}", construct=key, hint=fix)

    def unknown_keys(self, section: str, given: Mapping[str, Any], known: Mapping[str, str]):
        for key in given:
            if key not in known:
                allowed = ", ".join(sorted(known))
                raise self.fail(
                    f"{section}.{key}" if section else key,
                    "unknown key",
                    f"remove it or use one of: {allowed}",
                )


def _number(rep: _Reporter, key: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise rep.fail(key, f"expected a number, got {value!r}", "write a plain number")
    if math.isinf(value):
        raise rep.fail(key, f"must be finite, got {value!r}", "write a finite number")
    if positive and not value > 0:
        raise rep.fail(key, f"must be > 0, got {value!r}", "use a positive number")
    return float(value)


def _no_duplicates(rep: _Reporter, section: str, given: Mapping[str, Any]) -> None:
    """Names are case-insensitive (SQL identifiers): two differing only in case would clash."""
    seen: dict[str, str] = {}
    for name in given:
        first = seen.setdefault(name.lower(), name)
        if first != name:
            raise rep.fail(
                f"{section}.{name}",
                f"duplicate of {first!r} (names are case-insensitive)",
                "rename or remove one of them",
            )


def _build(data: dict[str, Any], path: Path | None) -> Policy:
    rep = _Reporter(path)
    # the shape of every section and key (types, unknown and required keys, ranges): the
    # published schema (dpsql.policy_schema); what follows checks what needs the whole policy
    check_shape(data, rep.fail)
    # [server]: read and validated by `dpsql serve` (dpsql.server.connections), not here
    server = data.get("server", {})
    engine = _engine(rep, data.get("engine", {}))
    limits = limits_from_section(data.get("limits", {}), rep.fail, rep.unknown_keys)
    privacy = data.get("privacy", {})
    epsilon = float(privacy.get("epsilon", 1.0))
    delta = float(privacy.get("delta", 0.0))
    mechanism = privacy.get("mechanism", "laplace")
    if mechanism == "gaussian" and delta <= 0:
        raise rep.fail(
            "privacy.delta", "the Gaussian mechanism needs delta > 0", "set e.g. delta = 1e-6"
        )
    budget_eps = float(privacy.get("budget_epsilon", 10.0))
    budget_delta = float(privacy.get("budget_delta", max(delta, 0)))
    share = float(privacy.get("gaussian_share", 1.0 if mechanism == "gaussian" else 0.0))
    if share > 0 and budget_delta <= 0:
        raise rep.fail(
            "privacy.budget_delta",
            "a Gaussian share of the budget needs budget_delta > 0",
            "set budget_delta = 1e-5, or gaussian_share = 0",
        )
    base = path.parent if path else Path.cwd()
    ledger = privacy.get("ledger")
    if ledger is not None:
        ledger_path: Path | None = (base / ledger).resolve()
    elif path is not None:
        ledger_path = (base / f"{path.stem}.ledger.sqlite").resolve()
    else:
        ledger_path = None
    dataset = privacy.get("dataset", path.stem if path else "default")
    max_bins = int(privacy.get("max_bins", 10_000))
    analysts = privacy.get("analysts")
    schema = privacy.get("schema")

    tables_raw = data["tables"]
    _no_duplicates(rep, "tables", tables_raw)
    tables = {
        name.lower(): _table(rep, name, spec, base, engine.name, max_bins)
        for name, spec in tables_raw.items()
    }
    tables = _resolve_unit_paths(rep, tables)
    _check_shared_units(rep, tables)
    access = _access(rep, data, tables_raw, analysts)
    return Policy(
        path=path,
        tables=tables,
        epsilon=epsilon,
        delta=delta,
        mechanism=mechanism,
        budget=_budgets(rep, data, Budget(budget_eps, budget_delta, share), access, analysts),
        ledger_path=ledger_path,
        dataset=dataset,
        max_bins=max_bins,
        schema=schema.strip() if schema is not None else None,
        engine=engine,
        analysts=None if analysts is None else frozenset(analysts),
        access=access,
        limits=limits,
        server=server,
    )


def _access(rep: _Reporter, data: dict[str, Any], tables: dict[str, Any], analysts: Any) -> Any:
    """``[access]`` and the tables' and columns' allow/deny (dpsql.access); None: none."""
    from dpsql.access import build_access

    names = None if analysts is None else frozenset(analysts)
    return build_access(rep, data.get("access"), tables, names)


def _budgets(
    rep: _Reporter, data: dict[str, Any], base: Budget, access: Any, analysts: Any
) -> Budget:
    """``[budgets]``: group, dataset-wide and renewing budgets (dpsql.privacy.budget_rules),
    carried by the per-analyst default budget; ``base`` itself without the section."""
    from dpsql.privacy.budget_rules import build_rules

    roles = access.roles if access is not None else {}
    names = None if analysts is None else frozenset(analysts)
    return build_rules(rep, data.get("budgets"), base, roles, names)


def _engine(rep: _Reporter, spec: Any) -> EngineConfig:
    # each key's type and range: the schema (dpsql.policy_schema); here, which engine takes it
    name = spec.get("name", "duckdb")
    master = spec.get("master")
    conf = spec.get("conf", {})
    bits = spec.get("perfect_hash_bits", 12)
    threads = spec.get("threads")
    prepared = spec.get("prepared", "off")
    prepared_dir = spec.get("prepared_dir")
    small_tables = spec.get("small_tables", "auto")
    for key in ("perfect_hash_bits", "threads", "small_tables"):  # Spark has a store too
        if name != "duckdb" and key in spec:
            raise rep.fail(f"engine.{key}", "only the DuckDB engine takes it", "remove it")
    if name != "spark" and (master is not None or conf):
        raise rep.fail(
            "engine.master" if master is not None else "engine.conf",
            "only the Spark engine takes a master or conf",
            'set name = "spark", or remove them',
        )
    return EngineConfig(
        name, master, dict(conf), bits, threads, prepared, prepared_dir, small_tables
    )


def _table(
    rep: _Reporter,
    name: str,
    spec: Any,
    base: Path,
    engine: str = "duckdb",
    max_bins: int = PUBLIC_ROWS,
) -> TablePolicy:
    key = f"tables.{name}"
    source = spec["source"]  # its shape: the schema (dpsql.policy_schema)
    source_path = _source_path(rep, key, source, base, engine)
    cols_raw = spec["columns"]
    _no_duplicates(rep, f"{key}.columns", cols_raw)
    columns = {c.lower(): _column(rep, f"{key}.columns.{c}", c, s) for c, s in cols_raw.items()}
    unit = spec.get("privacy_unit")
    if unit is not None:
        if unit.lower() not in columns:
            raise rep.fail(
                f"{key}.privacy_unit",
                f"{unit!r} is not a declared column",
                f"declare it under [{key}.columns.{unit}] or fix the name",
            )
        unit = unit.lower()
    # Unstated bounds (issue 31): "auto" where a unit may have several rows, 1 where it
    # cannot (no privacy unit: a row is its unit; a unit declared primary_key / unique: one
    # row per unit, so R = 1 and G = 1 never cut a row). Explicit values stay the curator's.
    one_row = unit is None or unit in _declared_unique(spec)
    rows = spec.get("max_rows_per_unit", 1 if one_row else "auto")
    groups = spec.get("max_groups_per_unit", 1 if one_row else "auto")
    auto_bounds = tuple(
        name
        for name, value in (("rows", rows), ("groups", groups))
        if value == "auto"  # checked by the schema: an int >= 1 or "auto"
    )
    unit_path = _unit_path(rep, key, spec.get("unit_path"), columns)
    if unit_path and unit is not None:
        raise rep.fail(
            f"{key}.unit_path",
            "a table declares either its own privacy_unit or a unit_path to it, not both",
            "remove unit_path (the table holds the unit column), or remove privacy_unit",
        )
    if unit is None and not unit_path and (rows != 1 or groups != 1):
        raise rep.fail(
            f"{key}.max_rows_per_unit" if rows != 1 else f"{key}.max_groups_per_unit",
            "without a privacy_unit every row is its own unit, so the bounds must be 1",
            "declare privacy_unit, or remove max_rows_per_unit / max_groups_per_unit",
        )
    if auto_bounds:
        rows = AUTO_CAP if rows == "auto" else rows
        groups = AUTO_CAP if groups == "auto" else groups
    fallback = (
        1 if "max_rows_per_unit" not in spec else AUTO_CAP,
        1 if "max_groups_per_unit" not in spec else AUTO_CAP,
    )
    version = spec.get("version")
    if version is not None:
        version = str(version)
    bounding = spec.get("bounding", BOUNDING_DEFAULT)
    public = spec.get("public", False)
    if public and unit_path:
        raise rep.fail(
            f"{key}.unit_path",
            "a public table has no privacy unit",
            "remove unit_path (the table is public), or remove public = true",
        )
    if public and unit is not None:
        raise rep.fail(
            f"{key}.public",
            "a public table has no privacy unit",
            "remove privacy_unit (the table is public), or remove public = true",
        )
    unique_keys = _unique_keys(rep, key, spec, columns)
    table = TablePolicy(
        name=name.lower(),
        source=source,
        source_path=source_path,
        columns=columns,
        privacy_unit=unit,
        max_rows_per_unit=rows,
        max_groups_per_unit=groups,
        auto_bounds=auto_bounds,
        bounds_share=float(spec.get("bounds_share", 0.1)),
        version=version,
        bounding=bounding,
        public=public,
        unchosen_fallback=fallback,
        unique_keys=unique_keys,
        unit_path=unit_path,
    )
    if public:
        table = replace(table, rows=_public_rows(rep, key, table, spec, max(max_bins, PUBLIC_ROWS)))
    return table


def _source_path(rep: _Reporter, key: str, source: str, base: Path, engine: str) -> Path | None:
    """A table's local file (or glob, or Spark's directory of part files), resolved against
    the policy's folder and checked to exist; None for a source read elsewhere (PostgreSQL,
    a remote URI), whose syntax alone is checked here."""
    source_path = None
    if is_postgres(source):  # read at connect by the engine (dpsql.sources, docs/sources.md)
        try:
            parse_postgres(source)
        except SourceSyntaxError as exc:
            raise rep.fail(f"{key}.source", str(exc), exc.hint) from None
    elif engine == "spark" and "://" in source:
        pass  # a URI Spark reads itself (s3a://, hdfs://, file://), checked when it loads
    elif is_remote(source):
        pass  # s3:// or https://: DuckDB's httpfs reads it at connect, or the engine refuses
    elif source.lower().rstrip("/").endswith(FILE_SUFFIXES):
        source_path = (base / source).resolve()
        # Spark also reads directories of part files (how it writes Parquet).
        if is_glob(source):
            if engine == "spark":
                raise rep.fail(
                    f"{key}.source",
                    "the Spark engine reads a directory of part files, not a glob",
                    "point source at the directory, or use the DuckDB engine",
                )
            if not glob_files(source_path):
                raise rep.fail(
                    f"{key}.source",
                    f"no file matches {str(source_path)!r}",
                    "fix the pattern (it is relative to the policy file)",
                )
        elif not (source_path.is_file() or (engine == "spark" and source_path.is_dir())):
            raise rep.fail(
                f"{key}.source",
                f"file {str(source_path)!r} does not exist",
                "fix the path (it is relative to the policy file)",
            )
    return source_path


def _unit_path(
    rep: _Reporter, key: str, raw: Any, columns: Mapping[str, ColumnPolicy]
) -> tuple[tuple[str, str, str], ...]:
    """``unit_path = ["fk -> table.key", ...]`` as (column, table, key) steps (their targets
    are checked once every table is read: :func:`_resolve_unit_paths`)."""
    if raw is None:
        return ()
    example = 'unit_path = ["encounter_id -> encounters.encounter_id"]'
    if isinstance(raw, str):  # a list of strings, or one: the schema (dpsql.policy_schema)
        raw = [raw]
    steps = []
    for step in raw:
        left, arrow, right = step.partition("->")
        target, dot, target_key = right.strip().partition(".")
        if not arrow or not dot or not left.strip() or not target or not target_key:
            raise rep.fail(
                f"{key}.unit_path",
                f"{step!r} is not a step 'column -> table.key'",
                example,
            )
        steps.append((left.strip().lower(), target.strip().lower(), target_key.strip().lower()))
    if steps[0][0] not in columns:
        raise rep.fail(
            f"{key}.unit_path",
            f"{steps[0][0]!r} is not a declared column",
            f"declare it under [{key}.columns.{steps[0][0]}] or fix the name",
        )
    return tuple(steps)


def _resolve_unit_paths(rep: _Reporter, tables: dict[str, TablePolicy]) -> dict[str, TablePolicy]:
    """Each unit_path table as the INNER JOIN of its path, its privacy unit the owner's unit
    column.

    Stability: every step joins ON a declared unique key of the next table, so each row meets
    at most one row there and, at the end, one owner row: the row belongs to exactly one unit
    (a row whose path breaks has no unit and is never used). Removing a unit from all tables
    removes exactly the rows that reach it, as for a table holding the unit column; bounding
    then runs on the joined rows (R rows per group, G groups per unit). The declared keys of
    private tables are facts the policy asserts (like privacy_unit), not checked on the data:
    checking them would be a data-dependent error.
    """
    out = dict(tables)
    for name, table in tables.items():
        if not table.unit_path:
            continue
        key = f"tables.{name}.unit_path"
        steps = [JoinStep(table, "j0")]
        current = table
        for i, (column, target_name, target_key) in enumerate(table.unit_path):
            where = f"step {i + 1} ({column} -> {target_name}.{target_key})"
            if column not in current.columns:
                raise rep.fail(
                    key,
                    f"{where}: {column!r} is not a declared column of {current.name!r}",
                    f"each step starts from a column of the table the previous step reached "
                    f"(declared: {', '.join(current.columns)})",
                )
            target = tables.get(target_name)
            if target is None or target is table:
                raise rep.fail(
                    key,
                    f"{where}: {target_name!r} is not another declared table",
                    "name a [tables.NAME] of this policy on the way to the privacy unit",
                )
            if target.public or target.unit_path:
                raise rep.fail(
                    key,
                    f"{where}: {target_name!r} "
                    + ("is public" if target.public else "has a unit_path of its own"),
                    "spell out the whole path, through private tables, to the table that "
                    "declares privacy_unit",
                )
            if target_key not in target.columns or target_key not in target.unique_keys:
                raise rep.fail(
                    key,
                    f"{where}: {target_name}.{target_key} is not a declared unique key",
                    f'declare primary_key = "{target_key}" (or unique = ["{target_key}"]) in '
                    f"[tables.{target_name}] if its values are unique: each row must reach "
                    "one row of the next table",
                )
            if current.columns[column].type != target.columns[target_key].type:
                raise rep.fail(
                    key,
                    f"{where}: {current.name}.{column} and {target_name}.{target_key} have "
                    "different types",
                    "declare both columns with the same type",
                )
            on = ((f"j{i}", column, f"j{i + 1}", target_key),)
            steps.append(JoinStep(target, f"j{i + 1}", "INNER", on))
            current = target
        unit = current.privacy_unit
        if unit is None:
            raise rep.fail(
                key,
                f"the path ends at {current.name!r}, which declares no privacy_unit",
                "continue the path to the table that declares privacy_unit",
            )
        if unit in table.columns:
            raise rep.fail(
                key,
                f"the table has a column {unit!r}, the name of the privacy unit it reaches",
                f'declare privacy_unit = "{unit}" instead of unit_path, or rename the column',
            )
        outputs = (*((c, "j0", c) for c in table.columns), (unit, steps[-1].alias, unit))
        path = " -> ".join(f"{s.table.name}" for s in steps)
        joined = JoinedSource(tuple(steps), outputs, f"{path} (unit_path, unique keys)")
        out[name] = replace(table, privacy_unit=unit, joined=joined)
    return out


def _check_shared_units(rep: _Reporter, tables: Mapping[str, TablePolicy]) -> None:
    """Tables naming the same privacy unit hold one person's id in one declared type.

    A join on the unit compares the two columns; were one a text id and the other an integer,
    the engine would cast, and the cast would fail on a unit whose id is not a number: one
    unit would decide whether every such query fails (an oracle no charge covers)."""
    first: dict[str, tuple[str, str]] = {}
    for name, table in tables.items():
        unit = table.privacy_unit
        if table.public or unit is None or table.unit_path or unit not in table.columns:
            continue
        kind = table.columns[unit].type
        seen = first.setdefault(unit, (name, kind))
        if seen[1] != kind:
            raise rep.fail(
                f"tables.{name}.columns.{unit}.type",
                f"the privacy unit {unit!r} is declared {kind!r} here and {seen[1]!r} in "
                f"[tables.{seen[0]}]: a join on the unit would cast one side and could fail "
                "on some person's id",
                f'declare {unit} with one type in every table (e.g. type = "{seen[1]}" in '
                f"[tables.{name}.columns.{unit}], and store the ids alike in both sources)",
            )


def _declared_unique(spec: Mapping[str, Any]) -> set[str]:
    """The lowercased columns a table spec declares primary_key or unique (unchecked)."""
    unique = spec.get("unique", [])
    names = [unique] if isinstance(unique, str) else list(unique)
    if spec.get("primary_key"):
        names.append(spec["primary_key"])
    return {str(n).lower() for n in names}


def _unique_keys(
    rep: _Reporter, key: str, spec: Mapping[str, Any], columns: Mapping[str, ColumnPolicy]
) -> tuple[str, ...]:
    """``primary_key = "id"`` and ``unique = ["code"]``: single declared columns."""
    out: list[str] = []
    primary = spec.get("primary_key")
    unique = spec.get("unique", [])
    if isinstance(unique, str):
        unique = [unique]
    for which, names in (("primary_key", [primary] if primary else []), ("unique", unique)):
        for column in names:
            if column.lower() not in columns:
                raise rep.fail(
                    f"{key}.{which}",
                    f"{column!r} is not a declared column",
                    f"declare it under [{key}.columns.{column}] or fix the name",
                )
            if column.lower() not in out:
                out.append(column.lower())
    if primary is not None:
        columns[primary.lower()] = replace(  # type: ignore[index]
            columns[primary.lower()], nullable=False, nullable_declared=True
        )
    return tuple(out)


def _public_rows(
    rep: _Reporter, key: str, table: TablePolicy, spec: Mapping[str, Any], limit: int
) -> tuple[tuple[Any, ...], ...]:
    """A public table's rows, typed as declared; its unique keys checked on them (public
    data, so reading it reveals nothing)."""
    import duckdb

    if table.source_path is None or not table.source_path.is_file():
        raise rep.fail(
            f"{key}.source",
            "a public table is read at connect and needs a CSV or Parquet file",
            'point source at a file, e.g. source = "departments.csv"',
        )
    path = str(table.source_path).replace("'", "''")
    parquet = table.source_path.name.lower().endswith(".parquet")
    relation = (
        f"read_parquet('{path}')"
        if parquet
        else f"read_csv('{path}', header = true, all_varchar = true, auto_detect = true)"
    )
    from dpsql.frontend.identifiers import quote_ident

    select = ", ".join(
        f"CAST({quote_ident(c.name)} AS {SQL_TYPES[c.type]})" for c in table.columns.values()
    )
    con = duckdb.connect(":memory:")
    try:
        rows = con.execute(f"SELECT {select} FROM {relation} LIMIT {limit + 1}").fetchall()
    except duckdb.Error as exc:
        raise rep.fail(
            f"{key}.source",
            f"cannot read the public table with the declared columns: {str(exc).splitlines()[0]}",
            "check that every declared column exists in the file with that type",
        ) from None
    finally:
        con.close()
    if len(rows) > limit:
        raise rep.fail(
            f"{key}.public",
            f"a public table may have at most {limit} rows (it is inlined into queries)",
            "keep public tables to dimensions, or raise privacy.max_bins",
        )
    names = list(table.columns)
    for column in table.unique_keys:
        values = [r[names.index(column)] for r in rows]
        which = "primary_key" if (spec.get("primary_key") or "").lower() == column else "unique"
        if which == "primary_key" and any(v is None for v in values):
            raise rep.fail(
                f"{key}.primary_key",
                f"column {column!r} has NULL values in {str(table.source_path)!r}",
                f'fill them, or declare unique = ["{column}"] instead',
            )
        present = [v for v in values if v is not None]
        if len(set(present)) != len(present):
            raise rep.fail(
                f"{key}.{which}",
                f"column {column!r} has duplicate values in {str(table.source_path)!r}",
                f"remove the duplicates, or drop {column!r} from {which}",
            )
    for column in (c for c in names if not table.columns[c].may_hold_null):
        if any(r[names.index(column)] is None for r in rows):
            raise rep.fail(
                f"{key}.columns.{column}.nullable",
                f"column {column!r} has NULL values in {str(table.source_path)!r}",
                "remove nullable = false, or fill the values",
            )
    return tuple(rows)


def default_granularity(col_type: str, lower: float | None, upper: float | None) -> float:
    """Fixed-point step: 1 for ints; for floats ~1e-4 of the largest magnitude, a power of 10."""
    if col_type != "float" or lower is None or upper is None:
        return 1.0
    magnitude = max(abs(lower), abs(upper), 1e-12)
    return 10.0 ** (math.floor(math.log10(magnitude)) - 4)


def _column(rep: _Reporter, key: str, name: str, spec: Any) -> ColumnPolicy:
    # each key's type and range: the schema (dpsql.policy_schema); here, what depends on type
    col_type = spec["type"]
    lower = spec.get("lower")
    upper = spec.get("upper")
    if (lower is not None or upper is not None) and col_type not in ("int", "float", "date"):
        raise rep.fail(key, "lower/upper are only for int, float and date columns", "remove them")
    if (lower is None) != (upper is None):
        raise rep.fail(key, "declare both lower and upper, or neither", "add the missing bound")
    date_range = None
    if col_type == "date" and lower is not None:
        date_range = (_iso_day(rep, f"{key}.lower", lower), _iso_day(rep, f"{key}.upper", upper))
        if date_range[0] > date_range[1]:
            raise rep.fail(
                f"{key}.lower",
                f"lower ({date_range[0]}) > upper ({date_range[1]})",
                "swap or fix the dates",
            )
        lower = upper = None  # the numeric bounds stay undeclared
    if lower is not None:
        lower = _number(rep, f"{key}.lower", lower)
        upper = _number(rep, f"{key}.upper", upper)
        if lower > upper:
            raise rep.fail(
                f"{key}.lower", f"lower ({lower:g}) > upper ({upper:g})", "swap or fix the bounds"
            )
        if col_type == "int" and (lower != int(lower) or upper != int(upper)):
            raise rep.fail(key, "bounds of an int column must be integers", "round the bounds")
    values = spec.get("values")
    if values is not None:
        values = tuple(_coerce_value(rep, f"{key}.values", col_type, v) for v in values)
        if len(set(values)) != len(values):
            raise rep.fail(f"{key}.values", "duplicate values", "list each value once")
    nullable_declared = "nullable" in spec
    # undeclared: no NULL bin in a public domain (never a phantom group; NULL keys dropped
    # as keys outside the domain are), a thresholded NULL key otherwise. Decided from the
    # policy alone, never from the data (docs/threat_model.md, "Nullability").
    public_domain = (
        values is not None or col_type == "bool" or lower is not None or date_range is not None
    )
    nullable = bool(spec["nullable"]) if nullable_declared else not public_domain
    granularity = spec.get("granularity")
    if granularity is None:
        granularity = default_granularity(col_type, lower, upper)
    else:
        if col_type != "float":
            raise rep.fail(
                f"{key}.granularity", "only float columns take a granularity", "remove it"
            )
        granularity = float(granularity)
    quantile_grid = spec.get("quantile_grid", "auto")
    quantile_bins = spec.get("quantile_bins")
    # unstated: "default", a clamp range chosen once per data version from a kept DP
    # histogram where a query sums the column (dpsql.service.bounds); "declared" keeps lower/upper
    clip = spec.get("clip", "default")
    clip_share = float(spec.get("clip_share", 0.1))
    clip_method = spec.get("clip_method", "auto")
    clip_quantile = float(spec.get("clip_quantile", 0.9))
    if (clip == "auto" or "clip_share" in spec) and (
        lower is None or col_type not in ("int", "float")
    ):
        raise rep.fail(
            key,
            "automatic clipping needs a number column with lower and upper",
            "declare the bounds it clips inside",
        )
    if ("quantile_grid" in spec or "quantile_bins" in spec) and lower is None:
        raise rep.fail(key, "a quantile grid needs declared lower and upper", "add the bounds")
    return ColumnPolicy(
        name=name.lower(),
        type=col_type,
        lower=lower,
        upper=upper,
        values=values,
        nullable=nullable,
        nullable_declared=nullable_declared,
        granularity=granularity,
        quantile_grid=quantile_grid,
        quantile_bins=quantile_bins,
        clip=clip,
        clip_share=clip_share,
        clip_method=clip_method,
        clip_quantile=clip_quantile,
        date_range=date_range,
    )


_ISO_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


def _iso_day(rep: _Reporter, key: str, value: Any) -> _dt.date:
    """A date column's bound: a TOML date or an ISO ``YYYY-MM-DD`` string (not a time)."""
    if isinstance(value, _dt.date) and not isinstance(value, _dt.datetime):
        return value
    if isinstance(value, str) and _ISO_DAY.fullmatch(value):
        with contextlib.suppress(ValueError):
            return _dt.date.fromisoformat(value)
    raise rep.fail(
        key, f"expected an ISO date, got {value!r}", 'write a day, e.g. "2024-01-01" or 2024-01-01'
    )


def _coerce_value(rep: _Reporter, key: str, col_type: str, value: Any) -> Any:
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "text": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "date": lambda v: isinstance(v, _dt.date | str),
    }[col_type]
    if not ok(value):
        raise rep.fail(key, f"{value!r} is not a {col_type}", f"list {col_type} values only")
    if col_type == "date" and isinstance(value, str):
        try:
            return _dt.date.fromisoformat(value)
        except ValueError:
            raise rep.fail(key, f"{value!r} is not an ISO date", "write YYYY-MM-DD") from None
    if col_type == "float":
        return float(value)
    return value
