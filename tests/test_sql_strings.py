"""Engine SQL is built as sqlglot trees, not spliced as text (issue 26 item 2).

Every lowering of a plan (DuckDB and Spark SQL, the column store's build, the prepared store,
the key domains' enumeration, the clamp pass's probe) builds its statements through
dpsql.lower.builders and renders them at the engine's edge, in the engine's dialect: a name
the policy gives is quoted by a builder, a value is a literal node, nothing is spliced.

This AST test finds the text that looks like SQL being assembled anywhere in dpsql/: an
f-string, a ``+``/``%`` concatenation, a ``.format()`` or a ``" AND ".join(...)`` whose
literal parts read as SQL (a statement or clause keyword first, or a clause's shape: SELECT
... FROM, CASE WHEN ... THEN, CAST(... AS, a JOIN ... ON, UNION ALL, IS NULL). Text handed to
an error or a refusal (a message quoting SQL to the analyst) is not engine SQL and is not
counted. What remains is recorded below per file with the reason it stays, as a ratchet: a
new SQL string fails, and a file whose strings were converted must lower its count.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dpsql"

_START = re.compile(
    r"^[\s(]*(?:(?:SELECT|WITH|CREATE|INSERT|UPDATE|DELETE|DROP|ATTACH|DETACH|PRAGMA|SET|"
    r"DESCRIBE|SUMMARIZE|COPY|FROM|WHERE|GROUP BY|ORDER BY|HAVING|LEFT JOIN|JOIN|UNION|"
    r"CASE WHEN|VALUES|AND|OR|LIMIT)\b|CAST\()",
)
_SHAPE = re.compile(
    r"\bSELECT\b.*\bFROM\b|\bCASE WHEN\b.*\bTHEN\b|\bCAST\(.*\bAS\b|\bJOIN\b.*\bON\b|"
    r"\bUNION ALL\b|\bCROSS JOIN\b|\bIS (NOT )?NULL\b|\bFILTER \(WHERE\b",
)
_SEPARATORS = re.compile(r"^\s*(AND|OR|UNION ALL|CROSS JOIN)\s*$")
#: calls whose text argument is a message to a person, not SQL for an engine
_MESSAGE_CALLS = re.compile(r"(Error|Exception|refuse|fail|warning|warn|info|debug|say|hint)$")

#: Files that still assemble SQL text, how many such strings each holds, and why they stay.
#: Lower a count when a string is converted (the test says so); never raise one: build the
#: statement through dpsql.lower.builders instead.
ALLOWED: dict[str, tuple[int, str]] = {
    "dpsql/commands.py": (
        1,
        "the CLI's SET statement, sent to the service as a statement text (parsed and "
        "checked there like the analyst's), never to an engine",
    ),
    "dpsql/curation/check.py": (
        12,
        "operator tools (dpsql check): profile the curator's own source on a private "
        "DuckDB before any query, names quoted by quote_ident; no plan is lowered",
    ),
    "dpsql/curation/init.py": (
        16,
        "operator tools (dpsql init): profile the curator's own source on a private "
        "DuckDB to draft a policy, names quoted by quote_ident; no plan is lowered",
    ),
    "dpsql/curation/source.py": (
        1,
        "administrative: ATTACH of a validated database path (a string literal, escaped)",
    ),
    "dpsql/engine/duckdb_engine.py": (
        6,
        "administrative at connect: SET of validated settings, ATTACH of a validated "
        "path, the typed load of a policy table (CREATE ... AS SELECT of casts of its "
        "declared columns from its source); no plan is lowered",
    ),
    "dpsql/engine/postgres_source.py": (
        2,
        "loading: the Postgres source copied into DuckDB (CREATE TABLE of the policy's "
        "columns, INSERT of a batch)",
    ),
    "dpsql/engine/scratch.py": (
        2,
        "administrative at connect: the scratch connection's shadow tables (CREATE TABLE of "
        "the policy's columns, no rows) and its SET memory_limit; its queries (key domains, "
        "post-processing with the released table put in its FROM) are trees",
    ),
    "dpsql/engine/spark_engine.py": (
        4,
        "loading: Spark's typed load (selectExpr casts of the policy's columns) and its "
        "type check, DataFrame expressions at connect; no plan is lowered",
    ),
    "dpsql/engine/store_files.py": (
        1,
        "administrative: SET temp_directory to a validated private directory",
    ),
    "dpsql/engine/versions.py": (
        2,
        "the data version's digests at connect (row count and hashes; storage metadata)",
    ),
    "dpsql/frontend/joins.py": (
        3,
        "a public table copied into the binder's own DuckDB (CREATE TABLE, INSERT of its "
        "declared values as literals), and EXPLAIN's text of a public join (display)",
    ),
    "dpsql/frontend/per_unit.py": (
        1,
        "describe(): EXPLAIN's text of a per-unit relation (display; its WHERE and values"
        " rendered from their trees)",
    ),
    "dpsql/frontend/private_joins.py": (
        1,
        "EXPLAIN's text of a private join (display)",
    ),
    "dpsql/frontend/typecheck.py": (
        5,
        "typing on the shadow DuckDB (CREATE TABLE of the policy's columns, SELECT ... "
        "LIMIT 0 of bound expressions) and lower_key, the text typing reads; the engine's"
        " key is the tree lower.bounding.lowered_key (test_compile_ast: they agree)",
    ),
    "dpsql/models/store.py": (
        4,
        "the analysts' model store (SQLite): fixed statements over a constant column list",
    ),
    "dpsql/plan/canonical.py": (
        1,
        "the canonical serialisation of a tree (a cache key), not SQL",
    ),
    "dpsql/plots.py": (
        1,
        "a plot's label (display)",
    ),
    "dpsql/policy.py": (
        2,
        "a public table's rows read at policy load from a validated file (casts of its "
        "declared columns)",
    ),
    "dpsql/privacy/ledger_file.py": (
        2,
        "the budget ledger (SQLite): fixed statements, a constant column name interpolated",
    ),
    "dpsql/privacy/ledger_verify.py": (
        3,
        "the budget ledger's verifier (SQLite): fixed statements, a constant column name "
        "interpolated",
    ),
    "dpsql/privacy/sqlite_ledger.py": (
        5,
        "the budget ledger (SQLite): fixed statements, a constant column name interpolated",
    ),
    "dpsql/rulelist/candidates.py": (
        1,
        "the released rule list's CASE text returned to the analyst (an output, not run "
        "here): a rule's conjunction of its features' rendered trees",
    ),
    "dpsql/rulelist/estimator.py": (
        1,
        "the released rule list's text (an output): a cut's negation spelt out; the rows "
        "run from trees (dpsql.lower.rows)",
    ),
    "dpsql/rulelist/table_function.py": (
        1,
        "the released rule list's text (an output): a cut's negation spelt out; the rows "
        "run from trees (dpsql.lower.rows)",
    ),
    "dpsql/server/backend.py": (
        1,
        "a wire command tag ('SELECT 5'), not SQL",
    ),
    "dpsql/server/catalog.py": (
        1,
        "the wire server's catalog emulation on its own DuckDB (no private data): "
        "DESCRIBE of a rewritten catalog query",
    ),
    "dpsql/server/catalog_schema.py": (
        2,
        "the wire server's pg_catalog emulation (no private data): macro bodies and views"
        " over the policy's names",
    ),
    "dpsql/server/catalog_worker.py": (
        10,
        "the wire server's pg_catalog emulation on its own DuckDB (no private data): "
        "tables, views and macros of the catalog",
    ),
    "dpsql/server/extended.py": (
        1,
        "a wire command tag ('SELECT 5'), not SQL",
    ),
    "dpsql/server/session.py": (
        1,
        "a wire command tag ('SELECT 5'), not SQL",
    ),
    "dpsql/service/explain_table.py": (
        2,
        "an EXPLAIN row's label (display)",
    ),
    "dpsql/service/postprocess.py": (
        1,
        "administrative: SET memory_limit of the post-processing database (a constant)",
    ),
}


#: Where the lowerings and the engines read SQL text back into a tree (sqlglot's parse_one,
#: parse, maybe_parse, transpile, condition), and why: text the code generated itself is never
#: read back (the tree flows from the plan to the renderer: the clamp histogram's bin, a key's
#: WHERE conjuncts, Spark's staged CTEs are trees); only text from outside is parsed.
PARSED: dict[str, tuple[int, str]] = {
    "dpsql/engine/scratch.py": (
        1,
        "check_post of a post-processing text given without its tree (every dpsql caller "
        "passes the tree): the analyst's text, checked again before the shared connection",
    ),
    "dpsql/lower/totality.py": (
        1,
        "a test oracle typing an engine text it is handed (tests only, never on a query's path)",
    ),
}
_PARSERS = {"parse_one", "parse", "maybe_parse", "transpile", "condition"}
_PARSED_FOLDERS = ("dpsql/lower/", "dpsql/engine/", "dpsql/plan/")


def parse_calls(source: str) -> list[int]:
    """Lines calling a sqlglot parser through the module (``sqlglot.parse_one(...)``,
    ``exp.condition(...)``) or by its imported name (``parse_one(...)``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _PARSERS:
            if isinstance(func.value, ast.Name) and func.value.id in ("sqlglot", "exp"):
                lines.append(node.lineno)
        elif isinstance(func, ast.Name) and func.id in _PARSERS - {"parse", "condition"}:
            lines.append(node.lineno)
    return sorted(lines)


def test_no_generated_text_is_parsed_back():
    """The lowerings and the engines parse no text but the recorded outside text; a file
    that stops parsing leaves the record (the debt only shrinks)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = str(path.relative_to(ROOT.parent))
        if name.startswith(_PARSED_FOLDERS):
            lines = parse_calls(path.read_text())
            if lines:
                found[name] = lines
    for name, lines in found.items():
        allowed, _ = PARSED.get(name, (0, ""))
        assert len(lines) <= allowed, (
            f"{name} parses SQL text at lines {lines} (allowed {allowed}): hand the tree "
            "along instead of its rendering (a field of the plan or the compiled query)"
        )
    for name, (allowed, reason) in PARSED.items():
        assert reason, f"{name}: say why it parses text"
        assert len(found.get(name, [])) == allowed, (
            f"{name}: set its count to {len(found.get(name, []))}"
        )


def test_the_parse_scanner_sees_parser_calls():
    source = (
        "import sqlglot\nfrom sqlglot import exp, parse_one\n"
        "a = sqlglot.parse_one(t, read='duckdb')\n"
        "b = exp.condition(t)\n"
        "c = parse_one(t)\n"
        "d = exp.column(t)\n"
        "e = text.parse(t)\n"
    )
    assert parse_calls(source) == [3, 4, 5]


def _text(node: ast.AST) -> str | None:
    """The literal text of a string-building node (its holes as {}), or None."""
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
        leaves = _operands(node)
        if not any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in leaves):
            return None
        return "".join(
            _text(n) or "{}" if not isinstance(n, ast.Constant) else str(n.value) for n in leaves
        )
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Constant)
        and isinstance(node.func.value.value, str)
    ):
        text = node.func.value.value
        if node.func.attr == "format":
            return text
        if node.func.attr == "join":
            return "{}" + text + "{}" if _SEPARATORS.match(text) else None
    return None


def _operands(node: ast.AST) -> list[ast.AST]:
    """The operands of a chain of ``+`` (or one ``%``), left to right."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [*_operands(node.left), *_operands(node.right)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return [node.left, node.right]
    return [node]


def _looks_like_sql(text: str) -> bool:
    return bool(_START.match(text) or _SHAPE.search(text) or _SEPARATORS.match(text.strip("{}")))


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def sql_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of each SQL-looking string assembled in ``source``, messages left out: a
    string raised, or passed to an error, a refusal or a log, within its statement. A string
    that is part of a larger one (an f-string inside a concatenation) counts with it."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, message: bool) -> None:
        if isinstance(node, ast.stmt):
            message = isinstance(node, ast.Raise)
        elif isinstance(node, ast.Call) and _MESSAGE_CALLS.search(_call_name(node)):
            message = True
        text = _text(node)
        if text is not None and _looks_like_sql(text):
            if not message:
                found.append((node.lineno, text))  # type: ignore[attr-defined]
            return
        for child in ast.iter_child_nodes(node):
            visit(child, message)

    visit(ast.parse(source), False)
    return sorted(found)


@functools.cache
def inventory() -> dict[str, list[tuple[int, str]]]:
    """path -> the SQL strings assembled in it (dpsql/ read once per test process)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        found = sql_strings(path.read_text())
        if found:
            out[str(path.relative_to(ROOT.parent))] = found
    return out


def test_no_new_sql_strings():
    found = inventory()
    for path, strings in found.items():
        allowed, _ = ALLOWED.get(path, (0, ""))
        shown = "\n".join(f"  {path}:{line}: {text[:90]!r}" for line, text in strings)
        assert len(strings) <= allowed, (
            f"{path} assembles {len(strings)} SQL strings (allowed {allowed}):\n{shown}\n"
            "build the statement as a tree through dpsql.lower.builders and render it where "
            "the engine runs it"
        )


def test_the_record_is_current():
    """A file whose strings were converted lowers its count (the debt only shrinks)."""
    found = inventory()
    for path, (allowed, reason) in ALLOWED.items():
        assert reason, f"{path}: say why its SQL strings stay"
        have = len(found.get(path, []))
        assert have == allowed, f"{path} now has {have} SQL strings: set its count to {have}"


def test_the_scanner_sees_sql_and_leaves_messages():
    source = (
        "def f(t, c):\n"
        "    a = f'SELECT {c} FROM {t}'\n"
        "    b = 'CAST(' + c + ' AS BIGINT)'\n"
        "    w = ' AND '.join(c)\n"
        "    d = f'{c} IS NULL'\n"
        "    raise ValueError(f'GROUP BY {c} is not allowed')\n"
        "def g(c):\n"
        "    refuse(f'SELECT {c} FROM t is refused', hint=f'write FROM {c}')\n"
        "    return f'the column {c}'\n"
    )
    assert [line for line, _ in sql_strings(source)] == [2, 3, 4, 5]
