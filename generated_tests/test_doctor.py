"""`zerostate doctor`: a setup's known-issue families, read from the configs users have.

The TRL configs are built by TRL itself (`clients.trl_job.config`, the project's client) and read from their
``to_dict()`` JSON as a user would save it; the families come from the known issues' own repro scenarios, so a test
here fails when a repro, a dimension or a reader changes what a setup is in the family of."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerostate.cli.main import main
from zerostate.doctor import Fact, Setup, diagnose, read_setup
from zerostate.doctor.diagnose import deepspeed_issues, matches, nearest
from zerostate.doctor.dimensions import BY_NAME, DIMENSIONS, requirements
from zerostate.doctor.read_inputs import classify
from zerostate.doctor.render import text
from zerostate.doctor.setup import DoctorError
from zerostate.known.issue import KnownIssue


def _trl_args(tmp_path: Path, trainer: str, ckpt: str) -> str:
    from zerostate.clients.trl_job import config

    path = tmp_path / f"{trainer}-{ckpt}.json"
    path.write_text(json.dumps(config(trainer, ckpt).to_dict(), default=str))
    return str(path)


def _first_release(k: KnownIssue) -> str:
    return ".".join(map(str, k.releases[0]))


def _setup_of(k: KnownIssue, which: int) -> Setup:
    """Everything said, as the issue's ``which``-th repro holds it: the setup that repro is."""
    sc = (k.scenario, *k.variants)[which]
    facts = {d.name: Fact(d.of_scenario(sc), "the repro") for d in DIMENSIONS}
    facts["world_size"] = Fact(max(sc.world_size, k.world_size), "the repro")
    return Setup(facts)


# ---------------------------------------------------------------- the TRL configs the project's clients build
@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("trl")
    return {ck: _trl_args(d, "sft", ck) for ck in ("non_reentrant", "reentrant", "trl", "none")}


@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo"])
def test_each_trl_trainers_config_with_peft_zero3_non_reentrant_is_in_seed_002s_family_on_0_19_2_only(
        tmp_path, trainer):
    path = _trl_args(tmp_path, trainer, "non_reentrant")
    on_192 = diagnose(read_setup([path], "0.19.2", {}, peft=True), "0.19.2")
    on_198 = diagnose(read_setup([path], "0.19.8", {}, peft=True), "0.19.8")
    assert "seed-002" in {e.issue.id for e in on_192.entries}
    assert "seed-002" not in {e.issue.id for e in on_198.entries}


def test_trl_sft_non_reentrant_names_seed_002_on_0_19_2_on_every_point(sft):
    d = diagnose(read_setup([sft["non_reentrant"]], "0.19.2", {}, peft=True), "0.19.2")
    entry = next(e for e in d.entries if e.issue.id == "seed-002")
    assert not entry.match.unsaid and not entry.match.missed
    assert {n.dimension for n in entry.match.met} >= {"stage", "non_reentrant_checkpointing", "frozen_in_checkpointed"}
    assert "DeepSpeed 0.19.3 or later" in entry.avoid
    assert "reentrant checkpointing instead (use_reentrant=True)" in entry.leaves_family
    assert any("zerostate.runtime" in a for a in entry.avoid)


def test_trl_sft_non_reentrant_says_nothing_of_seed_002_on_0_19_8(sft, capsys):
    rc = main([ "doctor", sft["non_reentrant"], "--peft", "lora", "--deepspeed", "0.19.8"])
    out = capsys.readouterr().out
    assert "seed-002" not in out and "non-reentrant recompute" not in out
    d = diagnose(read_setup([sft["non_reentrant"]], "0.19.8", {}, peft=True), "0.19.8")
    assert rc == (1 if d.entries else 0)
    assert "seed-002" in d.elsewhere and all(e.issue.id != "seed-002" for e in d.entries)


def test_reentrant_checkpointing_is_not_seed_002s_family(sft):
    d = diagnose(read_setup([sft["reentrant"]], "0.19.2", {}, peft=True), "0.19.2")
    assert all(e.issue.id != "seed-002" for e in d.entries)


