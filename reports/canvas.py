"""A tiny drawing surface: collect shapes once, write them as SVG (plain text) and PNG (Pillow).

Coordinates are pixels, origin top-left, y down (as in SVG).  Only what the
report pictures need: rectangles, lines, circles, polylines and text.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"


@dataclass
class Canvas:
    width: int
    height: int
    background: str = "#ffffff"
    shapes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    # ------------------------------------------------------------------ shapes
    def rect(self, x: float, y: float, w: float, h: float, fill: str = "none", stroke: str = "none",
             opacity: float = 1.0, width: float = 1.0) -> None:
        self.shapes.append(("rect", {"x": x, "y": y, "w": w, "h": h, "fill": fill, "stroke": stroke,
                                     "opacity": opacity, "width": width}))

    def line(self, x1: float, y1: float, x2: float, y2: float, color: str = "#000000", width: float = 1.0,
             dash: bool = False, opacity: float = 1.0) -> None:
        self.shapes.append(("line", {"x1": x1, "y1": y1, "x2": x2, "y2": y2, "color": color, "width": width,
                                     "dash": dash, "opacity": opacity}))

    def circle(self, cx: float, cy: float, r: float, fill: str = "#000000", stroke: str = "none",
               width: float = 1.0) -> None:
        self.shapes.append(("circle", {"cx": cx, "cy": cy, "r": r, "fill": fill, "stroke": stroke, "width": width}))

    def text(self, x: float, y: float, s: str, size: float = 12, color: str = "#000000",
             anchor: str = "start", bold: bool = False) -> None:
        """``y`` is the text's baseline; ``anchor`` is start, middle or end."""
        self.shapes.append(("text", {"x": x, "y": y, "s": s, "size": size, "color": color, "anchor": anchor,
                                     "bold": bold}))

    # --------------------------------------------------------------------- SVG
    def to_svg(self) -> str:
        out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}" font-family="{FONT}">'),
               f'<rect x="0" y="0" width="{self.width}" height="{self.height}" fill="{self.background}"/>']
        for kind, a in self.shapes:
            if kind == "rect":
                out.append(f'<rect x="{a["x"]:.1f}" y="{a["y"]:.1f}" width="{a["w"]:.1f}" height="{a["h"]:.1f}" '
                           f'fill="{a["fill"]}" stroke="{a["stroke"]}" stroke-width="{a["width"]}" '
                           f'opacity="{a["opacity"]}"/>')
            elif kind == "line":
                dash = ' stroke-dasharray="4 3"' if a["dash"] else ""
                out.append(f'<line x1="{a["x1"]:.1f}" y1="{a["y1"]:.1f}" x2="{a["x2"]:.1f}" y2="{a["y2"]:.1f}" '
                           f'stroke="{a["color"]}" stroke-width="{a["width"]}" opacity="{a["opacity"]}"{dash}/>')
            elif kind == "circle":
                out.append(f'<circle cx="{a["cx"]:.1f}" cy="{a["cy"]:.1f}" r="{a["r"]:.1f}" fill="{a["fill"]}" '
                           f'stroke="{a["stroke"]}" stroke-width="{a["width"]}"/>')
            elif kind == "text":
                weight = ' font-weight="bold"' if a["bold"] else ""
                out.append(f'<text x="{a["x"]:.1f}" y="{a["y"]:.1f}" font-size="{a["size"]}" fill="{a["color"]}" '
                           f'text-anchor="{a["anchor"]}"{weight}>{escape(a["s"])}</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"

    # --------------------------------------------------------------------- PNG
    def to_png(self, path: str) -> None:
        """Rasterise with Pillow, drawn at ``SUPERSAMPLE`` times the size and averaged down.  Raises ImportError
        when Pillow is missing."""
        from PIL import Image, ImageColor, ImageDraw

        s = SUPERSAMPLE if self.width * self.height <= SUPERSAMPLE_UP_TO else 1
        img = Image.new("RGB", (max(1, round(self.width * s)), max(1, round(self.height * s))),
                        ImageColor.getrgb(self.background))
        draw = ImageDraw.Draw(img, "RGBA")  # RGBA: a colour's alpha blends over what is drawn already

        def colour(name: str, opacity: float = 1.0) -> tuple[int, int, int, int] | None:
            if name == "none":
                return None
            r, g, b = ImageColor.getrgb(name)[:3]
            return r, g, b, round(255 * opacity)

        for kind, a in self.shapes:
            if kind == "rect":
                x, y = a["x"] * s, a["y"] * s
                box = (x, y, x + max(a["w"] * s, 0.0), y + max(a["h"] * s, 0.0))
                draw.rectangle(box, fill=colour(a["fill"], a["opacity"]), outline=colour(a["stroke"], a["opacity"]),
                               width=max(1, round(a["width"] * s)) if a["stroke"] != "none" else 0)
            elif kind == "line":
                ends = (a["x1"] * s, a["y1"] * s, a["x2"] * s, a["y2"] * s)
                for seg in (_dashes(*ends, on=4 * s, off=3 * s) if a["dash"] else [ends]):
                    draw.line(seg, fill=colour(a["color"], a["opacity"]), width=max(1, round(a["width"] * s)))
            elif kind == "circle":
                cx, cy, r = a["cx"] * s, a["cy"] * s, a["r"] * s
                draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour(a["fill"]), outline=colour(a["stroke"]),
                             width=max(1, round(a["width"] * s)) if a["stroke"] != "none" else 0)
            elif kind == "text":
                font, thicken = _font(round(a["size"] * s), a["bold"])
                draw.text((a["x"] * s, a["y"] * s), a["s"], fill=colour(a["color"]), font=font,
                          anchor=_ANCHOR[a["anchor"]], stroke_width=s // 2 if thicken else 0,
                          stroke_fill=colour(a["color"]) if thicken else None)
        img.reduce(s).save(path, format="PNG", compress_level=COMPRESS_LEVEL)


