"""Reading a user's setup: a DeepSpeed config (JSON), Hugging Face / TRL training arguments (the JSON of
``TrainingArguments.to_dict()``, whose ``deepspeed`` holds the config or its path) and an accelerate config (YAML),
into `Fact`s; then the model and loop options said on the command line.  Every value is read where the user wrote
it, or from DeepSpeed's documented default, or left unknown with a note saying why (``auto`` with no trainer
arguments to fill it, a checkpointing mode the trainer decides at run time)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerostate.doctor.dimensions import BY_NAME, Kind, Value
from zerostate.doctor.setup import DoctorError, Fact, Setup

DS_DEFAULTS = {"stage3_param_persistence_threshold": 100_000, "stage3_prefetch_bucket_size": 50_000_000,
               "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9}
"""DeepSpeed's defaults for the ZeRO-3 knobs the dimensions read (deepspeed/runtime/zero/config.py)."""
CLIPPING_DEFAULT_FROM = (0, 19, 5)
"""DeepSpeed's ``gradient_clipping`` defaults to 1.0 from this release, 0 (off) before it."""


@dataclass(frozen=True)
class Inputs:
    """The files given, each read and sorted by kind."""

    ds_config: tuple[str, dict[str, Any]] | None = None
    hf_args: tuple[str, dict[str, Any]] | None = None
    accelerate: tuple[str, dict[str, Any]] | None = None


def _load(path: str) -> Any:
    if not os.path.isfile(path):
        raise DoctorError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise DoctorError(f"{path}: cannot read it ({exc})") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise DoctorError(f"{path}: reading a YAML accelerate config needs PyYAML (pip install pyyaml)") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise DoctorError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DoctorError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None


