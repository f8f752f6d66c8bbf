"""The fork server (`harness.fork_server`, `harness.forked`): a forked worker is as fresh as a started one, runs
the same, and no forked process outlives what it serves."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from zerostate.findings.wire import to_wire
from zerostate.harness import envs, fork_server, forked
from zerostate.harness.process_state import PER_PROCESS_ENV, global_state
from zerostate.harness.rank_pool import RankPool
from zerostate.harness.worker_process import Worker
from zerostate.model.scenario import Block, Checkpoint, MicroStep, Scenario, TrainStep

OWN_DRAWS = ("python_random", "numpy_random")
"""A process's own random draws: seeded from the OS in each process, forked or started."""


def _env(fork: bool) -> dict[str, str]:
    env = envs.without_rendezvous(dict(os.environ))
    env.setdefault("OMP_NUM_THREADS", "1")
    env[forked.ENV] = "1" if fork else "0"
    return env


def _state(tmp_path: Path, fork: bool, name: str) -> tuple[dict, bool]:
    w = Worker(_env(fork), tmp_path / f"{name}.log")
    try:
        hello = w.request({"op": "hello"}, 600)
        assert hello.get("ok"), w.log_tail()
        state = w.request({"op": "state"}, 60)["state"]
        return state, w.proc.forked
    finally:
        w.close()


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_forked_worker_holds_what_a_started_one_holds(tmp_path):
    """Before its first run, a forked worker's global state (process group, DeepSpeed's backend, accelerator and
    ZeRO-Init globals, ``F.linear``, torch's threads and generator, gc, threads, signal handlers, environment,
    working directory) equals a started worker's, but for each process's own random draws -- which two forked
    workers do not share."""
    started, was_forked = _state(tmp_path, False, "started")
    assert not was_forked
    first, was_forked = _state(tmp_path, True, "forked1")
    assert was_forked, "the fork server did not fork (see its log under the cache's logs/)"
    second, _ = _state(tmp_path, True, "forked2")
    def compared(state: dict) -> dict:
        env = {k: v for k, v in state["env"].items() if k not in PER_PROCESS_ENV and k != forked.ENV}
        return {**{k: v for k, v in state.items() if k not in OWN_DRAWS}, "env": env}
    assert compared(first) == compared(started) and compared(second) == compared(started)
    assert first["dist"][0] and first["deepspeed_comm"] is not None  # the worker's own process group, as started
    assert first["python_random"] != second["python_random"]


def test_the_state_compared_is_this_process_s_own():
    """`global_state` reads the process it runs in (here, the test's: a process group only if an earlier test in
    it initialised one) and tells SIG_IGN from SIG_DFL."""
    import torch.distributed as dist
    state = global_state()
    assert state["dist"][0] == dist.is_initialized() and state["cwd"] == os.getcwd()
    assert state["env"] == dict(sorted(os.environ.items()))
    before = signal.getsignal(signal.SIGUSR2)
    try:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        from zerostate.harness.process_state import _name
        assert _name(signal.SIG_IGN) == "SIG_IGN" and _name(signal.SIG_DFL) == "SIG_DFL"
    finally:
        signal.signal(signal.SIGUSR2, before)


SCENARIOS = (
    Scenario(blocks=(Block(checkpoint=Checkpoint.NON_REENTRANT),), stage=3),
    Scenario(blocks=(Block(checkpoint=Checkpoint.REENTRANT), Block()), stage=3,
             steps=(TrainStep((MicroStep(), MicroStep())), TrainStep())),
    Scenario(blocks=(Block(), Block(checkpoint=Checkpoint.NON_REENTRANT)), stage=2),
)


def _without_clocks(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: _without_clocks(v) for k, v in obj.items() if "seconds" not in k}
    if isinstance(obj, list):
        return [_without_clocks(v) for v in obj]
    return obj


def test_forked_and_started_workers_record_the_same_runs(monkeypatch):
    """The same scenarios on a started and on a forked worker: the same records (events, observations,
    oracle's numbers), clocks aside, and the same findings."""
    from zerostate.targets.deepspeed.target import DeepSpeedTarget
    got = {}
    for fork in (False, True):
        monkeypatch.setenv(forked.ENV, "1" if fork else "0")
        with DeepSpeedTarget() as t:
            assert t.worker is not None
            outs = [t.run(sc) for sc in SCENARIOS]
            got[fork] = ([_without_clocks(to_wire(o.record)) for o in outs],
                         [sorted(f.key for f in o.findings) for o in outs], t.worker.proc.forked)
    assert got[False][2] is False and got[True][2] is True
    assert got[True][:2] == got[False][:2]


