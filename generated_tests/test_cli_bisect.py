"""``zerostate bisect`` over real releases (installs them: opt-in, ``ZEROSTATE_RELEASE_TESTS=1``)."""

from __future__ import annotations

import json
import os

import pytest
from test_cli_util import zs

import zerostate.targets.deepspeed.target  # noqa: F401  (a broken import fails, never skips)
pytestmark = [pytest.mark.deepspeed,
              pytest.mark.skipif(os.environ.get("ZEROSTATE_RELEASE_TESTS") != "1",
                                 reason="installs DeepSpeed releases; set ZEROSTATE_RELEASE_TESTS=1")]

SEED_002 = {"blocks": [{"checkpoint": "non_reentrant", "norm": "frozen", "lin": "trainable"}] * 2,
            "stage": 3, "persistence_threshold": 0}


def test_seed_002_was_first_fixed_in_0_19_3(tmp_path):
    path = tmp_path / "seed002.json"
    path.write_text(json.dumps(SEED_002))
    r = zs("bisect", str(path), "--from", "0.19.1", "--to", "0.19.4", timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "bisect over 4 release(s), 0.19.1 .. 0.19.4:"
    tried = {ln.split()[0]: ln.split()[1] for ln in lines[1:-1]}
    assert tried["0.19.4"] == "pass" and tried["0.19.2"] == "FAIL" and tried["0.19.3"] == "pass"
    assert lines[-1].startswith("first fixed: 0.19.3 (previous release 0.19.2 fails)")


def test_same_outcome_at_both_ends_is_nothing_to_bisect(tmp_path):
    path = tmp_path / "seed002.json"
    path.write_text(json.dumps(SEED_002))
    r = zs("bisect", str(path), "--from", "0.19.3", "--to", "0.19.4", "--json", timeout=1800)
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert data["release"] is None and "nothing to bisect" in data["message"]
    assert [t["release"] for t in data["tried"]] == ["0.19.4", "0.19.3"]
