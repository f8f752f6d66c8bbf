"""DeepSpeed's gradient-hook closures, as the runtime finds them and, on 0.18.5 / 0.18.6, replaces them.

On 0.18.5 and 0.18.6 every gradient hook (``grad_handling_hook`` of ZeRO-1/2,
``reduce_partition_and_remove_grads`` and ``reduce_leaf_module_grads`` of ZeRO-3) evaluates
``count_used_parameters_in_backward`` unconditionally -- once per hook, quadratic in the number of
parameters (deepspeedai/DeepSpeed#7882).  `plan_closure_swaps` finds each hook in its hook dictionary
(``param._post_accumulate_grad_hooks`` / ``module._backward_hooks``) and plans its replacement by
`build_hook`: the 0.18.7 closure (the shape of deepspeedai/DeepSpeed#7886) over the original's captured
values, which asks the hook state ``should_refresh_expected_hook_count`` first -- and the zerostate hook
state never asks for a count.  From 0.18.7 on the closures already have that shape and are kept
(checked: a closure that does not consult the hook state is refused).  `install` applies the swaps
through its `Patcher` (``set_item``: same key, same place in the dictionary's order).

On every supported release each z3 leaf module's hook (``reduce_leaf_module_grads``; on 0.18.5 / 0.18.6
its replacement) is also wrapped by `leaf_deferral.defer_leaf_hook`: the fix of DeepSpeed's
``z3-leaf-input-without-grad`` (the leaf's reduction waits for the gradients the backward will still
accumulate).  A leaf hook without the expected shape (three arguments, a ``params`` list captured) is
refused, and so is a PyTorch build without the internals the deferral needs -- before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from .compat_table import CompatRow, fmt
from .errors import UnsupportedEngineError, ZerostateInstallError
from .hook_state_manager import MissingTorchInternalsError
from .leaf_deferral import defer_leaf_hook, leaf_autograd


_HOOK_NAMES = {"grad_handling_hook": "stage12", "reduce_partition_and_remove_grads": "stage3",
               "reduce_leaf_module_grads": "stage3_leaf"}


def cells(fn: Callable) -> dict[str, Any]:
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True)}


def unwrap(fn: Callable) -> Callable:
    """Strip DeepSpeed's ``instrument_w_nvtx`` wrapper (``wrapped_fn`` closing over ``func``)."""
    seen = 0
    while getattr(fn, "__code__", None) is not None and fn.__code__.co_name == "wrapped_fn" and seen < 4:
        inner = cells(fn).get("func")
        if inner is None:
            break
        fn, seen = inner, seen + 1
    return fn


def build_hook(kind: str, cells: dict[str, Any], count: Callable) -> Callable:
    """The 0.18.7 hook closure (PR #7886 shape) over the original closure's captured values."""
    opt = cells["self"]
    if kind == "stage12":
        param, i, used = cells["param"], cells["i"], cells["all_params_requiring_grad"]

        def grad_handling_hook(*notneeded):
            st = opt._backward_hook_state
            refresh = st.should_refresh_expected_hook_count()
            st.reenter_backward_if_needed()
            opt.process_gradients(param, i)
            current = count(used) if refresh else st.max_expected_hooks_seen
            st.update_hook_state_and_maybe_run_epilogue(current)

        return grad_handling_hook
    non_leaf, leaf_count = cells["non_leaf_params_requiring_grad"], cells["leaf_module_count"]
    if kind == "stage3":
        param = cells["param"]

        def reduce_partition_and_remove_grads(*notneeded):
            st = opt._backward_hook_state
            refresh = st.should_refresh_expected_hook_count()
            st.reenter_backward_if_needed()
            opt.reduce_ready_partitions_and_remove_grads(param)
            current = count(non_leaf) + leaf_count if refresh else st.max_expected_hooks_seen
            st.update_hook_state_and_maybe_run_epilogue(current)

        return reduce_partition_and_remove_grads
    params = cells["params"]

    def reduce_leaf_module_grads(module, grad_input, grad_output):
        import torch

        st = opt._backward_hook_state
        refresh = st.should_refresh_expected_hook_count()
        st.reenter_backward_if_needed()
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            opt.reduce_ready_partitions_and_remove_grads(param)
        current = count(non_leaf) + leaf_count if refresh else st.max_expected_hooks_seen
        st.update_hook_state_and_maybe_run_epilogue(current)

    return reduce_leaf_module_grads


