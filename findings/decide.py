"""The one decision of which checks a run fails: `decide`, and the findings built from it (`findings_of`).

Every target, the repro scripts and the watch judge with this module.  `DeepSpeedTarget.run` (and its
rank-pool form) passes the executor's result here and builds its findings from what comes back; a repro
script (`harness.repro`) embeds this file, the executor, the tracer, the specs and the agreement
projection verbatim and calls `failed_checks` (a view of `decide`) on its own run, so it judges a
finding's check with the code explore judged it with; ``zerostate watch`` calls `decide_trace` on a user's
job, where there is no scenario and no oracle.

What fails:

* the exception's check (``exception``, ``saved-tensor-intact`` for torch's ``CheckpointError``,
  ``oracle-error``) when the run raised, with its origin (``ExcType@module.function``);
* ``oracle`` when the parameters after a train step differ from plain PyTorch;
* ``carried-state`` when an engine ran with process state an engine before it left;
* ``persistence`` when a ZeRO-3 engine marked other parameters persistent than its threshold says
  (`harness.net.persistence`);
* ``checkpoint`` when a checkpoint round trip (``save_load``) disagrees, with its code;
* every spec of `zerostate.specs` the trace violates (coordinator specs on ZeRO-3 runs only; after an
  exception, only violations at an event: a truncated trace cannot fulfil end-of-run obligations),
  with the violation's code; torch's ``CheckpointError`` and the ``saved-tensor-intact`` spec describe one
  event, so the spec's decision keeps it, with the exception's text appended;
* ``model-agreement`` when the model design's trace of the same scenario is given, the run finished, and
  the projections differ (`agreement.compare`);
* the cross-rank checks a rank pool computed (``ranks-*``, another rank's ``oracle``), each unless the run
  already fails that check.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from zerostate.model.events import Event
from zerostate.model.scenario import Scenario
from zerostate.specs import Spec, check_all, specs_for_stage

from zerostate.findings.agreement import compare
from zerostate.findings.checkpoint_judgement import resume_problem, round_trip_problem
from zerostate.findings.evidence import NO_EVIDENCE, Evidence, raised_of
from zerostate.findings.oracle_judgement import Explanation, explaining, mismatch_before, verdict
from zerostate.findings.origin import error_text, exception_check, origin_of
from zerostate.findings.record import ExceptionRecord, Persistent, RunRecord
from zerostate.findings.tolerance import tolerance


class Failed(NamedTuple):
    """A failed check as a repro script prints it: its message and its detail (origin or code)."""

    message: str
    detail: str = ""
    """The exception's origin (``exception``) or the violation's code; "" otherwise."""


@dataclass(frozen=True)
class Decision:
    """One check a run fails."""

    check: str
    message: str
    origin: str = ""
    """For the checks of a raised exception: ``ExcType@module.function`` (``exception``) or ``ExcType``."""
    code: str = ""
    """The violation's code (specs, cross-rank checks, ``checkpoint``, ``carried-state``)."""
    index: int | None = None
    """The violating event's index in the trace (spec violations at an event)."""
    across_ranks: bool = False
    """Found by comparing the ranks of a rank pool (not by rank 0's run alone)."""
    evidence: Evidence = NO_EVIDENCE
    """What the run shows of it: the exception the run raised, the oracle's disagreement."""

    @property
    def detail(self) -> str:
        return self.origin or self.code


@dataclass(frozen=True)
class ModelRun:
    """The model design's run of the same scenario: its trace, or why it could not run it."""

    design: str
    events: tuple[Event, ...] = ()
    error: str | None = None


def decide(record: RunRecord, scenario: Scenario, model: ModelRun | None = None,
           cross_rank: Mapping[str, tuple[str, str]] | None = None, specs: Sequence[Spec] | None = None,
           other_ranks: Sequence[RunRecord] = ()) -> tuple[Decision, ...]:
    """Every check the run of ``scenario`` that ``record`` holds fails, in report order.  ``model``: compare with
    the model design (None: not compared); ``cross_rank``: check id -> (text, code) from
    `harness.cross_rank_checks.cross_rank_problems` at world size > 1, and ``other_ranks`` the other ranks'
    records (the evidence of another rank's oracle disagreement); ``specs``: the specs judged (default: those of
    the scenario's ZeRO stage, `specs_for_stage`)."""
    return _judge(record, scenario.stage, scenario, model, cross_rank, specs, other_ranks, origin_of(record.raised))


