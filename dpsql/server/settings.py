"""Ordinary PostgreSQL session settings (SET / SHOW / RESET) kept per connection.

Clients set these on connect (application_name, extra_float_digits, DateStyle...). They change
nothing about privacy; dpsql's own settings (epsilon, delta, mechanism) are forwarded to the
dpsql connection instead. Values the server cannot honour (a non-UTF8 client encoding, a
non-ISO DateStyle, standard_conforming_strings off) are refused rather than silently ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dpsql.server.catalog_sql import SERVER_VERSION
from dpsql.server.failures import ClientError

# Canonical spellings of the parameters reported in ParameterStatus (PostgreSQL's GUC_REPORT).
REPORTED = (
    "application_name",
    "client_encoding",
    "DateStyle",
    "default_transaction_read_only",
    "in_hot_standby",
    "integer_datetimes",
    "IntervalStyle",
    "is_superuser",
    "server_encoding",
    "server_version",
    "session_authorization",
    "standard_conforming_strings",
    "TimeZone",
)

DEFAULTS = {
    "application_name": "",
    "client_encoding": "UTF8",
    "DateStyle": "ISO, MDY",
    "default_transaction_read_only": "on",
    "in_hot_standby": "off",
    "integer_datetimes": "on",
    "IntervalStyle": "postgres",
    "is_superuser": "off",
    "server_encoding": "UTF8",
    "server_version": f"{SERVER_VERSION} (dpsql)",
    "server_version_num": "160000",
    "standard_conforming_strings": "on",
    "TimeZone": "UTC",
    "extra_float_digits": "1",
    "search_path": '"$user", public',
    "max_identifier_length": "63",
    "max_index_keys": "32",
    "default_table_access_method": "heap",
    "max_function_args": "100",
    "data_directory_mode": "0700",
    "transaction_isolation": "read committed",
    "default_transaction_isolation": "read committed",
    "transaction_read_only": "on",
    "statement_timeout": "0",
    "lock_timeout": "0",
    "idle_in_transaction_session_timeout": "0",
    "lc_collate": "C.UTF-8",
    "lc_ctype": "C.UTF-8",
    "lc_messages": "C",
    "lc_monetary": "C",
    "lc_numeric": "C",
    "lc_time": "C",
    "bytea_output": "hex",
    "client_min_messages": "notice",
    "max_connections": "100",
    "block_size": "8192",
    "default_text_search_config": "pg_catalog.english",
    "jit": "off",
    "row_security": "on",
    "timezone_abbreviations": "Default",
    "datestyle": "ISO, MDY",
}
DEFAULTS.pop("datestyle")

_CANONICAL = {k.lower(): k for k in DEFAULTS}
# Other PostgreSQL settings clients send; accepted (they change nothing here) so tools connect,
# while a misspelt name such as "epsilonn" is refused instead of silently ignored.
_ACCEPTED = {
    "work_mem", "maintenance_work_mem", "temp_buffers", "effective_cache_size",
    "random_page_cost", "seq_page_cost", "geqo", "synchronous_commit", "xmloption",
    "array_nulls", "backslash_quote", "escape_string_warning", "quote_all_identifiers",
    "idle_session_timeout", "plan_cache_mode", "max_parallel_workers_per_gather",
    "default_with_oids", "check_function_bodies", "constraint_exclusion", "cursor_tuple_fraction",
    "from_collapse_limit", "join_collapse_limit", "force_parallel_mode", "session_replication_role",
    "default_tablespace", "temp_tablespaces", "vacuum_freeze_min_age", "gin_fuzzy_search_limit",
    "role", "session_authorization",
}  # fmt: skip
_ACCEPTED_PREFIXES = ("enable_", "log_", "tcp_", "lc_", "debug_", "track_", "auto_explain.")
_READ_ONLY = {
    "server_version",
    "server_version_num",
    "server_encoding",
    "integer_datetimes",
    "max_identifier_length",
    "max_index_keys",
    "max_function_args",
    "block_size",
    "lc_collate",
    "lc_ctype",
    "in_hot_standby",
    "is_superuser",
    "session_authorization",
    "max_connections",
}

_SET = re.compile(
    r"^\s*SET\s+(?:SESSION\s+|LOCAL\s+)?(?P<rest>.*?)\s*;?\s*$", re.IGNORECASE | re.DOTALL
)
_NAME_VALUE = re.compile(
    r"^(?P<name>[A-Za-z_][\w.$]*|\"[^\"]+\")\s*(?:=|\bTO\b)\s*(?P<value>.*)$",
    re.IGNORECASE | re.DOTALL,
)


class SettingError(ClientError):
    """A SET / SHOW / RESET the server cannot honour."""


@dataclass(frozen=True)
class SetCommand:
    name: str | None  # canonical name; None for no-op forms (SET TRANSACTION ...)
    value: str | None  # None means DEFAULT


def canonical(name: str) -> str:
    low = name.strip('"').lower()
    return _CANONICAL.get(low, low)


def _unquote(value: str) -> str:
    parts = []
    for item in _split_list(value.strip()):
        item = item.strip()
        if len(item) >= 2 and item[0] == item[-1] == "'":
            item = item[1:-1].replace("''", "'")
        elif item.lower().startswith("e'") and item.endswith("'"):
            item = item[2:-1]
        parts.append(item)
    return ", ".join(parts)


def _split_list(value: str) -> list[str]:
    out: list[str] = []
    cur: list[str] = []
    quote = False
    for ch in value:
        if ch == "'":
            quote = not quote
        if ch == "," and not quote:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def parse_set(sql: str) -> SetCommand:
    m = _SET.match(sql)
    if not m:
        raise SettingError("syntax error at or near SET", "42601")
    rest = m.group("rest")
    low = rest.lower()
    if (
        low.startswith("transaction")
        or low.startswith("characteristics")
        or low.startswith("session characteristics")
    ):
        return SetCommand(None, None)
    if low.startswith("time zone"):
        value = rest[len("time zone") :].strip()
        return SetCommand(
            "TimeZone", None if value.lower() in ("default", "local") else _unquote(value)
        )
    if low.startswith("names"):
        return SetCommand("client_encoding", _unquote(rest[len("names") :]))
    nv = _NAME_VALUE.match(rest)
    if not nv:
        raise SettingError(f"syntax error in SET statement: {sql.strip()!r}", "42601")
    value = nv.group("value").strip()
    name = canonical(nv.group("name"))
    if value.lower() == "default":
        return SetCommand(name, None)
    return SetCommand(name, _unquote(value))


def set_name_of(sql: str) -> str | None:
    """The parameter a SET/SHOW/RESET names (lower case), without validating the rest."""
    words = re.findall(r"[A-Za-z_][\w.$]*|\"[^\"]+\"", sql)
    if not words:
        return None
    head = words[0].lower()
    rest = [w for w in words[1:] if w.lower() not in ("session", "local")]
    if head in ("set", "show", "reset") and rest:
        phrase = " ".join(w.lower() for w in rest[:3])
        for prefix, name in _PHRASES.items():
            if phrase.startswith(prefix):
                return name
        return rest[0].strip('"').lower()
    return None


_PHRASES = {
    "transaction isolation level": "transaction_isolation",
    "time zone": "timezone",
    "authorization": "session_authorization",
}


class SessionSettings:
    """Current values; ``set`` returns the canonical names whose reported value changed."""

    def __init__(self, user: str, application_name: str = "") -> None:
        self.values = dict(DEFAULTS)
        self.values["session_authorization"] = user
        self.values["application_name"] = application_name
        self.defaults = dict(self.values)

    def get(self, name: str) -> str:
        key = canonical(name)
        if key not in self.values:
            raise SettingError(f'unrecognized configuration parameter "{name}"', "42704")
        return self.values[key]

    def lowered(self) -> dict[str, str]:
        return {k.lower(): v for k, v in self.values.items()}

    def set(self, name: str, value: str | None) -> list[str]:
        key = canonical(name)
        known = key in self.values or key in _ACCEPTED or "." in key
        if not known and not key.startswith(_ACCEPTED_PREFIXES):
            raise SettingError(
                f'unrecognized configuration parameter "{name}"',
                "42704",
                hint="dpsql's privacy settings are epsilon, delta and mechanism",
            )
        if key in _READ_ONLY:
            raise SettingError(f'parameter "{name}" cannot be changed', "55P02")
        if value is None:
            value = self.defaults.get(key, "")
        _validate(key, value)
        old = self.values.get(key)
        self.values[key] = value
        return [key] if key in REPORTED and old != value else []

    def reset_all(self) -> list[str]:
        changed = [k for k in REPORTED if self.values.get(k) != self.defaults.get(k)]
        self.values = dict(self.defaults)
        return changed


_DURATION = re.compile(r"^\s*\d+(\.\d+)?\s*(ms|s|min|h|d)?\s*$", re.IGNORECASE)


def _validate(key: str, value: str) -> None:
    low = value.lower().replace("-", "").replace("_", "")
    if key in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout") and (
        not _DURATION.match(value)
    ):
        raise SettingError(
            f'invalid value for parameter "{key}": "{value}"',
            "22023",
            hint="e.g. 5000, '5s' or '1min' (0 disables)",
        )
    if key == "client_encoding" and low not in ("utf8", "unicode"):
        raise SettingError(
            f'invalid value for parameter "client_encoding": "{value}"',
            "22023",
            hint="dpsql speaks UTF8 only",
        )
    if key == "DateStyle" and "iso" not in low:
        raise SettingError(
            f'invalid value for parameter "DateStyle": "{value}"',
            "22023",
            hint="dpsql writes dates in ISO format only",
        )
    if key == "standard_conforming_strings" and low not in ("on", "true", "1", "yes"):
        raise SettingError(
            'invalid value for parameter "standard_conforming_strings"',
            "22023",
            hint="dpsql requires standard_conforming_strings = on",
        )
