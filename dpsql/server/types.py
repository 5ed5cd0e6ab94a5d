"""PostgreSQL type OIDs and the text/binary encodings of the values dpsql returns.

dpsql releases five value types (BIGINT, DOUBLE, VARCHAR, BOOLEAN, DATE); the catalog emulation
returns a few more (int2/int4, oid, name, arrays). Each maps to one PostgreSQL OID so clients
decode exactly what they were told in the RowDescription.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import math
import re
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass

BOOL = 16
BYTEA = 17
CHAR = 18
NAME = 19
INT8 = 20
INT2 = 21
INT4 = 23
TEXT = 25
OID = 26
JSON = 114
FLOAT4 = 700
FLOAT8 = 701
UNKNOWN = 705
BPCHAR = 1042
VARCHAR = 1043
DATE = 1082
TIME = 1083
TIMESTAMP = 1114
TIMESTAMPTZ = 1184
INTERVAL = 1186
NUMERIC = 1700
UUID = 2950

ARRAY_OF = {
    BOOL: 1000,
    NAME: 1003,
    INT2: 1005,
    INT4: 1007,
    TEXT: 1009,
    VARCHAR: 1015,
    INT8: 1016,
    FLOAT4: 1021,
    FLOAT8: 1022,
    OID: 1028,
    DATE: 1182,
    CHAR: 1002,
}
ELEMENT_OF = {v: k for k, v in ARRAY_OF.items()}


@dataclass(frozen=True)
class PgType:
    oid: int
    name: str
    size: int  # typlen: -1 for variable length
    category: str  # typcategory


PG_TYPES: dict[int, PgType] = {
    t.oid: t
    for t in (
        PgType(BOOL, "bool", 1, "B"),
        PgType(BYTEA, "bytea", -1, "U"),
        PgType(CHAR, "char", 1, "Z"),
        PgType(NAME, "name", 64, "S"),
        PgType(INT8, "int8", 8, "N"),
        PgType(INT2, "int2", 2, "N"),
        PgType(INT4, "int4", 4, "N"),
        PgType(TEXT, "text", -1, "S"),
        PgType(OID, "oid", 4, "N"),
        PgType(JSON, "json", -1, "U"),
        PgType(FLOAT4, "float4", 4, "N"),
        PgType(FLOAT8, "float8", 8, "N"),
        PgType(UNKNOWN, "unknown", -2, "X"),
        PgType(BPCHAR, "bpchar", -1, "S"),
        PgType(VARCHAR, "varchar", -1, "S"),
        PgType(DATE, "date", 4, "D"),
        PgType(TIME, "time", 8, "D"),
        PgType(TIMESTAMP, "timestamp", 8, "D"),
        PgType(TIMESTAMPTZ, "timestamptz", 8, "D"),
        PgType(INTERVAL, "interval", 16, "T"),
        PgType(NUMERIC, "numeric", -1, "N"),
        PgType(UUID, "uuid", 16, "U"),
    )
}
for _elem, _arr in ARRAY_OF.items():
    PG_TYPES[_arr] = PgType(_arr, "_" + PG_TYPES[_elem].name, -1, "A")

# dpsql's cursor.description type codes (and the policy's column types) -> OID
DPSQL_TYPE_OIDS = {
    "BIGINT": INT8,
    "DOUBLE": FLOAT8,
    "VARCHAR": TEXT,
    "BOOLEAN": BOOL,
    "DATE": DATE,
    "TIMESTAMP": TIMESTAMP,
    "INTEGER": INT4,
}
POLICY_TYPE_OIDS = {"int": INT8, "float": FLOAT8, "text": TEXT, "bool": BOOL, "date": DATE}

_DUCKDB_SCALARS = {
    "BIGINT": INT8,
    "INTEGER": INT4,
    "SMALLINT": INT2,
    "TINYINT": INT2,
    "UTINYINT": INT2,
    "USMALLINT": INT4,
    "UINTEGER": OID,  # the catalog stores oid columns as UINTEGER
    "UBIGINT": NUMERIC,
    "HUGEINT": NUMERIC,
    "UHUGEINT": NUMERIC,
    "DOUBLE": FLOAT8,
    "FLOAT": FLOAT4,
    "VARCHAR": TEXT,
    "BOOLEAN": BOOL,
    "DATE": DATE,
    "TIME": TIME,
    "TIMESTAMP": TIMESTAMP,
    "TIMESTAMP WITH TIME ZONE": TIMESTAMPTZ,
    "INTERVAL": INTERVAL,
    "BLOB": BYTEA,
    "UUID": UUID,
    "JSON": JSON,
    "NULL": TEXT,
}


def duckdb_type_oid(type_name: str) -> int:
    """OID for a DuckDB type string, e.g. 'BIGINT', 'VARCHAR[]', 'DECIMAL(18,3)'."""
    name = str(type_name).upper()
    if name.endswith("[]"):
        elem = duckdb_type_oid(name[:-2])
        return ARRAY_OF.get(elem, ARRAY_OF[TEXT])
    if name.startswith("DECIMAL"):
        return NUMERIC
    return _DUCKDB_SCALARS.get(name, TEXT)


def type_size(oid: int) -> int:
    t = PG_TYPES.get(oid)
    return t.size if t else -1


# --------------------------------------------------------------------------------------------
# Text output


def format_float(value: float) -> str:
    """float8out with extra_float_digits >= 1: the shortest exact representation."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    text = repr(float(value))
    if text.endswith(".0"):
        text = text[:-2]
    return text


