"""Helpers for testing and benchmarking the server: a tiny blocking wire-protocol client.

The client speaks just enough of the protocol (startup, SCRAM-SHA-256, simple and extended
queries) to drive the server byte by byte, including deliberately broken input, without any
third-party driver.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from dpsql.server import protocol as p
from dpsql.server.scram import normalize_password


class ServerClosed(Exception):
    """The server closed the connection."""


@dataclass
class Reply:
    """Everything the server sent up to a ReadyForQuery (or the connection's end)."""

    messages: list[tuple[bytes, bytes]] = field(default_factory=list)
    status: str | None = None

    def kinds(self) -> bytes:
        return b"".join(k for k, _ in self.messages)

    def errors(self) -> list[dict[str, str]]:
        return [p.parse_error_fields(body) for k, body in self.messages if k == b"E"]

    def notices(self) -> list[dict[str, str]]:
        return [p.parse_error_fields(body) for k, body in self.messages if k == b"N"]

    def rows(self) -> list[list[bytes | None]]:
        out = []
        for kind, body in self.messages:
            if kind != b"D":
                continue
            r = p.Reader(body)
            row: list[bytes | None] = []
            for _ in range(r.int16()):
                size = r.int32()
                row.append(None if size < 0 else r.bytes(size))
            out.append(row)
        return out

    def text_rows(self) -> list[list[str | None]]:
        return [[None if v is None else v.decode() for v in row] for row in self.rows()]

    def columns(self) -> list[tuple[str, int, int]]:
        """(name, type OID, format) of the first RowDescription."""
        for kind, body in self.messages:
            if kind == b"T":
                r = p.Reader(body)
                cols = []
                for _ in range(r.int16()):
                    name = r.cstring()
                    _table, _col, oid, _size, _mod, fmt = struct.unpack("!ihihih", r.bytes(18))
                    cols.append((name, oid, fmt))
                return cols
        return []

    def tags(self) -> list[str]:
        return [body[:-1].decode() for k, body in self.messages if k == b"C"]


class RawClient:
    """A blocking protocol-level client. ``connect`` performs startup and SCRAM login."""

    def __init__(self, host: str, port: int, *, timeout: float = 20.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.params: dict[str, str] = {}
        self.pid = 0
        self.secret = 0

    # framing ---------------------------------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        self.sock.sendall(p.message(kind, payload))

    def _recv_exact(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self.sock.recv(n)
            if not chunk:
                raise ServerClosed()
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def recv(self) -> tuple[bytes, bytes]:
        header = self._recv_exact(5)
        length = struct.unpack("!i", header[1:])[0]
        return header[:1], self._recv_exact(length - 4)

    def until_ready(self) -> Reply:
        reply = Reply()
        try:
            while True:
                kind, body = self.recv()
                reply.messages.append((kind, body))
                if kind == b"Z":
                    reply.status = body.decode()
                    return reply
        except (ServerClosed, ConnectionError):
            return reply

    def until(self, *kinds: bytes) -> Reply:
        reply = Reply()
        while True:
            kind, body = self.recv()
            reply.messages.append((kind, body))
            if kind in kinds or kind == b"E":
                return reply

    def closed_by_server(self) -> bool:
        """True when the server has closed the connection (reads EOF), within the timeout."""
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionError, OSError):
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send(b"X")
        self.sock.close()

    # startup and authentication -------------------------------------------------------------
    def startup(self, user: str, database: str = "visits", **extra: str) -> None:
        params = {"user": user, "database": database, **extra}
        body = struct.pack("!i", p.PROTOCOL_V3)
        body += b"".join(p.cstr(k) + p.cstr(v) for k, v in params.items()) + b"\x00"
        self.send_raw(struct.pack("!i", len(body) + 4) + body)

    def login(self, user: str, password: str, database: str = "visits") -> Reply:
        """Startup + SCRAM; returns the messages up to ReadyForQuery (or the error)."""
        self.startup(user, database)
        kind, body = self.recv()
        if kind == b"E":
            return Reply([(kind, body)])
        assert kind == b"R" and struct.unpack("!i", body[:4])[0] == 10, (kind, body)
        client_nonce = base64.b64encode(os.urandom(18)).decode()
        first_bare = f"n=,r={client_nonce}"
        first = b"n,," + first_bare.encode()
        self.send(b"p", p.cstr("SCRAM-SHA-256") + struct.pack("!i", len(first)) + first)
        kind, body = self.recv()
        if kind == b"E":
            return Reply([(kind, body)])
        server_first = body[4:].decode()
        attrs = dict(part.split("=", 1) for part in server_first.split(","))
        salt = base64.b64decode(attrs["s"])
        salted = hashlib.pbkdf2_hmac("sha256", normalize_password(password), salt, int(attrs["i"]))
        client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
        stored = hashlib.sha256(client_key).digest()
        without_proof = f"c=biws,r={attrs['r']}"
        auth = f"{first_bare},{server_first},{without_proof}".encode()
        signature = hmac.new(stored, auth, hashlib.sha256).digest()
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self.send(b"p", f"{without_proof},p={base64.b64encode(proof).decode()}".encode())
        reply = self.until_ready()
        for kind, body in reply.messages:
            if kind == b"S":
                r = p.Reader(body)
                key = r.cstring()
                self.params[key] = r.cstring()
            elif kind == b"K":
                self.pid, self.secret = struct.unpack("!ii", body)
        return reply

    # queries ------------------------------------------------------------------------------
    def query(self, sql: str) -> Reply:
        self.send(b"Q", p.cstr(sql))
        return self.until_ready()

    def parse(self, sql: str, name: str = "", oids: Sequence[int] = ()) -> None:
        payload = p.cstr(name) + p.cstr(sql) + struct.pack("!h", len(oids))
        payload += b"".join(struct.pack("!I", o) for o in oids)
        self.send(b"P", payload)

    def bind(
        self,
        params: Sequence[bytes | None] = (),
        *,
        portal: str = "",
        statement: str = "",
        param_formats: Sequence[int] = (),
        result_formats: Sequence[int] = (),
    ) -> None:
        payload = p.cstr(portal) + p.cstr(statement)
        payload += struct.pack("!h", len(param_formats))
        payload += b"".join(struct.pack("!h", f) for f in param_formats)
        payload += struct.pack("!h", len(params))
        for value in params:
            payload += (
                struct.pack("!i", -1) if value is None else (struct.pack("!i", len(value)) + value)
            )
        payload += struct.pack("!h", len(result_formats))
        payload += b"".join(struct.pack("!h", f) for f in result_formats)
        self.send(b"B", payload)

    def describe(self, kind: str, name: str = "") -> None:
        self.send(b"D", kind.encode() + p.cstr(name))

    def execute(self, portal: str = "", max_rows: int = 0) -> None:
        self.send(b"E", p.cstr(portal) + struct.pack("!i", max_rows))

    def close_object(self, kind: str, name: str = "") -> None:
        self.send(b"C", kind.encode() + p.cstr(name))

    def sync(self) -> Reply:
        self.send(b"S")
        return self.until_ready()


def cancel_request(host: str, port: int, pid: int, secret: int) -> None:
    """Send a CancelRequest on a fresh connection, as libpq does."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(struct.pack("!iiii", 16, p.CANCEL_REQUEST, pid, secret))
        sock.settimeout(10)
        with contextlib.suppress(OSError):
            sock.recv(1)


def cancel_until_answered(client: RawClient, host: str, port: int, tries: int = 100) -> Reply:
    """Re-send the client's CancelRequest until its running query answers (up to ReadyForQuery).

    A cancel that arrives before the query has started is ignored, as in PostgreSQL, so one
    cancel is not enough for a test that has no other way to know the query is running.
    """
    timeout = client.sock.gettimeout()
    client.sock.settimeout(0.2)
    try:
        for _ in range(tries):
            cancel_request(host, port, client.pid, client.secret)
            try:
                first = client.recv()
            except TimeoutError:
                continue
            client.sock.settimeout(timeout)
            reply = client.until_ready()
            reply.messages.insert(0, first)
            return reply
    finally:
        client.sock.settimeout(timeout)
    raise TimeoutError("the query was never cancelled")
