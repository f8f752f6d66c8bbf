"""`zerostate.runtime.patcher.Patcher`: every patch recorded, undone exactly
(own values back, inherited ones unshadowed)."""

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


def test_set_item_puts_each_original_back_under_its_key_in_its_place():
    """A gradient hook swapped in its hook dictionary: same key, same place in the order; undo puts the
    identical original back there (and removes a key that was not there)."""
    first, second, third = (lambda: 1), (lambda: 2), (lambda: 3)
    hooks = {7: first, 8: second, 9: third}
    p = Patcher()
    p.set_item(hooks, 8, lambda: "swapped")
    p.set_item(hooks, 10, lambda: "new")
    assert list(hooks) == [7, 8, 9, 10] and hooks[8]() == "swapped"
    p.undo()
    assert list(hooks.items()) == [(7, first), (8, second), (9, third)]
    assert hooks[8] is second


def test_guarded_changes_leave_a_later_replacement_alone():
    """``guard=True``: what someone else put there after us is theirs; unguarded changes are undone."""
    obj = types.SimpleNamespace(state="original")
    hooks = {1: "hook"}
    p = Patcher()
    p.set(obj, "state", "ours", guard=True)
    p.set_item(hooks, 1, "ours", guard=True)
    obj.state, hooks[1] = "theirs", "theirs"
    p.undo()
    assert obj.state == "theirs" and hooks[1] == "theirs"
    p.set(obj, "state", "ours")
    obj.state = "someone else's"
    p.undo()
    assert obj.state == "theirs"  # unguarded: the value before the change is put back, whatever came since


def test_on_undo_runs_in_order_and_every_inverse_runs_when_one_fails():
    log = []
    obj = types.SimpleNamespace(x=0)
    p = Patcher()
    p.on_undo(lambda: log.append("first change undone"))
    p.set(obj, "x", 1)
    p.on_undo(lambda: (_ for _ in ()).throw(RuntimeError("inverse failed")))
    p.on_undo(lambda: log.append("last change undone"))
    try:
        p.undo()
    except RuntimeError as exc:
        assert "inverse failed" in str(exc)
    else:
        raise AssertionError("the failing inverse's error was swallowed")
    assert log == ["last change undone", "first change undone"] and obj.x == 0 and not p
