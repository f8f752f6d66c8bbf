"""Reach declared as goals: every known DeepSpeed issue's family is run by every default exploration.

The generated sequence reaches a family by the draw rates alone, so whether the default exploration ran, say, ZeRO-3
with non-reentrant checkpointing of frozen parameters (seed 002's family) depended on where the pseudo-random sequence
went.  A `Goal` is a family, stated by the issue's own repros through the dimensions `zerostate doctor` reads them on
(`doctor.dimensions.requirements`): a scenario reaches it when it has everything one repro has.  After the generated
examples and the pairwise completion, each goal no run reached gets forced draws (`pairs.DRAWS` scenarios with the
choice points its repros need forced, `force_of`), and the first that reaches it runs; a goal no draw reaches runs its
own repro, and the exploration says so (the strategy does not draw that family: a reach gap, loudly).  Deterministic
given the runs before it and the seed; of their outcomes it reads only which ran (a skipped run reaches nothing).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from zerostate.doctor.dimensions import BY_NAME, Value, requirements
from zerostate.explorer.choices import DEFAULT, PAIRED, POINTS, Weights, forcing
from zerostate.explorer.generate import seed_of
from zerostate.explorer.pairs import kept_draws
from zerostate.model.scenario import Scenario

FROM_EXAMPLES = 100
"""Goals run in explorations of at least this many examples (the default 200): a smaller one is a quick look."""


@dataclass(frozen=True)
class Goal:
    name: str
    """``known:<issue id>`` (its scenario's family), ``known:<issue id>/<i>`` (its variant ``i``'s, numbered as
    `known.recorded` numbers the repros), or ``survey:<combination>`` (`SURVEY`)."""
    title: str
    needs: tuple[dict[str, Value], ...]
    """Per repro, what a scenario must have (`doctor.dimensions.requirements`)."""
    repros: tuple[Scenario, ...]

    def reached_by(self, sc: Scenario) -> bool:
        return any(all(BY_NAME[d].holds(v, BY_NAME[d].of_scenario(sc)) for d, v in need.items())
                   for need in self.needs)


def _sc(**d: object) -> Scenario:
    return Scenario.from_dict(d)


def _need(**d: Value) -> dict[str, Value]:
    return d


_ZERO12 = ({"stage": 1}, {"stage": 2})
SURVEY: tuple[tuple[str, tuple[dict[str, Value], ...], Scenario], ...] = (
    # (name, what a scenario needs -- alternatives --, a scenario that has it)
    ("ZeRO-3 + reentrant + PyTorch-style backward (seed 000)",
     ({"stage": 3, "reentrant_checkpointing": True, "pytorch_backward": True},),
     _sc(stage=3, blocks=[{"checkpoint": "reentrant"}], steps=[{"micro": [{"backward": "torch"}]}])),
    ("ZeRO-3 + re-registration", ({"stage": 3, "hooks_reregistered": True},),
     _sc(stage=3, steps=[{}, {"reregister": True}])),
    ("ZeRO-1/2 + optimizer offload + gradient accumulation",
     tuple({**z, "offload_optimizer": True, "offload_param": False, "accumulation": True} for z in _ZERO12),
     _sc(stage=2, offload="optimizer", steps=[{"micro": [{}, {}, {}]}])),
    ("ZeRO-1/2 + optimizer offload + manual boundary",
     tuple({**z, "offload_optimizer": True, "offload_param": False, "manual_boundary": True} for z in _ZERO12),
     _sc(stage=2, offload="optimizer", manual_boundary=True, steps=[{"micro": [{}, {}]}])),
    ("ZeRO-3 + late module", ({"stage": 3, "late_module": True},), _sc(stage=3, late_module=True)),
    ("ZeRO-0 + bf16", ({"stage": 0, "precision": "bf16"},), _sc(stage=0, precision="bf16")),
    ("ZeRO-0 + fp16", ({"stage": 0, "precision": "fp16"},), _sc(stage=0, precision="fp16")),
    ("ZeRO-1/2 + contiguous_gradients off", tuple({**z, "no_contiguous_gradients": True} for z in _ZERO12),
     _sc(stage=2, contiguous_gradients=False)),
    ("ZeRO-1/2 + contiguous_gradients off + no offload at several ranks",
     tuple({**z, "no_contiguous_gradients": True, "offload_optimizer": False, "world_size": 2} for z in _ZERO12),
     _sc(stage=2, contiguous_gradients=False, world_size=2)),
    ("ZeRO-3 + all-reduce fetch", ({"stage": 3, "all_reduce_fetch": True},), _sc(stage=3, all_reduce_fetch=True)),
    ("engines before it", ({"several_engines": True},), _sc(stage=2, engines_before=[3])),
    ("config Adam + requires_grad changed between steps, ZeRO-1/2/3",
     tuple({"stage": z, "adam": True, "freeze_toggle": True} for z in (1, 2, 3)),
     _sc(stage=3, optimizer="config-adam", steps=[{}, {"frozen": [0]}])),
    ("config Adam at ZeRO-1/2 (DeepSpeed #7948's path)", tuple({**z, "adam": True} for z in _ZERO12),
     _sc(stage=2, optimizer="config-adam")),
    ("ZeRO-3 + checkpoint round trip", ({"stage": 3, "checkpoint_save": True},),
     _sc(stage=3, steps=[{}, {"save_load": True}])),
    ("ZeRO-1/2 + checkpoint round trip", tuple({**z, "checkpoint_save": True} for z in _ZERO12),
     _sc(stage=2, steps=[{}, {"save_load": True}])),
    ("world size 2", ({"world_size": 2},), _sc(stage=3, world_size=2)),
    ("world size 4", ({"world_size": 4},), _sc(stage=2, contiguous_gradients=False, world_size=4)),
    ("ZeRO-3 + zero_init", ({"stage": 3, "zero_init": True},),
     _sc(stage=3, zero_init=True, family="llama", lora=True, precision="bf16")),
    # the scenario language's optimizer dimensions: each stage with a scheduler either way and HF's groups
    *((f"ZeRO-{z} + LR scheduler {how}", (_need(stage=z, lr_scheduler=how),), _sc(stage=z, scheduler=how))
      for z in (0, 1, 2, 3) for how in ("initialize", "user")),
    *((f"ZeRO-{z} + HF's optimizer groups", (_need(stage=z, hf_param_groups=True),), _sc(stage=z, decay_groups=True))
      for z in (0, 1, 2, 3)),
    *((f"ZeRO-{z} + a module unused in some steps", (_need(stage=z, module_unused_in_step=True),),
       _sc(stage=z, blocks=[{}, {}], steps=[{}, {"unused": [0]}])) for z in (1, 2, 3)),
    ("ZeRO-3 + a module unused in some steps + prefetch",
     (_need(stage=3, module_unused_in_step=True, prefetch=True),),
     _sc(stage=3, blocks=[{}, {}, {}], prefetch_bucket_size=1000, steps=[{}, {"unused": [1]}, {}, {"unused": [1]}])),
    ("config Adam + a module unused in some steps",
     (_need(adam=True, module_unused_in_step=True),),
     _sc(stage=2, optimizer="config-adam", blocks=[{}, {}], steps=[{}, {"unused": [0]}])),
    # HF Trainer's resume into a fresh engine: each stage, with what a resume must restore (Adam's state, the fp16
    # loss scale, a scheduler DeepSpeed steps, ZeRO-3's persistent parameters), at two ranks, PEFT's LoRA
    *((f"ZeRO-{z} + resume into a fresh engine", (_need(stage=z, resume_fresh_engine=True),),
       _sc(stage=z, steps=[{}, {"resume": True}])) for z in (0, 1, 2, 3)),
    ("config Adam + resume into a fresh engine", (_need(adam=True, resume_fresh_engine=True),),
     _sc(stage=2, optimizer="config-adam", steps=[{}, {"resume": True}])),
    ("fp16 + resume into a fresh engine", (_need(precision="fp16", resume_fresh_engine=True),),
     _sc(stage=2, precision="fp16", steps=[{}, {"resume": True}])),
    ("LR scheduler passed to initialize + resume into a fresh engine",
     (_need(lr_scheduler="initialize", resume_fresh_engine=True),),
     _sc(stage=1, scheduler="initialize", steps=[{}, {"resume": True}])),
    ("ZeRO-3 + persistent parameters + resume into a fresh engine",
     (_need(stage=3, persistent_params=True, resume_fresh_engine=True),),
     _sc(stage=3, width=7, persistence_threshold=8, steps=[{}, {"resume": True}])),
    ("ZeRO-3 + resume into a fresh engine at two ranks", (_need(stage=3, resume_fresh_engine=True, world_size=2),),
     _sc(stage=3, world_size=2, steps=[{}, {"resume": True}])),
    ("ZeRO-3 + LoRA + resume into a fresh engine", (_need(stage=3, lora=True, resume_fresh_engine=True),),
     _sc(stage=3, family="llama", lora=True, steps=[{}, {"resume": True}])),
    # separate losses of one retained graph with zero_grad between them: each stage, and each precision at ZeRO-1
    *((f"ZeRO-{z} + zero_grad between two backwards of one graph", (_need(stage=z, zero_grad_between_backwards=True),),
       _sc(stage=z, steps=[{"micro": [{"retain": True, "zero_grad": True}]}])) for z in (0, 1, 2, 3)),
    *((f"{p} + zero_grad between two backwards of one graph",
       (_need(stage=1, precision=p, zero_grad_between_backwards=True),),
       _sc(stage=1, precision=p, steps=[{"micro": [{"retain": True, "zero_grad": True}]}])) for p in ("bf16", "fp16")),
    # the loop's own GatheredParameters: a read (TRL's weight sync) and an edit (DeepSpeed's documented way), between
    # steps at every stage, inside a step, at two ranks, and TRL's LoRA read
    *((f"ZeRO-{z} + GatheredParameters {how}", (_need(stage=z, gathered_parameters=how),),
       _sc(stage=z, steps=[{}, {"gather": how}])) for z in (0, 1, 2, 3) for how in ("read", "edit")),
    *((f"ZeRO-{z} + GatheredParameters {how} between a backward and engine.step()",
       (_need(stage=z, gathered_parameters=how, gathered_inside_step=True),),
       _sc(stage=z, steps=[{}, {"gather": how, "gather_inside": True}])) for z in (2, 3) for how in ("read", "edit")),
    *((f"ZeRO-3 + GatheredParameters {how} at two ranks", (_need(stage=3, gathered_parameters=how, world_size=2),),
       _sc(stage=3, world_size=2, steps=[{}, {"gather": how}])) for how in ("read", "edit")),
    ("ZeRO-0 + fp16 + GatheredParameters edit", (_need(stage=0, precision="fp16", gathered_parameters="edit"),),
     _sc(stage=0, precision="fp16", steps=[{}, {"gather": "edit"}])),
    ("ZeRO-3 + LoRA + GatheredParameters read (TRL's weight sync)",
     (_need(stage=3, lora=True, gathered_parameters="read"),),
     _sc(stage=3, family="llama", lora=True, steps=[{}, {"gather": "read"}])),
    ("ZeRO-3 + LoRA + HF's optimizer groups (one empty) + LR scheduler",
     (_need(stage=3, empty_param_group=True, lr_scheduler="initialize"),),
     _sc(stage=3, family="llama", lora=True, decay_groups=True, scheduler="initialize")),
)
"""The combinations docs/bug-coverage.md's survey of DeepSpeed bugs needs beyond the known issues' own families: goals
too, so their reach is the round's, not the generated sequence's."""


def goals() -> tuple[Goal, ...]:
    """One goal per repro of each known DeepSpeed issue (bugs and limitations, fixed ones too: a fixed bug's family
    is where its regression would show), in the table's order: its scenario's family, then each variant's whose
    requirements differ from the repros' before it -- a variant is another form of the mechanism (another stage,
    backward kind, optimizer), found only where that form runs, so each form is run, not only one per issue;
    then the survey's combinations (`SURVEY`)."""
    from zerostate.known.issues import KNOWN_ISSUES

    out = []
    for k in KNOWN_ISSUES:
        if k.owner != "deepspeed":
            continue
        seen: list[dict[str, Value]] = []
        for i, r in enumerate((k.scenario, *k.variants)):
            repro = r.with_(world_size=max(r.world_size, k.world_size))
            need = requirements(repro)
            if need in seen:
                continue
            seen.append(need)
            name, title = (f"known:{k.id}", k.title) if i == 0 else (f"known:{k.id}/{i}", f"{k.title} (variant {i})")
            out.append(Goal(name, title, (need,), (repro,)))
    out += [Goal(f"survey:{name}", name, needs, (repro,)) for name, needs, repro in SURVEY]
    return tuple(out)


