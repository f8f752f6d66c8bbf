"""The report's repro scripts run standalone: exit 0 on the pinned release, non-zero on a buggy one.

The runs on the pinned release are ``deepspeed``-marked (real DeepSpeed on CPU).  The runs on
buggy releases install those releases (``pip install --no-deps --target``, cached) and are
opt-in: set ``ZEROSTATE_RELEASE_TESTS=1``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_util import load_report, zs

import zerostate.targets.deepspeed.repro  # noqa: F401  (a broken import fails, never skips)
import zerostate.analysis.checker  # noqa: F401  (a broken import fails, never skips)

RELEASES = pytest.mark.skipif(os.environ.get("ZEROSTATE_RELEASE_TESTS") != "1",
                              reason="installs DeepSpeed releases; set ZEROSTATE_RELEASE_TESTS=1")
SEED_002 = {  # seed 002's MRE: frozen LayerNorm + trainable Linear per block, non-reentrant checkpoint
    "blocks": [{"checkpoint": "non_reentrant", "norm": "frozen", "lin": "trainable"}] * 2,
    "stage": 3, "persistence_threshold": 0,
}


def run_repro(script: Path, release: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python repro_<n>.py`` with only torch and deepspeed: the installed release, or ``release``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "HYPOTHESIS"))}
    if release:
        from zerostate.targets.deepspeed import envs
        env["PYTHONPATH"] = str(envs.ensure_release(release))
        env["TORCH_EXTENSIONS_DIR"] = str(envs.extensions_dir_for(f"deepspeed-{release}"))
    return subprocess.run([sys.executable, script.name], cwd=script.parent, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def hook_repro(tmp_path_factory) -> Path:
    """Seed 000 part 1 as ``zerostate check`` finds it on ds-0.18.4: a repro of the epilogue-once finding."""
    out = tmp_path_factory.mktemp("check")
    r = zs("check", "--design", "ds-0.18.4", "--max-blocks", "2", "--max-micro-steps", "1", "--jobs", "1",
           "--spec", "epilogue-once", "--out", str(out))
    assert r.returncode == 0, r.stderr
    f = next(f for f in load_report(out)["findings"] if f["check"] == "epilogue-once")
    assert "repro" in f["files"], f["notes"]
    return out / f["files"]["repro"]


@pytest.fixture(scope="module")
def seed002_repro(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("seed002")
    scenario = out / "seed002.json"
    scenario.write_text(json.dumps(SEED_002))
    r = zs("replay", str(scenario), "--target", "model", "--design", "ds-0.19.2", "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr  # the model predicts the failure
    files = load_report(out)["findings"][0]["files"]
    assert "repro" in files
    return out / files["repro"]


def test_repro_is_standalone_python(hook_repro):
    text = hook_repro.read_text()
    compile(text, str(hook_repro), "exec")
    assert "import deepspeed" in text
    assert not re.search(r"^\s*(from|import)\s+zerostate", text, re.M), "a repro must not need zerostate"


@pytest.mark.deepspeed
def test_hook_repro_passes_on_the_pinned_release(hook_repro):
    r = run_repro(hook_repro)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.deepspeed
@RELEASES
def test_hook_repro_fails_on_0_18_4(hook_repro):
    r = run_repro(hook_repro, "0.18.4")
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.deepspeed
def test_seed002_repro_passes_on_the_pinned_release(seed002_repro):
    r = run_repro(seed002_repro)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.deepspeed
@RELEASES
def test_seed002_repro_fails_on_0_19_2(seed002_repro):
    r = run_repro(seed002_repro, "0.19.2")
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_repro_names_itself(hook_repro):
    assert f"python {hook_repro.name}" in hook_repro.read_text()


def _scripts_namespace(text: str) -> dict:
    """The script's module-level names, without running ``main()`` (no DeepSpeed run)."""
    ns: dict = {"__name__": "repro_under_test"}
    exec(compile(text, "repro.py", "exec"), ns)  # noqa: S102 - our own generated script
    return ns


def test_an_order_dependent_findings_repro_runs_its_sequence_first():
    """Issue 15: the sequence the explorer found goes into the script (BEFORE, run first in the same
    process, each engine destroyed before the next), and an intermittent finding's rate into REPEAT."""
    from zerostate.model.scenario import Scenario
    from zerostate.targets.base import Finding
    from zerostate.targets.confirm import Confirmation
    from zerostate.targets.deepspeed.repro import repro_script
    sc = Scenario.from_dict(SEED_002)
    before = [Scenario.from_dict({"blocks": [{}], "stage": 1}), Scenario.from_dict({"blocks": [{"leaf": True}]})]
    f = Finding("oracle", "after train step 0: ...", sc, deepspeed="0.19.2")
    f.confirmation = Confirmation("order-dependent", sequence=before)
    ns = _scripts_namespace(repro_script(f, 3))
    assert ns["BEFORE"] == [s.to_dict() for s in before] and ns["REPEAT"] == 1
    assert "Order-dependent: the finding appears only after 2 other example(s)" in ns["__doc__"]
    f.confirmation = Confirmation("intermittent", repeat=100, hits=3)
    ns = _scripts_namespace(repro_script(f, 3))
    assert ns["BEFORE"] == [] and ns["REPEAT"] == 100 and "Intermittent (a race)" in ns["__doc__"]
    f.confirmation = Confirmation("confirmed")
    ns = _scripts_namespace(repro_script(f, 3))
    assert ns["BEFORE"] == [] and ns["REPEAT"] == 1
