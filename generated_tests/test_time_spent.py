"""Where an exploration's time went (explorer/time_spent.py, `targets.interface.Spent`): its phases' wall clock,
what its workers spent on runs (their CPU, the oracle's share, the judgement) and on starts, and the limit the runs'
own CPU sets; in explore's summary, its report and its printed summary."""

from __future__ import annotations

import pytest

from zerostate.explorer.exploration import explore
from zerostate.explorer.strategies import scenarios
from zerostate.explorer.time_spent import PHASES, breakdown, time_line
from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Spent, get_target

# `breakdown` rounds the wall and each phase to 0.01 s: their sum may pass the wall by half of that per value.
ROUNDING = 0.005


def test_spent_adds_field_by_field_and_the_limit_is_the_runs_cpu_over_the_cores():
    a = Spent(runs=2, cpu_seconds=3.0, oracle_seconds=1.0, starts=1, start_waited=10.0, start_seconds=9.0)
    b = Spent(runs=1, cpu_seconds=1.0, judge_seconds=0.5)
    total = a + b
    assert (total.runs, total.cpu_seconds, total.oracle_seconds, total.judge_seconds, total.starts) == (3, 4.0, 1.0,
                                                                                                          0.5, 1)
    t = breakdown(20.0, {"generation": 12.0, "shrinking": 5.0}, total, 2)
    assert t["phases"] == {"generation": 12.0, "shrinking": 5.0, "confirmation": 0.0}
    assert t["cpu_limit"] == 2.0 and t["wall_over_limit"] == 10.0 and t["spent"]["runs"] == 3
    line = time_line(t)
    assert "3 run(s)" in line and "4 CPU-s, of it the oracle's 1" in line
    assert "1 worker start(s) (none forked: each a new process): 10 s waited" in line
    assert "/ 2 core(s) = 2 s, wall 10.0x that" in line
    forked = time_line(breakdown(20.0, {}, total + Spent(starts=2, forked_starts=2), 2))
    assert "3 worker start(s) (2 forked from a fork server)" in forked
    assert "completion" not in line  # a run without the pairwise completion says nothing of it
    completed = breakdown(20.0, {"generation": 12.0}, total, 2, (7.25, 1.5))
    assert completed["completion"] == {"draw_seconds": 7.25, "waited_seconds": 1.5}
    assert ("(generation 12 s, of it 2 s waiting for the pairwise completion's draws (7 s drawn in all), "
            "shrinking") in time_line(completed)
    own = breakdown(20.0, {}, total, 2, explorer=(9.5, 4.25))
    assert own["explorer_cpu"] == {"seconds": 9.5, "searches": 4.25}
    assert "the explorer's own CPU 10 s (of it its Hypothesis searches' 4)" in time_line(own)
    assert "explorer's own" not in line  # not measured: not said


def test_a_target_without_workers_says_its_runs_are_not_measured():
    res = explore(get_target("model", design="ds-0.18.4"), examples=20, seed=None)
    t = res.time
    assert t is not None and t["spent"] is None and "cpu_limit" not in t
    assert set(t["phases"]) == set(PHASES) and t["phases"]["generation"] > 0
    assert sum(t["phases"].values()) <= t["wall"] + ROUNDING * (len(PHASES) + 1)
    assert "not measured" in time_line(t)


@pytest.mark.deepspeed
def test_deepspeed_runs_and_starts_are_accounted(ds):
    """One run at world size 1 and one at 2 (its rank pool's account is the target's): each outcome carries its
    workers' CPU and oracle seconds; the target's `spent` grows by each run and by the pool's start."""
    before = ds.spent()
    one = ds.run(Scenario.from_dict({"blocks": [{}], "stage": 3}))
    assert one.cpu_seconds and one.cpu_seconds > 0 and one.worker_seconds
    assert one.oracle_seconds and 0 < one.oracle_seconds <= one.cpu_seconds
    mid = ds.spent()
    assert mid.runs == before.runs + 1 and mid.cpu_seconds == pytest.approx(before.cpu_seconds + one.cpu_seconds)
    assert mid.judge_seconds > before.judge_seconds and mid.starts >= 1 and mid.start_seconds > 0
    two = ds.run(Scenario.from_dict({"blocks": [{}], "stage": 2, "world_size": 2}))
    assert not two.findings and two.cpu_seconds and two.oracle_seconds
    after = ds.spent()
    assert after.runs == mid.runs + 1 and after.starts == mid.starts + 1  # the pool's start
    assert after.cpu_seconds == pytest.approx(mid.cpu_seconds + two.cpu_seconds)


@pytest.mark.deepspeed
def test_an_exploration_on_deepspeed_has_its_time_broken_down(ds):
    res = explore(ds, examples=6, seed=None, strategy=scenarios(setup=False), polish=False, confirm=False)
    t = res.time
    assert t is not None and t["spent"] is not None, t
    s = t["spent"]
    assert s["runs"] >= res.examples and s["cpu_seconds"] > 0 and s["oracle_seconds"] > 0
    assert t["cpu_limit"] == pytest.approx(s["cpu_seconds"] / t["cores"], abs=0.01)
    assert t["wall_over_limit"] > 0 and sum(t["phases"].values()) <= t["wall"] + ROUNDING * (len(PHASES) + 1)


MEASURE_AGE = """
import sys, time
from zerostate.harness.worker_loop import _seconds_since_start
print(_seconds_since_start(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/uptime"), reason="process start times are Linux's /proc")
def test_a_process_s_own_start_up_is_at_most_the_time_its_parent_saw_it_take():
    # A start's "own start-up" (a worker's hello) is the seconds since its process began; measured against
    # /proc/stat's whole-second btime it came out up to a second long on every start, a forked one's included.
    import subprocess
    import sys
    import time
    for _ in range(3):
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", MEASURE_AGE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        assert p.stdout is not None and p.stdin is not None
        age = float(p.stdout.readline())
        seen = time.monotonic() - t0
        p.stdin.close()
        p.wait(timeout=60)
        assert 0.0 <= age <= seen + 0.02, (age, seen)  # 0.02: two clock ticks of /proc's start time
