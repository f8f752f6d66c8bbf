"""`zerostate.runtime.patcher.Patcher`: every patch recorded, undone exactly (own values back, inherited ones unshadowed)."""

from __future__ import annotations

import types

from zerostate.runtime.patcher import Patcher


class Engine:
    def step(self):
        return "class step"


def test_undo_restores_own_values_and_unshadows_class_attributes():
    eng = Engine()
    eng.backward = lambda: "own backward"
    own_backward = eng.backward
    p = Patcher()
    assert p.wrap(eng, "step", lambda f: lambda: "patched " + f()) is not None
    p.wrap(eng, "backward", lambda f: lambda: "patched " + f())
    assert eng.step() == "patched class step" and eng.backward() == "patched own backward"
    assert "step" in vars(eng) and len(p) == 2
    p.undo()
    assert "step" not in vars(eng), "an inherited method must show through again, not be pinned on the instance"
    assert eng.backward is own_backward and eng.step() == "class step"
    assert not p
    p.undo()  # idempotent
    assert eng.step() == "class step"


def test_patching_twice_unwinds_in_reverse_order():
    mod = types.SimpleNamespace(count=lambda: 1)
    first = mod.count
    p = Patcher()
    p.wrap(mod, "count", lambda f: lambda: f() + 10)
    p.wrap(mod, "count", lambda f: lambda: f() * 2)
    assert mod.count() == 22
    p.undo()
    assert mod.count is first


def test_missing_attribute_or_object_patches_nothing():
    p = Patcher()
    assert p.wrap(None, "x", lambda f: f) is None
    assert p.wrap(Engine(), "no_such_method", lambda f: f) is None
    assert len(p) == 0
