"""Findings on the pinned DeepSpeed (0.19.8) in the training-setup dimensions (precision, offload, optimizer,
parameter groups, engines in one process, checkpoints, ...).

Found by ``zerostate explore`` once the default strategy drew these dimensions; each becomes a
`known.KnownIssue` (``known.SETUP_ISSUES``; look them up by id there)
with its exact (shrunk) scenario, kept as a strict expected failure by
``generated_tests/test_deepspeed_setups.py`` and ``test_deepspeed_target.py::test_known_issue``.
docs/deepspeed-target.md has the details; docs/known-issues-provenance.md on which releases each range was
established, and the figures.
"""

from __future__ import annotations

from zerostate.model.scenario import Block, Family, Offload, Outputs, ParamKind, Precision, Scenario

from zerostate.findings.finding import Finding
from zerostate.known import rules
from zerostate.known.issue import KnownIssue, Nature
from zerostate.known.mechanism import narrow, params_named


def _retains(sc: Scenario) -> bool:
    return any(m.retain for _, _, m in sc.micro_steps())


def nested_outputs_zero12(sc: Scenario) -> bool:
    """ZeRO-1/2 with gas > 1 and a loss on an output computed from another output (HF's loss from its logits,
    or ``(hidden, hidden.mean(-1))`` with a loss on both): the shape of the nested-outputs issues."""
    nested = sc.family is Family.LLAMA or (sc.outputs is not Outputs.TENSOR and sc.losses == 2 and not sc.fused_head)
    return sc.stage in (1, 2) and sc.gas > 1 and nested


def _block_of(param: str, sc: Scenario) -> Block | None:
    """The scenario's block ``param`` belongs to (``blocks.N.*``), or None."""
    parts = param.split(".")
    if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdigit() or int(parts[1]) >= len(sc.blocks):
        return None
    return sc.blocks[int(parts[1])]


def _left_out_of_optimizer(param: str, sc: Scenario) -> bool:
    """``param`` is in a block the client optimizer was not given."""
    block = _block_of(param, sc)
    return block is not None and not block.in_optimizer


def _shared_across_reentrant(sc: Scenario) -> bool:
    from zerostate.model.scenario import Checkpoint, ParamKind
    return (sc.tie or sc.external) and sc.blocks[0].checkpoint is Checkpoint.REENTRANT and \
        sc.blocks[0].lin is ParamKind.TRAINABLE


SHARED_ACROSS_REENTRANT = KnownIssue(
    id="param-shared-across-reentrant-checkpoint",
    title="A parameter used inside a reentrant-checkpointed block and again outside it (tied weights): "
          "its gradient hook fires twice in one backward; ZeRO-2/3 assert",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"blocks": [{"checkpoint": "reentrant"}], "stage": 2, "tie": True,
                                 "steps": [{"micro": [{"backward": "engine"}]}]}),
    checks=("exception", "grad-handled-once"),
    explains=lambda f: rules.shared_param_hooked_twice(f) and narrow(f, _shared_across_reentrant),
    # ZeRO-3 with a reduce bucket the first gradient fills: the second hook finds it partitioned away
    # (AttributeError in __add_grad_to_ipg_bucket)
    variants=(Scenario.from_dict({"stage": 3, "tie": True, "reduce_bucket_size": 128,
                                  "blocks": [{"checkpoint": "reentrant"}], "steps": [{}]}),
              # the weight used by the root (external): the bucket holds it twice, asserted in the nested backward
              Scenario.from_dict({"stage": 3, "external": True, "reduce_bucket_size": 128,
                                  "blocks": [{"checkpoint": "reentrant"}], "steps": [{}]})),
    nature=Nature.LIMITATION,
    cites=("DeepSpeed's own assertion in runtime/zero/stage_1_and_2.py (reduce_independent_p_g_buckets_and_"
           "remove_grads, reduce_ipg_grads): 'Gradient computed twice for this partition.  Multiple gradient "
           "reduction(s) are currently not supported'"),
    detail=("Block 0 runs under torch.utils.checkpoint(use_reentrant=True) and its Linear is applied again after "
            "the blocks (a tied embedding / LM head with HF gradient checkpointing's reentrant mode) or its weight "
            "is used by the root.  The reentrant checkpoint's nested backward accumulates the weight's gradient "
            "and fires its AccumulateGrad hook; the outer backward accumulates the other use and fires it again. "
            "ZeRO-2: AssertionError 'The parameter blocks.0.lin.weight has already been reduced' "
            "(stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads); ZeRO-3: AssertionError in "
            "stage3.py __reduce_and_partition_ipg_grads (the parameter is in the bucket twice), or, when the first "
            "gradient filled the reduce bucket and was partitioned away, AttributeError 'NoneType' object has no "
            "attribute 'numel' in __add_grad_to_ipg_bucket (the second hook); ZeRO-1 handles "
            "it twice but the values agree with PyTorch.  Non-reentrant checkpointing has one AccumulateGrad call "
            "and is clean."),
)


# Retired: ``tracer-on-demand-fetch-as-prefetch`` -- the tracer named a parameter gathered on demand
# (a ZeRO-3 external parameter, a Linear inside a z3 leaf block applied again) a prefetch because another
# module owned it; it now names a status change by the status (gathered: FETCH, in flight: PREFETCH).


def _z3_retained_skipping(first: dict[str, object], backwards: tuple[str, ...], bucket: int | None = None,
                          eval_before: bool = False) -> Scenario:
    """ZeRO-3, three blocks, every micro-step two backwards of one forward (``backwards``: the first one's kind)
    skipping blocks 1 and 2: the first block ``first``, the others frozen (a reentrant first) or with a frozen norm
    and the last a z3 leaf (a plain first)."""
    rest = ([{"norm": "frozen", "lin": "frozen"}] * 2 if first
            else [{"norm": "frozen"}, {"norm": "frozen", "leaf": True}])
    step: dict[str, object] = {"micro": [{"backward": b, "skip": [1, 2], "retain": True} for b in backwards]}
    if eval_before:
        step["eval_before"] = True
    return Scenario.from_dict({"stage": 3, "max_reuse_distance": 128, "blocks": [first, *rest], "steps": [step],
                               **({"reduce_bucket_size": bucket} if bucket else {})})


