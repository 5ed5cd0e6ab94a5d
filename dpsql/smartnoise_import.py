"""Import a SmartNoise SQL metadata file (YAML) as a dpsql policy (TOML).

SmartNoise describes a collection of schemas of tables, each column with a type, bounds and
whether it is the private id; dpsql's policy says the same in its own words. The mapping is
conservative: wherever SmartNoise's contract is looser than dpsql's bounds, the policy takes the
bound that keeps every SmartNoise guarantee (see ``docs/bi_tools.md``):

- ``row_privacy: true`` -> no ``privacy_unit`` (each row is its own unit);
- the ``private_id: true`` column -> ``privacy_unit``; ``max_ids`` (rows per id in the whole
  table) -> ``max_rows_per_unit = max_groups_per_unit = max_ids`` (a unit with ``max_ids`` rows
  touches at most that many groups, with at most that many rows in each);
- ``int``/``float``/``string``/``boolean``/``datetime`` -> ``int``/``float``/``text``/``bool``/
  ``date``; ``lower``/``upper``/``nullable`` carry over;
- settings dpsql has no key for (``rows``, ``censor_dims``, ``clamp_counts``, ``clamp_columns``,
  ``use_dpsu``, ``sample_max_ids``, ``cardinality``, ``missing_value``, ``sensitivity``,
  ``engine``) are written as comments, with what dpsql does instead.

Command line (registered as ``dpsql import-smartnoise``; also ``python -m
dpsql.smartnoise_import``)::

    dpsql import-smartnoise META.yaml DATA.csv --out policy.toml [--table SCHEMA.TABLE]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TABLE_SETTINGS = (
    "rows",
    "rows_exact",
    "row_privacy",
    "max_ids",
    "sample_max_ids",
    "clamp_counts",
    "clamp_columns",
    "use_dpsu",
    "censor_dims",
)
TYPES = {"int": "int", "float": "float", "string": "text", "boolean": "bool", "datetime": "date"}
_BARE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_NOTES = {
    "rows": "a public row count; dpsql never uses one (counts are always measured)",
    "rows_exact": "an exact public row count; dpsql never uses one",
    "censor_dims": "dpsql always thresholds non-public GROUP BY keys (tau), as censor_dims = "
    "true does; declare `values` to release a key without threshold",
    "clamp_counts": "dpsql always clamps released counts at 0",
    "clamp_columns": "dpsql always clamps values to lower/upper",
    "use_dpsu": "dpsql has no DP SQL unions (DPSU); thresholding uses tau",
    "sample_max_ids": "dpsql keeps max_rows_per_unit rows per (unit, group) by keyed hash",
    "cardinality": "a public cardinality; declare `values` for a public domain",
    "missing_value": "dpsql reads NULL as missing; no substitute value",
    "sensitivity": "dpsql derives sensitivity from lower/upper",
    "engine": "the SmartNoise engine name; dpsql reads the CSV with DuckDB",
}


class MetadataError(ValueError):
    """A metadata file dpsql cannot express as a policy, with the key and what to do."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(f"{message} (hint: {hint})")
        self.hint = hint


@dataclass(frozen=True)
class ImportedTable:
    """One SmartNoise table as dpsql policy parts, plus what had no dpsql key."""

    schema: str
    name: str
    spec: dict[str, Any]
    columns: dict[str, dict[str, Any]]
    notes: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------------------------
# YAML: PyYAML when installed, else the block-mapping subset SmartNoise metadata uses


def load_yaml(text: str) -> Any:
    try:
        import yaml  # type: ignore[import-untyped]
    except ModuleNotFoundError:
        return _mini_yaml(text)
    return yaml.safe_load(text)