def classify(paths: list[str]) -> Inputs:
    """Read each file and tell a DeepSpeed config, trainer arguments and an accelerate config apart by their keys;
    one of each at most."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for path in paths:
        data = _load(path)
        if not isinstance(data, dict):
            raise DoctorError(f"{path}: expected an object of settings, got {type(data).__name__}")
        if "distributed_type" in data or "deepspeed_config" in data:
            kind = "accelerate"
        elif "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data or "train_batch_size" in data:
            kind = "ds_config"
        elif "output_dir" in data or "per_device_train_batch_size" in data or "gradient_accumulation_steps" in data:
            kind = "hf_args"
        else:
            raise DoctorError(f"{path}: neither a DeepSpeed config (no zero_optimization / train_batch_size), nor "
                              "trainer arguments (no output_dir / per_device_train_batch_size), nor an accelerate "
                              "config (no distributed_type / deepspeed_config)")
        if kind in found:
            raise DoctorError(f"{path}: a second {kind.replace('_', ' ')} (the first: {found[kind][0]})")
        found[kind] = (path, data)
    return Inputs(found.get("ds_config"), found.get("hf_args"), found.get("accelerate"))


def _auto(v: Any) -> bool:
    return isinstance(v, str) and v.lower() == "auto"


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            return float(v)
        except (TypeError, ValueError):
            raise DoctorError(f"{where}: expected a number, got {v!r}") from None
    return float(v)


def _flag(v: Any, where: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise DoctorError(f"{where}: expected true or false, got {v!r}")


def _section(cfg: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    v = cfg.get(key) or {}
    if not isinstance(v, dict):
        raise DoctorError(f"{where}: {key}: expected an object, got {type(v).__name__}")
    return v


def _release(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    try:
        return tuple(int(x) for x in version.split("+")[0].split(".")[:3])
    except ValueError:
        return None


def ds_facts(cfg: dict[str, Any], where: str, hf: dict[str, Any] | None, release: str | None
             ) -> tuple[dict[str, Fact], list[str]]:
    """The config dimensions of a DeepSpeed config; ``auto`` values filled from the trainer arguments ``hf`` as HF's
    integration fills them, else unknown (a note says which)."""
    facts: dict[str, Fact] = {}
    notes: list[str] = []
    zero = _section(cfg, "zero_optimization", where)

    def at(key: str) -> str:
        return f"{where}: {key}"

    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise DoctorError(f"{at('zero_optimization.stage')}: expected 0, 1, 2 or 3, got {stage!r}")
    facts["stage"] = Fact(stage, at("zero_optimization.stage") if "stage" in zero else "DeepSpeed's default (0)")

    precision: str | None = "fp32"
    source = "neither fp16 nor bf16 enabled"
    for name in ("bf16", "fp16"):
        sec = _section(cfg, name, where) or (_section(cfg, "bfloat16", where) if name == "bf16" else {})
        enabled = sec.get("enabled", False)
        if _auto(enabled):
            if hf is not None:
                if hf.get(name):
                    precision, source = name, f"{at(name + '.enabled')} auto, filled from the arguments' {name}"
            else:
                precision, source = None, at(name + ".enabled")
                notes.append(f"{at(name + '.enabled')} is \"auto\" and no trainer arguments fill it: the precision "
                             "is not known")
                break
        elif _flag(enabled, at(name + ".enabled")):
            precision, source = name, at(name + ".enabled")
    facts["precision"] = Fact(precision, source)
    accum = _section(cfg, "data_types", where).get("grad_accum_dtype")
    facts["fp32_grad_accum"] = Fact(precision == "bf16" and accum == "fp32",
                                    at("data_types.grad_accum_dtype") if accum else "DeepSpeed's default")

    for dim, key in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        device = _section(zero, key, at("zero_optimization")).get("device", "none")
        if _auto(device):
            facts[dim] = Fact(None, at(f"zero_optimization.{key}.device"))
        else:
            facts[dim] = Fact(str(device).lower() in ("cpu", "nvme"),
                              at(f"zero_optimization.{key}.device") if key in zero else "no offload section")

    opt = _section(cfg, "optimizer", where)
    if opt:
        facts["adam"] = Fact("adam" in str(opt.get("type", "")).lower(), at("optimizer.type"))

    clip = cfg.get("gradient_clipping")
    if clip is None:
        rel = _release(release)
        if rel is None:
            facts["clipping"] = Fact(None, "DeepSpeed's default, which depends on the release")
        else:
            facts["clipping"] = Fact(rel >= CLIPPING_DEFAULT_FROM, f"DeepSpeed {release}'s default")
    elif _auto(clip):
        if hf is not None:
            facts["clipping"] = Fact(_number(hf.get("max_grad_norm", 1.0), "max_grad_norm") > 0,
                                     f"{at('gradient_clipping')} auto, filled from the arguments' max_grad_norm")
        else:
            facts["clipping"] = Fact(None, at("gradient_clipping"))
            notes.append(f"{at('gradient_clipping')} is \"auto\" and no trainer arguments fill it")
    else:
        facts["clipping"] = Fact(_number(clip, at("gradient_clipping")) > 0, at("gradient_clipping"))

    gas = cfg.get("gradient_accumulation_steps")
    if gas is None or _auto(gas):
        if hf is not None:
            facts["accumulation"] = Fact(int(_number(hf.get("gradient_accumulation_steps", 1),
                                                     "gradient_accumulation_steps")) > 1,
                                         "the arguments' gradient_accumulation_steps")
        elif gas is None:
            facts["accumulation"] = Fact(False, "DeepSpeed's default (1)")
        else:
            facts["accumulation"] = Fact(None, at("gradient_accumulation_steps"))
            notes.append(f"{at('gradient_accumulation_steps')} is \"auto\" and no trainer arguments fill it")
    else:
        facts["accumulation"] = Fact(_number(gas, at("gradient_accumulation_steps")) > 1,
                                     at("gradient_accumulation_steps"))

    if stage == 3:
        for dim, key in (("persistent_params", "stage3_param_persistence_threshold"),
                         ("prefetch", "stage3_prefetch_bucket_size")):
            v = zero.get(key, DS_DEFAULTS[key])
            # HF fills "auto" from the model's hidden size: never 0 for a real model
            facts[dim] = Fact(True if _auto(v) else _number(v, at(f"zero_optimization.{key}")) > 0,
                              at(f"zero_optimization.{key}") if key in zero else f"DeepSpeed's default {v:g}")
        limits = [k for k in ("stage3_max_live_parameters", "stage3_max_reuse_distance")
                  if k in zero and not _auto(zero[k]) and _number(zero[k], at(f"zero_optimization.{k}")) < 10**9]
        facts["live_or_reuse_limit"] = Fact(bool(limits), at("zero_optimization." + limits[0]) if limits else
                                            "DeepSpeed's defaults (1e9)")
        fetch = zero.get("stage3_use_all_reduce_for_fetch_params", False)
        facts["all_reduce_fetch"] = Fact(_flag(fetch, at("zero_optimization.stage3_use_all_reduce_for_fetch_params")),
                                         at("zero_optimization.stage3_use_all_reduce_for_fetch_params"))
    else:
        for dim in ("persistent_params", "prefetch", "live_or_reuse_limit", "all_reduce_fetch"):
            facts[dim] = Fact(False, f"ZeRO stage {stage} (a ZeRO-3 knob)")
    facts["no_contiguous_gradients"] = Fact(
        not _flag(zero.get("contiguous_gradients", True), at("zero_optimization.contiguous_gradients")),
        at("zero_optimization.contiguous_gradients"))
    if "overlap_comm" in zero:
        on = _flag(zero["overlap_comm"], at("zero_optimization.overlap_comm"))
        facts["overlap_comm_changed"] = Fact(on != (stage == 3), at("zero_optimization.overlap_comm"))
    else:
        facts["overlap_comm_changed"] = Fact(False, "DeepSpeed's default (on at ZeRO-3, off at ZeRO-1/2)")
    scatter = _flag(zero.get("reduce_scatter", True), at("zero_optimization.reduce_scatter"))
    facts["no_reduce_scatter"] = Fact(not scatter, at("zero_optimization.reduce_scatter"))
    ranks = _world_size(cfg)
    if ranks is not None:
        facts["world_size"] = Fact(ranks, at("train_batch_size / (train_micro_batch_size_per_gpu x "
                                             "gradient_accumulation_steps)"))
    return facts, notes


def _world_size(cfg: dict[str, Any]) -> int | None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    vals = [cfg.get(k) for k in keys]
    if any(v is None or _auto(v) or isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
        return None
    total, micro, gas = (int(v) for v in vals if isinstance(v, int))
    return total // (micro * gas) if total % (micro * gas) == 0 else None


TRAINERS = ("hf", "sft", "dpo", "grpo", "custom")
"""``--trainer``: Hugging Face's Trainer, TRL's SFT / DPO / GRPO trainers, or the user's own loop."""


