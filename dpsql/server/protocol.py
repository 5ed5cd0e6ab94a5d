"""PostgreSQL v3 wire-protocol codec: frontend message parsing and backend message building.

Pure functions over bytes, no I/O, so the framing rules (lengths, terminators, caps) are tested
on their own. Every malformed input raises :class:`ProtocolViolation` (SQLSTATE 08P01), which
the session answers with an ErrorResponse and a disconnect.
"""

from __future__ import annotations

import builtins
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PROTOCOL_V3 = 196608  # 3.0
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102

# Messages are capped so one client cannot make the server buffer unbounded input.
DEFAULT_MAX_MESSAGE = 1 << 20
STARTUP_MAX = 10_000  # PostgreSQL's own limit for the startup packet

_I16 = struct.Struct("!h")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")


class ProtocolViolation(Exception):
    """A frontend message that breaks the protocol; the connection is closed after reporting."""

    sqlstate = "08P01"

    def __init__(self, message: str, sqlstate: str = "08P01") -> None:
        super().__init__(message)
        self.message = message
        self.sqlstate = sqlstate


class Reader:
    """Cursor over one message body; every read checks the bounds."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise ProtocolViolation("message is shorter than its contents declare")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def byte(self) -> int:
        return self._take(1)[0]

    def int16(self) -> int:
        return _I16.unpack(self._take(2))[0]

    def int32(self) -> int:
        return _I32.unpack(self._take(4))[0]

    def uint32(self) -> int:
        return _U32.unpack(self._take(4))[0]

    def bytes(self, n: int) -> bytes:
        return self._take(n)

    def cstring(self) -> str:
        end = self.data.find(b"\x00", self.pos)
        if end < 0:
            raise ProtocolViolation("unterminated string in message")
        raw = self.data[self.pos : end]
        self.pos = end + 1
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolViolation(
                "invalid byte sequence for encoding UTF8", sqlstate="22021"
            ) from None

    def rest(self) -> builtins.bytes:  # builtins: `bytes` here names the method above
        chunk = self.data[self.pos :]
        self.pos = len(self.data)
        return chunk

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolViolation("message has trailing bytes beyond its contents")


# --------------------------------------------------------------------------------------------
# Frontend messages


@dataclass(frozen=True)
class Startup:
    """A StartupMessage: protocol version 3.0 and its key/value parameters."""

    params: Mapping[str, str]


@dataclass(frozen=True)
class CancelKey:
    pid: int
    secret: int


@dataclass(frozen=True)
class Parse:
    name: str
    query: str
    param_oids: tuple[int, ...]


@dataclass(frozen=True)
class Bind:
    portal: str
    statement: str
    param_formats: tuple[int, ...]
    params: tuple[bytes | None, ...]
    result_formats: tuple[int, ...]


@dataclass(frozen=True)
class Describe:
    kind: str  # "S" statement or "P" portal
    name: str


@dataclass(frozen=True)
class Execute:
    portal: str
    max_rows: int


@dataclass(frozen=True)
class Close:
    kind: str
    name: str


def parse_startup_packet(body: bytes) -> Startup | CancelKey | int:
    """Body of an untyped startup-phase packet (after its length word).

    Returns a Startup, a CancelKey, or the bare request code (SSLRequest / GSSENCRequest).
    """
    r = Reader(body)
    code = r.int32()
    if code in (SSL_REQUEST, GSSENC_REQUEST):
        r.end()
        return code
    if code == CANCEL_REQUEST:
        key = CancelKey(r.int32(), r.int32())
        r.end()
        return key
    if code >> 16 != 3:
        raise ProtocolViolation(
            f"unsupported frontend protocol {code >> 16}.{code & 0xFFFF}: "
            "server supports 3.0 to 3.0",
            sqlstate="0A000",
        )
    params: dict[str, str] = {}
    while True:
        name = r.cstring()
        if name == "":
            break
        params[name] = r.cstring()
    r.end()
    return Startup(params)


def parse_parse(body: bytes) -> Parse:
    r = Reader(body)
    name = r.cstring()
    query = r.cstring()
    n = r.int16()
    if n < 0:
        raise ProtocolViolation("negative parameter count in Parse")
    oids = tuple(r.uint32() for _ in range(n))
    r.end()
    return Parse(name, query, oids)


def parse_bind(body: bytes) -> Bind:
    r = Reader(body)
    portal = r.cstring()
    statement = r.cstring()
    nfmt = r.int16()
    if nfmt < 0:
        raise ProtocolViolation("negative format count in Bind")
    formats = tuple(r.int16() for _ in range(nfmt))
    nparams = r.int16()
    if nparams < 0:
        raise ProtocolViolation("negative parameter count in Bind")
    params: list[bytes | None] = []
    for _ in range(nparams):
        size = r.int32()
        if size == -1:
            params.append(None)
        elif size < 0:
            raise ProtocolViolation("invalid parameter length in Bind")
        else:
            params.append(r.bytes(size))
    nres = r.int16()
    if nres < 0:
        raise ProtocolViolation("negative result format count in Bind")
    res_formats = tuple(r.int16() for _ in range(nres))
    r.end()
    for f in formats + res_formats:
        if f not in (0, 1):
            raise ProtocolViolation(f"unsupported format code: {f}", sqlstate="22023")
    return Bind(portal, statement, formats, tuple(params), res_formats)


def _statement_or_portal(body: bytes, message: str) -> tuple[str, str]:
    """The ('S' | 'P', name) body shared by Describe and Close."""
    r = Reader(body)
    kind = chr(r.byte())
    name = r.cstring()
    r.end()
    if kind not in ("S", "P"):
        raise ProtocolViolation(f"invalid {message} message subtype {kind!r}")
    return kind, name


def parse_describe(body: bytes) -> Describe:
    return Describe(*_statement_or_portal(body, "DESCRIBE"))


def parse_close(body: bytes) -> Close:
    return Close(*_statement_or_portal(body, "CLOSE"))


def parse_execute(body: bytes) -> Execute:
    r = Reader(body)
    portal = r.cstring()
    max_rows = r.int32()
    r.end()
    return Execute(portal, max_rows)


def parse_query(body: bytes) -> str:
    r = Reader(body)
    text = r.cstring()
    r.end()
    return text


def parse_sasl_initial(body: bytes) -> tuple[str, bytes]:
    r = Reader(body)
    mechanism = r.cstring()
    size = r.int32()
    data = b"" if size == -1 else r.bytes(size)
    r.end()
    return mechanism, data


# --------------------------------------------------------------------------------------------
# Backend messages


def message(kind: bytes, payload: bytes = b"") -> bytes:
    return kind + _I32.pack(len(payload) + 4) + payload


def cstr(text: str) -> bytes:
    return text.encode("utf-8") + b"\x00"


def authentication_ok() -> bytes:
    return message(b"R", _I32.pack(0))


def authentication_sasl(mechanisms: Iterable[str]) -> bytes:
    return message(b"R", _I32.pack(10) + b"".join(cstr(m) for m in mechanisms) + b"\x00")


def authentication_sasl_continue(data: bytes) -> bytes:
    return message(b"R", _I32.pack(11) + data)


def authentication_sasl_final(data: bytes) -> bytes:
    return message(b"R", _I32.pack(12) + data)


def parameter_status(name: str, value: str) -> bytes:
    return message(b"S", cstr(name) + cstr(value))


def backend_key_data(pid: int, secret: int) -> bytes:
    return message(b"K", _I32.pack(pid) + _I32.pack(secret))


def ready_for_query(status: str) -> bytes:
    return message(b"Z", status.encode("ascii"))


@dataclass(frozen=True)
class Field:
    """One column of a RowDescription."""

    name: str
    type_oid: int
    type_size: int = -1
    type_modifier: int = -1
    table_oid: int = 0
    column: int = 0
    format: int = 0


def row_description(fields: Sequence[Field]) -> bytes:
    parts = [_I16.pack(len(fields))]
    for f in fields:
        parts.append(
            cstr(f.name)
            + struct.pack(
                "!ihihih",
                f.table_oid,
                f.column,
                f.type_oid,
                f.type_size,
                f.type_modifier,
                f.format,
            )
        )
    return message(b"T", b"".join(parts))


def data_row(values: Sequence[bytes | None]) -> bytes:
    parts = [_I16.pack(len(values))]
    for v in values:
        if v is None:
            parts.append(_I32.pack(-1))
        else:
            parts.append(_I32.pack(len(v)) + v)
    return message(b"D", b"".join(parts))


def command_complete(tag: str) -> bytes:
    return message(b"C", cstr(tag))


def empty_query_response() -> bytes:
    return message(b"I")


def parse_complete() -> bytes:
    return message(b"1")


def bind_complete() -> bytes:
    return message(b"2")


def close_complete() -> bytes:
    return message(b"3")


def no_data() -> bytes:
    return message(b"n")


def portal_suspended() -> bytes:
    return message(b"s")


def parameter_description(oids: Sequence[int]) -> bytes:
    return message(b"t", _I16.pack(len(oids)) + b"".join(_U32.pack(o) for o in oids))


def _fields(severity: str, sqlstate: str, text: str, extra: Mapping[str, str]) -> bytes:
    parts = [
        b"S" + cstr(severity),
        b"V" + cstr(severity),
        b"C" + cstr(sqlstate),
        b"M" + cstr(text),
    ]
    for code, value in extra.items():
        if value:
            parts.append(code.encode("ascii") + cstr(value))
    return b"".join(parts) + b"\x00"


def error_response(
    sqlstate: str,
    text: str,
    *,
    severity: str = "ERROR",
    hint: str | None = None,
    detail: str | None = None,
    position: int | None = None,
) -> bytes:
    """ErrorResponse; ``position`` is PostgreSQL's 1-based character index into the query."""
    extra = {"D": detail or "", "H": hint or "", "P": str(position) if position else ""}
    return message(b"E", _fields(severity, sqlstate, text, extra))


def notice_response(
    sqlstate: str, text: str, *, hint: str | None = None, severity: str = "NOTICE"
) -> bytes:
    """NoticeResponse: the same fields, in the same order, as :func:`_fields` writes (a DP
    answer sends one or two a query, so they are written out here in one expression)."""
    sev = severity.encode("utf-8")
    payload = b"S%s\x00V%s\x00C%s\x00M%s\x00%s\x00" % (
        sev,
        sev,
        sqlstate.encode("utf-8"),
        text.encode("utf-8"),
        b"H" + hint.encode("utf-8") + b"\x00" if hint else b"",
    )
    return b"N" + _I32.pack(len(payload) + 4) + payload


def parse_error_fields(payload: bytes) -> dict[str, str]:
    """Decode ErrorResponse/NoticeResponse fields (used by tests and the fuzzer)."""
    out: dict[str, str] = {}
    r = Reader(payload)
    while True:
        code = r.byte()
        if code == 0:
            break
        out[chr(code)] = r.cstring()
    return out