TWO_BACKWARDS_PER_FORWARD = KnownIssue(
    id="two-backwards-per-forward",
    title="Two backwards of one forward (retain_graph=True): ZeRO-1/2 keep only the last one's gradients, "
          "ZeRO-3 raises",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 1, "steps": [{"micro": [{"backward": "engine", "retain": True}]}]}),
    checks=("oracle",),
    explains=lambda f: rules.two_backwards(f) and narrow(f, _retains),
    mechanisms=("last-backward-only", "last-backward-only-in-forward-too", "micro0-earlier-backward-lost",
                "boundary-first-backward-lost", "earlier-backwards-added-again",
                "in-forward-lost-after-unexited-backward", "unexited-backward-lost-before-boundary",
                "offload-cpu-buffer-added-again", "boundary-backwards-only-after-unexited-backward",
                "step-lost-after-unexited-backward", "bucket-tail-lost-after-unexited-backward",
                "bucket-flushed-overwritten-after-unexited-backward",
                "earlier-user-backwards-lost-after-unexited-backward", "in-forward-lost-in-step-of-unexited-backward",
                "last-backward-only-until-unexited-backward", "pytorch-style-backwards-lost-after-unexited-backward",
                "unexited-backward-lost-at-boundary"),
    # its spec forms: a PyTorch-style backward retained at the boundary (ZeRO-2), retained first (ZeRO-1), after a
    # fused head's backward inside the forward; ZeRO-3 raises on a frozen Linear
    variants=(Scenario.from_dict({"stage": 2, "steps": [
                  {"micro": [{"backward": "torch"}, {"backward": "torch", "retain": True}]}]}),
              Scenario.from_dict({"stage": 1, "blocks": [{"norm": "frozen"}], "steps": [
                  {"micro": [{"backward": "torch", "retain": True}, {"backward": "engine"}]}]}),
              Scenario.from_dict({"stage": 1, "fused_head": True, "blocks": [{"norm": "frozen"}], "steps": [
                  {"micro": [{"backward": "torch", "retain": True}, {"backward": "engine"}]}]}),
              Scenario.from_dict({"stage": 3, "blocks": [{"lin": "frozen"}], "persistence_threshold": 0,
                                  "steps": [{"micro": [{"backward": "engine", "retain": True}]}]}),
              # ZeRO-3 with the Linear trainable: the size-0 partition in the second backward's matmul
              Scenario.from_dict({"stage": 3, "persistence_threshold": 0,
                                  "steps": [{"micro": [{"backward": "engine", "retain": True}]}]}),
              # the retained PyTorch-style backward's never-exited depth met by the next train step's forward, or
              # by its eval forward
              Scenario.from_dict({"stage": 1, "steps": [
                  {"micro": [{"backward": "torch", "retain": True}, {"backward": "engine"}]},
                  {"micro": [{"backward": "engine"}, {"backward": "engine"}]}]}),
              Scenario.from_dict({"stage": 1, "steps": [
                  {"micro": [{"backward": "torch", "retain": True}, {"backward": "engine"}]},
                  {"eval_before": True, "micro": [{"backward": "engine"}, {"backward": "engine"}]}]}),
              # ZeRO-3 after an eval forward, two micro-steps with two backwards each: no exception, the parameters
              # left gathered when the next micro-step's backward starts
              Scenario.from_dict({"stage": 3, "persistence_threshold": 0, "steps": [
                  {"eval_before": True, "micro": [{"backward": "engine"}, {"backward": "engine", "retain": True},
                                                  {"backward": "engine", "retain": True}]}]}),
              # ZeRO-3, a non-scalar retained backward with the Linear unused: LayerNorm's 'weight of shape [0]'
              # raised from the harness's tensor.backward (report 0.19.8 #46)
              Scenario.from_dict({"stage": 3, "width": 7, "blocks": [{"lin": "unused"}],
                                  "steps": [{"micro": [{"backward": "nonscalar", "retain": True}]}]}),
              # ZeRO-3 persistent parameters, after an eval forward: the second backward's gradients left in the
              # bucket when the next forward starts (report 0.19.8 #48)
              Scenario.from_dict({"stage": 3, "width": 7, "persistence_threshold": 8, "steps": [
                  {"eval_before": True, "micro": [{"backward": "nonscalar", "retain": True},
                                                  {"backward": "engine", "retain": True}]}]}),
              # the same with the Linear unused: the LayerNorm's parameters keep stale holders (report 0.19.8 #61)
              Scenario.from_dict({"stage": 3, "width": 7, "persistence_threshold": 8, "blocks": [{"lin": "unused"}],
                                  "steps": [{"eval_before": True, "micro": [
                                      {"backward": "nonscalar", "retain": True},
                                      {"backward": "engine", "retain": True}]}]}),
              # no eval forward, input without grad: stale holders at the next user backward (report 0.19.8 #63)
              Scenario.from_dict({"stage": 3, "width": 7, "persistence_threshold": 8, "input_requires_grad": False,
                                  "blocks": [{"lin": "unused"}], "steps": [{"micro": [
                                      {"backward": "nonscalar", "retain": True},
                                      {"backward": "nonscalar", "retain": True}]}]}),
              # LayerNorm frozen, a retained PyTorch-style backward in the second step's boundary micro-step:
              # parameters left gathered at step() (report 0.19.8 #66)
              Scenario.from_dict({"stage": 3, "persistence_threshold": 0, "blocks": [{"norm": "frozen"}], "steps": [
                  {"micro": [{"backward": "engine"}, {"backward": "engine"}]},
                  {"eval_before": True, "micro": [{"backward": "engine"}, {"backward": "torch", "retain": True}]}]}),
              # llama + LoRA, a retained PyTorch-style backward after an eval forward: frozen base weights keep
              # stale holders with everything persistent (report 0.19.8 #14), adapters left in the bucket and
              # parameters left gathered without (report 0.19.8 #50, #65)
              Scenario.from_dict({"stage": 3, "persistence_threshold": 100000, "family": "llama", "lora": True,
                                  "steps": [{"eval_before": True, "micro": [{"backward": "torch", "retain": True}]}]}),
              Scenario.from_dict({"stage": 3, "persistence_threshold": 0, "family": "llama", "lora": True,
                                  "steps": [{"eval_before": True, "micro": [{"backward": "torch", "retain": True}]}]}),
              # a frozen Linear, a retained PyTorch-style backward after an eval forward: the frozen weights are
              # still gathered when the next micro-step's forward starts
              Scenario.from_dict({"stage": 3, "width": 7, "persistence_threshold": 0, "blocks": [{"lin": "frozen"}],
                                  "steps": [{"eval_before": True, "micro": [{"backward": "torch", "retain": True},
                                                                            {"backward": "engine"}]}]}),
              # ZeRO-1, a retained PyTorch-style backward at gas 1: its bucket is still held when the next step's
              # forward (or its eval forward) starts
              Scenario.from_dict({"stage": 1, "steps": [{"micro": [{"backward": "torch", "retain": True}]},
                                                        {"micro": [{"backward": "engine"}]}]}),
              Scenario.from_dict({"stage": 1, "steps": [{"micro": [{"backward": "torch", "retain": True}]},
                                                        {"eval_before": True, "micro": [{"backward": "engine"}]}]}),
              # a llama with LoRA, a retained PyTorch-style backward first: the crash in the next epilogue, the
              # adapters' gradients left in the bucket and the parameters gathered at the next forward
              # (met by test_every_finding_is_known)
              Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "width": 8, "persistence_threshold": 0,
                                  "steps": [{"eval_before": True, "micro": [{"backward": "torch", "retain": True},
                                                                           {"backward": "engine"}]}]}),
              # a llama after an eval forward, two retained micro-steps after a plain one: besides the size-0
              # crash, the coordinator's trace invalidated in the second backward's hooks (met by
              # test_every_finding_is_known; clean without the retains, and with one retained micro-step)
              Scenario.from_dict({"stage": 3, "family": "llama", "width": 8, "persistence_threshold": 0,
                                  "steps": [{"eval_before": True, "micro": [
                                      {"backward": "engine"}, {"backward": "engine", "retain": True},
                                      {"backward": "engine", "retain": True}]}]}),
              # a retained PyTorch-style backward, then the next micro-step's backward: its hook finds a gradient
              # the unexited second backward left in the bucket already taken ('NoneType' ... 'numel'; met by
              # test_every_finding_is_known; clean without the retain)
              Scenario.from_dict({"stage": 3, "width": 8, "persistence_threshold": 0, "reduce_bucket_size": 128,
                                  "steps": [{"eval_before": True, "save_load": True, "micro": [
                                      {"backward": "torch", "retain": True}, {"backward": "engine"}]}]}),
              # a z3 leaf module in the network, a retained PyTorch-style backward in the second step: its
              # parameters are among those left in the bucket and gathered (the fingerprint's leaf role), at step()
              # and at the next forward, with and without persistent ones (default 0.19.8 exploration; the same
              # findings labelled without the leaf, none without the retain)
              *(Scenario.from_dict({"stage": 3, "width": 8, "persistence_threshold": persist, "max_live_parameters": 64,
                                    "blocks": [{"norm": "frozen"}, {"leaf": True}], "steps": [
                                        {"eval_before": True, "micro": [{"backward": "engine"}] * micros},
                                        {"micro": [{"backward": "torch", "skip": [0], "retain": True}]
                                         + [{"backward": "engine"}] * (micros - 1)}]})
                for micros in (1, 2) for persist in (0, 8)),
              # ZeRO-1, gas 3, an engine then two PyTorch-style retained micro-steps: no epilogue after the
              # unexited second backward, so step() finds no gradient -- the idle step's KeyError
              # (step-without-gradient's fingerprint, another mechanism; clean without the retains), in fp32 and,
              # with the caller's boundary and fp16, in the overflow check
              Scenario.from_dict({"stage": 1, "steps": [{"micro": [
                  {"backward": "engine", "retain": True}, {"backward": "torch", "retain": True},
                  {"backward": "torch", "retain": True}]}]}),
              Scenario.from_dict({"stage": 1, "precision": "fp16", "manual_boundary": True, "steps": [
                  {"micro": [{"backward": "engine", "retain": True}, {"backward": "torch", "retain": True},
                             {"backward": "torch", "retain": True}]},
                  {"micro": [{"backward": "engine"}] * 3}]}),
              # the same at the next step, after one retained PyTorch-style backward at the boundary: step()'s norm
              # of no gradient is get_grad_norm_direct's TypeError (met by test_schedule_machine's random profile;
              # clean without the retain)
              Scenario.from_dict({"stage": 1, "blocks": [{"norm": "frozen"}], "steps": [
                  {"micro": [{"backward": "engine"}, {"backward": "torch", "retain": True}]},
                  {"micro": [{"backward": "torch"}, {"backward": "torch"}]}]}),
              # ZeRO-3, gas 3, every micro-step two backwards of one forward and skipping the frozen blocks, a z3
              # leaf or a reentrant block first: the second backward's routes in the bucket (the parameter in it
              # twice, or partitioned away by the first: asserted or None in the nested backward) and the leaf's
              # parameters left gathered, at the next backward, forward or step (met unlabelled when goals ran each
              # form of this issue; each clean without the retains)
              _z3_retained_skipping({"checkpoint": "reentrant", "leaf": True}, ("engine", "torch", "engine"), 128),
              _z3_retained_skipping({"checkpoint": "reentrant"}, ("engine", "torch", "engine"), 128),
              _z3_retained_skipping({}, ("nonscalar", "engine", "engine"), eval_before=True),
              _z3_retained_skipping({}, ("nonscalar",), eval_before=True),
              _z3_retained_skipping({"checkpoint": "reentrant", "leaf": True}, ("engine", "engine", "engine")),
              # ZeRO-1/2 with optimizer offload at gas 1, a retained engine backward in consecutive steps: each step
              # after the first also gets the earlier steps' second backwards from the CPU accumulation buffer
              # (`offload-cpu-buffer-added-again`, with last-backward-only; met unlabelled by the per-form goals)
              Scenario.from_dict({"stage": 1, "offload": "optimizer", "width": 7, "steps": [
                  {"micro": [{"backward": "engine", "retain": True}]}] * 3}),
              # ... and ZeRO-1 at gas > 1: its hooks run in the boundary micro-step alone (met unlabelled by a
              # fresh-clone exploration)
              Scenario.from_dict({"stage": 1, "offload": "optimizer", "width": 7, "steps": [
                  {"micro": [{"backward": "engine", "retain": True}] * 2}] * 2}),
              # ZeRO-1 after a PyTorch-style retained backward before the boundary (it never exits DeepSpeed's
              # backward): with a fused head the step keeps the boundary micro-step's backwards alone; with optimizer
              # offload and a loss.backward() at the boundary it gets nothing (met unlabelled on the plain-world-rate
              # sequence)
              Scenario.from_dict({"stage": 1, "fused_head": True, "steps": [
                  {"micro": [{"backward": "torch", "retain": True}, {"backward": "engine"}]}]}),
              Scenario.from_dict({"stage": 1, "offload": "optimizer", "steps": [
                  {"micro": [{"backward": "torch", "retain": True}, {"backward": "torch"}]}]}),
              # ZeRO-3 with a z3 leaf block and everything persistent, a retained PyTorch-style backward skipping a
              # block: the leaf's parameters keep stale holders at step() and at the next micro-step's forward,
              # with and without a frozen LayerNorm among them (each clean without the retains)
              *(Scenario.from_dict({"stage": 3, "persistence_threshold": 100000, "max_reuse_distance": 128,
                                    "max_live_parameters": 64, "blocks": blocks, "steps": [
                                        {"eval_before": True, "reregister": True, "save_load": True, "micro": [
                                            {"backward": b, "skip": [1], "retain": True} for b in backwards]}]})
                for blocks in ([{}, {"norm": "frozen"}, {"leaf": True}], [{}, {"norm": "frozen", "leaf": True}])
                for backwards in (("torch",), ("torch", "engine", "engine"))),
              Scenario.from_dict({"stage": 3, "width": 7, "outputs": "tuple", "persistence_threshold": 100000,
                                  "max_reuse_distance": 128, "blocks": [
                                      {"checkpoint": "non_reentrant"},
                                      {"checkpoint": "reentrant", "norm": "frozen", "leaf": True}], "steps": [
                                      {"reregister": True, "save_load": True, "micro": [
                                          {"backward": "torch", "skip": [1], "retain": True}]}]}),
              # a llama with LoRA: the adapters' gradients left in the bucket with persistent parameters (ZeRO-3)
              # and in the reduce bucket after step() (ZeRO-1)
              Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "persistence_threshold": 8, "steps": [
                  {"eval_before": True, "micro": [{"backward": "torch", "retain": True},
                                                  {"backward": "engine", "retain": True}]}]}),
              Scenario.from_dict({"stage": 1, "family": "llama", "lora": True, "steps": [
                  {"reregister": True, "micro": [{"backward": "torch", "retain": True}]}]}),
              # ZeRO-1/2 with a reduce bucket smaller than the gradients: a bucket reduced during a backward that
              # never exits keeps its flags, and the next backward's hook asserts the parameter already reduced
              # (ZeRO-2, and ZeRO-1 with overlap_comm; each clean without the retains)
              Scenario.from_dict({"stage": 2, "family": "llama", "reduce_bucket_size": 128, "steps": [
                  {"reregister": True, "micro": [{"backward": "engine", "retain": True},
                                                 {"backward": "torch", "retain": True},
                                                 {"backward": "engine", "retain": True}]}]}),
              Scenario.from_dict({"stage": 1, "family": "llama", "reduce_bucket_size": 128, "overlap_comm": True,
                                  "steps": [{"reregister": True, "micro": [
                                      {"backward": "engine", "retain": True}, {"backward": "torch", "retain": True},
                                      {"backward": "torch", "retain": True}]}]}),
              # ZeRO-3, a small reduce bucket and an unused z3 leaf block: the second backward's reduce-scatter meets
              # a size-0 gradient (clean without the retains)
              Scenario.from_dict({"stage": 3, "reduce_bucket_size": 128, "max_reuse_distance": 128,
                                  "max_live_parameters": 64, "blocks": [
                                      {}, {"norm": "frozen"}, {"norm": "unused", "lin": "unused", "leaf": True}],
                                  "steps": [{"eval_before": True, "reregister": True, "save_load": True, "micro": [
                                      {"backward": "torch", "skip": [1], "retain": True},
                                      {"backward": "torch", "skip": [1], "retain": True},
                                      {"backward": "engine", "skip": [1], "retain": True}]}]}),
              # ZeRO-3, the block frozen for the step, a retained non-scalar backward: its gradients left in the
              # bucket (a z3 leaf block) or its parameters with stale holders, at step() or at the next forward,
              # with and without persistent parameters (each clean without the retain)
              *(Scenario.from_dict({"stage": 3, "width": 7, "persistence_threshold": persist,
                                    "max_reuse_distance": 128, "blocks": [block], "steps": [
                                        {"eval_before": True, "reregister": True, "frozen": [0], "micro": [
                                            {"backward": "nonscalar", "retain": True}, *after]}]})
                for block, persist, after in (
                    ({"norm": "frozen", "leaf": True}, 100000, [{"backward": "engine", "skip": [0]}]),
                    ({"norm": "frozen", "leaf": True}, 0, [{"backward": "engine", "skip": [0]}]),
                    ({"leaf": True}, 0, []), ({"leaf": True}, 100000, []),
                    ({"norm": "frozen"}, 100000, [{"backward": "engine", "skip": [0]}]))),
              # llama + LoRA, a retained PyTorch-style backward, then a plain step: the adapters' stale bucket
              # survives step() (clean without the retain)
              Scenario.from_dict({"stage": 1, "family": "llama", "lora": True, "steps": [
                  {"micro": [{"backward": "torch", "retain": True}]}, {"micro": [{"backward": "engine"}]}]}),
              # the same flags asserted in reduce_ipg_grads under overlap_comm; bf16 llama: step()'s overflow check
              # of the gradients no epilogue moved; ZeRO-3 llama + LoRA after an eval forward: stale holders
              # (each clean without the retain)
              Scenario.from_dict({"stage": 1, "overlap_comm": True, "steps": [
                  {"micro": [{"backward": "torch", "retain": True}]}, {"micro": [{"backward": "engine"}]}]}),
              Scenario.from_dict({"stage": 1, "precision": "bf16", "family": "llama", "steps": [
                  {"micro": [{"backward": "torch", "retain": True}]}, {"micro": [{"backward": "torch"}]}]}),
              Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "persistence_threshold": 100000,
                                  "steps": [{"eval_before": True, "micro": [{"backward": "torch", "retain": True},
                                                                           {"backward": "engine", "retain": True}]}]}),
              # llama + LoRA, overlap_comm, a 128-element bucket, checkpointed blocks: the flags asserted in the
              # third backward of one forward (clean without the retains)
              Scenario.from_dict({"stage": 1, "family": "llama", "lora": True, "overlap_comm": True,
                                  "reduce_bucket_size": 128,
                                  "blocks": [{"checkpoint": "non_reentrant"}, {"checkpoint": "non_reentrant"}],
                                  "steps": [{"reregister": True, "save_load": True, "micro": [
                                      {"backward": "engine", "retain": True}, {"backward": "torch", "retain": True},
                                      {"backward": "torch", "retain": True}]}]}),
              # ZeRO-3, a checkpointed block with a frozen LayerNorm, two engine backwards: the second one's
              # recompute meets the parameter the first released; llama bf16 + overlap_comm, a 49-element bucket,
              # reentrant blocks, a second engine before: the flags asserted in a later backward's hook (each
              # clean without the retains)
              Scenario.from_dict({"stage": 3, "persistence_threshold": 8, "blocks": [
                  {"checkpoint": "non_reentrant", "norm": "frozen"}], "steps": [
                  {"micro": [{"backward": "engine", "retain": True}]}]}),
              Scenario.from_dict({"stage": 3, "blocks": [{"checkpoint": "non_reentrant", "norm": "frozen"}],
                                  "steps": [{"micro": [{"backward": "engine", "retain": True}]}]}),
              Scenario.from_dict({"stage": 1, "precision": "bf16", "family": "llama", "overlap_comm": True,
                                  "reduce_bucket_size": 49, "engines_before": [1],
                                  "blocks": [{"checkpoint": "reentrant"}, {"checkpoint": "reentrant"}],
                                  "steps": [{"reregister": True, "save_load": True, "micro": [
                                      {"backward": "engine", "retain": True}, {"backward": "torch", "retain": True},
                                      {"backward": "torch", "retain": True}]}]}),
              # llama + LoRA, a retained PyTorch-style backward, then an eval forward: the adapters' stale bucket
              # met at the eval forward's start (clean without the retain)
              Scenario.from_dict({"stage": 1, "family": "llama", "lora": True, "steps": [
                  {"micro": [{"backward": "torch", "retain": True}]},
                  {"eval_before": True, "micro": [{"backward": "engine"}]}]})),
    detail=("engine.backward(0.5 * loss, retain_graph=True) then engine.backward(0.5 * loss) (or loss.backward "
            "twice) in one micro-step.  ZeRO-1/2: the gradients are copied, not accumulated, into the partition "
            "while micro_step_id is 0 (stage_1_and_2.py: accumulate only `if self.micro_step_id > 0`; the id "
            "advances per micro-step, not per backward), so the second backward overwrites the first: the step "
            "applies half the gradient (PyTorch accumulates both).  With gradient accumulation (the oracle's "
            "counterfactual updates tell the cases apart): a second engine.backward in the boundary micro-step "
            "leaves the step the last backward's gradient alone (the earlier micro-steps' are lost too); with "
            "PyTorch-style backwards, all but the boundary micro-step's first backward; a second backward in an "
            "earlier micro-step is accumulated correctly.  ZeRO-3: the second backward runs no "
            "pre-backward fetch (the trace shows none) and computes with the size-0 partitions the first one "
            "released: RuntimeError 'The size of tensor a (0) must match the size of tensor b (8)', or with the "
            "Linear frozen LayerNorm's 'weight of shape [0]'.  stage3.py defers micro_step_id to the next "
            "forward on purpose (copy semantics within one backward, for reentrant checkpointing's phases), "
            "which makes any second backward of the same forward a copy too.  BF16_Optimizer (ZeRO-1, bf16, fp32 "
            "accumulation, no offload) counts the other way: the prologue that clears the 16-bit .grad runs once "
            "per forward (register_output_backward_hooks' preprocess_once_fn), the epilogue that adds .grad to "
            "the fp32 buffer after every backward, so each later backward adds the earlier ones again "
            "(counterfactual earlier-backwards-added-again).  Under ZeRO-3 the "
            "broken state then shows up in many ways (also "
            "'active_backward_submodules is empty', an epilogue outside a user backward, parameters left "
            "gathered, a released parameter read by the second backward, the bucket holding the second "
            "backward's gradients when the next backward adds them again): a finding is attributed to it only "
            "by what its own run shows of that (known/rules.py two_backwards).  A PyTorch-style second backward at the "
            "boundary never exits DeepSpeed's backward: with a reduce bucket smaller than its gradients, what the "
            "bucket still holds at its end is lost and what full buckets reduced during it is added (ZeRO-2 with "
            "offload) or copied over the step's gradient (ZeRO-1 with offload and overlap_comm), and the "
            "already-reduced flags those reductions set make a later backward's hook assert.  With optimizer "
            "offload the CPU accumulation buffer a second backward fills is never cleared: under fp16 one overflow "
            "left there skips every later step that has a second backward.  DeepSpeed's documented way to run "
            "several backwards before one boundary is engine.set_gradient_accumulation_boundary(False) before "
            "them and (True) before the last: with those calls ZeRO-1/2 match PyTorch exactly "
            "(docs/bug-coverage.md), so their half is silent wrongness for code that does not make "
            "them (a plain retain_graph loop) rather than a wrong result of the documented API; ZeRO-3 still "
            "raises with them."),
)

