"""The executor's network parts on plain PyTorch, without a DeepSpeed engine: the one training loop (`net.schedule`)
driven by a recording backend, its inputs, the checkpoint round trip (`net.checkpoint`) on a stand-in engine, the
persistence read (`net.persistence`), the llama family (`net.llama`), the rank helpers at one rank (`net.dist`) and
the size helper (`net.compare`).  On a real engine they run in every DeepSpeed test (test_deepspeed_*.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from zerostate.harness.net import checkpoint, compare, dist, llama, persistence, schedule
from zerostate.harness.net.torch_network import build_model
from zerostate.model.scenario import BackwardKind, Scenario


# ------------------------------------------------------------------ schedule
class _Recording:
    """A backend that trains the network with plain PyTorch and records every call the loop makes."""

    def __init__(self, sc: Scenario) -> None:
        self.model = build_model(sc)
        self.calls: list[tuple[Any, ...]] = []

    def module(self) -> torch.nn.Module:
        return self.model

    def save_load(self, step: int) -> Any:
        self.calls.append(("save_load", step))
        return {"step": step}

    def reregister(self, x: torch.Tensor | None = None) -> None:
        self.calls.append(("reregister",))

    def resume(self, step: int) -> Any:
        self.calls.append(("resume", step))
        return {"step": step}

    def gather(self, what: Any, block: int | None) -> None:
        self.calls.append(("gather", what.value, block))

    def eval_forward(self, x: torch.Tensor) -> None:
        self.calls.append(("eval",))
        schedule.no_grad_forward(self.model, x, llama=False)

    def forward(self, x: torch.Tensor, skip: tuple[int, ...] = ()) -> Any:
        self.calls.append(("forward", tuple(skip)))
        return self.model(x, skip=tuple(skip)) if skip else self.model(x)

    def boundary(self, boundary: bool) -> None:
        self.calls.append(("boundary", boundary))

    def backward(self, kind: BackwardKind, out: torch.Tensor, loss: torch.Tensor, fused: bool, part: float = 1.0,
                 keep: bool = False) -> None:
        self.calls.append(("backward", kind, part, keep))
        (loss * part).backward(retain_graph=keep)

    def zero_grad(self) -> None:
        self.calls.append(("zero_grad",))

    def micro_done(self, boundary: bool) -> None:
        self.calls.append(("micro_done", boundary))

    def lr_step(self) -> None:
        self.calls.append(("lr_step",))


def test_the_training_loop_makes_each_micro_steps_calls_in_order_and_marks_the_schedule():
    sc = Scenario.from_dict({"blocks": [{}, {}], "stage": 1, "steps": [
        {"micro": [{"backward": "torch"}, {"retain": True}], "eval_before": True},
        {"micro": [{}, {}], "save_load": True, "reregister": True}]})
    backend, marks, after = _Recording(sc), [], []
    schedule.run_schedule(sc, backend, lambda what, **info: marks.append((what, info.get("step"))), after.append)
    assert backend.calls[:8] == [("eval",), ("forward", ()), ("boundary", False),
                                 ("backward", BackwardKind.TORCH, 1.0, False), ("micro_done", False),
                                 ("forward", ()), ("boundary", True), ("backward", BackwardKind.ENGINE, 0.5, True)]
    assert backend.calls[8:11] == [("backward", BackwardKind.ENGINE, 0.5, False), ("micro_done", True),
                                   ("save_load", 1)]
    assert backend.calls[11] == ("reregister",) and after == [0, 1]
    assert [m for m in marks if m[0] in ("step", "save_load_start")] == [("step", 0), ("save_load_start", 1),
                                                                         ("step", 1)]
    assert all(p.grad is not None for p in backend.model.parameters() if p.requires_grad)


def test_inputs_are_seeded_by_the_scenario_and_differ_by_step_and_micro_step():
    sc = Scenario.from_dict({"blocks": [{}], "stage": 3})
    x = schedule.batch(sc, 0, 0)
    assert torch.equal(x, schedule.batch(sc, 0, 0)) and x.shape == (schedule.global_rows(), sc.width)
    assert not torch.equal(x, schedule.batch(sc, 0, 1)) and not torch.equal(x, schedule.batch(sc, 1, 0))
    assert x.requires_grad and not schedule.batch(sc, 0, 0, eval_=True).requires_grad
    assert torch.equal(schedule.generation_output((x, None)), x.detach())


# ------------------------------------------------------------------ checkpoint
class _Engine:
    """What `checkpoint.round_trip` calls on a ZeRO-1/2 engine: save and load, and the optimizer's master partition."""

    def __init__(self, loads: bool) -> None:
        self.optimizer = SimpleNamespace(single_partition_of_fp32_groups=[torch.zeros(3)])
        self.loads = loads

    def zero_optimization_partition_weights(self) -> bool:
        return False

    def save_checkpoint(self, path: str) -> None:
        with open(os.path.join(path, "mp_rank_00_model_states.pt"), "w") as fh:
            fh.write("saved")

    def load_checkpoint(self, path: str) -> tuple[str | None, dict[str, Any]]:
        return (path, {}) if self.loads else (None, {})


