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
  parameters; the recompute stops early inside its last module (torch's default
  early stop), so that module's post-forward hook does not fire; the
  recomputed tensors' metadata is checked right after the recompute, and each
  module's saved tensors are unpacked again in its backward;
* a z3 leaf block (ZeRO-3) has module hooks on the block only and one
  leaf-module backward hook instead of per-parameter hooks; its parameters'
  gradients accumulate (LEAF_GRAD, ``lin`` first) after its pre-backward hook;
  the leaf hook fires after them, or -- when no input of the block requires
  grad -- as soon as the output's gradient is known, before the block's
  pre-backward hook (known issue ``z3-leaf-input-without-grad``);
* ZeRO-3 module hooks: the root module (``model``) wraps every forward and
  backward; a module's pre-backward hook fires only when its output requires
  grad and its post-backward hook only when its input does (so a module fed an
  input that does not require grad never runs its post-backward hook).  The
  parameter-less container of a non-leaf block (``blocks.{i}``, the ``Block``
  module) is hooked too (``CONTAINER_HOOK``): its pre-forward before its
  sub-modules', its post-forward after theirs (not in a non-reentrant
  recompute, which stops early inside the block), its pre-backward before
  theirs where the block's output requires grad (a reentrant block: in the
  nested task, after the recompute) and its post-backward after theirs where
  the block's input requires grad;
* a micro-step may take a branch that skips frozen norms (``MicroStep.skip``),
  and a train step may start by re-registering ZeRO-3's hooks (REREGISTER).

``coordinator=False`` drops module-hook, recompute and unpack nodes (keeping
their ordering), which is all the hook-count half needs and keeps its state
space small.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import networkx as nx

from .events import Event, EventKind
from .network import HEAD, HEAD_WEIGHT, ROOT, Network
from .scenario import Checkpoint, ParamKind, Scenario

COORDINATOR_ONLY = frozenset({
    EventKind.CONTAINER_HOOK, EventKind.MODULE_PRE_FORWARD, EventKind.MODULE_POST_FORWARD,
    EventKind.MODULE_PRE_BACKWARD, EventKind.MODULE_POST_BACKWARD, EventKind.RECOMPUTE_START,
    EventKind.RECOMPUTE_END, EventKind.UNPACK, EventKind.EVAL_FORWARD_START, EventKind.EVAL_FORWARD_END,
    EventKind.REREGISTER,
})


Segment: TypeAlias = "nx.DiGraph[int]"
"""A DAG of driver events: int nodes, each carrying its `Event` as node attribute ``event`` (`event_at`)."""

CoordinatorMode: TypeAlias = bool | Literal["serial"]
"""Which driver events a run has: True every one, False none of the coordinator's (`COORDINATOR_ONLY`),
``"serial"`` every one with each module's gradient hooks right after its backward (`segments`)."""


def event_at(g: Segment, node: int) -> Event:
    """The driver event node ``node`` of segment ``g`` carries."""
    ev: Event = g.nodes[node]["event"]
    return ev


@dataclass
class _Builder:
    g: Segment = field(default_factory=nx.DiGraph)
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


def _chain_segment(events: list[Event]) -> Segment:
    b = _Builder()
    b.chain(events)
    return b.g


def has_container(net: Network, i: int) -> bool:
    """ZeRO-3 hooks block i's ``Block`` module as a parameter-less container (not when the block is a z3
    leaf module: then the block itself is the one hooked module)."""
    return net.scenario.stage == 3 and not net.is_leaf(i)


def _container(i: int, hook: str, phase: str | None = None) -> Event:
    return Event(EventKind.CONTAINER_HOOK, module=f"blocks.{i}", phase=phase, note=hook)


