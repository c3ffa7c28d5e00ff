"""The report's plots, drawn as inline SVG strings: line charts, heat maps, stacked bars.

No plotting library and no script: a report must open offline, years later, on a machine
that has only a browser. Hover text is SVG's own <title> element. Every text drawn comes
from a run's files (a model name, a node name), so every text is escaped (html.escape).

    svg = line_chart([Series("train", steps, losses)], x_label="step", y_label="loss")
    svg = heatmap(values, row_labels, col_labels, title="...")     # values: rows of numbers or None
    svg = stacked_bars(labels, [("compute", [..]), ("comm", [..])], title="...")
    html = figure("loss", "Loss against steps", svg, caption="...")   # <figure data-plot="loss">

Each function returns one <svg> element with a <title>; figure() wraps it for the page,
with the `data-plot` name the report's tests count. A series longer than MAX_POINTS is
thinned (every k-th point, the last kept) so a long run's report stays small.

Import rule: the standard library only (engine/monitor's rule is checked by
tests/test_architecture.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

MAX_POINTS = 2000
WIDTH = 760
HEIGHT = 300
# Room around the plot area: tick labels on the left, the legend on top, the x label below.
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 34, 46
CHAR_W = 6.6               # about the width of a character at font-size 12 (to fit labels)
# Okabe and Ito's palette: told apart by colour-blind readers too.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#E69F00", "#CC79A7", "#56B4E9", "#000000", "#F0E442")
MISSING = "#dddddd"        # a heat map cell with no number
# The largest magnitude a plot places. No step time, rate, byte or FLOP count comes near it; a
# larger number in a run's files is damaged, and left out: the axis arithmetic (spans, products,
# powers of ten) of numbers up to here stays far from a float's overflow (1.7e308 makes inf).
LARGEST = 1e30
# Viridis at five stops (dark blue: low, yellow: high); read the same in grey print.
VIRIDIS = ((0.0, (68, 1, 84)), (0.25, (59, 82, 139)), (0.5, (33, 145, 140)), (0.75, (94, 201, 98)),
           (1.0, (253, 231, 37)))


@dataclass
class Series:
    """One line of a chart: x and y values of the same length (y may hold None: a gap)."""
    name: str
    xs: list
    ys: list
    markers: bool = False      # draw each point (a few validation points would hide in a line)


def t(text) -> str:
    """Text for the page, escaped (quotes too: it also goes into attributes)."""
    return escape(str(text), quote=True)


def fmt(value: float) -> str:
    """A number in a few characters: 0.0123, 4.56, 7.8k, 1.2M, 3.4G."""
    if value == 0:
        return "0"
    size = abs(value)
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if size >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}" if size >= 1e-3 else f"{value:.2g}"


def fmt_bytes(value: float) -> str:
    """Bytes in binary units, as memory is reported: 1.50 GiB."""
    size = abs(value)
    for scale, suffix in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if size >= scale:
            return f"{value / scale:.3g} {suffix}"
    return f"{value:.0f} B"


def finite(value) -> bool:
    """A real number a plot can place (not None, not a bool, not NaN, infinite or beyond LARGEST).
    The comparisons are exact for an int of any size (no conversion to float that could overflow)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -LARGEST <= value <= LARGEST


def thin(xs: list, ys: list, limit: int = MAX_POINTS) -> tuple[list, list]:
    """At most `limit` points: every k-th, and always the last (the newest is what one looks for)."""
    if len(xs) <= limit:
        return list(xs), list(ys)
    k = math.ceil((len(xs) - 1) / (limit - 1))
    keep = list(range(0, len(xs) - 1, k)) + [len(xs) - 1]
    return [xs[i] for i in keep], [ys[i] for i in keep]


