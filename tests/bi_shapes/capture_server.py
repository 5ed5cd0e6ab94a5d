"""Run ``dpsql serve`` on a private copy of the visits fixture and log every statement a client
sends, with how the server routed it (dp, probe, catalog, set, ...) and the outcome.

    python tests/bi_shapes/capture_server.py --port 5433 --log /tmp/shapes.log [--exact]

Point a BI tool at it (user ``bi``, password ``bi-password``, database ``visits``), build the
charts, then copy the ``dp``/``probe`` lines of the log into a tests/bi_shapes/<tool>.toml
shape. ``--exact`` switches noise off (ZeroNoise, R = G = 100, as the replay suite does), so
the numbers the tool shows can be checked against the reference SQL. Never use it on real data.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import dpsql
from dpsql.server import session as session_module
from dpsql.server.server import Server, ServerThread
from dpsql.server.users import UserStore, users_path

ROOT = Path(__file__).resolve().parents[2]
USER, PASSWORD = "bi", "bi-password"


def _log_statements(path: Path) -> None:
    """Wrap the session's statement runner so each statement is logged before it runs."""
    original = session_module.Session.run_statement
    lock = threading.Lock()

    async def run_statement(self, sql, kind, params):  # type: ignore[no-untyped-def]
        entry = {"t": round(time.time(), 3), "kind": kind, "sql": sql}
        try:
            outcome = await original(self, sql, kind, params)
        except Exception as exc:
            entry["error"] = f"{getattr(exc, 'sqlstate', '?')} {exc}"
            raise
        else:
            entry["rows"] = len(getattr(outcome, "rows", []) or [])
            return outcome
        finally:
            with lock, path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")

    session_module.Session.run_statement = run_statement  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=5433)
    parser.add_argument("--log", type=Path, default=Path("bi_statements.log"))
    parser.add_argument("--exact", action="store_true", help="noise off, bounds never bind")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dpsql-capture-"))
    for name in ("visits.toml", "visits.csv"):
        shutil.copy(ROOT / "fixtures" / name, work / name)
    users = UserStore(users_path(work / "visits.toml"))
    users.add(USER, PASSWORD)
    options: dict = {"cache": False}
    policy: object = work / "visits.toml"
    if args.exact:
        import tomllib

        from dpsql.privacy.ledger import MemoryLedger
        from dpsql.privacy.samplers import ZeroNoise

        loaded = tomllib.loads((work / "visits.toml").read_text())
        loaded["tables"]["visits"].update(
            source=str(work / "visits.csv"), max_rows_per_unit=100, max_groups_per_unit=100
        )
        loaded["privacy"].update(budget_epsilon=1e9, budget_delta=0.5)
        policy = loaded
        options.update(ledger=MemoryLedger(), noise=ZeroNoise())
    service = dpsql.Service(policy, **options)
    _log_statements(args.log)
    thread = ServerThread(lambda: Server(service, users), port=args.port)
    thread.start()
    print(f"dpsql capture server on 127.0.0.1:{thread.port}, logging to {args.log}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        thread.stop()
        service.close()


if __name__ == "__main__":
    main()
