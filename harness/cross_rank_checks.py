"""The cross-rank checks: what must agree between the ranks of one example (`cross_rank_problems`).

Every rank runs the same scenario on its share of the global batch and reports its trace, its result
and a checksum of every gathered parameter after each train step.  Compared with rank 0:

* ``ranks-trace``   -- the same module trace (ZeRO-3 module hooks and recompute blocks, with their
  phase) and the same parameter order (fetch / prefetch / release), train step by train step
  (`per_step`);
* ``ranks-params``  -- the gathered parameters agree, bit for bit, after every step (`digests`);
* ``ranks-outcome`` -- every rank finished, or every rank raised the same exception (check and origin);
* ``oracle``        -- another rank's parameters differ from plain PyTorch while rank 0's agree.

Used by the rank pool's target (`ranks`) and by world-size-2 repro scripts (`repro`, which embed this
file: it imports nothing but the standard library, the records and their judgement, and torch only through the
tensors it is given).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerostate.findings.oracle_judgement import verdict
from zerostate.findings.origin import error_text, exception_check, origin_of
from zerostate.findings.record import RunRecord
from zerostate.findings.wire import from_wire
from zerostate.harness.protocol import RankRecord
from zerostate.model.events import Event
from zerostate.model.scenario import Scenario

CROSS_CHECKS = ("ranks-trace", "ranks-params", "ranks-outcome")
MODULE_KINDS = {"module_pre_forward", "module_post_forward", "module_pre_backward", "module_post_backward",
                "recompute_start", "recompute_end"}
PARAM_KINDS = {"fetch", "prefetch", "release"}


def digests(params: Mapping[str, Any]) -> dict[str, str]:
    """A checksum of each gathered parameter's exact bytes (ranks must agree bit for bit)."""
    out = {}
    for n, param in params.items():
        t = param.detach().float().contiguous().cpu()
        out[n] = hashlib.sha1(t.numpy().tobytes() + str(tuple(t.shape)).encode()).hexdigest()[:16]
    return out


@dataclass(frozen=True)
class RankRun:
    """One rank's part of an example: its record (None when it answered with a failure), the digests of its
    gathered parameters after each train step, and its failure."""

    rank: int
    record: RunRecord | None
    steps: tuple[Mapping[str, str], ...] = ()
    error: str | None = None


def rank_runs(ranks: Sequence[RankRecord]) -> list[RankRun]:
    """The rank pool's records, read (`wire.from_wire`)."""
    return [RankRun(rk["rank"], None if rk.get("result") is None else from_wire(RunRecord, rk["result"]),
                    tuple(rk.get("steps") or ()), rk.get("error")) for rk in ranks]


def per_step(events: Sequence[Event]) -> list[dict[str, list[str]]]:
    """Each train step's module trace and parameter order (the events up to and including its STEP)."""
    out: list[dict[str, list[str]]] = [{"modules": [], "params": []}]
    for e in events:
        k = e.kind.value
        if k in MODULE_KINDS:
            out[-1]["modules"].append(f"{k} {e.module} {e.phase or ''}".strip())
        elif k in PARAM_KINDS:
            out[-1]["params"].append(f"{k} {e.param}")
        elif k == "step":
            out.append({"modules": [], "params": []})
    return out


def _first_diff(a: list[str], b: list[str]) -> tuple[int, str, str] | None:
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else "(nothing)"
        y = b[i] if i < len(b) else "(nothing)"
        if x != y:
            return i, x, y
    return None


def _outcome(rec: RunRecord | None) -> tuple[str, str] | None:
    """(check, origin) of what a rank raised, else None."""
    return (exception_check(rec.raised), origin_of(rec.raised)) if rec is not None and rec.raised else None


def _said(rec: RunRecord | None) -> str:
    if rec is not None and rec.raised is not None:
        return f"raised {error_text(rec.raised).splitlines()[0][:200]}"
    return f"finished {len(rec.steps) if rec else 0} train step(s)"


def cross_rank_problems(ranks: Sequence[RankRun], scenario: Scenario) -> dict[str, tuple[str, str]]:
    """Cross-rank check id -> (what differs, its code), comparing every rank with rank 0.

    The code is the finding's identity (``Finding.key`` is check:code, never the message): ``ranks-outcome``
    ``one-rank-raised`` / ``different-exceptions``; ``ranks-trace`` ``module-trace`` / ``parameter-order``;
    ``ranks-params`` ``gathered-params-differ``; ``oracle`` ``other-rank-off``."""
    out: dict[str, tuple[str, str]] = {}
    r0 = ranks[0]
    off0 = verdict(r0.record, scenario) if r0.record is not None else None
    for rk in ranks[1:]:
        r = rk.rank
        e0, e1 = _outcome(r0.record), _outcome(rk.record)
        if e0 != e1 and "ranks-outcome" not in out:
            out["ranks-outcome"] = (f"rank 0 {_said(r0.record)}; rank {r} {_said(rk.record)}",
                                    "different-exceptions" if e0 and e1 else "one-rank-raised")
        if "ranks-trace" not in out:
            s0 = per_step(r0.record.events if r0.record else ())
            s1 = per_step(rk.record.events if rk.record else ())
            for i in range(min(len(s0), len(s1))):
                for what, label in (("modules", "module trace"), ("params", "parameter order")):
                    d = _first_diff(s0[i][what], s1[i][what])
                    if d is not None and "ranks-trace" not in out:
                        out["ranks-trace"] = ((f"train step {i}: the {label} differs at position {d[0]}: "
                                               f"rank 0 saw {d[1]!r}, rank {r} saw {d[2]!r}"),
                                              label.replace(" ", "-"))
        if "ranks-params" not in out:
            for i, (d0, d1) in enumerate(zip(r0.steps, rk.steps, strict=False)):
                bad = [n for n in d0 if d0.get(n) != d1.get(n)] + [n for n in d1 if n not in d0]
                if bad:
                    out["ranks-params"] = ((f"after train step {i}: the gathered parameters differ between "
                                            f"rank 0 and rank {r}: {', '.join(bad[:4])}"
                                            f"{' ...' if len(bad) > 4 else ''}"),
                                           "gathered-params-differ")
                    break
        off = verdict(rk.record, scenario) if rk.record is not None else None
        if off is not None and off0 is None and "oracle" not in out:
            out["oracle"] = (f"rank {r}: {off.message}", "other-rank-off")
    return out


__all__ = ["CROSS_CHECKS", "RankRun", "cross_rank_problems", "digests", "per_step", "rank_runs"]
