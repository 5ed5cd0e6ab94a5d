"""Per-analyst fair scheduling of the server's statement work.

Everything a session runs in the thread pool (a DP statement, an ``EXPLAIN``, a ``Describe``, a
zero-row probe, a catalog statement) spends CPU in the server process, and most of what is free
(binding, planning, explaining) is Python that holds the GIL and cannot be preempted. Before
this module, twenty connections of one analyst looping a 0.3 s ``EXPLAIN`` held all sixteen
query threads: another analyst's ``COUNT(*)`` waited behind the whole queue and then shared the
GIL with sixteen busy threads (its median went from 4 ms to 2 s).

Since running Python cannot be interrupted, the bound is placed *before* a statement starts,
and a statement that has started is made to step aside:

- **A per-analyst cap on statements in flight** (``analyst_statements``, default 2). A statement
  over the cap waits on the event loop, holding no thread. So however many connections one
  analyst opens, at most that many of its statements compete for the GIL with everyone else's.
- **A CPU account per analyst**: the thread CPU time (``CLOCK_THREAD_CPUTIME_ID``) of each of its
  statements, read live while a statement runs and decayed with a half-life
  (``cpu_half_life``). An analyst whose recent use exceeds its share (``analyst_cpu_share``
  cores, sustained) is *heavy*: while a lighter analyst has statements running or waiting, it
  runs ``heavy_statements`` (default 1) at a time.
- **A fair queue** for the server's run slots (``statements``, by default the thread pool's size
  minus two, which stay free for logins and clean-up): when a slot frees it goes to the waiting
  statement of the analyst that is not heavy, has the fewest statements running and has used
  the least CPU recently, in arrival order among equals. An analyst who has used more than
  their share waits behind everyone else and never ahead of a newcomer.
- **Yielding the GIL**: a *watched* statement (see :meth:`FairScheduler.wrap`) runs with a
  profile hook that, once its analyst is heavy, sleeps briefly after every few ms of its CPU
  while a lighter analyst's statement runs (:data:`YIELD_QUANTUM`). Without it, one GIL-bound
  thread alone made every GIL hand-off of another analyst's statement wait.

The queue wait counts against ``statement_timeout`` and a CancelRequest ends it (57014) without
running anything. The session keeps its event loop's own work bounded by a constant (long texts
and large results are handled as scheduled work, ``Session._small``). Each ``--workers`` worker
schedules its own connections. docs/server.md, "Sharing the CPU between analysts", has the
figures.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from dpsql.gil_gate import Gate, released
from dpsql.gil_gate import state as gil_state
from dpsql.server.failures import ClientError

# Descriptions of the [server] keys (also the error message's list of allowed keys).
SERVER_KEYS = {
    "analyst_statements": "statements of one analyst that may run at once in one server "
    "process (default 2); more wait for their turn without holding a thread",
    "heavy_statements": "the same for an analyst over its CPU share, while a lighter analyst "
    "has statements running or waiting (default 1)",
    "statements": "statements that may run at once in one server process (default 0: the "
    "thread pool's size minus 2)",
    "analyst_cpu_share": "cores one analyst may use, sustained, before it counts as heavy "
    "(default 0.25)",
    "cpu_half_life": "seconds after which half of an analyst's past CPU use is forgotten "
    "(default 5)",
}


class FairnessError(ClientError):
    """A [server] setting out of range."""


@dataclass(frozen=True)
class FairnessLimits:
    """How the server shares its CPU between analysts (one set per server process)."""

    analyst_statements: int = 2
    heavy_statements: int = 1
    statements: int = 0  # 0: the thread pool's size minus 2
    analyst_cpu_share: float = 0.25
    cpu_half_life: float = 5.0

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.analyst_statements, int) or self.analyst_statements < 1:
            problems.append("analyst_statements must be an integer >= 1")
        if not isinstance(self.heavy_statements, int) or not (
            1 <= self.heavy_statements <= max(1, self.analyst_statements)
        ):
            problems.append("heavy_statements must be an integer from 1 to analyst_statements")
        if not isinstance(self.statements, int) or self.statements < 0:
            problems.append("statements must be an integer >= 0")
        share, life = self.analyst_cpu_share, self.cpu_half_life
        if isinstance(share, bool) or not isinstance(share, int | float) or not share > 0:
            problems.append("analyst_cpu_share must be a number > 0")
        elif not math.isfinite(share):
            problems.append("analyst_cpu_share must be finite")
        if isinstance(life, bool) or not isinstance(life, int | float) or not 0 < life < 1e6:
            problems.append("cpu_half_life must be a number of seconds > 0")
        if problems:
            raise FairnessError("; ".join(problems), "22023")

    @property
    def heavy_cpu(self) -> float:
        """Decayed CPU seconds at which an analyst is heavy: what ``analyst_cpu_share`` cores,
        used without a pause, add up to (the decayed sum of a constant rate r is
        r * half_life / ln 2)."""
        return self.analyst_cpu_share * self.cpu_half_life / math.log(2)

    @classmethod
    def from_section(cls, section: Mapping[str, Any], where: str = "[server]") -> FairnessLimits:
        """Limits from a ``[server]`` table (unknown keys and bad values are refused)."""
        known = {f.name for f in fields(cls)}
        for key in section:
            if key not in known:
                raise FairnessError(
                    f"{where}: unknown key {key!r}",
                    "22023",
                    hint="use one of: " + ", ".join(sorted(known)),
                )
        values = dict(section)
        for key in ("analyst_cpu_share", "cpu_half_life"):
            value = values.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                values[key] = float(value)
        try:
            return cls(**values)
        except FairnessError as exc:
            raise FairnessError(f"{where}: {exc.message}", "22023") from None


class Abandoned(Exception):
    """A statement stopped waiting for its turn (cancel request or statement timeout)."""


# A heavy analyst's running statement yields the GIL to lighter analysts' statements: after
# each YIELD_QUANTUM seconds of its own CPU, while a lighter statement runs, it sleeps until none
# does, for at most YIELD_PAUSE (so it still gets at least QUANTUM / (QUANTUM + PAUSE) of a core,
# and a lock it holds is never kept from the others for longer than one pause). It looks at the
# clock every YIELD_EVENTS profile events (Python and C calls and returns, ~0.2 ms).
YIELD_QUANTUM = 0.002
YIELD_PAUSE = 0.02
YIELD_EVENTS = 1000
# Which statements are watched by the hook (see FairScheduler.wrap): an analyst past WARM of
# its heavy_cpu, or a statement with a text argument longer than WATCH_TEXT characters.
WARM = 0.25
WATCH_TEXT = 16 << 10
# An analyst with nothing running or waiting is forgotten once its account decays below this.
FORGET_CPU = 1e-3
# Seconds added to a running statement's wall time when it bounds the statement's CPU.
_CLOCK_SLACK = 1e-3


class Turn:
    """One statement's place in the scheduler: waiting, then running, then done."""

    __slots__ = (
        "analyst", "clock", "cpu", "cpu0", "finished", "granted", "paused", "running", "seq",
        "started", "waited", "watched",
    )  # fmt: skip

    def __init__(self, analyst: _Analyst, seq: int, granted: asyncio.Future[None]) -> None:
        self.analyst = analyst
        self.seq = seq
        self.granted = granted
        self.running = False
        self.clock: int | None = None  # the running thread's CPU clock
        self.cpu0 = 0.0
        self.cpu = 0.0  # CPU seconds so far (final once the call returns)
        self.waited = 0.0  # seconds it waited for its turn
        self.started = 0.0  # time.monotonic() when granted (its thread's clock starts later)
        self.paused = 0.0  # seconds it slept to yield to lighter analysts
        self.watched = False  # run with the yield hook
        self.finished = False  # its call returned (set by the pool thread)

    def most_cpu(self, now: float) -> float:
        """At least :meth:`live_cpu`, without reading the thread's clock (a system call, ~2.5
        µs, for each running statement at each dispatch): a thread uses at most one CPU
        second a second, and its clock starts after the grant at ``started``; the slack
        covers the two clocks' rounding."""
        if not self.running:
            return self.live_cpu()
        return max(0.0, now - self.started) + _CLOCK_SLACK

    def live_cpu(self) -> float:
        clock = self.clock
        if clock is None:
            return self.cpu
        try:
            return max(0.0, time.clock_gettime(clock) - self.cpu0)
        except OSError:
            return self.cpu

    def abandon(self) -> None:
        """Stop waiting (called on the event loop); a no-op once the statement runs."""
        if not self.granted.done():
            self.granted.set_exception(Abandoned())


