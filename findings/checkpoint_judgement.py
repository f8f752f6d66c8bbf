"""A checkpoint round trip's verdict (the ``checkpoint`` check), from its observation
(`record.CheckpointRoundTrip`): None, or ``(code, sentence)`` for the first of these that fails.

* ``no-files`` / ``not-loaded``: ``save_checkpoint`` wrote nothing, ``load_checkpoint`` found nothing;
* ``16-bit-state-dict`` (ZeRO-3): the consolidated 16-bit state dict exactly against the engine's own parameters
  (it is a copy of them), and against the oracle (the precision's tolerance);
* ``round-trip``: after the load, the parameters are exactly what they were before the save;
* ``counters``: so are the engine's global / skipped steps and fp16's loss scale (a round trip must not change
  training);
* ``zero-to-fp32`` (ZeRO-1/2/3): the fp32 weights ``zero_to_fp32`` rebuilds from the checkpoint against the
  engine's parameters (exactly in fp32 training; at the tolerance in bf16 / fp16, whose fp32 master copies differ
  from the 16-bit parameters by a rounding) and against the oracle;
* ``master-weights`` (ZeRO-1/2/3, ``BF16_Optimizer``): after the load this rank's fp32 master partitions are
  exactly the saved ones, though they were moved before the load (`harness.net.checkpoint.round_trip`): the
  optimizer steps them, so a restore skipped or rebuilt from 16-bit copies changes training below the oracle's
  16-bit tolerance.

Against the oracle only while the training agreed with it so far: a divergence is the oracle's finding, and the
checkpoint is then judged against the engine alone, so it is not reported twice."""

from __future__ import annotations

from zerostate.findings.oracle_judgement import compare_text
from zerostate.findings.record import CheckpointRoundTrip, ResumeObservation

_OWN = ("the engine", "the checkpoint")


def round_trip_problem(rt: CheckpointRoundTrip, tol: tuple[float, float],
                       against_oracle: bool) -> tuple[str, str] | None:
    """``(code, sentence)`` of the first check of the round trip that fails, else None; ``against_oracle``: the
    training agreed with the oracle until this round trip."""
    where = f"checkpoint before train step {rt.step}"
    if not rt.files:
        return "no-files", f"{where}: save_checkpoint wrote no file"
    if not rt.loaded:
        return "not-loaded", f"{where}: load_checkpoint loaded nothing (returned {rt.loaded_repr})"
    if rt.state16_vs_engine is not None:
        msg = compare_text(rt.state16_vs_engine, 0.0, 0.0, _OWN) or (
            against_oracle and rt.state16_vs_oracle is not None and compare_text(rt.state16_vs_oracle, *tol))
        if msg:
            return "16-bit-state-dict", f"{where}: the consolidated 16-bit state dict: {msg}"
    msg = compare_text(rt.after_vs_before, 0.0, 0.0, ("the engine before save_checkpoint",
                                                      "the engine after load_checkpoint"))
    if msg:
        return "round-trip", f"{where}: the parameters after load_checkpoint: {msg}"
    if rt.counters_before != rt.counters_after:
        before = rt.counters_before.as_text() if rt.counters_before else None
        after = rt.counters_after.as_text() if rt.counters_after else None
        return "counters", f"{where}: the engine's counters before save / after load: {before} / {after}"
    if rt.fp32_vs_engine is not None:
        exact = (0.0, 0.0) if rt.fp32_exact else tol
        msg = compare_text(rt.fp32_vs_engine, *exact, _OWN) or (
            against_oracle and rt.fp32_vs_oracle is not None and compare_text(rt.fp32_vs_oracle, *tol))
        if msg:
            return "zero-to-fp32", f"{where}: the fp32 weights zero_to_fp32 rebuilds from the checkpoint: {msg}"
    if rt.masters_restored is not None:
        msg = compare_text(rt.masters_restored, 0.0, 0.0, ("the saved checkpoint", "the engine after load_checkpoint"))
        if msg:
            return "master-weights", f"{where}: the fp32 master weights load_checkpoint restored: {msg}"
    return None


__all__ = ["round_trip_problem"]


def resume_problem(r: ResumeObservation) -> tuple[str, str] | None:
    """``(code, sentence)`` when a resume into a fresh engine loaded nothing or did not restore the engine's counters
    (global / skipped steps, fp16's loss scale), else None.  Its parameters and optimizer state are the oracle's to
    judge: PyTorch trains on as if the engine had never been rebuilt."""
    where = f"resume into a fresh engine before train step {r.step}"
    if not r.loaded:
        return "resume-not-loaded", f"{where}: load_checkpoint found no checkpoint"
    if r.counters_before != r.counters_after:
        before = r.counters_before.as_text() if r.counters_before else None
        after = r.counters_after.as_text() if r.counters_after else None
        return "resume-counters", (f"{where}: the counters of the saved engine / of the fresh one after the load: "
                                   f"{before} / {after}")
    return None
