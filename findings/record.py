"""`RunRecord`: what one run of a scenario on real DeepSpeed showed, observed inside the worker.

The worker only observes: the trace, what was raised (its type, message and frames), the numbers that compare
DeepSpeed's parameters with plain PyTorch's after every train step (values and updates on both sides, the
bf16 master weights, the counterfactual updates the oracle computed), the loss scaler, each checkpoint round
trip, the engine's own report of its settings.  No verdict and no sentence is made there: `findings.decide`
judges a record and words what fails.  A record is frozen, made of frozen dataclasses and tuples, and crosses
the process boundary through one codec (`findings.wire`).

Stdlib only (and the model's events): the repro scripts embed this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerostate.model.events import Event

Shape = tuple[int, ...]

PACKAGES = ("deepspeed", "torch", "transformers", "peft", "zerostate")
"""The packages a frame is placed in (`Frame.package`); any other code is ``other``."""


@dataclass(frozen=True)
class Frame:
    """One frame of a raised exception's traceback."""

    package: str
    """``deepspeed``, ``torch``, ``transformers``, ``peft``, ``zerostate`` or ``other``: the top-level package
    of the module the frame's code was imported as (`harness.observe.frames_of`), whatever folder holds it."""
    file: str
    """The file inside its package: ``runtime/zero/stage3.py``."""
    function: str
    line: int = 0
    module: str = ""
    """The module's name (``deepspeed.runtime.zero.stage3``); "" for code no module holds."""

    def at(self, file: str, function: str | None = None) -> bool:
        """In DeepSpeed's ``file`` (a path suffix: ``zero/stage3.py``), in ``function`` when given."""
        return (self.package == "deepspeed" and self.file.endswith(file)
                and (function is None or self.function == function))


@dataclass(frozen=True)
class ExceptionRecord:
    """An exception the run raised."""

    text: str
    """``"ExcType: message"`` (the run's temporary folders blanked)."""
    traceback: str
    """The traceback's last lines, as Python prints them."""
    frames: tuple[Frame, ...] = ()
    """Every frame of the traceback, outermost first (at most `MAX_FRAMES`)."""
    checkpoint_error: bool = False
    """torch's ``CheckpointError``: a tensor saved for backward changed before it was unpacked."""
    in_oracle: bool = False
    """The PyTorch oracle raised, not DeepSpeed's run: zerostate's own failure."""

    @property
    def shown(self) -> str:
        """What a report says was raised: the text, after ``oracle:`` for the oracle's own error."""
        return ("oracle: " if self.in_oracle else "") + self.text

    @property
    def type(self) -> str:
        head, _, _ = self._first_line().partition(":")
        return head.strip()

    @property
    def message(self) -> str:
        """The first line of the text, after the type."""
        return self._first_line().partition(":")[2].strip()

    def _first_line(self) -> str:
        return self.text.lstrip().splitlines()[0] if self.text.strip() else ""


MAX_FRAMES = 200
"""Frames kept of a traceback: the innermost ones (DeepSpeed's and torch's are there)."""


@dataclass(frozen=True)
class Elementwise:
    """One tensor of a reference set against the same-named tensor of another, element by element."""

    name: str
    want_shape: Shape
    got_shape: Shape | None
    """None: the other set has no tensor of that name."""
    err_max: float = 0.0
    """max |got - want| (0 when the shapes differ)."""
    want_max: float = 0.0
    """max |want|: a relative tolerance scales with it."""


Comparison = tuple[Elementwise, ...]
"""A set of tensors against a reference set, in the reference's order."""


@dataclass(frozen=True)
class Counterfactual:
    """DeepSpeed's update of one parameter at one train step against an update the oracle's optimizer makes
    from a part of the step's gradient (`harness.net.oracle.Counterfactuals`)."""

    name: str
    """``last_only``: the step's last backward's gradient alone; ``but_last``: the rest of it."""
    err_max: float
    """max |DeepSpeed's update - the counterfactual update|."""


