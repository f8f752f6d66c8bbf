"""JSON values as the report files hold them: what a report model serialises to, and the parts a model keeps
as they came (a scenario's dict, a record another package made, a summary a command builds).

``Json`` is read-only (`Mapping`, `Sequence`) so that a `dict` or `list` of narrower values is one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

Json: TypeAlias = bool | int | float | str | Sequence["Json"] | Mapping[str, "Json"] | None
JsonObject: TypeAlias = Mapping[str, Json]


def as_object(value: Json) -> JsonObject:
    """``value`` as a JSON object, or an empty one where it is something else (a field a reader lacks)."""
    return value if isinstance(value, Mapping) else {}


def as_list(value: Json) -> Sequence[Json]:
    """``value`` as a JSON array, or an empty one where it is something else (a string is not an array)."""
    return value if isinstance(value, Sequence) and not isinstance(value, str) else []


def as_str(value: Json) -> str | None:
    return value if isinstance(value, str) else None


def as_int(value: Json) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


__all__ = ["Json", "JsonObject", "as_int", "as_list", "as_object", "as_str"]
