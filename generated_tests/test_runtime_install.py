"""install / uninstall / patch_deepspeed on real DeepSpeed (the installed release, CPU, gloo).

CI budget: about a minute (engines of a few tiny blocks).  The heavier checks -- the
self-check on other releases (0.18.6, 0.19.2) -- are opt-in:
``ZEROSTATE_RUNTIME_RELEASES=0.18.6,0.19.2`` (each ~1 min, own process).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from itertools import pairwise

import pytest

pytestmark = [pytest.mark.deepspeed, pytest.mark.usefixtures("single_rank_process_group")]

torch = pytest.importorskip("torch")
deepspeed = pytest.importorskip("deepspeed")

from zerostate.runtime import (UnsupportedDeepSpeedError, UnsupportedEngineError,  # noqa: E402
                               ZerostateBackwardHookState, ZerostateInstallError, engine_support, install,
                               installation, is_installed, patch_deepspeed, uninstall, unpatch_deepspeed)
from zerostate.runtime import selfcheck  # noqa: E402
from zerostate.runtime.compat_table import COMPAT, compat_row, parse_version  # noqa: E402
from zerostate.runtime.release_policy import HOLD_ID  # noqa: E402


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
    snap["module_pre_hooks"] = {id(m): dict(m._forward_pre_hooks) for m in engine.module.modules()}
    snap["initialize"] = deepspeed.initialize
    return snap


def _diff(a, b, path="") -> list[str]:
    """Where two snapshots differ by identity (dicts compared key by key, lists item by item)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: key added/removed" for k in a.keys() ^ b.keys()]
        for k in a.keys() & b.keys():
            out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
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
def test_every_change_of_install_is_recorded_in_its_patcher(stage):
    """Install routes every change through one Patcher -- the hook state, each closure swap,
    the release policy, the refresh pre-hook -- and uninstall is that record undone, leaving it empty."""
    engine = _engine(stage, frozen=stage == 3)
    inst = install(engine)
    # state + hand-back, swaps, release policy + its leaf reuse walk (z3-leaf-kept-gathered), refresh pre-hook
    expected = 2 + len(inst.swaps) + (2 if inst.release is not None else 0) + 1
    assert len(inst.patcher) == expected, (len(inst.patcher), expected)
    assert inst.refresh_handle.id in engine.module._forward_pre_hooks
    uninstall(engine)
    assert not inst.patcher and inst.release is None
    assert inst.refresh_handle.id not in engine.module._forward_pre_hooks
    engine.destroy()


_SWAP_UNDO = """
import sys
sys.path.insert(0, {tests!r})
import deepspeed
import test_runtime_install as t
from zerostate.runtime import install, uninstall
t.selfcheck._setup_dist()
for stage in (2, 3):
    engine = t._engine(stage, frozen=stage == 3)
    before = t._snapshot(engine)
    inst = install(engine)
    assert inst.swaps, "no closure replaced on " + deepspeed.__version__
    assert t._diff(before["hooks"], t._snapshot(engine)["hooks"]), "the swaps changed no hook?"
    uninstall(engine)
    assert t._diff(before, t._snapshot(engine)) == [], t._diff(before, t._snapshot(engine))
    print("stage", stage, "swaps", len(inst.swaps), "restored")
    engine.destroy()
"""


