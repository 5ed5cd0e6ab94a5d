"""The curator page over HTTP: standard library only (``http.server``), read-only, operator-only.

- **Who**: HTTP Basic with the operator's name (``operator`` unless told otherwise) and a
  token: read from a private file (``--admin-token-file``), or random and printed once at
  start. Both are compared in constant time (:func:`hmac.compare_digest`). The operator's
  name may not be an analyst's (a login of the users file or a name in the ledger): such a
  server refuses to start, so no analyst credential can ever open the page. Anything else is
  401, the same answer for every wrong name or token.
- **Where**: 127.0.0.1 unless told otherwise; the page is plain HTTP (use an SSH tunnel or a
  TLS proxy to reach it from elsewhere).
- **What**: ``GET`` / ``HEAD`` of ``/`` only; every other method is 405 and changes nothing.
  The page has no script (``Content-Security-Policy: default-src 'none'``), is never cached
  (``Cache-Control: no-store``) and never framed.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import os
import secrets
import stat
import threading
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from dpsql.admin import DEFAULT_USER
from dpsql.admin.page import Reader, esc, render

log = logging.getLogger("dpsql.admin")
MIN_TOKEN = 16
MAX_LIMIT = 10_000
REALM = "dpsql curator"

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
    "img-src data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


class AdminError(Exception):
    """A curator page that cannot start (bad token file, an analyst's name as operator)."""


def read_token(path: str | os.PathLike[str]) -> str:
    """The operator's token: the first line of a file only its owner can read."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise AdminError(f"cannot read the token file {str(file)!r}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AdminError(
            f"the token file {str(file)!r} is readable by others (mode "
            f"{stat.S_IMODE(mode):04o}): chmod 600 it"
        )
    lines = text.splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < MIN_TOKEN:
        raise AdminError(
            f"the token in {str(file)!r} is shorter than {MIN_TOKEN} characters: write a "
            "random one, e.g. python -c 'import secrets; print(secrets.token_urlsafe(24))'"
        )
    return token


def new_token() -> str:
    return secrets.token_urlsafe(24)


class AdminServer:
    """Serves the curator page from a thread (:meth:`start`) until :meth:`close`."""

    def __init__(
        self,
        reader: Reader,
        *,
        token: str,
        user: str = DEFAULT_USER,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if len(token) < MIN_TOKEN:
            raise AdminError(f"the operator token must have at least {MIN_TOKEN} characters")
        if not user or ":" in user:
            raise AdminError("the operator's name must be non-empty and contain no ':'")
        if user in reader.analyst_names():
            raise AdminError(
                f"{user!r} is an analyst (a login or a name in the ledger): the curator page "
                "takes operator credentials only; choose another --admin-user"
            )
        self.reader = reader
        self.user = user
        self._secret = f"{user}:{token}".encode()
        self._httpd = ThreadingHTTPServer((host, port), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.admin = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}/"

    def start(self) -> AdminServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="dpsql-admin", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        self.reader.close()

    def authorized(self, header: str | None) -> bool:
        """HTTP Basic with the operator's name and token, compared in constant time."""
        scheme, _, value = (header or "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        return hmac.compare_digest(given, self._secret)


class _Handler(BaseHTTPRequestHandler):
    server_version = "dpsql-curator"
    sys_version = ""

    @property
    def admin(self) -> AdminServer:
        return self.server.admin  # type: ignore[attr-defined,no-any-return]

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def _send(self, status: HTTPStatus, body: str, *, extra: dict[str, str] | None = None) -> None:
        data = body.encode("utf-8", "replace")
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for name, value in {**HEADERS, **(extra or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _plain(self, status: HTTPStatus, text: str, **extra: str) -> None:
        self._send(
            status,
            f"<!DOCTYPE html><title>{status.value} {esc(status.phrase)}</title>"
            f"<h1>{status.value} {esc(status.phrase)}</h1><p>{esc(text)}</p>",
            extra=extra,
        )

    def do_GET(self) -> None:
        if not self.admin.authorized(self.headers.get("Authorization")):
            log.warning(
                "curator page: refused an unauthenticated request from %s", self.address_string()
            )
            self._plain(
                HTTPStatus.UNAUTHORIZED,
                "The curator page is for the operator: log in with the operator's name and "
                "token (printed when dpsql started, or in its --admin-token-file). Analysts' "
                "logins are refused.",
                **{"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'},
            )
            return
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/":
            self._plain(HTTPStatus.NOT_FOUND, "The curator page is at /.")
            return
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        analyst = (query.get("analyst") or [""])[-1] or None
        try:
            limit = int((query.get("limit") or ["200"])[-1])
        except ValueError:
            limit = -1
        if not 1 <= limit <= MAX_LIMIT:
            self._plain(HTTPStatus.BAD_REQUEST, f"limit must be an integer in 1..{MAX_LIMIT}")
            return
        try:
            page = render(self.admin.reader.snapshot(analyst=analyst, limit=limit))
        except Exception:
            log.exception("curator page: rendering failed")
            self._plain(HTTPStatus.INTERNAL_SERVER_ERROR, "The page failed; see dpsql's log.")
            return
        self._send(HTTPStatus.OK, page)

    do_HEAD = do_GET

    def _read_only(self) -> None:
        self._plain(
            HTTPStatus.METHOD_NOT_ALLOWED,
            "The curator page is read-only: GET and HEAD only.",
            Allow="GET, HEAD",
        )

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _read_only
