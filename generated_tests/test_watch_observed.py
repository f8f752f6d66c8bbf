"""Never a silent clean: ``zerostate watch`` says loudly what it did not observe, apart from the findings.

A job with no engine watched exits non-zero naming the cause (no deepspeed import; deepspeed imported and never
initialised; the rank that died first, and of what; a command that runs no Python); a rank gone before its events
were checked; a rank of the job's world size never watched (a launcher that does not pass the watch's environment
to every rank); a spec no event exercised ("not observed": an eval-only job's backward specs); ``--runtime`` that
could not install, and why; a ``WatchCallback`` that saw no engine.  The watch labels by evidence, through
`known.labels` (explore's table and rules): a crash in the job's own code is the job's crash, never a known
DeepSpeed issue, and a violation carries the label explore gives the same mechanism.  And what makes the watch
attach and judge right on the jobs users run: an engine found after ``importlib.util.find_spec`` (transformers,
accelerate and TRL ask it first), a root-module forward outside ``engine.forward`` (DPO's reference pass), findings
keyed by spec + code.
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
    assert rep["findings"] == [] and [c["error"] for c in rep["job_crashes"]] == ["SystemExit: 5"]


@pytest.mark.deepspeed
@pytest.mark.parametrize("then", ["sys-exit", "die"])
def test_a_job_that_fails_without_an_exception_is_never_clean(tmp_path, then):
    """A watched job that catches its error and calls ``sys.exit(1)`` has that error in the report, with its rank
    and step; one that dies with no exception at all (``os._exit``) is said loudly not to have told why."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc, rep, _ = _watch(tmp_path, sys.executable, JOBS, "gathered", "--steps", "1", "--then", then, env=env)
    assert rep["summary"]["watched"], proc.stderr[-2000:]
    if then == "sys-exit":  # the job's own error, caught and exited on: the job's crash, not a finding
        assert proc.returncode == 1 and rep["summary"]["backwards"] == 1
        crash = rep["job_crashes"]
        assert [c["error"] for c in crash] == [
            "SystemExit: 1, handling RuntimeError: the job gave up after its steps (test_watch_observed)"]
        assert crash[0]["rank"] == 0 and crash[0]["step"] == 1 and "raise RuntimeError" in crash[0]["traceback"]
        assert rep["summary"]["violations"] == 0 and rep["findings"] == [] and crash[0]["known_issue"] is None
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
    if "raise" in job:  # the crash is in the report, with its rank: the job's own
        crash = rep["job_crashes"]
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


# ---------------------------------------------------------------- what the watch saw against what the job ran
def test_a_spec_reads_ok_only_when_an_event_exercised_it():
    """An engine that saw only eval forwards: the backward specs (and ``clean-step``, a train step) read "not
    observed", never "ok", and the problem says what was missing; a trained engine exercises every spec.  ZeRO-1/2
    engines do not check the coordinator specs ("not checked")."""
    from zerostate.specs import SPECS
    from zerostate.watcher import observed
    evals = ["eval_forward_start", "eval_forward_end", "fetch", "release", "module_pre_forward",
             "module_post_forward", "trace_state", "persistent"]
    eng = {"rank": 0, "stage": 3, "specs": list(SPECS), "kinds": evals}
    got = observed.spec_results([eng])
    backward = {"epilogue-once", "grad-handled-once", "no-epilogue-before-user-backward", "count-once-per-phase",
                "count-matches-hooks", "clean-step", "released-after-backward"}
    assert {s for s, r in got.items() if r == "not observed"} == backward, got
    assert {s for s, r in got.items() if r == "ok"} == set(SPECS) - backward
    problems = observed.unexercised_specs([eng], got, "complete")
    assert any(p.startswith("no user backward was watched on any rank: `epilogue-once`") for p in problems), problems
    assert any("no train step" in p and "`clean-step`" in p for p in problems), problems
    trained = dict(eng, kinds=evals + ["forward_start", "user_backward_start", "grad_hook", "epilogue", "step",
                                       "task_start", "user_backward_end"])
    assert set(observed.spec_results([trained]).values()) == {"ok"}
    z2 = {"rank": 0, "stage": 2, "specs": [s for s, v in SPECS.items() if v.family == "hooks"],
          "kinds": trained["kinds"]}
    assert {s for s, r in observed.spec_results([z2]).items() if r == "not checked"} == {
        s for s, v in SPECS.items() if v.family == "coordinator"}


