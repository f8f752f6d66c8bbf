"""Every source module has a test: the test files that import it (the rule `conftest` states).

The map is read, not kept: the source modules are the ``.py`` files of pyproject.toml's package-dir folders, and a
test file imports a module when its syntax tree holds ``import zerostate.x.y``, ``from zerostate.x import y`` or
``from zerostate.x.y import name`` -- anywhere in the file, inside functions too (tests import DeepSpeed-side
modules late, so collecting them stays cheap).  Importing ``zerostate.x.y`` imports the package ``zerostate.x``
too.  ``python generated_tests/test_test_map.py [module ...]`` prints the map: each module and its test files.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def source_modules() -> dict[str, Path]:
    """Module name -> its file, for every ``.py`` file of the package-dir folders and of the packages inside them
    that package-dir does not map (``harness/net/``); a package is its ``__init__``."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    mapped = {(ROOT / folder).resolve() for folder in dirs.values()}
    out: dict[str, Path] = {}

    def walk(package: str, folder: Path) -> None:
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
        for sub in sorted(folder.iterdir()):
            if (sub / "__init__.py").is_file() and sub.resolve() not in mapped:
                walk(f"{package}.{sub.name}", sub)
    for package, folder in dirs.items():
        walk(package, ROOT / folder)
    return out


def imported_by(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports, in any of the three forms, with the packages they sit in."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found.update(m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules)
    return found


def paths_of_test_modules() -> list[Path]:
    """The test modules (``test_*.py``); conftest and helper modules hold fixtures and tools, not tests."""
    return sorted(TESTS.glob("test_*.py"))


def module_to_tests() -> dict[str, list[str]]:
    """Source module -> the test files that import it (empty: none does)."""
    modules = source_modules()
    out: dict[str, list[str]] = {m: [] for m in modules}
    for path in paths_of_test_modules():
        for m in imported_by(path, set(modules)):
            out[m].append(path.name)
    return out


def test_source_modules_are_the_package_dir_files():
    modules = source_modules()
    assert "zerostate.explorer.exploration" in modules and "zerostate.targets.deepspeed.target" in modules
    assert "zerostate.harness.net.torch_network" in modules  # a package package-dir does not map
    assert "zerostate.model" in modules  # a package: its __init__
    assert all(p.suffix == ".py" and p.is_file() for p in modules.values())


def test_every_import_form_is_read(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import zerostate.model.scenario\nfrom zerostate.explorer import strategies\n"
                     "from zerostate.runtime.install import install\n"
                     "def late():\n    from zerostate.cli import main as m\n    import json\n")
    got = imported_by(probe, set(source_modules()))
    assert {"zerostate.model.scenario", "zerostate.explorer.strategies", "zerostate.runtime.install",
            "zerostate.cli.main", "zerostate.model", "zerostate.explorer", "zerostate.runtime", "zerostate.cli",
            "zerostate"} <= got
    assert not any(m.startswith("json") for m in got)


AWAITING_TESTS: frozenset[str] = frozenset()
"""Modules no test file imports yet (none): not a place for new modules, the list may only shrink."""


def test_every_source_module_is_imported_by_a_test():
    untested = sorted(m for m, files in module_to_tests().items() if not files and m not in AWAITING_TESTS)
    assert not untested, "modules no test file imports (add a test that exercises each):\n  " + "\n  ".join(untested)


def test_awaiting_tests_lists_only_modules_that_still_have_none():
    tested = sorted(m for m in AWAITING_TESTS if module_to_tests().get(m))
    gone = sorted(AWAITING_TESTS - set(source_modules()))
    assert not tested and not gone, f"take these off AWAITING_TESTS: {tested + gone}"


def main(argv: list[str]) -> int:
    """Print the map (or the given modules' lines): one module a line, then its test files."""
    for module, files in sorted(module_to_tests().items()):
        if argv and module not in argv:
            continue
        print(f"{module}: {' '.join(files) if files else '(none)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
