"""The ZeRO-3 reuse walk that decides leaf-ness per module: the runtime's fix of ``z3-leaf-kept-gathered``.

``PartitionedParameterCoordinator.__params_to_release(submodule_to_release, step_id)`` (every release
0.18.4 - 0.19.8, the same body) keeps gathered every parameter a module later in the COMPLETE trace uses
again.  It walks those later modules with ``iter_params(module, recurse=z3_leaf_module(submodule_to_release))``:
the leaf-ness of the module being *released* decides, so when a z3 leaf module is released every later
module -- the root, recorded at the start of backward, included -- is walked recursively, all of the leaf's
parameters look reused and none is released after its forward.  A leaf whose backward never runs stays
gathered after the backward (known issue ``z3-leaf-kept-gathered``, ``known/issues.py``;
upstream patch ``docs/upstream/z3-leaf-kept-gathered/fix.patch``).

`fixed_params_to_release` is DeepSpeed's body with the one-line fix, ``recurse=z3_leaf_module(module)``,
memoised per (module, step id) for the installation's lifetime and returning the cached set itself, as
DeepSpeed's ``functools.lru_cache`` does (``release_sub_module`` may add to it).  `install` puts it on the
coordinator *instance* (``_PartitionedParameterCoordinator__params_to_release``) with the release policy:
the model's ``zerostate`` coordinator design (``leaf_walk_fixed``), checked on real DeepSpeed by
``generated_tests/test_runtime_release_refinement.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ATTRIBUTES", "PARAMS_TO_RELEASE", "fixed_params_to_release"]

_MANGLE = "_PartitionedParameterCoordinator__"
PARAMS_TO_RELEASE = _MANGLE + "params_to_release"
ATTRIBUTES = tuple(_MANGLE + a for a in ("params_to_release", "submodule_order",
                                         "most_recent_step_id_param_fetched_for", "max_reuse_dist_in_numel"))
"""What the fix reads on the coordinator (checked before anything is installed)."""


def fixed_params_to_release(coord: Any) -> Callable[[Any, int], set]:
    """``coord.__params_to_release`` with the reuse walk's leaf-ness taken from each walked module."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
    from deepspeed.utils import z3_leaf_module

    cache: dict[tuple[int, int], set] = {}

    def params_to_release(submodule_to_release: Any, step_id: int) -> set:
        key = (id(submodule_to_release), step_id)
        if key in cache:
            return cache[key]
        if not coord.is_complete_trace():
            raise RuntimeError("expected trace to be complete")
        own = list(iter_params(submodule_to_release, recurse=z3_leaf_module(submodule_to_release)))
        out = {p.ds_id for p in own if not p.ds_persist}
        fetched_for = getattr(coord, _MANGLE + "most_recent_step_id_param_fetched_for")
        for p in own:  # a reuse the prefetcher already skipped past: keep it (DeepSpeed's comment)
            if fetched_for[p] > step_id:
                out.discard(p.ds_id)
        traversed, limit = 0, getattr(coord, _MANGLE + "max_reuse_dist_in_numel")
        for module in getattr(coord, _MANGLE + "submodule_order")[step_id:]:
            if traversed >= limit:
                break
            for p in iter_params(module, recurse=z3_leaf_module(module)):  # the fix: this module's leaf-ness
                out.discard(p.ds_id)
                traversed += p.ds_numel
        cache[key] = out
        return out

    return params_to_release
