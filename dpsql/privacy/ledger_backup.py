"""Backing up and restoring the budget ledger: consistent copies, checked before they count.

Why not ``cp``: a live ledger's newest charges are in its ``-wal`` file (docs/ledger.md).
A backup is SQLite's online backup of one consistent snapshot, verified, written privately
(0600) and linked into place; a restore verifies the copy before it replaces anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import secrets
import sqlite3
import warnings
from pathlib import Path

from dpsql.errors import LedgerUnavailableError
from dpsql.privacy.ledger_file import (
    LedgerPermissionWarning,
    file_size,
    fsync_path,
    log,
    private_new_file,
)
from dpsql.privacy.sqlite_ledger import SQLiteLedger


@dataclasses.dataclass(frozen=True)
class LedgerCopy:
    """What a backup or restore copied: the log rows, totals and cached answers."""

    path: Path
    log_rows: int
    last_id: int
    totals: int
    answers: int


def _counts(conn: sqlite3.Connection, path: Path) -> LedgerCopy:
    log_rows, last_id = conn.execute(
        "SELECT COUNT(*), COALESCE(MAX(id), 0) FROM charge_log"
    ).fetchone()
    totals = conn.execute("SELECT COUNT(*) FROM totals").fetchone()[0]
    answers = conn.execute("SELECT COUNT(*) FROM answers").fetchone()[0]
    return LedgerCopy(path, log_rows, last_id, totals, answers)


def _copy_error(what: str, path: Path, cause: object, hint: str) -> LedgerUnavailableError:
    log.error("%s %s: %s", what, path, cause)
    return LedgerUnavailableError(f"{what} {str(path)!r}: {cause}", construct="ledger", hint=hint)


def _snapshot(source: sqlite3.Connection, dest: Path) -> None:
    """SQLite's online backup of ``source`` into a new private (0600) file ``dest``.

    One step (``pages=-1``) inside one read transaction: a consistent snapshot of the ledger,
    its ``-wal`` included, while other processes keep charging (WAL readers block no one)."""
    private_new_file(dest)
    target = sqlite3.connect(dest, isolation_level=None)
    try:
        source.backup(target, pages=-1)
    finally:
        target.close()
    fsync_path(dest)


def _checked(path: Path) -> tuple[list[str], LedgerCopy]:
    """Open a copy as a ledger (refusing what is not one), verify it, count its rows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerPermissionWarning)
        copy = SQLiteLedger(path)
    with copy:
        problems = copy.verify()
        with copy._read() as conn:
            counts = _counts(conn, path)
    return problems, counts


def _scratch_name(near: Path, what: str) -> Path:
    return near.with_name(f".{near.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}")


def _remove_copy(path: Path) -> None:
    for name in (str(path), f"{path}-wal", f"{path}-shm", f"{path}-journal"):
        with contextlib.suppress(OSError):
            os.unlink(name)


def backup_ledger(
    ledger: str | os.PathLike[str], dest: str | os.PathLike[str], *, force: bool = False
) -> LedgerCopy:
    """Copy a (possibly live) ledger to ``dest`` with SQLite's online backup API, verified.

    Copying the file with ``cp`` is not a backup: the newest charges live in its ``-wal``
    file until a checkpoint, and a copy without it loses them. The backup reads one
    consistent snapshot through SQLite (``-wal`` included) while writers go on, writes it to a
    private scratch file beside ``dest``, verifies it (integrity, totals = the log's sums) and
    renames it into place. ``dest`` must not exist unless ``force``.
    """
    source_path, dest = Path(ledger), Path(dest)
    if not source_path.exists():
        raise _copy_error(
            "no budget ledger at", source_path, "nothing to back up", "check the policy's ledger"
        )
    if os.path.lexists(dest) and not force:
        raise LedgerUnavailableError(
            f"the backup destination {str(dest)!r} exists",
            construct="ledger",
            hint="choose a new file name, or pass --force to replace it",
        )
    if Path(f"{dest}-wal").exists():
        raise LedgerUnavailableError(
            f"the backup destination {str(dest)!r} has a -wal file: it is a live ledger",
            construct="ledger",
            hint="back up to a file no dpsql process uses",
        )
    scratch = _scratch_name(dest, "backup")
    try:
        with SQLiteLedger(source_path) as live:
            try:
                with live._read() as conn:
                    _snapshot(conn, scratch)
            except (OSError, sqlite3.Error) as exc:
                raise _copy_error(
                    "cannot write the backup",
                    dest,
                    exc.strerror if isinstance(exc, OSError) else exc,
                    "check that the destination's directory exists and has free space",
                ) from None
        problems, counts = _checked(scratch)
        if problems:
            raise _copy_error(
                "the backup of",
                source_path,
                "; ".join(problems[:3]),
                "run dpsql budget verify on the ledger",
            )
        os.replace(scratch, dest)
        fsync_path(dest.parent)
    finally:
        _remove_copy(scratch)
    return dataclasses.replace(counts, path=dest)


