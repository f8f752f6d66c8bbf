"""`runtime.leaf_reuse_walk`, the runtime's fix of ``z3-leaf-kept-gathered``, on a stand-in coordinator: DeepSpeed's
own ``iter_params`` and ``z3_leaf_module`` walk plain torch modules (no engine, no process group).  Installed on a
real engine it is checked by test_runtime_release_refinement.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from zerostate.runtime.leaf_reuse_walk import ATTRIBUTES, fixed_params_to_release  # noqa: E402


def test_the_fixed_reuse_walk_takes_each_walked_modules_own_leafness():
    """`runtime.leaf_reuse_walk` on a stand-in coordinator: releasing a z3 leaf whose only later module in the
    trace is the (non-leaf) root releases the leaf's parameters -- DeepSpeed's walk, recursing into the root
    because the *released* module is a leaf, would find them all reused and keep them gathered
    (z3-leaf-kept-gathered).  A parameter the prefetcher already fetched for a later step stays."""
    leaf = torch.nn.Linear(2, 2)
    leaf._z3_leaf = True
    root = torch.nn.Sequential(leaf, torch.nn.Linear(2, 2))
    for i, p in enumerate(root.parameters()):
        p.ds_id, p.ds_persist, p.ds_numel = i, False, p.numel()
    for m in root.modules():
        m.ds_external_parameters = list  # what DeepSpeed's iter_params asks every module for: none here

    def coordinator(fetched_for):
        c = SimpleNamespace(is_complete_trace=lambda: True)
        for name, value in zip(ATTRIBUTES[1:], ([leaf, root], fetched_for, 10 ** 9), strict=True):
            setattr(c, name, value)
        return c
    release = fixed_params_to_release(coordinator(dict.fromkeys(root.parameters(), 0)))
    got = release(leaf, 1)
    assert got == {leaf.weight.ds_id, leaf.bias.ds_id} and release(leaf, 1) is got  # memoised, as lru_cache is
    ahead = fixed_params_to_release(coordinator({**dict.fromkeys(root.parameters(), 0), leaf.weight: 5}))
    assert ahead(leaf, 1) == {leaf.bias.ds_id}, "fetched for step 5 already: reused, kept"
