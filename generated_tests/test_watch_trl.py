"""``zerostate watch`` on the jobs users run: TRL's SFT, GRPO and DPO trainers, plain or under ``accelerate launch``
and DeepSpeed's own launcher (`zerostate.clients.trl_job`: tiny Llama + LoRA + gradient checkpointing, ZeRO-3 at
DeepSpeed's defaults, CPU, models and tokenizer built locally, ``HF_HUB_OFFLINE=1``).

On the installed DeepSpeed (0.19.8), two steps each: the SFT job importing trl first (transformers, accelerate and
TRL ask ``importlib.util.find_spec("deepspeed")`` before the job imports it) is watched and clean, and the report
names the checkpointing it ran (non-reentrant: TRL's "forced" reentrant does not reach transformers 5.2x's
Trainer); the reentrant job importing deepspeed first is clean too; GRPO (TRL's generation re-registers the ZeRO-3
hooks) has no violation and trains reentrant, which the report says leaves recompute unchecked; DPO is clean
and switches from non-reentrant to reentrant after its first step (the report names the steps); the SFT job
under ``accelerate launch`` with a DeepSpeed plugin config is watched and clean.

Opt-in (``ZEROSTATE_RELEASES=0.19.2``; the release is installed on first use): SFT at TRL's defaults importing trl
first, and non-reentrant importing deepspeed first, names ``saved-tensor-intact`` on the user's parameter names
(seed 002) and exits non-zero; under
``--runtime`` it trains and the report is clean with its backwards watched; the same under ``accelerate launch``;
GRPO at TRL's defaults keeps ``lm_head.weight`` / ``embed_tokens.weight`` held after each backward, labelled by
its evidence (a module whose pre-backward ran and whose post-backward did not: fixed in 0.19.3).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow, pytest.mark.usefixtures("no_inherited_rendezvous")]

for _mod in ("trl", "transformers", "peft", "accelerate", "datasets"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"{_mod} is not installed (pip install zerostate[test])", allow_module_level=True)

BIN = os.path.dirname(sys.executable)
ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
num_processes: 1
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
use_cpu: false
"""
_DROP = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _env(release: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false")
    if release:
        from zerostate.harness import envs
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(envs.ensure_release(release)), env.get("PYTHONPATH")]))
        env["TORCH_EXTENSIONS_DIR"] = str(envs.extensions_dir_for(f"deepspeed-{release}"))
    return env


def _job(tmp_path, *args: str, opts: tuple[str, ...] = (), launcher: str = "python", release: str | None = None,
         steps: int = 2) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """``zerostate watch [opts] -- <launcher> trl_job ARGS``: (the watch's process, its report, the job's result)."""
    out = tmp_path / f"report-{len(list(tmp_path.iterdir()))}"
    job = ["-m", "zerostate.clients.trl_job", "--steps", str(steps), *args]
    if launcher == "accelerate":
        cfg = tmp_path / "accelerate.yaml"
        cfg.write_text(ACCELERATE_CONFIG)
        cmd = [os.path.join(BIN, "accelerate"), "launch", "--config_file", str(cfg), *job, "--ds-config", "launcher"]
    else:
        cmd = [sys.executable, *job]
    proc = subprocess.run([sys.executable, "-m", "zerostate.cli.main", "watch", "--out", str(out), *opts, "--", *cmd],
                          capture_output=True, text=True, timeout=900, env=_env(release))
    rep = json.loads((out / "report.json").read_text())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"trainer"')]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, rep, json.loads(lines[-1])


def _checks(rep: dict) -> list[tuple[str, str]]:
    return [(f["check"], f["error"][:200]) for f in rep["findings"]]


def _clean(proc: subprocess.CompletedProcess, rep: dict, res: dict, steps: int = 2) -> None:
    assert proc.returncode == 0 and "error" not in res, (res.get("error"), proc.stderr[-3000:])
    assert rep["findings"] == [], _checks(rep)
    assert rep["not_observed"] == [] and rep["summary"]["watched"]
    assert rep["summary"]["backwards"] == steps and rep["summary"]["steps"] == steps
    assert proc.stderr.splitlines()[-1].startswith(f"watch: 0 violations in {steps} backwards, {steps} steps")


# ---------------------------------------------------------------- the installed release (0.19.8)
def test_sft_importing_trl_first_is_watched_and_names_the_checkpointing_it_ran(tmp_path):
    """TRL 1.16 says it forces ``use_reentrant=True`` (PEFT + ZeRO-3 + checkpointing) but writes the deprecated
    ``gradient_checkpointing_kwargs``, which transformers 5.2x's Trainer no longer reads: the job runs
    non-reentrant, and the report says what ran."""
    proc, rep, res = _job(tmp_path, "--trainer", "sft", "--import-order", "trl-first")
    _clean(proc, rep, res)
    assert res["trl_says_use_reentrant"] is True and res["use_reentrant"] is None
    conf = rep["configuration"]
    assert conf["zero_stage"] == 3 and conf["activation_checkpointing"] == "non-reentrant", conf
    assert conf["non_reentrant_recomputes"] > 0 and rep["not_checked"] == []
    assert "activation checkpointing non-reentrant" in (tmp_path / "report-0" / "report.md").read_text()


