"""Which checks one executor result fails: `failed_checks`, the judgement of `DeepSpeedTarget.run`.

`DeepSpeedTarget.run` turns a result of `executor.execute` into findings; a repro script (`repro`)
embeds this file, the executor, the tracer, the specs and the agreement projection verbatim and calls
`failed_checks` on its own run, so it judges a finding's check with the code explore judged it with:

* the exception's check (``exception``, ``saved-tensor-intact`` for torch's ``CheckpointError``,
  ``oracle-error``) when the run raised, with its origin (``ExcType@module.function``);
* ``oracle`` when the parameters after a train step differ from plain PyTorch;
* ``checkpoint`` when a checkpoint round trip (``save_load``) disagrees, with its code (`net.compare_save_load`);
* every spec of `zerostate.specs` the trace violates (coordinator specs on ZeRO-3 runs only; after an
  exception, only violations at an event: a truncated trace cannot fulfil end-of-run obligations),
  with the violation's code;
* ``model-agreement`` when ``model_events`` (the model design's trace of the same scenario) are given,
  the run finished, and the projections differ (`agreement.compare`).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from zerostate.model.events import Event
from zerostate.specs import check_trace, specs_for_stage

from zerostate.findings.agreement import compare


class Failed(NamedTuple):
    message: str
    detail: str = ""
    """The exception's origin (``exception``) or the spec violation's code; "" otherwise."""


def failed_checks(result: dict, stage: int, model_events: Iterable[Event] | None = None,
                  design: str = "") -> dict[str, Failed]:
    """check id -> `Failed`, for every check ``result`` (an `executor.execute` dict) fails."""
    out: dict[str, Failed] = {}
    if result.get("skipped"):
        return out
    events = [Event.from_dict(d) for d in result.get("events") or []]
    error = result.get("error")
    if error:
        out[result["error_check"]] = Failed(error, result.get("origin") or "")
    if result.get("mismatch"):
        out["oracle"] = Failed(result["mismatch"])
    if result.get("carried_state"):  # issue 15: process state an engine before it (engines_before) left
        out["carried-state"] = Failed(result["carried_state"], "torch-linear-replaced")
    if result.get("checkpoint"):  # a checkpoint round trip (save_load) that disagreed
        out["checkpoint"] = Failed(result["checkpoint"][1], result["checkpoint"][0])
    for spec in specs_for_stage(stage):  # as DeepSpeedTarget.run judges (targets.base.spec_findings)
        v = check_trace(spec, events)
        if v is not None and not (error and v.index is None):
            out[spec.id] = Failed(v.message, v.code)  # saved-tensor-intact: the spec's finding is kept
    if model_events is not None and not error:
        msg = compare(list(model_events), events, design)
        if msg:
            out["model-agreement"] = Failed(msg)
    return out


__all__ = ["Failed", "failed_checks"]
