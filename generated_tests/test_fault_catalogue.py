"""The fault-injection catalogue (benchmarks/faults/) is sound data, and its kill rule says what docs/faults.md says.

Cheap: no DeepSpeed import, no exploration.  Every fault's original text occurs exactly once in the installed
release's source; applying a fault and taking it back restores the file byte for byte, even when the block
fails; a fault whose text is missing writes nothing.  The kill rule (`faults.verdict.judge`) and the
kill rate (`faults.table.summary`) on hand-made findings.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from faults.apply import FaultError, applied, faulted_text
from faults.catalogue import FAULTS, RELEASE, Fault
from faults.table import summary
from faults.verdict import SeenFinding, judge


def _installed() -> Path:
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin, "deepspeed is not installed (the test extra installs it)"
    return Path(spec.origin).parent


def test_catalogue_is_for_the_installed_release() -> None:
    assert importlib.metadata.version("deepspeed") == RELEASE, (
        f"the fault catalogue's texts are taken from DeepSpeed {RELEASE}; this environment has "
        f"{importlib.metadata.version('deepspeed')}")


def test_catalogue_has_at_least_twenty_distinct_faults_over_every_area() -> None:
    assert len(FAULTS) >= 20
    assert len({f.id for f in FAULTS}) == len(FAULTS)
    assert {f.area for f in FAULTS} == {"hooks", "coordinator", "reduction", "step", "checkpoint"}
    assert all(f.original != f.replacement and f.rationale for f in FAULTS)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_original_text_occurs_exactly_once(fault: Fault) -> None:
    source = (_installed() / fault.file).read_text()
    assert source.count(fault.original) == 1


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_apply_then_revert_is_exact(fault: Fault, tmp_path: Path) -> None:
    path = tmp_path / "deepspeed" / fault.file
    path.parent.mkdir(parents=True)
    original = (_installed() / fault.file).read_bytes()
    path.write_bytes(original)
    with applied(fault, tmp_path):
        faulted = path.read_text()
        assert faulted != original.decode()
        assert faulted == original.decode().replace(fault.original, fault.replacement)
        assert fault.original not in faulted or fault.original in fault.replacement
    assert path.read_bytes() == original


def test_revert_survives_a_failing_block(tmp_path: Path) -> None:
    fault = FAULTS[0]
    path = tmp_path / "deepspeed" / fault.file
    path.parent.mkdir(parents=True)
    original = (_installed() / fault.file).read_bytes()
    path.write_bytes(original)
    with pytest.raises(RuntimeError, match="boom"), applied(fault, tmp_path):
        raise RuntimeError("boom")
    assert path.read_bytes() == original


def test_missing_or_repeated_text_writes_nothing(tmp_path: Path) -> None:
    fault = Fault("x", "hooks", "runtime/a.py", "needle\n", "pin\n", "test")
    path = tmp_path / "deepspeed" / "runtime" / "a.py"
    path.parent.mkdir(parents=True)
    for text in ("no such text\n", "needle\nneedle\n"):
        path.write_text(text)
        with pytest.raises(FaultError, match="occurs"), applied(fault, tmp_path):
            pass
        assert path.read_text() == text
    with pytest.raises(FaultError, match="no file"), applied(Fault("y", "hooks", "runtime/b.py", "a", "b", "test"),
                                                             tmp_path):
        pass
    assert faulted_text(fault, "x\nneedle\n") == "x\npin\n"


def _seen(key: str, check: str, seconds: float, known: str | None = None, n: int = 1) -> SeenFinding:
    return SeenFinding(key=key, check=check, error="e", known_issue=known, seconds=seconds, examples=n, n=n)


BASE = [{"key": "oracle:two-backwards-per-forward", "check": "oracle",
         "known_issue": {"id": "two-backwards-per-forward"}},
        {"key": "grad-handled-once:handled-twice", "check": "grad-handled-once", "known_issue": None}]


def test_only_a_new_key_about_deepspeed_kills() -> None:
    same = [_seen("grad-handled-once:handled-twice", "grad-handled-once", 3.0)]
    assert judge(BASE, same).status == "survived"
    tool = same + [_seen("oracle-error", "oracle-error", 4.0, n=2)]
    v = judge(BASE, tool)
    assert v.status == "tool-error" and v.tool_errors == ["oracle-error"]
    new = tool + [_seen("epilogue-once:no-epilogue", "epilogue-once", 9.0, n=3),
                  _seen("oracle", "oracle", 5.0, n=4)]
    v = judge(BASE, new)
    assert v.status == "killed" and v.killer is not None and v.killer["key"] == "oracle"  # the earliest
    assert set(v.new_keys) == {"epilogue-once:no-epilogue", "oracle"}
    assert judge(BASE, new, frozenset({"oracle", "epilogue-once:no-epilogue"})).status == "tool-error"


def test_a_kill_under_a_label_the_unfaulted_run_has_is_marked_hidden() -> None:
    hidden = [_seen("exception:ValueError@x.y", "exception", 2.0, known="two-backwards-per-forward")]
    assert judge(BASE, hidden).hidden_by_label
    assert not judge(BASE, [_seen("exception:ValueError@x.y", "exception", 2.0, known="other")]).hidden_by_label


def _result(status: str, cpu_blind: str = "", seconds: float = 1.0) -> dict[str, object]:
    killer = _seen("k", "oracle", seconds) if status == "killed" else None
    return {"status": status, "cpu_blind": cpu_blind, "killer": killer, "hidden_by_label": False}


def test_kill_rate_counts_an_equivalence_argument_that_a_kill_refuted() -> None:
    results = [_result("killed"), _result("killed", seconds=500.0), _result("survived"),
               _result("survived", cpu_blind="streams"), _result("killed", cpu_blind="streams")]
    figures = summary(results, 120.0)  # type: ignore[arg-type]
    assert figures["non_equivalent"] == 4 and figures["killed_non_equivalent"] == 3
    assert figures["killed_within_fast_s"] == 2


def test_findings_are_timed_by_the_first_report_that_holds_them() -> None:
    from faults.verdict import seen_in
    first = {"run": {"seconds": 4.5, "examples_run": 7},
             "findings": [{"key": "a", "check": "oracle", "error": "x", "known_issue": {"id": "k"}}]}
    later = {"run": {"seconds": 9.0, "examples_run": 12},
             "findings": [{"key": "a", "check": "oracle", "error": "x", "known_issue": {"id": "k"}},
                          {"key": "b", "check": "hang", "error": "y", "known_issue": None}]}
    seen = seen_in(later, seen_in(first, {}))
    assert (seen["a"]["seconds"], seen["a"]["examples"], seen["a"]["known_issue"]) == (4.5, 7, "k")
    assert (seen["b"]["seconds"], seen["b"]["n"]) == (9.0, 2)


def test_the_table_says_which_survivors_were_cut() -> None:
    from faults.table import markdown
    results = [{**_result("survived"), "id": "f", "area": "hooks", "tool_errors": [],
                "run": {"examples_run": 300, "cut_s": 480.0}},
               {**_result("killed"), "id": "g", "area": "step", "replays": {}, "run": {}}]
    text = markdown(results, summary(results, 120.0), {"release": RELEASE, "examples": None, "seed": None})  # type: ignore[arg-type]
    assert "run cut at 480 s" in text and "`g` | step | killed" in text
    assert "1/2 = 50%" in text
    assert "each faulted run cut" not in text  # a run with no --cut-s says none
    cut = markdown(results, summary(results, 120.0), {"release": RELEASE, "examples": None, "seed": None,  # type: ignore[arg-type]
                                                      "cut_s": 480.0})
    assert "default seed, each faulted run cut at 480 s of exploring without a kill)" in cut


def test_an_old_key_whose_example_the_fault_made_fail_kills() -> None:
    """diff's rule: a finding under a key the unfaulted run has kills when its example fails (same key) on the
    faulted tree and passes its check on the unfaulted tree; failing there too, failing there under another key,
    or not reproducing on the faulted tree does not.  The killer is the earliest killing finding of either kind."""
    from faults.verdict import introduced
    fails = {"passed": False, "same_key": True}
    assert introduced(fails, {"passed": True})
    assert not introduced(fails, fails)
    assert not introduced(fails, {"passed": False, "same_key": False})  # another key there: not counted
    assert not introduced({"passed": True}, {"passed": True})  # the faulted tree did not reproduce it
    assert not introduced({"passed": False, "same_key": False}, {"passed": True})
    assert not introduced({"error": "replay did not finish in 300 s"}, {"passed": True})
    old = _seen("grad-handled-once:handled-twice", "grad-handled-once", 3.0, n=1)
    assert judge(BASE, [old]).status == "survived"
    v = judge(BASE, [old], introduced_keys=frozenset({old["key"]}))
    assert (v.status, v.rule, v.killer) == ("killed", "introduced", old) and v.new_keys == []
    later_new = _seen("epilogue-once:no-epilogue", "epilogue-once", 9.0, n=2)
    v = judge(BASE, [old, later_new], introduced_keys=frozenset({old["key"]}))
    assert (v.rule, v.killer, v.new_keys) == ("introduced", old, ["epilogue-once:no-epilogue"])
    assert judge(BASE, [old, later_new]).rule == "new-key"
    # a new key is never "introduced" (it already kills as new), a tool error never kills either way
    tool = _seen("oracle-error", "oracle-error", 1.0, n=3)
    assert judge(BASE, [tool], introduced_keys=frozenset({"oracle-error"})).status == "tool-error"


def test_the_old_key_findings_replayed_are_bounded_and_come_before_the_kill() -> None:
    from faults.verdict import old_key_candidates
    seen = [_seen("oracle:two-backwards-per-forward", "oracle", 8.0, n=3),
            _seen("grad-handled-once:handled-twice", "grad-handled-once", 2.0, n=1),
            _seen("epilogue-once:no-epilogue", "epilogue-once", 5.0, n=2),  # new: kills by itself
            _seen("oracle-error", "oracle-error", 1.0, n=4)]
    base = BASE + [{"key": "oracle-error", "check": "oracle-error", "known_issue": None}]
    assert [f["n"] for f in old_key_candidates(base, seen, 3)] == [1, 3]  # first seen first; no tool error
    assert [f["n"] for f in old_key_candidates(base, seen, 1)] == [1]
    assert [f["n"] for f in old_key_candidates(base, seen, 3, before_s=5.0)] == [1]
    assert old_key_candidates(base, seen, 0) == []
    # the faulted run showed that key on the very example the unfaulted run did: nothing to replay
    sc = {"stage": 1, "blocks": [{}]}
    base_sc = [{**e, "scenario": sc} for e in base]
    report = [{"key": "grad-handled-once:handled-twice", "scenario": sc},
              {"key": "oracle:two-backwards-per-forward", "scenario": {**sc, "stage": 2}}]
    assert [f["n"] for f in old_key_candidates(base_sc, seen, 3, report=report)] == [3]


def test_a_generated_example_the_fault_made_show_an_old_key_is_a_candidate() -> None:
    """The same position and scenario on both runs, an old key about DeepSpeed the unfaulted run of that example
    did not show: a candidate (first such key, position order, bounded); a new key (a kill already), a tool
    error, another scenario at that position, a key both runs showed: not.  A replayed candidate kills as
    ``introduced``, timed by its own run."""
    from faults.verdict import changed_examples
    a, b = {"stage": 1, "blocks": [{}]}, {"stage": 3, "blocks": [{}]}
    gh = {"key": "grad-handled-once:handled-twice", "check": "grad-handled-once"}
    two = {"key": "oracle:two-backwards-per-forward", "check": "oracle"}
    tool = {"key": "oracle-error", "check": "oracle-error"}
    new = {"key": "epilogue-once:no-epilogue", "check": "epilogue-once"}
    base = BASE + [{"key": "oracle-error", "check": "oracle-error", "known_issue": None}]
    unfaulted = [{"position": 0, "seconds": 1.0, "scenario": a, "findings": [two]},
                 {"position": 1, "seconds": 2.0, "scenario": b, "findings": []},
                 {"position": 2, "seconds": 3.0, "scenario": a, "findings": []},
                 {"position": 3, "seconds": 4.0, "scenario": b, "findings": []},
                 {"position": 5, "seconds": 6.0, "scenario": b, "findings": []},
                 {"position": 6, "seconds": 7.0, "scenario": a, "findings": [gh]},
                 {"position": 7, "seconds": 8.0, "scenario": a, "findings": [gh]}]
    faulted = [{"position": 0, "seconds": 1.5, "scenario": a, "findings": [two, gh]},  # gained an old key
               {"position": 1, "seconds": 2.5, "scenario": b, "findings": [new, tool]},  # new key; tool error
               {"position": 2, "seconds": 3.5, "scenario": b, "findings": [gh]},  # not the same example
               {"position": 3, "seconds": 4.5, "scenario": b, "findings": [two, gh]},
               {"position": 4, "seconds": 5.5, "scenario": a, "findings": [gh]},  # the unfaulted run has no 4
               {"position": 5, "seconds": 6.5, "scenario": b, "findings": []},
               {"position": 6, "seconds": 7.5, "scenario": a, "findings": []},  # the fault made it pass
               {"position": 7, "seconds": 8.5, "scenario": a, "findings": [tool]}]  # the tool failed: not judged
    got = changed_examples(unfaulted, faulted, base, 8)
    assert [(r["position"], r["key"], r["seconds"], r["direction"]) for r in got] == [
        (0, gh["key"], 1.5, "gained"), (3, two["key"], 4.5, "gained"), (6, gh["key"], 7.5, "lost")]
    assert [r["position"] for r in changed_examples(unfaulted, faulted, base, 1)] == [0]
    assert changed_examples(unfaulted, unfaulted, base, 8) == []
    made = _seen(gh["key"], gh["check"], 4.5, n=10_004)
    later_new = _seen("epilogue-once:no-epilogue", "epilogue-once", 9.0, n=2)
    v = judge(BASE, [_seen(gh["key"], gh["check"], 3.0), later_new], introduced_examples=[made])
    assert (v.status, v.rule, v.killer) == ("killed", "introduced", made)
    assert judge(BASE, [_seen(gh["key"], gh["check"], 3.0)]).status == "survived"
    assert judge(BASE, [], introduced_examples=[_seen("oracle-error", "oracle-error", 1.0)]).status == "survived"
    # the other direction: an example failing on the unfaulted tree that the fault made pass
    from faults.verdict import fixed
    fails, passes = {"passed": False, "same_key": True}, {"passed": True}
    assert fixed(passes, fails) and not fixed(fails, fails) and not fixed(passes, passes)
    assert not fixed(passes, {"passed": False, "same_key": False})  # the unfaulted replay showed another key
    assert not fixed({"error": "replay did not finish in 300 s"}, fails)
    gone = _seen(gh["key"], gh["check"], 2.0, n=10_006)
    v = judge(BASE, [_seen(gh["key"], gh["check"], 3.0)], introduced_examples=[made], fixed_examples=[gone])
    assert (v.status, v.rule, v.killer) == ("killed", "fixed", gone)


def test_a_gathered_peak_the_fault_raised_beyond_diffs_tolerance_kills_as_memory() -> None:
    """The same position and scenario on both runs, each measured (a ZeRO-3 run to its end): a faulted peak
    above 1.1 x the unfaulted one (diff's default tolerance), or a peak where there was none, is a candidate;
    10 % exactly, a lower peak, an unmeasured side or another scenario is not.  Confirmed, it kills as
    ``memory``, timed by its own run; a finding seen earlier still kills first."""
    from faults.verdict import grown_examples, peak_grew
    assert peak_grew(100, 111) and peak_grew(0, 1)
    assert not peak_grew(100, 110) and not peak_grew(100, 90) and not peak_grew(0, 0)
    a, b = {"stage": 3, "blocks": [{}]}, {"stage": 3, "blocks": [{}, {}]}

    def row(pos: int, sc: dict, peak: int | None) -> dict:
        r = {"position": pos, "seconds": pos + 0.5, "scenario": sc, "findings": []}
        return r if peak is None else {**r, "gathered": {"peak_elements": peak, "peak_params": 1, "all_gathers": 3}}
    unfaulted = [row(0, a, 100), row(1, a, 100), row(2, a, 100), row(3, a, None), row(4, a, 100), row(5, a, 0)]
    faulted = [row(0, a, 110), row(1, a, 90), row(2, b, 500), row(3, a, 500), row(4, a, 300), row(5, a, 64)]
    got = grown_examples(unfaulted, faulted, 8)
    assert [(r["position"], r["base"], r["head"], r["seconds"]) for r in got] == [(4, 100, 300, 4.5), (5, 0, 64, 5.5)]
    assert [r["position"] for r in grown_examples(unfaulted, faulted, 1)] == [4]
    assert grown_examples(unfaulted, unfaulted, 8) == []
    grew = _seen("memory:gathered-peak", "gathered-peak", 4.5, n=10_004)
    v = judge(BASE, [_seen("grad-handled-once:handled-twice", "grad-handled-once", 1.0)], grown=[grew])
    assert (v.status, v.rule, v.killer) == ("killed", "memory", grew)
    earlier = _seen("epilogue-once:no-epilogue", "epilogue-once", 2.0, n=2)
    assert judge(BASE, [earlier], grown=[grew]).rule == "new-key"


def test_a_memory_kill_counts_only_when_measuring_again_shows_it() -> None:
    """The growth an exploration saw is confirmed by running the example again in a fresh worker on each tree
    (``zerostate replay --json``'s ``gathered``); an unmeasured or smaller replay does not confirm it."""
    from bench_faults import confirmed_growth

    def answer(peak: int | None) -> dict:
        return {"passed": True, "gathered": None if peak is None else {"peak_elements": peak}}
    assert confirmed_growth({"unfaulted": answer(100), "faulted": answer(300)})
    assert not confirmed_growth({"unfaulted": answer(100), "faulted": answer(105)})
    assert not confirmed_growth({"unfaulted": answer(None), "faulted": answer(300)})
    assert not confirmed_growth({"unfaulted": answer(100), "faulted": {"error": "replay did not finish in 300 s"}})


def test_the_table_says_a_kill_was_by_a_raised_peak() -> None:
    from faults.table import markdown
    r = {**_result("killed"), "rule": "memory", "id": "f", "area": "coordinator", "run": {},
         "replays": {"faulted": {"gathered": {"peak_elements": 300}},
                     "unfaulted": {"gathered": {"peak_elements": 100}}}}
    figures = summary([r], 120.0)  # type: ignore[list-item]
    assert figures["memory"] == 1 and "1 by a gathered-parameter peak the fault raised" in figures["sentence"]
    table = markdown([r], figures, {"release": RELEASE, "examples": None, "seed": None})  # type: ignore[list-item]
    assert "killed (memory: a gathered-parameter peak raised)" in table and "peak 300 / peak 100" in table


def test_the_table_says_a_kill_was_by_an_introduced_example() -> None:
    from faults.table import markdown
    r = {**_result("killed"), "rule": "introduced", "id": "f", "area": "reduction", "replays": {}, "run": {}}
    figures = summary([r], 120.0)  # type: ignore[list-item]
    assert figures["introduced"] == 1 and "1 of the kills by an old key's example" in figures["sentence"]
    assert "killed (introduced: old key)" in markdown([r], figures, {"release": RELEASE, "examples": None,  # type: ignore[list-item]
                                                                      "seed": None})


def test_a_result_kept_from_an_earlier_run_says_so() -> None:
    """A fault not run again keeps its earlier result: the table marks it and the figures count it apart."""
    from faults.table import markdown
    r = {"id": "f", "area": "hooks", "cpu_blind": "", "status": "killed", "hidden_by_label": False,
         "killer": {"key": "k", "error": "e", "seconds": 10.0}, "replays": {}, "run": {},
         "measured": "1 Dec, new-key rule"}
    figures = summary([r], 120.0)
    assert "1 of the 1 results kept from an earlier run (1 Dec, new-key rule)" in figures["sentence"]
    assert "killed (earlier run: 1 Dec, new-key rule)" in markdown([r], figures, {  # type: ignore[list-item]
        "release": RELEASE, "examples": None, "seed": None})
    r.pop("measured")
    assert "earlier run" not in summary([r], 120.0)["sentence"]


def test_a_kept_kill_not_judged_again_counts_as_not_killed() -> None:
    """A kept kill whose killing key a newer unfaulted run also shows is not a kill until judged again."""
    from faults.table import markdown
    r = {"id": "f", "area": "hooks", "cpu_blind": "", "status": "unjudged", "hidden_by_label": False,
         "killer": {"key": "k", "error": "e", "seconds": 10.0}, "replays": {}, "run": {}, "measured": "1 Dec"}
    figures = summary([r], 120.0)
    assert figures["killed_non_equivalent"] == 0 and figures["unjudged"] == 1 and figures["non_equivalent"] == 1
    assert "1 kept kill(s) not judged again" in figures["sentence"]
    assert "unjudged (earlier run: 1 Dec)" in markdown([r], figures, {  # type: ignore[list-item]
        "release": RELEASE, "examples": None, "seed": None})


def test_a_run_stopped_from_outside_gives_no_verdict() -> None:
    """Only a run that reached its end, or this benchmark's cut, can say "survived": one interrupted by a
    signal or ended by explore's own error saw part of the sequence: no verdict, the fault runs again."""
    from bench_faults import finished
    from faults.runner import ExploreRun
    assert finished(ExploreRun({"status": "complete"}, [], 300.0, False, 1, False))
    assert finished(ExploreRun({"status": "interrupted"}, [], 500.0, True, 130, True))  # cut at --cut-s
    assert not finished(ExploreRun({"status": "interrupted"}, [], 25.6, False, 130, False))  # a SIGINT from outside
    assert not finished(ExploreRun({}, [], 5.5, False, 2, False))  # explore failed


def test_results_kept_from_an_earlier_table_are_labelled_and_never_overwrite(tmp_path) -> None:
    """``--keep-from``: an earlier ``--json`` output seeds the runs folder (a new machine keeps the table's
    results): each result keeps its own label or takes the one given; a fault with a result already there, and
    an id the catalogue no longer has, are left alone."""
    import json
    from bench_faults import keep_from
    ids = [f.id for f in FAULTS[:3]]
    table = tmp_path / "faults.json"
    table.write_text(json.dumps({"faults": [
        {"id": ids[0], "status": "killed"}, {"id": ids[1], "status": "survived", "measured": "1 Dec"},
        {"id": ids[2], "status": "killed"}, {"id": "no-such-fault", "status": "killed"}]}))
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / f"{ids[2]}.json").write_text(json.dumps({"id": ids[2], "status": "survived"}))
    assert keep_from(table, runs, "2 Dec, main") == ids[:2]
    got = {i: json.loads((runs / f"{i}.json").read_text()) for i in ids}
    assert got[ids[0]]["measured"] == "2 Dec, main" and got[ids[1]]["measured"] == "1 Dec"
    assert got[ids[2]] == {"id": ids[2], "status": "survived"}
    assert not (runs / "no-such-fault.json").exists()


def test_a_kept_result_takes_the_catalogues_equivalence_argument(tmp_path) -> None:
    """An equivalence argued after a fault's run applies to its kept result: the table counts it apart."""
    import json
    from bench_faults import main
    fault = next(f for f in FAULTS if f.cpu_blind)
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / f"{fault.id}.json").write_text(json.dumps(
        {"id": fault.id, "area": fault.area, "cpu_blind": "", "status": "survived", "killer": None,
         "hidden_by_label": False, "run": {"examples_run": 10, "cut_s": None}}))
    out = tmp_path / "faults.json"
    assert main(["--table-only", "--runs", str(runs), "--faults", fault.id, "--json", str(out),
                 "--md", str(tmp_path / "faults.md")]) == 0
    table = json.loads(out.read_text())
    assert table["faults"][0]["cpu_blind"] == fault.cpu_blind
    assert table["summary"]["non_equivalent"] == 0


