"""The one codec between a record's frozen dataclasses and JSON: `to_wire` / `from_wire`.

A value crosses a process boundary (worker to parent, rank to rank, a repro script's ranks) as JSON.  The
codec is driven by the dataclasses' own field annotations, so a new field needs no codec change: dataclasses
are objects of their fields (a field at its default is left out), tuples are lists, `Event`s their
``to_dict``, enums their value.  Stdlib only (the repro scripts embed it).
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import TypeVar, Union

from zerostate.model.events import Event

Json = str | int | float | bool | None | list["Json"] | dict[str, "Json"]
"""A JSON value, as ``json.loads`` gives it."""

T = TypeVar("T")


class WireError(ValueError):
    """A JSON value does not have the form of the type it is read as."""


def to_wire(value: object) -> Json:
    """``value`` (a dataclass of this codec's types) as JSON."""
    if isinstance(value, Event):
        return typing.cast(Json, value.to_dict())
    if isinstance(value, enum.Enum):
        return typing.cast(Json, value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Json] = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if f.default is not dataclasses.MISSING and v == f.default:
                continue
            out[f.name] = to_wire(v)
        return out
    if isinstance(value, (tuple, list)):
        return [to_wire(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise WireError(f"{type(value).__name__} has no wire form")


def from_wire(cls: type[T], data: Json) -> T:
    """The ``cls`` value ``data`` (`to_wire`'s form) holds."""
    reader = _reader(typing.cast(object, cls))
    return typing.cast(T, reader(data))


@cache
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


@cache
def _reader(tp: object) -> Callable[[Json], object]:
    if tp is Json or tp is object:
        return lambda d: d
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        readers = [_reader(a) for a in args if a is not type(None)]
        if len(readers) != 1:
            raise WireError(f"{tp}: only X | None unions have a wire form")
        inner = readers[0]
        return lambda d: None if d is None else inner(d)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _reader(args[0])
            return lambda d: tuple(item(x) for x in _list(d, tp))
        items = [_reader(a) for a in args]
        return lambda d: tuple(r(x) for r, x in zip(items, _list(d, tp), strict=True))
    if tp is Event:
        return lambda d: Event.from_dict(_object(d, tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return typing.cast(Callable[[Json], object], tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_reader(tp)
    if tp is float:
        return lambda d: float(_number(d, tp))
    if tp in (int, str, bool):
        return lambda d: _plain(d, typing.cast(type, tp))
    raise WireError(f"{tp} has no wire form")


def _dataclass_reader(cls: type) -> Callable[[Json], object]:
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}

    def read(d: Json) -> object:
        obj = _object(d, cls)
        unknown = obj.keys() - fields.keys()
        if unknown:
            raise WireError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
        return cls(**{k: _reader(hints[k])(v) for k, v in obj.items()})
    return read


def _list(d: Json, tp: object) -> list[Json]:
    if not isinstance(d, list):
        raise WireError(f"{tp}: expected a list, got {type(d).__name__}")
    return d


def _object(d: Json, tp: object) -> dict[str, Json]:
    if not isinstance(d, dict):
        raise WireError(f"{tp}: expected an object, got {type(d).__name__}")
    return d


def _number(d: Json, tp: object) -> float:
    if isinstance(d, bool) or not isinstance(d, (int, float)):
        raise WireError(f"{tp}: expected a number, got {type(d).__name__}")
    return d


def _plain(d: Json, tp: type) -> object:
    if not isinstance(d, tp) or (tp is int and isinstance(d, bool)):
        raise WireError(f"expected {tp.__name__}, got {type(d).__name__}")
    return d


__all__ = ["Json", "WireError", "from_wire", "to_wire"]
