"""A small SVG line-chart writer (plain Python, no plotting library) for the Weitter run:
two rows (without / with Diana) × two panels (load in req/s; latency in ms)."""

from __future__ import annotations

from typing import Any, Optional
from xml.sax.saxutils import escape

W, H = 1140, 720
PW, PH = 470, 210  # plot area of one panel
LEFT, TOP = 70, 70
GAPX, GAPY = 90, 120


def nice_max(v: float) -> float:
    if v <= 0:
        return 1
    import math
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if v <= m * e:
            return m * e
    return 10 * e


def panel(x0: float, y0: float, title: str, xs: list[float], series: list[tuple[str, str, list[Optional[float]], str]],
          ymax: float, ylabel: str, shade: tuple[float, float], xmax: float) -> list[str]:
    out = [f'<g transform="translate({x0},{y0})">']
    sx = lambda x: PW * x / xmax
    sy = lambda y: PH - PH * min(y, ymax) / ymax
    # flood period
    out.append(f'<rect x="{sx(shade[0]):.1f}" y="0" width="{sx(shade[1]) - sx(shade[0]):.1f}" height="{PH}" '
               f'fill="#fde8e8"/>')
    out.append(f'<text x="{sx(shade[0]) + 4:.1f}" y="14" font-size="11" fill="#b44">flood on /hot/trending</text>')
    for i in range(6):
        yv = ymax * i / 5
        y = sy(yv)
        out.append(f'<line x1="0" x2="{PW}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="-6" y="{y + 4:.1f}" font-size="11" text-anchor="end">{yv:g}</text>')
    step = 5 if xmax <= 40 else 10
    for xv in range(0, int(xmax) + 1, step):
        out.append(f'<text x="{sx(xv):.1f}" y="{PH + 16}" font-size="11" text-anchor="middle">{xv}</text>')
    out.append(f'<rect x="0" y="0" width="{PW}" height="{PH}" fill="none" stroke="#444"/>')
    out.append(f'<text x="{PW / 2}" y="-10" font-size="13" font-weight="bold" text-anchor="middle">{escape(title)}</text>')
    out.append(f'<text x="{PW / 2}" y="{PH + 32}" font-size="11" text-anchor="middle">seconds</text>')
    out.append(f'<text transform="translate(-50,{PH / 2}) rotate(-90)" font-size="11" text-anchor="middle">'
               f'{escape(ylabel)}</text>')
    for _name, color, ys, dash in series:
        pts = []
        segs = []
        for x, y in zip(xs, ys):
            if y is None:
                if pts:
                    segs.append(pts)
                pts = []
                continue
            pts.append(f"{sx(x + 0.5):.1f},{sy(y):.1f}")
        if pts:
            segs.append(pts)
        for s in segs:
            out.append(f'<polyline points="{" ".join(s)}" fill="none" stroke="{color}" stroke-width="2" '
                       f'stroke-dasharray="{dash}"/>')
    # legend
    for i, (name, color, _ys, dash) in enumerate(series):
        lx = (i % 2) * (PW / 2)
        ly = PH + 50 + (i // 2) * 16
        out.append(f'<line x1="{lx}" x2="{lx + 22}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2" '
                   f'stroke-dasharray="{dash}"/>')
        out.append(f'<text x="{lx + 26}" y="{ly + 4}" font-size="11">{escape(name)}</text>')
    out.append("</g>")
    return out


def weitter_svg(result: dict[str, Any]) -> str:
    p = result["params"]
    runs = result["runs"]
    xmax = p["total_s"]
    load_max = nice_max(max(max(r["offered"] for r in run["series"]) for run in runs))
    lat_vals = [v for run in runs for r in run["series"]
                for v in (r["normal_p99_ms"], r["upstream_p99_ms"]) if v is not None]
    lat_max = nice_max(max(lat_vals) if lat_vals else 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{W / 2}" y="22" font-size="15" font-weight="bold" text-anchor="middle">'
             f'Weitter hot event, without and with Diana</text>',
             f'<text x="{W / 2}" y="40" font-size="12" text-anchor="middle">timeline service of capacity '
             f'≈{p["capacity"]:.0f} req/s; flood of {p["flood_rate"]:.0f} req/s on /hot/trending; '
             f'{p["normal_rate"]} req/s of normal /timeline/&lt;user&gt; reads all along</text>']
    for i, run in enumerate(runs):
        s = run["series"]
        xs = [r["t"] for r in s]
        name = "with Diana" if run["with_diana"] else "without Diana"
        y0 = TOP + i * (PH + GAPY)
        parts += panel(LEFT, y0, f"{name}: load (req/s)", xs, [
            ("offered (flood + normal)", "#888", [r["offered"] for r in s], "6,3"),
            ("reached the service", "#1f77b4", [r["upstream_received"] for r in s], ""),
            ("served 200 by the service", "#2ca02c", [r["upstream_served"] for r in s], ""),
            (f"capacity {p['capacity']:.0f}", "#d62728", [p["capacity"]] * len(s), "2,3"),
        ], load_max, "req/s", (p["flood_from"], p["flood_to"]), xmax)
        parts += panel(LEFT + PW + GAPX, y0, f"{name}: latency (ms)", xs, [
            ("normal reads p50 (client)", "#2ca02c", [r["normal_p50_ms"] for r in s], ""),
            ("normal reads p99 (client)", "#ff7f0e", [r["normal_p99_ms"] for r in s], ""),
            ("service p99 (queue + work)", "#9467bd", [r["upstream_p99_ms"] for r in s], "5,3"),
        ], lat_max, "ms", (p["flood_from"], p["flood_to"]), xmax)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
