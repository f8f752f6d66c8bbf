"""Known issues of ZeRO's hook and coordinator lifecycle (leaf modules, gradients, trace, release), each
with the scenario that shows it on the releases it names; part of the one table (`known.issues`).  On which
releases each range was established, and the figures: docs/known-issues-provenance.md."""

from __future__ import annotations

from dataclasses import replace

from zerostate.model.network import Network
from zerostate.model.scenario import ParamKind, Scenario

from zerostate.findings.finding import Finding
from zerostate.known.issue import KnownIssue, Nature
from zerostate.known import rules
from zerostate.known.mechanism import narrow


def _leaf_input_without_grad(sc: Scenario) -> bool:
    net = Network(sc)
    return sc.stage == 3 and any(b.leaf and not net.block_input_requires_grad(i) for i, b in enumerate(sc.blocks))


Z3_LEAF_INPUT_NO_GRAD = KnownIssue(
    id="z3-leaf-input-without-grad",
    title="ZeRO-3: a z3 leaf module whose input does not require grad reduces its gradients too early",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"blocks": [{"leaf": True}], "input_requires_grad": False, "stage": 3,
                                 "steps": [{"micro": [{"backward": "engine"}]}]}),
    checks=("exception",),
    upstream_patch="docs/upstream/z3-leaf-input-without-grad/",
    runtime_prevents=True,  # runtime/leaf_deferral.py
    # from 0.19.3 (the leaf's leftovers released) a second micro-step's backward finds them unavailable first
    variants=(Scenario.from_dict({"blocks": [{"leaf": True, "norm": "frozen"}], "input_requires_grad": False,
                                  "stage": 3,
                                  "steps": [{"micro": [{"backward": "engine"}, {"backward": "engine"}]}]}),
              # with the Linear's weight external to the leaf block, the spec sees that weight handled before its
              # gradient accumulated (met unlabelled on the plain-world-rate sequence)
              Scenario.from_dict({"blocks": [{"leaf": True}], "input_requires_grad": False, "stage": 3,
                                  "external": True, "steps": [{"micro": [{"backward": "engine"}]}]})),
    # and its side effect on the spec: the hook fired before the leaf's pre-backward, so the next driver
    # event after that pre-backward is the task's end, after the epilogue drained the leaf
    # ... and the model's view of the bug (DeepSpeed's model designs): the leaf's gradients accumulate after the
    # hook handled them (grad-handled-once, handled-before-accumulated).  zerostate.runtime defers the reduction.
    explains=lambda f: rules.leaf_reduced_early(f) and narrow(f, _leaf_input_without_grad),
    nature=Nature.LIMITATION,
    cites=("DeepSpeed's tests/unit/runtime/zero/test_zero_leaf_module.py expects RuntimeError 'inputs with "
           "requires_grad=False is not supported for a leaf module'; 0.19.8 raises a size mismatch instead"),
    detail=("stage3.py registers reduce_leaf_module_grads as the leaf module's full backward hook.  When no "
            "input of the module requires grad, torch fires a full backward hook as soon as the gradient of "
            "its *output* is known -- before the module's own backward has produced its parameters' "
            "gradients.  The hook then sets param.grad = zeros_like(param) on the still-partitioned (size 0) "
            "parameters and reduces them; the real gradients arrive afterwards and cannot accumulate into the "
            "size-0 .grad: RuntimeError 'The size of tensor a (0) must match the size of tensor b (8)' "
            "(engine.backward or loss.backward), or '0 != 8 Cannot reduce scatter gradients' in older "
            "releases.  Any z3 leaf module fed by data that does not require grad (a first layer) hits it."),
)

