"""Scenario values: JSON round trip, and malformed input named precisely."""

from __future__ import annotations

import json

import pytest
from hypothesis import given

from zerostate.model import Scenario, ScenarioError
from zerostate.model.scenario import Block, TrainStep
from zerostate.explorer.strategies import scenarios


@given(scenarios())
def test_json_round_trip(sc):
    assert Scenario.from_json(sc.to_json()) == sc
    assert Scenario.from_dict(json.loads(sc.to_json(indent=None))) == sc


@given(scenarios(), scenarios())
def test_a_scenario_is_its_own_key(a, b):
    """The explorer keys its memo and sets by the scenario: equal exactly when the JSON is, hashed alike."""
    assert (a == b) == (a.to_json(None) == b.to_json(None))
    back = Scenario.from_json(a.to_json())
    assert back == a and hash(back) == hash(a) and {a: 1}[back] == 1


def test_an_integer_clipping_is_the_float_it_equals():
    assert Scenario(gradient_clipping=1).to_json(None) == Scenario(gradient_clipping=1.0).to_json(None)
    assert type(Scenario(gradient_clipping=1).gradient_clipping) is float


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


# ------------------------------------------------------------ training-setup dimensions
def test_setup_fields_are_written_only_when_set():
    """Old scenario files stay byte-identical: a scenario without the new dimensions has none of their keys."""
    plain = Scenario.from_dict({"blocks": [{}], "steps": [{"micro": [{"backward": "torch"}]}]})
    keys = set(plain.to_dict()) | {k for b in plain.to_dict()["blocks"] for k in b} | \
        {k for s in plain.to_dict()["steps"] for k in s} | \
        {k for s in plain.to_dict()["steps"] for m in s["micro"] for k in m}
    new = {"precision", "gradient_clipping", "loss_scale_power", "fp32_grad_accum", "offload",
           "param_groups", "tie", "external", "outputs",
           "losses", "family", "lora", "in_optimizer", "idle", "frozen", "retain"}
    assert not keys & new, keys & new
    assert plain.beyond_model() == []
    full = Scenario.from_dict({"precision": "bf16", "fp32_grad_accum": True, "gradient_clipping": 0.5,
                               "offload": "both",
                               "param_groups": 2, "tie": True, "external": True, "outputs": "dict", "losses": 2,
                               "blocks": [{}, {"in_optimizer": False}],
                               "steps": [{"frozen": [0], "micro": [{"retain": True}]}, {"idle": True}]})
    assert Scenario.from_json(full.to_json()) == full
    assert len(full.beyond_model()) == 13, full.beyond_model()
    fp16 = Scenario.from_dict({"precision": "fp16", "loss_scale_power": 16})
    assert fp16.to_dict()["loss_scale_power"] == 16 and Scenario.from_json(fp16.to_json()) == fp16
    assert "loss_scale_power" not in Scenario.from_dict({"precision": "fp16"}).to_dict()