def nice_ticks(lo: float, hi: float, count: int = 5) -> tuple[float, float, list[float]]:
    """Axis bounds widened to round numbers and the ticks between them (steps of 1, 2, 2.5 or 5
    times a power of ten)."""
    # One value, or values closer than a float tells apart at their size: a band around it.
    if not hi - lo > max(abs(lo), abs(hi), 1 / LARGEST) * 1e-9:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / count
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first, last = math.floor(lo / step), math.ceil(hi / step)
    # 12 significant digits: float noise off (0.30000000000000004 is 0.3), small ticks kept.
    ticks = [float(f"{i * step:.12g}") for i in range(first, last + 1)]
    return ticks[0], ticks[-1], ticks


def log_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """Bounds and ticks of a log axis over positive lo..hi: the decades, or 1-2-5 steps within
    them when the data spans less than about two decades."""
    low, high = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    if high == low:
        high += 1
    ticks = [m * 10.0 ** e for e in range(low, high + 1) for m in ((1,) if high - low > 2 else (1, 2, 5))]
    # The bounds: the ticks just outside the data, so the line fills the plot.
    below = [v for v in ticks if v <= lo]
    bottom = below[-1]
    top = next(v for v in ticks if v >= hi and v > bottom)      # one value on a tick: up to the next
    return bottom, top, [v for v in ticks if bottom <= v <= top]


def colour(fraction: float) -> str:
    """The viridis colour at `fraction` (0: low, 1: high)."""
    fraction = min(1.0, max(0.0, fraction))
    for (a, ca), (b, cb) in zip(VIRIDIS, VIRIDIS[1:]):
        if fraction <= b:
            w = (fraction - a) / (b - a)
            r, g, bl = (round(x + (y - x) * w) for x, y in zip(ca, cb))
            return f"#{r:02x}{g:02x}{bl:02x}"
    return "#fde725"


def _svg_open(width: int, height: int, title: str) -> str:
    return (f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
            f'font-family="sans-serif" font-size="12"><title>{t(title)}</title>')


def _legend(names: list[str], colours: list[str], x: float, y: float) -> str:
    """Swatches and names in a row, left to right from (x, y)."""
    parts = []
    for name, c in zip(names, colours):
        parts.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="12" height="10" fill="{c}"/>'
                     f'<text x="{x + 16:.1f}" y="{y:.1f}">{t(name)}</text>')
        x += 28 + 7 * len(name)
    return "".join(parts)


def line_chart(series: list[Series], x_label: str, y_label: str, title: str, log_y: bool = False,
               x_format=fmt, y_format=fmt, width: int = WIDTH, height: int = HEIGHT,
               y_limits: tuple | None = None) -> str:
    """Several series against one x axis; log_y for values spanning decades (a loss). Points
    whose y is missing (or not positive on a log axis) leave a gap. y_limits: (lo, hi) the
    axis never goes past (a percentage: 0 and 100)."""
    cleaned = []
    for s in series:
        xs, ys = thin(s.xs, s.ys)
        # A log axis places positive numbers down to 1 / LARGEST (log10 of a smaller one, or of
        # a subnormal float, would take its ticks past what a float holds).
        ys = [y if finite(y) and (y >= 1 / LARGEST or not log_y) else None for y in ys]
        cleaned.append((s, [x if finite(x) else None for x in xs], ys))
    all_x = [x for _, xs, ys in cleaned for x, y in zip(xs, ys) if x is not None and y is not None]
    all_y = [y for _, xs, ys in cleaned for x, y in zip(xs, ys) if x is not None and y is not None]
    out = [_svg_open(width, height, title)]
    pw, ph = width - LEFT - RIGHT, height - TOP - BOTTOM
    if not all_y:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text></svg>')
        return "".join(out)
    x0, x1, xticks = nice_ticks(min(all_x), max(all_x))
    y0, y1, yticks = log_ticks(min(all_y), max(all_y)) if log_y else nice_ticks(min(all_y), max(all_y))
    if y_limits and not log_y:
        y0, y1 = max(y0, y_limits[0]), min(y1, y_limits[1])
        if not y1 > y0:
            y0, y1 = y_limits
        yticks = [y for y in yticks if y0 <= y <= y1] or [y0, y1]

    def px(x):
        return LEFT + (x - x0) / (x1 - x0) * pw

    def py(y):
        if log_y:
            return TOP + ph - (math.log10(y) - math.log10(y0)) / (math.log10(y1) - math.log10(y0)) * ph
        return TOP + ph - (y - y0) / (y1 - y0) * ph

    out.append(_axes(xticks, yticks, px, py, x_format, y_format, x_label, y_label, width, height))
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(cleaned))]
    for (s, xs, ys), c in zip(cleaned, colours):
        segments, current = [], []
        for x, y in zip(xs, ys):
            if x is None or y is None:
                if current:
                    segments.append(current)
                current = []
            else:
                current.append((x, y))
        if current:
            segments.append(current)
        last = next(((x, y) for x, y in zip(reversed(xs), reversed(ys)) if x is not None and y is not None), None)
        hover = f"{s.name}: last {y_format(last[1])} at {x_label} {x_format(last[0])}" if last else s.name
        out.append(f'<g><title>{t(hover)}</title>')
        for seg in segments:
            points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in seg)
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{points}"/>')
        if s.markers or all(len(seg) == 1 for seg in segments):
            for seg in segments:
                for x, y in seg:
                    out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"><title>'
                               f'{t(s.name)}: {t(y_format(y))} at {t(x_label)} {t(x_format(x))}</title></circle>')
        out.append("</g>")
    out.append(_legend([s.name for s, _, _ in cleaned], colours, LEFT, 16))
    out.append("</svg>")
    return "".join(out)


