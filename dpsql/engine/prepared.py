"""The prepared store: per source and data version, the derived layout the bounded plans need.

Built once in DuckDB when a source is loaded (``[engine] prepared = "memory"`` or ``"disk"``, or
``dpsql prepare``), it holds every declared column of the table plus:

- ``__dp_un``   rows of the row's privacy unit;
- ``__dp_pr<i>`` rows in the row's (unit, value of column i), for columns with a small public
  domain (declared values, booleans): a pair within R under no filter is within R under any;
- ``__dp_g<i>`` distinct values (NULL counted) of column i in the row's unit: the unit lies in at
  most the product of these over a key's columns groups, under any filter;
- ``__dp_fp<i>`` the fixed-point integer of a bounded numeric column, clamped and rounded exactly
  as :func:`dpsql.lower.compile.fixed_point_expr` does it per query;
- ``__dp_h``    the keyed-hash mix: DuckDB's HASH(c1, ..., cn, s) combines HASH(c1..cn) = h
  with HASH(s) as ``((h ^ h >> 32) * K) ^ HASH(s)``; the store keeps ``(h ^ h >> 32) * K`` mod
  2^64, checked at build on the rows themselves (no column if DuckDB combines otherwise);

and, beside it, per privacy unit and per (unit, value) of each small-domain column, the row count
and each fixed-point column's sum, sum of squares and count (``partials``): a query with no
filter and no key or one such key reads its (unit, group) pairs there instead of aggregating
the rows. Rows are clustered by unit, ordered by the unit's row count (a unit's rows stay
together, and a scan of the units over R skips, by DuckDB's zone maps, the row groups of the
small ones). A
store is keyed by the data version and the table's policy: another version or policy never
reads it (``STORES`` maps (table, version) to the one built for it), and a disk store's file
name and metadata carry that key.

Nothing in the store is ever released: it only lets the compiler (dpsql.lower.prepared_plan)
send units whose statistics prove they are within R and G straight to the final aggregate, with
results bit-identical to the plan without a store. Which plan runs depends on the policy and on
whether a store exists, never on the statistics' values (docs/performance.md, "Prepared store").
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
from sqlglot import exp

from dpsql.engine import store_files
from dpsql.lower.builders import (
    alias,
    and_all,
    attach,
    coalesce,
    count_distinct,
    count_star,
    count_where_over,
    create_table_as,
    cte,
    detach,
    left_join,
    named_table,
    order_by,
    policy_column,
    same,
    select,
    star,
    subquery,
    table_ref,
    with_ctes,
)
from dpsql.lower.row_values import cast, domain_condition, fixed_point_expr, internal_name
from dpsql.lower.store_layout import StoreInfo
from dpsql.plan.fixed_point import fixed_point_bounds
from dpsql.policy import ColumnPolicy, Policy, TablePolicy

FORMAT = 4  # bump when the layout changes: old files are then never matched
# DuckDB's CombineHash multiplier (src/include/duckdb/common/types/hash.hpp); verified at build
HASH_MULTIPLIER = 0xD6E8FEB86659FD93
PREFIX = "__dp_"


class Registry:
    """(table name, data version) -> the store built for it, with a refcount per entry for
    engines that share one (one registry per engine kind: DuckDB's here, Spark's in
    dpsql.engine.spark_store)."""

    def __init__(self) -> None:
        self.stores: dict[tuple[str, str], StoreInfo] = {}
        self._users: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def register(self, info: StoreInfo) -> None:
        with self._lock:
            key = (info.table, info.version)
            self.stores[key] = info
            self._users[key] = self._users.get(key, 0) + 1

    def unregister(self, info: StoreInfo) -> None:
        with self._lock:
            key = (info.table, info.version)
            left = self._users.get(key, 0) - 1
            if left > 0:
                self._users[key] = left
                return
            self._users.pop(key, None)
            if key in self.stores and self.stores[key].key == info.key:
                self.stores.pop(key, None)


_REGISTRY = Registry()
STORES = _REGISTRY.stores
register = _REGISTRY.register
unregister = _REGISTRY.unregister


def lookup(table: TablePolicy, version: str, engine: str | None = None) -> StoreInfo | None:
    """The store built for this table policy and data version, if any (a stale one never).
    ``engine`` ("duckdb", "spark"): that engine's stores only; None: DuckDB's, else Spark's
    (a process running both engines on one table and version should pass it)."""
    info = STORES.get((table.name, version)) if engine in (None, "duckdb") else None
    if info is None or info.key != store_key(table, version):
        return _spark_lookup(table, version) if engine in (None, "spark") else None
    return info


def _spark_lookup(table: TablePolicy, version: str) -> StoreInfo | None:
    """A Spark engine's store (dpsql.engine.spark_store), if that module is in use at all."""
    spark_store = sys.modules.get("dpsql.engine.spark_store")
    return None if spark_store is None else spark_store.lookup(table, version)


