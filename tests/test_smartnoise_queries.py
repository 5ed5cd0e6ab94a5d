"""SmartNoise SQL's own PUMS test queries, on the policy imported from SmartNoise metadata.

fixtures/smartnoise_pums_queries.toml holds the queries of SmartNoise's test suite that name
the PUMS table, each marked with whether SmartNoise answers it. They run on
fixtures/pums_sample.toml (written by ``dpsql import-smartnoise`` from fixtures/pums_sample.yaml,
SmartNoise's metadata format) over a synthetic PUMS-like CSV, first as written, then with
SmartNoise's schema-qualified names (``PUMS.PUMS``, ``PUMS.PUMS.PUMS``) mapped to the policy's
table name. The counts may only go up; ``python tests/test_smartnoise_queries.py`` prints them
per refusal reason (the figures in docs/bi_tools.md).
"""

from __future__ import annotations

import re
import sys
import tomllib
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import dpsql
from dpsql.privacy.ledger import MemoryLedger
from dpsql.privacy.samplers import ZeroNoise

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QUERIES_FILE = FIXTURES / "smartnoise_pums_queries.toml"
POLICY_FILE = FIXTURES / "pums_sample.toml"
# Measured on this tree (see docs/bi_tools.md); raise them as features land.
ANSWERED_AS_WRITTEN_FLOOR = 102
ANSWERED_MAPPED_FLOOR = 103
_QUALIFIED = re.compile(r'(?i)(?<![\w."])(?:"?pums"?\.)?"?pums"?\."?pums"?(?![\w"])')


@dataclass(frozen=True)
class Query:
    source: str
    smartnoise: str
    sql: str


def load_queries() -> list[Query]:
    return [Query(**q) for q in tomllib.loads(QUERIES_FILE.read_text())["query"]]


QUERIES = load_queries()


def pums_policy() -> dict:
    """The imported policy with its source made absolute and a budget that never runs out."""
    policy = tomllib.loads(POLICY_FILE.read_text())
    for table in policy["tables"].values():
        table["source"] = str(FIXTURES / table["source"])
    policy["privacy"].update(budget_epsilon=1e9, budget_delta=0.5)
    return policy


def map_names(sql: str) -> str:
    """SmartNoise's PUMS.PUMS (and PUMS.PUMS.PUMS) as the policy's table name PUMS."""
    return _QUALIFIED.sub("PUMS", sql)


def reason_of(exc: dpsql.Error) -> str:
    """A refusal's SQLSTATE and message with names, values and positions left out."""
    message = str(exc).split(" (at line")[0].split(" (hint")[0]
    message = re.sub(r"^\[\w+\]\s*", "", message)
    message = re.sub(r"'[^']*'|\"[^\"]*\"", "…", message)
    return f"{exc.sqlstate} {message}"


def outcome(conn: dpsql.Connection, sql: str) -> str | None:
    """None when dpsql answers ``sql``, else the refusal's reason."""
    cur = conn.cursor()
    try:
        cur.execute(sql)
        cur.fetchall()
    except dpsql.Error as exc:
        return reason_of(exc)
    return None


@dataclass(frozen=True)
class Tally:
    total: int
    as_written: int
    mapped: int
    reasons_as_written: Counter
    reasons_mapped: Counter


def tally(conn: dpsql.Connection, queries: list[Query]) -> Tally:
    answered = [q for q in queries if q.smartnoise == "answers"]
    written = [outcome(conn, q.sql) for q in answered]
    mapped = [outcome(conn, map_names(q.sql)) for q in answered]
    return Tally(
        total=len(answered),
        as_written=sum(r is None for r in written),
        mapped=sum(r is None for r in mapped),
        reasons_as_written=Counter(r for r in written if r is not None),
        reasons_mapped=Counter(r for r in mapped if r is not None),
    )


@pytest.fixture(scope="module")
def pums() -> Iterator[dpsql.Connection]:
    conn = dpsql.connect(
        policy=pums_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False
    )
    yield conn
    conn.close()


def test_query_file_is_well_formed():
    assert len(QUERIES) > 100
    assert {q.smartnoise for q in QUERIES} == {"answers", "refuses"}
    assert len({q.sql for q in QUERIES}) == len(QUERIES)


def test_name_mapping():
    assert map_names("SELECT COUNT(*) FROM PUMS.PUMS") == "SELECT COUNT(*) FROM PUMS"
    assert map_names("SELECT COUNT(*) FROM pums.pums AS p") == "SELECT COUNT(*) FROM PUMS AS p"
    assert map_names("SELECT COUNT(*) FROM PUMS.PUMS.PUMS") == "SELECT COUNT(*) FROM PUMS"
    assert map_names('SELECT COUNT(*) FROM "PUMS"."PUMS"') == "SELECT COUNT(*) FROM PUMS"
    assert map_names("SELECT p.married FROM pums p") == "SELECT p.married FROM pums p"


def test_answered_counts_do_not_regress(pums):
    counts = tally(pums, QUERIES)
    assert counts.total == sum(q.smartnoise == "answers" for q in QUERIES)
    assert counts.as_written >= ANSWERED_AS_WRITTEN_FLOOR
    assert counts.mapped >= ANSWERED_MAPPED_FLOOR
    assert counts.mapped >= counts.as_written


def test_refusals_are_free(pums):
    """Whatever dpsql refuses of SmartNoise's queries, it refuses before spending anything."""
    ledger = pums.service.ledger
    refused = 0
    for q in QUERIES:
        cur = pums.cursor()
        spent = ledger.spent("default", pums.service.policy.dataset)
        try:
            cur.execute(map_names(q.sql))
        except dpsql.Error:
            refused += 1
            assert ledger.spent("default", pums.service.policy.dataset) == spent, q.sql
    assert refused > 0


def _print_table(title: str, answered: int, total: int, reasons: Counter) -> None:
    print(f"\n{title}: {answered} of {total} answered")
    for reason, n in reasons.most_common():
        print(f"  {n:4d}  {reason}")


def main() -> int:
    warnings.simplefilter("ignore")
    conn = dpsql.connect(
        policy=pums_policy(), ledger=MemoryLedger(), noise=ZeroNoise(), cache=False
    )
    counts = tally(conn, QUERIES)
    print(f"{len(QUERIES)} queries; SmartNoise answers {counts.total}")
    _print_table("as written", counts.as_written, counts.total, counts.reasons_as_written)
    _print_table("names mapped", counts.mapped, counts.total, counts.reasons_mapped)
    refused = [q for q in QUERIES if q.smartnoise == "refuses"]
    agree = sum(outcome(conn, map_names(q.sql)) is not None for q in refused)
    print(f"\nSmartNoise refuses {len(refused)}; dpsql refuses {agree} of them (names mapped)")
    conn.close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