def _judge(record: RunRecord, stage: int, sc: Scenario | None, model: ModelRun | None,
           cross_rank: Mapping[str, tuple[str, str]] | None, specs: Sequence[Spec] | None,
           other_ranks: Sequence[RunRecord], origin: str) -> tuple[Decision, ...]:
    if record.skipped:
        return ()
    events = list(record.events)
    raised = record.raised
    differ = _params_listed((cross_rank or {}).get("ranks-params", ("", ""))[0])
    oracle = verdict(record, sc) if sc is not None else None
    ls = record.loss_scaling
    shown = Evidence(raised_of(raised), oracle.diff if oracle else None,
                     tuple(ls.pt_scales or ()) if ls else (), ls.ds_scale if ls else None, ranks_differ=differ)
    ran = Evidence(raised=shown.raised, ranks_differ=differ)  # what every check of the run can point to
    out: list[Decision] = []
    first: Decision | None = None
    if raised is not None:
        check = exception_check(raised)
        first = Decision(check, error_text(raised) + "\n" + raised.traceback,
                         origin=origin if check == "exception" else origin.split("@")[0], evidence=ran)
        out.append(first)
    if oracle is not None:
        out += _oracle_decisions(oracle.message, explaining(record, sc) if sc is not None else None, shown)
    carried = _carried_state(record.torch_linear, stage)
    if carried:
        out.append(Decision("carried-state", carried, code="torch-linear-replaced", evidence=ran))
    persistence = _persistence_problem(record.persistence, sc.persistence_threshold) if sc is not None else None
    if persistence:
        out.append(Decision("persistence", persistence, code="threshold-not-honoured", evidence=ran))
    if sc is not None:
        for rt in record.checkpoints:
            problem = round_trip_problem(rt, tolerance(sc), against_oracle=not mismatch_before(record, sc, rt.step))
            if problem:
                out.append(Decision("checkpoint", problem[1], code=problem[0], evidence=ran))
                break
        out += [Decision("checkpoint", problem[1], code=problem[0], evidence=ran)
                for problem in map(resume_problem, record.resumes) if problem][:1]
    out += [Decision("teardown", text, code="destroy-raised", evidence=ran) for text in _destroy_errors(record)]
    for d in _spec_decisions(events, specs_for_stage(stage) if specs is None else specs, truncated=raised is not None):
        decision = d
        if first is not None and d.check == first.check:  # CheckpointError: the spec points at the event
            out.remove(first)
            decision = Decision(d.check, d.message + "\n(torch raised) " + first.message, code=d.code,
                                index=d.index)
        out.append(replace(decision, evidence=ran))
    if model is not None and raised is None:
        msg = model.error or compare(list(model.events), events, model.design)
        if msg:
            out.append(Decision("model-agreement", msg, evidence=ran))
    failing = {d.check for d in out}
    for check, (text, code) in (cross_rank or {}).items():
        if check not in failing:
            off = next((v for v in (verdict(r, sc) for r in other_ranks) if v), None) \
                if check == "oracle" and sc is not None else None
            seen = Evidence(ran.raised, off.diff if off else None, ranks_differ=differ)
            out.append(Decision(check, text, code=code, across_ranks=True, evidence=seen))
    return tuple(out)


def decide_trace(events: Sequence[Event], stage: int, error: str | None = None, origin: str = "",
                 specs: Sequence[Spec] | None = None) -> tuple[Decision, ...]:
    """The checks a trace alone fails, for a run with no scenario and no oracle (``zerostate watch``: a
    user's job; the model target's run of a design): the exception it raised (``error``: ``"ExcType:
    message"``, ``origin``) and the specs (``specs``: as `decide`)."""
    record = RunRecord(events=tuple(events), raised=ExceptionRecord(error, "") if error else None)
    return _judge(record, stage, None, None, None, specs, (), origin)


def _oracle_decisions(message: str, ex: Explanation | None, shown: Evidence) -> list[Decision]:
    """The oracle's decisions: one, labelled by the known mechanisms whose reference explains every difference;
    or, when one explains only the first steps, that one and a second for what is left beyond it (a new bug
    after a known one is its own finding)."""
    if ex is None:
        return [Decision("oracle", message, evidence=shown)]
    out = [Decision("oracle", message, evidence=replace(shown, explained_by=ex.mechanisms))]
    if ex.remaining:
        rest = ex.remaining[0]
        out.append(Decision("oracle", f"beyond {' + '.join(ex.mechanisms)} (known mechanisms): {rest.message}",
                            evidence=Evidence(shown.raised, rest.diff, shown.loss_scales, shown.loss_scale,
                                              shown.ranks_differ)))
    return out


