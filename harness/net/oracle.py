"""The oracle: the scenario's network and schedule trained with plain PyTorch and the same optimizer
(`TorchBackend`, `oracle_params`).

fp16 and bf16 are mixed precision as DeepSpeed does it: the model the optimizer updates is the fp32 master
copy; forward and backward run on a 16-bit copy; at the step boundary the gradients are taken into fp32,
clipped, the master parameters stepped and copied back into the 16-bit copy.  fp16 adds DeepSpeed's dynamic
loss scaling (`fp16.LossScale`): the loss is multiplied by the current scale, a non-finite gradient skips the
step (the scale halves), the others are unscaled.  bf16's master copy starts as DeepSpeed's does, from the
bf16-rounded parameters, and with ``fp32_grad_accum`` each micro-step's gradient is added into fp32 at once
(DeepSpeed's ``grad_accum_dtype``); without it they accumulate in bf16 until the boundary."""

from __future__ import annotations

import copy
from dataclasses import replace
from collections.abc import Callable, Sequence
from typing import TypedDict

import torch
import torch.nn as nn

from zerostate.harness.net import fp16
from zerostate.harness.net.arithmetic_twin import ArithmeticTwin, differentiate
from zerostate.harness.net.compare import Params
from zerostate.harness.net.counterfactual import (MECHANISMS, Contribution, Mechanism, after_unexited_backward,
                                                  bucket_tail, offloaded, reduced_again, stuck_steps,
                                                  unexited_at_boundary, zero1_owners)
from zerostate.harness.net.dist import rank_rows, world_size
from zerostate.harness.net.config import fp16_section, make_optimizer, make_scheduler, param_groups
from zerostate.harness.net.torch_network import NetOutput, attach_late_module, blocks_of, build_model
from zerostate.harness.net.schedule import generation_output, loss_of, no_grad_forward, rows_share, run_schedule
from zerostate.findings.tolerance import rounding_eps
from zerostate.model.scenario import BackwardKind, Family, Gather, Precision, Scenario, Scheduler


HALF = {Precision.FP16: torch.float16, Precision.BF16: torch.bfloat16}
"""The dtype of the copy forward and backward run on, by mixed precision."""


def stays_fp32(sc: Scenario, name: str) -> bool:
    """Mixed precision: whether DeepSpeed's engine keeps parameter ``name`` in fp32: with ``zero_init`` only
    what ``zero.Init`` made is cast, and PEFT's LoRA adapters are made after it (`engine.build_zero_init`)."""
    return sc.zero_init and sc.stage == 3 and sc.lora and "lora_" in name


class NothingToDifferentiate(Exception):
    """A micro-step's loss has no ``grad_fn``: no parameter that requires grad reaches it and the input does
    not require grad.  PyTorch's ``backward`` refuses it ("element 0 of tensors does not require grad and does
    not have a grad_fn"), and so does DeepSpeed's ``engine.backward`` ("loss must be a scalar tensor", its check
    that the loss has a ``grad_fn``) and a PyTorch-style backward through the engine (torch's error): the
    scenario is not training code either side can run, so it is skipped, not judged."""


class OracleInfo(TypedDict, total=False):
    """What `oracle_params` reports beside the parameters."""

    initial: Params
    """The parameters before training."""
    skipped: list[int]
    """fp16: the train steps the loss scaler skipped."""
    scales: list[float]
    """fp16: the scale each train step ran with."""
    scale: float
    """fp16: the scale after the last train step (the one the next step would run with)."""
    generated: list[torch.Tensor | None]
    """The output of each generation (`reregister`), this rank's rows."""
    reads: list[torch.Tensor]
    """Every parameter at each ``gather: read``, flattened one after another."""
    counterfactuals: list[Counterfactuals]
    """Each train step's counterfactual updates (`Counterfactuals`); empty ones for a step the scaler skipped."""
    noise: list[Params]
    """Mixed precision: each train step's `TorchBackend.noise`; empty in fp32."""


class Counterfactuals(TypedDict):
    """The update the oracle's step (its optimizer, clipping included) would have made from a part of the step's
    gradient, from where the step started: what lets the oracle's difference say which backwards' gradients
    DeepSpeed's update holds (`harness.evidence.oracle_diff`)."""

    last_only: Params
    """From the step's last backward's gradient alone (the others' zero)."""
    but_last: Params
    """From the step's gradient without the last backward's share."""


