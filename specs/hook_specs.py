"""Specs of the gradient-hook / epilogue protocol (ZeRO 1, 2 and 3).

A *user-backward window* opens at ``USER_BACKWARD_START`` and closes at the next
forward, eval forward, ``engine.step()`` or the end of the run (so the epilogue
that ``engine.backward`` runs after ``loss.backward()`` returns is inside it).
"""

from __future__ import annotations

from typing import NamedTuple

from zerostate.model.events import Event, EventKind

from .base import Failure, Spec, fail

_CLOSERS = (EventKind.FORWARD_START, EventKind.EVAL_FORWARD_START, EventKind.STEP)
_HOOKS = (EventKind.GRAD_HOOK, EventKind.LEAF_HOOK)


# ------------------------------------------------------------- epilogue-once
_NO_EPILOGUE = "the user backward finished without running the epilogue"


class _EpilogueOnce(NamedTuple):
    open: bool = False
    epilogues: int = 0


def _epilogue_once_step(m: _EpilogueOnce, ev: Event) -> _EpilogueOnce | Failure:
    if ev.kind is EventKind.USER_BACKWARD_START:
        if m.open and m.epilogues == 0:
            return fail("a user backward started before the previous one ran its epilogue", "overlapping-backward")
        return _EpilogueOnce(True, 0)
    if not m.open:
        return m
    if ev.kind in _CLOSERS:
        if m.epilogues == 0:
            return fail(_NO_EPILOGUE, "no-epilogue")
        return _EpilogueOnce()
    if ev.kind is EventKind.EPILOGUE:
        if m.epilogues >= 1:
            return fail("the epilogue ran a second time in one user backward", "epilogue-twice")
        return m._replace(epilogues=1)
    if ev.kind in _HOOKS and m.epilogues:
        what = ev.param or ev.module
        return fail(f"gradient hook for {what} fired after the epilogue: the epilogue ran before "
                    f"the last phase (graph task {ev.task})", "hook-after-epilogue")
    return m


def _epilogue_once_finish(m: _EpilogueOnce) -> Failure | None:
    if m.open and m.epilogues == 0:
        return fail(_NO_EPILOGUE, "no-epilogue")
    return None


EPILOGUE_ONCE = Spec(
    id="epilogue-once",
    sentence="Each user backward runs the epilogue exactly once, after the last gradient hook of its last phase.",
    provenance=("seed 000 part 1", "deepspeedai/DeepSpeed#7780"),
    family="hooks",
    init=_EpilogueOnce, step=_epilogue_once_step, finish=_epilogue_once_finish,
    checks="In every user-backward window: exactly one EPILOGUE, and no GRAD_HOOK / LEAF_HOOK after it.",
    exercised_by=frozenset({EventKind.USER_BACKWARD_START}),
    reacts_to=frozenset({EventKind.USER_BACKWARD_START, *_CLOSERS, EventKind.EPILOGUE, *_HOOKS}),
)


# --------------------------------------------------------- grad-handled-once
class _Handled(NamedTuple):
    open: bool = False
    hooked: frozenset[str] = frozenset()
    handled: frozenset[str] = frozenset()
    bucket: frozenset[str] = frozenset()


def _param(ev: Event) -> str:
    """The parameter a gradient or bucket event names (every such event names one)."""
    assert ev.param is not None, f"a {ev.kind.value} event names its parameter"
    return ev.param


def _bucket(m: _Handled, ev: Event) -> frozenset[str]:
    if ev.kind is EventKind.BUCKET_ADD:
        return m.bucket | {_param(ev)}
    if ev.kind in (EventKind.BUCKET_FLUSH, EventKind.BUCKET_CLEAR):
        return frozenset()
    return m.bucket


def _close_handled(m: _Handled) -> Failure | None:
    missing = m.hooked - m.handled
    if missing:
        return fail(f"gradient hook fired but the gradient was never handled: {sorted(missing)}", "never-handled")
    if m.bucket:
        return fail(f"gradients left in the reduce bucket after the backward: {sorted(m.bucket)}", "left-in-bucket")
    return None


def _handled_step(m: _Handled, ev: Event) -> _Handled | Failure:
    if ev.kind is EventKind.USER_BACKWARD_START:
        return _Handled(True, frozenset(), frozenset(), m.bucket)
    if m.open and ev.kind in _CLOSERS:
        failed = _close_handled(m)
        return failed if failed else _Handled(bucket=m.bucket)
    if ev.kind is EventKind.BUCKET_ADD and m.open:
        p = _param(ev)
        if p in m.handled:
            return fail(f"gradient of {p} handled twice in one backward", "handled-twice")
        return _Handled(m.open, m.hooked, m.handled | {p}, m.bucket | {p})
    if ev.kind is EventKind.GRAD_HOOK and m.open:
        return _Handled(m.open, m.hooked | {_param(ev)}, m.handled, m.bucket)
    if ev.kind is EventKind.LEAF_GRAD and m.open and ev.param in m.handled:
        # known issue z3-leaf-input-without-grad: the leaf hook reduced (zero-filled) it before it existed
        return fail(f"gradient of {ev.param} accumulated after it was handled: the z3 leaf module's hook "
                    "reduced it before the backward produced it", "handled-before-accumulated")
    nb = _bucket(m, ev)
    return m if nb is m.bucket else m._replace(bucket=nb)