def test_trls_own_checkpointing_choice_is_said_to_be_unknown_and_seed_002_stays_a_condition(sft, capsys):
    """No use_reentrant in the config: the mode is decided at run time (TRL's override, transformers' default); the
    doctor says so and keeps seed 002 as "if it runs non-reentrant", never as met."""
    rc = main(["doctor", sft["trl"], "--peft", "lora", "--deepspeed", "0.19.2"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "decided at run time" in out
    d = diagnose(read_setup([sft["trl"]], "0.19.2", {}, peft=True), "0.19.2")
    entry = next(e for e in d.entries if e.issue.id == "seed-002")
    assert "non_reentrant_checkpointing" in {n.dimension for n in entry.match.unsaid}


def test_a_setup_in_no_known_family_says_so_and_that_it_is_not_proof(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                              "zero_optimization": {"stage": 0}}))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "out", "gradient_accumulation_steps": 1, "deepspeed": str(ds),
                                "gradient_checkpointing": False, "save_strategy": "no", "eval_strategy": "no"}))
    rc = main(["doctor", str(args), "--deepspeed", "0.19.8", "--peft", "none"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no known issue of DeepSpeed 0.19.8 is in the family of this setup" in out
    assert "not proof" in out and "zerostate watch" in out


# ---------------------------------------------------------------- the families are the repros'
@pytest.mark.parametrize("issue", deepspeed_issues(), ids=lambda k: k.id)
def test_every_repro_is_in_its_own_issues_family_on_its_release(issue):
    release = _first_release(issue)
    for i in range(1 + len(issue.variants)):
        d = diagnose(_setup_of(issue, i), release)
        entry = next((e for e in d.entries if e.issue.id == issue.id), None)
        assert entry is not None, f"{issue.id} repro {i}: its own setup is not in its family"
        assert not entry.match.unsaid


@pytest.mark.parametrize("issue", deepspeed_issues(), ids=lambda k: k.id)
def test_each_requirement_of_a_repro_is_needed_by_that_repro(issue):
    """A repro's setup with any one requirement turned to the dimension's neutral value (or another stage) no longer
    matches that repro: every requirement is checked, none is decoration."""
    for i, sc in enumerate((issue.scenario, *issue.variants)):
        base = _setup_of(issue, i)
        for name, value in requirements(sc, issue.world_size).items():
            d = BY_NAME[name]
            other = (1 if value != 1 else 2) if d.neutral is None else (
                value - 1 if d.at_least and isinstance(value, int) else d.neutral)
            changed = base.with_facts({name: Fact(other, "changed")})
            assert not matches(issue, changed)[i].in_family, f"{issue.id} repro {i}: {name}={other} still matches"


def test_an_unsaid_dimension_keeps_an_issue_as_a_condition_never_as_met():
    k = next(k for k in deepspeed_issues() if k.id == "two-backwards-per-forward")
    facts = dict(_setup_of(k, 0).facts)
    del facts["retain_graph"]
    m = nearest(k, Setup(facts))
    assert m is not None and [n.dimension for n in m.unsaid] == ["retain_graph"]
    facts["retain_graph"] = Fact(False, "the loop")
    assert all(not mm.in_family or "retain_graph" not in {n.dimension for n in mm.needs}
               for mm in matches(k, Setup(facts)))


# ---------------------------------------------------------------- readers
def test_ds_config_auto_values_without_trainer_arguments_are_unknown_and_said(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
                              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}))
    s = read_setup([str(ds)], "0.19.8", {})
    assert s.fact("precision").value is None and s.fact("accumulation").value is None
    assert s.fact("clipping").value is None
    assert s.fact("prefetch").value is False and s.fact("persistent_params").value is True
    assert s.fact("retain_graph").value is None  # no trainer: the loop is not known
    assert any("bf16.enabled" in n for n in s.notes)


def test_trainer_arguments_fill_autos_as_hf_does(tmp_path):
    ds = {"gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
          "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "o", "bf16": True, "gradient_accumulation_steps": 4,
                                "max_grad_norm": 0.0, "deepspeed": ds}))
    s = read_setup([str(args)], "0.19.8", {})
    assert s.fact("precision").value == "bf16" and s.fact("accumulation").value is True
    assert s.fact("clipping").value is False
    assert s.fact("pytorch_backward").value is False and s.fact("hf_model").value is True