def _destroy_errors(record: RunRecord) -> list[str]:
    """What ``engine.destroy()`` raised, as sentences: at a resume (the old engine) and at the end of a run that did
    not raise (a run that raised leaves a broken engine, whose teardown proves nothing)."""
    out = [f"engine.destroy() raised at the resume before train step {r.step}: {r.destroy_error}"
           for r in record.resumes if r.destroy_error]
    if record.teardown_error and record.raised is None:
        out.append(f"engine.destroy() raised at the end of the run: {record.teardown_error}")
    return out[:1]


def _carried_state(torch_linear: str, stage: int) -> str | None:
    """Process-wide state an earlier engine left that this (not ZeRO-3) engine ran with, as a sentence: a ZeRO-3
    engine replaces ``torch.nn.functional.linear`` by ``zero3_linear_wrap`` and ``destroy()`` does not put it
    back."""
    module, _, name = torch_linear.rpartition(".")
    if stage != 3 and "deepspeed" in module:
        return (f"torch.nn.functional.linear is DeepSpeed's {name} while this ZeRO-{stage} "
                "engine runs: left in place by a ZeRO-3 engine destroyed before it in this process")
    return None


def _persistence_problem(params: Sequence[Persistent] | None, threshold: int) -> str | None:
    """None when every parameter is persistent exactly when it has at most ``threshold`` elements (DeepSpeed's
    ``mark_persistent_parameters``); else the sentence naming those that are not."""
    wrong = [f"{p.name} ({p.numel} elements) is {'not ' if p.numel <= threshold else ''}persistent"
             for p in params or () if p.persistent != (p.numel <= threshold)]
    if not wrong:
        return None
    return (f"stage3_param_persistence_threshold {threshold}: " + "; ".join(wrong[:4])
            + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
            + " (a parameter of at most that many elements is persistent: mark_persistent_parameters)")


COLLECTIVE_MISMATCH = ("Received data size doesn't match expected size", "Detected mismatch between collectives")
"""What a rank's log says when the ranks ran different collectives at one point: gloo's abort on a size it did not
expect, torch's own check under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""


def decide_failure(check: str, text: str) -> Decision:
    """A run that returned no result: ``hang`` (no answer in time), ``crash`` (the worker died) or
    ``internal`` (zerostate's executor itself failed).  A crash whose rank log shows the ranks ran different
    collectives has the code ``collective-mismatch`` (its identity: a rank died of the others' divergence, not of
    its own error)."""
    code = "collective-mismatch" if check == "crash" and any(m in text for m in COLLECTIVE_MISMATCH) else ""
    return Decision(check, text, code=code)


def _params_listed(text: str) -> tuple[str, ...]:
    """The parameters a ``ranks-params`` sentence lists after its last colon (``...: a, b ...``)."""
    tail = text.rsplit(": ", 1)[-1] if ": " in text else ""
    return tuple(p.strip() for p in tail.replace(" ...", "").split(",") if p.strip())


def _spec_decisions(events: list[Event], specs: Sequence[Spec], truncated: bool) -> Iterable[Decision]:
    for sid, v in check_all(events, specs).items():
        if v is not None and not (truncated and v.index is None):  # a truncated trace cannot end its obligations
            yield Decision(sid, v.message, code=v.code, index=v.index)


def failed_checks(record: RunRecord, scenario: Scenario, model_events: Iterable[Event] | None = None,
                  design: str = "", cross_rank: Mapping[str, tuple[str, str]] | None = None) -> dict[str, Failed]:
    """check id -> `Failed`, for every check ``record`` fails (`decide`), as a repro script reads them."""
    model = ModelRun(design, tuple(model_events)) if model_events is not None else None
    return {d.check: Failed(d.message, d.detail) for d in decide(record, scenario, model, cross_rank)}


__all__ = ["COLLECTIVE_MISMATCH", "Decision", "Failed", "ModelRun", "decide", "decide_failure", "decide_trace",
           "failed_checks"]
