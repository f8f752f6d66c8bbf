"""Explore a target with Hypothesis: hand each distinct finding over at once, then shrink and confirm it.

::

    from zerostate.targets.base import get_target
    from zerostate.explorer.explore import explore
    res = explore(get_target("deepspeed", deepspeed="0.18.4"), examples=200, seed=None,
                  on_finding=print, on_progress=lambda n, k, s: None)
    res.findings, res.examples, res.seconds, res.first_seen

How, in two phases (issue 11: time to each bug matters more than the number of findings):

1. **Generate.**  The first ``examples`` scenarios of one deterministic Hypothesis sequence over
   `targets.strategies.scenarios()` (or ``strategy``) -- `generated`, drawn without running anything --
   run in *lanes* of ``lane`` (`LANE`) distinct scenarios, each lane in order in a worker started fresh
   for it, on ``jobs`` workers at once (``spawn()`` makes the others: a DeepSpeed worker, a rank pool at
   world size 2).  The first example with a finding key (`Finding.key`) not seen yet is handed over at
   once, unshrunk (``on_finding``; ``finding.shrunk`` False): its scenario already replays it.
2. **Shrink.**  Then, on the first worker alone (started fresh), each key in the order of its first
   generated example gets a Hypothesis search of its own: it replays the generated sequence (outcomes are
   memoised by scenario, so that costs nothing) up to the first example with the key and shrinks it (the
   predicate "has this key" is fixed, so shrinking is sound); the shrunk finding goes to ``on_update``
   (confirmation pending), then is confirmed (below) and goes to ``on_update`` again.  A key first seen
   while shrinking is handed over unshrunk at once too, and shrunk in its turn (a key the generated
   sequence never shows keeps the smallest scenario it was seen in).

The run ends when every key is shrunk and confirmed, or when the distinct target runs (shrinking
included) reach ``hard_cap(examples)`` = 5 x examples + 100: the keys not shrunk yet keep the smallest
scenario they were seen in (``shrunk`` False), confirmed.  Every example runs after the same examples
whatever ``jobs`` is (its lane's, from a fresh start; shrinking's, from a fresh start), so an outcome
that depends on what ran before it in the worker (state carried over) is the same with one job or
eight: the findings do not depend on ``jobs``; with several jobs only the order in which they are first
handed over may differ.

Shrink order (``first``): when given, the keys whose handed-over finding ``first`` holds for are shrunk
before the others, each group in the order above (``zerostate explore`` shrinks the findings no known issue
explains first: when the hard cap ends shrinking, the ones left unshrunk are documented bugs).

Polish (``polish=True``): each finding Hypothesis shrank is then simplified greedily
in the strategies' documented shrink order (fewer blocks and steps, ZeRO-3, plain
trainable blocks, engine.backward, no extras, default knobs), keeping any one-step
simplification that keeps its key: Hypothesis minimises the *choice sequence*, and a
ZeRO-3 scenario draws more choices (leaf flags) than a ZeRO-1 one, so without this a
ZeRO-3 bug that also shows under ZeRO-1 would be reported on ZeRO-1.

Determinism: ``seed=None`` explores the sequence of seed ``DEFAULT_SEED`` (0):
like the ci profile's ``derandomize``, the same target gives the same findings on
every run, and unlike it the sequence does not change when this module's source
does.  An integer seed picks another (equally reproducible) sequence.  No
Hypothesis database is read or written.

Confirmation (``confirm=True``, issue 15): before a shrunk finding is final it is replayed in a
fresh worker -- on the other workers while the first shrinks the next key (``jobs`` > 1), or on the
first after all shrinking (one job, so that shrinking runs after the same examples either way) (`targets.confirm`): alone, then, when it does not reproduce alone, after the examples
that ran before it in the same worker, cut to the shortest run that still makes it appear.  The
finding carries ``confirmation`` (a `confirm.Confirmation`: ``confirmed``, ``order-dependent`` with
its ``sequence``, ``intermittent`` with its rate, ``not-reproduced``, or ``not-checked`` after Ctrl-C).  The explorer keeps, for
every distinct run, the examples run before it since the worker's last (re)start, and counts the
restarts with their reason (``ExploreResult.restarts``: hang, crash, ranks out of step).

On Ctrl-C every finding seen is already handed over (unshrunk where it is not shrunk yet, not
confirmed), and KeyboardInterrupt propagates; `StopExploring` (a KeyboardInterrupt an ``on_progress``
raises to end the run, e.g. a time budget) first confirms the ones not final yet, as seen.
``on_restart(record)`` is called for each worker restart as it happens.  ``stop(findings)``, when given,
is asked after each hand-over during generation (unshrunk findings) and after each shrunk one: once it
returns True during generation, generation ends and the keys it was true for are shrunk first; once it
returns True on the shrunk findings, the run ends, and the findings not shrunk yet stay as handed over
(unshrunk, ``not-checked``): tests and benchmarks looking for one bug.

``on_progress(examples_run, findings_so_far, elapsed_seconds)`` is called after
every distinct target run.  `ExploreResult` has ``findings``, ``examples``
(distinct target runs, shrinking included), ``seconds``, ``first_seen`` (finding
key -> the number of distinct runs until it first appeared), ``generated_at``
(finding key -> the position, in the deterministic generation sequence, of the
first generated example that has it: "found within N examples"; a key seen only
while shrinking has none), ``seconds_to`` (finding key -> seconds until first handed over, unshrunk)
and ``seconds_final`` (-> seconds until its final finding: shrunk and confirmed).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hseed
from hypothesis.control import current_build_context

from zerostate.model.scenario import Scenario

from zerostate.targets.base import Outcome, Target

from zerostate.findings.finding import Finding
from zerostate.explorer.confirm import StopExploring


@dataclass
class ExploreResult:
    findings: list[Finding]
    examples: int
    seconds: float
    first_seen: dict[str, int] = field(default_factory=dict)
    generated_at: dict[str, int] = field(default_factory=dict)
    """Finding key -> position, in the deterministic generation sequence, of the first example with it."""
    seconds_to: dict[str, float] = field(default_factory=dict)
    """Finding key -> seconds from the start until it was first handed over (unshrunk)."""
    restarts: list[dict] = field(default_factory=list)
    """Worker restarts during exploring: ``{"example": n, "why": text}`` (n: the distinct run after which)."""
    seconds_final: dict[str, float] = field(default_factory=dict)
    """Finding key -> seconds from the start until its final (shrunk, confirmed) finding was handed over."""

    @property
    def reliability(self) -> dict:
        return reliability(self.findings, self.restarts)


def reliability(findings: list[Finding], restarts: list[dict]) -> dict:
    """The report's reliability figure: findings confirmed by replay / reported, order-dependent ones,
    not reproduced, and the worker restarts with their reasons."""
    st = [f.confirmation.status if f.confirmation is not None else "not-checked" for f in findings]
    return {"reported": len(findings), "confirmed": st.count("confirmed"),
            "order_dependent": st.count("order-dependent"), "intermittent": st.count("intermittent"),
            "not_reproduced": st.count("not-reproduced"), "not_checked": st.count("not-checked"),
            "restarts": list(restarts)}


DEFAULT_SEED = 0
"""The sequence ``seed=None`` explores.  A fixed seed rather than Hypothesis' ``derandomize``: derandomize
seeds from a digest of the test function's *source*, so every edit of this module would change which
examples are explored; a fixed seed keeps the sequence a function of the strategies alone."""


class _NewCheck(Exception):
    pass


class _TargetBroken(BaseException):
    """Carries an exception of the target itself (not a finding) through Hypothesis, unshrunk."""


class _BudgetSpent(BaseException):
    """Raised through Hypothesis (a BaseException, so it is not shrunk) when the hard cap is reached."""


def hard_cap(examples: int) -> int:
    """Distinct target runs one exploration may make at most, shrinking included."""
    return 5 * examples + 100


_STAGE_RANK = {3: 0, 1: 1, 2: 2}


def _rank(sc: Scenario) -> tuple:
    """How far a scenario is from the simplest one, in the strategies' documented shrink order: fewer
    blocks and steps, ZeRO-3, then plain trainable blocks, engine.backward, no extras, default knobs, no
    training-setup dimension."""
    d = Scenario()
    extras = sum((b.checkpoint.value != "none") + (b.norm.value != "trainable") + (b.lin.value != "trainable")
                 + b.leaf for b in sc.blocks)
    extras += sum(m.backward.value != "engine" for _, _, m in sc.micro_steps())
    extras += sum(st.eval_before for st in sc.steps) + sc.fused_head + (not sc.input_requires_grad)
    extras += sum(getattr(sc, k) != getattr(d, k) for k in ("persistence_threshold", "prefetch_bucket_size",
                                                           "reduce_bucket_size"))
    # the training-setup dimensions (issue 11: precision, offload, options, ...), re-registrations, branches
    extras += len(sc.beyond_model()) + sum(st.reregister for st in sc.steps) + sum(
        bool(m.skip) for _, _, m in sc.micro_steps()) + (sc.world_size > 1)
    extras += sc.optimizer != d.optimizer  # a setup dimension the model represents (not in beyond_model)
    extras += sum(st.save_load for st in sc.steps) * (sc.stage != 3)  # ZeRO-3's is in beyond_model
    return (len(sc.blocks), len(sc.steps), sc.gas, _STAGE_RANK.get(sc.stage, 3), extras)


def _candidates(sc: Scenario):
    """One-step simplifications of a scenario, most valuable first."""
    from dataclasses import replace

    from zerostate.model.scenario import BackwardKind, Checkpoint, ParamKind
    if sc.stage != 3:
        yield sc.with_(stage=3)
    for i in range(len(sc.blocks)) if len(sc.blocks) > 1 else ():
        yield sc.with_(blocks=sc.blocks[:i] + sc.blocks[i + 1:])
    for i in range(len(sc.steps)) if len(sc.steps) > 1 else ():
        yield sc.with_(steps=sc.steps[:i] + sc.steps[i + 1:])
    if sc.gas > 1:
        for j in range(sc.gas):
            yield sc.with_(steps=tuple(replace(st, micro=(st.micro[j],)) for st in sc.steps))
    if sc.stage == 2:
        yield sc.with_(stage=1)
    for i, b in enumerate(sc.blocks):
        for ch in (dict(checkpoint=Checkpoint.NONE), dict(norm=ParamKind.TRAINABLE), dict(lin=ParamKind.TRAINABLE),
                   dict(leaf=False)):
            nb = replace(b, **ch)
            if nb != b:
                yield sc.with_(blocks=sc.blocks[:i] + (nb,) + sc.blocks[i + 1:])
    for i, st in enumerate(sc.steps):
        if st.eval_before:
            yield sc.with_(steps=sc.steps[:i] + (replace(st, eval_before=False),) + sc.steps[i + 1:])
        for j, m in enumerate(st.micro):
            if m.backward is not BackwardKind.ENGINE:
                nm = st.micro[:j] + (replace(m, backward=BackwardKind.ENGINE),) + st.micro[j + 1:]
                yield sc.with_(steps=sc.steps[:i] + (replace(st, micro=nm),) + sc.steps[i + 1:])
    if sc.fused_head:
        yield sc.with_(fused_head=False)
    if not sc.input_requires_grad:
        yield sc.with_(input_requires_grad=True)
    d = Scenario()
    for k in ("persistence_threshold", "prefetch_bucket_size", "reduce_bucket_size"):
        if getattr(sc, k) != getattr(d, k):
            yield sc.with_(**{k: getattr(d, k)})
    yield from _setup_candidates(sc, d)


def _setup_candidates(sc: Scenario, d: Scenario):
    """The training-setup dimensions (issue 11) back to their plain value, one at a time (a key first seen
    while shrinking another keeps the scenario it was seen in, setup dimensions and all, so polish is
    what simplifies it)."""
    from dataclasses import replace

    from zerostate.model.scenario import _EXTENDED_DEFAULTS, Precision
    for k, v in _EXTENDED_DEFAULTS.items():
        if k in ("family", "fp32_grad_accum", "loss_scale_power") or getattr(sc, k) == v:
            continue
        if k == "precision":
            yield sc.with_(precision=Precision.FP32, fp32_grad_accum=False, loss_scale_power=8)
        elif k == "lora":
            yield sc.with_(lora=False, modules_to_save=False)
        else:
            yield sc.with_(**{k: v})
    if sc.fp32_grad_accum:
        yield sc.with_(fp32_grad_accum=False)
    if sc.engines_before:
        yield sc.with_(engines_before=())
    for k in ("max_reuse_distance", "max_live_parameters", "width"):
        if getattr(sc, k) != getattr(d, k):
            yield sc.with_(**{k: getattr(d, k)})
    if any(not b.in_optimizer for b in sc.blocks):
        yield sc.with_(blocks=tuple(replace(b, in_optimizer=True) for b in sc.blocks))
    for i, st in enumerate(sc.steps):
        plain = replace(st, reregister=False, frozen=(), save_load=False,
                        micro=tuple(replace(m, retain=False, skip=()) for m in st.micro))
        if plain != st and not st.idle:
            yield sc.with_(steps=sc.steps[:i] + (plain,) + sc.steps[i + 1:])


LANE = 100
"""Generated examples per lane: the generated sequence is cut into lanes of this many distinct scenarios,
each run in order in a worker started fresh for it, whatever ``jobs`` is -- so every example runs after
the same examples, and an example whose outcome depends on what ran before it in the worker (state
carried over, issue 15) has the same outcome with one job or eight.  Each lane costs a worker start (a
few seconds; a rank pool's at world size 2), so lanes are long: the default 200 examples are two."""


class _Abort(BaseException):
    """Ends the drawing thread of `generated` (a BaseException: Hypothesis re-raises it at once)."""


def _import_what_hypothesis_peeks_at() -> None:
    """Import numpy (when installed) before drawing starts in a thread of its own.  While it draws, Hypothesis
    looks numpy up in ``sys.modules`` (``sampled_from`` checks for ``numpy.ndarray``); if the main thread is
    importing numpy at that moment (the report's first PNG imports matplotlib, which imports numpy; a target
    may import torch), the drawing thread finds it half-initialised, fails with "partially initialized module
    'numpy' has no attribute 'ndarray'", and the run ends with that error (seen under load in the Ctrl-C CI
    test).  Imported once here, it is whole before the drawing thread starts."""
    import importlib.util
    if "numpy" not in sys.modules and importlib.util.find_spec("numpy") is not None:
        import numpy  # noqa: F401


def generated(strategy: Any, examples: int, seed: int | None) -> Iterator[Scenario]:
    """The first ``examples`` scenarios of the deterministic generation sequence of ``seed`` (duplicates
    included, in order): what every search of `explore` replays.  Drawing runs no target: a test that never
    fails makes Hypothesis generate exactly the sequence a failing search generates up to its failure.
    Drawn in a thread, a little ahead of the consumer (so ``examples`` may be huge); closing the iterator
    ends the drawing."""
    _import_what_hypothesis_peeks_at()
    q: queue.Queue = queue.Queue(maxsize=2 * LANE)
    halt = threading.Event()
    done = object()

    def put(item: Any) -> None:
        while not halt.is_set():
            try:
                q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise _Abort()

    @settings(max_examples=examples, database=None, deadline=None, derandomize=False, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
    @given(strategy)
    def draw(sc: Scenario) -> None:
        put(sc)

    def produce() -> None:
        try:
            hseed(DEFAULT_SEED if seed is None else seed)(draw)()
            put(done)
        except _Abort:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            try:
                put(exc)
            except _Abort:
                pass

    th = threading.Thread(target=produce, daemon=True, name="explore-draw")
    th.start()
    try:
        while True:
            try:
                item = q.get(timeout=0.5)
            except queue.Empty:
                if not th.is_alive():
                    return
                continue
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        halt.set()
        th.join(timeout=10)


def _lanes(workers: list, lanes: Iterator[list[Scenario]], stop_flag: threading.Event, fresh_first: list[bool]):
    """Run ``lanes`` on ``workers``: each lane in order, in a worker started fresh for it; yields
    ``(worker index, scenario, outcome or exception, the worker's restart count after it)`` in the order
    the runs end, and ``(worker index, None, "fresh", count)`` when a worker starts a lane.  One worker: inline, in
    the caller's thread (Ctrl-C lands between runs as before); several: one thread per worker."""
    def fresh(wid: int) -> None:
        if fresh_first[wid]:
            f = getattr(workers[wid], "fresh", None)
            if f is not None:
                f()
        fresh_first[wid] = True

    def count(wid: int) -> int:
        return int(getattr(workers[wid], "restarts", 0) or 0)

    if len(workers) == 1:
        for lane in lanes:
            if stop_flag.is_set():
                return
            fresh(0)
            yield 0, None, "fresh", count(0)
            for sc in lane:
                if stop_flag.is_set():
                    return
                try:
                    out: Any = workers[0].run(sc)
                except Exception as exc:
                    out = exc
                yield 0, sc, out, count(0)
        return
    take = threading.Lock()
    results: queue.Queue = queue.Queue()

    def work(wid: int) -> None:
        try:
            while not stop_flag.is_set():
                with take:  # lanes are handed out in order
                    lane = next(lanes, None)
                if lane is None:
                    return
                try:
                    fresh(wid)
                except Exception as exc:
                    results.put((wid, None, exc, 0))
                    return
                results.put((wid, None, "fresh", count(wid)))
                for sc in lane:
                    if stop_flag.is_set():
                        return
                    try:
                        out = workers[wid].run(sc)
                    except Exception as exc:
                        results.put((wid, sc, exc, 0))
                        return
                    results.put((wid, sc, out, count(wid)))
        finally:
            results.put((wid, None, None, 0))  # this worker is done

    threads = [threading.Thread(target=work, args=(w,), daemon=True, name=f"explore-job-{w}")
               for w in range(len(workers))]
    for t in threads:
        t.start()
    live = len(threads)
    try:
        while live:
            try:
                item = results.get(timeout=0.5)
            except queue.Empty:
                continue
            if item[2] is None:
                live -= 1
                continue
            yield item
    finally:
        stop_flag.set()
        for t in threads:
            t.join()


def explore(target: Target, *, examples: int, seed: int | None = None,
            on_finding: Callable[[Finding], None] | None = None,
            on_progress: Callable[[int, int, float], None] | None = None,
            strategy: Any = None, stop: Callable[[list[Finding]], bool] | None = None,
            polish: bool = True, confirm: bool = True,
            on_restart: Callable[[dict], None] | None = None,
            on_update: Callable[[Finding], None] | None = None,
            jobs: int = 1, spawn: Callable[[], Target] | None = None, lane: int = LANE,
            first: Callable[[Finding], bool] | None = None) -> ExploreResult:
    from zerostate.explorer import confirm as confirming
    from zerostate.explorer.strategies import scenarios
    strat = strategy if strategy is not None else scenarios()
    do_polish = polish
    t0 = time.perf_counter()
    memo: dict[str, Outcome] = {}
    handed: dict[str, Finding] = {}      # key -> the finding as handed over (unshrunk, then final)
    done: set[str] = set()               # keys whose last scenario is known (shrunk, or as seen)
    final: set[str] = set()              # ... and confirmed: final
    seen: dict[str, Finding] = {}        # key -> smallest finding seen
    first_seen: dict[str, int] = {}
    generated_at: dict[str, int] = {}
    seconds_to: dict[str, float] = {}
    seconds_final: dict[str, float] = {}
    cap = hard_cap(examples)
    restarts: list[dict] = []
    do_confirm = [confirm]
    queue_keys: list[str] = []           # keys to shrink, in order

    workers: list[Any] = [target]
    extra: list[Any] = []
    if jobs > 1 and spawn is not None:
        made: list[Any] = [None] * (jobs - 1)
        errors: list[BaseException] = []

        def make(i: int) -> None:
            try:
                made[i] = spawn()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        ths = [threading.Thread(target=make, args=(i,), daemon=True) for i in range(jobs - 1)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        extra = [m for m in made if m is not None]
        if errors:
            for m in extra:
                _close(m)
            raise errors[0]
        workers += extra

    def close_extra() -> None:
        while len(workers) > 1:
            _close(workers.pop())

    logs: list[list[Scenario]] = [[] for _ in workers]   # per worker: every scenario it ran, in order
    starts = [0] * len(workers)                          # per worker: index in its log of its last fresh start
    ran_at: dict[str, tuple[int, int, int]] = {}         # memo key -> (worker, its start, its index)

    def restarts_of(w: Any) -> int:
        return int(getattr(w, "restarts", 0) or 0)

    def record(wid: int, sc: Scenario, out: Outcome, restarted: bool) -> None:
        """A distinct run's outcome: memoised, logged in its worker's history, its new keys handed over at once."""
        key = sc.to_json(None)
        memo[key] = out
        logs[wid].append(sc)
        ran_at[key] = (wid, starts[wid], len(logs[wid]) - 1)
        if restarted:  # the next example in this worker starts in a fresh one
            starts[wid] = len(logs[wid])
            why = out.details.get("pool_restarted") or next(
                (f"{f.check}: {f.error.strip().splitlines()[0][:160]}" for f in out.findings
                 if f.check in ("hang", "crash")), "the worker was restarted")
            restarts.append({"example": len(memo), "why": why})
            if on_restart is not None:
                on_restart(restarts[-1])
        for f in out.findings:
            first_seen.setdefault(f.key, len(memo))
            if f.key not in seen or f.size < seen[f.key].size:
                seen[f.key] = f
            if f.key not in handed:  # new: hand it over now, unshrunk; shrinking and confirming follow
                f = replace(f, shrunk=False, confirmation=confirming.Confirmation("not-checked"))
                handed[f.key] = f
                queue_keys.append(f.key)
                seconds_to[f.key] = time.perf_counter() - t0
                if on_finding is not None:
                    on_finding(f)
        if on_progress is not None:
            on_progress(len(memo), len(handed), time.perf_counter() - t0)

    def run(sc: Scenario) -> Outcome:
        """One scenario on worker 0 (shrinking, polishing), memoised."""
        key = sc.to_json(None)
        out = memo.get(key)
        if out is None:
            if len(memo) >= cap:
                raise _BudgetSpent()
            before = restarts_of(workers[0])
            try:
                out = workers[0].run(sc)
            except Exception as exc:  # the target broke (e.g. its worker cannot restart): stop, loudly
                raise _TargetBroken(exc) from exc
            record(0, sc, out, restarts_of(workers[0]) != before)
        return out

    def polished(f: Finding) -> Finding:
        """Greedy, deterministic simplification after Hypothesis: Hypothesis minimises its choice sequence,
        which need not be the simplest scenario (a ZeRO-3 scenario draws more choices than a ZeRO-1 one);
        keep any one-step simplification that keeps the finding's key."""
        from zerostate.model.network import Network
        best, changed = f, True
        while changed:
            changed = False
            for cand in _candidates(best.scenario):
                try:
                    cand.validate()
                    if not Network(cand).loss_requires_grad or _rank(cand) >= _rank(best.scenario):
                        continue
                except Exception:
                    continue
                hit = next((g for g in run(cand).findings if g.key == f.key), None)
                if hit is not None:
                    best, changed = hit, True
                    break
        return best

    # ---- confirmation (issue 15): with several jobs, the other workers replay each shrunk finding in a
    # fresh worker while worker 0 shrinks the next; with one job, worker 0 confirms them after shrinking
    # (so the shrinking runs after the same examples whatever jobs is)
    conf_jobs: queue.Queue = queue.Queue()
    conf_done: queue.Queue = queue.Queue()
    helpers: list[threading.Thread] = []
    pending: list[tuple[Finding, list[Scenario]]] = []
    outstanding = [0]

    def history_of(f: Finding) -> list[Scenario]:
        wid, start, idx = ran_at.get(f.scenario.to_json(None), (0, 0, 0))
        return list(logs[wid][start:idx])

    def helper(w: Any) -> None:
        while True:
            item = conf_jobs.get()
            if item is None:
                return
            f, hist = item
            try:
                c: Any = confirming.confirm(w, f.key, f.scenario, hist)
            except BaseException as exc:  # noqa: BLE001 - the worker broke: re-raised in the main thread
                c = exc
            conf_done.put((f, c))

    def land(f: Finding) -> None:
        handed[f.key] = f
        final.add(f.key)
        seconds_final[f.key] = time.perf_counter() - t0
        if on_update is not None:
            on_update(f)

    def submit(f: Finding) -> None:
        """``f`` is its key's last scenario: confirm it (now, on a helper, or after shrinking), then land it."""
        if not do_confirm[0]:
            land(replace(f, confirmation=confirming.Confirmation("not-checked")))
            return
        outstanding[0] += 1
        if helpers:
            conf_jobs.put((f, history_of(f)))
        else:
            pending.append((f, history_of(f)))

    def drain(block: bool) -> None:
        """Land the confirmations that are done (``block``: all of them)."""
        while outstanding[0]:
            if helpers:
                try:
                    f, c = conf_done.get(timeout=0.5) if block else conf_done.get_nowait()
                except queue.Empty:
                    if block:
                        continue
                    return
                if isinstance(c, BaseException):
                    raise _TargetBroken(c) from c
            elif block:
                f, hist = pending.pop(0)
                before = restarts_of(workers[0])
                try:
                    c = confirming.confirm(workers[0], f.key, f.scenario, hist)
                except Exception as exc:
                    raise _TargetBroken(exc) from exc
                logs[0].extend(c.last_run)  # worker 0 now holds the last try's runs, from a fresh start
                starts[0] = len(logs[0]) - len(c.last_run)
                if restarts_of(workers[0]) != before:
                    starts[0] = len(logs[0])
            else:
                return
            outstanding[0] -= 1
            land(replace(f, confirmation=c))

    def shrunk(f: Finding, shrink: bool) -> None:
        """Its key's last scenario: polished (when ``shrink``), handed over as an update (confirmation
        pending: ``confirmation`` None), then confirmed."""
        if shrink and do_polish:
            try:
                f = polished(f)
            except _BudgetSpent:
                pass
        f = replace(f, shrunk=shrink, confirmation=None)
        handed[f.key] = f
        done.add(f.key)
        if on_update is not None:
            on_update(f)
        submit(f)

    def search(want: str) -> Scenario | None:
        """One Hypothesis search replaying the generation sequence (memoised: free) up to the first
        example with ``want``, then shrinking it on worker 0."""
        final_sc: list[Scenario] = []

        @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
                  phases=[Phase.generate, Phase.shrink], report_multiple_bugs=False, print_blob=False,
                  suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
        @given(strat)
        def probe(sc: Scenario) -> None:
            out = run(sc)
            if current_build_context().is_final:
                final_sc.append(sc)
            if any(f.key == want for f in out.findings):
                raise _NewCheck(sc)

        probe = hseed(DEFAULT_SEED if seed is None else seed)(probe)
        try:
            probe()
        except _NewCheck:
            return final_sc[-1] if final_sc else None
        return None

    stopped = False
    stop_flag = threading.Event()
    try:
        try:
            # ---- 1. generate: the deterministic sequence, run in lanes on the workers, new keys handed over
            position: dict[str, int] = {}  # scenario -> its first position in the generated sequence
            stream = generated(strat, examples, seed)

            def lanes_of() -> Iterator[list[Scenario]]:
                batch: list[Scenario] = []
                for i, sc in enumerate(stream, 1):
                    k = sc.to_json(None)
                    if k in position:
                        continue
                    position[k] = i
                    batch.append(sc)
                    if len(batch) == lane:
                        yield batch
                        batch = []
                if batch:
                    yield batch

            lanes = lanes_of()
            fresh_first = [bool(getattr(w, "examples", 0)) for w in workers]
            before = [restarts_of(w) for w in workers]
            gen = _lanes(workers, lanes, stop_flag, fresh_first)
            try:
                for wid, sc, out, now in gen:
                    if isinstance(out, BaseException):
                        raise _TargetBroken(out) from out
                    if sc is None:  # the worker started fresh for a lane
                        starts[wid] = len(logs[wid])
                        before[wid] = now
                        continue
                    record(wid, sc, out, now != before[wid])
                    before[wid] = now
                    for f in out.findings:
                        generated_at[f.key] = min(generated_at.get(f.key, position[sc.to_json(None)]),
                                                  position[sc.to_json(None)])
                    if stop is not None and stop(list(handed.values())):
                        stopped = True
                        break
            finally:
                stop_flag.set()
                gen.close()
                stream.close()
            # shrinking runs on worker 0 alone, started fresh: the same whatever jobs is; the others confirm
            for w in workers[1:]:
                helpers.append(threading.Thread(target=helper, args=(w,), daemon=True, name="explore-confirm"))
                helpers[-1].start()
            if logs[0][starts[0]:] and getattr(workers[0], "fresh", None) is not None:
                workers[0].fresh()
                starts[0] = len(logs[0])
            # ---- 2. shrink: each key, in the order of its first generated example, then the ones seen later
            order = lambda k: (generated_at.get(k, examples + 1), first_seen.get(k, 0))  # noqa: E731
            if stopped and stop is not None:  # the caller wants these: shrink them first
                wanted = [k for k in queue_keys if stop([handed[k]])]
                queue_keys.sort(key=lambda k: (k not in wanted, order(k)))
            else:
                queue_keys.sort(key=order)
            stopped = False
            while True:
                todo = [k for k in queue_keys if k not in done]
                if not todo:
                    break
                # ``first``: keys whose finding it holds for are shrunk before the others (explore: the ones no
                # known issue explains, so the hard cap falls on documented bugs, not on a new one)
                key = min(todo, key=lambda k: not first(handed[k])) if first is not None else todo[0]
                try:
                    sc2 = search(key)
                except _BudgetSpent:
                    break
                f2 = next((f for f in memo[sc2.to_json(None)].findings if f.key == key), None) if sc2 else None
                shrunk(f2 if f2 is not None else seen[key], shrink=True)
                drain(block=False)
                if stop is not None and stop([handed[k] for k in done]):
                    stopped = True  # the caller has what it wanted: the rest stay as handed over, unconfirmed
                    break
            if not stopped:  # budget spent: the rest as seen (the smallest scenario), confirmed
                for key in [k for k in queue_keys if k not in done]:
                    shrunk(seen[key], shrink=False)
            drain(block=True)
        except KeyboardInterrupt as exc:
            # Ctrl-C: what was seen is handed over already (unshrunk); a StopExploring (a time budget) confirms it
            do_confirm[0] = do_confirm[0] and isinstance(exc, StopExploring)
            if do_confirm[0]:
                for key in [k for k in handed if k not in done]:
                    shrunk(seen[key], shrink=False)
                drain(block=True)
            raise
        except _TargetBroken as wrapped:
            raise wrapped.args[0] from None
    finally:
        for _ in helpers:
            conf_jobs.put(None)
        close_extra()  # a helper in the middle of a replay fails at once: its worker is gone
        for th in helpers:
            th.join(timeout=30)
    findings = [handed[k] for k in handed]
    return ExploreResult(findings, len(memo), time.perf_counter() - t0, first_seen, generated_at, seconds_to,
                         restarts, seconds_final)


def _close(t: Any) -> None:
    closer = getattr(t, "close", None)
    if closer is not None:
        try:
            closer()
        except Exception:
            pass


__all__ = ["ExploreResult", "LANE", "StopExploring", "explore", "generated", "reliability"]
