"""The code speaks of event kinds through `EventKind` only, and folds specs over events in one place.

* No event kind as a string literal outside serialisation: an AST scan of the project's ``*.py`` for a kind's
  value (``"fetch"``, ``"user_backward_start"``) where an event is built or matched -- the kind given to
  ``emit`` / ``Event`` / ``EventKind``, a ``"kind": ...`` entry, compared with something named ``kind``, or (for the
  kinds of more than one word, which are no ordinary word) any comparison or dict key.  ``model/events.py``
  defines the kinds and their serialised form; nothing else is exempt.
* One spec fold: no spec's ``step`` is called outside `zerostate.model.fold` (``check_trace``, the model checker's
  state graph and the watch's checker all fold through it).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from zerostate.model.events import EventKind

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "specs", "analysis", "runtime", "findings", "known", "tracing", "harness", "targets", "explorer",
            "watcher", "clients", "cli", "zerostate")
KINDS = {k.value for k in EventKind}
WORDY = {k for k in KINDS if "_" in k}
SERIALISATION = {"model/events.py"}
_BUILDERS = {"emit", "Event", "EventKind", "put"}


def _files() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def _kind_constants(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in KINDS:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _kind_constants(e)]
    return []


def _names_kind(node: ast.AST) -> bool:
    return "kind" in ast.unparse(node).lower()


def kind_literals(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every event kind written as a string where an event is built or matched."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in _BUILDERS and node.args:
                out += [(node.lineno, v) for v in _kind_constants(node.args[0])]
            out += [(node.lineno, v) for kw in node.keywords if kw.arg == "kind" for v in _kind_constants(kw.value)]
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=False):
                if isinstance(k, ast.Constant) and k.value == "kind":
                    out += [(node.lineno, c) for c in _kind_constants(v)]
                if isinstance(k, ast.Constant) and k.value in WORDY:
                    out.append((node.lineno, k.value))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            consts = [c for s in sides for c in _kind_constants(s)]
            if any(_names_kind(s) for s in sides if not _kind_constants(s)):
                out += [(node.lineno, c) for c in consts]
            else:
                out += [(node.lineno, c) for c in consts if c in WORDY]
    return out


def test_the_scan_finds_kinds_written_as_strings():
    """The scan itself: each way of writing a kind as a string is found; `EventKind` members and plain words are
    not."""
    bad = ('emit("fetch", param=p)\nEvent("step")\n{"kind": "release"}\nif ev.kind == "holders": pass\n'
           'if ev.kind in ("prefetch", "fetch"): pass\nif what == "user_backward_start": pass\n'
           'd = {"forward_start": 1}\n')
    assert [v for _, v in kind_literals(bad)] == ["fetch", "step", "release", "holders", "prefetch", "fetch",
                                                  "user_backward_start", "forward_start"]
    good = ('emit(EventKind.FETCH)\nif ev.kind is EventKind.STEP: pass\nrow = {"step": 3}\n'
            'if name == "step": pass\nmark("step", step=1)\n')
    assert kind_literals(good) == []


def test_no_event_kind_as_a_string_literal_outside_serialisation():
    found = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in SERIALISATION:
            continue
        found += [f"{rel}:{line}: {lit!r}" for line, lit in kind_literals(path.read_text())]
    assert not found, "\n".join(found)


_STEP_CALL = re.compile(r"\b(spec|s|mon|monitor)\.(step|finish)\(")


def test_one_spec_fold():
    """Specs are stepped in `zerostate.model.fold` only (the specs' own modules define steps, they do not fold)."""
    found = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "model/fold.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _STEP_CALL.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
    from zerostate.model.fold import first_violation
    from zerostate.specs import base
    assert base.check_trace.__code__.co_names.count("first_violation") == 1 and first_violation is base.first_violation
