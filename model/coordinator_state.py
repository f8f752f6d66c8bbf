"""The ZeRO-3 parameter coordinator's state: an immutable record, small and hashable.

Fields mirror ``PartitionedParameterCoordinator`` (``runtime/zero/partitioned_param_coordinator.py``,
DeepSpeed 0.19.x) and the ``ds_*`` attributes it keeps on parameters and modules.  Everything is
indexed by position (parameters and hooked modules in `CoordIndex` order), so a state is a handful
of short tuples: cheap to hash inside the explorer's breadth-first search.

`CoordIndex` holds the static facts of one network (names, sizes, which parameters are frozen or
persistent, which module fetches which parameters) and the parameter trace derived from a recorded
module order.  It is built once per `Network` and cached on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from .network import HEAD, ROOT, params_of_module

if TYPE_CHECKING:
    from .network import Network


class ParamStatus(IntEnum):
    """A ZeRO-3 parameter's ``ds_status`` (``ZeroParamStatus``), and what it means for memory."""

    NOT_AVAILABLE = 0
    """Partitioned: ``param.data`` is an empty tensor; the rank keeps only its shard (``ds_tensor``)."""
    INFLIGHT = 1
    """An all-gather was issued (a prefetch): the full tensor's memory is allocated, not yet usable."""
    AVAILABLE = 2
    """Gathered: the full tensor is in memory and usable; it stays until released (or forever if persistent)."""


class TraceMode(IntEnum):
    """The coordinator's module trace (``ZeRoTraceMode``): whether prefetch may follow a recorded order."""

    INVALID = 0
    """No usable trace: every parameter is released at its module's post-hook; no prefetch."""
    RECORD = 1
    """The first step records the module order; releases are still per module, no prefetch."""
    COMPLETE = 2
    """The order is known: prefetch ahead of it, keep a parameter whose next use is within the reuse distance."""


NOT_AVAILABLE, INFLIGHT, AVAILABLE = ParamStatus.NOT_AVAILABLE, ParamStatus.INFLIGHT, ParamStatus.AVAILABLE
STATUS_NAMES = tuple(s.name for s in ParamStatus)
INVALID, RECORD, COMPLETE = TraceMode.INVALID, TraceMode.RECORD, TraceMode.COMPLETE
MODE_NAMES = tuple(m.name for m in TraceMode)

HOLD = -2
"""Holder id of the zerostate design's hold (the runtime's ``HOLD_ID`` sentinel) in a parameter's holders
(module indices, all >= 0)."""
HOLD_NAME = "zerostate-hold"

NEVER = -1
"""``fetched_for`` of a parameter never fetched yet (a step id; step ids are >= 0), standing for the
``__most_recent_step_id_param_fetched_for`` default (DeepSpeed uses -1e10)."""

DS_DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000
"""``stage3_max_reuse_distance``'s default (DeepSpeed 0.18.4 .. 0.19.8, ``zero/config.py``)."""
DS_DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000
"""``stage3_max_live_parameters``'s default."""


