"""Charts as inline SVG, drawn on the server: no script, no network, no library.

A chart is stacked bars, one per time slot, one colour per status class;
each bar carries a `<title>` (the browser's tooltip, read by screen readers)
and the whole chart an accessible name with the totals.  Colours are SVG
presentation attributes, not `style`, so the strict CSP needs no
`unsafe-inline`.  Every text is escaped.
"""
from __future__ import annotations

from typing import Any, Sequence

from tornado.escape import xhtml_escape

#: Status classes drawn, bottom first, with their colours (readable on white,
#: distinguishable without colour through the legend's order and the titles).
COLOURS = (("2xx", "#2e7d32"), ("3xx", "#1565c0"), ("4xx", "#ef6c00"), ("5xx", "#c62828"))
WIDTH, HEIGHT, PAD_LEFT, PAD_BOTTOM, PAD_TOP = 720, 180, 40, 22, 8


def _e(text: Any) -> str:
    return xhtml_escape(str(text))


def bar_chart(points: Sequence[dict[str, Any]], *, title: str, label_every: int,
              label: str = "time") -> str:
    """The SVG of stacked bars for `points` (`{"time", "2xx", ...}`, oldest first).

    Labels under every `label_every`-th bar show the slot's UTC time; the
    page's script rewrites them in the viewer's time zone (`data-time`)."""
    n = max(1, len(points))
    totals = [sum(int(p.get(c, 0)) for c, _ in COLOURS) for p in points]
    peak = max(totals + [1])
    plot_w, plot_h = WIDTH - PAD_LEFT - 4, HEIGHT - PAD_BOTTOM - PAD_TOP
    slot = plot_w / n
    bar_w = max(1.0, slot * 0.8)
    by_class = {c: sum(int(p.get(c, 0)) for p in points) for c, _ in COLOURS}
    summary = ", ".join(f"{v} {c}" for c, v in by_class.items() if v) or "no requests"
    out = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
           f'aria-label="{_e(title)}: {_e(summary)}" xmlns="http://www.w3.org/2000/svg">',
           f'<title>{_e(title)}: {_e(summary)}</title>']
    # Axis: zero line and the peak value.
    base_y = PAD_TOP + plot_h
    out.append(f'<line x1="{PAD_LEFT}" y1="{base_y}" x2="{WIDTH - 4}" y2="{base_y}" '
               'stroke="#888" stroke-width="1"/>')
    out.append(f'<text x="{PAD_LEFT - 4}" y="{PAD_TOP + 8}" text-anchor="end" font-size="10" '
               f'fill="#444">{peak}</text>')
    out.append(f'<text x="{PAD_LEFT - 4}" y="{base_y}" text-anchor="end" font-size="10" '
               'fill="#444">0</text>')
    for i, point in enumerate(points):
        x = PAD_LEFT + i * slot + (slot - bar_w) / 2
        y = float(base_y)
        total = totals[i]
        if total:
            parts = ", ".join(f"{int(point.get(c, 0))} {c}" for c, _ in COLOURS if point.get(c))
            out.append(f'<g><title>{_e(point["time"])}: {total} ({_e(parts)})</title>')
            for cls, colour in COLOURS:
                count = int(point.get(cls, 0))
                if not count:
                    continue
                h = plot_h * count / peak
                y -= h
                out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
                           f'fill="{colour}" data-class="{cls}"/>')
            out.append("</g>")
        if label_every and i % label_every == 0:
            out.append(f'<text x="{x:.1f}" y="{HEIGHT - 6}" font-size="10" fill="#444" '
                       f'data-time="{_e(point["time"])}" data-format="{_e(label)}">'
                       f'{_e(str(point["time"])[11:16] if label == "time" else str(point["time"])[5:10])}'
                       '</text>')
    out.append("</svg>")
    return "".join(out)


def legend() -> str:
    """The colour legend shared by the charts (HTML, no inline style)."""
    items = "".join(f'<li><svg width="12" height="12" aria-hidden="true"><rect width="12" '
                    f'height="12" fill="{colour}"/></svg> {cls}</li>' for cls, colour in COLOURS)
    return f'<ul class="legend" aria-label="Status classes">{items}</ul>'
