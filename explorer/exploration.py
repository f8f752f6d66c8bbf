"""Explore a target with Hypothesis as a stream of typed events: generate, shrink, confirm.

::

    from zerostate.targets.interface import get_target
    from zerostate.explorer.exploration import Exploration
    exp = Exploration(get_target("deepspeed", deepspeed="0.18.4"), examples=200)
    for event in exp.events():      # Seen, Shrunk, Confirmed, Progress, Restarted, Renumbered (exploration_events.py)
        ...                         # exp.request_stop(): the rest as seen, confirmed; closing: stop now
    res = exp.result()              # findings, examples, seconds, first_seen, generated_at, ...

The phases:

1. **Generate** (`generate`).  The first ``examples`` scenarios of one deterministic Hypothesis sequence run
   in *lanes* of ``lane`` distinct scenarios, each lane in order in a worker started fresh for it, on
   ``jobs`` workers at once (``spawn()`` makes the others).  The first example with a finding key not seen
   yet is handed over at once, unshrunk (`Seen`, numbered in hand-over order).
   Then (``pairs``, the default strategy only, not steered) the **pairwise completion** (`pairs`): the setup
   pairs no generated example took, drawn in scenarios of their own, up to one example per four, in lanes of
   `COMPLETION_LANE` at the positions after the generated ones, in two rounds.  The first reads no outcome, so
   it is drawn while the generated lanes run and a worker with no generated lane left runs its lanes
   (`first_round`); the second, after every run, redraws the pairs taken only by runs that ended on an exception.
   A key first met there is shrunk by polish alone (the generated sequence its search replays never meets it).
   Then (DeepSpeed targets, the default strategy, ``examples`` >= `goals.FROM_EXAMPLES`) the **goals round**
   (`goals`): every known DeepSpeed issue's family no run reached gets a forced draw that reaches it, or its own
   repro, at the positions after the completion's (`ExploreResult.goals` says which).
2. **Shrink** (`search`, `simplify`).  One pass on the first worker (started fresh): each key in the order of its
   first generated example (``first``'s keys before the others) gets a Hypothesis search of its own, then
   a greedy polish (`simplify`); the result is `Shrunk`.  A key first met while shrinking is handed over
   unshrunk at once too, and shrunk in its turn.  With helper workers, the searches of the keys next in line
   run ahead on them (`ahead`): the pass walks each search made ahead and records its runs as its own, against
   its cap, so the findings are those of one worker.
3. **Confirm** (`confirm`).  Each shrunk finding is replayed in a fresh worker (on the other workers, before
   they search ahead, or on the first after shrinking with one job) and handed over `Confirmed`.

The run ends when every key is shrunk and confirmed, or when the distinct target runs (shrinking included)
reach `hard_cap` (``examples``): the keys not shrunk yet keep the smallest scenario they were seen in
(stage ``as seen``), confirmed.  A complete run then renumbers its findings in the order the generated
sequence first met them (`Renumbered`, when that differs from the hand-over order).  Every example runs
after the same examples whatever ``jobs`` is, so the findings do not depend on ``jobs``.

Stopping: `Exploration.request_stop` (a time budget) ends the run at its next distinct run and hands the
findings not final yet over as seen, confirmed; closing the stream (or Ctrl-C) stops it at once, the
findings as handed over so far.  ``stop(findings)``, when given, is asked after each hand-over during
generation and after each shrunk finding: once true during generation, the keys it holds for are shrunk
first; once true on the shrunk findings, the run ends and the others stay as handed over (tests and
benchmarks looking for one bug).  ``seed=None`` explores the fixed seed `generate.DEFAULT_SEED`; no
Hypothesis database is read or written.

Steering (``steer="coverage"``, opt-in): generation runs in rounds of ``round_size`` distinct scenarios
(`rounds`), each drawn from draw weights that the rounds before it earned by the DeepSpeed arcs and
spec-monitor states their examples reached first (`steering_schedule`, `signal`); a finding's search replays its
round's strategy and seed.  ``shrink=False`` hands every finding over as seen after generation (benchmarks
that compare generations).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict
from collections.abc import Callable, Generator, Iterator

from zerostate.findings.finding import Finding
from zerostate.model.scenario import Scenario
from zerostate.specs import exercised, specs_for_stage
from zerostate.targets.interface import Outcome, Spent, Target

from zerostate.explorer.ahead import Ahead, Searched
from zerostate.explorer.confirm import Confirmation, ConfirmQueue, Job, Landed
from zerostate.explorer.exploration_events import (Confirmed, Event, FindingEvent, Progress, Renumbered,
                                                  Restarted, Seen, Shrunk, Stage)
from zerostate.explorer.generate import DEFAULT_SEED, LANE, Lanes, generated
from zerostate.explorer.draw_pool import DrawPool
from zerostate.explorer.first_round import FirstRound
from zerostate.explorer.goals import FROM_EXAMPLES as GOALS_FROM
from zerostate.explorer.goals import Reach, reach
from zerostate.explorer.goals import goals as goal_table
from zerostate.explorer.gathered import gathered_metrics
from zerostate.explorer.pairs import ROUNDS, Completion, budget_for, complete, ended_only, pairs_of, ran_through
from zerostate.explorer.rounds import ROUND, Rounds
from zerostate.explorer.signal import Unit, units
from zerostate.explorer.simplify import simplified
from zerostate.explorer.search import ShrinkSearch
from zerostate.explorer.time_spent import breakdown, cores, spent_by
from zerostate.explorer.workers import LaneStep, close_quietly, has_run, refresh, run_lanes, spawn_workers

STEERS = (None, "coverage", "flat")
"""``steer``: None (the fixed draw rates), ``coverage`` -- rounds whose draw rates follow the new DeepSpeed
arcs and spec-monitor states each choice's examples reached (`rounds`, `steering_schedule`) --, or ``flat``: the same
rounds, round seeds and coverage reads with the fixed rates (the control a benchmark compares steering with)."""


def hard_cap(examples: int) -> int:
    """Distinct target runs one exploration may make at most, shrinking included (and the pairwise
    completion's examples on top, and the goals round's with their share: `Exploration._run`)."""
    return 5 * examples + 100


GOAL_SHARE = 5
"""Distinct runs each goals-round example adds to the hard cap: its own and a generated example's share of shrinking
(`hard_cap`'s five per example), so a family the round reaches brings its own shrinking budget rather than taking
the generated findings'."""


SEARCH_AHEAD_ENV = "ZEROSTATE_SEARCH_AHEAD"
"""``0``: no searches ahead (`ahead`): shrinking's runs are the first worker's alone, the others only confirm (the
same findings; the benchmark's control)."""

COMPLETION_LANE = 8
"""The pairwise completion's examples per lane (a fixed size, so which examples share a worker does not depend
on ``jobs``)."""


class _GeneratedRunBase(TypedDict):
    """One generated example's outcome, as ``examples.jsonl`` holds it: the same seed draws the same examples
    in the same order, so a finding shown at a position by one tree and not by another is that tree's doing."""

    position: int
    seconds: float
    """Seconds from the start of the exploration to its outcome."""
    scenario: dict[str, Any]
    findings: list[dict[str, str]]
    """``{"key", "check"}`` of each finding of its run (empty: it passed)."""


class GeneratedRun(_GeneratedRunBase, total=False):
    gathered: dict[str, int]
    """A ZeRO-3 run that ran to its end: its gathered-parameter peak and all-gathers (`gathered.gathered_metrics`)."""


@dataclass
class ExploreResult:
    findings: list[Finding]
    """Each key's latest finding, in hand-over order."""
    examples: int
    seconds: float
    first_seen: dict[str, int] = field(default_factory=dict)
    """Finding key -> the number of distinct runs until it first appeared."""
    generated_at: dict[str, int] = field(default_factory=dict)
    """Finding key -> position, in the deterministic generation sequence, of the first example with it."""
    seconds_to: dict[str, float] = field(default_factory=dict)
    """Finding key -> seconds from the start until it was first handed over (unshrunk)."""
    restarts: list[dict[str, Any]] = field(default_factory=list)
    """Worker restarts during exploring: ``{"example": n, "why": text}`` (n: the distinct run after which)."""
    seconds_final: dict[str, float] = field(default_factory=dict)
    """Finding key -> seconds from the start until its final (shrunk, confirmed) finding was handed over."""
    stopped: bool = False
    """`Exploration.request_stop` cut the run (the rest handed over as seen)."""
    schedules: list[dict[str, list[int]]] = field(default_factory=list)
    """A steered run: the draw weights ``W_k`` of each round drawn (`choices.Weights.to_dict`)."""
    rounds: dict[str, int] = field(default_factory=dict)
    """A steered run: finding key -> the round whose strategy and seed its search replayed."""
    new_units: list[int] = field(default_factory=list)
    """A steered run: per round folded, the signal units (arcs, monitor states) its examples reached first."""
    generated: list[GeneratedRun] = field(default_factory=list)
    """Every distinct generated example's outcome, in sequence order (shrinking's runs left out): what two
    explorations of the same seed compare example by example (`GeneratedRun`)."""
    pairs: dict[str, Any] | None = None
    """The pairwise completion (`pairs.Completion.to_dict`); None where it did not run."""
    exercised: frozenset[str] = frozenset()
    """The specs some distinct run gave something to judge (`specs.exercised`): a spec no run exercised is not
    "ok", it is not exercised."""
    skipped: int = 0
    """Distinct runs whose scenario could not be trained at all, or not here (`Outcome.skipped`)."""
    time: dict[str, Any] | None = None
    """Where the time went (`time_spent.breakdown`); None before the exploration ended."""
    goals: dict[str, Any] | None = None
    """The goals round (`goals.Reach.to_dict`): which known issues' families the runs reached, which needed a forced
    draw or their own repro; None where it did not run (a steered run, a strategy of the caller's)."""

    @property
    def reliability(self) -> dict[str, Any]:
        return reliability(self.findings, self.restarts)


def reliability(findings: list[Finding], restarts: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's reliability figure: findings confirmed by replay / reported, order-dependent ones,
    not reproduced, and the worker restarts with their reasons."""
    st = [f.confirmation.status if f.confirmation is not None else "not-checked" for f in findings]
    return {"reported": len(findings), "confirmed": st.count("confirmed"),
            "order_dependent": st.count("order-dependent"), "intermittent": st.count("intermittent"),
            "not_reproduced": st.count("not-reproduced"), "not_checked": st.count("not-checked"),
            "restarts": list(restarts)}


def _calling_at_end(stream: Iterator[Scenario], done: Callable[[], None]) -> Iterator[Scenario]:
    """``stream``, then ``done()`` once it is exhausted (a huge sequence is never drawn whole up front)."""
    yield from stream
    done()


class _BudgetSpent(Exception):
    """The hard cap is reached: no more distinct runs."""


class _HungTooOften(Exception):
    """The key being shrunk has had `HANG_SHRINK_RUNS` runs that hung: its shrinking stops."""


HANG_SHRINK_RUNS = 3
"""Runs that may hang (each held to the step timeout, 60 s, and a worker or rank-pool restart) while one key is
shrunk; after them the key is handed over as seen.  A hang that every smaller scenario keeps would otherwise cost a
minute per shrinking step, a budget's worth of minutes for one finding."""


class _Stopped(Exception):
    """A stop was requested: the run ends at this distinct run."""


@dataclass
class _FindingsByKey:
    """The findings, one per key: the latest event of each (hand-over order), and what is known of it."""

    handed: dict[str, FindingEvent] = field(default_factory=dict)
    seen: dict[str, Finding] = field(default_factory=dict)
    """Key -> the smallest finding seen with it; of equal sizes, the first in sequence order (`see`)."""
    seen_at: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Key -> the sequence order of `seen`'s run."""
    queue: list[str] = field(default_factory=list)
    """Keys to shrink, in hand-over order (sorted when shrinking starts)."""
    done: set[str] = field(default_factory=set)
    """Keys whose last scenario is known (shrunk, or as seen)."""
    first_seen: dict[str, int] = field(default_factory=dict)
    generated_at: dict[str, int] = field(default_factory=dict)
    seconds_to: dict[str, float] = field(default_factory=dict)
    seconds_final: dict[str, float] = field(default_factory=dict)

    def see(self, f: Finding, runs: int, seconds: float, at: tuple[int, int]) -> Seen | None:
        """Note a finding of distinct run ``runs`` at sequence order ``at``; a new key is handed over (returned).
        Two scenarios of one size are told apart by ``at``, not by which landed first: with several jobs, lanes
        land in any order, and the key must keep the scenario one job keeps."""
        self.first_seen.setdefault(f.key, runs)
        if f.key not in self.seen or (f.size, at) < (self.seen[f.key].size, self.seen_at[f.key]):
            self.seen[f.key], self.seen_at[f.key] = f, at
        if f.key in self.handed:
            return None
        ev = Seen(len(self.handed) + 1, replace(f, shrunk=False, confirmation=Confirmation("not-checked")),
                  Stage.UNSHRUNK)
        self.handed[f.key] = ev
        self.queue.append(f.key)
        self.seconds_to[f.key] = seconds
        return ev

    def findings(self) -> list[Finding]:
        return [ev.finding for ev in self.handed.values()]

    def final_order(self) -> list[str]:
        """Keys in the order the generated sequence first met them; keys seen only while shrinking last, by key."""
        return sorted(self.handed, key=lambda k: (self.generated_at.get(k, float("inf")), k))


class _RunsPerWorker:
    """Per worker, every scenario it ran in order and the index of its last fresh start; per distinct run,
    where it ran: what a finding's confirmation replays before it when it is order-dependent."""

    def __init__(self, workers: int):
        self.logs: list[list[Scenario]] = [[] for _ in range(workers)]
        self.starts = [0] * workers
        self.ran_at: dict[Scenario, tuple[int, int, int]] = {}
        self.histories: dict[Scenario, tuple[Scenario, ...]] = {}

    def ran(self, wid: int, sc: Scenario) -> None:
        self.logs[wid].append(sc)
        self.ran_at[sc] = (wid, self.starts[wid], len(self.logs[wid]) - 1)

    def started_fresh(self, wid: int) -> None:
        self.starts[wid] = len(self.logs[wid])

    def ran_since_start(self, wid: int) -> bool:
        return bool(self.since_start(wid))

    def since_start(self, wid: int) -> list[Scenario]:
        return self.logs[wid][self.starts[wid]:]

    def ran_after(self, sc: Scenario, history: tuple[Scenario, ...]) -> None:
        """``sc`` ran (ahead of the pass) after ``history``, in a worker started fresh before it."""
        self.histories[sc] = history

    def before(self, sc: Scenario) -> list[Scenario]:
        if sc in self.histories:
            return list(self.histories[sc])
        wid, start, idx = self.ran_at.get(sc, (0, 0, 0))
        return list(self.logs[wid][start:idx])

    def replayed_on_first(self, c: Confirmation, restarted: bool) -> None:
        """The first worker now holds the last try's runs, from a fresh start."""
        self.logs[0].extend(c.last_run)
        self.starts[0] = len(self.logs[0]) - (0 if restarted else len(c.last_run))


def _restart_reason(out: Outcome) -> str:
    why = out.pool_restarted
    if why:
        return str(why)
    return next((f"{f.check}: {f.error.strip().splitlines()[0][:160]}" for f in out.findings
                 if f.check in ("hang", "crash")), "the worker was restarted")


class Exploration:
    """One exploration of ``target``; `events` runs it (once) and yields what happens."""

    def __init__(self, target: Target, *, examples: int, seed: int | None = None, strategy: Any = None,
                 stop: Callable[[list[Finding]], bool] | None = None, polish: bool = True, confirm: bool = True,
                 jobs: int = 1, spawn: Callable[[], Target] | None = None, lane: int = LANE,
                 first: Callable[[Finding], bool] | None = None, steer: str | None = None, round_size: int = ROUND,
                 shrink: bool = True, pairs: bool = True, goals: bool = True, search_ahead: bool | None = None):
        from zerostate.explorer.strategies import scenarios
        self.strategy = strategy if strategy is not None else scenarios()
        self.examples, self.seed, self.lane = examples, seed, lane
        self.stop, self.first, self.polish, self.confirm = stop, first, polish, confirm
        self.jobs, self.spawn = jobs, spawn
        if steer not in STEERS:
            raise ValueError(f"unknown steering {steer!r}; known: {', '.join(s for s in STEERS if s)}")
        if steer is not None and strategy is not None:
            raise ValueError("a steered exploration draws from strategies.scenarios(weights=...), not a strategy given")
        self.steer, self.round_size, self.shrink = steer, round_size, shrink
        self.search_ahead = (search_ahead if search_ahead is not None
                             else os.environ.get(SEARCH_AHEAD_ENV, "1") != "0")
        # completion draws from the default strategy's own choice points: not with a strategy of the caller's
        self.pairs = pairs and strategy is None and steer is None
        self.completion: Completion | None = None
        # the known issues' families (`goals`) are DeepSpeed's: a model design has none of them
        self.goals = goals and self.pairs and target.name == "deepspeed"
        self.reach: Reach | None = None
        self.rounds: Rounds | None = None
        self._positions: dict[Scenario, int] = {}
        self._generated_at: dict[int, tuple[Scenario, float]] = {}
        self.round_of: dict[str, int] = {}
        self._search_round = 0
        self.workers: list[Target] = [target]
        self.memo: dict[Scenario, Outcome] = {}
        self.exercised: set[str] = set()
        """The specs some distinct run so far exercised (`ExploreResult.exercised`)."""
        self.skipped = 0
        self._hung = 0
        """Runs that hung since the current key's shrinking started."""
        self.by_key = _FindingsByKey()
        self.runs_per_worker = _RunsPerWorker(1)
        self.restarts: list[Restarted] = []
        self.confirms: ConfirmQueue[FindingEvent] = ConfirmQueue(target)
        self.ahead: Ahead | None = None
        """With helper workers, the searches of the keys next in line, run ahead of the in-order pass (`ahead`)."""
        self._stop_requested = threading.Event()
        self._lanes_stop = threading.Event()
        self._stopped = False
        self._started = False
        self._t0 = time.perf_counter()
        self._ended: float | None = None
        self.phase_seconds: dict[str, float] = {}
        self._spent: Spent | None = None
        self._cpu0 = time.process_time()
        self._cpu: float | None = None
        """This process's CPU time while it explored (every thread's: drawing, searching, judging, the protocol)."""
        self._search_cpu: list[float] = []
        """Each Hypothesis search's own thread's CPU time (the pass's and those made ahead)."""

    # ------------------------------------------------------------ the consumer's side
    def events(self) -> Generator[Event, None, None]:
        """Run the exploration, yielding its events; closing the iterator stops it at once."""
        if self._started:
            raise RuntimeError("an exploration runs once")
        self._started = True
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()
        try:
            if self.jobs > 1 and self.spawn is not None:
                self.workers += spawn_workers(self.jobs - 1, self.spawn)
            self.runs_per_worker = _RunsPerWorker(len(self.workers))
            yield from self._phases()
        finally:
            self._ended = time.perf_counter()
            self._cpu = time.process_time() - self._cpu0
            self._spent = spent_by(self.workers)  # before the helpers close
            self._close()

    def request_stop(self) -> None:
        """End the run at its next distinct run; what was seen is handed over as seen, then confirmed."""
        self._stop_requested.set()
        self._lanes_stop.set()
        if self.ahead is not None:
            self.ahead.stop()

    def result(self) -> ExploreResult:
        end = self._ended if self._ended is not None else time.perf_counter()
        by_key = self.by_key
        rounds = self.rounds
        return ExploreResult(by_key.findings(), len(self.memo), end - self._t0, dict(by_key.first_seen),
                             dict(by_key.generated_at), dict(by_key.seconds_to), [r.to_dict() for r in self.restarts],
                             dict(by_key.seconds_final),
                             self._stopped, [w.to_dict() for w in rounds.weights] if rounds else [],
                             dict(self.round_of) if rounds else {}, list(rounds.new_units) if rounds else [],
                             self._generated_runs(), self.completion.to_dict() if self.completion else None,
                             frozenset(self.exercised), self.skipped,
                             breakdown(end - self._t0, self.phase_seconds, self._spent, cores(),
                                       (self.completion.draw_seconds, self.completion.waited_seconds)
                                       if self.completion else None,
                                       (self._cpu or 0.0, sum(self._search_cpu)))
                             if self._ended is not None else None,
                             self.reach.to_dict() if self.reach else None)

    def _generated_runs(self) -> list[GeneratedRun]:
        rows = []
        for pos, (sc, t) in sorted(self._generated_at.items()):
            out = self.memo[sc]
            # the scenario as a scenario file holds it (keys sorted)
            row = GeneratedRun(position=pos, seconds=round(t, 2), scenario=json.loads(sc.to_json(None)),
                               findings=[{"key": f.key, "check": f.check} for f in out.findings])
            m = gathered_metrics(sc, out)
            if m is not None:
                row["gathered"] = m
            rows.append(row)
        return rows

    @property
    def positions(self) -> dict[Scenario, int]:
        """Generated scenario -> its first position in the generation sequence (steered or not)."""
        return dict(self._positions)

    # ------------------------------------------------------------ phases
    def _phases(self) -> Generator[Event, None, None]:
        try:
            with self._phase("generation"):
                stopped = yield from self._generate()
            self._start_shrinking()
            with self._phase("shrinking"):
                if self.shrink:
                    stopped = yield from self._shrink(stopped)
                else:
                    stopped = False
                if not stopped:  # the hard cap came first: the rest as seen, confirmed
                    yield from self._hand_over_unshrunk_as_seen(self.by_key.queue)
            with self._phase("confirmation"):
                yield from self._hand_over_confirmations(block=True)
        except _Stopped:
            self._stopped = True
            if self.confirm:  # without confirmation the findings stay as handed over
                yield from self._hand_over_unshrunk_as_seen(list(self.by_key.handed))
                yield from self._hand_over_confirmations(block=True)
            return
        yield from self._renumber_in_generation_order()

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Adds the wall clock of the block to ``phase_seconds[name]`` (an interrupted phase's share included)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.perf_counter() - t0

    def _generate(self) -> Generator[Event, None, bool]:
        """Run the generated lanes (and the pairwise completion after them); whether ``stop`` ended generation."""
        if self.steer is not None:
            return (yield from self._generate_steered())
        if self.pairs:
            return (yield from self._generate_and_complete())
        stream = generated(self.strategy, self.examples, self.seed)
        lanes = Lanes(stream, self.lane)
        self._positions = lanes.position
        try:
            return (yield from self._run_lanes(iter(lanes), lanes.position))
        finally:
            stream.close()

    def _generate_and_complete(self) -> Generator[Event, None, bool]:
        """The generated lanes, then `pairs.completing`'s examples at the positions after them, in lanes of
        `COMPLETION_LANE`, in `ROUNDS` rounds: the first (`first_round`) reads no outcome and is drawn while the
        generated lanes run, its lanes handed out as soon as a worker has no generated lane left; the second,
        after every run, redraws the pairs whose runs all ended early.  Whether ``stop`` ended it."""
        stream = generated(self.strategy, self.examples, self.seed)
        budget = budget_for(self.examples)
        self.completion = done = Completion()
        # drawn in helpers at a lower priority, the round takes the cores the generated lanes leave
        helpers = min(self.jobs, os.cpu_count() or 1)
        firsts: list[FirstRound] = []
        generated_ran: list[Scenario] = []
        with contextlib.ExitStack() as stack:
            stack.callback(stream.close)
            pool = stack.enter_context(DrawPool(self.seed, helpers)) if helpers > 1 else None

            def drawn_whole() -> None:  # the generated sequence is known (its last lane not handed out yet)
                generated_ran.extend(lanes.position)
                firsts.append(stack.enter_context(FirstRound(done, generated_ran, budget, self.seed, pool)))
            lanes = Lanes(_calling_at_end(stream, drawn_whole), self.lane)
            self._positions = lanes.position
            if (yield from self._run_lanes(itertools.chain(lanes, self._completion_lanes(firsts)), self._positions)):
                return True
            for first in firsts:
                first.close()
            ran = generated_ran + done.examples
            stopped = yield from self._second_round(ran, budget, done, pool)
            done.draw_helpers = pool.failure if pool is not None else None
        if not stopped and self.goals:
            stopped = yield from self._goals_round(ran, self.examples + len(done.examples))
        return stopped

    def _goals_round(self, ran: list[Scenario], after: int) -> Generator[Event, None, bool]:
        """The goals no run reached (`goals.reach`), each forced, run at the positions after ``after``; an
        exploration smaller than `goals.FROM_EXAMPLES` runs none and says so."""
        if self.examples < GOALS_FROM:
            self.reach = Reach(goals=len(goal_table()), skipped=f"fewer than {GOALS_FROM} examples")
            return False
        if self._stop_requested.is_set():
            raise _Stopped()
        self.reach = step = reach([sc for sc in ran if self._ran(sc)], self.seed)
        if not step.examples:
            return False
        position = {sc: after + n for n, sc in enumerate(step.examples, 1)}
        self._positions.update(position)
        lanes = [step.examples[i:i + COMPLETION_LANE] for i in range(0, len(step.examples), COMPLETION_LANE)]
        self._lanes_stop.clear()
        try:
            return (yield from self._run_lanes(iter(lanes), position))
        finally:
            step.not_run = [goal for goal, sc in step.for_goal.items() if not self._ran(sc)]

    def _ran(self, sc: Scenario) -> bool:
        """``sc`` ran here and was trained (not skipped by the target)."""
        out = self.memo.get(sc)
        return out is not None and out.skipped is None

    def _completion_lanes(self, firsts: list[FirstRound]) -> Iterator[list[Scenario]]:
        """The first round's lanes (``firsts``: the round, made once the generated sequence was drawn whole), each
        as soon as its examples are chosen, their positions noted first."""
        if not firsts:
            return
        first = firsts[0]
        lane: list[Scenario] = []
        examples, n = first.examples(self._lanes_stop), 0
        while True:
            t0 = time.perf_counter()  # a worker wants a lane (the lanes are handed out one at a time)
            sc = next(examples, None)
            first.out.waited_seconds += time.perf_counter() - t0
            if sc is None:
                break
            n += 1
            self._positions[sc] = self.examples + n
            lane.append(sc)
            if len(lane) == COMPLETION_LANE:
                yield lane
                lane = []
        if lane:
            yield lane

    def _second_round(self, ran: list[Scenario], budget: int, done: Completion,
                      pool: DrawPool | None) -> Generator[Event, None, bool]:
        """Redraw the pairs taken only by runs that ended early and run them; the completion's last figures."""
        if self._stop_requested.is_set():
            raise _Stopped()
        for _ in range(ROUNDS - 1):
            t0 = time.perf_counter()
            step = complete(ran, budget - len(done.examples), self.seed, self._ended_early(ran), done.not_drawable,
                            drawer=pool)
            drew = time.perf_counter() - t0
            done.draw_seconds += drew
            done.waited_seconds += drew  # every worker waits for the second round
            done.not_drawable += step.not_drawable
            done.sampled_not_drawable += step.sampled_not_drawable
            done.left = step.left
            if not step.examples:
                break
            position = {sc: self.examples + len(done.examples) + n
                        for n, sc in enumerate(step.examples, 1)}
            done.examples += step.examples
            self._positions.update(position)
            lanes = [step.examples[i:i + COMPLETION_LANE] for i in range(0, len(step.examples), COMPLETION_LANE)]
            self._lanes_stop.clear()
            if (yield from self._run_lanes(iter(lanes), position)):
                return True
            ran += step.examples
        done.ended_early = ended_only(ran, self._ended_early(ran))
        ran_at_all = set().union(*map(pairs_of, ran))  # a retry the budget cut ran once: ended early, not "left"
        done.left = [p for p in done.left if p not in ran_at_all]
        return False

    def _ended_early(self, ran: list[Scenario]) -> list[Scenario]:
        """The scenarios of ``ran`` whose run ended on an exception (`pairs.ran_through`)."""
        outcomes = [self.memo.get(sc) for sc in ran]
        return [sc for sc, o in zip(ran, outcomes, strict=True) if o is not None and not ran_through(o.checks)]

    def _generate_steered(self) -> Generator[Event, None, bool]:
        """`_generate` in rounds (`rounds.Rounds`): every run's coverage read, each outcome's units noted; whether
        ``stop`` ended generation."""
        for w in self.workers:
            w.measure_coverage(True)
        self.rounds = rounds = Rounds(self.examples, self.seed, self.round_size,
                                      max(1, min(self.lane, self.round_size // 2)), self._lanes_stop,
                                      reweigh=self.steer == "coverage")
        self._positions = rounds.position
        try:
            return (yield from self._run_lanes(iter(rounds), rounds.position, rounds.round_at, rounds.note))
        finally:
            for w in self.workers:
                w.measure_coverage(False)

    def _run_lanes(self, lanes: Iterator[list[Scenario]], position: dict[Scenario, int],
                   round_at: dict[Scenario, int] | None = None,
                   note: Callable[[Scenario, frozenset[Unit]], None] | None = None) -> Generator[Event, None, bool]:
        """Run ``lanes`` on the workers, recording each outcome at its sequence ``position`` (and round); ``note``
        gets each outcome's steering units.  Whether ``stop`` ended generation."""
        before = [w.restarts for w in self.workers]
        steps = run_lanes(self.workers, lanes, self._lanes_stop, [has_run(w) for w in self.workers])
        try:
            for step in steps:
                if step.error is not None:
                    raise step.error
                if step.scenario is None or step.outcome is None:  # the worker started fresh for a lane
                    self.runs_per_worker.started_fresh(step.worker)
                else:
                    yield from self._record(step.worker, step.scenario, step.outcome,
                                            step.restarts != before[step.worker], at=position[step.scenario])
                    sc = step.scenario
                    self._note_position(step, position[sc], round_at[sc] if round_at is not None else 0)
                    if note is not None:
                        note(step.scenario, units(step.outcome.trace, step.outcome.coverage))
                before[step.worker] = step.restarts
                if step.scenario is not None and self.stop is not None and self.stop(self.by_key.findings()):
                    return True
        finally:
            self._lanes_stop.set()
            steps.close()
        return False

    def _note_position(self, step: LaneStep, position: int, round_k: int = 0) -> None:
        if step.scenario is not None:
            self._generated_at.setdefault(position, (step.scenario, self._elapsed()))
        for f in step.outcome.findings if step.outcome is not None else ():
            if position < self.by_key.generated_at.get(f.key, position + 1):
                self.round_of[f.key] = round_k
            self.by_key.generated_at[f.key] = min(self.by_key.generated_at.get(f.key, position), position)

    def _start_shrinking(self) -> None:
        """Shrinking is one pass over the keys on the first worker, started fresh (the same whatever ``jobs`` is);
        the others replay confirmations and, with shrinking on, run the searches of the keys next in line ahead of
        the pass (`ahead`)."""
        if self.runs_per_worker.ran_since_start(0) and refresh(self.workers[0]):
            self.runs_per_worker.started_fresh(0)
        if self.shrink and self.search_ahead and len(self.workers) > 1:
            self.ahead = Ahead(self.workers, self._search_ahead_of, self.confirms, self.memo.get,
                               [self.runs_per_worker.since_start(w) for w in range(len(self.workers))])
        else:
            self.confirms.add_helpers(self.workers[1:])

    def _shrink(self, stopped: bool) -> Generator[Event, None, bool]:
        """Shrink every key handed over, in order; whether ``stop`` ended the run."""
        try:
            return (yield from self._shrink_in_order(stopped))
        finally:
            if self.ahead is not None:  # what runs ahead now is thrown away
                self.ahead.stop()

    def _shrink_in_order(self, stopped: bool) -> Generator[Event, None, bool]:
        by_key = self.by_key

        def order(k: str) -> tuple[int, int]:
            return (by_key.generated_at.get(k, self.examples + 1), by_key.first_seen.get(k, 0))
        if stopped and self.stop is not None:  # the caller wants these: shrink them first
            stop = self.stop
            wanted = {k for k in by_key.queue if stop([by_key.handed[k].finding])}
            by_key.queue.sort(key=lambda k: (k not in wanted, order(k)))
        else:
            by_key.queue.sort(key=order)
        while True:
            todo = [k for k in by_key.queue if k not in by_key.done]
            if not todo:
                return False
            key = self._next_key(todo)
            self._hung = 0
            if self.ahead is not None:
                self.ahead.line(self._line(todo))
                self.ahead.ready(key)
            try:
                sc = yield from self._search(key)
            except _BudgetSpent:
                return False
            except _HungTooOften:  # as seen: the smallest scenario the key has shown so far
                yield from self._shrunk(by_key.seen[key], shrink=False)
                yield from self._hand_over_confirmations(block=False)
                continue
            hit = next((f for f in self.memo[sc].findings if f.key == key), None) if sc else None
            yield from self._shrunk(hit if hit is not None else by_key.seen[key], shrink=True)
            yield from self._hand_over_confirmations(block=False)
            if self.stop is not None and self.stop([by_key.handed[k].finding for k in by_key.done]):
                return True  # the caller has what it wanted: the rest stay as handed over, unconfirmed

    def _next_key(self, todo: list[str]) -> str:
        """``first``'s keys before the others (explore: the ones no known issue explains, so the hard cap
        falls on documented bugs), each group in queue order."""
        return self._line(todo)[0]

    def _line(self, todo: list[str]) -> list[str]:
        """``todo`` in the order the pass takes its keys, as far as known now (`_next_key`)."""
        if self.first is None:
            return list(todo)
        first = self.first
        return sorted(todo, key=lambda k: not first(self.by_key.handed[k].finding))

    def _search(self, want: str) -> Generator[Event, None, Scenario | None]:
        """Hypothesis's search for ``want`` over the strategy and seed that generated it (a steered run: its
        round's); made ahead whole (`ahead`): its requests walked, each run recorded as the search would."""
        if self.rounds is not None:
            self._search_round = self.round_of.setdefault(want, 0)
        searched = self.ahead.searched.get(want) if self.ahead is not None else None
        if searched is not None:
            for sc in searched.asked:
                yield from self._run(sc)
            return searched.found
        return (yield from self._search_with(want, self._run))

    def _search_with(self, want: str, run: Callable[[Scenario], Generator[Event, None, Outcome]],
                     asked: list[Scenario] | None = None) -> Generator[Event, None, Scenario | None]:
        if self.rounds is None and self.by_key.generated_at.get(want, self.examples + 1) > self.examples:
            # a key the generated sequence never met (the completion's, the goals', one met while shrinking):
            # the search replays that sequence, meets it nowhere and shrinks nothing -- seconds of drawing for None
            return None
        strategy, seed = self.strategy, self.seed
        if self.rounds is not None:
            k = self.round_of.get(want, 0)
            strategy, seed = self.rounds.strategy(k), self.rounds.seed_of_round(k)
        search = ShrinkSearch(strategy, self.examples, seed, want, self.memo.get)
        try:
            for sc in search.requests():
                if asked is not None:
                    asked.append(sc)
                out = yield from run(sc)
                search.answer(out)
        finally:
            search.close()
            self._search_cpu.append(search.cpu_seconds)
        return search.found

    def _search_ahead_of(self, want: str, run: Callable[[Scenario], Outcome]) -> Searched:
        """``want``'s search and polish as the pass will make them (`_search`, `_shrunk`), every run through
        ``run`` (made ahead: `ahead`), nothing recorded or handed over; the search's record."""
        def step(sc: Scenario) -> Generator[Event, None, Outcome]:
            return run(sc)
            yield  # a generator, as the pass's own run is  # pragma: no cover

        asked: list[Scenario] = []
        sc = _drain(self._search_with(want, step, asked))
        hit = next((f for f in run(sc).findings if f.key == want), None) if sc is not None else None
        f = hit if hit is not None else self.by_key.seen.get(want)
        if self.polish and f is not None:
            _drain(simplified(f, step))
        return Searched(tuple(asked), sc)

    def _hand_over_unshrunk_as_seen(self, keys: list[str]) -> Iterator[Event]:
        """The keys of ``keys`` not shrunk yet, as the smallest scenario each was seen in (stage ``as seen``)."""
        for key in [k for k in keys if k not in self.by_key.done]:
            yield from self._shrunk(self.by_key.seen[key], shrink=False)

    # ------------------------------------------------------------ runs
    def _run(self, sc: Scenario) -> Generator[Event, None, Outcome]:
        """One scenario on the first worker, memoised."""
        out = self.memo.get(sc)
        if out is not None:
            return out
        extra = (len(self.completion.examples) if self.completion else 0) + (
            GOAL_SHARE * len(self.reach.examples) if self.reach else 0)
        if len(self.memo) >= hard_cap(self.examples) + extra:
            raise _BudgetSpent()
        if self._hung >= HANG_SHRINK_RUNS:  # this key's shrinking runs keep hanging
            raise _HungTooOften()
        history: tuple[Scenario, ...] | None = None
        if self.ahead is not None:  # made ahead (else made now), on whichever worker, after its own history
            got = self.ahead.run(sc)
            out, restarted, history = got.outcome, got.restarted, got.history
        else:
            w = self.workers[0]
            before = w.restarts
            out = w.run(sc)
            restarted = w.restarts != before
        self._hung += any(f.check == "hang" for f in out.findings)
        yield from self._record(0, sc, out, restarted, history)
        return out

    def _record(self, wid: int, sc: Scenario, out: Outcome, restarted: bool,
                history: tuple[Scenario, ...] | None = None, at: int | None = None) -> Iterator[Event]:
        """A distinct run's outcome: memoised, logged in its worker's history (``history``: what its worker ran
        before it since a fresh start, a run made ahead), its new keys handed over."""
        self.memo[sc] = out
        self.exercised |= exercised(out.trace, specs_for_stage(sc.stage))
        self.skipped += out.skipped is not None
        if history is not None:
            self.runs_per_worker.ran_after(sc, history)
        else:
            self.runs_per_worker.ran(wid, sc)
        if restarted and history is None:  # the next example in this worker starts in a fresh one
            self.runs_per_worker.started_fresh(wid)
        if restarted:
            self.restarts.append(Restarted(len(self.memo), _restart_reason(out)))
            yield self.restarts[-1]
        order = (0, at) if at is not None else (1, len(self.memo))  # a lane's position; shrinking's runs after
        for f in out.findings:
            seen = self.by_key.see(f, len(self.memo), self._elapsed(), order)
            if seen is not None:
                if self.rounds is not None and self.rounds.stop.is_set():  # met while shrinking: its search's round
                    self.round_of.setdefault(f.key, self._search_round)
                yield seen
        yield Progress(len(self.memo), len(self.by_key.handed), self._elapsed())
        if self._stop_requested.is_set():
            raise _Stopped()

    # ------------------------------------------------------------ shrunk, then confirmed
    def _shrunk(self, f: Finding, shrink: bool) -> Iterator[Event]:
        """A key's last scenario: simplified (when ``shrink``), handed over (confirmation pending), confirmed."""
        if shrink and self.polish:
            with contextlib.suppress(_BudgetSpent, _HungTooOften):  # a cap came while polishing: Hypothesis' one
                f = yield from simplified(f, self._run)
        ev = Shrunk(self.by_key.handed[f.key].n, replace(f, shrunk=shrink, confirmation=None),
                    Stage.SHRUNK if shrink else Stage.AS_SEEN)
        self.by_key.handed[f.key] = ev
        self.by_key.done.add(f.key)
        yield ev
        if not self.confirm:
            yield self._hand_over_confirmed(ev, Confirmation("not-checked"))
            return
        scenario = ev.finding.scenario
        assert scenario is not None, "an explored finding has its scenario"
        self.confirms.submit(Job(ev, f.key, scenario, self.runs_per_worker.before(scenario)))

    def _hand_over_confirmations(self, block: bool) -> Iterator[Event]:
        """A `Confirmed` for each confirmation that has landed (``block``: wait for every pending one)."""
        for landed in self.confirms.landed(block):
            yield self._confirmation_landed(landed)

    def _confirmation_landed(self, landed: Landed[FindingEvent]) -> Confirmed:
        """One landed confirmation, handed over; a replay on the first worker joins that worker's runs."""
        if landed.inline:
            self.runs_per_worker.replayed_on_first(landed.confirmation, landed.restarted)
        return self._hand_over_confirmed(landed.item, landed.confirmation)

    def _hand_over_confirmed(self, ev: FindingEvent, c: Confirmation) -> Confirmed:
        """``ev``'s finding with its confirmation: its final event."""
        done = Confirmed(ev.n, replace(ev.finding, confirmation=c), ev.stage)
        self.by_key.handed[done.key] = done
        self.by_key.seconds_final[done.key] = self._elapsed()
        return done

    def _renumber_in_generation_order(self) -> Iterator[Event]:
        """`Renumbered`, when the order the generated sequence met the keys is not the hand-over order."""
        keys = self.by_key.final_order()
        if keys != list(self.by_key.handed):
            yield Renumbered(tuple(replace(self.by_key.handed[k], n=i) for i, k in enumerate(keys, 1)))

    # ------------------------------------------------------------ the end
    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def _close(self) -> None:
        self._lanes_stop.set()
        self.confirms.stop()
        if self.ahead is not None:
            self.ahead.close()
        while len(self.workers) > 1:  # a helper in the middle of a replay fails at once: its worker is gone
            close_quietly(self.workers.pop())
        self.confirms.join()
        if self.ahead is not None:
            self.ahead.join()


def _drain(steps: Generator[Event, None, Any]) -> Any:
    """What a generator of events returns, its events dropped."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def explore(target: Target, *, examples: int, seed: int | None = None,
            on_finding: Callable[[Finding], None] | None = None,
            on_progress: Callable[[int, int, float], None] | None = None,
            on_update: Callable[[Finding], None] | None = None,
            on_restart: Callable[[dict[str, Any]], None] | None = None, **options: Any) -> ExploreResult:
    """Run an `Exploration` to its end and return its result; the ``on_*`` observers see its events
    (``on_finding``: `Seen`; ``on_update``: `Shrunk` and `Confirmed`).  ``options``: `Exploration`'s."""
    exp = Exploration(target, examples=examples, seed=seed, **options)
    with contextlib.closing(exp.events()) as stream:
        for ev in stream:
            if isinstance(ev, Seen) and on_finding is not None:
                on_finding(ev.finding)
            elif isinstance(ev, (Shrunk, Confirmed)) and on_update is not None:
                on_update(ev.finding)
            elif isinstance(ev, Progress) and on_progress is not None:
                on_progress(ev.examples_run, ev.findings, ev.seconds)
            elif isinstance(ev, Restarted) and on_restart is not None:
                on_restart(ev.to_dict())
    return exp.result()


__all__ = ["DEFAULT_SEED", "Exploration", "ExploreResult", "GeneratedRun", "LANE", "explore", "generated",
           "hard_cap", "reliability"]
