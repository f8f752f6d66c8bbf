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

from zerostate.targets.interface import get_target
from zerostate.known.issues import SEED_BUGS
from zerostate.explorer.exploration import explore

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

SEEDS = [(v, pred) for v, (_, pred) in SEED_BUGS.items()]


def _enabled(version: str) -> bool:
    want = os.environ.get("ZEROSTATE_RELEASES", "")
    return want in ("1", "all", "yes", "true") or version in want.replace(",", " ").split()


@pytest.mark.parametrize("version, is_seed", SEEDS, ids=[s[0] for s in SEEDS])
def test_seed_bug_found_and_shrunk(version, is_seed):
    if not _enabled(version):
        pytest.skip("set ZEROSTATE_RELEASES=1 (or the version) to explore older releases")
    t = get_target("deepspeed", deepspeed=version)
    try:
        runs = [explore(t, examples=200, seed=None, stop=lambda found: any(map(is_seed, found)))
                for _ in range(2)]  # twice: the same findings both times
    finally:
        t.close()
    hit = [f for f in runs[0].findings if is_seed(f)]
    assert hit, f"the seed bug was not found on {version} within 200 examples: {[f.key for f in runs[0].findings]}"
    sc = hit[0].scenario
    assert len(sc.blocks) <= 2 and len(sc.steps) <= 2, sc.describe()
    assert {f.key: f.scenario for f in runs[0].findings} == {f.key: f.scenario for f in runs[1].findings}


def test_pinned_release_findings_are_all_documented():
    if not _enabled("0.19.8"):
        pytest.skip("set ZEROSTATE_RELEASES=1 (or 0.19.8) to run the 200-example exploration of 0.19.8")
    from zerostate.known.issues import explain
    t = get_target("deepspeed", deepspeed="0.19.8")
    try:
        res = explore(t, examples=200, seed=None)
    finally:
        t.close()
    unexplained = [f for f in res.findings if explain(f) is None]
    assert not unexplained, "\n".join(f"{f.key}: {f.error.splitlines()[0]}\n  {f.scenario.to_json(None)}"
                                      for f in unexplained)