ZERO12_NO_GRADIENT = KnownIssue(
    id="zero12-backward-without-gradients",
    title="ZeRO-1/2: a backward in which no parameter receives a gradient crashes the epilogue or step",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"blocks": [{"norm": "unused", "lin": "unused"}], "stage": 1,
                                 "steps": [{"micro": [{"backward": "engine"}]}]}),
    checks=("exception",),
    upstream_patch="docs/upstream/zero12-backward-without-gradients/",
    # an exception in the epilogue or step(): the IndexError of the epilogue, step()'s KeyError, or with bf16
    # and fp32 gradient accumulation (BF16_Optimizer) step()'s "stack expects a non-empty TensorList"
    # ... and, with a PyTorch-style backward, the epilogue that never runs (no hook queues it)
    explains=lambda f: rules.no_gradient_crash(f) and narrow(f, lambda sc: sc.stage in (1, 2)),
    # the PyTorch-style route: no hook queues the epilogue (epilogue-once:no-epilogue), step()'s KeyError
    # then BF16_Optimizer's route (bf16 with fp32 gradient accumulation), by either backward: step()'s norm of
    # the gradients it never received is torch.stack([])
    variants=(Scenario.from_dict({"blocks": [{"norm": "unused", "lin": "unused"}], "stage": 1,
                                  "steps": [{"micro": [{"backward": "torch"}]}]}),
              Scenario.from_dict({"blocks": [{"norm": "unused", "lin": "unused"}], "stage": 1, "precision": "bf16",
                                  "fp32_grad_accum": True, "steps": [{"micro": [{"backward": "engine"}]}]}),
              Scenario.from_dict({"blocks": [{"norm": "unused", "lin": "unused"}], "stage": 1, "precision": "bf16",
                                  "fp32_grad_accum": True, "steps": [{"micro": [{"backward": "torch"}]}]}),
              # fp16: step()'s overflow check meets the missing gradient first
              Scenario.from_dict({"blocks": [{"norm": "unused", "lin": "unused"}], "stage": 1, "precision": "fp16",
                                  "steps": [{"micro": [{"backward": "torch"}]}]}),
              # gas 2: the missing epilogue met by the next micro-step's forward
              Scenario.from_dict({"blocks": [{"norm": "unused", "lin": "unused"}], "stage": 1,
                                  "steps": [{"micro": [{"backward": "torch"}, {"backward": "torch"}]}]}),
              # a fused head (its gradient made in the forward) the only parameter held: the second backward of
              # the forward fires no hook, its epilogue meets the bucket the first one's emptied (clean without the
              # second backward)
              Scenario.from_dict({"blocks": [{"in_optimizer": False}], "stage": 1, "fused_head": True,
                                  "steps": [{"micro": [{"backward": "engine", "retain": True}]}]})),
    detail=("stage_1_and_2.py sets up its ipg bucket buffers lazily in process_gradients (the gradient "
            "hook).  If no hook fires in a backward (every trainable parameter unused; the loss depends on "
            "the input only), the epilogue's reduce_ipg_grads indexes bucket.buffer[bucket.index] of an "
            "empty list: IndexError.  With a PyTorch-style backward no epilogue runs at all and step() "
            "fails in scaled_global_norm with KeyError: 0.  ZeRO-1 in bf16 with fp32 gradient accumulation "
            "(BF16_Optimizer) fails in step(): the norm of no gradient is torch.stack of an empty list.  ZeRO-3 "
            "handles the same schedule."),
)

def _leaf_without_backward(sc: Scenario) -> bool:
    """A z3 leaf block whose backward never runs (its output does not require grad: frozen or unused and
    fed an input without grad, or reentrant-checkpointed and fed an input without grad) in a forward with a
    COMPLETE trace (any after the run's first): for the whole run, or in a step that freezes its Linear."""
    if sc.stage != 3 or len(sc.steps) * sc.gas <= 1:
        return False
    if _leaf_without_grad_output(sc):
        return True
    return any(_leaf_without_grad_output(_with_linears_frozen(sc, st.frozen)) and (i > 0 or sc.gas > 1)
               for i, st in enumerate(sc.steps) if st.frozen)


def _leaf_without_grad_output(sc: Scenario) -> bool:
    net = Network(sc)
    return any(b.leaf and not net.output_requires_grad[i] for i, b in enumerate(sc.blocks))


def _with_linears_frozen(sc: Scenario, blocks: tuple[int, ...]) -> Scenario:
    """``sc`` as one step that freezes these blocks' Linears sees it (`TrainStep.frozen`)."""
    return replace(sc, blocks=tuple(replace(b, lin=ParamKind.FROZEN) if i in blocks else b
                                    for i, b in enumerate(sc.blocks)))


