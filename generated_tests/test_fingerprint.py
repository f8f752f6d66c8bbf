"""A finding's identity is its evidence (`findings.fingerprint`): what its run showed, never names, sizes, counts
or step numbers, never its label; roles of the parameters involved as the trace declares them.  No DeepSpeed."""

from __future__ import annotations

import functools

import pytest
import torch

from zerostate.findings.evidence import Evidence, Frame, OracleDiff, ParamDiff, Raised
from zerostate.findings.finding import Finding
from zerostate.findings.fingerprint import abstract, params_in, raised_in, roles, spec_fingerprint
from zerostate.harness.net.engine import linear_in_use, stage0_masters
from zerostate.known import rules
from zerostate.model.events import Event, EventKind as K
from zerostate.watcher.torch_observers import checkpointed_module
from zerostate.watcher.tracer import z3_leaf_modules

pytestmark = pytest.mark.fast


def test_a_message_loses_its_specifics_and_keeps_what_went_wrong():
    assert abstract("The parameter blocks.3.lin.bias has already been reduced.   Gradient  computed twice") == \
        "The parameter P has already been reduced. Gradient computed twice"
    assert abstract("The size of tensor a (0) must match the size of tensor b (8)") == \
        "The size of tensor a [...] must match the size of tensor b [...]"
    assert abstract("'NoneType' object has no attribute 'numel'") == "'NoneType' object has no attribute 'numel'"
    assert abstract("KeyError: 'blocks.0.lin.weight'") == "KeyError: 'X'"
    assert abstract("/tmp/zerostate-ckpt-x1/global_step1/a.pt is not a zero checkpoint") == \
        "<path> is not a zero checkpoint"
    assert params_in("left in the bucket: ['blocks.0.lin.weight', 'empty']") == ("blocks.0.lin.weight", "empty")
    assert params_in("stack expects a non-empty TensorList") == ()


def test_roles_come_from_the_trace_and_only_the_distinguishing_ones():
    trace = (Event(K.FORWARD_START), Event(K.ROLE, param="blocks.0.norm.weight", note="frozen"),
             Event(K.ROLE, param="blocks.1.lin.weight", note="leaf"),
             Event(K.PERSISTENT, param="blocks.1.lin.weight"))
    assert roles(["blocks.0.norm.weight"], trace) == "frozen"
    assert roles(["blocks.1.lin.weight", "blocks.2.lin.bias"], trace) == "leaf,persistent"
    assert roles(["blocks.2.lin.bias", "head.weight"], trace) == ""  # plain trainable parameters
    assert roles(["base_model.model.layers.0.lora_A.default.weight"], ()) == "adapter"


def test_a_violation_is_keyed_by_its_event_pattern_where_it_happened_and_the_roles_involved():
    ev = (Event(K.FORWARD_START), Event(K.ROLE, param="blocks.0.norm.weight", note="frozen"),
          Event(K.USER_BACKWARD_START, note="engine"), Event(K.TASK_START, task=1, note="nested"),
          Event(K.BUCKET_ADD, param="blocks.0.norm.weight", task=1), Event(K.TASK_END, task=1),
          Event(K.BUCKET_ADD, param="blocks.0.norm.weight", task=0), Event(K.USER_BACKWARD_END, note="engine"),
          Event(K.STEP, value=0))
    nested = spec_fingerprint("grad-handled-once", "handled-twice", ev, 4, ())
    outer = spec_fingerprint("grad-handled-once", "handled-twice", ev, 6, ())
    at_step = spec_fingerprint("clean-step", "stale-bucket", ev, 8, ["blocks.0.norm.weight"])
    assert nested == "grad-handled-once:handled-twice@bucket_add/-/nested:frozen"
    assert outer == "grad-handled-once:handled-twice@bucket_add/-/outer:frozen"
    assert at_step == "clean-step:stale-bucket@step/-/none:frozen"
    assert spec_fingerprint("epilogue-once", "no-epilogue", ev, None, ()) == "epilogue-once:no-epilogue@end"


