"""The model core's seams: dependencies run one way, and the pluggable parts implement their protocols."""

from __future__ import annotations

import ast
from pathlib import Path

from zerostate.model.designs import designs
from zerostate.model.protocols import CoordinatorHalf, Monitor
from zerostate.specs import SPECS

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {
    "model": set(),
    "specs": {"model"},
    "analysis": {"model", "specs"},
    "runtime": {"model"},
    "findings": {"model", "specs"},
    "known": {"model", "specs", "findings", "tracing"},
    "tracing": {"model", "runtime"},
    "harness": {"model", "specs", "findings", "tracing", "runtime", "atomic", "jit_ops"},
    "targets": {"model", "specs", "findings", "known", "tracing", "harness", "atomic", "jit_ops"},
    "explorer": {"model", "specs", "findings", "known", "targets", "doctor", "atomic"},
    "cluster": {"model", "targets", "harness"},
    "clients": {"model", "runtime", "watcher"},
    "doctor": {"model", "findings", "known", "tracing"},
    "reports": {"model", "analysis", "findings", "known", "harness", "targets", "explorer", "atomic"},
    "watcher": {"model", "specs", "findings", "known", "tracing", "runtime", "reports", "atomic", "jit_ops"},
    "cli": {"model", "specs", "analysis", "runtime", "findings", "known", "tracing", "harness", "targets", "explorer",
            "cluster", "reports", "watcher", "doctor", "atomic", "jit_ops"},
}
"""What each package may import of the project (beside itself).  The runtime (shipped alone to DeepSpeed
users) imports only the model's era table; nothing imports the CLI (it holds the commands only: the reports
and pictures they write are ``reports``', which the watcher shares).  ``atomic`` and ``jit_ops`` are
stdlib-only leaves of the ``zerostate`` package (a file written whole; the torch extensions folder of each
DeepSpeed release)."""


def _project_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n.split(".")[1] for n in names if n.startswith("zerostate.") and n.count(".") >= 1}
    return out


def test_dependencies_run_one_way():
    bad = []
    for package, allowed in LAYERS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            wrong = _project_imports(path) - allowed - {package}
            if wrong:
                bad.append(f"{package}/{path.name} imports {sorted(wrong)}")
    assert not bad, bad


def test_no_torch_or_deepspeed_below_the_targets():
    for package in ("model", "specs", "analysis"):
        for path in (ROOT / package).glob("*.py"):
            text = path.read_text()
            assert "import torch" not in text and "import deepspeed" not in text, path


def test_designs_and_specs_implement_their_protocols():
    assert all(isinstance(d.coordinator, CoordinatorHalf) for d in designs().values())
    assert all(isinstance(s, Monitor) for s in SPECS.values())


def test_target_kinds_register_themselves_and_base_imports_none_of_them():
    import subprocess
    import sys
    base = ROOT / "targets" / "interface.py"
    imported = {(node.module or "").removeprefix("zerostate.targets.") for node in ast.walk(ast.parse(base.read_text()))
                if isinstance(node, ast.ImportFrom) and
                   (node.level > 0 or (node.module or "").startswith("zerostate.targets"))}
    kinds = {m for m in imported if m.split(".")[0] in ("model_target", "deepspeed")}
    assert not kinds, f"targets/interface.py imports its kinds: {kinds}"
    code = ("import sys, zerostate.targets.interface as b; print(','.join(b.target_kinds())); "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0].split(",") == ["model", "deepspeed"]
    assert out[1] == "[]", "importing zerostate.targets imported torch or deepspeed"


def test_get_target_checks_the_kind_and_its_options_before_building():
    import pytest
    from zerostate.targets.interface import TargetError, get_target
    for name, kw, match in (("nope", {}, "known targets: model, deepspeed"),
                            ("model", {"deepspeed": "0.19.8"}, "apply to the deepspeed target"),
                            ("model", {"design": "nope"}, "unknown design"),
                            ("deepspeed", {"world_size": 3}, "world size 1, 2, 4 or 8"),
                            ("deepspeed", {"design": "nope"}, "unknown design")):
        with pytest.raises(TargetError, match=match):
            get_target(name, **kw)
    assert get_target("model").design_name == "zerostate"
    assert get_target("model", design="ds-0.18.4").design_name == "ds-0.18.4"


def test_a_findings_key_is_its_check_and_code_never_its_message():
    """Rewording a message changes no finding's identity; two codes are two findings."""
    from zerostate.findings.finding import Finding
    a = Finding("epilogue-once", "no epilogue after blocks.0.lin.weight", None, code="no-epilogue")
    b = Finding("epilogue-once", "the epilogue never ran (3 hooks)", None, code="no-epilogue")
    c = Finding("epilogue-once", "no epilogue after blocks.0.lin.weight", None, code="hook-after-epilogue")
    assert a.key == b.key == "epilogue-once:no-epilogue" and c.key != a.key
    assert Finding("oracle-error", "oracle: ValueError: x", None).key == \
        Finding("oracle-error", "oracle: KeyError: 7", None).key == "oracle-error"
    assert Finding("exception", "boom", None, origin="KeyError@runtime.x").key == "exception:KeyError@runtime.x"


def test_the_era_table_reads_release_numbers_and_gives_each_release_one_row():
    from itertools import pairwise

    import pytest

    from zerostate.model import eras
    from zerostate.model.coordinator_designs import COORDINATOR_DESIGNS
    from zerostate.model.hook_designs import HOOK_DESIGNS
    assert eras.parse_release("0.19.8+cpu") == (0, 19, 8) and eras.parse_release("v0.19.3rc1") == (0, 19, 3)
    assert eras.parse_release("1.2") == (1, 2, 0)
    with pytest.raises(eras.UnknownRelease):
        eras.parse_release("latest")
    rows = eras.ERAS
    assert all(a.end == b.first for a, b in pairwise(rows)), "contiguous, no release twice"
    assert eras.era_of((0, 19, 8)).design == "ds-0.19.3" and eras.era_of((0, 18, 3)) is None
    assert eras.span(rows) == "0.18.4 <= version < 0.20.0"
    assert all(e.design in designs() and e.hook_design in HOOK_DESIGNS and e.coordinator_design in COORDINATOR_DESIGNS
               for e in rows), "every row names designs the model has"
