"""Line charts of run metrics as standalone SVG (no plotting library needed on a cluster node)."""
from __future__ import annotations

import html
import math

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def _ticks(lo: float, hi: float, n: int = 5) -> list:
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 1)]


def line_chart(series: dict, *, title: str = "", width: int = 640, height: int = 360, xlabel: str = "step") -> str:
    """``series``: name -> list of (x, y). Non-finite points are skipped. Returns SVG text."""
    pts = {k: [(float(x), float(y)) for x, y in v if math.isfinite(float(y))] for k, v in series.items()}
    pts = {k: v for k, v in pts.items() if v}
    if not pts:
        raise ValueError(f"line_chart: no finite points to plot ({title or 'untitled'})")
    xs = [x for v in pts.values() for x, _ in v]
    ys = [y for v in pts.values() for _, y in v]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
    left, right, top, bottom = 60, 20, 30, 40
    W, H = width - left - right, height - top - bottom

    def sx(x):
        return left + (x - x0) / (x1 - x0) * W

    def sy(y):
        return top + H - (y - y0) / (y1 - y0) * H

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
           f'<line x1="{left}" y1="{top + H}" x2="{left + W}" y2="{top + H}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + H}" stroke="black"/>',
           f'<text x="{left + W / 2}" y="{height - 8}" text-anchor="middle">{html.escape(xlabel)}</text>']
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{left - 4}" y1="{sy(t):.1f}" x2="{left + W}" y2="{sy(t):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:.4g}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{sx(t):.1f}" y="{top + H + 15}" text-anchor="middle">{t:.4g}</text>')
    for i, (name, v) in enumerate(sorted(pts.items())):
        color = COLORS[i % len(COLORS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(v))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"><title>{html.escape(name)}</title></polyline>')
        out.append(f'<text x="{left + 8}" y="{top + 14 + 14 * i}" fill="{color}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)