@dataclass(frozen=True)
class ParamStep:
    """One parameter after one train step: DeepSpeed's (its 16-bit or fp32 parameter, or its fp32 master
    weight) against PyTorch's.  ``pt``: PyTorch's value after the step; ``ds``: DeepSpeed's; a *start* is
    where the side began that step; the *run start* where it began the run."""

    name: str
    want_shape: Shape
    got_shape: Shape | None
    """None: DeepSpeed reported no such parameter."""
    err_max: float = 0.0
    """max |ds - pt|."""
    want_max: float = 0.0
    """max |pt|."""
    update_sq: float | None = None
    """|pt - pt's start|^2; None when a start is unknown or a shape differs (then no update field is set)."""
    ds_update_norm: float = 0.0
    """|ds - ds's start| (torch's norm of the difference)."""
    dot: float = 0.0
    """(ds - ds's start) . (pt - pt's start)."""
    again_dot: float | None = None
    """(ds - ds's start) . PyTorch's update of the step before; None at the first step."""
    again_sq: float | None = None
    """|PyTorch's update of the step before|^2."""
    counterfactuals: tuple[Counterfactual, ...] = ()
    run_update_sq: float | None = None
    """|pt - pt's run start|^2; None when a run start is unknown or a shape differs."""
    ds_run_update_sq: float | None = None
    """|ds - ds's run start|^2; None when DeepSpeed's run start is unknown."""
    want_sq: float = 0.0
    """|pt|^2."""
    diff_sq: float = 0.0
    """|ds - pt|^2."""
    run_update_max: float = 0.0
    """max |pt - pt's run start|."""
    update_err_max: float | None = None
    """max |(ds - ds's start) - (pt - pt's start)|: how far DeepSpeed's update of the step is from PyTorch's; None
    when an update field is (a start is unknown or a shape differs)."""
    update_max: float = 0.0
    """max |pt - pt's start|."""
    dtype: str = "float32"
    """DeepSpeed's tensor's dtype (``float32``, ``bfloat16``, ``float16``): the resolution its update has."""
    noise_max: float = 0.0
    """Mixed precision: the largest element of the update's measured noise (`harness.net.oracle.TorchBackend._noise`:
    how much of each element the 16-bit precision leaves undetermined; Adam makes a gradient element near its
    ``eps`` any share of the learning rate); 0 in fp32."""
    update_excess_max: float | None = None
    """Mixed precision: max over the elements of how far DeepSpeed's update is from PyTorch's beyond
    `tolerance.NOISE_TIMES` times that element's measured noise (what the judgement compares, in place of
    ``update_err_max``, with the limit); None without a noise measurement (fp32, a step the scaler skipped)."""


@dataclass(frozen=True)
class StepObservation:
    """DeepSpeed against PyTorch after one train step."""

    step: int
    params: tuple[ParamStep, ...]
    """Every parameter of PyTorch's model, in its order."""
    masters: tuple[ParamStep, ...] | None = None
    """bf16 / fp16: DeepSpeed's fp32 master weights against the mixed-precision oracle's, for the parameters it
    keeps one of (ZeRO's optimizers, ``BF16_Optimizer``, stage 0's fp16 optimizers); None when none were read
    (fp32, or none kept)."""
    generations: int = 0
    """How many generations (TRL's unwrap) DeepSpeed's side had made by then."""
    ds_run_start_known: bool = False
    """Mixed precision: DeepSpeed's own parameters before training were read (the update-norm check's start)."""
    reads: int = 0
    """How many reads under the loop's own ``GatheredParameters`` (``gather: read``) DeepSpeed's side had made by
    then."""


@dataclass(frozen=True)
class Generation:
    """One generation of TRL's unwrap: DeepSpeed's output against the oracle's (this rank's rows)."""

    want_shape: Shape | None
    """None: the oracle made no output to compare (not compared)."""
    got_shape: Shape
    err_max: float = 0.0
    want_max: float = 0.0


