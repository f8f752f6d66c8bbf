"""Every difference between DeepSpeed releases that the tracer depends on, in one place.

Supported releases: **0.18.4 <= version < 0.20** (``SUPPORTED``: the rows of the era table
`zerostate.model.eras.ERAS` whose ``tracer`` is set).  Tested:
0.18.4, 0.18.5, 0.18.6, 0.18.7, 0.19.0, 0.19.2, 0.19.3, 0.19.8 (``TESTED``).
Below 0.18.4 the PyTorch-style backward path (output hooks,
``count_used_parameters_in_backward``) this tracer observes does not exist in
the form wrapped here; from 0.20 on it is unknown.  Anything outside the range
fails with `UnsupportedRelease`, naming the version and the range, before any
scenario runs.

What differs, and how this module papers over it:

* hook-count state: 0.18.4 keeps ``_remaining_grad_acc_hooks`` /
  ``_backward_active_depth`` on the ZeRO optimizer itself; 0.18.5+ moved it into
  ``optimizer._backward_hook_state`` (``BackwardHookStateManager``), whose own
  methods are what the gradient hooks and the queued callback call.
  `hook_state_owner` returns the object whose methods to wrap.
* the queued post-backward callback (0.18.5+) is a closure named
  ``_run_post_backward``; 0.18.4 has none.
* gradient sinks: ZeRO-3 hooks call ``reduce_ready_partitions_and_remove_grads``,
  ZeRO-1/2 hooks call ``process_gradients`` (all releases); the hook closures are
  named in ``PARAM_HOOK_FRAMES`` / ``LEAF_HOOK_FRAMES``.
* ``count_used_parameters_in_backward`` is imported by name into
  ``deepspeed.runtime.zero.stage3`` and ``deepspeed.runtime.zero.stage_1_and_2``
  (all supported releases): the tracer rebinds it there.
* ZeRO-3 ipg buckets: ``optimizer.ipg_buckets`` (dtype -> bucket with ``.params``).
* ZeRO-3 coordinator: ``optimizer.parameter_offload.get_param_coordinator()``; trace mode via
  ``is_record_trace`` / ``is_complete_trace``; parameter ``ds_status``, ``ds_active_sub_modules``,
  ``ds_persist``; offload hooks ``pre/post_sub_module_forward/backward_function`` (all releases).
* world size 1 on CPU: `skip_shm_comm_op` avoids JIT-building a comm op nobody needs.
"""

from __future__ import annotations

from typing import Any

from zerostate.model.eras import ERAS, UnknownRelease, parse_release, span

_TRACED = [e for e in ERAS if e.tracer]
SUPPORTED = (_TRACED[0].first, _TRACED[-1].end)
SUPPORTED_TEXT = span(_TRACED)
TESTED = ("0.18.4", "0.18.5", "0.18.6", "0.18.7", "0.19.0", "0.19.2", "0.19.3", "0.19.8")

PARAM_HOOK_FRAMES = frozenset({"reduce_partition_and_remove_grads", "grad_handling_hook"})
LEAF_HOOK_FRAMES = frozenset({"reduce_leaf_module_grads"})
CALLBACK_FRAMES = frozenset({"_run_post_backward"})
COUNT_MODULES = ("deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2")
COUNT_NAME = "count_used_parameters_in_backward"


class UnsupportedRelease(RuntimeError):
    """A DeepSpeed release the tracer does not support; the message names the supported range."""


def version_tuple(version: str) -> tuple[int, int, int]:
    try:
        return parse_release(version)
    except UnknownRelease:
        raise UnsupportedRelease(f"cannot read a DeepSpeed version from {version!r}; "
                                 f"the deepspeed target supports {SUPPORTED_TEXT}") from None


def check_version(version: str) -> None:
    v = version_tuple(version)
    if not (SUPPORTED[0] <= v < SUPPORTED[1]):
        raise UnsupportedRelease(
            f"DeepSpeed {version} is outside the releases the deepspeed target's tracer supports "
            f"({SUPPORTED_TEXT}; tested: {', '.join(TESTED)}).  Its ZeRO hook internals differ; "
            f"see tracing/compat.py.")


def hook_state_owner(optimizer: Any) -> Any:
    """The object whose enter/exit_backward, run_grad_acc_post_hooks, queue_post_backward_callback the
    hooks actually call."""
    return getattr(optimizer, "_backward_hook_state", optimizer)


def has_queued_callback(owner: Any) -> bool:
    return hasattr(owner, "queue_post_backward_callback")


def callback_queued(owner: Any) -> bool:
    return bool(getattr(owner, "post_backward_callback_queued", False))


def depth(optimizer: Any) -> int:
    hs = getattr(optimizer, "_backward_hook_state", None)
    if hs is not None:
        return int(hs.backward_active_depth)
    return int(getattr(optimizer, "_backward_active_depth", 0))


def grad_sink(stage: int) -> str:
    return "reduce_ready_partitions_and_remove_grads" if stage == 3 else "process_gradients"


def stale_bucket_count(optimizer: Any) -> int:
    buckets = getattr(optimizer, "ipg_buckets", None)
    if not isinstance(buckets, dict):
        return 0
    return sum(len(getattr(b, "params", ()) or ()) for b in buckets.values())


def offload(optimizer: Any) -> Any:
    return getattr(optimizer, "parameter_offload", None)


def coordinator(optimizer: Any) -> Any:
    off = offload(optimizer)
    return off.get_param_coordinator() if off is not None else None


def param_status(p: Any) -> str:
    st = getattr(p, "ds_status", None)
    return getattr(st, "name", str(st)) if st is not None else "AVAILABLE"


def trace_mode(coord: Any) -> str | None:
    """The coordinator's module-trace mode: RECORD, COMPLETE or INVALID (None without a coordinator)."""
    if coord is None:
        return None
    if coord.is_record_trace():
        return "RECORD"
    if coord.is_complete_trace():
        return "COMPLETE"
    return "INVALID"


def holders(p: Any) -> int:
    """``len(param.ds_active_sub_modules)``: the modules holding a ZeRO-3 parameter gathered."""
    return len(getattr(p, "ds_active_sub_modules", ()) or ())


def is_persistent(p: Any) -> bool:
    return bool(getattr(p, "ds_persist", False))


def is_checkpoint_error(exc: BaseException) -> bool:
    return type(exc).__name__ == "CheckpointError"


def skip_shm_comm_op() -> None:
    """World size 1 on CPU: do not JIT-build DeepSpeed's shared-memory allreduce op (``deepspeed.comm.torch.
    build_shm_op``, ~30-90 s per fresh TORCH_EXTENSIONS_DIR); with one rank it has nothing to reduce, and
    collectives fall back to gloo.  Called by the worker before ``init_distributed``."""
    import importlib
    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_comm_torch, "build_shm_op"):
        setattr(ds_comm_torch, "build_shm_op", lambda: None)  # noqa: B010 - a release's own module attribute


def clear_globals() -> None:
    """Drop per-engine global state DeepSpeed keeps between engines (module stack of ZeRO-3)."""
    try:
        from deepspeed.runtime.zero import parameter_offload
    except ImportError:  # a release without ZeRO-3's offload module: nothing kept
        return
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack.clear()


__all__ = ["SUPPORTED", "SUPPORTED_TEXT", "TESTED", "UnsupportedRelease", "check_version", "version_tuple"]
