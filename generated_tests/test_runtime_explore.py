"""The real-DeepSpeed exploration with zerostate.runtime installed finds nothing stock does not.

The deepspeed target's worker gets the runtime through ``zerostate.runtime.autoinstall``
(a ``sitecustomize.py`` on ``PYTHONPATH`` + ``ZEROSTATE_RUNTIME=1``: every engine the worker's
``deepspeed.initialize`` builds is installed into), and the target judges the traces against
the ``zerostate`` model design (model-agreement) and every spec, beside the PyTorch oracle.

* CI: the installed release (0.19.8), a short derandomized exploration (``ZEROSTATE_RUNTIME_EXAMPLES``,
  default 25 examples per search).
* Opt-in: other releases, ``ZEROSTATE_RUNTIME_RELEASES=0.18.6,0.19.2`` -- releases that fail without
  the runtime (count-once-per-phase on 0.18.6, CheckpointError on 0.19.2).
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.deepspeed]

SITECUSTOMIZE = """import os
if os.environ.get("ZEROSTATE_RUNTIME") == "1":
    from zerostate.runtime.autoinstall import enable
    enable()
"""


def _releases() -> list:
    extra = [v for v in os.environ.get("ZEROSTATE_RUNTIME_RELEASES", "").split(",") if v]
    return [None] + [pytest.param(v, marks=pytest.mark.slow) for v in extra]


def _target(tmp_path, monkeypatch, release):
    from zerostate.targets.deepspeed.target import DeepSpeedTarget

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "installs.log"
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)  # set by an in-process engine of another test: not the worker's
    monkeypatch.setenv("ZEROSTATE_RUNTIME", "1")
    monkeypatch.setenv("ZEROSTATE_RUNTIME_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(site) + (os.pathsep + os.environ["PYTHONPATH"]
                                                  if os.environ.get("PYTHONPATH") else ""))
    return DeepSpeedTarget(deepspeed=release, design="zerostate"), log


@pytest.mark.parametrize("release", _releases())
def test_exploration_with_runtime_finds_nothing_new(release, tmp_path, monkeypatch):
    """Every finding with the runtime installed is one stock DeepSpeed has on the same scenario.

    Stock 0.19.8 has findings of its own that the runtime does not touch (e.g. a z3 leaf module
    whose input does not require grad; a ZeRO-1 model none of whose parameters is used), so each
    finding of the runtime run is replayed on stock DeepSpeed of the same release: it must be there
    too (same check, same place).  Findings the runtime *removes* are what it is for.
    """
    from zerostate.targets.deepspeed.target import DeepSpeedTarget
    from zerostate.explorer.exploration import explore
    from zerostate.known.labels import group_key

    target, log = _target(tmp_path, monkeypatch, release)
    try:
        # no confirmation replays (a fresh worker each): every finding is replayed on stock below, which is the check
        res = explore(target, examples=int(os.environ.get("ZEROSTATE_RUNTIME_EXAMPLES", "25")), seed=None,
                      confirm=False)
    finally:
        target.close()
    installs = log.read_text().splitlines() if log.exists() else []
    assert installs, "the worker never installed zerostate.runtime"
    monkeypatch.setenv("ZEROSTATE_RUNTIME", "0")
    stock = DeepSpeedTarget(deepspeed=release)
    new, preexisting = {}, {}
    try:
        for f in res.findings:
            found = stock.run(f.scenario).findings
            # Same finding: the same key, or the same root cause (`grouping.group_key`: the known DeepSpeed issue
            # explaining both, else the exception and its message).  Where DeepSpeed raises "has already been
            # reduced" depends on the engines an earlier example built in the same process (an order-dependent
            # finding); and on a known DeepSpeed bug the runtime may change the symptom -- two backwards
            # of one forward on ZeRO-1/2 (two-backwards-per-forward): stock skips the first backward's epilogue and
            # trains silently wrong, the runtime runs it and DeepSpeed then asserts "already been reduced".
            # The step's context (`fingerprint.step_context`) reads DeepSpeed's backward depth, which the runtime's
            # hook state keeps: the same crash in the same step() reads `@step/backward-unexited` on stock only.
            same = (f.key in {g.key for g in found} or group_key(f) in {group_key(g) for g in found}
                    or _without_step(f.key) in {_without_step(g.key) for g in found})
            (preexisting if same else new)[f.key] = (f"{f.error.splitlines()[0]}\n{f.scenario.describe()}\n"
                                                     f"scenario: {f.scenario.to_json(None)}\n"
                                                     f"stock: {sorted(g.key for g in found)}")
    finally:
        stock.close()
    print(f"DeepSpeed {target.version} with zerostate.runtime: {res.examples} runs, "
          f"pre-existing stock findings: {sorted(preexisting)}")
    assert not new, f"with zerostate.runtime on DeepSpeed {target.version}, not in stock: {new}"


@pytest.mark.parametrize("release", _releases())
def test_seed_scenarios_with_runtime(release, tmp_path, monkeypatch):
    """Seed 000 (reentrant + PyTorch-style backward) and seed 002 (frozen norm, non-reentrant) pass."""
    from zerostate.model.scenario import BackwardKind, Block, Checkpoint, MicroStep, ParamKind, Scenario, TrainStep

    seed000 = Scenario(blocks=(Block(Checkpoint.REENTRANT), Block()), stage=3,
                       steps=(TrainStep((MicroStep(BackwardKind.NONSCALAR),)),) * 2).validate()
    seed002 = Scenario(blocks=(Block(Checkpoint.NON_REENTRANT, norm=ParamKind.FROZEN),) * 2, stage=3,
                       persistence_threshold=0).validate()
    target, log = _target(tmp_path, monkeypatch, release)
    try:
        for sc in (seed000, seed002):
            out = target.run(sc)
            assert not out.findings, [(f.check, f.error) for f in out.findings]
    finally:
        target.close()
    assert log.exists() and log.read_text().count("release_policy=True") >= 1


@pytest.mark.parametrize("release", _releases())
def test_z3_leaf_input_without_grad_trains_with_runtime(release, tmp_path, monkeypatch):
    """Known issue z3-leaf-input-without-grad, on its scenario with every backward kind and on the model's
    two scenarios (test_hook_model.py; the second also without its kept-gathered leaf), and z3-leaf-kept-gathered
    on its own scenario: with the runtime (leaf deferral, leaf reuse walk) each trains, and the PyTorch oracle,
    every spec and the zerostate model design agree with the real trace.  Stock DeepSpeed of the same release
    still crashes on each with a leaf hook, and keeps the leaf of z3-leaf-kept-gathered's scenario gathered."""
    from test_hook_model import LEAF_INPUT_NO_GRAD, _leaf_input_no_grad_scenarios
    from zerostate.model.scenario import Scenario
    from zerostate.known.issues import Z3_LEAF_KEPT_GATHERED, explain
    from zerostate.targets.deepspeed.target import DeepSpeedTarget

    scs = {**_leaf_input_no_grad_scenarios(), **{k: Scenario.from_dict(v) for k, v in LEAF_INPUT_NO_GRAD.items()},
           "kept-gathered": Z3_LEAF_KEPT_GATHERED.scenario}
    target, log = _target(tmp_path, monkeypatch, release)
    try:
        with_runtime = {name: target.run(sc).findings for name, sc in scs.items()}
        assert target.design.name == "zerostate"  # model-agreement judged against the zerostate design
    finally:
        target.close()
    assert log.exists() and "closures_replaced=" in log.read_text()
    assert not any(with_runtime.values()), {k: [(f.key, f.error) for f in v] for k, v in with_runtime.items() if v}
    monkeypatch.setenv("ZEROSTATE_RUNTIME", "0")
    stock = DeepSpeedTarget(deepspeed=release)
    try:
        found = {name: stock.run(sc).findings for name, sc in scs.items() if name != "available-when-used"}
    finally:
        stock.close()
    # (no leaf hook there: an all-frozen leaf; 0.18.6 also counts in every hook, seed 000 part 2)
    kept = [f for f in found.pop("kept-gathered") if f.check == "released-after-backward"]
    assert [explain(f).id for f in kept] == ["z3-leaf-kept-gathered"], [(f.key, f.error) for f in kept]
    crashed = {name: [explain(f).id for f in fs if f.check == "exception"] for name, fs in found.items()}
    assert all(ids == ["z3-leaf-input-without-grad"] for ids in crashed.values()), crashed


def _without_step(key: str) -> str:
    """A key without the step's context an exception raised in step() carries."""
    return key.split("@step/", 1)[0]

