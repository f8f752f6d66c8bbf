"""One way to patch a live object and take the patch back exactly.

zerostate patches *instances* of a running DeepSpeed engine (its optimizer, its coordinator, its
hook-state manager, the ``count_used_parameters_in_backward`` binding of a module), entries of its
hook dictionaries, and ``deepspeed.initialize``, never DeepSpeed's classes or files.  A `Patcher`
records every change in order and `undo` takes them back, last change first:

* `set` / `wrap` -- an attribute.  Whether the object had its own value (an instance attribute) or
  inherited one (a class method) is recorded: an own value is put back, an inherited one is deleted
  again so the class's attribute shows through;
* `set_item` -- an entry of a dictionary (a gradient hook under its handle's key, in its place in the
  dictionary's order): the original value is put back under the same key, or the key removed when
  there was none;
* `on_undo` -- anything else that has its own exact inverse (a hook handle's ``remove``, a state
  hand-back), run at its place in the order.

``guard=True`` (`set`, `set_item`): at undo, put the original back only while the value is still the
one this patcher set; a value someone replaced since is theirs and is left alone.

Used by the runtime (`install`, `initialize_patch`, the release policy) and by the deepspeed target's
tracer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


class Patcher:
    """Patches with a record and exact, idempotent undo."""

    def __init__(self) -> None:
        self._record: list[Callable[[], None]] = []

    def set(self, obj: Any, name: str, value: Any, guard: bool = False) -> None:
        """``setattr(obj, name, value)``, remembering what was there."""
        own = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)

        def restore() -> None:
            if guard and getattr(obj, name, _MISSING) is not value:
                return
            if own is _MISSING:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, own)
        self._record.append(restore)
        setattr(obj, name, value)

    def wrap(self, obj: Any, name: str, make: Callable[[Any], Any], guard: bool = False) -> Any:
        """Replace ``obj.name`` by ``make(original)``; return the original (None, and nothing patched,
        when ``obj`` is None or has no such attribute).  ``guard``: as `set`'s."""
        if obj is None or not hasattr(obj, name):
            return None
        original = getattr(obj, name)
        self.set(obj, name, make(original), guard=guard)
        return original

    def set_item(self, mapping: Any, key: Any, value: Any, guard: bool = False) -> None:
        """``mapping[key] = value``, remembering what was there (an existing key keeps its place in the
        order; so does the original when it is put back)."""
        old = mapping.get(key, _MISSING)

        def restore() -> None:
            if guard and mapping.get(key, _MISSING) is not value:
                return
            if old is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old
        self._record.append(restore)
        mapping[key] = value

    def on_undo(self, inverse: Callable[[], None]) -> None:
        """Record a change made elsewhere by its exact inverse, called at its place in the undo order."""
        self._record.append(inverse)

    def undo(self) -> None:
        """Take back every change, last first; a second call does nothing.  Every inverse runs even when
        one raises (the first error is raised at the end)."""
        error: BaseException | None = None
        while self._record:
            inverse = self._record.pop()
            try:
                inverse()
            except BaseException as exc:  # noqa: BLE001 - finish the undo, then report
                error = error or exc
        if error is not None:
            raise error

    def __len__(self) -> int:
        return len(self._record)

    def __bool__(self) -> bool:
        return bool(self._record)


__all__ = ["Patcher"]