def restore_ledger(
    backup: str | os.PathLike[str], ledger: str | os.PathLike[str], *, force: bool = False
) -> tuple[LedgerCopy, int]:
    """Restore ``ledger`` from a backup; returns what was restored and how many log rows of
    the ledger it replaced are not in the backup (charges that are forgotten: budget given
    back). The backup is copied (online backup API) to a private scratch file and verified
    before anything is touched.

    - No ledger there: the verified copy is linked into place (an orphaned ``-wal`` left by
      a lost ledger is refused, or moved aside with ``force``).
    - A ledger there: refused without ``force``. With it, a readable ledger is overwritten
      through SQLite's backup API *into* it (safe while dpsql processes have it open: they
      see the restored state at their next transaction); a file that is not a ledger (empty,
      damaged) is moved aside to ``<name>.replaced-<time>`` with its side files, never
      deleted.
    """
    backup_path, target = Path(backup), Path(ledger)
    if not backup_path.is_file() or backup_path.stat().st_size == 0:
        raise _copy_error(
            "no backup at", backup_path, "missing or empty", "name a file dpsql budget backup wrote"
        )
    scratch = _scratch_name(target, "restore")
    try:
        try:
            source = sqlite3.connect(f"file:{backup_path}?mode=ro", uri=True)
            try:
                _snapshot(source, scratch)
            finally:
                source.close()
        except (OSError, sqlite3.Error) as exc:
            raise _copy_error(
                "cannot read the backup",
                backup_path,
                exc.strerror if isinstance(exc, OSError) else exc,
                "name a file dpsql budget backup wrote, readable by this user",
            ) from None
        problems, counts = _checked(scratch)  # refuses a file that is not a ledger
        if problems:
            raise _copy_error(
                "the backup",
                backup_path,
                "is not consistent: " + "; ".join(problems[:3]),
                "use another backup",
            )
        forgotten = 0
        if not os.path.lexists(target):
            if file_size(Path(f"{target}-wal")) > 0:
                if not force:
                    raise LedgerUnavailableError(
                        f"the ledger {str(target)!r} is missing but its -wal file is there "
                        "(it holds the newest charges of the lost ledger)",
                        construct="ledger",
                        hint="put the ledger back next to it, or pass --force to move the "
                        "-wal aside and restore the backup",
                    )
                _move_aside(target)
            os.link(scratch, target)
            fsync_path(target.parent)
        else:
            if not force:
                raise LedgerUnavailableError(
                    f"the ledger {str(target)!r} exists; restoring would replace it",
                    construct="ledger",
                    hint="pass --force to replace it (charges it has that the backup lacks "
                    "are forgotten), or restore to another path",
                )
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", LedgerPermissionWarning)
                    live: SQLiteLedger | None = SQLiteLedger(target)
            except LedgerUnavailableError:
                live = None  # empty, damaged, not a ledger: moved aside below
            if live is None:
                _move_aside(target)
                os.link(scratch, target)
                fsync_path(target.parent)
            else:
                with live:
                    with live._read() as conn:
                        forgotten = conn.execute(
                            "SELECT COUNT(*) FROM charge_log WHERE id > ?", (counts.last_id,)
                        ).fetchone()[0]
                    source = sqlite3.connect(scratch)
                    try:
                        with live._write_lock:
                            source.backup(live._conn(), pages=-1)
                    except sqlite3.Error as exc:
                        raise live._error(exc) from None
                    finally:
                        source.close()
        problems, restored = _checked(target)
        if problems:
            raise _copy_error(
                "the restored ledger", target, "; ".join(problems[:3]), "restore again"
            )
        log.warning(
            "budget ledger %s restored from %s (%d log rows; %d newer rows forgotten)",
            target,
            backup_path,
            restored.log_rows,
            forgotten,
        )
        return restored, forgotten
    finally:
        _remove_copy(scratch)


def _move_aside(path: Path) -> None:
    """Rename a ledger file that cannot be used, and its side files, out of the way."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
    for side in ("", "-wal", "-shm"):
        name = Path(f"{path}{side}")
        if os.path.lexists(name):
            os.rename(name, Path(f"{path}.replaced-{stamp}{side}"))
