"""The explorer the deepspeed target is driven by (targets/explorer.py), exercised on the model target.

Fast (no DeepSpeed): determinism, shrinking, the example budget, findings handed over as they are
final, a broken target, Ctrl-C.
"""

from __future__ import annotations

import pytest

from zerostate.model.scenario import Scenario
from zerostate.targets.base import Finding, Outcome, get_target
from zerostate.targets.explorer import explore, hard_cap


def test_deterministic_and_shrunk():
    t = get_target("model", design="ds-0.18.4")
    runs = [explore(t, examples=60, seed=None) for _ in range(2)]
    keys = [sorted((f.key, f.scenario.to_json(None)) for f in r.findings) for r in runs]
    assert keys[0] == keys[1] and keys[0]
    for f in runs[0].findings:  # 0.18.4's double count needs plain, reentrant, plain: 3 blocks is minimal
        assert len(f.scenario.blocks) <= 3 and len(f.scenario.steps) <= 2, f.scenario.describe()
    epi = next(f for f in runs[0].findings if f.check == "epilogue-once")
    assert len(epi.scenario.blocks) == 1 and len(epi.scenario.steps) == 1, epi.scenario.describe()


def test_findings_are_handed_over_as_they_come_and_progress_is_reported():
    t = get_target("model", design="ds-0.18.5")
    got, progress = [], []
    res = explore(t, examples=60, seed=None, on_finding=got.append,
                  on_progress=lambda n, k, s: progress.append((n, k)))
    assert [f.key for f in got] == [f.key for f in res.findings]
    assert "count-once-per-phase" in {f.check for f in got}
    assert progress and progress[-1][0] == res.examples <= hard_cap(60)


def test_stop_and_seed():
    t = get_target("model", design="ds-0.18.5")
    res = explore(t, examples=60, seed=1234, stop=lambda found: bool(found))
    assert len({f.key for f in res.findings}) >= 1


class _Broken:
    name, version = "broken", None

    def __init__(self, after: int, exc: BaseException):
        self.n, self.after, self.exc = 0, after, exc
        self.inner = get_target("model", design="ds-0.18.4")

    def run(self, sc: Scenario) -> Outcome:
        self.n += 1
        if self.n > self.after:
            raise self.exc
        return self.inner.run(sc)

    def close(self) -> None:
        pass


def test_a_broken_target_stops_the_run_with_its_own_error():
    with pytest.raises(RuntimeError, match="worker cannot restart"):
        explore(_Broken(3, RuntimeError("worker cannot restart")), examples=50, seed=None)


def test_ctrl_c_hands_over_what_was_seen():
    got: list[Finding] = []
    with pytest.raises(KeyboardInterrupt):
        explore(_Broken(40, KeyboardInterrupt()), examples=200, seed=None, on_finding=got.append)
    assert got
