"""A fault walk of every door: each dpsql function a statement runs fails once, in turn.

tests/test_internal_errors.py injects a failure at a handful of named steps. That list goes
stale the day a new step is added, so this walk finds the steps itself: it runs a statement
once while a trace function records every function of the ``dpsql`` package it enters, then
runs it again once per recorded function, with a trace function that raises a ``KeyError``
carrying a secret the moment that function is entered (from whichever module or thread calls
it). Whatever the door, the outcome must be one of:

- an answer (the failure was handled inside dpsql, e.g. an optional step skipped);
- a dpsql error whose text names no value and no internal class (no secret, no ``KeyError``,
  no traceback), and which, if the statement was charged, is the charged boundary's uniform
  error (a failure after data was read is uniform and already paid for); an XX000 internal
  error is never charged (it is decided before the reserve).

After the walk the door must still answer, on the same service (no state left broken).

The doors: the DB-API over every statement kind; the CLI and the wire server (simple and
extended protocol) over the functions only they run plus a fixed sample of the shared path
(the shared path is walked whole through the DB-API).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, FrameType, FunctionType
from typing import Any

import pytest
from conftest import FIXTURE_TOML, fixture_policy

import dpsql
from dpsql.boundary import CHARGED_STATES
from dpsql.dbapi import connect_service
from dpsql.privacy.ledger import MemoryLedger

PACKAGE = str(Path(dpsql.__file__).resolve().parent)
SECRET = "q999-secret-value"
INTERNAL_WORDS = (SECRET, "KeyError", "Traceback", "dpsql.", ".py")

STATEMENTS = {
    "public keys": "SELECT department, COUNT(*), AVG(cost) FROM visits WHERE age > 30 "
    "GROUP BY department",
    "private keys": "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis",
    "quantile": "SELECT MEDIAN(age) FROM visits",
    "explain": "EXPLAIN SELECT department, AVG(cost) FROM visits GROUP BY department",
    "show budget": "SHOW budget",
    "set": "SET epsilon = 0.5",
    "dp subquery": "SELECT department, COUNT(*) FROM visits WHERE department IN "
    "(SELECT department FROM visits GROUP BY department ORDER BY COUNT(*) DESC LIMIT 2) "
    "GROUP BY department",
    "probe": "SELECT * FROM visits LIMIT 0",
    "public select": "SELECT 1 + 1 AS two",
    "regression": "SELECT * FROM dp_linear_regression('visits', label => 'cost', "
    "features => ['age', 'smoker'], epsilon => 0.5)",
    "rule list": "SELECT * FROM dp_rule_list('visits', label => 'readmitted', "
    "features => ['smoker', 'department'], epsilon => 0.5, max_length => 2)",
}


class _Faults:
    """One process-wide trace function: records the dpsql functions entered, or raises in one.

    Installed for this thread and every thread started while it is on (thread pools, the
    server's loop), so a function is found whichever thread runs it."""

    def __init__(self) -> None:
        self.recording: dict[CodeType, None] | None = None
        self.main_thread: set[CodeType] = set()  # entered by the test's own thread
        self.target: CodeType | None = None
        self.fired = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return None
        code = frame.f_code
        if self.recording is not None:
            caller = frame.f_back
            inside = caller is not None and caller.f_code.co_filename.startswith(PACKAGE)
            # a door's own entry (called from the test, as a user calls it) is not walked:
            # nothing above it could turn its failure into an error
            if inside and code.co_filename.startswith(PACKAGE):
                self.recording.setdefault(code, None)
                if threading.current_thread() is threading.main_thread():
                    self.main_thread.add(code)
        elif code is self.target and not self.fired:
            self.fired = True
            raise KeyError(SECRET)
        return None

    @contextmanager
    def record(self) -> Iterator[dict[CodeType, None]]:
        self.recording, self.main_thread = {}, set()
        try:
            yield self.recording
        finally:
            self.recording = None

    @contextmanager
    def failing(self, code: CodeType) -> Iterator[None]:
        self.target, self.fired = code, False
        try:
            yield
        finally:
            self.target = None
            # Python drops a thread's trace function once it raises: put it back (a worker
            # thread that ran the failing function is traced again when it next starts)
            sys.settrace(self)


@pytest.fixture(scope="module")
def faults() -> Iterator[_Faults]:
    tracer = _Faults()
    previous = sys.gettrace()
    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        yield tracer
    finally:
        sys.settrace(previous)
        threading.settrace(None)  # type: ignore[arg-type]


def _name(code: CodeType) -> str:
    return f"{Path(code.co_filename).relative_to(PACKAGE)}:{code.co_firstlineno} {code.co_name}"


def _clean(text: str) -> bool:
    return not any(word in text for word in INTERNAL_WORDS)


def _service() -> dpsql.Service:
    policy = fixture_policy(privacy={"budget_epsilon": 1e9, "budget_delta": 0.5})
    return dpsql.Service(policy, ledger=MemoryLedger(), cache=False)


def _spent(service: dpsql.Service) -> float:
    return float(service.ledger.spent("mallory", service.policy.dataset).epsilon)


def _walk(codes: list[CodeType], check: Callable[[CodeType], list[str]]) -> list[str]:
    """Fail each of ``codes`` in turn; ``check`` runs the statement with the fault armed
    (``faults.failing(code)`` around the door's call only) and returns what went wrong."""
    problems: list[str] = []
    for code in codes:
        if os.environ.get("DPSQL_FAULT_WALK_VERBOSE"):
            print("fault:", _name(code), file=sys.stderr, flush=True)
        problems.extend(f"{_name(code)}: {p}" for p in check(code))
    return problems


# -- the DB-API: every statement kind, every function it runs -------------------------------------
@pytest.mark.parametrize("kind", list(STATEMENTS))
def test_every_function_of_a_dbapi_statement_fails_cleanly(faults, kind):
    service = _service()
    conn = connect_service(service, "mallory")
    sql = STATEMENTS[kind]
    conn.cursor().execute(sql)  # warm: one-time setup is not the statement's path
    with faults.record() as seen:
        conn.cursor().execute(sql)
    codes = list(seen)
    assert len(codes) > 20, "the recorder saw the statement's path"

    def check(code: CodeType) -> list[str]:
        before = _spent(service)
        try:
            with faults.failing(code):
                cursor = conn.cursor()
                cursor.execute(sql)
                rows = cursor.fetchall() if cursor.description else []
        except dpsql.Error as error:
            text = f"{error}"
            charged = _spent(service) > before
            wrong = []
            if not _clean(text):
                wrong.append(f"error shows internals: {text!r}")
            if charged and error.sqlstate not in CHARGED_STATES:
                wrong.append(f"charged, but {error.sqlstate} is not the uniform error")
            if error.sqlstate == "XX000" and charged:
                wrong.append("an XX000 was charged")
            return wrong
        except BaseException as error:
            return [f"escaped the door as {type(error).__name__}"]
        if any(SECRET in repr(row) for row in rows):
            return ["the secret reached a row"]
        return []

    problems = _walk(codes, check)
    assert not problems, "\n".join(problems)
    cursor = conn.cursor()
    cursor.execute(sql)  # the same service still answers
    service.close()


# -- the wire server and the CLI: the functions only they run, and a sample of the rest -------
# A trace function that raised is dropped by Python for its thread, and the server runs
# statements on its loop and on pool threads the test cannot reach: there, a function fails by
# having its code swapped for one that raises (every function object sharing that code, so
# every call site), and put back after.
_RAISER = compile(f"raise KeyError({SECRET!r})", "<injected fault>", "exec")


def _raising_code(code: CodeType) -> CodeType:
    """A code object with ``code``'s signature whose body raises the secret KeyError."""
    body = compile(
        f"def f(*args, **kwargs):\n    raise KeyError({SECRET!r})\n", "<injected fault>", "exec"
    )
    raiser = next(c for c in body.co_consts if isinstance(c, CodeType))
    return raiser.replace(co_name=code.co_name, co_qualname=code.co_qualname)


@contextmanager
def swapped(code: CodeType) -> Iterator[bool]:
    """Every function running ``code`` raises while inside; yields False when there is none
    to swap (a nested function or comprehension: made anew by each call of its parent)."""
    functions = [
        f
        for f in gc.get_referrers(code)
        if isinstance(f, FunctionType) and f.__code__ is code and not f.__closure__
    ]
    raising = _raising_code(code)
    for function in functions:
        function.__code__ = raising
    try:
        yield bool(functions)
    finally:
        for function in functions:
            function.__code__ = code


# (frontend/sqltext.py: the statement splitter the server and the CLI share, walked whole as when it
# lived in server/)
OWN_MODULES = (
    "server/",
    "frontend/sqltext.py",
    "cli.py",
    "commands.py",
    "cli_output.py",
    "terminal.py",
    "shell.py",
    "plots.py",
)
SAMPLE = 15  # every 15th function of the shared path (walked whole through the DB-API)


# Release functions of pools, run in a ``finally`` only: their failing on entry is a fault
# the model cannot ask them to survive (nothing is left to hand the resource back). They are
# plain bookkeeping on memory; the scheduler's own (fairness.leave) is walked anyway, since
# it reclaims a slot whose release failed.
RELEASES = {("server/catalog.py", "release")}


def _door_codes(seen: dict[CodeType, None]) -> list[CodeType]:
    own, shared = [], []
    for code in seen:
        if (str(Path(code.co_filename).relative_to(PACKAGE)), code.co_name) in RELEASES:
            continue
        name = str(Path(code.co_filename).relative_to(PACKAGE))
        (own if name.startswith(OWN_MODULES) else shared).append(code)
    return own + shared[::SAMPLE]


# EXPLAIN's server-side functions are the public keys'; the shared path of every kind is
# walked whole through the DB-API
WIRE_STATEMENTS = ["public keys", "show budget", "set", "probe", "public select"]


@pytest.fixture(scope="module")
def wire(faults, tmp_path_factory):
    import shutil

    from dpsql.server.server import Server, ServerThread
    from dpsql.server.users import UserStore, users_path

    root = tmp_path_factory.mktemp("wire")
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(FIXTURE_TOML.parent / name, root / name)
    UserStore(users_path(root / "visits.toml")).add("mallory", "pw-mallory-1")
    service = _service()
    # started after the faults fixture, so its loop and pool threads are recorded too
    thread = ServerThread(lambda: Server(service, UserStore(users_path(root / "visits.toml"))))
    thread.start()
    thread.service = service  # type: ignore[attr-defined]
    yield thread
    thread.stop()
    service.close()


def _wire_client(wire) -> Any:
    from dpsql.server.testing import RawClient

    client = RawClient("127.0.0.1", wire.port, timeout=30.0)
    reply = client.login("mallory", "pw-mallory-1")
    assert not reply.errors(), reply.errors()
    return client


def _wire_extended(client: Any, sql: str) -> Any:
    client.parse(sql)
    client.bind()
    client.describe("P")
    client.execute()
    return client.sync()


@pytest.mark.parametrize("protocol", ["simple", "extended"])
@pytest.mark.parametrize("kind", WIRE_STATEMENTS)
def test_every_function_of_a_wire_statement_fails_cleanly(faults, wire, kind, protocol):
    from dpsql.server.testing import ServerClosed

    sql = STATEMENTS[kind]
    send = (lambda c: c.query(sql)) if protocol == "simple" else (lambda c: _wire_extended(c, sql))
    client = _wire_client(wire)
    assert not send(client).errors()  # warm
    with faults.record() as seen:
        reply = send(client)
    assert not reply.errors(), reply.errors()
    # the server's side only: the test's client speaks the protocol with dpsql's own helpers
    codes = [c for c in _door_codes(seen) if c not in faults.main_thread]
    assert any("server/" in c.co_filename for c in codes), "the recorder saw the server"
    service = wire.service
    state = {"client": client}

    def check(code: CodeType) -> list[str]:
        before = _spent(service)
        with swapped(code) as any_swapped:
            if not any_swapped:
                return []
            try:
                reply = send(state["client"])
            except TimeoutError:
                reply = "hung"
            except (ServerClosed, OSError, AssertionError):
                reply = None  # the server closed the session: a new one must be accepted
        wrong: list[str] = []
        if reply == "hung":
            state["client"] = _wire_client(wire)
            healthy = not send(state["client"]).errors()
            return [f"the session hangs (the server still answers others: {healthy})"]
        if reply is None:
            state["client"] = _wire_client(wire)  # a new connection is accepted
            return wrong
        charged = _spent(service) > before
        for fields in reply.errors():
            text = " ".join(fields.values())
            if not _clean(text):
                wrong.append(f"error shows internals: {text!r}")
            state_code = fields.get("C", "")
            # the session may still die after its paid answer was delivered whole
            delivered = b"C" in reply.kinds() and fields.get("S") == "FATAL"
            if charged and state_code not in CHARGED_STATES and not delivered:
                wrong.append(f"charged, but {state_code} is not the uniform error")
        if any(SECRET in repr(row) for row in reply.rows()):
            wrong.append("the secret reached a row")
        return wrong

    problems = _walk(codes, check)
    assert not problems, "\n".join(problems)
    assert not send(_wire_client(wire)).errors()  # the server still answers


@pytest.mark.parametrize("kind", ["public keys", "show budget"])
def test_every_function_of_a_cli_statement_fails_cleanly(faults, tmp_path, capsys, kind):
    import shutil

    from dpsql.cli import main
    from dpsql.privacy.sqlite_ledger import SQLiteLedger

    shutil.copy(FIXTURE_TOML.parent / "visits.csv", tmp_path / "visits.csv")
    policy = tmp_path / "visits.toml"
    text = FIXTURE_TOML.read_text().replace("budget_epsilon = 10.0", "budget_epsilon = 1e9")
    policy.write_text(text.replace("[privacy]\n", '[privacy]\nledger = "walk.ledger.sqlite"\n', 1))
    argv = ["query", "--policy", str(policy), "--analyst", "mallory", STATEMENTS[kind]]
    assert main(argv) == 0
    with faults.record() as seen:
        assert main(argv) == 0
    capsys.readouterr()
    codes = _door_codes(seen)
    assert any(c.co_filename.endswith("cli.py") for c in codes)

    def spent() -> float:
        ledger = SQLiteLedger(tmp_path / "walk.ledger.sqlite")
        try:
            return float(ledger.spent("mallory", "visits").epsilon)
        finally:
            ledger.close()

    def check(code: CodeType) -> list[str]:
        before = spent()
        with swapped(code) as any_swapped:
            if not any_swapped:
                return []
            try:
                status = main(argv)
            except SystemExit as exit_:
                status = exit_.code
            except BaseException as error:
                capsys.readouterr()
                return [f"escaped the CLI as {type(error).__name__}"]
        out = capsys.readouterr()
        wrong = []
        if not _clean(out.err + out.out):
            wrong.append(f"the CLI shows internals: {(out.err + out.out)[-300:]!r}")
        if status != 0 and spent() > before and not any(s in out.err for s in CHARGED_STATES):
            wrong.append("charged, but not the uniform error")
        return wrong

    problems = _walk(codes, check)
    assert not problems, "\n".join(problems)
    assert main(argv) == 0
