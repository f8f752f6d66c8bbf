"""Which failures are zerostate's own, not DeepSpeed's: `harness_error`, the one place that says so.

A harness error is a project bug -- the PyTorch oracle raised (``oracle-error``), the executor failed
(``internal``), zerostate's own code raised (its tracer, its executor: not the network and loop DeepSpeed runs),
or the scenario could not be built before any DeepSpeed code ran.  Frames are zerostate's by the module their
code was imported as, never by the folder that holds it (`harness.observe.frames_of`).  Reports count and list
these apart from the findings about DeepSpeed ("harness errors: N"); no known issue explains one; a CI test fails
on any in the derandomized exploration.
"""

from __future__ import annotations

from zerostate.findings.finding import Finding

_TRAINING_CODE = "zerostate.harness.net."
"""The network, its loop and the engine's wrapper: code DeepSpeed runs (its hooks around the network's forward,
its engine under the loop), so what raises there is what DeepSpeed did, unless no DeepSpeed code ran at all."""

_OWN_CHECKS = {"oracle-error": "the PyTorch oracle raised", "internal": "zerostate's executor failed"}


def harness_error(f: Finding) -> str | None:
    """Why ``f`` is a failure of zerostate itself (a sentence), or None when it is a finding about DeepSpeed."""
    if f.check in _OWN_CHECKS:
        return _OWN_CHECKS[f.check]
    r = f.evidence.raised
    if f.check != "exception" or r is None or not r.frames:
        return None
    last = r.frames[-1]
    if last.package == "zerostate" and not last.module.startswith(_TRAINING_CODE):
        return f"zerostate's own code raised ({last.file}, {last.function})"
    if not r.deepspeed_frames and not f.trace:
        return "the scenario could not be built: it raised before any DeepSpeed code ran"
    return None


def split(findings: list[Finding]) -> tuple[list[Finding], list[Finding]]:
    """(findings about DeepSpeed, harness errors)."""
    about: list[Finding] = []
    own: list[Finding] = []
    for f in findings:
        (own if harness_error(f) else about).append(f)
    return about, own


__all__ = ["harness_error", "split"]