def trainer_of(hf: dict[str, Any]) -> str:
    """Which trainer's arguments these are, by the fields only that trainer's config has."""
    if "num_generations" in hf:
        return "grpo"
    if "beta" in hf and "loss_type" in hf:
        return "dpo"
    if "dataset_text_field" in hf or "packing" in hf:
        return "sft"
    return "hf"


def _use_reentrant(hf: dict[str, Any]) -> Any:
    for key in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        kw = hf.get(key)
        if isinstance(kw, str):
            try:
                kw = json.loads(kw)
            except json.JSONDecodeError:
                kw = None
        if isinstance(kw, dict) and "use_reentrant" in kw:
            return kw["use_reentrant"]
    return None


def _trainer_optimizer(config_optimizer: bool) -> dict[str, Fact]:
    """HF Trainer's optimizer and scheduler (transformers' integrations/deepspeed.py ``deepspeed_optim_sched``): with
    an ``optimizer`` section DeepSpeed builds it over the trainable parameters (one list: ``DummyOptim``) and the
    scheduler too (its config's, or HF's callable of that optimizer); without one the trainer builds its two groups
    (`create_optimizer`) and, from transformers 5, its scheduler after ``accelerator.prepare`` over what DeepSpeed
    left (trainer.py: "Create scheduler now that the optimizer won't change anymore")."""
    if config_optimizer:
        why = "the config's optimizer: DeepSpeed builds it over the trainable parameters (HF Trainer's DummyOptim)"
        return {"hf_param_groups": Fact(False, why), "empty_param_group": Fact(False, why),
                "lr_scheduler": Fact("deepspeed", "the config's optimizer: DeepSpeed builds the scheduler too (its "
                                     "config's, or HF Trainer's callable of the built optimizer)")}
    return {"hf_param_groups": Fact(True, "HF Trainer's create_optimizer (no optimizer section in the config)"),
            "lr_scheduler": Fact("after", "HF Trainer (transformers 5) creates its scheduler after accelerate's "
                                 "prepare, over the optimizer deepspeed.initialize left (before 5.x it was built "
                                 "before: say --set lr_scheduler=initialize for such a release)")}


