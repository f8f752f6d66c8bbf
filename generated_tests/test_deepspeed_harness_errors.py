"""The harness's own errors are never findings about DeepSpeed, and the derandomized exploration has none.

`findings.harness.harness_error` says which failures are zerostate's own (its oracle raised, its executor or
its own code failed, the scenario could not be built before DeepSpeed ran); reports list them apart.  The
exploration here is the one the CI explorer tests run (the explorer's fixed seed over the default strategy),
cut after generation: any harness error in it fails the test, with its finding."""

from __future__ import annotations

import os

import pytest

from zerostate.findings.harness import harness_error

EXAMPLES = int(os.environ.get("ZEROSTATE_HARNESS_EXAMPLES", "100"))


@pytest.mark.deepspeed
@pytest.mark.slow
def test_the_derandomized_exploration_has_no_harness_error(ds):
    from zerostate.explorer.exploration import explore
    # stop at the first harness error, or at the first shrunk finding (generation is over: nothing is shrunk before)
    res = explore(ds, examples=EXAMPLES, seed=None, polish=False, confirm=False,
                  stop=lambda found: any(harness_error(f) or f.shrunk for f in found))
    own = [f for f in res.findings if harness_error(f)]
    assert not own, "\n".join(f"{harness_error(f)}: {f.key}: {f.error.splitlines()[0]}\n  scenario: "
                              f"{f.scenario.to_json(None)}" for f in own)
