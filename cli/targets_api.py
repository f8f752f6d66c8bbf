"""The one place the CLI meets the targets package and the explorer (targets/interface.py, explorer/exploration.py).

The CLI builds, describes, runs and closes targets through here (options checked, errors as `CliError`),
and reads the one typed shape the targets produce -- `Finding` and `Outcome` (targets/interface.py) -- by
their fields, with no fallbacks.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from zerostate.model.scenario import Scenario
from zerostate.targets.interface import Outcome, Startup, Target, TargetError, get_target
from zerostate.findings.finding import Finding

if TYPE_CHECKING:
    from zerostate.explorer.exploration import Exploration

from zerostate.cli.common import CliError, need


def target(args: Any) -> Target:
    """The target named by ``--target`` / ``--design`` / ``--deepspeed`` / ``--deepspeed-path``."""
    kw: dict[str, Any] = {"design": getattr(args, "design", None)}
    if args.target == "model":
        if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_path", None):
            raise CliError("--deepspeed and --deepspeed-path select a DeepSpeed release; "
                           "they do not apply to --target model")
        kw["design"] = args.design or "zerostate"
    else:
        if args.deepspeed and args.deepspeed_path:
            raise CliError("give --deepspeed VERSION or --deepspeed-path DIR, not both")
        if args.deepspeed_path and not os.path.isdir(args.deepspeed_path):
            raise CliError(f"--deepspeed-path {args.deepspeed_path}: no such directory "
                           f"(expected a DeepSpeed checkout, the folder holding deepspeed/)")
        if args.deepspeed and getattr(args, "check_release", True):
            from zerostate.cli.releases import check_requested
            check_requested(args.deepspeed)
        kw.update(deepspeed=args.deepspeed, deepspeed_path=args.deepspeed_path,
                  world_size=getattr(args, "world_size", 1))
    if args.target == "deepspeed":
        from zerostate.cli.progress import note
        what = (f"DeepSpeed {args.deepspeed}" if args.deepspeed else
                f"DeepSpeed from {args.deepspeed_path}" if args.deepspeed_path else "the installed DeepSpeed")
        note(f"starting {what} on CPU or GPU (a release's first use installs it and builds its comm op: "
             "a few minutes)")
    try:
        return get_target(args.target, **{k: v for k, v in kw.items() if v is not None})
    except CliError:
        raise
    except (KeyError, ValueError, ImportError, RuntimeError, OSError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
        raise CliError(lines[0] if lines else type(exc).__name__) from None


def close(t: Target) -> None:
    t.close()


def startup(t: Target) -> list[Startup]:
    """What starting the target's workers cost, per world size (seconds; the DeepSpeed ops JIT-built then: a
    first build is start-up, not exploring); [] for a target without workers."""
    return t.startup()


def describe_target(t: Target) -> dict[str, Any]:
    """What a report says of the target: its kind, the DeepSpeed release (None for the model), the design."""
    return {"target": t.name, "deepspeed": t.version, "design": t.design.name}


def exploration(t: Target, examples: int, seed: int | None, **options: Any) -> Exploration:
    """An exploration of ``t`` to iterate (`Exploration.events`); ``options``: its other keywords (``jobs``,
    ``spawn``, ``first``, ``confirm``)."""
    mod = need("zerostate.explorer.exploration", "zerostate explore")
    exp: Exploration = mod.Exploration(t, examples=examples, seed=seed, **options)
    return exp


def run_scenario(t: Target, scenario: Scenario) -> Outcome:
    """One scenario on one target; the target failing (its worker cannot start) is a `CliError`."""
    try:
        return t.run(scenario)
    except TargetError as exc:
        raise target_failed(exc) from None


def target_failed(exc: Exception, runs: int | None = None) -> CliError:
    """The one line saying the target broke while running (a rank pool that cannot start, a worker that
    cannot restart): its first line, and how far the run got."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    what = lines[0] if lines else type(exc).__name__
    if isinstance(exc, CliError):
        return exc
    after = f" after {runs} distinct run(s)" if runs else ""
    return CliError(f"the target failed{after}: {what}")


# ------------------------------------------------------------------ findings
def findings(o: Outcome) -> list[Finding]:
    """An outcome's findings; a run that raised with no finding becomes an ``exception`` finding."""
    found = list(o.findings)
    if not found and o.error:
        found.append(Finding("exception", str(o.error), o.scenario, list(o.trace)))
    return found


def outcome(o: Outcome) -> tuple[bool, str | None, str]:
    """``(passed, failing check or None, reason)`` of one run's outcome."""
    first = o.findings[0] if o.findings else None
    error = o.error or (first.error if first is not None else "")
    passed = first is None and not error
    return passed, (None if passed else first.check if first is not None else None), str(error or "")


__all__ = ["close", "describe_target", "exploration", "findings", "outcome", "run_scenario", "startup", "target",
           "target_failed"]
