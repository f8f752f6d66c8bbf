"""The tracer's core on plain PyTorch, without DeepSpeed (`tracing.core.TraceCore`: graph tasks numbered by first
sight and ended by a callback, the training loop's marks, pauses), and the marks the harness's network calls
(`tracing.marks`).  On a real engine the tracer runs in every DeepSpeed test (test_deepspeed_target.py's
``test_tracer_*``, the watch tests)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from zerostate.harness.net.torch_network import build_model
from zerostate.model.events import EventKind
from zerostate.model.scenario import Scenario
from zerostate.tracing import marks
from zerostate.tracing.core import TraceCore


class _Sink:
    def __init__(self) -> None:
        self.events: list[tuple[EventKind, int | None, Any, str | None]] = []

    def put(self, kind: EventKind, param: str | None, module: str | None, task: int | None, value: Any,
            phase: str | None, note: str | None) -> None:
        self.events.append((kind, task, value, note))


def _core(net: torch.nn.Module) -> tuple[TraceCore, _Sink]:
    sink = _Sink()
    return TraceCore(SimpleNamespace(optimizer=None, module=net), stage=1, sink=sink), sink


def test_graph_tasks_are_numbered_by_first_sight_and_end_after_their_backward():
    net = torch.nn.Linear(2, 1)
    core, sink = _core(net)

    def seen_in_backward(grad: torch.Tensor) -> torch.Tensor:  # where DeepSpeed's hooks would ask
        core.task()
        core.task()  # asked again in the same task: no second start
        core.flush()
        return grad
    for _ in range(2):
        out = net(torch.ones(1, 2)).sum()
        out.register_hook(seen_in_backward)
        out.backward()
    assert [(k, t, n) for k, t, _, n in sink.events] == [
        (EventKind.TASK_START, 0, "outer"), (EventKind.TASK_END, 0, None),
        (EventKind.TASK_START, 1, "outer"), (EventKind.TASK_END, 1, None)]
    assert core.task() is None, "outside a backward there is no graph task"


def test_the_loops_marks_become_events_and_a_pause_hides_everything_inside():
    core, sink = _core(torch.nn.Linear(2, 1))
    core.mark("forward_start")
    core.mark("backward_start", kind="engine")
    with core.paused():
        core.mark("step", step=7)
    core.mark("step", step=0)
    core.mark("not_a_mark")
    assert [(k, v, n) for k, _, v, n in sink.events] == [(EventKind.FORWARD_START, None, None),
                                                        (EventKind.USER_BACKWARD_START, None, "engine"),
                                                        (EventKind.STEP, 0, None)]
    assert marks.LOOP_MARKS["eval_start"] is EventKind.EVAL_FORWARD_START


def test_the_network_calls_the_block_observer_around_each_checkpointed_block_and_its_recompute():
    sc = Scenario.from_dict({"blocks": [{"checkpoint": "reentrant"}, {}], "stage": 3})
    model = build_model(sc)
    calls: list[str] = []
    marks.BLOCK_OBSERVER = (lambda blk: calls.append("enter"), lambda blk: calls.append("exit"))
    try:
        model(torch.randn(2, sc.width, requires_grad=True)).pow(2).mean().backward()
    finally:
        marks.BLOCK_OBSERVER = None
    assert calls == ["enter", "exit"] * 2, "the forward, then the reentrant block's recompute in backward"
