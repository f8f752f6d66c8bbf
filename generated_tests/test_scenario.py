"""Scenario values: JSON round trip, and malformed input named precisely."""

from __future__ import annotations

import json

import pytest
from hypothesis import given

from zerostate.model import Scenario, ScenarioError
from zerostate.targets.strategies import scenarios


@given(scenarios())
def test_json_round_trip(sc):
    assert Scenario.from_json(sc.to_json()) == sc
    assert Scenario.from_dict(json.loads(sc.to_json(indent=None))) == sc


@pytest.mark.parametrize("data, field", [
    ({"blocks": [{"checkpoint": "sometimes"}]}, "blocks[0].checkpoint"),
    ({"blocks": [{"norm": "thawed"}]}, "blocks[0].norm"),
    ({"blocks": []}, "blocks"),
    ({"stage": 4}, "stage"),
    ({"stage": "3"}, "stage"),
    ({"steps": [{"micro": [{"backward": "sideways"}]}]}, "steps[0].micro[0].backward"),
    ({"steps": [{"micro": [{}]}, {"micro": [{}, {}]}]}, "steps[1].micro"),
    ({"blocks": [{"colour": "red"}]}, "blocks[0]"),
    ({"widht": 8}, "scenario"),
    ({"fused_head": 1}, "fused_head"),
    ([1, 2], "scenario"),
])
def test_malformed_scenarios_name_the_field(data, field):
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict(data)
    assert str(err.value).startswith(field), str(err.value)


def test_load_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"blocks": [{"lin": "sometimes"}]}')
    with pytest.raises(ScenarioError) as err:
        Scenario.load(str(bad))
    assert str(bad) in str(err.value) and "blocks[0].lin" in str(err.value)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ScenarioError, match="not valid JSON"):
        Scenario.load(str(broken))
    with pytest.raises(ScenarioError, match="cannot read"):
        Scenario.load(str(tmp_path / "missing.json"))


def test_finding_files_load_as_scenarios(tmp_path):
    sc = Scenario()
    f = tmp_path / "finding.json"
    f.write_text(json.dumps({"check": "epilogue-once", "scenario": sc.to_dict()}))
    assert Scenario.load(str(f)) == sc
