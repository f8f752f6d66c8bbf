"""Report pictures: the event sequence of a finding (and `write_picture`, shared with graph_picture).

Event sequence: one lane per module (parameters are drawn in their module's
lane; schedule and engine events in the ``engine`` lane), time left to right,
forward / eval / backward / recompute phases shaded, the violating event
marked in red.  Each picture is written as SVG and PNG.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from zerostate.model.events import EventKind, Event

from zerostate.atomic import replace_file
from zerostate.reports.canvas import Canvas

WINDOW = 120
"""Most events one picture shows; a longer trace is cut to the window ending just after the violation."""

_GREY, _BLUE, _TEAL, _ORANGE, _GREEN, _BROWN = "#616161", "#1565c0", "#00838f", "#ef6c00", "#2e7d32", "#8d4e2a"
MARKS: dict[EventKind, tuple[str, str]] = {
    EventKind.FORWARD_START: ("F>", _GREY), EventKind.FORWARD_END: ("F|", _GREY),
    EventKind.EVAL_FORWARD_START: ("V>", _GREY),
    EventKind.EVAL_FORWARD_END: ("V|", _GREY), EventKind.USER_BACKWARD_START: ("B>", _GREY),
    EventKind.USER_BACKWARD_END: ("B|", _GREY), EventKind.STEP: ("ST", _GREY),
    EventKind.TASK_START: ("T>", _BLUE), EventKind.TASK_END: ("T|", _BLUE), EventKind.OUTPUT_HOOK: ("O", _BLUE),
    EventKind.GRAD_HOOK: ("G", _BLUE), EventKind.LEAF_HOOK: ("L", _BLUE),
    EventKind.MODULE_PRE_FORWARD: ("f>", _TEAL), EventKind.MODULE_POST_FORWARD: ("f|", _TEAL),
    EventKind.MODULE_PRE_BACKWARD: ("b>", _TEAL), EventKind.MODULE_POST_BACKWARD: ("b|", _TEAL),
    EventKind.RECOMPUTE_START: ("R>", _TEAL), EventKind.RECOMPUTE_END: ("R|", _TEAL), EventKind.SAVE_LIVE: ("S", _TEAL),
    EventKind.UNPACK: ("U", _TEAL),
    EventKind.ENTER_BACKWARD: ("E+", _ORANGE), EventKind.EXIT_BACKWARD: ("E-", _ORANGE),
    EventKind.COUNT: ("#", _ORANGE), EventKind.EXPECTED: ("#E", _ORANGE),
    EventKind.CALLBACK_QUEUED: ("Q", _ORANGE), EventKind.CALLBACK_RUN: ("Q!", _ORANGE),
    EventKind.POST_HOOKS: ("P", _ORANGE),
    EventKind.EPILOGUE: ("EP", _ORANGE), EventKind.BUCKET_ADD: ("+", _ORANGE), EventKind.BUCKET_FLUSH: ("FL", _ORANGE),
    EventKind.BUCKET_CLEAR: ("CL", _ORANGE),
    EventKind.FETCH: ("AG", _GREEN), EventKind.PREFETCH: ("pf", _GREEN), EventKind.RELEASE: ("RL", _BROWN),
    EventKind.TRACE_STATE: ("TS", _GREEN),
}
MARKS.update({EventKind.REREGISTER: ("RR", _TEAL), EventKind.HOLDERS: ("H", _GREEN),
              EventKind.PERSISTENT: ("PS", _GREEN),
              EventKind.LEAF_GRAD: ("LG", _BLUE), EventKind.USER_GATHER: ("GP", _TEAL)})


def mark(ev: Event) -> tuple[str, str]:
    """The ringed code and colour of an event (an event kind added later still gets a readable code)."""
    label, color = MARKS.get(ev.kind, (ev.kind.value[:2].upper(), _GREY))
    if ev.kind is EventKind.HOLDERS and ev.note in ("+", "-"):
        label += ev.note
    if ev.kind is EventKind.USER_GATHER:
        label += "[" if ev.note == "enter" else "]"
    return label, color
PHASES = {"forward": "#dbeafe", "eval": "#eeeeee", "backward": "#ffe8cc", "recompute": "#e9d5ff"}
_OPEN = {EventKind.FORWARD_START: "forward", EventKind.EVAL_FORWARD_START: "eval",
         EventKind.USER_BACKWARD_START: "backward",
         EventKind.RECOMPUTE_START: "recompute"}
_CLOSE = {EventKind.FORWARD_END: "forward", EventKind.EVAL_FORWARD_END: "eval", EventKind.USER_BACKWARD_END: "backward",
          EventKind.RECOMPUTE_END: "recompute"}
ENGINE = "engine"


def lane_of(ev: Event) -> str:
    if ev.param:
        return ev.param.rsplit(".", 1)[0] if "." in ev.param else ev.param
    return ev.module or ENGINE


def _lane_key(name: str) -> tuple[int | tuple[int, int | str, int], ...]:
    if name == ENGINE:
        return (0,)
    parts = [int(p) if p.isdigit() else p for p in re.split(r"[.]", name)]
    sub = {"norm": 1, "lin": 2}
    return (1, *[(0, p, 0) if isinstance(p, int) else (1, 0, sub.get(p, 9)) for p in parts])


def phase_spans(events: Sequence[Event]) -> list[tuple[str, int, int]]:
    """``(phase, first index, last index)`` for every forward, eval, backward and recompute."""
    spans, open_at = [], {}
    for i, ev in enumerate(events):
        if ev.kind in _OPEN:
            open_at[_OPEN[ev.kind]] = i
        elif ev.kind in _CLOSE and _CLOSE[ev.kind] in open_at:
            spans.append((_CLOSE[ev.kind], open_at.pop(_CLOSE[ev.kind]), i))
    spans += [(p, i, len(events) - 1) for p, i in open_at.items()]
    order = list(PHASES)
    return sorted(spans, key=lambda s: (order.index(s[0]) == 3, s[1]))


def window(n: int, violation: int | None, size: int = WINDOW) -> tuple[int, int]:
    """Half-open index range of the events to show."""
    if n <= size:
        return 0, n
    end = min(n, (violation if violation is not None else n - 1) + 16)
    return max(0, end - size), end


def trace_picture(events: Sequence[Event], violation: int | None, title: str, subtitle: str = "") -> Canvas:
    lo, hi = window(len(events), violation)
    shown = list(events[lo:hi])
    lanes = sorted({lane_of(e) for e in shown} | {ENGINE}, key=_lane_key)
    col, lane_h, left, top = 22, 30, 170, 92
    kinds = list(dict.fromkeys(e.kind for e in shown))
    kinds.sort(key=lambda k: list(EventKind).index(k))
    legend_rows = (len(kinds) + 5) // 6
    width = max(left + col * len(shown) + 110, 1100)
    height = top + lane_h * len(lanes) + 50 + 22 * legend_rows + 36
    c = Canvas(int(width), int(height))
    titles(c, title, subtitle)

    def x0(i: int) -> int:
        return left + col * (i - lo)
    y_lanes = top + lane_h * len(lanes)
    for phase, start, end in phase_spans(events):
        a, b = max(start, lo), min(end, hi - 1)
        if a > b:
            continue
        y = top if phase != "recompute" else top + 4
        c.rect(x0(a), y, col * (b - a + 1), y_lanes - y, fill=PHASES[phase])
        if col * (b - a + 1) >= 7 * len(phase) + 6:
            c.text(x0(a) + 3, top - 6, phase, size=11, color="#444444")
    for j, name in enumerate(lanes):
        lane_y = top + lane_h * j + lane_h / 2
        c.line(left - 6, lane_y, x0(hi) + 6, lane_y, color="#bdbdbd", width=1)
        c.text(left - 10, lane_y + 4, name, size=12, anchor="end", bold=name == ENGINE)
    for i in range(lo, hi, 5):
        c.text(x0(i) + col / 2, y_lanes + 16, str(i), size=10, anchor="middle", color="#555555")
    c.text(left - 10, y_lanes + 16, "event #", size=10, anchor="end", color="#555555")
    if violation is not None and lo <= violation < hi:
        xv = x0(violation) + col / 2
        c.line(xv, top - 20, xv, y_lanes + 4, color="#d50000", width=2)
        c.text(xv - 4, top - 22, "violation", size=11, color="#d50000", bold=True, anchor="end")
    for i, ev in enumerate(shown, start=lo):
        label, color = mark(ev)
        cx, cy = x0(i) + col / 2, top + lane_h * lanes.index(lane_of(ev)) + lane_h / 2
        bad = i == violation
        c.circle(cx, cy, 9.5, fill="#ffffff", stroke="#d50000" if bad else color, width=3 if bad else 1.5)
        c.text(cx, cy + 3.5, label, size=9, anchor="middle", color="#d50000" if bad else color, bold=True)
    if violation is None:
        xv = x0(hi) + 2
        c.line(xv, top - 20, xv, y_lanes + 4, color="#d50000", width=2, dash=True)
        c.text(xv - 4, top - 22, "violated after the last event", size=11, color="#d50000",
               anchor="end", bold=True)
    ly = y_lanes + 44
    for k, kind in enumerate(kinds):
        label, color = MARKS.get(kind, (kind.value[:2].upper(), _GREY))
        x, y = 20 + 178 * (k % 6), ly + 22 * (k // 6)
        c.circle(x + 8, y - 4, 9, fill="#ffffff", stroke=color, width=1.5)
        c.text(x + 8, y - 0.5, label, size=9, anchor="middle", color=color, bold=True)
        c.text(x + 22, y, kind.value, size=11, color="#333333")
    c.text(12, height - 12, "phases:", size=11, color="#555555")
    for k, (phase, fill) in enumerate(PHASES.items()):
        c.rect(70 + 110 * k, height - 24, 16, 14, fill=fill, stroke="#9e9e9e")
        c.text(92 + 110 * k, height - 12, phase, size=11, color="#555555")
    note = "lanes: modules (a parameter's events in its module's lane)"
    if lo or hi < len(events):
        note += f"; showing events {lo}..{hi - 1} of {len(events)}"
    c.text(520, height - 12, note, size=11, color="#555555")
    return c


def titles(c: Canvas, title: str, subtitle: str) -> None:
    """Title and the first line of the error, cut to the picture's width."""
    room = max(40, int((c.width - 24) / 6.8))
    first = next((ln.strip() for ln in subtitle.splitlines() if ln.strip()), "")
    c.text(12, 24, title, size=16, bold=True)
    if first:
        c.text(12, 44, first if len(first) <= room else first[:room - 1] + "…", size=12, color="#333333")


def write_picture(canvas: Canvas, base: str, kept: dict[str, bytes] | None = None) -> dict[str, str]:
    """Write ``base.svg`` and ``base.png``; return the file names written (PNG only when Pillow is installed).
    ``kept``: PNGs already rasterised, by their SVG text -- a picture drawn again (a finding renumbered) is
    copied, not rasterised again."""
    files = {}
    svg = canvas.to_svg()
    replace_file(base + ".svg", svg)
    files["svg"] = os.path.basename(base + ".svg")
    tmp = base + ".png.tmp"
    try:
        if kept is not None and svg in kept:
            with open(tmp, "wb") as fh:
                fh.write(kept[svg])
        else:
            canvas.to_png(tmp)
            if kept is not None:
                with open(tmp, "rb") as fh:
                    kept[svg] = fh.read()
        os.replace(tmp, base + ".png")
        files["png"] = os.path.basename(base + ".png")
    except ImportError:
        pass
    return files


__all__ = ["MARKS", "PHASES", "lane_of", "mark", "phase_spans", "titles", "trace_picture", "window",
           "write_picture"]