GRAD_HANDLED_ONCE = Spec(
    id="grad-handled-once",
    sentence=("Every trainable parameter reached by the backward has its gradient handled exactly once "
              "per backward; none is left in a bucket."),
    provenance=("seed 000 part 1", "deepspeedai/DeepSpeed#7780"),
    family="hooks",
    init=_Handled, step=_handled_step, finish=lambda m: _close_handled(m) if m.open else None,
    checks=("In every user-backward window: each GRAD_HOOK param gets one BUCKET_ADD, no param gets two, "
            "no param's gradient accumulates (LEAF_GRAD) after its BUCKET_ADD, "
            "and the bucket is empty when the window closes."),
    exercised_by=frozenset({EventKind.GRAD_HOOK}),
    reacts_to=frozenset({EventKind.USER_BACKWARD_START, *_CLOSERS, EventKind.BUCKET_ADD, EventKind.GRAD_HOOK,
                         EventKind.BUCKET_FLUSH, EventKind.BUCKET_CLEAR, EventKind.LEAF_GRAD}),
)


# ------------------------------------------- no-epilogue-before-user-backward
def _no_early_step(open_: bool, ev: Event) -> bool | Failure:
    if ev.kind is EventKind.USER_BACKWARD_START:
        return True
    if ev.kind in _CLOSERS:
        return False
    if ev.kind is EventKind.EPILOGUE and not open_:
        return fail("the epilogue ran outside a user backward (a backward made inside forward)",
                    "epilogue-outside-user-backward")
    return open_


NO_EPILOGUE_BEFORE_USER_BACKWARD = Spec(
    id="no-epilogue-before-user-backward",
    sentence="Backward calls made before the user's backward never run the epilogue.",
    provenance=("deepspeedai/DeepSpeed#7886 (TiledFusedLogitsLoss)",),
    family="hooks",
    init=lambda: False, step=_no_early_step, finish=lambda m: None,
    checks="No EPILOGUE event outside a user-backward window.",
    exercised_by=frozenset({EventKind.USER_BACKWARD_START}),
    reacts_to=frozenset({EventKind.USER_BACKWARD_START, *_CLOSERS, EventKind.EPILOGUE}),
)


# ---------------------------------------------------- count-once-per-phase
def _count_step(counted: frozenset[int | None], ev: Event) -> frozenset[int | None] | Failure:
    if ev.kind is EventKind.FORWARD_START:
        return frozenset()
    if ev.kind is EventKind.COUNT:
        if ev.task in counted:
            return fail(f"count_used_parameters_in_backward evaluated again in graph task {ev.task} "
                        "(once per phase is the bound)", "counted-twice-in-phase")
        return counted | {ev.task}
    return counted


COUNT_ONCE_PER_PHASE = Spec(
    id="count-once-per-phase",
    sentence="count_used_parameters_in_backward is evaluated at most once per backward phase.",
    provenance=("seed 000 part 2", "deepspeedai/DeepSpeed#7882", "deepspeedai/DeepSpeed#7885",
                "deepspeedai/DeepSpeed#7886"),
    family="hooks",
    init=frozenset, step=_count_step, finish=lambda m: None,
    checks="At most one COUNT event per autograd graph task (a phase is one graph task).",
    exercised_by=frozenset({EventKind.COUNT}),
    reacts_to=frozenset({EventKind.FORWARD_START, EventKind.COUNT}),
)


# ---------------------------------------------------------- count-matches-hooks
class _Phase(NamedTuple):
    """One graph task's hooks so far, and the count / expectation evaluated in it (None: not evaluated)."""
    params: frozenset[str] = frozenset()
    leaves: frozenset[str] = frozenset()
    returned: int | None = None
    expected: int | None = None


_Phases = tuple[tuple[int | None, _Phase], ...]


def _phase_of(m: _Phases, task: int | None) -> _Phase:
    return next((ph for t, ph in m if t == task), _Phase())


def _with_phase(m: _Phases, task: int | None, ph: _Phase) -> _Phases:
    return tuple((t, x) for t, x in m if t != task) + ((task, ph),)


def _phase_verdict(task: int | None, ph: _Phase) -> Failure | None:
    fired = len(ph.params) + len(ph.leaves)
    if ph.returned is not None and ph.returned != len(ph.params):
        return fail(f"count_used_parameters_in_backward returned {ph.returned} in graph task {task}, where the "
                    f"gradient hooks of {len(ph.params)} parameter(s) fired", "count-not-hooks")
    if ph.expected is not None and ph.expected < fired:
        return fail(f"DeepSpeed expected {ph.expected} hook(s) for graph task {task}, fewer than the {fired} that "
                    f"fired there ({len(ph.params)} parameter(s), {len(ph.leaves)} z3 leaf module(s))",
                    "expected-short")
    return None