@pytest.mark.slow
def test_uninstall_restores_swapped_closures_exactly(other_release, tmp_path):
    """On a count-every-hook release (0.18.5, 0.18.6) install replaces every gradient-hook closure in its
    hook dictionary; uninstall puts each original back, by identity, under its key (opt-in, as above)."""
    from zerostate.runtime.compat_table import compat_row
    from zerostate.harness import envs

    if compat_row(other_release).hook_closures != "count-every-hook":
        pytest.skip(f"{other_release} keeps DeepSpeed's closures (nothing swapped)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(envs.ensure_release(other_release)), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               TORCH_EXTENSIONS_DIR=str(envs.extensions_dir_for(f"deepspeed-{other_release}")))
    code = _SWAP_UNDO.format(tests=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("restored") == 2, proc.stdout


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
    with pytest.raises(UnsupportedDeepSpeedError, match=r"supports DeepSpeed 0\.18\.5 <= version < 0\.19\.9.*Nothing"):
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
    for a, b in pairwise(COMPAT):
        assert a.end <= b.first
    assert parse_version("0.19.8+abc123") == (0, 19, 8) and parse_version("0.19.3rc1") == (0, 19, 3)
    assert compat_row("0.18.6").hook_closures == "count-every-hook"
    assert compat_row("0.19.8").release_policy == "owner-attribution"


# The seeds and the cost property on the installed release (0.19.8 in the project environment).
@pytest.mark.parametrize("case", ["z2-reentrant-torch", "z3-reentrant-nonscalar", "z3-reentrant-torch-gas2",
                                  "z3-seed002-engine", "z3-seed002-torch", "z3-seed002-noinputgrad",
                                  "z3-seed002-frozen-after-init"])
def test_selfcheck_installed_release(case):
    r = selfcheck.run_case(case, install=True)
    assert "error" not in r, r.get("traceback")
    assert r["max_diff"] == 0.0
    assert r["counts"] == 0 and r["phase_violations"] == 0
    if "after_last_use" in r:
        assert r["after_last_use"] == ["ZeroParamStatus.NOT_AVAILABLE"]  # released at the last use
        assert not any(r["gathered_after_backward"])
    if selfcheck.CASES[case].get("freeze_after_init"):
        assert r["refreshes"] == 1, "the frozen set was not re-collected after requires_grad changed"


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
    from zerostate.harness import envs

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


# ---------------------------------------------------------------- patch_deepspeed never breaks a job
def _variant_config(stage: int, dtype: str, offload: str, threshold_zero: bool) -> dict:
    zero: dict = {"stage": stage}
    if "optimizer" in offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if "param" in offload:
        zero["offload_param"] = {"device": "cpu"}
    if threshold_zero:
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True,
           "zero_force_ds_cpu_optimizer": False, "zero_optimization": zero}
    if dtype == "bf16-fp32acc":  # DeepSpeed picks BF16_Optimizer for ZeRO-1 + bf16 + fp32 grad accumulation
        cfg["bf16"] = {"enabled": True, "immediate_grad_update": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    elif dtype in ("bf16", "fp16"):
        cfg[dtype] = {"enabled": True}
    return cfg


def _train_variant(cfg: dict, stage: int, dtype: str, patched: bool):
    net = selfcheck._build({"stage": stage, "ckpt": "non_reentrant", "frozen": stage == 3})
    params = [p for p in net.parameters() if p.requires_grad]
    with (patch_deepspeed() if patched else _nullcontext()):
        engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(params, lr=0.1), config=cfg,
                                          model_parameters=params)
    inst = installation(engine)
    dt = {"fp32": torch.float32, "fp16": torch.float16}.get(dtype, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(4, selfcheck.WIDTH, generator=gen).to(device=engine.device, dtype=dt).requires_grad_(True)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        final = [p.detach().float().cpu().clone() for p in engine.module.parameters()]
    out = (type(engine.optimizer).__name__, inst and {"release_policy": inst.release_policy}, losses, final)
    if inst is not None:
        uninstall(engine)
    engine.destroy()
    return out


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


VARIANTS = [  # stage, dtype, offload, persistence threshold 0, installed?
    (1, "bf16-fp32acc", "none", False, False),  # BF16_Optimizer: refused with a warning, stays stock
    (1, "bf16", "none", False, True),
    (2, "bf16", "none", False, True),
    (3, "bf16", "none", True, True),
    (1, "fp32", "optimizer", False, True),
    (2, "fp32", "optimizer", False, True),
    (3, "fp32", "optimizer+param", True, True),
    (3, "fp32", "param", False, True),  # DeepSpeed's default persistence
    (2, "fp16", "none", False, True),
    (3, "fp16", "none", True, True),
]


@pytest.mark.parametrize("stage,dtype,offload,threshold_zero,installs", VARIANTS,
                         ids=[f"z{v[0]}-{v[1]}-offload_{v[2]}{'-persist0' if v[3] else ''}" for v in VARIANTS])
def test_patched_initialize_never_raises_and_trains_like_stock(stage, dtype, offload, threshold_zero, installs, caplog,
                                                                request):
    """Under patch_deepspeed, every engine either gets the runtime and trains exactly like stock, or is
    refused with one warning and stays stock -- deepspeed.initialize never raises because of zerostate."""
    if dtype == "fp16":  # on DeepSpeed's CPU accelerator as the explorer runs it, for this test only
        from zerostate.harness.net.fp16 import allow_fp16_on_cpu, restore_fp16_support
        allow_fp16_on_cpu()
        request.addfinalizer(restore_fp16_support)
    if dtype == "fp16" and not deepspeed.get_accelerator().is_fp16_supported():
        pytest.skip(f"fp16 is not supported by DeepSpeed's {deepspeed.get_accelerator().device_name()} accelerator")
    cfg = _variant_config(stage, dtype, offload, threshold_zero)
    caplog.set_level(logging.INFO, logger="zerostate.runtime")
    stock = _train_variant(cfg, stage, dtype, patched=False)
    caplog.clear()
    patched = _train_variant(cfg, stage, dtype, patched=True)
    warnings = [r for r in caplog.records if r.name == "zerostate.runtime" and r.levelno == logging.WARNING]
    assert (patched[1] is not None) == installs, (patched[0], [r.getMessage() for r in warnings])
    if installs:
        assert not warnings and patched[1]["release_policy"] == (stage == 3)
        assert any("installed into DeepSpeed" in r.getMessage() for r in caplog.records)
    else:
        assert stock[0] == "BF16_Optimizer" and len(warnings) == 1
        assert "BF16_Optimizer" in warnings[0].getMessage() and "stock" in warnings[0].getMessage()
    assert patched[2] == stock[2], "losses differ from stock"
    assert all(torch.equal(a, b) for a, b in zip(patched[3], stock[3], strict=False)), "parameters differ from stock"


def test_bf16_optimizer_refused_by_install_before_any_change():
    net = selfcheck._build({"stage": 1, "ckpt": "non_reentrant", "frozen": False})
    params = list(net.parameters())
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(params, lr=0.1),
                                      config=_variant_config(1, "bf16-fp32acc", "none", False), model_parameters=params)
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    before = _snapshot(engine)
    assert "BF16_Optimizer" in engine_support(engine)
    with pytest.raises(UnsupportedEngineError, match=r"BF16_Optimizer.*Nothing was changed"):
        install(engine)
    assert not is_installed(engine) and _diff(before, _snapshot(engine)) == []
    engine.destroy()


@pytest.mark.parametrize("getter", ["zero_offload_optimizer", "zero_offload_param"])
def test_nvme_offload_refused_before_any_change(monkeypatch, getter):
    engine = _engine(3, frozen=True)
    before = _snapshot(engine)
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    class _Nvme:  # what DeepSpeed's offload config reports for device: nvme (no NVMe engine on this machine)
        device = OffloadDeviceEnum.nvme

    monkeypatch.setattr(engine, getter, _Nvme)
    with pytest.raises(UnsupportedEngineError, match=r"NVMe.*Nothing was changed"):
        install(engine)
    assert not is_installed(engine) and _diff(before, _snapshot(engine)) == []
    monkeypatch.undo()
    engine.destroy()


def test_failure_inside_install_is_undone_and_initialize_still_returns(monkeypatch, caplog):
    """An unexpected error in the middle of applying (here: the release policy) puts back what was
    already changed; under patch_deepspeed the engine comes back stock with a warning."""
    install_mod = sys.modules["zerostate.runtime.install"]

    def boom(engine):
        raise RuntimeError("simulated failure while patching the coordinator")

    monkeypatch.setattr(install_mod, "install_release_policy", boom)
    caplog.set_level(logging.WARNING, logger="zerostate.runtime")
    with patch_deepspeed():
        engine = _engine(3, frozen=True)
    assert not is_installed(engine)
    assert type(engine.optimizer._backward_hook_state).__name__ == "BackwardHookStateManager"
    coord = engine.optimizer.parameter_offload.get_param_coordinator()
    assert not {"fetch_sub_module", "release_sub_module", "reset_step"} & set(vars(coord))
    assert any("simulated failure" in r.getMessage() for r in caplog.records)
    x = torch.randn(4, selfcheck.WIDTH, requires_grad=True)
    engine.backward(engine(x).float().pow(2).mean())  # trains stock
    engine.step()
    engine.destroy()


def test_install_logs_one_line(caplog):
    caplog.set_level(logging.INFO, logger="zerostate.runtime")
    engine = _engine(3, frozen=True)
    install(engine)
    lines = [r.getMessage() for r in caplog.records if r.name == "zerostate.runtime"]
    assert len(lines) == 1, lines
    assert f"DeepSpeed {deepspeed.__version__}" in lines[0] and "ZeRO-3" in lines[0]
    assert "hook state" in lines[0] and "release policy" in lines[0]
    uninstall(engine)
    engine.destroy()


def test_unfreezing_after_install_recollects_frozen_set_and_warns(caplog):
    engine = _engine(3, frozen=True)
    inst = install(engine)
    norms = {id(m) for m in engine.module.modules() if isinstance(m, torch.nn.LayerNorm)}
    assert norms <= set(inst.release.frozen_of)
    x = torch.randn(4, selfcheck.WIDTH, requires_grad=True)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    caplog.set_level(logging.INFO, logger="zerostate.runtime")
    for m in engine.module.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.weight.requires_grad_(True)
            m.bias.requires_grad_(True)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    assert inst.refreshes == 1 and not norms & set(inst.release.frozen_of)
    assert any(r.levelno == logging.WARNING and "became trainable" in r.getMessage() for r in caplog.records)
    engine.backward(engine(x).float().pow(2).mean())  # no further change: no further refresh
    assert inst.refreshes == 1
    engine.step()
    uninstall(engine)
    assert not engine.module._forward_pre_hooks or all(
        getattr(h, "func", None) is not sys.modules["zerostate.runtime.install"]._refresh_frozen_set
        for h in engine.module._forward_pre_hooks.values())
    engine.destroy()


def test_autoinstall_on_unsupported_release_warns_instead_of_raising(monkeypatch, caplog):
    from zerostate.runtime import autoinstall

    monkeypatch.setattr(deepspeed, "__version__", "0.18.4")
    caplog.set_level(logging.WARNING, logger="zerostate.runtime")
    original = deepspeed.initialize
    autoinstall._patch_now()  # what runs right after `import deepspeed` under ZEROSTATE_RUNTIME=1
    assert deepspeed.initialize is original
    assert any("0.18.4" in r.getMessage() for r in caplog.records)
    unpatch_deepspeed()


# ---------------------------------------------------------------- packaging
def test_runtime_import_pulls_no_explorer_dependency():
    """`import zerostate.runtime` (and its modules) imports neither the explorer's dependencies nor torch/deepspeed."""
    code = ("import sys, zerostate.runtime, zerostate.runtime.install, zerostate.runtime.autoinstall, "
            "zerostate.runtime.release_policy, zerostate.runtime.hook_state_manager, zerostate.runtime.selfcheck, "
            "zerostate.runtime.compat_table, zerostate.runtime.engine_support, zerostate.runtime.errors, "
            "zerostate.runtime.hook_closures, zerostate.runtime.initialize_patch, zerostate.runtime.patcher\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'hypothesis', 'networkx', 'PIL', 'matplotlib', 'transformers', 'torch', 'deepspeed'})\n"
            "print(bad)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_base_dependencies_never_replace_torch_or_deepspeed():
    """Installing zerostate into a DeepSpeed environment must not change its DeepSpeed: the base
    requirements are torch and deepspeed without any version; the explorer's pins are an extra."""
    import re
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]: d for d in meta["dependencies"]}
    assert names == {"torch": "torch", "deepspeed": "deepspeed"}, meta["dependencies"]
    extras = meta["optional-dependencies"]
    assert "deepspeed==0.19.8" in extras["explore"]
    for dep in ("hypothesis", "networkx", "pillow"):
        assert any(d.startswith(dep) for d in extras["explore"]), dep
    for dep in ("transformers", "peft", "accelerate"):
        assert any(d.startswith(dep) for d in extras["hf"]), dep
    assert any("explore" in d and "hf" in d for d in extras["test"])

