"""A small hand-written SVG of ``scale.py``'s results (no matplotlib: it is not a dependency).

Six panels (constructor to first batch, shutdown, frames/s, main-process CPU per batch, 1M and 25M
update latency), x = workers (log 2), y = log 10; one colour per collector kind, solid for rlharvest,
dashed for TorchRL 0.12.  Points that failed or did not start are left out (the table says why).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PANELS = (("run", "first_batch_s", 1.0, "constructor to first batch (s)"),
          ("run", "shutdown_s", 1.0, "shutdown (s)"),
          ("run", "frames_per_s", 1.0, "frames/s (counting env)"),
          ("run", "main_cpu_ms_per_batch", 1.0, "main-process CPU per batch (ms)"),
          ("w1m", "update_s", 1e3, "1M-parameter update (ms)"),
          ("w25m", "update_s", 1e3, "25M-parameter update (ms)"))
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
PANEL_W, PANEL_H, MARGIN_L, MARGIN_T, MARGIN_B = 300, 190, 48, 28, 30


def _series(results: list[dict[str, Any]], what: str, key: str, scale: float) -> dict[tuple[str, str], list]:
    series: dict[tuple[str, str], list] = {}
    for result in results:
        value = result.get(key)
        if result.get("what") != what or "error" in result or not isinstance(value, (int, float)) or value <= 0:
            continue
        series.setdefault((result["kind"], result["side"]), []).append((result["workers"], value * scale))
    return {name: sorted(points) for name, points in series.items()}


def _panel(x0: float, y0: float, title: str, series: dict, kinds: list[str], xs: list[int]) -> list[str]:
    out = [f'<text x="{x0 + PANEL_W / 2}" y="{y0 - 8}" text-anchor="middle" font-size="12">{title}</text>',
           f'<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#999"/>']
    values = [v for points in series.values() for _, v in points]
    if not values or not xs:
        return out + [f'<text x="{x0 + 10}" y="{y0 + 20}" font-size="11">no data</text>']
    lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    hi = max(hi, lo + 1)
    lx0, lx1 = math.log2(min(xs)), math.log2(max(xs))

    def px(n: float) -> float:
        return x0 + 10 + (PANEL_W - 20) * ((math.log2(n) - lx0) / (lx1 - lx0) if lx1 > lx0 else 0.5)

    def py(v: float) -> float:
        return y0 + PANEL_H - PANEL_H * (math.log10(v) - lo) / (hi - lo)

    for decade in range(lo, hi + 1):
        y = py(10.0**decade)
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + PANEL_W}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{10.0**decade:g}</text>')
    for n in xs:
        out.append(f'<text x="{px(n):.1f}" y="{y0 + PANEL_H + 14}" text-anchor="middle" font-size="10">{n}</text>')
    for (kind, side), points in sorted(series.items()):
        colour = COLOURS[kinds.index(kind) % len(COLOURS)]
        dash = ' stroke-dasharray="5,3"' if side != "rlharvest" else ""
        path = " ".join(f"{px(n):.1f},{py(v):.1f}" for n, v in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.6"{dash}/>')
        out += [f'<circle cx="{px(n):.1f}" cy="{py(v):.1f}" r="2.2" fill="{colour}"/>' for n, v in points]
    return out


def render(report: dict[str, Any]) -> str:
    """The SVG text of ``report`` (``scale.py``'s JSON)."""
    results = report["results"]
    kinds = sorted({r["kind"] for r in results})
    xs = sorted({r["workers"] for r in results})
    cols, rows = 3, 2
    width = cols * (PANEL_W + MARGIN_L) + 20
    legend_h = 20 * (len(kinds) // 3 + 2)
    height = rows * (PANEL_H + MARGIN_T + MARGIN_B) + legend_h + 30
    mode = "--busy: one spinning process per core" if report["mode"] == "busy" else "no --busy"
    loads = sorted(float(r["loadavg_before"].split()[0]) for r in results if r.get("loadavg_before"))
    load = f"1-min load {loads[0]:g}-{loads[-1]:g} before the points" if loads else f"load {report['loadavg_start']}"
    title = f"Scaling with workers ({mode}), {report['cpus']} cores, {report['date']}; {load}; x = workers"
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="18" font-size="13">{title}</text>']
    for index, (what, key, scale, label) in enumerate(PANELS):
        x0 = MARGIN_L + (index % cols) * (PANEL_W + MARGIN_L)
        y0 = 30 + MARGIN_T + (index // cols) * (PANEL_H + MARGIN_T + MARGIN_B)
        out += _panel(x0, y0, label, _series(results, what, key, scale), kinds, xs)
    y = rows * (PANEL_H + MARGIN_T + MARGIN_B) + 40
    for index, kind in enumerate(kinds):
        x, yy = 20 + (index % 3) * 300, y + 20 * (index // 3)
        colour = COLOURS[index % len(COLOURS)]
        out.append(f'<line x1="{x}" y1="{yy}" x2="{x + 24}" y2="{yy}" stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{x + 30}" y="{yy + 4}" font-size="11">{kind}</text>')
    yy = y + 20 * (len(kinds) // 3 + 1)
    out.append(f'<text x="20" y="{yy}" font-size="11">solid: rlharvest; dashed: TorchRL 0.12; '
               f'failed or unstarted points are omitted (see the table)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(report))
