"""The report's repro scripts run standalone: exit 0 on the pinned release, non-zero on a buggy one.

Every run here is standalone for real: from the script's own folder (outside the repository), with
``PYTHONPATH`` holding at most the DeepSpeed release, and with every ``zerostate`` import refused (the
editable install would otherwise serve it): the script must run on the code it embeds.
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

import zerostate.harness.repro
import zerostate.analysis.checker  # a broken import fails, never skips

RELEASES = pytest.mark.skipif(os.environ.get("ZEROSTATE_RELEASE_TESTS") != "1",
                              reason="installs DeepSpeed releases; set ZEROSTATE_RELEASE_TESTS=1")
SEED_002 = {  # seed 002's MRE: frozen LayerNorm + trainable Linear per block, non-reentrant checkpoint
    "blocks": [{"checkpoint": "non_reentrant", "norm": "frozen", "lin": "trainable"}] * 2,
    "stage": 3, "persistence_threshold": 0,
}


NO_ZEROSTATE = """
import runpy, sys
class NoZerostate:
    def find_spec(self, name, path=None, target=None):
        if name == "zerostate" or name.startswith("zerostate."):
            raise ModuleNotFoundError(f"{name}: a repro script must not import the installed zerostate")
        return None
sys.meta_path.insert(0, NoZerostate())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""``python -c NO_ZEROSTATE repro_<n>.py``: the script run as ``__main__`` with no zerostate importable."""


def run_repro(script: Path, release: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python repro_<n>.py`` with only torch and deepspeed: the installed release, or ``release``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "HYPOTHESIS"))}
    env.pop("PYTHONPATH", None)
    env.pop("TORCH_EXTENSIONS_DIR", None)  # the script keeps each release's JIT-built ops apart itself
    assert not script.resolve().is_relative_to(Path(__file__).resolve().parent.parent), "run it outside the repo"
    if release:
        from zerostate.harness import envs
        env["PYTHONPATH"] = str(envs.ensure_release(release))
    return subprocess.run([sys.executable, "-c", NO_ZEROSTATE, script.name], cwd=script.parent,
                          capture_output=True, text=True, timeout=timeout, env=env)


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
    """A repro needs no installed zerostate: outside the embedded sources it imports zerostate only in
    ``main()`` (served by its own import hook), and every zerostate module the script or an embedded
    module imports is embedded (the runs below refuse every other zerostate import)."""
    import ast
    text = hook_repro.read_text()
    tree = ast.parse(text)
    compile(text, str(hook_repro), "exec")
    assert "import deepspeed" in text
    ns = _scripts_namespace(text)
    embedded = ns["EMBEDDED"]
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [ast.unparse(n) for n in top if "zerostate" in ast.unparse(n)], "a repro must not need zerostate"
    sources = [text] + [src for _, src in embedded.values()]
    packages = {n.rsplit(".", k)[0] for n in embedded for k in range(1, n.count(".") + 1)}
    for src in sources:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("zerostate"):
                names = {node.module} if node.module in embedded else \
                    {f"{node.module}.{a.name}" for a in node.names}
                assert node.module in embedded or (node.module in packages and names <= embedded.keys()), \
                    f"{ast.unparse(node)}: not embedded"
    assert not re.search(r"^(from|import)\s+zerostate", text.split("EMBEDDED = {}")[0], re.M)


def test_repro_embeds_the_projects_own_checks_verbatim(hook_repro):
    """The script judges with the project's specs, agreement projection, tracer and executor --
    the files themselves, not a re-implementation -- and carries no hook checks of its own."""
    import inspect
    import zerostate.specs.hook_specs
    import zerostate.specs.coordinator_specs
    import zerostate.findings.agreement
    import zerostate.harness.executor
    import zerostate.findings.decide
    import zerostate.tracing.harness_tracer
    embedded = _scripts_namespace(hook_repro.read_text())["EMBEDDED"]
    for mod in (zerostate.specs.hook_specs, zerostate.specs.coordinator_specs, zerostate.findings.agreement,
                zerostate.harness.executor, zerostate.findings.decide,
                zerostate.tracing.harness_tracer):
        assert embedded[mod.__name__][1] == Path(inspect.getsourcefile(mod)).read_text(), mod.__name__
    assert embedded["zerostate.specs"][0] is True  # a package: its __init__ (SPECS) is embedded too
    outside = hook_repro.read_text().split("EMBEDDED = {}")[0]
    assert "class Watch" not in outside and "def verdict" not in outside and "def project" not in outside


def test_the_embedded_code_is_built_once_and_again_when_a_file_changes(monkeypatch):
    """A report writes a script per finding (three times each in an exploration): the embedded block is kept,
    not rebuilt, while every embedded file's (mtime, size) is what it was, and rebuilt from the files when one
    differs."""
    repro = zerostate.harness.repro
    monkeypatch.setattr(repro, "_EMBEDDED", {})
    text = repro._embedded_text()
    files, stamps, _ = repro._EMBEDDED["block"]
    assert len(files) == len(repro.embedded_modules()) and files[0].endswith(".py")
    repro._EMBEDDED["block"] = (files, stamps, "kept")
    assert repro._embedded_text() == "kept"  # nothing changed: the block is not built again
    repro._EMBEDDED["block"] = (files, ((stamps[0][0] + 1, stamps[0][1]), *stamps[1:]), "stale")
    assert repro._embedded_text() == text  # one file's stamp differs: rebuilt from the files


@pytest.mark.deepspeed
def test_hook_repro_passes_on_the_pinned_release(hook_repro):
    r = run_repro(hook_repro)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.deepspeed
@RELEASES
def test_hook_repro_fails_on_0_18_4(hook_repro):
    r = run_repro(hook_repro, "0.18.4")
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.returncode == 1 and "BUG PRESENT (epilogue-once)" in r.stdout, r.stdout[-2000:]  # its own check


@pytest.mark.deepspeed
def test_seed002_repro_passes_on_the_pinned_release(seed002_repro):
    r = run_repro(seed002_repro)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.deepspeed
@RELEASES
def test_seed002_repro_fails_on_0_19_2(seed002_repro):
    r = run_repro(seed002_repro, "0.19.2")
    assert r.returncode != 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.returncode == 1 and "BUG PRESENT (saved-tensor-intact)" in r.stdout, r.stdout[-2000:]


@pytest.mark.deepspeed
def test_model_agreement_repro_judges_with_the_embedded_projection(hook_repro, tmp_path):
    """A model-agreement repro compares the embedded model trace with the real run through the embedded
    `agreement.compare`: for seed 000 part 1's scenario the ds-0.18.4 design's trace (a premature
    epilogue) disagrees with the pinned release (exit 1), the pinned release's own design agrees (exit 0)."""
    from zerostate.model.scenario import Scenario
    from zerostate.findings.finding import Finding
    from zerostate.harness.repro import repro_script
    import deepspeed
    sc = Scenario.from_dict(_scripts_namespace(hook_repro.read_text())["SPEC"])
    codes = {}
    for release in ("0.18.4", deepspeed.__version__):
        script = tmp_path / f"repro_{release}.py"
        script.write_text(repro_script(Finding("model-agreement", "...", sc, deepspeed=release), 1))
        r = run_repro(script)
        codes[release] = r.returncode
        if release == "0.18.4":
            assert r.returncode == 1 and "BUG PRESENT (model-agreement)" in r.stdout, \
                r.stdout[-2000:] + r.stderr[-2000:]
    assert codes[deepspeed.__version__] == 0, codes


