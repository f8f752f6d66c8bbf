"""``zerostate explore`` and ``zerostate replay`` on the model target (fast: no DeepSpeed runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_cli_util import (BIN, FINDING_KEYS, REPORT_KEYS, FailingTarget, assert_one_line_error, assert_pictures,
                           load_report, zs)

import zerostate.explorer.exploration  # a broken import fails, never skips
import zerostate.targets.model_target  # noqa: F401  (a broken import fails, never skips)
from zerostate.model.scenario import Scenario

BUGGY = ("--target", "model", "--design", "ds-0.18.4")


@pytest.fixture(scope="module")
def buggy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("explore")
    r = zs("explore", *BUGGY, "--examples", "40", "--seed", "0", "--json", "--out", str(out))
    return r, out


def test_json_has_the_documented_keys(buggy_run):
    r, _ = buggy_run
    assert r.returncode == 1, r.stderr  # findings
    data = json.loads(r.stdout)
    assert set(data) >= {"target", "deepspeed", "examples", "seconds", "findings", "time"}
    assert data["time"]["spent"] is None and data["time"]["phases"]["generation"] > 0  # the model has no workers
    assert data["findings"]
    for f in data["findings"]:
        assert set(f) >= {"check", "error", "blocks", "steps", "scenario"}
        assert f["blocks"] == len(f["scenario"]["blocks"])


def test_report_has_every_finding_with_its_files(buggy_run):
    r, out = buggy_run
    rep = load_report(out)
    assert set(rep) >= REPORT_KEYS and rep["status"] == "complete" and rep["command"] == "explore"
    assert rep["run"]["design"] == "ds-0.18.4" and rep["run"]["seed"] == 0 and rep["run"]["examples"] == 40
    assert len(rep["findings"]) == len(json.loads(r.stdout)["findings"])
    for f in rep["findings"]:
        assert set(f) >= FINDING_KEYS
        assert rep["specs"][f["check"]]["results"][rep["columns"][0]] == "violated"
        assert (out / f["files"]["scenario"]).exists()
        if f["files"].get("trace_svg"):
            assert_pictures(out, f, "trace")
        assert "--target model --design ds-0.18.4" in f["replay"]
    md = (out / "report.md").read_text()
    assert "| target | model |" in md and "Finding 1" in md and "Scenario (shrunk)" in md
    assert "## Where the time went" in md and "the runs and starts are not measured" in md


def test_replay_says_fail_on_the_buggy_design_and_pass_on_the_fix(buggy_run):
    _, out = buggy_run
    finding = out / "finding_1.json"
    check = json.loads(finding.read_text())["check"]
    r = zs("replay", str(finding), *BUGGY)
    assert r.returncode == 1 and r.stdout.startswith("FAIL on model design ds-0.18.4") and check in r.stdout
    r = zs("replay", str(finding), "--target", "model", "--design", "zerostate")
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr


def test_a_correct_design_gives_no_finding(tmp_path):
    r = zs("explore", "--target", "model", "--design", "zerostate", "--examples", "15", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = load_report(tmp_path)
    assert rep["findings"] == [] and rep["status"] == "complete"
    assert set(rep["specs"]["epilogue-once"]["results"].values()) == {"ok"}


def _cmd(*args):
    return ([str(BIN)] if BIN.exists() else [sys.executable, "-m", "zerostate.cli.main"]) + list(args)


def _sigint_as_a_terminal_gives_it():
    """A shell's background job (``make test &``) ignores SIGINT, and so would the command it starts: restore
    the default, which Python turns into KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_until_first_finding(out_dir):
    """``zerostate explore`` on the buggy design with a huge budget, once its first finding is in the report."""
    proc = subprocess.Popen(_cmd("explore", *BUGGY, "--examples", "100000", "--out", str(out_dir)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CI": "true"},
                            preexec_fn=_sigint_as_a_terminal_gives_it)  # noqa: PLW1509 -- it only restores a signal handler
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if load_report(out_dir)["findings"]:
                return proc
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    proc.kill()
    proc.communicate()
    pytest.fail("no finding written within 120 s")


def _communicate_or_stacks(proc, timeout):
    """``proc.communicate``; a run still there after ``timeout`` fails the test with every thread's stack
    (``kill -USR1``: faulthandler, cli/main.py) instead of a bare TimeoutExpired."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(3)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running {timeout} s after the signal; stdout:\n{out[-4000:]}\n"
                    f"stderr, with every thread's stack at the end:\n{err[-20000:]}")


def test_ctrl_c_keeps_every_finding_found_so_far(tmp_path):
    proc = _start_until_first_finding(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        # the findings are written as they come: after a Ctrl-C only the report's last write is left
        out, err = _communicate_or_stacks(proc, 240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    rep = load_report(tmp_path)
    assert rep["status"] == "interrupted" and rep["findings"]
    for f in rep["findings"]:
        assert all((tmp_path / name).exists() for name in f["files"].values())
    assert "Status: interrupted" in (tmp_path / "report.md").read_text()


SWALLOWED_CTRL_C = """
import gc, os, signal, sys, threading
from zerostate.cli.main import main
out = sys.argv[1]
fired = []

def swallow(phase, info):
    # Once the first finding is on disk, SIGINT is handled inside this garbage-collector callback, in the
    # main thread: Python drops the KeyboardInterrupt it raises there ("Exception ignored in ..."), as it
    # does inside Hypothesis' own gc callback. Not inside the report's Ctrl-C-holding block (which would
    # raise it after the block, in ordinary code).
    if (fired or phase != "start" or threading.current_thread() is not threading.main_thread()
            or not os.path.exists(os.path.join(out, "finding_1.json"))
            or getattr(signal.getsignal(signal.SIGINT), "__module__", "") == "zerostate.reports.report_folder"):
        return
    fired.append(1)
    signal.raise_signal(signal.SIGINT)  # its handler runs before raise_signal returns: here

gc.callbacks.append(swallow)
sys.exit(main(["explore", "--target", "model", "--design", "ds-0.18.4", "--examples", "40", "--out", out]))
"""


def test_a_ctrl_c_python_swallows_still_stops_the_run(tmp_path):
    """A Ctrl-C whose KeyboardInterrupt is raised where Python ignores exceptions (a gc callback, as
    Hypothesis keeps one) is not lost: the run stops at its next example, interrupted, report kept.
    Before the fix the run went on to the end of its budget (the CI test's Ctrl-C "hang")."""
    r = subprocess.run([sys.executable, "-c", SWALLOWED_CTRL_C, str(tmp_path)], capture_output=True, text=True,
                       timeout=900, env={**os.environ, "CI": "true"}, preexec_fn=_sigint_as_a_terminal_gives_it)
    assert "Exception ignored in" in r.stderr and "KeyboardInterrupt" in r.stderr, r.stderr  # it was swallowed
    assert r.returncode == 130, (r.stdout, r.stderr)
    rep = load_report(tmp_path)
    assert rep["status"] == "interrupted" and rep["findings"]
    assert all((tmp_path / name).exists() for f in rep["findings"] for name in f["files"].values())


def test_a_ctrl_c_during_the_final_renumbering_lands_after_it():
    """A complete run's renumbering rewrites every finding; a Ctrl-C in the middle waits for its end (else the
    report would keep only the findings rewritten so far), then ends the run as interrupted."""
    from zerostate.cli.cmd_explore import _ctrl_c_kept
    done = []
    # Python's own Ctrl-C handling, whatever this test process inherited (pytest started as a shell's
    # background job ignores SIGINT, and _ctrl_c_kept then rightly leaves it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _ctrl_c_kept() as ctrl_c:
            with pytest.raises(KeyboardInterrupt), ctrl_c.held():
                signal.raise_signal(signal.SIGINT)
                done.append("rest of the block")
            assert ctrl_c.is_set()
            with pytest.raises(KeyboardInterrupt):  # outside the block a Ctrl-C is raised at once again
                signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert done == ["rest of the block"]


HALF_IMPORTED_NUMPY = """
import importlib.abc, importlib.machinery, sys, threading, time

class SlowNumpy(importlib.abc.MetaPathFinder):
    # the real numpy, half-initialised in sys.modules for 2 s (as while the main thread imports it, e.g.
    # through torch)
    def find_spec(self, name, path=None, target=None):
        if name != "numpy":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader

        class Slow(importlib.abc.Loader):
            def create_module(self, s):
                return real.create_module(s)

            def exec_module(self, m):
                time.sleep(2.0)
                real.exec_module(m)
        spec.loader = Slow()
        return spec

sys.meta_path.insert(0, SlowNumpy())
from zerostate.explorer.exploration import generated
from zerostate.explorer.strategies import scenarios
it = generated(scenarios(), 2000, 0)
next(it)  # drawing has started, in its own thread
importer = threading.Thread(target=__import__, args=("numpy",))
importer.start()
print(1 + sum(1 for _ in it))
importer.join()
"""


def test_drawing_survives_numpy_being_imported_meanwhile(tmp_path):
    """The generated sequence is drawn in a thread while the main thread runs examples and writes the report.
    Hypothesis looks numpy up in sys.modules while drawing; numpy half-imported by the main thread at that
    moment (then by the first PNG's matplotlib) made the drawing fail ("partially initialized module 'numpy'") and the
    run end with exit status 1 (seen under load in the Ctrl-C CI test). `generated` imports numpy first."""
    pytest.importorskip("numpy")  # without numpy there is nothing to race with
    r = subprocess.run([sys.executable, "-c", HALF_IMPORTED_NUMPY], capture_output=True, text=True, timeout=600,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-6000:]
    assert int(r.stdout.split()[-1]) == 2000


def test_sigusr1_dumps_every_threads_stack_and_the_run_goes_on(tmp_path):
    proc = _start_until_first_finding(tmp_path)
    try:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        assert proc.poll() is None  # a stack dump, not an exit
        proc.send_signal(signal.SIGINT)
        out, err = _communicate_or_stacks(proc, 240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Current thread" in err and "(most recent call first)" in err, err[-6000:]
    # the explorer's own frames: the exploration's (main) thread, or its drawing or shrinking thread (which holds
    # explorer/ frames whenever the main thread is writing the report)
    assert "/explorer/" in err


def test_progress_line_on_a_terminal_only(tmp_path):
    import pty
    args = ("explore", "--target", "model", "--design", "zerostate", "--examples", "10", "--out", str(tmp_path))
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    proc = subprocess.Popen(_cmd(*args), stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(master)
    tty = b"".join(chunks).decode(errors="replace")
    assert "example(s) run" in tty and "\r" in tty, tty
    quiet = zs(*args)  # CI=true, pipes: no progress line at all
    assert quiet.returncode == 0 and "example(s) run" not in quiet.stderr and "\r" not in quiet.stderr


def test_report_has_the_reliability_figure(buggy_run):
    r, out = buggy_run
    rel = load_report(out)["reliability"]
    assert rel["reported"] == len(json.loads(r.stdout)["findings"]) == rel["confirmed"]  # a model: pure
    assert rel["order_dependent"] == rel["not_reproduced"] == 0 and rel["restarts"] == []
    assert json.loads(r.stdout)["reliability"] == rel
    assert all(f["confirmation"]["status"] == "confirmed" for f in load_report(out)["findings"])
    assert "## Reliability" in (out / "report.md").read_text()
    assert all("key" in json.loads((out / f"finding_{i}.json").read_text())
               for i in range(1, rel["reported"] + 1))


def test_replay_json_gives_the_runs_gathered_parameter_metrics(tmp_path):
    """What the fault benchmark's ``memory`` rule measures again: a ZeRO-3 run's peak and all-gathers, the
    metrics ``diff`` compares (`explorer.gathered.gathered_metrics`); none for ZeRO-1/2."""
    from zerostate.explorer.gathered import metrics
    from zerostate.targets.model_target import ModelTarget
    z3, z1 = {"stage": 3, "blocks": [{}, {}]}, {"stage": 1, "blocks": [{}, {}]}
    got = {}
    for name, sc in (("z3", z3), ("z1", z1)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(sc))
        r = zs("replay", str(path), *BUGGY, "--json")
        got[name] = json.loads(r.stdout)["gathered"]
    expected = metrics(Scenario.from_dict(z3), ModelTarget("ds-0.18.4").run(Scenario.from_dict(z3)).trace)
    assert got["z3"] == expected and expected["all_gathers"] > 0 and expected["peak_elements"] > 0
    assert got["z1"] is None


def test_replay_judges_the_findings_own_check(buggy_run, tmp_path):
    """The exit status follows the finding's check; other failing checks are listed apart."""
    from zerostate.model.scenario import Scenario
    from zerostate.specs import SPECS
    from zerostate.targets.model_target import ModelTarget
    _, out = buggy_run
    saved = json.loads((out / "finding_1.json").read_text())
    failing = {f.check for f in ModelTarget("ds-0.18.4").run(Scenario.from_dict(saved["scenario"])).findings}
    holding = next(s for s in SPECS if s not in failing)
    r = zs("replay", str(out / "finding_1.json"), *BUGGY, "--json")
    data = json.loads(r.stdout)
    assert r.returncode == 1 and data["finding_check"] == data["check"] == saved["check"] and data["same_key"]
    assert data["key"] == data["finding_key"] == saved["key"]  # the replay's own key, beside the file's
    assert {o["check"] for o in data["other_failing_checks"]} == failing - {saved["check"]}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**saved, "check": holding, "key": holding}))
    r = zs("replay", str(other), *BUGGY)
    assert r.returncode == 0 and r.stdout.startswith(f"PASS on model design ds-0.18.4: the finding's check {holding}")
    passed = json.loads(zs("replay", str(other), *BUGGY, "--json").stdout)
    assert passed["key"] is None and passed["finding_key"] == holding  # nothing failed: no key of its own
    assert "other failing checks" in r.stdout and saved["check"] in r.stdout


def test_replay_runs_an_order_dependent_findings_sequence_first(buggy_run, tmp_path):
    _, out = buggy_run
    saved = json.loads((out / "finding_1.json").read_text())
    seq = tmp_path / "seq.json"
    seq.write_text(json.dumps({**saved, "sequence": [saved["scenario"], saved["scenario"]]}))
    r = zs("replay", str(seq), *BUGGY, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["sequence"] == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**saved, "sequence": [{"stage": 7}]}))
    r = zs("replay", str(bad), *BUGGY)
    assert r.returncode == 2 and "bad.json: sequence[0]" in r.stderr, r.stderr


