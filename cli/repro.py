"""The standalone repro script of a finding, from the deepspeed target's generator."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from zerostate.model.scenario import Scenario


def repro_for(scenario: Scenario, check: str, error: str, finding: Any = None) -> Callable[[int], str] | None:
    """``n -> text of repro_<n>.py``, or None when the generator is not installed."""
    try:
        gen = importlib.import_module("zerostate.targets.deepspeed.repro")
    except ImportError:
        return None
    if finding is None:
        finding = _finding(scenario, check, error)
    return lambda n: gen.repro_script(finding, n)


def _finding(scenario: Scenario, check: str, error: str) -> Any:
    base = importlib.import_module("zerostate.targets.base")
    return base.Finding(check=check, error=error, scenario=scenario)


__all__ = ["repro_for"]
