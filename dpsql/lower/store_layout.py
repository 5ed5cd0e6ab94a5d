"""What a lowering may use of one table's prepared store: its layout, as internal names.

The store is built and held by the engine (dpsql.engine.prepared, dpsql.engine.spark_store);
its layout is a value the plans over it read (dpsql.lower.prepared_plan), so it lives here,
before the engine in the query's flow (tests/test_layering.py), and holds no data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoreInfo:
    """What the compiler may use of one table's store (internal names only, no data)."""

    table: str
    version: str
    key: str
    catalog: str | None  # the attached database of a disk store, None in memory
    relation: str
    unit_rows: str | None
    pair_rows: Mapping[str, str]  # column -> rows in (unit, value)
    unit_keys: Mapping[str, str]  # column -> distinct values in the unit
    fixed: Mapping[str, tuple[int, int, str]]  # column -> (lo, hi, fixed-point column)
    hash_mix: str | None
    # "" (per unit) or a pair column -> relation of per-(unit[, value]) partials: __u, [__k,]
    # __n and, per fixed-point column, (sum, sum of squares, count) named in partial_columns
    partials: Mapping[str, str] = field(default_factory=dict)
    partial_columns: Mapping[str, tuple[str, str, str]] = field(default_factory=dict)
    # operator-facing only (dpsql prepare): never read by a plan
    rows: int = 0
    build_seconds: float = 0.0
    bytes: int = 0
    path: str | None = None
    reused: bool = False
    ranges: Mapping[str, tuple[Any, Any]] = field(default_factory=dict, compare=False, repr=False)