class TorchBackend:
    """The oracle's `schedule.Backend`: plain PyTorch, the same optimizer, DeepSpeed's loss scaling in fp16."""

    def __init__(self, sc: Scenario, model: nn.Module, mechanisms: Sequence[Mechanism] = ()) -> None:
        self.master, self.gas = model, sc.gas
        self.mechanisms = tuple(mechanisms)
        """Counterfactual: the known bugs' mechanisms this reference applies (`counterfactual`); none for the
        correct reference."""
        self._contributions: list[Contribution] = []
        self._seen: Params = {}
        self._micro = 0
        self._prev: Params = {}
        """Counterfactual: the gradient the step before stepped with, clipped (a stale one applied again); after an
        overflowed step, what the step wrote instead (`_overflowed`)."""
        self._overflowed: set[str] = set()
        """Counterfactual (``overflowed-replayed``): the parameters whose ``_prev`` an overflowed step wrote: its
        gradient still scaled, non-finite where it overflowed."""
        self._raw: Params = {}
        """This step's 16-bit gradients as backward made them (scaled), kept where the step overflowed."""
        self._stale: set[str] = set()
        """Counterfactual: the parameters whose gradient this step is a frozen parameter's stale one."""
        self._scale_before = 1.0
        self._offloaded = offloaded(sc)
        self._stuck = stuck_steps(sc)
        self._hooked = False
        """Counterfactual: the output hooks divide this backward's gradient by gas (`_hook_outputs`)."""
        self._pytorch_style = False
        """Counterfactual: the backward being made is PyTorch-style (`Contribution.pytorch_style`)."""
        self.clip = float(sc.gradient_clipping)
        self.opt = make_optimizer(sc, param_groups(sc, model))
        self.scheduler = make_scheduler(sc, self.opt)
        self._engine_schedules = sc.scheduler is Scheduler.INITIALIZE
        """DeepSpeed steps a scheduler passed to initialize with each applied optimizer step (not on an overflow);
        the loop steps its own after every boundary (`lr_step`)."""
        self.llama = sc.family is Family.LLAMA
        self.scaler: fp16.LossScale | None = None
        self.model = model
        self.steps = 0
        """fp16: train steps the loss scaler has seen."""
        self.train_step = 0
        """The train step the loop is in (counted at each boundary)."""
        self.stage = sc.stage
        self.generated: list[torch.Tensor | None] = []
        """The output of each generation (`reregister`), this rank's rows."""
        self.reads: list[torch.Tensor] = []
        """Every parameter at each ``gather: read``, flattened one after another."""
        self.counterfactuals: list[Counterfactuals] = []
        """Each train step's counterfactual updates (`Counterfactuals`; empty in a counterfactual reference)."""
        self.noise: list[Params] = []
        """Mixed precision: each train step's noise (`_step_references`; {} for a step the scaler skipped).  A
        counterfactual reference measures its own, on the gradient its mechanisms made: an element near zero in one
        is not in the other."""
        self._rounding = rounding_eps(sc)
        self._last: Params = {}
        self.half = HALF.get(sc.precision)
        """The 16-bit dtype forward and backward run in (mixed precision), else None."""
        self.fp32_accum = sc.precision is Precision.BF16 and sc.fp32_grad_accum
        self.sc = sc
        self.world = world_size()
        self._by_rank = self.world > 1 and any(m.outside_partition for m in self.mechanisms)
        """Counterfactual: each backward's contribution is split into the ranks' shares (`_rank_shares`)."""
        self._owners: dict[str, frozenset[int]] = {}
        self._cpu_buffer: Params = {}
        """Counterfactual: the CPU accumulation buffer the later backwards of a step leave (`Mechanism.cpu_buffer`)."""
        """Counterfactual: the ranks whose ZeRO-1 partition holds some of each parameter."""
        if self._by_rank:
            names = {id(p): n for n, p in model.named_parameters()}
            self._owners = zero1_owners([[(names[id(p)], p.numel()) for p in g["params"] if p.numel() > 0]
                                         for g in self.opt.param_groups], self.world)
        self._x: tuple[torch.Tensor, tuple[int, ...]] | None = None
        """Counterfactual: the micro-step's input and skipped blocks (the ranks' shares recompute its forward)."""
        self._shares: tuple[Params, ...] = ()
        self._order: list[str] = []
        """Counterfactual: the parameters in the order the backward being made accumulated them
        (`Contribution.order`)."""
        if self.half is not None:
            self.model = copy.deepcopy(model).to(self.half)
            for n, q in self.model.named_parameters():
                if stays_fp32(sc, n):
                    q.data = q.data.float()
        if sc.precision is Precision.FP16:
            scaler = self.scaler = fp16.LossScale(fp16_section(sc), unit=any(m.unit_loss_scale for m in mechanisms))
            fp16.set_loss_scale(lambda: scaler.scale)
        attach_late_module(sc, self.model)
        self._twin = ArithmeticTwin(self._forward_on, lambda res: loss_of(sc, res), self._register_output_hooks) \
            if self.half is not None else None
        """Mixed precision: each micro-step again in fp32 arithmetic (`arithmetic_twin`), for the update's noise."""
        if any(m.initial_zero_step for m in self.mechanisms):
            self._initial_zero_step()

    def _initial_zero_step(self) -> None:
        """What FP16_Optimizer / FP16_UnfusedOptimizer's ``initialize_optimizer_states`` does: one optimizer step
        with a zero gradient for every parameter, to allocate the optimizer's state."""
        held = [q for g in self.opt.param_groups for q in g["params"]]
        for q in held:
            q.grad = torch.zeros_like(q)
        self.opt.step()
        for q in held:
            q.grad = None

    def module(self) -> nn.Module:
        return self.model

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if self.half is not None and x.is_floating_point():
            x = x.detach().to(self.half).requires_grad_(x.requires_grad)
        return x

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> NetOutput:
        if self.mechanisms:
            self._seen = self._total()
        x = self._input(x)
        if self._by_rank:
            self._x = (x, tuple(skip))
        if any(m.own_rows for m in self.mechanisms):
            x = rank_rows(x).detach().requires_grad_(x.requires_grad)
        if self._twin is not None:
            self._twin.forward(x, tuple(skip), self._grads())
        res = self._forward_on(self.model, x, tuple(skip))
        self._register_output_hooks(res, lambda: self._hooked)
        return res

    def _forward_on(self, model: nn.Module, x: torch.Tensor, skip: tuple[int, ...]) -> NetOutput:
        if self.llama:
            res: NetOutput = model(input_ids=x, labels=x)
            return res
        return model(x, skip=skip) if skip else model(x)

    def _register_output_hooks(self, res: object, divide: Callable[[], bool]) -> None:
        """Counterfactual: each output tensor divides its gradient by gas while ``divide()`` says so (DeepSpeed's
        output backward hooks, `Mechanism.output_hooks`); nothing for a reference without them."""
        if not any(m.output_hooks for m in self.mechanisms):
            return
        if isinstance(res, torch.Tensor):
            if res.requires_grad:
                res.register_hook(lambda g: g / self.gas if divide() else g)
        elif isinstance(res, (tuple, list)):
            for r in res:
                self._register_output_hooks(r, divide)
        elif isinstance(res, dict) or hasattr(res, "values"):
            for r in res.values():
                self._register_output_hooks(r, divide)

    def reregister(self, x: torch.Tensor | None = None) -> None:
        """Plain PyTorch has no hooks to remove: only the generation of TRL's unwrap (ZeRO-3, as the engine
        side does it), whose output this rank's share of is kept (``generated``) to compare with DeepSpeed's."""
        if x is None or self.stage != 3:
            return
        self.generated.append(rows_share(generation_output(no_grad_forward(self.model, self._input(x), self.llama))))

    def gather(self, what: Gather, block: int | None) -> None:
        """Plain PyTorch has nothing to gather; an edit halves the Linear weight of ``block`` the optimizer steps
        (the master copy, and the 16-bit copy from it).  A read records every parameter of the model forward runs
        on (DeepSpeed's read is of the engine's module: the 16-bit copy in mixed precision)."""
        if what is Gather.READ:
            self.reads.append(torch.cat([p.detach().float().flatten() for p in self.model.parameters()]))
        if what is not Gather.EDIT or block is None:
            return
        with torch.no_grad():
            if any(m.edit_model_only for m in self.mechanisms) and self.model is not self.master:
                blocks_of(self.model).block(block).lin.weight.mul_(0.5)  # counterfactual: the master keeps its value
                return
            blocks_of(self.master).block(block).lin.weight.mul_(0.5)
            if self.model is not self.master:
                blocks_of(self.model).block(block).lin.weight.copy_(blocks_of(self.master).block(block).lin.weight)

    def save_load(self, step: int) -> None:
        return None  # the oracle is unchanged: a checkpoint round trip must not change training

    def resume(self, step: int) -> None:
        return None  # nor a resume into a fresh engine

    def eval_forward(self, x: torch.Tensor) -> None:
        no_grad_forward(self.model, self._input(x), self.llama)

    def backward(self, kind: BackwardKind, out: torch.Tensor, loss: torch.Tensor, fused: bool, part: float = 1.0,
                 keep: bool = False) -> None:
        """``part``: the share of the loss this backward takes; ``keep``: retain_graph (two backwards)."""
        source = loss if kind is not BackwardKind.NONSCALAR or fused else out
        if not source.requires_grad:
            raise NothingToDifferentiate(
                f"train step {self.train_step}'s {'output' if source is out and out is not loss else 'loss'} has "
                "nothing to differentiate (no parameter that requires grad reaches it and the input does not "
                "require grad): PyTorch's backward and DeepSpeed's engine.backward both refuse it")
        scale = self.scaler.scale if self.scaler is not None and not self._loss_unscaled() else 1.0
        pytorch_style = kind is not BackwardKind.ENGINE
        self._hooked = any(m.output_hooks == "all" or (m.output_hooks == "pytorch-style" and pytorch_style)
                           for m in self.mechanisms)
        gas = 1 if self._hooked else self.gas  # the hooks divide instead
        self._pytorch_style = pytorch_style
        before = self._grads()
        if self.mechanisms:
            self._note_backward_start()
        if self._twin is not None:
            self._twin.backward(kind, fused, part, gas, scale, keep, self._hooked)
        handles = self._record_hook_order() if any(m.bucket_tail for m in self.mechanisms) else []
        try:
            differentiate(kind, out, loss, fused, part, gas, scale, keep)
        finally:
            for h in handles:
                h.remove()
        self._last = {n: g - before[n] if n in before else g for n, g in self._grads().items()}
        if self._by_rank:
            self._shares = self._rank_shares(kind, fused, part / gas * scale)
        if self.mechanisms:
            self._note_backward_end()

    def _rank_shares(self, kind: BackwardKind, fused: bool, factor: float) -> tuple[Params, ...]:
        """Counterfactual: each rank's share of the backward just made -- the gradient of its rows of the global
        batch (its own loss, times ``factor``: the backward's part, over gas, times the loss scale) over the world
        size, fp32 and unscaled -- recomputed by a forward and backward of those rows; the gradients the
        backwards accumulated are put back after."""
        assert self._x is not None
        x, skip = self._x
        params = list(self.model.named_parameters())
        saved = [q.grad for _, q in params]
        unscale = 1.0 / self.scaler.scale if self.scaler is not None and not self._loss_unscaled() else 1.0
        shares: list[Params] = []
        try:
            for rows in x.detach().chunk(self.world):
                for _, q in params:
                    q.grad = None
                xs = rows.clone().requires_grad_(x.requires_grad)
                if self.llama:
                    res: NetOutput = self.model(input_ids=xs, labels=xs)
                else:
                    res = self.model(xs, skip=skip) if skip else self.model(xs)
                out, loss = loss_of(self.sc, res)
                if kind is BackwardKind.NONSCALAR:
                    g = torch.ones_like(loss) if fused else (2 * out / out.numel()).detach()
                    (loss if fused else out).backward(gradient=g * factor)
                else:
                    (loss * factor).backward()
                shares.append({n: q.grad.detach().float() * unscale / self.world for n, q in params
                               if q.grad is not None})
        finally:
            for (_, q), kept in zip(params, saved, strict=True):
                q.grad = kept  # type: ignore[assignment]  # None where no backward had reached it
        return tuple(shares)

    def _grads(self) -> Params:
        """The gradients the backwards accumulated so far (fp16: scaled, on the fp16 copy)."""
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def _updates_from(self, grad_sets: Sequence[Params]) -> list[Params]:
        """What this step's optimizer (clipping included) does with each of ``grad_sets``, each from where the step
        starts: on clones of the parameters it holds and of its state, one optimizer of the same kind over them
        (the model is not copied: the parameters in no group do not move)."""
        held = [p for g in self.opt.param_groups for p in g["params"]]
        clones = {id(p): p.detach().clone() for p in held}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [clones[id(p)] for p in g["params"]]}
                  for g in self.opt.param_groups]  # every group carries its own hyperparameters (lr as scheduled)
        opt = type(self.opt)(groups)  # type: ignore[call-arg]  # SGD and AdamW: lr has a default
        named = list(self.master.named_parameters())
        out: list[Params] = []
        for grads in grad_sets:
            opt.state.clear()
            with torch.no_grad():
                for n, p in named:
                    c = clones.get(id(p))
                    if c is None:
                        continue
                    c.copy_(p)
                    c.grad = grads[n].clone() if n in grads else None
                    if p in self.opt.state:
                        opt.state[c] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                        for k, v in self.opt.state[p].items()}
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(list(clones.values()), self.clip)
            opt.step()
            out.append({n: clones[id(p)] - p.detach() if id(p) in clones else torch.zeros_like(p) for n, p in named})
        return out

    def _step_references(self, unscale: float, last: Params, spread: Params) -> tuple[Counterfactuals, Params]:
        """What this step's optimizer (clipping included) makes of parts and moves of the step's gradient as the
        master parameters hold it now (a counterfactual reference's: its mechanisms applied), each from where the
        step starts, in one `_updates_from`: the correct reference's `Counterfactuals` (``last``: the last
        backward's share as the 16-bit copy got it, ``unscale`` takes it to the masters' units; a counterfactual
        reference computes none, nothing reads them) and, in mixed precision, the `noise` of its update.

        The noise: how much of each element of each parameter's update the 16-bit precision leaves undetermined --
        the larger change of the update when every element of the step's gradient moves by the 16-bit unit
        roundoff times the largest element of its tensor, or by the tensor's ``spread`` where that is more (the
        16-bit arithmetic's error of the step's gradient, `arithmetic_twin`), in a fixed random direction and in
        its opposite.  DeepSpeed's gradient goes through other 16-bit kernels than this one, so it differs from it
        by about that much; for SGD, and for Adam where an element is well above the rounding, the change is a
        small share of the update, but Adam turns a gradient element within the rounding of zero (near its
        ``eps``) into any share of the learning rate.  Measured on the gradient the reference steps with: a
        mechanism that drops a contribution can leave an element near zero that the correct gradient has far from
        it."""
        total = {n: p.grad.detach().clone() for n, p in self.master.named_parameters() if p.grad is not None}
        sets: list[Params] = []
        if not self.mechanisms:
            part = {n: last[n].float() * unscale if n in last else torch.zeros_like(g) for n, g in total.items()}
            sets += [part, {n: g - part[n] for n, g in total.items()}]
        held = {n: g for n, g in total.items() if g.numel() > 0}
        if self._rounding is not None and held:
            gen = torch.Generator().manual_seed(self.train_step)
            moves = {n: (torch.randint(0, 2, g.shape, generator=gen).to(g.dtype) * 2 - 1)
                     * torch.maximum(self._rounding * g.abs().max(), spread.get(n, torch.zeros(())).to(g.dtype))
                     for n, g in held.items()}
            sets += [held, *({n: g + sign * moves[n] for n, g in held.items()} for sign in (1.0, -1.0))]
        updates = self._updates_from(sets) if sets else []
        cf: Counterfactuals = {"last_only": {}, "but_last": {}}
        if not self.mechanisms:
            cf = {"last_only": updates[0], "but_last": updates[1]}
            updates = updates[2:]
        noise: Params = {}
        if updates:
            base, *both = updates
            for moved in both:
                for n in held:
                    change = (moved[n] - base[n]).abs()
                    noise[n] = torch.maximum(noise[n], change) if n in noise else change
        return cf, noise

    def boundary(self, boundary: bool) -> None:
        pass  # plain PyTorch: the step boundary is where the loop calls the optimizer

    def _take_grads(self) -> None:
        """bf16: the 16-bit copy's gradients added into the master parameters' (fp32), the copy's cleared."""
        for p, q in zip(self.master.parameters(), self.model.parameters(), strict=True):
            if q.grad is not None:
                p.grad = q.grad.float() if p.grad is None else p.grad + q.grad.float()
        self.model.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        """PyTorch's ``optimizer.zero_grad()``: every gradient of the step so far is gone (the 16-bit copy's and the
        fp32 masters' alike)."""
        if any(m.zero_grad_ignored for m in self.mechanisms):
            return
        if self._twin is not None:
            self._twin.zero_grad()
        self.model.zero_grad(set_to_none=True)
        self.master.zero_grad(set_to_none=True)

    def micro_done(self, boundary: bool) -> None:
        if self._twin is not None:
            # the master parameters' units: fp16's gradient is divided by the scale (the loss scaled or not)
            self._twin.measure(self.model, self._grads(), 1.0 / self.scaler.scale if self.scaler is not None else 1.0)
        if self.fp32_accum:
            self._take_grads()
        self._micro += 1
        if not boundary:
            return
        self.train_step += 1
        overflow, unscale = False, 1.0
        if self.half is torch.bfloat16:
            self._take_grads()
        if self.scaler is not None:
            grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
            # DeepSpeed checks the gradients of the parameters its optimizer holds: a parameter in no group
            # (``in_optimizer: false``) may overflow without skipping the step
            held = {id(q) for g in self.opt.param_groups for q in g["params"]}
            overflow = any(not torch.isfinite(grads[n]).all() for n, p in self.master.named_parameters()
                           if id(p) in held and n in grads) or self._buffer_overflows()
            self._raw = {n: g.detach().float().clone() for n, g in grads.items()} if overflow else {}
            unscale = 1.0 / self.scaler.scale
            for n, p in self.master.named_parameters():
                p.grad = None if overflow or n not in grads else grads[n].float() * unscale
            self.model.zero_grad(set_to_none=True)
            self._scale_before = self.scaler.scale
            self.scaler.update(overflow, self.steps)
            self.steps += 1
        last, self._last = self._last, {}
        self._stale = set()
        if self.mechanisms:
            self._apply_mechanisms(overflow)
        spread = self._twin.take() if self._twin is not None else {}
        cf, noise = (self._step_references(unscale, last, spread) if not overflow
                     else ({"last_only": {}, "but_last": {}}, {}))
        self.counterfactuals.append(cf)
        if self._rounding is not None:
            self.noise.append(noise)
        if overflow:  # the step is skipped
            return
        if self.clip > 0:
            self._clip()
        if self.mechanisms:  # a stale gradient replayed later is the one this step stepped with: clipped
            self._prev = {n: p.grad.detach().clone() for n, p in self.master.named_parameters() if p.grad is not None}
        self.opt.step()
        if self.scheduler is not None and self._engine_schedules:
            self.scheduler.step()
        self.opt.zero_grad(set_to_none=True)
        if self.sc.stage == 0 and self.half is None:
            # DeepSpeed's own choice at stage 0 in fp32 (engine._take_model_step calls engine.zero_grad): every
            # module parameter's gradient goes, in the optimizer or not -- the same set its clip's norm reads
            # (`_clip`), so a parameter in no group carries no gradient into the next step's norm
            self.master.zero_grad(set_to_none=True)
        if self.half is not None:
            with torch.no_grad():
                for p, q in zip(self.master.parameters(), self.model.parameters(), strict=False):
                    q.copy_(p)

    def lr_step(self) -> None:
        if self.scheduler is not None and not self._engine_schedules:
            self.scheduler.step()

    def _clip(self) -> None:
        """Clip by the global norm.  A gradient a frozen parameter's stale one replays (`_stale`) is in no norm:
        DeepSpeed's norm covers the step's own gradients; the coefficient scales every gradient it holds."""
        held = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        if self.sc.stage == 0 and self.half is None:
            # DeepSpeed's own choice at stage 0 in fp32 (engine.clip_fp32_gradients): the norm of every module
            # parameter with a gradient, in the optimizer or not, as HF Trainer clips model.parameters()
            held = [p for p in self.master.parameters() if p.grad is not None]
        if not self._stale:
            torch.nn.utils.clip_grad_norm_(held, self.clip)
            return
        names = {id(p): n for n, p in self.master.named_parameters()}
        own = [p.grad.norm() for p in held if names[id(p)] not in self._stale]
        norm = float(torch.linalg.vector_norm(torch.stack(own))) if own else 0.0
        coef = min(1.0, self.clip / (norm + 1e-6))
        for p in held:
            p.grad.mul_(coef)

    def params(self) -> Params:
        return {n: p.detach().clone() for n, p in self.master.named_parameters()}

    # ------------------------------------------------------------ counterfactual references
    def _loss_unscaled(self) -> bool:
        return any(m.loss_unscaled for m in self.mechanisms)

    def _total(self) -> Params:
        """The gradient the step has so far, in fp32 and unscaled (the master parameters' units)."""
        unscale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        out: Params = {}
        for (n, p), q in zip(self.master.named_parameters(), self.model.parameters(), strict=True):
            g = p.grad.detach().float().clone() if p.grad is not None else None
            if q is not p and q.grad is not None:
                add = q.grad.detach().float() * unscale
                g = add.clone() if g is None else g + add
            if g is not None:
                out[n] = g
        return out

    def _delta(self, before: Params) -> Params:
        now = self._total()
        return {n: g - before[n] if n in before else g for n, g in now.items()
                if n not in before or not torch.equal(g, before[n])}

    def _note_backward_start(self) -> None:
        made = self._delta(self._seen)  # what a backward inside the forward added since it began
        if made and not any(c.micro == self._micro for c in self._contributions):
            self._contributions.append(Contribution("forward", self._micro, 0, made,
                                                    stuck=self.train_step in self._stuck))
        self._seen = self._total()

    def _record_hook_order(self) -> list[torch.utils.hooks.RemovableHandle]:
        """Counterfactual (`Mechanism.bucket_tail`): note each parameter as this backward accumulates its gradient
        (the order DeepSpeed's gradient hooks see the same graph in)."""
        self._order = []
        return [q.register_post_accumulate_grad_hook(lambda _q, n=n: self._order.append(n))
                for (n, _), q in zip(self.master.named_parameters(), self.model.parameters(), strict=True)
                if q.requires_grad]

    def _note_backward_end(self) -> None:
        index = sum(c.kind == "backward" and c.micro == self._micro for c in self._contributions)
        self._contributions.append(Contribution("backward", self._micro, index, self._delta(self._seen),
                                                self._shares, self._pytorch_style, self.train_step in self._stuck,
                                                tuple(self._order)))
        self._shares, self._order = (), []
        self._seen = self._total()

    def _buffer_overflows(self) -> bool:
        """Counterfactual (`Mechanism.cpu_buffer`): a later backward of this boundary micro-step added the CPU buffer
        to the gradient DeepSpeed checks for overflow, so a non-finite gradient an overflowed step left in the buffer
        makes this step overflow as well -- and every later one with a second backward."""
        if not any(m.cpu_buffer for m in self.mechanisms):
            return False
        later = [c for c in self._contributions if c.kind == "backward" and c.index >= 1 and c.micro == self.gas - 1]
        return any(n in self._cpu_buffer and not torch.isfinite(self._cpu_buffer[n]).all()
                   for c in later for n in c.grads)

    def _add_cpu_buffer(self, contributions: Sequence[Contribution]) -> None:
        """Counterfactual (`Mechanism.cpu_buffer`): each backward after the first of the boundary micro-step adds the
        CPU buffer to its gradient and leaves the sum there; the step's gradient of a parameter its last backward
        reached gains what the buffer held before it."""
        later = sorted((c for c in contributions if c.kind == "backward" and c.index >= 1
                        and c.micro == self.gas - 1), key=lambda c: c.index)
        held_before: Params = {}
        for c in later:
            for n, g in c.grads.items():
                prev = self._cpu_buffer.get(n)
                if c is later[-1] and prev is not None:
                    held_before[n] = prev
                self._cpu_buffer[n] = g.clone() if prev is None else g + prev
        for n, p in self.master.named_parameters():
            if n in held_before and p.grad is not None:
                p.grad = p.grad + held_before[n]

    def _slot(self, n: str) -> torch.Tensor:
        """Counterfactual: what ZeRO-1/2's offloaded fp32 gradient partition still holds for ``n`` (nothing this step
        wrote it), as the step applies it: the step before's gradient (an overflowed step's, scaled, when it wrote
        last), unscaled once more by an fp16 step, which unscales the whole partition in place."""
        g = self._prev[n].clone()
        return g / self.scaler.scale if self.scaler is not None else g

    def _bucket_tail_applied(self, contributions: list[Contribution], rule: str) -> list[Contribution]:
        """The step's contributions as `Mechanism.bucket_tail` leaves them: each never-exited backward of the
        boundary micro-step without what it left in the reduce bucket; with ``overwritten``, every other backward
        without what that one's full buckets reduced."""
        out = list(contributions)
        for i, c in enumerate(contributions):
            if not unexited_at_boundary(c, self.gas):
                continue
            tail = bucket_tail([n for n in c.order if n in c.grads], {n: g.numel() for n, g in c.grads.items()},
                               self.sc.reduce_bucket_size)
            flushed = set(c.grads) - tail
            for j, o in enumerate(out):
                drop = tail if j == i else flushed if rule == "overwritten" and o.kind == "backward" else set()
                if drop:
                    out[j] = replace(o, grads={n: g for n, g in o.grads.items() if n not in drop})
        return out

    def _apply_mechanisms(self, overflow: bool) -> None:
        """At the step's boundary: the master parameters' gradient as the mechanisms make it."""
        contributions, self._contributions, self._micro = self._contributions, [], 0
        if overflow:
            if any(m.cpu_buffer for m in self.mechanisms):  # the backwards wrote the buffer before step() skipped
                self._add_cpu_buffer(contributions)
            if any(m.gradient == "overflowed-replayed" for m in self.mechanisms):
                # the backwards copied their scaled gradient into the fp32 partition; the skipped step unscaled
                # nothing and nothing clears it
                self._prev.update(self._raw)
                self._overflowed |= set(self._raw)
            return
        made = {n for c in contributions for n in c.grads}
        kept: list[Contribution] | None = None
        tail_rule = next((m.bucket_tail for m in self.mechanisms if m.bucket_tail), "")
        if tail_rule:
            contributions = self._bucket_tail_applied(contributions, tail_rule)
            kept = list(contributions)
        if any(m.in_forward_lost_after_unexited for m in self.mechanisms):
            step, after = self.train_step - 1, after_unexited_backward(self.sc)
            lost = [c for c in contributions if c.kind == "forward" and (step, c.micro) in after]
            kept = [c for c in contributions if c not in lost] if lost else None
        for m in sorted(self.mechanisms, key=lambda m: m.counts_again):  # drops first (`Mechanism.counts_again`)
            if m.keep is not None:
                chosen = m.keep(kept if kept is not None else contributions, self.gas)
                if chosen is not None:
                    kept = list(chosen)
        if kept is not None:
            summed: Params = {}
            for c in kept:
                for n, g in c.grads.items():
                    summed[n] = summed[n] + g if n in summed else g.clone()
            for n, p in self.master.named_parameters():
                p.grad = summed.get(n)
                if p.grad is None and n in made and self.sc.stage in (1, 2):
                    # ZeRO-1/2 step every parameter of their flat partition: one whose every contribution the
                    # mechanism lost is stepped with a zero gradient (Adam's state and step count move), not skipped;
                    # with optimizer offload its slot of the fp32 gradient partition, which nothing clears, still
                    # holds what the step before applied: that again (unscaled again by an fp16 step)
                    p.grad = self._slot(n) if self._offloaded and n in self._prev else torch.zeros_like(p)
        if any(m.cpu_buffer for m in self.mechanisms):
            self._add_cpu_buffer(contributions)
        if self._by_rank:
            # optimizer offload makes contiguous_gradients true (stage_1_and_2.py line 300): reduce_scatter decides
            extra = reduced_again(contributions, self.gas, self._owners, self.world,
                                  all_reduce=not self.sc.reduce_scatter)
            for n, p in self.master.named_parameters():
                if extra is not None and n in extra:
                    p.grad = extra[n].clone() if p.grad is None else p.grad + extra[n]
        held = {id(q) for g in self.opt.param_groups for q in g["params"]}
        # without a gradient this step: frozen for it, or in a module its forwards did not apply (`unused`)
        off = {id(q) for m in self.model.modules() if getattr(m, "use_lin", True) is False
               for q in m.lin.parameters()}  # type: ignore[union-attr]
        pairs = list(zip(self.master.named_parameters(), self.model.parameters(), strict=True))
        unused = {n for (n, p), q in pairs if q.requires_grad and id(q) in off}
        frozen = {n for (n, p), q in pairs if not q.requires_grad} | unused
        idle = not contributions
        for m in self.mechanisms:
            for n, p in self.master.named_parameters():
                stale = ((m.gradient == "stale-frozen" and n in frozen)
                         or (m.gradient in ("stale-idle", "stale-idle-unscaled-again") and idle)
                         or (m.gradient == "stale-unused" and n in unused)
                         or (m.gradient == "stale-frozen-unscaled-again" and n in frozen and n not in self._overflowed)
                         or (m.gradient == "overflowed-replayed" and n in frozen and n in self._overflowed))
                if stale and p.grad is None and n in self._prev:
                    if m.gradient in ("stale-frozen-unscaled-again", "overflowed-replayed"):
                        p.grad = self._slot(n)
                    else:
                        p.grad = self._prev[n].clone()
                    if m.gradient == "stale-idle-unscaled-again":
                        p.grad = p.grad / self._scale_before
                    if m.gradient.startswith("stale-frozen") or m.gradient == "overflowed-replayed":
                        self._stale.add(n)
                elif m.gradient == "replayed-when-lost" and kept == [] and n in self._prev:
                    p.grad = self._prev[n].clone()  # the fp32 partition still holds the step before's
                elif p.grad is None and id(p) in held and ((m.gradient == "zero-for-frozen" and n in frozen)
                                                          or (m.gradient == "zero-when-idle" and idle)):
                    p.grad = torch.zeros_like(p)
                elif p.grad is None:
                    continue
                elif m.gradient == "halved-when-scale-grows" and self.scaler is not None \
                        and self.scaler.scale > self._scale_before:
                    p.grad = p.grad * (self._scale_before / self.scaler.scale)
                elif m.gradient == "unscaled-by-65536":
                    p.grad = p.grad * 2.0 ** -16
        self._prev = {n: p.grad.detach().clone() for n, p in self.master.named_parameters() if p.grad is not None}
        self._overflowed = set()


