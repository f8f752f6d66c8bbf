"""Driver events of a scenario: what the user and PyTorch do, as a sequence of DAGs.

A run is a list of *segments*.  Each segment is a ``networkx.DiGraph`` whose
nodes carry one driver `Event` (node attribute ``event``); an edge ``a -> b``
means ``a`` happens before ``b``.  Every linear extension of a segment is a
legal interleaving.  Forwards, eval forwards and ``engine.step()`` are chains;
the user's backward is a real DAG:

* backward visits blocks from last to first; inside a block, ``lin`` before ``norm``;
* a module's parameter gradient hooks fire after its pre-backward hook and
  before its graph task ends, in any order relative to other modules' work;
* a reentrant block's backward is a *nested* graph task: recompute, then the
  block's backward and hooks, then the task ends, and only then does the
  gradient flow on to the block before it;
* a non-reentrant block recomputes its forward on the first unpack (after the
  pre-backward hook of its last module), saving live references to frozen
  parameters; the recomputed tensors' metadata is checked right after the
  recompute, and each module's saved tensors are unpacked again in its backward;
* a z3 leaf block (ZeRO-3) has module hooks on the block only and one
  leaf-module backward hook instead of per-parameter hooks.

``coordinator=False`` drops module-hook, recompute and unpack nodes (keeping
their ordering), which is all the hook-count half needs and keeps its state
space small.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

import networkx as nx

from .events import E, Ev, Event
from .network import HEAD, HEAD_WEIGHT, Network
from .scenario import Checkpoint, ParamKind, Scenario

COORDINATOR_ONLY = frozenset({
    Ev.MODULE_PRE_FORWARD, Ev.MODULE_POST_FORWARD, Ev.MODULE_PRE_BACKWARD,
    Ev.MODULE_POST_BACKWARD, Ev.RECOMPUTE_START, Ev.RECOMPUTE_END, Ev.UNPACK,
    Ev.EVAL_FORWARD_START, Ev.EVAL_FORWARD_END,
})


@dataclass
class _Builder:
    g: nx.DiGraph = field(default_factory=nx.DiGraph)
    ids: Iterator[int] = field(default_factory=itertools.count)

    def add(self, ev: Event, after: tuple[int, ...] = ()) -> int:
        n = next(self.ids)
        self.g.add_node(n, event=ev)
        for a in after:
            self.g.add_edge(a, n)
        return n

    def chain(self, events: list[Event], after: tuple[int, ...] = ()) -> tuple[int, ...]:
        last = after
        for ev in events:
            last = (self.add(ev, last),)
        return last


def _chain_segment(events: list[Event]) -> nx.DiGraph:
    b = _Builder()
    b.chain(events)
    return b.g


def _module_groups(net: Network, i: int) -> list[tuple[str, tuple[str, ...]]]:
    """(hooked module name, its used params) for block i in forward order.  A leaf block is one module."""
    mods = net.block_modules(i)
    if net.is_leaf(i):
        return [(f"blocks.{i}", tuple(p for m in mods for p in m.params))]
    return [(m.name, m.params) for m in mods]


def forward_events(net: Network, phase: str, block_range: range | None = None) -> list[Event]:
    """Module pre/post forward hooks of a whole forward (or recompute of some blocks)."""
    out: list[Event] = []
    blocks = block_range if block_range is not None else range(len(net.scenario.blocks))
    for i in blocks:
        for mod, _ in _module_groups(net, i):
            out += [E(Ev.MODULE_PRE_FORWARD, module=mod, phase=phase),
                    E(Ev.MODULE_POST_FORWARD, module=mod, phase=phase)]
    return out


def _recompute_events(net: Network, i: int, nonreentrant: bool) -> list[Event]:
    out = [E(Ev.RECOMPUTE_START, module=f"blocks.{i}")]
    for mod, params in _module_groups(net, i):
        out.append(E(Ev.MODULE_PRE_FORWARD, module=mod, phase="recompute"))
        if nonreentrant:
            out += [E(Ev.SAVE_LIVE, param=p, module=f"blocks.{i}") for p in params
                    if net.params[p].kind is ParamKind.FROZEN]
        out.append(E(Ev.MODULE_POST_FORWARD, module=mod, phase="recompute"))
    out.append(E(Ev.RECOMPUTE_END, module=f"blocks.{i}"))
    if nonreentrant:
        out += [E(Ev.UNPACK, param=p, module=f"blocks.{i}", note="check")
                for _, params in _module_groups(net, i) for p in params
                if net.params[p].kind is ParamKind.FROZEN]
    return out


def backward_dag(net: Network, outer: int, first_nested: int, kind: str) -> nx.DiGraph:
    """The DAG of one user backward.  ``outer`` is its graph task id; nested tasks count up from
    ``first_nested``."""
    b = _Builder()
    start = b.chain([E(Ev.USER_BACKWARD_START, note=kind), E(Ev.TASK_START, task=outer, note="outer"),
                     E(Ev.OUTPUT_HOOK, task=outer)])
    frontier = start  # where the gradient currently is
    tails: list[int] = []  # nodes that must finish before the outer task ends
    if net.scenario.fused_head:
        frontier = b.chain([E(Ev.MODULE_PRE_BACKWARD, module=HEAD), E(Ev.MODULE_POST_BACKWARD, module=HEAD)],
                           frontier)
    nested = first_nested
    for i in reversed(range(len(net.scenario.blocks))):
        if not net.gradient_reaches_block(i):
            break
        ck = net.scenario.blocks[i].checkpoint
        task = outer
        if ck is Checkpoint.REENTRANT:
            task, nested = nested, nested + 1
            frontier = b.chain([E(Ev.TASK_START, task=task, value=outer, note="nested", module=f"blocks.{i}")]
                               + _recompute_events(net, i, nonreentrant=False), frontier)
        groups = list(reversed(_module_groups(net, i)))
        block_tails: list[int] = []
        for gi, (mod, params) in enumerate(groups):
            frontier = (b.add(E(Ev.MODULE_PRE_BACKWARD, module=mod), frontier),)
            if ck is Checkpoint.NON_REENTRANT and gi == 0:
                frontier = b.chain(_recompute_events(net, i, nonreentrant=True), frontier)
            frozen = [p for p in params if net.params[p].kind is ParamKind.FROZEN]
            if ck is Checkpoint.NON_REENTRANT and frozen:
                frontier = b.chain([E(Ev.UNPACK, param=p, module=f"blocks.{i}", note="use") for p in frozen],
                                   frontier)
            hooked = [p for p in params if net.params[p].kind is ParamKind.TRAINABLE]
            if net.is_leaf(i):
                frontier = b.chain([E(Ev.LEAF_HOOK, module=mod, task=task)], frontier)
            elif hooked:
                block_tails += list(b.chain([E(Ev.GRAD_HOOK, param=p, task=task) for p in hooked], frontier))
            frontier = (b.add(E(Ev.MODULE_POST_BACKWARD, module=mod), frontier),)
        if ck is Checkpoint.REENTRANT:
            frontier = (b.add(E(Ev.TASK_END, task=task, module=f"blocks.{i}"), frontier + tuple(block_tails)),)
        else:
            tails += block_tails
    b.chain([E(Ev.TASK_END, task=outer, note="outer"), E(Ev.USER_BACKWARD_END, note=kind)],
            frontier + tuple(tails))
    return b.g


def forward_segment(net: Network, pre_task: int) -> list[Event]:
    out = [E(Ev.FORWARD_START)] + forward_events(net, "forward")
    if net.scenario.fused_head:
        out += [E(Ev.MODULE_PRE_FORWARD, module=HEAD, phase="forward"),
                E(Ev.TASK_START, task=pre_task, note="pre"),
                E(Ev.GRAD_HOOK, param=HEAD_WEIGHT, task=pre_task),
                E(Ev.TASK_END, task=pre_task, note="pre"),
                E(Ev.MODULE_POST_FORWARD, module=HEAD, phase="forward")]
    return out + [E(Ev.FORWARD_END)]


def eval_segment(net: Network) -> list[Event]:
    ev = [E(Ev.EVAL_FORWARD_START)] + forward_events(net, "eval")
    if net.scenario.fused_head:
        ev += [E(Ev.MODULE_PRE_FORWARD, module=HEAD, phase="eval"),
               E(Ev.MODULE_POST_FORWARD, module=HEAD, phase="eval")]
    return ev + [E(Ev.EVAL_FORWARD_END)]


def contract(g: nx.DiGraph, drop: frozenset[Ev]) -> nx.DiGraph:
    """Remove nodes whose event kind is in ``drop``, keeping the order they implied."""
    h = g.copy()
    for n in [n for n, d in g.nodes(data=True) if d["event"].kind in drop]:
        preds, succs = list(h.predecessors(n)), list(h.successors(n))
        h.remove_node(n)
        h.add_edges_from((p, s) for p in preds for s in succs)
    return nx.transitive_reduction(h) if h.number_of_edges() else h


def _with_events(h: nx.DiGraph, g: nx.DiGraph) -> nx.DiGraph:
    for n in h.nodes:
        h.nodes[n]["event"] = g.nodes[n]["event"]
    return h


def segments(scenario: Scenario, coordinator: bool = True) -> list[nx.DiGraph]:
    """The whole run as segments (DAGs of driver events), in schedule order."""
    net = Network(scenario)
    task_ids = itertools.count()
    out: list[nx.DiGraph] = []
    for si, step in enumerate(scenario.steps):
        if step.eval_before:
            out.append(_chain_segment(eval_segment(net)))
        for micro in step.micro:
            out.append(_chain_segment(forward_segment(net, next(task_ids))))
            outer = next(task_ids)
            nested_base = next(task_ids)
            for _ in range(len(scenario.blocks)):
                next(task_ids)
            out.append(backward_dag(net, outer, nested_base, micro.backward.value))
        out.append(_chain_segment([E(Ev.STEP, value=si)]))
    if not coordinator:
        out = [_with_events(contract(g, COORDINATOR_ONLY | {Ev.SAVE_LIVE}), g) for g in out]
        out = [g for g in out if g.number_of_nodes()]
    return out


def default_order(g: nx.DiGraph) -> list[Event]:
    """PyTorch's deterministic order on CPU, approximated: smallest node id first."""
    return [g.nodes[n]["event"] for n in nx.lexicographical_topological_sort(g)]


__all__ = ["COORDINATOR_ONLY", "backward_dag", "contract", "default_order", "eval_segment",
           "forward_events", "forward_segment", "segments"]
