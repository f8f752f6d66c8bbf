"""install / uninstall / patch_deepspeed on real DeepSpeed (the installed release, CPU, gloo).

CI budget: about a minute (engines of a few tiny blocks).  The heavier checks -- the
self-check on other releases (0.18.6, 0.19.2) -- are opt-in:
``ZEROSTATE_RUNTIME_RELEASES=0.18.6,0.19.2`` (each ~1 min, own process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.deepspeed

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed")

from zerostate.runtime import (UnsupportedDeepSpeedError, ZerostateBackwardHookState,  # noqa: E402
                               ZerostateInstallError, install, installation, is_installed, patch_deepspeed,
                               uninstall)
from zerostate.runtime import selfcheck  # noqa: E402
from zerostate.runtime.install import COMPAT, compat_row, parse_version  # noqa: E402
from zerostate.runtime.release_policy import HOLD_ID  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def dist():
    selfcheck._setup_dist()
    yield


def _engine(stage: int, frozen: bool = False):
    net = selfcheck._build({"stage": stage, "ckpt": "non_reentrant", "frozen": frozen})
    params = [p for p in net.parameters() if p.requires_grad]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(params, lr=0.1), config=cfg,
                                      model_parameters=params)
    return engine


def _snapshot(engine):
    """Everything install() may touch, by identity."""
    opt = engine.optimizer
    snap = {"manager": opt._backward_hook_state, "opt_dict": dict(opt.__dict__)}
    hooks = []
    for h in list(getattr(opt, "_grad_acc_hooks", [])) + list(getattr(opt, "_leaf_module_hooks", [])):
        d = h.hooks_dict_ref()
        hooks.append((h.id, d[h.id]))
    snap["hooks"] = hooks
    off = getattr(opt, "parameter_offload", None)
    if off is not None:
        snap["coord_dict"] = dict(off.get_param_coordinator().__dict__)
    snap["module_hooks"] = {id(m): dict(m._forward_hooks) for m in engine.module.modules()}
    return snap


def _diff(a, b, path="") -> list[str]:
    """Where two snapshots differ by identity (dicts compared key by key, lists item by item)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: key added/removed" for k in a.keys() ^ b.keys()]
        for k in a.keys() & b.keys():
            out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a is b or (isinstance(a, (int, str)) and a == b) else [f"{path}: {a!r} is not {b!r}"]


@pytest.mark.parametrize("stage", [2, 3])
def test_install_twice_then_uninstall_restores_every_object_identically(stage):
    engine = _engine(stage, frozen=stage == 3)
    before = _snapshot(engine)
    inst = install(engine)
    assert install(engine) is inst  # twice: no-op
    assert _diff(before, _snapshot(engine)), "install changed nothing?"
    assert uninstall(engine) is True and uninstall(engine) is False
    assert _diff(before, _snapshot(engine)) == []
    engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_install_train_uninstall(stage):
    engine = _engine(stage, frozen=stage == 3)
    before = _snapshot(engine)
    inst = install(engine)
    assert is_installed(engine) and installation(engine) is inst
    assert isinstance(engine.optimizer._backward_hook_state, ZerostateBackwardHookState)
    assert inst.release_policy == (stage == 3)
    post_hooks = list(inst.original_manager._grad_acc_post_hooks)
    assert post_hooks and engine.optimizer._backward_hook_state._grad_acc_post_hooks == post_hooks  # carried over
    x = torch.randn(4, selfcheck.WIDTH, requires_grad=True)
    for _ in range(2):
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    uninstall(engine)
    after = _snapshot(engine)
    assert after["manager"] is before["manager"]
    assert _diff(before["hooks"], after["hooks"]) == []
    assert _diff(before["module_hooks"], after["module_hooks"]) == []
    if stage == 3:
        assert before["coord_dict"].keys() == after["coord_dict"].keys()
        assert "backward_epilogue" not in engine.optimizer.__dict__
    assert not any(HOLD_ID in getattr(p, "ds_active_sub_modules", ()) for p in engine.module.parameters())
    engine.backward(engine(x).float().pow(2).mean())  # and it still trains stock
    engine.step()
    engine.destroy()