Z3_LEAF_KEPT_GATHERED = KnownIssue(
    id="z3-leaf-kept-gathered",
    title="ZeRO-3: with a complete trace, a z3 leaf module's forward release keeps all its parameters gathered",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"blocks": [{"leaf": True, "norm": "frozen", "lin": "frozen"}, {}],
                                 "input_requires_grad": False, "stage": 3,
                                 "steps": [{"micro": [{"backward": "engine"}]}, {"micro": [{"backward": "engine"}]}]}),
    checks=("released-after-backward",),
    # the leaf's Linear trainable but frozen for the step (`TrainStep.frozen`): its backward runs in no micro-step
    # of that step, and the second micro-step's forward has the complete trace
    variants=(Scenario.from_dict({"blocks": [{"leaf": True, "norm": "frozen"}, {}], "input_requires_grad": False,
                                  "stage": 3, "steps": [{"micro": [{"backward": "engine"}, {"backward": "engine"}],
                                                         "frozen": [0]}]}),),
    upstream_patch="docs/upstream/z3-leaf-kept-gathered/",
    # before 0.19.3 the first leak of its scenario is z3-released-late-input-without-grad's (blocks.1.norm, whose
    # input is the frozen leaf's output, at step 0): the leaf's own leak comes after it
    scenario_shows_from=(0, 19, 3),
    runtime_prevents=True,  # runtime/leaf_reuse_walk.py
    explains=lambda f: rules.kept_by_leaf(f) and narrow(f, _leaf_without_backward),
    detail=("partitioned_param_coordinator.py __params_to_release (every release from 0.18.4 to 0.19.8) scans "
            "the modules after the current step for reuse with "
            "``iter_params(module, recurse=z3_leaf_module(submodule_to_release))``: the leaf-ness of the module "
            "being *released* decides whether *other* modules are walked recursively.  For a leaf module every "
            "later module is walked recursively -- including the root, which the trace records at the start "
            "of backward -- so all of the leaf's parameters look reused and none is released after its "
            "forward once the trace is COMPLETE (second step on).  A leaf whose backward runs is released at "
            "its post-backward (memory held across the whole forward, defeating ZeRO-3 for MoE-style leaves); "
            "one whose backward never runs (frozen, or reentrant-checkpointed, and its input does not require grad) "
            "stays gathered after "
            "the backward and the epilogue.  Fix: ``recurse=z3_leaf_module(module)``."),
)

def _input_without_grad_z3(sc: Scenario) -> bool:
    """ZeRO-3 and a block fed an input without grad: the blocks family's model says which; in the llama family
    LoRA freezes the embedding, so the first decoder layer's input does not require grad."""
    if sc.stage == 3 and sc.family.value == "llama":
        return sc.lora
    net = Network(sc)
    return sc.stage == 3 and any(not net.block_input_requires_grad(i) for i in range(len(sc.blocks)))


Z3_NO_POST_BACKWARD_NO_DRAIN = KnownIssue(
    id="z3-released-late-input-without-grad",
    title="ZeRO-3 before 0.19.3: a module whose input does not require grad keeps its parameters gathered "
          "after the backward (its post-backward hook never fires and nothing drains it)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 3)),
    fixed_in="0.19.3",
    runtime_prevents=True,  # runtime/release_policy.py drains the backward's leftovers on releases without it
    scenario=Scenario.from_dict({"stage": 3, "input_requires_grad": False,
                                 "steps": [{"micro": [{"backward": "engine"}]}]}),
    checks=("released-after-backward",),
    # and, with an eval forward before the step, the trace made INVALID by the parameters left gathered
    # (trace-consistent:uncalled-for-invalid; llama + LoRA)
    explains=lambda f: rules.released_late(f) and narrow(f, _input_without_grad_z3),
    detail=("The first block's LayerNorm gets an input that does not require grad, so torch never calls the "
            "module's backward hook on its inputs: DeepSpeed's post-backward hook (release of its parameters, "
            "parameter_offload.py) never fires.  The pre-backward fetched them (its output requires grad), so "
            "they stay gathered after the backward and its epilogue until engine.step()'s "
            "release_and_reset_all (``released-after-backward``: still gathered, or 'still have holders').  "
            "0.19.3 (PR #8148) added release_backward_leftovers to the epilogue, which drains the modules "
            "whose pre-backward ran and post-backward did not.  zerostate's design ds-0.19.2 predicts it; "
            "found by ``zerostate explore --deepspeed 0.19.2`` (ws 1 and 2) and ``zerostate diff --base 0.19.2 "
            "--head 0.19.3`` (fixed)."),
)


