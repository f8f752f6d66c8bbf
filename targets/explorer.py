"""Explore a target with Hypothesis: find distinct findings, shrink each, hand them over as they are final.

::

    from zerostate.targets.base import get_target
    from zerostate.targets.explorer import explore
    res = explore(get_target("deepspeed", deepspeed="0.18.4"), examples=200, seed=None,
                  on_finding=print, on_progress=lambda n, k, s: None)
    res.findings, res.examples, res.seconds, res.first_seen

How: a sequence of Hypothesis searches over `targets.strategies.scenarios()` (or
``strategy``).  Each search fails on the first scenario whose outcome has a
finding key (`Finding.key`: the check id, plus where DeepSpeed raised for an
``exception``) not found yet; Hypothesis shrinks that failure (the predicate "has a
check not found yet" is fixed during the search, so shrinking is sound), the
shrunk scenario's new findings go to ``on_finding`` at once, and the next search
starts with those ids known.  Outcomes are memoised by scenario, so a search
replaying the examples of the previous one costs nothing; ``examples`` bounds
each search's generated examples, i.e. the explored prefix of one deterministic
sequence.  The run ends when a search exhausts ``examples`` with nothing new, or
when the distinct target runs (shrinking included) reach ``hard_cap(examples)``
= 5 x examples + 100.

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

A key seen in an example whose search was about another key (several findings
at once, or a shrink candidate) gets a search of its own right after (failing
only on that key), so it is shrunk for itself and handed over early; a key such
a search cannot generate within ``examples`` is handed over at the end with the
smallest scenario it was seen in.
Confirmation (``confirm=True``, issue 15): before a finding is handed over it is replayed in a
fresh worker (`targets.confirm`): alone, then, when it does not reproduce alone, after the examples
that ran before it in the same worker, cut to the shortest run that still makes it appear.  The
finding carries ``confirmation`` (a `confirm.Confirmation`: ``confirmed``, ``order-dependent`` with
its ``sequence``, ``intermittent`` with its rate, ``not-reproduced``, or ``not-checked`` after Ctrl-C).  The explorer keeps, for
every distinct run, the examples run before it since the worker's last (re)start, and counts the
restarts with their reason (``ExploreResult.restarts``: hang, crash, ranks out of step).

On Ctrl-C the findings seen but not yet handed over are handed over (smallest
scenario so far, not confirmed), then KeyboardInterrupt propagates; `StopExploring` (a
KeyboardInterrupt an ``on_progress`` raises to end the run, e.g. a time budget) hands them over
confirmed.  ``on_restart(record)`` is called for each worker restart as it happens.  ``stop(findings_so_far)``,
when given, ends the run early once it returns True (tests looking for one bug).

``on_progress(examples_run, findings_so_far, elapsed_seconds)`` is called after
every distinct target run.  `ExploreResult` has ``findings``, ``examples``
(distinct target runs, shrinking included), ``seconds``, ``first_seen`` (finding
key -> the number of distinct runs until it first appeared), ``generated_at``
(finding key -> the position, in the deterministic generation sequence, of the
first generated example that has it: "found within N examples"; a key seen only
while shrinking has none) and ``seconds_to`` (finding key -> seconds until handed over).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hseed
from hypothesis.control import current_build_context

from zerostate.model.scenario import Scenario

from .base import Finding, Outcome, Target
from .confirm import StopExploring


@dataclass
class ExploreResult:
    findings: list[Finding]
    examples: int
    seconds: float
    first_seen: dict[str, int] = field(default_factory=dict)
    generated_at: dict[str, int] = field(default_factory=dict)
    """Finding key -> position, in the deterministic generation sequence, of the first example with it."""
    seconds_to: dict[str, float] = field(default_factory=dict)
    """Finding key -> seconds from the start until it was handed over (shrunk)."""
    restarts: list[dict] = field(default_factory=list)
    """Worker restarts during exploring: ``{"example": n, "why": text}`` (n: the distinct run after which)."""

    @property
    def reliability(self) -> dict:
        return reliability(self.findings, self.restarts)


def reliability(findings: list[Finding], restarts: list[dict]) -> dict:
    """The report's reliability figure: findings confirmed by replay / reported, order-dependent ones,
    not reproduced, and the worker restarts with their reasons."""
    st = [getattr(getattr(f, "confirmation", None), "status", "not-checked") for f in findings]
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
    blocks and steps, ZeRO-3, then plain trainable blocks, engine.backward, no extras, default knobs."""
    d = Scenario()
    extras = sum((b.checkpoint.value != "none") + (b.norm.value != "trainable") + (b.lin.value != "trainable")
                 + b.leaf for b in sc.blocks)
    extras += sum(m.backward.value != "engine" for _, _, m in sc.micro_steps())
    extras += sum(st.eval_before for st in sc.steps) + sc.fused_head + (not sc.input_requires_grad)
    extras += sum(getattr(sc, k) != getattr(d, k) for k in ("persistence_threshold", "prefetch_bucket_size",
                                                           "reduce_bucket_size"))
    return (len(sc.blocks), len(sc.steps), sc.gas, _STAGE_RANK.get(sc.stage, 3), extras)


def _candidates(sc: Scenario):
    """One-step simplifications of a scenario, most valuable first."""
    from dataclasses import replace

    from zerostate.model.scenario import BackwardKind, Block, Checkpoint, MicroStep, ParamKind, TrainStep
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


