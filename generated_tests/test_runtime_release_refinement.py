"""Refinement of the release policy: real DeepSpeed with the runtime fetches, releases and holds every
parameter exactly where the model's ``zerostate`` coordinator design does.

Hypothesis draws ZeRO-3 scenarios from the full scenario strategy (`targets.strategies.scenarios`: plain /
reentrant / non-reentrant blocks, trainable / frozen / unused parameters, z3 leaf blocks, the fused head,
inputs with and without grad, eval forwards, branches, hook re-registration, gas 1-2, at least two train
steps, and the ZeRO-3 knobs at 0, between the parameter sizes and at DeepSpeed's defaults: persistence
threshold 0 / 8 / 1e5, ``stage3_max_reuse_distance`` 1e9 / 0 / 128, ``stage3_prefetch_bucket_size`` 0 / 1 /
256 / DeepSpeed's default 5e7 and ``stage3_max_live_parameters`` 0 / 64 / the default 1e9).
Each runs (a) in the model, design ``zerostate``, PyTorch's CPU order, and (b) on the installed
DeepSpeed with ``zerostate.runtime`` installed in the deepspeed target's worker, traced.  Both traces are
projected, per parameter, onto its FETCH / PREFETCH / RELEASE events and its holder count, each anchored
at the module hook it happened in (``module_post_backward:blocks.0.norm`` ...): the two projections must
be equal.

Prefetch is compared like everything else: DeepSpeed also fetches (and so prefetches) in the hooks of the
parameter-less ``Block`` containers, and so does the model (``CONTAINER_HOOK``, docs/coordinator.md).
Not covered: the training-setup dimensions the model does not represent (`Scenario.beyond_model`) are not
drawn; runs that raise in DeepSpeed itself are accepted only when a known DeepSpeed issue explains them.

CI: ``ZEROSTATE_RUNTIME_RELEASE_EXAMPLES`` (default 25) examples on the installed release.

Seed 002 at DeepSpeed's DEFAULT ``stage3_param_persistence_threshold`` (1e5): the small frozen
norms are persistent, and while the trace is not COMPLETE ``release_sub_module`` partitions persistent
parameters too.  On the installed release the runtime must keep them whole through the recompute (the
trace shows no release between the recompute's fetch and the metadata check); on 0.19.0-0.19.2 that
release is seed 002's CheckpointError -- opt-in, ``ZEROSTATE_RUNTIME_RELEASES=0.19.2`` (stock fails,
runtime passes).
"""

from __future__ import annotations

import inspect
import os

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from zerostate.model.designs import get_design
from zerostate.model.events import EventKind
from zerostate.model.explore import run
from zerostate.model.network import Network
from zerostate.model.scenario import Checkpoint, ParamKind
from zerostate.findings.agreement import coordinator_project
from zerostate.explorer.strategies import scenarios

pytestmark = [pytest.mark.deepspeed]

def project(events, params, holders: bool = False) -> dict:
    """Per parameter: (FETCH | PREFETCH | RELEASE, anchor) and, with ``holders``, the holder count where it
    changed -- the model-agreement projection of the coordinator half (`agreement.coordinator_project`)."""
    return coordinator_project(events, params, holders)


def _runtime_target(site, release=None, runtime=True):
    from zerostate.targets.deepspeed.target import DeepSpeedTarget

    mp = pytest.MonkeyPatch()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        mp.delenv(k, raising=False)
    mp.setenv("ZEROSTATE_RUNTIME", "1" if runtime else "0")
    mp.setenv("PYTHONPATH", str(site) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                         else ""))
    try:
        return DeepSpeedTarget(deepspeed=release, design="zerostate")
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def runtime_target(tmp_path_factory):
    from zerostate.targets.deepspeed.target import DeepSpeedTarget

    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('ZEROSTATE_RUNTIME') == '1':\n"
        "    from zerostate.runtime.autoinstall import enable\n    enable()\n")
    mp = pytest.MonkeyPatch()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        mp.delenv(k, raising=False)
    mp.setenv("ZEROSTATE_RUNTIME", "1")
    mp.setenv("PYTHONPATH", str(site) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                         else ""))
    target = DeepSpeedTarget(design="zerostate")
    mp.undo()
    yield target
    target.close()


PREFETCH_BUCKETS = (0, 1, 256, 50_000_000)
"""``stage3_prefetch_bucket_size``: off, one parameter at a time, a few parameters, DeepSpeed's default."""
MAX_LIVE = (1_000_000_000, 64, 0)
"""``stage3_max_live_parameters``: DeepSpeed's default, one Linear weight (width 8), nothing to prefetch."""