STEP_WITHOUT_GRADIENT = KnownIssue(
    id="step-without-gradient",
    title="engine.step() at a boundary with no backward since the last step crashes (every stage)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 3, "steps": [{"micro": [{"backward": "engine"}]},
                                                       {"idle": True, "micro": [{"backward": "engine"}]}]}),
    checks=("exception",),
    explains=lambda f: rules.idle_step_crash(f) and narrow(f, lambda sc: any(s.idle for s in sc.steps)),
    mechanisms=("stale-gradient-replayed-at-idle-step", "idle-step-stepped-with-zero-gradient",
                "stale-gradient-unscaled-again-at-idle-step"),
    # BF16_Optimizer's form: the gradient norm of no gradient is torch.stack of an empty list
    variants=(Scenario.from_dict({"stage": 1, "precision": "bf16", "fp32_grad_accum": True,
                                  "steps": [{"idle": True}]}),
              # an idle step after a trained one: the gradients reset to None by the step before (fp32: the norm,
              # bf16 without fp32 accumulation: the overflow check; default 0.19.8 exploration)
              *(Scenario.from_dict({"stage": 1, "precision": precision,
                                    "steps": [{"micro": [{"backward": "engine"}]},
                                              {"idle": True, "micro": [{"backward": "engine"}]}]})
                for precision in ("fp32", "bf16"))),
    detail=("A train step that skips its batches (no forward, no backward: a data-dependent skip, an empty "
            "batch) still calls engine.step().  ZeRO-3: KeyError: 0 in stage3.py _get_norm_groups "
            "(self.averaged_gradients[i] is filled only by a backward); ZeRO-1/2: TypeError: 'NoneType' object is "
            "not iterable in stage_1_and_2.py get_grad_norm_direct (averaged_gradients[i] reset to None after the "
            "previous step), or KeyError: 0 in scaled_global_norm when no backward ever ran.  With optimizer "
            "offload (ZeRO-1/2) it does not crash but is silently wrong: the previous step's gradients, still in "
            "the CPU buffer, are applied a second time (oracle mismatch).  ZeRO-3 with parameter and optimizer "
            "offload does not crash either: it steps every parameter with a zero gradient, which Adam counts (its "
            "moments decay, its step count and bias correction run one ahead: the next update is about 0.73 of "
            "PyTorch's).  PyTorch's optimizer skips parameters "
            "without gradient.  A ZeRO-1/2 step whose requires_grad change leaves no gradient at all runs a "
            "backward without hooks first: its finding shows zero12-backward-without-gradients' mechanism.  "
            "fp16 (ZeRO-1/2): the "
            "loss scaler's overflow check reads the same missing gradients first -- KeyError: 0 in "
            "stage_1_and_2.py has_overflow_partitioned_grads_serial (``self.averaged_gradients[i]``, line 3232 "
            "on 0.19.8) where fp32 fails in scaled_global_norm."),
)

