"""A finding's identity, built only from what its run showed: `fingerprint`.

Two findings are one bug exactly when their fingerprints are equal: the explorer keeps one finding per
fingerprint, shrinking keeps it, ``diff`` matches base and head by it, and a known issue's exception and spec
labels hold only on the fingerprints recorded from the issue's own repro.  Never a parameter's or a module's
name, a size, a count or a step number, which shrinking changes; never the known issue that explains it.

* an exception: its check, its type, the innermost DeepSpeed frame it passed (module and function; zerostate's
  calling frame or the innermost one when it passed none), its message with numbers, names and paths blanked
  (`abstract`) and which backward it was raised in (`raised_in`: the same message from the same function is two
  bugs when one is raised in the first backward through a graph and the other in a second one), or, raised in
  the step, what that step had (no backward, a backward never exited, a backward without gradients);
* a spec violation: the spec's code, the violating event's kind and phase, where it happened (the user's
  backward's own graph task, a reentrant checkpoint's nested one, outside any backward), and the roles of the
  parameters involved (`roles`);
* an oracle difference: the counterfactual class that explains it (the known mechanisms whose reference
  DeepSpeed matches: `oracle_judgement`), or how its update relates to PyTorch's when none does, with the roles
  of the differing parameters; the kind of comparison; whether a step before had trained;
* anything else (a checkpoint round trip, the carried state, the cross-rank checks, a hang, a crash): its check
  and code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from zerostate.model.events import Event, EventKind

from zerostate.findings.evidence import Evidence, OracleDiff, Raised
from zerostate.findings.oracle_class import signature, trained_before

RAISED_CHECKS = frozenset({"exception", "saved-tensor-intact", "oracle-error"})

_DOTTED = r"\b[A-Za-z_]\w*\.(?:\w+\.)*(?:weight|bias)\b"
_PARAM_NAME = re.compile(_DOTTED + r"|(?<![-\w])empty(?=[:,\]' ]|$)")
"""A parameter's name in a message: dotted, or the network's zero-element parameter ``empty``."""
_PARAM_IN_TEXT = re.compile(_DOTTED)
_PATH = re.compile(r"(?:<[^>]+>|/[\w.\-]+)(?:/[\w.\-<>]+)+")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_LIST = re.compile(r"\[[^\]]*\]|\([\d, ]*\)")


def _quoted(m: re.Match[str]) -> str:
    """A quoted name stays when it is an identifier (an attribute, a key: part of what went wrong); a dotted
    name, a path or a number is blanked (a parameter's, a module's, a file's)."""
    inner = m.group(0)[1:-1]
    return m.group(0) if re.fullmatch(r"[A-Za-z_]\w*", inner) else "'X'"


def params_in(message: str) -> tuple[str, ...]:
    """The parameter names a message's first line mentions, in order."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    return tuple(dict.fromkeys(m for m in _PARAM_NAME.findall(first)))


def abstract(message: str) -> str:
    """A message with its specifics blanked: paths, quoted names, parameter names, lists and shapes, numbers;
    runs of white space as one."""
    text = " ".join(message.split()[:60]) if message.strip() else ""
    text = text.split(" Traceback ")[0]
    text = _PATH.sub("<path>", text)
    text = _QUOTED.sub(_quoted, text)
    text = _PARAM_IN_TEXT.sub("P", text)
    text = _LIST.sub("[...]", text)
    return _NUMBER.sub("N", text)


def _innermost_deepspeed(r: Raised) -> str:
    for f in reversed(r.frames):
        if f.package == "deepspeed":
            name = f.module.removeprefix("deepspeed.") if f.module.startswith("deepspeed") else \
                f.file.removesuffix(".py").replace("/", ".")
            return f"{name}.{f.function}"
    for f in reversed(r.frames):
        if f.package == "zerostate":
            return f"zerostate.{f.function}"
    return f"{r.frames[-1].file.rsplit('/', 1)[-1].removesuffix('.py')}.{r.frames[-1].function}" if r.frames else "?"


_PLACED = frozenset({"exception", "saved-tensor-intact"})
"""The raised checks whose exception DeepSpeed's run raised, so its trace says where (an ``oracle-error`` is the
reference's own run)."""


def raised_in(trace: Sequence[Event], raised: Raised | None = None) -> str:
    """Which backward the run was in when it raised, from its trace (the events up to the raise): ``backward``
    (the first backward through the graph of the last forward), ``backward-again`` (a later one through the same
    graph: ``retain_graph``), either with ``/nested`` while a reentrant checkpoint's nested graph task ran; in
    ``engine.step()`` (the trace's last mark is the step and the exception passed DeepSpeed's ``step``, or ``raised``
    has no frames: a watched job's), what the step had to work on when it was not a step after a backward
    (`step_context`); "" otherwise
    (a forward, an evaluation, ``initialize``, a step after a backward, a checkpoint: measured, one bug raises in
    the training forward, the eval forward or a checkpoint's, so they stay one identity).  Never a step number, a
    module or how many micro-steps ran before, which shrinking changes."""
    where, backwards = "", 0
    tasks: dict[int, str | None] = {}  # the graph tasks started and not ended: id -> outer / nested / pre
    step_at = None
    for i, e in enumerate(trace):
        k = e.kind
        if k is EventKind.FORWARD_START:
            where, backwards, step_at = "", 0, None
        elif k is EventKind.USER_BACKWARD_START:
            backwards += 1
            where = "backward" if backwards == 1 else "backward-again"
        elif k in (EventKind.EVAL_FORWARD_START, EventKind.USER_BACKWARD_END):
            where, step_at = "", None
        elif k is EventKind.STEP:
            where, step_at = "", i
        elif k is EventKind.TASK_START and e.task is not None:
            tasks[e.task] = e.note
        elif k is EventKind.TASK_END and e.task is not None:
            tasks.pop(e.task, None)
    if where and tasks and list(tasks.values())[-1] == "nested":
        return f"{where}/nested"
    if step_at is not None and (raised is None or not raised.frames or raised.passed("runtime/engine.py", "step")):
        return step_context(trace, step_at)  # (not a checkpoint saved after the step, nor the loop's own code)
    return where


def step_context(trace: Sequence[Event], at: int) -> str:
    """What the step at ``trace[at]`` had to step, when it was not the gradients of a backward: ``step/no-backward``
    (no user backward since the step before, or the start: an idle step), ``step/backward-unexited`` (DeepSpeed's
    backward was entered and not exited: its depth is up at the step, so no epilogue reduced), ``step/no-gradient``
    (the last user backward, with the forward it went through, fired no gradient hook),
    ``step/gradient-unobserved`` (that, where the trace declares it cannot see gradients: ZeRO stage 0 has no hook
    to watch, so no hook firing says nothing); "" for a step after a backward that made gradients.  One crash in
    ``step()`` (``KeyError`` in the norm of the gradients) is what three mechanisms leave, and the step's context is
    what tells them apart in the run."""
    backwards: list[int] = []
    for i in range(at - 1, -1, -1):
        k = trace[i].kind
        if k is EventKind.STEP:
            break
        if k is EventKind.USER_BACKWARD_START:
            backwards.append(i)
    if not backwards:
        return "step/no-backward"
    depth = next((e.value for e in reversed(trace[:at])
                  if e.kind in (EventKind.ENTER_BACKWARD, EventKind.EXIT_BACKWARD)), 0)
    if isinstance(depth, int) and depth > 0:
        return "step/backward-unexited"
    last = backwards[0]
    end = next((i for i in range(last, at) if trace[i].kind is EventKind.USER_BACKWARD_END), at)
    # from its forward: a fused loss's backward runs inside the forward
    start = next((i for i in range(last, -1, -1) if trace[i].kind in (EventKind.FORWARD_START, EventKind.STEP)), 0)
    if not any(e.kind in _GRADIENT_MADE for e in trace[start:end]):
        unseen = any(e.kind is EventKind.GRADIENTS_UNOBSERVED for e in trace[:at])
        return "step/gradient-unobserved" if unseen else "step/no-gradient"
    return ""


_GRADIENT_MADE = frozenset({EventKind.GRAD_HOOK, EventKind.LEAF_HOOK, EventKind.BUCKET_ADD})
"""The events that say a backward made a parameter's gradient (the hooks DeepSpeed registers, its bucket)."""


def placement(check: str, trace: Sequence[Event] | None, raised: Raised | None = None) -> str:
    """Where a ``check`` finding's run raised ``raised`` (`raised_in`), for the checks whose exception DeepSpeed's
    run raised; "" for the others and outside any backward.  One place for the fingerprint and
    `known.labels.root_key`."""
    return raised_in(trace or (), raised) if check in _PLACED else ""


def _placed(check: str, head: str, trace: Sequence[Event] | None, raised: Raised | None = None) -> str:
    where = placement(check, trace, raised)
    return f"{head}@{where}" if where else head


def exception_fingerprint(check: str, r: Raised, trace: Sequence[Event] | None = None) -> str:
    return _placed(check, f"{check}:{r.type}@{_innermost_deepspeed(r)}:{abstract(r.message)}", trace, r)


def _param_roles(trace: Sequence[Event]) -> dict[str, set[str]]:
    """Each parameter's roles, as the trace declares them (ROLE, PERSISTENT): frozen (for the whole run or a
    step), a z3 leaf module's, persistent.  The same in explore and watch: the tracer declares them from the live
    engine, never from a scenario."""
    roles: dict[str, set[str]] = {}
    for e in trace:
        if e.param and e.kind is EventKind.PERSISTENT:
            roles.setdefault(e.param, set()).add("persistent")
        elif e.param and e.kind is EventKind.ROLE and e.note in ("frozen", "leaf"):
            roles.setdefault(e.param, set()).add(e.note)
    return roles


_PLAIN = frozenset({"trainable", "head", "param"})
"""Roles every network has: the parameters involved say nothing of the mechanism by them (shrinking keeps or drops
a plain parameter, the fingerprint does not change)."""


def roles(names: Iterable[str], trace: Sequence[Event]) -> str:
    """The roles that set the named parameters apart (`_param_roles`: frozen, in a z3 leaf module, persistent;
    ``adapter`` for a LoRA one), as one sorted set; "" when they are plain trainable parameters."""
    table = _param_roles(trace)
    out: set[str] = set()
    for n in names:
        r = set(table.get(n, ()))
        if "lora_" in n:
            r.add("adapter")
        out |= r - _PLAIN
    return ",".join(sorted(out))


def _with_roles(head: str, who: str) -> str:
    return f"{head}:{who}" if who else head


def _where(trace: Sequence[Event], index: int) -> str:
    """Where the violating event happened: in a user backward's own graph task (``outer``), in a reentrant
    checkpoint's nested task (``nested``), inside a user backward but in no graph task the tracer saw
    (``backward``), or outside any user backward (``none``)."""
    task = trace[index].task
    if task is not None:
        start = next((e for e in trace if e.kind is EventKind.TASK_START and e.task == task), None)
        return "nested" if start is not None and start.note == "nested" else "outer"
    depth = 0
    for e in trace[:index]:
        if e.kind is EventKind.USER_BACKWARD_START:
            depth += 1
        elif e.kind is EventKind.USER_BACKWARD_END:
            depth = max(depth - 1, 0)
    return "backward" if depth else "none"


def spec_fingerprint(check: str, code: str, trace: Sequence[Event] | None, index: int | None,
                     named: Iterable[str]) -> str:
    if not trace or index is None or not 0 <= index < len(trace):
        return _with_roles(f"{check}:{code}@end", roles(named, trace or ()))
    e = trace[index]
    involved = set(named) | ({e.param} if e.param else set())
    return _with_roles(f"{check}:{code}@{e.kind.value}/{e.phase or '-'}/{_where(trace, index)}",
                       roles(involved, trace[:index + 1]))


def oracle_fingerprint(o: OracleDiff | None, explained_by: tuple[str, ...] | None,
                       events: Sequence[Event] | None) -> str:
    if o is None:
        return "oracle"
    when = "" if o.step is None else (
        "@later-step" if (trained_before(events, o.step) if events else o.step > 0) else "@first-step")
    if explained_by:
        return f"oracle:{'+'.join(explained_by)}{when}"
    shape = signature(o, events).split("@", 1)[0]
    return _with_roles(f"oracle:unexplained:{shape}{when}", roles(o.names, events or ()))


def fingerprint(check: str, code: str, evidence: Evidence, trace: Sequence[Event] | None, index: int | None,
                named: Iterable[str] = (), origin: str = "") -> str:
    """The finding's identity (see the module docstring); ``origin``: where an exception was raised, for a
    finding whose run left no frames (a watched job's)."""
    if check in RAISED_CHECKS and evidence.raised is not None and index is None:
        return exception_fingerprint(check, evidence.raised, trace)
    if check in RAISED_CHECKS and origin and index is None:
        return _placed(check, f"{check}:{origin}", trace)
    if check == "oracle":
        return oracle_fingerprint(evidence.oracle, evidence.explained_by, trace)
    if index is not None or (trace and code and check not in _CODED):
        return spec_fingerprint(check, code, trace, index, named)
    return f"{check}:{code}" if code else check


_CODED = frozenset({"checkpoint", "carried-state", "persistence", "teardown", "ranks-trace", "ranks-params",
                    "ranks-outcome", "model-agreement", "hang", "crash", "internal"})
"""Checks whose code alone says what went wrong."""


__all__ = ["RAISED_CHECKS", "abstract", "exception_fingerprint", "fingerprint", "oracle_fingerprint", "params_in",
           "raised_in", "roles", "spec_fingerprint", "step_context"]