_STRATEGY = st.tuples(
    scenarios(stages=(3,), **{k: False for k in ("setup", "llama") if k in inspect.signature(scenarios).parameters}),
    st.sampled_from(PREFETCH_BUCKETS), st.sampled_from(MAX_LIVE)).map(
    lambda t: t[0].with_(prefetch_bucket_size=t[1], max_live_parameters=t[2],
                         steps=t[0].steps if len(t[0].steps) >= 2 else t[0].steps * 2))


def _kept_gathered():
    """Known issue z3-leaf-kept-gathered's scenario (a frozen z3 leaf fed without grad, two steps): the runtime's
    leaf reuse walk releases the leaf after its forward -- rare in the strategy, so always played (a runtime
    without the walk passes 200 drawn examples, measured, and fails this one)."""
    from zerostate.known.issues import Z3_LEAF_KEPT_GATHERED
    return Z3_LEAF_KEPT_GATHERED.scenario


@settings(max_examples=int(os.environ.get("ZEROSTATE_RUNTIME_RELEASE_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sc=_STRATEGY)
@example(sc=_kept_gathered())
def test_real_release_points_match_the_zerostate_model(runtime_target, sc):
    if getattr(sc, "beyond_model", lambda: ())():
        return  # a training-setup dimension the model does not represent
    net = Network(sc)
    if not any(p.trainable and p.kind is not ParamKind.UNUSED for p in net.params.values()):
        return  # no optimizer can be built (the target skips it)
    model = run(get_design("zerostate"), sc)
    out = runtime_target.run(sc)
    if out.skipped:
        return
    if out.error is not None:
        from zerostate.known.issues import explain

        crashes = [f for f in out.findings if f.check in ("exception", "oracle", "saved-tensor-intact")]
        assert crashes and all(explain(f) and explain(f).owner == "deepspeed" for f in crashes), out.error
        return  # a DeepSpeed bug the runtime does not touch, on a truncated trace
    params = list(net.params)
    got, want = project(out.trace, params, holders=True), project(model.events, params, holders=True)
    event("compared" + (", prefetching" if any(e[0] == "prefetch" for v in want.values() for e in v) else ""))
    for p in params:
        assert got[p] == want[p], (f"{p}: real DeepSpeed + runtime and the zerostate model differ\n"
                                   f"real:  {got[p]}\nmodel: {want[p]}\n{sc.describe()}\n{sc.to_json(None)}")


# ----------------------------------------------------- seed 002 at DeepSpeed's default persistence threshold
DEFAULT_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's ``stage3_param_persistence_threshold`` default (1e5): every parameter of these nets is persistent."""


def seed002_at_default_threshold():
    from zerostate.model.scenario import Block, Scenario, TrainStep

    return Scenario(blocks=(Block(Checkpoint.NON_REENTRANT, norm=ParamKind.FROZEN),) * 2, stage=3,
                    persistence_threshold=DEFAULT_PERSISTENCE_THRESHOLD,
                    steps=(TrainStep(),) * 2).validate()


def released_between_recompute_and_check(events, params) -> list[str]:
    """Frozen params a RELEASE hit after a non-reentrant recompute started and before torch's metadata
    check of that block (UNPACK note=check): what seed 002's CheckpointError is made of."""
    bad, open_ = [], set()
    for e in events:
        if e.kind is EventKind.RECOMPUTE_START:
            open_ |= {p for p in params if p.startswith((e.module or "") + ".")}
        elif e.kind is EventKind.RELEASE and e.param in open_:
            bad.append(f"{e.param} released at {e.module}")
        elif e.kind is EventKind.UNPACK and e.note == "check":
            open_.discard(e.param)
    return bad


def test_seed002_at_default_persistence_threshold_installed_release(runtime_target):
    """At the default threshold the frozen norms are persistent; the runtime keeps
    them whole from the recompute to the metadata check (on the installed release no crash either way,
    but before the fix the trace showed the release: the norm partitioned by the recompute's post-forward
    while the trace is RECORD), and matches the zerostate design on every frozen parameter."""
    sc = seed002_at_default_threshold()
    net = Network(sc)
    frozen = [n for n, p in net.params.items() if p.frozen]
    assert frozen and all(net.params[p].persistent for p in frozen)
    out = runtime_target.run(sc)
    assert out.error is None, out.error
    assert not out.findings, [(f.check, f.error.splitlines()[0]) for f in out.findings]
    assert not released_between_recompute_and_check(out.trace, frozen)
    model = run(get_design("zerostate"), sc)
    got, want = project(out.trace, frozen), project(model.events, frozen)
    assert got == want


def _releases() -> list:
    return [pytest.param(v, marks=pytest.mark.slow)
            for v in os.environ.get("ZEROSTATE_RUNTIME_RELEASES", "").split(",") if v] or [
        pytest.param("none", marks=pytest.mark.skip(reason="opt-in: ZEROSTATE_RUNTIME_RELEASES=0.19.2"))]


@pytest.mark.parametrize("release", _releases())
def test_seed002_at_default_persistence_threshold_other_release(release, tmp_path):
    """On 0.19.0-0.19.2 stock dies of seed 002's CheckpointError at the default threshold; the runtime
    trains (no finding against the zerostate design)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('ZEROSTATE_RUNTIME') == '1':\n"
        "    from zerostate.runtime.autoinstall import enable\n    enable()\n")
    sc = seed002_at_default_threshold()
    stock = _runtime_target(site, release, runtime=False)
    try:
        bad = stock.run(sc)
    finally:
        stock.close()
    if stock.version.startswith("0.19.") and int(stock.version.split(".")[2]) <= 2:
        assert any(f.check == "saved-tensor-intact" for f in bad.findings), \
            f"stock {stock.version} did not fail at the default threshold: {[f.check for f in bad.findings]}"
    fixed = _runtime_target(site, release)
    try:
        out = fixed.run(sc)
    finally:
        fixed.close()
    assert out.error is None, out.error
    assert not any(f.check in ("saved-tensor-intact", "exception", "oracle") for f in out.findings), \
        [(f.check, f.error.splitlines()[0]) for f in out.findings]


@pytest.fixture
def rendezvous_restored():
    """The rendezvous variables as they were before the test: an in-process DeepSpeed sets them
    (``selfcheck._setup_dist``) to the port its live process group keeps listening on, and a later test's
    worker inheriting MASTER_PORT dies of EADDRINUSE."""
    names = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in names}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_runtime_holds_persistent_frozen_params_itself_at_default_threshold(rendezvous_restored):
    """The mechanism 0.19.0-0.19.2 need, checked on the installed release: at DeepSpeed's default
    threshold a frozen norm recomputed by a non-reentrant checkpoint is kept whole by the runtime's own
    hold (``HOLD_ID``) through its recompute post-forward -- not by 0.19.3+'s attribution to the backward
    module in progress, which 0.19.2 does not have."""
    import torch

    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from zerostate.runtime import install, selfcheck, uninstall
    from zerostate.runtime.release_policy import HOLD_ID

    selfcheck._setup_dist()
    net = selfcheck._build({"stage": 3, "ckpt": "non_reentrant", "frozen": True})
    params = [p for p in net.parameters() if p.requires_grad]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3}}  # every threshold at DeepSpeed's default
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(params, lr=0.1), config=cfg,
                                      model_parameters=params)
    seen: list = []

    def after_release(module, inputs, output):  # appended: runs after DeepSpeed's post-forward release
        if torch._C._current_graph_task_id() != -1:
            seen.extend([(p.ds_persist, p.ds_status == ZeroParamStatus.AVAILABLE, HOLD_ID in p.ds_active_sub_modules)
                         for p in module.parameters()])

    handles = [b.norm.register_forward_hook(after_release) for b in engine.module.blocks]
    install(engine)
    try:
        for _ in range(2):
            engine.backward(engine(torch.randn(4, selfcheck.WIDTH, requires_grad=True)).pow(2).mean())
            engine.step()
    finally:
        for h in handles:
            h.remove()
        uninstall(engine)
        engine.destroy()
    # the last block's norm is not the block's last module, so its post-forward fires in every recompute
    assert seen and all(all(s) for s in seen), seen


@pytest.mark.parametrize("stage,threshold", [(3, DEFAULT_PERSISTENCE_THRESHOLD), (3, 0), (2, 0)])
def test_runtime_reports_nothing_across_a_checkpoint(runtime_target, stage, threshold):
    """A checkpoint saved and loaded between the two steps (``save_load``) of seed 002's network,
    runtime installed: no hook runs inside the round trip; ZeRO-3's checkpoint prologue releases every
    parameter and its epilogue gathers the persistent ones again.  Neither the specs over the runtime's trace
    nor the checkpoint check nor the oracle report anything, and the round trip really ran (a record with
    files and a loaded path).  ZeRO-2: the model's agreement check runs too (a ZeRO-1/2 checkpoint is inside
    the model)."""
    from dataclasses import replace
    sc = seed002_at_default_threshold()
    sc = sc.with_(stage=stage, persistence_threshold=threshold,
                  steps=(sc.steps[0], replace(sc.steps[1], save_load=True))).validate()
    assert bool(sc.beyond_model()) == (stage == 3)
    out = runtime_target.run(sc)
    assert out.error is None, out.error
    assert not out.findings, [(f.check, f.error.splitlines()[0]) for f in out.findings]
    recs = out.record.checkpoints if out.record else ()
    assert len(recs) == 1 and recs[0].files and recs[0].loaded, out.record