def hf_facts(hf: dict[str, Any] | None, where: str, trainer: str, stage: Value | None
             ) -> tuple[dict[str, Fact], list[str]]:
    """What a trainer says beyond the DeepSpeed config: from its arguments ``hf`` (when given) the model's
    checkpointing, the optimizer, evaluation and saving; from the trainer itself its loop (HF Trainer and TRL call
    ``engine.backward`` on one scalar loss per micro-step through accelerate, never retain the graph, and mark the
    accumulation boundary as DeepSpeed's ``gradient_accumulation_steps`` says)."""
    facts: dict[str, Fact] = {}
    notes: list[str] = []
    generates = trainer == "grpo"
    if trainer != "custom":  # a trainer's own loop; a custom loop says nothing of itself
        loop = f"{'TRL ' + trainer.upper() if trainer != 'hf' else 'HF'} Trainer's loop"
        facts["hf_model"] = Fact(True, loop)
        facts["nested_outputs"] = Fact(True, "an HF model computes its loss from its logits")
        facts["param_groups"] = Fact(True, "HF Trainer's optimizer groups (with and without weight decay)")
        facts["param_outside_optimizer"] = Fact(False, "HF Trainer puts every trainable parameter in a group")
        for d in ("fused_loss", "late_module", "retain_graph", "pytorch_backward", "nonscalar_backward", "idle_step",
                  "freeze_toggle", "manual_boundary"):
            facts[d] = Fact(False, loop)
        if generates:
            gather = (hf or {}).get("ds3_gather_for_generation", True)
            facts["hooks_reregistered"] = Fact(stage == 3 and bool(gather),
                                               "GRPO's generation under ZeRO-3 (ds3_gather_for_generation)")
        else:
            facts["hooks_reregistered"] = Fact(False, loop)
    if hf is None:
        if generates:
            facts["eval_forward"] = Fact(True, "GRPO's generation (no_grad forwards between steps)")
        return facts, notes
    ckpt = bool(hf.get("activation_checkpointing") or hf.get("gradient_checkpointing"))
    key = "activation_checkpointing" if "activation_checkpointing" in hf else "gradient_checkpointing"
    if not ckpt:
        facts["reentrant_checkpointing"] = facts["non_reentrant_checkpointing"] = Fact(False, f"{where}: {key}")
    else:
        reentrant = _use_reentrant(hf)
        if reentrant is None:
            for d in ("reentrant_checkpointing", "non_reentrant_checkpointing"):
                facts[d] = Fact(None, f"{where}: {key} without use_reentrant")
            notes.append(f"{where}: checkpointing on without use_reentrant: the mode is decided at run time "
                         "(transformers 5 enables use_reentrant=False, 4.x True; TRL forces True with PEFT + ZeRO-3 in "
                         "some trainers): say --checkpointing, or run the job under `zerostate watch` to see which ran")
        else:
            r = _flag(reentrant, f"{where}: gradient_checkpointing_kwargs.use_reentrant")
            facts["reentrant_checkpointing"] = Fact(r, f"{where}: gradient_checkpointing_kwargs.use_reentrant")
            facts["non_reentrant_checkpointing"] = Fact(not r, f"{where}: gradient_checkpointing_kwargs.use_reentrant")
    optim = str(hf.get("optim", "adamw_torch"))
    facts["adam"] = Fact("adam" in optim.lower(), f"{where}: optim ({optim})")
    if trainer != "custom":  # a custom loop evaluates and saves as it likes, whatever the arguments say
        eval_on = str(hf.get("eval_strategy", hf.get("evaluation_strategy", "no"))).lower() not in (
            "no", "intervalstrategy.no")
        facts["eval_forward"] = Fact(eval_on or generates, f"{where}: eval_strategy" + (
            " and GRPO's generation" if generates else ""))
        save_on = str(hf.get("save_strategy", "steps")).lower() not in ("no", "savestrategy.no",
                                                                         "intervalstrategy.no")
        facts["checkpoint_save"] = Fact(save_on, f"{where}: save_strategy")
    return facts, notes