def test_an_exception_is_its_type_its_innermost_deepspeed_function_and_its_abstracted_message():
    def crash(message, function):
        frames = (Frame("zerostate", "harness/executor.py", "execute", 1, "zerostate.harness.executor"),
                  Frame("deepspeed", "runtime/zero/stage3.py", function, 9, "deepspeed.runtime.zero.stage3"),
                  Frame("torch", "functional.py", "cat", 3, "torch.functional"))
        return Finding("exception", f"AssertionError: {message}", None, (), None, "deepspeed", "0.19.8",
                       evidence=Evidence(raised=Raised("AssertionError", message, frames)))
    a = crash("param 3 of 12 already reduced", "__reduce_and_partition_ipg_grads")
    assert a.key == ("exception:AssertionError@runtime.zero.stage3.__reduce_and_partition_ipg_grads:"
                      "param N of N already reduced")
    assert crash("param 7 of 2 already reduced", "__reduce_and_partition_ipg_grads").key == a.key  # sizes
    assert crash("param 3 of 12 already reduced", "partition_grads").key != a.key  # another function
    assert crash("bucket not empty", "__reduce_and_partition_ipg_grads").key != a.key  # another message
    assert rules.raised_at("AssertionError", "zero/stage3.py", "__reduce_and_partition_ipg_grads")(a)
    assert not rules.raised_at("AssertionError", "zero/stage3.py", "partition_grads")(a)


def _size_crash(trace, function="backward"):
    """0.19.2's ``The size of tensor a (0) must match ...`` from ``engine.backward``, after ``trace``."""
    message = "The size of tensor a (0) must match the size of tensor b (8) at non-singleton dimension 1"
    frames = (Frame("zerostate", "harness/net/engine.py", "backward", 1, "zerostate.harness.net.engine"),
              Frame("deepspeed", "runtime/engine.py", function, 9, "deepspeed.runtime.engine"))
    return Finding("exception", f"RuntimeError: {message}", None, trace, None, "deepspeed", "0.19.2",
                   evidence=Evidence(raised=Raised("RuntimeError", message, frames)))


_FWD = (Event(K.FORWARD_START), Event(K.FORWARD_END))
_BWD = (Event(K.USER_BACKWARD_START, note="engine"), Event(K.TASK_START, task=0, note="outer"))
_GRAD = (Event(K.GRAD_HOOK, param="blocks.0.lin.weight", task=0),)
_DONE = _GRAD + (Event(K.TASK_END, task=0), Event(K.USER_BACKWARD_END, note="engine"))


def test_an_exception_is_also_which_backward_raised_it():
    """Two mechanisms of 0.19.2 raise the same message from the same DeepSpeed function: a z3 leaf module's
    released input in the first backward through a graph, a second backward through a retained graph whose
    parameters the first one released.  Which backward raised each tells them apart; neither a step number nor how
    many micro-steps ran before does (shrinking changes those), nor which forward (training, evaluation, a
    checkpoint's) raised it."""
    first = _FWD + _BWD
    again = _FWD + _BWD + _DONE + (Event(K.USER_BACKWARD_START, note="engine"), Event(K.TASK_START, task=1,
                                                                                      note="outer"))
    assert raised_in(first) == "backward" and raised_in(again) == "backward-again"
    assert _size_crash(first).key != _size_crash(again).key
    assert _size_crash(first).key.endswith("at non-singleton dimension N@backward")
    later = _FWD + _BWD + _DONE + (Event(K.STEP, value=0),) + _FWD + _BWD  # a later step, a later micro-step
    assert _size_crash(later).key == _size_crash(first).key
    nested = first + (Event(K.TASK_START, task=1, note="nested"),)
    assert raised_in(nested) == "backward/nested"
    assert raised_in(nested + (Event(K.TASK_END, task=1),)) == "backward"
    after = _FWD + _BWD + _DONE + (Event(K.STEP, value=0),)
    outside = [(), _FWD[:1], after, after + (Event(K.EVAL_FORWARD_START),), _FWD + _BWD + _DONE + _FWD[:1]]
    assert {raised_in(t) for t in outside} == {""}
    assert {_size_crash(t).key for t in outside} == {_size_crash(()).key}
    assert _size_crash(()).key.endswith("at non-singleton dimension N")
    # an exception the job raised with no frames (a watched one): its origin, placed the same way
    assert Finding("exception", "boom", None, again, origin="KeyError@runtime.x").key == \
        "exception:KeyError@runtime.x@backward-again"
    assert Finding("exception", "boom", None, after, origin="KeyError@runtime.x").key == "exception:KeyError@runtime.x"