NESTED_OUTPUTS_SCALED_TWICE = KnownIssue(
    id="zero12-nested-outputs-scaled-twice",
    title="ZeRO-1/2, loss.backward() with gradient accumulation: an output computed from another output "
          "(HF's loss from its logits) is divided by gradient_accumulation_steps twice",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 1, "outputs": "tuple", "losses": 2,
                                 "steps": [{"micro": [{"backward": "torch"}, {"backward": "torch"}]}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("output-hooks-divide-by-gas",),
    detail=("engine.forward registers register_output_backward_hooks on *every* tensor of the output "
            "structure (runtime/utils.py OutputBackwardHookManager._traverse_and_register_hooks), and each "
            "hook divides its gradient by gradient_accumulation_steps (engine._backward_prologue_per_tensor).  "
            "When one output is computed from another -- a Hugging Face CausalLMOutput's loss from its logits, "
            "or (hidden, aux = hidden.mean(-1)) with a loss on both -- the gradient passes two hooks and is "
            "divided by gas twice: with gas 2 the update is half what PyTorch (and engine.backward) gives.  "
            "Observed on ZeRO-1/2 only; ZeRO-3 agrees with the oracle on the same scenarios.  HF Trainer "
            "calls engine.backward, so it is not affected; PyTorch-style loops (accelerate without the "
            "DeepSpeed plugin's backward, custom loops) are."),
)

Z3_UNGROUPED_NOT_GATHERED = KnownIssue(
    id="z3-ungrouped-param-not-gathered-for-backward",
    title="ZeRO-3: a module whose parameters require grad but are in no optimizer group runs its backward "
          "with them partitioned",
    owner="deepspeed",
    # from 0.19.3: on older releases its scenario shows z3-released-late-input-without-grad instead (the
    # parameters stay gathered from the forward, so they are available in the backward)
    releases=((0, 19, 3), (0, 20, 0)),
    scenario=Scenario.from_dict({"blocks": [{"in_optimizer": False}, {}], "stage": 3, "input_requires_grad": False,
                                 "steps": [{"micro": [{"backward": "torch"}]}]}),
    checks=("available-when-used",),
    explains=lambda f: rules.released_by_early_epilogue(f) and narrow(f, lambda sc: sc.stage == 3 and all(
        _left_out_of_optimizer(p, sc) for p in params_named(f.error))),
    detail=("Block 0's parameters require grad but the client optimizer was given only block 1's (a common "
            "pattern: freeze by leaving out of the optimizer instead of requires_grad=False).  In the first "
            "backward, blocks.0.norm's backward starts while its weight and bias are NOT_AVAILABLE (never "
            "fetched by a pre-backward hook); with the same parameters in the optimizer they are fetched.  "
            "The values agree with PyTorch here only because LayerNorm's backward does not read its weight "
            "when its input needs no gradient (the network input does not require grad), and the ungrouped "
            "parameters are never updated.  Observed, not yet traced to the coordinator line."),
)

Z3_LINEAR_OVERRIDE_OUTLIVES_ENGINE = KnownIssue(
    id="z3-linear-override-outlives-engine",
    title="A ZeRO-3 engine replaces torch.nn.functional.linear process-wide and destroy() does not put it back: "
          "every later engine (and plain PyTorch) in the process runs nn.Linear through zero3_linear_wrap",
    owner="deepspeed",
    # 0.18.4 - 0.19.3 replace F.linear only inside a ``with zero.Init()`` block (patch_init_and_builtins), not
    # for a model handed to deepspeed.initialize; Init(module=...)'s _enable_mem_efficient_linear() is absent
    # from 0.19.3's source and present in 0.19.8's.  0.19.4 is not cached: the range starts there
    releases=((0, 19, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 2, "blocks": [{}, {}], "engines_before": [3],
                                 "steps": [{"micro": [{"backward": "engine"}]}]}),
    checks=("carried-state",),
    explains=lambda f: f.check == "carried-state" and f.code == "torch-linear-replaced"
    and narrow(f, lambda sc: 3 in sc.engines_before),
    nature=Nature.LIMITATION,
    cites=("DeepSpeed logs it: runtime/zero/partition_parameters.py _enable_mem_efficient_linear prints "
           "'nn.functional.linear has been overridden with a more memory efficient version. This will persist "
           "unless manually reset.' (0.19.8)"),
    detail=("Several engines in one process (TRL: policy, reference, reward model; the scenario's engines_before). "
            "A ZeRO-3 engine's DeepSpeedZeRoOffload._convert_to_zero_parameters (runtime/zero/parameter_offload.py "
            "line 270 in 0.19.8) builds zero.Init(module=...); Init.__init__ (runtime/zero/partition_parameters.py "
            "line 1090-1091) calls _enable_mem_efficient_linear, which sets torch.nn.functional.linear = "
            "zero3_linear_wrap (line 419; its own log line says 'This will persist unless manually reset'). "
            "engine.destroy() and the Init context's unpatch_init_and_builtins never restore it, so after the first "
            "ZeRO-3 engine every nn.Linear in the process -- a later ZeRO-1/2 engine's, a PyTorch reference "
            "model's -- runs through LinearFunctionForZeroStage3, one autograd node for input, weight and bias "
            "gradients: the values agree with PyTorch here, but the gradient hooks fire in another order (weight "
            "and bias swap; test_deepspeed_setups.py shows it in the trace), which moves ZeRO-1/2's bucket flushes "
            "and so which assertion a double reduction hits: the order-dependent 0.19.8 finding (ZeRO-2 bf16, tied "
            "weights, two backwards, after a ZeRO-3 engine in the same worker: 'already been reduced' in "
            "reduce_independent_p_g_buckets_and_remove_grads instead of reduce_ipg_grads).  The zerostate worker "
            "puts torch's F.linear back after every example (executor.restore_torch_linear), so examples stay "
            "independent; the finding (check carried-state) is raised when a ZeRO-1/2 engine runs with DeepSpeed's "
            "F.linear left by an engine before it.  Fix: restore linear_bk when the engine that patched it is "
            "destroyed (or patch only inside the Init context)."),
)

FP16_SCALE_INCREASE_HALVES_STEP = KnownIssue(
    id="fp16-scale-increase-halves-step",
    title="fp16 dynamic loss scaling: on a step where the loss scale grows, ZeRO unscales the gradients by the "
          "new (doubled) scale, so that step's update is half what it should be",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 3, "precision": "fp16", "blocks": [{}, {}], "steps": [{}, {}, {}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("update-halved-when-scale-grows",),
    detail=("Found by the fp16 oracle (fp16 on the CPU accelerator, net.LossScale).  With "
            "loss_scale_window 2 the scale doubles after the third clean step (2**8 -> 2**9).  The ZeRO optimizers "
            "update the scale before unscaling: stage3.py step() calls _loss_scale_update_and_overflow_cleanup "
            "(line 2891 on 0.19.8, loss_scaler.update_scale) and only then unscale_and_clip_grads (line 2918), "
            "which divides the fp32 gradient partition by self.loss_scale -- already the new scale; "
            "stage_1_and_2.py the same (_update_scale line 3047, unscale_and_clip_grads line 3080 with "
            "combined_scale = self.loss_scale, line 3198, while the reported norm uses prev_scale, line 3071).  "
            "The gradients were computed with the old scale, so the update of every step on which the scale grows "
            "is exactly half (ZeRO-1, 2 and 3).  Stage 0's FP16_Optimizer does the same (fused_optimizer.py step(): "
            "_update_scale line 337, then unscale_and_clip_grads line 344 with cur_scale; FP16_UnfusedOptimizer lines "
            "227-228): a 3-step stage-0 fp16 run is this plus zero0-fp16-loss-not-scaled.  "
            "torch.cuda.amp.GradScaler and apex update the scale after the step.  It cancels when "
            "gradient clipping binds (the clip factor is computed from the same new scale).  With DeepSpeed's "
            "default window of 1000 steps it halves one update in a thousand.  The default exploration (at most "
            "2 train steps) does not reach it; the stateful test (3 steps) did.  A comment on "
            "deepspeedai/DeepSpeed PR #8588 (open) describes the same ordering.  Fix: unscale with prev_scale (or "
            "update the scale after the step)."),
)

Z3_LATE_MODULE_REREGISTERED = KnownIssue(
    id="z3-late-module-after-reregister",
    title="ZeRO-3: after the hooks are re-registered (TRL's generation), a module attached after "
          "deepspeed.initialize crashes the forward (AttributeError: ... no attribute 'ds_external_parameters')",
    owner="deepspeed",
    releases=((0, 19, 1), (0, 20, 0)),  # before 0.19.1 the late module fails earlier, in the forward prologue
    # (z3-module-attached-after-initialize, known/fixed.py)
    scenario=Scenario.from_dict({"stage": 3, "late_module": True, "steps": [{}, {"reregister": True}]}),
    checks=("exception",),
    explains=lambda f: rules.late_module_after_reregister(f) and narrow(f, lambda sc: sc.late_module and sc.stage == 3),
    detail=("Found by the default exploration once the strategy drew a late module (0.19.8).  A module "
            "attached after initialize has no ZeRO-3 hooks, and since #8009 (0.19.1) its forward runs.  "
            "Re-registering the hooks (``_register_deepspeed_module``, what TRL's unwrap_model_for_generation "
            "does around generation) now hooks it too, but it never got the ``ds_external_parameters`` method "
            "that zero.Init gives every module it converts, so the next forward's pre-forward hook "
            "(partitioned_param_coordinator.get_all_parameters) raises.  Realistic when an adapter is loaded "
            "after initialize and generation runs between train steps."),
)

OFFLOAD_STALE_GRAD_AFTER_FREEZE = KnownIssue(
    id="offload-stale-grad-after-freeze",
    title="Optimizer offload (ZeRO-2/3): a parameter whose requires_grad is off for a step gets the previous "
          "step's gradient applied again",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 3, "offload": "optimizer", "steps": [{}, {"frozen": [0]}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("stale-gradient-replayed-when-frozen", "stale-gradient-unscaled-again-when-frozen"),
    detail=("Found by the default exploration on 0.19.8 (a requires_grad change drawn with optimizer "
            "offload).  Step 0 trains block 0's Linear; step 1 runs with its requires_grad False (progressive "
            "freezing, a LoRA base frozen after warm-up).  PyTorch's optimizer skips a parameter without "
            "gradient; with offload_optimizer the CPU gradient partition of that parameter still holds step 0's "
            "gradient, and the CPU optimizer steps it again: after step 1 the Linear has moved exactly twice "
            "step 0's update, while the parameters that did get a gradient are right.  ZeRO-2 and ZeRO-3 with "
            "optimizer offload; parameter offload alone is correct.  The "
            "ZeRO-1/2 step with no gradient at all (step-without-gradient) is the whole-model form of it.  A "
            "module a step does not use (`unused`) leaves its parameters without a gradient the same way: the "
            "same mechanism replays theirs."),
)

FP16_OFFLOAD_OVERFLOWED_GRAD_AFTER_FREEZE = KnownIssue(
    id="fp16-offload-overflowed-grad-after-freeze",
    title="ZeRO-1/2, fp16 with optimizer offload: a parameter without a gradient in the step after an overflowed "
          "one (frozen for it) is stepped with the overflowed gradient, which no overflow check sees: its weight "
          "becomes NaN",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 1, "precision": "fp16", "loss_scale_power": 16, "offload": "optimizer",
                                 "steps": [{}, {"frozen": [0]}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("overflowed-gradient-replayed",),
    upstream_patch="docs/upstream/fp16-offload-overflowed-grad-after-freeze/",
    detail=("Step 0 overflows at the initial loss scale (2**16) and is skipped, as PyTorch's scaler skips it; step 1 "
            "runs with block 0's Linear frozen (progressive freezing, a LoRA base frozen after warm-up).  With "
            "offload_optimizer the backward copies each gradient, still scaled, into the fp32 CPU gradient partition "
            "before step() checks for overflow; the skipped step clears nothing there (reset_cpu_buffers resets only "
            "the norms and local_overflow).  In step 1 the frozen Linear gets no gradient, so its slot still holds "
            "step 0's non-finite one, and step() decides overflow from local_overflow, which only the gradients "
            "copied in this step set (stage_1_and_2.py has_overflow: ``self.local_overflow if self.cpu_offload``).  "
            "The step is applied and the frozen weight's fp32 master becomes NaN, then its 16-bit copy.  Without the "
            "overflow the same slot replays the step before's gradient divided by the loss scale again "
            "(offload-stale-grad-after-freeze).  A parameter whose every gradient of the step another bug loses (a "
            "fused head's after a never-exited backward) is stepped from the same slot: NaN as well.  Checking the "
            "whole fp32 gradient partition for overflow, or zeroing it when a step is skipped, would fix it."),
)

ZERO0_FP16_LOSS_NOT_SCALED = KnownIssue(
    id="zero0-fp16-loss-not-scaled",
    title="ZeRO stage 0 with fp16: engine.backward does not scale the loss, the fp16 optimizer divides by the "
          "loss scale all the same, so each update is the loss scale times too small",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 0, "precision": "fp16", "steps": [{}, {}]}),
    checks=("oracle",),
    # with SGD the update is divided by the scale (at most a few times 1/scale of it); Adam normalises that
    # division away, and what shows is the fp16 gradient lost to underflow without the scale (the figure:
    # docs/known-issues-provenance.md)
    explains=None,
    mechanisms=("loss-not-scaled",),
    detail=("The fp16 sibling of #7839 (ZeRO-0 + bf16, fixed in 0.18.6 by turning loss scaling off for bf16).  "
            "engine.backward (runtime/engine.py, 0.19.8) scales the loss only for a ZeROOptimizer or torch "
            "autocast's GradScaler; at stage 0 the fp16 optimizer is FP16_UnfusedOptimizer (FP16_Optimizer for a "
            "fused one), a plain DeepSpeedOptimizer, so loss.backward runs on the unscaled loss, and the "
            "optimizer's step divides the gradients by cur_scale: the update is 2**-initial_scale_power of "
            "PyTorch's, and the gradients after engine.backward equal PyTorch's unscaled ones.  Found once stage 0 "
            "was drawn with fp16 (it had been drawn as bf16, "
            "'not investigated').  Upstream fix proposed in DeepSpeed PR #8393 (open, not in 0.19.8): route fp16 + "
            "ZeRO-0 through FP16_Optimizer.backward, which scales the loss."),
)

Z3_FP16_LOSS_SCALER_FROM_FP32_PARAM = KnownIssue(
    id="z3-fp16-loss-scaling-off-for-fp32-first-param",
    title="ZeRO-3 with fp16: the loss scaler's dtype is the first trainable parameter's, so fp32 LoRA adapters under "
          "zero.Init turn fp16 loss scaling off (a static scale of 1) while the forward and backward run in fp16",
    owner="deepspeed",
    releases=((0, 19, 8), (0, 20, 0)),  # from the oldest release its scenario was run on
    scenario=Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "precision": "fp16",
                                 "zero_init": True}),
    checks=("oracle",),
    explains=None,
    mechanisms=("loss-scaler-from-fp32-first-param",),
    detail=("stage3.py takes the optimizer's dtype from the first parameter of its first group "
            "(``self.dtype = self.optimizer.param_groups[0]['params'][0].dtype``) and builds the loss scaler with "
            "it; runtime/fp16/loss_scaler.py ``CreateLossScaler`` gives a dynamic scaler only for torch.half and a "
            "static ``LossScaler(scale=1.0)`` otherwise.  With an fp16 model built under zero.Init (HF "
            "from_pretrained with ZeRO-3) PEFT adds its LoRA adapters in fp32 (autocast_adapter_dtype), so every "
            "trainable parameter is fp32: the config's dynamic fp16 loss scaling is silently off while the frozen "
            "base runs its forward and backward in fp16, where small gradients underflow.  The oracle sees the loss "
            "scale: DeepSpeed's stays 1 where the configured scaler's is 2**initial_scale_power; the reference with "
            "a static scale of 1 matches DeepSpeed exactly.  Without zero.Init the engine casts the adapters to "
            "fp16 and the scale is the configured one; with modules_to_save the mixed dtypes fail first "
            "(z3-mixed-dtype-trainable-params).  Met unlabelled by the default exploration on the plain-world-rate "
            "sequence."),
)

