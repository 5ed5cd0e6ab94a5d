"""No refusal names an internal class: a corpus of refused statements across the binder, the
planner, the typer, rule lists and settings, each of whose messages (and hints) must read as SQL,
never as a sqlglot or Python class (``construct Filter``, ``<class 'sqlglot...Neg'>``).

Known offenders live in dpsql/frontend/bind.py (and one crash in the rule-list planning); they are
marked xfail(strict=False) with the class they leak, for the core to fix.
"""

from __future__ import annotations

import inspect
import re

import pytest
from conftest import fixture_policy
from sqlglot import exp

import dpsql
from dpsql.privacy.ledger import MemoryLedger

# Every sqlglot expression class name that is not also an upper-case SQL word (JSON, MD5, CTE)
# or plain English a message may start a sentence with.
ENGLISH = {"Hint", "If", "In", "Is", "Not", "Or", "And", "All", "Add", "Use", "Set", "Show"}
CLASS_NAMES = sorted(
    {c.__name__ for c in vars(exp).values() if inspect.isclass(c) and issubclass(c, exp.Expression)}
    - ENGLISH
)
CLASS_WORD = re.compile(r"\b(" + "|".join(n for n in CLASS_NAMES if not n.isupper()) + r")\b")
PYTHON = re.compile(r"<class |sqlglot|Traceback|\bexp\.|Error\(|object at 0x")


def _known(sql: str, leak: str, where: str = "dpsql/frontend/bind.py"):
    return pytest.param(
        sql,
        marks=pytest.mark.xfail(strict=False, reason=f"the message names {leak} ({where})"),
    )


