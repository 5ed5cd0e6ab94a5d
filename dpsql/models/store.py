"""Named models an analyst learned with DP, kept next to the budget they cost.

A model is released output (its parameters were measured with DP and charged), so storing,
listing and applying it is post-processing. Records are per (analyst, dataset): an analyst
sees and applies only their own models, as with cached answers.

Backed by the ledger's SQLite file (a ``models`` table of its own, opened through the
ledger's ``path``) when the ledger is a :class:`~dpsql.privacy.sqlite_ledger.SQLiteLedger`,
and by a dict for the in-memory ledger: a model lives exactly as long as the budget record.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
import weakref
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

#: Kinds of model; each has a SQL predictor in :data:`dpsql.models.predict.PREDICTORS`.
KINDS = ("rule_list", "linear_regression", "logistic_regression")


@dataclass(frozen=True)
class StoredModel:
    """One stored model: what it is, whose, what it cost and the statement that made it."""

    name: str
    kind: str
    analyst: str
    dataset: str
    table: str
    created: str  # ISO 8601 UTC
    epsilon: float
    delta: float
    rho: float
    query: str
    model_json: str

    def summary(self) -> dict[str, Any]:
        """Everything but the model itself (``dpsql model list``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model_json"}


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


_COLUMNS = tuple(f.name for f in fields(StoredModel))
_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT NOT NULL, kind TEXT NOT NULL, analyst TEXT NOT NULL, dataset TEXT NOT NULL,
    "table" TEXT NOT NULL, created TEXT NOT NULL, epsilon REAL NOT NULL, delta REAL NOT NULL,
    rho REAL NOT NULL, query TEXT NOT NULL, model_json TEXT NOT NULL,
    PRIMARY KEY (analyst, dataset, name)
)
"""


class ModelStore:
    """put / get / list / delete of :class:`StoredModel` by (analyst, dataset, name).

    ``path`` None keeps models in memory (the in-memory ledger); otherwise they live in the
    SQLite file at ``path`` in a ``models`` table (one connection per thread, WAL, a busy
    timeout, as the ledger itself).  ``put`` replaces a model of the same name.
    """

    def __init__(self, path: str | Path | None = None, *, timeout: float = 30.0) -> None:
        self.path = None if path is None else Path(path)
        self.timeout = timeout
        self._memory: dict[tuple[str, str, str], StoredModel] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    @staticmethod
    def for_ledger(ledger: Any) -> ModelStore:
        """The store that lives with ``ledger`` (one per ledger object, created on first use)."""
        with _STORES_LOCK:
            store = _STORES.get(ledger)
            if store is None:
                from dpsql.privacy.sqlite_ledger import SQLiteLedger

                path = ledger.path if isinstance(ledger, SQLiteLedger) else None
                store = ModelStore(path)
                _STORES[ledger] = store
            return store

    # -- SQLite -------------------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            assert self.path is not None  # every caller keeps a memory store off SQLite
            conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
            conn.execute(_SCHEMA)
            self._local.conn = conn
        return conn

    # -- API ----------------------------------------------------------------------------------
    def put(self, model: StoredModel) -> None:
        if model.kind not in KINDS:
            raise ValueError(f"unknown model kind {model.kind!r}")
        if self.path is None:
            with self._lock:
                self._memory[(model.analyst, model.dataset, model.name)] = model
            return
        marks = ", ".join("?" for _ in _COLUMNS)
        names = ", ".join(f'"{c}"' for c in _COLUMNS)
        self._conn().execute(
            f"INSERT OR REPLACE INTO models ({names}) VALUES ({marks})", astuple(model)
        )

    def get(self, analyst: str, dataset: str, name: str) -> StoredModel | None:
        if self.path is None:
            with self._lock:
                return self._memory.get((analyst, dataset, name))
        names = ", ".join(f'"{c}"' for c in _COLUMNS)
        row = (
            self._conn()
            .execute(
                f"SELECT {names} FROM models WHERE analyst = ? AND dataset = ? AND name = ?",
                (analyst, dataset, name),
            )
            .fetchone()
        )
        return None if row is None else StoredModel(*row)

    def list(self, analyst: str | None = None, dataset: str | None = None) -> list[StoredModel]:
        """Models, by analyst, dataset and name; ``None`` matches any analyst / dataset."""
        if self.path is None:
            with self._lock:
                found = list(self._memory.values())
        else:
            names = ", ".join(f'"{c}"' for c in _COLUMNS)
            found = [StoredModel(*r) for r in self._conn().execute(f"SELECT {names} FROM models")]
        return sorted(
            (
                m
                for m in found
                if (analyst is None or m.analyst == analyst)
                and (dataset is None or m.dataset == dataset)
            ),
            key=lambda m: (m.analyst, m.dataset, m.name),
        )

    def delete(self, analyst: str, dataset: str, name: str) -> bool:
        """Remove a model; True if it existed."""
        if self.path is None:
            with self._lock:
                return self._memory.pop((analyst, dataset, name), None) is not None
        cur = self._conn().execute(
            "DELETE FROM models WHERE analyst = ? AND dataset = ? AND name = ?",
            (analyst, dataset, name),
        )
        return cur.rowcount > 0

    def lookup(self, analyst: str, dataset: str):
        """``name -> StoredModel | None`` for one analyst and dataset (for expand_predictions)."""
        return lambda name: self.get(analyst, dataset, name)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


_STORES: weakref.WeakKeyDictionary[Any, ModelStore] = weakref.WeakKeyDictionary()
_STORES_LOCK = threading.Lock()


def model_record(
    plan: Any, kind: str, analyst: str, dataset: str, query: str, payload: dict[str, Any]
) -> StoredModel:
    """The :class:`StoredModel` of a table function called with ``model => name`` (its plan
    has ``model``, ``table`` and ``cost``)."""
    import json

    c = plan.cost
    return StoredModel(
        name=plan.model,
        kind=kind,
        analyst=analyst,
        dataset=dataset,
        table=plan.table,
        created=now(),
        epsilon=float(c.epsilon),
        delta=float(c.delta),
        rho=float(c.rho),
        query=query,
        model_json=json.dumps(payload),
    )
