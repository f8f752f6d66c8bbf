"""A model-check counterexample as a report finding: violating event, state graph, path through it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zerostate.model.events import Event
from zerostate.model.failure import Violation
from zerostate.model.scenario import Scenario
from zerostate.findings.finding import Finding

from zerostate.reports.repro_file import repro_for

MAX_GRAPH_STATES = 4000
"""Larger state graphs are not drawn (the picture would be a smear)."""


def finding(v: Violation, scenario: Scenario, events: list[Event]) -> Finding:
    """A model counterexample (the scenario, the event sequence, the monitor's `Violation` on it) as a
    `Finding` of the model target."""
    return Finding(v.spec, v.message, scenario, list(events), v.index, "model", code=v.code)


def graph_path(graph: Any, events: Sequence[Event]) -> list[Any]:
    """Nodes from the initial state along edges whose events spell ``events`` (depth-first)."""
    want = [str(e) for e in events]
    roots = [n for n in graph.nodes if graph.in_degree(n) == 0]
    seen: set[tuple[Any, int]] = set()

    def walk(node: Any, at: int) -> list[Any] | None:
        if at >= len(want):
            return [node]
        if (node, at) in seen:
            return None
        seen.add((node, at))
        for nxt in graph.successors(node):
            evs = graph.edges[node, nxt].get("events", [])
            rest = want[at:]
            if evs[:len(rest)] == rest[:len(evs)]:
                tail = walk(nxt, at + min(len(evs), len(rest)))
                if tail is not None:
                    return [node] + tail
        return None

    for r in roots:
        path = walk(r, 0)
        if path:
            return path
    return []


def shown(design: str, f: Finding) -> dict[str, Any]:
    """How the report shows a model counterexample (`report.Shown`'s fields): the design, its state graph
    with the path of ``f.trace`` through it (when small enough to draw), the repro script."""
    from zerostate.analysis.checker import counterexample_graph
    graph, path, notes = None, [], []
    try:
        if f.scenario is None:
            raise ValueError("the finding has no scenario")
        g = counterexample_graph(design, f.scenario, f.check)
        if g is not None and g.number_of_nodes() <= MAX_GRAPH_STATES:
            graph, path = g, graph_path(g, f.trace or [])
        elif g is not None:
            notes.append(f"state graph not drawn: {g.number_of_nodes()} states (over {MAX_GRAPH_STATES})")
    except Exception as exc:  # noqa: BLE001 -- the picture is a bonus; the finding stands without it
        notes.append(f"state graph not drawn: {type(exc).__name__}: {exc}")
    return {"design": design, "graph": graph, "graph_path": path, "notes": notes,
            "repro": repro_for(f.scenario, f.check, f.error, f)}


__all__ = ["MAX_GRAPH_STATES", "finding", "graph_path", "shown"]
