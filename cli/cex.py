"""A model-check counterexample as a report finding: violating event, state graph, path through it."""

from __future__ import annotations

from typing import Any, Callable

from zerostate.model.events import Event
from zerostate.model.scenario import Scenario

from .report import FindingRecord

MAX_GRAPH_STATES = 4000
"""Larger state graphs are not drawn (the picture would be a smear)."""


def violation_index(spec_id: str, events: list[Event]) -> int | None:
    from zerostate.specs import SPECS, check_trace
    v = check_trace(SPECS[spec_id], events) if spec_id in SPECS else None
    return v.index if v else None


def graph_path(graph: Any, events: list[Event]) -> list[Any]:
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


def record(design: str, spec_id: str, scenario: Scenario, events: list[Event], message: str,
           repro: Callable[[Scenario, str, str], Callable[[int], str] | None]) -> FindingRecord:
    from zerostate.analysis.checker import counterexample_graph
    graph, path, notes = None, [], []
    try:
        g = counterexample_graph(design, scenario, spec_id)
        if g is not None and g.number_of_nodes() <= MAX_GRAPH_STATES:
            graph, path = g, graph_path(g, events)
        elif g is not None:
            notes.append(f"state graph not drawn: {g.number_of_nodes()} states (over {MAX_GRAPH_STATES})")
    except Exception as exc:  # the picture is a bonus; the finding stands without it
        notes.append(f"state graph not drawn: {type(exc).__name__}: {exc}")
    return FindingRecord(check=spec_id, error=message, scenario=scenario, events=events,
                         violation=violation_index(spec_id, events), design=design, graph=graph,
                         graph_path=path, repro=repro(scenario, spec_id, message), notes=notes)


__all__ = ["MAX_GRAPH_STATES", "graph_path", "record", "violation_index"]