class CoordIndex:
    """Static facts of one network, by position.  Use `index_for`."""

    def __init__(self, net: Network):
        self.params: tuple[str, ...] = tuple(net.params)
        self.pidx = {p: i for i, p in enumerate(self.params)}
        infos = [net.params[p] for p in self.params]
        self.numel = tuple(i.numel for i in infos)
        self.persistent = tuple(i.persistent for i in infos)
        self.frozen = tuple(i.frozen for i in infos)
        mods = [ROOT]
        boxes = []  # the parameter-less Block containers of non-leaf blocks (also hooked by ZeRO-3)
        for i in range(len(net.scenario.blocks)):
            mods.append(f"blocks.{i}")
            if not net.is_leaf(i):
                boxes.append(len(mods) - 1)
                mods += [m.name for m in net.block_modules(i)]
        if net.scenario.fused_head:
            mods.append(HEAD)
        self.modules: tuple[str, ...] = tuple(mods)
        self.midx = {m: i for i, m in enumerate(self.modules)}
        # iter_params(module, recurse=leaf): sorted by ds_id (= registration order) as record_parameters does
        subtree = tuple(tuple(sorted(self.pidx[p] for p in params_of_module(m) if p in self.pidx))
                        for m in self.modules)
        self.containers = frozenset(boxes)
        """Module indices of the ``Block`` containers: they own no parameter (``iter_params(recurse=False)``
        is empty), but each recursively holds its block's."""
        self.module_params: tuple[tuple[int, ...], ...] = tuple(
            () if mi in self.containers else ps for mi, ps in enumerate(subtree))
        self.output_requires_grad = tuple(self._out_rg(net, m) for m in self.modules)
        self.nonreentrant = tuple(self._nonreentrant(net, m) for m in self.modules)
        """Whether the module is inside a block recomputed by a non-reentrant checkpoint."""
        self.n = len(self.params)
        owner = [0] * self.n
        for mi, ps in enumerate(self.module_params):
            for p in ps:
                owner[p] = mi
        self.owner: tuple[int, ...] = tuple(owner)
        """The hooked module that fetches each parameter (the module that computes with it)."""
        self._param_trace: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}
        sc = net.scenario
        self.max_reuse_distance: int = sc.max_reuse_distance
        """``stage3_max_reuse_distance`` (DeepSpeed's default 1e9, `DS_DEFAULT_MAX_REUSE_DISTANCE`)."""
        self.max_live_parameters: int = sc.max_live_parameters
        """``stage3_max_live_parameters`` (DeepSpeed's default 1e9, `DS_DEFAULT_MAX_LIVE_PARAMETERS`)."""
        root = self.midx[ROOT]
        everything = tuple(range(self.n))
        leafs = {self.midx[f"blocks.{i}"] for i in range(len(sc.blocks)) if net.is_leaf(i)}
        # iter_params(module, recurse) per module: the root, a z3 leaf *block* and a Block container own no
        # parameter directly; recursively the root has every parameter and a block all of its own.
        self.iter_params: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = (
            tuple(() if (mi == root or mi in leafs) else ps for mi, ps in enumerate(self.module_params)),
            tuple(everything if mi == root else ps for mi, ps in enumerate(subtree)))
        """``iter_params(module, recurse=False / True)`` per module index (``[recurse][module]``)."""
        self.leaf_modules = frozenset(leafs)

    @staticmethod
    def _out_rg(net: Network, module: str) -> bool:
        """Whether the module's (re)computed output requires grad (so its ops saved tensors for backward)."""
        if module in (ROOT, HEAD):
            return net.loss_requires_grad
        i = int(module.split(".")[1])
        for g in net.hook_groups(i):
            if g.module == module:
                return g.output_requires_grad
        return False

    @staticmethod
    def _nonreentrant(net: Network, module: str) -> bool:
        parts = module.split(".")
        if parts[0] != "blocks":
            return False
        return net.scenario.blocks[int(parts[1])].checkpoint.value == "non_reentrant"

    def param_trace(self, order: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """``construct_parameter_trace_from_module_trace``: ``(param, step_id_last_used_at)`` per recorded
        module occurrence, each module's parameters sorted by ds_id."""
        got = self._param_trace.get(order)
        if got is None:
            got = tuple((p, step) for step, m in enumerate(order) for p in self.module_params[m])
            self._param_trace[order] = got
        return got


def index_for(net: Network) -> CoordIndex:
    """The `CoordIndex` of ``net``, built once and kept on it (the network knows nothing of the coordinator)."""
    index: CoordIndex | None = net.__dict__.get("_coord_index")
    if index is None:
        index = net.__dict__["_coord_index"] = CoordIndex(net)
    return index


@dataclass(frozen=True)
class CoordState:
    """One coordinator state.  See the module docstring; every field names its DeepSpeed counterpart."""

    status: tuple[int, ...]
    """``param.ds_status`` per parameter."""
    holders: tuple[frozenset[int], ...]
    """``param.ds_active_sub_modules`` per parameter (module indices; `HOLD` is the zerostate hold)."""
    mode: int = INVALID
    """``__trace_mode`` (INVALID / RECORD / COMPLETE)."""
    step_id: int = 0
    """``__step_id``: module fetches since the root forward's ``reset_step``."""
    order: tuple[int, ...] = ()
    """``__submodule_order``: the recorded module trace (being recorded while RECORD)."""
    queue: int = 0
    """Position in the parameter trace of ``__param_queue`` (its popped prefix)."""
    fetched_for: tuple[int, ...] = ()
    """``__most_recent_step_id_param_fetched_for`` per parameter (`NEVER` when unset)."""
    cache: tuple[tuple[tuple[int, int], frozenset[int]], ...] = ()
    """``functools.lru_cache`` of ``__params_to_release(module, step_id)``: never cleared in DeepSpeed."""
    stack: tuple[int, ...] = ()
    """0.19.3+ ``__active_backward_submodules``: backward modules in progress, in insertion order."""
    recompute: tuple[tuple[int, frozenset[int]], ...] = ()
    """0.19.3 ``module.ds_recompute_parameters`` (only modules with some), sorted by module."""
    held: tuple[tuple[int, frozenset[int]], ...] = ()
    """zerostate: parameters held for a module's backward (the runtime policy's ``holds``)."""
    declared: bool = False
    """Persistent parameters have been declared (PERSISTENT events) to the trace."""
    live: int = 0
    """``__n_available_params``: elements the coordinator gathered minus those it released since the last
    ``reset_step`` (it may drift below 0: persistent parameters re-gathered by ``engine.step()`` are not
    counted, their releases are).  Bounds prefetch by ``stage3_max_live_parameters``."""

    @staticmethod
    def initial(index: CoordIndex) -> CoordState:
        """zero.Init partitions every parameter; nothing is held; the trace starts INVALID."""
        return CoordState(status=(NOT_AVAILABLE,) * index.n, holders=(frozenset(),) * index.n,
                          fetched_for=(NEVER,) * index.n)

    def with_(self, **changes: Any) -> CoordState:
        return replace(self, **changes)

    def observable(self, index: CoordIndex) -> dict[str, Any]:
        """DeepSpeed's names for what a traced engine exposes (for refinement tests and reports)."""
        return {
            "ds_status": {index.params[i]: STATUS_NAMES[s] for i, s in enumerate(self.status)},
            "ds_active_sub_modules": {index.params[i]: sorted(HOLD_NAME if h == HOLD else index.modules[h] for h in hs)
                                      for i, hs in enumerate(self.holders) if hs},
            "trace_mode": MODE_NAMES[self.mode],
            "step_id": self.step_id,
            "submodule_order": [index.modules[m] for m in self.order],
            "active_backward_submodules": [index.modules[m] for m in self.stack],
        }


def lookup(pairs: tuple[tuple[int, frozenset[int]], ...], key: int) -> frozenset[int]:
    for k, v in pairs:
        if k == key:
            return v
    return frozenset()


def assign(pairs: tuple[tuple[int, frozenset[int]], ...], key: int,
           value: frozenset[int]) -> tuple[tuple[int, frozenset[int]], ...]:
    """Set ``key`` to ``value`` in a sorted pair tuple (an empty value removes the key)."""
    rest = [(k, v) for k, v in pairs if k != key]
    if value:
        rest.append((key, value))
    return tuple(sorted(rest, key=lambda kv: kv[0]))


__all__ = ["AVAILABLE", "COMPLETE", "DS_DEFAULT_MAX_LIVE_PARAMETERS", "DS_DEFAULT_MAX_REUSE_DISTANCE", "HOLD",
           "HOLD_NAME", "INFLIGHT", "INVALID", "MODE_NAMES", "NEVER", "NOT_AVAILABLE", "RECORD", "STATUS_NAMES",
           "CoordIndex", "CoordState", "ParamStatus", "TraceMode", "assign", "index_for", "lookup"]
