"""Files of the prepared store on disk: private, and never left behind by a killed build.

A disk store (dpsql.engine.prepared, dpsql.engine.spark_store) is a copy of the private rows.
So is every half-written file of a build. The rules here:

- the store directory is owner-only (0700) whatever the umask: created so, and an existing one
  that holds nothing but store files is tightened (one holding other files is left as the
  operator made it, with a warning in the log);
- a build writes inside a private scratch directory ``.build-<random>`` (0700) in the store
  directory, and the finished file or Parquet directory (0600 files, 0700 directories) is
  renamed into place from there;
- every build holds a shared ``flock`` on ``.builds.lock`` while it runs. At start-up (before
  a store is built or reused) whatever a killed build left (``.build-*`` directories, and the
  ``<store>.<pid>.<thread>.tmp`` files of earlier versions) is removed, under the exclusive
  lock: only when no build of any process is running, so a concurrent build is never touched;
- DuckDB spills (its ``temp_directory``, ``.tmp`` in the current directory by default) go to a
  private ``.spill-*`` directory there, locked by its process while it lives; those of dead
  processes are removed at start-up too.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import stat
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("dpsql.store")

BUILD_PREFIX = ".build-"
SPILL_PREFIX = ".spill-"
# The spill directory of each DuckDB connection of this process: its lock stays held until
# the connection is collected (or the process exits), then the directory is removed.
_SPILLS: weakref.WeakKeyDictionary[Any, Path] = weakref.WeakKeyDictionary()
LOCK_NAME = ".builds.lock"
# Names a store directory holds: stores, build scratch, the lock, leftovers of old versions.
_STORE_SUFFIXES = (".duckdb", ".duckdb.wal", ".spark.parquet", ".tmp")


def private_directory(directory: Path) -> None:
    """Create ``directory`` (and missing parents) owner-only (0700) whatever the umask; an
    existing one is tightened when it holds only store files."""
    missing: list[Path] = []
    probe = directory
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
            os.chmod(path, 0o700)  # mkdir's mode is masked by the umask
    if missing:
        return
    mode = stat.S_IMODE(directory.stat().st_mode)
    if not mode & 0o077:
        return
    if all(_is_store_entry(p.name) for p in directory.iterdir()):
        try:
            os.chmod(directory, 0o700)
            log.warning(
                "the prepared-store directory %s was accessible to other users (mode %04o); "
                "made it private (0700)",
                directory,
                mode,
            )
            return
        except OSError:
            pass
    log.warning(
        "the prepared-store directory %s is accessible to other users (mode %04o); its "
        "stores are private files (0600), but use a directory of its own, mode 0700",
        directory,
        mode,
    )


def _is_store_entry(name: str) -> bool:
    return (
        name.startswith((BUILD_PREFIX, SPILL_PREFIX))
        or name == LOCK_NAME
        or name.endswith(_STORE_SUFFIXES)
    )


def private_spill(con: Any, directory: Path) -> Path | None:
    """Point DuckDB's spill files (its ``temp_directory``, by default ``.tmp`` in the current
    directory, with the umask's mode) at a private (0700) ``.spill-*`` directory in the store
    directory: a store build out of core spills copies of the private rows, and a killed
    process leaves them. The directory is locked for the life of the process; the start-up
    clean-up removes those of dead processes. None when DuckDB already used its directory."""
    if con in _SPILLS:
        return _SPILLS[con]
    area = directory / f"{SPILL_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    area.mkdir(mode=0o700)
    os.chmod(area, 0o700)
    fd = os.open(area / ".owner.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        con.execute(f"SET temp_directory = '{str(area).replace(chr(39), chr(39) * 2)}'")
    except Exception:  # already used: keep DuckDB's own
        os.close(fd)
        shutil.rmtree(area, ignore_errors=True)
        return None
    _SPILLS[con] = area
    weakref.finalize(con, _release_spill, area, fd)
    return area


def _release_spill(area: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
    shutil.rmtree(area, ignore_errors=True)


def _spill_in_use(path: Path) -> bool:
    """A spill directory whose owner process still runs (it holds the lock)."""
    try:
        fd = os.open(path / ".owner.lock", os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _lock_file(directory: Path) -> int:
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o600)
    return fd


def clean_interrupted(directory: Path) -> list[Path]:
    """Remove what killed builds left in ``directory`` (none is running: the exclusive lock);
    returns what was removed. Skipped, to be done at the next start, while a build runs."""
    if not directory.is_dir():
        return []
    leftovers = [
        p
        for p in directory.iterdir()
        if p.name.startswith(BUILD_PREFIX)
        or (p.name.endswith(".tmp") and p.name != ".tmp")
        or (p.name.startswith(SPILL_PREFIX) and not _spill_in_use(p))
    ]
    if not leftovers:
        return []
    try:
        fd = _lock_file(directory)
    except OSError:
        return []
    removed: list[Path] = []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []  # a build is running: leave everything to the next start
        for path in leftovers:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
            if not os.path.lexists(path):
                removed.append(path)
    finally:
        os.close(fd)  # releases the lock
    if removed:
        log.warning(
            "removed %d leftover(s) of interrupted prepared-store builds in %s: %s",
            len(removed),
            directory,
            ", ".join(p.name for p in removed),
        )
    return removed


@contextlib.contextmanager
def build_area(directory: Path) -> Iterator[Path]:
    """A private (0700) scratch directory in ``directory`` for one build, removed afterwards;
    the build holds the shared lock, so no start-up clean-up removes it meanwhile."""
    fd = _lock_file(directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        area = directory / f"{BUILD_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        area.mkdir(mode=0o700)
        try:
            os.chmod(area, 0o700)
            yield area
        finally:
            shutil.rmtree(area, ignore_errors=True)
    finally:
        os.close(fd)


def owner_only(path: Path) -> None:
    """A finished store (a file, or a directory of files): 0600 files, 0700 directories."""
    if not path.is_dir():
        os.chmod(path, 0o600)
        return
    os.chmod(path, 0o700)
    for item in path.rglob("*"):
        os.chmod(item, 0o700 if item.is_dir() else 0o600)