def _reregistered_z3(sc: Scenario) -> bool:
    return sc.stage == 3 and any(st.reregister for st in sc.steps)


Z3_REREGISTER_WHILE_RECORDING = KnownIssue(
    id="z3-reregister-while-recording",
    title="ZeRO-3 before 0.19.2: hooks re-registered between train steps (TRL's generation) while the trace "
          "is still recording crash the next forward (IndexError: pop from an empty deque)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 2)),
    fixed_in="0.19.2",
    scenario=Scenario.from_dict({"stage": 3, "steps": [{"micro": [{"backward": "engine"}]},
                                                       {"micro": [{"backward": "engine"}], "reregister": True}]}),
    checks=("exception", "trace-consistent"),
    # model-agreement: the model design for these releases (ds-0.19.2) re-registers as #8043 does, so after a
    # re-registration the real coordinator keeps holders the design releases
    explains=lambda f: rules.recording_when_reregistered(f) and narrow(f, _reregistered_z3),
    # Its scenario shows neither check on the releases it was run on (0.18.4, 0.18.5, 0.19.1: a
    # ``trace-consistent:uncalled-for-complete`` the rule does not accept, and a model-agreement), so no fingerprint
    # is recorded and the label is never given: such a finding reads unexplained until a repro shows the crash
    scenario_shows_from=(0, 19, 2),
    detail=("Re-registering ZeRO-3's module hooks (TRL's unwrap_model_for_generation removes and re-adds them) "
            "gives the modules new ds_ids while the coordinator's trace is still RECORD; the trace is not made "
            "INVALID (``trace-consistent``), so the next forward's reset_step -> record_parameters pops an "
            "empty deque: IndexError.  Fixed in 0.19.2 (DeepSpeed PR #8043).  Reached by the default "
            "exploration (``reregister``); found by docs/bug-coverage.md's survey."),
)


def _persistent_race_ws2(f: Finding) -> bool:
    """The differing parameters are persistent ones, at world size > 1; with the all-reduce fetch on,
    z3-all-reduce-fetch-padding explains a rank disagreement instead."""
    return rules.differing_persistent(f) and narrow(
        f, lambda sc: sc.stage == 3 and sc.persistence_threshold > 0 and not sc.all_reduce_fetch)


Z3_PERSISTENT_PARAM_RACE_WS2 = KnownIssue(
    id="z3-persistent-param-race-ws2",
    title="ZeRO-3 on 0.19.2 at world size 2: one rank sometimes ends a step with a wrong (at times garbage) "
          "persistent parameter",
    owner="deepspeed",
    releases=((0, 19, 2), (0, 19, 3)),  # no fixing release known: ends after the one that shows it
    scenario=Scenario.from_dict({"blocks": [{"norm": "trainable", "lin": "unused"}], "stage": 3,
                                 "fused_head": True, "input_requires_grad": False, "persistence_threshold": 8,
                                 "steps": [{"micro": [{"backward": "engine"}], "eval_before": True}]}),
    checks=("oracle", "ranks-params"),
    explains=_persistent_race_ws2,
    world_size=2,
    detail=("Intermittent (in a few of the engines built one after another in one rank pool; confirmation "
            "reports it ``intermittent`` with its rate): after a ZeRO-3 train step one rank's persistent LayerNorm "
            "parameter differs from PyTorch (at times by garbage) while the other rank's agrees, so the gathered "
            "parameters differ between the ranks.  Needs world size 2 and a persistence threshold that makes "
            "the LayerNorm persistent; never at world size 1 nor on 0.19.8.  The mechanism is "
            "not traced to a DeepSpeed line; docs/world-size-2.md has the rates.  Its scenario shows it "
            "only in some runs, so a world-size-1 run of it (test_known_issue) finds nothing."),
)


