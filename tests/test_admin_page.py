"""The curator page (dpsql.admin): operator-only, read-only, escaped; and in a real browser.

Plain HTTP (urllib) covers authentication (the operator's token, never an analyst's login),
methods (GET/HEAD only), escaping of attacker-controlled query texts, and the content (budgets,
the log with cached answers, tables and access rules, data versions and stores). The browser
test runs the system's Chromium headless (``--dump-dom``, ``--screenshot``) against the page;
it skips, saying why, when no Chromium is installed.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

import dpsql
from dpsql.admin.page import NOT_RECORDED, Reader
from dpsql.admin.server import AdminError, AdminServer, read_token
from dpsql.cli import build_parser
from dpsql.policy import load_policy
from dpsql.privacy.sqlite_ledger import SQLiteLedger
from dpsql.server.users import UserStore

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "op-token-0123456789abcdef"
XSS = "<script>alert('pwned')</script><img src=x onerror=alert(1)>"

ACCESS = """
[access]
roles = { clinicians = ["alice", "bob"] }
"""


def _policy_text() -> str:
    text = (ROOT / "fixtures" / "visits.toml").read_text(encoding="utf-8")
    text = text.replace('source = "visits.csv"', f'source = "{ROOT / "fixtures" / "visits.csv"}"')
    text = text.replace('dataset = "visits"', 'dataset = "visits"\nledger = "state/visits.sqlite"')
    text = text.replace(
        "max_groups_per_unit = 3       # groups one patient may contribute to",
        'max_groups_per_unit = 3\nallow = ["clinicians", "carol"]',
    )
    text = text.replace(
        "[tables.visits.columns.diagnosis]\n",
        '[tables.visits.columns.diagnosis]\nallow = ["clinicians"]\n',
    )
    return ACCESS + text


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A policy with [access], a ledger with real charges of three analysts (one query text
    carries an XSS payload), a users file with an analyst login."""
    tmp = tmp_path_factory.mktemp("curator")
    (tmp / "state").mkdir()
    policy = tmp / "visits.toml"
    policy.write_text(_policy_text(), encoding="utf-8")
    store = UserStore(tmp / "visits.users.json")
    store.add("alice", "alice-secret-password")
    queries = {
        "alice": [
            "SELECT department, COUNT(*) FROM visits GROUP BY department",
            "SELECT AVG(cost) FROM visits",
        ],
        "bob": [f"SELECT COUNT(*) FROM visits /* {XSS} */"],
        "carol": ["SELECT COUNT(*) FROM visits WHERE age > 40"],
    }
    for analyst, texts in queries.items():
        with dpsql.connect(policy=str(policy), analyst=analyst) as conn:
            cur = conn.cursor()
            for text in texts:
                cur.execute(text)
                cur.fetchall()
            cur.execute(texts[0])  # a re-run: a cache hit, free, not logged
            cur.fetchall()
    with SQLiteLedger(tmp / "state" / "visits.sqlite") as led:
        from dpsql.privacy.accounting import Budget

        led.set_budget("carol", "visits", Budget(3.0, 1e-5))
    loaded = load_policy(policy)
    reader = Reader(loaded, logins=store.names)
    server = AdminServer(reader, token=TOKEN).start()
    yield {"tmp": tmp, "policy": policy, "server": server, "url": server.url}
    server.close()


def _auth(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def fetch(
    url: str,
    *,
    auth: str | None = None,
    method: str = "GET",
    data: bytes | None = None,
) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, method=method, data=data)
    if auth is not None:
        request.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def page(setup: dict, query: str = "") -> str:
    status, _, body = fetch(setup["url"] + query, auth=_auth("operator", TOKEN))
    assert status == 200, body
    return body


