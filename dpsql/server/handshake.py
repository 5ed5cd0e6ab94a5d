"""A wire session's start: the startup packet (and SSLRequest / GSSENCRequest / CancelRequest),
SCRAM-SHA-256 login with the login throttle and limits, and opening the analyst's backends
(the service session and the catalog shadow) with the startup parameters applied."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from typing import Any

from dpsql.server import protocol as p
from dpsql.server.backend import DpBackend
from dpsql.server.scram import MECHANISM, ScramError, ScramExchange
from dpsql.server.settings import REPORTED, SessionSettings, SettingError
from dpsql.server.wire_errors import as_sql_error

log = logging.getLogger("dpsql.server")


class Handshake:
    """Startup, login and backends for one session (``session``: the wire session, typed
    loosely so this module does not import it)."""

    def __init__(self, session: Any) -> None:
        self.session = session

    async def startup(self) -> p.Startup | None:
        s = self.session
        tls_done = False
        while True:
            header = await s._read_exact(4)
            length = struct.unpack("!i", header)[0]
            if length < 8 or length > p.STARTUP_MAX:
                await s.fatal("08P01", "invalid length of startup packet")
                return None
            msg = p.parse_startup_packet(await s._read_exact(length - 4))
            if msg == p.SSL_REQUEST:
                if tls_done or s.server.ssl_context is None:
                    s.send(b"N")
                    await s.flush()
                    continue
                if s.reader._buffer:  # type: ignore[attr-defined]
                    # Plaintext bytes sent after SSLRequest would be trusted as if encrypted
                    # (CVE-2021-23214): refuse.
                    await s.fatal("08P01", "received unencrypted data after SSL request")
                    return None
                s.send(b"S")
                await s.flush()
                s._auth_stage = "tls"
                await s.writer.start_tls(s.server.ssl_context)
                s._auth_stage = "startup"
                tls_done = True
                continue
            if msg == p.GSSENC_REQUEST:
                s.send(b"N")
                await s.flush()
                continue
            if isinstance(msg, p.CancelKey):
                s.server.cancel(msg.pid, msg.secret)
                return None
            assert isinstance(msg, p.Startup)
            if s.server.require_tls and not tls_done:
                await s.fatal(
                    "28000", "this server requires TLS", hint="connect with sslmode=require"
                )
                return None
            return msg

    async def authenticate(self, startup: p.Startup) -> bool:
        s = self.session
        user = startup.params.get("user", "")
        if not user:
            await s.fatal("28000", "no PostgreSQL user name specified in startup packet")
            return False
        s._auth_stage = "login"
        failed = f'password authentication failed for user "{user}"'
        try:
            verifier = s.server.users.get(user)
        except Exception:
            log.exception("cannot read the users file")
            verifier = None
        exchange = ScramExchange(verifier, mock_secret=s.server.mock_secret, user=user)
        s.send(p.authentication_sasl([MECHANISM]))
        await s.flush()
        try:
            kind, body = await s.read_message()
            if kind != b"p":
                await s.fatal("28000", "authentication required: expected a SASL response")
                return False
            mechanism, data = p.parse_sasl_initial(body)
            if mechanism != MECHANISM:
                await s.fatal(
                    "28000",
                    f"SASL mechanism {mechanism!r} is not supported",
                    hint="use SCRAM-SHA-256",
                )
                return False
            s.send(p.authentication_sasl_continue(exchange.first(data)))
            await s.flush()
            kind, body = await s.read_message()
            if kind != b"p":
                await s.fatal("28000", "authentication required: expected a SASL response")
                return False
            final = exchange.final(body)
        except ScramError as exc:
            # the log (not the client) says whether the user exists
            log.info(
                "login failed for %r from %s: %s",
                user,
                s.peer,
                "unknown user" if exchange.mock else exc.message,
            )
            # answered after a delay growing with the address's and the login's failures
            # (dpsql.server.connections.LoginThrottle): no thread held, the slot kept
            delay = s.server.throttle.failed(s.address, user)
            if s._auth_deadline is not None:
                s._auth_deadline.reschedule(None)
            await asyncio.sleep(delay)
            if exc.sqlstate == "28P01":
                await s.fatal("28P01", failed)
            else:
                await s.fatal(exc.sqlstate, exc.message)
            return False
        s.server.throttle.succeeded(user)
        refusal = s.server.admit_login(s, user)
        if refusal is not None:
            await s.fatal("53300", *refusal)
            return False
        s.send(p.authentication_sasl_final(final))
        s.send(p.authentication_ok())
        s.user = user
        s.database = startup.params.get("database") or user
        log.info("analyst %r connected from %s (pid %d)", user, s.peer, s.pid)
        return True

    async def open_backends(self, startup: p.Startup) -> bool:
        s = self.session
        try:
            opened = await s._blocking(s.server.open_session, s.user, scheduled=False)
        except Exception as exc:
            err = as_sql_error(exc)
            await s.fatal(err.sqlstate, err.message, err.hint)
            return False
        s.dp = DpBackend(opened)
        s.shadow = await s._blocking(s.server.shadow.cursor, scheduled=False)
        s.settings = SessionSettings(s.user, startup.params.get("application_name", ""))
        for key, value in _startup_options(startup.params).items():
            with contextlib.suppress(SettingError):
                s.settings.set(key, value)
        for name in REPORTED:
            s.send(p.parameter_status(name, s.settings.values[name]))
        s.send(p.backend_key_data(s.pid, s.secret))
        s.send(p.ready_for_query(s.tx))
        await s.flush()
        return True


def _startup_options(params: dict[str, str] | Any) -> dict[str, str]:
    """``options=-c key=value ...`` plus plain startup parameters such as DateStyle."""
    out: dict[str, str] = {}
    for key, value in params.items():
        if key in ("user", "database", "options", "replication", "application_name"):
            continue
        out[key] = value
    options = params.get("options", "")
    tokens = options.replace("--", "-c ").split()
    for i, tok in enumerate(tokens):
        if tok == "-c" and i + 1 < len(tokens) and "=" in tokens[i + 1]:
            key, _, value = tokens[i + 1].partition("=")
            out[key] = value
        elif tok.startswith("-c") and "=" in tok[2:]:
            key, _, value = tok[2:].partition("=")
            out[key] = value
    return out