def _array_item(value: object, elem: int) -> str:
    if value is None:
        return "NULL"
    text = encode_text(value, elem).decode("utf-8")
    if text == "" or re.search(r'[{},"\\\s]', text) or text.upper() == "NULL":
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def encode_text(value: object, oid: int) -> bytes:
    """PostgreSQL text output of a non-NULL value."""
    if isinstance(value, bool):
        return b"t" if value else b"f"
    if oid in ELEMENT_OF and isinstance(value, list | tuple):
        elem = ELEMENT_OF[oid]
        return ("{" + ",".join(_array_item(v, elem) for v in value) + "}").encode("utf-8")
    if isinstance(value, float):
        return format_float(value).encode("ascii")
    if isinstance(value, dt.datetime):
        text = value.isoformat(sep=" ")
        if value.tzinfo is not None and text.endswith("+00:00"):
            text = text[:-6] + "+00"
        return text.encode("ascii")
    if isinstance(value, dt.date | dt.time):
        return value.isoformat().encode("ascii")
    if isinstance(value, bytes | bytearray | memoryview):
        return b"\\x" + bytes(value).hex().encode("ascii")
    if isinstance(value, list | tuple):
        return ("{" + ",".join(_array_item(v, TEXT) for v in value) + "}").encode("utf-8")
    return str(value).encode("utf-8")


# --------------------------------------------------------------------------------------------
# Binary output

_EPOCH_DATE = dt.date(2000, 1, 1)
_EPOCH_TS = dt.datetime(2000, 1, 1)
_EPOCH_TSTZ = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


class UnsupportedBinary(Exception):
    """The client asked for a binary format this server does not produce or accept."""


def _numeric_binary(value: object) -> bytes:
    d = value if isinstance(value, decimal.Decimal) else decimal.Decimal(str(value))
    if d.is_nan():
        return struct.pack("!hhHH", 0, 0, 0xC000, 0)
    if not d.is_finite():
        raise UnsupportedBinary("binary output of an infinite numeric is not supported")
    sign = 0x4000 if d.is_signed() and d != 0 else 0
    exponent = d.as_tuple().exponent
    dscale = max(0, -exponent) if isinstance(exponent, int) else 0
    int_part, _, frac_part = format(abs(d), "f").partition(".")
    int_part = int_part.lstrip("0")
    int_part = "0" * (-len(int_part) % 4) + int_part
    frac_part += "0" * (-len(frac_part) % 4)
    groups = [int(int_part[i : i + 4]) for i in range(0, len(int_part), 4)]
    weight = len(groups) - 1
    groups += [int(frac_part[i : i + 4]) for i in range(0, len(frac_part), 4)]
    while groups and groups[0] == 0:
        groups.pop(0)
        weight -= 1
    while groups and groups[-1] == 0:
        groups.pop()
    if not groups:
        weight = 0
    return struct.pack(f"!hhHH{len(groups)}H", len(groups), weight, sign, dscale, *groups)


