"""The forced draws of a setup pair, kept on disk: drawn once per code, read by every later exploration.

`pairs.draws` is a function of (pair, seed) and of the code that draws -- the strategies, the model's scenario
types, Hypothesis --, and a completion asks for up to every setup pair's `pairs.DRAWS` scenarios: about a minute
and a half of Hypothesis on 2 cores, the same in every exploration of the same code.  This keeps each pair's draws
in ``<cache>/draws/<code>/<pair and seed>.json``, where ``<code>`` is a digest of every source file of
``zerostate.explorer`` and ``zerostate.model`` and of the Hypothesis and Python versions: an edit of any of them
draws again.  A file that does not read back whole is drawn again and written over.  ``ZEROSTATE_DRAW_CACHE=0``
turns it off (every pair drawn again).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path

from zerostate.model.scenario import Scenario

ENV = "ZEROSTATE_DRAW_CACHE"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of what the draws depend on: the sources of ``zerostate.explorer`` and ``zerostate.model``, and
    the Hypothesis and Python versions."""
    import hypothesis

    import zerostate.explorer
    import zerostate.model
    h = hashlib.sha256(f"{hypothesis.__version__} {sys.version_info[:2]}".encode())
    for pkg in (zerostate.explorer, zerostate.model):
        for folder in pkg.__path__:
            for src in sorted(Path(folder).rglob("*.py")):
                h.update(str(src.relative_to(folder)).encode())
                h.update(src.read_bytes())
    return h.hexdigest()[:16]


def path_for(pair: tuple[int, ...], seed: int, draws: int) -> Path:
    # zerostate's cache folder (``$ZEROSTATE_CACHE`` or ``~/.cache/zerostate``), as `jit_ops.cache_root` says it:
    # the explorer imports nothing of the harness's layer
    cache_root = Path(os.environ.get("ZEROSTATE_CACHE") or Path.home() / ".cache" / "zerostate")
    name = hashlib.sha256(repr((tuple(pair), seed, draws)).encode()).hexdigest()[:24]
    return cache_root / "draws" / code_digest() / f"{name}.json"


def load(pair: tuple[int, ...], seed: int, draws: int) -> tuple[Scenario, ...] | None:
    """The kept draws of ``pair``; None when none are kept (or the file does not read back whole)."""
    if not enabled():
        return None
    try:
        data = json.loads(path_for(pair, seed, draws).read_text())
        if data["pair"] != list(pair) or data["seed"] != seed or len(data["scenarios"]) > draws:
            return None
        return tuple(Scenario.from_dict(d) for d in data["scenarios"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(pair: tuple[int, ...], seed: int, draws: int, scenarios: tuple[Scenario, ...]) -> None:
    """Keep ``scenarios`` for ``pair`` (written whole or not at all; a failure to write is no error: the next
    exploration draws again)."""
    if not enabled():
        return
    path = path_for(pair, seed, draws)
    data = {"pair": list(pair), "seed": seed, "scenarios": [sc.to_dict() for sc in scenarios]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass


__all__ = ["ENV", "code_digest", "enabled", "load", "path_for", "store"]
