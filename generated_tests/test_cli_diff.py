"""``zerostate diff``: classification, memory figures, report, and the command on real DeepSpeed builds.

Default-on: the classification on made-up outcomes, the trace metrics on made-up traces, the labels and
groups of the pinned release's known issues, and one short real ``diff`` of the installed DeepSpeed
against itself (as a ``--deepspeed-path`` tree: nothing can be fixed or introduced, every ratio is 1).
Opt-in (``ZEROSTATE_RELEASE_TESTS=1``, installs releases): the issue's acceptance, 0.19.2 -> 0.19.3 fixes
seed 002 and 0.18.6 -> 0.18.7 fixes count-once-per-phase, nothing introduced.  Opt-in
(``ZEROSTATE_PATCHED_DEEPSPEED=DIR``: a 0.19.8 tree with a patch of docs/upstream/ applied): the diff
against 0.19.8 fixes that patch's known issue and introduces nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from test_cli_util import FailingTarget, assert_one_line_error, zs

import deepspeed

from zerostate.reports.diff_classify import classify
from zerostate.explorer.gathered import metrics
from zerostate.reports.diff_memory import compare
from zerostate.model.events import Event, EventKind
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome
from zerostate.findings.finding import Finding
from zerostate.findings.evidence import Evidence, Frame, Raised
from zerostate.known import issues as known
from zerostate.known.labels import groups, label, root_key

RELEASES = os.environ.get("ZEROSTATE_RELEASE_TESTS") == "1"
PATCHED = os.environ.get("ZEROSTATE_PATCHED_DEEPSPEED")
SITE = str(Path(deepspeed.__file__).resolve().parents[1])
UPSTREAM = Path(__file__).resolve().parents[1] / "docs" / "upstream"


# ---------------------------------------------------------------- classification (made-up outcomes)
class _Fake:
    """A recorder stand-in: scenario -> the findings a build shows on it, each ``(check, error, origin)`` or a
    whole `Finding` (its trace and evidence: what a label reads)."""

    def __init__(self, version, table):
        self.version, self.table, self.runs = version, table, []

    def run(self, sc):
        self.runs.append(sc)
        found = [replace(x, scenario=sc, deepspeed=self.version) if isinstance(x, Finding)
                 else Finding(x[0], x[1], sc, target="deepspeed", deepspeed=self.version, origin=x[2])
                 for x in self.table.get(sc, [])]
        return Outcome(sc, [], next((f.error for f in found if f.check == "exception"), None), found)

    def repeat(self, sc, shows, before, runs, max_seconds):
        """Fresh runs, as `cmd_diff.Recorder.repeat` makes them (a fake's worker carries nothing over)."""
        for b in before:
            self.run(b)
        return sum(bool(shows(self.run(sc))) for _ in range(runs)), runs


SC_A = Scenario.from_dict({"blocks": [{}], "stage": 1})
SC_B = Scenario.from_dict({"blocks": [{}, {}], "stage": 3})
SC_C = Scenario.from_dict({"blocks": [{"checkpoint": "reentrant"}], "stage": 3})


def _fs(ver, sc, check, error="boom", origin=None):
    return Finding(check, error, sc, target="deepspeed", deepspeed=ver, origin=origin)


def _evt(kind, param=None, note=None, module=None, task=None):
    return Event(EventKind(kind), param=param, note=note, module=module, task=task)


_W = "blocks.0.norm.weight"


def _leaf_kept(ver, sc):
    """z3-leaf-kept-gathered's evidence: the leaf blocks.0 gathered its norm in this forward, its backward never
    began, the norm is still gathered at the step."""
    trace = (_evt("forward_start"), _evt("role", _W, note="leaf"), _evt("role", _W, note="frozen"),
             _evt("module_pre_forward", module="blocks.0"), _evt("fetch", _W, module="blocks.0"),
             _evt("module_post_forward", module="blocks.0"), _evt("user_backward_start", note="engine"),
             _evt("user_backward_end", note="engine"), _evt("step"))
    return Finding("released-after-backward", f"after the backward (and its epilogue) {_W} is still gathered", sc,
                   trace, len(trace) - 1, "deepspeed", ver, code="still-gathered")


def _leaf_early(ver, sc, check="available-when-used"):
    """z3-leaf-input-without-grad's evidence: the leaf's hook fired before its backward began."""
    from zerostate.findings.evidence import Evidence, Raised
    trace = (_evt("forward_start"), _evt("user_backward_start", note="engine"),
             _evt("task_start", task=0, note="outer"),
             _evt("leaf_hook", module="blocks.0", task=0), _evt("module_pre_backward", module="blocks.0"))
    if check == "exception":
        msg = "The size of tensor a (0) must match the size of tensor b (8) at non-singleton dimension 1"
        return Finding("exception", f"RuntimeError: {msg}", sc, trace, None, "deepspeed", ver,
                       origin="RuntimeError@runtime.engine.backward",
                       evidence=Evidence(raised=Raised("RuntimeError", msg, (
                           Frame("deepspeed", "runtime/engine.py", "backward", 1, "deepspeed.runtime.engine"),))))
    return Finding("available-when-used", f"blocks.0 computes (backward) with {_W} not AVAILABLE", sc, trace,
                   len(trace) - 1, "deepspeed", ver, code="unavailable-in-backward")


def test_classify_fixed_introduced_unchanged_with_the_other_sides_replay():
    a = ("exception", "ValueError: a", "ValueError@x.f")
    base = _Fake("0.19.8", {SC_A: [a], SC_B: [("clean-step", "stale", None)]})
    head = _Fake("0.19.8", {SC_B: [("clean-step", "stale", None)],
                            SC_C: [("oracle", "differs", None)]})
    entries = classify([_fs("0.19.8", SC_A, *a), _fs("0.19.8", SC_B, "clean-step", "stale")],
                       [_fs("0.19.8", SC_B, "clean-step", "stale"), _fs("0.19.8", SC_C, "oracle", "differs")],
                       base, head)
    status = {e.check: e.status for e in entries}
    assert status == {"exception": "fixed", "clean-step": "unchanged", "oracle": "introduced"}
    assert [e.status for e in entries] == ["introduced", "fixed", "unchanged"]
    fixed = next(e for e in entries if e.status == "fixed")
    assert fixed.replay.clean and fixed.other_side == "head" and fixed.found_on == "base"
    new = next(e for e in entries if e.status == "introduced")
    assert new.replay.clean and new.other_side == "base" and new.found_on == "head"
    assert SC_C in base.runs and SC_A in head.runs  # each finding replayed on the other build


def test_a_finding_the_head_exploration_missed_is_unchanged_when_its_replay_shows_it():
    f = ("exception", "IndexError: list index out of range", "IndexError@s.reduce_ipg_grads")
    base = _Fake("0.19.8", {SC_A: [f]})
    head = _Fake("0.19.8", {SC_A: [f]})
    entries = classify([_fs("0.19.8", SC_A, *f)], [], base, head)
    assert [e.status for e in entries] == ["unchanged"]


def test_a_known_bug_of_base_that_a_crash_hid_is_unmasked_not_introduced():
    sc = known.Z3_LEAF_KEPT_GATHERED.scenario
    kept = ("released-after-backward", "after the backward (and its epilogue) X are still gathered", None)
    crash = ("exception", "RuntimeError: The size of tensor a (0) must match", "RuntimeError@stage3.hook")
    head = _Fake("0.19.8", {sc: [kept]})
    entries = classify([], [_leaf_kept("0.19.8", sc)], _Fake("0.19.8", {sc: [crash]}), head)
    assert [e.status for e in entries] == ["unmasked"]
    # the same finding where base ran to the end without it is introduced
    entries = classify([], [_leaf_kept("0.19.8", sc)], _Fake("0.19.8", {}), head)
    assert [e.status for e in entries] == ["introduced"]
    # and a finding no known issue explains is introduced even behind a crash
    other = ("clean-step", "stale gradients survive engine.step()", None)
    entries = classify([], [_fs("0.19.8", SC_A, *other[:2])], _Fake("0.19.8", {SC_A: [crash]}),
                       _Fake("0.19.8", {SC_A: [other]}))
    assert [e.status for e in entries] == ["introduced"]


def test_a_known_bug_of_base_that_another_bug_hid_is_unmasked_not_introduced():
    """0.19.2 -> 0.19.3: 0.19.3 releases a z3 leaf's backward leftovers, so the leaf fed no grad meets its
    size-0 parameters (z3-leaf-input-without-grad's exception, its fingerprint recorded from this scenario on
    0.19.3: a variant of the issue); on 0.19.2 the still-gathered leak kept them gathered and the replay shows
    that finding instead."""
    sc = Scenario.from_dict({"blocks": [{"leaf": True, "norm": "frozen"}], "input_requires_grad": False, "stage": 3,
                             "steps": [{"micro": [{"backward": "engine"}, {"backward": "engine"}]}]})
    unavailable = _leaf_early("0.19.3", sc, check="exception")
    head = _Fake("0.19.3", {})
    leak = _Fake("0.19.2", {sc: [("released-after-backward", "X are still gathered", None)]})
    assert [e.status for e in classify([], [unavailable], leak, head)] == ["unmasked"]
    # base ran clean: introduced; and a finding no known issue explains is introduced behind another bug
    assert [e.status for e in classify([], [unavailable], _Fake("0.19.2", {}), head)] == ["introduced"]
    other = _fs("0.19.3", SC_A, "clean-step", "stale gradients survive engine.step()")
    leak_a = _Fake("0.19.2", {SC_A: [("released-after-backward", "X are still gathered", None)]})
    assert [e.status for e in classify([], [other], leak_a, head)] == ["introduced"]


class _Racy(_Fake):
    """A build whose worker shows a finding on every ``every``-th run of its scenario (a race: counted over the
    build's whole life, a fresh worker does not reset it)."""

    def __init__(self, version, sc, finding, every):
        super().__init__(version, {})
        self.sc, self.finding, self.every, self.n = sc, finding, every, 0

    def run(self, sc):
        out = super().run(sc)
        if sc == self.sc:
            self.n += 1
            if self.n % self.every == 0:
                c, e, o = self.finding
                out.findings.append(Finding(c, e, sc, target="deepspeed", deepspeed=self.version, origin=o))
        return out


def test_a_base_finding_is_fixed_only_after_as_many_replays_as_confirmation_makes():
    """'fixed' means what the explorer calls 'not reproduced' (explorer/confirm.py): no hit in REPEAT runs
    alone in a fresh worker, after the first replay."""
    from zerostate.explorer.confirm import REPEAT
    a = ("exception", "ValueError: a", "ValueError@x.f")
    head = _Fake("0.19.8", {})
    entries = classify([_fs("0.19.8", SC_A, *a)], [], _Fake("0.19.8", {SC_A: [a]}), head)
    assert [e.status for e in entries] == ["fixed"]
    assert entries[0].replay.runs == REPEAT + 1 and entries[0].replay.hits == 0
    assert head.runs.count(SC_A) == REPEAT + 1


def test_a_race_one_replay_misses_is_intermittent_not_fixed():
    """A base finding its first head replay does not show, but later ones do: intermittent on head, and
    not counted as fixed."""
    from zerostate.explorer.confirm import REPEAT
    a = ("exception", "ValueError: a", "ValueError@x.f")
    head = _Racy("0.19.8", SC_A, a, every=7)
    entries = classify([_fs("0.19.8", SC_A, *a)], [], _Fake("0.19.8", {SC_A: [a]}), head)
    assert [e.status for e in entries] == ["intermittent"]
    rep = entries[0].replay
    assert entries[0].other_side == "head" and rep.runs == REPEAT + 1 and rep.hits == (REPEAT + 1) // 7
    # a head finding that base shows in some runs only exists on base: intermittent, not introduced
    entries = classify([], [_fs("0.19.8", SC_A, *a)], _Racy("0.19.8", SC_A, a, every=7), _Fake("0.19.8", {}))
    assert [e.status for e in entries] == ["intermittent"]


def test_a_label_preserving_swap_of_one_crash_for_another_is_introduced():
    """Head swaps base's crash for another one (another message, from another place) in the same scenario,
    under the same known issue: not unchanged, and not unmasked either -- base ran into that known issue
    itself.  Both show the mechanism: the leaf's hook fired before its backward (the trace) and left size-0
    gradients, which base's backward cannot accumulate into and head's ZeRO-3 reduction refuses (its own
    RuntimeError in __reduce_and_partition_ipg_grads: a head that reduces the leaf's bucket first)."""
    sc = known.Z3_LEAF_INPUT_NO_GRAD.scenario
    fb = _leaf_early("0.19.8", sc, "exception")
    reduce_refuses = Raised("RuntimeError", "0 != 64 Cannot reduce scatter gradients whose size is not same as the "
                            "params", (Frame("deepspeed", "runtime/engine.py", "backward", 1,
                                             "deepspeed.runtime.engine"),
                                       Frame("deepspeed", "runtime/zero/stage3.py",
                                             "__reduce_and_partition_ipg_grads", 1, "deepspeed.runtime.zero.stage3")))
    fh = replace(fb, error=f"RuntimeError: {reduce_refuses.message}",
                 origin="RuntimeError@runtime.zero.stage3.__reduce_and_partition_ipg_grads",
                 evidence=Evidence(raised=reduce_refuses))
    # a crash that does not show the mechanism is no swap under the label: it is the head's own finding
    alien = replace(fh, evidence=Evidence(raised=replace(reduce_refuses, frames=(
        Frame("deepspeed", "runtime/zero/stage3.py", "_injected_fault", 1, "deepspeed.runtime.zero.stage3"),))))
    assert label(alien) is None
    assert fb.key != fh.key and label(fb) is not None and label(fb) == label(fh)  # the same label
    base, head = _Fake("0.19.8", {sc: [fb]}), _Fake("0.19.8", {sc: [fh]})
    entries = classify([fb], [fh], base, head)
    # head raised where base did: base's crash is not judged fixed there, head's is introduced
    assert {e.found_on: e.status for e in entries} == {"base": "not-reached", "head": "introduced"}


def test_a_build_that_breaks_while_running_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from zerostate.cli import targets_api
    from zerostate.cli.main import main
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(targets_api, "target", lambda args: FailingTarget(after=5))
    rc = main(["diff", "--base", "0.19.7", "--head", "0.19.8", "--examples", "10", "--out", str(tmp_path / "d")])
    assert_one_line_error(rc, capsys.readouterr().err, "the target failed", "rank pool (2 ranks) did not start")


# ---------------------------------------------------------------- memory figures (made-up traces)
def _ev(kind, param=None, note=None):
    return Event(EventKind(kind), param=param, note=note)


def test_peak_counts_elements_gathered_at_once_and_all_gathers_once_each():
    sc = Scenario.from_dict({"blocks": [{}, {}], "stage": 3})
    w = "blocks.0.lin.weight"
    trace = [_ev("fetch", w), _ev("prefetch", "blocks.1.lin.weight"), _ev("fetch", "blocks.1.lin.weight", "inflight"),
             _ev("release", w), _ev("release", "blocks.1.lin.weight"), _ev("fetch", w), _ev("release", w)]
    m = metrics(sc, trace)
    width = sc.width
    assert m == {"peak_elements": 2 * width * width, "peak_params": 2, "all_gathers": 3}


def test_a_head_peak_beyond_the_tolerance_is_a_regression_and_a_lower_one_is_not():
    sc = Scenario.from_dict({"blocks": [{"leaf": True}], "stage": 3})
    base = {"peak_elements": 100, "peak_params": 2, "all_gathers": 4}
    up = compare([(sc, base, {**base, "peak_elements": 111})], 0.10)
    assert len(up.regressions) == 1 and up.families[0].peak_elements.worst_ratio == pytest.approx(1.11)
    down = compare([(sc, base, {**base, "peak_elements": 50})], 0.10)
    assert not down.regressions and down.families[0].peak_elements.differ_most.head == 50
    assert not compare([(sc, base, {**base, "peak_elements": 110})], 0.10).regressions


# ---------------------------------------------------------------- labels and groups
def test_the_known_issues_scenarios_are_labelled_and_backward_kinds_share_a_group():
    from zerostate.findings.evidence import Evidence, Frame, Raised
    no_grad = known.ZERO12_NO_GRADIENT.scenario
    index = Raised("IndexError", "list index out of range",
                   (Frame("deepspeed", "runtime/zero/stage_1_and_2.py", "reduce_ipg_grads", 1,
                          "deepspeed.runtime.zero.stage_1_and_2"),))
    hookless = (_evt("forward_start"), _evt("user_backward_start", note="engine"))  # raised in that backward
    for k, f in ((known.Z3_LEAF_INPUT_NO_GRAD,
                   _leaf_early("0.19.8", known.Z3_LEAF_INPUT_NO_GRAD.scenario, "exception")),
                 (known.ZERO12_NO_GRADIENT, Finding("exception", "IndexError: list index out of range", no_grad,
                                                    hookless, None, "deepspeed", "0.19.8",
                                                    evidence=Evidence(raised=index))),
                 (known.Z3_LEAF_KEPT_GATHERED, _leaf_kept("0.19.8", known.Z3_LEAF_KEPT_GATHERED.scenario))):
        assert label(f)["id"] == k.id
        assert label(replace(f, trace=())) is None  # the scenario alone labels nothing
    eng = _fs(None, SC_A, "exception", "RuntimeError: size of tensor a (0) must match b (8)", "E@engine.backward")
    tor = _fs(None, SC_A, "exception", "RuntimeError: size of tensor a (0) must match b (16)", "E@stage3.hook")
    assert eng.key != tor.key and root_key(eng) == root_key(tor)
    # the same message raised in a second backward through a retained graph is another root cause
    again = (_evt("forward_start"), _evt("user_backward_start", note="engine"),
             _evt("user_backward_end", note="engine"), _evt("user_backward_start", note="engine"))
    assert root_key(replace(eng, trace=again)) == root_key(eng) + " @backward-again"
    # so is a saved tensor changed under the same two backwards: placed as its fingerprint places it
    inplace = "one of the variables needed for gradient computation has been modified by an inplace operation"
    saved = Finding("saved-tensor-intact", f"RuntimeError: {inplace}", SC_A, target="deepspeed",
                    evidence=Evidence(raised=Raised("RuntimeError", inplace, ())))
    assert root_key(replace(saved, trace=again)) == root_key(saved) + " @backward-again"
    assert root_key(replace(saved, trace=hookless)) == root_key(saved) + " @backward"
    violated = replace(saved, evidence=Evidence())  # the spec's own violation: its key places it, not the trace's end
    assert root_key(replace(violated, trace=again)) == root_key(violated)
    assert label(eng) is None  # no release: not labelled
    entries = [{"n": 1, "group": "g1", "group_title": "t"}, {"n": 2, "group": "g2"}, {"n": 3, "group": "g1"}]
    assert [(g["key"], g["count"], g["findings"]) for g in groups(entries)] == [("g1", 2, [1, 3]), ("g2", 1, [2])]


def test_seed_bugs_are_labelled_with_their_first_fixed_release_only_on_releases_that_have_them():
    sc = Scenario.from_dict({"blocks": [{"checkpoint": "non_reentrant", "norm": "frozen"}], "stage": 3})
    trace = (_evt("role", _W, note="frozen"), _evt("user_backward_start", note="engine"),
             _evt("save_live", _W, module="blocks.0"),
             _evt("release", _W, module="blocks.0.norm"), _evt("unpack", _W, module="blocks.0", note="check"))
    seed = Finding("saved-tensor-intact", f"{_W} is partitioned in place after the recompute saved it", sc, trace, 4,
                   "deepspeed", "0.19.2", code="partitioned-at-check")
    assert label(seed)["fixed_in"] == "0.19.3"
    assert label(replace(seed, deepspeed="0.19.3")) is None
    assert label(replace(seed, trace=trace[:3] + trace[4:], index=3)) is None  # never released after the save


# ---------------------------------------------------------------- the command on real DeepSpeed
@pytest.mark.deepspeed
def test_diff_of_a_build_against_itself_changes_nothing(tmp_path):
    out = tmp_path / "d"
    kept = str(UPSTREAM / "z3-leaf-kept-gathered" / "scenario.json")
    r = zs("diff", "--base", SITE, "--head", SITE, "--examples", "4", "--time-budget", "60", "--out", str(out),
           "--scenario", kept, "--json", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert data["counts"]["fixed"] == data["counts"]["introduced"] == 0
    # the given scenario ran on both builds: its known bug is there, unchanged
    assert any(e["status"] == "unchanged" and (e["known_issue"] or {}).get("id") == "z3-leaf-kept-gathered"
               for e in data["findings"]), data["findings"]
    assert data["base"]["deepspeed"] == data["head"]["deepspeed"] == deepspeed.__version__
    assert data["memory"]["families"] and not data["memory"]["regressions"]
    for fam in data["memory"]["families"]:
        assert fam["peak_elements"]["worst_ratio"] == fam["all_gathers"]["worst_ratio"] == 1.0
    md = (out / "diff.md").read_text()
    assert "no regression" in md and "## Gathered-parameter memory" in md
    assert json.loads((out / "diff.json").read_text())["verdict"] == "no regression"


def test_bad_base_is_a_clear_error_before_anything_runs(tmp_path):
    r = zs("diff", "--base", str(tmp_path / "nope"), "--head", "0.19.8", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--base" in r.stderr and "no such directory" in r.stderr
    assert not (tmp_path / "o").exists()


def _diff(base, head, tmp_path, *extra):
    r = zs("diff", "--base", base, "--head", head, "--out", str(tmp_path / "d"), "--json", *extra, timeout=3000)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return json.loads(r.stdout), r.returncode


@pytest.mark.deepspeed
@pytest.mark.skipif(not RELEASES, reason="installs DeepSpeed releases; set ZEROSTATE_RELEASE_TESTS=1")
def test_0_19_3_fixes_seed_002_and_introduces_nothing(tmp_path):
    data, rc = _diff("0.19.2", "0.19.3", tmp_path)
    fixed = [e for e in data["findings"] if e["status"] == "fixed"]
    assert any((e["known_issue"] or {}).get("id") == "seed-002" for e in fixed), data["findings"]
    assert data["counts"]["introduced"] == 0 and rc == (1 if data["memory"]["regressions"] else 0)


@pytest.mark.deepspeed
@pytest.mark.skipif(not RELEASES, reason="installs DeepSpeed releases; set ZEROSTATE_RELEASE_TESTS=1")
def test_0_18_7_fixes_count_once_per_phase_and_introduces_nothing(tmp_path):
    data, rc = _diff("0.18.6", "0.18.7", tmp_path)
    assert any(e["check"] == "count-once-per-phase" for e in data["findings"] if e["status"] == "fixed")
    assert data["counts"]["introduced"] == 0 and rc == (1 if data["memory"]["regressions"] else 0)


@pytest.mark.deepspeed
@pytest.mark.skipif(not PATCHED, reason="set ZEROSTATE_PATCHED_DEEPSPEED=DIR (0.19.8 + a docs/upstream patch)")
def test_a_docs_upstream_patch_fixes_its_issue_and_introduces_nothing(tmp_path):
    scenarios = sorted(UPSTREAM.glob("*/scenario*.json"))  # each bug's shrunk scenario, besides the exploration
    data, rc = _diff("0.19.8", PATCHED, tmp_path, *[a for sc in scenarios for a in ("--scenario", str(sc))])
    assert data["head"]["deepspeed"] == "0.19.8"
    assert data["counts"]["fixed"] >= 1 and data["counts"]["introduced"] == 0, data["findings"]
    assert rc == 0


# ---------------------------------------------------------------- --deepspeed-path: a plain checkout's version
def _checkout(tmp_path, version_txt):
    """A tree shaped like a git checkout of the installed DeepSpeed: no git_version_info_installed.py (so
    DeepSpeed reads the relative path version.txt), the package's own files symlinked."""
    root = tmp_path / "DeepSpeed"
    pkg = root / "deepspeed"
    pkg.mkdir(parents=True)
    src = Path(deepspeed.__file__).resolve().parent
    for entry in src.iterdir():
        if entry.name in ("git_version_info_installed.py", "__pycache__"):
            continue
        if entry.name in ("__init__.py", "git_version_info.py"):
            (pkg / entry.name).write_text(entry.read_text())
        else:
            (pkg / entry.name).symlink_to(entry)
    if version_txt:
        (root / "version.txt").write_text(version_txt + "\n")
    return root


def _patch(root, rel, old, new, append=""):
    """Replace the symlinked ``deepspeed/<rel>`` of a `_checkout` tree by a patched copy (its folders become
    real folders of symlinks on the way down)."""
    parts = Path(rel).parts
    here = root / "deepspeed"
    for part in parts[:-1]:
        link = here / part
        if link.is_symlink():
            src = link.resolve()
            link.unlink()
            link.mkdir()
            for entry in src.iterdir():
                if entry.name != "__pycache__":
                    (link / entry.name).symlink_to(entry)
        here = link
    target = here / parts[-1]
    text = target.read_text()
    assert text.count(old) == 1, f"{rel}: the patch's anchor is not there once"
    target.unlink()
    target.write_text(text.replace(old, new) + append)


LEAF_HOOK = """        def _pre_forward_module_hook(module, *args):
            self.pre_sub_module_forward_function(module)"""
LEAF_CHECK = """

def _check_leaf_inputs(module, inputs):
    if z3_leaf_module(module) and torch.is_grad_enabled() and not any(
            torch.is_tensor(t) and t.requires_grad for t in inputs):
        raise ValueError("a z3 leaf module's inputs do not require grad")
"""


@pytest.mark.deepspeed
def test_a_patch_that_swaps_a_known_crash_for_another_is_introduced(tmp_path):
    """The head tree (0.19.8, patched) fails z3-leaf-input-without-grad's scenario with a ValueError raised in
    the leaf module's pre-forward hook instead of 0.19.8's RuntimeError in the backward: the same scenario
    family, another mechanism.  diff says introduced, not unchanged or unmasked; base's crash in the backward is
    not-reached on head (head stopped in the forward before it), not fixed."""
    root = _checkout(tmp_path, deepspeed.__version__)
    _patch(root, "runtime/zero/parameter_offload.py", LEAF_HOOK,
           LEAF_HOOK.replace("            self.pre", "            _check_leaf_inputs(module, args[0] if args else ())\n"
                                                 "            self.pre"), LEAF_CHECK)
    scenario = tmp_path / "leaf.json"
    scenario.write_text(known.Z3_LEAF_INPUT_NO_GRAD.scenario.to_json())
    data, rc = _diff(SITE, str(root), tmp_path, "--examples", "1", "--scenario", str(scenario))
    assert rc == 1 and data["verdict"] == "head introduces findings", data["findings"]
    leaf = known.Z3_LEAF_INPUT_NO_GRAD.scenario.to_dict()
    by_side = {e["found_on"]: e for e in data["findings"] if e["scenario"] == leaf}
    head, base = by_side["head"], by_side["base"]
    assert head["key"] == ("exception:ValueError@runtime.zero.parameter_offload._check_leaf_inputs:"
                           "a z3 leaf module's inputs do not require grad"), head
    assert head["status"] == "introduced" and base["status"] == "not-reached", (head, base)
    assert base["key"] != head["key"] and base["known_issue"]["id"] == "z3-leaf-input-without-grad"
    assert base["replay_on_head"]["hits"] == 0 and base["replay_on_head"]["runs"] > 1


@pytest.mark.deepspeed
def test_a_rank_pool_that_cannot_start_is_one_line_and_exit_2(tmp_path):
    """A checkout that imports in the world-size-1 worker but not on two ranks: replaying a world-size-2
    scenario, and exploring one, end with one line and exit 2, never a traceback."""
    root = _checkout(tmp_path, deepspeed.__version__)
    init = root / "deepspeed" / "__init__.py"
    init.write_text('import os as _os\nif _os.environ.get("WORLD_SIZE") == "2":\n'
                    '    raise ImportError("this tree does not import on two ranks")\n' + init.read_text())
    ws2 = tmp_path / "ws2.json"
    ws2.write_text(json.dumps({"blocks": [{}], "stage": 1, "world_size": 2}))
    r = zs("replay", str(ws2), "--deepspeed-path", str(root), timeout=900)
    assert_one_line_error(r.returncode, r.stderr, "2 ranks")


@pytest.mark.deepspeed
def test_a_checkout_reports_the_version_in_its_version_txt(tmp_path):
    root = _checkout(tmp_path, deepspeed.__version__)
    (tmp_path / "s.json").write_text(json.dumps({"blocks": [{}], "stage": 1}))
    r = zs("replay", "--deepspeed-path", str(root), str(tmp_path / "s.json"), timeout=600)
    assert r.returncode == 0 and f"on DeepSpeed {deepspeed.__version__}" in r.stdout, r.stdout + r.stderr


@pytest.mark.deepspeed
def test_a_checkout_without_version_txt_is_a_clear_error(tmp_path):
    root = _checkout(tmp_path, None)
    (tmp_path / "s.json").write_text(json.dumps({"blocks": [{}], "stage": 1}))
    r = zs("replay", "--deepspeed-path", str(root), str(tmp_path / "s.json"), timeout=600)
    assert r.returncode == 2 and "version.txt" in r.stderr and "0.0.0" in r.stderr, r.stdout + r.stderr


# ---------------------------------------------------------------- docs/upstream: the patches still apply


@pytest.mark.parametrize("issue", ["z3-leaf-kept-gathered", "zero12-backward-without-gradients",
                                   "z3-leaf-input-without-grad", "bf16-optimizer-clears-in-forward-grads",
                                   "zero1-reduce-keeps-other-partitions", "fp16-offload-overflowed-grad-after-freeze"])
def test_each_upstream_patch_applies_to_the_pinned_release(issue, tmp_path):
    import shutil
    import subprocess
    if shutil.which("patch") is None:
        pytest.skip("no `patch` program")
    k = next(k for k in known.KNOWN_ISSUES if k.id == issue)
    assert k.upstream_patch == f"docs/upstream/{issue}/" and k.affects(deepspeed.__version__)
    fix = (UPSTREAM / issue / "fix.patch").read_text()
    site = Path(deepspeed.__file__).resolve().parents[1]
    for line in fix.splitlines():  # the files it touches, copied from the installed release
        if line.startswith("+++ b/"):
            rel = line[len("+++ b/"):].split("\t")[0]
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(site / rel, tmp_path / rel)
    r = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(tmp_path), "-i", str(UPSTREAM / issue / "fix.patch")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "FAILED" not in r.stdout and "offset" not in r.stdout, r.stdout + r.stderr
    for name in ("README.md", "fix.patch"):
        assert (UPSTREAM / issue / name).exists()


# ---------------------------------------------------------------- the recorder, the report
def test_the_recorder_memoises_runs_and_keeps_each_finished_zero3_runs_gathered_metrics():
    """`cli.cmd_diff.Recorder` on the model target: one target run per scenario, the ZeRO-3 ones' metrics kept."""
    from zerostate.cli.cmd_diff import Recorder
    from zerostate.targets.interface import get_target
    rec = Recorder(get_target("model", design="ds-0.19.3"))
    z3, z1 = Scenario.from_dict({"blocks": [{}, {}], "stage": 3}), SC_A
    first = rec.run(z3)
    assert rec.run(z3) is first and rec.run(z1).scenario == z1
    assert set(rec.outcomes) == {z3, z1} and set(rec.gathered) == {z3}  # ZeRO-1 gathers nothing
    assert rec.gathered[z3] == metrics(z3, first.trace) and rec.gathered[z3]["all_gathers"] > 0
    rec.close()


def test_the_diff_report_writes_its_json_and_a_markdown_row_per_finding(tmp_path):
    """`reports.diff_model` serialised and `reports.diff_report` rendered, from classified entries."""
    from zerostate.reports.diff_model import DiffReport, DiffSide
    from zerostate.reports.diff_report import write_report
    a = ("exception", "ValueError: a", "ValueError@x.f")
    base = _Fake("0.19.8", {SC_A: [a]})
    head = _Fake("0.19.8", {SC_C: [("oracle", "differs", None)]})
    entries = classify([_fs("0.19.8", SC_A, *a)], [_fs("0.19.8", SC_C, "oracle", "differs")], base, head)
    z3 = {"peak_elements": 100, "peak_params": 2, "all_gathers": 4}
    memory = compare([(SC_B, z3, {**z3, "peak_elements": 150})], 0.10)
    counts = {"introduced": 1, "fixed": 1, "intermittent": 0, "unmasked": 0, "unchanged": 0, "not-reached": 0}
    report = DiffReport(DiffSide("0.19.8", "DeepSpeed 0.19.8", "0.19.8", 3, "complete"),
                        DiffSide("/tmp/ds", "DeepSpeed /tmp/ds", "0.19.8", 4, "complete"), "complete", 10, (), None,
                        1, 1.5, counts, tuple(entries), memory, "zerostate diff", "head introduces findings")
    write_report(str(tmp_path), report)
    data = json.loads((tmp_path / "diff.json").read_text())
    assert data == json.loads(json.dumps(report.to_json()))
    assert [(f["n"], f["status"], f["file"]) for f in data["findings"]] == [(1, "introduced", "finding_1.json"),
                                                                          (2, "fixed", "finding_2.json")]
    assert "replay_on_base" in data["findings"][0] and "replay_on_head" in data["findings"][1]
    assert json.loads((tmp_path / "finding_2.json").read_text())["check"] == "exception"
    md = (tmp_path / "diff.md").read_text()
    assert md.startswith("# zerostate diff: DeepSpeed 0.19.8 → DeepSpeed /tmp/ds\n")
    assert "| [1](#diff-1) | **introduced** | `oracle` |" in md and "| [2](#diff-2) | **fixed** | `exception` |" in md
    assert "**Memory regressions**" in md and "Root causes: " in md


# ---------------------------------------------------------------- one identity per bug: the fingerprint
def _crash(ver, sc, message, function="__reduce_and_partition_ipg_grads", steps=1):
    """An AssertionError raised in ZeRO-3's ``function`` after ``steps`` train steps, with ``message``."""
    trace = tuple(e for _ in range(steps) for e in (_evt("forward_start"), _evt("step"))) + (_evt("forward_start"),)
    frames = (Frame("zerostate", "harness/executor.py", "execute", 1, "zerostate.harness.executor"),
              Frame("deepspeed", "runtime/zero/stage3.py", function, 1, "deepspeed.runtime.zero.stage3"))
    return Finding("exception", f"AssertionError: {message}", sc, trace, None, "deepspeed", ver,
                   origin=f"AssertionError@runtime.zero.stage3.{function}",
                   evidence=Evidence(raised=Raised("AssertionError", message, frames)))


def test_two_mechanisms_with_one_old_key_are_two_findings_and_a_swap_is_introduced():
    """The same exception type from the same DeepSpeed function (one key before fingerprints) with two
    messages is two bugs: kept apart, and a head that swaps one for the other introduces the second."""
    from zerostate.findings.build import unique_by_key
    one = _crash("0.19.8", SC_B, "param 3 already reduced")
    other = _crash("0.19.8", SC_B, "bucket of 4 elements is not empty")
    assert one.origin == other.origin and one.key != other.key
    assert unique_by_key([one, other]) == [one, other]
    base, head = _Fake("0.19.8", {SC_B: [one]}), _Fake("0.19.8", {SC_B: [other]})
    status = {(e.found_on, e.status) for e in classify([one], [other], base, head)}
    # head raised at the step where base did: it never ran past base's failure, so base's is not judged fixed
    assert status == {("base", "not-reached"), ("head", "introduced")}, status


def test_a_head_that_crashes_earlier_does_not_fix_base_findings():
    """Base fails at train step 2; head raises another exception at step 0: head never reached the point where
    base failed, so base's finding is not reached, not fixed (and head's crash is introduced)."""
    late = _crash("0.19.8", SC_B, "param 3 already reduced", steps=2)
    early = _crash("0.19.8", SC_B, "bucket of 4 elements is not empty", function="partition_grads", steps=0)
    base, head = _Fake("0.19.8", {SC_B: [late]}), _Fake("0.19.8", {SC_B: [early]})
    head.run = lambda sc, _run=head.run: replace(_run(sc), trace=list(early.trace))  # its run's own trace
    status = {(e.found_on, e.status) for e in classify([late], [early], base, head)}
    assert status == {("base", "not-reached"), ("head", "introduced")}, status
    clean = _Fake("0.19.8", {})  # a head that runs the scenario to its end does fix it
    assert [e.status for e in classify([late], [], base, clean)] == ["fixed"]