def store_key(table: TablePolicy, version: str) -> str:
    """What a store depends on: its format, DuckDB's version (its HASH), the data version
    and every column declaration of the table."""
    cols = [
        (c.name, c.type, c.lower, c.upper, c.values, c.nullable, c.granularity)
        for c in stored_columns(table)
    ]
    text = repr((FORMAT, duckdb.__version__, table.name, version, table.privacy_unit, cols))
    return hashlib.sha256(text.encode()).hexdigest()


def stored_columns(table: TablePolicy) -> list[ColumnPolicy]:
    """The columns the source holds (computed columns are derived per query)."""
    return [c for c in table.columns.values() if c.expr is None]


def _pair_column(col: ColumnPolicy) -> bool:
    """Columns whose (unit, value) row counts are kept: a small public domain, keyed as is."""
    return col.type in ("text", "bool", "int") and (col.values is not None or col.type == "bool")


# -- build ---------------------------------------------------------------------------------


def store_layout(table: TablePolicy) -> dict[str, Any]:
    """Internal column names per role, from the policy alone."""
    cols = stored_columns(table)
    index = {c.name: i for i, c in enumerate(table.columns.values())}
    unit = table.privacy_unit
    layout: dict[str, Any] = {"pair": {}, "keys": {}, "fixed": {}}
    for c in cols:
        i = index[c.name]
        if unit is not None and c.name != unit:
            layout["keys"][c.name] = f"{PREFIX}g{i}"
            if _pair_column(c):
                layout["pair"][c.name] = f"{PREFIX}pr{i}"
        if c.numeric and c.bounded:
            lo, hi = fixed_point_bounds(c.lower, c.upper, c.granularity)  # type: ignore[arg-type]
            layout["fixed"][c.name] = (lo, hi, f"{PREFIX}fp{i}")
    if unit is not None:
        layout["partials"] = {"": "units", **{c: f"pairs{i}" for c, i in _pair_indexes(table)}}
        layout["partial_columns"] = {
            name: (f"{PREFIX}s{index[name]}", f"{PREFIX}q{index[name]}", f"{PREFIX}c{index[name]}")
            for name in layout["fixed"]
        }
    return layout


def layout_fields(table: TablePolicy, layout: dict[str, Any]) -> dict[str, Any]:
    """The StoreInfo fields a store's layout names the same way on every engine."""
    return {
        "unit_rows": f"{PREFIX}un" if table.privacy_unit is not None else None,
        "pair_rows": dict(layout["pair"]),
        "unit_keys": dict(layout["keys"]),
        "fixed": dict(layout["fixed"]),
    }


def _pair_indexes(table: TablePolicy) -> list[tuple[str, int]]:
    index = {c.name: i for i, c in enumerate(table.columns.values())}
    return [
        (c.name, index[c.name])
        for c in stored_columns(table)
        if c.name != table.privacy_unit and _pair_column(c)
    ]


def _partials(
    table: TablePolicy, layout: dict[str, Any], rows: exp.Table, name: Callable[[str], exp.Table]
) -> list[exp.Create]:
    """CREATE TABLEs of the partials: per unit, and per (unit, value) of each pair column, the
    row count and each fixed-point column's SUM, SUM of squares (128-bit) and COUNT, over the
    rows with a unit (the plans never use the others). None for a row-level table."""
    if table.privacy_unit is None:
        return []
    sums: list[exp.Expression] = []
    for column, (_, _, fp) in layout["fixed"].items():
        s, q, c = layout["partial_columns"][column]
        square = exp.Mul(this=cast(internal_name(fp), "INT128"), expression=internal_name(fp))
        sums += [
            alias(exp.Sum(this=internal_name(fp)), s),
            alias(exp.Sum(this=square), q),
            alias(exp.Count(this=internal_name(fp)), c),
        ]
    out = []
    for column, relation in layout["partials"].items():
        unit = policy_column(table.privacy_unit)
        key = [alias(policy_column(column), "__k")] if column else []
        items = [alias(unit, "__u"), *key, alias(count_star(), "__n"), *sums]
        group: list[exp.Expression] = [internal_name("__u")]
        group += [internal_name("__k")] if column else []
        with_unit = exp.Not(this=exp.Is(this=unit.copy(), expression=exp.Null()))
        grouped = select([i.copy() for i in items], rows.copy(), where=[with_unit], group=group)
        if column:
            # __g: the unit's pairs whose key is in the public domain (the plans' pair filter)
            inside = domain_condition(table.columns[column], "__k")
            counted = alias(count_where_over(inside, [internal_name("__u")]), "__g")
            grouped = select([star(), counted], subquery(grouped, "g"))
        out.append(create_table_as(name(relation), order_by(grouped, [internal_name("__u")])))
    return out


