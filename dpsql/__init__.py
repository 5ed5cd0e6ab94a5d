"""dpsql: a differential-privacy proxy for SQL.

import dpsql
with dpsql.connect(policy="fixtures/visits.toml", analyst="alice") as conn:
    cur = conn.cursor()
    cur.execute("SELECT department, COUNT(*) AS visits FROM visits GROUP BY department")
    print(cur.fetchall())
"""

import logging
from typing import TYPE_CHECKING, Any

from dpsql.errors import (
    BudgetExhaustedError,
    BudgetWarning,
    DatabaseError,
    DataError,
    Error,
    IntegrityError,
    InterfaceError,
    InternalError,
    NotSupportedError,
    OperationalError,
    PolicyError,
    PrivacyError,
    ProgrammingError,
    Warning,
)

if TYPE_CHECKING:
    from dpsql.dbapi import (
        BINARY,
        BOOLEAN,
        DATETIME,
        NUMBER,
        ROWID,
        STRING,
        Binary,
        Connection,
        Cursor,
        Date,
        DateFromTicks,
        Service,
        Time,
        TimeFromTicks,
        Timestamp,
        TimestampFromTicks,
        connect,
        read_sql,
    )
    from dpsql.privacy.ledger import EphemeralBudgetWarning
    from dpsql.privacy.ledger_file import LedgerPermissionWarning

# PEP 249 module globals (also in dpsql.dbapi).
apilevel = "2.0"
threadsafety = 1
paramstyle = "qmark"

_PEP249 = [
    "BINARY",
    "BOOLEAN",
    "DATETIME",
    "NUMBER",
    "ROWID",
    "STRING",
    "Binary",
    "Date",
    "DateFromTicks",
    "Time",
    "TimeFromTicks",
    "Timestamp",
    "TimestampFromTicks",
]
_LAZY = {
    "Connection": "dpsql.dbapi",
    "Cursor": "dpsql.dbapi",
    "connect": "dpsql.dbapi",
    "read_sql": "dpsql.dbapi",
    **dict.fromkeys(_PEP249, "dpsql.dbapi"),
    "Service": "dpsql.dbapi",  # the service with the DB-API door (service.connect)
    "EphemeralBudgetWarning": "dpsql.privacy.ledger",
    "LedgerPermissionWarning": "dpsql.privacy.ledger_file",
}


def __getattr__(name: str) -> Any:
    """Import the engine-heavy modules on first use, so `dpsql budget` etc. start fast."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dpsql' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__version__ = "0.1.0"

# A library logs for the application to route; without a handler of its own, Python's last
# resort would print dpsql's operator messages (tracebacks of internal errors) to stderr.
logging.getLogger("dpsql").addHandler(logging.NullHandler())

__all__ = [
    "BINARY",
    "BOOLEAN",
    "DATETIME",
    "NUMBER",
    "ROWID",
    "STRING",
    "Binary",
    "BudgetExhaustedError",
    "BudgetWarning",
    "Connection",
    "Cursor",
    "DataError",
    "DatabaseError",
    "Date",
    "DateFromTicks",
    "EphemeralBudgetWarning",
    "Error",
    "IntegrityError",
    "InterfaceError",
    "InternalError",
    "LedgerPermissionWarning",
    "NotSupportedError",
    "OperationalError",
    "PolicyError",
    "PrivacyError",
    "ProgrammingError",
    "Service",
    "Time",
    "TimeFromTicks",
    "Timestamp",
    "TimestampFromTicks",
    "Warning",
    "apilevel",
    "connect",
    "paramstyle",
    "read_sql",
    "threadsafety",
]
