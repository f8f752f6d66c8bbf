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
from typing import Any, NamedTuple

from zerostate.model.events import Event
from zerostate.specs import Spec, check_all, specs_for_stage

from zerostate.findings.agreement import compare
from zerostate.findings.evidence import NO_EVIDENCE, Evidence, from_result, oracle_from


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


def decide(result: Mapping[str, Any], stage: int, model: ModelRun | None = None,
           cross_rank: Mapping[str, tuple[str, str]] | None = None,
           specs: Sequence[Spec] | None = None, other_ranks: Sequence[Mapping[str, Any]] = (),
           events: Sequence[Event] | None = None) -> tuple[Decision, ...]:
    """Every check ``result`` (an `executor.execute` dict) fails, in report order.  ``model``: compare with
    the model design (None: not compared); ``cross_rank``: check id -> (text, code) from
    `harness.cross_rank_checks.cross_rank_problems` at world size > 1, and ``other_ranks`` the other ranks'
    results (the evidence of another rank's oracle disagreement); ``specs``: the specs judged (default:
    those of the ZeRO ``stage``, `specs_for_stage`); ``events``: the trace when the caller holds it as events
    already (else read from ``result["events"]``)."""
    if result.get("skipped"):
        return ()
    events = list(events) if events is not None else [Event.from_dict(d) for d in result.get("events") or []]
    error = result.get("error")
    differ = _params_listed((cross_rank or {}).get("ranks-params", ("", ""))[0])
    shown = replace(from_result(result), ranks_differ=differ)
    ran = Evidence(raised=shown.raised, ranks_differ=differ)  # what every check of the run can point to
    out: list[Decision] = []
    raised: Decision | None = None
    if error:
        check = result["error_check"]
        origin = result.get("origin") or ""
        raised = Decision(check, error + "\n" + (result.get("traceback") or ""),
                          origin=origin if check == "exception" else origin.split("@")[0], evidence=ran)
        out.append(raised)
    if result.get("mismatch"):
        out.append(Decision("oracle", result["mismatch"], evidence=shown))
    if result.get("carried_state"):
        out.append(Decision("carried-state", result["carried_state"], code="torch-linear-replaced", evidence=ran))
    if result.get("persistence"):
        out.append(Decision("persistence", result["persistence"], code="threshold-not-honoured", evidence=ran))
    if result.get("checkpoint"):
        code, sentence = result["checkpoint"]
        out.append(Decision("checkpoint", sentence, code=code, evidence=ran))
    for d in _spec_decisions(events, specs_for_stage(stage) if specs is None else specs, truncated=bool(error)):
        decision = d
        if raised is not None and d.check == raised.check:  # CheckpointError: the spec points at the event
            out.remove(raised)
            decision = Decision(d.check, d.message + "\n(torch raised) " + raised.message, code=d.code,
                                index=d.index)
        out.append(replace(decision, evidence=ran))
    if model is not None and not error:
        msg = model.error or compare(list(model.events), events, model.design)
        if msg:
            out.append(Decision("model-agreement", msg, evidence=ran))
    failing = {d.check for d in out}
    for check, (text, code) in (cross_rank or {}).items():
        if check not in failing:
            off = next((r for r in other_ranks if r.get("mismatch")), None) if check == "oracle" else None
            seen = Evidence(ran.raised, oracle_from(off.get("oracle_diff")) if off else None, ranks_differ=differ)
            out.append(Decision(check, text, code=code, across_ranks=True, evidence=seen))
    return tuple(out)


def decide_trace(events: Sequence[Event], stage: int, error: str | None = None, origin: str = "",
                 specs: Sequence[Spec] | None = None) -> tuple[Decision, ...]:
    """The checks a trace alone fails, for a run with no scenario and no oracle (``zerostate watch``: a
    user's job; the model target's run of a design): the exception it raised (``error``: ``"ExcType:
    message"``, ``origin``) and the specs (``specs``: as `decide`)."""
    result = {"error": error, "origin": origin, "error_check": "exception" if error else None}
    return decide(result, stage, specs=specs, events=events)


def decide_failure(check: str, text: str) -> Decision:
    """A run that returned no result: ``hang`` (no answer in time), ``crash`` (the worker died) or
    ``internal`` (zerostate's executor itself failed)."""
    return Decision(check, text)


def _params_listed(text: str) -> tuple[str, ...]:
    """The parameters a ``ranks-params`` sentence lists after its last colon (``...: a, b ...``)."""
    tail = text.rsplit(": ", 1)[-1] if ": " in text else ""
    return tuple(p.strip() for p in tail.replace(" ...", "").split(",") if p.strip())


def _spec_decisions(events: list[Event], specs: Sequence[Spec], truncated: bool) -> Iterable[Decision]:
    for sid, v in check_all(events, specs).items():
        if v is not None and not (truncated and v.index is None):  # a truncated trace cannot end its obligations
            yield Decision(sid, v.message, code=v.code, index=v.index)


def failed_checks(result: Mapping[str, Any], stage: int, model_events: Iterable[Event] | None = None,
                  design: str = "", cross_rank: Mapping[str, tuple[str, str]] | None = None) -> dict[str, Failed]:
    """check id -> `Failed`, for every check ``result`` fails (`decide`), as a repro script reads them."""
    model = ModelRun(design, tuple(model_events)) if model_events is not None else None
    return {d.check: Failed(d.message, d.detail) for d in decide(result, stage, model, cross_rank)}


__all__ = ["Decision", "Failed", "ModelRun", "decide", "decide_failure", "decide_trace", "failed_checks"]
