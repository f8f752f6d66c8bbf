"""DeepSpeed checkpoints (not activation checkpointing): the round trip HF Trainer makes (`round_trip`); the
executor records it (`executor.round_trip_record`) and `findings.checkpoint_judgement` judges it."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Iterator
from typing import Any, Protocol, TypedDict

from zerostate.harness.net.compare import Params
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


class ResumeRecord(TypedDict, total=False):
    """A resume into a fresh engine (`engine.DeepSpeedBackend.resume`): the counters before the save and after the
    load, and whether the load found the checkpoint."""

    step: int
    counters: list[Counters]
    loaded: bool
    destroy_error: str | None
    """What the old engine's ``destroy()`` raised, if anything."""


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


@contextlib.contextmanager
def shared_checkpoint_dir() -> Iterator[str]:
    """A directory every rank writes its part of one DeepSpeed checkpoint to; after the block the ranks meet and rank
    0 removes it."""
    path = shared_tmpdir()
    try:
        yield path
    finally:
        barrier()
        if not rank_of():
            shutil.rmtree(path, ignore_errors=True)


def round_trip(backend: Checkpointable, step: int) -> SaveLoadRecord:
    """``save_load``: what HF Trainer does every ``save_steps`` and on ``--resume_from_checkpoint``, into
    the same engine.  At ZeRO-3 first the consolidated 16-bit state dict
    (``engine._zero3_consolidated_16bit_state_dict()``, what Accelerate's ``get_state_dict`` -- HF
    Trainer's model save -- calls: a ``GatheredParameters`` per module), then
    ``engine.save_checkpoint(dir)`` and ``engine.load_checkpoint(dir)``; the directory is shared by the
    ranks and removed.  Returns what the executor records of it.

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
    with shared_checkpoint_dir() as path:
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
    rec["after"] = backend.params()
    rec["counters"].append(backend.counters())
    rec["fp32_exact"] = backend.fp32
    return rec


__all__ = ["MASTER_ATTRIBUTES", "Checkpointable", "Counters", "ResumeRecord", "SaveLoadRecord",
           "shared_checkpoint_dir",
           "fp32_from_zero_checkpoint", "master_partitions", "round_trip"]