ZERO_ADAM_STEPS_FROZEN_PARAM = KnownIssue(
    id="zero-adam-steps-frozen-param",
    title="ZeRO-1/2/3 with Adam: a parameter whose requires_grad is off for a step is stepped as if its gradient "
          "were zero (Adam's momentum moves it; its step count advances)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"optimizer": "config-adam", "stage": 3, "steps": [{}, {"frozen": [0]}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("frozen-stepped-with-zero-gradient",),
    detail=("Found by exploring with the DeepSpeed-built optimizer (config AdamW, torch_adam) and its "
            "requires_grad change between steps.  PyTorch's optimizers skip a parameter whose grad is None "
            "(torch.optim.AdamW: no update, no state change).  ZeRO keeps one flat fp32 partition per parameter "
            "group and steps it as one tensor: a parameter that got no gradient in this step has zeros in the "
            "flat gradient (ZeRO-3: stage3.py independent_gradient_partition_epilogue takes "
            "``torch.zeros_like(param.ds_tensor)`` when ``not param.requires_grad``; ZeRO-1/2: the group's flat "
            "gradient partition covers every parameter of the group, zeros where none arrived), so AdamW decays its "
            "moments and applies lr * m_hat / (sqrt(v_hat) + eps) from the earlier steps' momentum: after step 1 "
            "block 0's Linear has moved where PyTorch leaves it (scenario above; and when the Linear is frozen "
            "in step 0 and trained in step 1 instead, the flat group's shared step count gives it step 2's bias "
            "correction).  ZeRO stage 0 in fp32 (torch's AdamW on the parameters themselves) agrees; at stage 0 "
            "with fp16 or bf16 FP16_UnfusedOptimizer gives a parameter without a gradient a zero one too "
            "(runtime/fp16/unfused_optimizer.py step); "
            "client SGD hides it (a zero gradient moves nothing without momentum or decay).  A module a step does "
            "not use (`unused`) leaves its parameters without a gradient the same way, and they are stepped the "
            "same (ZeRO-1/2; ZeRO-3 replays their stale gradient instead: z3-stale-grad-for-unused-module).  "
            "With weight decay "
            "it also decays every parameter without a gradient.  DeepSpeed's flat partitions cannot skip one "
            "parameter; DeepSpeed #2615 / #2653 keep parameters frozen at initialize out of the groups, not "
            "ones frozen later (progressive freezing / unfreezing).  With optimizer offload the stale gradient of "
            "offload-stale-grad-after-freeze comes first."),
)

def dropped_by_zero_to_fp32(f: Finding) -> str | None:
    """The parameter a ``checkpoint:zero-to-fp32`` finding says zero_to_fp32 left out, as ``"frozen"`` (its
    ``requires_grad`` is False: a frozen block sub-module, a LoRA base weight), ``"ungrouped"`` (trainable, in
    no optimizer group), ``"empty"`` (the parameter with no elements, ``empty_param``) or None (another
    finding, or a parameter that is none of these)."""
    import re
    m = re.search(r"zero_to_fp32 rebuilds from the checkpoint: (\S+): shape \(.*?\) in \w[\w ]* vs None in ",
                  f.error or "")
    if f.check != "checkpoint" or f.code != "zero-to-fp32" or not m or f.scenario is None:
        return None
    name, sc = m.group(1), f.scenario
    if name == "empty" and sc.empty_param:
        return "empty"
    if sc.family is Family.LLAMA:
        return "frozen" if sc.lora and "lora_" not in name and "modules_to_save" not in name else None
    parts = name.split(".")
    if parts[0] != "blocks" or len(parts) < 3 or not parts[1].isdigit() or int(parts[1]) >= len(sc.blocks):
        return None
    if parts[2] not in ("norm", "lin"):  # a block holds a norm and a Linear: any other name is not the network's
        return None
    blk = sc.blocks[int(parts[1])]
    if getattr(blk, parts[2]) is ParamKind.FROZEN:
        return "frozen"
    return "ungrouped" if not blk.in_optimizer else None


ZERO_TO_FP32_DROPS_UNGROUPED = KnownIssue(
    id="zero-to-fp32-drops-param-in-no-group",
    title="ZeRO-1/2/3 checkpoint: zero_to_fp32 leaves out a parameter that requires grad but is in no "
          "optimizer group",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 2, "blocks": [{}, {"in_optimizer": False}],
                                 "steps": [{}, {"save_load": True}]}),
    checks=("checkpoint",),
    explains=lambda f: dropped_by_zero_to_fp32(f) == "ungrouped",  # the parameter it names, as the run built it
    detail=("Found by the checkpoint round trip (save_load), which also rebuilds the fp32 weights with "
            "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint, as users convert a ZeRO "
            "checkpoint.  Block 1's parameters require grad but the client optimizer was given only block 0's "
            "(freezing by leaving parameters out of the optimizer).  The checkpoint stores the optimizer's "
            "flat groups (param_shapes) and, as frozen_param_shapes / fragments, the parameters the optimizer "
            "does not own -- selected by requires_grad=False before 0.19.8 and by is_optimized_parameter "
            "(requires_grad and numel > 0) in 0.19.8: either way a trainable parameter outside every group is "
            "in neither, and the rebuilt state dict has no key for it (load_state_dict(strict=True) fails; "
            "strict=False leaves it at its initial value silently).  load_checkpoint into the engine is "
            "correct (the module state dict has it at ZeRO-1/2, the ZeRO-3 partitions are restored), and so "
            "is ZeRO-3's 16-bit state dict."),
)

