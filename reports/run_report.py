"""The report of one run (``explore``, ``check``, ``compare``, ``replay``) as a value: `RunReport`, which
``report.json`` serialises (`RunReport.to_json`, in the key order docs/report-format.md shows) and
``report.md`` renders (`report_markdown`).  `report_folder.Report` builds it as the run goes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zerostate.reports.finding_entry import FindingEntry
from zerostate.reports.json_value import Json, JsonObject

FORMAT = 1
NOT_CHECKED = "not checked"
NOT_EXERCISED = "not exercised"
"""A spec no run gave anything to judge (`specs.exercised`): never "ok"."""


@dataclass(frozen=True)
class SpecRow:
    """One spec (or one check that is not a spec: ``exception``, ``oracle``): its result per column, the
    findings that violate it."""

    sentence: str
    family: str
    results: Mapping[str, str]
    """Column -> ``ok`` / ``holds`` / ``violated`` / ``not checked`` / ..."""
    findings: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Json]:
        return {"sentence": self.sentence, "family": self.family, "results": dict(self.results),
                "findings": list(self.findings)}


@dataclass(frozen=True)
class Reliability:
    """explore: the findings confirmed by a replay in a fresh worker, out of those reported; the worker
    restarts and the lanes a cluster ran again, as their makers recorded them."""

    reported: int = 0
    confirmed: int = 0
    order_dependent: int = 0
    intermittent: int = 0
    not_reproduced: int = 0
    not_checked: int = 0
    """Not confirmed: the run was interrupted before the replay."""
    restarts: tuple[JsonObject, ...] = ()
    """`explorer.exploration_events.Restarted` records: ``example``, ``why``."""
    cluster_retries: tuple[JsonObject, ...] | None = None
    """`cluster` retry records; None: no cluster ran this."""

    @classmethod
    def of(cls, findings: Sequence[FindingEntry], restarts: Sequence[JsonObject] = (),
           cluster_retries: Sequence[JsonObject] | None = None) -> Reliability:
        st = [f.confirmation.status if f.confirmation else "not-checked" for f in findings]
        return cls(len(findings), st.count("confirmed"), st.count("order-dependent"), st.count("intermittent"),
                   st.count("not-reproduced"), st.count("not-checked"), tuple(restarts),
                   None if cluster_retries is None else tuple(cluster_retries))

    def to_json(self) -> dict[str, Json]:
        out: dict[str, Json] = {
            "reported": self.reported, "confirmed": self.confirmed, "order_dependent": self.order_dependent,
            "intermittent": self.intermittent, "not_reproduced": self.not_reproduced,
            "not_checked": self.not_checked, "restarts": list(self.restarts)}
        if self.cluster_retries is not None:
            out["cluster_retries"] = list(self.cluster_retries)
        return out


@dataclass(frozen=True)
class HarnessError:
    """A finding that is zerostate's own failure, not one about DeepSpeed."""

    n: int
    key: str
    why: str

    def to_json(self) -> dict[str, Json]:
        return {"n": self.n, "key": self.key, "why": self.why}


@dataclass(frozen=True)
class WhatRan:
    """What ran: the command's own description of it (target, release or design, budget, seed, command line:
    its keys, in its order), then when it started, how long it took, and how it ended early."""

    described: JsonObject
    started: str
    seconds: float = 0.0
    examples_run: int | None = None
    """explore: distinct runs so far (the examples, then shrinking)."""
    stopped: str | None = None
    """Why the run stopped before its budget was spent (a time budget, a target that broke)."""

    def to_json(self) -> dict[str, Json]:
        out: dict[str, Json] = {**self.described, "started": self.started, "seconds": self.seconds}
        if self.examples_run is not None:
            out["examples_run"] = self.examples_run
        if self.stopped is not None:
            out["stopped"] = self.stopped
        return out


@dataclass(frozen=True)
class RunReport:
    """Everything ``report.json`` holds."""

    zerostate: str
    command: str
    status: str
    """``running``, ``complete`` or ``interrupted``."""
    run: WhatRan
    columns: tuple[str, ...]
    specs: Mapping[str, SpecRow]
    findings: tuple[FindingEntry, ...]
    summary: JsonObject
    """What the command printed with ``--json`` (explore's summary, check's and compare's results)."""
    reliability: Reliability | None = None
    """explore's; None for the other commands."""
    harness_errors: tuple[HarnessError, ...] | None = None
    """None where the run does not count them (a model design has none)."""
    pairs: Json = None
    """explore: the setup pairs the examples took and left (`explorer.pairs`)."""
    steering: Json = None
    """explore --steer: every round's draw weights and what each reached first."""
    summary_text: str | None = None
    """check, compare: the table the command printed."""

    @property
    def about_the_target(self) -> tuple[FindingEntry, ...]:
        """The findings, less zerostate's own failures (harness errors)."""
        return tuple(f for f in self.findings if not f.harness_error)

    @property
    def own_failures(self) -> tuple[FindingEntry, ...]:
        return tuple(f for f in self.findings if f.harness_error)

    def to_json(self) -> dict[str, Json]:
        out: dict[str, Json] = {
            "format": FORMAT, "zerostate": self.zerostate, "command": self.command, "status": self.status,
            "run": self.run.to_json(), "columns": list(self.columns),
            "specs": {sid: row.to_json() for sid, row in self.specs.items()},
            "findings": [f.to_json() for f in self.findings], "summary": self.summary}
        if self.reliability is not None:
            out["reliability"] = self.reliability.to_json()
        if self.harness_errors is not None:
            out["harness_errors"] = [h.to_json() for h in self.harness_errors]
        if self.pairs is not None:
            out["pairs"] = self.pairs
        if self.steering is not None:
            out["steering"] = self.steering
        if self.summary_text is not None:
            out["summary_text"] = self.summary_text
        return out


__all__ = ["FORMAT", "HarnessError", "NOT_CHECKED", "NOT_EXERCISED", "Reliability", "WhatRan", "RunReport", "SpecRow"]
