"""Data versions: what every cache key names, so that no answer outlives its data.

A plan's fingerprint, and with it the key of every cached answer, includes the data version of
each table it reads (``Service.data_version``). A version must therefore change whenever what
the engine would read changes:

- **CSV** sources are read once, at connect, into a table: their version is fixed for the
  process, ``sha256(content)@mtime_ns:size`` of the file as loaded.
- **Parquet** sources are views, read again by every query: the file can be replaced while the
  service runs. Its identity (mtime in ns, size) is checked on every read of the version — a
  ``stat``, a few microseconds — and when it changed the file is hashed again and the version
  becomes the new ``sha256@mtime_ns:size``. A replaced file therefore never replays an answer
  cached for the old one: the plan cache drops the stale plan, and the new plan's fingerprint
  names no cached answer.
- **Attached DuckDB tables** (``--database``): the database is attached read-only, so it cannot
  change while the process runs; across a restart it can. Their version is the identity of the
  database file (and its ``.wal``: DuckDB writes the file on every checkpoint, so any change
  moves its mtime) with a digest of the table's storage metadata read at connect (its row
  count and, per column segment of each row group, its position, row count, compression,
  block and min/max statistics: ``pragma_storage_info``), which reads no row: milliseconds at
  10M rows where a digest of the rows took ~2 s of CPU and a full read (issue 28). A changed
  row that left the file's identity alone (a copy restoring its mtime) still changes its
  segment's block or statistics, unless it changed nothing those record.
- **Globs** of local files (``data/part-*.parquet``) are expanded once, at connect; files
  added or removed later are seen at the next start. Their version is a digest over the
  sorted list's (path, size, mtime in ns, SHA-256 of the content): ``glob:N:sha256``. A CSV
  glob is loaded into a table and keeps its version; a Parquet glob is a view over the listed
  files, each of whose identity is checked on every read of the version, as for one file.
- **PostgreSQL tables** are read at connect (one read-only snapshot) into a table; their
  version is ``pg:`` and a digest of the location and of the loaded rows (row count and two
  order-independent sums of row hashes), computed at connect: it changes when any row of the
  declared columns changes, and is fixed until the next start (docs/sources.md).
- A **declared** ``version`` in the policy is used as it is: the operator's word that the data
  is the same (no file is checked).

What the analyst learns (docs/threat_model.md, "Data versions"): whether an answer is
replayed or fresh tells them whether the version changed since it was cached. The version
changes when the operator (or their pipeline) *writes* the source — its mtime moves even when
the bytes are the same — so the bit is the operator's act, not a function of anyone's rows.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The version of a watched file that cannot be read right now (being replaced, removed).
UNAVAILABLE = "unavailable"


def identity(path: Path | str) -> tuple[int, int] | None:
    """(mtime in ns, size) of ``path``, or None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def file_digest(path: Path | str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_version(path: Path | str, ident: tuple[int, int] | None = None) -> str:
    """``sha256(content)@mtime_ns:size``: a rewrite is a new version even with the same bytes
    (the replay decision follows the operator's writes, not the rows: module docstring)."""
    ident = identity(path) if ident is None else ident
    if ident is None:
        return UNAVAILABLE
    try:
        content = file_digest(path)
    except OSError:
        return UNAVAILABLE
    return f"{content}@{ident[0]}:{ident[1]}"


def files_version(paths: Sequence[Path], idents: Sequence[tuple[int, int] | None]) -> str:
    """A glob's version: a digest over the sorted list of (path, size, mtime in ns, SHA-256 of
    the content); a file added, removed, rewritten or touched changes it."""
    digest = hashlib.sha256()
    for path, ident in sorted(zip(paths, idents, strict=True)):
        if ident is None:
            return UNAVAILABLE
        try:
            content = file_digest(path)
        except OSError:
            return UNAVAILABLE
        digest.update(repr((str(path), ident[1], ident[0], content)).encode())
    return f"glob:{len(paths)}:{digest.hexdigest()}"


def database_identity(database: str) -> str:
    """The identity of a DuckDB database file and its write-ahead log (if any)."""
    parts = []
    for path in (database, database + ".wal"):
        ident = identity(path)
        if ident is not None:
            parts.append(f"{Path(path).name}@{ident[0]}:{ident[1]}")
    return ",".join(parts)


def table_digest_sql(relation: str, columns: Sequence[str]) -> str:
    """One query over ``relation`` (quoted) giving its row count and two order-independent sums
    of the hash of each row's ``columns`` (quoted): a digest of the table's content."""
    row = f"hash({', '.join(columns)})"
    return (
        f"SELECT count(*), CAST(bit_xor({row}) AS VARCHAR), "
        f"CAST(sum(CAST({row} AS HUGEINT)) AS VARCHAR) FROM {relation}"
    )


def storage_digest_sql(relation: str, name: str) -> str:
    """One query giving an attached table's row count and a digest of its storage metadata
    (module docstring): ``relation`` is the quoted ``catalog.table``, ``name`` the same as a
    SQL string (pragma_storage_info's argument). Reads metadata only, never a row."""
    fields = (
        "row_group_id, column_id, column_path, segment_id, segment_type, start, count, "
        "compression, stats, has_updates, persistent, block_id, block_offset, "
        "additional_block_ids"
    )
    return (
        f"SELECT (SELECT count(*) FROM {relation}), md5(string_agg(concat_ws(',', {fields}), "
        f"';' ORDER BY row_group_id, column_id, column_path, segment_id, start)) "
        f"FROM pragma_storage_info({name})"
    )


def table_version(database: str, digest_row: Sequence[object]) -> str:
    """An attached table's version from its database's identity and its digest row."""
    text = repr((database_identity(database), tuple(str(v) for v in digest_row)))
    return "db:" + hashlib.sha256(text.encode()).hexdigest()


class SourceVersions(dict[str, str]):
    """table name -> data version; a watched (lazily read) file is re-checked on each read.

    ``get`` and ``[]`` stat each watched file (or each file of a watched glob) and, when an
    identity moved, hash again and update the version (under a lock: one thread hashes, the
    others wait for its result). Assigning a version (tests, the Spark engine) replaces it
    until a file moves again.
    """

    def __init__(self) -> None:
        super().__init__()
        # name -> (its files, their identities when hashed, whether it is a glob's list)
        self._watched: dict[str, tuple[tuple[Path, ...], tuple[Any, ...], bool]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _version(paths: tuple[Path, ...], idents: tuple[Any, ...], many: bool) -> str:
        if many:
            return files_version(paths, idents)
        return file_version(paths[0], idents[0]) if idents[0] is not None else UNAVAILABLE

    def watch(self, name: str, path: Path) -> str:
        """Version ``name`` by the file at ``path`` from now on; returns its version."""
        return self._watch(name, (path,), many=False)

    def watch_files(self, name: str, paths: Sequence[Path]) -> str:
        """Version ``name`` by a glob's files (:func:`files_version`); returns its version."""
        return self._watch(name, tuple(paths), many=True)

    def _watch(self, name: str, paths: tuple[Path, ...], *, many: bool) -> str:
        idents = tuple(identity(p) for p in paths)
        version = self._version(paths, idents, many)
        with self._lock:
            self._watched[name] = (paths, idents, many)
            super().__setitem__(name, version)
        return version

    def _refresh(self, name: str) -> None:
        watched = self._watched.get(name)
        if watched is None:
            return
        paths, known, many = watched
        if tuple(identity(p) for p in paths) == known:
            return
        with self._lock:
            paths, known, many = self._watched[name]
            idents = tuple(identity(p) for p in paths)
            if idents == known:
                return  # another thread hashed it meanwhile
            version = self._version(paths, idents, many)
            if version != UNAVAILABLE and tuple(identity(p) for p in paths) != idents:
                version = UNAVAILABLE  # still being written: hash it again next time
                idents = (None,) * len(paths)
            self._watched[name] = (paths, idents, many)
            super().__setitem__(name, version)

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        self._refresh(name)
        return super().get(name, default)

    def __getitem__(self, name: str) -> str:
        self._refresh(name)
        return super().__getitem__(name)
