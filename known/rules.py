"""What each known issue's mechanism leaves behind in a finding's own evidence: one predicate per issue (or
family), read by the table's ``explains`` (`known.issues`), each combined there with the scenario conditions
that narrow it.

Every rule names the check(s) it explains and what their evidence must show: the exception's type, message and
the DeepSpeed function it was raised in; the event pattern of the trace (`known.mechanism`); the parameters
the finding names; the oracle's differing parameters and the size and direction of their update."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from zerostate.model.events import Event

from zerostate.findings.evidence import Raised
from zerostate.findings.finding import Finding
from zerostate.known.mechanism import (K, at, bucketed_again_unflushed, bucketed_twice_after_second_backward,
                                       early_leaf_hooks, gathered_at, hook_after_epilogue, hooked_in_two_tasks,
                                       hookless_backward, idle_step, left_by_second_backward, oracle, params_named,
                                       persistent, raised, raised_in, raised_in_second_backward, reregistered_before,
                                       second_backward_start, second_backwards, this_iteration, trace,
                                       unexited_second_backward, violating)


def _inside(param: str, modules: set[str]) -> bool:
    return any(param.startswith(m + ".") for m in modules)


# ------------------------------------------------------------------ the exception alone
def raised_at(exc_type: str, file: str, function: str | None = None, *says: str) -> Callable[[Finding], bool]:
    """The rule of an issue whose whole evidence is one exception raised in one DeepSpeed function."""
    return lambda f: raised_in(f, exc_type, file, function, *says)


# ------------------------------------------------------------------ hooks, leaves, reduction
def leaf_reduced_early(f: Finding) -> bool:
    """A z3 leaf module's backward hook fired before the module's own backward (the trace), and what followed is
    what reducing zero-filled, size-0 gradients leaves: the real gradient cannot accumulate into the size-0
    ``.grad`` (RuntimeError, tensor a of size 0), or the ZeRO-3 reduction refuses the size-0 gradient in its
    bucket (RuntimeError 'Cannot reduce scatter gradients' in __reduce_and_partition_ipg_grads), or the spec
    sees the leaf's parameters handled before their gradient accumulated / unavailable in its backward, or the
    oracle sees only the leaf's parameters off."""
    early = early_leaf_hooks(trace(f), at(f) + 1)
    if not early:
        return False
    if f.check == "exception":
        r = raised(f, "RuntimeError")
        return r is not None and (r.says("must match the size of tensor", "(0)")
                                  or (r.says("Cannot reduce scatter gradients whose size is not same")
                                      and r.raised_in("zero/stage3.py", "__reduce_and_partition_ipg_grads")))
    ev = violating(f)
    if f.violation == "grad-handled-once:handled-before-accumulated":
        return ev is not None and ev.param is not None and _inside(ev.param, early)
    if f.check == "available-when-used" and f.code == "unavailable-in-backward":
        named = params_named(f.error)
        return bool(named) and all(_inside(p, early) for p in named)
    o = oracle(f)
    return o is not None and bool(o.params) and all(_inside(p.param, early) for p in o.params)


def no_gradient_crash(f: Finding) -> bool:
    """The last user backward fired no gradient hook (the trace), then the epilogue indexed the empty bucket
    (IndexError in reduce_ipg_grads) or step() found no gradient (KeyError in scaled_global_norm, or in fp16's
    overflow check before it; bf16 with fp32 accumulation: torch.stack of an empty list under bf16_optimizer), or no
    epilogue ran at all."""
    if not hookless_backward(trace(f), at(f) + 1):
        return False
    if f.check == "exception":
        r = raised(f, "RuntimeError")
        return (raised_in(f, "IndexError", "zero/stage_1_and_2.py", "reduce_ipg_grads")
                or raised_in(f, "KeyError", "zero/stage_1_and_2.py", "scaled_global_norm")
                or raised_in(f, "KeyError", "zero/stage_1_and_2.py", "has_overflow_partitioned_grads_serial")
                or (r is not None and r.passed("runtime/bf16_optimizer.py") and r.says("non-empty TensorList")))
    return f.violation == "epilogue-once:no-epilogue"