@dataclass
class ClosureSwap:
    hooks: Any
    """The hook dictionary (``param._post_accumulate_grad_hooks`` or ``module._backward_hooks``)."""
    key: int
    original: Callable
    replacement: Callable
    leaf_deferral: bool = False
    """The replacement defers a z3 leaf module's reduction (`leaf_deferral.defer_leaf_hook`)."""


def plan_closure_swaps(opt: Any, row: CompatRow) -> list[ClosureSwap]:
    """Find every gradient / leaf hook of ``opt``; for count-every-hook releases, plan its replacement.

    Raises `ZerostateInstallError` when the hooks do not have the shape the table promises.
    """
    handles = list(getattr(opt, "_grad_acc_hooks", ()) or ()) + list(getattr(opt, "_leaf_module_hooks", ()) or ())
    swaps: list[ClosureSwap] = []
    for h in handles:
        ref = getattr(h, "hooks_dict_ref", None)
        hooks = ref() if ref is not None else None
        if hooks is None or h.id not in hooks:
            raise ZerostateInstallError(f"cannot locate the gradient hook behind handle {h!r}")
        fn = hooks[h.id]
        inner = unwrap(fn)
        kind = _HOOK_NAMES.get(getattr(getattr(inner, "__code__", None), "co_name", ""))
        if kind is None:
            raise UnsupportedEngineError(
                f"{type(opt).__name__} has a gradient hook zerostate.runtime does not know "
                f"({getattr(getattr(inner, '__code__', None), 'co_qualname', inner)!r}); the runtime covers the "
                f"closures of DeepSpeed's ZeRO stage 1/2/3 optimizers (a modified DeepSpeed or a new optimizer?)")
        gated = "should_refresh_expected_hook_count" in inner.__code__.co_names
        leaf = _leaf_params(inner) if kind == "stage3_leaf" else None
        if row.hook_closures == "refresh-gated":
            if not gated:
                raise ZerostateInstallError(
                    f"DeepSpeed's {inner.__code__.co_name} does not consult should_refresh_expected_hook_count, "
                    f"but the compatibility table says it does for {fmt(row.first)} <= version < {fmt(row.end)}")
            if leaf is not None:
                swaps.append(ClosureSwap(hooks, h.id, fn, defer_leaf_hook(fn, leaf, _leaf_autograd()), True))
            continue
        g = inner.__globals__
        if "count_used_parameters_in_backward" not in g:
            raise ZerostateInstallError(f"{inner.__code__.co_name}: count_used_parameters_in_backward not found")

        def count(params, _g=g):  # looked up at call time, as the original closure does
            return _g["count_used_parameters_in_backward"](params)

        new = build_hook(kind, cells(inner), count)
        if leaf is not None:
            new = defer_leaf_hook(new, leaf, _leaf_autograd())
        swaps.append(ClosureSwap(hooks, h.id, fn, new, leaf is not None))
    return swaps


def _leaf_params(inner: Callable) -> list:
    """The parameters a z3 leaf module's hook reduces (its captured ``params``); refuses another shape."""
    code = inner.__code__
    params = cells(inner).get("params")
    if code.co_argcount != 3 or not isinstance(params, (list, tuple)):
        raise UnsupportedEngineError(
            f"DeepSpeed's z3 leaf-module hook {code.co_name} does not have the shape zerostate.runtime defers "
            f"(a full backward hook (module, grad_input, grad_output) over a captured list `params`; got "
            f"{code.co_argcount} arguments, params {type(params).__name__}). Nothing was changed.")
    return list(params)


def _leaf_autograd():
    try:
        return leaf_autograd()
    except MissingTorchInternalsError as e:
        raise ZerostateInstallError(f"{e} Nothing was changed.") from None


__all__ = ["ClosureSwap", "build_hook", "plan_closure_swaps"]