@pytest.mark.parametrize("data, field", [
    ({"precision": "fp8"}, "precision"),
    ({"offload": "param", "stage": 2}, "offload"),
    ({"offload": "disk"}, "offload"),
    ({"fp32_grad_accum": True}, "fp32_grad_accum"),
    ({"loss_scale_power": 16}, "loss_scale_power"),
    ({"precision": "fp16", "loss_scale_power": 25}, "loss_scale_power"),
    ({"precision": "fp16", "loss_scale_power": "16"}, "loss_scale_power"),
    ({"gradient_clipping": -1}, "gradient_clipping"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping"),
    ({"param_groups": 4}, "param_groups"),
    ({"losses": 3}, "losses"),
    ({"outputs": "list"}, "outputs"),
    ({"lora": True}, "lora"),
    ({"family": "llama", "width": 6}, "width"),
    ({"family": "llama", "blocks": [{"norm": "frozen"}]}, "blocks"),
    ({"family": "llama", "fused_head": True}, "fused_head"),
    ({"tie": True, "blocks": [{"lin": "unused"}]}, "tie/external"),
    ({"blocks": [{"in_optimizer": "no"}]}, "blocks[0].in_optimizer"),
    ({"steps": [{"frozen": [3]}]}, "steps[0].frozen"),
    ({"blocks": [{"lin": "frozen"}], "steps": [{"frozen": [0]}]}, "steps[0].frozen"),
    ({"steps": [{"idle": True, "eval_before": True}]}, "steps[0].idle"),
    ({"steps": [{"micro": [{"retain": 1}]}]}, "steps[0].micro[0].retain"),
])
def test_malformed_setup_fields_name_the_field(data, field):
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict(data)
    assert str(err.value).startswith(field), str(err.value)


DRAWN = {
    "bf16": lambda s: s.precision.value == "bf16" and s.fp32_grad_accum,
    "fp16": lambda s: s.precision.value == "fp16",
    "fp16 from DeepSpeed's default scale 2**16": lambda s: s.precision.value == "fp16" and s.loss_scale_power == 16,
    "prefetch bucket 1": lambda s: s.stage == 3 and s.prefetch_bucket_size == 1,
    "max live parameters 0": lambda s: s.stage == 3 and s.max_live_parameters == 0,
    "clipping": lambda s: s.gradient_clipping > 0,
    "optimizer offload": lambda s: s.offload.value == "optimizer",
    "parameter offload": lambda s: s.offload.value in ("param", "both"),
    "param groups": lambda s: s.param_groups > 1,
    "no group": lambda s: any(not b.in_optimizer for b in s.blocks),
    "requires_grad change": lambda s: any(st.frozen for st in s.steps),
    "width not divisible by 2": lambda s: s.width % 2 == 1,
    "tie": lambda s: s.tie and s.family.value == "blocks",
    "external": lambda s: s.external,
    "tuple": lambda s: s.outputs.value == "tuple",
    "dict + 2 losses": lambda s: s.outputs.value == "dict" and s.losses == 2,
    "retain_graph": lambda s: any(m.retain for _, _, m in s.micro_steps()),
    "step without gradient": lambda s: any(st.idle for st in s.steps),
    "reregister": lambda s: any(st.reregister for st in s.steps),
    "branches": lambda s: any(m.skip for _, _, m in s.micro_steps()),
    "llama": lambda s: s.family.value == "llama",
    "llama + lora + checkpoint": lambda s: s.lora and s.blocks[0].checkpoint.value != "none",
    "engines before it in the process": lambda s: bool(s.engines_before),
    "llama + lora + modules_to_save": lambda s: s.modules_to_save,
    "ZeRO-3 + modules_to_save": lambda s: s.modules_to_save and s.stage == 3,
    "gas 3": lambda s: s.gas == 3,
    "ZeRO-1/2 + optimizer offload + gas 3": lambda s: s.gas == 3 and s.stage in (1, 2)
    and s.offload.value == "optimizer",
    "manual boundary": lambda s: s.manual_boundary,
    "ZeRO-1/2 + optimizer offload + manual boundary": lambda s: s.manual_boundary and s.stage in (1, 2)
    and s.offload.value == "optimizer",
    "contiguous_gradients off": lambda s: not s.contiguous_gradients,
    "overlap_comm on at ZeRO-1/2": lambda s: s.overlap_comm is True and s.stage in (1, 2),
    "overlap_comm off at ZeRO-3": lambda s: s.overlap_comm is False and s.stage == 3,
    "all-reduce fetch": lambda s: s.all_reduce_fetch,
    "all-reduce fetch, width 7": lambda s: s.all_reduce_fetch and s.width == 7,
    "late module at ZeRO-3": lambda s: s.late_module and s.stage == 3,
    "ZeRO-0": lambda s: s.stage == 0,
    "ZeRO-0 + bf16": lambda s: s.stage == 0 and s.precision.value == "bf16",
    "config Adam": lambda s: s.optimizer.value == "config-adam",
    "config Adam + optimizer offload": lambda s: s.optimizer.value == "config-adam"
    and s.offload.value in ("optimizer", "both"),
    "config Adam + bf16": lambda s: s.optimizer.value == "config-adam" and s.precision.value == "bf16",
    "config Adam + fp16": lambda s: s.optimizer.value == "config-adam" and s.precision.value == "fp16",
    "config Adam + param groups + no group": lambda s: s.optimizer.value == "config-adam" and s.param_groups > 1
    and any(not b.in_optimizer for b in s.blocks),
    "ZeRO-0 + bf16 + save_load": lambda s: s.stage == 0 and s.precision.value == "bf16"
    and any(st.save_load for st in s.steps),
    "ZeRO-3 + save_load": lambda s: s.stage == 3 and any(st.save_load for st in s.steps),
}


def test_default_strategy_draws_every_dimension():
    """``zerostate explore``'s default strategy reaches each dimension within 600 derandomized draws (no
    DeepSpeed needed).  400 until the config-Adam draw: with it, ZeRO-3 + modules_to_save (about one draw in
    72) was absent from the 400 of this sequence (2 in another 400-draw sequence, 8 in 800: measured)."""
    from hypothesis import HealthCheck, Phase, given, settings
    seen: set[str] = set()

    @settings(max_examples=600, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(scenarios())
    def draw(sc):
        seen.update(name for name, pred in DRAWN.items() if pred(sc))

    draw()
    assert seen == set(DRAWN), sorted(set(DRAWN) - seen)


# ------------------------------------------------- several engines in one process
def test_engines_before_is_written_only_when_set():
    plain = Scenario.from_dict({"stage": 2})
    assert "engines_before" not in plain.to_dict() and plain.engines_before == ()
    sc = Scenario.from_dict({"stage": 2, "engines_before": [3, 1]})
    assert sc.engines_before == (3, 1) and sc.to_dict()["engines_before"] == [3, 1]
    assert Scenario.from_json(sc.to_json()) == sc
    assert "engines before it in the process: ZeRO-3, ZeRO-1" in sc.beyond_model()
    assert "ZeRO-3, ZeRO-1" in sc.describe()


@pytest.mark.parametrize("value, field", [([4], "engines_before"), ([3, 3, 3, 3], "engines_before"),
                                          (["3"], "engines_before[0]"), (3, "engines_before")])
def test_malformed_engines_before_names_the_field(value, field):
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict({"engines_before": value})
    assert str(err.value).startswith(field), str(err.value)


@pytest.mark.slow  # a shrink or an enumeration of tens of seconds: the full tier only
def test_engines_before_is_drawn_and_shrinks_to_one_zero3_engine():
    """The strategy draws the dimension (one draw in eight) and a scenario that needs it shrinks to a single
    ZeRO-3 engine before an otherwise plain scenario; one that does not need it shrinks it away."""
    from hypothesis import find, settings
    cfg = settings(database=None, max_examples=2000, derandomize=True)
    sc = find(scenarios(), lambda s: bool(s.engines_before), settings=cfg)
    assert sc.engines_before == (3,)
    assert sc.with_(stage=3) == Scenario(engines_before=(3,)), sc.to_json(None)  # plain but for the stage
    plain = find(scenarios(), lambda s: s.stage == 2, settings=cfg)
    assert plain.engines_before == ()


# ------------------------------------------------- engine and loop options (strategies.EXTRAS)
def test_options_are_written_only_when_set_and_round_trip():
    plain = Scenario.from_dict({"stage": 2})
    for k in ("modules_to_save", "manual_boundary", "contiguous_gradients", "overlap_comm", "all_reduce_fetch",
              "late_module"):
        assert k not in plain.to_dict()
    sc = Scenario.from_dict({"stage": 3, "manual_boundary": True, "contiguous_gradients": False,
                             "overlap_comm": False, "all_reduce_fetch": True, "late_module": True,
                             "steps": [{"micro": [{}, {}]}]})
    assert Scenario.from_json(sc.to_json()) == sc
    assert {"manual_boundary=True", "contiguous_gradients=False", "overlap_comm=False", "all_reduce_fetch=True",
            "late_module=True"} <= set(sc.beyond_model())
    llama = Scenario.from_dict({"family": "llama", "lora": True, "modules_to_save": True})
    assert Scenario.from_json(llama.to_json()) == llama and llama.to_dict()["modules_to_save"] is True


@pytest.mark.parametrize("data, field", [
    ({"stage": 2, "all_reduce_fetch": True}, "all_reduce_fetch"),
    ({"family": "llama", "modules_to_save": True}, "modules_to_save"),
    ({"family": "llama", "late_module": True}, "late_module"),
    ({"overlap_comm": "yes"}, "overlap_comm"),
    ({"manual_boundary": 1}, "manual_boundary"),
    ({"contiguous_gradients": None}, "contiguous_gradients"),
    ({"stage": 0, "offload": "optimizer"}, "offload"),
    ({"stage": 0, "steps": [{"micro": [{"backward": "torch"}]}]}, "steps"),
    ({"optimizer": "adam"}, "optimizer"),
    ({"optimizer": 1}, "optimizer")])
def test_malformed_options_name_the_field(data, field):
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict(data)
    assert str(err.value).startswith(field), str(err.value)


@pytest.mark.slow  # a shrink or an enumeration of tens of seconds: the full tier only
@pytest.mark.parametrize("option", ["gas3", "manual_boundary", "late_module"])
def test_each_option_shrinks_to_its_plain_case(option):
    """A scenario that needs the option keeps it and shrinks everything else to plain; one that does not
    need it shrinks the option away."""
    from hypothesis import find, settings
    need = {"gas3": lambda s: s.gas == 3, "manual_boundary": lambda s: s.manual_boundary,
            "late_module": lambda s: s.late_module}[option]
    cfg = settings(database=None, max_examples=3000, derandomize=True)
    sc = find(scenarios(), need, settings=cfg)
    assert sc.beyond_model() in ([], ["manual_boundary=True"], ["late_module=True"]), sc.to_json(None)
    assert len(sc.blocks) == 1 and sc.blocks[0] == Block(), sc.to_json(None)
    plain = find(scenarios(), lambda s: s.stage == 2, settings=cfg)
    assert not plain.manual_boundary and not plain.late_module and plain.gas == 1


# What the default `zerostate explore` reaches is declared as goals (explorer/goals.py: every known DeepSpeed issue's
# family and the bug survey's combinations, each run by a forced draw or its repro when no example reached it) and
# checked by test_goals.py, not pinned in the pseudo-random sequence here.


def test_across_ranks_options_draw_more_ranks_without_changing_the_sequence():
    """An option whose bugs show across ranks (`strategies.across_ranks`) gets world size 2 in five draws of eight
    and 4 in one, the rest world size 2 in one of eight -- through the same eight-way choice, so the generated
    sequence is the same scenarios but for their world size (Hypothesis labels a strategy by its elements' hash:
    another strategy would shift it)."""
    from zerostate.explorer import strategies as S
    from zerostate.explorer.exploration import generated

    def sequence():
        return list(generated(S.scenarios(), 200, None))

    with_rate = sequence()
    plain = S.across_ranks
    try:
        S.across_ranks = lambda sc: False
        without = sequence()
    finally:
        S.across_ranks = plain
    def strip(sc):
        return json.dumps({k: v for k, v in sc.to_dict().items() if k != "world_size"}, sort_keys=True)

    assert [strip(a) for a in with_rate] == [strip(b) for b in without]
    across = [(a.world_size, b.world_size) for a, b in zip(with_rate, without, strict=True) if S.across_ranks(a)]
    others = [(a.world_size, b.world_size) for a, b in zip(with_rate, without, strict=True) if not S.across_ranks(a)]
    assert all(a == b for a, b in others)  # the rate changes only the across-ranks scenarios
    assert any(a == 2 and b == 1 for a, b in across) and not any(a == 1 and b == 2 for a, b in across)
    assert any(a == 4 and b == 2 for a, b in across)  # the one-in-eight draw gives an across-ranks scenario four
    assert {a for a, _ in across} == {1, 2, 4} and {a for a, _ in others} == {1, 2}
    assert S.across_ranks(Scenario.from_dict({"stage": 2, "contiguous_gradients": False}))
    assert not S.across_ranks(Scenario.from_dict({"stage": 3, "contiguous_gradients": False}))
    assert S.across_ranks(Scenario.from_dict({"stage": 3, "all_reduce_fetch": True}))


def test_empty_param_json_validation_and_beyond_model():
    """``empty_param`` is written only when set, round-trips, belongs to the blocks family, is beyond the model
    (the model's networks have no such parameter) and shrinks away: the draw below ZeRO-3 is zero_init's."""
    sc = Scenario.from_dict({"stage": 2, "empty_param": True})
    assert sc.to_dict()["empty_param"] is True and "empty_param" not in Scenario.from_dict({"stage": 2}).to_dict()
    assert Scenario.from_json(sc.to_json()) == sc
    assert any(d.startswith("empty_param") for d in sc.beyond_model())
    with pytest.raises(ScenarioError) as err:
        Scenario.from_dict({"family": "llama", "empty_param": True})
    assert str(err.value).startswith("empty_param"), str(err.value)


# ------------------------------------------------- the optimizer DeepSpeed builds from its config
def test_optimizer_field_json_and_validation():
    """``optimizer`` is written only when not the client SGD, round-trips, is not a `beyond_model` dimension (the
    hook trace does not depend on it) and is named in the description; a bad value names the field."""
    plain = Scenario.from_dict({"stage": 2})
    assert "optimizer" not in plain.to_dict() and plain.optimizer.value == "sgd"
    adam = Scenario.from_dict({"stage": 2, "optimizer": "config-adam", "param_groups": 2,
                               "blocks": [{}, {}, {"in_optimizer": False}]})
    assert adam.to_dict()["optimizer"] == "config-adam"
    assert Scenario.from_json(adam.to_json()) == adam and adam != adam.with_(optimizer=plain.optimizer)
    assert not any(d.startswith("optimizer") for d in adam.beyond_model()), adam.beyond_model()
    assert "config-adam" in adam.describe()
    with pytest.raises(ScenarioError) as err:
        plain.with_(optimizer="config-adam").validate()  # a plain string, not the enum
    assert str(err.value).startswith("optimizer"), str(err.value)


@pytest.mark.slow  # a shrink or an enumeration of tens of seconds: the full tier only
def test_config_adam_shrinks_to_the_client_sgd():
    """Drawn by default (`strategies.EXTRAS`): a scenario that needs it keeps it and shrinks everything else to
    plain; one that does not need it shrinks it away."""
    from hypothesis import find, settings
    cfg = settings(database=None, max_examples=3000, derandomize=True)
    sc = find(scenarios(), lambda s: s.optimizer.value == "config-adam", settings=cfg)
    assert sc.beyond_model() == [] and len(sc.blocks) == 1 and sc.blocks[0] == Block(), sc.to_json(None)
    assert find(scenarios(), lambda s: s.stage == 2, settings=cfg).optimizer.value == "sgd"
# ------------------------------------------------- checkpoint save/load between steps
def test_save_load_is_written_only_when_set_and_parsed_back():
    plain = Scenario.from_dict({"stage": 3, "steps": [{}, {}]})
    assert all("save_load" not in st for st in plain.to_dict()["steps"])
    sc = Scenario.from_dict({"stage": 3, "steps": [{}, {"save_load": True}]})
    assert [st.save_load for st in sc.steps] == [False, True]
    assert [("save_load" in st) for st in sc.to_dict()["steps"]] == [False, True]
    assert Scenario.from_json(sc.to_json()) == sc and Scenario.from_json(sc.to_json()) != plain
    assert "before step 1: checkpoint saved and loaded" in sc.describe()
    # beyond the model at ZeRO-3 only (its checkpoint prologue / epilogue move parameters); ZeRO-1/2: inside
    assert any(d.startswith("ZeRO-3 checkpoint save/load before step(s) 1") for d in sc.beyond_model())
    assert Scenario.from_dict({"stage": 2, "steps": [{"save_load": True}]}).beyond_model() == []


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_save_load_must_be_a_boolean(bad):
    with pytest.raises(ScenarioError, match=r"steps\[1\]\.save_load: expected true or false"):
        Scenario.from_dict({"steps": [{}, {"save_load": bad}]})
    sc = Scenario(steps=(TrainStep(), TrainStep(save_load=bad)))
    with pytest.raises(ScenarioError, match=r"steps\[1\]\.save_load"):
        sc.validate()


def test_scenario_fields_are_plain_values_named_as_the_json_writes_them():
    from zerostate.model.scenario_fields import BackwardKind, Checkpoint, MicroStep, ParamKind
    assert [k.pytorch_style for k in BackwardKind] == [False, True, True]
    assert Checkpoint("non_reentrant") is Checkpoint.NON_REENTRANT and ParamKind.FROZEN == "frozen"
    b = Block(norm=ParamKind.FROZEN)
    assert b.has_frozen and b.has_trainable and b.kind_of("norm") is ParamKind.FROZEN
    assert hash(b) == hash(Block(norm=ParamKind.FROZEN))  # a value: equal blocks hash alike
    with pytest.raises(AttributeError, match="no sub-module 'head'"):
        b.kind_of("head")
    sc = Scenario.from_dict({"blocks": [{"checkpoint": "reentrant"}],
                             "steps": [{"micro": [{"backward": "torch"}]}]})
    assert sc.blocks[0].checkpoint is Checkpoint.REENTRANT and sc.steps[0].micro == (MicroStep(BackwardKind.TORCH),)
    assert sc.steps[0] == TrainStep(micro=(MicroStep(BackwardKind.TORCH),))