def _scalar(raw: str) -> Any:
    value = raw.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    lowered = value.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("null", "~", ""):
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"":
            quote = None if quote == ch else (ch if quote is None else quote)
        elif ch == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _mini_yaml(text: str) -> dict[str, Any]:
    """Nested block mappings of scalars (what SmartNoise metadata files are)."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, root)]
    for number, original in enumerate(text.splitlines(), start=1):
        line = _strip_comment(original).rstrip()
        if not line.strip() or line.strip() == "---":
            continue
        indent = len(line) - len(line.lstrip(" "))
        body = line.strip()
        key, sep, rest = body.partition(":")
        if not sep or body.startswith("- "):
            raise MetadataError(
                f"line {number}: only 'key: value' mappings are read without PyYAML",
                "pip install pyyaml for other YAML forms",
            )
        while stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        name = _scalar(key)
        name = "" if name is None else str(name)
        if rest.strip():
            parent[name] = _scalar(rest)
        else:
            child: dict[str, Any] = {}
            parent[name] = child
            stack.append((indent, child))
    return root


# --------------------------------------------------------------------------------------------
# metadata -> policy


def collection_of(meta: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """The one collection of a metadata file (an ``engine`` key may stand beside it)."""
    if not isinstance(meta, Mapping) or not meta:
        raise MetadataError("the metadata has no collection", "see SmartNoise's metadata format")
    names = [k for k in meta if k != "engine"]
    if len(names) != 1:
        raise MetadataError(
            f"the metadata has {len(names)} collections {names!r}; SmartNoise reads one",
            "keep one collection per file",
        )
    body = meta[names[0]]
    if not isinstance(body, Mapping):
        raise MetadataError(f"collection {names[0]!r} is not a mapping", "schema: table: column")
    return str(names[0] or ""), body


def _column(table: str, name: str, spec: Any) -> tuple[dict[str, Any], bool, list[str]]:
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise MetadataError(f"column {table}.{name} has no type", "add type: int|float|string|…")
    kind = str(spec["type"])
    if kind not in TYPES:
        raise MetadataError(
            f"column {table}.{name} has type {kind!r}",
            f"use one of {', '.join(TYPES)} (dpsql has no 'unknown' type)",
        )
    column: dict[str, Any] = {"type": TYPES[kind]}
    for bound in ("lower", "upper"):
        if spec.get(bound) is not None:
            if kind not in ("int", "float"):
                raise MetadataError(
                    f"column {table}.{name}: {bound} on a {kind} column", "bounds are numeric"
                )
            value = float(spec[bound])
            column[bound] = int(value) if kind == "int" else value
    if "nullable" in spec:
        column["nullable"] = bool(spec["nullable"])
    notes = [f"{name}.{k} = {spec[k]!r}: {_NOTES[k]}" for k in spec if k in _NOTES]
    if kind == "datetime":
        notes.append(f"{name}: SmartNoise datetime read as a dpsql date (dpsql has no timestamp)")
    extra = set(spec) - {"type", "lower", "upper", "nullable", "private_id", *_NOTES}
    if extra:
        raise MetadataError(
            f"column {table}.{name} has unknown keys {sorted(extra)}",
            "remove them or check SmartNoise's metadata format",
        )
    return column, bool(spec.get("private_id", False)), notes


def import_table(schema: str, name: str, spec: Mapping[str, Any]) -> ImportedTable:
    """One SmartNoise table as policy parts (source not filled in)."""
    columns: dict[str, dict[str, Any]] = {}
    keys: list[str] = []
    notes: list[str] = []
    for key, value in spec.items():
        if key in TABLE_SETTINGS:
            continue
        column, is_key, column_notes = _column(name, str(key), value)
        columns[str(key)] = column
        notes += column_notes
        if is_key:
            keys.append(str(key))
    out: dict[str, Any] = {}
    row_privacy = bool(spec.get("row_privacy", False))
    if len(keys) > 1:
        raise MetadataError(
            f"table {schema}.{name} has {len(keys)} private_id columns {keys}",
            "dpsql has one privacy-unit column per table; keep the one that identifies a person",
        )
    if keys and not row_privacy:
        max_ids = int(spec.get("max_ids", 1))
        if max_ids < 1:
            raise MetadataError(f"table {schema}.{name}: max_ids = {max_ids}", "use max_ids >= 1")
        out.update(privacy_unit=keys[0], max_rows_per_unit=max_ids, max_groups_per_unit=max_ids)
        columns[keys[0]].setdefault("nullable", False)
    elif not row_privacy:
        notes.append(
            "no private_id and row_privacy false: imported as row-level (one row, one unit)"
        )
    elif keys:
        notes.append(f"row_privacy true: {keys[0]} is an ordinary column, each row its own unit")
    for setting in ("rows", "rows_exact", "censor_dims", "clamp_counts", "clamp_columns"):
        if setting in spec:
            notes.append(f"{setting} = {spec[setting]!r}: {_NOTES[setting]}")
    for setting in ("use_dpsu", "sample_max_ids"):
        if setting in spec:
            notes.append(f"{setting} = {spec[setting]!r}: {_NOTES[setting]}")
    return ImportedTable(schema, name, out, columns, tuple(notes))


def import_metadata(meta: Mapping[str, Any]) -> tuple[str, list[ImportedTable]]:
    """The collection name and every table of a SmartNoise metadata mapping."""
    collection, body = collection_of(meta)
    tables = []
    for schema, schema_body in body.items():
        if not isinstance(schema_body, Mapping):
            raise MetadataError(f"schema {schema!r} is not a mapping", "schema: table: column")
        for table, spec in schema_body.items():
            if not isinstance(spec, Mapping):
                raise MetadataError(f"table {schema}.{table} is not a mapping", "table: column")
            tables.append(import_table(str(schema or ""), str(table), spec))
    names = [t.name.lower() for t in tables]
    if len(set(names)) != len(names):
        raise MetadataError(
            "two schemas hold tables of the same name",
            "import one schema at a time (--table SCHEMA.TABLE)",
        )
    return collection, tables


def policy_accepts_schema() -> bool:
    """Whether this dpsql's policy has ``[privacy] schema`` (so PUMS.PUMS resolves)."""
    from dpsql import policy

    return "schema" in getattr(policy, "_PRIVACY_KEYS", {})