def test_findings_end_shrunk_under_the_number_they_were_handed_over_with(buggy_run):
    """explore writes each new finding at once, unshrunk, then rewrites it shrunk and confirmed under the
    same number: at the end every finding is shrunk, or -- only when the run's distinct runs reached the
    hard cap -- kept as seen (said so), numbered 1..n, each file written once."""
    from zerostate.explorer.exploration import hard_cap
    _, out = buggy_run
    rep = load_report(out)
    assert [f["n"] for f in rep["findings"]] == list(range(1, len(rep["findings"]) + 1))
    assert any(f["shrunk"] is True for f in rep["findings"])
    as_seen = [f for f in rep["findings"] if f["shrunk"] is not True]
    assert all(f.get("stage") == "as seen" for f in as_seen), as_seen
    if as_seen:
        assert rep["run"]["examples_run"] == hard_cap(40) + rep["pairs"]["examples"]
    md = (out / "report.md").read_text()
    assert "Scenario (unshrunk" not in md and md.count("Scenario (as seen, not shrunk") == len(as_seen)
    for f in rep["findings"]:
        saved = json.loads((out / f["files"]["scenario"]).read_text())
        assert saved["scenario"] == f["scenario"] and saved["key"] == f["key"]
    assert rep["run"]["time_budget"] is None and not rep["run"].get("stopped")


