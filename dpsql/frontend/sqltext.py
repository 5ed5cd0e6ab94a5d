"""Lexical helpers over client SQL text: statement splitting, leading keywords, identifiers.

A simple Query may hold several statements; PostgreSQL runs them in order and stops at the first
error. Splitting must respect quotes, dollar quotes and comments, and keep each statement's
offset so an error position can be reported against the whole query string.

Every door that reads statement text uses them (the wire server routes and splits a Query, the
command line splits a file or a shell's input), so they live below the doors, not in one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_DOLLAR = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")


@dataclass(frozen=True)
class Statement:
    text: str
    offset: int  # 0-based character offset of ``text`` in the full query string


def skip_quoted(sql: str, i: int) -> int:
    """Index just past the quoted string / comment starting at ``i`` (or ``i`` if none)."""
    n = len(sql)
    ch = sql[i]
    if ch == "-" and sql.startswith("--", i):
        end = sql.find("\n", i)
        return n if end < 0 else end + 1
    if ch == "/" and sql.startswith("/*", i):
        depth, j = 1, i + 2
        while j < n and depth:
            if sql.startswith("/*", j):
                depth, j = depth + 1, j + 2
            elif sql.startswith("*/", j):
                depth, j = depth - 1, j + 2
            else:
                j += 1
        return j
    if ch in "'\"":
        backslash = (
            ch == "'"
            and i > 0
            and sql[i - 1] in "eE"
            and (i < 2 or not (sql[i - 2].isalnum() or sql[i - 2] == "_"))
        )
        j = i + 1
        while j < n:
            c = sql[j]
            if backslash and c == "\\":
                j += 2
                continue
            if c == ch:
                if j + 1 < n and sql[j + 1] == ch:
                    j += 2
                    continue
                return j + 1
            j += 1
        return n
    if ch == "$":
        if i > 0 and (sql[i - 1].isalnum() or sql[i - 1] == "_"):
            return i
        m = _DOLLAR.match(sql, i)
        if m:
            end = sql.find(m.group(0), m.end())
            return n if end < 0 else end + len(m.group(0))
    return i


def _plain(sql: str) -> bool:
    """True if ``sql`` has no quote, dollar or comment: nothing for :func:`skip_quoted` to skip, so
    the helpers below take their one-pass forms (most BI statements; ~0.3 ms less each)."""
    return not any(c in sql for c in _SPECIAL) and "--" not in sql and "/*" not in sql


_SPECIAL = ("'", '"', "$")


def strip_comments(sql: str) -> str:
    """The text with comments replaced by a space (quotes kept)."""
    if _plain(sql):
        return sql
    out, i, n = [], 0, len(sql)
    while i < n:
        j = skip_quoted(sql, i)
        if j == i:
            out.append(sql[i])
            i += 1
        else:
            if sql.startswith("--", i) or sql.startswith("/*", i):
                out.append(" ")
            else:
                out.append(sql[i:j])
            i = j
    return "".join(out)


def split_statements(sql: str) -> list[Statement]:
    """Split on top-level semicolons; drop statements that are only whitespace/comments."""
    if _plain(sql):
        plain, start = [], 0
        for piece in sql.split(";"):
            plain.append(Statement(piece, start))
            start += len(piece) + 1
        return [p for p in plain if p.text.strip()]
    parts: list[Statement] = []
    start, i, n = 0, 0, len(sql)
    while i < n:
        j = skip_quoted(sql, i)
        if j != i:
            i = j
            continue
        if sql[i] == ";":
            parts.append(Statement(sql[start:i], start))
            start = i + 1
        i += 1
    parts.append(Statement(sql[start:], start))
    return [p for p in parts if strip_comments(p.text).strip()]


def keywords(sql: str, count: int = 3) -> list[str]:
    """The first ``count`` words of the statement, lower-cased, comments skipped."""
    return [w.lower() for w in _WORD.findall(strip_comments(sql))[:count]]


def identifiers(sql: str) -> set[str]:
    """Every bare or double-quoted identifier outside string literals and comments, lowered.

    Used to route a statement: if any identifier names a private table, the statement goes to
    the DP pipeline (which parses it properly and refuses what it cannot answer).
    """
    found: set[str] = set()
    if _plain(sql):
        # the loop below, without quotes to skip: a word preceded by a word character lies
        # inside a longer word, as do the positions after it that the loop would try
        for word in _WORD.finditer(sql):
            at = word.start()
            if at == 0 or not (sql[at - 1].isalnum() or sql[at - 1] in "_$"):
                found.add(word.group(0).lower())
        return found
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch == '"':
            j = skip_quoted(sql, i)
            found.add(sql[i + 1 : j - 1].replace('""', '"').lower())
            i = j
            continue
        j = skip_quoted(sql, i)
        if j != i:
            i = j
            continue
        m = _WORD.match(sql, i)
        if m and (i == 0 or not (sql[i - 1].isalnum() or sql[i - 1] in "_$")):
            found.add(m.group(0).lower())
            i = m.end()
            continue
        i += 1
    return found
