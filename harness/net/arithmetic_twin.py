"""The oracle's micro-step again in fp32 arithmetic: how far 16-bit arithmetic took each gradient.

In mixed precision, forward and backward run in 16 bits: every intermediate value (an activation, its gradient,
attention's softmax) is rounded, and each rounding reaches a parameter's gradient through every sum after it.  Where
such a sum cancels (a LoRA ``lora_B``'s gradient over the tokens), the rounding is relative to its terms, not to the
result, so a gradient element can be off by far more than the unit roundoff times the tensor's largest element
(the noise `TorchBackend` models on the step's gradient alone).  DeepSpeed's forward and backward run other 16-bit
kernels in other orders over the same values, so its gradient is off by about as much, independently.

`ArithmeticTwin` measures it on the reference itself: the micro-step's forward and each of its backwards replayed
on an fp32 copy of the 16-bit model (the same values, exact to fp32), and per tensor the largest element of the
difference between the 16-bit gradient and the fp32 one.  The oracle moves the step's gradient by at least that
much when it measures its update's noise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from zerostate.harness.net.compare import Params
from zerostate.harness.net.torch_network import NetOutput
from zerostate.model.scenario import BackwardKind


def differentiate(kind: BackwardKind, out: torch.Tensor, loss: torch.Tensor, fused: bool, part: float, gas: int,
                  scale: float, keep: bool) -> None:
    """One backward of the loop: of the loss (or, non-scalar, of the output with the squared mean's gradient, or of
    a fused head's loss tensor with ones) times the backward's ``part`` of the loss, over ``gas``, times the loss
    ``scale``, in that order, as DeepSpeed's engine does: in fp16 the product's own backward multiplies by the
    scale alone (65536 is beyond fp16, so a scale of 2^16 overflows there however small the loss)."""
    if kind is BackwardKind.NONSCALAR:
        g = torch.ones_like(loss) if fused else (2 * out / out.numel()).detach()
        (loss if fused else out).backward(gradient=part * g / gas * scale, retain_graph=keep)
    else:
        (part * loss / gas * scale if scale != 1.0 else part * loss / gas).backward(retain_graph=keep)


@dataclass(frozen=True)
class _Backward:
    kind: BackwardKind
    fused: bool
    part: float
    gas: int
    scale: float
    keep: bool
    hooked: bool
    """The reference's output hooks divide this backward by gas (a counterfactual's `Mechanism.output_hooks`)."""


Forward = Callable[[nn.Module, torch.Tensor, tuple[int, ...]], NetOutput]
"""The reference's forward of a model on the input it fed and the blocks it skipped."""
Loss = Callable[[NetOutput], tuple[torch.Tensor, torch.Tensor]]
HookOutputs = Callable[[NetOutput, Callable[[], bool]], None]
"""Registers the reference's output hooks on a forward's result, dividing while the callable says so."""


class ArithmeticTwin:
    """Per train step, each tensor's largest 16-bit arithmetic error of its gradient (`spread`), in the fp32
    master parameters' units, summed over the step's micro-steps."""

    def __init__(self, forward: Forward, loss: Loss, hook_outputs: HookOutputs) -> None:
        self._forward, self._loss, self._hook_outputs = forward, loss, hook_outputs
        self._input: tuple[torch.Tensor, bool, tuple[int, ...]] | None = None
        self._before: Params = {}
        self._calls: list[_Backward | None] = []
        """The micro-step's backwards in order; None where the loop cleared the gradients between two."""
        self.spread: Params = {}

    def forward(self, fed: torch.Tensor, skip: tuple[int, ...], grads: Params) -> None:
        """The micro-step's forward: the input as the 16-bit model got it, and the gradients it starts from."""
        self._input, self._before, self._calls = (fed.detach(), fed.requires_grad, tuple(skip)), grads, []

    def backward(self, kind: BackwardKind, fused: bool, part: float, gas: int, scale: float, keep: bool,
                 hooked: bool) -> None:
        self._calls.append(_Backward(kind, fused, part, gas, scale, keep, hooked))

    def zero_grad(self) -> None:
        self._calls.append(None)
        self._before = {}

    def measure(self, model: nn.Module, grads: Params, unscale: float) -> None:
        """At the micro-step's end (``grads``: the 16-bit model's gradients now, before anything moves them): the
        micro-step replayed on an fp32 copy of ``model``; each tensor's largest difference, times ``unscale``, is
        added to its `spread`."""
        if self._input is None or not self._calls:
            self._input = None
            return
        twin = copy.deepcopy(model).float()
        twin.zero_grad(set_to_none=True)
        fed, requires_grad, skip = self._input
        self._input = None
        x = fed.float().requires_grad_(requires_grad) if fed.is_floating_point() else fed
        hooked = [False]
        with torch.enable_grad():
            res = self._forward(twin, x, skip)
            self._hook_outputs(res, lambda: hooked[0])
            out, loss = self._loss(res)
            for call in self._calls:
                if call is None:
                    twin.zero_grad(set_to_none=True)
                    continue
                hooked[0] = call.hooked
                differentiate(call.kind, out, loss, call.fused, call.part, call.gas, call.scale, call.keep)
        for (n, q), t in zip(model.named_parameters(), twin.parameters(), strict=True):
            if t.grad is None or n not in grads or q.numel() == 0:
                continue
            mine = grads[n].float() - self._before[n].float() if n in self._before else grads[n].float()
            d = (mine - t.grad).abs().max() * unscale
            self.spread[n] = self.spread[n] + d if n in self.spread else d

    def take(self) -> Params:
        """The step's spread, cleared for the next step."""
        out, self.spread = self.spread, {}
        return out


__all__ = ["ArithmeticTwin", "differentiate"]