_NORM_OF_NO_GRADIENT = (("zero/stage3.py", "_get_norm_groups"), ("zero/stage3.py", "get_grad_norm_direct"),
                        ("zero/stage_1_and_2.py", "get_grad_norm_direct"),
                        ("zero/stage_1_and_2.py", "scaled_global_norm"),
                        ("zero/stage_1_and_2.py", "has_overflow_partitioned_grads_serial"))


def idle_step_crash(f: Finding) -> bool:
    """engine.step() with no backward since the step before (the trace), and step() reading the gradients no
    backward made (KeyError / TypeError in the norm or overflow check; BF16_Optimizer's norm of an empty list), or a
    spec violated at that very step.  (With optimizer offload the stale CPU gradients are applied again: an oracle
    difference, stated as the counterfactual ``stale-gradient-replayed-at-idle-step``.)"""
    ev = trace(f)
    if f.check == "exception":
        return idle_step(ev, len(ev)) and (
            any(raised_in(f, t, file, fn) for t in ("KeyError", "TypeError") for file, fn in _NORM_OF_NO_GRADIENT)
            # ZeRO-0 with clipping: clip_grad_norm_ filters out the parameters without a gradient, then indexes
            # the empty list (parameters[0].device)
            or raised_in(f, "IndexError", "runtime/utils.py", "clip_grad_norm_")
            # BF16_Optimizer (ZeRO-1 bf16 with fp32 accumulation): the norm of no gradient is torch.stack([])
            or (raised_in(f, "RuntimeError", "runtime/utils.py", "get_global_norm_of_tensors",
                          "stack expects a non-empty TensorList") and _passed_bf16_optimizer(f)))
    e = violating(f)
    return e is not None and e.kind is K.STEP and idle_step(ev, at(f))


def _passed_bf16_optimizer(f: Finding) -> bool:
    r = f.evidence.raised
    return r is not None and r.passed("runtime/bf16_optimizer.py", "step")


def shared_param_hooked_twice(f: Finding) -> bool:
    """A parameter's gradient hook fired in two graph tasks of one backward (a reentrant checkpoint's nested
    task and the outer one: the trace), and the second reduction was refused (ZeRO-2: AssertionError 'already
    been reduced'; ZeRO-3: the assertion in __reduce_and_partition_ipg_grads, or -- when the first gradient
    filled the reduce bucket and was partitioned away -- the second hook's ``param.grad.numel()`` on None in
    __add_grad_to_ipg_bucket) or the spec saw it handled twice."""
    twice = hooked_in_two_tasks(trace(f), at(f) + 1)
    if not twice:
        return False
    if f.check == "exception":
        r = raised(f, "AssertionError")
        gone = raised(f, "AttributeError")
        return (r is not None and (r.says("has already been reduced")
                                   or r.raised_in("zero/stage3.py", "__reduce_and_partition_ipg_grads"))) or (
            gone is not None and gone.raised_in("zero/stage3.py", "__add_grad_to_ipg_bucket")
            and gone.says("'NoneType' object has no attribute 'numel'"))
    e = violating(f)
    return f.code == "handled-twice" and f.check == "grad-handled-once" and e is not None and e.param in twice


