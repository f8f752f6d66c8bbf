"""The fingerprints each known issue's own repros give (`fingerprints.json`), recorded by
``tools/record_fingerprints.py`` from the issue's scenario and variants on the releases it affects, and checked
by ``test_known_issue``: a known issue's exception and spec labels hold only on these (`KnownIssue.recognises`),
so the same crash from another DeepSpeed function, or a violation with another event pattern, is new."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

FILE = Path(__file__).with_name("fingerprints.json")


@cache
def table() -> dict[str, frozenset[str]]:
    """Issue id -> its recorded fingerprints."""
    if not FILE.exists():
        return {}
    data = json.loads(FILE.read_text())
    return {k: frozenset(v["fingerprints"]) for k, v in data.items()}


def recorded(issue_id: str) -> frozenset[str]:
    return table().get(issue_id, frozenset())


__all__ = ["FILE", "recorded", "table"]