@pytest.mark.deepspeed
def test_failed_checks_is_the_targets_judgement():
    """`run_checks.failed_checks` (what a repro judges with) gives the check ids of the findings
    `DeepSpeedTarget.run` reports, on the same run record -- a clean run and one with findings."""
    from zerostate.model.scenario import Scenario
    from zerostate.findings.decide import failed_checks
    from zerostate.targets.deepspeed.target import DeepSpeedTarget
    from zerostate.model.explore import run as model_run
    from zerostate.model.events import Event
    from zerostate.findings.record import RunRecord
    from zerostate.findings.wire import from_wire
    with DeepSpeedTarget(deepspeed="0.19.2") as t:
        for spec in (SEED_002, {"blocks": [{"checkpoint": "non_reentrant"}, {"leaf": True}], "stage": 3},
                     {"blocks": [{}], "stage": 2}):
            sc = Scenario.from_dict(spec)
            res = t.worker_response(sc)["result"]
            t.worker_response = lambda _sc, _res={"ok": True, "result": res}: _res  # the same result, judged by run()
            outcome = t.run(sc)
            del t.worker_response
            model = None if sc.beyond_model() else [Event.from_dict(e.to_dict())
                                                             for e in model_run(t.design, sc).events]
            got = failed_checks(from_wire(RunRecord, res), sc, model, t.design.name)
            assert set(got) == {f.check for f in outcome.findings}, (spec, set(got), outcome.findings)
            for f in outcome.findings:
                if f.code:
                    assert got[f.check].detail == f.code
            if spec is SEED_002:
                assert "saved-tensor-intact" in got  # the case has findings: the comparison can fail