def two_backwards(f: Finding) -> bool:
    """A second user backward of one forward ran before it (the trace: retain_graph), and it is what that leaves:
    ZeRO-1/2 copy the boundary's second backward's gradients over what the step had accumulated (the oracle's
    counterfactual updates; without them, a share of PyTorch's update between half and all of it).  ZeRO-3: the second
    backward computes with parameters the first one released (torch meets a size-0 tensor, raised inside that
    backward), or runs without its epilogue: its gradients stay in the bucket (left there; a later epilogue
    finds them twice: DeepSpeed's assertion in __reduce_and_partition_ipg_grads, or a later hook finds the gradient
    already taken: 'NoneType' ... 'numel' in __add_grad_to_ipg_bucket; step()'s zero_grad on the stale
    entries: 'unknown parameter type'), its parameters gathered; with a small reduce bucket the second backward's
    reduce-scatter meets a size-0 gradient ('Cannot reduce scatter gradients'); or no active backward submodule is
    found.  Any stage: a PyTorch-style second backward enters DeepSpeed's backward and, without an epilogue, never
    exits (its gradients outlive step() in the bucket, the backward depth stays up); at ZeRO-1/2 the flags of a
    bucket reduced during it are never reset, so a later backward's hook asserts the parameter 'already been
    reduced'."""
    ev = trace(f)
    second = second_backward_start(ev, at(f) + 1)
    if second is None:
        return False
    if f.check == "exception":
        r = f.evidence.raised
        return r is not None and (
            (_partitioned_in_use(r) and raised_in_second_backward(ev))
            or raised_in(f, "RuntimeError", "zero/stage3.py", "zero_grad", "unknown parameter type")
            or (r.type == "AssertionError" and r.says("active_backward_submodules is empty"))
            or (raised_in(f, "AssertionError", "zero/stage3.py", "__reduce_and_partition_ipg_grads")
                and bool(bucketed_twice_after_second_backward(ev, at(f) + 1)
                         or bucketed_again_unflushed(ev, at(f) + 1)))
            or (raised_in(f, "AttributeError", "zero/stage3.py", "__add_grad_to_ipg_bucket", "'numel'")
                and bool(left_by_second_backward(ev, at(f) + 1)))
            or (raised_in(f, "RuntimeError", "zero/stage3.py", "__reduce_and_partition_ipg_grads",
                          "Cannot reduce scatter gradients") and raised_in_second_backward(ev))
            or (_no_epilogue_after_unexited(ev) and any(
                raised_in(f, t, file, fn) for t in ("KeyError", "TypeError") for file, fn in _NORM_OF_NO_GRADIENT))
            # the already-reduced flags a bucket reduced during an earlier backward of the forward set (or during a
            # never-exited one, which no epilogue resets), asserted by the hook or, under overlap_comm, by the
            # epilogue's reduction
            or (any(raised_in(f, "AssertionError", "zero/stage_1_and_2.py", fn, "already been reduced")
                    for fn in ("reduce_independent_p_g_buckets_and_remove_grads", "reduce_ipg_grads"))
                and (unexited_second_backward(ev, at(f) + 1) or raised_in_second_backward(ev))))
    if f.violation in ("clean-step:backward-never-exited",  # the second backward entered and had no epilogue to exit
                 "no-epilogue-before-user-backward:epilogue-outside-user-backward"):  # a later epilogue sees its depth
        return unexited_second_backward(ev, at(f) + 1)
    if f.violation == "clean-step:stale-bucket":  # the second backward ran no epilogue: its gradients outlive step()
        named = params_named(f.error)
        return bool(named) and named <= left_by_second_backward(ev, at(f) + 1)
    return f.violation in _AFTER_A_SECOND_BACKWARD and f.index is not None and f.index >= second


def _no_epilogue_after_unexited(events: Sequence[Event]) -> bool:
    """A second backward entered DeepSpeed's backward without exiting it, and no epilogue ran from then on: the
    later backwards start deeper and never reduce, so step() finds no gradient (its norm of None)."""
    unexited = [a for a, b in second_backwards(events) if b < len(events) and unexited_second_backward(events, b + 1)
                and not unexited_second_backward(events, a)]
    return bool(unexited) and not any(e.kind is K.EPILOGUE for e in events[unexited[0]:])


def _partitioned_in_use(r: Raised) -> bool:
    """torch met a size-0 tensor where a parameter's full shape belongs: a partitioned ZeRO-3 parameter (its
    ``.data`` an empty tensor) or its size-0 gradient in the computation."""
    return r.type == "RuntimeError" and (r.says("must match the size of tensor", "(0)") or r.says("of shape [0]"))


_AFTER_A_SECOND_BACKWARD = ("epilogue-once:no-epilogue", "grad-handled-once:left-in-bucket",
                            "saved-tensor-intact:partitioned-at-check",  # a recompute in the second backward
                            "released-after-backward:still-gathered", "released-after-backward:stale-holders",
                            "trace-consistent:uncalled-for-invalid")


def premature_epilogue(f: Finding) -> bool:
    """Seed 000 part 1: in a user backward a gradient hook fired after its epilogue (the trace), and the finding
    is that epilogue's consequence: the next step's zero_grad on the stale bucket ('unknown parameter type' on
    CPU, 'NoneType' ... 'numel' on GPU) or the epilogue / bucket / clean-step specs."""
    if not hook_after_epilogue(trace(f), at(f) + 1):
        return False
    if f.check == "exception":
        return (raised_in(f, "RuntimeError", "zero/stage3.py", None, "unknown parameter type")
                or raised_in(f, "AttributeError", "zero/stage3.py", None, "numel"))
    return f.code in _AFTER_A_PREMATURE_EPILOGUE.get(f.check, ())