def test_every_rank_of_the_world_size_is_watched_or_said_not_to_be(tmp_path):
    """The world size a rank saw (else the launcher's ``--nproc-per-node``): a rank without a watch file is named,
    with why; an unreadable watch file is named, with why, never dropped silently."""
    from zerostate.watcher import job_launch, job_report, observed
    eng = {"rank": 0, "pid": 10, "world_size": 2, "backwards": 3, "steps": 3, "events": 99}
    procs = [{"pid": 10, "rank": 0, "rank_known": True, "world_size": 2, "deepspeed": "0.19.8"},
             {"pid": 9, "rank": 0, "rank_known": False, "world_size": None}]  # the launcher
    world = observed.world_size([eng], procs, None)
    assert world == 2 and observed.world_size([], [], 4) == 4
    got = observed.unwatched_ranks([eng], procs, world, [], "complete")
    assert len(got) == 1 and got[0].startswith("rank 1 of 2 was never watched: no process of that rank ran the watch")
    assert [(r["rank"], r["watched"], r["backwards"], r["steps"]) for r in observed.ranks([eng], world)] == [
        (0, True, 3, 3), (1, False, 0, 0)]
    (tmp_path / "rank1-11-1.json").write_text('{"rank": 1, "trunc')
    (tmp_path / "rank0-10-1.json").write_text(json.dumps(eng))
    engines, bad = job_report.read_rank_files(str(tmp_path))
    assert [e["rank"] for e in engines] == [0] and [b["file"] for b in bad] == ["rank1-11-1.json"]
    got = observed.unwatched_ranks(engines, procs, world, bad, "complete")
    assert got[0].startswith("the watch file rank1-11-1.json could not be read (JSONDecodeError")
    assert "rank 1 of 2 was never watched: its watch file rank1-11-1.json could not be read" in got[1]
    assert job_launch.launcher_world_size(["torchrun", "--master_port", "1", "--nproc-per-node", "2", "a.py",
                                           "--nproc-per-node", "5"]) == 2
    assert job_launch.launcher_world_size(["deepspeed", "--num_gpus=2", "--num_nodes", "2", "a.py"]) == 4
    assert job_launch.launcher_world_size(["python", "a.py"]) is None


