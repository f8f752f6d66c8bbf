"""One way to patch a live object and take the patch back exactly.

zerostate patches *instances* of a running DeepSpeed engine (its optimizer, its coordinator, its
hook-state manager, the ``count_used_parameters_in_backward`` binding of a module), never
DeepSpeed's classes or files.  A `Patcher` records, for every attribute it sets, whether the object
had its own value (an instance attribute) or inherited one (a class method), and `undo` restores
exactly that, last patch first: an own value is put back, an inherited one is deleted again so the
class's attribute shows through.  Used by the runtime (`install`, the release policy) and by the
deepspeed target's tracer.
"""

from __future__ import annotations

from typing import Any, Callable

_MISSING = object()


class Patcher:
    """Instance-attribute patches with a record and exact, idempotent undo."""

    def __init__(self) -> None:
        self._record: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, remembering what was there."""
        own = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)
        self._record.append((obj, name, own))
        setattr(obj, name, value)

    def wrap(self, obj: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """Replace ``obj.name`` by ``make(original)``; return the original (None, and nothing patched,
        when ``obj`` is None or has no such attribute)."""
        if obj is None or not hasattr(obj, name):
            return None
        original = getattr(obj, name)
        self.set(obj, name, make(original))
        return original

    def undo(self) -> None:
        """Restore every patched attribute, last patch first; a second call does nothing."""
        while self._record:
            obj, name, own = self._record.pop()
            if own is _MISSING:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, own)

    def __len__(self) -> int:
        return len(self._record)

    def __bool__(self) -> bool:
        return bool(self._record)


__all__ = ["Patcher"]
