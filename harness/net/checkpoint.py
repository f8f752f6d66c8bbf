"""DeepSpeed checkpoints (not activation checkpointing): the round trip HF Trainer makes (`round_trip`) and
its judgement (`compare_save_load`)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from typing import Any, Protocol, TypedDict

from zerostate.harness.net.compare import Params, compare
from zerostate.harness.net.dist import barrier, rank_of, shared_tmpdir


class Counters(TypedDict):
    """The engine state a checkpoint round trip must keep."""

    global_steps: int
    skipped_steps: int
    loss_scale: float | None


class _RecordBase(TypedDict):
    step: int
    before: Params
    counters: list[Counters]


class SaveLoadRecord(_RecordBase, total=False):
    """One round trip: the parameters before and after, the 16-bit state dict (ZeRO-3), the files written, the
    loaded path, the fp32 weights ``zero_to_fp32`` rebuilds (ZeRO-1/2/3), the counters before and after, and
    this rank's fp32 master partitions as saved and after the load (`master_partitions`)."""

    state16: Params
    files: list[str]
    fp32: Params
    loaded: Any
    after: Params
    fp32_exact: bool
    master: Params
    master_after: Params


class Checkpointable(Protocol):
    """What `round_trip` needs of the engine backend."""

    engine: Any
    stage: int
    fp32: bool
    """fp32 training: zero_to_fp32's weights must equal the engine's exactly."""

    def params(self) -> Params: ...

    def counters(self) -> Counters: ...


def fp32_from_zero_checkpoint(path: str) -> Params:
    """The fp32 weights DeepSpeed's ``zero_to_fp32`` rebuilds from a ZeRO checkpoint
    (``get_fp32_state_dict_from_zero_checkpoint``, what users convert a checkpoint with); its prints are
    silenced.  The 0.19.8 engine saves the shapes of parameters the optimizer does not own (a parameter in
    no group, a zero-element one) with the frozen ones: before, only ``requires_grad=False`` ones."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with contextlib.redirect_stdout(io.StringIO()):
        return {k: v.detach().cpu().clone() for k, v in get_fp32_state_dict_from_zero_checkpoint(path).items()}


MASTER_ATTRIBUTES = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")
"""Where this rank's flat fp32 master partitions live: ZeRO-3, ZeRO-1/2, ``BF16_Optimizer``."""


def master_partitions(optimizer: Any) -> list[Any] | None:
    """This rank's fp32 master weights (what the optimizer steps), one flat tensor per group, or None where the
    optimizer keeps none under a known name (stage 0: the model's own fp32 parameters, or FP16_Optimizer)."""
    for name in MASTER_ATTRIBUTES:
        flat = getattr(optimizer, name, None)
        if isinstance(flat, list) and flat:
            return flat
    return None


def _snapshot(flat: list[Any]) -> Params:
    return {f"fp32 master group {i}": t.detach().cpu().clone() for i, t in enumerate(flat)}


def round_trip(backend: Checkpointable, step: int) -> SaveLoadRecord:
    """``save_load``: what HF Trainer does every ``save_steps`` and on ``--resume_from_checkpoint``, into
    the same engine.  At ZeRO-3 first the consolidated 16-bit state dict
    (``engine._zero3_consolidated_16bit_state_dict()``, what Accelerate's ``get_state_dict`` -- HF
    Trainer's model save -- calls: a ``GatheredParameters`` per module), then
    ``engine.save_checkpoint(dir)`` and ``engine.load_checkpoint(dir)``; the directory is shared by the
    ranks and removed.  Returns the record `compare_save_load` judges.

    Between the save and the load every fp32 master partition is moved by +1: a resume loads into an engine
    whose master weights are not the saved ones (HF Trainer's ``--resume_from_checkpoint`` starts a fresh
    one), and a load into the engine that just saved cannot show a restore it skipped or took from the
    rounded 16-bit copies.  A load that returns nothing gets the saved partitions back, so only the
    ``not-loaded`` finding reports it."""
    engine = backend.engine
    rec: SaveLoadRecord = {"step": step, "before": backend.params(), "counters": [backend.counters()]}
    if engine.zero_optimization_partition_weights():
        sd = engine._zero3_consolidated_16bit_state_dict()  # every rank gathers; rank 0 gets it
        if sd is not None:
            rec["state16"] = {k: v.detach().cpu().clone() for k, v in sd.items()}
    path = shared_tmpdir()
    try:
        engine.save_checkpoint(path)
        barrier()  # every rank's files are written
        rec["files"] = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
        if backend.stage > 0:
            rec["fp32"] = fp32_from_zero_checkpoint(path)
        flat = master_partitions(engine.optimizer)
        if flat is not None:
            rec["master"] = _snapshot(flat)
            for t in flat:
                t.data.add_(1.0)
        rec["loaded"], _ = engine.load_checkpoint(path)
        if flat is not None:
            if not rec["loaded"]:
                for t, saved in zip(flat, rec["master"].values(), strict=True):
                    t.data.copy_(saved)
            rec["master_after"] = _snapshot(master_partitions(engine.optimizer) or flat)
    finally:
        barrier()
        if not rank_of():
            shutil.rmtree(path, ignore_errors=True)
    rec["after"] = backend.params()
    rec["counters"].append(backend.counters())
    rec["fp32_exact"] = backend.fp32
    return rec