@pytest.mark.deepspeed
def test_world_size_2_repro_judges_the_ranks_together(tmp_path):
    """A ranks-params finding's script gathers both ranks' results under torchrun and judges them with the
    embedded cross-rank checks (the ranks agree on the pinned release: exit 0 from both); with plain
    ``python`` (one rank) it cannot judge a cross-rank check and says so (exit 2)."""
    import shutil
    from zerostate.model.scenario import Scenario
    from zerostate.findings.finding import Finding
    from zerostate.harness.repro import repro_script
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    f = Finding("ranks-params", "...", Scenario.from_dict({"blocks": [{"checkpoint": "non_reentrant"}, {"leaf": True}],
                                                            "stage": 3}), deepspeed="0.19.8", world_size=2)
    script = tmp_path / "repro_1.py"
    script.write_text(repro_script(f, 1))
    assert "torchrun --nproc-per-node 2 repro_1.py" in script.read_text()
    one = run_repro(script)
    assert one.returncode == 2 and "torchrun" in one.stdout, one.stdout[-2000:] + one.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "HYPOTHESIS", "MASTER_", "RANK"))}
    env.pop("PYTHONPATH", None)
    (tmp_path / "no_zerostate.py").write_text(NO_ZEROSTATE)
    from zerostate.harness.rank_pool import free_port
    r = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "no_zerostate.py",
                        script.name],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.count("OK: ranks-params not reproduced") == 2, \
        r.stdout[-2000:] + r.stderr[-3000:]


@pytest.mark.deepspeed
def test_world_size_2_repro_of_an_exception_on_one_rank_ends_with_its_verdict(tmp_path):
    """Only rank 1 raises (``z3-set-full-fp32-param-unpadded``) and rank 0 waits in DeepSpeed's next collective: the
    script must not gather the ranks' results then (it would wait with rank 0 for ever) -- rank 1 judges its own record,
    says BUG PRESENT and exits 1, and torchrun stops rank 0."""
    import shutil
    from zerostate.model.scenario import Scenario
    from zerostate.findings.finding import Finding
    from zerostate.harness.repro import repro_script
    from zerostate.harness.rank_pool import free_port
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    f = Finding("exception", "RuntimeError: start (25) + length (25) exceeds dimension size (49).",
                Scenario.from_dict({"stage": 3, "width": 7, "steps": [{}, {"gather": "edit"}]}), deepspeed="0.19.8",
                world_size=2)
    script = tmp_path / "repro_1.py"
    script.write_text(repro_script(f, 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "HYPOTHESIS", "MASTER_", "RANK"))}
    env.pop("PYTHONPATH", None)
    (tmp_path / "no_zerostate.py").write_text(NO_ZEROSTATE)
    r = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "no_zerostate.py",
                        script.name], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1 and "BUG PRESENT (exception)" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert "judged on its own record" in r.stdout


def test_repro_names_itself(hook_repro):
    assert f"python {hook_repro.name}" in hook_repro.read_text()


def _scripts_namespace(text: str) -> dict:
    """The script's module-level names, without running ``main()`` (no DeepSpeed run)."""
    ns: dict = {"__name__": "repro_under_test"}
    exec(compile(text, "repro.py", "exec"), ns)
    return ns


def test_an_order_dependent_findings_repro_runs_its_sequence_first():
    """The sequence the explorer found goes into the script (BEFORE, run first in the same
    process, each engine destroyed before the next), and an intermittent finding's rate into REPEAT."""
    from zerostate.model.scenario import Scenario
    from zerostate.findings.finding import Finding
    from dataclasses import replace

    from zerostate.explorer.confirm import Confirmation
    from zerostate.harness.repro import repro_script
    sc = Scenario.from_dict(SEED_002)
    before = [Scenario.from_dict({"blocks": [{}], "stage": 1}), Scenario.from_dict({"blocks": [{"leaf": True}]})]
    f = Finding("oracle", "after train step 0: ...", sc, deepspeed="0.19.2",
                confirmation=Confirmation("order-dependent", sequence=before))
    ns = _scripts_namespace(repro_script(f, 3))
    assert ns["BEFORE"] == [s.to_dict() for s in before] and ns["REPEAT"] == 1
    assert "Order-dependent: the finding appears only after 2 other example(s)" in ns["__doc__"]
    f = replace(f, confirmation=Confirmation("intermittent", repeat=100, hits=3))
    ns = _scripts_namespace(repro_script(f, 3))
    assert ns["BEFORE"] == [] and ns["REPEAT"] == 100 and "Intermittent (a race)" in ns["__doc__"]
    f = replace(f, confirmation=Confirmation("confirmed"))
    ns = _scripts_namespace(repro_script(f, 3))
    assert ns["BEFORE"] == [] and ns["REPEAT"] == 1