def test_a_forked_rank_pool_runs_and_its_ranks_die_with_the_server(tmp_path):
    """A rank pool forked from its server: each rank in a session of its own, a child of the server; the pool
    answers hello on its own rendezvous; when the server is gone, so are its ranks."""
    env = dict(_env(True), ZEROSTATE_RANK_WARMUP="0")
    pool = RankPool(env, 2, tmp_path / "pool.log")
    try:
        hello = pool.request({"op": "hello"}, 600)
        assert hello.get("ok"), pool.log_tail()
        assert all(rk.proc.forked for rk in pool.ranks)
        for rk in pool.ranks:  # each forked rank holds its own rendezvous variables (its /proc environ: the server's)
            rk.send({"op": "state"})
        for rk in pool.ranks:
            while b"\n" not in rk.buf:
                rk.buf += os.read(rk.stdout.fileno(), 1 << 20)
            env = rk.lines()[0]["state"]["env"]
            assert (env["RANK"], env["WORLD_SIZE"]) == (str(rk.rank), "2")
            assert env["MASTER_PORT"] == str(pool._store.port) and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        pids = pool.pids
        parents = {_ppid(p) for p in pids}
        assert len(parents) == 1 and parents != {os.getpid()}
        assert all(os.getsid(p) == p for p in pids)  # each its own session: killed by process group
        (server_pid,) = parents
        os.kill(server_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        pool.close(kill=True)


def test_a_killed_forked_worker_reads_as_killed_and_a_closed_one_exits_0(tmp_path):
    w = Worker(_env(True), tmp_path / "w.log")
    try:
        assert w.request({"op": "hello"}, 600).get("ok")
        assert w.proc.forked and w.proc.poll() is None
        w.proc.kill()
        assert w.proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        w.close()
    w = Worker(_env(True), tmp_path / "w2.log")
    assert w.request({"op": "hello"}, 600).get("ok")
    w.close()
    assert w.proc.returncode == 0


def test_without_the_fork_server_every_worker_is_started(tmp_path):
    w = Worker(_env(False), tmp_path / "w.log")
    try:
        assert w.request({"op": "hello"}, 600).get("ok")
        assert not w.proc.forked and _ppid(w.proc.pid) == os.getpid()
    finally:
        w.close()


def test_no_fork_server_restores_the_environment():
    before = os.environ.get(forked.ENV)
    with forked.disabled():
        assert not forked.enabled()
    assert os.environ.get(forked.ENV) == before


def test_a_server_whose_imports_fail_leaves_the_workers_to_say_so(tmp_path):
    """A release that does not import: the server cannot serve, the worker is started instead and its hello
    names the import error, as without a fork server."""
    broken = tmp_path / "site" / "deepspeed"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('this deepspeed is broken on purpose')\n")
    env = _env(True)
    env["PYTHONPATH"] = str(broken.parent) + os.pathsep + env.get("PYTHONPATH", "")
    w = Worker(env, tmp_path / "w.log")
    try:
        hello = w.request({"op": "hello"}, 600)
        assert not hello.get("ok") and "broken on purpose" in str(hello.get("error"))
        assert not w.proc.forked
        server = forked.server_for(env, str(envs.cache_root()), tmp_path)
        assert server.ready.wait(60) and not server.fork and "broken on purpose" in server.why
    finally:
        w.close()


@pytest.fixture(autouse=True, scope="module")
def _servers_closed():
    yield
    forked.close_servers()


def test_idle_servers_are_stopped_and_a_busy_one_is_kept(tmp_path):
    """A new server stops the least recently used idle ones beyond `forked.MAX_IDLE_SERVERS` (each holds
    hundreds of MB); a server with a running child is never stopped (its ranks would die with it)."""
    forked.close_servers()
    busy = Worker(_env(True), tmp_path / "busy.log")
    try:
        assert busy.request({"op": "hello"}, 600).get("ok") and busy.proc.forked
        cwd = str(envs.cache_root())
        made = []
        for i in range(forked.MAX_IDLE_SERVERS + 2):  # servers that cannot serve (their deepspeed is broken): idle
            site = tmp_path / f"site{i}" / "deepspeed"
            site.mkdir(parents=True)
            (site / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
            env = dict(_env(True), PYTHONPATH=str(site.parent))
            made.append(forked.server_for(env, cwd, tmp_path))
            assert made[-1].ready.wait(120)
        kept = set(map(id, forked._SERVERS.values()))
        assert id(made[-1]) in kept and id(made[0]) not in kept
        assert len(kept) == forked.MAX_IDLE_SERVERS + 2  # the busy one, the idle ones allowed, the newest
        assert busy.proc.poll() is None and busy.request({"op": "hello"}, 60).get("ok")
        assert any(s.busy() for s in forked._SERVERS.values())
    finally:
        busy.close()


def test_the_server_answers_what_it_does_not_serve(tmp_path):
    """The server program (`fork_server`): an unknown request is answered with an error, a pid it never forked
    with no exit code, and the server goes on forking."""
    w = Worker(_env(True), tmp_path / "w.log")
    try:
        assert w.request({"op": "hello"}, 600).get("ok") and w.proc.forked
        server = w.proc._server
        assert server is not None
        assert fork_server.__name__ in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
        assert "unknown op" in server._ask({"op": "nope"})["error"]
        assert server.exit_code(os.getpid()) is None
        again = Worker(_env(True), tmp_path / "again.log")
        assert again.request({"op": "hello"}, 600).get("ok") and again.proc.forked
        again.close()
    finally:
        w.close()


def test_a_tree_edited_after_the_server_imported_it_is_imported_anew(tmp_path):
    """A checkout under edit (a pull request being worked on, a fault applied to a tree): once a ``deepspeed``
    source file the server imported changed, the next worker is forked from a new server that imports the tree as
    it is now, and the old server forks no more."""
    import deepspeed
    tree = tmp_path / "tree"
    import shutil
    shutil.copytree(Path(deepspeed.__file__).parent, tree / "deepspeed")
    (tree / "version.txt").write_text(deepspeed.__version__ + "\n")
    env = dict(_env(True), PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    w = Worker(env, tmp_path / "w.log", cwd=tree)
    try:
        assert w.request({"op": "hello"}, 600).get("ok") and w.proc.forked
        first = w.proc._server
        init = tree / "deepspeed" / "__init__.py"
        init.write_text(init.read_text() + "\nEDITED_AFTER_THE_SERVER_STARTED = True\n")
        again = Worker(env, tmp_path / "again.log", cwd=tree)
        try:
            assert again.request({"op": "hello"}, 600).get("ok") and again.proc.forked
            assert again.proc._server is not first and first.stale and "__init__.py" in first.why
            assert w.proc.poll() is None  # the old server's worker runs on
        finally:
            again.close()
    finally:
        w.close()
