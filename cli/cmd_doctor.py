"""``zerostate doctor CONFIG...``: which known DeepSpeed issues a training setup is in the family of, what each does
and what avoids it -- before the job runs.  "May be hit", never "is hit": ``--replay`` runs each issue's nearest repro
on the release, ``zerostate watch`` watches the job itself.

Exit status: 0 no known issue's family, 1 some issue may be hit, 2 bad input."""

from __future__ import annotations

import argparse
import json
from importlib import metadata
from typing import Any

from zerostate.cli.common import EXIT_FINDINGS, EXIT_OK, CliError, positive_int
from zerostate.doctor.diagnose import Diagnosis, Entry, diagnose
from zerostate.doctor.dimensions import BY_NAME, DIMENSIONS, Value
from zerostate.doctor.read_inputs import TRAINERS, parse_value, read_setup
from zerostate.doctor.render import as_json, text
from zerostate.doctor.setup import DoctorError
from zerostate.known.issues import KNOWN_ISSUES
from zerostate.model.eras import UnknownRelease, parse_release

OLDEST = min(k.releases[0] for k in KNOWN_ISSUES)
"""The oldest release the known-issue table was established on."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="which known DeepSpeed issues your setup may be hit by, before it runs",
                       description="Read a DeepSpeed config (JSON), trainer arguments (the JSON of "
                                   "TrainingArguments.to_dict(), TRL's configs included) and/or an accelerate config "
                                   "(YAML); say which known issues of the release the setup is in the family of, what "
                                   "each does and what avoids it.")
    p.add_argument("configs", nargs="*", metavar="CONFIG", help="ds_config.json, args.json, accelerate.yaml")
    p.add_argument("--deepspeed", metavar="VERSION", help="the release to judge (default: the installed one)")
    p.add_argument("--trainer", choices=TRAINERS, default=None,
                   help="the training loop: HF Trainer, TRL's SFT/DPO/GRPO, or your own (default: read from the "
                        "arguments file; custom without one)")
    p.add_argument("--peft", choices=("lora", "none"), help="the model is wrapped by PEFT LoRA (its base frozen)")
    p.add_argument("--checkpointing", choices=("none", "reentrant", "non-reentrant"),
                   help="activation checkpointing as it runs (overrides the arguments' use_reentrant)")
    p.add_argument("--modules-to-save", action="store_true", help="PEFT modules_to_save is set")
    p.add_argument("--z3-leaf-modules", action="store_true", help="the model has ZeRO-3 leaf modules")
    p.add_argument("--tied-weights", action="store_true", help="a parameter is used by two modules (tied embeddings)")
    p.add_argument("--zero-init", action="store_true", help="the model is built inside deepspeed.zero.Init")
    p.add_argument("--world-size", type=positive_int, metavar="N", help="ranks the job runs on")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="say any setup dimension (--dimensions lists them), e.g. --set retain_graph=false")
    p.add_argument("--dimensions", action="store_true", help="list the setup dimensions and exit")
    p.add_argument("--replay", action="store_true",
                   help="run each issue's nearest repro on the release, each in a fresh worker, and say whether it "
                        "showed the issue")
    p.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    p.set_defaults(run=run)


def release_of(args: argparse.Namespace) -> str:
    version = args.deepspeed
    if not version:
        try:
            version = metadata.version("deepspeed")
        except metadata.PackageNotFoundError:
            raise CliError("no DeepSpeed is installed here: name the release with --deepspeed VERSION") from None
    try:
        v = parse_release(version)
    except UnknownRelease:
        raise CliError(f"--deepspeed {version!r}: not a DeepSpeed release number (expected e.g. 0.19.2)") from None
    if v < OLDEST:
        raise CliError(f"DeepSpeed {version}: the known-issue table starts at {'.'.join(map(str, OLDEST))} (older "
                       "releases were never judged; the doctor cannot say anything of them)")
    return version


def options_of(args: argparse.Namespace) -> tuple[dict[str, Value], bool | None]:
    """The model and loop facts said on the command line; PEFT's answer apart (it says two facts)."""
    out: dict[str, Value] = {}
    if args.checkpointing:
        out["reentrant_checkpointing"] = args.checkpointing == "reentrant"
        out["non_reentrant_checkpointing"] = args.checkpointing == "non-reentrant"
    for flag, name in ((args.modules_to_save, "modules_to_save"), (args.z3_leaf_modules, "z3_leaf"),
                       (args.tied_weights, "shared_param"), (args.zero_init, "zero_init")):
        if flag:
            out[name] = True
    if args.world_size:
        out["world_size"] = args.world_size
    for item in args.set:
        name, eq, value = item.partition("=")
        if not eq:
            raise CliError(f"--set {item}: expected NAME=VALUE")
        out[name.strip()] = parse_value(name.strip(), value.strip())
    return out, (None if args.peft is None else args.peft == "lora")


def replay(d: Diagnosis, entries: tuple[Entry, ...]) -> dict[str, str]:
    """Each entry's nearest repro on the release, in a fresh worker: whether a finding its own evidence labels as
    that issue showed."""
    from zerostate.cli import targets_api as api
    from zerostate.known.labels import issues_of

    out = {}
    for e in entries:
        ns = argparse.Namespace(target="deepspeed", design=None, deepspeed=d.release, deepspeed_path=None,
                                world_size=1)
        target = api.target(ns)
        try:
            found = api.findings(api.run_scenario(target, e.match.repro))
        finally:
            api.close(target)
        ids = {k.id for f in found for k in issues_of(f)}
        if e.issue.id in ids:
            out[e.issue.id] = f"reproduced on DeepSpeed {d.release} ({e.match.which})"
        elif found:
            out[e.issue.id] = (f"not reproduced on DeepSpeed {d.release} ({e.match.which}); other findings: " +
                               ", ".join(f.key for f in found))
        else:
            out[e.issue.id] = f"not reproduced on DeepSpeed {d.release} ({e.match.which}): every check held"
    return out


def run(args: argparse.Namespace) -> int:
    if args.dimensions:
        for dim in DIMENSIONS:
            print(f"{dim.name:28} {dim.kind.value:6} {dim.phrase.replace('{v}', 'N')}")
        return EXIT_OK
    if not args.configs:
        raise CliError("doctor needs a DeepSpeed config, trainer arguments or an accelerate config (CONFIG...)")
    release = release_of(args)
    try:
        options, peft = options_of(args)
        setup = read_setup(args.configs, release, options, trainer=args.trainer, peft=peft)
    except DoctorError as exc:
        raise CliError(str(exc)) from None
    d = diagnose(setup, release)
    replays = replay(d, d.entries) if args.replay and d.entries else None
    if args.json:
        print(json.dumps(as_json(d, replays), indent=2))
    else:
        print(text(d, replays))
    return EXIT_FINDINGS if d.entries else EXIT_OK


__all__ = ["BY_NAME", "add_parser", "run"]