def _array_binary(values: list | tuple, elem: int) -> bytes:
    has_null = any(v is None for v in values)
    parts = [struct.pack("!iiI", 1, int(has_null), elem), struct.pack("!ii", len(values), 1)]
    for v in values:
        if v is None:
            parts.append(struct.pack("!i", -1))
        else:
            data = encode_binary(v, elem)
            parts.append(struct.pack("!i", len(data)) + data)
    return b"".join(parts)


_BINARY: dict[int, Callable[[object], bytes]] = {
    BOOL: lambda v: b"\x01" if v else b"\x00",
    INT2: lambda v: struct.pack("!h", int(v)),  # type: ignore[call-overload]
    INT4: lambda v: struct.pack("!i", int(v)),  # type: ignore[call-overload]
    INT8: lambda v: struct.pack("!q", int(v)),  # type: ignore[call-overload]
    OID: lambda v: struct.pack("!I", int(v)),  # type: ignore[call-overload]
    FLOAT4: lambda v: struct.pack("!f", float(v)),  # type: ignore[arg-type]
    FLOAT8: lambda v: struct.pack("!d", float(v)),  # type: ignore[arg-type]
    DATE: lambda v: struct.pack("!i", (v - _EPOCH_DATE).days),  # type: ignore[operator]
    NUMERIC: _numeric_binary,
    BYTEA: lambda v: bytes(v),  # type: ignore[call-overload]
}