def forward_events(net: Network, phase: str, block_range: range | None = None,
                   skip: frozenset[int] = frozenset()) -> list[Event]:
    """Module pre/post forward hooks of the blocks of a whole forward (``skip``: blocks whose frozen
    norm this forward's branch skips), each non-leaf block's inside its container's."""
    out: list[Event] = []
    blocks = block_range if block_range is not None else range(len(net.scenario.blocks))
    for i in blocks:
        box = has_container(net, i)
        if box:
            out.append(_container(i, "pre_forward", phase))
        for g in net.hook_groups(i, i in skip):
            out += [Event(EventKind.MODULE_PRE_FORWARD, module=g.module, phase=phase),
                    Event(EventKind.MODULE_POST_FORWARD, module=g.module, phase=phase)]
        if box:
            out.append(_container(i, "post_forward", phase))
    return out


def _recompute_events(net: Network, i: int, nonreentrant: bool, skip: bool) -> list[Event]:
    """A checkpointed block's forward re-run during backward.

    Non-reentrant: each module's ops save their frozen parameters as live references (SAVE_LIVE), and
    the recompute *stops early* (``torch.utils.checkpoint``'s default ``set_checkpoint_early_stop(True)``)
    as soon as the last tensor the backward needs is saved -- inside the block's last module, whose
    post-forward hook therefore never fires; right after, torch checks every recomputed tensor's
    metadata (UNPACK note=check).  Reentrant: the whole forward re-runs (every post-forward fires).
    """
    groups = net.hook_groups(i, skip)
    box = has_container(net, i)
    out = [Event(EventKind.RECOMPUTE_START, module=f"blocks.{i}")]
    if box:
        out.append(_container(i, "pre_forward", "recompute"))
    for gi, g in enumerate(groups):
        out.append(Event(EventKind.MODULE_PRE_FORWARD, module=g.module, phase="recompute"))
        if nonreentrant:
            out += [Event(EventKind.SAVE_LIVE, param=p, module=f"blocks.{i}") for p in g.saved_live]
        if not (nonreentrant and gi == len(groups) - 1):
            out.append(Event(EventKind.MODULE_POST_FORWARD, module=g.module, phase="recompute"))
    if box and not nonreentrant:  # the early stop leaves the Block's forward too
        out.append(_container(i, "post_forward", "recompute"))
    out.append(Event(EventKind.RECOMPUTE_END, module=f"blocks.{i}"))
    if nonreentrant:
        out += [Event(EventKind.UNPACK, param=p, module=f"blocks.{i}", note="check")
                for g in groups for p in g.saved_live]
    return out


def _computes(net: Network, i: int, skip: bool) -> bool:
    """Block i runs some sub-module in this pass.  A non-reentrant checkpoint recomputes on the first
    unpack of a tensor the block saved: a block that runs none (its norm skipped, its Linear unused: it
    returns its input) saved nothing and is never recomputed -- also when it is one z3 leaf module."""
    return any(not (skip and m.name.endswith(".norm")) for m in net.block_modules(i))


