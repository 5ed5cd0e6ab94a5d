"""The small interface every private engine satisfies (DuckDB embedded, Spark for scale).

An engine loads the policy's sources with the declared column types, then only ever runs SQL
that dpsql compiled from a validated plan, and hands back *exact* aggregates as Python ints.
It holds no privacy logic: bounding, clamping, fixed point and keyed-hash selection are all in
the compiled SQL; noise is drawn in Python after the engine returns.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np
from sqlglot import exp

from dpsql.engine.api import EngineResult, QueryHandle
from dpsql.engine.duckdb_engine import DuckDBEngine
from dpsql.errors import ProgrammingError
from dpsql.lower.compile import CompiledQuery
from dpsql.policy import Policy

ENGINES = ("duckdb", "spark")


@runtime_checkable
class Engine(Protocol):
    """What the pipeline needs from an engine."""

    name: str
    dialect: str  # sqlglot dialect the compiled plan is rendered in
    versions: dict[str, str]  # table -> data version (part of every cache key)

    def execute(self, compiled: CompiledQuery, handle: QueryHandle | None = None) -> EngineResult:
        """Exact bounded aggregates of one compiled plan; raises dpsql.errors on failure."""
        ...

    def fetch_matrix(self, query: exp.Expression, handle: QueryHandle | None = None) -> np.ndarray:
        """Integer rows of a generated row-input query (dpsql.lower.rows: dp_rule_list's
        pattern counts, the regressions' bounded rows), a tree with its secret printed,
        rendered here in the engine's dialect."""
        ...

    def close(self) -> None: ...


__all__ = ["ENGINES", "Engine", "EngineResult", "QueryHandle", "open_engine"]


def open_engine(
    policy: Policy,
    database: str = ":memory:",
    name: str | None = None,
    spark_session: Any = None,
) -> Engine:
    """The engine the caller asked for, else the policy's ``[engine] name`` (default DuckDB)."""
    chosen = name or ("spark" if spark_session is not None else policy.engine.name)
    if chosen not in ENGINES:
        raise ProgrammingError(
            f"unknown engine {chosen!r}", construct="engine", hint='use "duckdb" or "spark"'
        )
    if chosen == "spark":
        if database not in (":memory:", "", None):
            raise ProgrammingError(
                "database= names a DuckDB file, which the Spark engine does not read",
                construct="database",
                hint="declare Spark sources in the policy (catalog tables or Parquet/CSV paths)",
            )
        from dpsql.engine.spark_engine import SparkEngine

        return SparkEngine(policy, spark_session)
    if spark_session is not None:
        raise ProgrammingError(
            "spark_session= was given but the engine is duckdb",
            construct="engine",
            hint='pass engine="spark" (or drop spark_session)',
        )
    return DuckDBEngine(policy, database)