_AFTER_A_PREMATURE_EPILOGUE = {"epilogue-once": ("hook-after-epilogue", "epilogue-twice", "no-epilogue"),
                               "grad-handled-once": ("left-in-bucket", "never-handled"),
                               "clean-step": ("stale-bucket",)}


def counted_in_every_hook(f: Finding) -> bool:
    """Seed 000 part 2: count_used_parameters_in_backward evaluated twice in one graph task (the violating COUNT
    event itself)."""
    e = violating(f)
    return f.violation.startswith("count-once-per-phase:counted-twice-in-phase") and e is not None and e.kind is K.COUNT


def frozen_partitioned_in_recompute(f: Finding) -> bool:
    """Seed 002: the recompute saved a live reference to a frozen parameter (SAVE_LIVE), the coordinator
    released that parameter, and torch's metadata check unpacked it partitioned (the violating UNPACK)."""
    e, ev = violating(f), trace(f)
    if f.check != "saved-tensor-intact" or e is None or e.kind is not K.UNPACK or not e.param:
        return False
    saved = [i for i, x in enumerate(ev[:f.index]) if x.kind is K.SAVE_LIVE and x.param == e.param]
    return bool(saved) and any(x.kind is K.RELEASE and x.param == e.param for x in ev[saved[-1]:f.index])


# ------------------------------------------------------------------ the ZeRO-3 coordinator
def kept_by_leaf(f: Finding) -> bool:
    """A still-gathered parameter was fetched in this iteration for a z3 leaf module (an enclosing module
    gathers it, not its own) whose backward never began (no pre-backward of it since the forward)."""
    if f.violation != "released-after-backward:still-gathered":
        return False
    ev, upto = trace(f), at(f)
    lo, _ = this_iteration(ev, upto)
    for p in params_named(f.error):
        if not gathered_at(ev, upto, p):
            continue
        leaves = {e.module for e in ev[lo:upto] if e.kind is K.FETCH and e.param == p and e.module
                  and p.startswith(e.module + ".") and e.module != p.rsplit(".", 1)[0]}
        if any(not any(e.kind is K.MODULE_PRE_BACKWARD and e.module == m for e in ev[lo:upto]) for m in leaves):
            return True
    return False


def held_after_backward(f: Finding, upto: int) -> set[str]:
    """Parameters that gained a holder inside a user backward before ``upto`` (a pre-backward fetch) and still
    had it when that backward ended: no post-backward released them."""
    out: set[str] = set()
    held: dict[str, int] | None = None
    for e in trace(f)[:upto]:
        if e.kind is K.USER_BACKWARD_START:
            held = {}
        elif e.kind is K.USER_BACKWARD_END and held is not None:
            out |= {p for p, n in held.items() if n > 0}
            held = None
        elif held is not None and e.kind is K.HOLDERS and e.param and e.note in ("+", "-"):
            held[e.param] = held.get(e.param, 0) + (1 if e.note == "+" else -1)
    return out


def released_late(f: Finding) -> bool:
    """Parameters took a holder in the backward (their module's pre-backward) and kept it past the backward's
    end (their post-backward never fired): the still-gathered / stale-holder parameters are those; or, in a
    run that shows such parameters, the coordinator's trace became INVALID without a cause."""
    if f.violation in ("released-after-backward:still-gathered", "released-after-backward:stale-holders"):
        named = params_named(f.error)
        return bool(named) and named <= held_after_backward(f, at(f) + 1)
    if f.violation == "trace-consistent:uncalled-for-invalid":
        return bool(held_after_backward(f, len(trace(f))))
    return False


def kept_for_a_use_skipped(f: Finding) -> bool:
    """A still-gathered parameter whose module (nor a module holding it) ran no hook in this train iteration:
    it was gathered for a recorded use (reuse, prefetch, a recompute) that the branch taken skipped."""
    if f.violation != "released-after-backward:still-gathered":
        return False
    ev, upto = trace(f), at(f)
    lo, _ = this_iteration(ev, upto)
    named = params_named(f.error)
    if not all(gathered_at(ev, upto, p) for p in named):
        return False
    ran = {e.module for e in ev[lo:upto] if e.module and e.kind in (K.MODULE_PRE_FORWARD, K.MODULE_PRE_BACKWARD)}
    if not ran - {"model"}:  # a trace without module hooks (the llama family's) cannot show which module ran
        return False
    return bool(named) and all(not any(p.startswith(m + ".") for m in ran) for p in named)


