"""Install the zerostate runtime into a live DeepSpeed engine, and take it out again.

``install(engine)`` changes only that engine's objects:

1. the hook state: ``engine.optimizer._backward_hook_state`` becomes a
   `ZerostateBackwardHookState` carrying the old manager's post hooks and counters;
2. on releases whose gradient hooks call ``count_used_parameters_in_backward`` in
   every hook (0.18.5, 0.18.6), each hook function is replaced *in its hook
   dictionary* (``param._post_accumulate_grad_hooks`` / ``module._backward_hooks``,
   same key, same order) by the 0.18.7-shaped closure that asks the hook state
   whether to count -- and the zerostate hook state never asks;
3. under ZeRO-3 (0.19.0 on), the recompute release policy (`release_policy`).

Every original is recorded; ``uninstall(engine)`` puts back the identical objects
(the original manager, the original hook functions under their original keys, the
instance attributes as they were).  Installing twice is a no-op.  An unsupported
DeepSpeed release, a missing PyTorch internal, an engine the design does not cover
(`engine_support`: no ZeRO optimizer, ``BF16_Optimizer``, NVMe offload, gradient hooks of
an unknown shape) or an engine in the middle of a backward is refused with a clear error
*before anything is changed*; under `patch_deepspeed` such an engine gets one warning and
stays stock -- ``deepspeed.initialize`` never raises because of the runtime (issue 10).

Supported engines: ZeRO stage 1, 2 and 3 (``DeepSpeedZeroOptimizer``,
``DeepSpeedZeroOptimizer_Stage3``) in fp32, bf16 or fp16, with or without CPU offload of
the optimizer state (``offload_optimizer``) and, under ZeRO-3, of the parameters
(``offload_param``): their gradient hooks are the closures of the table below whatever
the precision or offload device.

Parameters frozen or unfrozen after install: the release policy's frozen set is
re-collected (the policy re-installed through its public API) at the first root forward
after any ``requires_grad`` changed; a parameter made trainable after
``deepspeed.initialize`` gets a warning -- DeepSpeed registered no gradient hook for it.

Each install logs one INFO line on the ``zerostate.runtime`` logger (release, stage, what
was changed); each refusal under `patch_deepspeed` one WARNING.

All version knowledge lives in `COMPAT` below: the rows of the project's one era table
(`zerostate.model.eras.ERAS`) that the runtime supports.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from zerostate.model.eras import ERAS, UnknownRelease, parse_release

from .hook_state import MissingTorchInternalsError, TorchAutograd, ZerostateBackwardHookState
from .release_policy import (ReleasePolicyState, check_release_policy_supported, install_release_policy,
                             uninstall_release_policy)

__all__ = ["COMPAT", "Installation", "UnsupportedDeepSpeedError", "UnsupportedEngineError", "ZerostateInstallError",
           "engine_support", "install", "installation", "is_installed", "patch_deepspeed", "supported_range",
           "uninstall", "unpatch_deepspeed"]

log = logging.getLogger("zerostate.runtime")


# ----------------------------------------------------------------- the table
@dataclass(frozen=True)
class CompatRow:
    first: tuple[int, int, int]
    end: tuple[int, int, int]
    """Exclusive."""
    hook_closures: str
    """``count-every-hook``: closures call count_used_parameters_in_backward unconditionally and are
    replaced; ``refresh-gated``: closures ask ``should_refresh_expected_hook_count`` first (kept)."""
    release_policy: str | None
    """``plain`` (no recompute attribution), ``owner-attribution`` (PR #8148), or None (not supported)."""
    note: str


COMPAT: tuple[CompatRow, ...] = tuple(
    CompatRow(e.first, e.end, e.runtime_hooks, e.runtime_release_policy, e.note) for e in ERAS if e.runtime_hooks)
"""The runtime's rows of the era table (0.18.5 <= version < 0.19.9).  Releases outside every row are refused."""


def supported_range() -> str:
    return f"{_fmt(COMPAT[0].first)} <= version < {_fmt(COMPAT[-1].end)}"


def _release_policy_range() -> str:
    return f"{_fmt(next(r.first for r in COMPAT if r.release_policy))} <= version < {_fmt(COMPAT[-1].end)}"


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def parse_version(version: str) -> tuple[int, int, int]:
    try:
        return parse_release(version)
    except UnknownRelease as exc:
        raise UnsupportedDeepSpeedError(f"{exc}; zerostate.runtime supports DeepSpeed {supported_range()}. "
                                        "Nothing was changed.") from None


def compat_row(version: str) -> CompatRow:
    v = parse_version(version)
    for row in COMPAT:
        if row.first <= v < row.end:
            return row
    raise UnsupportedDeepSpeedError(
        f"zerostate.runtime supports DeepSpeed {supported_range()} (hook state) and {_release_policy_range()} "
        f"(ZeRO-3 recompute release policy); the installed DeepSpeed is {version}. Nothing was changed.")


class ZerostateInstallError(RuntimeError):
    """install() refused; nothing was changed."""


class UnsupportedDeepSpeedError(ZerostateInstallError):
    """The DeepSpeed release is outside `COMPAT`."""


class UnsupportedEngineError(ZerostateInstallError):
    """The engine is one the zerostate design does not cover (see `engine_support`)."""


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
      closures of `COMPAT` (install raised "unexpected ZeRO gradient hook" inside
      ``deepspeed.initialize`` before issue 10);
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


# ------------------------------------------------------------ the closures
_HOOK_NAMES = {"grad_handling_hook": "stage12", "reduce_partition_and_remove_grads": "stage3",
               "reduce_leaf_module_grads": "stage3_leaf"}


def _cells(fn: Callable) -> dict[str, Any]:
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


def _unwrap(fn: Callable) -> Callable:
    """Strip DeepSpeed's ``instrument_w_nvtx`` wrapper (``wrapped_fn`` closing over ``func``)."""
    seen = 0
    while getattr(fn, "__code__", None) is not None and fn.__code__.co_name == "wrapped_fn" and seen < 4:
        inner = _cells(fn).get("func")
        if inner is None:
            break
        fn, seen = inner, seen + 1
    return fn


def _build_hook(kind: str, cells: dict[str, Any], count: Callable) -> Callable:
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
class _Swap:
    hooks: Any
    """The hook dictionary (``param._post_accumulate_grad_hooks`` or ``module._backward_hooks``)."""
    key: int
    original: Callable
    replacement: Callable


def _plan_closure_swaps(opt: Any, row: CompatRow) -> list[_Swap]:
    """Find every gradient / leaf hook of ``opt``; for count-every-hook releases, plan its replacement.

    Raises `ZerostateInstallError` when the hooks do not have the shape the table promises.
    """
    handles = list(getattr(opt, "_grad_acc_hooks", ()) or ()) + list(getattr(opt, "_leaf_module_hooks", ()) or ())
    swaps: list[_Swap] = []
    for h in handles:
        ref = getattr(h, "hooks_dict_ref", None)
        hooks = ref() if ref is not None else None
        if hooks is None or h.id not in hooks:
            raise ZerostateInstallError(f"cannot locate the gradient hook behind handle {h!r}")
        fn = hooks[h.id]
        inner = _unwrap(fn)
        kind = _HOOK_NAMES.get(getattr(getattr(inner, "__code__", None), "co_name", ""))
        if kind is None:
            raise UnsupportedEngineError(
                f"{type(opt).__name__} has a gradient hook zerostate.runtime does not know "
                f"({getattr(getattr(inner, '__code__', None), 'co_qualname', inner)!r}); the runtime covers the "
                f"closures of DeepSpeed's ZeRO stage 1/2/3 optimizers (a modified DeepSpeed or a new optimizer?)")
        gated = "should_refresh_expected_hook_count" in inner.__code__.co_names
        if row.hook_closures == "refresh-gated":
            if not gated:
                raise ZerostateInstallError(
                    f"DeepSpeed's {inner.__code__.co_name} does not consult should_refresh_expected_hook_count, "
                    f"but the compatibility table says it does for {_fmt(row.first)} <= version < {_fmt(row.end)}")
            continue
        g = inner.__globals__
        if "count_used_parameters_in_backward" not in g:
            raise ZerostateInstallError(f"{inner.__code__.co_name}: count_used_parameters_in_backward not found")

        def count(params, _g=g):  # looked up at call time, as the original closure does
            return _g["count_used_parameters_in_backward"](params)

        swaps.append(_Swap(hooks, h.id, fn, _build_hook(kind, _cells(inner), count)))
    return swaps


# --------------------------------------------------------- the installation
@dataclass
class Installation:
    """What install() changed on one engine (everything uninstall() needs to put back)."""

    version: str
    row: CompatRow
    optimizer: Any
    original_manager: Any
    manager: ZerostateBackwardHookState
    swaps: list[_Swap] = field(default_factory=list)
    release: ReleasePolicyState | None = None
    engine_ref: Any = None
    """weakref to the engine (the frozen-set refresh re-installs the release policy on it)."""
    requires_grad: tuple[bool, ...] = ()
    """``requires_grad`` of every module parameter when last checked (install, then each root forward)."""
    trainable_at_install: frozenset[int] = frozenset()
    refresh_handle: Any = None
    refreshes: int = 0
    """How many times a ``requires_grad`` change re-collected the release policy's frozen set."""

    @property
    def release_policy(self) -> bool:
        return self.release is not None

    def describe(self) -> str:
        """What this installation changed, in one line (the install log line)."""
        parts = [f"hook state {type(self.manager).__name__} on {type(self.optimizer).__name__}"]
        if self.swaps:
            parts.append(f"{len(self.swaps)} gradient-hook closures replaced (count in every hook, #7882)")
        else:
            parts.append("DeepSpeed's gradient-hook closures kept")
        if self.release is not None:
            parts.append(f"ZeRO-3 recompute release policy on {len(self.release.frozen_of)} modules with frozen "
                         f"parameters ({self.row.release_policy})")
        return "; ".join(parts)


_INSTALLED: "weakref.WeakKeyDictionary[Any, Installation]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def installation(engine: Any) -> Installation | None:
    return _INSTALLED.get(engine)


def is_installed(engine: Any) -> bool:
    return engine in _INSTALLED


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def install(engine: Any, *, release_policy: bool | None = None) -> Installation:
    """Install the zerostate hook state (and, under ZeRO-3, the release policy) into ``engine``.

    ``release_policy``: None (default) installs it when the engine is ZeRO-3 and the
    release supports it; True requires it (error otherwise); False skips it.
    Returns the `Installation` record; a second call returns the same record.
    """
    with _LOCK:
        done = _INSTALLED.get(engine)
        if done is not None:
            return done
        # ---- every check first; nothing is changed until all pass
        version = _deepspeed_version()
        row = compat_row(version)
        try:
            autograd = TorchAutograd()
        except MissingTorchInternalsError as e:
            raise ZerostateInstallError(str(e)) from None
        why_not = engine_support(engine)
        if why_not:
            raise UnsupportedEngineError(f"{why_not}. Nothing was changed.")
        opt = engine.optimizer
        old = opt._backward_hook_state
        if getattr(old, "backward_active_depth", 0):
            raise ZerostateInstallError("install() called during a backward (backward_active_depth > 0); "
                                        "install between train steps. Nothing was changed.")
        swaps = _plan_closure_swaps(opt, row)
        want_release = release_policy
        why = check_release_policy_supported(engine) if want_release is not False else "not requested"
        if want_release is None:
            want_release = why is None and row.release_policy is not None
        elif want_release:
            if row.release_policy is None:
                raise ZerostateInstallError(
                    f"the zerostate release policy supports DeepSpeed {_release_policy_range()}; "
                    f"installed {version}. Nothing was changed.")
            if why:
                raise ZerostateInstallError(f"release policy: {why}. Nothing was changed.")
        module = getattr(engine, "module", None)
        params = list(module.parameters()) if module is not None else []
        # ---- apply (all or nothing: any failure puts back what was done so far)
        manager = ZerostateBackwardHookState.from_manager(old, autograd)
        inst = Installation(version, row, opt, old, manager, engine_ref=weakref.ref(engine),
                            requires_grad=tuple(p.requires_grad for p in params),
                            trainable_at_install=frozenset(id(p) for p in params if p.requires_grad))
        try:
            opt._backward_hook_state = manager
            for s in swaps:
                s.hooks[s.key] = s.replacement
                inst.swaps.append(s)
            if want_release:
                inst.release = install_release_policy(engine)
            if module is not None:
                inst.refresh_handle = module.register_forward_pre_hook(
                    functools.partial(_refresh_frozen_set, weakref.ref(inst)), prepend=True)
        except BaseException:
            _undo(inst)
            raise
        _INSTALLED[engine] = inst
        log.info("zerostate.runtime installed into DeepSpeed %s ZeRO-%s engine: %s", version,
                 _stage(engine), inst.describe())
        return inst


def _stage(engine: Any) -> Any:
    fn = getattr(engine, "zero_optimization_stage", None)
    return fn() if callable(fn) else "?"


def _refresh_frozen_set(inst_ref: "weakref.ref[Installation]", module: Any, args: Any) -> None:
    """Root forward pre-hook: when a parameter's ``requires_grad`` changed since the last check,
    re-collect the release policy's frozen set (uninstall + install through its public API; at a
    root forward no hold is in flight that the next ``reset_step`` would not drop anyway)."""
    inst = inst_ref()
    if inst is None:
        return
    params = list(module.parameters())
    now = tuple(p.requires_grad for p in params)
    if now == inst.requires_grad:
        return
    import torch

    if torch._C._current_graph_task_id() != -1:
        return  # inside a backward (a recompute): wait for the next root forward
    with _LOCK:
        inst.requires_grad = now
        late = [p for p in params if p.requires_grad and id(p) not in inst.trainable_at_install]
        if late:
            log.warning("zerostate.runtime: %d parameter(s) became trainable after install; DeepSpeed's ZeRO "
                        "optimizer registers gradient hooks and optimizer partitions in deepspeed.initialize only, "
                        "so DeepSpeed may not train them", len(late))
            inst.trainable_at_install = inst.trainable_at_install | {id(p) for p in late}
        engine = inst.engine_ref() if inst.engine_ref is not None else None
        if inst.release is not None and engine is not None:
            uninstall_release_policy(inst.release)
            inst.release = None
            inst.release = install_release_policy(engine)
            inst.refreshes += 1
            log.info("zerostate.runtime: requires_grad changed; release policy frozen set re-collected "
                     "(%d modules with frozen parameters)", len(inst.release.frozen_of))


def _undo(inst: Installation) -> None:
    if inst.refresh_handle is not None:
        inst.refresh_handle.remove()
        inst.refresh_handle = None
    if inst.release is not None:
        uninstall_release_policy(inst.release)
        inst.release = None
    for s in reversed(inst.swaps):
        if s.hooks.get(s.key) is s.replacement:
            s.hooks[s.key] = s.original
    if inst.optimizer._backward_hook_state is inst.manager:
        inst.manager.copy_state_to(inst.original_manager)
        inst.optimizer._backward_hook_state = inst.original_manager


def uninstall(engine: Any) -> bool:
    """Restore everything install() changed on ``engine``.  Returns False if it was not installed."""
    with _LOCK:
        inst = _INSTALLED.pop(engine, None)
        if inst is None:
            return False
        _undo(inst)
        return True


# ------------------------------------------------- before deepspeed.initialize
class _Patch:
    def __init__(self, module: Any, original: Callable, kwargs: dict) -> None:
        self.module, self.original, self.kwargs = module, original, kwargs
        self.engines: "weakref.WeakSet[Any]" = weakref.WeakSet()


_PATCH: _Patch | None = None


def _is_zero_engine(engine: Any) -> bool:
    return getattr(getattr(engine, "optimizer", None), "_backward_hook_state", None) is not None


def _log_install(engine: Any, inst: Installation) -> None:
    """With ``ZEROSTATE_RUNTIME_LOG=<path>``, append one line per engine patch_deepspeed installed into."""
    import os

    path = os.environ.get("ZEROSTATE_RUNTIME_LOG")
    if not path:
        return
    stage = getattr(getattr(engine, "zero_optimization_stage", None), "__call__", lambda: "?")()
    try:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} deepspeed={inst.version} stage={stage} release_policy={inst.release_policy} "
                    f"closures_replaced={len(inst.swaps)}\n")
    except OSError as e:
        log.warning("zerostate.runtime: cannot append to ZEROSTATE_RUNTIME_LOG=%s: %s", path, e)


