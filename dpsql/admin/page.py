"""The curator page's content: read what the ledger, the policy and the engine record, and
render it as one HTML page (server-rendered, no script; every text escaped).

What is read, and from where:

- **analysts and budgets**: the ledger's read API (``SQLiteLedger.analysts``), on its own
  connection; ``budget_timeline`` of :mod:`dpsql.plots` for the spending over time, drawn here
  as a small inline SVG (matplotlib is optional and its SVG would be a second escaping job);
- **the query log**: ``SQLiteLedger.entries`` (charges, resets, budget changes: time, analyst,
  cost, text) and, per charge, whether an answer is stored under its plan hash
  (``SQLiteLedger.cached``: re-asking it returns that answer at no cost). A cache hit writes
  nothing and a refusal writes nothing, so neither is in the log, and the page says so
  instead of inventing them;
- **tables and policy**: the loaded :class:`~dpsql.policy.Policy` (privacy unit, R, G, bounds,
  public domains, ``[access]`` rules);
- **data versions and stores**: a serving process's engine (``dpsql serve --admin-port``);
  standalone (``dpsql dashboard``), what can be computed without loading data: a declared
  version, a file source's ``sha256@mtime:size`` (the engine's own rule,
  :func:`dpsql.engine.versions.file_version`), and the disk stores in the store directory.

Reading never writes: a missing ledger is reported, not created, and a WAL reader never
blocks a charge.
"""

from __future__ import annotations

import datetime as dt
import html
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpsql.engine import prepared
from dpsql.engine.versions import file_version, identity
from dpsql.errors import Error
from dpsql.plots import BudgetTimeline, budget_timeline
from dpsql.policy import ColumnPolicy, Policy, TablePolicy
from dpsql.privacy.budget_rules import LimitStatus, rules_of
from dpsql.privacy.ledger import AnalystStatus, LogEntry
from dpsql.privacy.sqlite_ledger import SQLiteLedger
from dpsql.tables import number

#: Query texts longer than this are cut on the page (``dpsql budget log --json`` has them whole).
TEXT_LIMIT = 2000
#: Declared values listed per column before "... and N more".
VALUES_SHOWN = 12

NOT_RECORDED = (
    "Refusals are not recorded: a refused query (budget exhausted, access denied, a policy or "
    "grammar refusal) is free and writes nothing to the ledger, so it cannot be listed here. "
    "Cache hits are not recorded either: returning a stored answer writes nothing. The "
    "\u201canswer cached\u201d column says whether an answer is stored for a charge\u2019s "
    "plan, i.e. whether re-asking that query is free."
)


def esc(value: object) -> str:
    """Every text that reaches the page goes through here (query texts are the analysts')."""
    return html.escape(str(value), quote=True)


def fmt(value: Any) -> str:
    return esc(number(value))


@dataclass(frozen=True)
class VersionRow:
    table: str
    version: str
    how: str


@dataclass(frozen=True)
class StoreRow:
    table: str
    state: str
    where: str
    version: str = ""
    rows: int | None = None
    size: int | None = None
    seconds: float | None = None


@dataclass
class Snapshot:
    """Everything one page shows, read in one request."""

    policy: Policy
    statuses: list[AnalystStatus] = field(default_factory=list)
    pools: list[LimitStatus] = field(default_factory=list)  # [budgets]: groups, the dataset
    entries: list[LogEntry] = field(default_factory=list)
    cached: dict[int, bool] = field(default_factory=dict)
    timeline: BudgetTimeline | None = None
    versions: list[VersionRow] = field(default_factory=list)
    stores: list[StoreRow] = field(default_factory=list)
    stores_note: str = ""
    logins: list[str] | None = None
    ledger_note: str = ""
    live: bool = False
    analyst: str | None = None
    limit: int = 200
    at: str = ""


