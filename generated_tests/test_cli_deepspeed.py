"""The CLI against real DeepSpeed on CPU, on small budgets: explore, replay, and bad releases / paths."""

from __future__ import annotations

import json

import pytest
from test_cli_util import REPORT_KEYS, load_report, zs

import zerostate.targets.deepspeed.target  # noqa: F401  (a broken import fails, never skips)
pytestmark = pytest.mark.deepspeed

SEED_002 = {"blocks": [{"checkpoint": "non_reentrant", "norm": "frozen", "lin": "trainable"}] * 2,
            "stage": 3, "persistence_threshold": 0}


def _installed() -> str:
    import importlib.metadata
    return importlib.metadata.version("deepspeed")


def test_explore_the_installed_release(tmp_path):
    import zerostate.explorer.exploration  # noqa: F401
    r = zs("explore", "--examples", "3", "--seed", "1", "--json", "--out", str(tmp_path), timeout=600)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    data = json.loads(r.stdout)
    assert data["target"] == "deepspeed" and data["deepspeed"] == _installed()
    rep = load_report(tmp_path)
    assert set(rep) >= REPORT_KEYS and rep["status"] == "complete"
    assert rep["run"]["deepspeed"] == _installed() and rep["columns"] == [f"deepspeed {_installed()}"]
    assert len(rep["findings"]) == len(data["findings"])


def test_replay_seed_002_passes_on_the_installed_release(tmp_path):
    path = tmp_path / "seed002.json"
    path.write_text(json.dumps(SEED_002))
    r = zs("replay", str(path), timeout=600)
    assert r.returncode == 0 and r.stdout.startswith(f"PASS on DeepSpeed {_installed()}"), r.stdout + r.stderr


def test_a_checkout_that_does_not_import_is_a_clear_error(tmp_path):
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("raise ImportError('half-merged branch')\n")
    r = zs("replay", "--deepspeed-path", str(tmp_path), _scenario(tmp_path), timeout=600)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "does not import" in r.stderr and str(tmp_path) in r.stderr


def test_a_folder_without_deepspeed_is_a_clear_error(tmp_path):
    r = zs("replay", "--deepspeed-path", str(tmp_path), _scenario(tmp_path))
    assert r.returncode == 2 and "deepspeed/__init__.py" in r.stderr, r.stderr


def test_an_unsupported_release_names_the_supported_range(tmp_path):
    r = zs("replay", "--deepspeed", "0.3.1", _scenario(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "0.18.4" in r.stderr, r.stderr


def _scenario(folder) -> str:
    path = folder / "s.json"
    path.write_text("{}")
    return str(path)
