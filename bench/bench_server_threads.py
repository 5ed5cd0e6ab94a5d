"""Where ``dpsql serve``'s CPU goes, by thread: each process's event loop against its statement
threads, and how often they switch, per query of the bench's DP load.

The server's CPU a query is not one Python function (docs/server.md, "Where the door's
millisecond goes"): it is the loop's own work and the hand-offs between the loop and the
statement threads. This prints, for one round of ``bench_server.py``'s DP queries after a
warm-up, the user and system CPU and the voluntary / involuntary context switches a query of
each process's main thread (the event loop) and of its other threads (statements, the group
commit, DuckDB; connections' own threads), read from ``/proc/PID/task/*`` (Linux) at an eighth
and at seven eighths of the round (the queries between: the round's rate times the interval).
Switches a query depend much less on the machine's load than CPU does.

    python bench/bench_server_threads.py --workers 2 --warmup 45 --seconds 8
    python bench/bench_server_threads.py --tree /tmp/before --workers 1   # another source tree
"""

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_server as b
from bench_server_ab import fixture_copy, start

ROOT = Path(__file__).resolve().parent.parent

# (pid, tid) -> (user ticks, system ticks, voluntary switches, involuntary switches)
Counts = dict[tuple[int, int], tuple[int, int, int, int]]


def _processes(pid: int) -> list[int]:
    """The server and its children (``--workers`` processes, catalog helpers)."""
    out = [pid]
    for entry in Path("/proc").iterdir():
        fields = b._stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and fields[1] == str(pid):
            out.append(int(entry.name))
    return out


def _switches(status: str, key: str) -> int:
    return int(status.split(f"\n{key}:")[1].split()[0])


def threads(pid: int) -> Counts:
    counts: Counts = {}
    for proc in _processes(pid):
        for task in Path(f"/proc/{proc}/task").iterdir():
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                status = (task / "status").read_text()
            except OSError:  # the thread ended meanwhile
                continue
            counts[(proc, int(task.name))] = (
                int(fields[11]),
                int(fields[12]),
                _switches(status, "voluntary_ctxt_switches"),
                _switches(status, "nonvoluntary_ctxt_switches"),
            )
    return counts


def report(before: Counts, after: Counts, queries: int) -> None:
    """Sums the change of each thread, the loops (a process's main thread) apart."""
    tick = os.sysconf("SC_CLK_TCK")
    sums = {"event loops": [0, 0, 0, 0], "other threads": [0, 0, 0, 0]}
    for key, now in after.items():
        then = before.get(key, (0, 0, 0, 0))
        group = sums["event loops" if key[0] == key[1] else "other threads"]
        for i in range(4):
            group[i] += now[i] - then[i]
    for name, (user, system, vol, inv) in sums.items():
        print(
            f"{name:<14} user {1000 * user / tick / queries:6.3f}  sys "
            f"{1000 * system / tick / queries:6.3f} ms a query   switches a query: "
            f"voluntary {vol / queries:5.1f}  involuntary {inv / queries:5.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=str(ROOT), help="source tree whose dpsql serve runs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=45.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="server-threads-"))
    proc, port = start(a.tree, fixture_copy(tmp, a.connections), a.workers)
    try:
        b.run_server((proc, port), a.connections, a.warmup, None, "warm")
        print(f"--workers {a.workers}, {a.connections} connections, {b._load()}")
        # Read inside the round (its connections open): threads that end with the round's
        # connections would be missed by a read after it.
        samples: list[tuple[float, Counts]] = []

        def sample() -> None:
            samples.append((time.monotonic(), threads(proc.pid)))

        inner = max(0.5, a.seconds / 8)
        timers = [threading.Timer(inner, sample), threading.Timer(a.seconds - inner, sample)]
        for timer in timers:
            timer.start()
        rate = b.run_server((proc, port), a.connections, a.seconds, None, "round")
        for timer in timers:
            timer.join()
        (t0, before), (t1, after) = samples
        report(before, after, max(1, round(rate * (t1 - t0))))  # queries, within a few %
        print(b._load())
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