def _kept_then_branch(sc: Scenario) -> bool:
    """With a COMPLETE trace parameters are kept for a recorded later use (reuse distance or a prefetch's
    mark) that a branch then skips: an eval forward keeps them for the backward and the train forward
    takes another branch; or, after the first pass, a branch empties a non-reentrant block (its norm
    skipped, its Linear unused), whose recorded recompute then never runs."""
    if sc.stage != 3 or not (sc.max_reuse_distance > 0 or sc.prefetch_bucket_size > 0):
        return False
    if any(st.eval_before and any(m.skip for m in st.micro) for st in sc.steps):
        return True
    later = [m for k, (_, _, m) in enumerate(sc.micro_steps()) if k > 0]
    return any(sc.blocks[i].checkpoint.value == "non_reentrant" and sc.blocks[i].lin.value == "unused"
               for m in later for i in m.skip)


Z3_KEPT_FOR_REUSE_THEN_BRANCH = KnownIssue(
    id="z3-kept-for-reuse-then-branch",
    title="ZeRO-3: parameters kept gathered for a recorded later use stay gathered when a branch skips that use",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"blocks": [{"norm": "frozen"}], "stage": 3,
                                 "steps": [{"micro": [{"backward": "engine"}]},
                                           {"micro": [{"backward": "engine", "skip": [0]}], "eval_before": True}]}),
    checks=("released-after-backward",),
    explains=lambda f: rules.kept_for_a_use_skipped(f) and narrow(f, _kept_then_branch),
    detail=("partitioned_param_coordinator.py (0.19.2 and 0.19.8 source): with a COMPLETE "
            "trace, __params_to_release keeps a parameter whose module is recorded again within "
            "stage3_max_reuse_distance (default 1e9: anywhere later in the iteration) or whose next use a "
            "prefetch already walked past.  An eval forward fetches the frozen norm and keeps it for the "
            "backward use the trace recorded; the train forward then takes a branch that skips the norm, "
            "which invalidates the trace (_invalidate_trace releases only in-flight parameters) -- the "
            "kept norm is never used again and nothing releases it until engine.step()'s "
            "release_and_reset_all: gathered past the backward and its epilogue (0.19.3's "
            "release_backward_leftovers only drains modules whose pre-backward ran).  zerostate's model "
            "predicts it at DeepSpeed's default reuse distance.  A second route (found by the "
            "release refinement test): a branch that leaves a non-reentrant block computing nothing (its "
            "norm skipped, its Linear unused) skips the block's recompute the trace recorded, so its "
            "post-backward keeps every parameter for that recompute."),
)


HOOK_ISSUES: tuple[KnownIssue, ...] = (Z3_KEPT_FOR_REUSE_THEN_BRANCH, Z3_LEAF_INPUT_NO_GRAD, ZERO12_NO_GRADIENT,
                                      Z3_LEAF_KEPT_GATHERED)
"""Checked before the training-setup issues (`known.setups`)."""
LATE_HOOK_ISSUES: tuple[KnownIssue, ...] = (Z3_NO_POST_BACKWARD_NO_DRAIN, Z3_PERSISTENT_PARAM_RACE_WS2,
                                           Z3_REREGISTER_WHILE_RECORDING)
"""Checked after them."""

__all__ = ["HOOK_ISSUES", "LATE_HOOK_ISSUES", "Z3_KEPT_FOR_REUSE_THEN_BRANCH", "Z3_LEAF_INPUT_NO_GRAD",
           "Z3_LEAF_KEPT_GATHERED", "Z3_NO_POST_BACKWARD_NO_DRAIN", "Z3_PERSISTENT_PARAM_RACE_WS2",
           "Z3_REREGISTER_WHILE_RECORDING", "ZERO12_NO_GRADIENT"]
