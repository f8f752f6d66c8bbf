"""Which engines the runtime covers: `engine_support` (None, or why not).

The zerostate design decides when a ZeRO optimizer's backward epilogue runs; it applies where the
gradient hooks consult DeepSpeed's backward hook state and are the closures `hook_closures` knows.
"""

from __future__ import annotations

from typing import Any


_ZERO_OPTIMIZERS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")
"""DeepSpeed's ZeRO stage 1/2 and stage 3 optimizers (and subclasses, whose hooks are then checked)."""


def _offload_device(cfg: Any) -> str:
    device = getattr(cfg, "device", None) if cfg is not None else None
    return str(getattr(device, "value", device) or "none")


def engine_support(engine: Any) -> str | None:
    """None when `install` covers ``engine``, else why not (the text of the refusal).

    Covered: an optimizer that is (a subclass of) DeepSpeed's ZeRO stage 1/2 or stage 3 optimizer,
    any precision, offload to CPU or none.  Not covered:

    * no ZeRO optimizer (plain DeepSpeed, ZeRO stage 0): no backward hook state to replace;
    * ``BF16_Optimizer`` (ZeRO-1 + bf16 + fp32 gradient accumulation): it runs its backward epilogue
      from ``engine.backward`` only and its gradient hooks (``immediate_grad_update``) never consult
      the backward hook state -- the design has nothing to decide there, and its hooks are not the
      closures of `COMPAT` (install would raise "unexpected ZeRO gradient hook" inside
      ``deepspeed.initialize``);
    * NVMe offload (optimizer or parameters): its swap-in / swap-out paths around fetch and release
      are not verified with the release policy.
    """
    opt = getattr(engine, "optimizer", None)
    names = [c.__name__ for c in type(opt).__mro__]
    if getattr(opt, "_backward_hook_state", None) is None:
        return ("engine.optimizer has no _backward_hook_state: zerostate.runtime installs into ZeRO stage 1, 2 "
                f"or 3 engines (got optimizer {type(opt).__name__})")
    if "BF16_Optimizer" in names:
        return ("BF16_Optimizer (ZeRO-1 + bf16 with fp32 gradient accumulation) drives its backward epilogue from "
                "engine.backward only and its gradient hooks never consult the backward hook state: the zerostate "
                "design does not apply to it")
    if not any(n in _ZERO_OPTIMIZERS for n in names):
        return (f"optimizer {type(opt).__name__} is not one of DeepSpeed's ZeRO optimizers "
                f"({', '.join(_ZERO_OPTIMIZERS)})")
    for what, getter in (("optimizer", "zero_offload_optimizer"), ("parameter", "zero_offload_param")):
        fn = getattr(engine, getter, None)
        device = _offload_device(fn()) if callable(fn) else "none"
        if device == "nvme":
            return f"{what} offload to NVMe is not verified with zerostate.runtime (CPU offload is)"
    return None


__all__ = ["engine_support"]