class Reader:
    """Reads a :class:`Snapshot` per request. ``versions`` / ``stores``: a serving process's
    live engine (table -> data version, its ``StoreInfo`` list); None: standalone, computed
    from the policy. ``logins``: the analysts who may log in to the wire server."""

    def __init__(
        self,
        policy: Policy,
        *,
        versions: Callable[[], Mapping[str, str]] | None = None,
        stores: Callable[[], Sequence[Any]] | None = None,
        logins: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self.policy = policy
        self._versions = versions
        self._stores = stores
        self._logins = logins
        self._ledger: SQLiteLedger | None = None
        self._lock = threading.Lock()
        self._file_versions: dict[Path, tuple[tuple[int, int] | None, str]] = {}

    @property
    def live(self) -> bool:
        return self._versions is not None

    def ledger(self) -> SQLiteLedger | None:
        """The ledger, opened on first use once its file exists (never created here)."""
        path = self.policy.ledger_path
        with self._lock:
            if self._ledger is None and path is not None and path.exists():
                self._ledger = SQLiteLedger(path)
            return self._ledger

    def close(self) -> None:
        with self._lock:
            if self._ledger is not None:
                self._ledger.close()
                self._ledger = None

    def analyst_names(self) -> set[str]:
        """Every analyst known to the ledger or the users file (for refusing their logins)."""
        names = set(self._login_names() or ())
        try:
            ledger = self.ledger()
            if ledger is not None:
                names.update(
                    s.analyst for s in ledger.analysts(self.policy.dataset, self.policy.budget)
                )
        except Error:
            pass
        return names

    def _login_names(self) -> list[str] | None:
        if self._logins is None:
            return None
        try:
            return sorted(self._logins())
        except Exception:  # an unreadable users file: the page says so, still renders
            return None

    def snapshot(self, *, analyst: str | None = None, limit: int = 200) -> Snapshot:
        policy = self.policy
        snap = Snapshot(policy, live=self.live, analyst=analyst, limit=limit)
        snap.at = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        snap.logins = self._login_names()
        try:
            ledger = self.ledger()
            if ledger is None:
                snap.ledger_note = (
                    f"No ledger at {policy.ledger_path} yet: nobody has been charged on this "
                    "dataset."
                )
            else:
                snap.statuses = ledger.analysts(policy.dataset, policy.budget)
                snap.pools = ledger.pools(policy.dataset, policy.budget)
                snap.entries = ledger.entries(policy.dataset, analyst=analyst, limit=limit)
                known: dict[tuple[str, str], bool] = {}
                for e in snap.entries:
                    if e.kind == "charge" and e.plan_hash:
                        key = (e.analyst, e.plan_hash)
                        if key not in known:
                            known[key] = (
                                ledger.cached(e.analyst, e.dataset, e.plan_hash) is not None
                            )
                        snap.cached[e.id] = known[key]
                snap.timeline = budget_timeline(policy, ledger)
        except Error as exc:
            snap.ledger_note = f"The ledger could not be read: {exc}"
        snap.versions = self._version_rows()
        snap.stores, snap.stores_note = self._store_rows(snap.versions)
        return snap

    # -- data versions and stores ---------------------------------------------------------------

    def _version_rows(self) -> list[VersionRow]:
        if self._versions is not None:
            live = dict(self._versions())
            return [
                VersionRow(name, live.get(name, "") or "(none)", "the serving engine's")
                for name in self.policy.tables
            ]
        rows = []
        for name, table in self.policy.tables.items():
            if table.version is not None:
                rows.append(VersionRow(name, table.version, "declared in the policy"))
            elif table.source_path is not None:
                rows.append(
                    VersionRow(
                        name,
                        self._file_version(table.source_path),
                        "the source file now (sha256@mtime:size); a CSV is read at connect, "
                        "so a running server keeps the version it loaded",
                    )
                )
            else:
                rows.append(
                    VersionRow(
                        name,
                        "(computed by the engine at connect)",
                        "a table of a DuckDB database: its digest is read when the engine "
                        "loads it; dpsql serve --admin-port shows it",
                    )
                )
        return rows

    def _file_version(self, path: Path) -> str:
        """The file's version, hashed again only when its (mtime, size) moved."""
        ident = identity(path)
        known = self._file_versions.get(path)
        if known is not None and known[0] == ident and ident is not None:
            return known[1]
        version = file_version(path, ident)
        self._file_versions[path] = (ident, version)
        return version

    def _store_rows(self, versions: list[VersionRow]) -> tuple[list[StoreRow], str]:
        mode = self.policy.engine.prepared
        if self._stores is not None:
            rows = [
                StoreRow(
                    info.table,
                    "reused" if info.reused else "built",
                    info.path or "memory",
                    info.version,
                    info.rows,
                    info.bytes,
                    info.build_seconds,
                )
                for info in self._stores()
            ]
            note = f"[engine] prepared = {mode!r}; the stores this serving engine holds."
            return rows, note
        directory = prepared.store_directory(self.policy)
        note = (
            f"[engine] prepared = {mode!r}. Disk stores (dpsql prepare, or prepared = "
            f'"disk") live in {directory}; an in-memory store exists only inside a serving '
            "process (see dpsql serve --admin-port)."
        )
        if directory is None or not directory.is_dir():
            return [], note + " No store directory yet."
        current = {}
        by_version = {v.table: v.version for v in versions}
        for name, table in self.policy.tables.items():
            version = by_version.get(name, "")
            if version and not version.startswith("("):
                key = prepared.store_key(table, version)
                current[f"{name}-{key[:24]}.duckdb"] = (name, version)
        rows = []
        for path in sorted(directory.glob("*.duckdb")):
            try:
                size = path.stat().st_size
            except OSError:
                continue
            match = current.get(path.name)
            if match is not None:
                rows.append(StoreRow(match[0], "current", str(path), match[1], size=size))
            else:
                rows.append(
                    StoreRow(
                        path.name.rsplit("-", 1)[0],
                        "stale (another data version, policy or dpsql: never read; removed "
                        "at the next build)",
                        str(path),
                        size=size,
                    )
                )
        return rows, note


# -- rendering ------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 auto;max-width:1200px;padding:0 16px;color:#222}
h1{font-size:22px;margin:16px 0 4px}
h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ccc}
h3{font-size:15px;margin:16px 0 4px}
table{border-collapse:collapse;margin:6px 0} th,td{border:1px solid #ddd;padding:3px 7px;
vertical-align:top;text-align:left} th{background:#f3f3f3} td.n{text-align:right;
font-variant-numeric:tabular-nums} .q{font-family:ui-monospace,monospace;white-space:pre-wrap;
word-break:break-word;max-width:560px} .note{color:#555;max-width:900px} .muted{color:#888}
.warn{color:#a35a00}
.bar{display:inline-block;width:120px;height:10px;background:#eee;vertical-align:middle}
.bar i{display:block;height:10px;background:#3b7dd8} .bar i.full{background:#d8493b}
nav a{margin-right:12px} .kind-reset{background:#fff6e0} .kind-budget{background:#eef6ff}
"""


def render(snap: Snapshot) -> str:
    policy = snap.policy
    parts = [
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
        "<meta name=viewport content='width=device-width'>",
        f"<title>dpsql curator: {esc(policy.dataset)}</title><style>{_CSS}</style></head><body>",
        f"<h1>dpsql curator page: dataset <code>{esc(policy.dataset)}</code></h1>",
        "<p class=muted>",
        f"policy {esc(policy.path)} &middot; ledger {esc(policy.ledger_path)} &middot; "
        f"read {esc(snap.at)} &middot; {'serving process' if snap.live else 'standalone'} "
        "&middot; read-only</p>",
        "<nav><a href='#analysts'>Analysts</a><a href='#log'>Query log</a>"
        "<a href='#tables'>Tables</a><a href='#versions'>Data versions and stores</a></nav>",
    ]
    if snap.ledger_note:
        parts.append(f"<p class=note><strong>{esc(snap.ledger_note)}</strong></p>")
    parts.append(_analysts(snap))
    parts.append(_shared_budgets(snap))
    parts.append(_log(snap))
    parts.append(_tables(policy))
    parts.append(_versions(snap))
    parts.append("</body></html>")
    return "".join(parts)


def _shared_budgets(snap: Snapshot) -> str:
    """[budgets]: each group's and the dataset-wide budget, spent this period (empty without)."""
    rules = rules_of(snap.policy.budget)
    if rules is None:
        return ""
    renew = rules.renew or "never"
    out = [
        "<h2 id=shared>Shared and renewing budgets</h2>",
        "<p class=note>From the policy's [budgets]: a group's budget caps the sum of its "
        "members' spending, the dataset-wide budget the sum of every analyst's (the guarantee "
        "when analysts may pool their answers). A query must fit the analyst's own budget and "
        f"every one of these. Analysts' and groups' budgets renew: {esc(renew)}; a renewed "
        "budget guarantees its (&epsilon;, &delta;) per period, not in total.</p>",
        "<table><tr><th>budget</th><th>members</th><th>period</th><th>charges</th>"
        "<th>spent &epsilon;</th><th>spent &delta;</th><th>spent &rho;</th>"
        "<th>&epsilon; equiv.</th><th>budget &epsilon;</th><th>budget &delta;</th>"
        "<th>left &epsilon;</th><th>used</th></tr>",
    ]
    members = {g.name: ", ".join(sorted(g.members)) for g in rules.groups}
    for p in snap.pools:
        left_eps, _ = p.remaining
        used = p.epsilon_spent / p.budget.epsilon if p.budget.epsilon > 0 else 1.0
        share = max(0.0, min(1.0, used))
        who = members.get(p.name, "") if p.kind == "group" else "every analyst"
        out.append(
            f"<tr><td>{esc(p.label)}</td><td>{esc(who)}</td>"
            f"<td>{esc(p.period or 'never renews')}</td><td class=n>{p.charges}</td>"
            f"<td class=n>{fmt(p.spent.epsilon)}</td><td class=n>{fmt(p.spent.delta)}</td>"
            f"<td class=n>{fmt(p.spent.rho)}</td><td class=n>{fmt(p.epsilon_spent)}</td>"
            f"<td class=n>{fmt(p.budget.epsilon)}</td><td class=n>{fmt(p.budget.delta)}</td>"
            f"<td class=n>{fmt(left_eps)}</td>"
            f"<td><span class=bar title='{share:.0%}'><i class='{'full' if share >= 1 else ''}'"
            f" style='width:{share * 100:.1f}%'></i></span> {share:.0%}</td></tr>"
        )
    out.append("</table>")
    return "".join(out)


def _analysts(snap: Snapshot) -> str:
    policy = snap.policy
    out = [
        "<h2 id=analysts>Analysts and budgets</h2>",
        f"<p class=note>Default budget: &epsilon; = {fmt(policy.budget.epsilon)}, "
        f"&delta; = {fmt(policy.budget.delta)} per analyst; default query &epsilon; = "
        f"{fmt(policy.epsilon)}, mechanism {esc(policy.mechanism)}. "
        "&ldquo;&epsilon; equiv.&rdquo; is what the spent (&epsilon;, &delta;, &rho;) amounts "
        "to under the analyst's &delta; (the figure compared with the budget); &ldquo;left "
        "&epsilon;&rdquo; the largest &epsilon; one more pure-&epsilon; query may take.</p>",
    ]
    if not snap.statuses:
        out.append("<p>No analyst has been charged on this dataset yet.</p>")
    else:
        out.append(
            "<table><tr><th>analyst</th><th>charges</th><th>spent &epsilon;</th>"
            "<th>spent &delta;</th><th>spent &rho;</th><th>&epsilon; equiv.</th>"
            "<th>budget &epsilon;</th><th>budget &delta;</th><th>left &epsilon;</th>"
            "<th>left &delta;</th><th>used</th></tr>"
        )
        for s in snap.statuses:
            left_eps, left_delta = s.remaining
            used = s.epsilon_spent / s.budget.epsilon if s.budget.epsilon > 0 else 1.0
            share = max(0.0, min(1.0, used))
            link = "?" + urllib.parse.urlencode({"analyst": s.analyst}) + "#log"
            star = "*" if s.overridden else ""
            out.append(
                f"<tr><td><a href='{esc(link)}'>{esc(s.analyst)}</a></td>"
                f"<td class=n>{s.charges}</td><td class=n>{fmt(s.spent.epsilon)}</td>"
                f"<td class=n>{fmt(s.spent.delta)}</td><td class=n>{fmt(s.spent.rho)}</td>"
                f"<td class=n>{fmt(s.epsilon_spent)}</td>"
                f"<td class=n>{fmt(s.budget.epsilon)}{star}</td>"
                f"<td class=n>{fmt(s.budget.delta)}</td><td class=n>{fmt(left_eps)}</td>"
                f"<td class=n>{fmt(left_delta)}</td>"
                f"<td><span class=bar title='{share:.0%}'><i class='{'full' if share >= 1 else ''}'"
                f" style='width:{share * 100:.1f}%'></i></span> {share:.0%}</td></tr>"
            )
        out.append("</table>")
        if any(s.overridden for s in snap.statuses):
            out.append("<p class=note>* budget set by an administrator (dpsql budget set)</p>")
    if snap.logins is not None:
        charged = {s.analyst for s in snap.statuses}
        idle = [name for name in snap.logins if name not in charged]
        if idle:
            out.append(
                "<p class=note>Logins never charged on this dataset: "
                + ", ".join(f"<code>{esc(n)}</code>" for n in idle)
                + "</p>"
            )
    out.append("<h3>Spending over time</h3>")
    out.append(budget_svg(snap.timeline))
    return "".join(out)


_COLOURS = ("#3b7dd8", "#d8493b", "#2e9e5b", "#9b59b6", "#e08e0b", "#16a2b8", "#7f7f7f", "#b5651d")


def budget_svg(timeline: BudgetTimeline | None, width: int = 760, height: int = 280) -> str:
    """ε spent (ε-equivalent of the running total) after each event, per analyst, as steps;
    each analyst's budget dashed in the same colour. Static SVG, every label escaped."""
    if timeline is None or not any(timeline.times):
        return "<p class=muted>Nothing in the log yet.</p>"
    left, right, top, bottom = 64, 16, 12, 46
    plot_w, plot_h = width - left - right, height - top - bottom
    stamps = [t for times in timeline.times for t in times]
    t0, t1 = min(stamps), max(stamps)
    if t1 <= t0:
        t0, t1 = t0 - dt.timedelta(minutes=30), t1 + dt.timedelta(minutes=30)
    t1 = t1 + (t1 - t0) / 20  # room after the last event, so its step shows
    span = (t1 - t0).total_seconds()
    stamp = "%Y-%m-%d %H:%M" if span >= 3600 else "%Y-%m-%d %H:%M:%S"
    limits = [v for step in timeline.steps for _, v in step]
    ymax = max([*timeline.budgets, *limits, *(v for s in timeline.spent for v in s), 1e-12]) * 1.08

    def x(t: dt.datetime) -> float:
        return left + plot_w * (t - t0).total_seconds() / span

    def y(v: float) -> float:
        return top + plot_h * (1 - v / ymax)

    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' "
        f"height='{height + 18 * len(timeline.analysts)}' role='img' "
        "aria-label='privacy budget spent over time' font-family='sans-serif' font-size='11'>",
        f"<rect x='{left}' y='{top}' width='{plot_w}' height='{plot_h}' fill='#fafafa' "
        "stroke='#bbb'/>",
    ]
    for i in range(5):
        v = ymax / 1.08 * i / 4
        out.append(
            f"<line x1='{left}' x2='{left + plot_w}' y1='{y(v):.1f}' y2='{y(v):.1f}' "
            "stroke='#e4e4e4'/>"
            f"<text x='{left - 6}' y='{y(v) + 4:.1f}' text-anchor='end'>{fmt(v)}</text>"
        )
    for i, anchor in enumerate(("start", "middle", "middle", "end")):
        t = t0 + (t1 - t0) * i / 3
        out.append(
            f"<text x='{x(t):.1f}' y='{top + plot_h + 16}' text-anchor='{anchor}'>"
            f"{esc(t.strftime(stamp))}</text>"
        )
    out.append(
        f"<text x='14' y='{top + plot_h / 2:.0f}' transform='rotate(-90 14 "
        f"{top + plot_h / 2:.0f})' text-anchor='middle'>&#949; spent (dashed: budget)</text>"
        f"<text x='{left + plot_w / 2:.0f}' y='{top + plot_h + 34}' text-anchor='middle'>"
        "time (UTC)</text>"
    )
    for i, (name, times, spent, budget) in enumerate(
        zip(timeline.analysts, timeline.times, timeline.spent, timeline.budgets, strict=True)
    ):
        colour = _COLOURS[i % len(_COLOURS)]
        # the limit in force at each time (a step at each change), not today's over the past
        step = timeline.steps[i] if timeline.steps else ()
        limit = [f"M{left},{y(step[0][1] if step else budget):.1f}"]
        limit += [f"H{x(t):.1f}V{y(v):.1f}" for t, v in step[1:]]
        limit.append(f"H{left + plot_w:.1f}")
        out.append(
            f"<path d='{''.join(limit)}' fill='none' stroke='{colour}' "
            "stroke-dasharray='5 4' opacity='0.7'/>"
        )
        if times:
            d = [f"M{x(times[0]):.1f},{y(0):.1f}"]
            for t, v in zip(times, spent, strict=True):
                d.append(f"H{x(t):.1f}V{y(v):.1f}")
            d.append(f"H{left + plot_w:.1f}")
            out.append(f"<path d='{''.join(d)}' fill='none' stroke='{colour}' stroke-width='2'/>")
        ly = height + 18 * i + 4
        out.append(
            f"<line x1='{left}' x2='{left + 24}' y1='{ly}' y2='{ly}' stroke='{colour}' "
            f"stroke-width='2'/><text x='{left + 30}' y='{ly + 4}'>{esc(name)}: "
            f"{fmt(spent[-1] if spent else 0)} of {fmt(budget)}</text>"
        )
    out.append("</svg>")
    return "".join(out)


def _log(snap: Snapshot) -> str:
    who = f" of <code>{esc(snap.analyst)}</code>" if snap.analyst else ""
    out = [
        f"<h2 id=log>Query log{who}</h2>",
        "<form method=get action='#log'><label>analyst <input name=analyst value='"
        f"{esc(snap.analyst or '')}'></label> <label>rows <input name=limit size=5 value='"
        f"{snap.limit}'></label> <button>show</button> <a href='?#log'>everyone</a></form>",
        f"<p class=note>The most recent {snap.limit} rows of the append-only log, oldest "
        "first: charges (a query, charged before it ran), resets and budget changes. "
        f"{esc(NOT_RECORDED)}</p>",
    ]
    if not snap.entries:
        out.append("<p>The log is empty.</p>")
        return "".join(out)
    out.append(
        "<table><tr><th>id</th><th>time (UTC)</th><th>analyst</th><th>kind</th>"
        "<th>&epsilon;</th><th>&delta;</th><th>&rho;</th><th>answer cached</th>"
        "<th>query text</th></tr>"
    )
    for e in snap.entries:
        cached = snap.cached.get(e.id)
        mark = "" if cached is None else ("yes" if cached else "no")
        text = e.query_text
        if len(text) > TEXT_LIMIT:
            text = f"{text[:TEXT_LIMIT]}\u2026 ({len(e.query_text) - TEXT_LIMIT} more characters)"
        out.append(
            f"<tr class='kind-{esc(e.kind)}'><td class=n>{e.id}</td>"
            f"<td>{esc(e.at[:19].replace('T', ' '))}</td><td>{esc(e.analyst)}</td>"
            f"<td>{esc(e.kind)}</td><td class=n>{fmt(e.cost.epsilon)}</td>"
            f"<td class=n>{fmt(e.cost.delta)}</td><td class=n>{fmt(e.cost.rho)}</td>"
            f"<td>{mark}</td><td class=q>{esc(text)}</td></tr>"
        )
    out.append("</table>")
    return "".join(out)


def _rule(rule: Any) -> str:
    if rule is None:
        return "everyone"
    allow = "everyone" if rule.allow is None else (", ".join(sorted(rule.allow)) or "nobody")
    deny = ", ".join(sorted(rule.deny))
    return esc(allow + (f"; denied: {deny}" if deny else ""))


def _tables(policy: Policy) -> str:
    access = policy.access
    out = ["<h2 id=tables>Tables and their policy</h2>"]
    if access is None:
        out.append(
            "<p class=note>No <code>[access]</code> rules: every analyst may query every "
            "table and column.</p>"
        )
    elif access.roles:
        out.append(
            "<p class=note>Roles: "
            + "; ".join(
                f"<code>{esc(r)}</code> = {esc(', '.join(sorted(m)) or '(nobody)')}"
                for r, m in sorted(access.roles.items())
            )
            + "</p>"
        )
    for name, table in policy.tables.items():
        out.append(_table(name, table, access))
    return "".join(out)


def _table(name: str, table: TablePolicy, access: Any) -> str:
    unit = table.privacy_unit or "none: each row is its own unit"
    facts: list[tuple[str, object]] = [
        ("source", table.source),
        ("public table", "yes: no privacy unit, never charged" if table.public else "no"),
        ("privacy unit", unit),
        ("max_rows_per_unit (R)", table.max_rows_per_unit),
        ("max_groups_per_unit (G)", table.max_groups_per_unit),
        ("bounding", table.bounding),
        ("declared version", table.version or "(none: from the source)"),
    ]
    if table.unit_path:
        facts.append(
            ("unit path", " \u2192 ".join(f"{c} = {t}.{k}" for c, t, k in table.unit_path))
        )
    if access is not None:
        facts.append(("who may query", None))
    out = [f"<h3>{esc(name)}</h3><table>"]
    for label, value in facts:
        cell = _rule(access.tables.get(name)) if value is None else esc(value)
        out.append(f"<tr><th>{esc(label)}</th><td>{cell}</td></tr>")
    out.append(
        "</table><table><tr><th>column</th><th>type</th><th>nullable</th>"
        "<th>bounds</th><th>granularity</th><th>public domain</th><th>clip</th>"
    )
    if access is not None:
        out.append("<th>who may use it</th>")
    out.append("</tr>")
    for col in table.columns.values():
        if col.expr is not None:
            continue
        out.append(
            f"<tr><td>{esc(col.name)}</td><td>{esc(col.type)}</td>"
            f"<td>{_nullable(col)}</td><td>{_bounds(col)}</td>"
            f"<td class=n>{fmt(col.granularity) if col.numeric else ''}</td>"
            f"<td>{_domain(col)}</td><td>{esc(col.clip)}</td>"
        )
        if access is not None:
            out.append(f"<td>{_rule(access.columns.get((name, col.name)))}</td>")
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def _nullable(col: ColumnPolicy) -> str:
    """yes / no, and a policy warning where the policy does not say (issue 31): an undeclared
    column with a public domain releases no NULL group, one without a public domain releases
    a NULL key only by thresholding. Read off the policy alone (``dpsql check`` counts the
    NULLs in the data)."""
    shown = "yes" if col.nullable else "no"
    if col.nullable_declared:
        return shown
    return (
        f"{shown} <span class=warn>not declared: "
        f"{'a NULL key is thresholded' if col.nullable else 'no NULL group is released'}; "
        "declare nullable (dpsql check shows the NULLs in the data)</span>"
    )


def _bounds(col: ColumnPolicy) -> str:
    if col.date_range is not None:
        return esc(f"{col.date_range[0]} .. {col.date_range[1]}")
    if col.lower is None and col.upper is None:
        return "<span class=muted>none</span>"
    low = "" if col.lower is None else fmt(col.lower)
    high = "" if col.upper is None else fmt(col.upper)
    return f"{low} .. {high}"


def _domain(col: ColumnPolicy) -> str:
    if col.values is not None:
        shown = ", ".join(str(v) for v in col.values[:VALUES_SHOWN])
        more = len(col.values) - VALUES_SHOWN
        return esc(
            f"{len(col.values)} values: {shown}" + (f", \u2026 and {more} more" if more > 0 else "")
        )
    if col.type == "bool":
        return "true, false"
    if col.date_range is not None:
        return "every day of the bounds"
    if col.type == "int" and col.bounded:
        return "the integers of the bounds (when few enough)"
    return "<span class=muted>none: keys are thresholded</span>"


def _versions(snap: Snapshot) -> str:
    out = [
        "<h2 id=versions>Data versions and stores</h2>",
        "<p class=note>A cached answer is keyed by its table's data version: a new version "
        "never replays an answer cached for the old one.</p>",
        "<table><tr><th>table</th><th>data version</th><th>from</th></tr>",
    ]
    for v in snap.versions:
        out.append(
            f"<tr><td>{esc(v.table)}</td><td class=q>{esc(v.version)}</td>"
            f"<td>{esc(v.how)}</td></tr>"
        )
    out.append("</table><h3>Prepared stores</h3>")
    out.append(f"<p class=note>{esc(snap.stores_note)}</p>")
    if not snap.stores:
        out.append("<p>No prepared store.</p>")
        return "".join(out)
    out.append(
        "<table><tr><th>table</th><th>state</th><th>where</th><th>data version</th>"
        "<th>rows</th><th>size (MiB)</th><th>build (s)</th></tr>"
    )
    for s in snap.stores:
        out.append(
            f"<tr><td>{esc(s.table)}</td><td>{esc(s.state)}</td><td class=q>{esc(s.where)}</td>"
            f"<td class=q>{esc(s.version)}</td>"
            f"<td class=n>{'' if s.rows is None else s.rows}</td>"
            f"<td class=n>{'' if s.size is None else fmt(s.size / 2**20)}</td>"
            f"<td class=n>{'' if s.seconds is None else fmt(s.seconds)}</td></tr>"
        )
    out.append("</table>")
    return "".join(out)
