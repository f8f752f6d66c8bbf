"""The deepspeed target's processes without a working DeepSpeed: the target kind's checks before anything starts
(`targets.deepspeed.kind`), and a worker (`harness.worker`, through `harness.worker_process.Worker`) or a rank pool
of rank workers (`harness.rank_worker`, through `targets.deepspeed.ranks`) whose DeepSpeed does not import, which
must say so in one error naming the release's folder.  The ranks' collective counter (`rank_worker.sync_state`) on a
one-rank gloo group.  Every DeepSpeed test runs the same processes on a real release (test_deepspeed_*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zerostate.harness import envs, rank_worker, worker  # run as processes below; a broken import fails here
from zerostate.harness.worker_process import Worker
from zerostate.targets.deepspeed import kind
from zerostate.targets.deepspeed.ranks import DeepSpeedRanksTarget
from zerostate.targets.interface import TargetError, get_target

BROKEN = "this DeepSpeed cannot be imported (test)"


@pytest.fixture
def broken_deepspeed(tmp_path):
    """A folder whose ``deepspeed`` package raises on import, as ``--deepspeed-path`` would name a checkout."""
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    return tmp_path


def test_the_kinds_checks_refuse_before_anything_starts():
    with pytest.raises(TargetError, match="not both"):
        kind.validate(deepspeed="0.19.8", deepspeed_path="/x")
    with pytest.raises(TargetError, match="asked for 3"):
        kind.validate(world_size=3)
    with pytest.raises(TargetError, match="ds-9"):
        kind.validate(design="ds-9")
    kind.validate(deepspeed="0.19.8", world_size=4, design="zerostate")
    with pytest.raises(TargetError, match="world size 2 or more"):
        DeepSpeedRanksTarget(world_size=1)


def test_a_worker_whose_deepspeed_does_not_import_answers_every_request_with_why(broken_deepspeed, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(broken_deepspeed) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    w = Worker(env, tmp_path / "worker.log")
    try:
        for request in ({"op": "hello"}, {"op": "run", "scenario": {}}):
            answer = w.request(request, timeout=120)
            assert answer["ok"] is False and BROKEN in answer["error"]
            assert os.path.join("harness", "worker.py") in answer["traceback"]  # `worker.main` answered
        assert w.alive()
    finally:
        w.close()
    assert not w.alive()


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_target_whose_deepspeed_does_not_import_is_one_error_naming_its_folder(broken_deepspeed, world_size):
    with pytest.raises(TargetError) as err:
        get_target("deepspeed", deepspeed_path=str(broken_deepspeed), world_size=world_size)
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"DeepSpeed from {broken_deepspeed} does not import or initialise") and BROKEN in first
    main = "rank_worker.py" if world_size > 1 else "worker.py"
    assert os.path.join("harness", main) in str(err.value), "the traceback is the worker's own"
    assert worker.__name__ != rank_worker.__name__


def test_each_rank_counts_its_collectives_per_process_group():
    """What the pool compares across ranks after an example: a group's number grows with each collective."""
    code = ("import json, os, torch.distributed as dist\n"
            "from zerostate.harness.rank_worker import sync_state\n"
            "dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())\n"
            "before = sync_state()\n"
            "import torch; dist.all_reduce(torch.ones(1)); dist.all_reduce(torch.ones(1))\n"
            "print(json.dumps([before, sync_state()]))\n"
            "dist.destroy_process_group()\n")  # an exit with the group alive may abort in gloo's teardown
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=envs.without_rendezvous(dict(os.environ)))
    assert p.returncode == 0, p.stderr[-2000:]
    before, after = json.loads(p.stdout.strip().splitlines()[-1])
    assert before.keys() == after.keys() and before
    assert all(after[g] == before[g] + 2 for g in before)