def _install_or_warn(engine: Any, patch: _Patch) -> Installation | None:
    """install() for an engine ``deepspeed.initialize`` built: a refusal, or any failure, is a
    warning and the engine stays stock -- the runtime never breaks the user's ``initialize``."""
    try:
        inst = install(engine, **patch.kwargs)
    except ZerostateInstallError as e:
        log.warning("zerostate.runtime not installed; this engine runs stock DeepSpeed: %s", e)
        return None
    except Exception as e:  # noqa: BLE001 - install() undid its own changes before re-raising
        log.warning("zerostate.runtime not installed (unexpected %s: %s); this engine runs stock DeepSpeed",
                    type(e).__name__, e, exc_info=True)
        return None
    patch.engines.add(engine)
    _log_install(engine, inst)
    return inst


def patch_deepspeed(**install_kwargs: Any) -> "contextlib.AbstractContextManager[None]":
    """Make every engine ``deepspeed.initialize`` builds get `install` (for trainers that build it).

    Usable as a plain call (``zerostate.runtime.patch_deepspeed()`` before ``Trainer(...)``) or
    as a context manager (restores ``deepspeed.initialize`` on exit).  Checks the DeepSpeed
    release first: an unsupported one raises here, before ``deepspeed.initialize`` is touched.
    Engines without a ZeRO optimizer are returned untouched; an engine `install` refuses
    (`engine_support`) gets one warning on the ``zerostate.runtime`` logger and stays stock.
    """
    global _PATCH
    import deepspeed

    compat_row(deepspeed.__version__)
    try:
        TorchAutograd()
    except MissingTorchInternalsError as e:
        raise ZerostateInstallError(str(e)) from None
    with _LOCK:
        if _PATCH is None:
            original = deepspeed.initialize
            patch = _Patch(deepspeed, original, install_kwargs)

            @functools.wraps(original)
            def initialize(*args, **kwargs):
                result = original(*args, **kwargs)
                engine = result[0] if isinstance(result, tuple) else result
                if _is_zero_engine(engine):
                    _install_or_warn(engine, patch)
                return result

            initialize.__zerostate_original__ = original  # type: ignore[attr-defined]
            deepspeed.initialize = initialize
            _PATCH = patch
    return _patch_context()


@contextlib.contextmanager
def _patch_context() -> Iterator[None]:
    try:
        yield
    finally:
        unpatch_deepspeed()


def unpatch_deepspeed(uninstall_engines: bool = False) -> bool:
    """Restore ``deepspeed.initialize``; optionally uninstall from the engines it built."""
    global _PATCH
    with _LOCK:
        patch = _PATCH
        if patch is None:
            return False
        patch.module.initialize = patch.original
        _PATCH = None
        if uninstall_engines:
            for e in list(patch.engines):
                uninstall(e)
        return True
