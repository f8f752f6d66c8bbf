"""The model core's seams: dependencies run one way, and the pluggable parts implement their protocols."""

from __future__ import annotations

import ast
from pathlib import Path

from zerostate.model.designs import designs
from zerostate.model.protocols import CoordinatorHalf, Monitor
from zerostate.specs import SPECS

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"model": set(), "specs": {"model"}, "analysis": {"model", "specs"}, "runtime": {"model"},
          "targets": {"model", "specs", "runtime", "atomic"}}
"""What each package may import of the project (beside itself): nothing imports the CLI, the runtime
(shipped alone to DeepSpeed users) only the model's era table."""


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
