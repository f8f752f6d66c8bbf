"""The one place transitions happen: ``step(state, event) -> (state, trace events)``.

`ModelState` is the product of three immutable records:

* `HookState`   -- the hook-count half (what a `HookDesign` owns);
* a coordinator state -- the ZeRO-3 parameter half (what a coordinator design owns);
* `EnvState`    -- what PyTorch and the engine hold regardless of design: the
  stack of autograd graph tasks, callbacks queued on them, the ipg bucket, and
  which kind of user backward is running.

A driver event goes to the hook half first; the driver event and every hook
effect then go to the coordinator half (so an epilogue can release
parameters).  Effects update the environment in order.  ``TASK_END`` first runs
the callbacks queued on that task, exactly as the autograd engine does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from .events import Event, EventKind
from .hook_state import HookState
from .network import Network
from .scenario import BackwardKind

if TYPE_CHECKING:
    from .designs import Design


class EnvState(NamedTuple):
    tasks: tuple[tuple[int, frozenset[str]], ...] = ()
    """Graph-task stack, innermost last: (task id, trainable non-leaf params its graph reaches)."""
    callbacks: frozenset[int] = frozenset()
    """Graph tasks with a queued post-backward callback."""
    bucket: frozenset[str] = frozenset()
    """Parameters whose gradient sits in the reduce bucket, not yet reduced."""
    backward_kind: str | None = None
    """The running user backward's `BackwardKind` value, None outside one."""


class ModelState(NamedTuple):
    hooks: HookState
    coord: Any
    env: EnvState


class Ctx:
    """What a design may read about the environment when it reacts to an event."""

    __slots__ = ("net", "env")

    def __init__(self, net: Network, env: EnvState):
        self.net = net
        self.env = env

    @property
    def task(self) -> int | None:
        return self.env.tasks[-1][0] if self.env.tasks else None

    @property
    def stage(self) -> int:
        return self.net.scenario.stage

    @property
    def bucket(self) -> frozenset[str]:
        return self.env.bucket

    @property
    def running_engine_backward(self) -> bool:
        return self.env.backward_kind == BackwardKind.ENGINE.value

    def expected_count(self) -> int:
        """``count_used_parameters_in_backward`` over the *current* graph task (+ leaf modules)."""
        reach = self.env.tasks[-1][1] if self.env.tasks else frozenset()
        return len(reach) + self.net.leaf_module_count

    def leaf_params(self, module: str | None) -> tuple[str, ...]:
        """The parameters leaf block ``module``'s (``blocks.{i}``) backward hook handles."""
        i = int(str(module).split(".")[1])
        return self.net.leaf_hook_params(i)

    def leaf_pending(self, module: str | None) -> tuple[str, ...]:
        """Of leaf block ``module``'s hook parameters, those whose gradient the running backward will still
        accumulate when its hook fires (``torch._C._will_engine_execute_node`` on their AccumulateGrad nodes)."""
        return self.net.leaf_pending(int(str(module).split(".")[1]))


def initial_state(design: Design, net: Network) -> ModelState:
    return ModelState(HookState(), design.coordinator.initial(net), EnvState())


def _reach(net: Network, ev: Event) -> frozenset[str]:
    if ev.note == "outer":
        return net.reach_of_outer_task()
    if ev.note == "nested":
        return net.reach_of_nested_task(int(str(ev.module).split(".")[1]))
    return net.reach_of_pre_backward()


def _apply_effects(env: EnvState, effects: tuple[Event, ...]) -> tuple[EnvState, tuple[Event, ...]]:
    """Update the environment with each effect in order.  A flush or clear is stamped here with
    how many gradients it took from the bucket (a design cannot see adds of its own reaction)."""
    out: list[Event] = []
    for e in effects:
        if e.kind is EventKind.BUCKET_ADD:
            assert e.param is not None, "a BUCKET_ADD names its parameter"
            env = env._replace(bucket=env.bucket | {e.param})
        elif e.kind in (EventKind.BUCKET_FLUSH, EventKind.BUCKET_CLEAR):
            taken = len(env.bucket)
            env = env._replace(bucket=frozenset())
            out.append(e if e.value == taken else Event(e.kind, value=taken))
            continue
        elif e.kind is EventKind.CALLBACK_QUEUED:
            assert e.task is not None, "a CALLBACK_QUEUED names its graph task"
            env = env._replace(callbacks=env.callbacks | {e.task})
        out.append(e)
    return env, tuple(out)


def _react(design: Design, net: Network, st: ModelState, ev: Event) -> tuple[ModelState, list[Event]]:
    hooks, h_eff = design.hooks.react(st.hooks, ev, Ctx(net, st.env))
    env, h_eff = _apply_effects(st.env, h_eff)
    coord = st.coord
    c_eff: list[Event] = []
    for e in (ev, *h_eff):
        coord, more = design.coordinator.react(coord, e, Ctx(net, env))
        c_eff += more
    return ModelState(hooks, coord, env), [*h_eff, *c_eff]


def step(design: Design, net: Network, st: ModelState, ev: Event) -> tuple[ModelState, list[Event]]:
    """Apply one driver event.  Returns the new state and the events to append to the trace."""
    out: list[Event] = []
    env = st.env
    if ev.kind is EventKind.TASK_START:
        assert ev.task is not None, "a TASK_START names its graph task"
        env = env._replace(tasks=env.tasks + ((ev.task, _reach(net, ev)),))
    elif ev.kind is EventKind.USER_BACKWARD_START:
        env = env._replace(backward_kind=ev.note)
    elif ev.kind is EventKind.TASK_END and ev.task in env.callbacks:
        cb = Event(EventKind.CALLBACK_RUN, task=ev.task)
        st, eff = _react(design, net, st._replace(env=env._replace(callbacks=env.callbacks - {ev.task})), cb)
        out += [cb, *eff]
        env = st.env
    st = st._replace(env=env)
    st, eff = _react(design, net, st, ev)
    trace = [*out, ev, *eff]
    env = st.env
    if ev.kind is EventKind.TASK_END:
        env = env._replace(tasks=tuple(t for t in env.tasks if t[0] != ev.task))
    elif ev.kind is EventKind.USER_BACKWARD_END:
        env = env._replace(backward_kind=None)
    return st._replace(env=env), trace


__all__ = ["Ctx", "EnvState", "ModelState", "initial_state", "step"]