def _axes(xticks, yticks, px, py, x_format, y_format, x_label, y_label, width, height) -> str:
    """Grid lines, tick labels and axis labels of a chart with numeric x and y."""
    out = []
    bottom, top = py(yticks[0]), py(yticks[-1])
    left, right = px(xticks[0]), px(xticks[-1])
    for v in yticks:
        y = py(v)
        out.append(f'<line x1="{left:.1f}" x2="{right:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>'
                   f'<text x="{left - 6:.1f}" y="{y + 4:.1f}" text-anchor="end">{t(y_format(v))}</text>')
    for v in xticks:
        x = px(v)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top:.1f}" y2="{bottom:.1f}" stroke="#f0f0f0"/>'
                   f'<text x="{x:.1f}" y="{bottom + 16:.1f}" text-anchor="middle">{t(x_format(v))}</text>')
    out.append(f'<rect x="{left:.1f}" y="{top:.1f}" width="{right - left:.1f}" height="{bottom - top:.1f}" '
               'fill="none" stroke="#888"/>')
    out.append(f'<text x="{(left + right) / 2:.1f}" y="{height - 8}" text-anchor="middle">{t(x_label)}</text>')
    out.append(f'<text x="14" y="{(top + bottom) / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 14 {(top + bottom) / 2:.1f})">{t(y_label)}</text>')
    return "".join(out)


