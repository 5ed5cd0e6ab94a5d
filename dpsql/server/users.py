"""The analysts who may log in to ``dpsql serve``: a JSON file of SCRAM verifiers.

The file sits next to the policy as ``<policy stem>.users.json`` (mode 0600, replaced
atomically on every change) and holds only salted SCRAM-SHA-256 verifiers, never passwords.
Each user name is also the analyst name charged in the budget ledger.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from dpsql.server.scram import Verifier, make_verifier

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.@-]{0,62}$")


class UserStoreError(Exception):
    pass


def users_path(policy_path: str | Path) -> Path:
    policy = Path(policy_path)
    return policy.with_name(f"{policy.stem}.users.json")


def validate_name(name: str) -> str:
    if not _NAME.match(name):
        raise UserStoreError(
            f"invalid user name {name!r}: use letters, digits, '_', '.', '@' or '-' "
            "(first a letter or '_', at most 63 characters)"
        )
    return name


class UserStore:
    """Read on each lookup (so ``dpsql user add`` takes effect without a restart)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _load(self) -> dict[str, dict[str, object]]:
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UserStoreError(
                f"users file {str(self.path)!r} is not valid JSON: {exc}"
            ) from None
        users = data.get("users", {}) if isinstance(data, dict) else None
        if not isinstance(users, dict):
            raise UserStoreError(f"users file {str(self.path)!r} has no 'users' object")
        return users

    def _save(self, users: dict[str, dict[str, object]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"version": 1, "users": users}, fh, indent=2, sort_keys=True)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, name: str) -> Verifier | None:
        entry = self._load().get(name)
        if entry is None:
            return None
        try:
            return Verifier.from_dict(entry)
        except (KeyError, ValueError, TypeError):
            return None

    def names(self) -> list[str]:
        return sorted(self._load())

    def add(self, name: str, password: str, *, replace: bool = False) -> None:
        validate_name(name)
        if not password:
            raise UserStoreError("empty password")
        users = self._load()
        if name in users and not replace:
            raise UserStoreError(f"user {name!r} already exists (use --replace to change it)")
        users[name] = make_verifier(password).to_dict()
        self._save(users)

    def remove(self, name: str) -> None:
        users = self._load()
        if name not in users:
            raise UserStoreError(f"no user {name!r}")
        del users[name]
        self._save(users)
