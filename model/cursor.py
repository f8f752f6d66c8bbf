"""One execution cursor: a design run over a scenario, one driver event at a time.

The driver events of a scenario are a sequence of DAG *segments* (`model.driver.segments`); every
linear extension of a segment is a legal interleaving.  A `Cursor` holds where a run is (segment,
fired nodes), the design's state and the events emitted so far; ``enabled()`` lists the driver
nodes that may fire next, ``fire(n)`` fires one and returns what it emitted.  The explorer's `run`,
the Hypothesis stateful tests and the runtime refinement test all drive a design through this one
loop; the state graph (`model.explore.state_graph`) uses its pure half, `enabled_at`, over
immutable positions.
"""

from __future__ import annotations

from collections.abc import Sequence

from .designs import Design
from .driver import CoordinatorMode, Segment, event_at, segments
from .events import Event
from .machine import ModelState, initial_state, step
from .network import Network
from .scenario import Scenario


def enabled_at(g: Segment, done: frozenset[int], preds: dict[int, tuple[int, ...]] | None = None) -> list[int]:
    """The nodes of segment ``g`` not yet fired whose predecessors all fired: sorted, or in the graph's
    node order when ``preds`` (each node's predecessors, precomputed) is given (the state graph's order)."""
    if preds is None:
        return sorted(n for n in g.nodes if n not in done and all(p in done for p in g.predecessors(n)))
    return [n for n in g.nodes if n not in done and all(p in done for p in preds[n])]


class Cursor:
    """A design's run over a scenario: ``enabled()``, ``fire(node)``, ``events``, ``state``."""

    def __init__(self, design: Design, scenario: Scenario, coordinator: CoordinatorMode,
                 segs: Sequence[Segment] | None = None, net: Network | None = None) -> None:
        self.design = design
        self.net = net or Network(scenario)
        self.segs = list(segs) if segs is not None else segments(scenario, coordinator=coordinator)
        self.seg = 0
        self.done: frozenset[int] = frozenset()
        self.state: ModelState = initial_state(design, self.net)
        self.events: list[Event] = []
        self._skip_empty()

    @property
    def finished(self) -> bool:
        return self.seg >= len(self.segs)

    def enabled(self) -> list[int]:
        return [] if self.finished else enabled_at(self.segs[self.seg], self.done)

    def event_of(self, node: int) -> Event:
        return event_at(self.segs[self.seg], node)

    def fire(self, node: int) -> list[Event]:
        """Fire one enabled driver node; return the events it emitted (the driver event and the design's effects)."""
        self.state, out = step(self.design, self.net, self.state, self.event_of(node))
        self.events += out
        self.done = self.done | {node}
        if len(self.done) == self.segs[self.seg].number_of_nodes():
            self.seg, self.done = self.seg + 1, frozenset()
            self._skip_empty()
        return out

    def _skip_empty(self) -> None:
        while not self.finished and self.segs[self.seg].number_of_nodes() == 0:
            self.seg += 1


__all__ = ["Cursor", "enabled_at"]
