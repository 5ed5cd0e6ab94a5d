"""Reading a policy table's source as the engine reads it: a CSV file (all text, cast to the
declared types once), a Parquet file or a table of a DuckDB database file (native types, cast
when read)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb

from dpsql.policy import FILE_SUFFIXES


class SourceError(Exception):
    """A source that cannot be opened, with what to do."""


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class Source:
    """One table's data: ``path`` (CSV/Parquet) or ``table`` in ``database``."""

    path: Path | None = None
    table: str | None = None
    database: Path | None = None

    @property
    def kind(self) -> str:
        if self.path is None:
            return "table"
        return "parquet" if self.path.name.lower().endswith(".parquet") else "csv"

    def describe(self) -> str:
        if self.path is not None:
            return f"{self.kind.upper() if self.kind == 'csv' else 'Parquet'} file {self.path}"
        return f"table {self.table!r} of the DuckDB database {self.database}"

    def relation(self, *, as_engine: bool = False) -> str:
        """The FROM item. ``as_engine``: a CSV read all as text, as the engine reads it before
        casting to the declared types; otherwise with DuckDB's detected types."""
        if self.path is None:
            return f"src.{quote_ident(self.table or '')}"
        path = sql_string(str(self.path))
        if self.kind == "parquet":
            return f"read_parquet({path})"
        if as_engine:
            return f"read_csv({path}, header = true, all_varchar = true, auto_detect = true)"
        return f"read_csv({path}, header = true, auto_detect = true)"

    def connect(self) -> duckdb.DuckDBPyConnection:
        """A private in-memory connection (the database file attached read-only as src)."""
        con = duckdb.connect(":memory:")
        try:
            if self.path is not None:
                if not self.path.is_file():
                    raise SourceError(f"{self.path}: no such file")
            else:
                if self.database is None or not self.database.is_file():
                    raise SourceError(f"database {self.database}: no such file")
                con.execute(f"ATTACH {sql_string(str(self.database))} AS src (READ_ONLY)")
                found = con.execute(
                    "SELECT count(*) FROM duckdb_tables() WHERE database_name = 'src' "
                    "AND lower(table_name) = lower(?)",
                    [self.table],
                ).fetchone()
                if not found or not found[0]:
                    raise SourceError(f"table {self.table!r} not found in {self.database}")
        except BaseException:
            con.close()
            raise
        return con


def file_source(path: str | Path) -> Source:
    p = Path(path)
    if not p.name.lower().rstrip("/").endswith(FILE_SUFFIXES):
        raise SourceError(
            f"{p}: not a CSV/Parquet file (its name ends in none of {', '.join(FILE_SUFFIXES)}); "
            "for a DuckDB table give --database FILE --table NAME"
        )
    return Source(path=p.resolve())


def duckdb_type_family(sql_type: str) -> str | None:
    """A DuckDB type as a policy column type, or None where the policy has none."""
    t = sql_type.upper()
    ints = ("BIGINT", "INTEGER", "SMALLINT", "TINYINT", "HUGEINT")
    if t in ints or (t.startswith("U") and t[1:] in ints):
        return "int"
    if t in ("DOUBLE", "FLOAT", "REAL") or t.startswith("DECIMAL"):
        return "float"
    if t == "VARCHAR" or t == "UUID":
        return "text"
    if t == "BOOLEAN":
        return "bool"
    if t == "DATE" or t.startswith("TIMESTAMP"):
        return "date"
    return None