_ONE = frozenset({1})
FORCES: dict[str, dict[Value, dict[str, frozenset[int]]]] = {
    "stage": {3: {"stage": frozenset({0})}, 1: {"stage": frozenset({1}), "extra:stage0": frozenset({0})},
              2: {"stage": frozenset({2}), "extra:stage0": frozenset({0})},
              0: {"stage": frozenset({1, 2}), "extra:stage0": _ONE}},
    "precision": {"bf16": {"precision": _ONE}, "fp16": {"precision": frozenset({2})}},
    "fp32_grad_accum": {True: {"fp32_grad_accum": _ONE}},
    "offload_optimizer": {True: {"offload": frozenset({1, 3})}},
    "offload_param": {True: {"offload": frozenset({2, 3})}},
    "adam": {True: {"extra:config_adam": _ONE}},
    "clipping": {True: {"clipping": frozenset({1, 2})}},
    "accumulation": {True: {"extra:gas3": _ONE}},
    "persistent_params": {True: {"persistence": frozenset({1, 2})}},
    "no_contiguous_gradients": {True: {"extra:contiguous_gradients": _ONE}},
    "overlap_comm_changed": {True: {"extra:overlap_comm": _ONE}},
    "no_reduce_scatter": {True: {"extra:reduce_scatter": _ONE}},
    "all_reduce_fetch": {True: {"extra:all_reduce_fetch": _ONE}},
    "zero_init": {True: {"extra:zero_init": _ONE}},
    "empty_param": {True: {"extra:zero_init": _ONE}},
    "reentrant_checkpointing": {True: {"checkpoint": _ONE}},
    "non_reentrant_checkpointing": {True: {"checkpoint": frozenset({2})}},
    "z3_leaf": {True: {"leaf": _ONE}},
    "hf_model": {True: {"llama": _ONE}},
    "lora": {True: {"llama": _ONE}},
    "modules_to_save": {True: {"llama": _ONE}},
    "small_reduce_bucket": {True: {"reduce_bucket": frozenset({1, 2})}},
    "several_engines": {True: {"engines_before": frozenset(range(1, 9))}},
    "retain_graph": {True: {"retain": _ONE}},
    "idle_step": {True: {"idle": _ONE}},
    "manual_boundary": {True: {"extra:manual_boundary": _ONE}},
    "late_module": {True: {"extra:late_module": _ONE}},
    "lr_scheduler": {"initialize": {"scheduler": _ONE}, "user": {"scheduler": frozenset({2})}},
    "hf_param_groups": {True: {"decay_groups": _ONE}},
    "module_unused_in_step": {True: {"unused_in_step": _ONE}},
    "gathered_parameters": {"read": {"gathered": _ONE}, "edit": {"gathered": frozenset({2})}},
    "resume_fresh_engine": {True: {"resume": _ONE}},
    "zero_grad_between_backwards": {True: {"zero_grad": _ONE, "extra:gas3": frozenset({0}),
                                           "extra:manual_boundary": frozenset({0})}},
    "gathered_inside_step": {True: {"gathered": frozenset({1, 2}), "gathered_inside": _ONE}},
    "empty_param_group": {True: {"decay_groups": _ONE}},
}
"""Which choice points' alternatives (`choices.POINTS`) make a dimension's value likely in a draw; a dimension not
here (frozen parameters, a PyTorch-style backward, an eval forward ...) is left to the draws' own rates."""


