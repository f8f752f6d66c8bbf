"""The scenario's real network and training loop: torch (and, inside functions, deepspeed) only.

This module imports nothing from zerostate, on purpose: `repro.py` embeds its
source verbatim (``inspect.getsource``) into standalone reproduction scripts,
so the network a finding is reproduced with is byte-for-byte the one the
executor ran.  A *spec* here is the plain dict of ``Scenario.to_dict()``.

* `Net` -- blocks of ``norm`` (LayerNorm) -> ``lin`` (Linear); each block plain,
  reentrant- or non-reentrant-checkpointed; sub-modules trainable, frozen or
  unused; an optional fused head (`FusedHeadLoss`, the TiledFusedLogitsLoss
  pattern: ``torch.autograd.backward`` inside a custom Function's forward, with
  ``head.weight`` not an input tensor of the Function).  Parameter names are
  ``blocks.{i}.norm.weight`` ... ``head.weight``, as in ``zerostate.model.network``.
* `ds_config` -- the DeepSpeed config: every numerics-relevant key is explicit
  (fp32, ``gradient_clipping: 0.0``, SGD passed as a client optimizer).
* `run_schedule` -- the one training loop, parameterised by a `Backend`: the
  DeepSpeed engine (`DeepSpeedBackend`) or plain PyTorch (`TorchBackend`, the
  oracle).  DeepSpeed divides by ``gradient_accumulation_steps`` itself
  (``engine.backward`` scales the loss, the output hooks scale PyTorch-style
  gradients); the oracle divides explicitly.
"""

import os
import warnings

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

BATCH = 2
LR = 0.05
ATOL = 1e-5
RTOL = 1e-4

# A tracer may set this to a pair of callables (start(), end()) observing the backward made inside forward.
PRE_BACKWARD_OBSERVER = None
# ... and this to a pair (enter(block), exit(block)) called around every checkpointed block's forward,
# including a recompute that torch stops early (non-reentrant checkpoint stops once it has what it needs).
BLOCK_OBSERVER = None


def _call_block(blk, x, skip_norm):
    obs = BLOCK_OBSERVER
    if obs is not None:
        obs[0](blk)
    try:
        return blk(x, skip_norm=skip_norm)
    finally:
        if obs is not None:
            obs[1](blk)


