"""Ablation (`explorer.ablate`, ``zerostate replay --ablate``): a finding's scenario without each of its
triggers in turn, replayed, as evidence of what an unexplained finding is made of."""

from __future__ import annotations

import json

import pytest

from zerostate.explorer.ablate import ablations
from zerostate.model.scenario import Scenario

from test_cli_util import zs

# a second backward of one forward, optimizer and parameter offload, hooks re-registered and block 0 frozen for
# step 1: oracle:x0.5+stale-update-again on 0.19.8 (docs/results.md)
TWO_MECHANISMS = {"stage": 3, "offload": "both", "persistence_threshold": 100000, "input_requires_grad": False,
                  "blocks": [{}], "steps": [{}, {"reregister": True, "frozen": [0],
                                                 "micro": [{"backward": "engine", "retain": True}]}]}


@pytest.mark.fast
def test_each_trigger_is_taken_away_alone():
    sc = Scenario.from_dict(TWO_MECHANISMS)
    got = dict(ablations(sc))
    assert set(got) == {"without a second backward per micro-step (retain_graph)",
                        "without hooks re-registered (reregister)",
                        "without requires_grad switched off for a step (frozen)",
                        "with an input that requires grad", "with offload=none"}, sorted(got)
    for what, cand in got.items():
        d, o = cand.to_dict(), sc.to_dict()
        assert cand != sc and cand.validate() is cand, what
        assert d.get("blocks") == o.get("blocks"), what
    assert not any(m.retain for _, _, m in got["without a second backward per micro-step (retain_graph)"].micro_steps())
    assert got["with offload=none"].offload.value == "none"
    assert not list(ablations(Scenario.from_dict({"stage": 3}))), "a plain scenario has no trigger"


@pytest.mark.fast
def test_an_invalid_ablation_is_left_out():
    """fp16 back to fp32 takes its loss-scale power with it (a loss-scale power without fp16 is invalid)."""
    sc = Scenario.from_dict({"stage": 0, "precision": "fp16", "loss_scale_power": 16})
    got = dict(ablations(sc))
    assert set(got) == {"with loss_scale_power=8, precision=fp32", "with loss_scale_power=8"}, sorted(got)


@pytest.mark.deepspeed
@pytest.mark.slow
def test_replay_ablate_takes_two_known_mechanisms_apart(tmp_path):
    """The unexplained finding is two known issues at once: without the second backward what is left is
    optimizer offload's stale gradient, without offload the second backward's half gradient -- each labelled
    by its own evidence.  The finding itself stays unexplained."""
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"check": "oracle", "key": "oracle:x0.5+stale-update-again@later-step",
                                "scenario": TWO_MECHANISMS}))
    r = zs("replay", str(path), "--ablate", "--json", timeout=900)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {a["change"]: a["findings"] for a in json.loads(r.stdout)["ablations"]}
    assert {f["known_issue"] for f in rows["without a second backward per micro-step (retain_graph)"]} == {
        "offload-stale-grad-after-freeze"}, rows
    assert {f["known_issue"] for f in rows["with offload=none"]} == {"two-backwards-per-forward"}, rows


@pytest.mark.fast
def test_the_report_offers_the_ablation_for_an_unexplained_deepspeed_finding_only():
    from dataclasses import replace

    from zerostate.reports.finding_entry import FindingEntry, KnownIssue, Labels
    from zerostate.reports.report_markdown import _finding
    base = FindingEntry(3, "oracle", "differs", None, "DeepSpeed 0.19.8", 1, 1, {}, "ZeRO-3", None, (), {}, (),
                        "oracle", "zerostate replay finding_3.json --deepspeed 0.19.8")
    unexplained = Labels(None, "oracle", "oracle", None)
    ablate = "zerostate replay finding_3.json --deepspeed 0.19.8 --ablate"
    assert any(line.startswith(ablate) for line in _finding(replace(base, labels=unexplained)))
    known = KnownIssue("k", "t", "deepspeed", None, None, "bug", None)
    assert not any(ablate in line for line in _finding(replace(base, labels=replace(unexplained, known_issue=known))))
    assert not any(ablate in line for line in _finding(replace(base, labels=replace(unexplained,
                                                                                     harness_error="oracle raised"))))
    model = replace(base, where=None, design="ds-0.18.4", labels=unexplained)
    assert not any("--ablate" in line for line in _finding(model))
