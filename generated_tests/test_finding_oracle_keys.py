"""An oracle difference no counterfactual explains is keyed by what its own run shows (`findings.oracle_class`):
two different mechanisms are two keys (two findings, two groups, and ``diff`` calls a swap of one for the other
introduced), one mechanism in two shapes (other parameter names, sizes, counts, step numbers) is one key.
No DeepSpeed: the findings carry made-up evidence of the form the executor gives (`harness.evidence`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zerostate.reports.diff_classify import classify
from zerostate.findings.evidence import Evidence, OracleDiff, ParamDiff
from zerostate.findings.finding import Finding
from zerostate.findings.oracle_class import OTHER, ratio_class, update_class
from zerostate.known.labels import annotate, groups, labelled
from zerostate.model.events import Event, EventKind as K
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome

SC_SMALL = Scenario.from_dict({"blocks": [{}], "stage": 1})
SC_BIG = Scenario.from_dict({"blocks": [{}, {}, {}], "stage": 2, "width": 16,
                             "steps": [{"micro": [{"backward": "engine"}]}] * 3})


def _steps(*backwards: bool) -> tuple[Event, ...]:
    """A trace of train steps, each with a user backward before its STEP when ``backwards[i]``."""
    out: list[Event] = []
    for i, b in enumerate(backwards):
        out.append(Event(K.FORWARD_START))
        if b:
            out += [Event(K.USER_BACKWARD_START, note="engine"), Event(K.USER_BACKWARD_END, note="engine")]
        out.append(Event(K.STEP, value=i))
    return tuple(out)


def _oracle(sc: Scenario, step: int, rows: list[tuple[str, float | None]], trace: tuple[Event, ...],
            moved: tuple[str, ...] = (), version: str = "0.19.8", **flags: bool | None) -> Finding:
    """An oracle finding whose differing parameters got ``ratio`` times PyTorch's update (`ParamDiff`)."""
    params = tuple(ParamDiff(name, 1e-3 * (i + 1), r, 1.0, abs(r or 0.0), None, flags.get("last_only"),
                             flags.get("but_last")) for i, (name, r) in enumerate(rows))
    o = OracleDiff("params", step, params, rows[0][1], moved)
    return Finding("oracle", f"DeepSpeed {version} disagrees with PyTorch after train step {step}: {rows[0][0]}: ...",
                   sc, trace, None, "deepspeed", version, evidence=Evidence(oracle=o))


def test_the_ratio_classes():
    assert [ratio_class(r) for r in (0.0, 0.01, -1.0, -0.3, 2.04, 0.49, 1.0, 0.7, 1.6, 3.0, None)] == [
        "not-updated", "not-updated", "sign-flipped", OTHER, "x2", "x0.5", OTHER, OTHER, OTHER, OTHER, OTHER]
    p = ParamDiff("blocks.0.lin.weight", 1e-3, None, 0.0, 1.0, 1.0)
    assert update_class(p, ("blocks.0.lin.weight",)) == "stale-update-again"
    assert update_class(replace(p, again=None), ("blocks.0.lin.weight",)) == "moved-without-update"
    cf = ParamDiff("head.weight", 1e-3, 0.33, 1.0, 0.3, None, True, False)
    assert update_class(cf, ()) == "last-backward-only"
    assert update_class(replace(cf, last_only=False, but_last=True), ()) == "without-last-backward"
    assert update_class(replace(cf, last_only=False), ()) == OTHER  # no counterfactual matches: the ratio


