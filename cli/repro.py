"""The standalone repro script of a finding, from the deepspeed target's generator."""

from __future__ import annotations

from typing import Any, Callable

from zerostate.model.scenario import Scenario
from zerostate.targets.base import Finding
from zerostate.targets.deepspeed import repro as generator


def repro_for(scenario: Scenario, check: str, error: str, finding: Any = None) -> Callable[[int], str]:
    """``n -> text of repro_<n>.py`` for a finding (or for a bare scenario, check and message)."""
    if finding is None:
        finding = Finding(check=check, error=error, scenario=scenario)
    return lambda n: generator.repro_script(finding, n)


__all__ = ["repro_for"]