def test_the_watch_labels_by_evidence_through_known_labels():
    """A crash is labelled on its own evidence by `known.labels` (the table and rules explore labels with): step()'s
    KeyError in DeepSpeed's scaled_global_norm after a backward that fired no gradient hook is
    zero12-backward-without-gradients; the same KeyError raised by the job's own data code is the job's crash,
    unlabelled, whatever the stage.  A label holds on a fingerprint the issue's own repros recorded: the watch
    fingerprints a crash as explore does (the PyTorch-style repro's ``loss.backward()``, then step()'s KeyError)."""
    from zerostate.known.issues import by_id
    from zerostate.known.labels import label
    from zerostate.watcher import judge
    # what the tracer records of a PyTorch-style backward (kind ``torch``) in which no gradient hook fired: with
    # engine.backward the epilogue would have raised first (IndexError in reduce_ipg_grads)
    trace = (Event(EventKind.FORWARD_START), Event(EventKind.FORWARD_END),
             Event(EventKind.USER_BACKWARD_START, note="torch"), Event(EventKind.USER_BACKWARD_END, note="torch"))
    main = {"package": "other", "file": "train.py", "function": "main", "line": 3, "module": "__main__"}
    in_ds = [main, {"package": "zerostate", "file": "watcher/watch.py", "function": "call", "line": 1,
                    "module": "zerostate.watcher.watch"},
             {"package": "deepspeed", "file": "runtime/engine.py", "function": "step", "line": 1,
              "module": "deepspeed.runtime.engine"},
             {"package": "deepspeed", "file": "runtime/zero/stage_1_and_2.py", "function": "scaled_global_norm",
              "line": 1, "module": "deepspeed.runtime.zero.stage_1_and_2"}]
    # the watch marks the step before engine.step() runs (`WatchTracer._w_step`): the crash is placed in that step
    f = judge.exception("KeyError: 0", in_ds, (*trace, Event(EventKind.STEP)), 2, "0.19.8")
    assert f.key in by_id("zero12-backward-without-gradients").fingerprints, f.key
    assert f.known == "zero12-backward-without-gradients" and not judge.raised_by_the_job(in_ds)
    assert judge.judged(f)["known_issue"] == label(f) and judge.explanation(f)["runtime_prevents"] is False
    own = [main, {"package": "other", "file": "train.py", "function": "collate", "line": 9, "module": "__main__"}]
    f = judge.exception("KeyError: 'input_ids'", own, trace, 2, "0.19.8")
    assert judge.raised_by_the_job(own) and f.known == "" and judge.where_in_the_job(own) == "train.py:9 in collate"
    # the job's own function called from DeepSpeed (a model's forward) raising: still the job's own code
    assert judge.raised_by_the_job([*in_ds[:3], own[1]])
    # a violation: the same labelling -- the same repro's other finding: no hook fired, so no epilogue ran before
    # step() (`epilogue-once:no-epilogue` at the STEP), on the releases the issue affects (its first and 0.19.8)
    stepped = (*trace, Event(EventKind.STEP))
    for release in ("0.18.4", "0.19.8"):
        f = judge.violation("epilogue-once", "the user backward finished without running the epilogue", "no-epilogue",
                            stepped, len(stepped) - 1, release)
        assert f.key in by_id("zero12-backward-without-gradients").fingerprints, f.key
        assert f.known == "zero12-backward-without-gradients" and judge.judged(f)["known_issue"] == label(f)


def _torchrun() -> str:
    import shutil
    return shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")


def _free_port() -> str:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


UNFORWARDED = """#!/bin/sh
# A launcher that does not forward every variable to every rank (pdsh forwards PYTHON*, NCCL*, ... and
# .deepspeed_env, a scheduler its own list): rank 1 starts without the watch's ZEROSTATE_WATCH_* variables.
if [ "$LOCAL_RANK" = "1" ]; then
  exec env -u ZEROSTATE_WATCH_DIR -u ZEROSTATE_WATCH_STOP -u ZEROSTATE_WATCH_RUNTIME -u ZEROSTATE_WATCH_HANG "$@"
fi
exec "$@"
"""


@pytest.mark.deepspeed
def test_a_rank_started_without_the_watchs_environment_is_named_and_the_exit_is_non_zero(tmp_path):
    """``torchrun --nproc-per-node 2`` where rank 1 runs without the watch's environment: rank 0 is watched (3
    backwards, 3 steps), rank 1 is named as never watched, and the watch exits 3 though the job exited 0."""
    wrapper = tmp_path / "unforwarded.sh"
    wrapper.write_text(UNFORWARDED)
    wrapper.chmod(0o755)
    proc, rep, out = _watch(tmp_path, _torchrun(), "--nproc-per-node", "2", "--master_port", _free_port(),
                            "--no-python", str(wrapper), sys.executable, JOBS, "train", "--steps", "3",
                            env=dict(os.environ, DS_ACCELERATOR="cpu"), timeout=400)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert rep["run"]["ranks"] == [0] and rep["run"]["world_size"] == 2
    assert [(r["rank"], r["watched"], r["backwards"], r["steps"]) for r in rep["ranks"]] == [(0, True, 3, 3),
                                                                                          (1, False, 0, 0)]
    assert rep["summary"]["ranks_not_watched"] == [1] and rep["findings"] == [], rep["findings"]
    assert any(p.startswith("rank 1 of 2 was never watched: no process of that rank ran the watch")
               for p in rep["not_observed"]), rep["not_observed"]
    assert "watch: NOT OBSERVED: rank 1 of 2 was never watched" in proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("watch: 0 violations in 3 backwards, 3 steps on 1 of 2 ranks; NOT OBSERVED"), last
    assert "**no: not observed**" in (out / "report.md").read_text()


