"""The exhaustive checker's reductions are sound, and its verdicts are the expected ones.

* ``order_hooks_within_tasks`` (partial-order reduction) never changes any spec's verdict:
  checked against the unreduced state graph on drawn scenarios, for every hook design.
* ``canonical`` (non-scalar computed as ``torch``) is sound: the two traces differ only in
  the note of ``USER_BACKWARD_START``.
* A small bound reproduces the expected table: the fixed designs hold, each buggy era
  violates exactly the specs its bug is about.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings

from zerostate.model import BackwardKind, get_design
from zerostate.analysis.checker import Bound, canonical, check
from zerostate.model.events import EventKind
from zerostate.model.explore import run, state_graph
from zerostate.specs import SPECS, check_trace
from zerostate.specs.hook_specs import HOOK_SPECS
from zerostate.explorer.strategies import scenarios

HOOK_DESIGNS = ("ds-0.18.4", "ds-0.18.5", "ds-0.18.7", "zerostate")


@given(scenarios(max_blocks=2, max_steps=2, max_gas=2, stages=(3,)))
@settings(max_examples=40)
def test_hook_order_reduction_preserves_every_verdict(sc):
    for name in HOOK_DESIGNS:
        d = get_design(name)
        full = state_graph(d, sc, HOOK_SPECS, coordinator=False, reduce=False)
        reduced = state_graph(d, sc, HOOK_SPECS, coordinator=False, reduce=True)
        assert full.checked == reduced.checked and set(full.violations) == set(reduced.violations)
        assert reduced.states <= full.states


@given(scenarios(max_blocks=3, max_steps=2, max_gas=2, zero0=False))
@settings(max_examples=40)
def test_nonscalar_and_torch_backward_differ_only_in_name(sc):
    rep = canonical(sc)
    for name in HOOK_DESIGNS:
        a = run(get_design(name), sc, coordinator=False).events
        b = run(get_design(name), rep, coordinator=False).events
        strip = [dataclasses.replace(e, note=None)
                 if e.kind in (EventKind.USER_BACKWARD_START, EventKind.USER_BACKWARD_END)
                 else e for e in a]
        strip_b = [dataclasses.replace(e, note=None)
                   if e.kind in (EventKind.USER_BACKWARD_START, EventKind.USER_BACKWARD_END)
                   else e for e in b]
        assert strip == strip_b


def test_small_bound_verdicts():
    bound = Bound(max_blocks=2, max_micro_steps=1, backwards=(BackwardKind.ENGINE, BackwardKind.TORCH))
    res = check(list(HOOK_DESIGNS), bound, spec_ids=[s.id for s in HOOK_SPECS], jobs=1)
    violated = {n: set(d.violations) for n, d in res.designs.items()}
    assert violated["ds-0.18.7"] == set() and violated["zerostate"] == set()
    assert violated["ds-0.18.5"] == {"count-once-per-phase"}
    assert {"epilogue-once", "grad-handled-once", "clean-step"} <= violated["ds-0.18.4"]
    assert res.ok
    # every counterexample is a scenario of the bound, and re-running it reproduces the violation
    for name, d in res.designs.items():
        assert d.checked == tuple(s.id for s in HOOK_SPECS if s.id in d.judged)
        for sid, v in d.violations.items():
            sc, events = d.counterexamples[sid]
            again = state_graph(get_design(name), sc, [s for s in HOOK_SPECS if s.id == sid], coordinator=False)
            assert not again.holds(sid)
            assert check_trace(SPECS[sid], events) == v  # the violation is the monitor's own on its events


def test_a_state_graph_violation_is_the_monitors_own_on_its_counterexample():
    """The state graph reports the `Violation` that `check_trace` gives on the counterexample it returns:
    same spec, message, code and index (None for an end-of-run obligation) -- one violation type."""
    seen: set[tuple[str, str]] = set()
    for sc in Bound(max_blocks=2, max_micro_steps=1).scenarios():
        g = state_graph(get_design("ds-0.18.4"), sc, list(HOOK_SPECS), coordinator=False)
        for sid, v in g.violations.items():
            assert check_trace(SPECS[sid], g.counterexamples[sid]) == v, (sid, sc.describe())
            seen.add((sid, v.code))
        if len(seen) >= 4:
            break
    assert len(seen) >= 4, seen  # ds-0.18.4 violates several hook specs on two-block scenarios
