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

from dpsql.engine import store_files
from dpsql.frontend.identifiers import quote_ident as _q
from dpsql.lower.row_values import domain_condition, fixed_point_expr
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


def _partials_sql(
    table: TablePolicy, layout: dict[str, Any], rows: str, name: Callable[[str], str]
) -> list[str]:
    """CREATE TABLEs of the partials: per unit, and per (unit, value) of each pair column, the
    row count and each fixed-point column's SUM, SUM of squares (128-bit) and COUNT, over the
    rows with a unit (the plans never use the others). None for a row-level table."""
    if table.privacy_unit is None:
        return []
    u = _q(table.privacy_unit)
    sums = []
    for column, (_, _, fp) in layout["fixed"].items():
        s, q, c = layout["partial_columns"][column]
        sums += [
            f"SUM({fp}) AS {s}",
            f"SUM(CAST({fp} AS HUGEINT) * {fp}) AS {q}",
            f"COUNT({fp}) AS {c}",
        ]
    out = []
    for column, relation in layout["partials"].items():
        key = [f"{_q(column)} AS __k"] if column else []
        items = ", ".join([f"{u} AS __u", *key, "COUNT(*) AS __n", *sums])
        group = "__u, __k" if column else "__u"
        grouped = f"SELECT {items} FROM {rows} WHERE {u} IS NOT NULL GROUP BY {group}"
        if column:
            # __g: the unit's pairs whose key is in the public domain (the plans' pair filter)
            inside = domain_condition(table.columns[column], "__k").sql(dialect="duckdb")
            counted = f"COUNT(*) FILTER (WHERE {inside}) OVER (PARTITION BY __u) AS __g"
            grouped = f"SELECT *, {counted} FROM ({grouped})"
        out.append(f"CREATE TABLE {name(relation)} AS {grouped} ORDER BY __u")
    return out


def _build_sql(table: TablePolicy, layout: dict[str, Any], dest: str, hashed: bool) -> str:
    """One CREATE TABLE: the typed rows, their statistics joined on, clustered by unit."""
    cols = stored_columns(table)
    unit = table.privacy_unit
    src = _q(table.name)
    items = ["r.*"]
    for name, (lo, hi, fp) in layout["fixed"].items():
        expr = fixed_point_expr(table.columns[name], lo, hi).sql(dialect="duckdb")
        items.append(f"{expr} AS {fp}")
    if hashed:
        h = "HASH(" + ", ".join(f"r.{_q(c.name)}" for c in cols) + ")"
        items.append(
            f"CAST((CAST(XOR({h}, {h} >> 32) AS UHUGEINT) * {HASH_MULTIPLIER}::UHUGEINT) "
            f"% 18446744073709551616::UHUGEINT AS UBIGINT) AS {PREFIX}h"
        )
    if unit is None:
        return f"CREATE TABLE {dest} AS SELECT {', '.join(items)} FROM {src} AS r"
    u = _q(unit)
    per_unit = unit_statistics(layout, _q)
    ctes = [f"u AS (SELECT {u}, {', '.join(per_unit)} FROM {src} GROUP BY {u})"]
    joins = [f"LEFT JOIN u ON r.{u} IS NOT DISTINCT FROM u.{u}"]
    items += [f"COALESCE(u.{PREFIX}un, 0) AS {PREFIX}un"]
    items += [f"COALESCE(u.{g}, 0) AS {g}" for g in layout["keys"].values()]
    for j, (name, pr) in enumerate(layout["pair"].items()):
        c = _q(name)
        ctes.append(f"p{j} AS (SELECT {u}, {c}, COUNT(*) AS {pr} FROM {src} GROUP BY {u}, {c})")
        joins.append(
            f"LEFT JOIN p{j} ON r.{u} IS NOT DISTINCT FROM p{j}.{u} "
            f"AND r.{c} IS NOT DISTINCT FROM p{j}.{c}"
        )
        items.append(f"COALESCE(p{j}.{pr}, 0) AS {pr}")
    return (
        f"CREATE TABLE {dest} AS WITH {', '.join(ctes)} SELECT {', '.join(items)} "
        f"FROM {src} AS r {' '.join(joins)} ORDER BY {PREFIX}un, r.{u}"
    )


