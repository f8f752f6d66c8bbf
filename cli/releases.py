"""DeepSpeed releases on the package index, for ``bisect`` and for naming an unknown release."""

from __future__ import annotations

import re
import subprocess
import sys

from packaging.version import InvalidVersion, Version

from zerostate.cli.common import CliError


def available_releases() -> list[str]:
    """Every final DeepSpeed release on the index, oldest first (asks pip)."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "deepspeed"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CliError(f"cannot list DeepSpeed releases from the package index: {exc}") from None
    m = re.search(r"Available versions:\s*(.+)", out.stdout)
    if not m:
        raise CliError("cannot list DeepSpeed releases from the package index "
                       f"(pip index versions deepspeed said: {(out.stderr or out.stdout).strip()[-200:]})")
    versions = [v.strip() for v in m.group(1).split(",") if v.strip()]
    return sorted((v for v in versions if not Version(v).is_prerelease), key=Version)


def parse(version: str, option: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion:
        raise CliError(f"{option} {version!r}: not a DeepSpeed release number (expected e.g. 0.18.4)") from None


def check_release(version: str, option: str, releases: list[str]) -> None:
    """``version`` must be a release on the index; the error names the nearest ones."""
    parse(version, option)
    if version not in releases:
        near = sorted(releases, key=lambda r: abs(_num(Version(r)) - _num(Version(version))))[:3]
        raise CliError(f"{option} {version}: unknown DeepSpeed release; expected a release on the package "
                       f"index (nearest: {', '.join(sorted(near, key=Version))}; "
                       f"{releases[0]} to {releases[-1]} exist)")


def check_requested(version: str) -> None:
    """``--deepspeed VERSION``: a release already cached is fine; otherwise it must be on the index."""
    parse(version, "--deepspeed")
    from zerostate.harness import envs
    if (envs.release_dir(version) / "installed").exists():
        return
    check_release(version, "--deepspeed", available_releases())


def release_range(lo: str, hi: str, releases: list[str]) -> list[str]:
    """Releases from ``lo`` to ``hi`` inclusive; both must be releases on the index."""
    for v, opt in ((lo, "--from"), (hi, "--to")):
        check_release(v, opt, releases)
    a, b = Version(lo), Version(hi)
    if a >= b:
        raise CliError(f"--from {lo} --to {hi}: --from must be an older release than --to")
    return [r for r in releases if a <= Version(r) <= b]


def _num(v: Version) -> float:
    major, minor, micro = (list(v.release) + [0, 0, 0])[:3]
    return major * 1e6 + minor * 1e3 + micro


__all__ = ["available_releases", "check_release", "check_requested", "parse", "release_range"]
