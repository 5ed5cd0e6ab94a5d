"""Quoting of identifiers in generated SQL (one rule for every engine and module)."""

from __future__ import annotations


def quote_ident(name: str) -> str:
    """A standard-SQL double-quoted identifier; embedded quotes are doubled."""
    return '"' + name.replace('"', '""') + '"'
