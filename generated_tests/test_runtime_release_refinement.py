"""Refinement of the release policy: real DeepSpeed with the runtime releases frozen parameters exactly
where the model's ``zerostate`` coordinator design does.

Hypothesis draws ZeRO-3 scenarios with frozen parameters and plain / non-reentrant-checkpointed blocks.
Each runs (a) in the model, design ``zerostate``, PyTorch's CPU order, and (b) on the installed
DeepSpeed with ``zerostate.runtime`` installed in the deepspeed target's worker, traced.  Both traces
are projected, per frozen parameter, onto its FETCH / PREFETCH / RELEASE events, each anchored at the
module hook it happened in (``module_post_backward:blocks.0.norm`` ...): the two projections must be
equal -- the runtime gathers and releases every frozen parameter at the same hook as the model.

CI: ``ZEROSTATE_RUNTIME_RELEASE_EXAMPLES`` (default 12) examples on the installed release.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from zerostate.model.designs import get_design
from zerostate.model.events import Ev
from zerostate.model.explore import run
from zerostate.model.network import Network
from zerostate.model.scenario import Checkpoint, ParamKind
from zerostate.targets.strategies import scenarios

pytestmark = [pytest.mark.deepspeed]

_MOD = (Ev.MODULE_PRE_FORWARD, Ev.MODULE_POST_FORWARD, Ev.MODULE_PRE_BACKWARD, Ev.MODULE_POST_BACKWARD)
_PARAM = (Ev.FETCH, Ev.PREFETCH, Ev.RELEASE)


def project(events, params) -> dict:
    out: dict = {p: [] for p in params}
    anchor = "start"
    for e in events:
        if e.kind in _MOD:
            anchor = f"{e.kind.value}:{e.module}:{e.phase or ''}"
        elif e.kind in (Ev.USER_BACKWARD_START, Ev.STEP, Ev.FORWARD_START, Ev.EPILOGUE):
            anchor = e.kind.value
        elif e.kind in _PARAM and e.param in out:
            out[e.param].append((e.kind.value, anchor))
    return out


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


# One train step: from the second step on (COMPLETE trace) real DeepSpeed keeps a parameter whose next
# use is near (reuse distance: the last module of forward is the first of backward), which the
# coordinator model does not do yet -- for stock 0.19.8 vs the ds-0.19.3 design alike, so it is a model
# gap, not the runtime's; widen to max_steps=2 once the model has it.
_STRATEGY = scenarios(max_blocks=3, max_steps=1, max_gas=1, stages=(3,),
                      kinds=(ParamKind.TRAINABLE, ParamKind.FROZEN),
                      checkpoints=(Checkpoint.NON_REENTRANT, Checkpoint.NONE),
                      leaf=False, fused_head=False, eval_forwards=False, knobs=False)


@settings(max_examples=int(os.environ.get("ZEROSTATE_RUNTIME_RELEASE_EXAMPLES", "12")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sc=_STRATEGY)
def test_real_release_points_match_the_zerostate_model(runtime_target, sc):
    net = Network(sc)
    frozen = [n for n, p in net.params.items() if p.frozen and not p.persistent]
    if not frozen:
        return
    if not any(p.trainable and p.kind is not ParamKind.UNUSED for p in net.params.values()):
        return  # no optimizer can be built (the target skips it)
    model = run(get_design("zerostate"), sc)
    out = runtime_target.run(sc)
    if out.details.get("skipped"):
        return
    assert out.error is None, out.error
    got, want = project(out.trace, frozen), project(model.events, frozen)
    for p in frozen:
        assert got[p] == want[p], (f"{p}: real DeepSpeed + runtime and the zerostate model differ\n"
                                   f"real:  {got[p]}\nmodel: {want[p]}\n{sc.describe()}")
