"""The one training loop (`run_schedule`), parameterised by a `Backend`: the DeepSpeed engine
(`engine.DeepSpeedBackend`) or plain PyTorch (`oracle.TorchBackend`).  DeepSpeed divides by
``gradient_accumulation_steps`` itself (``engine.backward`` scales the loss, the output hooks scale
PyTorch-style gradients); the oracle divides explicitly.  Also the inputs (`batch`) and the no-grad
forward both backends' evaluations and generations use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from zerostate.harness.net.config import BATCH
from zerostate.harness.net.dist import rank_rows, world_size
from zerostate.harness.net.llama import SEQ, VOCAB
from zerostate.harness.net.torch_network import NetOutput, blocks_of
from zerostate.model.scenario import BackwardKind, Family, Gather, Scenario, Scheduler


class Mark(Protocol):
    """Observes a schedule point (the tracer's marks): ``mark("step", step=i)`` ..."""

    def __call__(self, what: str, **info: Any) -> None: ...


class Backend(Protocol):
    """What the loop drives: the engine or the oracle."""

    def module(self) -> nn.Module:
        """The network it trains (the engine's ``module``)."""
        ...

    def save_load(self, step: int) -> Any:
        """A checkpoint round trip before train step ``step``: its record (`checkpoint.round_trip`), or None."""
        ...

    def resume(self, step: int) -> Any:
        """HF's resume into a fresh engine before train step ``step``: its record, or None."""
        ...

    def reregister(self, x: torch.Tensor | None = None) -> None: ...

    def gather(self, what: Gather, block: int | None) -> None:
        """The loop's own ``GatheredParameters`` context (`Gather`): ``block`` is the one an edit halves the Linear
        weight of."""
        ...

    def eval_forward(self, x: torch.Tensor) -> None: ...

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> NetOutput: ...

    def boundary(self, boundary: bool) -> None: ...

    def backward(self, kind: BackwardKind, out: torch.Tensor, loss: torch.Tensor, fused: bool, part: float = 1.0,
                 keep: bool = False) -> None: ...

    def zero_grad(self) -> None:
        """The loop's ``zero_grad`` between two backwards of one retained graph (`MicroStep.zero_grad`)."""
        ...

    def micro_done(self, boundary: bool) -> None: ...

    def lr_step(self) -> None:
        """``scheduler: user``: the loop's ``scheduler.step()`` after a boundary ``engine.step()``."""
        ...


@runtime_checkable
class _ModelOutput(Protocol):
    """A Hugging Face model's output (a llama's forward)."""

    logits: torch.Tensor


def global_rows() -> int:
    """The global batch's rows: `BATCH`, or one per rank where there are more ranks (world size 4, 8), so every
    rank has an equal share; world sizes 1 and 2 keep `BATCH` rows, and with them their draws' inputs."""
    ws = world_size()
    return BATCH if ws <= BATCH else ws


def batch(sc: Scenario, step: int, micro: int, eval_: bool = False) -> torch.Tensor:
    """The input of one micro-step (or of the step's eval forward / generation): seeded by the scenario."""
    g = torch.Generator().manual_seed(1000003 * sc.seed + 1009 * step + 2 * micro + int(eval_))
    rows = global_rows()
    if sc.family is Family.LLAMA:
        return torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    x = torch.randn(rows, sc.width, generator=g)
    if sc.input_requires_grad and not eval_:
        x.requires_grad_(True)
    return x


def no_grad_forward(module: nn.Module, x: torch.Tensor, llama: bool) -> NetOutput:
    """One forward of ``module`` in eval mode without autograd (an eval forward, a generation), its output."""
    module.eval()
    with torch.no_grad():
        out = module(input_ids=x) if llama else module(x)
    module.train()
    return out


def generation_output(res: NetOutput) -> torch.Tensor:
    """The tensor a generation forward produced: a llama's logits, the blocks network's main output."""
    if isinstance(res, _ModelOutput):
        return res.logits.detach()
    if isinstance(res, dict):
        return res["out"].detach()
    return (res[0] if isinstance(res, tuple) else res).detach()


def rows_share(out: torch.Tensor) -> torch.Tensor | None:
    """This rank's share of the oracle's output of the whole batch: its rows; None for a scalar (a fused
    head's loss) at world size > 1, which each rank computes over its own rows only (not compared)."""
    if out.dim() == 0:
        return None if world_size() > 1 else out.float()
    return rank_rows(out).float()


def loss_of(sc: Scenario, res: NetOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, loss)`` of a forward's result: what a non-scalar backward starts from, and the scalar loss."""
    if sc.family is Family.LLAMA:
        return res.loss, res.loss
    fused = sc.fused_head
    out, aux = (res["out"], res["aux"]) if isinstance(res, dict) else res if isinstance(res, tuple) else (res, None)
    loss = out if fused else out.pow(2).mean()
    if sc.losses == 2:  # an auxiliary loss (on the hidden state's own output if none)
        # a fused head's output is already its scalar loss: the auxiliary term on it is linear, since the
        # square of one rank's mean is not the mean over the ranks (the oracle trains on the global batch,
        # data parallelism averages the ranks' gradients)
        loss = loss + (0.1 * out if fused and aux is None else 0.1 * (out if aux is None else aux).pow(2).mean())
    return out, loss


def _no_mark(what: str, **info: Any) -> None:
    pass


def _gather(sc: Scenario, backend: Backend, mark: Mark, what: Gather) -> None:
    mark("gather_start", gather=what.value)
    backend.gather(what, sc.edited_block)
    mark("gather_end", gather=what.value)


def run_schedule(sc: Scenario, backend: Backend, mark: Mark = _no_mark,
                 after_step: Callable[[int], None] | None = None) -> None:
    """The training loop.  ``mark(what, **info)`` observes schedule points; ``after_step(i)`` runs after
    each train step's boundary ``engine.step()``."""
    gas = sc.gas
    user_schedule = sc.scheduler is Scheduler.USER
    for si, st in enumerate(sc.steps):
        if st.save_load:  # a checkpoint saved and loaded after the previous step (HF Trainer)
            mark("save_load_start", step=si)
            record = backend.save_load(si)
            mark("save_load_end", step=si, record=record)
        if st.resume:  # a fresh engine loads the checkpoint of the previous step (HF Trainer's resume)
            mark("resume_start", step=si)
            record = backend.resume(si)
            mark("resume_end", step=si, record=record)
        if st.reregister:
            mark("reregister")
            backend.reregister(batch(sc, si, 0, eval_=True))
        if st.gather is not Gather.NONE and not st.gather_inside:
            _gather(sc, backend, mark, st.gather)
        if st.eval_before:
            mark("eval_start")
            backend.eval_forward(batch(sc, si, 0, eval_=True))
            mark("eval_end")
        frozen = [p for b in st.frozen for p in blocks_of(backend.module()).block(b).lin.parameters()]
        for p in frozen:  # requires_grad changed for this step only
            p.requires_grad_(False)
        unused = [blocks_of(backend.module()).block(b) for b in st.unused]
        for blk in unused:  # a module this step's forwards do not apply (after its eval forward, which does)
            blk.use_lin = False
        for mi, m in enumerate(st.micro):
            boundary = mi == gas - 1
            if st.idle:  # engine.step() without any forward or backward
                backend.boundary(boundary)
                if boundary:
                    mark("step", step=si)
                backend.micro_done(boundary)
                if boundary and user_schedule:
                    backend.lr_step()
                continue
            x = batch(sc, si, mi)
            mark("forward_start")
            res = backend.forward(x, m.skip)
            mark("forward_end")
            out, loss = loss_of(sc, res)
            backend.boundary(boundary)
            for part, keep in (((0.5, True), (0.5, False)) if m.retain else ((1.0, False),)):
                mark("backward_start", kind=m.backward.value)
                backend.backward(m.backward, out, loss, sc.fused_head, part, keep)
                mark("backward_end", kind=m.backward.value)
                if keep and m.zero_grad:  # separate losses of one retained graph: the first one's gradient cleared
                    backend.zero_grad()
            if mi == 0 and st.gather_inside:
                _gather(sc, backend, mark, st.gather)
            if boundary:
                mark("step", step=si)
            backend.micro_done(boundary)
            if boundary and user_schedule:
                backend.lr_step()
        for p in frozen:
            p.requires_grad_(True)
        for blk in unused:
            blk.use_lin = True
        if after_step is not None:
            after_step(si)


__all__ = ["Backend", "Mark", "batch", "generation_output", "loss_of", "no_grad_forward", "rows_share",
           "run_schedule"]