def test_a_crash_in_the_step_is_also_what_that_step_had():
    """0.19.8's ZeRO-1/2 ``step()`` raises ``KeyError: 0`` in ``scaled_global_norm`` for three mechanisms: a step
    with no backward since the step before (`step-without-gradient`), a step whose backward entered DeepSpeed's
    and never exited (no epilogue reduced: `two-backwards-per-forward`'s PyTorch-style retained backwards), a step
    whose last backward fired no gradient hook (`zero12-backward-without-gradients`).  The step's context, read
    from the trace, keeps them three findings; a step after a backward that made gradients adds nothing."""
    def key_error(trace):
        frames = (Frame("deepspeed", "runtime/engine.py", "step", 1, "deepspeed.runtime.engine"),
                  Frame("deepspeed", "runtime/zero/stage_1_and_2.py", "scaled_global_norm", 9,
                        "deepspeed.runtime.zero.stage_1_and_2"))
        return Finding("exception", "KeyError: 0", None, trace, None, "deepspeed", "0.19.8",
                       evidence=Evidence(raised=Raised("KeyError", "0", frames)))
    step = (Event(K.STEP, value=0),)
    trained = _FWD + _BWD + _DONE + step
    idle = trained + step  # a second step, no backward since the first
    hookless = _FWD + _BWD + (Event(K.TASK_END, task=0), Event(K.USER_BACKWARD_END, note="torch")) + step
    unexited = _FWD + _BWD + (Event(K.ENTER_BACKWARD, value=1),) + _DONE + step
    exited = _FWD + _BWD + (Event(K.ENTER_BACKWARD, value=1),) + _GRAD + (Event(K.EXIT_BACKWARD, value=0),) + \
        _DONE[1:] + step
    assert [raised_in(t) for t in (trained, idle, step, hookless, unexited, exited)] == [
        "", "step/no-backward", "step/no-backward", "step/no-gradient", "step/backward-unexited", ""]
    keys = {key_error(t).key for t in (trained, idle, hookless, unexited)}
    assert len(keys) == 4
    assert key_error(idle).key == "exception:KeyError@runtime.zero.stage_1_and_2.scaled_global_norm:N@step/no-backward"
    # a fused loss's backward made its gradients in the forward: the step had them
    fused = _FWD[:1] + _GRAD + _FWD[1:] + _BWD + (Event(K.TASK_END, task=0), Event(K.USER_BACKWARD_END)) + step
    assert raised_in(fused) == ""
    # a raise after the step's forward started is the forward's again
    assert raised_in(idle + _FWD[:1]) == ""
    # after the step but not in it (a checkpoint saved after it, the loop's own scheduler step): no step context
    saved = Raised("ValueError", "x is not a zero checkpoint", (
        Frame("deepspeed", "utils/zero_to_fp32.py", "parse_optim_states", 3, "deepspeed.utils.zero_to_fp32"),))
    assert raised_in(idle, saved) == "" and raised_in(idle, key_error(idle).evidence.raised) == "step/no-backward"
    assert Finding("exception", "x", None, idle, evidence=Evidence(raised=saved)).key == \
        "exception:ValueError@utils.zero_to_fp32.parse_optim_states:x is not a zero checkpoint"


def test_a_step_after_gradients_nobody_could_see_does_not_claim_there_were_none():
    """ZeRO stage 0 registers no gradient hook, so its backwards fire none whatever they make: where the tracer
    declares that (`GRADIENTS_UNOBSERVED`), a crash in the step says the gradients were unobserved, not absent --
    the same events at ZeRO-1 still say no gradient, and the other contexts are unchanged."""
    step = (Event(K.STEP, value=0),)
    hookless = _FWD + _BWD + (Event(K.TASK_END, task=0), Event(K.USER_BACKWARD_END, note="torch")) + step
    unseen = (Event(K.FORWARD_START), Event(K.GRADIENTS_UNOBSERVED)) + hookless[1:]
    assert raised_in(hookless) == "step/no-gradient"
    assert raised_in(unseen) == "step/gradient-unobserved"
    assert raised_in(unseen + step) == "step/no-backward"  # an idle step is seen in the loop's own marks


