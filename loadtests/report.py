"""The HTML report of a load-test run: budgets, and latency and replicas over time.

Plots are hand-made inline SVG, so the report is one self-contained file that needs no
plotting library and no network to open (CI keeps it as an artifact).
"""

from __future__ import annotations

import csv
import html
import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PALETTE = ("#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#bcbd22")
FAILED_COLOR = "#d62728"
MAX_DOTS = 4000  # beyond this an SVG gets slow to open; failures are always kept


@dataclass
class Series:
    """One thing drawn on a chart: dots (one per request), a line, or steps (counts)."""

    label: str
    points: list[tuple[float, float]]
    style: str = "line"  # "line", "step" or "dots"
    color: str = ""
    dashed: bool = False


@dataclass
class Frame:
    """Maps data to pixels for one chart."""

    x_max: float
    y_min: float
    y_max: float
    log_y: bool
    width: int = 820
    height: int = 230
    # Margins: the right one holds the legend.
    top: int = 30
    right: int = 150
    bottom: int = 36
    left: int = 62

    def x(self, value: float) -> float:
        share = min(max(value, 0), self.x_max) / self.x_max
        return self.left + (self.width - self.left - self.right) * share

    def y(self, value: float) -> float:
        top, bottom = self.top, self.bottom
        if self.log_y:
            value = max(value, self.y_min)
            share = math.log10(value / self.y_min) / math.log10(self.y_max / self.y_min)
        else:
            share = (value - self.y_min) / (self.y_max - self.y_min)
        return self.height - bottom - (self.height - top - bottom) * min(max(share, 0), 1)