@pytest.mark.parametrize("version", ["0.18.4", "0.17.0", "0.19.9", "0.20.0", "1.0.0"])
def test_unsupported_release_is_refused_before_any_change(monkeypatch, version):
    engine = _engine(2)
    before = _snapshot(engine)
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(UnsupportedDeepSpeedError, match=r"supports DeepSpeed 0\.18\.5 to 0\.19\.8.*Nothing"):
        install(engine)
    with pytest.raises(UnsupportedDeepSpeedError):
        patch_deepspeed()
    assert deepspeed.initialize.__name__ == "initialize" and not hasattr(deepspeed.initialize, "__zerostate_original__")
    assert not is_installed(engine) and _diff(before, _snapshot(engine)) == []
    engine.destroy()


def test_missing_torch_internals_are_refused_before_any_change(monkeypatch):
    engine = _engine(2)
    before = _snapshot(engine)
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(ZerostateInstallError, match="_current_graph_task_id"):
        install(engine)
    monkeypatch.undo()
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", object())  # no queue_callback
    with pytest.raises(ZerostateInstallError, match="queue_callback"):
        install(engine)
    monkeypatch.undo()
    assert not is_installed(engine) and _diff(before, _snapshot(engine)) == []
    engine.destroy()


def test_install_during_backward_is_refused():
    engine = _engine(2)
    engine.optimizer._backward_hook_state.backward_active_depth = 1
    with pytest.raises(ZerostateInstallError, match="during a backward"):
        install(engine)
    engine.optimizer._backward_hook_state.backward_active_depth = 0
    assert not is_installed(engine)
    engine.destroy()


def test_patch_deepspeed_installs_into_engines_initialize_builds():
    original = deepspeed.initialize
    with patch_deepspeed():
        assert deepspeed.initialize is not original
        engine = _engine(3, frozen=True)
        assert is_installed(engine) and installation(engine).release_policy
    assert deepspeed.initialize is original
    uninstall(engine)
    engine.destroy()


def test_compat_table_is_contiguous_and_parses():
    for a, b in zip(COMPAT, COMPAT[1:]):
        assert a.last < b.first
    assert parse_version("0.19.8+abc123") == (0, 19, 8) and parse_version("0.19.3rc1") == (0, 19, 3)
    assert compat_row("0.18.6").hook_closures == "count-every-hook"
    assert compat_row("0.19.8").release_policy == "owner-attribution"


# The seeds and the cost property on the installed release (0.19.8 in the project environment).
@pytest.mark.parametrize("case", ["z2-reentrant-torch", "z3-reentrant-nonscalar", "z3-reentrant-torch-gas2",
                                  "z3-seed002-engine", "z3-seed002-torch", "z3-seed002-noinputgrad"])
def test_selfcheck_installed_release(case):
    r = selfcheck.run_case(case, install=True)
    assert "error" not in r, r.get("traceback")
    assert r["max_diff"] == 0.0
    assert r["counts"] == 0 and r["phase_violations"] == 0
    if "after_last_use" in r:
        assert r["after_last_use"] == ["ZeroParamStatus.NOT_AVAILABLE"]  # released at the last use
        assert not any(r["gathered_after_backward"])


def _releases(config) -> list[str]:
    return [v for v in os.environ.get("ZEROSTATE_RUNTIME_RELEASES", "").split(",") if v]


def pytest_generate_tests(metafunc):
    if "other_release" in metafunc.fixturenames:
        rel = _releases(metafunc.config)
        metafunc.parametrize("other_release", rel or [pytest.param("none", marks=pytest.mark.skip(
            reason="opt-in: ZEROSTATE_RUNTIME_RELEASES=0.18.6,0.19.2"))])


@pytest.mark.slow
def test_selfcheck_other_release(other_release, tmp_path):
    """On 0.18.6 (count in every hook) and 0.19.2 (seed 002's CheckpointError): stock fails, installed passes."""
    from zerostate.targets.deepspeed import envs

    site = envs.ensure_release(other_release)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}  # this process's
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               TORCH_EXTENSIONS_DIR=str(envs.extensions_dir_for(f"deepspeed-{other_release}")))
    out = {}
    for mode in ("install", "stock"):
        path = tmp_path / f"{mode}.json"
        cmd = [sys.executable, "-m", "zerostate.runtime.selfcheck", "--json", str(path)]
        if mode == "stock":
            cmd.append("--no-install")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = {r["case"]: r for r in json.loads(path.read_text())["results"]}
    for name, r in out["install"].items():
        assert "error" not in r, (name, r.get("traceback"))
        assert r["max_diff"] == 0.0 and r["counts"] == 0, (name, r)
    stock_bad = [n for n, r in out["stock"].items() if "error" in r or r["counts"] > 1]
    assert stock_bad, f"stock {other_release} showed no failure to fix"
