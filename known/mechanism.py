"""The vocabulary a known issue's rule reads a finding's own evidence with: the exception it raised and where,
the event pattern in its trace, the parameters it names, the oracle's disagreement.

Each predicate looks at the finding alone.  A rule (`KnownIssue.explains`) combines one or more of these with
scenario conditions that may narrow it (`narrow`), never replace it: a finding in a matching scenario whose
evidence does not show the mechanism is unexplained."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

from zerostate.model.events import Event, EventKind
from zerostate.model.scenario import Scenario

from zerostate.findings.evidence import OracleDiff, Raised
from zerostate.findings.finding import Finding

K = EventKind
_PARAM = re.compile(r"\b((?:blocks\.\d+|base_model|model|head|lm_head|empty)[\w.]*)")


# ------------------------------------------------------------------ the scenario may narrow, never decide
def narrow(f: Finding, pred: Callable[[Scenario], bool]) -> bool:
    """``pred`` on the finding's scenario; a finding without one (a watched job) is not narrowed."""
    return f.scenario is None or pred(f.scenario)


# ------------------------------------------------------------------ the exception
def raised(f: Finding, exc_type: str, *, check: str = "exception") -> Raised | None:
    """The exception of an ``exception``-class finding when it is of ``exc_type``."""
    r = f.evidence.raised
    if f.check != check or r is None or r.type != exc_type:
        return None
    return r


def raised_in(f: Finding, exc_type: str, file: str, function: str | None = None, *says: str) -> bool:
    """An ``exception`` finding of ``exc_type`` whose innermost DeepSpeed frame is ``file`` (``function``), its
    message holding every one of ``says``."""
    r = raised(f, exc_type)
    return r is not None and r.raised_in(file, function) and r.says(*says)


def raised_through(f: Finding, exc_type: str, file: str, function: str | None = None, *says: str) -> bool:
    """As `raised_in`, for an exception raised below DeepSpeed (in torch) on a path through ``file``."""
    r = raised(f, exc_type)
    return r is not None and r.passed(file, function) and r.says(*says)


# ------------------------------------------------------------------ the trace
def trace(f: Finding) -> Sequence[Event]:
    return f.trace or ()


def at(f: Finding) -> int:
    """Where the finding happened in its trace: the violating event, else (an exception, an end-of-run
    obligation) the end of the trace."""
    return f.index if f.index is not None else len(trace(f))


def violating(f: Finding) -> Event | None:
    ev = trace(f)
    return ev[f.index] if f.index is not None and 0 <= f.index < len(ev) else None


def backward_windows(events: Sequence[Event]) -> list[tuple[int, int]]:
    """Each user backward as ``(start, end)`` indices (end: its USER_BACKWARD_END, or the trace's end)."""
    out, start = [], None
    for i, e in enumerate(events):
        if e.kind is K.USER_BACKWARD_START:
            start = i
        elif e.kind is K.USER_BACKWARD_END and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(events)))
    return out


def second_backward_start(events: Sequence[Event], upto: int) -> int | None:
    """The index of the first user backward, before ``upto``, that is the second (or later) backward of one
    forward (two backwards per forward, ``retain_graph``)."""
    backwards = 0
    for i, e in enumerate(events[:upto]):
        if e.kind in (K.FORWARD_START, K.EVAL_FORWARD_START, K.STEP):
            backwards = 0 if e.kind is not K.EVAL_FORWARD_START else backwards
        elif e.kind is K.USER_BACKWARD_START:
            backwards += 1
            if backwards == 2:
                return i
    return None


def second_backwards(events: Sequence[Event]) -> list[tuple[int, int]]:
    """The ``(start, end)`` windows (`backward_windows`) of the user backwards that are the second (or later)
    backward of one forward."""
    starts, backwards = set(), 0
    for i, e in enumerate(events):
        if e.kind in (K.FORWARD_START, K.STEP):
            backwards = 0
        elif e.kind is K.USER_BACKWARD_START:
            backwards += 1
            if backwards >= 2:
                starts.add(i)
    return [w for w in backward_windows(events) if w[0] in starts]