def accelerate_facts(acc: dict[str, Any], where: str) -> tuple[dict[str, Fact], dict[str, Any], str | None]:
    """An accelerate config's DeepSpeed plugin: its facts, the DeepSpeed config it amounts to (for `ds_facts`), and
    the path of the config file it names instead, if any."""
    plugin = _section(acc, "deepspeed_config", where)
    facts: dict[str, Fact] = {}
    if str(acc.get("distributed_type", "DEEPSPEED")).upper() != "DEEPSPEED":
        raise DoctorError(f"{where}: distributed_type is {acc.get('distributed_type')!r}, not DEEPSPEED")
    file = plugin.get("deepspeed_config_file")
    if file:
        path = file if os.path.isabs(file) else os.path.join(os.path.dirname(where) or ".", file)
        return facts, {}, path
    cfg: dict[str, Any] = {"zero_optimization": {"stage": plugin.get("zero_stage", 2)}}
    for key, name in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
        if key in plugin:
            cfg["zero_optimization"][name] = {"device": plugin[key]}
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if key in plugin:
            cfg[key] = plugin[key]
    mp = str(acc.get("mixed_precision", "no")).lower()
    if mp in ("bf16", "fp16"):
        cfg[mp] = {"enabled": True}
    if "zero3_init_flag" in plugin:
        facts["zero_init"] = Fact(bool(plugin["zero3_init_flag"]) and cfg["zero_optimization"]["stage"] == 3,
                                  f"{where}: deepspeed_config.zero3_init_flag")
    if isinstance(acc.get("num_processes"), int):
        facts["world_size"] = Fact(int(acc["num_processes"]) * int(acc.get("num_machines", 1) or 1),
                                   f"{where}: num_processes x num_machines")
    return facts, cfg, None


def parse_value(name: str, text: str) -> Value:
    """``--set NAME=VALUE``: a dimension's value as its repros hold it."""
    d = BY_NAME.get(name)
    if d is None:
        raise DoctorError(f"--set {name}: no such setup dimension (known: {', '.join(sorted(BY_NAME))})")
    if isinstance(d.neutral, bool):
        low = text.lower()
        if low not in ("true", "false", "yes", "no", "1", "0"):
            raise DoctorError(f"--set {name}={text}: expected true or false")
        return low in ("true", "yes", "1")
    if isinstance(d.neutral, int) or d.neutral is None:
        try:
            return int(text)
        except ValueError:
            raise DoctorError(f"--set {name}={text}: expected an integer") from None
    if d.choices and text not in d.choices:
        raise DoctorError(f"--set {name}={text}: expected one of {', '.join(d.choices)}")
    return text