def _count_hooks_step(m: _Phases, ev: Event) -> _Phases | Failure:
    k = ev.kind
    if k is EventKind.TASK_START:
        return _with_phase(m, ev.task, _Phase())
    if k is EventKind.TASK_END:
        failed = _phase_verdict(ev.task, _phase_of(m, ev.task))
        return failed if failed else tuple((t, x) for t, x in m if t != ev.task)
    ph = _phase_of(m, ev.task)
    if k is EventKind.GRAD_HOOK and ev.param is not None:
        return _with_phase(m, ev.task, ph._replace(params=ph.params | {ev.param}))
    if k is EventKind.LEAF_HOOK and ev.module is not None:
        return _with_phase(m, ev.task, ph._replace(leaves=ph.leaves | {ev.module}))
    if k is EventKind.COUNT and ev.value is not None:
        return _with_phase(m, ev.task, ph._replace(returned=ev.value))
    if k is EventKind.EXPECTED and ev.value is not None:
        return _with_phase(m, ev.task, ph._replace(expected=ev.value))
    return m


COUNT_MATCHES_HOOKS = Spec(
    id="count-matches-hooks",
    sentence=("count_used_parameters_in_backward counts exactly the parameters whose gradient hook fires in its graph "
              "task, and the hook count DeepSpeed expects from it covers every hook that fires there."),
    provenance=("deepspeedai/DeepSpeed#7882", "deepspeedai/DeepSpeed#7886",
                "count_used_parameters_in_backward's docstring (runtime/utils.py)"),
    family="hooks",
    init=tuple, step=_count_hooks_step, finish=lambda m: None,
    checks=("At each graph task's TASK_END, for a task in which a COUNT was evaluated: its value equals the distinct "
            "parameters of the GRAD_HOOKs of that task, and the EXPECTED after it is at least those plus the z3 "
            "leaf modules of its LEAF_HOOKs.  A task that never ends (the run raised) is not judged."),
    exercised_by=frozenset({EventKind.COUNT}),
    reacts_to=frozenset({EventKind.TASK_START, EventKind.TASK_END, EventKind.GRAD_HOOK, EventKind.LEAF_HOOK,
                         EventKind.COUNT, EventKind.EXPECTED}),
)


# ---------------------------------------------------------------- clean-step
class _Clean(NamedTuple):
    after_step: bool = False
    depth: int = 0
    bucket: frozenset[str] = frozenset()


def _clean_problem(m: _Clean) -> Failure | None:
    if m.bucket:
        return fail(f"stale gradients in the reduce bucket survive engine.step(): {sorted(m.bucket)}",
                    "stale-bucket")
    if m.depth:
        return fail(f"backward depth is {m.depth} after engine.step(): a backward never exited",
                    "backward-never-exited")
    return None


def _clean_step(m: _Clean, ev: Event) -> _Clean | Failure:
    if ev.kind in (EventKind.FORWARD_START, EventKind.EVAL_FORWARD_START) and m.after_step:
        failed = _clean_problem(m)
        return failed if failed else m._replace(after_step=False)
    if ev.kind is EventKind.STEP:
        return m._replace(after_step=True)
    if ev.kind in (EventKind.ENTER_BACKWARD, EventKind.EXIT_BACKWARD):
        return m._replace(depth=ev.value or 0)
    if ev.kind is EventKind.BUCKET_ADD:
        p = _param(ev)
        return m if p in m.bucket else _Clean(m.after_step, m.depth, m.bucket | {p})
    if ev.kind in (EventKind.BUCKET_FLUSH, EventKind.BUCKET_CLEAR):
        return m._replace(bucket=frozenset())
    return m


CLEAN_STEP = Spec(
    id="clean-step",
    sentence="After the optimizer step, no hook state or bucket entry survives into the next forward.",
    provenance=("seed 000 part 1", "deepspeedai/DeepSpeed#7780"),
    family="hooks",
    init=_Clean, step=_clean_step, finish=lambda m: _clean_problem(m) if m.after_step else None,
    checks="At the first forward after STEP (or the end of the run): the bucket is empty and backward depth is 0.",
    exercised_by=frozenset({EventKind.STEP}),
    reacts_to=frozenset({EventKind.FORWARD_START, EventKind.EVAL_FORWARD_START, EventKind.STEP,
                         EventKind.ENTER_BACKWARD, EventKind.EXIT_BACKWARD, EventKind.BUCKET_ADD,
                         EventKind.BUCKET_FLUSH, EventKind.BUCKET_CLEAR}),
)

HOOK_SPECS = (EPILOGUE_ONCE, GRAD_HANDLED_ONCE, NO_EPILOGUE_BEFORE_USER_BACKWARD, COUNT_ONCE_PER_PHASE,
              COUNT_MATCHES_HOOKS, CLEAN_STEP)

__all__ = ["CLEAN_STEP", "COUNT_MATCHES_HOOKS", "COUNT_ONCE_PER_PHASE", "EPILOGUE_ONCE", "GRAD_HANDLED_ONCE",
           "HOOK_SPECS", "NO_EPILOGUE_BEFORE_USER_BACKWARD"]