def oracle_params(sc: Scenario, info: OracleInfo | None = None, mechanisms: Sequence[str] = ()) -> list[Params]:
    """Parameters after each train step, trained with plain PyTorch.  ``info``: `OracleInfo`; ``mechanisms``: a
    counterfactual reference, with those known bugs' mechanisms applied (`counterfactual.MECHANISMS`)."""
    model = build_model(sc)
    if sc.precision is Precision.BF16:  # DeepSpeed's fp32 master copy is made from the bf16-cast parameters
        with torch.no_grad():
            for n, p in model.named_parameters():
                if not stays_fp32(sc, n):
                    p.copy_(p.to(torch.bfloat16))
    if info is not None:
        info["initial"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        be = TorchBackend(sc, model, [MECHANISMS[m] for m in mechanisms])
        out: list[Params] = []
        run_schedule(sc, be, after_step=lambda i: out.append(be.params()))
    finally:
        fp16.set_loss_scale(None)
    if info is not None and be.scaler is not None:
        info["skipped"], info["scales"], info["scale"] = be.scaler.skipped, be.scaler.scales, be.scaler.scale
    if info is not None:
        info["generated"], info["counterfactuals"], info["reads"] = be.generated, be.counterfactuals, be.reads
        info["noise"] = be.noise
    return out


__all__ = ["HALF", "Counterfactuals", "NothingToDifferentiate", "OracleInfo", "TorchBackend", "oracle_params",
           "stays_fp32"]
