"""The wire server's own Python work a DP query, counted (not timed): load-independent.

A :class:`~dpsql.server.server.Server` over the fixture's service (answer cache off, memory
ledger) runs in this process on its own loop thread; one client sends the bench's DP queries
(bench_server.py's four shapes, new WHERE numbers each time) one after another. After
``--warmup`` queries, a profile hook counts every Python function call in the server's threads
(the loop and the statement pool) over ``--queries`` queries and prints the calls a query by
where the called function lives: the server (``dpsql/server``, ``dpsql/gil_gate.py``), the
standard library's event loop and threads (asyncio, concurrent.futures, threading, selectors,
socket), and the rest (the pipeline). Timings on this shared machine move ±20% with the other
sessions' load; these counts move only when the code does. Then ``--cpu-rounds`` rounds of
``--cpu-queries`` queries with no hook: the CPU of the server's threads a query (the process's
CPU less the client thread's), one client at a time, so no contention between statements:
still load-dependent (run two trees alternately to compare).

    python bench/bench_server_calls.py --warmup 400 --queries 400
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_server as b

import dpsql
from dpsql.privacy.ledger import MemoryLedger
from dpsql.server.server import Server, ServerThread
from dpsql.server.testing import RawClient
from dpsql.server.users import UserStore, users_path

ROOT = Path(__file__).resolve().parent.parent
_STDLIB = ("asyncio", "concurrent", "threading.py", "selectors.py", "socket.py", "queue.py")

counting = False
unhook = False
calls: collections.Counter[str] = collections.Counter()
functions: collections.Counter[str] = collections.Counter()


def _where(filename: str) -> str:
    if "/dpsql/server/" in filename or filename.endswith("gil_gate.py"):
        return "server"
    if any(part in filename for part in _STDLIB):
        return "event loop and threads (stdlib)"
    return "pipeline and the rest"


def _hook(frame: Any, event: str, _arg: Any) -> None:
    if unhook:  # each thread drops the hook at its next event (the timed rounds)
        sys.setprofile(None)
        return
    if counting and event == "call":
        code = frame.f_code
        where = _where(code.co_filename)
        calls[where] += 1
        if where != "pipeline and the rest":
            functions[f"{Path(code.co_filename).name}:{code.co_name}"] += 1


def main() -> None:
    global counting, unhook
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warmup", type=int, default=400)
    ap.add_argument("--queries", type=int, default=400)
    ap.add_argument("--top", type=int, default=25, help="the server's most called functions")
    ap.add_argument("--cpu-rounds", type=int, default=3, help="rounds timing the server's CPU")
    ap.add_argument("--cpu-queries", type=int, default=200)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="server-calls-"))
    policy = tmp / "visits.toml"
    for name in ("visits.toml", "visits.csv"):
        (tmp / name).write_bytes((ROOT / "fixtures" / name).read_bytes())
    UserStore(users_path(policy)).add("bench0", b.PASSWORD)
    service = dpsql.Service(policy, cache=False, ledger=MemoryLedger())
    users = UserStore(users_path(policy))
    threading.setprofile(_hook)  # the server's threads start after this
    th = ServerThread(lambda: Server(service, users))
    port = th.start()
    c = RawClient("127.0.0.1", port, timeout=120)
    assert c.login("bench0", b.PASSWORD).status == "I"
    c.query(f"SET epsilon = {b.EPSILON}")
    for k in range(a.warmup):
        c.query(b._query(k, False))
    counting = True
    for k in range(a.warmup, a.warmup + a.queries):
        reply = c.query(b._query(k, False))
        assert not reply.errors(), reply.errors()
    counting = False
    unhook = True
    threading.setprofile(None)
    for k in range(20):  # every server thread has run (and dropped the hook) after a few
        c.query(b._query(k, False))
    server_cpu = []
    for r in range(a.cpu_rounds):  # the server's CPU a query, no profile hook counting
        start = a.warmup + a.queries + r * a.cpu_queries
        before, own = time.process_time(), time.thread_time()
        for k in range(start, start + a.cpu_queries):
            c.query(b._query(k, False))
        spent = (time.process_time() - before) - (time.thread_time() - own)
        server_cpu.append(spent / a.cpu_queries * 1e3)
    c.close()
    th.stop()
    service.close()
    n = a.queries
    print(f"Python calls a DP query in the server's threads ({n} queries after {a.warmup}):")
    for where, count in calls.most_common():
        print(f"  {count / n:8.1f}  {where}")
    print(f"  {sum(calls.values()) / n:8.1f}  total")
    if server_cpu:
        print(
            f"the server's CPU a DP query (its threads; one client, {a.cpu_queries} queries a "
            f"round): rounds {', '.join(f'{x:.3f}' for x in server_cpu)} ms, "
            f"median {statistics.median(server_cpu):.3f} ms (moves with the load)"
        )
    print("the server's and the stdlib's most called:")
    for name, count in functions.most_common(a.top):
        print(f"  {count / n:8.1f}  {name}")


if __name__ == "__main__":
    main()