def heatmap(values: list[list], row_labels: list[str], col_labels: list[str], title: str, x_label: str = "",
            y_label: str = "", cell_titles: list[list[str]] | None = None, annotate: bool = False,
            value_format=fmt, width: int = WIDTH, scale: tuple | None = None) -> str:
    """A grid of coloured cells (rows top to bottom), a colour scale on the right. annotate
    writes each cell's number in it (a confusion matrix); cell_titles are the hover texts.
    scale: (lo, hi) of the colours (default: the numbers' range); a cell outside takes the
    end's colour (its hover text keeps its number)."""
    rows, cols = len(values), max((len(r) for r in values), default=0)
    numbers = [v for row in values for v in row if finite(v)]
    out_w = width
    longest = max((len(str(label)) for label in row_labels), default=0)
    left = max(60, 12 + CHAR_W * longest) + (24 if y_label else 0)
    right, top = 90, 12
    cell_h = min(28.0, max(3.0, 480 / max(rows, 1)))
    if annotate:
        cell_h = max(cell_h, 22.0)
    ph = cell_h * rows
    height = int(top + ph + 48)
    out = [_svg_open(out_w, height, title)]
    if not numbers or cols == 0:
        out.append(f'<text x="{out_w / 2}" y="{height / 2}" text-anchor="middle">no data</text></svg>')
        return "".join(out)
    lo, hi = scale if scale else (min(numbers), max(numbers))
    span = hi - lo or 1.0
    pw = out_w - left - right
    cell_w = pw / cols
    for i, row in enumerate(values):
        y = top + i * cell_h
        for j, v in enumerate(row):
            x = left + j * cell_w
            fill = colour(min(1.0, max(0.0, (v - lo) / span))) if finite(v) else MISSING
            hover = cell_titles[i][j] if cell_titles else (value_format(v) if finite(v) else "no number")
            # A hair wider than the cell: no white seams between neighbours at fractional widths.
            out.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{cell_w + 0.3:.2f}" height="{cell_h + 0.3:.2f}" '
                       f'fill="{fill}" shape-rendering="crispEdges"><title>{t(hover)}</title></rect>')
            if annotate and finite(v):
                ink = "#ffffff" if (v - lo) / span < 0.6 else "#000000"
                out.append(f'<text x="{x + cell_w / 2:.1f}" y="{y + cell_h / 2 + 4:.1f}" text-anchor="middle" '
                           f'fill="{ink}">{t(value_format(v))}</text>')
    # Row labels: every one when they fit, else every k-th.
    every = max(1, math.ceil(11 / cell_h))
    for i, label in enumerate(row_labels):
        if i % every == 0:
            out.append(f'<text x="{left - 6}" y="{top + i * cell_h + cell_h / 2 + 4:.1f}" '
                       f'text-anchor="end">{t(label)}</text>')
    every = max(1, math.ceil(cols / 10))
    for j, label in enumerate(col_labels):
        if j % every == 0 or j == cols - 1 and cols <= 10:
            out.append(f'<text x="{left + j * cell_w + cell_w / 2:.1f}" y="{top + ph + 16:.1f}" '
                       f'text-anchor="middle">{t(label)}</text>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 8}" text-anchor="middle">{t(x_label)}</text>')
    out.append(f'<text x="14" y="{top + ph / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + ph / 2:.1f})">{t(y_label)}</text>')
    # The colour scale: 20 bands, high at the top, the two ends labelled.
    bar_x, bar_h = out_w - right + 14, max(ph, 60.0)
    for k in range(20):
        out.append(f'<rect x="{bar_x}" y="{top + (19 - k) * bar_h / 20:.2f}" width="14" height="{bar_h / 20 + 0.3:.2f}" '
                   f'fill="{colour(k / 19)}"/>')
    out.append(f'<text x="{bar_x + 18}" y="{top + 10}">{t(value_format(hi))}</text>'
               f'<text x="{bar_x + 18}" y="{top + bar_h:.1f}">{t(value_format(lo))}</text>')
    out.append("</svg>")
    return "".join(out)