def build_policy(
    meta: Mapping[str, Any],
    sources: Mapping[str, str] | str,
    *,
    table: str | None = None,
    privacy: Mapping[str, Any] | None = None,
    schema_key: bool | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """A policy dict (loadable by :func:`dpsql.policy.load_policy`) and the notes.

    ``sources`` maps table names to CSV paths, or is one path for a one-table import;
    ``table`` picks ``TABLE`` or ``SCHEMA.TABLE``; ``privacy`` overrides the defaults;
    ``schema_key`` writes the tables' one SmartNoise schema as ``[privacy] schema`` (default:
    when this dpsql's policy accepts the key), so ``SCHEMA.TABLE`` names resolve as written.
    """
    collection, tables = import_metadata(meta)
    if table is not None:
        tables = [t for t in tables if table.lower() in (t.name.lower(), _qualified(t).lower())]
        if not tables:
            raise MetadataError(f"no table {table!r} in the metadata", "name TABLE or SCHEMA.TABLE")
    if isinstance(sources, str | os.PathLike):
        if len(tables) != 1:
            raise MetadataError(
                f"one data file for {len(tables)} tables",
                "pick a table with --table SCHEMA.TABLE",
            )
        sources = {tables[0].name: str(sources)}
    with_schema = policy_accepts_schema() if schema_key is None else schema_key
    settings: dict[str, Any] = {
        "epsilon": 1.0,
        "delta": 1e-6,
        "mechanism": "laplace",
        "budget_epsilon": 10.0,
        "budget_delta": 1e-5,
    }
    settings.update(privacy or {})
    settings.setdefault("dataset", collection or tables[0].name)
    schemas = sorted({t.schema for t in tables if t.schema})
    notes: list[str] = []
    if with_schema and len(schemas) == 1:
        settings.setdefault("schema", schemas[0])
    elif schemas:
        why = "this dpsql has no [privacy] schema key" if not with_schema else "several schemas"
        notes.append(
            f"SmartNoise schemas {', '.join(schemas)} not declared ({why}): "
            "queries must name the tables without a schema"
        )
    policy: dict[str, Any] = {"privacy": settings, "tables": {}}
    for t in tables:
        if t.name not in sources:
            raise MetadataError(f"no data file for table {t.name!r}", "pass one CSV per table")
        spec: dict[str, Any] = {"source": str(sources[t.name])}
        spec.update(t.spec)
        spec["columns"] = t.columns
        policy["tables"][t.name] = spec
        notes += [f"{t.name}: {n}" for n in t.notes]
    return policy, notes


def _qualified(t: ImportedTable) -> str:
    return f"{t.schema}.{t.name}" if t.schema else t.name


# --------------------------------------------------------------------------------------------
# TOML output (policies hold strings, numbers, booleans and lists of them)


def _toml_key(key: str) -> str:
    return key if _BARE.match(key) else _toml_string(key)


def _toml_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MetadataError(f"the value {value!r} has no TOML form here", "use a finite bound")
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, Sequence):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def to_toml(policy: Mapping[str, Any], notes: Sequence[str] = (), header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()]
    if notes:
        lines.append("# SmartNoise settings without a dpsql key, and what dpsql does instead:")
        lines += [f"#   {n}" for n in notes]
    lines += ["", "[privacy]"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in policy["privacy"].items()]
    for name, spec in policy["tables"].items():
        lines += ["", f"[tables.{_toml_key(name)}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in spec.items() if k != "columns"]
        for column, col_spec in spec["columns"].items():
            lines += ["", f"[tables.{_toml_key(name)}.columns.{_toml_key(column)}]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in col_spec.items()]
    return "\n".join(lines) + "\n"


def import_file(
    meta_path: str | Path,
    data_path: str | Path,
    out_path: str | Path,
    *,
    table: str | None = None,
    privacy: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Read META, write the policy to OUT (its source relative to OUT), check it loads."""
    from dpsql.policy import load_policy

    meta_path, data_path, out_path = Path(meta_path), Path(data_path), Path(out_path)
    meta = load_yaml(meta_path.read_text(encoding="utf-8"))
    source = os.path.relpath(data_path.resolve(), out_path.resolve().parent)
    policy, notes = build_policy(meta, source, table=table, privacy=privacy)
    header = f"dpsql policy imported from the SmartNoise metadata {meta_path.name}"
    text = to_toml(policy, notes, header)
    out_path.write_text(text, encoding="utf-8")
    load_policy(out_path)  # fails with a PolicyError naming the key if the result is unusable
    return policy, notes


def _privacy_args(args: argparse.Namespace) -> dict[str, Any]:
    chosen = {
        "epsilon": args.epsilon,
        "delta": args.delta,
        "budget_epsilon": args.budget_epsilon,
        "budget_delta": args.budget_delta,
        "dataset": args.dataset,
    }
    return {k: v for k, v in chosen.items() if v is not None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``import-smartnoise`` arguments (for the ``dpsql`` command's subparser)."""
    parser.add_argument("metadata", help="SmartNoise SQL metadata file (YAML)")
    parser.add_argument("data", help="the table's CSV/Parquet file")
    parser.add_argument("--out", required=True, help="the policy file to write (TOML)")
    parser.add_argument("--table", help="TABLE or SCHEMA.TABLE when the metadata has several")
    parser.add_argument("--epsilon", type=float, help="default per-query epsilon (1.0)")
    parser.add_argument("--delta", type=float, help="default per-query delta (1e-6)")
    parser.add_argument("--budget-epsilon", type=float, help="each analyst's epsilon (10)")
    parser.add_argument("--budget-delta", type=float, help="each analyst's delta (1e-5)")
    parser.add_argument("--dataset", help="ledger dataset name (default: the collection)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")


def run(args: argparse.Namespace) -> int:
    """Run ``dpsql import-smartnoise`` with parsed arguments; 0 on success, 1 on failure."""
    from dpsql.errors import PolicyError

    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"dpsql: {out} exists (use --force to overwrite)", file=sys.stderr)
        return 1
    try:
        _, notes = import_file(
            args.metadata, args.data, out, table=args.table, privacy=_privacy_args(args)
        )
    except (MetadataError, PolicyError, OSError) as exc:
        print(f"dpsql: cannot import {args.metadata}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    for note in notes:
        print(f"  note: {note}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dpsql import-smartnoise",
        description="Write a dpsql policy from a SmartNoise SQL metadata file.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