def backward_dag(net: Network, outer: int, first_nested: int, kind: str,
                 skip: frozenset[int] = frozenset(), serial: bool = False) -> Segment:
    """The DAG of one user backward.  ``outer`` is its graph task id; nested tasks count up from
    ``first_nested``.  A module's pre-backward hook fires only when its output requires grad, its
    post-backward hook only when its input does (DeepSpeed hangs them on those tensors).
    ``serial``: each module's gradient hooks fire right after its backward, before its post-backward
    hook (one linear extension instead of all of them)."""
    b = _Builder()
    start = b.chain([Event(EventKind.USER_BACKWARD_START, note=kind),
                     Event(EventKind.TASK_START, task=outer, note="outer"),
                     Event(EventKind.OUTPUT_HOOK, task=outer), Event(EventKind.MODULE_PRE_BACKWARD, module=ROOT)])
    frontier = start  # where the gradient currently is
    tails: list[int] = []  # nodes that must finish before the outer task ends
    nested = first_nested
    for i in reversed(range(len(net.scenario.blocks))):
        if not net.gradient_reaches_block(i):
            break
        ck = net.scenario.blocks[i].checkpoint
        task = outer
        if ck is Checkpoint.REENTRANT:
            task, nested = nested, nested + 1
            frontier = b.chain([Event(EventKind.TASK_START, task=task, value=outer, note="nested",
                                      module=f"blocks.{i}")]
                               + _recompute_events(net, i, nonreentrant=False, skip=i in skip), frontier)
        block_tails: list[int] = []
        box = has_container(net, i)
        if box:  # on the Block's output: before its sub-modules' (reentrant: in the nested task)
            frontier = (b.add(_container(i, "pre_backward"), frontier),)
        leaf_hook = net.is_leaf(i) and bool(net.leaf_hook_params(i))  # DeepSpeed hooks only leaf modules with
        early = leaf_hook and net.leaf_hook_early(i)  # optimizer parameters; no input requires grad: on the output
        for gi, g in enumerate(reversed(net.hook_groups(i, i in skip))):
            if early:
                frontier = b.chain([Event(EventKind.LEAF_HOOK, module=g.module, task=task)], frontier)
            if g.output_requires_grad:
                frontier = (b.add(Event(EventKind.MODULE_PRE_BACKWARD, module=g.module), frontier),)
            if ck is Checkpoint.NON_REENTRANT and gi == 0 and _computes(net, i, i in skip):
                frontier = b.chain(_recompute_events(net, i, nonreentrant=True, skip=i in skip), frontier)
            if ck is Checkpoint.NON_REENTRANT and g.saved_live:
                frontier = b.chain([Event(EventKind.UNPACK, param=p, module=f"blocks.{i}", note="use")
                                    for p in g.saved_live], frontier)
            if net.is_leaf(i):
                frontier = b.chain([Event(EventKind.LEAF_GRAD, param=p, task=task) for p in net.leaf_grad_params(i)]
                                   + ([Event(EventKind.LEAF_HOOK, module=g.module, task=task)]
                                      if leaf_hook and not early else []), frontier)
            else:
                hooked = [p for p in g.params if net.params[p].kind is ParamKind.TRAINABLE]
                if hooked and serial:
                    frontier = b.chain([Event(EventKind.GRAD_HOOK, param=p, task=task) for p in hooked], frontier)
                elif hooked:
                    block_tails += list(b.chain([Event(EventKind.GRAD_HOOK, param=p, task=task) for p in hooked],
                                                frontier))
            if g.input_requires_grad:
                frontier = (b.add(Event(EventKind.MODULE_POST_BACKWARD, module=g.module), frontier),)
        if box and net.block_input_requires_grad(i):  # on the Block's input: after its sub-modules'
            frontier = (b.add(_container(i, "post_backward"), frontier),)
        if ck is Checkpoint.REENTRANT:
            frontier = (b.add(Event(EventKind.TASK_END, task=task, module=f"blocks.{i}"),
                              frontier + tuple(block_tails)),)
        else:
            tails += block_tails
    if net.scenario.input_requires_grad:
        frontier = (b.add(Event(EventKind.MODULE_POST_BACKWARD, module=ROOT), frontier),)
    b.chain([Event(EventKind.TASK_END, task=outer, note="outer"), Event(EventKind.USER_BACKWARD_END, note=kind)],
            frontier + tuple(tails))
    return b.g


def forward_segment(net: Network, pre_task: int, skip: frozenset[int] = frozenset()) -> list[Event]:
    out = [Event(EventKind.FORWARD_START), Event(EventKind.MODULE_PRE_FORWARD, module=ROOT, phase="forward")]
    out += forward_events(net, "forward", skip=skip)
    if net.scenario.fused_head:
        # the head's loss Function runs autograd.backward after the head's forward: its module backward
        # hooks fire there, inside forward, and never in the user's backward (as DeepSpeed 0.19.8 traces it)
        out += [Event(EventKind.MODULE_PRE_FORWARD, module=HEAD, phase="forward"),
                Event(EventKind.MODULE_POST_FORWARD, module=HEAD, phase="forward"),
                Event(EventKind.TASK_START, task=pre_task, note="pre"),
                Event(EventKind.MODULE_PRE_BACKWARD, module=HEAD),
                Event(EventKind.GRAD_HOOK, param=HEAD_WEIGHT, task=pre_task),
                Event(EventKind.MODULE_POST_BACKWARD, module=HEAD),
                Event(EventKind.TASK_END, task=pre_task, note="pre")]
    return out + [Event(EventKind.MODULE_POST_FORWARD, module=ROOT, phase="forward"), Event(EventKind.FORWARD_END)]


