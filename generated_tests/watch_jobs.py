"""Small DeepSpeed ZeRO-3 jobs (CPU, gloo, one rank) for test_watch.py, each a user's script as written.

    python generated_tests/watch_jobs.py leaf               # a z3 leaf module fed by an input without grad
    python generated_tests/watch_jobs.py gathered [--then crash|interrupt|forever] [--steps N]
    python generated_tests/watch_jobs.py api                # zerostate.watch(engine): prints the handle
    python generated_tests/watch_jobs.py direct [--steps N]   # engine.module(x) under no_grad before each step
    python generated_tests/watch_jobs.py plain [--stage 2|3] [--late N] [--steps N]
                                                            # loss.backward(), no leaf; watched after N steps
    python generated_tests/watch_jobs.py train [--stage N] [--steps N]   # a clean job: no leaf, engine.backward
    python generated_tests/watch_jobs.py eval [--stage N] [--steps N]    # eval only: forwards under no_grad
    python generated_tests/watch_jobs.py datakey [--stage N] [--steps N] # its data code raises KeyError at step 1
    python generated_tests/watch_jobs.py resume|again|pair [--stage N] [--steps N]  # a second engine in the process
    python generated_tests/watch_jobs.py gather|gather-edit [--persistence N] [--steps N]  # the loop's own
                                                            # GatheredParameters after each step (read / edit)

``--find-spec-first`` asks ``importlib.util.find_spec("deepspeed")`` before the job imports deepspeed (as
transformers, accelerate and TRL do when imported first).

``gathered``: a frozen z3 leaf block fed by data that does not require grad, then a trainable block --
0.18.4-0.19.8 keep the leaf's parameters gathered after the backward from the second step on
(``released-after-backward``; known issue ``z3-leaf-kept-gathered``).  ``--then crash`` raises after the
steps, ``exit`` ends the process at once (``os._exit``, no atexit), ``interrupt`` sends itself SIGINT (Ctrl-C),
``forever`` keeps training until interrupted, ``hang``
never returns from the next ``engine.forward``.  ``sys-exit`` catches an error after the steps and calls
``sys.exit(1)``; ``die`` ends with ``os._exit(3)``, no exception at all.

``eval``: an engine built for training (with its optimizer) that only evaluates -- ``engine.eval()``, forwards under
``torch.no_grad()``, no backward, no step.

``resume``: trains, saves, destroys the engine, builds the model and an engine again, loads and trains on (HF's
``resume_from_checkpoint``); ``again``: a second engine over the first engine's module, the first never destroyed
(``trainer.train()`` called twice without freeing the first engine); ``pair``: two live engines over two models
trained in turn (an actor and a critic in one process).

``datakey``: the job's own data code (a collate function reading ``batch["input_ids"]``) raises
``KeyError: 'input_ids'`` at train step 1, outside DeepSpeed's calls.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time


def _env() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "MASTER_PORT" not in os.environ:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        s.close()
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)


def build(leaf_frozen: bool, blocks: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(self.norm(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x).pow(2).mean()

    torch.manual_seed(0)
    model = Net()
    if leaf_frozen:
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)
    return model


def engine_for(model, stage: int = 3, leaf: bool = True, persistence: int = 0):
    import deepspeed
    import torch
    from deepspeed.utils import set_z3_leaf_module

    from zerostate.tracing import compat
    compat.skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    if leaf:
        set_z3_leaf_module(model.blocks[0], True)
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persistence},
           "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=0.1), config=cfg)
    return engine


def train(engine, steps: int, plain: bool = False) -> list[float]:
    """``plain``: ``loss.backward()`` as in PyTorch (DeepSpeed >= 0.18 runs its epilogue from a post-backward
    callback), not ``engine.backward(loss)``."""
    import torch
    losses = []
    for i in range(steps):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))  # no grad: a first layer's input
        loss = engine(x)
        if plain:
            loss.backward()
        else:
            engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def main(argv: list[str]) -> int:
    _env()
    argv = [a for a in argv if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
    if "--find-spec-first" in argv:  # as transformers / accelerate / TRL do at import, before the job imports deepspeed
        import importlib.util
        assert importlib.util.find_spec("deepspeed") is not None and "deepspeed" not in sys.modules
    what = argv[0] if argv else "leaf"
    then = argv[argv.index("--then") + 1] if "--then" in argv else None
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 2
    if what == "leaf":
        engine = engine_for(build(leaf_frozen=False, blocks=1))
        print(json.dumps({"losses": train(engine, steps)}))
        return 0
    if what == "gathered":
        engine = engine_for(build(leaf_frozen=True, blocks=2))
        losses = train(engine, steps)
        print(json.dumps({"losses": losses}), flush=True)
        if then == "crash":
            raise RuntimeError("the job crashed after its steps (test_watch)")
        if then == "sys-exit":  # as scripts do: catch the error, log it, exit 1 (sys.excepthook never sees it)
            try:
                raise RuntimeError("the job gave up after its steps (test_watch_observed)")
            except RuntimeError as exc:
                print(f"error: {exc}", file=sys.stderr)
                sys.exit(1)
        if then == "die":  # fails without any exception (as a native crash or a kill would)
            os._exit(3)
        if then == "exit":  # ends without atexit (as a rank killed by its launcher): its watch is never closed
            os._exit(0)
        if then == "interrupt":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        if then == "hang":  # an engine.forward that never returns (as a rank stuck in a collective)
            def stuck_in_forward(*_):
                time.sleep(3600)
            engine.module.head.register_forward_pre_hook(stuck_in_forward)
            train(engine, 1)
        if then == "forever":
            while True:
                train(engine, 1)
                time.sleep(0.05)
        return 0
    if what == "plain":  # loss.backward(), watched from the start or after --late unwatched steps
        import zerostate
        stage = int(argv[argv.index("--stage") + 1]) if "--stage" in argv else 3
        late = int(argv[argv.index("--late") + 1]) if "--late" in argv else 0
        engine = engine_for(build(leaf_frozen=False, blocks=2), stage=stage, leaf=False)
        train(engine, late, plain=True)
        handle = zerostate.watch(engine)
        losses = train(engine, steps, plain=True)
        handle.close()
        print(json.dumps({"losses": losses, "steps": handle.steps, "backwards": handle.backwards,
                          "violations": handle.violations, "memory": handle.memory}, default=str))
        return 0
    if what in ("train", "eval", "datakey"):
        import torch
        stage = int(argv[argv.index("--stage") + 1]) if "--stage" in argv else (3 if what != "datakey" else 2)
        engine = engine_for(build(leaf_frozen=False, blocks=2), stage=stage, leaf=False)
        if what == "train":
            print(json.dumps({"losses": train(engine, steps)}))
            return 0
        if what == "eval":
            engine.eval()
            with torch.no_grad():
                losses = [float(engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(i))))
                          for i in range(steps)]
            print(json.dumps({"losses": losses}))
            return 0

        def collate(example: dict) -> torch.Tensor:  # the job's own data code
            return example["input_ids"]

        for i in range(steps):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
            batch = collate({"input_ids": x} if i == 0 else {"inputs": x})  # step 1: the key is not there
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
        return 0
    if what == "direct":  # the root module called outside engine.forward, as DPO's reference pass does
        import torch
        engine = engine_for(build(leaf_frozen=False, blocks=2), leaf=False)
        for i in range(steps):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(i))
            with torch.no_grad():
                engine.module(x)
            loss = engine(x)
            engine.backward(loss)
            engine.step()
        print(json.dumps({"steps": steps}))
        return 0
    if what == "api":
        import zerostate
        engine = engine_for(build(leaf_frozen=True, blocks=2))
        handle = zerostate.watch(engine)
        losses = train(engine, steps)
        handle.close()
        print(json.dumps({"losses": losses, "summary": handle.summary(), "steps": handle.steps,
                          "backwards": handle.backwards, "violations": handle.violations,
                          "memory": handle.memory}, default=str))
        return 0
    if what in ("resume", "again"):  # a second engine in the same process
        import tempfile
        stage = int(argv[argv.index("--stage") + 1]) if "--stage" in argv else 3
        engine = engine_for(build(leaf_frozen=False, blocks=2), stage=stage, leaf=False)
        losses = train(engine, steps)
        if what == "again":  # trainer.train() called again: the same module wrapped by a second engine
            engine = engine_for(engine.module, stage=stage, leaf=False)
        else:  # resume_from_checkpoint in a fresh engine: save, destroy, build the model again, load
            ckpt = tempfile.mkdtemp(prefix="zerostate-watch-resume-")
            engine.save_checkpoint(ckpt, tag="t")
            engine.destroy()
            engine = engine_for(build(leaf_frozen=False, blocks=2), stage=stage, leaf=False)
            engine.load_checkpoint(ckpt, tag="t")
        losses += train(engine, steps)
        print(json.dumps({"losses": losses}))
        return 0
    if what in ("gather", "gather-edit"):  # the loop's own GatheredParameters between steps (TRL's weight sync)
        import deepspeed
        import torch
        stage = int(argv[argv.index("--stage") + 1]) if "--stage" in argv else 3
        persistence = int(argv[argv.index("--persistence") + 1]) if "--persistence" in argv else 0
        engine = engine_for(build(leaf_frozen=False, blocks=2), stage=stage, leaf=False, persistence=persistence)
        losses, sums = [], []
        for _ in range(steps):
            losses += train(engine, 1)
            params = list(engine.module.parameters())
            rank0 = 0 if what == "gather-edit" else None
            with deepspeed.zero.GatheredParameters(params, modifier_rank=rank0):
                sums.append(float(sum(p.detach().float().sum() for p in params)))
                if what == "gather-edit":
                    with torch.no_grad():
                        engine.module.head.weight.mul_(0.5)
        print(json.dumps({"losses": losses, "sums": sums}))
        return 0
    if what == "pair":  # two live engines over two models trained in turn (an actor and a critic in one process)
        stage = int(argv[argv.index("--stage") + 1]) if "--stage" in argv else 3
        actor = engine_for(build(leaf_frozen=False, blocks=2), stage=stage, leaf=False)
        critic = engine_for(build(leaf_frozen=False, blocks=1), stage=stage, leaf=False)
        losses = [train(e, 1)[0] for _ in range(steps) for e in (actor, critic)]
        print(json.dumps({"losses": losses}))
        return 0
    raise SystemExit(f"unknown job {what!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
