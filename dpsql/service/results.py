"""What a statement returns: the Result record, DB-API type codes, and the released table
(keys, values, intervals) that post-processing reads, encoded for the answer cache."""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import numpy as np

from dpsql.aggregates import KINDS
from dpsql.engine.scratch import (
    Projection,
    cast_value,
)
from dpsql.plan.annotated import Plan
from dpsql.policy import SQL_TYPES
from dpsql.privacy.bias import widened
from dpsql.privacy.release import Released

TYPE_CODES = {
    "BIGINT": "BIGINT",
    "INTEGER": "BIGINT",
    "SMALLINT": "BIGINT",
    "TINYINT": "BIGINT",
    "HUGEINT": "BIGINT",
    "UBIGINT": "BIGINT",
    "UINTEGER": "BIGINT",
    "USMALLINT": "BIGINT",
    "UTINYINT": "BIGINT",
    "DOUBLE": "DOUBLE",
    "FLOAT": "DOUBLE",
    "VARCHAR": "VARCHAR",
    "BOOLEAN": "BOOLEAN",
    "DATE": "DATE",
    "TIMESTAMP": "TIMESTAMP",
}


def type_code(duck_type: str) -> str:
    """DB-API type code for a DuckDB type: BIGINT, DOUBLE, VARCHAR, BOOLEAN, DATE, TIMESTAMP."""
    if duck_type.startswith("DECIMAL"):
        return "DOUBLE"
    return TYPE_CODES.get(duck_type, "VARCHAR")


@dataclass
class Result:
    """What a statement returns to a front door."""

    description: list[tuple[str, str]] = field(default_factory=list)
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    intervals: list[tuple[tuple[float, float] | None, ...]] = field(default_factory=list)
    cost: Any = None
    cached: bool = False
    status: str = "SELECT"
    notes: list[str] = field(default_factory=list)
    # per row, per column: (bias estimate, bias-inclusive low, high) of a released aggregate
    # whose bias is measured (dpsql.privacy.bias), else None
    biases: list[tuple[tuple[float, float, float] | None, ...]] = field(default_factory=list)
    # what the bounds cut, one line per aggregate column (every door shows them)
    bias_notes: list[str] = field(default_factory=list)


def jsonable(value: Any) -> Any:
    """A released key or value as JSON holds it (a date as ISO text, a numpy scalar as a
    Python number): what the ledger remembers of an answer for replay."""
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Decimal):  # e.g. GROUP BY x * 1.5: DECIMAL keys, released as DOUBLE
        return float(value)
    return value


SQL_TYPES_BY_CODE = {
    "BIGINT": "BIGINT",
    "DOUBLE": "DOUBLE",
    "VARCHAR": "VARCHAR",
    "BOOLEAN": "BOOLEAN",
    "DATE": "DATE",
    "TIMESTAMP": "TIMESTAMP",
}
assert set(SQL_TYPES.values()) <= set(SQL_TYPES_BY_CODE.values())


def is_output_column(column: str) -> bool:
    """A released aggregate column a0, a1, ... (which has a 95% interval)."""
    return column.startswith("a") and column[1:].isdigit()


def released_table(plan: Plan, answer: dict) -> tuple[list[str], list[str], list[tuple[Any, ...]]]:
    """Columns, SQL types and rows of the released table (keys k0.., then a_i, a_i_lo, a_i_hi
    per output, then __suppressed): what post-processing may read."""
    n_keys = len(plan.keys)
    columns = [f"k{i}" for i in range(n_keys)]
    types = [SQL_TYPES_BY_CODE[t] for t in answer["key_types"]]
    whole = []
    for i, o in enumerate(plan.outputs):
        columns += [f"a{i}", f"a{i}_lo", f"a{i}_hi"]
        column = plan.query.table.columns[o.call.column] if o.call.column else None
        kind = KINDS[o.call.kind].released_type(column)
        types += [kind, "DOUBLE", "DOUBLE"]
        whole.append(kind == "BIGINT")
    columns.append("__suppressed")
    types.append("DOUBLE")
    for i in range(len(plan.outputs)):  # what the bounds cut (dpsql.privacy.bias)
        columns += [f"a{i}_bias", f"a{i}_blo", f"a{i}_bhi"]
        types += ["DOUBLE", "DOUBLE", "DOUBLE"]
    outputs, intervals, suppressed = answer["outputs"], answer["intervals"], answer["suppressed"]
    biases = answer.get("biases") or [None] * len(whole)
    rows = []
    for r, key in enumerate(answer["keys"]):
        row: list[Any] = list(key)
        cut: list[Any] = []
        for i, is_whole in enumerate(whole):
            value = outputs[i][r]
            low, high = intervals[i][r]
            if is_whole and value is not None:
                value = round(value)
                # an integer answer's interval on whole numbers too, rounded outward (a
                # rescaled count's noise is in a fine grid): post-processing
                if low is not None and high is not None and np.isfinite(low) and np.isfinite(high):
                    low, high = math.floor(low), math.ceil(high)
            row += [value, low, high]
            cut += _bias_cells(biases[i][r] if biases[i] is not None else None, low, high)
        row.append(suppressed[r] if suppressed is not None else None)
        rows.append(tuple(row + cut))
    return columns, types, rows


def _bias_cells(estimate: Sequence[float] | None, low: Any, high: Any) -> list[Any]:
    """(bias, bias-inclusive low, high) of one value, or three NULLs (dpsql.privacy.bias)."""
    if estimate is None or low is None or high is None:
        return [None, None, None]
    b, h = estimate
    if not (np.isfinite(low) and np.isfinite(high) and math.isfinite(b) and math.isfinite(h)):
        return [None, None, None]
    return [b, *widened(low, high, b, h)]


