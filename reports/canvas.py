"""A tiny drawing surface: collect shapes once, write them as SVG (plain text) and PNG (matplotlib).

Coordinates are pixels, origin top-left, y down (as in SVG).  Only what the
report pictures need: rectangles, lines, circles, polylines and text.
"""

from __future__ import annotations

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
    def to_png(self, path: str, dpi: int = 100) -> None:
        """Rasterise with matplotlib (Agg).  Raises ImportError when matplotlib is missing."""
        import matplotlib
        matplotlib.use("Agg", force=False)
        from matplotlib import patches
        from matplotlib.figure import Figure

        fig = Figure(figsize=(self.width / dpi, self.height / dpi), dpi=dpi)
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(0, self.width)
        ax.set_ylim(self.height, 0)
        ax.axis("off")
        fig.patch.set_facecolor(self.background)
        pt = 72.0 / dpi  # pixels -> points
        from matplotlib.collections import LineCollection
        z, i = 0, 0
        while i < len(self.shapes):
            kind, a = self.shapes[i]
            z += 1
            if kind == "line":  # a run of equally styled lines is one collection (fast for big graphs)
                style = (a["color"], a["width"], a["dash"], a["opacity"])
                segs = []
                while i < len(self.shapes) and self.shapes[i][0] == "line" and (
                        self.shapes[i][1]["color"], self.shapes[i][1]["width"], self.shapes[i][1]["dash"],
                        self.shapes[i][1]["opacity"]) == style:
                    b = self.shapes[i][1]
                    segs.append([(b["x1"], b["y1"]), (b["x2"], b["y2"])])
                    i += 1
                ax.add_collection(LineCollection(segs, colors=a["color"], linewidths=a["width"] * pt * 1.4,
                                                 linestyles=(0, (4, 3)) if a["dash"] else "solid",
                                                 alpha=a["opacity"], zorder=z))
                continue
            i += 1
            if kind == "rect":
                ax.add_patch(patches.Rectangle(
                    (a["x"], a["y"]), a["w"], a["h"], facecolor=a["fill"] if a["fill"] != "none" else "none",
                    edgecolor=a["stroke"] if a["stroke"] != "none" else "none", alpha=a["opacity"],
                    linewidth=a["width"] * pt if a["stroke"] != "none" else 0, zorder=z))
            elif kind == "circle":
                ax.add_patch(patches.Circle((a["cx"], a["cy"]), a["r"], facecolor=a["fill"],
                                            edgecolor=a["stroke"] if a["stroke"] != "none" else "none",
                                            linewidth=a["width"] * pt, zorder=z))
            elif kind == "text":
                ha = {"start": "left", "middle": "center", "end": "right"}[a["anchor"]]
                ax.text(a["x"], a["y"], a["s"], fontsize=a["size"] * pt, color=a["color"], ha=ha,
                        va="baseline", fontweight="bold" if a["bold"] else "normal", zorder=z)
        fig.savefig(path, dpi=dpi, facecolor=self.background, format="png")


__all__ = ["Canvas"]
