"""Timing channels: what wall time tells an observer, measured side by side in one run.

The figures for "timing channels (out of scope)" in docs/threat_model.md. The shipped fixture
(20k visits, privacy unit patient_id), the DB-API, real noise. Neighbouring datasets D / D' differ
by patient 999 and their 5 visits: D' is the fixture as shipped, D the fixture without them.
Every comparison is interleaved (sides alternate, their order flipped every rep, so machine noise
and order effects hit both alike) after a short warm-up; each side gets ``--reps`` samples:
median and p10 / p90 of wall time, the difference of medians with a bootstrap 95% interval, and
that difference against the run-to-run spread (p90 - p10).

1. neighbours: the same DP query on D and on D' (answer cache off, so each run is answered and
   charged). The residual channel that stays out of scope: the engine reads one more unit.
2. outcomes: a free refusal (typing) vs an answered query vs its cached replay. The analyst
   sees which of the three happened anyway, so this is informational.
3. planning caches: EXPLAIN by analyst A (cold, then warm), then by B after A warmed it, and by C
   on a text nobody sent (a cold control at B's place in the sequence). The caches are per
   analyst, so B should time like a cold A, and like C. 3b repeats B vs C with the process-wide
   token cache (dpsql/frontend/positions.py, keyed by the exact text) emptied before every run: the
   part of the B-vs-C difference that disappears is that cache's.
4. a lazily read source: D / D' as Parquet (the engine reads it through a casting view), one of
   patient 999's ages in D' a value that does not cast. The engine TRY_CASTs lazily read
   sources, so it reads NULL (before that, D' failed and D answered): both should time alike.
   Then the uniform, charged failure (58000) vs an answer: no query of the typed grammar fails
   on the data any more, so the failure is an operator fault instead, a copy of D truncated
   under the running service. No monkeypatching either way.
5. an odd value in one unit: D without patient 999, D' with them and one of their visit dates
   'infinity' (DuckDB holds it; numpy's datetime64 cannot). Before issue 25 item 6 that value
   made the column-program load of the whole table fail silently, so every query on D' ran its
   SQL (~3x slower). Each side prints which path the table takes (held in columns or not).
6. the two choices left inside a column program that read the table (dpsql.engine.columnar):
   its (unit, group) slots as a dense grid (units x groups <= 8 per row) or by sorted pairs,
   and its group codes in mixed radix (groups <= max(4 per row, 4096)) or re-densified. Both
   follow counts of distinct values, which one unit moves: generated tables with D just inside
   each limit and D' one unit (one row) past it. Timed is the engine's part alone (the compiled
   query's execute, where the choice is made): end to end, the release's noise for one more
   group present on D' is a difference of its own that would hide this one.
7. one unit across the held table's declared size (200,000 rows): D a generated table of
   199,998 rows, D' with one more unit of 5 rows. Each side prints whether it starts and is
   held; where both start (before issue 25 item 6: D held, D' silently not) their engine times
   are compared. Now D' does not start (PolicyError naming small_tables = "sql").

    python bench/bench_timing_channels.py                  # 200 reps per side, ~1 minute
    python bench/bench_timing_channels.py --reps 50        # quick look
    python bench/bench_timing_channels.py --markdown /work/notes/timing.md
    python bench/bench_timing_channels.py --only odd      # section 5 alone
    python bench/bench_timing_channels.py --only odd grid # sections 5 and 6
    python bench/bench_timing_channels.py --only rows     # section 7 (~30 s to build)
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402

import dpsql  # noqa: E402
from dpsql.dbapi import connect_service  # noqa: E402
from dpsql.frontend import positions  # noqa: E402
from dpsql.privacy.ledger import MemoryLedger  # noqa: E402

FIXTURE_TOML = ROOT / "fixtures" / "visits.toml"
FIXTURE_CSV = ROOT / "fixtures" / "visits.csv"
UNIT = "999"  # in the shipped fixture, with 5 visits

NEIGHBOUR_QUERIES = {
    "count unit": f"SELECT COUNT(*) FROM visits WHERE patient_id = {UNIT}",
    "group dept": "SELECT department, COUNT(*) FROM visits GROUP BY department",
    "threshold diag": "SELECT diagnosis, COUNT(*) FROM visits GROUP BY diagnosis",
}
ODD_QUERIES = {
    **NEIGHBOUR_QUERIES,
    "date where": "SELECT COUNT(*) FROM visits WHERE visit_date >= '2024-06-01'",
}
FAILING_QUERY = "SELECT AVG(age) FROM visits"
# {x}: a literal unique to the rep, so every rep's text (and answer-cache key) is new.
REFUSED = "SELECT COUNT(*) FROM visits WHERE diagnosis IS TRUE AND age > {x}"
ANSWERED = "SELECT department, COUNT(*) FROM visits WHERE age > {x} GROUP BY department"
# {tag}: a fixed-width comment unique to the text, so process-wide text caches start cold too.
EXPLAIN = "EXPLAIN SELECT age, COUNT(*) FROM visits GROUP BY age /* {tag} */"


@dataclass(frozen=True)
class Side:
    """One side of a comparison: wall and process-CPU times in seconds, and what every run
    returned. CPU (DuckDB's threads included) is what the load of a shared machine disturbs
    least; wall time is what an observer sees."""

    name: str
    times: tuple[float, ...]
    cpu: tuple[float, ...]
    outcomes: frozenset[str]

    def median(self) -> float:
        return statistics.median(self.times)

    def quantile(self, q: int) -> float:
        """The q-th decile (statistics' inclusive method)."""
        return statistics.quantiles(self.times, n=10, method="inclusive")[q - 1]

    def spread(self) -> float:
        return self.quantile(9) - self.quantile(1)

    def cpu_median(self) -> float:
        return statistics.median(self.cpu)


@dataclass(frozen=True)
class Row:
    """A side measured against its reference side."""

    section: str
    label: str
    side: Side
    reference: Side | None

    def delta(self) -> float | None:
        return None if self.reference is None else self.side.median() - self.reference.median()


# -- data and services ----------------------------------------------------------------------
def policy(source: Path) -> dict[str, Any]:
    """The fixture's policy over ``source``; budgets large enough for every rep."""
    pol = tomllib.loads(FIXTURE_TOML.read_text())
    pol["tables"]["visits"]["source"] = str(source)
    pol["privacy"].update(budget_epsilon=1e12, budget_delta=0.5)
    return pol


def without_unit(tmp: Path) -> Path:
    """D: the fixture CSV without patient 999's rows."""
    path = tmp / "visits_without_999.csv"
    with FIXTURE_CSV.open(newline="") as src, path.open("w", newline="") as dst:
        reader, writer = csv.reader(src), csv.writer(dst)
        writer.writerow(next(reader))
        dropped = 0
        for row in reader:
            if row[0] == UNIT:
                dropped += 1
                continue
            writer.writerow(row)
    assert dropped == 5, f"the fixture should hold 5 visits of patient {UNIT}, found {dropped}"
    return path


def parquet_neighbours(tmp: Path) -> tuple[Path, Path]:
    """D without patient 999, D' with them and one age that does not cast to an integer.

    Stored as text so the loader's LIMIT 0 check passes; the engine's view casts on read.
    """
    con = duckdb.connect()
    rows = f"read_csv('{FIXTURE_CSV}', header = true, all_varchar = true)"
    d, d_prime = tmp / "d.parquet", tmp / "d_prime.parquet"
    con.execute(f"COPY (SELECT * FROM {rows} WHERE patient_id <> '{UNIT}') TO '{d}'")
    con.execute(
        f"COPY (SELECT * REPLACE (CASE WHEN patient_id = '{UNIT}' AND visit_date = "
        f"(SELECT MAX(visit_date) FROM {rows} WHERE patient_id = '{UNIT}') THEN 'n/a' "
        f"ELSE age END AS age) FROM {rows}) TO '{d_prime}'"
    )
    con.close()
    return d, d_prime


def service(source: Path, *, cache: bool = False) -> dpsql.Service:
    return dpsql.Service(policy(source), ledger=MemoryLedger(), cache=cache)


# -- timing -----------------------------------------------------------------------------------
def timed(cursor: Any, sql: str) -> tuple[float, float, str]:
    """Wall and CPU time of execute + fetchall, and the outcome: answered, cached or the
    SQLSTATE."""
    cpu, start = time.process_time(), time.perf_counter()
    try:
        cursor.execute(sql)
        cursor.fetchall()
        outcome = "cached" if cursor.cached else "answered"
    except dpsql.Error as exc:
        outcome = exc.sqlstate
    return time.perf_counter() - start, time.process_time() - cpu, outcome


Step = Callable[[int], tuple[float, float, str]]


def interleave(
    steps: dict[str, Step], reps: int, warmup: int, odd: Sequence[str] | None = None
) -> list[Side]:
    """Run every step once per rep: in the given order on even reps, in ``odd`` (default: the
    reverse) on odd reps, so neither side always runs first. Sides come back in step order."""
    names = list(steps)
    orders = (names, list(odd) if odd is not None else names[::-1])
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    outcomes: dict[str, set[str]] = {n: set() for n in names}
    for rep in range(-warmup, reps):
        for name in orders[rep % 2]:
            elapsed, used, outcome = steps[name](rep + warmup)
            if rep >= 0:
                times[name].append(elapsed)
                cpu[name].append(used)
                outcomes[name].add(outcome)
    return [Side(n, tuple(times[n]), tuple(cpu[n]), frozenset(outcomes[n])) for n in names]


def expect(side: Side, outcome: str) -> None:
    """Every run of the side ended as the comparison assumes, or its figure means nothing."""
    if side.outcomes != {outcome}:
        raise SystemExit(f"{side.name}: expected {outcome} on every run, got {set(side.outcomes)}")


def bench_neighbours(tmp: Path, reps: int, warmup: int) -> list[Row]:
    d, d_prime = service(without_unit(tmp)), service(FIXTURE_CSV)
    cur_d, cur_dp = (
        connect_service(d, "observer").cursor(),
        connect_service(d_prime, "observer").cursor(),
    )
    rows = []
    for label, sql in NEIGHBOUR_QUERIES.items():
        ref, side = interleave(
            {"D": lambda _i, s=sql: timed(cur_d, s), "D'": lambda _i, s=sql: timed(cur_dp, s)},
            reps,
            warmup,
        )
        expect(ref, "answered")
        expect(side, "answered")
        rows.append(Row("1 neighbours D vs D'", label, side, ref))
    d.close()
    d_prime.close()
    return rows


def bench_outcomes(reps: int, warmup: int) -> list[Row]:
    svc = service(FIXTURE_CSV, cache=True)
    cur = connect_service(svc, "observer").cursor()

    def literal(i: int) -> str:
        return f"{45 + i * 1e-6:.6f}"

    answered, cached, refused = interleave(
        {
            "answered": lambda i: timed(cur, ANSWERED.format(x=literal(i))),
            "cached replay": lambda i: timed(cur, ANSWERED.format(x=literal(i))),
            "refused at typing": lambda i: timed(cur, REFUSED.format(x=literal(i))),
        },
        reps,
        warmup,
        odd=["refused at typing", "answered", "cached replay"],  # a replay follows its answer
    )
    svc.close()
    expect(answered, "answered")
    expect(cached, "cached")
    expect(refused, "42804")
    return [
        Row("2 outcomes", "answered", answered, None),
        Row("2 outcomes", "cached replay", cached, answered),
        Row("2 outcomes", "refused (free)", refused, answered),
    ]


def bench_planning_caches(reps: int, warmup: int, *, clear_tokens: bool = False) -> list[Row]:
    """``clear_tokens``: empty the process-wide token cache (keyed by text) before every run, to
    show which part of a B-vs-C difference it accounts for."""
    svc = service(FIXTURE_CSV)
    cursors: dict[str, Any] = {}
    tokens_cache = getattr(positions, "_tokens_cached", None)

    def explain(analyst: str, tag: str) -> tuple[float, float, str]:
        if analyst not in cursors:
            cursors[analyst] = connect_service(svc, analyst).cursor()
        if clear_tokens and tokens_cache is not None:
            tokens_cache.cache_clear()
        return timed(cursors[analyst], EXPLAIN.format(tag=tag))

    a_cold, a_warm, b_after, c_cold = interleave(
        {
            "A cold": lambda i: explain(f"a{i}", f"t{i:06d}"),
            "A warm": lambda i: explain(f"a{i}", f"t{i:06d}"),
            "B after A": lambda i: explain(f"b{i}", f"t{i:06d}"),
            "C cold": lambda i: explain(f"c{i}", f"u{i:06d}"),
        },
        reps,
        warmup,
        odd=["A cold", "A warm", "C cold", "B after A"],  # B always after A warmed
    )
    svc.close()
    for side in (a_cold, a_warm, b_after, c_cold):
        expect(side, "answered")
    if clear_tokens:
        section = "3b the same, token cache emptied before each run (diagnostic)"
        return [Row(section, "B after A warmed", b_after, c_cold)]
    section = "3 planning caches (EXPLAIN)"
    return [
        Row(section, "A cold", a_cold, None),
        Row(section, "A warm", a_warm, a_cold),
        Row(section, "B after A warmed", b_after, a_cold),
        Row(section, "B after A warmed", b_after, c_cold),
    ]


def bench_failure(tmp: Path, reps: int, warmup: int) -> list[Row]:
    d_path, d_prime_path = parquet_neighbours(tmp)
    broken_path = tmp / "broken.parquet"
    broken_path.write_bytes(d_path.read_bytes())
    d, d_prime, broken = service(d_path), service(d_prime_path), service(broken_path)
    data = broken_path.read_bytes()
    broken_path.write_bytes(data[: len(data) // 2])  # lost under the running service
    cur_d, cur_dp, cur_broken = (
        connect_service(s, "observer").cursor() for s in (d, d_prime, broken)
    )
    answered, dirty, failed = interleave(
        {
            "D": lambda _i: timed(cur_d, FAILING_QUERY),
            "D'": lambda _i: timed(cur_dp, FAILING_QUERY),
            "broken": lambda _i: timed(cur_broken, FAILING_QUERY),
        },
        reps,
        warmup,
    )
    for svc in (d, d_prime, broken):
        svc.close()
    expect(answered, "answered")
    expect(dirty, "answered")
    expect(failed, "58000")
    section = "4 lazily read source (Parquet), AVG(age)"
    return [
        Row(section, "D' with a dirty age (NULL)", dirty, answered),
        Row(section, "source truncated: charged", failed, answered),
    ]


def odd_neighbour(tmp: Path) -> Path:
    """D': the fixture CSV with one of patient 999's visit dates 'infinity'."""
    path = tmp / "visits_999_infinity.csv"
    with FIXTURE_CSV.open(newline="") as src, path.open("w", newline="") as dst:
        reader, writer = csv.reader(src), csv.writer(dst)
        header = next(reader)
        writer.writerow(header)
        column, changed = header.index("visit_date"), 0
        for row in reader:
            if row[0] == UNIT and not changed:
                row[column], changed = "infinity", 1
            writer.writerow(row)
    return path


def bench_odd_value(tmp: Path, reps: int, warmup: int) -> list[Row]:
    d, d_prime = service(without_unit(tmp)), service(odd_neighbour(tmp))
    for name, svc in (("D", d), ("D'", d_prime)):
        held = "visits" in getattr(svc.engine, "columns", {})
        print(f"  5: {name}: table held in columns (programs run): {held}")
    cur_d, cur_dp = (
        connect_service(d, "observer").cursor(),
        connect_service(d_prime, "observer").cursor(),
    )
    rows = []
    for label, sql in ODD_QUERIES.items():
        ref, side = interleave(
            {"D": lambda _i, s=sql: timed(cur_d, s), "D'": lambda _i, s=sql: timed(cur_dp, s)},
            reps,
            warmup,
        )
        expect(ref, "answered")
        expect(side, "answered")
        rows.append(Row("5 D' with an 'infinity' date in one unit vs D", label, side, ref))
    d.close()
    d_prime.close()
    return rows


def _generated(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _small_policy(source: Path, columns: dict[str, Any], unit: str | None) -> dict[str, Any]:
    table: dict[str, Any] = {"source": str(source), "columns": columns}
    if unit is not None:
        table.update(privacy_unit=unit, max_rows_per_unit=2, max_groups_per_unit=3)
    privacy = {"epsilon": 1.0, "delta": 1e-6, "budget_epsilon": 1e12, "budget_delta": 0.5}
    return {"privacy": privacy, "tables": {"t": table}}


def grid_neighbours(tmp: Path) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(label, query, policy of D, policy of D') for each limit."""
    values = [f"v{i:02d}" for i in range(16)]
    dense_cols = {
        "u": {"type": "int", "nullable": False},
        "k": {"type": "text", "values": values, "nullable": False},
        "a": {"type": "int", "lower": 0, "upper": 100, "nullable": False},
    }
    # 2000 rows, 940 units, 16 keys (+ NULL's label): 941 x 17 = 15,997 slots <= 8 x 2000;
    # D' adds a unit with one row: 942 x 17 = 16,014 > 8 x 2001
    base = [(i % 940, values[i % 16], i % 50) for i in range(2000)]
    dense_d = _generated(tmp / "grid_d.csv", ["u", "k", "a"], base)
    dense_dp = _generated(tmp / "grid_dp.csv", ["u", "k", "a"], [*base, (99_999, "v00", 1)])
    radix_cols = {
        "k1": {"type": "int", "lower": 0, "upper": 63, "nullable": False},
        "k2": {"type": "int", "lower": 0, "upper": 63, "nullable": False},
    }
    # 1000 rows, keys 0..62 each (+ NULL's label): 64 x 64 = 4096 codes; D' one row with k1 63
    pairs = [(i % 63, (i // 63) % 63) for i in range(1000)]
    radix_d = _generated(tmp / "radix_d.csv", ["k1", "k2"], pairs)
    radix_dp = _generated(tmp / "radix_dp.csv", ["k1", "k2"], [*pairs, (63, 0)])
    return [
        (
            "dense grid -> sorted pairs",
            "SELECT k, COUNT(*), SUM(a) FROM t GROUP BY k",
            _small_policy(dense_d, dense_cols, "u"),
            _small_policy(dense_dp, dense_cols, "u"),
        ),
        (
            "mixed radix -> re-densified",
            "SELECT k1, k2, COUNT(*) FROM t GROUP BY k1, k2",
            _small_policy(radix_d, radix_cols, None),
            _small_policy(radix_dp, radix_cols, None),
        ),
    ]


def engine_step(svc: dpsql.Service, sql: str) -> Step:
    """The engine's execute of ``sql`` compiled once (the program, where the plan has one)."""
    from dpsql.frontend.bind import parse_statement
    from dpsql.pipeline import Settings

    settings = Settings.from_policy(svc.policy)
    key = svc._plans.key(sql, None, settings, "observer")
    prepared = svc._prepare(key, parse_statement(sql, svc.policy), settings, "observer")
    compiled = svc._compiled(prepared).with_secret(4242)
    assert compiled.program is not None, sql

    def step(_i: int) -> tuple[float, float, str]:
        cpu, start = time.process_time(), time.perf_counter()
        svc.engine.execute(compiled)
        return time.perf_counter() - start, time.process_time() - cpu, "answered"

    return step


def bench_grid(tmp: Path, reps: int, warmup: int) -> list[Row]:
    rows = []
    for label, sql, pol_d, pol_dp in grid_neighbours(tmp):
        d = dpsql.Service(pol_d, ledger=MemoryLedger(), cache=False)
        d_prime = dpsql.Service(pol_dp, ledger=MemoryLedger(), cache=False)
        assert "t" in d.engine.columns and "t" in d_prime.engine.columns
        ref, side = interleave(
            {"D": engine_step(d, sql), "D'": engine_step(d_prime, sql)},
            reps,
            warmup,
        )
        expect(ref, "answered")
        expect(side, "answered")
        rows.append(Row("6 a program's choices (engine only), D inside, D' past", label, side, ref))
        d.close()
        d_prime.close()
    return rows


def bench_row_switch(tmp: Path, reps: int, warmup: int) -> list[Row]:
    rng = random.Random(1)
    base = [
        (rng.randrange(40_000), rng.randrange(100), f"d{rng.randrange(6)}") for _ in range(199_998)
    ]
    columns = {
        "u": {"type": "int", "nullable": False},
        "a": {"type": "int", "lower": 0, "upper": 100, "nullable": False},
        "k": {"type": "text", "values": [f"d{i}" for i in range(6)], "nullable": False},
    }
    services: dict[str, Any] = {}
    for name, extra in (("D", []), ("D'", [(999_999, 5, "d1")] * 5)):
        path = _generated(tmp / f"rows_{len(extra)}.csv", ["u", "a", "k"], [*base, *extra])
        try:
            services[name] = dpsql.Service(
                _small_policy(path, columns, "u"), ledger=MemoryLedger(), cache=False
            )
        except dpsql.Error as exc:
            print(f"  7: {name} ({199_998 + len(extra):,} rows) does not start: {exc}")
            continue
        held = "t" in services[name].engine.columns
        print(f"  7: {name} ({199_998 + len(extra):,} rows) starts; held in columns: {held}")
    rows = []
    if len(services) == 2:
        for label, sql in (
            ("count unit", "SELECT COUNT(*) FROM t WHERE u = 999999"),
            ("group k", "SELECT k, COUNT(*), SUM(a) FROM t GROUP BY k"),
        ):
            ref, side = interleave(
                {n: engine_step(services[n], sql) for n in ("D", "D'")}, reps, warmup
            )
            rows.append(Row("7 one unit across 200,000 rows (engine only)", label, side, ref))
    for svc in services.values():
        svc.close()
    return rows


# -- report -----------------------------------------------------------------------------------
def bootstrap(
    side: Sequence[float], reference: Sequence[float], rounds: int = 1000
) -> tuple[float, float]:
    """A 95% interval for the difference of medians (resampling each side independently)."""
    rng = random.Random(0)
    a, b = list(side), list(reference)
    deltas = sorted(
        statistics.median(rng.choices(a, k=len(a))) - statistics.median(rng.choices(b, k=len(b)))
        for _ in range(rounds)
    )
    return deltas[int(0.025 * rounds)], deltas[int(0.975 * rounds) - 1]


HEADER = (
    "label",
    "outcome",
    "median ms",
    "p10..p90 ms",
    "vs",
    "delta us [95% CI]",
    "spread us",
    "delta/spread",
    "cpu ms",
    "cpu delta us [95% CI]",
)


def _delta(side: Sequence[float], ref: Sequence[float]) -> str:
    lo, hi = bootstrap(side, ref)
    d = statistics.median(side) - statistics.median(ref)
    return f"{d * 1e6:+.0f} [{lo * 1e6:+.0f}, {hi * 1e6:+.0f}]"


def cells(row: Row) -> tuple[str, ...]:
    side, ref = row.side, row.reference
    base = (
        row.label,
        "/".join(sorted(side.outcomes)),
        f"{side.median() * 1e3:.2f}",
        f"{side.quantile(1) * 1e3:.2f}..{side.quantile(9) * 1e3:.2f}",
    )
    cpu = f"{side.cpu_median() * 1e3:.2f}"
    if ref is None:
        return (*base, "", "", f"{side.spread() * 1e6:.0f}", "", cpu, "")
    spread = max(side.spread(), ref.spread())
    return (
        *base,
        f"{ref.name} {ref.median() * 1e3:.2f}",
        _delta(side.times, ref.times),
        f"{spread * 1e6:.0f}",
        f"{(row.delta() or 0.0) / spread:+.3f}",
        cpu,
        _delta(side.cpu, ref.cpu),
    )


def text_table(rows: Sequence[Row]) -> str:
    table = [HEADER] + [cells(r) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(HEADER))]
    out, section = [], None
    for i, line in enumerate(table):
        if i > 0 and rows[i - 1].section != section:
            section = rows[i - 1].section
            out.append(f"-- {section}")
        out.append(
            "  ".join(
                c.rjust(w) if j else c.ljust(w)
                for j, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
    return "\n".join(out)


def markdown_table(rows: Sequence[Row]) -> str:
    out = ["| section | " + " | ".join(HEADER) + " |", "|" + "---|" * (len(HEADER) + 1)]
    out += [f"| {r.section} | " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(out)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def commit() -> str:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


LEGEND = (__doc__ or "").split("\n    python ")[0].strip()


def write_markdown(path: Path, rows: Sequence[Row], args: argparse.Namespace, meta: dict) -> None:
    command = "python bench/bench_timing_channels.py " + shlex.join(sys.argv[1:])
    path.write_text(
        "# Timing channels: measured figures\n\n"
        f"Command (from {ROOT}): `{command.strip()}`  \n"
        f"Commit {meta['commit']} (working tree as it stood), {os.cpu_count()} cpus, "
        f"{args.reps} reps per side after {args.warmup} warm-up, {meta['seconds']:.0f} s.  \n"
        f"`uptime` before: `{meta['before']}`  \n"
        f"`uptime` after: `{meta['after']}`\n\n"
        f"{LEGEND}\n\n"
        "delta = median(side) - median(vs); spread = the larger p90 - p10 of the two sides; "
        "the 95% intervals are bootstraps of the difference of medians; cpu = process CPU "
        "(DuckDB's threads included).\n\n"
        f"{markdown_table(rows)}\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=200, help="timed runs per side (default 200)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed runs per side first")
    ap.add_argument("--markdown", type=Path, help="also write the figures to this file")
    ap.add_argument(
        "--only",
        choices=["neighbours", "outcomes", "planning", "failure", "odd", "grid", "rows"],
        nargs="+",
    )
    args = ap.parse_args()
    if args.reps < 10:
        ap.error("--reps must be at least 10 (deciles)")
    before = uptime()
    print(
        f"dpsql timing channels: fixture, {args.reps} reps per side (+{args.warmup} warm-up), "
        f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}"
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dpsql-timing-") as tmp:
        every = ("neighbours", "outcomes", "planning", "failure", "odd", "grid", "rows")
        only = set(args.only or every)
        rows: list[Row] = []
        if "neighbours" in only:
            rows += bench_neighbours(Path(tmp), args.reps, args.warmup)
        if "outcomes" in only:
            rows += bench_outcomes(args.reps, args.warmup)
        if "planning" in only:
            rows += bench_planning_caches(args.reps, args.warmup)
            rows += bench_planning_caches(args.reps, args.warmup, clear_tokens=True)
        if "failure" in only:
            rows += bench_failure(Path(tmp), args.reps, args.warmup)
        if "odd" in only:
            rows += bench_odd_value(Path(tmp), args.reps, args.warmup)
        if "grid" in only:
            rows += bench_grid(Path(tmp), args.reps, args.warmup)
        if "rows" in only:
            rows += bench_row_switch(Path(tmp), args.reps, args.warmup)
    seconds = time.perf_counter() - start
    after = uptime()
    print(text_table(rows))
    print(f"{seconds:.0f} s, load {os.getloadavg()[0]:.1f} after")
    if args.markdown is not None:
        meta = {"commit": commit(), "seconds": seconds, "before": before, "after": after}
        write_markdown(args.markdown, rows, args, meta)
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