def encode_binary(value: object, oid: int) -> bytes:
    """PostgreSQL binary (send) format of a non-NULL value."""
    if oid in ELEMENT_OF and isinstance(value, list | tuple):
        return _array_binary(value, ELEMENT_OF[oid])
    if oid in (TEXT, VARCHAR, NAME, BPCHAR, UNKNOWN, JSON, CHAR):
        return encode_text(value, oid)
    if oid == TIMESTAMP and isinstance(value, dt.datetime):
        delta = value.replace(tzinfo=None) - _EPOCH_TS
        return struct.pack("!q", delta // dt.timedelta(microseconds=1))
    if oid == TIMESTAMPTZ and isinstance(value, dt.datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        return struct.pack("!q", (aware - _EPOCH_TSTZ) // dt.timedelta(microseconds=1))
    if oid == UUID and isinstance(value, uuid.UUID):
        return value.bytes
    fn = _BINARY.get(oid)
    if fn is None:
        raise UnsupportedBinary(f"binary output of type {PG_TYPES.get(oid, oid)} is not supported")
    return fn(value)


# --------------------------------------------------------------------------------------------
# Parameter input


class ParameterError(ValueError):
    """A Bind parameter that cannot be read as its declared type (SQLSTATE 22P02)."""


_TRUE = {"t", "true", "y", "yes", "on", "1"}
_FALSE = {"f", "false", "n", "no", "off", "0"}


def _parse_number(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


# JDBC sends setDate()/setTimestamp() values untyped (OID 0) with a zone suffix, relying on the
# server to infer the type from context; "2024-01-01 +00" is never meant as text.
_JDBC_DATE = re.compile(r"^(\d{4}-\d{2}-\d{2}) [+-]\d{2}(:?\d{2})?$")


def parse_array_text(text: str) -> list[str | None]:
    """A one-dimensional PostgreSQL array literal ``{a,"b c",NULL}`` as a list of strings."""
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise ParameterError(f'malformed array literal: "{text}"')
    items: list[str | None] = []
    body, i, n = text[1:-1], 0, len(text) - 2
    while i < n:
        if body[i] == '"':
            j, chars = i + 1, []
            while j < n and body[j] != '"':
                if body[j] == "\\" and j + 1 < n:
                    j += 1
                chars.append(body[j])
                j += 1
            items.append("".join(chars))
            i = j + 1
        else:
            j = body.find(",", i)
            j = n if j < 0 else j
            raw = body[i:j].strip()
            if raw.startswith("{"):
                raise ParameterError("multidimensional arrays are not supported")
            items.append(None if raw.upper() == "NULL" else raw)
            i = j
        if i < n and body[i] == ",":
            i += 1
    return items


def decode_text_param(text: str, oid: int) -> object:
    """A text-format parameter as the Python value dpsql substitutes for ``$n``."""
    if oid in ELEMENT_OF:
        elem = ELEMENT_OF[oid]
        return [None if v is None else decode_text_param(v, elem) for v in parse_array_text(text)]
    if oid in (0, UNKNOWN):
        m = _JDBC_DATE.match(text)
        if m:
            with contextlib.suppress(ValueError):
                return dt.date.fromisoformat(m.group(1))
        return text
    try:
        if oid in (INT2, INT4, INT8, OID):
            return int(text.strip())
        if oid in (FLOAT4, FLOAT8):
            return float(text)
        if oid == NUMERIC:
            return _parse_number(text.strip())
        if oid == BOOL:
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(text)
        if oid == DATE:
            return dt.date.fromisoformat(text.strip())
    except ValueError:
        name = PG_TYPES[oid].name if oid in PG_TYPES else str(oid)
        raise ParameterError(f'invalid input syntax for type {name}: "{text}"') from None
    return text


def _decode_binary_array(data: bytes) -> list[object]:
    ndim, _flags, elem = struct.unpack("!iiI", data[:12])
    if ndim == 0:
        return []
    if ndim != 1:
        raise UnsupportedBinary("multidimensional arrays are not supported")
    count, _lower = struct.unpack("!ii", data[12:20])
    pos = 20
    out: list[object] = []
    for _ in range(count):
        (size,) = struct.unpack("!i", data[pos : pos + 4])
        pos += 4
        if size < 0:
            out.append(None)
            continue
        out.append(decode_binary_param(data[pos : pos + size], elem))
        pos += size
    return out


def decode_binary_param(data: bytes, oid: int) -> object:
    try:
        if oid in ELEMENT_OF:
            return _decode_binary_array(data)
        if oid == INT2:
            return struct.unpack("!h", data)[0]
        if oid == INT4:
            return struct.unpack("!i", data)[0]
        if oid == INT8:
            return struct.unpack("!q", data)[0]
        if oid == OID:
            return struct.unpack("!I", data)[0]
        if oid == FLOAT4:
            return struct.unpack("!f", data)[0]
        if oid == FLOAT8:
            return struct.unpack("!d", data)[0]
        if oid == BOOL:
            if len(data) != 1:
                raise ValueError
            return data != b"\x00"
        if oid == DATE:
            return _EPOCH_DATE + dt.timedelta(days=struct.unpack("!i", data)[0])
        if oid in (TEXT, VARCHAR, NAME, BPCHAR, UNKNOWN, 0):
            return data.decode("utf-8")
        if oid == NUMERIC:
            return _decode_numeric(data)
    except (struct.error, ValueError, OverflowError, UnicodeDecodeError):
        name = PG_TYPES[oid].name if oid in PG_TYPES else str(oid)
        raise ParameterError(f"incorrect binary data format in bind parameter ({name})") from None
    raise UnsupportedBinary(f"binary input of type OID {oid} is not supported")


def _decode_numeric(data: bytes) -> int | float:
    ndigits, weight, sign, dscale = struct.unpack("!hhHH", data[:8])
    digits = struct.unpack(f"!{ndigits}H", data[8 : 8 + 2 * ndigits])
    if sign == 0xC000:
        return math.nan
    value = decimal.Decimal(0)
    for i, d in enumerate(digits):
        value += decimal.Decimal(d).scaleb(4 * (weight - i))
    if sign == 0x4000:
        value = -value
    return int(value) if dscale == 0 else float(value)


def decode_param(data: bytes | None, oid: int, fmt: int) -> object:
    if data is None:
        return None
    if fmt == 1:
        return decode_binary_param(data, oid)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ParameterError("invalid byte sequence for encoding UTF8") from None
    return decode_text_param(text, oid)