ZERO1_CHECKPOINT_DROPS_FROZEN = KnownIssue(
    id="zero1-checkpoint-drops-frozen-params",
    title="ZeRO-1 checkpoint: frozen parameters are not saved with the ZeRO state, so zero_to_fp32 leaves "
          "them out (deepspeedai/DeepSpeed#5439, open)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 1, "blocks": [{"lin": "frozen"}, {}], "steps": [{}, {"save_load": True}]}),
    checks=("checkpoint",),
    explains=lambda f: dropped_by_zero_to_fp32(f) == "frozen" and narrow(f, lambda sc: sc.stage == 1),
    detail=("Found by the checkpoint round trip (save_load), which rebuilds the fp32 weights with "
            "zero_to_fp32.  engine.py saves frozen_param_shapes / fragments only when "
            "zero_optimization_partition_gradients() (ZeRO-2 and 3): at ZeRO-1 a requires_grad=False parameter "
            "(block 0's Linear here; every LoRA base weight of a PEFT model) is in neither the optimizer's flat "
            "groups nor the frozen fragments, and the rebuilt state dict has no key for it.  Reported upstream as "
            "#5439 (open; the maintainer did not remember the reason for the condition).  load_checkpoint into "
            "the engine is correct (the module state dict has it).  ZeRO-2 with the same scenario is correct."),
)

Z3_MIXED_DTYPE_TRAINABLE_DEFRAGMENT = KnownIssue(
    id="z3-mixed-dtype-trainable-params",
    title="ZeRO-3: trainable parameters of two dtypes in one group (a bf16/fp16 model built under zero.Init, PEFT's "
          "fp32 LoRA adapters and its modules_to_save copy in the model's dtype) fail deepspeed.initialize "
          "(AssertionError in defragment)",
    owner="deepspeed",
    releases=((0, 19, 2), (0, 20, 0)),  # from the oldest release its scenario was run on
    scenario=Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "modules_to_save": True,
                                 "precision": "bf16", "zero_init": True}),
    checks=("exception",),
    # with parameter offload the partitions skip defragment and the mixed dtypes reach the first forward
    # (fp16 the same: its message names Half; met unlabelled once the world-size draw was a plain rate)
    variants=(Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "modules_to_save": True,
                                  "precision": "bf16", "zero_init": True, "offload": "param"}),
              Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "modules_to_save": True,
                                  "precision": "fp16", "zero_init": True, "offload": "param"})),
    explains=lambda f: (rules.raised_at("AssertionError", "zero/utils.py", "defragment")(f)
                        or rules.raised_at("RuntimeError", "zero/linear.py", "forward", "same dtype")(f)) and narrow(
        f, lambda sc: sc.stage == 3 and sc.modules_to_save and sc.precision.value != "fp32"),
    detail=("Found by the default exploration of 0.19.8 once `zero_init` was drawn.  Built as HF's "
            "from_pretrained builds a model under ZeRO-3, the base weights are bf16 (fp16); PEFT then upcasts the "
            "trainable parameters it adds to fp32 (autocast_adapter_dtype, peft 0.21: the LoRA adapters and the "
            "modules_to_save copy of lm_head alike), and the ZeRO-3 engine casts no parameter already partitioned, "
            "so the trainable parameters have two dtypes.  Stage3's "
            "_create_fp16_partitions_with_defragmentation flattens each trainable group with "
            "runtime/zero/utils.py defragment, which asserts a single dtype (``assert len(set(t.dtype for t in "
            "tensors)) == 1``).  With parameter offload that branch is skipped (each partition is moved to a CPU "
            "buffer instead), initialize succeeds, and the first forward fails: the fp32 head copy meets the bf16 "
            "hidden states in zero3_linear_wrap ('expected m1 and m2 to have the same dtype'; the adapters survive "
            "it, PEFT casts their input to their dtype).  LoRA alone (fp32 adapters only) and fp32 training are "
            "fine.  The same assertion is reported with TRL (huggingface/trl#1770) and DeepSpeed #7669 asks for "
            "modules_to_save support under ZeRO-3 (open)."),
)

Z3_EMPTY_PARAM_NOT_GATHERED = KnownIssue(
    id="z3-empty-param-not-gathered",
    title="ZeRO-3: a parameter with no elements is never gathered, and the forward asserts it is available "
          "(open; DeepSpeed PR #8375)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 3, "empty_param": True, "steps": [{}]}),
    # on 0.19.8 a checkpoint saved before the first forward moves the assertion into the backward
    variants=(Scenario.from_dict({"stage": 3, "empty_param": True, "steps": [{"save_load": True}]}),),
    checks=("exception",),
    # on 0.19.8 (0.18.4 raises it one frame up: ...partitioned_param_coordinator.fetch_sub_module)
    explains=lambda f: rules.raised_at("AssertionError", "partitioned_param_coordinator.py", None,
                                       "'status': 'NOT_AVAILABLE'", "'numel': 0")(f)
    and narrow(f, lambda sc: sc.empty_param and sc.stage == 3),
    detail=("The coordinator gathers only parameters with elements (fetch_numel > 0), then asserts every "
            "parameter of the module is AVAILABLE: the zero-element one stays NOT_AVAILABLE and the first "
            "forward raises AssertionError (ds_summary: numel 0).  The same network trains at ZeRO-1/2 from 0.19.6 "
            "(#8280).  At world size 2, a module holding a sized and a zero-sized parameter in one coalesced "
            "all-gather fails instead in the handle's wait (torch.cat of an empty list); DeepSpeed PR #8375 "
            "(open) gathers zero-sized parameters and names "
            "both.  Not in the default exploration's draw (`empty_param` is drawn below ZeRO-3 only); kept as a "
            "strict expected failure on its scenario."),
)

ZERO_TO_FP32_Z3_EMPTY_PARAM = KnownIssue(
    id="zero-to-fp32-z3-empty-param",
    title="zero_to_fp32 cannot rebuild a ZeRO-3 checkpoint holding a parameter with no elements (TypeError in "
          "its lazy tensor's contiguous)",
    owner="deepspeed",
    # ends before 0.19.8 although 0.19.8's zero_to_fp32.py has the same code: there the scenario stops earlier, in
    # the 16-bit state dict's gather (z3-empty-param-not-gathered)
    releases=((0, 18, 4), (0, 19, 8)),
    scenario=Scenario.from_dict({"stage": 3, "empty_param": True, "steps": [{"save_load": True}]}),
    checks=("exception",),
    explains=lambda f: rules.raised_at("TypeError", "utils/zero_to_fp32.py", "contiguous")(f)
    and narrow(f, lambda sc: sc.empty_param and sc.stage == 3),
    detail=("Met by the default exploration of 0.19.7 while polishing an empty_param finding to ZeRO-3: a "
            "checkpoint saved before the first forward (the parameter was never asked to be gathered).  "
            "utils/zero_to_fp32.py GatheredTensor.contiguous looks for the flat group holding [offset, offset + "
            "numel): for a zero-element parameter at the end of the flat groups no group satisfies offset < "
            "group end, so start_group_id and end_group_id stay None and range(None, ...) raises TypeError.  "
            "Unchanged in 0.19.8's source."),
)

ZERO1_CHECKPOINT_DROPS_EMPTY_PARAM = KnownIssue(
    id="zero1-checkpoint-drops-empty-param",
    title="ZeRO-1 checkpoint on 0.19.8: zero_to_fp32 leaves out a trainable parameter with no elements",
    owner="deepspeed",
    releases=((0, 19, 8), (0, 20, 0)),  # 0.19.7's checkpoint of its scenario keeps it (detail)
    scenario=Scenario.from_dict({"stage": 1, "empty_param": True, "steps": [{"save_load": True}]}),
    checks=("checkpoint",),
    explains=lambda f: dropped_by_zero_to_fp32(f) == "empty" and narrow(f, lambda sc: sc.stage == 1),
    detail=("Found by test_deepspeed_target.py::test_every_finding_is_known in Hypothesis's random (dev) profile, "
            "once empty_param was drawn: at ZeRO-1 the fp32 state dict zero_to_fp32 rebuilds from a "
            "0.19.8 checkpoint has no key for the zero-element parameter (``empty: shape (0,) in the engine vs "
            "None in the checkpoint``), so loading it strictly fails on a missing key.  0.19.7's checkpoint of the "
            "same scenario keeps it, and so does ZeRO-2 on 0.19.8; zero_to_fp32.py is the same in both "
            "releases apart from buffer dtypes, so the change is on the saving side -- not traced to its line."),
)

ZERO_TO_FP32_BF16_OPTIMIZER = KnownIssue(
    id="zero-to-fp32-bf16-optimizer-checkpoint",
    title="zero_to_fp32 refuses the checkpoint of ZeRO-1 with bf16 and fp32 gradient accumulation (BF16_Optimizer): "
          "'... is not a zero checkpoint'",
    owner="deepspeed",
    releases=((0, 19, 2), (0, 20, 0)),  # from the oldest release its scenario was run on
    scenario=Scenario.from_dict({"stage": 1, "precision": "bf16", "fp32_grad_accum": True,
                                 "steps": [{"save_load": True}]}),
    checks=("exception",),
    explains=lambda f: rules.raised_at("ValueError", "utils/zero_to_fp32.py", "parse_optim_states",
                                       "is not a zero checkpoint")(f)
    and narrow(f, lambda sc: sc.stage == 1 and sc.fp32_grad_accum),
    detail=("Found by `make explore` from a fresh clone (0.19.8).  ZeRO-1 with "
            "bf16 and grad_accum_dtype fp32 runs DeepSpeed's BF16_Optimizer, whose checkpoint files "
            "(bf16_zero_pp_rank_*_optim_states.pt) lack the ZeRO optimizer state keys parse_optim_states looks for, "
            "so zero_to_fp32 -- the script a checkpoint directory ships for turning it into fp32 weights -- raises "
            "ValueError.  load_checkpoint into the engine works (the run then trains); not traced further."),
)

BF16_OPTIMIZER_CLEARS_IN_FORWARD_GRADS = KnownIssue(
    id="bf16-optimizer-clears-in-forward-grads",
    title="BF16_Optimizer (ZeRO-1 + bf16 + fp32 gradient accumulation): engine.backward clears the gradient a "
          "backward inside the forward already wrote (a fused logits+loss head), so that parameter never steps",
    owner="deepspeed",
    releases=((0, 19, 2), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 1, "precision": "bf16", "fp32_grad_accum": True, "fused_head": True,
                                 "blocks": [{}], "width": 7, "steps": [{}]}),
    checks=("oracle",),
    upstream_patch="docs/upstream/bf16-optimizer-clears-in-forward-grads/",
    explains=None,
    mechanisms=("in-forward-gradient-dropped",),
    detail=("Found by the default exploration on 0.19.8 once the optimizer wrapper was a pairwise point "
            "(docs/results.md).  A loss head that computes its gradients inside the forward (DeepSpeed's own "
            "TiledFusedLogitsLoss, ALST) writes the head weight's gradient into its bf16 .grad before "
            "engine.backward runs.  With bf16.immediate_grad_update off (the default) BF16_Optimizer keeps "
            "gradients in the bf16 .grad until the backward's epilogue adds them to the fp32 buffer, and "
            "engine._backward_prologue calls optimizer.backward_prologue() -> clear_lp_grads() at the start of "
            "every engine.backward: the head's gradient is wiped, at every gas, and the head's fp32 master weight "
            "does not move (and with clipping the other parameters get more than their update, the norm "
            "having lost the head's share).  With immediate_grad_update true the master weights equal PyTorch's "
            "exactly; ZeRO-2/3 and ZeRO-1 without fp32 accumulation (the ZeRO optimizer, whose prologue does not "
            "clear .grad) are correct."),
)