def test_a_mixture_over_the_parameters_is_one_class_whatever_the_mixture():
    """A distorted update (clipping with another norm, a share lost) gives each parameter its own ratio: the
    mixture is ``other``, so a shape with other parameters (other ratios) keeps the key; what PyTorch left where
    it was is said apart."""
    mixed = _oracle(SC_SMALL, 0, [("blocks.0.lin.weight", 0.5), ("head.weight", 1.4), ("blocks.0.norm.bias", -0.2)],
                    _steps(True))
    other_mix = _oracle(SC_BIG, 0, [("blocks.1.lin.weight", 0.0), ("head.weight", 0.8)], _steps(True))
    assert mixed.key == other_mix.key == "oracle:unexplained:other@first-step"
    rows = [("blocks.1.lin.weight", 0.0), ("head.weight", 0.01), ("blocks.0.norm.weight", None)]
    with_kept = _oracle(SC_BIG, 1, rows, _steps(True, True), moved=("blocks.0.norm.weight",))
    assert with_kept.key == "oracle:unexplained:not-updated+moved-without-update@later-step"


def test_two_mechanisms_are_two_keys_and_one_mechanism_in_two_shapes_is_one():
    halved = _oracle(SC_SMALL, 0, [("blocks.0.lin.weight", 0.5)], _steps(True))
    halved_big = _oracle(SC_BIG, 1, [("blocks.2.norm.bias", 0.51), ("head.weight", 0.497), ("blocks.0.lin.bias", 0.5)],
                         _steps(False, True, True))  # step 0 idle: step 1 is the first that trained
    doubled = _oracle(SC_SMALL, 0, [("blocks.0.lin.weight", 2.0)], _steps(True))
    none = _oracle(SC_SMALL, 0, [("blocks.0.lin.weight", 0.0)], _steps(True))
    later = _oracle(SC_BIG, 1, [("blocks.0.lin.weight", 0.5)], _steps(True, True))
    frozen = _oracle(SC_SMALL, 0, [("blocks.0.lin.weight", None)], _steps(True), moved=("blocks.0.lin.weight",))
    assert halved.key == halved_big.key == "oracle:unexplained:x0.5@first-step"
    keys = [f.key for f in (halved, doubled, none, later, frozen)]
    assert len(set(keys)) == len(keys), keys
    assert later.key == "oracle:unexplained:x0.5@later-step"
    assert frozen.key == "oracle:unexplained:moved-without-update@first-step"
    # without a trace (a watched job's shape), the step's number stands in for "a step trained before"
    assert replace(halved, trace=None).key == "oracle:unexplained:x0.5@first-step"
    assert replace(later, trace=None).key == "oracle:unexplained:x0.5@later-step"


@pytest.mark.parametrize("kind", ["generation", "loss-scaling"])
def test_a_difference_without_parameters_is_keyed_by_its_kind(kind):
    f = Finding("oracle", "x", SC_SMALL, (), None, "deepspeed", "0.19.8",
                evidence=Evidence(oracle=OracleDiff(kind, None)))
    assert f.key == f"oracle:unexplained:{kind}"
    assert Finding("oracle", "x", SC_SMALL).key == "oracle"  # no evidence (a run from before): the check alone


def test_a_label_is_never_in_the_key_and_unlabelled_ones_group_by_mechanism():
    """A finding's key is its evidence, whatever label it carries; unlabelled ones are grouped by mechanism, not
    lumped into one group by their common wording."""
    a = labelled(_oracle(SC_SMALL, 0, [("blocks.0.lin.weight", 0.5)], _steps(True)))
    b = labelled(_oracle(SC_SMALL, 0, [("blocks.0.lin.weight", 2.0)], _steps(True)))
    assert not a.known and not b.known
    assert replace(a, known="two-backwards-per-forward").key == a.key  # a label is never part of the key
    entries = [{"n": i + 1, **annotate(f)} for i, f in enumerate((a, b, a))]
    assert [(g["key"], g["findings"]) for g in groups(entries)] == [("oracle:unexplained:x0.5@first-step", [1, 3]),
                                                                    ("oracle:unexplained:x2@first-step", [2])]


