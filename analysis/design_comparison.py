"""``zerostate compare DESIGN_A DESIGN_B``: two designs over the same scenarios, side by side.

The pure computation behind the command (the CLI only prints and files it)::

    compare(design_a: str, design_b: str, scenarios: Iterable[Scenario] | None = None,
            specs: Sequence[Spec] | None = None) -> Comparison
    Comparison.to_json() -> dict          # stable keys, see below
    Comparison.to_text() -> str           # the side-by-side table (= render_text(to_json()))
    render_text(data: dict) -> str
    default_scenarios(max_blocks: int = 2) -> list[Scenario]

``scenarios`` defaults to `default_scenarios`: 1-2 blocks, each plain / reentrant / non-reentrant and
trainable, frozen-norm (seed 002's shape) or all-frozen (a frozen base layer, as LoRA leaves it), the
input requiring grad or not, prefetch off or on, one train step of two micro-steps (so the recorded
trace is used), ZeRO-3.  Each design is judged
on every spec (hook specs over every interleaving of the backward DAG without module hooks;
coordinator specs on the serial DAG, see `driver.segments`), and scored by the ``gathered-peak``
and ``allgathers`` metrics on one run of each scenario.

JSON (``to_json``)::

    {"designs": [A, B], "scenarios": N,
     "specs": {spec_id: {A: {"holds": bool, "violations": k, "message": str | None,
                             "counterexample": scenario-dict | None}, B: {...}}},
     "gathered_peak": {A: {"median": x, "max": x}, B: {...},
                       "ratio": {"median": r, "worst": r, "best": r, "higher": n, "lower": n, "equal": n},
                       "most_different": {"scenario": scenario-dict, "describe": str, A: x, B: x, "ratio": r}},
     "allgathers": {A: {"total": n, "median": x}, B: {...},
                    "ratio": {"median": r, "worst": r, "best": r, "higher": n, "lower": n, "equal": n}},
     "per_scenario": [{"scenario": scenario-dict, A: {"gathered_peak": x, "allgathers": n,
                                                       "violated": [spec_id, ...]}, B: {...}}, ...]}

Ratios are B / A ("worst" is the largest: where B gathers most relative to A).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from zerostate.model.designs import get_design
from zerostate.model.driver import CoordinatorMode
from zerostate.model.events import Event
from zerostate.model.explore import run, state_graph
from zerostate.model.failure import Violation
from zerostate.model.network import Network
from zerostate.model.scenario import Block, Checkpoint, MicroStep, ParamKind, Scenario, TrainStep
from zerostate.specs.base import Spec
from zerostate.specs.coordinator_specs import allgathers, gathered_peak


def default_scenarios(max_blocks: int = 2) -> list[Scenario]:
    """The scenarios ``zerostate compare`` explores by default (smallest first)."""
    out = []
    kinds = ((ParamKind.TRAINABLE, ParamKind.TRAINABLE), (ParamKind.FROZEN, ParamKind.TRAINABLE),
             (ParamKind.FROZEN, ParamKind.FROZEN))
    cks = (Checkpoint.NONE, Checkpoint.REENTRANT, Checkpoint.NON_REENTRANT)
    for n in range(1, max_blocks + 1):
        for combo in itertools.product(itertools.product(cks, kinds), repeat=n):
            blocks = tuple(Block(ck, *kind) for ck, kind in combo)
            for rg in (True, False):
                for prefetch in (0, 256):
                    # stage3_max_reuse_distance 0: at DeepSpeed's default (1e9) a COMPLETE trace keeps every
                    # parameter used again gathered, and the designs' release decisions barely show
                    sc = Scenario(blocks=blocks, steps=(TrainStep((MicroStep(), MicroStep())),),
                                  input_requires_grad=rg, prefetch_bucket_size=prefetch, max_reuse_distance=0)
                    if Network(sc).loss_requires_grad:
                        out.append(sc)
    return out


@dataclass
class Side:
    """One design on one scenario: its metrics, and per violated spec the state graph's `Violation` with
    the event sequence it is on (``counterexamples[spec]``)."""

    peak: float
    allgathers: float
    violations: dict[str, Violation] = field(default_factory=dict)
    counterexamples: dict[str, list[Event]] = field(default_factory=dict)


def _judge(design_name: str, sc: Scenario, specs: Sequence[Spec]) -> Side:
    d = get_design(design_name)
    hook = [s for s in specs if s.family == "hooks"]
    coord = [s for s in specs if s.family == "coordinator"]
    side = Side(0.0, 0.0)
    passes: tuple[tuple[list[Spec], CoordinatorMode], ...] = ((hook, False), (coord, "serial"))
    for chosen, mode in passes:
        if chosen:
            g = state_graph(d, sc, chosen, coordinator=mode)
            side.violations.update(g.violations)
            side.counterexamples.update(g.counterexamples)
    events = run(d, sc, coordinator="serial").events
    net = Network(sc)
    side.peak = gathered_peak(events, net)
    side.allgathers = allgathers(events, net)
    return side


def _ratios(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    rs = [(b / a if a else (1.0 if not b else float("inf"))) for a, b in pairs]
    if not rs:
        return {"median": None, "worst": None, "best": None, "higher": 0, "lower": 0, "equal": 0}
    return {"median": round(statistics.median(rs), 4), "worst": round(max(rs), 4), "best": round(min(rs), 4),
            "higher": sum(r > 1 for r in rs), "lower": sum(r < 1 for r in rs), "equal": sum(r == 1 for r in rs)}


@dataclass
class Comparison:
    a: str
    b: str
    scenarios: list[Scenario]
    sides: list[tuple[Side, Side]]
    spec_ids: list[str]

    def first_violation(self, design: str, spec_id: str) -> tuple[Scenario, Violation, list[Event]] | None:
        """The first scenario on which ``design`` violates ``spec_id``: it, the violation, and its events."""
        k = (self.a, self.b).index(design)
        for sc, s in zip(self.scenarios, self.sides, strict=True):
            if spec_id in s[k].violations:
                return sc, s[k].violations[spec_id], s[k].counterexamples[spec_id]
        return None

    def to_json(self) -> dict[str, Any]:
        a, b = self.a, self.b
        specs: dict[str, Any] = {}
        for sid in self.spec_ids:
            specs[sid] = {}
            for k, name in ((0, a), (1, b)):
                bad = [(sc, s[k].violations[sid].message) for sc, s in zip(self.scenarios, self.sides, strict=True)
                       if sid in s[k].violations]
                specs[sid][name] = {"holds": not bad, "violations": len(bad),
                                    "message": bad[0][1] if bad else None,
                                    "counterexample": bad[0][0].to_dict() if bad else None}
        peaks = [(s[0].peak, s[1].peak) for s in self.sides]
        ags = [(s[0].allgathers, s[1].allgathers) for s in self.sides]
        gp: dict[str, Any] = {
            a: {"median": _med([p[0] for p in peaks]), "max": max((p[0] for p in peaks), default=None)},
            b: {"median": _med([p[1] for p in peaks]), "max": max((p[1] for p in peaks), default=None)},
            "ratio": _ratios(peaks), "most_different": None}
        if peaks:
            i = max(range(len(peaks)), key=lambda j: (abs(_logratio(*peaks[j])), -j))
            sc = self.scenarios[i]
            gp["most_different"] = {"scenario": sc.to_dict(), "describe": sc.describe(), a: peaks[i][0],
                                    b: peaks[i][1], "ratio": _ratios([peaks[i]])["median"]}
        return {
            "designs": [a, b], "scenarios": len(self.scenarios), "specs": specs, "gathered_peak": gp,
            "allgathers": {a: {"total": sum(x[0] for x in ags), "median": _med([x[0] for x in ags])},
                           b: {"total": sum(x[1] for x in ags), "median": _med([x[1] for x in ags])},
                           "ratio": _ratios(ags)},
            "per_scenario": [{"scenario": sc.to_dict(),
                              a: {"gathered_peak": s[0].peak, "allgathers": s[0].allgathers,
                                  "violated": sorted(s[0].violations)},
                              b: {"gathered_peak": s[1].peak, "allgathers": s[1].allgathers,
                                  "violated": sorted(s[1].violations)}}
                             for sc, s in zip(self.scenarios, self.sides, strict=True)],
        }

    def to_text(self) -> str:
        return render_text(self.to_json())


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _logratio(x: float, y: float) -> float:
    import math
    if x == y:
        return 0.0
    if not x or not y:
        return float("inf")
    return math.log(y / x)


def compare(design_a: str, design_b: str, scenarios: Iterable[Scenario] | None = None,
            specs: Sequence[Spec] | None = None) -> Comparison:
    """Run both designs over the same scenarios; see the module docstring.  Unknown names raise
    `UnknownDesignError` before any work."""
    get_design(design_a)
    get_design(design_b)
    if specs is None:
        from zerostate.specs import SPECS
        specs = list(SPECS.values())
    scs = list(scenarios) if scenarios is not None else default_scenarios()
    sides = [(_judge(design_a, sc, specs), _judge(design_b, sc, specs)) for sc in scs]
    return Comparison(design_a, design_b, scs, sides, [s.id for s in specs])


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:g}"
    return str(x)


def render_text(data: dict[str, Any]) -> str:
    """The side-by-side table of a comparison's JSON."""
    a, b = data["designs"]
    n = data["scenarios"]
    w = max(26, *(len(s) + 2 for s in data["specs"]))
    col = max(22, len(a) + 2, len(b) + 2)
    lines = [f"{a} vs {b} over {n} scenario(s) (model; specs over every interleaving)", "",
             f"{'':{w}}{a:<{col}}{b:<{col}}"]

    def cell(v: dict[str, Any]) -> str:
        return "holds" if v["holds"] else f"VIOLATED ({v['violations']}/{n})"

    for sid, v in data["specs"].items():
        lines.append(f"{sid:{w}}{cell(v[a]):<{col}}{cell(v[b]):<{col}}")
    gp = data["gathered_peak"]
    lines.append("")
    lines.append(f"{'gathered-peak, median':{w}}{_fmt(gp[a]['median']):<{col}}{_fmt(gp[b]['median']):<{col}}")
    lines.append(f"{'gathered-peak, max':{w}}{_fmt(gp[a]['max']):<{col}}{_fmt(gp[b]['max']):<{col}}")
    r = gp["ratio"]
    lines.append(f"{'  ratio ' + b + '/' + a:{w}}median {_fmt(r['median'])}, worst {_fmt(r['worst'])}, "
                 f"best {_fmt(r['best'])}  (higher on {r['higher']}, lower on {r['lower']}, equal on {r['equal']})")
    ag = data["allgathers"]
    lines.append(f"{'all-gathers, total':{w}}{_fmt(ag[a]['total']):<{col}}{_fmt(ag[b]['total']):<{col}}")
    r = ag["ratio"]
    lines.append(f"{'  ratio ' + b + '/' + a:{w}}median {_fmt(r['median'])}, worst {_fmt(r['worst'])}, "
                 f"best {_fmt(r['best'])}  (more on {r['higher']}, fewer on {r['lower']}, equal on {r['equal']})")
    md = gp.get("most_different")
    if md and md["ratio"] != 1:
        lines += ["", f"gathered-peak differs most ({a} {_fmt(md[a])}, {b} {_fmt(md[b])} elements) on:"]
        lines += ["  " + x for x in md["describe"].splitlines()]
    for sid, v in data["specs"].items():
        for name in (a, b):
            if not v[name]["holds"]:
                lines += ["", f"{name} violates {sid}: {v[name]['message']}", "  first on:"]
                lines += ["    " + x for x in Scenario.from_dict(v[name]["counterexample"]).describe().splitlines()]
    return "\n".join(lines)


__all__ = ["Comparison", "compare", "default_scenarios", "render_text"]