def _zero1_grad_accum_reduce(sc: Scenario) -> bool:
    """ZeRO-1 keeping gradients in the fp32 ``grad_accum`` attribute (bf16, fp32 accumulation, optimizer offload)
    at several ranks, with a second backward of one forward: the route of `ZERO1_REDUCE_KEEPS_OTHER_PARTITIONS`."""
    return (sc.stage == 1 and sc.world_size > 1 and sc.precision is Precision.BF16 and sc.fp32_grad_accum
            and sc.offload is not Offload.NONE and _retains(sc))


ZERO1_REDUCE_KEEPS_OTHER_PARTITIONS = KnownIssue(
    id="zero1-reduce-keeps-other-partitions",
    title="ZeRO-1 with fp32 gradient accumulation (bf16 + optimizer offload), world size > 1: a second backward of "
          "one forward in the boundary micro-step reduces each rank's gradient of the other ranks' partitions again",
    owner="deepspeed",
    # from 0.19.8: 0.19.2 has the same ZeRO-1 branch, but its fp32-accumulation offload path is off with one
    # backward already (another difference); the releases between are not cached
    releases=((0, 19, 8), (0, 20, 0)),
    scenario=Scenario.from_dict({"blocks": [{}], "stage": 1, "precision": "bf16", "fp32_grad_accum": True,
                                 "offload": "optimizer", "steps": [{"micro": [{"backward": "engine",
                                                                              "retain": True}]}]}),
    checks=("oracle", "crash"),
    # a fused head as well: the non-owner's kept gradient of the head changes what its bucket holds at the second
    # backward's reduction, so the ranks all-reduce buckets of different sizes (gloo aborts a rank; NCCL would hang
    # or mix the buckets up) -- gone with the patch (measured: the replay on the patched tree passes)
    explains=lambda f: rules.ranks_ran_different_collectives(f) and narrow(f, _zero1_grad_accum_reduce),
    mechanisms=("zero1-outside-partition-reduced-again",),
    variants=(Scenario.from_dict({"blocks": [{}], "stage": 1, "precision": "bf16", "fp32_grad_accum": True,
                                  "offload": "optimizer", "fused_head": True, "world_size": 2,
                                  "steps": [{"micro": [{"backward": "engine", "retain": True}]}]}),),
    world_size=2,
    upstream_patch="docs/upstream/zero1-reduce-keeps-other-partitions/",
    detail=("Found by the default exploration of 0.19.8 (issue 42: `oracle:master:other@first-step`, a llama at world "
            "size 2 with a checkpoint round trip; shrunk by hand to the blocks scenario above).  ZeRO-1 keeps "
            "the gradient in the fp32 ``grad_accum`` attribute when the gradient accumulation dtype differs from "
            "the parameters' (``use_grad_accum_attribute``: bf16 with grad_accum_dtype fp32, which takes the "
            "ZeRO optimizer instead of BF16_Optimizer only with optimizer offload).  Every engine.backward at the "
            "boundary reduces (engine.allreduce_gradients -> reduce_gradients -> reduce_ipg_grads): each rank "
            "copies its grad_accum into the bucket and points grad_accum at it, average_tensor divides the bucket "
            "by the world size in place and reduces each slice to the partition's owner.  Then the ZeRO-2 branch of "
            "reduce_ipg_grads clears the gradient of every parameter outside the rank's partition; the ZeRO-1 "
            "branch (stage_1_and_2.py lines 2272-2274 on 0.19.8) only moves the owned ones (copy_grads_in_partition, "
            "which clears them), so a non-owner keeps its divided share until the next forward "
            "(clear_backward_seen_flag).  A second backward of the same forward adds to it and reduces it again: "
            "at world size 2 with two halves of the loss the non-owning rank's share of each such parameter is "
            "0.625 of its gradient where it should be 0.5.  A parameter straddling two partitions is owned by "
            "both (cleared on both).  With reduce_scatter off the kept value is the all-reduced one (the "
            "counterfactual covers both).  Earlier micro-steps of the step are sent by the "
            "first reduction and counted again with it.  ZeRO-2 (the same precision and "
            "offload), world size 1, and one backward per forward are correct.  Without fp32 accumulation the same "
            "scenario shows two-backwards-per-forward instead (the ZeRO optimizer's copy while micro_step_id is "
            "0), without offload BF16_Optimizer (another difference, not labelled).  Patch: clear the "
            "other partitions' gradients in the ZeRO-1 branch as the ZeRO-2 branch does (docs/upstream/)."),
)

FP16_OPTIMIZER_INIT_STEP = KnownIssue(
    id="fp16-optimizer-init-step",
    title="ZeRO stage 0 with fp16 or bf16: the fp16 optimizer allocates the optimizer's state with one step on zero "
          "gradients, so Adam's step count and bias correction run one step ahead of PyTorch's",
    owner="deepspeed",
    releases=((0, 19, 2), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 0, "precision": "bf16", "optimizer": "config-adam", "steps": [{}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("optimizer-state-initialised-by-a-step",),
    variants=(Scenario.from_dict({"stage": 0, "precision": "fp16", "optimizer": "config-adam", "steps": [{}]}),),
    detail=("Found by the oracle on the update once stage 0's fp32 master weights were read.  At stage 0 with fp16 "
            "or bf16 DeepSpeed wraps the optimizer in FP16_UnfusedOptimizer (FP16_Optimizer for a fused one); "
            "their constructor calls initialize_optimizer_states (runtime/fp16/unfused_optimizer.py, "
            "fused_optimizer.py), which sets every gradient to zeros and calls optimizer.step() to allocate the "
            "state.  torch's AdamW counts that step: before training state['step'] is 1, so the first real step "
            "uses step 2's bias correction, lr * (0.1 g / 0.19) / (sqrt(0.001 g^2 / 0.002) + eps), about 0.74 of "
            "PyTorch's first update; every later step is one ahead as well.  SGD without momentum hides it (a zero "
            "gradient moves nothing).  ZeRO 1-3 do not take the step (their optimizers allocate lazily).  Seen on "
            "0.19.2 and 0.19.8 (the same code in both)."),
)

def _scheduler_over_empty_group(f: Finding) -> bool:
    """The scheduler's step raised torch's strict-zip mismatch (`LRScheduler._update_lr`: more rates than the
    optimizer has groups), in a setup with an empty group and a scheduler built over the client optimizer."""
    r = f.evidence.raised if f.check == "exception" else None
    return (r is not None and r.type == "ValueError" and r.says("zip()", "is longer than") and bool(r.frames)
            and r.frames[-1].package == "torch" and r.frames[-1].file.endswith("optim/lr_scheduler.py")
            and r.frames[-1].function == "_update_lr"
            and narrow(f, lambda sc: sc.empty_group and sc.scheduler.value != "none"))


EMPTY_GROUP_DROPPED_UNDER_SCHEDULER = KnownIssue(
    id="empty-param-group-dropped-under-scheduler",
    title="deepspeed.initialize removes an empty parameter group from the client optimizer in place, under the LR "
          "scheduler already built over it: the scheduler's first step raises (torch >= 2.10: 'zip() argument 2 "
          "is longer than argument 1'; before, rates were assigned by position)",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 1, "decay_groups": True, "blocks": [{"lin": "frozen"}],
                                 "scheduler": "initialize"}),
    checks=("exception",),
    variants=(
        # the loop steps the scheduler itself: DeepSpeed never sees it, the same groups are gone
        Scenario.from_dict({"stage": 1, "decay_groups": True, "blocks": [{"lin": "frozen"}], "scheduler": "user"}),
        # what HF / TRL / OpenRLHF users run: LoRA under HF's two groups (the no-decay one empty), ZeRO-3
        Scenario.from_dict({"stage": 3, "family": "llama", "lora": True, "decay_groups": True,
                            "scheduler": "initialize"}),
        # stage 0 too: the removal is the engine's (_configure_optimizer), not ZeRO's
        Scenario.from_dict({"stage": 0, "decay_groups": True, "blocks": [{"lin": "frozen"}],
                            "scheduler": "initialize"}),
        # the block outside the optimizer, a fused head (its weight the only parameter held): the no-decay group
        # empty; without contiguous gradients the step sees no gradient
        Scenario.from_dict({"stage": 1, "fused_head": True, "decay_groups": True, "blocks": [{"in_optimizer": False}],
                            "contiguous_gradients": False, "scheduler": "initialize"})),
    explains=_scheduler_over_empty_group,
    cites=("engine.py _configure_optimizer: ``basic_optimizer.param_groups[:] = [pg for pg in "
           "basic_optimizer.param_groups if len(pg['params']) != 0]`` (DeepSpeed #4277, 'Handle empty parameter "
           "groups'); reported by users of OpenRLHF (#1225), LlamaFactory (#10141, #10144) and HF transformers "
           "(PR #43692) with LoRA on torch >= 2.10"),
    detail=("HF Trainer, TRL, OpenRLHF and LlamaFactory build two groups (weights to decay; biases and norms not) and "
            "pass both even when one is empty -- with LoRA (bias='none') every trainable parameter is an adapter "
            "weight, so the no-decay group is.  A scheduler built over that optimizer holds one base rate per group. "
            "deepspeed.initialize then filters the client optimizer's param_groups in place (any stage, 0 included), "
            "so the scheduler has two rates for one group: torch >= 2.10's LRScheduler._update_lr zips them with "
            "strict=True and the first step raises ValueError, inside engine.step() when the scheduler was passed "
            "to initialize, in the loop when it steps the scheduler itself.  Before torch 2.10 the zip truncated: "
            "each remaining group got the rate of the group at its position (a wrong schedule when the rates "
            "differ).  A scheduler DeepSpeed builds (its config's, or a callable of the optimizer, as HF Trainer "
            "passes one with a config optimizer) is built after the filter and is fine, and so is a loop that "
            "passes no empty group."),
)


