"""The state graph of a counterexample: states in breadth-first layers left to right from the
initial state, the counterexample path in red, ending at the violation."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise
from typing import Any

from zerostate.reports.canvas import Canvas
from zerostate.reports.trace_picture import titles


def graph_picture(graph: Any, path: Iterable[Any] = (), title: str = "", subtitle: str = "") -> Canvas:
    """Breadth-first layers left to right; ``path`` (node keys in order) drawn in red."""
    import networkx as nx

    roots = [n for n in graph.nodes if graph.in_degree(n) == 0] or list(graph.nodes)[:1]
    depth: dict[Any, int] = {}
    for r in roots:
        for n, d in nx.single_source_shortest_path_length(graph, r).items():
            depth[n] = min(d, depth.get(n, d))
    layers: dict[int, list[Any]] = {}
    for n, d in sorted(depth.items(), key=lambda kv: kv[1]):
        layers.setdefault(d, []).append(n)
    tallest = max((len(v) for v in layers.values()), default=1)
    dx, dy, left, top = 36, max(6, min(28, 900 // max(tallest, 1))), 40, 80
    path = list(path)
    steps = _steps(graph, path)
    width = max(left * 2 + dx * max(len(layers), 1), 1000)
    key_rows = (len(steps) + STEP_COLUMNS - 1) // STEP_COLUMNS
    height = top + dy * tallest + 50 + (24 + 17 * key_rows if steps else 0)
    pos = {n: (left + dx * d, top + dy * (i + (tallest - len(layers[d])) / 2))
           for d, ns in layers.items() for i, n in enumerate(ns)}
    c = Canvas(int(width), int(height))
    titles(c, title, subtitle)
    on_path = set(pairwise(path))
    for a, b in graph.edges:
        if a in pos and b in pos and (a, b) not in on_path:
            c.line(*pos[a], *pos[b], color="#9e9e9e", width=0.6, opacity=0.6)
    for k, (a, b) in enumerate(pairwise(path), start=1):
        if a in pos and b in pos:
            c.line(*pos[a], *pos[b], color="#d50000", width=2.5)
            (x1, y1), (x2, y2) = pos[a], pos[b]
            c.text((x1 + x2) / 2, (y1 + y2) / 2 - 6, str(k), size=9, anchor="middle", color="#b71c1c")
    r = max(2.0, min(5.0, dy / 3))
    for n, (x, y) in pos.items():
        c.circle(x, y, r, fill="#d50000" if n in path else "#1565c0")
    if path and path[-1] in pos:
        x, y = pos[path[-1]]
        c.text(x + 8, y - 8, "violation", size=11, color="#d50000", bold=True)
    ky = top + dy * tallest + 40
    if steps:
        c.text(12, ky, "counterexample transitions (number on the red edge: the events that step emitted)",
               size=11, color="#b71c1c", bold=True)
    colw = (width - 24) / STEP_COLUMNS
    for k, text in enumerate(steps):
        col_x, row_y = 12 + colw * (k // key_rows), ky + 17 * (k % key_rows + 1)
        room = int(colw / 6.2)
        c.text(col_x, row_y, text if len(text) <= room else text[:room - 1] + "…", size=10, color="#333333")
    c.text(12, height - 12, f"{graph.number_of_nodes()} states, {graph.number_of_edges()} transitions, "
           f"{len(layers)} layers (breadth-first depth from the initial state); red: the counterexample",
           size=11, color="#555555")
    return c


STEP_COLUMNS = 3


def _steps(graph: Any, path: list[Any]) -> list[str]:
    """One line per counterexample transition: its number and the events it emitted."""
    out = []
    for k, (a, b) in enumerate(pairwise(path), start=1):
        evs = graph.edges[a, b].get("events", []) if graph.has_edge(a, b) else []
        out.append(f"{k}. " + ("; ".join(evs) if evs else "(next segment)"))
    return out


__all__ = ["graph_picture"]