def force_of(need: dict[str, Value]) -> Weights | None:
    """The default rates with what ``need`` asks of the choice points forced; None when two of its dimensions ask for
    different alternatives of one point (its draws then use the default rates)."""
    want: dict[str, frozenset[int]] = {}
    for dim, value in need.items():
        for point, alts in FORCES.get(dim, {}).get(value, {}).items():
            want[point] = want.get(point, alts) & alts
    if any(not alts for alts in want.values()):
        return None
    index = {p.name: k for k, p in enumerate(POINTS)}
    return forcing({index[point]: alts for point, alts in want.items()})


def _draws(need: dict[str, Value], seed: int | None) -> tuple[Scenario, ...]:
    """`DRAWS` scenarios drawn with ``need``'s points forced: a function of the rates and the seed, kept on disk
    under the rates (two goals forcing the same points share their draws)."""
    weights = force_of(need)
    # a goals-only point at its default rate is left out of the key (goals that do not force one draw as before); a
    # forced one enters with its index, negated (no weight is negative), so two such points never share a key
    table = (weights or DEFAULT).table
    key = tuple(x for row in table[:len(PAIRED)] for x in row) + tuple(
        x for k in range(len(PAIRED), len(table)) if table[k] != DEFAULT.table[k] for x in (-(k + 1), *table[k]))
    return kept_draws(key, weights, zlib.crc32(repr((seed_of(seed), key)).encode()))


