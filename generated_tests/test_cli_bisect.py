"""``zerostate bisect``: the search and the outcome kinds (default-on, no DeepSpeed run), and bisect over
real releases (installs them: opt-in, ``ZEROSTATE_RELEASE_TESTS=1``)."""

from __future__ import annotations

import json
import os

import pytest
from test_cli_util import FailingTarget, assert_one_line_error, zs

import zerostate.targets.deepspeed.target  # noqa: F401  (a broken import fails, never skips)
from zerostate.cli.cmd_bisect import PASS, outcome_of, transitions
from zerostate.model.scenario import Scenario
from zerostate.findings.finding import Finding

releases_only = [pytest.mark.deepspeed,
                 pytest.mark.skipif(os.environ.get("ZEROSTATE_RELEASE_TESTS") != "1",
                                    reason="installs DeepSpeed releases; set ZEROSTATE_RELEASE_TESTS=1")]

SEED_002 = {"blocks": [{"checkpoint": "non_reentrant", "norm": "frozen", "lin": "trainable"}] * 2,
            "stage": 3, "persistence_threshold": 0}


@releases_only[0]
@releases_only[1]
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


@releases_only[0]
@releases_only[1]
def test_same_outcome_at_both_ends_is_nothing_to_bisect(tmp_path):
    path = tmp_path / "seed002.json"
    path.write_text(json.dumps(SEED_002))
    r = zs("bisect", str(path), "--from", "0.19.3", "--to", "0.19.4", "--json", timeout=1800)
    assert r.returncode == 1
    data = json.loads(r.stdout)
    assert data["release"] is None and "nothing to bisect" in data["message"]
    assert [t["release"] for t in data["tried"]] == ["0.19.4", "0.19.3"]


@releases_only[0]
@releases_only[1]
def test_both_reports_first_bad_and_first_fixed_of_seed_002(tmp_path):
    path = tmp_path / "seed002.json"
    path.write_text(json.dumps(SEED_002))
    r = zs("bisect", str(path), "--from", "0.19.1", "--to", "0.19.4", "--both", "--bad", "0.19.2", "--json",
           timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert (data["first_bad"], data["first_fixed"]) == ("0.19.2", "0.19.3")
    assert {t["release"]: t["outcome"] for t in data["tried"]}["0.19.2"] == "violation"


# ---------------------------------------------------------------- the search itself, on made-up outcomes
def _f(check):
    return Finding(check, "text", Scenario())


def test_outcome_kinds_are_distinct_and_model_disagreement_is_not_one():
    assert outcome_of([]) == PASS
    assert outcome_of([_f("model-agreement")]) == PASS
    assert outcome_of([_f("exception")]) == outcome_of([_f("hang")]) == "crash"
    assert outcome_of([_f("epilogue-once"), _f("saved-tensor-intact")]) == "violation"
    assert outcome_of([_f("oracle")]) == "oracle difference"
    assert outcome_of([_f("exception"), _f("clean-step")]) == "crash + violation"


def _search(outcomes, **kw):
    runs = []

    def outcome(i):
        runs.append(i)
        return outcomes[i]
    rel = [f"0.19.{i}" for i in range(len(outcomes))]
    return [(c["kind"], c["release"]) for c in transitions(rel, outcome, **kw)], runs


def test_first_fixed_and_first_bad_by_binary_search():
    assert _search([PASS, PASS, "crash", "crash", "crash"], both=False, bad=None)[0] == [("first bad", "0.19.2")]
    assert _search(["crash"] * 3 + [PASS] * 5, both=False, bad=None)[0] == [("first fixed", "0.19.3")]


def test_a_crash_turning_into_a_violation_is_a_change():
    assert _search(["crash", "crash", "violation"], both=False, bad=None)[0] == [("outcome changed", "0.19.2")]


def test_both_with_a_known_bad_release_uses_two_binary_searches():
    outcomes = [PASS] * 6 + ["violation"] * 3 + [PASS] * 7
    found, runs = _search(outcomes, both=True, bad=7)
    assert found == [("first bad", "0.19.6"), ("first fixed", "0.19.9")]
    assert len(set(runs)) < len(outcomes) // 2 + 2


def test_both_without_a_bad_release_runs_every_release():
    found, runs = _search([PASS, "crash", "violation", PASS], both=True, bad=None)
    assert found == [("first bad", "0.19.1"), ("outcome changed", "0.19.2"), ("first fixed", "0.19.3")]
    assert set(runs) == {0, 1, 2, 3}


def test_a_release_that_breaks_while_running_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from zerostate.cli import cmd_bisect, targets_api
    from zerostate.cli.main import main
    path = tmp_path / "seed002.json"
    path.write_text(json.dumps(SEED_002))
    monkeypatch.setattr(cmd_bisect, "available_releases", lambda: ["0.19.7", "0.19.8"])
    monkeypatch.setattr(targets_api, "target", lambda args: FailingTarget(after=0))
    rc = main(["bisect", str(path), "--from", "0.19.7", "--to", "0.19.8"])
    assert_one_line_error(rc, capsys.readouterr().err, "rank pool (2 ranks) did not start")
