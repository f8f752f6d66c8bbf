"""The reports package's parts on their own, without running a command: JSON values, pictures (the drawing
surface, a finding's event sequence, a counterexample's state graph), a model counterexample as a finding, the
repro file, and the root-cause groups.  The commands' reports as a whole are tested through the commands
(test_cli_*.py, test_matrix.py)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from itertools import pairwise

import pytest

from zerostate.model import get_design
from zerostate.model.events import Event, EventKind
from zerostate.model.explore import run, state_graph
from zerostate.model.scenario import Scenario
from zerostate.analysis.checker import Bound
from zerostate.specs import SPECS, check_trace
from zerostate.specs.hook_specs import HOOK_SPECS

from zerostate.reports import json_value, model_counterexample
from zerostate.reports.canvas import Canvas
from zerostate.reports.finding_entry import Labels
from zerostate.reports.graph_picture import graph_picture
from zerostate.reports.repro_file import repro_for
from zerostate.reports.root_causes import root_causes
from zerostate.reports.trace_picture import lane_of, phase_spans, trace_picture, window, write_picture

SVG = "{http://www.w3.org/2000/svg}"


def _svg(c: Canvas) -> ET.Element:
    root = ET.fromstring(c.to_svg())
    assert root.tag == SVG + "svg" and root.get("width") == str(c.width)
    return root


@pytest.fixture(scope="module")
def epilogue_counterexample():
    """ds-0.18.4's first ``epilogue-once`` counterexample at the checker's smallest bound: (scenario, events,
    violation), the monitor's own violation on those events."""
    spec = next(s for s in HOOK_SPECS if s.id == "epilogue-once")
    for sc in Bound(max_blocks=2, max_micro_steps=1).scenarios():
        g = state_graph(get_design("ds-0.18.4"), sc, [spec], coordinator=False)
        if "epilogue-once" in g.violations:
            events = list(g.counterexamples["epilogue-once"])
            return sc, events, g.violations["epilogue-once"]
    pytest.fail("ds-0.18.4 breaks epilogue-once on two blocks (seed 000)")


# ------------------------------------------------------------------ json_value
def test_json_value_readers_take_only_their_own_type():
    assert json_value.as_object({"a": 1}) == {"a": 1} and json_value.as_object([1]) == {}
    assert json_value.as_list([1, 2]) == [1, 2] and json_value.as_list("ab") == [] and json_value.as_list(None) == []
    assert json_value.as_str("x") == "x" and json_value.as_str(3) is None
    assert json_value.as_int(3) == 3 and json_value.as_int(True) is None and json_value.as_int("3") is None


# ------------------------------------------------------------------ canvas
def test_canvas_writes_every_shape_as_svg_with_text_escaped():
    c = Canvas(200, 100)
    c.rect(1, 2, 30, 40, fill="#ff0000")
    c.line(0, 0, 10, 10, dash=True)
    c.circle(50, 50, 4)
    c.text(10, 90, "a < b & c", anchor="middle", bold=True)
    root = _svg(c)
    tags = [e.tag.removeprefix(SVG) for e in root]
    assert tags == ["rect", "rect", "line", "circle", "text"]  # the background first
    assert root[2].get("stroke-dasharray") and root[4].text == "a < b & c" and root[4].get("font-weight") == "bold"


def test_canvas_png_draws_what_the_svg_says(tmp_path):
    """The PNG (Pillow) is the picture's size, its background where nothing is drawn, and each shape's colour
    where it is drawn: a filled rectangle, a circle, a line half-transparent over the background; text in its
    colour; a dashed line leaves gaps."""
    pytest.importorskip("PIL")
    from PIL import Image
    c = Canvas(120, 60, background="#ffffff")
    c.rect(10, 10, 20, 20, fill="#ff0000")
    c.circle(60, 20, 6, fill="#0000ff")
    c.line(0, 45, 120, 45, color="#00ff00", width=3, opacity=0.5)
    c.line(0, 55, 120, 55, color="#000000", width=2, dash=True)
    c.text(90, 30, "WWW", size=14, color="#000000", bold=True)
    c.to_png(str(tmp_path / "p.png"))
    img = Image.open(tmp_path / "p.png").convert("RGB")
    assert img.size == (120, 60)
    px = img.load()
    assert px[2, 2] == (255, 255, 255)  # background
    assert px[20, 20] == (255, 0, 0) and px[60, 20] == (0, 0, 255)
    r, g, b = px[50, 45]
    assert g > 240 and 100 < r < 160 and 100 < b < 160  # green at half opacity over white
    assert any(px[x, y] != (255, 255, 255) for x in range(88, 120) for y in range(15, 32))  # the text
    row = [px[x, 55][0] for x in range(120)]
    assert min(row) < 60 and max(row) > 200  # dashes and gaps
    big = Canvas(4000, 2500)  # over SUPERSAMPLE_UP_TO: drawn at its own size, the same picture
    big.rect(10, 10, 20, 20, fill="#ff0000")
    big.to_png(str(tmp_path / "big.png"))
    img = Image.open(tmp_path / "big.png").convert("RGB")
    assert img.size == (4000, 2500) and img.getpixel((20, 20)) == (255, 0, 0) and img.getpixel((2, 2)) == (255,) * 3


