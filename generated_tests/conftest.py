"""Hypothesis profiles, pytest options and the fixtures more than one test module uses.

Where a module's tests are: a module's tests are the test files that import it (``import zerostate.x.y`` or
``from zerostate.x import y``, at the top or inside a test).  ``python generated_tests/test_test_map.py
[zerostate.x.y ...]`` prints that map, module -> test files, and test_test_map.py checks that every source module
has at least one; ``pytest --co -q generated_tests/test_<name>.py`` lists a file's tests.  A fixture two test
modules need is defined here, once; one module's own fixtures stay in it.

Profiles (``HYPOTHESIS_PROFILE``; ``ci`` is the default under ``CI=true``,
``dev`` otherwise):

* ``ci``       -- derandomized (same examples every run), bounded example counts, no deadline,
                  no database writes: two CI runs give the same findings.
* ``dev``      -- random, moderate counts, database on: shrunk failures replay first.
* ``thorough`` -- many examples, for a night run or before a release.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, Phase, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                                       HealthCheck.filter_too_much]}
settings.register_profile("ci", derandomize=True, max_examples=60, database=None, print_blob=True,
                          stateful_step_count=40, **_COMMON)
settings.register_profile("dev", max_examples=100, stateful_step_count=50, print_blob=True, **_COMMON)
settings.register_profile("thorough", max_examples=2000, stateful_step_count=100,
                          phases=list(Phase), **_COMMON)
_default = "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))


def pytest_addoption(parser):
    group = parser.getgroup("zerostate")
    group.addoption("--deepspeed", action="store", default=None, metavar="VERSION",
                    help="run the deepspeed target against this DeepSpeed release (own cached venv)")
    group.addoption("--deepspeed-path", action="store", default=None, metavar="DIR",
                    help="run the deepspeed target against a local DeepSpeed checkout")
    group.addoption("--world-size", action="store", type=int, default=1,
                    help="ranks for the deepspeed target (1 or 2)")


FAST_MODULES = frozenset({
    "test_checker", "test_coordinator_model", "test_hook_model", "test_model_core", "test_scenario",
    "test_event_kinds_and_fold", "test_cli_check", "test_cli_compare", "test_cli_errors", "test_fault_catalogue",
    "test_one_place", "test_test_map", "test_cli_common", "test_atomic", "test_reports", "test_explorer",
})
"""The fast tier (``make test-fast``, ``-m fast``): the model, the specs, the strategies, the explorer's and the
reports' parts and the CLI on the model target, and the test map, whole modules but their ``slow`` tests; the one
real-DeepSpeed smoke is marked ``fast`` where it stands."""


def pytest_sessionstart(session):
    """Before any test: clear the build locks a killed JIT build left in torch's default extensions folder
    (`jit_ops.clear_stale_locks`, locks over half an hour old).  The tests' jobs use this project's folders, but a
    job run as a user runs it (no ``TORCH_EXTENSIONS_DIR``) builds there, and one stale lock makes every such
    job wait for ever on ``FileBaton.wait`` with nothing said: the test would fail after its whole timeout."""
    if hasattr(session.config, "workerinput"):  # the pytest-xdist controller clears once, before the workers
        return
    from pathlib import Path

    import zerostate.jit_ops as jit_ops
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    for folder in [root, *(p for p in root.glob("*") if p.is_dir())]:
        for lock in jit_ops.clear_stale_locks(folder):
            print(f"conftest: removed {lock}, a JIT build lock left by a killed build", file=sys.stderr)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        if module in FAST_MODULES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True)
def no_inherited_master_port(monkeypatch):
    """No test inherits ``MASTER_PORT``: a test that ran DeepSpeed inside this pytest process (test_runtime_install)
    leaves it at the port its live process group still listens on, and a job, repro script or CLI command that
    a later test launches from this process (pytest-xdist may put any module after it) would fail with
    EADDRINUSE; without it each picks a free port.  The rest of the rendezvous stays: DeepSpeed in this process
    reads ``LOCAL_RANK`` when it builds an engine."""
    monkeypatch.delenv("MASTER_PORT", raising=False)


@pytest.fixture
def no_inherited_rendezvous(monkeypatch):
    """For tests that launch DeepSpeed jobs as subprocesses (test_watch, test_hf_trainer): the whole rendezvous
    (``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` too) is the job's own, as under a launcher."""
    from zerostate.harness.envs import RENDEZVOUS
    for name in RENDEZVOUS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def ds(request):
    """One DeepSpeed target per test module: the release ``--deepspeed`` / ``--deepspeed-path`` name, else the
    installed one; at world size 1, or at ``--world-size`` in a module that sets ``DS_HONOURS_WORLD_SIZE = True``
    (its tests hold at any world size).  Module scope: starting a worker costs seconds, and ``make test`` runs a
    module whole on one pytest-xdist worker (``--dist loadfile``), so its tests share the target in order."""
    from zerostate.targets.interface import get_target
    opts = {"deepspeed": request.config.getoption("--deepspeed"),
            "deepspeed_path": request.config.getoption("--deepspeed-path")}
    if getattr(request.module, "DS_HONOURS_WORLD_SIZE", False):
        opts["world_size"] = request.config.getoption("--world-size")
    t = get_target("deepspeed", **{k: v for k, v in opts.items() if v})
    yield t
    t.close()


@pytest.fixture(scope="module")
def single_rank_process_group():
    """torch.distributed initialised in this pytest process, one rank on gloo (`runtime.selfcheck._setup_dist`),
    for the modules that build DeepSpeed engines in-process (test_runtime_install, test_runtime_leaf_deferral).
    Module scope, as DeepSpeed initialises its process group once per process; it is never torn down (DeepSpeed
    keeps using it)."""
    from zerostate.runtime import selfcheck
    selfcheck._setup_dist()
