"""The one place the CLI meets the targets package (targets/base.py, targets/explorer.py).

Everything the CLI needs of a target or a finding goes through here, so a
change of the targets API is one edit, and a missing piece is a clear error.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from zerostate.model.events import Event
from zerostate.model.scenario import Scenario

from .common import CliError, need


def target(args: Any) -> Any:
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
            from .releases import check_requested
            check_requested(args.deepspeed)
        kw.update(deepspeed=args.deepspeed, deepspeed_path=args.deepspeed_path,
                  world_size=getattr(args, "world_size", 1))
    base = need("zerostate.targets.base", f"--target {args.target}")
    if args.target == "deepspeed":
        from .progress import note
        what = (f"DeepSpeed {args.deepspeed}" if args.deepspeed else
                f"DeepSpeed from {args.deepspeed_path}" if args.deepspeed_path else "the installed DeepSpeed")
        note(f"starting {what} on CPU or GPU (a release's first use installs it and builds its comm op: "
             "a few minutes)")
    try:
        return base.get_target(args.target, **{k: v for k, v in kw.items() if v is not None})
    except CliError:
        raise
    except (KeyError, ValueError, ImportError, RuntimeError, OSError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
        raise CliError(lines[0] if lines else type(exc).__name__) from None


def close(t: Any) -> None:
    closer = getattr(t, "close", None)
    if closer:
        closer()


def describe_target(t: Any) -> dict[str, Any]:
    return {"target": getattr(t, "name", type(t).__name__),
            "deepspeed": getattr(t, "version", None) or getattr(t, "deepspeed_version", None),
            "design": getattr(t, "design_name", None) or getattr(getattr(t, "design", None), "name", None)}


def explore(t: Any, examples: int, seed: int | None, on_finding: Callable[[Any], None],
            on_progress: Callable[..., None], **options: Any) -> Any:
    """``options``: the explorer's other keywords (``on_restart``, ``confirm``)."""
    mod = need("zerostate.targets.explorer", "zerostate explore")
    return mod.explore(t, examples=examples, seed=seed, on_finding=on_finding, on_progress=on_progress, **options)


def run_scenario(t: Any, scenario: Scenario) -> Any:
    """One scenario on one target: an outcome with ``ok`` / ``check`` / ``error``."""
    return t.run(scenario)


# ------------------------------------------------------------------ findings
def f_check(f: Any) -> str:
    return str(_get(f, "check", "spec", default="?"))


def f_error(f: Any) -> str:
    return str(_get(f, "error", "message", default=""))


def f_scenario(f: Any) -> Scenario:
    sc = _get(f, "scenario")
    return sc if isinstance(sc, Scenario) else Scenario.from_dict(sc)


def f_events(f: Any) -> list[Event] | None:
    ev = _get(f, "events")
    if ev is None:
        trace = _get(f, "trace")
        ev = getattr(trace, "events", trace)
    if ev is None:
        return None
    return [e if isinstance(e, Event) else Event.from_dict(e) for e in ev]


def f_violation(f: Any) -> int | None:
    v = _get(f, "index", "event_index", "violation_index")
    return v if isinstance(v, int) else None


def findings(o: Any) -> list[Any]:
    """An outcome's findings; a run that raised with no finding becomes an ``exception`` finding."""
    found = list(_get(o, "findings", default=[]) or [])
    error = _get(o, "error")
    if not found and error:
        found.append({"check": "exception", "error": str(error), "scenario": _get(o, "scenario"),
                      "events": _get(o, "trace")})
    return found


def outcome(o: Any) -> tuple[bool, str | None, str]:
    """``(passed, failing check or None, reason)`` of one run's outcome."""
    bad = _get(o, "findings", "violations", default=None) or []
    first = bad[0] if bad else None
    check = _get(o, "check") or (f_check(first) if first is not None else None)
    error = _get(o, "error", "message") or (f_error(first) if first is not None else "")
    ok = _get(o, "ok", "passed")
    passed = bool(ok) if ok is not None else not (bad or check or error)
    return passed, (None if passed else check), str(error or "")


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = obj.get(n) if isinstance(obj, dict) else getattr(obj, n, None)
        if v is not None:
            return v
    return default


__all__ = ["close", "describe_target", "explore", "f_check", "f_error", "f_events", "f_scenario", "f_violation", "findings",
           "outcome", "run_scenario", "target"]