def test_a_picture_written_again_is_copied_not_rasterised_again(tmp_path, monkeypatch):
    """`write_picture` with ``kept``: the second write of the same picture (explore's renumbering) copies its PNG;
    a different picture is rasterised."""
    pytest.importorskip("PIL")
    rasterised = []
    real = Canvas.to_png
    monkeypatch.setattr(Canvas, "to_png", lambda self, path: (rasterised.append(path), real(self, path))[1])
    kept: dict[str, bytes] = {}
    a, b = Canvas(40, 20), Canvas(40, 20)
    b.rect(0, 0, 10, 10, fill="#ff0000")
    write_picture(a, str(tmp_path / "one"), kept)
    write_picture(a, str(tmp_path / "two"), kept)
    write_picture(b, str(tmp_path / "three"), kept)
    assert len(rasterised) == 2 and (tmp_path / "two.png").read_bytes() == (tmp_path / "one.png").read_bytes()
    assert (tmp_path / "three.png").read_bytes() != (tmp_path / "one.png").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.png", "one.svg", "three.png", "three.svg",
                                                           "two.png", "two.svg"]  # no temporary file left


# ------------------------------------------------------------------ trace picture
def test_a_findings_event_sequence_is_drawn_with_its_violation_marked(tmp_path):
    sc = Scenario.from_dict({"blocks": [{}, {}], "stage": 3})
    events = list(run(get_design("ds-0.19.3"), sc).events)
    assert lane_of(Event(EventKind.FETCH, param="blocks.1.lin.weight")) == "blocks.1.lin"  # its module's lane
    assert lane_of(Event(EventKind.STEP)) == "engine"
    spans = phase_spans(events)
    assert {p for p, _, _ in spans} >= {"forward", "backward"} and all(a <= b for _, a, b in spans)
    assert window(1000, 500, 120) == (396, 516) and window(10, None, 120) == (0, 10)  # ends 16 after it
    c = trace_picture(events, len(events) - 1, "clean-step violated", "first line\nsecond line")
    texts = [e.text for e in _svg(c).iter(SVG + "text")]
    assert texts[:2] == ["clean-step violated", "first line"] and "violation" in texts
    assert sum(e.get("stroke") == "#d50000" for e in _svg(c).iter(SVG + "circle")) == 1  # the violating event
    after_last = _svg(trace_picture(events, None, "t"))
    assert "violated after the last event" in [e.text for e in after_last.iter(SVG + "text")]
    files = write_picture(c, str(tmp_path / "trace_1"))
    assert (tmp_path / files["svg"]).read_text() == c.to_svg()
    assert "png" not in files or (tmp_path / files["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ model counterexample, state graph picture
def test_a_model_counterexample_is_a_finding_of_the_model_target(epilogue_counterexample):
    sc, events, v = epilogue_counterexample
    f = model_counterexample.finding(v, sc, events)
    assert (f.check, f.target, f.code, f.index, f.scenario) == ("epilogue-once", "model", v.code, v.index, sc)
    assert check_trace(SPECS["epilogue-once"], f.trace) == v


def test_the_counterexample_path_runs_through_its_state_graph_to_the_violation(epilogue_counterexample):
    sc, events, v = epilogue_counterexample
    shown = model_counterexample.shown("ds-0.18.4", model_counterexample.finding(v, sc, events))
    graph, path = shown["graph"], shown["graph_path"]
    assert graph is not None and not shown["notes"] and shown["design"] == "ds-0.18.4"
    assert len(path) >= 2 and graph.in_degree(path[0]) == 0
    assert all(graph.has_edge(a, b) for a, b in pairwise(path))
    c = graph_picture(graph, path, "state graph: epilogue-once", v.message)
    texts = [e.text for e in _svg(c).iter(SVG + "text")]
    assert "violation" in texts and texts[0] == "state graph: epilogue-once"
    assert sum(e.get("fill") == "#d50000" for e in _svg(c).iter(SVG + "circle")) == len(set(path))


# ------------------------------------------------------------------ repro file
def test_the_repro_file_is_a_script_that_replays_the_findings_scenario():
    sc = Scenario.from_dict({"blocks": [{"checkpoint": "reentrant"}], "stage": 3})
    text = repro_for(sc, "epilogue-once", "a gradient hook fired after the epilogue")(7)
    compile(text, "repro_7.py", "exec")  # a whole Python script
    assert "epilogue-once" in text and "repro_7" in text


# ------------------------------------------------------------------ root causes
@dataclass(frozen=True)
class _Entry:
    n: int
    labels: Labels | None


def test_root_causes_group_labelled_entries_in_order_of_first_appearance():
    a = Labels(None, "exception:KeyError", "KeyError in a hook", None)
    b = Labels(None, "oracle", "parameters differ from PyTorch", None)
    got = root_causes([_Entry(1, a), _Entry(2, None), _Entry(3, b), _Entry(4, a)])
    assert [(g.key, g.title, g.count, g.findings) for g in got] == [
        ("exception:KeyError", "KeyError in a hook", 2, (1, 4)), ("oracle", "parameters differ from PyTorch", 1, (3,))]
    assert root_causes([_Entry(1, None)]) == []
