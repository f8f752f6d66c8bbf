"""The fault catalogue: small faults of the kinds a pull request introduces into DeepSpeed 0.19.8's ZeRO code.

Each fault is data: the file (relative to the ``deepspeed`` package), the exact original text (it must occur
exactly once in that file), the replacement, and one line on the mistake it stands for.  ``cpu_blind``
is set only for a fault no run on the CPU accelerator can observe, with the reason (docs/faults.md argues
each).  The sample was chosen before any faulted run, by the kind of mistake and the code it touches, to
spread over the hook state, the ZeRO-3 coordinator, gradient reduction and accumulation, the optimizer step
and checkpointing; it is not tuned to what the explorer finds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    id: str
    area: str
    """hooks | coordinator | reduction | step | checkpoint"""
    file: str
    """Path inside the ``deepspeed`` package."""
    original: str
    replacement: str
    rationale: str
    cpu_blind: str = ""
    """Why no run on DeepSpeed's CPU accelerator can observe it ("" when one can)."""
    reintroduces: str = ""
    """The known issue whose mechanism the fault puts back ("" for none): the only label a finding it introduces
    may carry (`labels.still_wrong`)."""


RELEASE = "0.19.8"
"""The release whose source the original texts are taken from."""

_BASE = "runtime/base_optimizer.py"
_STAGE3 = "runtime/zero/stage3.py"
_STAGE12 = "runtime/zero/stage_1_and_2.py"
_COORD = "runtime/zero/partitioned_param_coordinator.py"
_OFFLOAD = "runtime/zero/parameter_offload.py"
_ENGINE = "runtime/engine.py"

HELD_OUT: tuple[Fault, ...] = (
    # two small numeric faults in clipping, where a tolerance widened by the 16-bit arithmetic's measured error
    # (`harness.net.arithmetic_twin`) could let them through, and one in BF16_Optimizer's accumulation, a mechanism
    # no known issue states for that optimizer
    Fault("clip-eps-large", "step", "runtime/utils.py",
          "    clip_coef = max_norm / (global_norm + eps)\n",
          "    clip_coef = max_norm / (global_norm + 1e-2)\n",
          "wrong constant: the clipping coefficient's epsilon 1e-2 instead of the argument (1e-6), about 1 % off "
          "where the norm is near 1 (BF16_Optimizer's clipping)"),
    Fault("z12-clip-eps-large", "step", _STAGE12,
          "            clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad\n",
          "            clip = ((clip_norm / self.loss_scale) + 1e-2) / self.clip_grad\n",
          "wrong constant: ZeRO-1/2's clipping divides by the norm plus 1e-2, about 1 % off where the norm is near 1"),
    Fault("bf16-accumulate-copies", "reduction", "runtime/bf16_optimizer.py",
          "        hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype).view(hp_grad.shape))\n",
          "        hp_grad.data.copy_(lp.grad.data.to(hp_grad.dtype).view(hp_grad.shape))\n",
          "wrong call: BF16_Optimizer's fp32 accumulation copies each backward's gradient over the ones before"),
)
"""Faults written after the rest, before any faulted run of them, by the code a numeric pull request touches."""