class _Analyst:
    __slots__ = ("heavy", "name", "recent", "running", "stamp", "statements", "total_cpu")

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.recent = 0.0  # decayed CPU seconds of finished statements, as of ``stamp``
        self.stamp = now
        self.running: list[Turn] = []
        self.heavy = False  # over its share, as last computed on the event loop
        self.total_cpu = 0.0
        self.statements = 0


class FairScheduler:
    """Admits statements to the thread pool, fairly between analysts.

    ``enter``, ``leave`` and everything they call run on the server's event loop; the call
    returned by ``wrap`` runs in a pool thread and only reads the scheduler's state.
    """

    def __init__(self, limits: FairnessLimits, slots: int, gate: Gate | None = None) -> None:
        self.limits = limits
        # the statements' queue in front of the GIL (dpsql.gil_gate); None: no gate
        self.gate = gate
        self.slots = max(1, limits.statements or slots)
        self._analysts: dict[str, _Analyst] = {}
        self._waiting: list[Turn] = []
        self._running = 0
        self._seq = 0
        self._decay = math.log(2) / limits.cpu_half_life
        self._heavy_cpu = limits.heavy_cpu  # (the limits are frozen)
        self.light_running = 0  # running statements of analysts that are not heavy
        # set while light_running is 0 (wakes pauses); kept up to date while a watched
        # statement runs (only their hooks wait on it: an Event's set and clear are ~9 Python
        # calls a statement, most statements are not watched)
        self._no_light = threading.Event()
        self._no_light.set()
        self.watching = 0  # running turns that are watched (see wrap)

    # accounting ---------------------------------------------------------------------------
    def _analyst(self, name: str) -> _Analyst:
        a = self._analysts.get(name)
        if a is None:
            a = self._analysts[name] = _Analyst(name, time.monotonic())
        return a

    def _recent(self, a: _Analyst, now: float) -> float:
        if now > a.stamp:
            a.recent *= math.exp(-self._decay * (now - a.stamp))
            a.stamp = now
        return a.recent

    def _usage(self, a: _Analyst, now: float) -> float:
        return self._recent(a, now) + sum(t.live_cpu() for t in a.running)

    def usage(self, name: str) -> float:
        """An analyst's recent CPU seconds: finished statements decayed, plus those running."""
        a = self._analysts.get(name)
        return 0.0 if a is None else self._usage(a, time.monotonic())

    def heavy(self, name: str) -> bool:
        return self.usage(name) > self.limits.heavy_cpu

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per analyst: recent and total CPU, statements run, running, waiting, and the seconds
        its statements waited for their turn or slept to yield (for logs and tests)."""
        waiting: dict[str, int] = {}
        for t in self._waiting:
            waiting[t.analyst.name] = waiting.get(t.analyst.name, 0) + 1
        return {
            name: {
                "recent_cpu": self.usage(name),
                "heavy": self.heavy(name),
                "total_cpu": a.total_cpu,
                "statements": a.statements,
                "running": len(a.running),
                "waiting": waiting.get(name, 0),
            }
            for name, a in self._analysts.items()
        }

    # admission ------------------------------------------------------------------------------
    def enter(self, analyst: str) -> Turn:
        """A place in line; await ``turn.granted`` (it may already be done)."""
        loop = asyncio.get_running_loop()
        self._seq += 1
        turn = Turn(self._analyst(analyst), self._seq, loop.create_future())
        turn.waited = time.monotonic()
        self._waiting.append(turn)
        try:
            self._dispatch()
        except BaseException:  # a turn its caller never got back must not hold a slot:
            turn.finished = True  # the next dispatch takes it back if the release fails too,
            turn.granted.cancel()  # and a cancelled turn is never granted
            self._release(turn)
            raise
        return turn

    def leave(self, turn: Turn) -> None:
        """The statement ended (or stopped waiting): account its CPU, hand its slot on."""
        self._release(turn)
        self._dispatch()

    def _release(self, turn: Turn) -> None:
        """Take ``turn`` out of the line or out of its slot (idempotent), accounting its CPU.

        Also called by :meth:`_dispatch` for a running turn whose call has finished, so a
        slot comes back even if the ``leave`` that should have followed never ran (a failure
        on the loop between the call and the leave): no failure can shrink the server."""
        a = turn.analyst
        if turn.running:
            turn.running = False
            if turn.watched:
                turn.watched = False
                self.watching -= 1
            self._running -= 1
            a.running.remove(turn)
            cpu = turn.live_cpu()
            a.recent = self._recent(a, time.monotonic()) + cpu
            a.total_cpu += cpu
            a.statements += 1
        elif turn in self._waiting:
            self._waiting.remove(turn)
        if not turn.granted.done():
            turn.granted.cancel()

    def _dispatch(self) -> None:
        """Take back finished slots, recompute every analyst's account and heavy mark, forget
        idle analysts, and grant waiting turns. Runs twice a statement on the event loop, so
        the accounting of :meth:`_usage` is inlined here (one pass, same arithmetic)."""
        analysts = self._analysts
        for a in list(analysts.values()):
            if a.running:
                for turn in a.running[:]:
                    if turn.finished:
                        self._release(turn)
        now = time.monotonic()
        heavy_cpu = self._heavy_cpu
        decay = self._decay
        waiting: set[str] = set()  # (loops, not comprehensions: each of those is a call)
        if self._waiting:
            self._waiting = [t for t in self._waiting if not t.granted.done()]
            for t in self._waiting:
                waiting.add(t.analyst.name)
        usage: dict[str, float] = {}  # exact, for every analyst whose figure is read below
        for name, a in analysts.items():
            if now > a.stamp:  # _recent
                a.recent *= math.exp(-decay * (now - a.stamp))
                a.stamp = now
            if a.running and name not in waiting:
                # its figure is read only for its heavy mark: when the running statements'
                # wall time since their grant cannot take it past the mark, it is not heavy,
                # and their clocks need not be read (the same mark as the exact sum)
                most: float = a.recent
                for t in a.running:
                    most += t.most_cpu(now)
                if most <= heavy_cpu:
                    a.heavy = False
                    continue
            live: float = 0  # as sum() of the running turns' CPU
            for t in a.running:
                live += t.live_cpu()
            usage[name] = used = a.recent + live
            a.heavy = used > heavy_cpu
        # A heavy analyst is held to heavy_statements only while a lighter one has statements
        # running or waiting; alone, it may use the server as anyone else (work-conserving).
        contended = False
        idle = []
        for name, a in analysts.items():
            if a.running or name in waiting:
                contended = contended or not a.heavy
            elif usage[name] < FORGET_CPU:
                idle.append(name)
        for name in idle:
            del analysts[name]  # its account has decayed to nothing: forget it
        while self._running < self.slots and self._waiting:
            best: tuple[Any, ...] | None = None
            chosen: Turn | None = None
            for t in self._waiting:
                a = t.analyst
                cap = self.limits.analyst_statements
                if a.heavy and contended:
                    cap = self.limits.heavy_statements
                if len(a.running) >= cap:
                    continue
                key = (a.heavy, len(a.running), usage.get(a.name, 0.0), t.seq)
                if best is None or key < best:
                    best, chosen = key, t
            if chosen is None:
                break
            self._waiting.remove(chosen)
            chosen.running = True
            chosen.waited = now - chosen.waited
            chosen.started = now
            chosen.analyst.running.append(chosen)
            self._running += 1
            chosen.granted.set_result(None)
        light = 0
        for a in analysts.values():
            if not a.heavy:
                light += len(a.running)
        self.light_running = light
        if self.watching:
            self._light_event()

    def _light_event(self) -> None:
        """``_no_light`` set while no light statement runs (an Event's set and clear take its
        lock: only when the state changes)."""
        if self.light_running:
            if self._no_light.is_set():
                self._no_light.clear()
        elif not self._no_light.is_set():
            self._no_light.set()

    # running --------------------------------------------------------------------------------
    def wrap(self, turn: Turn, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """``fn(*args)`` for a pool thread (call it on the loop, right after the grant): measures
        the thread's CPU for the analyst's account and, for a statement that may turn out
        expensive, watches it with a profile hook that yields the GIL to lighter analysts once
        its analyst is over its share (see :data:`YIELD_QUANTUM`).

        The hook costs its own thread about a third more CPU in Python, so it is not on every
        statement: only on those of an analyst that is heavy or warm (past :data:`WARM` of its
        share), that runs another statement at the same time, or whose text is long
        (:data:`WATCH_TEXT`; binding and planning grow with it). A short first statement of an
        idle analyst runs unwatched, and so cannot be slowed once it starts.
        """
        a = turn.analyst
        heavy_cpu = self._heavy_cpu
        watched = (
            a.heavy or self._usage(a, time.monotonic()) > WARM * heavy_cpu or len(a.running) > 1
        )
        if not watched:
            for x in args:  # (a loop, not any(...): a generator's every step is a call)
                if isinstance(x, str) and len(x) > WATCH_TEXT:
                    watched = True
                    break
        if watched:
            if not turn.watched and turn.running:
                self.watching += 1  # counted until its turn is released
            turn.watched = True
            self._light_event()  # its hook may wait on it: up to date from now on

        def call() -> Any:
            try:
                clock = time.pthread_getcpuclockid(threading.get_ident())
            except (AttributeError, OSError):  # not on Linux: count at the end only
                clock = None
            turn.cpu0 = time.thread_time()
            turn.clock = clock
            hook = None
            if watched and sys.getprofile() is None:  # never displace a profiler
                hook = self._yielder(turn, heavy_cpu)
                sys.setprofile(hook)
            gate, took = self.gate, False
            try:
                took = gate is not None and gate.enter()  # or runs without (dpsql.gil_gate)
                return fn(*args)
            finally:
                # given back inline with no function of dpsql (gil_gate.leave): after a
                # charged answer nothing of ours may fail here
                mine = took and getattr(gil_state, "gate", None) is gate
                if mine and gate is not None:
                    gil_state.gate = None
                    gate.give()
                if hook is not None:
                    sys.setprofile(None)
                turn.cpu = max(0.0, time.thread_time() - turn.cpu0)
                turn.clock = None
                turn.finished = True

        return call

    def _yielder(self, turn: Turn, heavy_cpu: float) -> Callable[..., None]:
        """A profile function for a watched statement's thread (see :data:`YIELD_QUANTUM`)."""
        a = turn.analyst
        countdown = YIELD_EVENTS
        next_cpu = time.thread_time() + YIELD_QUANTUM
        thread_time, monotonic = time.thread_time, time.monotonic

        def others() -> int:
            """Lighter analysts' running statements (this analyst's own are not among them
            once the loop has marked it heavy; until then they are subtracted here)."""
            return self.light_running - (0 if a.heavy else len(a.running))

        def hook(_frame: Any, _event: str, _arg: Any) -> None:
            nonlocal countdown, next_cpu
            countdown -= 1
            if countdown:
                return
            countdown = YIELD_EVENTS
            now_cpu = thread_time()
            if now_cpu < next_cpu:
                return
            next_cpu = now_cpu + YIELD_QUANTUM
            # over its share: as last marked on the loop, or by this statement's CPU so far
            heavy = a.heavy or a.recent + (now_cpu - turn.cpu0) > heavy_cpu
            if not heavy or others() <= 0:
                return
            start = monotonic()
            # Sleep until no lighter statement runs (the loop sets the event) or the pause
            # ends; waiting on the event, not polling, leaves the GIL to the others meanwhile.
            with released():  # the others may run their Python meanwhile
                self._no_light.wait(YIELD_PAUSE)
            turn.paused += monotonic() - start

        return hook
