"""The z3 leaf-module hook deferral: the runtime's fix of DeepSpeed's ``z3-leaf-input-without-grad``.

ZeRO-3 registers ``reduce_leaf_module_grads`` as each z3 leaf module's *full backward hook*
(``stage3.py`` ``create_reduce_and_remove_grad_hooks``, every release 0.18.4 - 0.19.8).  When no input
of the module requires grad, torch runs that hook as soon as the gradient of the module's *output* is
known -- before the module's own backward has produced its parameters' gradients.  The hook then
zero-fills the still-partitioned (size 0) ``.grad`` and reduces it; the real gradients cannot
accumulate afterwards (``RuntimeError: The size of tensor a (0) must match ...``).  Known issue
``z3-leaf-input-without-grad`` (``known/issues.py``); upstream patch and evidence in
``docs/upstream/z3-leaf-input-without-grad/``.

`defer_leaf_hook` wraps DeepSpeed's hook (or, on 0.18.5 / 0.18.6, the replacement closure
``hook_closures`` builds) as the patch does: when the hook fires with every ``grad_input`` None, it
finds the leaf's parameters whose gradient accumulation the running backward will still execute
(``torch._C._will_engine_execute_node`` on each parameter's AccumulateGrad node, as DeepSpeed's
``count_used_parameters_in_backward`` does) and runs the wrapped hook once all of them have
accumulated (one-shot post-accumulate-grad hooks); with none pending it runs it at once.  The wrapped
hook is called unchanged, with the same arguments, in the same backward, so the leaf still counts
once.  This is the model's ``zerostate`` hook design (``_leaf_hook_zerostate`` in
``zerostate.model.hook_designs``), checked event by event by ``generated_tests/test_runtime_refinement.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

from .hook_state_manager import MissingTorchInternalsError

__all__ = ["LeafAutograd", "Wrapper", "defer_leaf_hook", "leaf_autograd"]


class LeafAutograd:
    """The autograd internals the deferral needs, bound once (a refinement test passes its own):

    * ``pending(params)``: the parameters whose AccumulateGrad node the running backward will execute
      (``torch.autograd.graph._get_grad_fn_or_grad_acc``, ``torch._C._will_engine_execute_node``);
    * ``after_accumulated(param, fn)``: ``param.register_post_accumulate_grad_hook(fn)`` (a handle).
    """

    def __init__(self) -> None:
        import torch

        missing = []
        will = getattr(torch._C, "_will_engine_execute_node", None)
        if will is None:
            missing.append("torch._C._will_engine_execute_node")
        node_of: Callable[[Any], Any] | None
        try:
            from torch.autograd.graph import _get_grad_fn_or_grad_acc as node_of
        except ImportError:
            node_of = None
            missing.append("torch.autograd.graph._get_grad_fn_or_grad_acc")
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            missing.append("torch.Tensor.register_post_accumulate_grad_hook")
        if missing:
            raise MissingTorchInternalsError(
                f"zerostate.runtime needs PyTorch autograd internals that this build (torch {torch.__version__}) "
                f"does not have: {', '.join(missing)}. It defers a ZeRO-3 z3 leaf module's gradient reduction "
                "until the gradients the running backward will still accumulate have accumulated "
                "(DeepSpeed's z3-leaf-input-without-grad).")
        assert will is not None and node_of is not None  # else ``missing`` named them
        self._torch = torch
        self._will = will
        self._node: Callable[[Any], Any] = node_of

    def pending(self, params: list) -> list:
        out = []
        for p in params:
            if not p.requires_grad:
                continue
            with self._torch.enable_grad():  # backward hooks run with grad mode off; older torch needs it on
                node = self._node(p)
            if node is not None and self._will(node):
                out.append(p)
        return out

    def after_accumulated(self, param: Any, fn: Callable[[Any], None]) -> Any:
        return param.register_post_accumulate_grad_hook(fn)


_LEAF: LeafAutograd | None = None


def leaf_autograd() -> LeafAutograd:
    """The process's `LeafAutograd` (raises `MissingTorchInternalsError` naming what this torch lacks)."""
    global _LEAF  # noqa: PLW0603 -- built on first use: it probes torch internals that may be missing
    if _LEAF is None:
        _LEAF = LeafAutograd()
    return _LEAF


def _run_after_accumulated(params: list, fn: Callable[[], None], autograd: Any) -> None:
    """Run ``fn`` once, right after the gradients of all ``params`` have been accumulated."""
    left = {id(p) for p in params}
    handles: list = []

    def accumulated(param: Any) -> None:
        if id(param) not in left:
            return
        left.discard(id(param))
        if not left:
            for h in handles:
                h.remove()  # torch iterates over a copy of the hooks (pytorch#58354): safe inside a hook
            fn()

    for p in params:
        handles.append(autograd.after_accumulated(p, accumulated))


class Wrapper(Protocol):
    """A hook standing in for another one, which it names as ``__wrapped__`` (as `functools.wraps` does)."""

    __wrapped__: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def defer_leaf_hook(hook: Callable, params: list, autograd: Any) -> Wrapper:
    """``hook`` (a z3 leaf module's full backward hook over ``params``), deferred while gradients it
    would reduce are still to accumulate (z3-leaf-input-without-grad)."""

    def leaf_module_backward_hook(module, grad_input, grad_output):
        if all(g is None for g in grad_input):  # no input requires grad: fired on the output's gradient
            pending = autograd.pending(params)
            if pending:
                _run_after_accumulated(pending, lambda: hook(module, grad_input, grad_output), autograd)
                return None
        return hook(module, grad_input, grad_output)

    wrapper: Wrapper = cast(Wrapper, leaf_module_backward_hook)
    wrapper.__wrapped__ = hook
    return wrapper
