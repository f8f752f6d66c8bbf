"""The standalone repro script written beside a finding (``repro_<n>.py``), from the deepspeed target's generator
(`zerostate.harness.repro`, which builds its text)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zerostate.model.scenario import Scenario
from zerostate.findings.finding import Finding


def repro_for(scenario: Scenario | None, check: str, error: str, finding: Any = None) -> Callable[[int], str]:
    """``n -> text of repro_<n>.py`` for a finding (or for a bare scenario, check and message)."""
    if finding is None:
        finding = Finding(check=check, error=error, scenario=scenario)

    def script(n: int) -> str:
        from zerostate.harness import repro as generator  # imports torch: only when a script is written
        text: str = generator.repro_script(finding, n)
        return text
    return script


__all__ = ["repro_for"]