class _Build:
    """A diff side that shows, on every scenario, the findings of its table (scenario -> findings)."""

    def __init__(self, version: str, table: dict[Scenario, list[Finding]]) -> None:
        self.version, self.table = version, table

    def run(self, sc: Scenario) -> Outcome:
        found = [replace(f, scenario=sc, deepspeed=self.version) for f in self.table.get(sc, [])]
        return Outcome(sc, [], None, found)

    def repeat(self, sc, shows, before, runs, max_seconds):  # type: ignore[no-untyped-def]
        return sum(bool(shows(self.run(sc))) for _ in range(runs)), runs


def test_diff_calls_a_swap_of_one_oracle_mechanism_for_another_introduced():
    """Base's scenario shows a halved update, head's the same scenario not updated at all: one bug fixed and
    another introduced, where the key ``oracle`` alone read unchanged.  The same mechanism on head (other
    parameters) is unchanged."""
    sc = SC_SMALL
    fb = _oracle(SC_SMALL, 0, [("blocks.0.lin.weight", 0.5)], _steps(True))
    fh = _oracle(SC_SMALL, 0, [("blocks.0.lin.weight", 0.0)], _steps(True))
    entries = classify([fb], [fh], _Build("0.19.8", {sc: [fb]}), _Build("0.19.8", {sc: [fh]}))
    assert {e.found_on: e.status for e in entries} == {"base": "fixed", "head": "introduced"}
    same = _oracle(SC_SMALL, 0, [("head.weight", 0.502)], _steps(True))
    entries = classify([fb], [same], _Build("0.19.8", {sc: [fb]}), _Build("0.19.8", {sc: [same]}))
    assert [e.status for e in entries] == ["unchanged"]


def test_no_update_is_not_updated_whatever_the_counterfactuals_say():
    """With one backward in the step, the update "without the last backward's share" is no update: a step that
    updated nothing is ``not-updated`` in that shape too, as in a shape with several backwards."""
    one_backward = _oracle(SC_SMALL, 0, [("blocks.0.lin.weight", 0.0)], _steps(True), last_only=False, but_last=True)
    two_backwards = _oracle(SC_BIG, 0, [("head.weight", 0.01)], _steps(True), last_only=False, but_last=False)
    assert one_backward.key == two_backwards.key == "oracle:unexplained:not-updated@first-step"


@pytest.mark.deepspeed
@pytest.mark.slow
def test_faults_injected_into_real_deepspeed_give_one_key_per_mechanism(tmp_path):
    """Real DeepSpeed with a fault of the benchmark's catalogue applied to a copy of the installed release:
    engine.backward no longer dividing the loss by gas 2 doubles the update (``x2``) at ZeRO-1, 2 and 3 alike,
    with other widths, block counts and steps; ZeRO-3 overwriting the second micro-step's gradient keeps the last
    backward's share alone (the oracle's counterfactual) -- another key in the same shapes."""
    import sys
    from pathlib import Path

    import deepspeed

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from faults.apply import applied, make_tree
    from faults.catalogue import by_id
    from zerostate.targets.interface import get_target

    def sc(stage: int, blocks: int, width: int, steps: int = 1) -> Scenario:
        return Scenario.from_dict({"stage": stage, "blocks": [{}] * blocks, "width": width,
                                   "steps": [{"micro": [{"backward": "engine"}] * 2}] * steps})

    tree = make_tree(Path(deepspeed.__file__).resolve().parent, tmp_path / "tree")
    keys: dict[str, list[list[str]]] = {}
    for fault, shapes in (("engine-gas-scaling-inverted", (sc(1, 1, 8), sc(2, 2, 7, 2), sc(3, 3, 8))),
                          ("z3-accumulate-from-second", (sc(3, 1, 8), sc(3, 2, 7, 2)))):
        with applied(by_id()[fault], tree):
            t = get_target("deepspeed", deepspeed_path=str(tree))
            try:
                keys[fault] = [[f.key for f in t.run(s).findings] for s in shapes]
            finally:
                t.close()
    assert keys == {"engine-gas-scaling-inverted": [["oracle:unexplained:x2@first-step"]] * 3,
                    "z3-accumulate-from-second": [["oracle:unexplained:last-backward-only@first-step"]] * 2}, keys
