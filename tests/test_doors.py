"""The doors over the service (issue 26 item 5): the wire server and the command line run on the
service's session (dpsql.service.session), never on the DB-API, and every door says the same
about one answer.

tests/test_layering.py checks the imports; these check the running doors: with the DB-API's
Connection and Cursor made to fail, the CLI and the wire server still answer; and one answer's
rows, low-budget warning and bias notes read alike through the cursor, the protocol's
WARNING/NOTICE messages and the CLI's stderr lines.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURE_TOML, fixture_policy

from dpsql import dbapi
from dpsql.cli import main
from dpsql.commands import run_statement
from dpsql.pipeline import Service
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise
from dpsql.server.backend import DpBackend
from dpsql.server.server import Server, ServerThread
from dpsql.server.testing import RawClient
from dpsql.server.users import UserStore, users_path
from dpsql.service.session import Session

SQL = "SELECT COUNT(*) AS n FROM visits"


@pytest.fixture
def no_dbapi(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any DB-API connection or cursor made from here on fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a door built on the DB-API")

    monkeypatch.setattr(dbapi.Connection, "__init__", refuse)
    monkeypatch.setattr(dbapi.Cursor, "__init__", refuse)


def _policy_copy(tmp_path: Path) -> Path:
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(FIXTURE_TOML.parent / name, tmp_path / name)
    return tmp_path / "visits.toml"


def test_the_cli_answers_without_the_dbapi(no_dbapi, tmp_path: Path, capsys) -> None:
    policy = _policy_copy(tmp_path)
    assert main(["query", "--policy", str(policy), "--format", "csv", SQL]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "n" and "-- charged epsilon=1 " in err
    assert main(["query", "--policy", str(policy), "SET epsilon = 0.5; SHOW epsilon"]) == 0
    assert capsys.readouterr().out.split()[:2] == ["epsilon", "0.5"]


def test_the_wire_server_answers_without_the_dbapi(no_dbapi, tmp_path: Path) -> None:
    policy = _policy_copy(tmp_path)
    UserStore(users_path(policy)).add("alice", "pw")
    service = Service(policy, cache=False, ledger=MemoryLedger())
    thread = ServerThread(lambda: Server(service, UserStore(users_path(policy))))
    thread.start()
    try:
        client = RawClient("127.0.0.1", thread.port)
        assert client.login("alice", "pw").status == "I"
        reply = client.query(f"SET epsilon = 0.5; {SQL}; SHOW epsilon")
        assert not reply.errors() and reply.tags() == ["SET", "SELECT 1", "SHOW"]
        said = [n.get("M", "") for n in reply.notices()]
        assert any(m.startswith("dpsql: charged epsilon=0.5 ") for m in said)
        assert reply.text_rows()[-1] == ["0.5"]
        client.sock.close()
    finally:
        thread.stop()
        service.close()


def test_the_three_doors_say_the_same_about_one_answer() -> None:
    """One service, one statement, three analysts (each with 1.05 of ε: a charge of 1 leaves
    less than 10%): the DB-API's cursor, the wire server's messages and the CLI's lines carry
    the same rows, low-budget warning and bias notes."""
    policy = fixture_policy(privacy={"budget_epsilon": 1.05})
    service = Service(policy, ledger=MemoryLedger(), noise=ZeroNoise(), cache=False)
    try:
        cur = dbapi.Connection(service, "alice").cursor()
        cur.execute(SQL)
        dbapi_rows, dbapi_warnings = cur.fetchall(), [text for _, text in cur.messages]

        outcome = DpBackend(Session(service, "bob", dialect="postgres")).execute(SQL, None)
        wire_warnings = [text for severity, _, text in outcome.notices if severity == "WARNING"]
        wire_notes = [
            text.removeprefix("dpsql: ")
            for severity, _, text in outcome.notices
            if severity == "NOTICE" and not text.startswith("dpsql: charged")
        ]

        out, err = io.StringIO(), io.StringIO()
        carol = Session(service, "carol")
        run_statement(carol, SQL, analyst="carol", fmt="csv", intervals=False, out=out, err=err)
        lines = err.getvalue().splitlines()
        cli_warnings = [w.removeprefix("-- warning: ") for w in lines if w.startswith("-- warning")]
        cli_notes = [line.removeprefix("-- ") for line in lines if line.startswith("-- bias")]
    finally:
        service.close()

    assert len(dbapi_warnings) == 1 and "less than 10% of the privacy budget" in dbapi_warnings[0]
    assert dbapi_warnings == wire_warnings == cli_warnings
    assert cur.bias_notes and cur.bias_notes == wire_notes == cli_notes
    assert dbapi_rows == outcome.rows == [(int(out.getvalue().splitlines()[1]),)]
