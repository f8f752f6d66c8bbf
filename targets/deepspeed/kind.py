"""The ``deepspeed`` target kind in the target registry (`zerostate.targets.interface.register`).

Validation runs first and imports nothing heavy; the factory imports `DeepSpeedTarget` (world size 1) or
`DeepSpeedRanksTarget` (world size 2, 4, 8: a rank pool of that many processes, gloo on CPU, nccl with as many
GPUs), whose constructors check the release and start the worker."""

from __future__ import annotations

from typing import Any

from zerostate.model.scenario import WORLD_SIZES
from zerostate.targets.interface import Target, TargetError, known_design, register


def validate(*, deepspeed: str | None = None, deepspeed_path: str | None = None, design: str | None = None,
             world_size: int = 1, **_: Any) -> None:
    if deepspeed and deepspeed_path:
        raise TargetError("give --deepspeed VERSION or --deepspeed-path DIR, not both")
    if world_size not in WORLD_SIZES:
        raise TargetError(f"the deepspeed target runs world size 1, 2, 4 or 8 (asked for {world_size})")
    if design is not None:
        known_design(design)


def build(*, world_size: int = 1, **options: Any) -> Target:
    if world_size > 1:
        from zerostate.targets.deepspeed.ranks import DeepSpeedRanksTarget
        return DeepSpeedRanksTarget(world_size=world_size, **options)
    from zerostate.targets.deepspeed.target import DeepSpeedTarget
    return DeepSpeedTarget(**options)


register("deepspeed", build, validate)

__all__ = ["WORLD_SIZES", "build", "validate"]
