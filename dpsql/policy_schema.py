"""The shape of a privacy policy, as a pydantic model, and its published JSON Schema.

:func:`check` validates the *shape* of a policy document (the keys each section takes, their
types, the required keys, each value's own range or choices) before :mod:`dpsql.policy` checks
what only the whole policy can say (a declared privacy unit, unit paths, bounds against column
types, access rules, cross-section constraints). A value the model refuses is reported exactly
as the hand-written checks reported it: the dotted key (``tables.t.columns.d.upper``), the
problem and the fix; every field carries a :class:`Rule` that words them.

The JSON Schema generated from the model ships in the package as ``dpsql/policy.schema.json``
(``dpsql schema`` prints it) so editors complete and check policies: put
``#:schema ./policy.schema.json`` (taplo, Even Better TOML) on a policy's first line.
tests/test_policy_schema.py checks that the shipped file is what the model generates; after
adding or changing a key here, regenerate it with ``dpsql schema > dpsql/policy.schema.json``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from dpsql.access import ACCESS_KEYS, RULE_KEYS
from dpsql.limits import DEFAULT_LIMITS, LIMIT_KEYS, Limits
from dpsql.limits import HIGHEST_LIMITS as _LIMIT_HIGHEST

SCHEMA_ID = "https://dpsql.invalid/policy.schema.json"

ColumnType = Literal["int", "float", "text", "bool", "date"]
Mechanism = Literal["laplace", "gaussian"]
EngineName = Literal["duckdb", "spark"]
Bounding = Literal["scale", "sample"]

Explain = Callable[[Any, str, Mapping[str, Any]], "tuple[str, str] | None"]


@dataclass(frozen=True)
class Rule:
    """How a value the schema refuses is reported: ``explain(value, key, parent)`` returns
    (problem, fix) as the policy loader words them (None: the model's own message)."""

    explain: Explain


@dataclass(frozen=True)
class Items:
    """The rule of each value of a table of values (``roles = { NAME = [...] }``), reported
    under the value's own key."""

    rule: Rule


def _plain_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def _number_problem(value: Any, positive: bool) -> tuple[str, str] | None:
    if not _plain_number(value):
        return f"expected a number, got {value!r}", "write a plain number"
    if math.isinf(value):
        return f"must be finite, got {value!r}", "write a finite number"
    if positive and not value > 0:
        return f"must be > 0, got {value!r}", "use a positive number"
    return None


def number(
    *, positive: bool = False, out_of_range: Callable[[float], tuple[str, str]] | None = None
) -> Rule:
    """A finite number (> 0 if ``positive``); ``out_of_range`` words a violated range."""

    def explain(value: Any, key: str, parent: Mapping[str, Any]) -> tuple[str, str] | None:
        problem = _number_problem(value, positive)
        if problem is None and out_of_range is not None:
            return out_of_range(float(value))
        return problem

    return Rule(explain)


def integer(lowest: int = 1, highest: int | None = None, hint: str = "write e.g. 1 or 10") -> Rule:
    bound = f">= {lowest}" if highest is None else f"from {lowest} to {highest}"
    return Rule(lambda value, key, parent: (f"must be an integer {bound}, got {value!r}", hint))


def choice(allowed: Any, what: str) -> Rule:
    """One of a Literal's values: ``unknown WHAT 'x'``, naming the choices."""
    shown = [f'"{a}"' for a in typing.get_args(allowed)]
    hint = "use " + ", ".join(shown[:-1]) + " or " + shown[-1]
    return Rule(lambda value, key, parent: (f"unknown {what} {value!r}", hint))


def share(example: str) -> Rule:
    return Rule(lambda value, key, parent: ("must be a number in (0, 1)", f"e.g. {example}"))


def fixed(problem: str, hint: str) -> Rule:
    """The same words for any bad value; ``{key}``, ``{name}`` (the last part of the key) and
    ``{value}`` are filled in."""

    def explain(value: Any, key: str, parent: Mapping[str, Any]) -> tuple[str, str]:
        def fill(text: str) -> str:
            name = key.rpartition(".")[2]
            return (
                text.replace("{key}", key).replace("{name}", name).replace("{value}", repr(value))
            )

        return fill(problem), fill(hint)

    return Rule(explain)


def _bound(value: Any, key: str, parent: Mapping[str, Any]) -> tuple[str, str] | None:
    """lower / upper: an ISO day for a date column, a finite number otherwise."""
    if parent.get("type") == "date":
        return (
            f"expected an ISO date, got {value!r}",
            'write a day, e.g. "2024-01-01" or 2024-01-01',
        )
    return _number_problem(value, False)


def _values(value: Any, key: str, parent: Mapping[str, Any]) -> tuple[str, str] | None:
    if not isinstance(value, list) or not value:
        return "must be a non-empty list", 'e.g. values = ["a", "b"]'
    kind = parent.get("type")
    bad = next((v for v in value if not isinstance(v, str | int | float | _dt.date)), value[0])
    return f"{bad!r} is not a {kind}", f"list {kind} values only"


#: max_rows_per_unit / max_groups_per_unit: a positive integer or "auto"
_CONTRIBUTION_BOUND = Rule(
    lambda value, key, parent: (
        f'must be an integer >= 1 or "auto", got {value!r}',
        'write e.g. 5, or "auto" to let dpsql choose it privately',
    )
)

#: the default of a key whose default is computed from others (or absent): not in the schema
_UNSET: Any = None

_ACCESS_LIST = fixed("must be a list of analysts or roles", '{name} = ["clinicians", "carol"]')
_NAME = Annotated[str, Field(min_length=1)]
_FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
_FORBID = ConfigDict(strict=True, extra="forbid", populate_by_name=False)


class Section(BaseModel):
    model_config = _FORBID
    #: the fix when a section of this kind is not a table (``{key}``: its dotted key)
    section_hint: ClassVar[str] = "write a [{key}] section"


class PrivacySection(Section):
    """[privacy]: the defaults of each query and each analyst's budget."""

    epsilon: Annotated[
        float,
        Field(gt=0, allow_inf_nan=False, description="default per-query epsilon (> 0)"),
        number(positive=True),
    ] = 1.0
    delta: Annotated[
        float,
        Field(
            ge=0, lt=1, allow_inf_nan=False, description="default per-query delta (0 <= delta < 1)"
        ),
        number(out_of_range=lambda v: (f"must be in [0, 1), got {v}", "e.g. delta = 1e-6")),
    ] = 0.0
    mechanism: Annotated[
        Mechanism, Field(description='"laplace" or "gaussian"'), choice(Mechanism, "mechanism")
    ] = "laplace"
    budget_epsilon: Annotated[
        float,
        Field(gt=0, allow_inf_nan=False, description="each analyst's total epsilon"),
        number(positive=True),
    ] = 10.0
    budget_delta: Annotated[
        float,
        Field(
            ge=0,
            lt=1,
            allow_inf_nan=False,
            description="each analyst's total delta (default: delta)",
        ),
        number(out_of_range=lambda v: ("must be in [0, 1)", "e.g. budget_delta = 1e-5")),
    ] = Field(default=_UNSET)
    gaussian_share: Annotated[
        float,
        Field(
            ge=0,
            le=1,
            allow_inf_nan=False,
            description="fraction of budget_epsilon reserved for Gaussian (zCDP) releases "
            "(default 0 for laplace policies, 1 for gaussian ones)",
        ),
        number(out_of_range=lambda v: ("must be in [0, 1]", "e.g. gaussian_share = 0.5")),
    ] = Field(default=_UNSET)
    ledger: Annotated[
        str,
        Field(
            description="path of the durable budget ledger (SQLite), relative to the policy "
            "file (default: <policy stem>.ledger.sqlite next to it)"
        ),
        fixed("must be a path string", 'e.g. ledger = "budget.sqlite"'),
    ] = Field(default=_UNSET)
    dataset: Annotated[
        str,
        Field(
            min_length=1,
            description="name of this dataset in the ledger (default: the policy file's stem)",
        ),
        fixed("must be a non-empty string", 'e.g. dataset = "visits"'),
    ] = Field(default=_UNSET)
    max_bins: Annotated[
        int,
        Field(
            ge=1,
            description="largest public domain enumerated for a GROUP BY key (default 10000)",
        ),
        integer(),
    ] = 10_000
    analysts: Annotated[
        list[_NAME],
        Field(
            description="the analyst names in-process front doors (dpsql.connect, dpsql query, "
            "dpsql:// URLs) may name (default: any; dpsql serve authenticates its users instead)"
        ),
        fixed("must be a list of names", 'e.g. analysts = ["alice", "bob"]'),
    ] = Field(default=_UNSET)
    schema_: Annotated[
        str,
        Field(
            alias="schema",
            pattern=r"\S",
            description="a schema name queries may qualify tables with (schema.table); main "
            "and public are always accepted",
        ),
        fixed("must be a non-empty string", 'e.g. schema = "pums"'),
    ] = Field(default=_UNSET, alias="schema")


_ROWS_HINT = "write e.g. 1 or 10"


class ColumnSpec(Section):
    """[tables.NAME.columns.COL]: a column's type and its public facts."""

    section_hint: ClassVar[str] = "write a [{key}] section with type = ..."

    type: Annotated[
        ColumnType,
        Field(description='"int", "float", "text", "bool" or "date"'),
        Rule(
            lambda value, key, parent: (
                f"unknown or missing type {value!r}",
                f"use one of {typing.get_args(ColumnType)}",
            )
        ),
    ]
    lower: Annotated[
        _FiniteFloat | _dt.date | str,
        Field(
            description="public lower bound (numbers; an ISO date for a date column)",
        ),
        Rule(_bound),
    ] = Field(default=_UNSET)
    upper: Annotated[
        _FiniteFloat | _dt.date | str,
        Field(
            description="public upper bound (numbers; an ISO date for a date column)",
        ),
        Rule(_bound),
    ] = Field(default=_UNSET)
    values: Annotated[
        list[str | int | float | bool | _dt.date],
        Field(min_length=1, description="the public list of values (a categorical domain)"),
        Rule(_values),
    ] = Field(default=_UNSET)
    nullable: Annotated[
        bool,
        Field(
            description="whether NULL is a value of the column's public domain (GROUP BY "
            "releases a NULL group). Not declared: false for a column with declared values, "
            "bool, bounds or days (no NULL group; dpsql check warns), true otherwise (a NULL "
            "key is thresholded); never inferred from the data"
        ),
        fixed("must be true or false", "write nullable = false"),
    ] = Field(default=_UNSET)
    allow: Annotated[
        list[_NAME],
        Field(
            description="analysts or roles who may use the column (default: the table's readers)"
        ),
        _ACCESS_LIST,
    ] = Field(default=_UNSET)
    deny: Annotated[
        list[_NAME],
        Field(description="analysts or roles who may not use the column"),
        _ACCESS_LIST,
    ] = Field(default=_UNSET)
    granularity: Annotated[
        float,
        Field(
            gt=0,
            allow_inf_nan=False,
            description="fixed-point step for sums of this column (float columns; default "
            "~1e-4 of the largest bound)",
        ),
        number(positive=True),
    ] = Field(default=_UNSET)
    quantile_grid: Annotated[
        Literal["auto", "linear", "log"],
        Field(
            description='the public grid of MEDIAN/PERCENTILE/MIN/MAX: "auto" (default: one '
            "bin per value for an integer range of <= 4096 values, else log for a non-negative "
            'range >= 1000 wide, else linear), "linear" or "log" (constant relative '
            "resolution, for skewed columns such as income)"
        ),
        choice(Literal["auto", "linear", "log"], "grid"),
    ] = "auto"
    quantile_bins: Annotated[
        int,
        Field(
            ge=2,
            le=1 << 17,
            description="how many grid bins (default 4096, or 6 per e-fold of the range for "
            "the auto log grid: 79 on [0, 500000]; integer columns with a smaller range get "
            "one bin per value)",
        ),
        integer(2, 1 << 17, "e.g. quantile_bins = 4096"),
    ] = 4096
    clip: Annotated[
        Literal["default", "declared", "auto"],
        Field(
            description='"default" (unstated): SUM/AVG/VAR clamp to a range inside lower/upper '
            "chosen from a DP histogram of the column's values, bought once per analyst and "
            "data version from bounds_share of the first such query's ε and kept; "
            '"declared": clamp to lower/upper; "auto": each query spends clip_share of its ε on '
            "a DP estimate of a tighter range inside them, then clamps to it"
        ),
        choice(Literal["default", "declared", "auto"], "clip"),
    ] = "default"
    clip_share: Annotated[
        float,
        Field(
            gt=0,
            lt=1,
            description="the share of a query's ε spent on the automatic range (default 0.1)",
        ),
        share("clip_share = 0.1"),
    ] = 0.1
    clip_method: Annotated[
        Literal["auto", "sum", "quantile", "threshold"],
        Field(
            description='"auto" (default: "sum" for a query without GROUP BY, "quantile" with '
            'one), "sum" (the bound minimising the estimated bias + noise of the query\'s SUMs), '
            '"quantile" (the clip_quantile of |x|) or "threshold" (ApproxBounds)'
        ),
        choice(Literal["auto", "sum", "quantile", "threshold"], "method"),
    ] = "auto"
    clip_quantile: Annotated[
        float,
        Field(
            gt=0,
            lt=1,
            description="the level of |x| that method quantile clips at (default 0.9)",
        ),
        share("clip_quantile = 0.9"),
    ] = 0.9


class TableSpec(Section):
    """[tables.NAME]: a table, its source, privacy unit and contribution bounds."""

    source: Annotated[
        str,
        Field(
            min_length=1,
            description="a CSV/Parquet path relative to the policy file (or a glob of them), a "
            "postgresql://host:port/db?table=schema.name URL, or a table of the database",
        ),
        fixed("missing source", 'add source = "file.csv" (or a database table)'),
    ]
    privacy_unit: Annotated[
        str,
        Field(description="the column identifying one person (omit: every row is its own unit)"),
        Rule(
            lambda value, key, parent: (
                f"{value!r} is not a declared column",
                f"declare it under [{key.rpartition('.')[0]}.columns.{value}] or fix the name",
            )
        ),
    ] = Field(default=_UNSET)
    max_rows_per_unit: Annotated[
        Annotated[int, Field(ge=1)] | Literal["auto"],
        Field(
            description='rows one unit may contribute to each group, or "auto": chosen from '
            'a DP histogram of rows per unit (dpsql.privacy.contribution). Default: "auto" '
            "with a privacy_unit; 1 without one (a row is its unit) or where the privacy_unit "
            "is the primary_key (or unique): one row per unit, which R = 1 never cuts"
        ),
        _CONTRIBUTION_BOUND,
    ] = Field(default=_UNSET)
    max_groups_per_unit: Annotated[
        Annotated[int, Field(ge=1)] | Literal["auto"],
        Field(
            description='groups one unit may contribute to, or "auto": chosen from a DP '
            'histogram of groups per unit. Default: as max_rows_per_unit ("auto" with a '
            "privacy_unit, 1 without one or where it is the primary_key or unique)"
        ),
        _CONTRIBUTION_BOUND,
    ] = Field(default=_UNSET)
    bounds_share: Annotated[
        float,
        Field(
            gt=0,
            lt=1,
            description='the share of a query\'s ε spent choosing "auto" bounds, by the '
            "analyst's first query that needs them on a data version (default 0.1)",
        ),
        share("bounds_share = 0.1"),
    ] = 0.1
    version: Annotated[
        str | int | float | _dt.date | _dt.datetime,
        Field(description="a data version string; changing it invalidates cached answers"),
        fixed("must be a version string", 'e.g. version = "2025-06"'),
    ] = Field(default=_UNSET)
    bounding: Annotated[
        Bounding,
        Field(
            description='"scale" (default: a (unit, group) over max_rows_per_unit rows counts '
            'R/n of each of its n rows) or "sample" (it keeps R rows chosen by a keyed hash)'
        ),
        choice(Bounding, "bounding"),
    ] = "scale"
    columns: Annotated[
        dict[str, ColumnSpec],
        Field(min_length=1, description="a [tables.NAME.columns.COL] table per column"),
        fixed("no columns declared", "add a [{key}.COL] section per column"),
    ]
    public: Annotated[
        bool,
        Field(
            description="true for a public table (a dimension such as departments): no "
            "privacy unit, never charged, read at connect (a CSV/Parquet file); its values are "
            "public domains"
        ),
        fixed("must be true or false", "write public = true"),
    ] = False
    primary_key: Annotated[
        str,
        Field(
            description="a column whose values are unique and not NULL (checked at connect for "
            "a public table)"
        ),
        fixed("must be one column name", 'write primary_key = "id"'),
    ] = Field(default=_UNSET)
    unique: Annotated[
        str | list[str],
        Field(description='columns whose non-NULL values are unique, e.g. unique = ["code"]'),
        fixed("must be a list of column names", 'unique = ["code"]'),
    ] = Field(default=_UNSET)
    unit_path: Annotated[
        str | Annotated[list[str], Field(min_length=1)],
        Field(
            description="for a private table without the unit column: the foreign keys leading "
            'to the table that declares privacy_unit, e.g. unit_path = ["encounter_id -> '
            'encounters.encounter_id"] (each step ON a declared primary_key/unique of the next '
            "table)"
        ),
        fixed(
            "must be a list of foreign-key steps",
            'unit_path = ["encounter_id -> encounters.encounter_id"]',
        ),
    ] = Field(default=_UNSET)
    allow: Annotated[
        list[_NAME],
        Field(
            description="analysts or roles ([access] roles) who may query it (default: "
            'everyone), e.g. allow = ["clinicians", "carol"]'
        ),
        _ACCESS_LIST,
    ] = Field(default=_UNSET)
    deny: Annotated[
        list[_NAME],
        Field(description=RULE_KEYS["deny"]),
        _ACCESS_LIST,
    ] = Field(default=_UNSET)


class EngineSection(Section):
    """[engine]: which engine runs the compiled plans, and how."""

    section_hint: ClassVar[str] = 'write an [engine] section with name = "spark"'

    name: Annotated[
        EngineName,
        Field(description='"duckdb" (default: embedded) or "spark"'),
        choice(EngineName, "engine"),
    ] = "duckdb"
    master: Annotated[
        str,
        Field(
            min_length=1,
            description='the Spark master URL, e.g. "local[*]", "spark://host:7077", "yarn"',
        ),
        fixed("must be a string", 'e.g. master = "local[*]"'),
    ] = Field(default=_UNSET)
    conf: Annotated[
        dict[str, str | int | float | bool],
        Field(description='extra Spark settings, e.g. conf = { "spark.executor.memory" = "8g" }'),
        fixed(
            "must be a table of Spark settings with plain values",
            'e.g. conf = { "spark.sql.shuffle.partitions" = 400 }',
        ),
    ] = Field(default_factory=dict)
    threads: Annotated[
        int,
        Field(
            ge=1,
            le=1024,
            description="DuckDB: threads per query (default: one per core); 1 suits many small "
            "concurrent queries (dpsql serve)",
        ),
        integer(1, 1024, "e.g. threads = 1, or remove it"),
    ] = Field(default=_UNSET)
    perfect_hash_bits: Annotated[
        int,
        Field(
            ge=0,
            le=24,
            description="DuckDB: group keys of up to this many bits (integer columns with a "
            "known range) aggregate in a perfect hash table (default 12)",
        ),
        integer(
            0,
            24,
            "use 12 (DuckDB's default) or ~20 for large tables with compact integer units",
        ),
    ] = 12
    prepared: Annotated[
        Literal["off", "memory", "disk"],
        Field(
            description="a prepared store per data version (dpsql.engine.prepared, "
            'spark_store): "off" (default), "memory", or "disk" (a file next to the ledger, '
            "reused across processes)"
        ),
        choice(Literal["off", "memory", "disk"], "mode"),
    ] = "off"
    prepared_dir: Annotated[
        str,
        Field(min_length=1, description="where disk stores go (default: the ledger's directory)"),
        fixed("must be a directory path", 'e.g. "store/"'),
    ] = Field(default=_UNSET)
    small_tables: Annotated[
        Literal["auto", "columns", "sql"],
        Field(
            description='DuckDB: how plans on CSV tables run: "auto" (default: a CSV table of '
            "at most 200,000 rows is held in memory for column programs, dpsql.engine.columnar, "
            'a larger one runs SQL, decided once per data version at connect), "columns" (every '
            'CSV table held; more than 200,000 rows fails the start) or "sql" (none held): '
            "declare it to pin the path"
        ),
        choice(Literal["auto", "columns", "sql"], "mode"),
    ] = "auto"


class AccessSection(Section):
    """[access]: roles, named groups of analysts that allow / deny lists may name."""

    roles: Annotated[
        dict[str, list[_NAME]],
        Field(description=ACCESS_KEYS["roles"]),
        fixed("must be a table of lists", 'roles = { clinicians = ["alice"] }'),
        Items(fixed("must be a list of analyst names", '{name} = ["alice", "bob"]')),
    ] = Field(default_factory=dict)


def _limits_model() -> type[Section]:
    """[limits]: one integer field per :class:`dpsql.limits.Limits` setting."""
    spec: dict[str, Any] = {}
    for f in fields(Limits):
        highest = _LIMIT_HIGHEST.get(f.name)
        default = getattr(DEFAULT_LIMITS, f.name)
        spec[f.name] = (
            Annotated[
                int,
                Field(ge=1, le=highest, description=LIMIT_KEYS.get(f.name)),
                integer(1, highest, f"e.g. {f.name} = {default} (the default)"),
            ],
            default,
        )
    model = create_model("LimitsSection", __base__=Section, **spec)
    model.__doc__ = "[limits]: what one statement may be (dpsql.limits)."
    return model


LimitsSection = _limits_model()


class PolicyDocument(Section):
    """A dpsql privacy policy (TOML): the only source of public facts about the data."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        title="dpsql privacy policy",
        json_schema_extra={"$id": SCHEMA_ID},
    )

    server: Annotated[
        dict[str, Any],
        Field(
            description="the wire server's settings (dpsql serve validates them: docs/server.md)"
        ),
        fixed("must be a table", "write a [server] section"),
    ] = Field(default_factory=dict)
    engine: Annotated[
        EngineSection,
        Field(description="which engine runs the compiled plans"),
        fixed("must be a table", EngineSection.section_hint),
    ] = Field(default_factory=EngineSection)
    limits: Annotated[
        LimitsSection,  # type: ignore[valid-type]
        Field(description="what one statement may be (dpsql.limits)"),
        fixed("must be a table", "write a [limits] section, e.g. max_depth = 32"),
    ] = Field(default_factory=LimitsSection)
    privacy: Annotated[
        PrivacySection,
        Field(description="per-query defaults and each analyst's budget"),
        fixed("must be a table", "write a [privacy] section"),
    ] = Field(default_factory=PrivacySection)
    access: Annotated[
        AccessSection,
        Field(description="roles for the tables' and columns' allow / deny lists"),
        fixed("must be a table", "write an [access] section"),
    ] = Field(default_factory=AccessSection)
    budgets: Annotated[
        dict[str, Any],
        Field(
            description="group, dataset-wide and renewing budgets (validated by "
            "dpsql.privacy.budget_rules)"
        ),
        fixed("must be a table", "write a [budgets] section"),
    ] = Field(default_factory=dict)
    tables: Annotated[
        dict[str, TableSpec],
        Field(min_length=1, description="a [tables.NAME] section per table"),
        fixed("no tables declared", "add a [tables.NAME] section per table"),
    ]


def keys(model: type[BaseModel]) -> dict[str, str]:
    """A section's keys and what each means (the "unknown key" hint and the docs)."""
    return {(f.alias or name): (f.description or "") for name, f in model.model_fields.items()}


PRIVACY_KEYS = keys(PrivacySection)
TABLE_KEYS = keys(TableSpec)
COLUMN_KEYS = keys(ColumnSpec)
ENGINE_KEYS = keys(EngineSection)
COLUMN_TYPES: tuple[str, ...] = typing.get_args(ColumnType)
MECHANISMS: tuple[str, ...] = typing.get_args(Mechanism)
ENGINE_NAMES: tuple[str, ...] = typing.get_args(EngineName)
BOUNDINGS: tuple[str, ...] = typing.get_args(Bounding)


# -- errors -----------------------------------------------------------------------------------


def check(data: Mapping[str, Any], fail: Callable[[str, str, str], Exception]) -> None:
    """Validate the shape of ``data``; raise ``fail(key, problem, fix)`` for its first error
    (in the order of the sections and keys of the model)."""
    try:
        PolicyDocument.model_validate(data)
    except ValidationError as exc:
        raise _report(exc.errors(), data, fail) from None


def _rule(info: Any) -> Rule | None:
    return next((m for m in info.metadata if isinstance(m, Rule)), None)


def _items_rule(info: Any) -> Rule | None:
    return next((m.rule for m in info.metadata if isinstance(m, Items)), None)


def _by_alias(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f for name, f in model.model_fields.items()}


def _items_model(annotation: Any) -> type[Section] | None:
    """``Model`` of a ``dict[str, Model]`` field (tables, columns)."""
    if typing.get_origin(annotation) is dict:
        value = typing.get_args(annotation)[1]
        if isinstance(value, type) and issubclass(value, Section):
            return value
    return None


def _report(
    errors: list[Any], data: Mapping[str, Any], fail: Callable[[str, str, str], Exception]
) -> Exception:
    error = errors[0]
    loc = tuple(error["loc"])
    if error["type"] == "extra_forbidden":
        model, _, _, _ = _walk(loc[:-1], data)
        key = ".".join(str(p) for p in loc)
        known = ", ".join(sorted(_by_alias(model))) if model is not None else ""
        return fail(key, "unknown key", f"remove it or use one of: {known}")
    _, rule, key, (value, parent) = _walk(loc, data)
    words = rule.explain(value, key, parent) if rule is not None else None
    if words is None:  # the model and the rule disagree: the model's own words
        words = (str(error["msg"]).lower(), "see `dpsql schema` for what this key takes")
    return fail(key, *words)


_MISSING: Any = None


def _walk(
    loc: tuple[Any, ...], data: Mapping[str, Any]
) -> tuple[type[BaseModel] | None, Rule | None, str, tuple[Any, Mapping[str, Any]]]:
    """Follow ``loc`` through the model and the document: the model reached (None past a
    field), the last rule met, its dotted key, and the value there with its section."""
    model: type[BaseModel] | None = PolicyDocument
    raw: Any = data
    parent: Mapping[str, Any] = data
    rule: Rule | None = None
    key_parts: list[str] = []
    found: tuple[str, Any, Mapping[str, Any]] = ("", raw, parent)
    i = 0
    while i < len(loc) and model is not None:
        part = loc[i]
        info = _by_alias(model).get(part) if isinstance(part, str) else None
        if info is None:
            break
        parent = raw if isinstance(raw, Mapping) else {}
        raw = parent.get(part, _MISSING)
        key_parts.append(part)
        rule = _rule(info)
        found = (".".join(key_parts), raw, parent)
        model = None
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, Section):
            model = annotation
        elif (items := _items_model(annotation)) is not None and i + 1 < len(loc):
            name = loc[i + 1]
            if isinstance(raw, Mapping) and name in raw:
                parent, raw = raw, raw[name]
                key_parts.append(str(name))
                rule = fixed("must be a table", items.section_hint)
                found = (".".join(key_parts), raw, parent)
                model = items
                i += 1
        elif (each := _items_rule(info)) is not None and i + 1 < len(loc):
            name = loc[i + 1]
            if isinstance(raw, Mapping) and name in raw:
                parent, raw = raw, raw[name]
                key_parts.append(str(name))
                rule = each
                found = (".".join(key_parts), raw, parent)
        i += 1
    key, value, section = found
    return model, rule, key, (value, section)


# -- the published JSON Schema ----------------------------------------------------------------


def _without_null_defaults(node: Any) -> Any:
    """Drop ``"default": null`` (a key left out has a computed default, not a TOML null)."""
    if isinstance(node, dict):
        return {
            k: _without_null_defaults(v)
            for k, v in node.items()
            if not (k == "default" and v is None)
        }
    if isinstance(node, list):
        return [_without_null_defaults(v) for v in node]
    return node


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy, generated from the model."""
    schema = PolicyDocument.model_json_schema(by_alias=True)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **_without_null_defaults(schema),
    }


def schema_text() -> str:
    """The schema as shipped in dpsql/policy.schema.json."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def shipped_schema_text() -> str:
    """The schema file installed with the package."""
    from importlib import resources

    return resources.files("dpsql").joinpath("policy.schema.json").read_text(encoding="utf-8")


if __name__ == "__main__":
    import sys

    sys.stdout.write(schema_text())