# -- authentication ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "auth",
    [
        None,
        _auth("operator", "wrong-token-wrong-token"),
        _auth("operator", TOKEN[:-1]),
        _auth("alice", "alice-secret-password"),  # an analyst's own (wire) login
        _auth("alice", TOKEN),  # an analyst's name with the operator's token
        "Bearer " + TOKEN,
        "Basic !!!not-base64",
        _auth("operator", TOKEN) + "x",
    ],
)
def test_only_the_operator_gets_in(setup, auth):
    status, headers, body = fetch(setup["url"], auth=auth)
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Basic realm=")
    assert "SELECT" not in body and "alice" not in body


def test_an_analyst_cannot_be_the_operator(setup):
    reader = Reader(
        load_policy(setup["policy"]), logins=UserStore(setup["tmp"] / "visits.users.json").names
    )
    with pytest.raises(AdminError, match="is an analyst"):
        AdminServer(reader, token=TOKEN, user="alice")  # a login
    with pytest.raises(AdminError, match="is an analyst"):
        AdminServer(reader, token=TOKEN, user="carol")  # a name in the ledger only
    with pytest.raises(AdminError, match="at least"):
        AdminServer(reader, token="short")


def test_token_file_must_be_private(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n", encoding="utf-8")
    path.chmod(0o644)
    with pytest.raises(AdminError, match="chmod 600"):
        read_token(path)
    path.chmod(0o600)
    assert read_token(path) == TOKEN
    path.write_text("short\n", encoding="utf-8")
    with pytest.raises(AdminError, match="shorter"):
        read_token(path)


def test_bound_to_loopback_by_default(setup):
    host, _ = setup["server"].address
    assert host == "127.0.0.1"
    args = build_parser().parse_args(["dashboard", "--policy", "p.toml"])
    assert args.admin_host == "127.0.0.1"
    args = build_parser().parse_args(["serve", "--policy", "p.toml", "--admin-port", "0"])
    assert (args.admin_host, args.admin_port, args.admin_user) == ("127.0.0.1", 0, "operator")


# -- read-only --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_only_get_and_head(setup, method):
    ledger = setup["tmp"] / "state" / "visits.sqlite"
    before = SQLiteLedger(ledger).entries("visits")
    status, headers, _ = fetch(
        setup["url"] + "?analyst=carol",
        auth=_auth("operator", TOKEN),
        method=method,
        data=b"analyst=carol&epsilon=100" if method in ("POST", "PUT", "PATCH") else None,
    )
    assert status == 405
    assert headers["Allow"] == "GET, HEAD"
    assert SQLiteLedger(ledger).entries("visits") == before


def test_head_and_headers(setup):
    status, headers, body = fetch(setup["url"], auth=_auth("operator", TOKEN), method="HEAD")
    assert status == 200 and body == ""
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert "script-src" not in headers["Content-Security-Policy"]
    assert headers["Cache-Control"] == "no-store"
    assert headers["X-Frame-Options"] == "DENY"
    status, _, _ = fetch(setup["url"] + "other", auth=_auth("operator", TOKEN))
    assert status == 404
    status, _, _ = fetch(setup["url"] + "?limit=0", auth=_auth("operator", TOKEN))
    assert status == 400


# -- content ----------------------------------------------------------------------------------


def test_query_texts_are_escaped(setup):
    body = page(setup)
    assert "<script" not in body.lower()
    assert "<img" not in body.lower()
    assert "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;" in body
    assert "onerror=alert(1)&gt;" in body
    # an attacker-controlled analyst filter is escaped too
    body = page(setup, "?analyst=" + urllib.parse.quote("'><script>x</script>"))
    assert "<script" not in body.lower()


def test_budgets_and_log(setup):
    body = page(setup)
    for name in ("alice", "bob", "carol"):
        assert f">{name}</a>" in body
    # carol's budget was set by an administrator: 3*, and the set is in the log
    assert "3*" in body and "budget set by an administrator" in body
    assert "kind-budget" in body
    assert "SELECT AVG(cost) FROM visits" in body
    # every charge's answer is cached (re-asking it is free); re-runs are not in the log
    cached = re.findall(r"<td>(yes|no)</td><td class=q>", body)
    assert cached == ["yes"] * 4
    assert body.count("SELECT department, COUNT(*) FROM visits GROUP BY department") == 1
    assert NOT_RECORDED.split(":")[0] in body  # refusals: not recorded, and the page says so
    assert "<svg" in body and "privacy budget spent over time" in body


def test_one_analysts_log(setup):
    body = page(setup, "?analyst=carol")
    log = body.split("id=log", 1)[1].split("id=tables", 1)[0]
    assert "age &gt; 40" in log
    assert "AVG(cost)" not in log and "pwned" not in log


def test_tables_versions_and_stores(setup):
    body = page(setup)
    assert "patient_id" in body and "max_rows_per_unit (R)" in body
    assert "cardiology" in body  # a public domain
    assert "<code>clinicians</code> = alice, bob" in body  # [access] roles
    assert "carol, clinicians" in body  # who may query visits
    tables = body.split("id=tables", 1)[1]
    assert re.search(r"<td>diagnosis</td>.*?<td>clinicians</td></tr>", tables)
    version = re.search(r"<td class=q>([0-9a-f]{64}@\d+:\d+)</td>", body)
    assert version is not None  # the CSV's sha256@mtime:size, as the engine computes it
    assert "Prepared stores" in body


def test_live_versions_and_stores_from_a_service(setup):
    service = dpsql.Service(str(setup["policy"]))
    try:
        reader = Reader(
            service.policy,
            versions=lambda: {n: service.data_version(t) for n, t in service.policy.tables.items()},
            stores=lambda: list(service.engine.stores),
        )
        snap = reader.snapshot()
        assert snap.live
        assert snap.versions[0].version == service.data_version(service.policy.tables["visits"])
        assert snap.versions[0].how == "the serving engine's"
        reader.close()
    finally:
        service.close()


def test_missing_ledger_is_reported_not_created(tmp_path):
    text = _policy_text().replace("state/visits.sqlite", "nowhere.sqlite")
    path = tmp_path / "p.toml"
    path.write_text(text, encoding="utf-8")
    reader = Reader(load_policy(path))
    server = AdminServer(reader, token=TOKEN).start()
    try:
        status, _, body = fetch(server.url, auth=_auth("operator", TOKEN))
    finally:
        server.close()
    assert status == 200
    assert "No ledger at" in body
    assert not (tmp_path / "nowhere.sqlite").exists()


def test_reading_never_blocks_a_charge(setup):
    """The page reads in WAL snapshots on its own connection: a writer holding the lock does
    not stop the page, and the page does not stop the writer."""
    path = setup["tmp"] / "state" / "visits.sqlite"
    import sqlite3

    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # a charge in progress
    try:
        started = time.monotonic()
        page(setup)
        assert time.monotonic() - started < 10
    finally:
        writer.execute("ROLLBACK")
        writer.close()


# -- the commands -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_until_ready(cmd: list[str], marker: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [line for line in lines if marker in line]
        if found:
            return proc, found[0]
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(
        f"{cmd} did not start: {lines} {proc.stderr.read() if proc.stderr else ''}"
    )


def test_dashboard_command_prints_a_token_and_serves(setup):
    port = _free_port()
    proc, line = _run_until_ready(
        [
            sys.executable,
            "-m",
            "dpsql",
            "dashboard",
            "--policy",
            str(setup["policy"]),
            "--port",
            str(port),
        ],
        "curator page on",
    )
    try:
        token = re.search(r"token (\S+) \(shown once", line)
        assert token is not None, line
        assert f"http://127.0.0.1:{port}/" in line
        status, _, body = fetch(f"http://127.0.0.1:{port}/", auth=_auth("operator", token[1]))
        assert status == 200 and "Analysts and budgets" in body
        status, _, _ = fetch(
            f"http://127.0.0.1:{port}/", auth=_auth("alice", "alice-secret-password")
        )
        assert status == 401
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_serve_admin_port(setup, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n", encoding="utf-8")
    token_file.chmod(0o600)
    port = _free_port()
    proc, line = _run_until_ready(
        [
            sys.executable,
            "-m",
            "dpsql",
            "serve",
            "--policy",
            str(setup["policy"]),
            "--port",
            "0",
            "--admin-port",
            str(port),
            "--admin-token-file",
            str(token_file),
        ],
        "curator page on",
    )
    try:
        assert TOKEN not in line and f"token from {token_file}" in line
        status, _, body = fetch(f"http://127.0.0.1:{port}/", auth=_auth("operator", TOKEN))
        assert status == 200
        assert "serving process" in body and "the serving engine&#x27;s" in body
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_refuses_an_analyst_as_operator(setup):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dpsql",
            "serve",
            "--policy",
            str(setup["policy"]),
            "--port",
            "0",
            "--admin-port",
            "0",
            "--admin-user",
            "alice",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "is an analyst" in result.stderr


# -- a real browser -----------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _browser(binary: str, url: str, *flags: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            f"--user-data-dir={cwd / 'profile'}",
            *flags,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


@pytest.mark.skipif(_chromium() is None, reason="no Chromium installed (apt-get install chromium)")
def test_in_a_headless_browser(setup, tmp_path):
    binary = _chromium()
    assert binary is not None
    host, port = setup["server"].address
    with_login = f"http://operator:{TOKEN}@{host}:{port}/"
    # Without credentials the browser gets a 401 (headless, no login dialog: an empty or
    # error page), nothing of the ledger.
    dom = _browser(binary, setup["url"], "--dump-dom", cwd=tmp_path).stdout
    assert "Analysts and budgets" not in dom and "alice" not in dom and "SELECT" not in dom
    # With them, the page, and the payload in bob's query text is text, not a script: the
    # browser's DOM has no <script> and no <img> element (the CSP would block them too).
    dom = _browser(binary, with_login, "--dump-dom", cwd=tmp_path).stdout
    assert "Analysts and budgets" in dom
    assert "<script" not in dom and "<img" not in dom
    assert "&lt;script&gt;alert('pwned')&lt;/script&gt;" in dom
    assert "<svg" in dom
    shot = tmp_path / "page.png"
    result = _browser(
        binary,
        with_login,
        f"--screenshot={shot}",
        "--window-size=1280,1700",
        "--hide-scrollbars",
        cwd=tmp_path,
    )
    assert shot.exists() and shot.stat().st_size > 20_000, result.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("DPSQL_CURATOR_SCREENSHOT"):  # refresh docs/curator_page.png
        shutil.copy(shot, os.environ["DPSQL_CURATOR_SCREENSHOT"])


def test_undeclared_nullable_is_a_policy_warning_on_the_page():
    """Issue 31: the curator page flags a column whose nullable the policy does not declare
    (read off the policy alone: no data is read for it)."""
    from conftest import fixture_policy

    from dpsql.admin.page import _table

    policy = fixture_policy()
    del policy["tables"]["visits"]["columns"]["department"]["nullable"]
    del policy["tables"]["visits"]["columns"]["diagnosis"]["nullable"]
    table = load_policy(policy).tables["visits"]
    html = _table("visits", table, None)
    row = html.split("<td>department</td>", 1)[1].split("</tr>", 1)[0]
    assert "no <span class=warn>not declared: no NULL group is released" in row
    row = html.split("<td>diagnosis</td>", 1)[1].split("</tr>", 1)[0]
    assert "yes <span class=warn>not declared: a NULL key is thresholded" in row
    row = html.split("<td>age</td>", 1)[1].split("</tr>", 1)[0]
    assert "<td>no</td>" in row and "warn" not in row