@dataclass
class Reach:
    """What the goals round made of the runs before it."""

    goals: int = 0
    by_runs: list[str] = field(default_factory=list)
    """Goals a generated or completion example reached."""
    by_draws: list[str] = field(default_factory=list)
    """Goals reached by a forced draw, run in the goals round."""
    by_round: list[str] = field(default_factory=list)
    """Goals reached by an example the round ran for an earlier goal."""
    by_repro: list[str] = field(default_factory=list)
    """Goals no draw reached: their own repro ran (a family the strategy does not draw)."""
    examples: list[Scenario] = field(default_factory=list)
    for_goal: dict[str, Scenario] = field(default_factory=dict)
    """Goal -> the round's example that reaches it (by_draws, by_round, by_repro)."""
    not_run: list[str] = field(default_factory=list)
    """Goals of the round whose example did not run (skipped by the target, or the exploration stopped first): not
    reached, whatever the lists above say."""
    skipped: str = ""
    """Why no goal was judged (a small exploration), or ""."""

    def to_dict(self) -> dict[str, object]:
        return {"goals": self.goals, "reached_by_runs": len(self.by_runs), "reached_by_forced_draws": self.by_draws,
                "reached_by_another_goals_example": self.by_round,
                "run_as_their_repro": self.by_repro, "examples": len(self.examples), "not_run": self.not_run,
                **({"skipped": self.skipped} if self.skipped else {})}