def compare_save_load(rec: SaveLoadRecord, expected: Params | None,
                      tol: tuple[float, float]) -> tuple[str, str] | None:
    """A checkpoint round trip (`round_trip`): None, or ``(code, sentence)`` for the first of these that
    fails.  ``expected``: the oracle's parameters at that point (before the step), or None when the
    training already disagrees with the oracle (its own finding says so; the checkpoint is then judged against
    the engine alone, so a divergence is not reported twice).

    * ``no-files`` / ``not-loaded``: ``save_checkpoint`` wrote nothing, ``load_checkpoint`` found nothing;
    * ``16-bit-state-dict`` (ZeRO-3): the consolidated 16-bit state dict exactly against the engine's own
      parameters (it is a copy of them), and against the oracle (``tol``);
    * ``round-trip``: after the load, the parameters are exactly what they were before the save;
    * ``counters``: so are the engine's global / skipped steps and fp16's loss scale (a round trip must
      not change training);
    * ``zero-to-fp32`` (ZeRO-1/2/3): the fp32 weights ``zero_to_fp32`` rebuilds from the checkpoint against
      the engine's parameters (exactly in fp32 training; at ``tol`` in bf16 / fp16, whose fp32 master copies
      differ from the 16-bit parameters by a rounding) and against the oracle (``tol``);
    * ``master-weights`` (ZeRO-1/2/3, ``BF16_Optimizer``): after the load this rank's fp32 master partitions
      are exactly the saved ones, though they were moved before the load (`round_trip`): the optimizer
      steps them, so a restore skipped or rebuilt from 16-bit copies changes training below the oracle's
      16-bit tolerance."""
    where = f"checkpoint before train step {rec['step']}"
    own = ("the engine", "the checkpoint")
    if not rec.get("files"):
        return "no-files", f"{where}: save_checkpoint wrote no file"
    if not rec.get("loaded"):
        return "not-loaded", f"{where}: load_checkpoint loaded nothing (returned {rec.get('loaded')!r})"
    if "state16" in rec:
        msg = compare(rec["before"], rec["state16"], 0.0, 0.0, own) or (
            expected is not None and compare(expected, rec["state16"], *tol))
        if msg:
            return "16-bit-state-dict", f"{where}: the consolidated 16-bit state dict: {msg}"
    msg = compare(rec["before"], rec["after"], 0.0, 0.0, ("the engine before save_checkpoint",
                                                          "the engine after load_checkpoint"))
    if msg:
        return "round-trip", f"{where}: the parameters after load_checkpoint: {msg}"
    if rec["counters"][0] != rec["counters"][1]:
        return "counters", (f"{where}: the engine's counters before save / after load: {rec['counters'][0]} / "
                            f"{rec['counters'][1]}")
    if "fp32" in rec:
        exact = (0.0, 0.0) if rec.get("fp32_exact") else tol
        msg = compare(rec["before"], rec["fp32"], *exact, own) or (
            expected is not None and compare(expected, rec["fp32"], *tol))
        if msg:
            return "zero-to-fp32", f"{where}: the fp32 weights zero_to_fp32 rebuilds from the checkpoint: {msg}"
    if "master" in rec:
        msg = compare(rec["master"], rec.get("master_after", {}), 0.0, 0.0,
                      ("the saved checkpoint", "the engine after load_checkpoint"))
        if msg:
            return "master-weights", f"{where}: the fp32 master weights load_checkpoint restored: {msg}"
    return None


__all__ = ["MASTER_ATTRIBUTES", "Checkpointable", "Counters", "SaveLoadRecord", "compare_save_load",
           "fp32_from_zero_checkpoint", "master_partitions", "round_trip"]