class _FakeClock:
    """A clock that moves one second each time it is read: the time budget is read once per distinct run, so
    the run it cuts depends on no machine's speed."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        self.now += 1.0
        return self.now


def test_a_time_budget_is_opt_in_and_a_run_it_cuts_says_it_is_not_repeatable(tmp_path, monkeypatch, capsys):
    from zerostate.cli import cmd_explore
    from zerostate.cli.main import main
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(cmd_explore, "clock", _FakeClock())
    rc = main(["explore", *BUGGY, "--examples", "40", "--time-budget", "30", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "(time budget spent)" in out and "another run may find other findings" in out, out
    rep = load_report(tmp_path)
    assert "not repeatable" in rep["run"]["stopped"] and rep["findings"]
    # one clock reading per distinct run: the 31st run is the first past 30 s, and the run ends there
    assert rep["run"]["examples_run"] == 31, rep["run"]
    assert rep["reliability"]["confirmed"] == len(rep["findings"])  # a time budget still confirms
    assert all(f.get("stage") == "as seen" for f in rep["findings"] if not f["shrunk"])


def test_a_complete_run_numbers_its_findings_in_generation_order(tmp_path):
    """The explorer numbers findings in hand-over order as they come, and a complete run ends with them
    renumbered in the order the generated sequence first met them (then by key), whatever order they were
    handed over in (with --jobs > 1 the lanes' timing decides it): the same command, the same report.  The
    CLI rewrites its report from that event, files and replay commands renamed with the numbers."""
    from zerostate.cli.cmd_explore import _Column, _renumber, _write
    from zerostate.reports.report_folder import Report
    from zerostate.explorer.exploration_events import Renumbered, Seen
    from zerostate.explorer.exploration import Exploration
    from zerostate.explorer.strategies import scenarios
    from zerostate.specs import SPECS
    from zerostate.targets.interface import get_target

    # ds-0.18.4 on the core strategy: one example shows several keys at once, handed over in its order
    exp = Exploration(get_target("model", design="ds-0.18.4"), examples=40, strategy=scenarios(setup=False))
    events = list(exp.events())
    seen = [e for e in events if isinstance(e, Seen)]
    assert [e.n for e in seen] == list(range(1, len(seen) + 1))
    (ren,) = [e for e in events if isinstance(e, Renumbered)]
    at = exp.result().generated_at
    keys = [f.key for f in ren.findings]
    assert keys != [e.key for e in seen] and sorted(keys) == sorted(e.key for e in seen)
    assert keys == sorted(keys, key=lambda k: (at.get(k, float("inf")), k))
    assert [f.n for f in ren.findings] == list(range(1, len(keys) + 1))

    shown_as = _Column("model:ds-0.18.4", {"target": "model", "design": "ds-0.18.4", "deepspeed": None})
    report = Report(str(tmp_path), "explore", {"target": "model"}, columns=[shown_as.column], specs=SPECS)
    for e in seen:
        _write(report, e, shown_as)
    _renumber(report, ren, shown_as)
    data = json.loads((tmp_path / "report.json").read_text())
    assert [e["key"] for e in data["findings"]] == keys and [e["n"] for e in data["findings"]] == [
        f.n for f in ren.findings]
    for n, key in enumerate(keys, 1):
        assert json.loads((tmp_path / f"finding_{n}.json").read_text())["key"] == key
        assert data["findings"][n - 1]["replay"].split()[2].endswith(f"finding_{n}.json")
    assert not (tmp_path / f"finding_{len(keys) + 1}.json").exists()


def test_a_target_that_breaks_while_exploring_is_one_line_and_exit_2_with_the_report_kept(tmp_path, monkeypatch,
                                                                                          capsys):
    """A rank pool that cannot start (raised by the run that needs it) ends explore with one line on stderr and
    exit 2, never a traceback; the report keeps every finding handed over before, and says why it stopped."""
    from zerostate.cli import targets_api
    from zerostate.cli.main import main
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(targets_api, "target", lambda args: FailingTarget(after=30))
    rc = main(["explore", *BUGGY, "--examples", "40", "--out", str(tmp_path)])
    assert_one_line_error(rc, capsys.readouterr().err, "the target failed", "rank pool (2 ranks) did not start")
    rep = load_report(tmp_path)
    assert rep["status"] == "interrupted" and rep["findings"]
    assert "rank pool (2 ranks) did not start" in rep["run"]["stopped"]
    assert all((tmp_path / name).exists() for f in rep["findings"] for name in f["files"].values())


def test_a_target_that_breaks_while_replaying_is_one_line_and_exit_2(buggy_run, monkeypatch, capsys):
    from zerostate.cli import targets_api
    from zerostate.cli.main import main
    _, out = buggy_run
    monkeypatch.setattr(targets_api, "target", lambda args: FailingTarget(after=0))
    rc = main(["replay", str(out / "finding_1.json"), *BUGGY])
    assert_one_line_error(rc, capsys.readouterr().err, "rank pool (2 ranks) did not start")


def test_examples_jsonl_holds_each_generated_examples_outcome_in_sequence_order(buggy_run):
    """What two explorations of one seed compare example by example: every generated example once, in order,
    with the keys its own run showed -- the report's findings are among them (each first met while generating
    or while shrinking; those met while generating are at their generation position)."""
    _, out = buggy_run
    rows = [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]
    report = load_report(out)
    positions = [r["position"] for r in rows]
    assert positions == sorted(set(positions)) and rows
    assert len(rows) <= report["run"]["examples_run"]
    assert all(r["seconds"] >= 0 and r["scenario"]["blocks"] for r in rows)
    shown = {f["key"] for r in rows for f in r["findings"]}
    failing = [r for r in rows if r["findings"]]
    assert failing and len(failing) < len(rows)  # ds-0.18.4 fails some examples and passes others
    assert shown <= {f["key"] for f in report["findings"]}
    # the gathered-parameter metrics `diff` compares: each ZeRO-3 example that ran to its end, no other one
    stage = {r["position"]: Scenario.from_dict(r["scenario"]).stage for r in rows}
    z3_passed = [r for r in rows if stage[r["position"]] == 3 and not r["findings"]]
    assert all("gathered" not in r for r in rows if stage[r["position"]] != 3)
    assert z3_passed and all("gathered" in r for r in z3_passed)
    assert any(r["gathered"]["all_gathers"] > 0 and r["gathered"]["peak_elements"] > 0 for r in z3_passed)
