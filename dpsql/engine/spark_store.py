"""The prepared store on Spark: the DuckDB store's layout (dpsql.engine.prepared), as Parquet.

Per table and data version the Spark engine derives the same rows the DuckDB store holds --
every declared column, ``__dp_un`` (rows of the unit), ``__dp_pr<i>`` (rows of the (unit, value)
pair), ``__dp_g<i>`` (distinct values of column i in the unit, NULL counted) and ``__dp_fp<i>``
(the fixed-point integer, :func:`dpsql.lower.compile.fixed_point_expr` rendered in Spark SQL, so
the very value the plan without a store computes per query) -- ordered by (unit rows, unit):
a unit's rows stay together and Parquet's row-group statistics on ``__dp_un`` let a scan of the
units over R skip the small ones. No hash mix: ``XOR(mix, HASH(s)) = HASH(cols, s)`` is a
property of DuckDB's HASH, not of Spark's xxhash64, so the store plan hashes the stored columns
as the plain plan does (dpsql.lower.prepared_plan falls back when ``hash_mix`` is None).

``[engine] prepared = "memory"`` caches the derived rows in the engine's session (memory, then
disk); ``"disk"`` writes ``<table>-<key>.spark.parquet`` (a Parquet directory, owner-only) under
the store directory, through a temporary directory renamed into place, and reuses it while its
metadata file carries this very key (format, Spark's version, data version, every column
declaration). Either way the rows are a temporary view named like the DuckDB in-memory store,
registered here (``STORES``) and found by ``compile_plan`` through ``prepared.lookup``. Nothing
of it is ever released: it only changes how the same exact measures are computed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dpsql.engine import prepared, store_files
from dpsql.engine.prepared import PREFIX
from dpsql.lower.builders import named_table
from dpsql.lower.compile import render
from dpsql.lower.store_layout import StoreInfo
from dpsql.policy import TablePolicy

FORMAT = 1  # bump when the Spark layout changes: old directories are then never matched
META = "_dpsql_store.json"  # a leading underscore: Spark's Parquet reader skips the file

# (table name, data version) -> the Spark store built for it; a refcount per entry
_REGISTRY = prepared.Registry()
STORES = _REGISTRY.stores
register = _REGISTRY.register
unregister = _REGISTRY.unregister


def lookup(table: TablePolicy, version: str) -> StoreInfo | None:
    """The Spark store of this table policy and data version, if any (a stale one never)."""
    info = STORES.get((table.name, version))
    if info is None or info.key != store_key(table, version):
        return None
    return info


def store_key(table: TablePolicy, version: str) -> str:
    """What a Spark store depends on: its format, Spark's version (its rounding and casts),
    the data version and every column declaration of the table."""
    import pyspark

    cols = [
        (c.name, c.type, c.lower, c.upper, c.values, c.nullable, c.granularity)
        for c in prepared.stored_columns(table)
    ]
    text = repr(
        ("spark", FORMAT, pyspark.__version__, table.name, version, table.privacy_unit, cols)
    )
    return hashlib.sha256(text.encode()).hexdigest()


def view_name(table: TablePolicy) -> str:
    """The store's temporary view: the name the DuckDB in-memory store has."""
    return f"{PREFIX}store_{table.name}"


def build_sql(table: TablePolicy, layout: dict[str, Any], source: str) -> str:
    """Spark SQL of the derived rows (:func:`dpsql.engine.prepared.rows_query` over the engine's
    view ``source`` of the table, rendered here, the one edge where it becomes text): the typed
    rows, their fixed-point columns and their unit's statistics, ordered by (unit rows, unit)."""

    return render(prepared.rows_query(table, layout, named_table(source)), "spark")


def prepare_table(
    spark: Any,
    table: TablePolicy,
    version: str,
    *,
    directory: Path | None,
    source: str,
    storage_level: Any,
    progress: Callable[[str], None] | None = None,
) -> tuple[StoreInfo, Any] | None:
    """Build (or, on disk, reuse) the store of ``table`` at ``version`` in ``spark`` and make
    it the view :func:`view_name`; also returns the cached DataFrame (the engine unpersists it
    on close). None where the DuckDB store would keep none (an internal name clash, a public or
    unit_path table, a disk store without a data version)."""
    if any(name.startswith(PREFIX) for name in table.columns) or table.public:
        return None
    if table.joined is not None or (directory is not None and not version):
        return None
    say = progress or (lambda _text: None)
    key = store_key(table, version)
    layout = prepared.store_layout(table)
    started = time.perf_counter()
    sql = build_sql(table, layout, source)
    path: Path | None = None
    reused = False
    if directory is None:
        say(f"{table.name}: building the Spark prepared store in memory")
        df = spark.sql(sql).persist(storage_level)
    else:
        store_files.private_directory(directory)  # 0700 whatever the umask
        store_files.clean_interrupted(directory)  # what a killed build left behind
        path = directory / f"{table.name}-{key[:24]}.spark.parquet"
        reused = _valid(path, key)
        if not reused:
            say(f"{table.name}: building the Spark prepared store {path}")
            _write(spark, sql, path, key, version)
            _remove_stale(directory, table.name, path)
        df = spark.read.parquet(str(path))
    rows = int(df.count())  # a cached store is computed here, once
    df.createOrReplaceTempView(view_name(table))
    size = _dir_bytes(path) if path is not None else _cached_bytes(df)
    seconds = time.perf_counter() - started
    info = StoreInfo(
        table=table.name,
        version=version,
        key=key,
        catalog=None,
        relation=view_name(table),
        **prepared.layout_fields(table, layout),
        hash_mix=None,
        rows=rows,
        build_seconds=seconds,
        bytes=size,
        path=str(path) if path is not None else None,
        reused=reused,
    )
    say(
        f"{table.name}: Spark store {'reused' if reused else 'built'} in {seconds:.1f} s, "
        f"{rows:,} rows, {size / 2**20:.1f} MiB"
    )
    return info, (df if directory is None else None)