def project_rows(
    projection: Projection,
    columns: Sequence[str],
    types: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
    *,
    cost: Any,
    cached: bool,
) -> Result:
    """The result of a plain projection (see :func:`plain_projection`) without DuckDB: the
    released rows in order (or sorted, then cut), each value as ``CAST(? AS type)`` returns
    it, and the interval of every picked aggregate. Raises NotPlain when DuckDB must decide
    (a value its cast would convert, or tied ORDER BY values)."""
    index = {c: i for i, c in enumerate(columns)}
    picks = [(i, types[i]) for _, i in projection.items]
    spans = [
        (index[f"{columns[i]}_lo"], index[f"{columns[i]}_hi"])
        if is_output_column(columns[i])
        else None
        for _, i in projection.items
    ]
    cuts = [
        index.get(f"{columns[i]}_bias") if is_output_column(columns[i]) else None
        for _, i in projection.items
    ]
    selected = [rows[r] for r in projection.select_rows(rows, types)]
    out_rows = [tuple(cast_value(row[i], t) for i, t in picks) for row in selected]
    intervals = [
        tuple(
            None
            if span is None
            else (cast_value(row[span[0]], "DOUBLE"), cast_value(row[span[1]], "DOUBLE"))
            for span in spans
        )
        for row in selected
    ]
    biases = [
        tuple(
            None if c is None or row[c] is None else (row[c], row[c + 1], row[c + 2]) for c in cuts
        )
        for row in selected
    ]
    return Result(
        description=[(name, type_code(types[i])) for name, i in projection.items],
        rows=out_rows,
        intervals=intervals,
        cost=cost,
        cached=cached,
        biases=biases,
    )


def to_python(value: Any) -> Any:
    """A numpy scalar as the Python value a door returns (others unchanged)."""
    if isinstance(value, np.generic):
        return value.item()
    return value


def float_values(values: Any) -> Any:
    """Released numbers as float64, the one type the remembered answer stores them in."""
    return np.asarray(values, dtype=np.float64)


def _answer_fields(released: Released, key_types: Sequence[str]) -> dict:
    """The released table in JSON's own types (lists, Python numbers, ISO dates), before the
    text: what encode_answer writes and decode_answer reads back (keys' dates still text)."""
    return {
        "keys": [[jsonable(v) for v in k] for k in released.key_values],
        "key_types": list(key_types),
        # float64 .tolist(): the same Python floats as float(x) per element, in C
        # a value-released kind (MODE: a domain value) keeps its own values
        "outputs": [
            [jsonable(v) for v in o] if np.asarray(o).dtype == object else float_values(o).tolist()
            for o in released.outputs
        ],
        "intervals": [float_values(iv).reshape(-1, 2).tolist() for iv in released.intervals],
        "suppressed": (
            None
            if released.suppressed_probability is None
            else float_values(released.suppressed_probability).tolist()
        ),
        "biases": [None if b is None else float_values(b).tolist() for b in released.biases],
    }


def encode_answer(released: Released, key_types: Sequence[str]) -> str:
    """A released table as the JSON text the ledger remembers (replayed by decode_answer)."""
    return json.dumps(_answer_fields(released, key_types))


def answer_data(released: Released, key_types: Sequence[str]) -> dict:
    """``decode_answer(encode_answer(released, key_types))`` without the JSON text between: a
    fresh answer that is not remembered (no answer cache) in the types its replay would have.

    JSON keeps every value :func:`_answer_fields` holds as it is (lists, str, bool, None, int,
    float incl. NaN and ±inf, written in ``repr`` and read back bit for bit), so only the
    keys' dates are parsed back. tests/test_answer_data.py compares both.
    """
    fields = _answer_fields(released, key_types)
    # the same TypeError as encode_answer for a value JSON lacks (the keys and a kind's own
    # values; the rest are float64's Python floats)
    json.dumps(
        [
            fields["keys"],
            [
                v
                for v, o in zip(fields["outputs"], released.outputs, strict=True)
                if np.asarray(o).dtype == object
            ],
        ]
    )
    return _parse_dates(fields)


def decode_answer(answer: str) -> dict:
    """A remembered answer (encode_answer's text) back as released keys and values, dates
    and timestamps parsed again from their key types."""
    return _parse_dates(json.loads(answer))


def _parse_dates(data: dict) -> dict:
    """``data`` with its DATE and TIMESTAMP keys parsed from their ISO text."""
    for i, t in enumerate(data["key_types"]):
        parse = {"DATE": dt.date.fromisoformat, "TIMESTAMP": dt.datetime.fromisoformat}.get(t)
        if parse is not None:
            for k in data["keys"]:
                if k[i] is not None:
                    k[i] = parse(k[i])
    return data


#: The columns of EXPLAIN (FORMAT TABLE), the default: one row per measure, range and total.
EXPLAIN_COLUMNS = [
    ("aggregate", "VARCHAR"),
    ("measure", "VARCHAR"),
    ("mechanism", "VARCHAR"),
    ("sensitivity_l1", "DOUBLE"),
    ("sensitivity_l2", "DOUBLE"),
    ("noise_scale", "DOUBLE"),
    ("epsilon", "DOUBLE"),
    ("delta", "DOUBLE"),
    ("rho", "DOUBLE"),
    ("ci95_halfwidth", "DOUBLE"),
]
