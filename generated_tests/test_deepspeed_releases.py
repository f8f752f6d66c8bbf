"""Acceptance against older DeepSpeed releases: each seed bug is found, shrunk, deterministically.

Not run by default (each release is installed into ``~/.cache/zerostate`` on first use and
explored for up to a minute or two).  Run them with::

    ZEROSTATE_RELEASES=1 pytest generated_tests/test_deepspeed_releases.py -v

(``ZEROSTATE_RELEASES=0.19.2`` runs that release only.)  Every run starts from an empty
Hypothesis database (the explorer uses none) with the ci profile's derandomized sequence.
Measured figures are in docs/deepspeed-target.md and benchmarks/bench_deepspeed_explore.py.
"""

from __future__ import annotations

import os

import pytest

from zerostate.targets.base import get_target
from zerostate.targets.explorer import explore

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

SEEDS = [
    # release, finding key, what the shrunk scenario must show
    ("0.18.4", "exception:RuntimeError@runtime.zero.stage3.zero_grad",
     lambda sc: sc.stage == 3 and any(b.checkpoint.value == "reentrant" for b in sc.blocks)
     and any(m.backward.pytorch_style for _, _, m in sc.micro_steps())),
    ("0.18.6", "count-once-per-phase", lambda sc: True),
    ("0.19.2", "saved-tensor-intact",
     lambda sc: sc.stage == 3 and any(b.checkpoint.value == "non_reentrant" and b.has_frozen for b in sc.blocks)),
]


def _enabled(version: str) -> bool:
    want = os.environ.get("ZEROSTATE_RELEASES", "")
    return want in ("1", "all", "yes", "true") or version in want.replace(",", " ").split()


@pytest.mark.parametrize("version, key, shape", SEEDS, ids=[s[0] for s in SEEDS])
def test_seed_bug_found_and_shrunk(version, key, shape):
    if not _enabled(version):
        pytest.skip("set ZEROSTATE_RELEASES=1 (or the version) to explore older releases")
    t = get_target("deepspeed", deepspeed=version)
    try:
        runs = []
        for _ in range(2):  # twice: the same findings both times
            res = explore(t, examples=200, seed=None, stop=lambda found: any(f.key == key for f in found))
            runs.append(res)
    finally:
        t.close()
    hit = [f for f in runs[0].findings if f.key == key]
    assert hit, f"{key} not found on {version} within 200 examples: {[f.key for f in runs[0].findings]}"
    sc = hit[0].scenario
    assert len(sc.blocks) <= 2 and len(sc.steps) <= 2, sc.describe()
    assert shape(sc), sc.describe()
    pos = runs[0].generated_at.get(key)
    assert pos is None or pos <= 200
    first = sorted((f.key, f.scenario.to_json(None)) for f in runs[0].findings)
    second = sorted((f.key, f.scenario.to_json(None)) for f in runs[1].findings)
    assert first == second


def test_pinned_release_findings_are_all_documented():
    if not _enabled("0.19.8"):
        pytest.skip("set ZEROSTATE_RELEASES=1 (or 0.19.8) to run the 200-example exploration of 0.19.8")
    from zerostate.targets.deepspeed.known import explain
    t = get_target("deepspeed", deepspeed="0.19.8")
    try:
        res = explore(t, examples=200, seed=None)
    finally:
        t.close()
    unexplained = [f for f in res.findings if explain(f) is None]
    assert not unexplained, "\n".join(f"{f.key}: {f.error.splitlines()[0]}\n  {f.scenario.to_json(None)}"
                                      for f in unexplained)
