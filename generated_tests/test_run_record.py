"""The run record and the worker protocol: every payload that crosses a process boundary is typed (no ``Any``,
no ``dict[str, Any]``), a record survives its one codec whole, and the judgement takes the record."""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import types
import typing
from typing import Any, Union

import pytest

from zerostate.findings import decide, record
from zerostate.findings.record import RunRecord
from zerostate.findings.wire import Json, WireError, from_wire, to_wire
from zerostate.harness import protocol
from zerostate.model.events import Event, EventKind

pytestmark = pytest.mark.fast


def _untyped(tp: object, seen: set[object], where: str) -> list[str]:
    """Where ``tp`` (a resolved annotation) holds ``Any`` or a bare container."""
    if tp is Json:
        return []
    if tp is Any or tp in (dict, list, tuple):
        return [where]
    if (isinstance(tp, type) and typing.is_typeddict(tp)) or dataclasses.is_dataclass(tp):
        if tp in seen:
            return []
        seen.add(tp)
        hints = typing.get_type_hints(tp, vars(sys.modules[tp.__module__]))
        return [w for name, h in hints.items() for w in _untyped(h, seen, f"{where}.{name}")]
    out: list[str] = []
    for a in typing.get_args(tp):
        if a is not Ellipsis and not isinstance(a, str):
            out += _untyped(a, seen, where)
    return out


def test_nothing_untyped_crosses_the_worker_protocol():
    """Every TypedDict of the protocol, and the record inside its answers, is typed field by field."""
    messages = [v for v in vars(protocol).values() if isinstance(v, type) and typing.is_typeddict(v)]
    assert len(messages) >= 8
    bad = [w for m in messages for w in _untyped(m, set(), m.__name__)]
    bad += _untyped(RunRecord, set(), "RunRecord")
    assert not bad, bad


def test_the_check_finds_an_untyped_field():
    """The walk above can fail: a payload with a ``dict[str, Any]`` field is reported."""
    class Loose(typing.TypedDict):
        result: dict[str, Any]
    assert _untyped(Loose, set(), "Loose") == ["Loose.result"]


def _example(tp: object) -> object:
    """A value of ``tp`` with every optional part set (so the codec round trip covers every field)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _example(next(a for a in args if a is not type(None)))
    if origin is tuple:
        return (_example(args[0]),) if args[1:] == (Ellipsis,) else tuple(_example(a) for a in args)
    if tp is Event:
        return Event(EventKind.GRAD_HOOK, param="blocks.0.lin.weight", task=2)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp, vars(sys.modules[tp.__module__]))
        return tp(**{f.name: _example(hints[f.name]) for f in dataclasses.fields(tp)})
    return {int: 3, float: 0.25, str: "s", bool: True}[tp]  # type: ignore[index]


def test_a_record_with_every_field_set_survives_the_wire():
    full = _example(RunRecord)
    assert isinstance(full, RunRecord) and full.engine is not None and full.steps[0].masters
    again = from_wire(RunRecord, json.loads(json.dumps(to_wire(full))))
    assert again == full
    assert from_wire(RunRecord, to_wire(RunRecord())) == RunRecord()


def test_every_record_type_is_frozen():
    kinds = [v for v in vars(record).values() if dataclasses.is_dataclass(v)]
    thawed = [k for k in kinds if not k.__dataclass_params__.frozen]
    assert kinds and not thawed, thawed


@pytest.mark.parametrize("bad", [{"steps": 3}, {"nonsense": 1}, {"events": [{"kind": "no-such-kind"}]},
                                 {"raised": {"text": 5, "traceback": ""}}])
def test_a_malformed_record_is_refused_with_its_field(bad):
    with pytest.raises((WireError, ValueError)):
        from_wire(RunRecord, bad)


def test_the_judgement_takes_the_record():
    params = list(inspect.signature(decide.decide).parameters.values())
    hints = typing.get_type_hints(decide.decide)
    assert params[0].name == "record" and hints["record"] is RunRecord
