"""Where each DeepSpeed release lives: a cached ``pip install --no-deps --target`` directory per release.

``ensure_release("0.18.4")`` installs ``deepspeed==0.18.4`` (no dependencies: it runs over the
project environment's torch and DeepSpeed's small pure-Python deps, identical for every supported
release) into ``<cache>/deepspeed/0.18.4/site`` on first use and returns that directory; later
calls return at once.  The cache is ``$ZEROSTATE_CACHE`` or ``~/.cache/zerostate``.  Each release
(and each local checkout) builds its JIT ops into a ``TORCH_EXTENSIONS_DIR`` of its own and of the
torch version (`zerostate.jit_ops`): releases never load each other's ops.  A file lock makes
concurrent first uses safe.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import zerostate.jit_ops as jit_ops
from zerostate.tracing import compat


class InstallError(RuntimeError):
    """pip could not install the requested release."""


RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
"""torch.distributed's rendezvous variables.  A worker never inherits them: set in the parent (zerostate run
inside a launched job, or after DeepSpeed ran in this process) they name a port that process group still
listens on, and the worker's own init fails with EADDRINUSE.  A world-size-1 worker picks a free port; a rank
pool sets its own."""


def without_rendezvous(env: dict[str, str]) -> dict[str, str]:
    """``env`` without `RENDEZVOUS`'s variables."""
    return {k: v for k, v in env.items() if k not in RENDEZVOUS}


def cache_root() -> Path:
    return jit_ops.cache_root()


def release_dir(version: str) -> Path:
    return cache_root() / "deepspeed" / version


def extensions_dir_for(key: str) -> Path:
    """The extensions folder of the DeepSpeed sources ``key`` names (``deepspeed-<release>``) built against this
    interpreter's torch: the folder `jit_ops.folder_for` gives a process that imports that release."""
    return jit_ops.extensions_dir(jit_ops.with_torch(key, jit_ops.torch_version(sys.path)))


def path_key(path: str) -> str:
    real = os.path.realpath(path)
    return "path-" + hashlib.sha1(real.encode()).hexdigest()[:12]


def ensure_release(version: str, python: str | None = None) -> Path:
    """The ``site`` directory holding ``deepspeed==version``; installed on first use."""
    compat.check_version(version)
    root = release_dir(version)
    site = root / "site"
    marker = root / "installed"
    if marker.exists() and (site / "deepspeed" / "__init__.py").exists():
        return site
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and (site / "deepspeed" / "__init__.py").exists():
            return site
        tmp = Path(tempfile.mkdtemp(prefix="site-", dir=root))
        base = [python or sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                "--no-deps", "--target", str(tmp), f"deepspeed=={version}"]
        env = dict(os.environ, DS_BUILD_OPS="0", PIP_NO_INPUT="1")
        errors = []
        for extra in ([], ["--no-build-isolation"]):
            proc = subprocess.run(base + extra, capture_output=True, text=True, env=env)
            if proc.returncode == 0 and (tmp / "deepspeed" / "__init__.py").exists():
                break
            errors.append((proc.stderr or proc.stdout).strip()[-1500:])
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            raise InstallError(f"cannot install deepspeed=={version} into {site}: "
                               f"pip failed:\n{errors[-1] if errors else '(no output)'}")
        if site.exists():
            shutil.rmtree(site)
        tmp.rename(site)
        marker.write_text(version + "\n")
    return site


def checkout_version(path: str) -> str | None:
    """The version a DeepSpeed *checkout* (not pip-installed) declares in its top-level ``version.txt``.

    A plain git checkout has no ``deepspeed/git_version_info_installed.py`` (setup.py writes it), so
    ``deepspeed/git_version_info.py`` opens the *relative* path ``version.txt`` and reports "0.0.0" unless
    the process's working directory holds it.  The worker of a ``--deepspeed-path`` target therefore runs
    in the checkout's root (`worker_cwd`), and this is the version expected of it.  None when the
    checkout has no readable ``version.txt`` (an installed tree reports its own version)."""
    f = Path(path).expanduser().resolve() / "version.txt"
    try:
        text = f.read_text().strip()
    except OSError:
        return None
    return text.splitlines()[0].strip() if text else None


def worker_cwd(path: str | None) -> Path:
    """Where a worker runs: a checkout's root when it holds ``version.txt`` (see `checkout_version`),
    otherwise the cache root."""
    if path and checkout_version(path):
        return Path(path).expanduser().resolve()
    return cache_root()