def stacked_bars(labels: list[str], parts: list[tuple[str, list]], title: str, value_label: str,
                 horizontal: bool = True, value_format=fmt, colours: list[str] | None = None,
                 width: int = WIDTH) -> str:
    """One bar per label, made of `parts` (name, a value per label) end to end. Horizontal:
    a row per label (many ranks read down the page); vertical: a column per label."""
    colours = colours or [PALETTE[i % len(PALETTE)] for i in range(len(parts))]
    n = len(labels)
    totals = [sum(v for _, values in parts if finite(v := values[i]) and v > 0) for i in range(n)]
    _, vmax, ticks = nice_ticks(0.0, max(totals, default=0.0) or 1.0)
    longest = max((len(str(label)) for label in labels), default=0)
    # Horizontal: room for the longest label on the left; vertical: the value ticks there.
    left = max(LEFT, 14 + CHAR_W * longest) if horizontal else LEFT
    # Vertical: the last column's label is centred under it and must not run off the edge.
    pw = width - left - (RIGHT if horizontal else max(RIGHT, CHAR_W * longest / 2))
    if horizontal:
        band = min(26.0, max(4.0, 480 / max(n, 1)))
        height = int(TOP + band * n + BOTTOM)
    else:
        band = pw / max(n, 1)
        height = HEIGHT
    ph = height - TOP - BOTTOM
    out = [_svg_open(width, height, title)]
    if n == 0:
        out.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text></svg>')
        return "".join(out)

    def scale(v):
        return v / vmax * (pw if horizontal else ph)

    for i, label in enumerate(labels):
        start = 0.0
        described = ", ".join(f"{name} {value_format(values[i])}" for name, values in parts if finite(values[i]))
        hover = f"{label}: {described} (total {value_format(totals[i])})"
        out.append(f'<g><title>{t(hover)}</title>')
        for (name, values), c in zip(parts, colours):
            v = values[i]
            if not finite(v) or v <= 0:
                continue
            size = scale(v)
            if horizontal:
                out.append(f'<rect x="{left + scale(start):.2f}" y="{TOP + i * band + band * 0.1:.2f}" '
                           f'width="{size:.2f}" height="{band * 0.8:.2f}" fill="{c}"/>')
            else:
                bar_w = min(band * 0.8, 60.0)        # a few ranks: bars, not walls
                out.append(f'<rect x="{left + i * band + (band - bar_w) / 2:.2f}" y="{TOP + ph - scale(start) - size:.2f}" '
                           f'width="{bar_w:.2f}" height="{size:.2f}" fill="{c}"/>')
            start += v
        out.append("</g>")
    every = max(1, math.ceil((11 if horizontal else CHAR_W * longest + 8) / band))
    for i, label in enumerate(labels):
        if i % every:
            continue
        if horizontal:
            out.append(f'<text x="{left - 6}" y="{TOP + i * band + band / 2 + 4:.1f}" text-anchor="end">{t(label)}</text>')
        else:
            out.append(f'<text x="{left + i * band + band / 2:.1f}" y="{TOP + ph + 16:.1f}" '
                       f'text-anchor="middle">{t(label)}</text>')
    for v in ticks:
        if horizontal:
            x = left + scale(v)
            out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + band * n:.1f}" stroke="#bbb" '
                       f'stroke-dasharray="2,3"/><text x="{x:.1f}" y="{TOP + band * n + 16:.1f}" '
                       f'text-anchor="middle">{t(value_format(v))}</text>')
        else:
            y = TOP + ph - scale(v)
            out.append(f'<line x1="{left}" x2="{width - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#bbb" '
                       f'stroke-dasharray="2,3"/><text x="{left - 6}" y="{y + 4:.1f}" '
                       f'text-anchor="end">{t(value_format(v))}</text>')
    axis_y = TOP + band * n if horizontal else TOP + ph
    if horizontal:
        out.append(f'<text x="{left + pw / 2:.1f}" y="{axis_y + 36:.1f}" text-anchor="middle">{t(value_label)}</text>')
    else:
        out.append(f'<text x="14" y="{TOP + ph / 2:.1f}" text-anchor="middle" '
                   f'transform="rotate(-90 14 {TOP + ph / 2:.1f})">{t(value_label)}</text>')
    out.append(_legend([name for name, _ in parts], colours, left, 16))
    out.append("</svg>")
    return "".join(out)


def figure(name: str, title: str, svg: str, caption: str = "") -> str:
    """A plot for the page: <figure data-plot="name"> with its heading and what it shows."""
    note = f"<p>{t(caption)}</p>" if caption else ""
    return (f'<figure data-plot="{t(name)}" id="plot-{t(name)}"><figcaption><h3>{t(title)}</h3>{note}'
            f'</figcaption>{svg}</figure>')