def rows_query(
    table: TablePolicy,
    layout: dict[str, Any],
    source: exp.Table,
    extra: list[exp.Expression] | None = None,
) -> exp.Select:
    """The store's rows, as every engine derives them (DuckDB here, Spark in
    dpsql.engine.spark_store): the typed rows of ``source``, their fixed-point columns and the
    ``extra`` items (DuckDB's hash mix), their unit's statistics joined on, ordered by (unit
    rows, unit)."""
    fixed = [
        alias(fixed_point_expr(table.columns[name], lo, hi), fp)
        for name, (lo, hi, fp) in layout["fixed"].items()
    ]
    rows = select([star(), *fixed, *(extra or [])], source.copy())
    unit = table.privacy_unit
    if unit is None:
        return rows
    u = policy_column(unit)
    per_unit = select([u, *unit_statistics(layout)], source.copy(), group=[u.copy()])
    ctes = [cte("r", rows), cte("u", per_unit)]
    joins = [left_join(table_ref("u"), same(policy_column(unit, "r"), policy_column(unit, "u")))]
    items = [star("r"), alias(coalesce(internal_name(f"{PREFIX}un", "u"), _zero()), f"{PREFIX}un")]
    items += [alias(coalesce(internal_name(g, "u"), _zero()), g) for g in layout["keys"].values()]
    for j, (name, pr) in enumerate(layout["pair"].items()):
        c, p = policy_column(name), f"p{j}"
        counts = [u.copy(), c, alias(count_star(), pr)]
        ctes.append(cte(p, select(counts, source.copy(), group=[u.copy(), c.copy()])))
        on = exp.And(
            this=same(policy_column(unit, "r"), policy_column(unit, p)),
            expression=same(policy_column(name, "r"), policy_column(name, p)),
        )
        joins.append(left_join(table_ref(p), on))
        items.append(alias(coalesce(internal_name(pr, p), _zero()), pr))
    out = select(items, table_ref("r"), joins=joins)
    return order_by(with_ctes(out, ctes), [internal_name(f"{PREFIX}un"), policy_column(unit, "r")])


def _zero() -> exp.Expression:
    return exp.Literal.number(0)


def unit_statistics(layout: dict[str, Any]) -> list[exp.Expression]:
    """The per-unit statistics' aggregates (both engines read them): the unit's rows, and per
    key column its distinct values, NULL counted as one."""
    items: list[exp.Expression] = [alias(count_star(), f"{PREFIX}un")]
    for name, g in layout["keys"].items():
        null = exp.Case(
            ifs=[exp.If(this=exp.Is(this=policy_column(name), expression=exp.Null()), true=_one())],
            default=_zero(),
        )
        distinct = exp.Add(this=count_distinct(policy_column(name)), expression=exp.Max(this=null))
        items.append(alias(distinct, g))
    return items


def _one() -> exp.Expression:
    return exp.Literal.number(1)


def _hash_mix(columns: list[exp.Expression]) -> exp.Expression:
    """DuckDB's ``(h ^ h >> 32) * K`` mod 2^64 of ``h = HASH(columns)``, as UBIGINT: what
    HASH(columns..., s) combines with HASH(s) (checked by :func:`_hash_combines_as_expected`)."""
    h = exp.Anonymous(this="HASH", expressions=columns)
    folded = exp.BitwiseXor(
        this=h, expression=exp.BitwiseRightShift(this=h.copy(), expression=exp.Literal.number(32))
    )
    mixed = exp.Mul(
        this=cast(folded, "UINT128"),
        expression=cast(exp.Literal.number(HASH_MULTIPLIER), "UINT128"),
    )
    wrapped = exp.Mod(
        this=exp.Paren(this=mixed), expression=cast(exp.Literal.number(2**64), "UINT128")
    )
    return cast(wrapped, "UBIGINT")