def eval_segment(net: Network) -> list[Event]:
    ev = [Event(EventKind.EVAL_FORWARD_START), Event(EventKind.MODULE_PRE_FORWARD, module=ROOT, phase="eval")]
    ev += forward_events(net, "eval")
    if net.scenario.fused_head:
        ev += [Event(EventKind.MODULE_PRE_FORWARD, module=HEAD, phase="eval"),
               Event(EventKind.MODULE_POST_FORWARD, module=HEAD, phase="eval")]
    return ev + [Event(EventKind.MODULE_POST_FORWARD, module=ROOT, phase="eval"), Event(EventKind.EVAL_FORWARD_END)]


def contract(g: Segment, drop: frozenset[EventKind]) -> Segment:
    """Remove nodes whose event kind is in ``drop``, keeping the order they implied."""
    h = g.copy()
    for n in [n for n, d in g.nodes(data=True) if d["event"].kind in drop]:
        preds, succs = list(h.predecessors(n)), list(h.successors(n))
        h.remove_node(n)
        h.add_edges_from((p, s) for p in preds for s in succs)
    return nx.transitive_reduction(h) if h.number_of_edges() else h


def _with_events(h: Segment, g: Segment) -> Segment:
    for n in h.nodes:
        h.nodes[n]["event"] = g.nodes[n]["event"]
    return h


def segments(scenario: Scenario, coordinator: CoordinatorMode = True, serial: bool = False) -> list[Segment]:
    """The whole run as segments (DAGs of driver events), in schedule order.

    ``serial=True`` (or ``coordinator="serial"``) keeps every coordinator event but fires each module's
    gradient hooks right after its backward: every segment is a chain.  That one interleaving is enough
    for the coordinator half and its specs whenever the hook half's EPILOGUE does not depend on the order
    of gradient hooks (true of ds-0.18.7 and zerostate, whose epilogue runs from the callback at the outer
    task's end or when ``engine.backward`` returns, and of every design whose coordinator ignores EPILOGUE).
    """
    if coordinator == "serial":
        coordinator, serial = True, True
    net = Network(scenario)
    task_ids = itertools.count()
    out: list[Segment] = []
    for si, step in enumerate(scenario.steps):
        if step.reregister:
            out.append(_chain_segment([Event(EventKind.REREGISTER)]))
        if step.eval_before:
            out.append(_chain_segment(eval_segment(net)))
        for micro in step.micro:
            skip = frozenset(micro.skip)
            out.append(_chain_segment(forward_segment(net, next(task_ids), skip)))
            outer = next(task_ids)
            nested_base = next(task_ids)
            for _ in range(len(scenario.blocks)):
                next(task_ids)
            out.append(backward_dag(net, outer, nested_base, micro.backward.value, skip, serial))
        out.append(_chain_segment([Event(EventKind.STEP, value=si)]))
    if not coordinator:
        out = [_with_events(contract(g, COORDINATOR_ONLY | {EventKind.SAVE_LIVE}), g) for g in out]
        out = [g for g in out if g.number_of_nodes()]
    return out


def default_order(g: Segment) -> list[Event]:
    """PyTorch's deterministic order on CPU, approximated: smallest node id first."""
    return [event_at(g, n) for n in nx.lexicographical_topological_sort(g)]


__all__ = ["COORDINATOR_ONLY", "CoordinatorMode", "Segment", "backward_dag", "contract", "default_order",
           "eval_segment", "event_at", "forward_events", "forward_segment", "has_container", "segments"]