FAULTS: tuple[Fault, ...] = (
    # ------------------------------------------------------------------ hook state, expected counts, epilogue
    Fault("count-every-hook", "hooks", _BASE,
          "        return (self.hooks_fired_this_backward == 0\n",
          "        return (self.hooks_fired_this_backward >= 0\n",
          "wrong condition: the expected hook count is refreshed in every hook, not once per phase "
          "(the shape of the 0.18.5 regression)"),
    Fault("enter-backward-resets-phase", "hooks", _BASE,
          "        if self.backward_active_depth == 0 and not self.backward_seen_this_step:\n",
          "        if self.backward_active_depth == 0:\n",
          "missed case: counters and the queued-callback flag are reset on a reentrant phase's re-entry too"),
    Fault("reenter-without-seen", "hooks", _BASE,
          "            if self.backward_active_depth == 0 and self.backward_seen_this_step:\n"
          "                self.enter_backward()\n",
          "            if self.backward_active_depth == 0:\n"
          "                self.enter_backward()\n",
          "dropped condition: a backward run before the user's (a fused loss's) re-enters the backward context"),
    Fault("callback-queued-reports-false", "hooks", _BASE,
          "        if self.post_backward_callback_queued:\n            return True\n",
          "        if self.post_backward_callback_queued:\n            return False\n",
          "wrong return value: a second hook of the same backward takes the count-based fallback path too"),
    Fault("fallback-epilogue-strict", "hooks", _BASE,
          "        if self.hooks_fired_this_backward >= self.max_expected_hooks_seen:\n",
          "        if self.hooks_fired_this_backward > self.max_expected_hooks_seen:\n",
          "off-by-one in the count-based fallback epilogue",
          cpu_blind="the fallback runs only when queue_post_backward_callback returns False inside a gradient "
                    "hook, i.e. outside the user's backward (depth 0), where run_grad_acc_post_hooks returns "
                    "at once; torch 2.13 always has queue_callback and _current_graph_task_id, on CPU as on GPU: "
                    "equivalent on this torch whatever the device"),
    Fault("count-all-grad-nodes", "hooks", "runtime/utils.py",
          "    participating = sum(map(torch._C._will_engine_execute_node, seen_nodes))\n",
          "    participating = len(seen_nodes)\n",
          "wrong computation: count_used_parameters_in_backward counts every parameter's node, not the ones "
          "the running backward executes"),
    Fault("z3-count-misses-leaf-modules", "hooks", _STAGE3,
          "                            # Update hook state and run epilogue if all expected hooks have fired\n"
          "                            if refresh_expected:\n"
          "                                current_expected = count_used_parameters_in_backward(\n"
          "                                    non_leaf_params_requiring_grad) + leaf_module_count\n",
          "                            # Update hook state and run epilogue if all expected hooks have fired\n"
          "                            if refresh_expected:\n"
          "                                current_expected = count_used_parameters_in_backward(\n"
          "                                    non_leaf_params_requiring_grad)\n",
          "missed case: ZeRO-3's parameter hook forgets the z3 leaf modules' hooks in the expected count"),
    Fault("engine-no-exit-backward", "hooks", _ENGINE,
          "                self.optimizer.backward_epilogue()\n            self.optimizer.exit_backward()\n",
          "                self.optimizer.backward_epilogue()\n",
          "dropped call: engine._backward_epilogue no longer leaves the backward context"),
    # ------------------------------------------------------------------ ZeRO-3 coordinator and module hooks
    Fault("recompute-attribution-inverted", "coordinator", _COORD,
          "        in_checkpoint_recompute = forward and torch._C._current_graph_task_id() != -1\n",
          "        in_checkpoint_recompute = forward and torch._C._current_graph_task_id() == -1\n",
          "inverted condition: frozen parameters fetched by a checkpoint recompute are no longer attributed "
          "to the backward module (seed 002's mechanism)"),
    Fault("trace-length-off-by-one", "coordinator", _COORD,
          "            if len(self.__submodule_order) <= self.__step_id:\n",
          "            if len(self.__submodule_order) < self.__step_id:\n",
          "off-by-one: a module beyond the recorded trace's end is looked up instead of invalidating the trace"),
    Fault("release-skip-prefetched-ge", "coordinator", _COORD,
          "            if self.__most_recent_step_id_param_fetched_for[param] > step_id:\n",
          "            if self.__most_recent_step_id_param_fetched_for[param] >= step_id:\n",
          "off-by-one: a parameter whose last fetch is this step is kept instead of released"),
    Fault("reset-step-keeps-fetch-steps", "coordinator", _COORD,
          "        self.__param_queue = collections.deque(self.__param_order)  # reset fetch queue\n"
          "        self.__most_recent_step_id_param_fetched_for = collections.defaultdict(lambda: int(-1e10))\n",
          "        self.__param_queue = collections.deque(self.__param_order)  # reset fetch queue\n",
          "missed reset: the last-fetched step of each parameter survives into the next step"),
    Fault("release-persistent-recompute", "coordinator", _COORD,
          "            recompute_params = set([p.ds_id for p in submodule.ds_recompute_parameters "
          "if not p.ds_persist])\n",
          "            recompute_params = set([p.ds_id for p in submodule.ds_recompute_parameters])\n",
          "missed case: persistent parameters attributed to a recompute owner are released with it"),
    Fault("backward-fetch-as-forward", "coordinator", _OFFLOAD,
          "        param_coordinator.fetch_sub_module(sub_module, forward=False)\n",
          "        param_coordinator.fetch_sub_module(sub_module, forward=True)\n",
          "wrong flag: the pre-backward fetch is made as a forward fetch"),
    Fault("persistence-threshold-strict", "coordinator", _OFFLOAD,
          "            if param.ds_numel <= param_threshold:\n",
          "            if param.ds_numel < param_threshold:\n",
          "off-by-one: a parameter exactly at stage3_param_persistence_threshold is no longer persistent"),
    Fault("z3-epilogue-no-leftover-release", "coordinator", _STAGE3,
          "        self.parameter_offload.release_backward_leftovers()\n",
          "        pass\n",
          "dropped call: modules whose post-backward hook never fired keep their parameters gathered"),
    # ------------------------------------------------------------------ gradient reduction and accumulation
    Fault("z3-accumulate-from-second", "reduction", _STAGE3,
          "            if self.micro_step_id == 0:  # don't accumulate\n",
          "            if self.micro_step_id <= 1:  # don't accumulate\n",
          "off-by-one: ZeRO-3 overwrites instead of accumulating the second micro-step's gradient partition"),
    Fault("z3-micro-step-always", "reduction", _STAGE3,
          "        if self._epilogue_ran_this_backward:\n            self.micro_step_id += 1\n",
          "        self.micro_step_id += 1\n",
          "dropped condition: every forward counts as a micro-step, an eval forward included"),
    Fault("z3-contiguous-exact-fit", "reduction", _STAGE3,
          "        if self.contiguous_gradients and bucket.elements + param.grad.numel() <= self.reduce_bucket_size:\n",
          "        if self.contiguous_gradients and bucket.elements + param.grad.numel() < self.reduce_bucket_size:\n",
          "off-by-one: a gradient that exactly fills the bucket is not copied into the contiguous buffer"),
    Fault("z12-reduced-flags-kept", "reduction", _STAGE12,
          "        for i in range(len(self.params_already_reduced)):\n"
          "            self.params_already_reduced[i] = False\n",
          "",
          "missed reset: ZeRO-1/2's epilogue no longer clears the already-reduced flags"),
    Fault("z12-accumulate-copies", "reduction", _STAGE12,
          "                        accumulated_grad.add_(new_avg_grad)\n",
          "                        accumulated_grad.copy_(new_avg_grad)\n",
          "wrong operation: ZeRO-1's epilogue overwrites the accumulated gradients instead of adding"),
    Fault("z12-boundary-reduce-dropped", "reduction", _STAGE12,
          "        if self.partition_gradients or self.is_gradient_accumulation_boundary() or self.zenflow:\n",
          "        if self.partition_gradients or self.zenflow:\n",
          "dropped condition: ZeRO-1 with overlap_comm no longer reduces in the hook at the boundary"),
    Fault("z12-bucket-swap-dropped", "reduction", _STAGE12,
          "            if self.contiguous_gradients and self.overlap_comm:\n"
          "                # Swap index between 0 and 1\n"
          "                bucket.index = 1 - bucket.index\n",
          "",
          "dropped call: the double-buffered ipg bucket is no longer swapped after a reduce",
          cpu_blind="the second buffer only protects a reduce still running on another stream; the CPU "
                    "accelerator's streams are no-ops and gloo's reduce has finished when reduce_ipg_grads "
                    "returns, so the reused buffer is never still being read"),
    Fault("z12-zero-grad-keeps-accum", "reduction", _STAGE12,
          "                    p.grad = None  # epilogue and in step\n                    p.grad_accum = None\n",
          "                    p.grad = None  # epilogue and in step\n",
          "missed reset: zero_grad leaves ZeRO-1/2's grad_accum attribute set"),
    # ------------------------------------------------------------------ optimizer step, loss scaling, engine
    Fault("z12-clip-clamp-max", "step", _STAGE12,
          "            clip = torch.clamp(clip, min=1.0)\n            combined_scale = clip * self.loss_scale\n\n"
          "        for grad in grad_groups_flat:\n",
          "            clip = torch.clamp(clip, max=1.0)\n            combined_scale = clip * self.loss_scale\n\n"
          "        for grad in grad_groups_flat:\n",
          "wrong bound: ZeRO-1/2's clipping factor is capped at 1 instead of floored, scaling small gradients up"),
    Fault("z3-clip-ignores-loss-scale", "step", _STAGE3,
          "            clip = ((total_norm / self.loss_scale) + 1e-6) / self.clip_grad\n",
          "            clip = (total_norm + 1e-6) / self.clip_grad\n",
          "missed case: ZeRO-3's clipping compares the still loss-scaled norm with the threshold"),
    Fault("engine-gas-scaling-inverted", "step", _ENGINE,
          "            loss = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss\n",
          "            loss = loss / self.gradient_accumulation_steps() if not scale_wrt_gas else loss\n",
          "inverted condition: engine.backward no longer divides the loss by the accumulation steps"),
    Fault("engine-boundary-off-by-one", "step", _ENGINE,
          "                return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0\n",
          "                return self.micro_steps % self.gradient_accumulation_steps() == 0\n",
          "off-by-one: the accumulation boundary is the first micro-step of a step, not the last"),
    Fault("loss-scale-grows-on-overflow", "step", "runtime/fp16/loss_scaler.py",
          "                    next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)\n",
          "                    next_scale = max(self.cur_scale * self.scale_factor, self.min_scale)\n",
          "wrong operator: the dynamic loss scale grows after an overflow instead of halving"),
    Fault("bf16-clip-threshold", "step", "runtime/bf16_optimizer.py",
          "        if self.clip_grad > 0.:\n            clip_tensors_by_global_norm(",
          "        if self.clip_grad > 1.:\n            clip_tensors_by_global_norm(",
          "wrong constant: BF16_Optimizer clips only for thresholds above 1, DeepSpeed's default 1.0 included"),
    Fault("bf16-step-keeps-hp-grads", "step", "runtime/bf16_optimizer.py",
          "        self.update_lp_params()\n\n        self.clear_hp_grads()\n",
          "        self.update_lp_params()\n",
          "dropped call: BF16_Optimizer.step no longer clears the fp32 gradients it stepped with",
          cpu_blind="the engine is the only caller of BF16_Optimizer.step, and engine._take_model_step calls "
                    "optimizer.zero_grad() right after it whenever bf16 is enabled, which clears the fp32 "
                    "gradients (BF16_Optimizer.zero_grad -> clear_hp_grads): argued on 2 Dec after the fault "
                    "survived; equivalent through the engine whatever the device"),
    # ------------------------------------------------------------------ checkpoint save / load
    Fault("z12-load-from-bit16", "checkpoint", _STAGE12,
          "        if load_from_fp32_weights:\n            # option 2 from above\n",
          "        if not load_from_fp32_weights:\n            # option 2 from above\n",
          "inverted condition: ZeRO-1/2's load rebuilds the fp32 master weights from the 16-bit copies"),
    Fault("z3-load-skips-fp32-restore", "checkpoint", _STAGE3,
          "            curr_param.data.copy_(saved_param.data)\n",
          "            pass\n",
          "dropped call: ZeRO-3's load keeps the engine's fp32 partitions instead of the saved ones"),
    Fault("z3-16bit-state-dict-drops-frozen", "checkpoint", _ENGINE,
          "                            if param is None or (exclude_frozen_parameters and not param.requires_grad):\n",
          "                            if param is None or not param.requires_grad:\n",
          "missed case: the consolidated 16-bit state dict leaves frozen parameters out though not asked to"),
    *HELD_OUT,
)


def by_id() -> dict[str, Fault]:
    return {f.id: f for f in FAULTS}


__all__ = ["FAULTS", "HELD_OUT", "Fault", "RELEASE", "by_id"]
