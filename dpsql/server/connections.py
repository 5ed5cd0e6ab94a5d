"""Connections between analysts: per-login and per-address limits, the authentication timeout,
login throttling, and refusing a connection only after its SSL negotiation.

Before this module one login could hold every connection slot, an unauthenticated socket held
one for up to 60 s, failed logins ran at ~133/s with no delay, and past ``max_connections`` the
``53300`` answer was written before the answer to libpq's ``SSLRequest`` (``sslmode=prefer``,
libpq's default), so those clients saw "received invalid response to SSL negotiation" instead
of "too many clients".

- **Limits** (:class:`ConnectionLimits`): at most ``max_connections_per_address`` connections
  from one IP address (counted from the accept, so unauthenticated sockets count) and at most
  ``max_connections_per_login`` authenticated sessions of one login (checked after its password,
  as PostgreSQL checks a role's ``CONNECTION LIMIT``, so nobody can lock a login out by naming
  it). Both refusals are ``53300``, sent after the SSL negotiation.
- **Authentication timeout**: startup, TLS handshake and SCRAM must finish within
  ``auth_timeout`` seconds (5): ``08P01`` before the startup packet, ``28000`` during SCRAM,
  a plain close in the middle of a TLS handshake (nothing can be written there).
- **Throttling** (:class:`LoginThrottle`): each failed login from an address, and for a login
  name, doubles the delay before the failure is answered (``login_delay`` · 2^(n-1), at most
  ``login_delay_max``), whichever of the two is longer; the counts are forgotten after
  ``login_forget`` quiet seconds, and a success clears its login's count. The delay is an
  ``asyncio.sleep``: no thread is held, other connections are served meanwhile, and the
  connection keeps its slot (counted against its address) while it waits, so the rate of
  failures one address can get answered is at most ``max_connections_per_address`` /
  ``login_delay_max`` per second.

``[server]`` keys of the policy file are read by :func:`server_settings_from_section` together
with the scheduler's (:mod:`dpsql.server.fairness`); an unknown key is refused with its path.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import ssl
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dpsql.server import protocol as p
from dpsql.server.fairness import SERVER_KEYS, FairnessError, FairnessLimits

CONNECTION_KEYS = {
    "max_connections_per_login": "authenticated sessions one login may hold (default 0: a "
    "quarter of --max-connections, at least 1)",
    "max_connections_per_address": "connections from one IP address, authenticated or not "
    "(default 0: half of --max-connections, at least 1)",
    "auth_timeout": "seconds a connection has to finish its startup, TLS handshake and login "
    "(default 5)",
    "login_delay": "seconds the first failed login is answered after; each further failure "
    "from the address or for the login doubles it (default 0.1)",
    "login_delay_max": "the longest delay before a failed login is answered (default 4)",
    "login_forget": "quiet seconds after which an address's or login's failures are forgotten "
    "(default 60)",
}

TOO_MANY_CLIENTS = "sorry, too many clients already"


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-login and per-address connection limits, the auth timeout and login throttling."""

    max_connections_per_login: int = 0  # 0: max(1, max_connections // 4)
    max_connections_per_address: int = 0  # 0: max(1, max_connections // 2)
    auth_timeout: float = 5.0
    login_delay: float = 0.1
    login_delay_max: float = 4.0
    login_forget: float = 60.0

    def __post_init__(self) -> None:
        problems = []
        for key in ("max_connections_per_login", "max_connections_per_address"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{key} must be an integer >= 0 (0: the default share)")
        for key, low, high in (
            ("auth_timeout", 0.0, 3600.0),
            ("login_delay", 0.0, 60.0),
            ("login_delay_max", 0.0, 60.0),
            ("login_forget", 0.0, 86400.0),
        ):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or not low <= value <= high
                or (key == "auth_timeout" and value == 0)
            ):
                bound = f"> 0 and at most {high:g}" if key == "auth_timeout" else f"{low:g}"
                problems.append(
                    f"{key} must be a number of seconds "
                    + (bound if key == "auth_timeout" else f"from {bound} to {high:g}")
                )
        if not problems and self.login_delay > self.login_delay_max:
            problems.append("login_delay must be at most login_delay_max")
        if problems:
            raise FairnessError("; ".join(problems), "22023")

    def per_login(self, max_connections: int) -> int:
        return self.max_connections_per_login or max(1, max_connections // 4)

    def per_address(self, max_connections: int) -> int:
        return self.max_connections_per_address or max(1, max_connections // 2)

    @classmethod
    def from_section(cls, section: Mapping[str, Any], where: str = "[server]") -> ConnectionLimits:
        values = dict(section)
        for key in ("auth_timeout", "login_delay", "login_delay_max", "login_forget"):
            value = values.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                values[key] = float(value)
        try:
            return cls(**values)
        except FairnessError as exc:
            raise FairnessError(f"{where}: {exc.message}", "22023") from None


def server_settings_from_section(
    section: Mapping[str, Any], where: str = "policy"
) -> tuple[FairnessLimits, ConnectionLimits]:
    """The scheduler's and the connections' settings from one ``[server]`` table; an unknown
    key or a bad value is refused naming ``server.<key>``."""
    if not isinstance(section, Mapping):
        raise FairnessError(f"{where}: server: must be a table", "22023", hint="write [server]")
    own = {f.name for f in fields(ConnectionLimits)}
    theirs = set(SERVER_KEYS) | {f.name for f in fields(FairnessLimits)}
    for key in section:
        if key not in own and key not in theirs:
            raise FairnessError(
                f"{where}: server.{key}: unknown key",
                "22023",
                hint="remove it or use one of: " + ", ".join(sorted(own | theirs)),
            )
    fairness = FairnessLimits.from_section(
        {k: v for k, v in section.items() if k in theirs}, f"{where}: [server]"
    )
    connections = ConnectionLimits.from_section(
        {k: v for k, v in section.items() if k in own}, f"{where}: [server]"
    )
    return fairness, connections


def server_settings_from_policy_file(path: str | Path) -> tuple[FairnessLimits, ConnectionLimits]:
    """The ``[server]`` table of a policy file (the defaults when it has none)."""
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return FairnessLimits(), ConnectionLimits()  # the policy loader reports these itself
    return server_settings_from_section(data.get("server", {}), f"policy file {str(path)!r}")


def limits_from_policy_file(path: str | Path) -> FairnessLimits:
    """The scheduler's part of a policy file's ``[server]`` table (the defaults when it has
    none); the table's connection limits are read and checked with it, here, so that the
    scheduler (dpsql.server.fairness) imports nothing of the connection layer above it."""
    return server_settings_from_policy_file(path)[0]


class LoginThrottle:
    """Failed-login counts per address and per login name, and the delay they earn.

    Bounded: at most ``capacity`` keys are remembered (the least recently failed go first), so
    a spray of made-up login names cannot grow it without bound."""

    def __init__(
        self,
        limits: ConnectionLimits,
        *,
        capacity: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.capacity = capacity
        self.clock = clock
        self._failures: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()

    def _count(self, key: tuple[str, str], now: float) -> int:
        entry = self._failures.get(key)
        if entry is None or now - entry[1] > self.limits.login_forget:
            return 0
        return entry[0]

    def delay_for(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        limits = self.limits
        return min(limits.login_delay_max, limits.login_delay * 2.0 ** min(failures - 1, 60))

    def failed(self, address: str, login: str) -> float:
        """Record one failure; returns the seconds to wait before answering it."""
        now = self.clock()
        counts = []
        for key in (("address", address), ("login", login)):
            count = self._count(key, now) + 1
            self._failures[key] = (count, now)
            self._failures.move_to_end(key)
            counts.append(count)
        while len(self._failures) > self.capacity:
            self._failures.popitem(last=False)
        return self.delay_for(max(counts))

    def succeeded(self, login: str) -> None:
        """A correct password clears its login's failures (not its address's: one valid login
        must not reset the count of guesses at other logins from the same address)."""
        self._failures.pop(("login", login), None)

    def failures(self, address: str, login: str | None = None) -> int:
        now = self.clock()
        count = self._count(("address", address), now)
        if login is not None:
            count = max(count, self._count(("login", login), now))
        return count


def address_of(peer: Any) -> str:
    """The IP address of a ``peername`` (the whole value for a Unix socket)."""
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return str(peer or "")


async def refuse_after_negotiation(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    ssl_context: ssl.SSLContext | None,
    sqlstate: str,
    message: str,
    *,
    hint: str | None = None,
    timeout: float = 5.0,
    on_cancel: Callable[[int, int], None] | None = None,
) -> None:
    """Answer ``SSLRequest``/``GSSENCRequest`` as usual (``S`` and a TLS handshake when the
    server has TLS, else ``N``), read the startup packet, then send the FATAL — what PostgreSQL
    does, and what libpq waits for: with ``sslmode=prefer`` it sends ``SSLRequest`` first and
    reads a FATAL in place of the answer as a broken negotiation. A ``CancelRequest`` is handed
    to ``on_cancel`` (a full server still lets a client cancel its query). Bounded by
    ``timeout``; the writer is closed at the end."""

    async def negotiate() -> bool:
        tls_done = False
        while True:
            header = await reader.readexactly(4)
            length = struct.unpack("!i", header)[0]
            if length < 8 or length > p.STARTUP_MAX:
                return True  # garbage: the FATAL says why it cannot connect anyway
            msg = p.parse_startup_packet(await reader.readexactly(length - 4))
            if msg == p.SSL_REQUEST and not tls_done and ssl_context is not None:
                if reader._buffer:  # type: ignore[attr-defined]  # CVE-2021-23214
                    return True
                writer.write(b"S")
                await writer.drain()
                await writer.start_tls(ssl_context)
                tls_done = True
                continue
            if msg in (p.SSL_REQUEST, p.GSSENC_REQUEST):
                writer.write(b"N")
                await writer.drain()
                continue
            if isinstance(msg, p.CancelKey):
                if on_cancel is not None:
                    on_cancel(msg.pid, msg.secret)
                return False
            return True

    try:
        async with asyncio.timeout(timeout):
            if await negotiate():
                writer.write(p.error_response(sqlstate, message, severity="FATAL", hint=hint))
                await writer.drain()
    except (
        TimeoutError,
        asyncio.IncompleteReadError,
        ConnectionError,
        OSError,
        ssl.SSLError,
        p.ProtocolViolation,
        RuntimeError,
    ):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def tls_server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The server's TLS context (as :func:`dpsql.server.server.tls_context`), for the
    ``--workers`` supervisor, which refuses connections itself and imports no engine."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


async def refuse_socket(
    sock: socket.socket,
    ssl_context: ssl.SSLContext | None,
    sqlstate: str,
    message: str,
    *,
    hint: str | None = None,
    timeout: float = 5.0,
    on_cancel: Callable[[int, int], None] | None = None,
) -> None:
    """:func:`refuse_after_negotiation` on an accepted socket (server-side TLS)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await refuse_after_negotiation(
                reader,
                writer,
                ssl_context,
                sqlstate,
                message,
                hint=hint,
                timeout=timeout,
                on_cancel=on_cancel,
            )
        finally:
            if not done.done():
                done.set_result(None)

    def factory() -> asyncio.StreamReaderProtocol:
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), run, loop=loop)

    transport, _ = await loop.connect_accepted_socket(factory, sock)
    try:
        await asyncio.wait_for(done, timeout + 1.0)
    except TimeoutError:
        pass
    finally:
        transport.close()