def released_by_early_epilogue(f: Finding) -> bool:
    """The module computed its backward with parameters the epilogue had already released: an EPILOGUE in this
    backward before the violation, and a RELEASE of every parameter named after it (the module's parameters
    have no gradient hook, so the epilogue came before their backward)."""
    if f.check != "available-when-used" or f.code != "unavailable-in-backward" or f.index is None:
        return False
    ev = trace(f)
    start = max((i for i, e in enumerate(ev[:f.index]) if e.kind is K.USER_BACKWARD_START), default=None)
    if start is None:
        return False
    epi = next((i for i in range(start, f.index) if ev[i].kind is K.EPILOGUE), None)
    named = params_named(f.error)
    return (epi is not None and bool(named)
            and named <= {e.param for e in ev[epi:f.index] if e.kind is K.RELEASE and e.param})


def recording_when_reregistered(f: Finding) -> bool:
    """The hooks were re-registered (the trace's REREGISTER) before it, and it is what a trace left RECORD shows
    next: record_parameters popping an empty deque, the trace not made INVALID, or the coordinator's holders
    the design releases."""
    if not reregistered_before(trace(f), at(f)):
        return False
    if f.check == "exception":
        return raised_in(f, "IndexError", "partitioned_param_coordinator.py", "record_parameters", "empty deque")
    if f.check == "model-agreement":
        return f.error.startswith("coordinator:") and "holders" in f.error
    return f.violation == "trace-consistent:not-made-invalid"


def late_module_after_reregister(f: Finding) -> bool:
    """The hooks were re-registered (REREGISTER) and the next forward's pre-forward asked a module zero.Init
    never converted for its external parameters (AttributeError 'ds_external_parameters' in get_all_parameters)."""
    return reregistered_before(trace(f), at(f)) and raised_in(
        f, "AttributeError", "partitioned_param_coordinator.py", "get_all_parameters", "ds_external_parameters")


def ranks_ran_different_collectives(f: Finding) -> bool:
    """A rank died of the others' divergence: its log shows the ranks ran different collectives at one point
    (``crash`` with the code `findings.decide.decide_failure` gives it)."""
    return f.check == "crash" and f.code == "collective-mismatch"


def differing_persistent(f: Finding) -> bool:
    """At world size > 1, the parameters that differ (between the ranks, or from PyTorch) are all persistent
    ones (the trace's PERSISTENT declarations)."""
    if f.world_size < 2:
        return False
    pers = persistent(trace(f))
    if f.check == "ranks-params":
        named = set(f.evidence.ranks_differ)
    elif f.check == "oracle" and f.evidence.oracle is not None:
        named = set(f.evidence.oracle.names)
    else:
        return False
    return bool(named) and named <= pers


def ranks_gathered_apart(f: Finding) -> bool:
    """At world size > 1 the ranks gathered different values of a parameter in this run (``ranks-params``), and
    the oracle finding's differing parameters are among those."""
    differ = set(f.evidence.ranks_differ)
    if f.world_size < 2 or not differ:
        return False
    if f.check == "ranks-params":
        return f.code == "gathered-params-differ"
    o = oracle(f)
    return o is not None and bool(set(o.names) & differ)


# ------------------------------------------------------------------ the oracle: which parameters, which way














def pytorch_style_backward(f: Finding) -> bool:
    return any(e.kind is K.USER_BACKWARD_START and e.note in ("torch", "nonscalar") for e in trace(f))


__all__ = ["counted_in_every_hook", "differing_persistent", "frozen_partitioned_in_recompute", "held_after_backward",
           "idle_step_crash", "kept_by_leaf", "kept_for_a_use_skipped", "late_module_after_reregister",
           "leaf_reduced_early", "no_gradient_crash", "premature_epilogue", "pytorch_style_backward", "raised_at",
           "ranks_gathered_apart", "recording_when_reregistered", "released_by_early_epilogue", "released_late",
           "shared_param_hooked_twice", "two_backwards"]
