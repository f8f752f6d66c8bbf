"""A hang's shrinking is capped: each run that hangs is held to the step timeout (60 s) and restarts a worker or a
rank pool, so a hang every smaller scenario keeps would cost a minute per shrinking step.  After
`HANG_SHRINK_RUNS` hung runs the key is handed over as seen; other keys shrink as before."""

from __future__ import annotations

from zerostate.explorer.exploration import HANG_SHRINK_RUNS, explore
from zerostate.findings.finding import Finding
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Target, get_target


class _HangsAtZero3(Target):
    """The model target, but every ZeRO-3 run of two blocks or more hangs (a timeout finding, as the DeepSpeed
    target reports one), and every run of three blocks or more also finds a plain exception."""

    name, version = "hangs-at-zero3", None

    def __init__(self) -> None:
        self.inner = get_target("model", design="zerostate")
        self.design = self.inner.design
        self.hung: list[Scenario] = []

    def run(self, sc: Scenario) -> Outcome:
        out = self.inner.run(sc)
        if sc.stage == 3 and len(sc.blocks) >= 2:
            self.hung.append(sc)
            out.findings.append(Finding("hang", "a step took longer than 60 s (worker killed and restarted)", sc,
                                        target=self.name))
        if len(sc.blocks) >= 3:
            out.findings.append(Finding("exception", "RuntimeError: three blocks", sc, target=self.name,
                                        origin="RuntimeError@three"))
        return out


def test_a_hang_stops_shrinking_after_its_cap_and_is_handed_over_as_seen():
    t = _HangsAtZero3()
    res = explore(t, examples=40, seed=None, confirm=False, pairs=False, goals=False)
    generated = {Scenario.from_dict(g["scenario"]) for g in res.generated}
    by_check = {f.check: f for f in res.findings}
    assert "hang" in by_check and "exception" in by_check, [f.key for f in res.findings]
    shrinking_hangs = [sc for sc in t.hung if sc not in generated]  # uncapped: 13 (each a minute on DeepSpeed)
    assert len(shrinking_hangs) <= HANG_SHRINK_RUNS * len(res.findings), len(shrinking_hangs)
    hang = by_check["hang"]
    assert hang.shrunk is False, hang.scenario  # handed over as seen (uncapped: shrunk)
    assert by_check["exception"].shrunk and len(by_check["exception"].scenario.blocks) == 3  # the others shrink on