def _build(table: TablePolicy, layout: dict[str, Any], dest: exp.Table, hashed: bool) -> exp.Create:
    """One CREATE TABLE: the typed rows, their statistics joined on, clustered by unit."""
    columns: list[exp.Expression] = [policy_column(c.name) for c in stored_columns(table)]
    extra: list[exp.Expression] = [alias(_hash_mix(columns), f"{PREFIX}h")] if hashed else []
    return create_table_as(dest, rows_query(table, layout, named_table(table.name), extra))


def _hash_combines_as_expected(con: duckdb.DuckDBPyConnection, table: TablePolicy) -> bool:
    """Does HASH(cols..., s) equal the stored mix XOR HASH(s), here, on this table's rows?"""
    columns: list[exp.Expression] = [policy_column(c.name) for c in stored_columns(table)]
    checks: list[exp.Expression] = []
    for s in (0, 7, 4242, 2**40 + 3, 2**61 + 12345, 2**62 - 1):
        seeded = exp.Anonymous(this="HASH", expressions=[*_copies(columns), exp.Literal.number(s)])
        alone = exp.Anonymous(this="HASH", expressions=[exp.Literal.number(s)])
        combined = exp.BitwiseXor(this=_hash_mix(_copies(columns)), expression=alone)
        checks.append(exp.LogicalAnd(this=exp.EQ(this=seeded, expression=combined)))
    sample = select([star()], named_table(table.name)).limit(2048, copy=False)
    query = select([coalesce(and_all(checks), exp.true())], subquery(sample, "sample"))
    row = con.execute(query.sql(dialect="duckdb")).fetchone()
    return bool(row and row[0])


def _copies(nodes: list[exp.Expression]) -> list[exp.Expression]:
    return [n.copy() for n in nodes]


def _ranges(con: duckdb.DuckDBPyConnection, relation: exp.Table, table: TablePolicy) -> dict:
    """Each numeric column's min and max (the operator's report only: no plan reads them)."""
    numeric = [c.name for c in stored_columns(table) if c.numeric]
    if not numeric:
        return {}
    items: list[exp.Expression] = []
    for n in numeric:
        items += [exp.Min(this=policy_column(n)), exp.Max(this=policy_column(n))]
    row = con.execute(select(items, relation.copy()).sql(dialect="duckdb")).fetchone() or ()
    return {n: (row[2 * i], row[2 * i + 1]) for i, n in enumerate(numeric)}


def _run(con: duckdb.DuckDBPyConnection, statement: exp.Expression, *params: Any) -> Any:
    """Render one statement in DuckDB's dialect (the edge) and run it."""
    return con.execute(statement.sql(dialect="duckdb"), list(params) if params else None)


def prepare_table(
    con: duckdb.DuckDBPyConnection,
    table: TablePolicy,
    version: str,
    *,
    directory: Path | None,
    progress: Callable[[str], None] | None = None,
) -> StoreInfo | None:
    """Build (or, on disk, reuse) the store of ``table`` at ``version`` on ``con``, before the
    connection is sealed. ``directory`` None: in memory. None when no store can be kept (a
    name clash with the internal columns, or a disk store without a data version, or a
    unit_path table: it is read through its path, its unit is not among its own columns)."""
    if any(name.startswith(PREFIX) for name in table.columns) or table.public:
        return None
    if table.joined is not None:
        return None
    if directory is not None and not version:
        return None  # nothing would tell a later process that the data changed
    say = progress or (lambda _text: None)
    key = store_key(table, version)
    layout = store_layout(table)
    started = time.perf_counter()
    # a row-level table samples nothing: no hash mix
    sampled = table.privacy_unit is not None
    if directory is None:
        catalog, relation = None, f"{PREFIX}store_{table.name}"
        dest = named_table(relation)
        hashed = sampled and _hash_combines_as_expected(con, table)
        say(f"{table.name}: building the prepared store in memory")
        before = _memory_bytes(con)
        _run(con, _build(table, layout, dest, hashed))
        for statement in _partials(table, layout, dest, lambda r: named_table(f"{relation}_{r}")):
            _run(con, statement)
        path, reused, size = None, False, max(_memory_bytes(con) - before, 0)
    else:
        store_files.private_directory(directory)  # 0700 whatever the umask
        store_files.clean_interrupted(directory)  # what a killed build left behind
        store_files.private_spill(con, directory)  # DuckDB's spills of the rows: private too
        path_ = directory / f"{table.name}-{key[:24]}.duckdb"
        catalog, relation = f"{PREFIX}p_{table.name}", "store"
        reused = path_.is_file() and _valid(con, path_, key)
        if not reused:
            hashed = sampled and _hash_combines_as_expected(con, table)
            say(f"{table.name}: building the prepared store {path_}")
            _build_file(con, table, layout, path_, key, version, hashed)
            _remove_stale(directory, table.name, path_)
        _run(con, attach(str(path_), catalog, read_only=True))
        meta = json.loads(_first(con, _info(catalog)))
        hashed = bool(meta["hashed"])
        dest = named_table(relation, catalog)
        path, size = str(path_), path_.stat().st_size
    rows = int(_first(con, select([count_star()], dest.copy())))
    seconds = time.perf_counter() - started
    info = StoreInfo(
        table=table.name,
        version=version,
        key=key,
        catalog=catalog,
        relation=relation,
        **layout_fields(table, layout),
        hash_mix=f"{PREFIX}h" if hashed else None,
        partials={
            column: relation if catalog is not None else f"{PREFIX}store_{table.name}_{relation}"
            for column, relation in layout.get("partials", {}).items()
        },
        partial_columns=dict(layout.get("partial_columns", {})),
        rows=rows,
        build_seconds=seconds,
        bytes=size,
        path=path,
        reused=reused,
        ranges=_ranges(con, dest, table),
    )
    say(
        f"{table.name}: store {'reused' if reused else 'built'} in {seconds:.1f} s, "
        f"{rows:,} rows, {info.bytes / 2**20:.1f} MiB"
    )
    return info