@pytest.mark.deepspeed
def test_an_eval_only_job_s_backward_specs_read_not_observed(tmp_path):
    """An engine built for training that only evaluates (no_grad forwards, no backward): its backward specs read "not
    observed", not ok, and the watch exits 3 though the job exited 0 -- ok needs an observation."""
    proc, rep, out = _watch(tmp_path, sys.executable, JOBS, "eval", "--steps", "2",
                            env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    results = {sid: row["results"][rep["columns"][0]] for sid, row in rep["specs"].items()}
    backward = {"epilogue-once", "grad-handled-once", "no-epilogue-before-user-backward", "count-once-per-phase",
                "count-matches-hooks", "clean-step", "released-after-backward"}
    assert {s for s, r in results.items() if r == "not observed"} == backward, results
    assert results["available-when-used"] == "ok"  # eval forwards did exercise it (ZeRO-3 fetches for them)
    assert rep["summary"]["backwards"] == 0 and set(rep["summary"]["specs_not_observed"]) == backward
    assert any(p.startswith("no user backward was watched on any rank") for p in rep["not_observed"])
    assert "| `epilogue-once` | **not observed** |" in (out / "report.md").read_text()
    assert "NOT OBSERVED" in proc.stderr.splitlines()[-1]


@pytest.mark.deepspeed
def test_a_key_error_in_the_job_s_own_data_code_at_zero_2_is_the_job_s_crash(tmp_path):
    """A ZeRO-2 job whose own collate function raises ``KeyError: 'input_ids'`` at train step 1: the job's crash, with
    its rank, step and where in the job's code; no finding, no known-issue label (the KeyError of
    zero12-backward-without-gradients is raised in DeepSpeed's step())."""
    proc, rep, out = _watch(tmp_path, sys.executable, JOBS, "datakey", "--steps", "3",
                            env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 1, proc.stderr[-3000:]  # the job's own exit status
    assert rep["findings"] == [], [(f["check"], f["error"], f.get("known_issue")) for f in rep["findings"]]
    (crash,) = rep["job_crashes"]
    assert crash["error"] == "KeyError: 'input_ids'" and crash["known_issue"] is None
    assert crash["rank"] == 0 and crash["step"] == 1 and crash["where"].startswith("watch_jobs.py:")
    assert crash["where"].endswith("in collate")
    assert rep["configuration"]["zero_stage"] == 2 and rep["not_observed"] == [], rep["not_observed"]
    md = (out / "report.md").read_text()
    assert "## The job's own crash" in md and "zero12-backward-without-gradients" not in md
    assert "the job's own code raised KeyError: 'input_ids' (rank 0)" in proc.stderr.splitlines()[-1]


@pytest.mark.deepspeed
def test_a_watched_violation_carries_the_label_explore_gives(tmp_path):
    """The frozen z3 leaf job is z3-leaf-kept-gathered's scenario written as a user's script: the watch's finding
    carries exactly the label (`known.labels.label`) explore gives that scenario's finding on the same release."""
    from zerostate.known.issues import by_id
    from zerostate.known.labels import label
    from zerostate.targets.interface import get_target
    proc, rep, _ = _watch(tmp_path, sys.executable, JOBS, "gathered", "--steps", "2",
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (watched,) = _finding(rep, "released-after-backward")
    target = get_target("deepspeed")
    try:
        explored = [f for f in target.run(by_id("z3-leaf-kept-gathered").scenario).findings
                    if f.check == "released-after-backward"]
    finally:
        target.close()
    assert explored and explored[0].deepspeed == rep["run"]["deepspeed"]
    assert watched["known_issue"] == label(explored[0]) and watched["known_issue"]["id"] == "z3-leaf-kept-gathered"
    # one finding, one fingerprint: the watch's key is explore's, and the failure it names is still-gathered
    assert watched["key"] == explored[0].key and explored[0].violation == "released-after-backward:still-gathered"
    assert watched["key"].startswith(explored[0].violation + "@"), watched["key"]
    assert watched["explanation"]["runtime_prevents"] is True


@pytest.mark.deepspeed
@pytest.mark.parametrize("job,stage", [("resume", 3), ("resume", 2), ("pair", 3), ("pair", 2)])
def test_each_engine_of_a_process_is_judged_on_its_own_calls(tmp_path, job, stage):
    """Two engines in one process, each judged on what its own hooks did: HF's resume into a fresh engine (the
    first destroyed) and two live engines trained in turn (an actor and a critic).  Every engine's gradient hooks call
    the one ``count_used_parameters_in_backward`` of DeepSpeed's module: folded into every engine's trace, the other
    engine's counts read as ``count-matches-hooks`` violations (two "new findings" in the pair, one in the resume)."""
    proc, rep, _ = _watch(tmp_path, sys.executable, JOBS, job, "--stage", str(stage), "--steps", "2",
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rep["findings"] == [] and rep["not_observed"] == [], (rep["findings"], rep["not_observed"])
    assert rep["run"]["engines"] == 2 and [r["engines"] for r in rep["ranks"]] == [2]
    files = [json.loads(p.read_text()) for p in sorted((tmp_path / "report" / "ranks").glob("rank0-*.json"))]
    assert [f["destroyed"] for f in files] == ([True, False] if job == "resume" else [False, False])
    assert all(f["backwards"] == 2 and f["closed"] and f["shares_parameters_with"] == [] for f in files), files


@pytest.mark.deepspeed
def test_two_live_engines_over_one_module_are_said_not_told_apart(tmp_path):
    """A second engine over the module a live engine still hooks (``trainer.train()`` again without freeing the
    first): both engines' hooks run in every forward and backward (DeepSpeed leaves the first's in place), so the
    watch cannot say which one gathered a shared parameter -- it says so, and exits 3, instead of a clean or a
    confident finding."""
    proc, rep, _ = _watch(tmp_path, sys.executable, JOBS, "again", "--steps", "2",
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 3, proc.stderr[-3000:]
    shared = [p for p in rep["not_observed"] if "engines 1 and 2 wrap the same parameters while both are live" in p]
    assert len(shared) == 1, rep["not_observed"]
    assert "NOT OBSERVED" in proc.stderr.splitlines()[-1]


@pytest.mark.deepspeed
@pytest.mark.parametrize("job,persistence", [("gather", 100000), ("gather-edit", 10), ("gather", 0)])
def test_the_loops_own_gathered_parameters_is_no_finding(tmp_path, job, persistence):
    """The loop's own ``deepspeed.zero.GatheredParameters`` between steps, as TRL's weight sync reads every parameter
    (and a user's edit under ``modifier_rank=0``), at ZeRO-3 with persistent parameters or none: the context's
    gathers and releases happen outside every engine call and leave no violation; every backward and step is seen."""
    proc, rep, _ = _watch(tmp_path, sys.executable, JOBS, job, "--persistence", str(persistence), "--steps", "3",
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rep["findings"] == [] and rep["not_observed"] == [], (rep["findings"], rep["not_observed"])
    assert (rep["summary"]["backwards"], rep["summary"]["steps"]) == (3, 3)
