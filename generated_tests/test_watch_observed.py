"""Never a silent clean: ``zerostate watch`` says loudly what it did not observe, apart from the findings.

A job with no engine watched exits non-zero naming the cause (no deepspeed import; deepspeed imported and never
initialised; the rank that died first, and of what; a command that runs no Python); a rank gone before its events
were checked; ``--runtime`` that could not install, and why; a ``WatchCallback`` that saw no engine.  And what
makes the watch attach and judge right on the jobs users run: an engine found after ``importlib.util.find_spec``
(transformers, accelerate and TRL ask it first), a root-module forward outside ``engine.forward`` (DPO's reference
pass), findings keyed by spec + code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zerostate.model.events import Event, EventKind
from zerostate.watcher.monitor import OnlineChecker

pytestmark = pytest.mark.usefixtures("no_inherited_rendezvous")

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = os.path.join(HERE, "watch_jobs.py")


def _feed(events):
    c = OnlineChecker(lambda n: 10)
    for e in events:
        c.feed(e.to_dict())
    return c


def _watch(tmp_path, *job, opts=(), env=None, timeout=600):
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "zerostate.cli.main", "watch", "--out", str(out), *opts, "--", *job]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    rep = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    return proc, rep, out


def _finding(rep, check):
    return [f for f in rep["findings"] if f["check"] == check]


def test_watch_keeps_the_commands_exit_status(tmp_path):
    proc, rep, _ = _watch(tmp_path, sys.executable, "-c", "import sys; sys.exit(5)")
    assert proc.returncode == 5
    last = proc.stderr.splitlines()[-1]
    assert "0 backwards, 0 steps" in last and "died first, of SystemExit: 5" in last, last
    assert rep["status"] == "complete" and rep["run"]["exit_status"] == 5
    assert [f["error"] for f in rep["findings"]] == ["SystemExit: 5"]


@pytest.mark.deepspeed
@pytest.mark.parametrize("then", ["sys-exit", "die"])
def test_a_job_that_fails_without_an_exception_is_never_clean(tmp_path, then):
    """A watched job that catches its error and calls ``sys.exit(1)`` has that error in the report, with its rank
    and step; one that dies with no exception at all (``os._exit``) is said loudly not to have told why."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc, rep, _ = _watch(tmp_path, sys.executable, JOBS, "gathered", "--steps", "1", "--then", then, env=env)
    assert rep["summary"]["watched"], proc.stderr[-2000:]
    if then == "sys-exit":
        assert proc.returncode == 1 and rep["summary"]["backwards"] == 1
        crash = _finding(rep, "exception")
        assert [c["error"] for c in crash] == [
            "SystemExit: 1, handling RuntimeError: the job gave up after its steps (test_watch_observed)"]
        assert crash[0]["rank"] == 0 and crash[0]["step"] == 1 and "raise RuntimeError" in crash[0]["traceback"]
        assert rep["summary"]["violations"] == 1
    else:
        assert proc.returncode == 3 and rep["findings"] == []
        assert any("the job failed (exit status 3) but no process recorded why" in t for t in rep["not_observed"])
        assert "NOT OBSERVED" in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("job,cause", [
    ("print('no deepspeed here')", "none of the 1 Python process(es) of the command imported deepspeed"),
    ("import deepspeed", "deepspeed was imported but deepspeed.initialize never built an engine"),
    ("import deepspeed; raise ValueError('dies before its engine')",
     "rank 0 (pid {pid}) died first, of ValueError: dies before its engine"),
])
def test_a_job_with_no_engine_watched_exits_non_zero_naming_the_cause(tmp_path, job, cause):
    """Never a silent clean: the job exits 0 (or dies), the watch says loudly that it watched nothing, and why."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc, rep, out = _watch(tmp_path, sys.executable, "-c", job, env=env)
    assert proc.returncode == (1 if "raise" in job else 3), proc.stderr[-2000:]
    if "{pid}" in cause:
        cause = cause.format(pid=rep["processes"][0]["pid"])
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("watch: no DeepSpeed engine was watched: ") and cause in last, proc.stderr[-2000:]
    assert rep["not_observed"] and cause in rep["not_observed"][0] and rep["summary"]["watched"] is False
    assert "NOT OBSERVED" in (out / "report.md").read_text()
    if "raise" in job:  # the crash is in the report, with its rank
        crash = _finding(rep, "exception")
        assert crash and crash[0]["error"] == "ValueError: dies before its engine" and crash[0]["rank"] == 0


def test_a_command_that_runs_no_python_is_not_watched(tmp_path):
    import shutil
    proc, _rep, _ = _watch(tmp_path, shutil.which("true") or "/bin/true")
    assert proc.returncode == 3 and "no Python process of the command ran zerostate's sitecustomize" in proc.stderr


@pytest.mark.deepspeed
def test_an_engine_found_after_find_spec_is_watched(tmp_path):
    """transformers, accelerate and TRL ask ``importlib.util.find_spec("deepspeed")`` before the job imports it: the
    watch still wraps ``deepspeed.initialize`` when the import comes."""
    proc, rep, _ = _watch(tmp_path, sys.executable, JOBS, "gathered", "--steps", "2", "--find-spec-first")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rep["summary"]["watched"] and rep["summary"]["backwards"] == 2 and rep["summary"]["steps"] == 2
    assert rep["not_observed"] == []


@pytest.mark.deepspeed
def test_a_root_forward_outside_engine_forward_is_a_root_forward(tmp_path):
    """``engine.module(x)`` (DPO's reference pass): DeepSpeed's root pre-forward hook resets the coordinator's step
    as at any root forward, so the watch reports one (an eval forward here): no ``trace-consistent`` false alarm."""
    proc, rep, _ = _watch(tmp_path, sys.executable, JOBS, "direct", "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rep["findings"] == [], [(f["check"], f["error"]) for f in rep["findings"]]
    assert rep["summary"]["steps"] == 3 and rep["summary"]["backwards"] == 3


@pytest.mark.deepspeed
def test_a_rank_that_ends_before_its_events_are_checked_is_said_loudly(tmp_path):
    """A rank gone without closing its watch (``os._exit``, as a launcher's kill): exit non-zero though the job
    exited 0, and the report says which rank's last events were not checked."""
    proc, rep, _ = _watch(tmp_path, sys.executable, JOBS, "gathered", "--steps", "1", "--then", "exit")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert any("rank 0" in p and "ended without closing its watch" in p
               for p in rep["not_observed"]), rep["not_observed"]
    assert "NOT OBSERVED: rank 0" in proc.stderr


def test_runtime_that_could_not_install_says_why(tmp_path, monkeypatch):
    """``--runtime`` on a release the runtime refuses: the job runs stock and is watched, and the report says loudly
    that the runtime was not installed, and why (the process record keeps the refusal)."""
    pytest.importorskip("deepspeed")
    from zerostate.runtime import initialize_patch
    from zerostate.runtime.errors import ZerostateInstallError
    from zerostate.watcher import observed, process, watch

    def refuse() -> None:
        raise ZerostateInstallError("DeepSpeed 9.9.9 is outside the releases the runtime supports")

    monkeypatch.setattr(initialize_patch, "patch_deepspeed", refuse)
    rec = process.ProcessRecord(str(tmp_path), runtime=True)
    monkeypatch.setattr(process, "_RECORD", [rec])
    try:
        watch.patch_initialize(out=str(tmp_path), runtime=True)
    finally:
        watch.unpatch_initialize()
    procs = process.load(str(tmp_path))
    assert procs[0]["runtime_errors"] == [("zerostate.runtime not installed: DeepSpeed 9.9.9 is outside the releases "
                                          "the runtime supports")]
    engine = {"rank": 0, "pid": procs[0]["pid"], "closed": True, "runtime_installed": False}
    got = observed.problems([engine], procs, "complete", 0, runtime=True)
    assert got == [("--runtime: zerostate.runtime was not installed in rank 0: zerostate.runtime not installed: "
                   "DeepSpeed 9.9.9 is outside the releases the runtime supports")]
    assert observed.problems([dict(engine, runtime_installed=True)], procs, "complete", 0, runtime=True) == []


def test_watch_findings_are_keyed_by_spec_and_code():
    """Two leaks with different parameters are one finding (``released-after-backward:still-gathered``), counted
    twice, both messages kept; a different code of the same spec is another finding."""
    p, q = "blocks.0.lin.weight", "blocks.1.lin.weight"
    one = [Event(EventKind.FORWARD_START), Event(EventKind.FETCH, param=p), Event(EventKind.FORWARD_END),
           Event(EventKind.USER_BACKWARD_START), Event(EventKind.EPILOGUE), Event(EventKind.USER_BACKWARD_END),
           Event(EventKind.STEP, value=0), Event(EventKind.RELEASE, param=p)]
    two = [Event(EventKind.FORWARD_START), Event(EventKind.FETCH, param=q), Event(EventKind.FORWARD_END),
           Event(EventKind.USER_BACKWARD_START), Event(EventKind.EPILOGUE), Event(EventKind.USER_BACKWARD_END),
           Event(EventKind.STEP, value=1), Event(EventKind.RELEASE, param=q)]
    c = _feed(one + two)
    got = [v for v in c.to_dict() if v["spec"] == "released-after-backward"]
    assert len(got) == 1 and got[0]["key"] == "released-after-backward:still-gathered" and got[0]["count"] == 2, got
    assert [p in m for m in got[0]["messages"]] == [True, False] and q in got[0]["messages"][1]
    assert [f.key for f in c.findings()] == [v["key"] for v in c.to_dict()]


def test_watch_callback_without_an_engine_says_so(capsys):
    """A Trainer that built no DeepSpeed engine: the callback's summary is no silent '0 violations'."""
    pytest.importorskip("transformers")
    from zerostate.watcher import watch
    from zerostate.watcher.hf import WatchCallback
    try:
        cb = WatchCallback()
        cb.on_train_end(None, None, "control")
    finally:
        watch.unpatch_initialize()
    assert cb.summary().startswith("no DeepSpeed engine was watched: the Trainer built no DeepSpeed engine")
    assert "no DeepSpeed engine was watched" in capsys.readouterr().err