def test_sft_reentrant_importing_deepspeed_first_is_clean(tmp_path):
    proc, rep, res = _job(tmp_path, "--trainer", "sft", "--ckpt", "reentrant", "--import-order", "deepspeed-first")
    _clean(proc, rep, res)
    assert res["use_reentrant"] is True and rep["configuration"]["activation_checkpointing"] == "reentrant"


def test_grpo_generation_is_no_false_alarm_and_its_reentrant_recompute_is_said_unchecked(tmp_path):
    """TRL's generation unwraps the model (``remove_hooks``, generate, ``add_hooks``: the trace is invalidated and the
    hooks registered again): the watch sees the re-registration, so ``trace-consistent`` holds.  After each
    generation TRL enables checkpointing again with its ``use_reentrant=True``: the job trains reentrant, and the
    report says what that leaves unchecked."""
    proc, rep, res = _job(tmp_path, "--trainer", "grpo")
    _clean(proc, rep, res)
    assert rep["configuration"]["activation_checkpointing"] == "reentrant", rep["configuration"]
    assert rep["not_checked"] and "reentrant checkpoint recompute" in rep["not_checked"][0]


def test_dpo_is_clean_and_its_checkpointing_switch_is_named(tmp_path):
    """DPO's reference forward runs under TRL's ``disable_gradient_checkpointing``, which enables checkpointing again
    with TRL's kwargs (``use_reentrant=True``): the first step's backward recomputes non-reentrant (the Trainer's
    choice), every later one reentrant.  The report says so, step by step."""
    proc, rep, res = _job(tmp_path, "--trainer", "dpo", steps=3)
    _clean(proc, rep, res, steps=3)
    conf = rep["configuration"]
    assert conf["checkpointing_steps"] == {"non-reentrant": [0, 0], "reentrant": [1, 2]}, conf
    assert "non-reentrant in train steps 1-1, reentrant in train steps 2-3" in conf["checkpointing_switched"]
    assert rep["not_checked"] and "reentrant checkpoint recompute" in rep["not_checked"][0]


def test_sft_under_accelerate_launch_is_watched(tmp_path):
    proc, rep, res = _job(tmp_path, "--trainer", "sft", launcher="accelerate")
    _clean(proc, rep, res)


# ---------------------------------------------------------------- 0.19.2 (opt-in)
def _release(version: str) -> str:
    want = os.environ.get("ZEROSTATE_RELEASES", "")
    if want not in ("1", "all", "yes", "true") and version not in want.replace(",", " ").split():
        pytest.skip(f"set ZEROSTATE_RELEASES={version} (or 1) to watch TRL jobs on DeepSpeed {version}")
    return version


def _seed_002(proc: subprocess.CompletedProcess, rep: dict, res: dict) -> None:
    assert res["deepspeed"] == "0.19.2" and res["error"]["type"] == "CheckpointError"
    assert proc.returncode != 0
    got = [f for f in rep["findings"] if f["check"] == "saved-tensor-intact"]
    assert got, _checks(rep)
    assert got[0]["explanation"]["id"] == "seed-002" and got[0]["explanation"]["runtime_prevents"] is True
    assert any(p.startswith("base_model.model.model.layers.") and "layernorm" in p for p in got[0]["params"])


@pytest.mark.parametrize("order,ckpt", [("trl-first", "trl"), ("deepspeed-first", "non_reentrant")])
def test_sft_on_0_19_2_names_seed_002_and_the_runtime_prevents_it(tmp_path, order, ckpt):
    """``trl``: at TRL's defaults the job runs non-reentrant (TRL's "forced" reentrant does not reach the Trainer), so
    a TRL user on 0.19.0-0.19.2 does meet seed 002."""
    rel = _release("0.19.2")
    _seed_002(*_job(tmp_path, "--trainer", "sft", "--ckpt", ckpt, "--import-order", order, release=rel))
    proc, rep, res = _job(tmp_path, "--trainer", "sft", "--ckpt", ckpt, "--import-order", order,
                          opts=("--runtime",), release=rel)
    _clean(proc, rep, res)
    assert rep["run"]["runtime"] is True


def test_sft_on_0_19_2_under_accelerate_launch(tmp_path):
    rel = _release("0.19.2")
    _seed_002(*_job(tmp_path, "--trainer", "sft", "--ckpt", "non_reentrant", launcher="accelerate", release=rel))
    _clean(*_job(tmp_path, "--trainer", "sft", "--ckpt", "non_reentrant", launcher="accelerate", release=rel,
                 opts=("--runtime",)))


def test_grpo_on_0_19_2_leftovers_are_labelled_by_their_evidence(tmp_path):
    proc, rep, res = _job(tmp_path, "--trainer", "grpo", release=_release("0.19.2"))
    assert proc.returncode == 0 and "error" not in res, res.get("error")
    assert {f["check"] for f in rep["findings"]} == {"released-after-backward"}, _checks(rep)
    f = rep["findings"][0]
    assert f["explanation"]["id"] == "z3-released-late-input-without-grad" and f["explanation"]["fixed_in"] == "0.19.3"
    left = f["evidence"]["left_by_module_without_post_backward"]
    assert left == {"base_model.model.lm_head.weight": "base_model.model",
                    "base_model.model.model.embed_tokens.weight": "base_model.model.model.embed_tokens"}, left
