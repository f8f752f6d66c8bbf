"""The opt-in coverage probe (harness/coverage_probe.py): off without its variable; with it, one line per
request with the arcs run in the measured files only, written even when the request raises."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from zerostate.harness import coverage_probe, worker_loop

SOURCE = '''
def branchy(x):
    if x > 0:
        return "pos"
    return "neg"
'''


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(coverage_probe.ENV, raising=False)
    assert coverage_probe.from_env({"ok": True, "file": "/x/deepspeed/__init__.py"}) is None
    probe, hello = worker_loop._coverage_probe({"ok": True, "file": "/x/deepspeed/__init__.py"})
    assert probe is None and hello["ok"]


def test_one_line_per_request_with_the_measured_files_only(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("coverage", reason="the opt-in's dependency (test extra)")
    package = tmp_path / "deepspeed"
    measured = package / coverage_probe.FILES[0]
    measured.parent.mkdir(parents=True)
    measured.write_text(SOURCE)
    other = package / "not_measured.py"
    other.write_text(SOURCE)
    inside, outside = _load(measured, "zs_cov_inside"), _load(other, "zs_cov_outside")
    monkeypatch.setenv(coverage_probe.ENV, str(tmp_path / "out"))
    probe = coverage_probe.from_env({"ok": True, "file": str(package / "__init__.py")})
    assert probe is not None
    assert probe.around({"scenario": {"a": 1}}, lambda: {"r": inside.branchy(1) + outside.branchy(1)}) == {
        "r": "pospos"}
    with pytest.raises(ValueError):
        probe.around({"scenario": {"a": 2}}, lambda: {"r": inside.branchy(-1), "x": int("nope")})
    lines = [json.loads(x) for x in next((tmp_path / "out").glob("cov-*.jsonl")).read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["scenario"] != lines[1]["scenario"]
    assert set(lines[0]["arcs"]) == {coverage_probe.FILES[0]}
    first, second = ({tuple(a) for a in line["arcs"][coverage_probe.FILES[0]]} for line in lines)
    assert (3, 4) in first and (3, 5) not in first  # x > 0: the taken branch only
    assert (3, 5) in second and (3, 4) not in second


def test_a_sample_measures_one_request_in_k(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("coverage", reason="the opt-in's dependency (test extra)")
    monkeypatch.setenv(coverage_probe.ENV, str(tmp_path / "out"))
    monkeypatch.setenv(coverage_probe.EVERY_ENV, "3")
    probe = coverage_probe.from_env({"ok": True, "file": str(tmp_path / "deepspeed" / "__init__.py")})
    assert probe is not None
    answers = [probe.around({"scenario": {"i": i}}, lambda i=i: {"i": i}) for i in range(7)]
    assert [a["i"] for a in answers] == list(range(7))
    lines = next((tmp_path / "out").glob("cov-*.jsonl")).read_text().splitlines()
    assert len(lines) == 3  # requests 0, 3 and 6


def test_arc_ids_round_trip() -> None:
    arcs = [(-1, 1), (1, -1), (3, 4), (524287, -524287), (0, 0)]
    assert [coverage_probe.arc_of(coverage_probe.arc_id(a)) for a in arcs] == arcs
    assert len({coverage_probe.arc_id(a) for a in arcs}) == len(arcs)


@pytest.mark.deepspeed
def test_a_run_that_asks_gets_its_arcs_in_band(ds) -> None:  # type: ignore[no-untyped-def]
    """Real DeepSpeed: a run request with ``coverage`` answers with the arcs of the measured files (the ZeRO-3
    coordinator's among them, for a ZeRO-3 scenario); without it, no field and nothing measured."""
    pytest.importorskip("coverage", reason="the opt-in's dependency (test extra)")
    from zerostate.model.scenario import Scenario
    sc = Scenario(stage=3)
    assert ds.run(sc).coverage is None
    ds.measure_coverage(True)
    try:
        first, second = ds.run(sc), ds.run(sc.with_(stage=2))
    finally:
        ds.measure_coverage(False)
    assert not first.findings and not second.findings
    got, other = first.coverage, second.coverage
    assert set(got) <= set(coverage_probe.FILES) and set(other) <= set(coverage_probe.FILES)
    assert got["runtime/zero/partitioned_param_coordinator.py"] and got["runtime/engine.py"]
    assert "runtime/zero/partitioned_param_coordinator.py" not in other or not other[
        "runtime/zero/partitioned_param_coordinator.py"]
    assert other["runtime/zero/stage_1_and_2.py"]
    engine = Path(str(ds.hello["file"])).parent / "runtime/engine.py"
    length = len(engine.read_text().splitlines())
    assert all(0 < abs(a) <= length and 0 < abs(b) <= length
               for a, b in map(coverage_probe.arc_of, got["runtime/engine.py"]))
    assert ds.run(sc).coverage is None