def _valid(path: Path, key: str) -> bool:
    """An existing directory is used only if its metadata file carries this very key."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("key") == key


def _write(spark: Any, sql: str, path: Path, key: str, version: str) -> None:
    """Write the Parquet directory in a private scratch directory beside its final name
    (0700, removed at the next start if the build is killed: dpsql.engine.store_files), then
    rename it into place: a reader sees no directory or a whole one (its metadata file is
    written last)."""
    with store_files.build_area(path.parent) as area:
        tmp = area / "store.spark.parquet"
        spark.sql(sql).write.mode("overwrite").parquet(str(tmp))
        meta = {"key": key, "version": version, "format": FORMAT, "engine": "spark"}
        (tmp / META).write_text(json.dumps(meta))
        _owner_only(tmp)
        if _valid(path, key):  # another process finished the same store first: keep it
            return
        if path.exists():  # a stale or tampered store under this name: never read
            shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


def _owner_only(directory: Path) -> None:
    """A copy of the private rows: readable by the operator only."""
    store_files.owner_only(directory)


def _remove_stale(directory: Path, table: str, keep: Path) -> None:
    """Spark stores of this table for another version or policy: never read again."""
    for old in directory.glob(f"{table}-*.spark.parquet"):
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _cached_bytes(df: Any) -> int:
    """The optimizer's size of the cached relation (the operator's report only)."""
    with contextlib.suppress(Exception):
        return int(str(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes()))
    return 0


# -- rendering a store plan for Spark ------------------------------------------------------


def store_tables(tree: Any) -> set[str]:
    """The tables whose prepared store the compiled tree reads (this engine's view of it, or a
    DuckDB store: in memory the same name, on disk the catalog ``__dp_p_<table>``)."""
    from sqlglot import exp

    names = set()
    for t in tree.find_all(exp.Table):
        if t.name.startswith(f"{PREFIX}store_") and not t.db:
            names.add(t.name[len(f"{PREFIX}store_") :])
        elif t.db.startswith(f"{PREFIX}p_"):
            names.add(t.db[len(f"{PREFIX}p_") :])
    return names


def spark_tree(tree: Any, tables: Mapping[str, TablePolicy]) -> Any:
    """A copy of a store plan's tree that Spark runs with DuckDB's integer semantics.

    - A tree compiled against a DuckDB store (a plan handed to this engine anyway: a service's
      plans carry their own engine's store) reads this engine's view, and its hash mix
      ``XOR(__dp_h, HASH(secret))`` -- a DuckDB identity -- becomes the keyed hash of the
      stored columns, as the plan without a store orders rows (the columns pass through the
      window where the mix did).
    - The direct phase sums every row of a group, not at most R per pair: its sums take
      DECIMAL(38, 0) arguments, since Spark's SUM(BIGINT) wraps around silently past 2^63
      where DuckDB's widens (the uncentred sums of squares of the store plan reach it within
      ~10^8 rows). They are in ``direct`` or, when one scan serves both phases, ``grouped``.
      A row-level plan's outer sums, and ``CAST(x AS INT128)`` (Spark has no 128-bit integer:
      DECIMAL(38, 0)), are rewritten by the renderer (dpsql.lower.compile._spark_safe).
    """
    from sqlglot import exp

    from dpsql.lower.builders import decimal_type

    tree = tree.copy()  # rewritten in place below; the compiled tree is shared
    for name in store_tables(tree):
        _own_store(tree, tables[name])
    for cte in tree.find_all(exp.CTE):
        if cte.alias not in ("direct", "grouped"):
            continue
        for total in list(cte.this.find_all(exp.Sum)):
            inner = total.this
            if not (isinstance(inner, exp.Cast) and inner.to.this == exp.DataType.Type.DECIMAL):
                total.set("this", exp.Cast(this=inner, to=decimal_type(38, 0)))
    return tree


def _own_store(tree: Any, table: TablePolicy) -> None:
    """Point a DuckDB store plan of ``table`` at this engine's view, without the hash mix."""
    from sqlglot import exp

    from dpsql.lower.hashing import keyed_hash
    from dpsql.lower.row_values import quoted

    for t in list(tree.find_all(exp.Table)):
        if t.db == f"{PREFIX}p_{table.name}":
            t.set("db", None)
            t.set("this", exp.to_identifier(view_name(table)))
    mix = f"{PREFIX}h"
    stored = [n for n in table.columns if table.columns[n].expr is None]
    for xor in list(tree.find_all(exp.BitwiseXor)):
        if isinstance(xor.this, exp.Column) and xor.this.name == mix:
            secret = xor.expression.expressions[-1].copy()
            xor.replace(keyed_hash([*(quoted(n) for n in stored), secret]))
    for select in list(tree.find_all(exp.Select)):
        items = select.expressions
        if not any(isinstance(i, exp.Column) and i.name == mix for i in items):
            continue
        have = {i.alias_or_name for i in items}
        fresh = [quoted(n) for n in stored if n not in have]
        kept = [i for i in items if not (isinstance(i, exp.Column) and i.name == mix)]
        select.set("expressions", [*kept, *fresh])
