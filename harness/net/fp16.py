"""fp16 on both sides: DeepSpeed's dynamic loss-scaling algorithm for the oracle (`LossScale`), the current
loss scale user code outside the engine must apply (`loss_scale`), and fp16 on DeepSpeed's CPU accelerator
(`allow_fp16_on_cpu` / `restore_fp16_support`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Protocol, TypedDict

import torch


class Fp16Config(TypedDict):
    """The ``fp16`` section `config.ds_config` writes for an fp16 scenario."""

    enabled: bool
    loss_scale: int
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: int


_SCALE: list[Callable[[], float]] = []
"""The current loss scale of the backend that runs (at most one), which the fused head's backward inside
forward must apply itself, as any user code calling backward outside the engine must."""


def set_loss_scale(scale: Callable[[], float] | None) -> None:
    """The running backend's loss scale from now on (None: no loss scaling)."""
    _SCALE.clear()
    if scale is not None:
        _SCALE.append(scale)


def loss_scale() -> float:
    """The running backend's current loss scale; 1.0 without fp16."""
    return _SCALE[0]() if _SCALE else 1.0


class LossScale:
    """DeepSpeed's dynamic loss scaler (runtime/fp16/loss_scaler.py ``DynamicLossScaler.update_scale``) for
    the config `config.ds_config` writes: ``hysteresis`` 1, factor 2, ``consecutive_hysteresis`` off.  An
    overflow (a non-finite gradient) skips the step and halves the scale (not below ``min_loss_scale``);
    after ``loss_scale_window`` steps without overflow it doubles."""

    def __init__(self, cfg: Fp16Config, unit: bool = False) -> None:
        self.unit = unit
        """DeepSpeed's static ``LossScaler(scale=1.0)`` instead (`CreateLossScaler` for an optimizer whose dtype is
        not fp16): the scale stays 1, an overflow still skips the step."""
        self.scale = 1.0 if unit else float(2 ** cfg["initial_scale_power"])
        self.window, self.min = cfg["loss_scale_window"], cfg["min_loss_scale"]
        self.iter, self.last_overflow = 0, -1
        self.skipped: list[int] = []
        """The train steps skipped for an overflow."""
        self.scales: list[float] = []
        """The scale each train step ran with."""

    def update(self, overflow: bool, step: int) -> None:
        self.scales.append(self.scale)
        if self.unit:
            if overflow:
                self.skipped.append(step)
        elif overflow:
            self.skipped.append(step)
            self.scale = max(self.scale / 2, self.min)
            self.last_overflow = self.iter
        else:
            stable = self.iter - self.last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.scale *= 2
        self.iter += 1


class _Accelerator(Protocol):
    def device_name(self) -> str: ...

    def is_fp16_supported(self) -> bool: ...

    def supported_dtypes(self) -> list[torch.dtype]: ...


def _accelerator() -> _Accelerator:
    from deepspeed.accelerator import get_accelerator
    acc: _Accelerator = get_accelerator()
    return acc


def allow_fp16_on_cpu() -> bool:
    """zerostate's one change to DeepSpeed, made only for an fp16 scenario on DeepSpeed's CPU accelerator:
    that accelerator says fp16 is supported only when oneDNN has AVX512-FP16
    (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``, accelerator/cpu_accelerator.py ``is_fp16_supported``),
    and ``deepspeed.initialize`` refuses fp16 otherwise (engine.py: "fp16 is not supported on this
    accelerator").  That is a speed statement: torch computes float16 on any CPU (emulated, slower), and the
    fp16 path under test -- the loss scaler, the overflow check, ZeRO's fp16 parameters and fp32 master
    partitions -- is device-independent Python.  So the accelerator instance is told fp16 is supported
    (``is_fp16_supported`` and ``supported_dtypes``); nothing else of DeepSpeed changes.  Returns True when it
    made the change (False on a GPU, or on a CPU that has fp16).  `restore_fp16_support` undoes it: the
    executor does after every example, so no other scenario runs with it (zero.Init's default dtype, for
    one, follows ``is_fp16_supported``)."""
    acc = _accelerator()
    if acc.device_name() != "cpu" or acc.is_fp16_supported():
        return False
    dtypes = acc.supported_dtypes
    # on the instance, so delattr brings the class's own back (setattr: mypy refuses assigning to a method)
    setattr(acc, "is_fp16_supported", lambda: True)  # noqa: B010
    setattr(acc, "supported_dtypes", lambda: list(dtypes()) + [torch.float16])  # noqa: B010
    return True


def restore_fp16_support() -> bool:
    """Undo `allow_fp16_on_cpu` (the class's own methods again); True when there was something to undo."""
    if "deepspeed" not in sys.modules:
        return False
    acc = _accelerator()
    changed = False
    for name in ("is_fp16_supported", "supported_dtypes"):
        if name in vars(acc):
            delattr(acc, name)
            changed = True
    return changed


__all__ = ["Fp16Config", "LossScale", "allow_fp16_on_cpu", "loss_scale", "restore_fp16_support", "set_loss_scale"]