def test_clipping_default_follows_the_release(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}))
    assert read_setup([str(ds)], "0.19.2", {}).fact("clipping").value is False
    assert read_setup([str(ds)], "0.19.8", {}).fact("clipping").value is True


def test_an_accelerate_config_is_read_with_its_plugin(tmp_path):
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 2\ndeepspeed_config:\n"
                   "  zero_stage: 3\n  zero3_init_flag: true\n  offload_optimizer_device: cpu\n")
    s = read_setup([str(acc)], "0.19.2", {})
    assert (s.fact("stage").value, s.fact("precision").value, s.fact("zero_init").value,
            s.fact("offload_optimizer").value, s.fact("world_size").value) == (3, "bf16", True, True, 2)


def test_grpo_under_zero3_generates_and_reregisters_hooks(tmp_path):
    s = read_setup([_trl_args(tmp_path, "grpo", "none")], "0.19.8", {}, peft=True)
    assert s.fact("eval_forward").value is True and s.fact("hooks_reregistered").value is True


# ---------------------------------------------------------------- bad input: one line, exit 2
@pytest.mark.parametrize("content, argv, says", [
    ("{not json", [], "not valid JSON (line 1"),
    ('{"zero_optimization": {"stage": 5}}', [], "zero_optimization.stage: expected 0, 1, 2 or 3, got 5"),
    ('{"hello": 1}', [], "neither a DeepSpeed config"),
    ('{"zero_optimization": {"stage": 1}}', ["--set", "bogus=true"], "--set bogus: no such setup dimension"),
    ('{"zero_optimization": {"stage": 1}}', ["--set", "retain_graph=maybe"], "expected true or false"),
    ('{"zero_optimization": {"stage": 1}}', ["--deepspeed", "0.17.0"], "the known-issue table starts at 0.18.4"),
    ('{"zero_optimization": {"stage": 1}}', ["--deepspeed", "latest"], "not a DeepSpeed release number"),
])
def test_bad_input_is_one_line_naming_the_problem(tmp_path, capsys, content, argv, says):
    f = tmp_path / "ds.json"
    f.write_text(content)
    rc = main(["doctor", str(f), *(argv if "--deepspeed" in argv else [*argv, "--deepspeed", "0.19.8"])])
    err = capsys.readouterr().err
    assert rc == 2
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_release_newer_than_the_table_judges_open_issues_as_not_established(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    d = diagnose(read_setup([str(ds)], "0.21.0", {"empty_param": True}), "0.21.0")
    assert d.newer_than_table
    entry = next(e for e in d.entries if e.issue.id == "z3-empty-param-not-gathered")
    assert not entry.established
    assert all(e.issue.fixed_in is None for e in d.entries)


def test_json_output_carries_the_sources_and_the_repro(sft, capsys):
    rc = main(["doctor", sft["non_reentrant"], "--peft", "lora", "--deepspeed", "0.19.2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    seed = next(e for e in out["may_be_hit"] if e["id"] == "seed-002")
    assert seed["scenario"]["stage"] == 3 and seed["needs_unsaid"] == []
    assert out["setup"]["stage"]["source"].endswith("zero_optimization.stage")


# ---------------------------------------------------------------- --replay runs the nearest repro, real DeepSpeed
@pytest.mark.deepspeed
@pytest.mark.slow
def test_replay_runs_the_nearest_repro_on_the_release(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                              "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}}))
    rc = main(["doctor", str(ds), "--deepspeed", "0.19.8", "--json", "--replay", "--trainer", "custom",
               "--set", "retain_graph=true", "--set", "pytorch_backward=false", "--set", "frozen_params=false",
               "--set", "idle_step=false", "--set", "unused_params=false", "--set", "fused_loss=false",
               "--set", "empty_param=false", "--set", "eval_forward=false", "--set", "checkpoint_save=false",
               "--set", "nested_outputs=false", "--set", "several_engines=false", "--set", "hf_model=false"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    two = next(e for e in out["may_be_hit"] if e["id"] == "two-backwards-per-forward")
    assert two["replay"].startswith("reproduced on DeepSpeed 0.19.8"), two


def test_two_configs_of_one_kind_are_refused_naming_both(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for f in (a, b):
        f.write_text('{"zero_optimization": {"stage": 1}}')
    with pytest.raises(DoctorError, match=r"b\.json: a second ds config \(the first: .*a\.json\)"):
        classify([str(a), str(b)])


def test_the_text_lists_what_no_input_said(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3}}')
    out = text(diagnose(read_setup([str(ds)], "0.19.8", {}), "0.19.8"))
    unsaid = out.split("not said")[1]
    assert "retain_graph" in unsaid and "z3_leaf" in unsaid and "stage" not in unsaid.split(":")[1].split(", ")


def test_the_installed_release_is_judged_when_none_is_named():
    import argparse
    from importlib import metadata

    from zerostate.cli import cmd_doctor

    assert cmd_doctor.release_of(argparse.Namespace(deepspeed=None)) == metadata.version("deepspeed")


@pytest.mark.deepspeed
@pytest.mark.slow
def test_replay_on_0_19_2_reproduces_seed_002_for_the_trl_sft_config(sft, capsys):
    """Opt-in like the other older-release tests (the release is installed on first use):
    ``ZEROSTATE_RELEASES=0.19.2``."""
    import os

    if "0.19.2" not in os.environ.get("ZEROSTATE_RELEASES", "") and os.environ.get("ZEROSTATE_RELEASES") != "1":
        pytest.skip("set ZEROSTATE_RELEASES=0.19.2 (or 1) to replay on an older release")
    rc = main(["doctor", sft["non_reentrant"], "--peft", "lora", "--deepspeed", "0.19.2", "--json", "--replay",
               "--set", "z3_leaf=false", "--set", "empty_param=false", "--set", "input_without_grad=false",
               "--set", "modules_to_save=false"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    seed = next(e for e in out["may_be_hit"] if e["id"] == "seed-002")
    assert seed["replay"].startswith("reproduced on DeepSpeed 0.19.2"), seed


def test_a_custom_loop_says_nothing_of_its_loop_even_with_trainer_arguments(sft):
    s = read_setup([sft["non_reentrant"]], "0.19.8", {}, trainer="custom", peft=True)
    assert s.fact("retain_graph").value is None and s.fact("eval_forward").value is None
    assert s.fact("non_reentrant_checkpointing").value is True  # the arguments still say the model's checkpointing


# ---------------------------------------------------------------- the optimizer dimensions (issue 44)
EMPTY_GROUP = "empty-param-group-dropped-under-scheduler"


def test_trl_with_lora_has_an_empty_group_and_its_scheduler_built_after_initialize(sft):
    """TRL's SFT config with LoRA: HF's groups (the no-decay one empty under LoRA), the scheduler built after
    accelerate's prepare (transformers 5): not in the empty-group issue's family; a release of transformers that
    built it before (said with --set) is, on every point."""
    s = read_setup([sft["non_reentrant"]], "0.19.8", {}, peft=True)
    assert s.fact("hf_param_groups").value is True and s.fact("empty_param_group").value is True
    assert s.fact("lr_scheduler").value == "after"
    assert EMPTY_GROUP not in {e.issue.id for e in diagnose(s, "0.19.8").entries}
    older = read_setup([sft["non_reentrant"]], "0.19.8", {"lr_scheduler": "initialize", "frozen_params": True},
                       peft=True)
    entries = [e for e in diagnose(older, "0.19.8").entries if e.issue.id == EMPTY_GROUP]
    assert entries, [e.issue.id for e in diagnose(older, "0.19.8").entries]


def test_a_config_optimizer_keeps_the_trainer_out_of_the_empty_group_family(tmp_path):
    """With an optimizer section DeepSpeed builds the optimizer over one list and the scheduler itself."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}))
    s = read_setup([str(ds)], "0.19.8", {}, trainer="sft", peft=True)
    assert s.fact("empty_param_group").value is False and s.fact("lr_scheduler").value == "deepspeed"
    assert EMPTY_GROUP not in {e.issue.id for e in diagnose(s, "0.19.8").entries}


def test_an_unknown_scheduler_value_is_refused_naming_the_values(tmp_path):
    from zerostate.doctor.read_inputs import parse_value
    with pytest.raises(DoctorError, match="expected one of none, initialize, user"):
        parse_value("lr_scheduler", "cosine")