def reach(ran: Iterable[Scenario], seed: int | None, table: Sequence[Goal] | None = None) -> Reach:
    """The goals round after ``ran`` (the runs that ran: a skipped one reaches nothing): each goal no scenario of
    ``ran`` reached gets the first of its forced draws (per repro, in order) that reaches it and is new, else its first
    repro not run."""
    table = goals() if table is None else table
    before = list(dict.fromkeys(ran))
    seen = list(before)
    out = Reach(goals=len(table))
    for goal in table:
        if any(goal.reached_by(sc) for sc in before):
            out.by_runs.append(goal.name)
            continue
        earlier = next((sc for sc in out.examples if goal.reached_by(sc)), None)
        if earlier is not None:
            out.by_round.append(goal.name)
            out.for_goal[goal.name] = earlier
            continue
        pick = next((sc for need in goal.needs for sc in _draws(need, seed)
                     if goal.reached_by(sc) and sc not in seen), None)
        if pick is not None:
            out.by_draws.append(goal.name)
        else:
            pick = next((r for r in goal.repros if r not in seen), goal.repros[0])
            out.by_repro.append(goal.name)
        out.examples.append(pick)
        out.for_goal[goal.name] = pick
        seen.append(pick)
    return out


__all__ = ["FORCES", "FROM_EXAMPLES", "Goal", "Reach", "force_of", "goals", "reach"]