def raised_in_second_backward(events: Sequence[Event]) -> bool:
    """The run ended (raised) inside a user backward that is the second of its forward: its window is still
    open at the trace's end."""
    windows = second_backwards(events)
    return bool(windows) and windows[-1][1] == len(events)


def bucketed_twice_after_second_backward(events: Sequence[Event], upto: int) -> set[str]:
    """Parameters the reduce bucket held twice when its last flush before ``upto`` began: put there by a
    second user backward of one forward, which flushed nothing, and again by a later backward."""
    ev = events[:upto]
    flushes = [i for i, e in enumerate(ev) if e.kind is K.BUCKET_FLUSH]
    if not flushes:
        return set()
    lo = flushes[-2] + 1 if len(flushes) > 1 else 0
    second = second_backwards(ev)
    first: dict[str, bool] = {}  # parameter -> its first add since the flush before was in a second backward
    out: set[str] = set()
    for i in range(lo, flushes[-1]):
        e = ev[i]
        if e.kind is not K.BUCKET_ADD or not e.param:
            continue
        if first.get(e.param):
            out.add(e.param)
        first.setdefault(e.param, any(a <= i < b for a, b in second))
    return out


def bucketed_again_unflushed(events: Sequence[Event], upto: int) -> set[str]:
    """Parameters a second user backward of one forward put in the reduce bucket, with no flush after it, that a
    later backward put there again before ``upto``: the bucket holds them twice when the next flush begins (a flush
    that raises over them records no flush event)."""
    ev = events[:upto]
    last_flush = max((i for i, e in enumerate(ev) if e.kind is K.BUCKET_FLUSH), default=-1)
    left: dict[str, int] = {}  # parameter -> where the second backward that left it ended
    for a, b in second_backwards(ev):
        for e in ev[max(a, last_flush + 1):b]:
            if e.kind is K.BUCKET_ADD and e.param:
                left[e.param] = b
    return {e.param for i, e in enumerate(ev) if e.kind is K.BUCKET_ADD and e.param in left and i >= left[e.param]}


def left_by_second_backward(events: Sequence[Event], upto: int) -> set[str]:
    """Parameters a second user backward of one forward put in the reduce bucket that no flush (epilogue) took
    out before ``upto``."""
    ev = events[:upto]
    last_flush = max((i for i, e in enumerate(ev) if e.kind is K.BUCKET_FLUSH), default=-1)
    return {e.param for a, b in second_backwards(ev) for e in ev[max(a, last_flush + 1):b]
            if e.kind is K.BUCKET_ADD and e.param}


def unexited_second_backward(events: Sequence[Event], upto: int) -> bool:
    """A second user backward of one forward before ``upto`` entered DeepSpeed's backward (ENTER_BACKWARD) and
    ended without exiting it: no epilogue took the depth back."""
    ev = events[:upto]
    return any(sum(e.kind is K.ENTER_BACKWARD for e in ev[a:b]) > sum(e.kind is K.EXIT_BACKWARD for e in ev[a:b])
               for a, b in second_backwards(ev) if b < len(ev))


def idle_step(events: Sequence[Event], upto: int) -> bool:
    """The last ``engine.step()`` at or before ``upto`` had no user backward since the step before it (or the
    start): a step with no gradient produced for it."""
    last = None
    for i, e in enumerate(events[:upto + 1]):
        if e.kind is K.STEP:
            last = i
    if last is None:
        return False
    for e in reversed(events[:last]):
        if e.kind is K.USER_BACKWARD_START:
            return False
        if e.kind is K.STEP:
            return True
    return True


def hookless_backward(events: Sequence[Event], upto: int) -> bool:
    """The last user backward before ``upto`` fired no gradient or leaf hook: no parameter got a gradient."""
    windows = [w for w in backward_windows(events) if w[0] < upto]
    if not windows:
        return False
    lo, hi = windows[-1]
    return not any(e.kind in (K.GRAD_HOOK, K.LEAF_HOOK, K.BUCKET_ADD) for e in events[lo:hi])


