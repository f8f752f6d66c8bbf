"""DeepSpeed bugs of releases before the pinned one, fixed since, that the engine and loop options reach.

docs/bug-coverage.md surveyed DeepSpeed's fixes from 0.17 to 0.19.8 and found these outside the scenario space
of the time; `strategies.EXTRAS` and `strategies.LORA` now draw what each one needs.  Each is a
`known.issue.KnownIssue` (``FIXED_ISSUES``, in the table `known.issues`)
with the release range where its scenario fails and
the release that fixed it, so ``zerostate explore --deepspeed <buggy release>`` labels the finding, and
``test_known_issue --deepspeed <release>`` checks the range: a strict expected failure on a buggy release,
nothing on a fixed one (the pinned 0.19.8 included).  The upper bound is the fixing release of the PR; on
which releases each range was established, and the figures: docs/known-issues-provenance.md.
"""

from __future__ import annotations

from zerostate.model.scenario import Family, Scenario

from zerostate.findings.finding import Finding

from zerostate.known import rules
from zerostate.known.issue import KnownIssue
from zerostate.known.mechanism import narrow


ZERO12_OFFLOAD_GAS3 = KnownIssue(
    id="zero12-offload-drops-middle-micro-steps",
    title="ZeRO-1/2 with optimizer offload before 0.19.0: at gas >= 3 the micro-steps between the first and "
          "the last are dropped from the update and the norm",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 0)),
    fixed_in="0.19.0",
    scenario=Scenario.from_dict({"stage": 2, "offload": "optimizer", "steps": [{"micro": [{}, {}, {}]}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("middle-micro-steps-dropped",),
    detail=("stage_1_and_2.py's CPU-offload accumulation (async_accumulate_grad_in_cpu_via_gpu) copied a "
            "gradient into the CPU accumulator only at micro-step 0 and added it only at the boundary, so "
            "micro-steps 1 .. gas-2 never reach the update or the gradient norm.  Introduced by #6550, fixed in "
            "0.19.0 by DeepSpeed PR #7967.  gas 2 is one micro-step short of it (zerostate drew gas <= 2 "
            "until the `gas3` option)."),
)

ZERO12_OFFLOAD_MANUAL_BOUNDARY = KnownIssue(
    id="zero12-offload-manual-boundary-drops-backwards",
    title="ZeRO-1/2 with optimizer offload before 0.19.0: with engine gas 1 and a manual accumulation "
          "boundary (set_gradient_accumulation_boundary), every backward but the last is dropped",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 0)),
    fixed_in="0.19.0",
    scenario=Scenario.from_dict({"stage": 2, "offload": "optimizer", "manual_boundary": True,
                                 "steps": [{"micro": [{}, {}]}, {"micro": [{}, {}]}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("last-micro-step-only",),
    detail=("With gradient_accumulation_steps 1 the CPU-offload path of stage_1_and_2.py accumulated across "
            "backwards only when gas > 1, so the backwards made under set_gradient_accumulation_boundary(False) "
            "(the API of #7665) were overwritten by the last one.  Fixed in 0.19.0 by DeepSpeed PR #7981."),
)

PEFT_MODULES_TO_SAVE = KnownIssue(
    id="z3-peft-modules-to-save",
    title="ZeRO-3 before 0.19.3: a PEFT model with modules_to_save crashes the first forward "
          "(AttributeError: 'Linear' object has no attribute 'ds_grads_remaining')",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 3)),
    fixed_in="0.19.3",
    scenario=Scenario.from_dict({"family": "llama", "lora": True, "modules_to_save": True, "stage": 3,
                                 "steps": [{}, {}]}),
    checks=("exception",),
    explains=lambda f: rules.raised_at("AttributeError", "zero/parameter_offload.py", None, "ds_grads_remaining")(f)
    and narrow(f, lambda sc: sc.modules_to_save and sc.stage == 3),
    detail=("PEFT's ModulesToSaveWrapper forwards attribute lookups to the module it wraps, so ZeRO-3's hook "
            "registration found hook state on the wrapper that belongs to the wrapped Linear, and the hook "
            "function ZeRO-3 wraps the module's forward in (a torch.autograd.Function: its forward, or its "
            "setup_context from 0.19) looked up ds_grads_remaining on a module that never got it.  Issue #7615, "
            "fixed in 0.19.3 by DeepSpeed PR #8144.  Reached by the llama family's LoRA draw "
            "(`strategies.LORA`: modules_to_save=['lm_head'])."),
)

LATE_MODULE = KnownIssue(
    id="z3-module-attached-after-initialize",
    title="ZeRO-3 before 0.19.1: a module attached after deepspeed.initialize crashes the forward "
          "(AttributeError: 'dict' object has no attribute '_in_forward')",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 1)),
    fixed_in="0.19.1",
    scenario=Scenario.from_dict({"stage": 3, "late_module": True, "steps": [{}, {}]}),
    checks=("exception",),
    explains=lambda f: rules.raised_at("AttributeError", "runtime/engine.py", "_forward_prologue", "_in_forward")(f)
    and narrow(f, lambda sc: sc.late_module and sc.stage == 3 and sc.family is Family.BLOCKS),
    detail=("ZeRO-3's forward hooks treat a module's _parameters as DeepSpeed's ZeROOrderedDict; a module "
            "attached after initialize keeps torch's plain dict (torch >= 2.5), so the engine's forward "
            "prologue, marking every module's parameters _in_forward, raises.  Fixed in 0.19.1 by DeepSpeed PR #8009 "
            "(a late module *with* "
            "parameters is still not partitioned, as the PR says; zerostate's late module has none)."),
)

