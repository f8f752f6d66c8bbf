"""Where a run's exception was raised, as a finding's key names it, and which check it fails.

`origin_of` is ``ExcType@module.function`` of the innermost frame of DeepSpeed or of zerostate's code that calls
it (the network and its loop, the executor, the tracer), else of the innermost frame: stable across releases (a
DeepSpeed module by its name below ``deepspeed``) and across moves of zerostate's files (its calling modules by
their last name, the network's as ``net``)."""

from __future__ import annotations

from zerostate.findings.record import ExceptionRecord, Frame

_CALLERS = ("zerostate.harness.", "zerostate.tracing.")
"""zerostate's modules that call into DeepSpeed: where an exception left DeepSpeed for them, the origin names
their frame as it names DeepSpeed's."""


def _frame_module(f: Frame) -> str | None:
    """The name the origin gives a frame's module, or None for a frame of any other code."""
    if f.module == "deepspeed" or f.module.startswith("deepspeed."):
        name = f.module.removeprefix("deepspeed").removeprefix(".")
        return ".".join(n for n in (name, "__init__" if f.file.endswith("__init__.py") else "") if n)
    if not f.module and f.package == "deepspeed":  # code no module holds: placed by its path
        return f.file.removesuffix(".py").replace("/", ".")
    if f.module.startswith("zerostate.harness.net."):
        return "net"
    if f.module.startswith(_CALLERS):
        return f.module.rsplit(".", 1)[1]
    return None


def origin_of(raised: ExceptionRecord | None) -> str:
    """``ExcType@module.function`` (see the module docstring); "" for nothing raised or the oracle's own error."""
    if raised is None or raised.in_oracle:
        return ""
    pick = None
    for f in raised.frames:
        module = _frame_module(f)
        if module is not None:
            pick = (module, f.function)
    if pick is None and raised.frames:
        last = raised.frames[-1]
        pick = (last.file.rsplit("/", 1)[-1].removesuffix(".py"), last.function)
    return f"{raised.type}@{pick[0]}.{pick[1]}" if pick else raised.type


def exception_check(raised: ExceptionRecord) -> str:
    """The check an exception fails: ``oracle-error`` (the oracle's own), ``saved-tensor-intact`` (torch's
    ``CheckpointError``), else ``exception``."""
    if raised.in_oracle:
        return "oracle-error"
    return "saved-tensor-intact" if raised.checkpoint_error else "exception"


def error_text(raised: ExceptionRecord) -> str:
    """What a report says was raised: ``"ExcType: message"``, ``"oracle: ..."`` for the oracle's own error."""
    return raised.shown


__all__ = ["error_text", "exception_check", "origin_of"]