def test_an_oracle_difference_is_its_counterfactual_class_never_its_label():
    o = OracleDiff("params", 1, (ParamDiff("blocks.0.lin.weight", 1e-3, 0.5, 1.0, 0.5),), 0.5)
    trace = (Event(K.FORWARD_START), Event(K.USER_BACKWARD_START), Event(K.STEP, value=0), Event(K.FORWARD_START),
             Event(K.STEP, value=1))
    known = Finding("oracle", "x", None, trace, evidence=Evidence(oracle=o, explained_by=("last-backward-only",)))
    new = Finding("oracle", "x", None, trace, evidence=Evidence(oracle=o))
    assert known.key == "oracle:last-backward-only@later-step"
    assert new.key == "oracle:unexplained:x0.5@later-step"
    from dataclasses import replace
    assert replace(known, known="two-backwards-per-forward").key == known.key


def test_the_engine_wrapper_names_the_linear_it_runs_with_and_reads_stage0_masters(monkeypatch):
    # torch's own linear, set here: a ZeRO-3 engine an earlier test built in this process may have left
    # DeepSpeed's in its place (z3-linear-override-outlives-engine)
    monkeypatch.setattr(torch.nn.functional, "linear", torch._C._nn.linear)
    linear = torch.nn.functional.linear
    assert linear_in_use() == f"{linear.__module__}.{linear.__name__}" and "deepspeed" not in linear_in_use()

    def zero3_linear_wrap(*args, **kwargs):  # what partition_parameters.py puts in its place
        return linear(*args, **kwargs)
    zero3_linear_wrap.__module__ = "deepspeed.runtime.zero.linear"
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    assert linear_in_use() == "deepspeed.runtime.zero.linear.zero3_linear_wrap"
    a, b = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float16)), torch.nn.Parameter(torch.ones(3))
    module = torch.nn.Module()
    module.register_parameter("a", a)
    module.register_parameter("b", b)

    class Fused:  # FP16_Optimizer: one flat fp32 tensor per group over its 16-bit parameters, in order
        def __init__(self) -> None:
            self.fp16_groups = [[a, b]]
            self.fp32_groups_flat = [torch.arange(7, dtype=torch.float32)]
    got = stage0_masters(module, Fused())
    assert got["a"].tolist() == [[0, 1], [2, 3]] and got["b"].tolist() == [4, 5, 6]
    assert stage0_masters(module, object()) == {}


def test_watch_helpers_find_leaf_modules_and_the_module_a_checkpoint_recomputes():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    net[1]._z3_leaf = True
    assert set(z3_leaf_modules(net)) == {"1"}
    assert checkpointed_module(functools.partial(net[0].__call__)) is net[0]
    assert checkpointed_module(lambda x: x) is None


@pytest.mark.parametrize("log, code", [
    (("rank 1 exited (code -6) while 0 of 2 ranks had answered\nterminate called after throwing an instance of "
      "'gloo::EnforceNotMet'\n  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 76 vs 44. "
      "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?"),
     "collective-mismatch"),
    ("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: ...",
     "collective-mismatch"),
    ("rank 1 exited (code -9) while 1 of 2 ranks had answered", ""),
])
def test_a_crash_is_named_by_what_its_rank_log_shows(log, code):
    """A rank killed by the others' divergence (two collectives of different sizes at one point) is its own
    identity, ``crash:collective-mismatch``; a crash whose log says nothing of why keeps the bare ``crash``."""
    from zerostate.findings.build import findings_of
    from zerostate.findings.decide import decide_failure
    d = decide_failure("crash", log)
    assert d.code == code
    assert decide_failure("hang", log).code == ""  # a hang is placed by its stacks, not by this
    [f] = findings_of([d], None, None, "deepspeed", "0.19.8", 2)
    assert f.key == (f"crash:{code}" if code else "crash")
    assert rules.ranks_ran_different_collectives(f) == bool(code)