ZERO12_UNREDUCED_WITHOUT_CONTIGUOUS = KnownIssue(
    id="zero12-cpu-no-reduce-without-contiguous-gradients",
    title="ZeRO-1/2 with contiguous_gradients off before 0.19.8: on CPU no gradient is averaged across ranks",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 8)),
    fixed_in="0.19.8",
    scenario=Scenario.from_dict({"stage": 2, "contiguous_gradients": False, "steps": [{}], "world_size": 2}),
    checks=("oracle",),
    explains=None,
    mechanisms=("own-rows-only",),
    detail=("Without contiguous gradients stage_1_and_2.py reduces through buffered_reduce_fallback, whose "
            "split_half_float_double groups tensors by legacy type strings (torch.cuda.FloatTensor, ...); a CPU "
            "tensor's type string matches none of them, so every bucket is dropped and each rank steps on its "
            "own gradient.  0.19.8 matches CPU tensors too.  Shows at world size 2 (the oracle trains on the "
            "global batch); also ZeRO-1."),
)

ZERO0_BF16_UPDATE_LOST = KnownIssue(
    id="zero0-bf16-update-lost",
    title="ZeRO stage 0 with bf16 before 0.18.6: the optimizer divides by a loss scale that was never applied, "
          "so the update is lost",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 18, 6)),
    fixed_in="0.18.6",
    scenario=Scenario.from_dict({"stage": 0, "precision": "bf16", "steps": [{}, {}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("update-unscaled-by-65536",),
    detail=("With bf16 and no ZeRO the engine wrapped the client optimizer in FP16_UnfusedOptimizer, which "
            "unscales the gradients by its dynamic loss scale (65536) although bf16 never scales the loss, and "
            "skipped zero_grad: the update is about 1/65536 of PyTorch's, below bf16's resolution of the "
            "parameters (the module's bf16 parameters do not move at all here).  Issue #7837, fixed in 0.18.6 "
            "by DeepSpeed PR #7839.  The oracle's per-element bf16 tolerance hides a lost update of this size "
            "on these small networks; `oracle_judgement.update_norm_text` (the update's norm) shows it."),
)

ZERO12_NESTED_OUTPUTS_ENGINE_BACKWARD = KnownIssue(
    id="zero12-nested-outputs-engine-backward",
    title="ZeRO-1/2 up to 0.19.5 (fixed in 0.19.6 or 0.19.7): with gas > 1, engine.backward of a loss on two outputs "
          "where one is computed from the other divides that gradient by gas twice",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 6)),  # fixed in 0.19.6 or 0.19.7: the range ends after the last one that shows it
    fixed_in=None,
    scenario=Scenario.from_dict({"stage": 1, "outputs": "tuple", "losses": 2,
                                 "steps": [{"micro": [{}, {}]}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("output-hooks-divide-by-gas-engine-backward",),
    detail=("The engine-backward form of zero12-nested-outputs-scaled-twice (known/setups.py, still present on "
            "0.19.8 for a PyTorch-style backward).  Likely mechanism (the same as that issue's; not traced in these "
            "releases' source): the engine's output backward hooks divide by gradient_accumulation_steps, and "
            "a hidden state's auxiliary output (hidden, hidden.mean(-1)) "
            "passes two of them, so the auxiliary loss's share of the gradient is divided by gas twice (also "
            "the HF Llama family, whose loss is computed from its logits).  Found by the default "
            "exploration on 0.18.4 once oracle findings were keyed by known issue.  Fixed in 0.19.6 or 0.19.7: the "
            "range ends after 0.19.5 and no fixing release is named.  ZeRO stage 0 shows it too (the default "
            "0.19.3 exploration: gas 3, tuple outputs, two losses)."),
)

def _allgather_raised(f: Finding, says: str) -> bool:
    return rules.raised_at("RuntimeError", "comm/torch.py", "all_gather_into_tensor", says)(f)


Z3_ZERO_INIT_MIXED_DTYPES = KnownIssue(
    id="z3-zero-init-mixed-dtype-allgather",
    title="ZeRO-3 on 0.19.2: a model built under zero.Init in bf16 with fp32 PEFT LoRA adapters fails the first "
          "step's all-gather of persistent parameters (output tensor of the first parameter's dtype)",
    owner="deepspeed",
    releases=((0, 19, 2), (0, 19, 3)),
    fixed_in="0.19.3",
    scenario=Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "precision": "bf16", "zero_init": True,
                                 "persistence_threshold": 100000, "world_size": 2}),
    checks=("exception",),
    explains=lambda f: (_allgather_raised(f, "invalid tensor type") or _allgather_raised(f, "must have the same type"))
    and narrow(f, lambda sc: sc.zero_init and sc.stage == 3),
    detail=("partition_parameters._allgather_params_coalesced allocated every output buffer with the dtype of the "
            "first parameter in the list.  Before 0.19.2 the engine cast the whole module to bf16, so the "
            "persistent parameters shared one dtype; 0.19.2's per-policy cast (#8066) kept the fp32 LoRA adapters "
            "PEFT makes outside zero.Init (autocast_adapter_dtype), and the post-step all-gather of persistent "
            "parameters (DeepSpeed's default persistence threshold holds them all here) fails on gloo with "
            "'invalid tensor type' (NCCL: 'output tensor must have the same type as input tensor').  Issue #8072 "
            "(TRL SFT with PEFT, ZeRO-3 and bf16), fixed in 0.19.3 by DeepSpeed PR #8073.  Needs two ranks "
            "(world size 1 trains) and `zero_init` (without it the adapters are cast)."),
)

Z3_ALL_REDUCE_FETCH_PADDING = KnownIssue(
    id="z3-all-reduce-fetch-padding",
    title="ZeRO-3 with stage3_use_all_reduce_for_fetch_params before 0.19.4: at world size 2 the ranks sometimes "
          "gather different parameters (uninitialised partition padding summed into a parameter)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 4)),
    fixed_in="0.19.4",
    world_size=2,
    scenario=Scenario.from_dict({"stage": 3, "all_reduce_fetch": True, "fused_head": True, "input_requires_grad": False,
                                 "persistence_threshold": 100000, "param_groups": 3, "tie": True, "external": True,
                                 "outputs": "dict", "blocks": [{"in_optimizer": False}],
                                 "steps": [{"frozen": [0]}, {}]}),
    checks=("ranks-params", "oracle"),
    explains=lambda f: rules.ranks_gathered_apart(f) and narrow(f, lambda sc: sc.all_reduce_fetch and sc.stage == 3),
    detail=("DeepSpeed #8158 (fixed in 0.19.4): the all-reduce fetch sizes its buffer by the aligned numel but walks "
            "it by the unaligned one, so a partition's padding -- uninitialised memory -- is summed into the next "
            "parameter.  Found by the default world-size-1 exploration of 0.19.3, once world size 2 was "
            "drawn by default: the scenario above (its shrunk form) ends step 0 with blocks.0.lin.weight different "
            "on the two ranks in some runs (and the oracle off), never without the knob.  Intermittent because "
            "the padding is whatever the memory held: confirmation reports it ``intermittent``, and its "
            "world-size-1 test_known_issue run finds nothing."),
)

ZERO12_TRAILING_EMPTY_PARAM = KnownIssue(
    id="zero12-trailing-empty-param",
    title="ZeRO-1/2 before 0.19.6: a trainable parameter with no elements, last in its group, crashes the "
          "gradient reduction (KeyError in average_tensor; DeepSpeed #8279)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 6)),
    fixed_in="0.19.6",
    scenario=Scenario.from_dict({"stage": 2, "empty_param": True, "steps": [{}]}),
    checks=("exception",),
    explains=lambda f: rules.raised_at("KeyError", "zero/stage_1_and_2.py", "average_tensor")(f)
    and narrow(f, lambda sc: sc.empty_param and sc.stage in (1, 2)),
    detail=("stage_1_and_2.py buckets every gradient it reduces, the zero-element one of a parameter made with "
            "torch.empty(0) too; the bucket's partition bookkeeping has no entry for a parameter with no "
            "elements at the end of a group, and average_tensor's lookup raises KeyError (ZeRO-1 and ZeRO-2, "
            "world size 1 and 2).  DeepSpeed #8280 (0.19.6) returns early "
            "for a zero-sized parameter in reduce_independent_p_g_buckets_and_remove_grads.  Reached by the "
            "default exploration through "
            "``empty_param`` (`strategies.extras`: the zero_init draw below ZeRO-3)."),
)

def _stuck_in_initialize(f: Finding) -> bool:
    """A hang whose stuck rank waits inside ZeRO-1/2's optimizer construction (its stack, in the hang's text)
    while another rank finished: the rank that failed initialize left it alone in a collective."""
    return f.check == "hang" and "finished: rank" in f.error and any(
        "stage_1_and_2.py" in line and line.rstrip().endswith("in __init__") for line in f.error.splitlines())


ZERO12_EMPTY_PARAM_INSIDE_PARTITION = KnownIssue(
    id="zero12-empty-param-inside-partition",
    title="ZeRO-1/2 before 0.19.7: a parameter with no elements inside a partition (before its padding) fails "
          "initialize ('fragment start N should be < fragment_end N'; DeepSpeed issue #8297's shape)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 19, 7)),  # 0.19.6 not cached: counted in, the range ends where it trains
    fixed_in="0.19.7",
    scenario=Scenario.from_dict({"stage": 1, "fused_head": True, "empty_param": True, "steps": [{}]}),
    checks=("exception",),
    explains=lambda f: (rules.raised_at("AssertionError", "utils/tensor_fragment.py", "get_hp_fragment_mapping",
                                        "fragment start", "fragment_end")(f) or _stuck_in_initialize(f))
    and narrow(f, lambda sc: sc.empty_param and sc.stage in (1, 2)),
    detail=("Met by the default exploration of 0.19.5: with a fused head the zero-element parameter ends "
            "the flat group at offset 88, before the group's alignment padding, so _link_all_hp_params "
            "(_init_lp_to_hp_mapping) takes it for a parameter overlapping the partition and "
            "get_hp_fragment_mapping asserts on its empty fragment.  At world size 2 rank 0 fails in "
            "initialize while rank 1 waits in a collective: a hang.  Issue #8297 reports the same assertion for "
            "a zero-sized parameter strictly inside a partition (world size 2) and says it reproduced on a master "
            "that had #8280; this shape trains from 0.19.7 (world size 1 and 2)."),
)

FIXED_ISSUES: tuple[KnownIssue, ...] = (ZERO12_OFFLOAD_GAS3, ZERO12_OFFLOAD_MANUAL_BOUNDARY, PEFT_MODULES_TO_SAVE,
                                        LATE_MODULE, ZERO12_UNREDUCED_WITHOUT_CONTIGUOUS,
                                        ZERO0_BF16_UPDATE_LOST, ZERO12_NESTED_OUTPUTS_ENGINE_BACKWARD,
                                        Z3_ZERO_INIT_MIXED_DTYPES, Z3_ALL_REDUCE_FETCH_PADDING,
                                        ZERO12_TRAILING_EMPTY_PARAM, ZERO12_EMPTY_PARAM_INSIDE_PARTITION)

__all__ = ["FIXED_ISSUES"]
