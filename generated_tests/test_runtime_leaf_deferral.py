"""install / uninstall of the z3 leaf-module deferral (z3-leaf-input-without-grad) on real DeepSpeed (the installed
release, CPU, gloo): the deferred hook trains the leaf, uninstall restores DeepSpeed's closure, and a hook of
another shape or a torch without the deferral's internals is refused before any change."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.deepspeed, pytest.mark.usefixtures("single_rank_process_group")]

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed")

from test_runtime_install import _diff, _snapshot  # noqa: E402  (the snapshot of what install may touch)

from zerostate.runtime import UnsupportedEngineError, ZerostateInstallError, install, is_installed, uninstall  # noqa: E402
from zerostate.runtime import selfcheck  # noqa: E402


def _leaf_engine():
    """ZeRO-3 over two blocks, the first a z3 leaf module (``set_z3_leaf_modules`` before initialize)."""
    from deepspeed.utils import set_z3_leaf_modules

    class Leaf(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = torch.nn.LayerNorm(selfcheck.WIDTH), torch.nn.Linear(selfcheck.WIDTH, selfcheck.WIDTH)

        def forward(self, x):
            return torch.tanh(self.lin(self.norm(x)))

    net = torch.nn.Sequential(Leaf(), torch.nn.Linear(selfcheck.WIDTH, selfcheck.WIDTH))
    set_z3_leaf_modules(net, [Leaf])
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=cfg,
                                      model_parameters=list(net.parameters()))
    return engine


def _leaf_backward(engine):
    x = torch.randn(4, selfcheck.WIDTH)  # does not require grad: the leaf's hook fires before its backward
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()


def test_leaf_hook_deferred_then_restored_exactly():
    """Stock, the leaf fed an input that does not require grad crashes (z3-leaf-input-without-grad).  install
    wraps the z3 leaf module's hook (same key) so its reduction waits for the gradients: the leaf trains;
    uninstall puts DeepSpeed's own closure back."""
    stock = _leaf_engine()
    with pytest.raises(RuntimeError, match="must match the size"):
        _leaf_backward(stock)
    stock.destroy()
    engine = _leaf_engine()
    before = _snapshot(engine)
    inst = install(engine)
    [swap] = [s for s in inst.swaps if s.leaf_deferral]
    assert swap.hooks[swap.key] is swap.replacement and swap.replacement.__wrapped__ is swap.original  # 0.18.7 on
    leaf = engine.module[0]
    for _ in range(2):
        w = leaf.lin.weight.ds_tensor.detach().clone()
        _leaf_backward(engine)
        assert not torch.equal(w, leaf.lin.weight.ds_tensor)  # the leaf's real gradient reached its partition
    assert "z3 leaf-module hooks deferred" in inst.describe()
    uninstall(engine)
    after = _snapshot(engine)  # (training changed the coordinator's own state: compare what install touches)
    assert after["manager"] is before["manager"] and _diff(before["hooks"], after["hooks"]) == []
    assert _diff(before["module_hooks"], after["module_hooks"]) == []
    engine.destroy()


def test_leaf_hook_of_another_shape_is_refused_before_any_change(monkeypatch):
    engine = _leaf_engine()
    [h] = engine.optimizer._leaf_module_hooks
    hooks = h.hooks_dict_ref()

    def reduce_leaf_module_grads(module, grad_input):  # DeepSpeed's name, not its shape
        return None

    monkeypatch.setitem(hooks, h.id, reduce_leaf_module_grads)
    before = _snapshot(engine)
    with pytest.raises(UnsupportedEngineError, match=r"does not have the shape.*Nothing was changed"):
        install(engine)
    assert not is_installed(engine) and _diff(before, _snapshot(engine)) == []
    monkeypatch.undo()
    engine.destroy()


@pytest.mark.parametrize("internal", ["_will_engine_execute_node", "register_post_accumulate_grad_hook"])
def test_missing_leaf_deferral_internals_are_refused_before_any_change(monkeypatch, internal):
    from zerostate.runtime import leaf_deferral

    engine = _leaf_engine()
    before = _snapshot(engine)
    monkeypatch.setattr(leaf_deferral, "_LEAF", None)
    monkeypatch.delattr(torch._C if internal.startswith("_") else torch.Tensor, internal)
    with pytest.raises(ZerostateInstallError, match=internal + ".*Nothing was changed"):
        install(engine)
    monkeypatch.undo()
    assert not is_installed(engine) and _diff(before, _snapshot(engine)) == []
    engine.destroy()