def unit_statistics(layout: dict[str, Any], quote: Callable[[str], str]) -> list[str]:
    """The per-unit statistics' aggregates (SQL both engines read): the unit's rows, and per
    key column its distinct values, NULL counted as one."""
    items = [f"COUNT(*) AS {PREFIX}un"]
    for name, g in layout["keys"].items():
        c = quote(name)
        items.append(f"COUNT(DISTINCT {c}) + MAX(CASE WHEN {c} IS NULL THEN 1 ELSE 0 END) AS {g}")
    return items


def _hash_combines_as_expected(con: duckdb.DuckDBPyConnection, table: TablePolicy) -> bool:
    """Does HASH(cols..., s) equal the stored mix XOR HASH(s), here, on this table's rows?"""
    cols = ", ".join(_q(c.name) for c in stored_columns(table))
    h = f"HASH({cols})"
    mix = (
        f"CAST((CAST(XOR({h}, {h} >> 32) AS UHUGEINT) * {HASH_MULTIPLIER}::UHUGEINT) "
        "% 18446744073709551616::UHUGEINT AS UBIGINT)"
    )
    checks = " AND ".join(
        f"bool_and(HASH({cols}, {s}) = XOR({mix}, HASH({s})))"
        for s in (0, 7, 4242, 2**40 + 3, 2**61 + 12345, 2**62 - 1)
    )
    sample = f"(SELECT * FROM {_q(table.name)} LIMIT 2048)"
    row = con.execute(f"SELECT coalesce({checks}, true) FROM {sample}").fetchone()
    return bool(row and row[0])


def _ranges(con: duckdb.DuckDBPyConnection, relation: str, table: TablePolicy) -> dict:
    """Each numeric column's min and max (the operator's report only: no plan reads them)."""
    numeric = [c.name for c in stored_columns(table) if c.numeric]
    if not numeric:
        return {}
    items = ", ".join(f"min({_q(n)}), max({_q(n)})" for n in numeric)
    row = con.execute(f"SELECT {items} FROM {relation}").fetchone() or ()
    return {n: (row[2 * i], row[2 * i + 1]) for i, n in enumerate(numeric)}


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
        dest = _q(relation)
        hashed = sampled and _hash_combines_as_expected(con, table)
        say(f"{table.name}: building the prepared store in memory")
        before = _memory_bytes(con)
        con.execute(_build_sql(table, layout, dest, hashed))
        for statement in _partials_sql(table, layout, dest, lambda r: _q(f"{relation}_{r}")):
            con.execute(statement)
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
        con.execute(f"ATTACH '{_escape(str(path_))}' AS {catalog} (READ_ONLY)")
        meta = json.loads(con.execute(f"SELECT info FROM {catalog}.meta").fetchone()[0])  # type: ignore[index]
        hashed = bool(meta["hashed"])
        dest = f"{catalog}.{relation}"
        path, size = str(path_), path_.stat().st_size
    rows = int(con.execute(f"SELECT count(*) FROM {dest}").fetchone()[0])  # type: ignore[index]
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


def _escape(text: str) -> str:
    return text.replace("'", "''")


def _valid(con: duckdb.DuckDBPyConnection, path: Path, key: str) -> bool:
    """An existing file is used only if its metadata carries this very key."""
    probe = f"{PREFIX}probe"
    try:
        con.execute(f"ATTACH '{_escape(str(path))}' AS {probe} (READ_ONLY)")
        try:
            row = con.execute(f"SELECT info FROM {probe}.meta").fetchone()
        finally:
            con.execute(f"DETACH {probe}")
    except duckdb.Error:
        return False
    return bool(row) and json.loads(row[0]).get("key") == key  # type: ignore[index]


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
        con.execute(f"ATTACH '{_escape(str(tmp))}' AS {build}")
        try:
            con.execute(_build_sql(table, layout, f"{build}.store", hashed))
            for statement in _partials_sql(
                table, layout, f"{build}.store", lambda r: f"{build}.{r}"
            ):
                con.execute(statement)
            info = json.dumps({"key": key, "version": version, "format": FORMAT, "hashed": hashed})
            con.execute(f"CREATE TABLE {build}.meta AS SELECT ? AS info", [info])
        finally:
            con.execute(f"DETACH {build}")
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