def test_a_new_findings_label_is_wrong_only_when_the_unfaulted_release_does_not_show_it(tmp_path) -> None:
    """`faults.labels`: each labelled new finding is replayed on the unfaulted tree; a label the release shows on
    the finding's own scenario (first or summed, on any of its replays) is the release's own bug; one it never shows,
    or a finding with no file to replay, stays wrong."""
    from faults.labels import REPEAT, replay_labels, still_wrong
    from faults.table import _new_labels

    report = {"findings": [{"key": k, "files": {"scenario": f"{k}.json"}} for k in ("a", "b", "c")]}
    answers = {  # what `zerostate replay --json` answered per finding file, in order
        "a.json": [{"passed": False, "key": "a", "known_issue": {"id": "two-backwards-per-forward"}}],
        "b.json": [{"passed": True}] * REPEAT,
        "c.json": [{"passed": False, "key": "x",
                    "known_issue": {"id": "other", "also": [{"id": "step-without-gradient"}]}}],
    }
    calls: list[str] = []

    def replay(path: Path, log: Path) -> dict:
        calls.append(path.name)
        return answers[path.name][sum(c == path.name for c in calls) - 1]

    cands = [{"key": "a", "label": "two-backwards-per-forward"}, {"key": "b", "label": "step-without-gradient"},
             {"key": "c", "label": "step-without-gradient"}, {"key": "gone", "label": "seed-002"}]
    rows = replay_labels(cands, report, tmp_path, replay, tmp_path / "x.label")
    assert [r["shown_unfaulted"] for r in rows] == [True, False, True, None]
    assert calls.count("b.json") == REPEAT and calls.count("a.json") == 1
    assert still_wrong(rows) == [{"key": "b", "label": "step-without-gradient"}, {"key": "gone", "label": "seed-002"}]
    cell = _new_labels({"new_labels": cands[:1] + [{"key": "n", "label": None}], "wrong_labels": [],
                        "label_replays": rows[:1]})
    assert cell == "none, two-backwards-per-forward (the release's own: shown unfaulted)"


def test_a_new_findings_label_is_the_finished_reports_and_a_label_it_lost_is_said() -> None:
    """`verdict.final_labels`: a label seen on the unshrunk finding and gone from the finished report (the shrunk
    scenario no longer shows that issue) is not the label the reader is told; the table says it changed."""
    from faults.table import _new_labels
    from faults.verdict import final_labels

    report = {"findings": [{"key": "a", "known_issue": None}, {"key": "b", "known_issue": {"id": "seed-002"}}]}
    got = final_labels([{"key": "a", "label": "two-backwards-per-forward"}, {"key": "b", "label": "seed-002"},
                        {"key": "gone", "label": "x"}], report)
    assert got == [{"key": "a", "label": None, "first_label": "two-backwards-per-forward"},
                   {"key": "b", "label": "seed-002"}, {"key": "gone", "label": "x"}]
    cell = _new_labels({"new_labels": got[:1], "wrong_labels": []})
    assert cell == ("none (first seen labelled two-backwards-per-forward while unshrunk; the finished report's label "
                    "is shown)")