REFUSED = [
    "SELECT * FROM visits",
    "SELECT age FROM visits",
    "SELECT COUNT(*) FILTER (WHERE age > 3) OVER () FROM visits",
    "SELECT SUM(-patient_id) FROM visits",
    "SELECT SUM(age * patient_id) FROM visits",
    "SELECT SUM(1 / age) FROM visits",
    "SELECT SUM(LENGTH(diagnosis)) FROM visits",
    "SELECT COUNT(*) OVER () FROM visits",
    "SELECT ROW_NUMBER() OVER (ORDER BY age) FROM visits",
    # (a set operation of DP queries is answered since issue 27: over private rows it is not)
    "SELECT age FROM visits UNION SELECT COUNT(*) FROM visits",
    "SELECT age FROM visits INTERSECT SELECT COUNT(*) FROM visits",
    "SELECT COUNT(*) FROM visits EXCEPT SELECT age FROM visits",
    "SELECT COUNT(*) FROM (SELECT * FROM visits LIMIT 5)",
    "SELECT COUNT(*) FROM (SELECT DISTINCT age FROM visits) AS d",
    "SELECT COUNT(*) FROM visits a JOIN visits b ON a.age = b.age",
    "WITH RECURSIVE v AS (SELECT * FROM visits) SELECT COUNT(*) FROM v",
    "WITH v AS (SELECT * FROM visits) SELECT COUNT(*) FROM visits WHERE age IN (SELECT age FROM v)",
    "SELECT COUNT(*) FROM visits WHERE age IN (SELECT age FROM visits)",
    "DELETE FROM visits",
    "INSERT INTO visits VALUES (1)",
    "CREATE TABLE x (a INT)",
    "DROP TABLE visits",
    "ATTACH 'x.db'",
    "COPY visits TO 'out.csv'",
    "PRAGMA version",
    "SELECT COUNT(*) FROM read_csv('visits.csv')",
    "SELECT COUNT(*) FROM visits WHERE random() > 0.5",
    "SELECT COUNT(*) FROM visits HAVING COUNT(*)",
    "SELECT COUNT(*) FROM visits LIMIT 'a'",
    "SELECT COUNT(*) FROM visits LIMIT CAST(5 AS INTEGER)",
    "SELECT COUNT(*) FROM visits GROUP BY COUNT(*)",
    "SELECT COUNT(DISTINCT age) FROM visits",
    "SELECT SUM(department) FROM visits",
    "SELECT SUM(patient_id) FROM visits",
    "SELECT dp_interval_low(age) FROM visits",
    "SELECT dp_suppression_probability(1) FROM visits",
    "SELECT COUNT(*) FROM visits WHERE (age & 3) = 1",
    "SELECT COUNT(*) FROM visits WHERE age << 1 > 3",
    "SELECT COUNT(*) FROM visits WHERE department->>'a' = 'b'",
    "SELECT COUNT(*) FROM visits WHERE [age, 1][1] = 1",
    "SELECT COUNT(*) FROM visits WHERE {'a': age}.a = 1",
    "SELECT COUNT(*) FROM visits WHERE list_transform([age], x -> x + 1)[1] = 2",
    "SELECT COUNT(*) FROM visits WHERE regexp_matches(department, 'a')",
    "SELECT COUNT(*) FROM visits WHERE department SIMILAR TO 'a%'",
    "SELECT COUNT(*) FROM visits WHERE department GLOB 'a*'",
    "SELECT COUNT(*) FROM visits WHERE department COLLATE NOCASE = 'a'",
    "SELECT COUNT(*) FROM visits WHERE visit_date > DATE '2024-01-01' + INTERVAL 1 DAY",
    "SELECT COUNT(*) FROM visits GROUP BY ROLLUP (department)",
    "SELECT COUNT(*) FROM visits QUALIFY COUNT(*) > 1",
    "SELECT COUNT(*) FROM visits TABLESAMPLE 10%",
    "SELECT COUNT(*) FROM visits USING SAMPLE 10",
    "PIVOT visits ON department USING COUNT(*)",
    "VALUES (1)",
    "SELECT COLUMNS(*) FROM visits",
    "SELECT * EXCLUDE (age) FROM visits",
    "SELECT COUNT(*) FROM visits WHERE TRY(age / 0) = 1",
    "SELECT COUNT(*) FROM visits WHERE age",
    "SELECT COUNT(*) FROM visits WHERE department",
    "SELECT MEDIAN(age) FROM visits",
    "SELECT STRING_AGG(department, ',') FROM visits",
    "SELECT ARRAY_AGG(age) FROM visits",
    "SELECT MIN(age) FROM visits",
    "SELECT COUNT(*) FROM visits WHERE nope = 1",
    "SELECT COUNT(*) FROM nope",
    "SELECT COUNT(*) FROM visits WHERE age = ?",
    "SELECT COUNT(*) FROM visits WHERE age > (SELECT 1)",
    "SELECT COUNT(*) FROM visits WHERE EXISTS (SELECT 1)",
    "SELECT COUNT(*) FROM visits ORDER BY age",
    "SELECT COUNT(*) FROM visits WHERE age = ANY ([1, 2])",
    "SELECT COUNT(*) FROM visits WHERE age > ALL (SELECT 1)",
    "SELECT COUNT(*) FROM visits WHERE age = 1 AND",
    "SELECT COUNT(*) FROM visits WHERE md5(department) = 'a'",
    "SELECT COUNT(*) FROM visits WHERE hash(age) = 1",
    "SELECT COUNT(*) FROM visits WHERE current_setting('threads') = '1'",
    "SELECT COUNT(*) FROM visits WHERE getvariable('x') = 1",
    "SELECT COUNT(*) FROM visits WHERE age = $x",
    "SELECT COUNT(*) FROM visits WHERE NOT -age",
    "SELECT COUNT(*) FROM visits WHERE ~age = 1",
    "SELECT COUNT(*) FROM visits WHERE age % 2 = 1 ESCAPE 'x'",
    "SELECT COUNT(*) FROM visits WHERE department LIKE ANY ('a%', 'b%')",
    "SELECT COUNT(*) FROM visits WHERE struct_pack(a := age).a = 1",
    "SELECT COUNT(*) FROM visits WHERE unnest([age]) = 1",
    "SELECT COUNT(*) FROM visits WHERE visit_date::TIMESTAMPTZ > NOW()",
    "SELECT COUNT(*) FROM visits WHERE age = 1 OR age",
    "SELECT COUNT(*) FROM visits WHERE age = 1 COLLATE x",
    "SELECT * FROM dp_rule_list('visits', label => 'smoker', bogus => 1)",
    "SELECT * FROM dp_rule_list('visits')",
    "SELECT * FROM dp_rule_list('nope', label => 'smoker')",
    "SELECT * FROM dp_rule_list('visits', label => 'age')",
    "SELECT * FROM dp_rule_list('visits', label => 'smoker', features => ['nope'])",
    "SELECT * FROM dp_rule_list('visits', label => 'smoker', max_length => -1)",
    "SELECT repeat(rule, 2) FROM dp_rule_list('visits', label => 'smoker')",
    "SELECT * FROM dp_rule_list('visits', label => 'smoker', epsilon => 'x')",
    "SET epsilon = -1",
    "SET threads = 4",
    "SHOW nope",
    "EXPLAIN DELETE FROM visits",
    "SELECT COUNT(*) FROM visits; SELECT 1",
]


@pytest.fixture(scope="module")
def conn():
    policy = fixture_policy(privacy={"budget_epsilon": 1e6, "budget_delta": 0.5})
    with dpsql.connect(policy=policy, analyst="corpus", ledger=MemoryLedger()) as c:
        yield c


def leaks(message: str) -> list[str]:
    """The internal names in a message: class names (case-sensitive words) and Python text."""
    found = [m.group(0) for m in CLASS_WORD.finditer(message.replace("Hint:", ""))]
    return found + [m.group(0) for m in PYTHON.finditer(message)]


def test_the_detector():
    assert leaks("construct Filter is not allowed in SELECT") == ["Filter"]
    assert leaks("Required keyword missing for <class 'sqlglot.expressions.core.Neg'>") == [
        "Neg",
        "<class ",
        "sqlglot",
    ]
    assert leaks("FILTER, JSON and MD5 are not allowed; the filter is. Hint: use COUNT") == []


@pytest.mark.parametrize("sql", REFUSED)
def test_refusal_names_no_internal_class(conn, sql):
    try:
        conn.cursor().execute(sql)
    except dpsql.Error as exc:
        error = exc
    else:  # the grammar grows: a statement accepted now has no refusal to read
        pytest.skip("accepted by this version of dpsql")
    assert error.sqlstate and len(error.sqlstate) == 5
    assert leaks(str(error)) == [], str(error)
    assert error.hint, str(error)
