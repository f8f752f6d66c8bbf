"""Where DeepSpeed's JIT-built ops live: one torch extensions folder per DeepSpeed release and torch version.

DeepSpeed builds its C++ ops (``deepspeed_shm_comm`` ...) on first use into torch's extensions folder
(``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/py<ver>_<device>``), keyed by the op's name
alone, so two releases sharing the folder load each other's build (0.19.8 loading 0.19.2's
``deepspeed_shm_comm``: ``module 'deepspeed_shm_comm' has no attribute 'vector_kernel_level'``).
`extensions_dir` gives each DeepSpeed release and torch version a folder of its own (a source checkout one
of its own too: its sources are its own), found without importing either (`locate_deepspeed`), so builds
are never shared.  The explorer's workers, repro scripts and ``zerostate watch``'s job all use it.
Stdlib only: repro scripts embed this module.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import os
import re
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "TORCH_EXTENSIONS_DIR"


@dataclass(frozen=True)
class DeepSpeedLocation:
    """The ``deepspeed`` package a process would import, and what it says it is."""

    package: Path
    """Its ``deepspeed/`` folder."""
    version: str | None
    """Its release (installed metadata, or a checkout's ``version.txt``); None when nothing says."""
    checkout: bool
    """A source tree without installed metadata (a git checkout, an editable install, a patched copy)."""


def cache_root() -> Path:
    """zerostate's cache: ``$ZEROSTATE_CACHE`` or ``~/.cache/zerostate``."""
    return Path(os.environ.get("ZEROSTATE_CACHE") or Path.home() / ".cache" / "zerostate")


def search_path(env: Mapping[str, str]) -> list[str]:
    """Where a Python process started with ``env`` looks for packages: its ``PYTHONPATH`` first, then this
    interpreter's own path (the job runs this Python, or one with the same site-packages)."""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return extra + [p for p in sys.path if p and p not in extra]


def _find(name: str, path: Sequence[str]) -> Path | None:
    spec = importlib.machinery.PathFinder.find_spec(name, list(path))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _installed_version(name: str, package: Path) -> str | None:
    """The version in the metadata installed beside ``package`` (a site-packages or ``--target`` folder)."""
    for dist in importlib.metadata.distributions(name=name, path=[str(package.parent)]):
        return dist.version
    return None


def locate_deepspeed(path: Sequence[str]) -> DeepSpeedLocation | None:
    """The ``deepspeed`` package the first entry of ``path`` holding one provides, without importing it."""
    package = _find("deepspeed", path)
    if package is None:
        return None
    version = _installed_version("deepspeed", package)
    if version is not None:
        return DeepSpeedLocation(package, version, checkout=False)
    try:  # a checkout declares its version at its root (deepspeed/git_version_info.py reads it from the cwd)
        text = (package.parent / "version.txt").read_text().strip()
    except OSError:
        text = ""
    return DeepSpeedLocation(package, text.splitlines()[0].strip() if text else None, checkout=True)


def torch_version(path: Sequence[str]) -> str | None:
    """The version of the ``torch`` package ``path`` provides (``torch/version.py``), without importing it."""
    package = _find("torch", path)
    if package is None:
        return None
    try:
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", (package / "version.py").read_text(), re.M)
    except OSError:
        found = None
    return found.group(1) if found else _installed_version("torch", package)


def with_torch(key: str, torch: str | None) -> str:
    """``key`` (what names the DeepSpeed sources) with the torch and Python versions its ops are built against."""
    return f"{key}-torch-{torch}-py{sys.version_info[0]}{sys.version_info[1]}"


def extensions_key(ds: DeepSpeedLocation | None, torch: str | None) -> str:
    """The folder name: the DeepSpeed release (a checkout's with its path's digest), torch's and Python's."""
    if ds is None:
        return with_torch("deepspeed-none", torch)
    name = f"deepspeed-{ds.version or 'unknown'}"
    if ds.checkout:
        name += "-path-" + hashlib.sha1(str(ds.package.resolve()).encode()).hexdigest()[:12]
    return with_torch(name, torch)


STALE_LOCK_SECONDS = 1800.0
"""A build lock older than this was left by a killed build: a JIT build of one op takes minutes at most."""


def clear_stale_locks(folder: Path, older_than: float = STALE_LOCK_SECONDS, now: float | None = None) -> list[Path]:
    """Remove the build locks a killed build left in ``folder``; the locks removed.

    torch's JIT build creates ``<folder>/<op>/lock`` before it builds and deletes it after
    (``torch.utils.file_baton.FileBaton``); a build killed in between (a timeout, Ctrl-C) leaves it, and every
    later process that needs the op waits on it for ever, with no message.  A lock is a plain file, not a held
    lock, so age is the only sign: one older than ``older_than`` seconds is such a leftover."""
    now = time.time() if now is None else now
    removed = []
    for lock in folder.glob("*/lock"):
        try:
            if now - lock.stat().st_mtime > older_than:
                lock.unlink()
                removed.append(lock)
        except OSError:  # gone meanwhile: its build finished
            continue
    return removed


def extensions_dir(key: str) -> Path:
    """``<cache>/torch_extensions/<key>``, made if missing, without a killed build's lock (`clear_stale_locks`,
    said on stderr)."""
    folder = cache_root() / "torch_extensions" / key
    folder.mkdir(parents=True, exist_ok=True)
    for lock in clear_stale_locks(folder):
        print(f"zerostate: removed {lock}, a JIT build lock left by a killed build (every later build of that op "
              "would have waited on it for ever)", file=sys.stderr)
    return folder


def folder_for(env: Mapping[str, str]) -> Path:
    """The extensions folder of the DeepSpeed and torch a process started with ``env`` would import."""
    path = search_path(env)
    return extensions_dir(extensions_key(locate_deepspeed(path), torch_version(path)))


def keep_apart(env: MutableMapping[str, str]) -> str:
    """Set ``TORCH_EXTENSIONS_DIR`` in ``env`` to `folder_for` it, unless the user set one; the folder used."""
    if not env.get(ENV):
        env[ENV] = str(folder_for(env))
    return env[ENV]


def built_ops(folder: str | os.PathLike[str]) -> dict[str, float]:
    """The ops built in an extensions folder: op name -> the modification time of its library."""
    out: dict[str, float] = {}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return out
    for entry in entries:
        lib = Path(entry.path) / f"{entry.name}.so"
        if entry.is_dir() and lib.exists():
            out[entry.name] = lib.stat().st_mtime
    return out


def new_builds(before: Mapping[str, float], after: Mapping[str, float]) -> list[str]:
    """The ops built between two `built_ops` listings of one folder."""
    return sorted(name for name, mtime in after.items() if before.get(name) != mtime)


__all__ = ["DeepSpeedLocation", "ENV", "STALE_LOCK_SECONDS", "built_ops", "cache_root", "clear_stale_locks",
           "extensions_dir", "extensions_key", "folder_for", "keep_apart", "locate_deepspeed", "new_builds",
           "search_path", "torch_version", "with_torch"]
