"""Running a design over a scenario: one interleaving, or all of them.

`run` drives one interleaving (chosen by a callback, default PyTorch's CPU
order) and returns the `Trace`.  `state_graph` builds the reachable state
graph of a scenario and design as a ``networkx.DiGraph`` -- nodes are
``(segment, done driver nodes, ModelState, monitor states)`` -- and reports, per
spec, the shortest event sequence that violates it.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, TypeAlias

import networkx as nx

from .coordinator_null import NULL_COORDINATOR
from .cursor import Cursor, enabled_at
from .designs import Design
from .driver import CoordinatorMode, Segment, event_at, segments
from .events import Event, EventKind, Trace
from .fold import MonitorBank
from .machine import ModelState, initial_state, step
from .failure import Failure, Violation, violation
from .network import Network
from .protocols import Monitor
from .scenario import Scenario

Chooser = Callable[[list[Event]], int]
"""Given the enabled driver events, return the index of the one to fire next."""


def first_enabled(enabled: list[Event]) -> int:
    return 0


def enabled_nodes(g: Segment, done: frozenset[int]) -> list[int]:
    return enabled_at(g, done)


def needs_coordinator(design: Design, scenario: Scenario) -> bool:
    return scenario.stage == 3 and design.coordinator.name != "none"


def run(design: Design, scenario: Scenario, choose: Chooser = first_enabled,
        coordinator: CoordinatorMode | None = None) -> Trace:
    """Drive one interleaving; return the full trace (driver and effect events) and the final state."""
    coord = needs_coordinator(design, scenario) if coordinator is None else coordinator
    cur = Cursor(design, scenario, coord)
    while not cur.finished:
        en = cur.enabled()
        cur.fire(en[choose([cur.event_of(x) for x in en]) if len(en) > 1 else 0])
    return Trace(tuple(cur.events), {"state": cur.state})


StateGraph: TypeAlias = "nx.DiGraph[int]"
"""A reachable state graph kept for pictures: nodes are hashes of states, edges carry the events emitted."""

_Node: TypeAlias = tuple[int, frozenset[int], ModelState, tuple[Any, ...]]
"""A state of the search: (segment, its fired driver nodes, the design's state, the monitor states)."""
_Parents: TypeAlias = dict[_Node, tuple[_Node, list[Event]] | None]
"""Each reached state's predecessor on a shortest path and the events of that transition (None: the start)."""


@dataclass
class GraphResult:
    """The state graph of one (design, scenario) with the given specs' monitors inside it.

    ``violations``: per violated spec, its `Violation` on the shortest event sequence that reaches it,
    ``counterexamples[spec]`` (``index`` counts in it; None: an end-of-run obligation).  A spec
    checked and not in ``violations`` holds on every interleaving."""

    scenario: Scenario
    design: str
    states: int
    transitions: int
    seconds: float
    checked: tuple[str, ...] = ()
    violations: dict[str, Violation] = field(default_factory=dict)
    counterexamples: dict[str, list[Event]] = field(default_factory=dict)
    graph: StateGraph | None = None

    def holds(self, spec_id: str) -> bool:
        return spec_id not in self.violations


def state_graph(design: Design, scenario: Scenario, specs: Sequence[Monitor], keep_graph: bool = False,
                coordinator: CoordinatorMode | None = None, max_states: int = 2_000_000,
                reduce: bool = True) -> GraphResult:
    """Breadth-first over every interleaving, merging equal states; shortest counterexample per spec."""
    t0 = time.perf_counter()
    net = Network(scenario)
    coord = needs_coordinator(design, scenario) if coordinator is None else coordinator
    segs, preds = _prepared_segments(scenario, coord, reduce and not coord)
    if not coord:  # hook-only graphs carry no module events: keep the coordinator out of the state
        design = replace(design, coordinator=NULL_COORDINATOR)
    bank = MonitorBank(specs)
    start: _Node = (0, frozenset(), initial_state(design, net), bank.initial())
    parent: _Parents = {start: None}
    graph: StateGraph | None = nx.DiGraph() if keep_graph else None
    found: dict[str, tuple[_Node, list[Event], int | None, Failure]] = {}
    queue = deque([start])
    transitions = 0
    finals: list[_Node] = []
    while queue:
        node = queue.popleft()
        seg, done, st, mons = node
        g = segs[seg]
        succ: list[tuple[_Node, list[Event]]]
        if len(done) == g.number_of_nodes():
            if seg + 1 < len(segs):
                succ = [((seg + 1, frozenset(), st, mons), [])]
            else:
                finals.append(node)
                succ = []
        else:
            succ = []
            for n in enabled_at(g, done, preds[seg]):
                st2, out = step(design, net, st, event_at(g, n))
                mons2, failed = bank.advance(mons, out)
                for sid, (i, failure) in failed.items():
                    if sid not in found:
                        found[sid] = (node, out[: i + 1], i, failure)
                succ.append(((seg, done | {n}, st2, mons2), out))
        for nxt, out in succ:
            transitions += 1
            if graph is not None:
                graph.add_edge(_key(node), _key(nxt), events=[str(e) for e in out])
            if nxt not in parent:
                parent[nxt] = (node, out)
                queue.append(nxt)
                if len(parent) > max_states:
                    raise RuntimeError(f"state graph exceeds {max_states} states for {scenario.describe()}")
    # end-of-run obligations (monitor finish)
    for node in finals:
        for sid, failure in bank.ends(node[3]).items():
            found.setdefault(sid, (node, [], None, failure))
    res = GraphResult(scenario, design.name, len(parent), transitions, time.perf_counter() - t0,
                      tuple(s.id for s in specs), graph=graph)
    for spec in specs:
        if spec.id in found:
            node, tail, at, failure = found[spec.id]
            path = _path(parent, node)
            res.counterexamples[spec.id] = path + tail
            res.violations[spec.id] = violation(spec.id, failure, None if at is None else len(path) + at)
    return res


_HOOK_KINDS = (EventKind.GRAD_HOOK, EventKind.LEAF_HOOK)


@lru_cache(maxsize=64)
def _prepared_segments(scenario: Scenario, coordinator: CoordinatorMode,
                       reduce: bool) -> tuple[list[Segment], list[dict[int, tuple[int, ...]]]]:
    """Segments (and each node's predecessors) of a scenario, shared by every design checked on it."""
    segs = segments(scenario, coordinator=coordinator)
    if reduce:
        segs = [order_hooks_within_tasks(g) for g in segs]
    return segs, [{n: tuple(g.predecessors(n)) for n in g.nodes} for g in segs]


def order_hooks_within_tasks(g: Segment) -> Segment:
    """Partial-order reduction for the hook-count half: chain the gradient hooks of each graph task.

    Every hook design reacts to a gradient hook through counts only (fired, remaining, the task's
    reach) and files the gradient in a bucket *set*; every hook spec is symmetric in parameter
    names.  So two hooks of the same graph task commute up to renaming, and one order per task
    (PyTorch's, the smallest node id first) represents them all.  Interleavings that change the
    outcome -- hooks against graph-task boundaries, nested tasks and callbacks -- are all kept.
    The stateful Hypothesis tests fire hooks in every order, unreduced.
    """
    order = {n: i for i, n in enumerate(nx.lexicographical_topological_sort(g))}
    by_task: dict[int | None, list[int]] = {}
    for n, d in g.nodes(data=True):
        if d["event"].kind in _HOOK_KINDS:
            by_task.setdefault(d["event"].task, []).append(n)
    if not any(len(v) > 1 for v in by_task.values()):
        return g
    h = g.copy()
    for nodes in by_task.values():
        nodes.sort(key=order.__getitem__)
        h.add_edges_from(itertools.pairwise(nodes))  # forward in one topological order: stays acyclic
    return h


def _key(node: _Node) -> int:
    return hash(node)


def _path(parent: _Parents, node: _Node) -> list[Event]:
    chunks = []
    link = parent[node]
    while link is not None:
        node, out = link
        chunks.append(out)
        link = parent[node]
    return [e for chunk in reversed(chunks) for e in chunk]


__all__ = ["GraphResult", "enabled_nodes", "first_enabled", "needs_coordinator", "run",
           "state_graph"]
