"""A real Hugging Face client with the runtime: tiny Llama + LoRA + gradient checkpointing, HF ``Trainer``,
DeepSpeed ZeRO-3 at DeepSpeed's *default* config (``clients/hf_job.py``), on CPU.

Default-on (installed DeepSpeed, 0.19.8 here; four processes, two at a time, ~8 s of CPU each):
for reentrant and non-reentrant
checkpointing, the job with ``zerostate.runtime.patch_deepspeed()`` trains with exactly the losses and
LoRA weights of stock DeepSpeed, and the runtime really was installed (release policy included).

Opt-in, like the other release tests (``ZEROSTATE_RUNTIME_RELEASES=0.19.2``; each listed release is
installed with ``harness/envs.py`` and put first on ``PYTHONPATH``): the runtime trains both
checkpointing modes with the same losses and weights as stock on the installed release; on 0.19.0-0.19.2
stock non-reentrant dies of seed 002's ``CheckpointError`` at the default config (the small
frozen RMSNorm weights are persistent, and DeepSpeed partitions persistent parameters while the trace
is not complete).

Each configuration runs in its own process (a fresh process group, nothing shared between stock and
runtime).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.deepspeed, pytest.mark.usefixtures("no_inherited_rendezvous")]



pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

STEPS = 4
CKPTS = ["reentrant", "non_reentrant"]
SEED002_RELEASES = ("0.19.0", "0.19.1", "0.19.2")


def run_jobs(tmp_path, jobs: list[tuple[str, bool, str | None]], steps: int = STEPS) -> list[dict]:
    """Run ``python -m zerostate.clients.hf_job`` once per (ckpt, runtime, release), each in its own
    process, all at once (2 cores: a stock/runtime pair costs one job's wall time); their JSON records."""
    import zerostate.jit_ops as jit_ops
    from zerostate.harness.envs import without_rendezvous

    procs = []
    try:
        for ckpt, runtime, release in jobs:
            env = without_rendezvous(dict(os.environ))
            env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu")
            if release:
                from zerostate.harness import envs

                env["PYTHONPATH"] = os.pathsep.join([str(envs.ensure_release(release))] + [
                    p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            jit_ops.keep_apart(env)  # the release's own JIT-op folder, as zerostate watch gives a job
            out = tmp_path / f"{release or 'installed'}-{ckpt}-{'runtime' if runtime else 'stock'}.json"
            cmd = [sys.executable, "-m", "zerostate.clients.hf_job", "--ckpt", ckpt, "--steps", str(steps),
                   "--json", str(out)] + (["--runtime"] if runtime else [])
            procs.append((release, out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                         stderr=subprocess.PIPE, text=True)))
        records = []
        for release, out, proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            assert proc.returncode == 0 and out.exists(), (stdout[-2000:], stderr[-4000:])
            record = json.loads(out.read_text())
            if release:
                assert record["deepspeed"] == release, record["deepspeed"]
            records.append(record)
    finally:  # a failed job fails the test; none of its siblings outlives it
        for _, _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return records


def _trained(record: dict) -> None:
    assert "error" not in record, record["error"].get("traceback")
    assert record["checkpointing"], "gradient checkpointing was not enabled on the model"
    assert len(record["losses"]) == record["steps"] and all(math.isfinite(x) for x in record["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", CKPTS)
def test_runtime_equals_stock_at_default_config(tmp_path, ckpt):
    stock, rt = run_jobs(tmp_path, [(ckpt, False, None), (ckpt, True, None)])
    _trained(stock)
    _trained(rt)
    assert rt["installed"] and rt["release_policy"], "patch_deepspeed did not install into the Trainer's engine"
    assert rt["deepspeed"] == stock["deepspeed"]
    assert rt["losses"] == stock["losses"]
    assert rt["weights_sha256"] == stock["weights_sha256"]


def pytest_generate_tests(metafunc):
    if "hf_release" in metafunc.fixturenames:
        rel = [v for v in os.environ.get("ZEROSTATE_RUNTIME_RELEASES", "").split(",") if v]
        metafunc.parametrize("hf_release", rel or [pytest.param("none", marks=pytest.mark.skip(
            reason="opt-in: ZEROSTATE_RUNTIME_RELEASES=0.19.2"))])


@pytest.mark.slow
def test_runtime_trains_other_release_like_installed_stock(tmp_path, hf_release):
    """On 0.19.2: stock dies of seed 002 at the default config; the runtime trains, losses and weights equal
    to stock on the installed release (0.19.8)."""
    jobs = [(ckpt, runtime, release) for ckpt in CKPTS for runtime, release in ((False, None), (True, hf_release))]
    if hf_release in SEED002_RELEASES:
        jobs.append(("non_reentrant", False, hf_release))
    records = run_jobs(tmp_path, jobs)
    for ckpt, reference, rt in zip(CKPTS, records[0:4:2], records[1:4:2], strict=True):
        _trained(reference)
        _trained(rt)
        assert rt["installed"] and rt["release_policy"]
        assert rt["losses"] == reference["losses"], (ckpt, rt["losses"], reference["losses"])
        assert rt["weights_sha256"] == reference["weights_sha256"], ckpt
    if hf_release in SEED002_RELEASES:
        stock_old = records[4]
        assert stock_old.get("error", {}).get("type") == "CheckpointError", stock_old.get("error") or "stock trained"