@dataclass(frozen=True)
class LossScaling:
    """fp16: DeepSpeed's loss scaler at the end of the run and the oracle's (DeepSpeed's policy in PyTorch)."""

    ds_skipped: int
    ds_scale: float
    pt_skipped: tuple[int, ...] | None = None
    """The train steps the oracle's scaler skipped for an overflow."""
    pt_scales: tuple[float, ...] | None = None
    """The scale each of the oracle's train steps ran with."""
    pt_scale: float | None = None
    """The oracle's scale after the last step (the one the next step would run with)."""


@dataclass(frozen=True)
class CounterfactualRun:
    """DeepSpeed's run against a counterfactual reference: the same run trained by plain PyTorch with known bugs'
    mechanisms applied (`harness.net.counterfactual`), observed as against the correct one."""

    mechanisms: tuple[str, ...]
    steps: tuple[StepObservation, ...] = ()
    loss_scaling: LossScaling | None = None
    error: str | None = None
    """The counterfactual reference could not be computed (what it raised)."""


@dataclass(frozen=True)
class Counters:
    """The engine state a checkpoint round trip must keep."""

    global_steps: int
    skipped_steps: int
    loss_scale: float | None = None

    def as_text(self) -> str:
        """As a report prints it (the form of a dict)."""
        return str({"global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                    "loss_scale": self.loss_scale})


@dataclass(frozen=True)
class CheckpointRoundTrip:
    """One ``save_load`` (`harness.net.checkpoint.round_trip`): what was written and loaded, compared."""

    step: int
    files: tuple[str, ...] | None
    loaded: str | None
    """What ``load_checkpoint`` returned first (the path it loaded), as text; None (or "") when it loaded
    nothing."""
    loaded_repr: str
    """The same, as Python's repr (what a report quotes)."""
    state16: tuple[str, ...] | None
    """ZeRO-3: the keys of the consolidated 16-bit state dict (None below ZeRO-3 or when rank 0 got none)."""
    fp32: tuple[str, ...] | None
    """The keys of the fp32 weights ``zero_to_fp32`` rebuilds (None at ZeRO-0)."""
    state16_vs_engine: Comparison | None = None
    """The 16-bit state dict against the engine's parameters before the save."""
    state16_vs_oracle: Comparison | None = None
    """... against the oracle's parameters at that point."""
    after_vs_before: Comparison = ()
    """The engine's parameters after the load against those before the save."""
    counters_before: Counters | None = None
    counters_after: Counters | None = None
    fp32_vs_engine: Comparison | None = None
    fp32_vs_oracle: Comparison | None = None
    fp32_exact: bool = False
    """fp32 training: ``zero_to_fp32``'s weights must equal the engine's exactly."""
    masters_restored: Comparison | None = None
    """This rank's fp32 master partitions after the load against those saved (None: none kept)."""


@dataclass(frozen=True)
class ResumeObservation:
    """One resume into a fresh engine (``TrainStep.resume``: `harness.net.engine.DeepSpeedBackend.resume`)."""

    step: int
    loaded: bool
    """``load_checkpoint`` into the fresh engine found the checkpoint."""
    destroy_error: str | None = None
    """What the old engine's ``destroy()`` raised, if anything."""
    counters_before: Counters | None = None
    """The old engine's counters at the save."""
    counters_after: Counters | None = None
    """The fresh engine's after the load."""


@dataclass(frozen=True)
class Persistent:
    """ZeRO-3: whether the engine marked one parameter persistent, and its size."""

    name: str
    numel: int
    persistent: bool


@dataclass(frozen=True)
class GroupSettings:
    lr: float | None = None
    eps: float | None = None
    betas: tuple[float, ...] | None = None
    weight_decay: float | None = None


@dataclass(frozen=True)
class OptimizerBuilt:
    """Which optimizer the engine holds under its ZeRO / precision wrapper."""

    class_name: str | None
    from_config: bool
    """DeepSpeed built it from the config (no client optimizer was passed)."""
    groups: tuple[GroupSettings, ...] = ()


@dataclass(frozen=True)
class EngineSettings:
    """What the built engine reports of the settings a scenario chooses (`harness.net.engine.engine_settings`),
    so a test can tell that a scenario option reached DeepSpeed."""

    gradient_accumulation_steps: int
    contiguous_gradients: bool
    overlap_comm: bool
    reduce_scatter: bool
    late_module: bool
    world_size: int
    optimizer: OptimizerBuilt
    all_reduce_fetch: bool | None
    """ZeRO-3's all-reduce fetch flag of the ``zero.Init`` that converted the parameters; None if absent."""
    built_partitioned: int = 0
    """Parameters ``zero.Init`` had partitioned before ``deepspeed.initialize``."""
    unwrap_gathered: tuple[int, ...] = ()
    """After a ZeRO-3 ``reregister`` (TRL's unwrap): the parameters available while the unhooked module
    generated, one count per unwrap."""


@dataclass(frozen=True)
class RunRecord:
    """Everything one run showed.  See the module docstring."""

    events: tuple[Event, ...] = ()
    raised: ExceptionRecord | None = None
    skipped: str | None = None
    """Why the scenario could not be trained at all, or not here (`harness.executor.untrainable`,
    `unrunnable`, the oracle's `NothingToDifferentiate`); nothing else is set then."""
    steps: tuple[StepObservation, ...] = ()
    """One per train step DeepSpeed finished, compared with the oracle's."""
    generations: tuple[Generation, ...] = ()
    """Every generation DeepSpeed made (TRL's unwrap), against the oracle's of the same index."""
    oracle_generations: int = 0
    """How many generations the oracle made."""
    reads: tuple[Generation, ...] = ()
    """Every read under the loop's own ``GatheredParameters``: every parameter as DeepSpeed gathered it, against
    the oracle's parameters at the same point (its 16-bit copy in mixed precision, what the engine's module holds)."""
    oracle_reads: int = 0
    loss_scaling: LossScaling | None = None
    checkpoints: tuple[CheckpointRoundTrip, ...] = ()
    resumes: tuple[ResumeObservation, ...] = ()
    engine: EngineSettings | None = None
    persistence: tuple[Persistent, ...] | None = None
    """ZeRO-3: every parameter's persistence as the engine marked it."""
    torch_linear: str = ""
    """``module.name`` of ``torch.nn.functional.linear`` while the engine ran (DeepSpeed's ``zero3_linear_wrap``
    when an earlier ZeRO-3 engine left it in place)."""
    engines_before: tuple[str, ...] = ()
    """One line per engine run before the scenario's own (``"ZeRO-3: ok"`` or its exception)."""
    masters_unread: tuple[tuple[str, str], ...] = ()
    """bf16: (parameter, DeepSpeed's error) for each parameter whose master copy its accessor could not give."""
    torch_linear_replaced: bool = False
    """After the run ``torch.nn.functional.linear`` was DeepSpeed's (a ZeRO-3 engine ran); put back since."""
    teardown_error: str | None = None
    """What the engine's ``destroy()`` at the end of the run raised, when it did."""
    counterfactuals: tuple[CounterfactualRun, ...] = ()
    """When DeepSpeed differs from the correct reference: the same run against each counterfactual reference of
    the known mechanisms the scenario can trigger, alone and, when none alone explains it, in pairs."""

    @property
    def error(self) -> str | None:
        """``"ExcType: message"`` of what the run raised (``"oracle: ..."`` for the oracle's own), else None."""
        return self.raised.shown if self.raised is not None else None

    @property
    def max_diff(self) -> float:
        """The largest |DeepSpeed - PyTorch| over every parameter of every compared step."""
        return max((p.err_max for s in self.steps for p in s.params if p.got_shape == p.want_shape), default=0.0)


__all__ = ["MAX_FRAMES", "PACKAGES", "CheckpointRoundTrip", "Comparison", "Counterfactual", "CounterfactualRun",
           "Counters", "Elementwise", "EngineSettings", "ExceptionRecord", "Frame", "Generation", "GroupSettings",
           "LossScaling", "OptimizerBuilt", "ParamStep", "Persistent", "RunRecord", "Shape", "StepObservation"]
