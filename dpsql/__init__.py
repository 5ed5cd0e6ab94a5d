"""dpsql: a differential-privacy proxy for SQL.

import dpsql
with dpsql.connect(policy="fixtures/visits.toml", analyst="alice") as conn:
    cur = conn.cursor()
    cur.execute("SELECT department, COUNT(*) AS visits FROM visits GROUP BY department")
    print(cur.fetchall())
"""

from dpsql.dbapi import Connection, Cursor, apilevel, connect, paramstyle, threadsafety
from dpsql.errors import (
    BudgetExhaustedError,
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
from dpsql.pipeline import Service

__version__ = "0.1.0"

__all__ = [
    "BudgetExhaustedError",
    "Connection",
    "Cursor",
    "DataError",
    "DatabaseError",
    "Error",
    "IntegrityError",
    "InterfaceError",
    "InternalError",
    "NotSupportedError",
    "OperationalError",
    "PolicyError",
    "PrivacyError",
    "ProgrammingError",
    "Service",
    "Warning",
    "apilevel",
    "connect",
    "paramstyle",
    "threadsafety",
]
