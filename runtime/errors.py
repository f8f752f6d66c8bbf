"""The errors `install` and `patch_deepspeed` raise: each means nothing was changed."""

from __future__ import annotations


class ZerostateInstallError(RuntimeError):
    """install() refused; nothing was changed."""


class UnsupportedDeepSpeedError(ZerostateInstallError):
    """The DeepSpeed release is outside `COMPAT`."""


class UnsupportedEngineError(ZerostateInstallError):
    """The engine is one the zerostate design does not cover (see `engine_support`)."""


__all__ = ["UnsupportedDeepSpeedError", "UnsupportedEngineError", "ZerostateInstallError"]
