"""The checkpoint check sees a load that does not restore the fp32 master weights (real DeepSpeed, faulted).

Two faults of the catalogue (benchmarks/faults/) survived the default exploration when the round trip loaded
into the engine that had just saved: its master weights already were the saved ones.  `checkpoint.round_trip`
now moves them before the load (a resume loads into an engine whose master weights differ), and the
``checkpoint`` check compares them with the saved ones exactly.  Each fault is applied to a copy of the
installed release and run through ``--deepspeed-path`` as the fault benchmark does; the unfaulted release
passes the same scenarios (test_deepspeed_save_load.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from faults.apply import applied, make_tree
from faults.catalogue import by_id

from zerostate.model.scenario import Scenario

TWO = [{}, {"save_load": True}]
CASES = {
    # ZeRO-3 load keeps the engine's fp32 partitions: the 16-bit parameters are rebuilt from them
    "z3-load-skips-fp32-restore": ({"stage": 3, "steps": TWO}, {"checkpoint:round-trip", "checkpoint:master-weights"}),
    # ZeRO-1/2 load rebuilds the fp32 master weights from the 16-bit copies: bf16 rounds them
    "z12-load-from-bit16": ({"stage": 2, "precision": "bf16", "steps": TWO}, {"checkpoint:master-weights"}),
}


@pytest.mark.deepspeed
@pytest.mark.parametrize("fault_id", sorted(CASES))
def test_the_checkpoint_check_kills_a_load_that_keeps_other_master_weights(fault_id, tmp_path):
    from zerostate.targets.base import get_target
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin
    tree = tmp_path / "tree"
    make_tree(Path(spec.origin).parent, tree)
    scenario, keys = CASES[fault_id]
    with applied(by_id()[fault_id], tree):
        target = get_target("deepspeed", deepspeed_path=str(tree))
        try:
            out = target.run(Scenario.from_dict(scenario))
        finally:
            target.close()
    got = {f.key for f in out.findings}
    assert got & keys, [(f.key, f.error[:300]) for f in out.findings]
