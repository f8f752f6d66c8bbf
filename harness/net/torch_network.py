"""The blocks network a scenario describes (`Net`) and `build_model`, which builds either family.

Blocks of ``norm`` (LayerNorm) -> ``lin`` (Linear); each block plain, reentrant- or non-reentrant-
checkpointed; sub-modules trainable, frozen or unused; an optional fused head (`FusedHeadLoss`, the
TiledFusedLogitsLoss pattern: ``torch.autograd.backward`` inside a custom Function's forward, with
``head.weight`` not an input tensor of the Function).  Parameter names are ``blocks.{i}.norm.weight`` ...
``head.weight``, as in ``zerostate.model.network``.  Training-setup options: ``tie`` (block 0's Linear
applied again after the last block), ``external`` (the root module uses block 0's Linear weight itself: a
ZeRO-3 external parameter), ``outputs`` (tuple / dict) and ``losses`` (an auxiliary loss on ``aux``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from zerostate.harness.net import fp16
from zerostate.harness.net.llama import build_llama
from zerostate.model.scenario import Checkpoint, Family, Outputs, ParamKind, Scenario
from zerostate.tracing import marks

NetOutput = Any
"""What a forward returns: a tensor, ``(hidden, aux)``, ``{"out", "aux"}`` or an HF model output."""


def _call_block(blk: Block, x: torch.Tensor, skip_norm: bool) -> torch.Tensor:
    obs = marks.BLOCK_OBSERVER
    if obs is not None:
        obs[0](blk)
    try:
        return blk(x, skip_norm=skip_norm)
    finally:
        if obs is not None:
            obs[1](blk)


class Block(nn.Module):
    """x -> lin(norm(x)); a sub-module marked "unused" is skipped by forward."""

    def __init__(self, width: int, norm_kind: ParamKind, lin_kind: ParamKind) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)
        self.use_norm = norm_kind is not ParamKind.UNUSED
        self.use_lin = lin_kind is not ParamKind.UNUSED
        self.norm_skipped = False

    def forward(self, x: torch.Tensor, skip_norm: bool = False) -> torch.Tensor:
        self.norm_skipped = skip_norm  # the tracer reads it: a skipped norm's parameters are not saved
        if self.use_norm and not skip_norm:
            x = self.norm(x)
        if self.use_lin:
            x = self.lin(x)
        return x


class FusedHeadLoss(torch.autograd.Function):
    """A loss that runs its own backward inside forward (TiledFusedLogitsLoss pattern).

    ``head`` is a Module, not an input tensor: its weight's gradient is accumulated during
    *forward*, by ``torch.autograd.backward``, before the user ever calls backward.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        scale = fp16.loss_scale()  # fp16: the head's gradient is loss-scaled
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(True)
            loss = head(h).pow(2).mean()
            obs = marks.PRE_BACKWARD_OBSERVER
            if obs is not None:
                obs[0]()
            torch.autograd.backward(loss * scale if scale != 1.0 else loss)
            if obs is not None:
                obs[1]()
        assert h.grad is not None
        ctx.save_for_backward(h.grad if scale == 1.0 else h.grad / scale)
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (gh,) = ctx.saved_tensors
        return gh * grad, None


class Net(nn.Module):
    def __init__(self, sc: Scenario) -> None:
        super().__init__()
        w = sc.width
        self.blocks = nn.ModuleList(Block(w, b.norm, b.lin) for b in sc.blocks)
        self.ckpt = [b.checkpoint for b in sc.blocks]
        self.head = nn.Linear(w, w, bias=False) if sc.fused_head else None
        self.tie = sc.tie
        self.external = sc.external
        self.outputs = sc.outputs
        # registered last: the trailing parameter of every optimizer group (DeepSpeed #8279)
        self.empty = nn.Parameter(torch.zeros(0)) if sc.empty_param else None

    def block(self, i: int) -> Block:
        blk = self.blocks[i]
        assert isinstance(blk, Block)
        return blk

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> NetOutput:
        """``skip``: blocks whose (frozen) norm this forward skips, a data-dependent branch."""
        grad = torch.is_grad_enabled()
        for i, (blk, ck) in enumerate(zip(self.blocks, self.ckpt, strict=True)):
            s = i in skip
            if grad and ck is Checkpoint.REENTRANT:
                x = checkpoint(_call_block, blk, x, s, use_reentrant=True)
            elif grad and ck is Checkpoint.NON_REENTRANT:
                x = checkpoint(_call_block, blk, x, s, use_reentrant=False)
            else:
                x = blk(x, skip_norm=s)
        if self.tie:  # the same Linear module a second time in one forward (a tied embedding / LM head)
            x = self.block(0).lin(x)
        if self.external:  # the root module computes with a parameter block 0's Linear owns
            x = x + 0.5 * torch.nn.functional.linear(x, self.block(0).lin.weight)
        if "late" in self._modules:  # attached after deepspeed.initialize (`attach_late_module`)
            x = self.get_submodule("late")(x)
        if self.empty is not None:  # used in forward: its gradient, of no elements, reaches ZeRO's hooks
            x = x + self.empty.sum()
        aux = x.mean(-1)
        if self.head is not None:
            x = FusedHeadLoss.apply(x, self.head) if grad else self.head(x).pow(2).mean()
        if self.outputs is Outputs.TUPLE:
            return x, aux
        if self.outputs is Outputs.DICT:
            return {"out": x, "aux": aux}
        return x


def blocks_of(module: nn.Module) -> Net:
    """The blocks network a backend trains (the engine wraps it; ``module`` is its ``module``)."""
    assert isinstance(module, Net), f"a blocks-family scenario trains a Net, not {type(module).__name__}"
    return module


def attach_late_module(sc: Scenario, module: nn.Module) -> None:
    """``late_module``: attach a parameterless module to the network after ``deepspeed.initialize`` (both
    backends call it once the model is built or wrapped; the oracle's is a no-op).  DeepSpeed #8009: before
    0.19.1 ZeRO-3's forward hooks meet its plain-dict ``_parameters`` (``'dict' object has no attribute
    '_in_forward'``)."""
    if sc.late_module:
        module.late = nn.Identity()


def build_model(sc: Scenario) -> nn.Module:
    """The network with seeded, non-trivial initial values; frozen parameters have requires_grad False."""
    if sc.family is Family.LLAMA:
        return build_llama(sc)
    torch.manual_seed(sc.seed)
    net = Net(sc)
    with torch.no_grad():
        for i in range(len(net.blocks)):
            net.block(i).norm.weight.normal_(1.0, 0.2)
            net.block(i).norm.bias.normal_(0.0, 0.2)
    for i, b in enumerate(sc.blocks):
        for sub, kind in (("norm", b.norm), ("lin", b.lin)):
            if kind is ParamKind.FROZEN:
                for p in net.block(i).get_submodule(sub).parameters():
                    p.requires_grad_(False)
    return net


__all__ = ["Block", "FusedHeadLoss", "Net", "NetOutput", "attach_late_module", "blocks_of", "build_model"]
