"""Steered generation: the sequence in rounds, each drawn from the schedule the rounds before it earned.

Round ``k`` is the first ``size`` scenarios new to the run in the generation sequence (`generate.generated`,
the whole budget as Hypothesis's ``max_examples``, as unsteered) of ``scenarios(weights=W_k)`` with the seed
`steering_schedule.round_seed` ``(seed, k)``.  ``W_0`` is `choices.DEFAULT` and round 0's seed is ``seed``: round 0
is the unsteered sequence's start.  Counted in *distinct* scenarios, unlike the unsteered budget (every
Hypothesis run starts from its simplest examples, so each round's stream begins with scenarios an earlier
round ran: counting them would spend a quarter of a round on nothing); the rounds end when ``examples``
distinct scenarios were drawn or a round's stream has nothing new.  A round's scenarios are cut into
lanes of ``lane`` (a lane never spans two rounds: every example still runs after the
same examples, whatever ``jobs`` is).  Before drawing round ``k+1``, `Rounds` waits until every scenario
of round ``k`` has its outcome (`note`, called by the exploration as each lands, in any order), folds them
in sequence position order (`signal.fold`) and asks `steering_schedule.schedule` for ``W_{k+1}``: so given the seed
and a target whose runs reach the same units each time, the sequence does not depend on ``jobs``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from zerostate.model.scenario import Scenario

from zerostate.explorer.choices import DEFAULT, Weights, taken
from zerostate.explorer.generate import generated, seed_of
from zerostate.explorer.steering_schedule import round_seed, schedule
from zerostate.explorer.signal import Unit, fold

ROUND = 50
"""Examples per round: the default budget (`cli.cmd_explore.DEFAULT_EXAMPLES`) runs in four rounds, so its draw
weights are re-cut three times."""


def steered_strategy(weights: Weights) -> Any:
    from zerostate.explorer.strategies import scenarios
    return scenarios(weights=weights)


class Rounds:
    """The lanes of a steered exploration (an iterator of lanes, like `generate.Lanes`), and its schedules."""

    def __init__(self, examples: int, seed: int | None, size: int, lane: int, stop: threading.Event,
                 strategy_of: Callable[[Weights], Any] = steered_strategy, reweigh: bool = True):
        self.examples, self.seed, self.size, self.lane = examples, seed_of(seed), size, lane
        self.strategy_of = strategy_of
        self.reweigh = reweigh
        """False: every round keeps the default weights (the control that tells steering from the rounds' seeds)."""
        self.stop = stop
        self.weights: list[Weights] = [DEFAULT]
        """``W_k`` of each round drawn so far."""
        self.position: dict[Scenario, int] = {}
        """Scenario -> its first position in the whole steered sequence (every round's stream drawn up to
        its last new scenario, one after the other, duplicates included), from 1."""
        self.drawn = 0
        self.round_at: dict[Scenario, int] = {}
        """Scenario -> the round that first drew it."""
        self.union: set[Unit] = set()
        self.new_units: list[int] = []
        """Per round folded: the units its examples reached first."""
        self._units: dict[Scenario, frozenset[Unit]] = {}
        self._outcome_noted = threading.Condition()  # notified by `note`; `_wait_and_fold` waits on it

    def strategy(self, k: int) -> Any:
        return self.strategy_of(self.weights[k])

    def seed_of_round(self, k: int) -> int:
        return round_seed(self.seed, k)

    def note(self, sc: Scenario, units: frozenset[Unit]) -> None:
        """A generated scenario's outcome landed (any thread, any order)."""
        with self._outcome_noted:
            self._units[sc] = units
            self._outcome_noted.notify_all()

    def __iter__(self) -> Iterator[list[Scenario]]:
        k = 0
        while len(self.position) < self.examples:
            if k > 0:
                folded = self._wait_and_fold(k - 1)
                if folded is None:
                    return
                self.weights.append(schedule(self.weights[k - 1], folded) if self.reweigh else self.weights[k - 1])
            mine = self._draw(k)
            if not mine:
                return
            k += 1
            for i in range(0, len(mine), self.lane):
                yield mine[i:i + self.lane]

    def _draw(self, k: int) -> list[Scenario]:
        """Round ``k``'s distinct scenarios new to the run, in order; positions and rounds noted."""
        take = min(self.size, self.examples - len(self.position))
        out: list[Scenario] = []
        stream = generated(self.strategy(k), self.examples, self.seed_of_round(k))
        try:
            for sc in stream:
                if len(out) == take:
                    break
                self.drawn += 1
                if sc in self.position:
                    continue
                self.position[sc] = self.drawn
                self.round_at[sc] = k
                out.append(sc)
        finally:
            stream.close()
        return out

    def _wait_and_fold(self, k: int) -> list[Any] | None:
        """Round ``k``'s examples folded in position order, once all have landed (None: stopped first)."""
        mine = sorted((sc for sc, at in self.round_at.items() if at == k), key=self.position.__getitem__)
        with self._outcome_noted:
            while not all(sc in self._units for sc in mine):
                if self.stop.is_set():
                    return None
                self._outcome_noted.wait(0.2)
            ordered = [(sc, self._units[sc]) for sc in mine]
        folded = fold(((taken(sc), units) for sc, units in ordered), self.union)
        self.new_units.append(sum(f.new for f in folded))
        return folded


__all__ = ["ROUND", "Rounds", "steered_strategy"]