def _info(catalog: str) -> exp.Select:
    """``SELECT info FROM catalog.meta``: a disk store's metadata (its key, format, hash mix)."""
    return select([internal_name("info")], named_table("meta", catalog))


def _first(con: duckdb.DuckDBPyConnection, query: exp.Select) -> Any:
    """The first value of a one-row query's first row (its statement rendered here)."""
    row = _run(con, query).fetchone()
    assert row is not None, "an aggregate or a store's metadata has one row"
    return row[0]


def _valid(con: duckdb.DuckDBPyConnection, path: Path, key: str) -> bool:
    """An existing file is used only if its metadata carries this very key."""
    probe = f"{PREFIX}probe"
    try:
        _run(con, attach(str(path), probe, read_only=True))
        try:
            row = _run(con, _info(probe)).fetchone()
        finally:
            _run(con, detach(probe))
    except duckdb.Error:
        return False
    return row is not None and json.loads(row[0]).get("key") == key


def _build_file(
    con: duckdb.DuckDBPyConnection,
    table: TablePolicy,
    layout: dict[str, Any],
    path: Path,
    key: str,
    version: str,
    hashed: bool,
) -> None:
    """Write the store to a file in a private scratch directory (0700: the half-written copy
    of the private rows is never readable by others, and a killed build's is removed at the
    next start, dpsql.engine.store_files), then rename it into place (atomic: a concurrent
    process sees the old state or the whole new file, never half of one)."""
    with store_files.build_area(path.parent) as area:
        tmp = area / "store.duckdb"
        build = f"{PREFIX}build"
        _run(con, attach(str(tmp), build, read_only=False))
        try:
            dest = named_table("store", build)
            _run(con, _build(table, layout, dest, hashed))
            for statement in _partials(table, layout, dest, lambda r: named_table(r, build)):
                _run(con, statement)
            info = json.dumps({"key": key, "version": version, "format": FORMAT, "hashed": hashed})
            meta = exp.Select(expressions=[alias(exp.Placeholder(), "info")])
            _run(con, create_table_as(named_table("meta", build), meta), info)
        finally:
            _run(con, detach(build))
        store_files.owner_only(tmp)  # a copy of the private rows: readable by the operator only
        os.replace(tmp, path)


def _remove_stale(directory: Path, table: str, keep: Path) -> None:
    """Stores of this table for another version or policy: never read again."""
    for old in directory.glob(f"{table}-*.duckdb"):
        if old != keep:
            old.unlink(missing_ok=True)


def _memory_bytes(con: duckdb.DuckDBPyConnection) -> int:
    """Bytes DuckDB holds for the in-memory database (the store's size, before and after)."""
    row = con.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()
    return int(row[0] or 0) if row else 0


def store_directory(policy: Policy) -> Path | None:
    """Where disk stores go: ``[engine] prepared_dir`` (relative to the policy file), else the
    ledger's directory; None when neither is known (then the store stays in memory)."""
    configured = policy.engine.prepared_dir
    if configured is not None:
        path = Path(configured)
        if not path.is_absolute() and policy.path is not None:
            path = policy.path.parent / path
        return path
    if policy.ledger_path is not None:
        return policy.ledger_path.parent / "dpsql-store"
    return None
