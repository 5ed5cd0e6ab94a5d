"""What a wire session answers itself: routing a statement by what it names (classify), and
the statements no backend sees — transaction control (BEGIN/COMMIT/ROLLBACK, tracked for the
ReadyForQuery status), SET/RESET/SHOW of PostgreSQL settings, and DISCARD/DEALLOCATE/CLOSE."""

from __future__ import annotations

from typing import Any

from dpsql.frontend.sqltext import identifiers, keywords
from dpsql.limits import check_bytes
from dpsql.server import protocol as p
from dpsql.server import types as t
from dpsql.server.backend import Outcome
from dpsql.server.probes import may_be_probe
from dpsql.server.settings import SettingError, canonical, parse_set, set_name_of
from dpsql.server.wire_errors import SqlError

_TX_WORDS = {"begin", "start", "commit", "end", "rollback", "abort", "savepoint", "release"}
_NOOP_WORDS = {"discard", "deallocate", "listen", "unlisten", "close", "checkpoint"}


class SessionStatements:
    """The session's own statements (``session``: the wire session, typed loosely so this
    module does not import it)."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def classify(self, sql: str) -> str:
        s = self.session
        # every statement, catalog ones too, before any parse: its size here, and the full scan
        # (tokenizing: up to ~1 s near the message cap) in its own thread, see run_statement
        # (whose check_size does the counts; here only the size, before the keyword scan)
        check_bytes(sql, s.limits)
        words = keywords(sql, 3)
        if not words:
            return "empty"
        head = words[0]
        if head in _TX_WORDS:
            return "tx"
        if head in ("set", "show", "reset"):
            name = set_name_of(sql)
            assert s.dp is not None
            if name is not None and (name in s.dp.setting_names or name.startswith("dpsql.")):
                return "dp"
            if head == "show" and name not in ("all", None) and not self._pg_setting(name):
                return "dp"  # e.g. SHOW budget: the pipeline answers or says it is unknown
            return head
        if head in _NOOP_WORDS:
            return "noop"
        if head == "explain" and not identifiers(sql) & s.server.private_names:
            return "explain"
        if identifiers(sql) & s.server.private_names:
            # Whether it is a zero-row probe takes a parse: run_statement decides that as the
            # analyst's scheduled work, not here on the event loop (may_be_probe is a regex).
            return "maybe_probe" if head in ("select", "with") and may_be_probe(sql) else "dp"
        return "catalog"

    def _pg_setting(self, name: str) -> bool:
        s = self.session
        assert s.settings is not None
        try:
            s.settings.get(name)
        except SettingError:
            return False
        return True

    def check_failed_block(self, sql: str, kind: str) -> None:
        s = self.session
        if s.tx != "E":
            return
        words = keywords(sql, 1)
        if kind == "tx" and words and words[0] in ("commit", "end", "rollback", "abort"):
            return
        raise SqlError(
            "25P02",
            "current transaction is aborted, commands ignored until end of transaction block",
            hint="send ROLLBACK (or COMMIT) to end the failed transaction block",
        )

    def transaction(self, sql: str) -> Outcome:
        s = self.session
        words = keywords(sql, 3)
        head = words[0]
        notices: list[tuple[str, str, str]] = []
        if head in ("begin", "start"):
            if s.tx != "I":
                notices.append(("WARNING", "25001", "there is already a transaction in progress"))
            s.tx = "T"
            return Outcome(
                None, [], "BEGIN" if head == "begin" else "START TRANSACTION", tuple(notices)
            )
        if head in ("commit", "end"):
            tag = "ROLLBACK" if s.tx == "E" else "COMMIT"
            if s.tx == "I":
                notices.append(("WARNING", "25P01", "there is no transaction in progress"))
            s.tx = "I"
            return Outcome(None, [], tag, tuple(notices))
        if head in ("rollback", "abort"):
            if "to" in words[1:3]:
                if s.tx == "I":
                    raise SqlError(
                        "25P01", "ROLLBACK TO SAVEPOINT can only be used in transaction blocks"
                    )
                s.tx = "T"
                return Outcome(None, [], "ROLLBACK")
            if s.tx == "I":
                notices.append(("WARNING", "25P01", "there is no transaction in progress"))
            s.tx = "I"
            return Outcome(None, [], "ROLLBACK", tuple(notices))
        if s.tx == "I":
            raise SqlError("25P01", f"{head.upper()} can only be used in transaction blocks")
        return Outcome(None, [], head.upper())

    def set(self, sql: str) -> Outcome:
        s = self.session
        assert s.settings is not None
        cmd = parse_set(sql)
        if cmd.name is not None:
            for name in s.settings.set(cmd.name, cmd.value):
                s.send(p.parameter_status(name, s.settings.values[name]))
        return Outcome(None, [], "SET")

    def reset(self, sql: str) -> Outcome:
        s = self.session
        assert s.settings is not None and s.dp is not None
        name = set_name_of(sql)
        if name == "all":
            for changed in s.settings.reset_all():
                s.send(p.parameter_status(changed, s.settings.values[changed]))
            for dp_name in sorted(s.dp.setting_names):
                s.dp.execute(f"RESET {dp_name}", None)
        elif name:
            for changed in s.settings.set(name, None):
                s.send(p.parameter_status(changed, s.settings.values[changed]))
        return Outcome(None, [], "RESET")

    def show(self, sql: str) -> Outcome:
        s = self.session
        assert s.settings is not None
        name = set_name_of(sql) or ""
        if name == "all":
            rows = [(k, v, "") for k, v in sorted(s.settings.values.items())]
            cols = (("name", t.TEXT), ("setting", t.TEXT), ("description", t.TEXT))
            return Outcome(cols, rows, "SHOW")
        value = s.settings.get(name)
        return Outcome(((canonical(name), t.TEXT),), [(value,)], "SHOW")

    def noop(self, sql: str) -> Outcome:
        s = self.session
        words = keywords(sql, 3)
        head = words[0]
        if head == "discard":
            what = words[1] if len(words) > 1 else "all"
            if what == "all":  # what connection pools send: back to a fresh session
                self.reset("RESET ALL")
            if what in ("all", "plans"):
                s.extended.statements.clear()
                s.extended.portals.clear()
                s.extended.prepared_bytes = 0
            return Outcome(None, [], "DISCARD " + what.upper())
        if head == "deallocate":
            rest = [w for w in words[1:] if w != "prepare"]
            if rest and rest[0] == "all":
                s.extended.statements = {k: v for k, v in s.extended.statements.items() if k == ""}
                return Outcome(None, [], "DEALLOCATE ALL")
            if rest:
                s.extended.statements.pop(rest[0], None)
            return Outcome(None, [], "DEALLOCATE")
        if head == "close":
            return Outcome(None, [], "CLOSE CURSOR")
        return Outcome(None, [], head.upper())