class Block(nn.Module):
    """x -> lin(norm(x)); a sub-module marked "unused" is skipped by forward."""

    def __init__(self, width, norm_kind, lin_kind):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)
        self.use_norm = norm_kind != "unused"
        self.use_lin = lin_kind != "unused"

    def forward(self, x, skip_norm=False):
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
    def forward(ctx, hidden, head):
        with torch.enable_grad():
            h = hidden.detach().requires_grad_(True)
            loss = head(h).pow(2).mean()
            obs = PRE_BACKWARD_OBSERVER
            if obs is not None:
                obs[0]()
            torch.autograd.backward(loss)
            if obs is not None:
                obs[1]()
        ctx.save_for_backward(h.grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        (gh,) = ctx.saved_tensors
        return gh * grad, None


class Net(nn.Module):
    def __init__(self, spec):
        super().__init__()
        w = spec.get("width", 8)
        bl = spec.get("blocks", [{}])
        self.blocks = nn.ModuleList(Block(w, b.get("norm", "trainable"), b.get("lin", "trainable")) for b in bl)
        self.ckpt = [b.get("checkpoint", "none") for b in bl]
        self.head = nn.Linear(w, w, bias=False) if spec.get("fused_head", False) else None

    def forward(self, x, skip=()):
        """``skip``: blocks whose (frozen) norm this forward skips, a data-dependent branch."""
        grad = torch.is_grad_enabled()
        for i, (blk, ck) in enumerate(zip(self.blocks, self.ckpt)):
            s = i in skip
            if grad and ck == "reentrant":
                x = checkpoint(_call_block, blk, x, s, use_reentrant=True)
            elif grad and ck == "non_reentrant":
                x = checkpoint(_call_block, blk, x, s, use_reentrant=False)
            else:
                x = blk(x, skip_norm=s)
        if self.head is not None:
            if grad:
                return FusedHeadLoss.apply(x, self.head)
            return self.head(x).pow(2).mean()
        return x


def build_model(spec):
    """The network with seeded, non-trivial initial values; frozen parameters have requires_grad False."""
    torch.manual_seed(spec.get("seed", 0))
    net = Net(spec)
    with torch.no_grad():
        for blk in net.blocks:
            blk.norm.weight.normal_(1.0, 0.2)
            blk.norm.bias.normal_(0.0, 0.2)
    for i, b in enumerate(spec.get("blocks", [{}])):
        for sub in ("norm", "lin"):
            if b.get(sub, "trainable") == "frozen":
                for p in getattr(net.blocks[i], sub).parameters():
                    p.requires_grad_(False)
    return net


def gas_of(spec):
    return len(spec.get("steps", [{}])[0].get("micro", [{}]))


def batch(spec, step, micro, eval_=False):
    g = torch.Generator().manual_seed(1000003 * spec.get("seed", 0) + 1009 * step + 2 * micro + int(eval_))
    x = torch.randn(BATCH, spec.get("width", 8), generator=g)
    if spec.get("input_requires_grad", True) and not eval_:
        x.requires_grad_(True)
    return x


def ds_config(spec):
    """Every numerics-relevant key explicit, so correct releases agree with the oracle."""
    zero = {"stage": spec.get("stage", 3), "reduce_bucket_size": spec.get("reduce_bucket_size", 500_000_000)}
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = spec.get("persistence_threshold", 0)
        zero["stage3_prefetch_bucket_size"] = spec.get("prefetch_bucket_size", 0)
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas_of(spec),
        "gradient_clipping": 0.0,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


class TorchBackend:
    """The oracle: the same network and schedule with plain PyTorch and the same optimizer."""

    def __init__(self, spec, model):
        self.model, self.gas = model, gas_of(spec)
        self.opt = torch.optim.SGD(trainable(model), lr=LR)

    def forward(self, x, skip=()):
        return self.model(x, skip=tuple(skip)) if skip else self.model(x)

    def reregister(self):
        pass

    def eval_forward(self, x):
        self.model.eval()
        with torch.no_grad():
            self.model(x)
        self.model.train()

    def backward(self, kind, out, loss, fused):
        if kind == "nonscalar":
            g = torch.ones_like(loss) if fused else (2 * out / out.numel()).detach()
            (loss if fused else out).backward(gradient=g / self.gas)
        else:
            (loss / self.gas).backward()

    def micro_done(self, boundary):
        if boundary:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def params(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def rank_rows(x):
    """This rank's rows of the global batch (world size > 1; else ``x``).  The oracle trains on the whole
    batch; each rank's loss is the mean over its equal share, and data-parallel averaging of the gradients
    makes the mean of the per-rank means: the gradient of the global batch's mean."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    ws, rank = dist.get_world_size(), dist.get_rank()
    if x.shape[0] % ws:
        raise ValueError(f"batch of {x.shape[0]} rows cannot be split evenly over {ws} ranks")
    return x.detach().chunk(ws)[rank].clone().requires_grad_(x.requires_grad)


class DeepSpeedBackend:
    """The real engine: ``deepspeed.initialize`` with ZeRO 1/2/3 and a client SGD optimizer."""

    def __init__(self, spec, model):
        import deepspeed
        self.spec = spec
        if spec.get("stage", 3) == 3:
            from deepspeed.utils import set_z3_leaf_module
            for i, b in enumerate(spec.get("blocks", [{}])):
                if b.get("leaf", False):
                    set_z3_leaf_module(model.blocks[i], True)
        opt = torch.optim.SGD(trainable(model), lr=LR)
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(spec))
        self.names = {id(p): n for n, p in self.engine.module.named_parameters()}

    def forward(self, x, skip=()):
        x = rank_rows(x)
        if x.device != self.engine.device:
            x = x.detach().to(self.engine.device).requires_grad_(x.requires_grad)
        return self.engine(x, skip=tuple(skip)) if skip else self.engine(x)

    def reregister(self):
        """Remove ZeRO-3's module hooks and register them again, as TRL's unwrap_model_for_generation does."""
        off = getattr(self.engine.optimizer, "parameter_offload", None)
        if off is None:
            return
        for p in self.engine.module.parameters():
            if hasattr(p, "ds_active_sub_modules"):
                p.ds_active_sub_modules.clear()
        for h in off.forward_hooks + off.backward_hooks:
            h.remove()
        off.forward_hooks, off.backward_hooks = [], []
        off._register_deepspeed_module(off.module)

    def eval_forward(self, x):
        self.engine.eval()
        with torch.no_grad():
            self.engine(rank_rows(x).to(self.engine.device))
        self.engine.train()

    def backward(self, kind, out, loss, fused):
        if kind == "engine":
            self.engine.backward(loss)
        elif kind == "torch":
            loss.backward()
        else:
            g = torch.ones_like(loss) if fused else (2 * out / out.numel()).detach()
            (loss if fused else out).backward(gradient=g)

    def micro_done(self, boundary):
        self.engine.step()  # DeepSpeed's loop: step() after every micro-step; it updates at the boundary

    def params(self):
        out = {}
        for n, p in self.engine.module.named_parameters():
            if hasattr(p, "ds_tensor") and getattr(getattr(p, "ds_status", None), "name", "") == "AVAILABLE":
                out[n] = p.detach().cpu().clone()  # gathered (persistent): GatheredParameters would partition it
            elif hasattr(p, "ds_tensor"):  # ZeRO-3: read the (world size 1: whole) partition
                import deepspeed
                with deepspeed.zero.GatheredParameters([p]):
                    out[n] = p.detach().cpu().clone()
            else:
                out[n] = p.detach().cpu().clone()
        return out

    def close(self):
        eng = getattr(self, "engine", None)
        if eng is not None and hasattr(eng, "destroy"):
            try:
                eng.destroy()
            except Exception:
                pass
        self.engine = None


def run_schedule(spec, backend, mark=None, after_step=None):
    """The training loop.  ``mark(what, **info)`` observes schedule points; ``after_step(i)`` runs after
    each train step's boundary ``engine.step()``."""
    mark = mark or (lambda what, **info: None)
    fused = spec.get("fused_head", False)
    steps = spec.get("steps", [{}])
    gas = gas_of(spec)
    for si, st in enumerate(steps):
        if st.get("reregister", False):
            mark("reregister")
            backend.reregister()
        if st.get("eval_before", False):
            mark("eval_start")
            backend.eval_forward(batch(spec, si, 0, eval_=True))
            mark("eval_end")
        for mi, m in enumerate(st.get("micro", [{}])):
            kind = m.get("backward", "engine")
            x = batch(spec, si, mi)
            mark("forward_start")
            out = backend.forward(x, m.get("skip", ()))
            mark("forward_end")
            loss = out if fused else out.pow(2).mean()
            mark("backward_start", kind=kind)
            backend.backward(kind, out, loss, fused)
            mark("backward_end", kind=kind)
            boundary = mi == gas - 1
            if boundary:
                mark("step", step=si)
            backend.micro_done(boundary)
        if after_step is not None:
            after_step(si)


def compare(expected, actual, atol=ATOL, rtol=RTOL):
    """None when every parameter agrees; else a sentence naming the worst parameter."""
    worst = None
    for n, e in expected.items():
        a = actual.get(n)
        if a is None or a.shape != e.shape:
            return f"{n}: shape {tuple(e.shape)} in PyTorch vs {None if a is None else tuple(a.shape)} in DeepSpeed"
        err = (a.float() - e.float()).abs().max().item()
        lim = atol + rtol * e.float().abs().max().item()
        if err > lim and (worst is None or err > worst[1]):
            worst = (n, err, lim)
    if worst:
        return f"{worst[0]}: max |DeepSpeed - PyTorch| = {worst[1]:.3g} > tolerance {worst[2]:.3g}"
    return None


def oracle_params(spec):
    """Parameters after each train step, trained with plain PyTorch."""
    model = build_model(spec)
    be = TorchBackend(spec, model)
    out = []
    run_schedule(spec, be, after_step=lambda i: out.append(be.params()))
    return out


def setup_distributed():
    """World size 1 on CPU (gloo) unless launched by the deepspeed launcher / on a GPU (nccl)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    warnings.filterwarnings("ignore")
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