SUPERSAMPLE = 2
"""Drawn at twice the size and box-averaged down: anti-aliased edges and text."""
SUPERSAMPLE_UP_TO = 8_000_000
"""Pixels up to which a picture is supersampled; a bigger one (a state graph of thousands of states) is drawn at
its own size, so that its drawing surface stays a few hundred megabytes at most."""
COMPRESS_LEVEL = 1
"""zlib's fastest level: these flat-coloured pictures compress well at any level, and an exploration waits while
a finding's PNG is written (`bench_report_writing.py`)."""
_ANCHOR = {"start": "ls", "middle": "ms", "end": "rs"}  # Pillow's anchors: horizontal, then on the baseline


def _dashes(x1: float, y1: float, x2: float, y2: float, on: float, off: float) -> list[tuple[float, ...]]:
    """A dashed line as its drawn pieces (SVG's ``stroke-dasharray="4 3"``)."""
    length = math.hypot(x2 - x1, y2 - y1)
    if length == 0:
        return []
    dx, dy = (x2 - x1) / length, (y2 - y1) / length
    out: list[tuple[float, ...]] = []
    t = 0.0
    while t < length:
        e = min(t + on, length)
        out.append((x1 + dx * t, y1 + dy * t, x1 + dx * e, y1 + dy * e))
        t = e + off
    return out


@functools.cache
def _font(size: int, bold: bool) -> tuple[Any, bool]:
    """DejaVu Sans (the SVG's first choice) where a copy is found -- most Linux systems and matplotlib ship
    one --, else Pillow's own scalable default font, which has no bold face: True then asks for bold text to
    be thickened with a stroke."""
    from PIL import ImageFont
    for path in _dejavu(bold):
        try:
            return ImageFont.truetype(path, size), False
        except OSError:
            continue
    return ImageFont.load_default(size), bold


def _dejavu(bold: bool) -> list[str]:
    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    places = []
    spec = importlib.util.find_spec("matplotlib")  # its font files, without importing it
    if spec is not None and spec.submodule_search_locations:
        places += [os.path.join(d, "mpl-data", "fonts", "ttf", name) for d in spec.submodule_search_locations]
    places += [os.path.join(d, name) for d in ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu",
                                               "/usr/share/fonts/TTF")]
    return [p for p in places if os.path.exists(p)]


__all__ = ["Canvas"]