def nice_step(span: float, count: int = 6) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) giving about ``count`` ticks."""
    raw = max(span, 1e-9) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def frame_for(series: list[Series], x_max: float, log_y: bool) -> Frame:
    values = [y for s in series for _, y in s.points]
    if log_y:
        positive = [v for v in values if v > 0] or [1.0]
        low = 10 ** math.floor(math.log10(max(min(positive), 0.1)))
        high = 10 ** math.ceil(math.log10(max(max(positive), low * 10)))
        return Frame(max(x_max, 1.0), low, max(high, low * 10), True)
    high = max([*values, 1.0])
    return Frame(max(x_max, 1.0), 0.0, count_step(high) * math.ceil(high / count_step(high)),
                 False)


def count_step(high: float) -> float:
    """Tick step of a linear chart: those plot counts, so never a fraction."""
    return max(nice_step(high, 4), 1.0)


def y_ticks(frame: Frame) -> list[float]:
    if frame.log_y:
        low, high = round(math.log10(frame.y_min)), round(math.log10(frame.y_max))
        return [10.0 ** e for e in range(low, high + 1)]
    step = count_step(frame.y_max)
    return [i * step for i in range(int(frame.y_max / step) + 1)]


def axes_svg(frame: Frame, title: str, y_label: str) -> list[str]:
    top, bottom, left = frame.top, frame.bottom, frame.left
    x0, x1 = frame.x(0), frame.x(frame.x_max)
    parts = [f'<text x="{left}" y="18" class="title">{html.escape(title)}</text>']
    for value in y_ticks(frame):
        y = frame.y(value)
        parts.append(f'<line x1="{x0}" x2="{x1}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        parts.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" class="tick" '
                     f'text-anchor="end">{value:g}</text>')
    step = nice_step(frame.x_max)
    for i in range(int(frame.x_max / step) + 1):
        x = frame.x(i * step)
        parts.append(f'<text x="{x:.1f}" y="{frame.height - bottom + 16}" class="tick" '
                     f'text-anchor="middle">{i * step:g}</text>')
    parts.append(f'<text x="{(x0 + x1) / 2:.0f}" y="{frame.height - 4}" class="tick" '
                 'text-anchor="middle">seconds since the scenario started</text>')
    parts.append(f'<text x="12" y="{top + 4}" class="tick">{html.escape(y_label)}</text>')
    parts.append(f'<line x1="{x0}" x2="{x0}" y1="{top}" y2="{frame.y(frame.y_min):.1f}" '
                 'class="axis"/>')
    return parts


def series_svg(frame: Frame, s: Series) -> str:
    if s.style == "dots":
        return "".join(f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="2.2" '
                       f'fill="{s.color}" fill-opacity="0.6"/>' for x, y in s.points)
    if not s.points:
        return ""
    coords = [(frame.x(x), frame.y(y)) for x, y in s.points]
    path = f"M{coords[0][0]:.1f},{coords[0][1]:.1f}"
    for (_, y_prev), (x, y) in itertools.pairwise(coords):
        # Steps: a count holds its value until the next sample.
        path += f" L{x:.1f},{y_prev:.1f} L{x:.1f},{y:.1f}" if s.style == "step" \
            else f" L{x:.1f},{y:.1f}"
    dash = ' stroke-dasharray="5,3"' if s.dashed else ""
    return f'<path d="{path}" fill="none" stroke="{s.color}" stroke-width="1.8"{dash}/>'


def legend_svg(frame: Frame, series: list[Series]) -> list[str]:
    x = frame.width - frame.right + 12
    parts = []
    for i, s in enumerate(series):
        y = frame.top + 6 + 16 * i
        dash = ' stroke-dasharray="5,3"' if s.dashed else ""
        parts.append(f'<line x1="{x}" x2="{x + 16}" y1="{y}" y2="{y}" stroke="{s.color}" '
                     f'stroke-width="{5 if s.style == "dots" else 2}"{dash}/>')
        parts.append(f'<text x="{x + 22}" y="{y + 4}" class="tick">{html.escape(s.label)}'
                     "</text>")
    return parts


def chart(title: str, series: list[Series], x_max: float, y_label: str,
          log_y: bool = False) -> str:
    """One inline SVG chart; an empty chart says so instead of drawing nothing."""
    for i, s in enumerate(series):
        s.color = s.color or PALETTE[i % len(PALETTE)]
    series = [s for s in series if s.points]
    frame = frame_for(series, x_max, log_y)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{frame.width}" '
             f'height="{frame.height}" viewBox="0 0 {frame.width} {frame.height}">']
    parts += axes_svg(frame, title, y_label)
    if not series:
        parts.append(f'<text x="{frame.width / 2}" y="{frame.height / 2}" class="tick" '
                     'text-anchor="middle">no data</text>')
    parts += [series_svg(frame, s) for s in series]
    parts += legend_svg(frame, series)
    return "\n".join([*parts, "</svg>"])


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def latency_series(out: Path, name: str, started: float) -> list[Series]:
    """Every request as a dot (failures red), and locust's windowed p95 as a line."""
    by_name: dict[str, list[tuple[float, float]]] = {}
    failed: list[tuple[float, float]] = []
    for row in read_csv(out / f"{name}_requests.csv"):
        point = (float(row["start"]) - started, max(float(row["ms"]), 0.1))
        (by_name.setdefault(row["name"], []) if row["ok"] == "1" else failed).append(point)
    thin = max(1, sum(len(p) for p in by_name.values()) // MAX_DOTS)
    series = [Series(label, points[::thin], "dots") for label, points in sorted(by_name.items())]
    series.append(Series("failed", failed, "dots", FAILED_COLOR))
    p95 = [(float(r["Timestamp"]) - started, float(r["95%"]))
           for r in read_csv(out / f"{name}_stats_history.csv")
           if r["Name"] == "Aggregated" and r["95%"] not in ("N/A", "", "0")]
    series.append(Series("p95, 10 s window", p95, "line", "#333333", dashed=True))
    return series


def replica_series(samples: list[dict[str, Any]], run: dict[str, Any]) -> tuple[
        list[Series], list[Series]]:
    """Replicas (running, starting) and requests in flight (ongoing, queued) per deployment."""
    rows = [s for s in samples if s["server"] == run["server"]
            and run["started"] - 1 <= s["t"] <= run["ended"] + 1]
    replicas: list[Series] = []
    inflight: list[Series] = []
    for i, deployment in enumerate(sorted({r["deployment"] for r in rows})):
        mine = [r for r in rows if r["deployment"] == deployment]
        color = PALETTE[i % len(PALETTE)]

        def points(key: str, mine: list[dict[str, Any]] = mine) -> list[tuple[float, float]]:
            return [(r["t"] - run["started"], float(r[key])) for r in mine]

        replicas += [Series(f"{deployment} running", points("running"), "step", color),
                     Series(f"{deployment} starting", points("starting"), "step", color, True)]
        inflight += [Series(f"{deployment} ongoing", points("ongoing"), "step", color),
                     Series(f"{deployment} queued", points("queued"), "step", color, True)]
    return replicas, inflight


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1000px; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 4px 10px; text-align: left; }
.pass { color: #1a7f37; font-weight: bold; } .fail { color: #d62728; font-weight: bold; }
svg { display: block; margin: 0.5em 0 1em; }
svg .title { font-size: 14px; font-weight: bold; } svg .tick { font-size: 11px; fill: #444; }
svg .grid { stroke: #e5e5e5; } svg .axis { stroke: #888; }
"""


def verdict(passed: bool) -> str:
    return '<span class="pass">PASS</span>' if passed else '<span class="fail">FAIL</span>'


def budget_table(runs: list[dict[str, Any]]) -> str:
    rows = ["<tr><th>scenario</th><th>budget</th><th>measured</th><th>limit</th>"
            "<th>result</th></tr>"]
    for run in runs:
        missing = {"name": "budgets", "detail": run.get("error") or "no budget report",
                   "measured": None, "limit": 0, "unit": "", "at_least": False, "passed": False}
        for b in run["budgets"] or [missing]:
            measured = "-" if b["measured"] is None else f"{b['measured']:g}{b['unit']}"
            limit = f"{'>=' if b['at_least'] else '<='} {b['limit']:g}{b['unit']}"
            if b.get("detail"):
                measured, limit = b["detail"], ""
            rows.append(f"<tr><td><a href='#{run['name']}'>{run['name']}</a></td>"
                        f"<td>{html.escape(b['name'])}</td><td>{measured}</td>"
                        f"<td>{html.escape(limit)}</td><td>{verdict(b['passed'])}</td></tr>")
    return "<table>" + "\n".join(rows) + "</table>"


def scenario_section(out: Path, run: dict[str, Any], samples: list[dict[str, Any]]) -> str:
    name, span = run["name"], max(run["ended"] - run["started"], 1.0)
    links = " · ".join(f'<a href="{f}">{f}</a>' for f in (
        f"{name}.html", f"{name}_stats.csv", f"{name}_stats_history.csv",
        f"{name}_requests.csv", f"{name}.log") if (out / f).is_file())
    replicas, inflight = replica_series(samples, run)
    note = f"<p class='fail'>{html.escape(run['error'])}</p>" if run.get("error") else ""
    return "\n".join([
        f'<h2 id="{name}">{name} {verdict(run["passed"])}</h2>',
        f"<p>app <code>{html.escape(run['app'])}</code>, {span:.0f} s, locust exit code "
        f"{run['exit_code']}. Files: {links}</p>{note}",
        chart("Latency of each request", latency_series(out, name, run["started"]), span,
              "ms (log)", log_y=True),
        chart("Replicas (from /-/status every 0.5 s)", replicas, span, "replicas"),
        chart("Requests in flight, as seen by the ingress", inflight, span, "requests"),
    ])


def write_report(out: Path, runs: list[dict[str, Any]], samples: list[dict[str, Any]],
                 title: str) -> Path:
    """Write ``out/index.html`` and return its path."""
    passed = bool(runs) and all(run["passed"] for run in runs)
    body = [
        f"<h1>{html.escape(title)}: {verdict(passed)}</h1>",
        f"<p>Generated {time.strftime('%Y-%m-%d %H:%M:%S')}. Raw samples of /-/status: "
        '<a href="replicas.csv">replicas.csv</a>.</p>',
        "<h2>Budgets</h2>", budget_table(runs),
        *[scenario_section(out, run, samples) for run in runs],
    ]
    index = out / "index.html"
    index.write_text("<!doctype html>\n<html><head><meta charset='utf-8'>"
                     f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
                     "<body>\n" + "\n".join(body) + "\n</body></html>\n")
    return index