@pytest.mark.parametrize("loads", [True, False])
def test_a_checkpoint_round_trip_records_the_files_and_the_master_weights_around_the_load(loads):
    engine = _Engine(loads)
    backend = SimpleNamespace(engine=engine, stage=0, fp32=True, params=lambda: {"w": torch.ones(2)},
                              counters=lambda: {"global_steps": 1, "skipped_steps": 0, "loss_scale": None})
    rec = checkpoint.round_trip(backend, 2)
    assert rec["step"] == 2 and rec["files"] == ["mp_rank_00_model_states.pt"] and len(rec["counters"]) == 2
    assert torch.equal(rec["master"]["fp32 master group 0"], torch.zeros(3))
    # the load runs on masters moved by +1; one that returns nothing gets the saved partition back
    moved = rec["master_after"]["fp32 master group 0"]
    assert torch.equal(moved, torch.ones(3) if loads else torch.zeros(3))
    assert not os.path.exists(rec["loaded"] or "/nonexistent"), "the shared checkpoint folder is removed"
    assert checkpoint.master_partitions(SimpleNamespace()) is None


# ------------------------------------------------------------------ persistence, compare, dist
def test_persistence_reads_the_size_and_the_mark_the_engine_put_on_each_parameter():
    module = torch.nn.Linear(2, 2)
    for p, persist in ((module.weight, True), (module.bias, False)):
        p.ds_numel, p.ds_persist = p.numel(), persist
    got = persistence.persistence_of(module)
    assert [(p.name, p.numel, p.persistent) for p in got] == [("weight", 4, True), ("bias", 2, False)]


def test_the_size_helper_and_the_rank_helpers_at_one_rank():
    assert compare.max_abs(torch.tensor([1.0, -3.0])) == 3.0 and compare.max_abs(torch.zeros(0)) == 0.0
    x = torch.randn(4, 3, requires_grad=True)
    assert dist.rank_rows(x) is x or dist.world_size() > 1
    assert dist.rank_of() == 0 and dist.world_size() >= 1
    path = dist.shared_tmpdir()
    try:
        assert os.path.basename(path).startswith(dist.CKPT_PREFIX)
        assert dist.without_tmpdir(f"cannot open {path}/global_step1") == "cannot open <checkpoint dir>/global_step1"
    finally:
        os.rmdir(path)


# ------------------------------------------------------------------ llama
def test_the_llama_family_is_a_seeded_tiny_hf_llama_with_nonzero_lora():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    sc = Scenario.from_dict({"family": "llama", "lora": True, "modules_to_save": True, "width": 8,
                             "blocks": [{"checkpoint": "non_reentrant"}] * 2})
    model = llama.build_llama(sc)
    again = llama.build_llama(sc)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(),
                                                 strict=True))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b), "B drawn non-zero: A's gradient is not zero at step 0"
    assert any("modules_to_save" in n for n, _ in model.named_parameters())
    x = torch.randint(0, llama.VOCAB, (2, llama.SEQ))
    assert model(input_ids=x, labels=x).loss.requires_grad


def test_zero_grad_clears_between_the_two_backwards_of_a_retained_graph():
    sc = Scenario.from_dict({"blocks": [{}], "stage": 1, "steps": [{"micro": [{"retain": True, "zero_grad": True}]}]})
    backend = _Recording(sc)
    schedule.run_schedule(sc, backend)
    assert [c for c in backend.calls if c[0] in ("backward", "zero_grad", "micro_done")] == [
        ("backward", BackwardKind.ENGINE, 0.5, True), ("zero_grad",), ("backward", BackwardKind.ENGINE, 0.5, False),
        ("micro_done", True)]