def read_setup(paths: list[str], release: str | None, options: dict[str, Value], trainer: str | None = None,
               peft: bool | None = None) -> Setup:
    """The user's setup from the files given and the command line's model and loop options (``options``: dimension
    name -> value, said last, so they win)."""
    inputs = classify(paths)
    facts: dict[str, Fact] = {}
    notes: list[str] = []
    hf = inputs.hf_args[1] if inputs.hf_args else None
    ds: tuple[str, dict[str, Any]] | None = inputs.ds_config
    if inputs.accelerate:
        acc_facts, acc_cfg, file = accelerate_facts(inputs.accelerate[1], inputs.accelerate[0])
        facts.update(acc_facts)
        if file and ds is None:
            data = _load(file)
            if not isinstance(data, dict):
                raise DoctorError(f"{file}: expected an object of settings, got {type(data).__name__}")
            ds = (file, data)
        elif ds is None:
            ds = (f"{inputs.accelerate[0]}: deepspeed_config", acc_cfg)
    if ds is None and hf is not None and hf.get("deepspeed"):
        named = hf["deepspeed"]
        if isinstance(named, dict):
            ds = (f"{inputs.hf_args[0] if inputs.hf_args else ''}: deepspeed", named)
        elif isinstance(named, str):
            data = _load(named)
            if not isinstance(data, dict):
                raise DoctorError(f"{named}: expected an object of settings, got {type(data).__name__}")
            ds = (named, data)
    if ds is None:
        raise DoctorError("no DeepSpeed config given: pass its JSON, trainer arguments whose deepspeed names one, or "
                          "an accelerate config with a DeepSpeed plugin")
    got, said = ds_facts(ds[1], ds[0], hf, release)
    config_optimizer = "adam" in got  # the DeepSpeed config's optimizer section: DeepSpeed builds that one
    facts = {**got, **facts}
    notes += said
    if hf is not None and inputs.hf_args:
        got, said = hf_facts(hf, inputs.hf_args[0], trainer or trainer_of(hf), facts["stage"].value)
        if "adam" in facts:  # the DeepSpeed config's optimizer section: DeepSpeed builds that one, not the trainer
            got.pop("adam", None)
        facts.update(got)
        notes += said
    elif trainer in ("hf", "sft", "dpo", "grpo"):
        got, said = hf_facts(None, f"--trainer {trainer}", trainer, facts["stage"].value)
        facts.update(got)
        notes += said
    if "hf_model" in facts:  # a trainer's loop: who builds the optimizer decides its groups and its scheduler
        facts.update(_trainer_optimizer(config_optimizer))
    if peft is not None:
        facts["lora"] = Fact(peft, "--peft")
        if peft:
            facts["frozen_params"] = Fact(True, "--peft lora (the base weights are frozen)")
    for name, value in options.items():
        facts[name] = Fact(value, f"--{name.replace('_', '-')}" if name in _OPTION_NAMES else f"--set {name}")
    # what follows from what was said: checkpointing off means nothing frozen is inside a checkpointed module
    ck = [facts.get(d) for d in ("reentrant_checkpointing", "non_reentrant_checkpointing")]
    if all(f is not None and f.value is False for f in ck) and "frozen_in_checkpointed" not in options:
        facts["frozen_in_checkpointed"] = Fact(False, "no activation checkpointing")
    elif (any(f is not None and f.value is True for f in ck) and facts.get("frozen_params", Fact(None, "")).value
          is True and "frozen_in_checkpointed" not in options):
        facts["frozen_in_checkpointed"] = Fact(True, "frozen parameters (LoRA's base: every layer) and checkpointing")
    groups, lora = facts.get("hf_param_groups"), facts.get("lora")
    if (groups is not None and groups.value is True and lora is not None and lora.value is True
            and "empty_param_group" not in options):
        facts["empty_param_group"] = Fact(True, "HF's no-decay group under LoRA (every trainable parameter an "
                                          "adapter weight)")
    elif (groups is not None and groups.value is True and lora is not None and lora.value is False
            and "empty_param_group" not in options):
        facts["empty_param_group"] = Fact(False, "no LoRA: HF's no-decay group holds the model's norms and biases")
    return Setup(facts, release, tuple(notes))


_OPTION_NAMES = {"world_size", "zero_init", "z3_leaf", "modules_to_save", "shared_param", "several_engines"}

LOOP_DIMENSIONS = tuple(d.name for d in BY_NAME.values() if d.kind is Kind.LOOP)

__all__ = ["LOOP_DIMENSIONS", "TRAINERS", "Inputs", "accelerate_facts", "classify", "ds_facts", "hf_facts",
           "parse_value", "read_setup", "trainer_of"]
