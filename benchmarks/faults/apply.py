"""Apply one catalogued fault to a DeepSpeed tree, all or nothing, and take it back exactly.

A tree is laid out as ``zerostate explore --deepspeed-path`` accepts it: ``TREE/deepspeed/__init__.py``.
`make_tree` copies an installed package there (without byte code).  `applied` is a context manager:
it checks the fault's original text occurs exactly once before writing anything, writes the faulted file
whole (a temporary file renamed over it), and restores the saved bytes on the way out, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from collections.abc import Iterator

from faults.catalogue import Fault


class FaultError(Exception):
    """A fault that cannot be applied as written: its file is missing or its original text does not occur
    exactly once (the release changed under the catalogue)."""


def make_tree(installed_package: Path, tree: Path) -> Path:
    """A fresh copy of ``installed_package`` (a ``.../site-packages/deepspeed`` folder) at ``tree/deepspeed``."""
    target = tree / "deepspeed"
    if target.exists():
        shutil.rmtree(target)
    tree.mkdir(parents=True, exist_ok=True)
    shutil.copytree(installed_package, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return tree


def faulted_text(fault: Fault, source: str) -> str:
    """``source`` with the fault's original text replaced; FaultError unless it occurs exactly once."""
    count = source.count(fault.original)
    if count != 1:
        raise FaultError(f"fault {fault.id}: its original text occurs {count} times in {fault.file} "
                         "(expected exactly once)")
    return source.replace(fault.original, fault.replacement, 1)


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed over it: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def applied(fault: Fault, tree: Path) -> Iterator[Path]:
    """``tree`` with ``fault`` applied for the duration of the block; the file's original bytes afterwards."""
    path = tree / "deepspeed" / fault.file
    if not path.is_file():
        raise FaultError(f"fault {fault.id}: no file {path}")
    original = path.read_bytes()
    new = faulted_text(fault, original.decode("utf-8")).encode("utf-8")
    _write_whole(path, new)
    try:
        yield path
    finally:
        _write_whole(path, original)
