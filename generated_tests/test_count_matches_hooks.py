"""``count-matches-hooks``: count_used_parameters_in_backward counts exactly the parameters whose gradient hook
fires in its graph task, and the count DeepSpeed expects from it (plus its z3 leaf modules) covers every hook
there.  Synthetic traces for each verdict; every model design satisfies it (the model's count is its network's
reach); on real DeepSpeed, test_fault_kills.py shows it see two faults of the catalogue."""

from __future__ import annotations

from hypothesis import given, settings

from zerostate.model.designs import designs, get_design
from zerostate.model.events import Event, EventKind as K
from zerostate.model.explore import run
from zerostate.specs.base import check_trace
from zerostate.specs.hook_specs import COUNT_MATCHES_HOOKS, HOOK_SPECS

from zerostate.explorer.strategies import scenarios

hook_scenarios = scenarios(max_blocks=3, max_steps=2, max_gas=2, zero0=False)


def _task(count: int | None, expected: int | None, params: tuple[str, ...], leaves: tuple[str, ...] = (),
          end: bool = True) -> list[Event]:
    ev = [Event(K.USER_BACKWARD_START, note="engine"), Event(K.TASK_START, task=0, note="outer")]
    for i, p in enumerate(params):
        ev.append(Event(K.GRAD_HOOK, param=p, task=0))
        if i == 0 and count is not None:
            ev.append(Event(K.COUNT, task=0, value=count))
            if expected is not None:
                ev.append(Event(K.EXPECTED, task=0, value=expected))
    ev += [Event(K.LEAF_HOOK, module=m, task=0) for m in leaves]
    ev += [Event(K.GRAD_HOOK, param=params[0], task=1)]  # another task's hook is not this task's
    return ev + ([Event(K.TASK_END, task=0)] if end else [])


P = ("blocks.0.lin.weight", "blocks.0.lin.bias")


def _code(events: list[Event]) -> str | None:
    failed = check_trace(COUNT_MATCHES_HOOKS, events)
    return None if failed is None else failed.code


def test_a_count_of_the_hooks_that_fire_holds():
    assert _code(_task(2, 2, P)) is None
    assert _code(_task(2, 4, P, ("blocks.1",))) is None  # a z3 leaf module expected but fired elsewhere: covered
    assert _code(_task(2, 3, P, ("blocks.1",))) is None


def test_a_count_of_parameters_that_never_fire_is_a_miscount():
    assert _code(_task(4, 4, P)) == "count-not-hooks"
    assert _code(_task(1, 1, P)) == "count-not-hooks"


def test_an_expectation_short_of_the_leaf_modules_that_fire():
    assert _code(_task(2, 2, P, ("blocks.1",))) == "expected-short"


def test_a_task_that_never_ends_is_not_judged():
    assert _code(_task(4, 4, P, end=False)) is None


def test_the_spec_is_one_of_the_hook_specs():
    assert COUNT_MATCHES_HOOKS in HOOK_SPECS and COUNT_MATCHES_HOOKS.provenance


@given(hook_scenarios)
@settings(max_examples=60)
def test_every_model_design_counts_the_hooks_of_its_task(sc):
    for name in designs():
        events = list(run(get_design(name), sc, coordinator=False).events)
        assert check_trace(COUNT_MATCHES_HOOKS, events) is None, name