def explore(target: Target, *, examples: int, seed: int | None = None,
            on_finding: Callable[[Finding], None] | None = None,
            on_progress: Callable[[int, int, float], None] | None = None,
            strategy: Any = None, stop: Callable[[list[Finding]], bool] | None = None,
            polish: bool = True, confirm: bool = True,
            on_restart: Callable[[dict], None] | None = None) -> ExploreResult:
    from . import confirm as confirming
    from .strategies import scenarios
    strat = strategy if strategy is not None else scenarios()
    do_polish = polish
    t0 = time.perf_counter()
    memo: dict[str, Outcome] = {}
    reported: dict[str, Finding] = {}
    seen: dict[str, Finding] = {}       # check -> smallest finding seen (for leftovers)
    first_seen: dict[str, int] = {}
    generated_at: dict[str, int] = {}

    seconds_to: dict[str, float] = {}
    cap = hard_cap(examples)
    runlog: list[Scenario] = []          # every scenario the worker ran, in order
    epoch = [0]                          # index in runlog of the worker's last (re)start
    ran_at: dict[str, tuple[int, int]] = {}  # memo key -> (its worker's start, its own index) in runlog
    restarts: list[dict] = []
    do_confirm = [confirm]

    def polish(f: Finding) -> Finding:
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

    def restarts_of() -> int:
        return int(getattr(target, "restarts", 0) or 0)

    def confirmed(f: Finding) -> Finding:
        if not do_confirm[0]:
            f.confirmation = confirming.Confirmation("not-checked")
            return f
        start, idx = ran_at.get(f.scenario.to_json(None), (0, 0))
        before = restarts_of()
        c = confirming.confirm(target, f.key, f.scenario, runlog[start:idx])
        runlog.extend(c.last_run)  # the worker now holds the last try's runs, from a fresh start
        epoch[0] = len(runlog) - len(c.last_run)
        if restarts_of() != before:
            epoch[0] = len(runlog)
        f.confirmation = c
        return f

    def emit(f: Finding) -> None:
        if do_polish:
            try:
                f = polish(f)
            except _BudgetSpent:
                pass
        f = confirmed(f)
        reported[f.key] = f
        seconds_to[f.key] = time.perf_counter() - t0
        if on_finding is not None:
            on_finding(f)

    def run(sc: Scenario) -> Outcome:
        key = sc.to_json(None)
        out = memo.get(key)
        if out is None:
            if len(memo) >= cap:
                raise _BudgetSpent()
            before = restarts_of()
            try:
                out = target.run(sc)
            except Exception as exc:  # the target broke (e.g. its worker cannot restart): stop, loudly
                raise _TargetBroken(exc) from exc
            memo[key] = out
            runlog.append(sc)
            ran_at[key] = (epoch[0], len(runlog) - 1)
            if restarts_of() != before:  # the next example starts in a fresh worker
                epoch[0] = len(runlog)
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
            if on_progress is not None:
                on_progress(len(memo), len(reported), time.perf_counter() - t0)
        return out

    def search(want: str | None = None) -> Scenario | None:
        """One Hypothesis search: fails on a finding key not reported yet (or on ``want`` only)."""
        final: list[Scenario] = []
        known = frozenset(reported)
        calls = {"n": 0, "failed": False}

        def interesting(out: Outcome) -> bool:
            if want is not None:
                return any(f.key == want for f in out.findings)
            return any(f.key not in known for f in out.findings)

        @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
                  phases=[Phase.generate, Phase.shrink], report_multiple_bugs=False, print_blob=False,
                  suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
        @given(strat)
        def probe(sc: Scenario) -> None:
            out = run(sc)
            if not calls["failed"]:
                calls["n"] += 1
                for f in out.findings:  # every search replays the same prefix: keep the first position
                    generated_at[f.key] = min(generated_at.get(f.key, calls["n"]), calls["n"])
            if current_build_context().is_final:
                final.append(sc)
            if interesting(out):
                calls["failed"] = True
                raise _NewCheck(sc)

        probe = hseed(DEFAULT_SEED if seed is None else seed)(probe)
        try:
            probe()
        except _NewCheck:
            return final[-1] if final else None
        return None

    unfindable: set[str] = set()
    budget_spent = stopped = False
    try:
        while True:
            try:
                sc = search()
            except _BudgetSpent:
                break
            if sc is None:
                break
            new = [f for f in memo[sc.to_json(None)].findings if f.key not in reported]
            if not new:
                break
            for f in new:
                emit(f)
            if stop is not None and stop(list(reported.values())):
                stopped = True
                break
            # keys seen in other examples (several findings at once, or a shrink candidate): a search of
            # their own, so each is shrunk for itself; one never generated within the budget waits
            for key in sorted(set(seen) - set(reported) - unfindable):
                try:
                    sc2 = search(want=key)
                except _BudgetSpent:
                    sc2, budget_spent = None, True
                    break
                f2 = next((f for f in memo[sc2.to_json(None)].findings if f.key == key), None) if sc2 else None
                if f2 is None:
                    unfindable.add(key)
                else:
                    emit(f2)
                    if stop is not None and stop(list(reported.values())):
                        stopped = True
                        break
            if budget_spent or stopped:
                break
        if stopped:
            do_polish = False  # the caller has what it wanted: hand the rest over as seen
        for check in sorted(set(seen) - set(reported)):  # never generated by a search of their own
            emit(seen[check])
    except KeyboardInterrupt as exc:
        do_polish = False  # hand over what was seen, as it is: no more target runs (but StopExploring confirms)
        do_confirm[0] = do_confirm[0] and isinstance(exc, StopExploring)
        for check in sorted(set(seen) - set(reported)):
            emit(seen[check])
        raise
    except _TargetBroken as wrapped:
        do_polish = False
        do_confirm[0] = False
        for check in sorted(set(seen) - set(reported)):
            emit(seen[check])
        raise wrapped.args[0] from None
    return ExploreResult(list(reported.values()), len(memo), time.perf_counter() - t0, first_seen,
                         generated_at, seconds_to, restarts)


__all__ = ["ExploreResult", "StopExploring", "explore", "reliability"]
