"""Source kinds beyond one local file: globs of local files, PostgreSQL tables, remote paths.

A policy table's ``source`` is one of (docs/sources.md has each kind and its data version):

- a CSV / Parquet file relative to the policy file (``visits.csv``);
- a **glob** of such files (``data/part-*.parquet``): expanded once at connect, in sorted order;
- a **PostgreSQL table** (``postgresql://user@host:port/db?table=schema.name``): read at
  connect, in one read-only snapshot, into the engine (the engine is sealed after loading, so
  nothing is read live);
- a **remote path** (``s3://…``, ``https://…``): read by DuckDB's httpfs extension at connect
  where that extension is installed, refused otherwise;
- a table of the DuckDB database given to ``connect(database=...)``.

Nothing here echoes a password: a PostgreSQL source may not carry one inline (libpq reads
``PGPASSWORD`` or a passfile, or ``password_env=NAME`` names an environment variable), and
messages show :func:`display_source`, which keeps only the host, port, database and table.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

POSTGRES_SCHEMES = ("postgresql", "postgres")
#: Schemes DuckDB reads through its httpfs extension.
REMOTE_SCHEMES = ("s3", "s3a", "s3n", "gs", "gcs", "r2", "http", "https")
_GLOB_CHARS = ("*", "?", "[")
#: Query keys of a PostgreSQL source that dpsql reads itself (the rest go to libpq).
_OWN_KEYS = ("table", "password_env")


def _scheme(source: str) -> str:
    head, sep, _ = source.partition("://")
    return head.lower() if sep else ""


def is_postgres(source: str) -> bool:
    return _scheme(source) in POSTGRES_SCHEMES


def is_remote(source: str) -> bool:
    return _scheme(source) in REMOTE_SCHEMES


def is_glob(source: str | Path) -> bool:
    return any(c in str(source) for c in _GLOB_CHARS)


def glob_files(pattern: Path | str) -> list[Path]:
    """The regular files matching ``pattern`` (``**`` spans directories), sorted by path."""
    return sorted(Path(p) for p in glob.glob(str(pattern), recursive=True) if Path(p).is_file())


@dataclass(frozen=True)
class PostgresSource:
    """A parsed ``postgresql://`` source. ``conninfo`` (the URI for libpq without dpsql's own
    keys) may name the user; it is passed to the driver and never shown."""

    conninfo: str
    schema: str | None
    table: str
    password_env: str | None
    display: str

    def qualified(self) -> tuple[str, ...]:
        return (self.schema, self.table) if self.schema else (self.table,)


class SourceSyntaxError(ValueError):
    """A source string that cannot be used; the message never quotes the source."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


_EXAMPLE = 'source = "postgresql://dpsql@127.0.0.1:5432/clinic?table=public.visits"'


def parse_postgres(source: str) -> PostgresSource:
    """Split a ``postgresql://`` source into what libpq reads and what dpsql reads."""
    try:
        parts = urlsplit(source)
        port = parts.port
        password = parts.password
    except ValueError:
        raise SourceSyntaxError("not a valid postgresql:// URL", _EXAMPLE) from None
    query = parse_qsl(parts.query, keep_blank_values=True)
    keys = [k for k, _ in query]
    if password is not None or "password" in keys:
        raise SourceSyntaxError(
            "a PostgreSQL source may not carry its password (the policy is not a secret store)",
            "remove it from the URL; set PGPASSWORD or a passfile (~/.pgpass), or add "
            "password_env=NAME to the URL to read it from the environment variable NAME",
        )
    own = {k: v for k, v in query if k in _OWN_KEYS}
    if keys.count("table") != 1 or not own.get("table"):
        raise SourceSyntaxError(
            "a PostgreSQL source names its table once, as ?table=schema.name", _EXAMPLE
        )
    names = own["table"].split(".")
    if len(names) > 2 or not all(names):
        raise SourceSyntaxError(
            "table= must be a table name or schema.name", 'e.g. "?table=public.visits"'
        )
    schema, table = (names[0], names[1]) if len(names) == 2 else (None, names[0])
    env = own.get("password_env")
    if env is not None and not env.replace("_", "").isalnum():
        raise SourceSyntaxError(
            "password_env must name an environment variable", 'e.g. "&password_env=PG_PASSWORD"'
        )
    database = unquote(parts.path.lstrip("/"))
    rest = urlencode([(k, v) for k, v in query if k not in _OWN_KEYS])
    conninfo = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, ""))
    host = parts.hostname or "localhost"
    where = f"{host}:{port}" if port else host
    display = f"postgresql://{where}/{database} table {'.'.join(names)}"
    return PostgresSource(conninfo, schema, table, env, display)


def display_source(source: str) -> str:
    """The source as messages may show it: a PostgreSQL URL without its user or options."""
    if is_postgres(source):
        try:
            return parse_postgres(source).display
        except SourceSyntaxError:
            return "a postgresql:// source"
    return source
