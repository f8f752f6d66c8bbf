"""Each judgement lives in one place: one findings decider, one known-issue table (the spec fold and the event
kinds have their own scan in test_event_kinds_and_fold.py).

* One decider: `zerostate.findings.decide` decides which checks a run fails.  The DeepSpeed target and the repro
  scripts import it, the watch and the model target reach it through `decide_trace`, and no module of the
  targets, the harness or the explorer builds a `Finding` itself (`findings.build` makes them from decisions).
* One known-issue table: every `KnownIssue` record the data modules define is in `known.issues.KNOWN_ISSUES`,
  once, under an id of its own, and no module outside ``known/`` defines a `KnownIssue`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from zerostate.known.issue import KnownIssue

ROOT = Path(__file__).resolve().parent.parent
DECIDING = ("targets", "harness", "explorer")
"""Packages that run scenarios and hand findings on: they never word a finding themselves."""


def _calls(path: Path, name: str) -> list[int]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if called == name:
                out.append(node.lineno)
    return out


def _imports(path: Path, module: str) -> bool:
    return any(isinstance(n, ast.ImportFrom) and n.module == module for n in ast.walk(ast.parse(path.read_text())))


def test_one_findings_decider():
    built = [f"{p.relative_to(ROOT)}:{line}" for pkg in DECIDING for p in sorted((ROOT / pkg).rglob("*.py"))
             for line in _calls(p, "Finding")]
    assert not built, f"findings built outside findings.build: {built}"
    assert _imports(ROOT / "targets" / "deepspeed" / "target.py", "zerostate.findings.decide")
    from zerostate.harness import repro  # a repro script embeds the decider and judges with it
    assert "zerostate.findings.decide" in repro.embedded_modules()
    assert "from zerostate.findings.decide import failed_checks" in (ROOT / "harness" / "repro.py").read_text()
    # decide_trace: the model, the watch
    assert _imports(ROOT / "targets" / "interface.py", "zerostate.findings.decide")
    from zerostate.findings import decide
    assert decide.failed_checks.__module__ == decide.__name__


def test_one_known_issue_table():
    from zerostate.known import fixed, issues, seeds, setups, zero_hooks
    table = issues.KNOWN_ISSUES
    ids = [k.id for k in table]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    defined = {id(v) for m in (fixed, seeds, setups, zero_hooks) for v in vars(m).values()
               if isinstance(v, KnownIssue)}
    assert defined <= {id(k) for k in table}, "a KnownIssue defined in a data module is not in the table"
    elsewhere = [f"{p.relative_to(ROOT)}:{line}" for p in sorted(ROOT.rglob("*.py"))
                 if "known" not in p.relative_to(ROOT).parts[:1] and ".venv" not in p.parts
                 and "generated_tests" not in p.parts for line in _calls(p, "KnownIssue")]
    assert not elsewhere, f"KnownIssue records outside known/: {elsewhere}"
