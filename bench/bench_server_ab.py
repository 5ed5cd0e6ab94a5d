"""``dpsql serve`` from two source trees side by side: before and after a change to the server.

Each tree's server (``--workers 1``, or ``--workers N``; answer cache off) gets its own copy
of the fixture policy, data and ledger; after ``--warmup`` seconds (its analysts' text shapes
learned), rounds of the DP queries of bench_server.py alternate between the two, so load from
other jobs hits both alike. Prints q/s,
latency and the server's CPU per query for each round, the ratio after/before per round and its
median, then rounds of ``SHOW epsilon`` (answered by the session, no engine): before, after,
after, before. Last, ``--backend-rounds`` alternating runs of each tree's ``DpBackend`` in a
process of its own (no socket, no event loop: the door's own cost over the service), CPU a query
and Python function calls a query (cProfile: a count that does not depend on the load).

    git archive OLD | tar -x -C /tmp/before; git archive HEAD | tar -x -C /tmp/after
    python bench/bench_server_ab.py /tmp/before /tmp/after --connections 8 --seconds 4 --rounds 6

The two sides may be one tree with a different environment (``--env-after DPSQL_GATE=0``,
``--env-before``; repeatable): each side's server is started with its variables set.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_server as b

from dpsql.policy import load_policy
from dpsql.server.users import UserStore, users_path

ROOT = Path(__file__).resolve().parent.parent

# Run with cwd = a source tree, argv: name, JSON [epsilon, queries]: the DP queries through
# that tree's DpBackend, in process.
BACKEND = """
import json, sys, time
sys.path.insert(0, ".")
from dpsql.dbapi import Service
from dpsql.privacy.ledger import MemoryLedger
from dpsql.server.backend import DpBackend
from dpsql.server.server import Server
epsilon, queries = json.loads(sys.argv[2])
service = Service("fixtures/visits.toml", cache=False, ledger=MemoryLedger())
server = Server.__new__(Server)
server.service = service
opener = getattr(Server, "open_session", None) or getattr(Server, "connect_analyst")
backend = DpBackend(opener(server, "bench"))
backend.execute(f"SET epsilon = {epsilon!r}", None)
def run(n, start):
    for k in range(start, start + n):
        backend.execute(queries[k % 4].format(i=k % 90, j=10 + k % 90), None)
run(400, 0)
times = []
for r in range(5):
    t = time.process_time()
    run(200, 1000 + 200 * r)
    times.append((time.process_time() - t) / 200)
times.sort()
import cProfile, pstats
profile = cProfile.Profile()
profile.enable()
run(200, 3000)
profile.disable()
calls = pstats.Stats(profile).total_calls / 200  # load-independent: Python calls a query
print(f"backend {sys.argv[1]:<6} CPU a query: min {1000 * times[0]:.3f} ms, "
      f"median {1000 * times[2]:.3f} ms; {calls:.1f} Python calls a query")
service.close()
"""


def start(
    tree: str, policy: Path, workers: int = 1, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, int]:
    """``dpsql serve`` from ``tree`` (``python -m dpsql`` run there imports that tree's code),
    with ``env`` added to this process's environment."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpsql",
            "serve",
            "--policy",
            str(policy),
            "--port",
            "0",
            "--no-cache",
            "--workers",
            str(workers),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tree,
        env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline() if proc.stdout else ""
    m = re.search(r":(\d+)\s*$", line)
    assert m, line
    return proc, int(m.group(1))


def fixture_copy(tmp: Path, connections: int) -> Path:
    """The fixture's policy and data copied into ``tmp`` (so its ledger is a fresh one), with
    the logins ``bench0`` .. ``bench{connections - 1}``; returns the copied policy's path."""
    src = ROOT / "fixtures" / "visits.toml"
    policy = tmp / src.name
    shutil.copy(src, policy)
    for t in load_policy(src).tables.values():
        if t.source_path is not None:
            shutil.copy(t.source_path, tmp / t.source_path.name)
    users = UserStore(users_path(policy))
    for i in range(connections):
        users.add(f"bench{i}", b.PASSWORD)
    return policy


def _env(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` options as a mapping."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--env-before/--env-after take KEY=VALUE, not {pair!r}")
        out[key] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend-rounds", type=int, default=3, help="in-process DpBackend runs")
    ap.add_argument("--workers", type=int, default=1, help="dpsql serve --workers N for both")
    ap.add_argument("--warmup", type=float, default=6.0, help="seconds of warm-up per server")
    for side in ("before", "after"):
        ap.add_argument(
            f"--env-{side}",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"an environment variable set for the {side} server (repeatable)",
        )
    a = ap.parse_args()
    envs = {"before": _env(a.env_before), "after": _env(a.env_after)}
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    tmps: list[Path] = []
    try:
        for name, tree in (("before", a.base), ("after", a.new)):
            tmp = Path(tempfile.mkdtemp(prefix=f"doors-{name}-"))
            tmps.append(tmp)
            servers[name] = start(tree, fixture_copy(tmp, a.connections), a.workers, envs[name])
        print(
            f"{a.connections} connections, {a.seconds:g} s rounds, --workers {a.workers}, "
            f"env before {envs['before']} after {envs['after']}, {b._load()}"
        )
        for name, srv in servers.items():
            b.run_server(srv, a.connections, a.warmup, None, f"warm {name}")
        rates: dict[str, list[float]] = {n: [] for n in servers}
        for r in range(a.rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for name in order:
                rates[name].append(
                    b.run_server(servers[name], a.connections, a.seconds, None, name)
                )
            print(f"ratio after/before = {rates['after'][-1] / rates['before'][-1]:.3f}")
        for name in [*servers, *reversed(servers)]:  # before, after, after, before
            b.run_server(servers[name], a.connections, 3.0, "SHOW epsilon", f"proto {name}")
        ratios = [x / y for x, y in zip(rates["after"], rates["before"], strict=True)]
        print(f"median ratio after/before = {statistics.median(ratios):.3f}; {b._load()}")
        cpu = {n: b.CPU_MS.get(n, []) for n in servers}
        if all(cpu.values()):
            print(
                "median ms CPU a query: before {:.2f}, after {:.2f} (ratio {:.3f})".format(
                    statistics.median(cpu["before"]),
                    statistics.median(cpu["after"]),
                    statistics.median(cpu["after"]) / statistics.median(cpu["before"]),
                )
            )
        trees = {"before": a.base, "after": a.new}
        for r in range(a.backend_rounds):
            for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                spec = json.dumps([b.EPSILON, b.DP_QUERIES])
                command = [sys.executable, "-c", BACKEND, name, spec]
                subprocess.run(command, cwd=trees[name], check=True)
        print(b._load())
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(30)
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)


if __name__ == "__main__":
    main()
