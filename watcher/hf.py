"""`WatchCallback`: an HF ``TrainerCallback`` that watches the engine ``Trainer`` builds (`watch.patch_initialize`).

Its own module so that ``zerostate watch``'s ``sitecustomize`` never imports transformers."""

from __future__ import annotations

import sys
from typing import Any

from zerostate.watcher.observed import NO_ENGINE

from zerostate.watcher.watch import WatchHandle, patch_initialize


def _callback_base() -> type:
    try:
        from transformers import TrainerCallback
        return TrainerCallback
    except ImportError:  # transformers not installed: a plain base with the same hook names
        return object


class WatchCallback(_callback_base()):  # type: ignore[misc]
    """``Trainer(..., callbacks=[WatchCallback()])``: watches the engine the Trainer builds.

    Create it before ``trainer.train()`` (the engine is built there).  ``handles``: the watched engines;
    ``violations``: all of theirs.  At the end of training the handles are closed (open obligations
    judged) and, with ``out``, written."""

    def __init__(self, out: str | None = None, stop_on_violation: bool = False, runtime: bool = False) -> None:
        self.handles: list[WatchHandle] = []
        patch_initialize(out=out, stop_on_violation=stop_on_violation, runtime=runtime, on_handle=self.handles.append)

    @property
    def violations(self) -> list[dict[str, Any]]:
        return [v for h in self.handles for v in h.violations]

    def summary(self) -> str:
        """"N violations in M backwards, K steps", or, when the Trainer built no DeepSpeed engine, says so."""
        if not self.handles:
            return f"{NO_ENGINE}: the Trainer built no DeepSpeed engine (no deepspeed config in its arguments?)"
        n = len(self.violations)
        return (f"{n} violation{'s' if n != 1 else ''} in {sum(h.backwards for h in self.handles)} backwards, "
                f"{sum(h.steps for h in self.handles)} steps")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        for h in self.handles:
            h.close()
        if not self.handles:  # never a silent clean
            print(f"zerostate WatchCallback: {self.summary()}", file=sys.stderr)
        return control


__all__ = ["WatchCallback"]