ZERO12_GROUP_OF_EMPTY_PARAMS = KnownIssue(
    id="zero12-group-of-empty-params",
    title="ZeRO-1/2 (and BF16_Optimizer): an optimizer parameter group whose only trainable parameters have no "
          "elements fails deepspeed.initialize (IndexError in stage_1_and_2's __init__; torch.cat of an empty list "
          "in BF16_Optimizer)",
    owner="deepspeed",
    releases=((0, 19, 8), (0, 20, 0)),  # 0.19.2 raises zero12-trailing-empty-param's KeyError on the same scenario
    scenario=Scenario.from_dict({"stage": 1, "param_groups": 2, "blocks": [{"in_optimizer": False}, {}],
                                 "empty_param": True}),
    checks=("exception",),
    variants=(Scenario.from_dict({"stage": 2, "param_groups": 2, "blocks": [{"in_optimizer": False}, {}],
                                  "empty_param": True}),
              Scenario.from_dict({"stage": 1, "param_groups": 2, "blocks": [{"in_optimizer": False}, {}],
                                  "empty_param": True, "precision": "bf16", "fp32_grad_accum": True})),
    explains=lambda f: (rules.raised_at("IndexError", "zero/stage_1_and_2.py", "__init__", "list index out of range")(f)
                        or rules.raised_at("ValueError", "runtime/bf16_optimizer.py", "_flatten_dense_tensors_aligned",
                                           "expected a non-empty list of Tensors")(f))
    and narrow(f, lambda sc: sc.empty_param and sc.stage in (1, 2)),
    detail=("Found by the default exploration of 0.19.8 (a shrink of a ZeRO-1 scenario with two groups, block 0 in "
            "none, and a zero-element parameter: group 0 holds that parameter alone).  deepspeed.initialize drops "
            "groups with no parameter (engine.py _configure_optimizer: ``len(pg['params']) != 0``); the optimizer "
            "wrappers then keep only ``is_optimized_parameter`` ones -- trainable, with at least one element (the "
            "zero-element filter of #8280, which fixed zero12-trailing-empty-param) -- so this group, not empty when "
            "the engine filtered, is empty in the wrapper: stage_1_and_2.py reads ``self.bit16_groups[i][0].dtype`` "
            "(IndexError), BF16_Optimizer flattens an empty list (torch.cat).  Checking the group after the "
            "wrapper's filter, or the engine filtering by is_optimized_parameter, would fix it.  0.19.2 fails the same "
            "scenario earlier, with zero12-trailing-empty-param's KeyError; no release between 0.19.2 and 0.19.8 was "
            "run."),
)


Z3_STALE_GRAD_FOR_UNUSED = KnownIssue(
    id="z3-stale-grad-for-unused-module",
    title="ZeRO-3: a trainable parameter whose module a step does not use (routing, a head used in some steps) is "
          "stepped again with the gradient of the last step that used it",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),  # its scenario run on 0.18.4, 0.19.2 and 0.19.8
    scenario=Scenario.from_dict({"stage": 3, "blocks": [{}, {}], "steps": [{}, {"unused": [0]}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("stale-gradient-replayed-when-unused",),
    detail=("Found the first time the `unused` dimension ran.  stage3.py keeps each parameter's reduced "
            "gradient in its slice of grad_partitions_flat_buffer (partition_grads copies into it at micro-step 0, "
            "adds after); nothing clears the slice of a parameter no backward reached, and the epilogue hands the "
            "optimizer every slice of a parameter that requires grad (``averaged_gradients[i] = "
            "[__param_id_to_grad_partition[p.ds_id] if p.requires_grad else zeros ...]``), so a module a step did not "
            "use is stepped again with its last gradient.  A frozen parameter gets zeros there (its requires_grad "
            "is off: correct without offload, offload-stale-grad-after-freeze with it).  PyTorch's optimizer skips "
            "a parameter without a gradient.  ZeRO-1/2 without offload are correct; with optimizer offload the CPU "
            "partition replays it the same way (offload-stale-grad-after-freeze's mechanism).  MoE layers whose "
            "experts see no token in a step, and heads or branches used in some steps only, take this path unless "
            "they are z3 leaf modules."),
)


STAGE0_MASTER_NOT_SETTABLE = KnownIssue(
    id="stage0-mixed-master-not-settable",
    title="ZeRO stage 0 fp16/bf16: safe_set_full_fp32_param silently does nothing, so a trained parameter changed "
          "the way DeepSpeed documents it goes back to its old value at the next step",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),  # its scenario run on 0.18.4 and 0.19.8
    scenario=Scenario.from_dict({"stage": 0, "precision": "bf16", "steps": [{}, {"gather": "edit"}, {}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("edit-not-in-master",),
    detail=("Found the first time the `gather` dimension ran.  DeepSpeed answers users who change a parameter in "
            "training with the tensor-fragment API (deepspeedai/DeepSpeed#2424: GatheredParameters(modifier_rank=0) "
            "for the 16-bit weight, deepspeed.utils.safe_set_full_fp32_param for its fp32 master).  "
            "utils/tensor_fragment.py reaches the master only through ``param._z3_optimizer`` (ZeRO-3) or "
            "``param._hp_mapping`` (ZeRO-1/2, BF16_Optimizer); stage 0's FP16_Optimizer (fp16) and "
            "FP16_UnfusedOptimizer (bf16 with a client optimizer) keep fp32 masters but map neither, so "
            "safe_get_full_fp32_param returns None and safe_set_full_fp32_param returns without a word.  The next "
            "applied step writes the unchanged master plus its update over the 16-bit weight: the edit is gone "
            "(its forwards in between did use it).  ZeRO-1/2/3 and BF16_Optimizer keep it.  The counterfactual "
            "edits the 16-bit copy only and matches DeepSpeed exactly."),
)


BF16_OPTIMIZER_ZERO_GRAD_KEEPS_FP32_GRADS = KnownIssue(
    id="bf16-optimizer-zero-grad-keeps-fp32-grads",
    title="ZeRO-1 bf16 with fp32 gradient accumulation: engine.zero_grad() between two backwards of one retained "
          "graph clears nothing the step uses, so the step applies both losses' gradients",
    owner="deepspeed",
    # its scenario run on 0.18.5, 0.19.1, 0.19.2 and 0.19.8; on 0.18.4 a second backward of one forward leaves
    # BF16_Optimizer's parameters not updated at all (an unexplained finding of its own)
    releases=((0, 18, 5), (0, 20, 0)),
    scenario=Scenario.from_dict({"stage": 1, "precision": "bf16", "fp32_grad_accum": True,
                                 "steps": [{"micro": [{"retain": True, "zero_grad": True}]}]}),
    checks=("oracle",),
    explains=None,
    mechanisms=("zero-grad-not-in-fp32-accumulation",),
    detail=("Found the first time the `zero_grad` dimension ran (separate losses of one retained graph, the "
            "gradient cleared between them, as a loop that steps on each loss does).  BF16_Optimizer's gradient "
            "hooks move every backward's 16-bit gradient into its fp32 accumulation buffer at once "
            "(accumulate_hp_grads_and_remove_lp); engine.zero_grad() only sets each parameter's .grad to None "
            "(engine.py zero_grad), so the first loss's gradient stays in the buffer and step() applies both.  "
            "BF16_Optimizer.zero_grad() would clear it (clear_hp_grads), but the engine's does not call it.  ZeRO "
            "stage 0, 1 and 2 in fp32, fp16 and bf16 without fp32 accumulation agree with PyTorch; ZeRO-3 crashes on "
            "the second backward (two-backwards-per-forward).  The counterfactual that ignores the zero_grad "
            "matches DeepSpeed exactly.  Upstream: the engine's zero_grad not calling the optimizer's is among the "
            "inconsistencies deepspeedai/DeepSpeed#6554 (open) lists; this consequence is not reported there."),
)


Z3_SET_FULL_FP32_PARAM_UNPADDED = KnownIssue(
    id="z3-set-full-fp32-param-unpadded",
    title="ZeRO-3 at several ranks: safe_set_full_fp32_param raises on the last rank for a parameter whose element "
          "count the world size does not divide, and the other ranks hang in the next collective",
    owner="deepspeed",
    releases=((0, 18, 4), (0, 20, 0)),  # its scenario run on 0.18.4, 0.19.2 and 0.19.8
    scenario=Scenario.from_dict({"stage": 3, "world_size": 2, "width": 7, "steps": [{}, {"gather": "edit"}]}),
    checks=("exception",),
    explains=lambda f: rules.raised_at("RuntimeError", "zero/stage3.py", "set_full_hp_param",
                                       "exceeds dimension size")(f)
    and narrow(f, lambda sc: sc.stage == 3 and sc.world_size > 1),
    detail=("Found the first time the `gather` dimension ran at two ranks (a hang: rank 0 waited in the next "
            "forward's reset_step collective for rank 1, whose run had raised).  stage3.py set_full_hp_param (what "
            "deepspeed.utils.safe_set_full_fp32_param and safe_set_full_optimizer_state call at ZeRO-3) copies "
            "``value.flatten().narrow(0, partition_numel * rank, partition_numel)`` into the rank's fp32 partition; "
            "the partitions are padded to ``ceil(numel / world_size)`` elements, the value is not, so on the last rank "
            "the narrow runs past the value's end whenever the world size does not divide the parameter's element "
            "count (7x7 = 49 at two ranks: 'start (25) + length (25) exceeds dimension size (49)').  Only that rank "
            "raises; the others go on into the next collective and wait for ever.  Narrowing to the value's remaining "
            "elements (and leaving the padding) would fix it.  0.18.4, 0.19.2 and 0.19.8 alike."),
)


SETUP_ISSUES: tuple[KnownIssue, ...] = (ZERO0_FP16_LOSS_NOT_SCALED, Z3_UNGROUPED_NOT_GATHERED,
                                        TWO_BACKWARDS_PER_FORWARD, STEP_WITHOUT_GRADIENT, NESTED_OUTPUTS_SCALED_TWICE,
                                        SHARED_ACROSS_REENTRANT, Z3_LINEAR_OVERRIDE_OUTLIVES_ENGINE,
                                        FP16_SCALE_INCREASE_HALVES_STEP, Z3_LATE_MODULE_REREGISTERED,
                                        OFFLOAD_STALE_GRAD_AFTER_FREEZE, FP16_OFFLOAD_OVERFLOWED_GRAD_AFTER_FREEZE,
                                        ZERO_ADAM_STEPS_FROZEN_PARAM,
                                        ZERO_TO_FP32_DROPS_UNGROUPED, ZERO1_CHECKPOINT_DROPS_FROZEN,
                                        Z3_MIXED_DTYPE_TRAINABLE_DEFRAGMENT, Z3_EMPTY_PARAM_NOT_GATHERED,
                                        ZERO_TO_FP32_Z3_EMPTY_PARAM, ZERO1_CHECKPOINT_DROPS_EMPTY_PARAM,
                                        ZERO_TO_FP32_BF16_OPTIMIZER, BF16_OPTIMIZER_CLEARS_IN_FORWARD_GRADS,
                                        ZERO1_REDUCE_KEEPS_OTHER_PARTITIONS, FP16_OPTIMIZER_INIT_STEP,
                                        EMPTY_GROUP_DROPPED_UNDER_SCHEDULER, ZERO12_GROUP_OF_EMPTY_PARAMS,
                                        Z3_STALE_GRAD_FOR_UNUSED, STAGE0_MASTER_NOT_SETTABLE,
                                        Z3_SET_FULL_FP32_PARAM_UNPADDED, BF16_OPTIMIZER_ZERO_GRAD_KEEPS_FP32_GRADS,
                                        Z3_FP16_LOSS_SCALER_FROM_FP32_PARAM)

__all__ = ["SETUP_ISSUES", "dropped_by_zero_to_fp32", "nested_outputs_zero12"]