def early_leaf_hooks(events: Sequence[Event], upto: int | None = None) -> set[str]:
    """z3 leaf modules whose full backward hook fired in a user backward before the module's own backward
    began (its pre-backward): torch fires it as soon as the output's gradient is known when no input of the
    module requires grad."""
    out: set[str] = set()
    for lo, hi in backward_windows(events[:upto] if upto is not None else events):
        started: set[str] = set()
        for e in events[lo:hi]:
            if e.kind is K.MODULE_PRE_BACKWARD and e.module:
                started.add(e.module)
            elif e.kind is K.LEAF_HOOK and e.module and e.module not in started:
                out.add(e.module)
    return out


def hook_after_epilogue(events: Sequence[Event], upto: int | None = None) -> bool:
    """In some user backward a gradient hook fired after its epilogue: the epilogue ran too early."""
    for lo, hi in backward_windows(events[:upto] if upto is not None else events):
        done = False
        for e in events[lo:hi]:
            if e.kind is K.EPILOGUE:
                done = True
            elif done and e.kind in (K.GRAD_HOOK, K.LEAF_HOOK):
                return True
    return False


def hooked_in_two_tasks(events: Sequence[Event], upto: int | None = None) -> set[str]:
    """Parameters whose gradient hook fired in two different graph tasks of one user backward (a reentrant
    checkpoint's nested task and the outer one)."""
    out: set[str] = set()
    for lo, hi in backward_windows(events[:upto] if upto is not None else events):
        tasks: dict[str, set[int | None]] = {}
        for e in events[lo:hi]:
            if e.kind is K.GRAD_HOOK and e.param:
                tasks.setdefault(e.param, set()).add(e.task)
        out |= {p for p, ts in tasks.items() if len(ts) > 1}
    return out


def gathered_at(events: Sequence[Event], upto: int, param: str) -> bool:
    """``param`` was gathered (its last fetch / prefetch / release before ``upto`` is not a release)."""
    for e in reversed(events[:upto]):
        if e.param == param and e.kind in (K.FETCH, K.PREFETCH, K.RELEASE):
            return e.kind is not K.RELEASE
    return False


def reregistered_before(events: Sequence[Event], upto: int) -> bool:
    return any(e.kind is K.REREGISTER for e in events[:upto])


def persistent(events: Sequence[Event]) -> set[str]:
    return {e.param for e in events if e.kind is K.PERSISTENT and e.param}


def module_of(param: str) -> str:
    return param.rsplit(".", 1)[0]


def this_iteration(events: Sequence[Event], upto: int) -> tuple[int, int]:
    """``(start, upto)``: the events since the last train forward before ``upto``."""
    start = 0
    for i, e in enumerate(events[:upto]):
        if e.kind is K.FORWARD_START:
            start = i
    return start, upto


def ran_in(events: Sequence[Event], lo: int, hi: int, module: str, kinds: Iterable[EventKind]) -> bool:
    """``module`` (or a module holding it: a z3 leaf block) had one of ``kinds`` between ``lo`` and ``hi``."""
    kinds = tuple(kinds)
    return any(e.kind in kinds and e.module is not None and (module == e.module or module.startswith(e.module + "."))
               for e in events[lo:hi])


# ------------------------------------------------------------------ what the finding names
def params_named(text: str) -> set[str]:
    """The parameter names a message mentions (``blocks.0.norm.weight`` ...; not module names), on its first
    line."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    names = {n for n in (m.rstrip(".,:") for m in _PARAM.findall(first)) if n.rsplit(".", 1)[-1] in ("weight", "bias")}
    return names | ({"empty"} if re.search(r"\bempty: ", first) else set())  # the zero-element parameter


def oracle(f: Finding) -> OracleDiff | None:
    return f.evidence.oracle if f.check == "oracle" else None








__all__ = ["at", "backward_windows", "bucketed_again_unflushed", "bucketed_twice_after_second_backward",
           "early_leaf_hooks", "gathered_at",
           "hook_after_epilogue", "hooked_in_two_tasks", "hookless_backward", "idle_step", "left_by_second_backward",
           "module_of", "narrow", "oracle", "params_named", "persistent", "raised", "raised_in",
           "raised_in_second_backward", "raised_through", "ran_in", "reregistered_before", "second_backward_start",
           "second_backwards", "this_iteration", "trace", "unexited_second_backward", "violating"]
