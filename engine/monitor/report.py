"""`ringpipe report RUN_DIR --out FILE.html`: one self-contained HTML report of a run.

One file that opens offline in any browser, now or years later, copied off the cluster:
no script, no external URL, no image file beside it; the plots are inline SVG (svg.py) and
their hover texts SVG <title>s. It reads what the run wrote (read.py: monitor.json and
metrics.jsonl), so it runs on a login node without MPI, during the run or after it.

    a summary        model, layout, ranks and nodes, steps done of all, last loss and val loss,
                     tokens/s and MFU (medians), wall time
    stragglers       every rank the run named as one (metrics.jsonl's "stragglers"), a table
    loss             train and val loss against steps ("loss") and tokens seen ("loss-tokens");
                     val bits per byte ("bpb"); a classifier's accuracy ("accuracy") and its
                     last confusion matrix (OUT/val_confusion.json; an older run's records)
                     with per-class precision and recall ("confusion")
    speed            tokens/s (or examples/s) ("throughput") and MFU ("mfu") against steps
    every rank       compute time per rank and interval, a heat map ("step-heatmap"); the time
                     split per rank ("time-split"); resident and peak memory per rank ("memory")

A plot whose numbers the run did not write is left out with a note saying why (no val_bpb,
no MFU measured, an older run without per-rank sections). The file is written atomically
and only over a report this command wrote (or with --force): --out is never someone's file.

Import rule: engine/monitor's (job/ only; tests/test_architecture.py).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
from html import escape

from ringpipe.engine.job.files import try_create_beside, write_text_atomic
from ringpipe.engine.monitor import confusion, read, svg
from ringpipe.engine.monitor.svg import Series, finite, fmt

GENERATOR = '<meta name="generator" content="ringpipe report">'
# A report this command wrote has GENERATOR near its top; only such a file is overwritten
# without --force. Reading this much of the existing file is enough to find it.
MARK_BYTES = 4096
# The heat map and the per-rank bars stay readable (and the file small) for any run: longer
# runs have their intervals averaged in groups, larger worlds their ranks.
MAX_COLUMNS = 120
MAX_RANK_ROWS = 128
PARTS = ("compute", "comm", "bubble", "data", "other")
PART_COLOURS = ("#0072B2", "#E69F00", "#CC79A7", "#009E73", "#999999")
CONFUSION_LIMIT = 64        # classes; a larger matrix is unreadable as cells (the table stays)

STYLE = """
body { font-family: sans-serif; margin: 24px auto; max-width: 1100px; color: #222; padding: 0 16px; }
h1 { font-size: 1.5em; margin-bottom: 4px; } h2 { margin-top: 36px; border-bottom: 1px solid #ccc; }
h3 { font-size: 1.05em; margin: 0 0 4px 0; }
table { border-collapse: collapse; margin: 8px 0; }
td, th { border: 1px solid #ccc; padding: 3px 10px; text-align: left; font-variant-numeric: tabular-nums; }
th { background: #f3f3f3; }
figure { margin: 18px 0; } figcaption p { margin: 0 0 6px 0; color: #555; font-size: 0.92em; }
.note { color: #7a4b00; background: #fff6e0; padding: 6px 10px; border-left: 3px solid #e69f00; }
.muted { color: #666; font-size: 0.9em; }
nav a { margin-right: 14px; }
"""


class ReportError(ValueError):
    """The report cannot be written where asked; the message says why and what to do."""


# ---- the numbers ------------------------------------------------------------------------

def number(value) -> float | None:
    """A finite real number from a record, or None (missing, damaged or not a number)."""
    return float(value) if finite(value) else None


def replayed_out(records: list[dict]) -> list[dict]:
    """The records of the run as it stands: a run resumed from a checkpoint writes again the
    steps after that checkpoint; the newer records replace the older ones."""
    kept: list[dict] = []
    for record in records:
        while kept and kept[-1]["step"] >= record["step"]:
            kept.pop()
        kept.append(record)
    return kept


def median_of(records: list[dict], key: str) -> float | None:
    values = [v for r in records if (v := number(r.get(key))) is not None]
    return statistics.median(values) if values else None


def last_number(records: list[dict], key: str) -> tuple[float, int] | None:
    """The newest value of `key` and its step."""
    for record in reversed(records):
        if (v := number(record.get(key))) is not None:
            return v, record["step"]
    return None


def series_of(records: list[dict], key: str, scale: float = 1.0) -> tuple[list, list]:
    """Steps and values of the records that hold a number under `key`."""
    steps, values = [], []
    for record in records:
        if (v := number(record.get(key))) is not None:
            steps.append(record["step"])
            values.append(v * scale)
    return steps, values


def rate_key(header: dict | None, records: list[dict]) -> str:
    """tokens_per_s or examples_per_s: as the header's unit says, else as the records hold."""
    if header and header.get("unit") in ("tokens", "examples"):
        return f"{header['unit']}_per_s"
    return "examples_per_s" if any("examples_per_s" in r for r in records[:50]) else "tokens_per_s"


def items_per_step(header: dict | None, records: list[dict]) -> tuple[float | None, bool]:
    """Items (tokens or examples) one step processes, and whether it is estimated: from the
    header, else from the records (their rate is items per step over the step's time)."""
    given = number((header or {}).get("items_per_step"))
    if given:
        return given, False
    key = rate_key(header, records)
    sizes = [rate * ms / 1e3 for r in records
             if (rate := number(r.get(key))) is not None and (ms := number(r.get("step_ms"))) is not None]
    return (round(statistics.median(sizes)), True) if sizes else (None, True)


def rank_sections(records: list[dict]) -> list[dict]:
    """The records that hold a per-rank section, each entry checked to be a rank's dict."""
    sections = []
    for record in records:
        rows = record.get("ranks")
        if isinstance(rows, list):
            rows = [row for row in rows if isinstance(row, dict) and isinstance(row.get("rank"), int)]
            if rows:
                sections.append({"step": record["step"], "interval_steps": record.get("interval_steps"),
                                 "ranks": {row["rank"]: row for row in rows}})
    return sections


def steps_of(section: dict) -> int:
    """The steps a per-rank section averages over (1 where the record does not say)."""
    steps = section.get("interval_steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 1


def straggler_rows(records: list[dict]) -> list[dict]:
    """Every (rank, what) the run named as a straggler: when first and last, the worst ratio."""
    named: dict[tuple, dict] = {}
    for record in records:
        stragglers = record.get("stragglers")
        for s in stragglers if isinstance(stragglers, list) else []:
            if not isinstance(s, dict) or not isinstance(s.get("rank"), int):
                continue
            key = (s["rank"], str(s.get("what", "?")))
            row = named.setdefault(key, {"rank": s["rank"], "what": key[1], "node": s.get("node"),
                                         "first": record["step"], "ratio": None, "intervals": None})
            row["last"] = record["step"]
            if (ratio := number(s.get("ratio"))) is not None:
                row["ratio"] = max(ratio, row["ratio"] or ratio)
            if (count := number(s.get("intervals"))) is not None:
                row["intervals"] = max(int(count), row["intervals"] or 0)
    return sorted(named.values(), key=lambda row: (row["rank"], row["what"]))


def groups(count: int, limit: int) -> list[range]:
    """0..count-1 cut into at most `limit` consecutive groups of (nearly) equal size."""
    size = math.ceil(count / limit) if count > limit else 1
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"


def wall_seconds(records: list[dict]) -> float | None:
    """From the first step's start to the last step's end (a requeued run's waits included);
    a run whose records have no time: the sum of its step times."""
    timed = [r for r in records if number(r.get("time")) is not None]
    if len(timed) >= 1:
        first_ms = number(timed[0].get("step_ms")) or 0.0
        return timed[-1]["time"] - timed[0]["time"] + first_ms / 1e3
    total = sum(v for r in records if (v := number(r.get("step_ms"))) is not None)
    return total / 1e3 if total else None


# ---- the page ---------------------------------------------------------------------------

def t(text) -> str:
    return escape(str(text), quote=True)


def note(name: str, text: str) -> str:
    """What stands where a plot would be, and why it is not there."""
    return f'<p class="note" data-missing="{t(name)}">{t(text)}</p>'


def table(head: list[str] | None, rows: list[list]) -> str:
    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{t(h)}</th>" for h in head) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{t(cell)}</td>" for cell in row) + "</tr>")
    out.append("</table>")
    return "".join(out)


def _servers(header: dict) -> str:
    """ " + K parameter server(s)" for a run with dedicated servers (not in `world`)."""
    servers = header.get("parameter_servers")
    return f" + {len(servers)} parameter server(s)" if isinstance(servers, list) and servers else ""


def summary(run_dir: str, header: dict | None, records: list[dict]) -> str:
    header = header or {}
    unit = rate_key(header, records).split("_")[0]
    layout = header.get("layout")
    layout_text = (" x ".join(f"{k} {v}" for k, v in layout.items()) if isinstance(layout, dict) else "not recorded")
    ranks = header.get("ranks") if isinstance(header.get("ranks"), list) else []
    nodes = {r["node"] for r in ranks if isinstance(r, dict) and isinstance(r.get("node"), str)}
    world = header.get("world", len(ranks) or "?")
    steps_done = records[-1]["step"] if records else 0
    loss, val = last_number(records, "loss"), last_number(records, "val_loss")
    rate, mfu = median_of(records, rate_key(header, records)), median_of(records, "mfu")
    wall = wall_seconds(records)
    rows = [["model", header.get("model", "not recorded (no monitor.json)")],
            ["layout", layout_text],
            ["ranks / nodes", f"{world}{_servers(header)} / {len(nodes) if nodes else '?'}"],
            ["steps done / total", f"{steps_done} / {header.get('steps', '?')}"],
            ["last loss", f"{loss[0]:.4f} (step {loss[1]})" if loss else "none yet"],
            ["last val loss", f"{val[0]:.4f} (step {val[1]})" if val else "none yet"],
            [f"{unit}/s, median", fmt(rate) if rate is not None else "none yet"],
            ["MFU, median", f"{100 * mfu:.1f}%" if mfu is not None else "not measured"],
            ["wall time", duration(wall) if wall is not None else "none yet"]]
    sync = read.sync_text(header)
    if sync:
        rows.append(["gradient sync", sync])
    if header.get("precision"):
        rows.append(["precision", header["precision"]])
    slurm = header.get("slurm")
    if isinstance(slurm, dict):
        rows.append(["Slurm job", " ".join(f"{k} {v}" for k, v in slurm.items() if v is not None)])
    rows.append(["run directory", os.path.abspath(run_dir)])
    return "<h2 id=\"summary\">Summary</h2>" + table(None, rows)


def stragglers_section(header: dict | None, records: list[dict]) -> str:
    rows = straggler_rows(records)
    rule = (header or {}).get("straggler")
    told = (f" (a rank is named when it is {rule.get('ratio')}x the median for {rule.get('intervals')} "
            "intervals in a row)") if isinstance(rule, dict) else ""
    out = ['<h2 id="stragglers">Stragglers</h2>']
    if not rows:
        return "".join(out) + f"<p>No rank was named a straggler{t(told)}.</p>"
    out.append(f"<p>Ranks the run named a straggler{t(told)}; ratio: against the median rank.</p>")
    out.append(table(["rank", "node", "what", "worst ratio", "intervals in a row", "first named at step",
                      "last named at step"],
                     [[r["rank"], r["node"] or "?", r["what"], f"{r['ratio']:.2f}x" if r["ratio"] else "?",
                       r["intervals"] if r["intervals"] is not None else "?", r["first"], r["last"]]
                      for r in rows]))
    return "".join(out)


def loss_section(header: dict | None, records: list[dict]) -> str:
    out = ['<h2 id="loss">Loss</h2>']
    train_x, train_y = series_of(records, "loss")
    val_x, val_y = series_of(records, "val_loss")
    positive = [v for v in train_y + val_y if v > 0]
    log_y = bool(positive) and min(positive) > 0 and max(positive) / min(positive) > 20
    series = [Series("train loss", train_x, train_y), Series("val loss", val_x, val_y, markers=True)]
    scale_note = " Log scale (the loss spans more than 20x)." if log_y else ""
    out.append(svg.figure("loss", "Loss against steps", svg.line_chart(
        series, "step", "loss", "Train and validation loss against steps", log_y=log_y),
        f"Train loss each step, validation loss where the run validated.{scale_note}"))
    per_step, estimated = items_per_step(header, records)
    unit = rate_key(header, records).split("_")[0]
    if per_step:
        seen = [Series(s.name, [x * per_step for x in s.xs], s.ys, s.markers) for s in series]
        how = (f"estimated as {unit}/s x step time ({fmt(per_step)} a step; no monitor.json)" if estimated
               else f"step x {fmt(per_step)} {unit} a step")
        out.append(svg.figure("loss-tokens", f"Loss against {unit} seen", svg.line_chart(
            seen, f"{unit} seen", "loss", f"Train and validation loss against {unit} seen", log_y=log_y),
            f"{unit.capitalize()} seen: {how}.{scale_note}"))
    else:
        out.append(note("loss-tokens", f"No loss against {unit} seen: the run recorded neither its {unit} per "
                        "step (monitor.json) nor a rate and a step time."))
    bpb_x, bpb_y = series_of(records, "val_bpb")
    if bpb_y:
        out.append(svg.figure("bpb", "Validation bits per byte", svg.line_chart(
            [Series("val bits per byte", bpb_x, bpb_y, markers=True)], "step", "bits per byte",
            "Validation bits per byte against steps"),
            "The validation loss in bits per byte of text: comparable across tokenizers."))
    else:
        out.append(note("bpb", "No bits-per-byte plot: the run recorded no val_bpb (a classifier, a run "
                        "without validation, or none reached yet)."))
    return "".join(out)


def newest_confusion(run_dir: str, records: list[dict]) -> tuple[dict | None, str]:
    """The newest confusion matrix ({"step", "val_confusion"}): OUT/val_confusion.json, or an
    older run's last record that holds one; and why there is none when its file is damaged
    (the rest of the report is still drawn)."""
    try:
        found = confusion.read_confusion(run_dir)
    except (read.ReadError, OSError) as e:
        return None, f"No confusion matrix: {e}."
    if found is None:
        found = read.last_with(records, confusion.KEY)
    return found, ""


def classifier_section(records: list[dict], found: dict | None = None, problem: str = "") -> str:
    """Accuracy and the newest confusion matrix (`found`: newest_confusion's); '' for a run
    that is not a classifier."""
    acc_x, acc_y = series_of(records, "val_accuracy", scale=100.0)
    if not acc_y and found is None and not problem:
        return ""
    out = ['<h2 id="classifier">Classifier</h2>']
    if acc_y:
        out.append(svg.figure("accuracy", "Validation accuracy", svg.line_chart(
            [Series("val accuracy", acc_x, acc_y, markers=True)], "step", "accuracy (%)",
            "Validation accuracy against steps", y_format=lambda v: f"{v:.3g}%", y_limits=(0.0, 100.0)),
            "The share of validation examples classified right."))
    matrix = found.get(confusion.KEY) if found else None
    if not (isinstance(matrix, list) and matrix and all(isinstance(row, list) for row in matrix)):
        out.append(note("confusion", problem or "No confusion matrix: the run recorded none (or not as rows of "
                        "counts)."))
        return "".join(out)
    n = len(matrix)
    # Precision and recall of the same validation: its record (the newest that has them, else).
    last = next((r for r in reversed(records) if r["step"] == found["step"] and "val_precision" in r),
                read.last_with(records, "val_precision") or found)
    if not any(r["step"] == found["step"] for r in records):
        out.append(note("confusion-step", f"The confusion matrix is of step {found['step']}, which the log's "
                        "records do not hold (a resumed run went back to an earlier checkpoint, and has not "
                        "validated past it yet)."))
    precision = last.get("val_precision") if isinstance(last.get("val_precision"), list) else []
    recall = last.get("val_recall") if isinstance(last.get("val_recall"), list) else []
    if n <= CONFUSION_LIMIT:
        values = [[number(v) for v in row] for row in matrix]
        titles = [[f"true {i}, predicted {j}: {v if v is not None else 'no number'}" for j, v in enumerate(row)]
                  for i, row in enumerate(values)]
        out.append(svg.figure("confusion", f"Confusion matrix at step {found['step']}", svg.heatmap(
            values, [f"true {i}" for i in range(n)], [f"{j}" for j in range(max(len(r) for r in values))],
            f"Confusion matrix at step {found['step']}", x_label="predicted class", y_label="true class",
            cell_titles=titles, annotate=n <= 20, value_format=lambda v: f"{v:.0f}",
            width=180 + n * max(24, min(60, 560 // n))),
            "Rows: the true class; columns: the predicted class; counts of validation examples."))
    else:
        out.append(note("confusion", f"The confusion matrix has {n} classes, too many to draw as cells "
                        f"(at most {CONFUSION_LIMIT}); the table below has each class's precision and recall."))

    def pct(values, i):
        return f"{100 * v:.1f}%" if i < len(values) and (v := number(values[i])) is not None else "?"

    out.append(table(["class", "precision", "recall", "examples (true)"],
                     [[i, pct(precision, i), pct(recall, i),
                       fmt(sum(v for v in row if finite(v)))] for i, row in enumerate(matrix)]))
    return "".join(out)


def speed_section(header: dict | None, records: list[dict]) -> str:
    out = ['<h2 id="speed">Speed</h2>']
    key = rate_key(header, records)
    unit = key.split("_")[0]
    x, y = series_of(records, key)
    if y:
        out.append(svg.figure("throughput", f"{unit.capitalize()} per second", svg.line_chart(
            [Series(f"{unit}/s", x, y)], "step", f"{unit}/s", f"{unit.capitalize()} per second against steps"),
            f"The whole job's {unit} per second at each step (the first step includes compiling)."))
    else:
        out.append(note("throughput", f"No throughput plot: no record has {key} yet."))
    x, y = series_of(records, "mfu", scale=100.0)
    if y:
        out.append(svg.figure("mfu", "Model FLOPs utilisation", svg.line_chart(
            [Series("MFU", x, y)], "step", "MFU (%)", "MFU against steps", y_format=lambda v: f"{v:.3g}%"),
            "Model FLOP/s over the ranks' measured GEMM peak (world x gemm_peak_flops_per_rank)."))
    else:
        out.append(note("mfu", "No MFU plot: the run did not measure its GEMM peak at start-up (or no step "
                        "record has mfu yet)."))
    return "".join(out)


def rank_label(rank: int, marked: set) -> str:
    return f"rank {rank}{' *' if rank in marked else ''}"


def ranks_section(header: dict | None, records: list[dict]) -> str:
    out = ['<h2 id="ranks">Every rank</h2>']
    sections = rank_sections(records)
    if not sections:
        why = ("this run's metrics.jsonl has no per-rank section (an older run, written before the monitor, "
               "or one that has not reached its first interval)")
        if header and header.get("interval") == 0:
            why = "the run was started with --monitor-every 0 (per-rank measurements off)"
        for name in ("step-heatmap", "time-split", "memory"):
            out.append(note(name, f"No {name.replace('-', ' ')} plot: {why}."))
        return "".join(out)
    ranks = sorted({r for s in sections for r in s["ranks"]})
    nodes = {}
    for s in sections:
        for r, row in s["ranks"].items():
            nodes[r] = str(row.get("node", "?"))
    marked = {row["rank"] for row in straggler_rows(records)}
    star = " Ranks marked * were named stragglers." if marked else ""
    rank_groups = groups(len(ranks), MAX_RANK_ROWS)

    def group_label(g):
        return rank_label(ranks[g[0]], marked) if len(g) == 1 else f"ranks {ranks[g[0]]}-{ranks[g[-1]]}"

    grouped_note = (f" {len(ranks)} ranks drawn in groups of {len(rank_groups[0])}." if len(rank_groups[0]) > 1
                    else "")
    # The heat map: a row per rank, a column per interval (or group of intervals).
    col_groups = groups(len(sections), MAX_COLUMNS)
    values, titles = [], []
    for g in rank_groups:
        row_values, row_titles = [], []
        for cg in col_groups:
            first = sections[cg[0]]
            start = first["step"] - steps_of(first) + 1
            end = sections[cg[-1]]["step"]
            per_rank = []
            for ri in g:
                cells = [v for ci in cg if (v := number(sections[ci]["ranks"].get(ranks[ri], {}).get("compute_ms")))
                         is not None]
                if cells:
                    per_rank.append((sum(cells) / len(cells), ranks[ri]))
            if per_rank:
                # A group of ranks shows its slowest: a straggler must not be averaged away.
                worst, who = max(per_rank)
                row_values.append(worst)
                row_titles.append(f"rank {who} on {nodes.get(who, '?')}, steps {start}-{end}: compute {worst:.1f} ms"
                                  " a step")
            else:
                row_values.append(None)
                row_titles.append(f"{group_label(g)}, steps {start}-{end}: no number")
        values.append(row_values)
        titles.append(row_titles)
    col_labels = [str(sections[cg[-1]]["step"]) for cg in col_groups]
    averaged = (f" Columns average {len(col_groups[0])} intervals each." if len(col_groups[0]) > 1 else "")
    # The colours span the later columns: the first interval holds the step that compiles the
    # kernels (several times a step's compute), which would leave every later cell one colour.
    later = [v for row in values for v in row[1:] if v is not None]
    scale = (min(later), max(later)) if len(col_groups) > 1 and later else None
    scaled = (" The first column (the step that compiles the kernels) is left out of the colour scale; a cell "
              "beyond it takes the brightest colour." if scale else "")
    out.append(svg.figure("step-heatmap", "Compute time per rank and interval", svg.heatmap(
        values, [group_label(g) for g in rank_groups], col_labels,
        "Compute time (ms a step) per rank and interval", x_label="step (end of the interval)",
        cell_titles=titles, scale=scale),
        "Colour: compute_ms, the rank's compute time a step, its mean over each interval (brighter is slower; "
        f"the time a rank waits for others is not compute, so a slow rank stands out).{averaged}{scaled}"
        f"{grouped_note}{star}"))
    # The time split: the mean over every interval, per rank.
    def mean_split(rank):
        """The mean per step over the run: each interval weighted by its steps (the first,
        short one holds the compiling step and must not count as much as a long one)."""
        split = {}
        for part in PARTS:
            cells = [(v, steps_of(s)) for s in sections
                     if (v := number(s["ranks"].get(rank, {}).get(f"{part}_ms"))) is not None]
            weight = sum(w for _, w in cells)
            split[part] = sum(v * w for v, w in cells) / weight if weight else None
        return split

    means = {part: [] for part in PARTS}
    for g in rank_groups:
        # A group of ranks shows its slowest rank's split (the largest total), as the heat map does.
        split = max((mean_split(ranks[ri]) for ri in g), key=lambda sp: sum(v for v in sp.values() if v))
        for part in PARTS:
            means[part].append(split[part])
    out.append(svg.figure("time-split", f"Time split per rank, mean over all {len(sections)} intervals",
                          svg.stacked_bars([group_label(g) for g in rank_groups],
                                           [(p, means[p]) for p in PARTS],
                                           f"Time split per rank (ms a step), mean over all {len(sections)} "
                                           "intervals", "ms a step", colours=list(PART_COLOURS)),
                          "Each rank's step time split into compute, exposed communication, pipeline bubble, data "
                          f"wait and the rest (untimed), averaged over every per-rank interval.{grouped_note}"
                          f"{' Groups show their slowest rank.' if grouped_note else ''}{star}"))
    out.append(_memory_figure(sections[-1], ranks, rank_groups, [group_label(g) for g in rank_groups],
                              f"{' Groups show their largest rank.' if grouped_note else ''}{star}"))
    return "".join(out)


def _memory_figure(last: dict, ranks: list, rank_groups: list, labels: list, more: str) -> str:
    """Memory per rank (a group of ranks: its largest) at the last interval `last`: resident,
    and the peak above it; `more`: what the caption adds (groups, stragglers)."""
    resident, above = [], []
    for g in rank_groups:
        rows = [last["ranks"].get(ranks[ri], {}) for ri in g]
        rss = [v for row in rows if (v := number(row.get("rss_bytes"))) is not None]
        peak = [v for row in rows if (v := number(row.get("peak_bytes"))) is not None]
        top_rss = max(rss) if rss else None
        resident.append(top_rss)
        above.append(max(0.0, max(peak) - (top_rss or 0.0)) if peak else None)
    # Ticks at round numbers of one binary unit (GiB, or MiB for a small run), not of bytes.
    largest = max([v for v in resident if v is not None] + [0.0])
    unit, scale = ("GiB", 1 << 30) if largest + max([v or 0.0 for v in above] + [0.0]) >= 1 << 30 else ("MiB", 1 << 20)
    return svg.figure("memory", f"Memory per rank at step {last['step']}", svg.stacked_bars(
        labels,
        [("resident", [v / scale if v is not None else None for v in resident]),
         ("peak above resident", [v / scale if v is not None else None for v in above])],
        f"Resident and peak memory per rank at step {last['step']}", unit, horizontal=False,
        value_format=lambda v: f"{v:.3g} {unit}", colours=["#0072B2", "#56B4E9"]),
        "Resident memory at the last interval (dark) and the process's peak (VmHWM: the whole bar)." + more)


def render(run_dir: str, header: dict | None, records: list[dict], now: float | None = None) -> str:
    """The whole report page as one string."""
    records = replayed_out(records)
    found, problem = newest_confusion(run_dir, records)
    classifier = found is not None or bool(problem) or any("val_accuracy" in r for r in records)
    # The page's sections, for the links at its top (in-page anchors: the file stays self-contained).
    sections = ["summary", "stragglers", "loss"] + (["classifier"] if classifier else []) + ["speed", "ranks"]
    name = os.path.basename(os.path.abspath(run_dir))
    when = datetime.datetime.fromtimestamp(now if now is not None else datetime.datetime.now().timestamp())
    parts = [f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n{GENERATOR}\n'
             f"<title>ringpipe report: {t(name)}</title><style>{STYLE}</style></head><body>",
             f"<h1>ringpipe report: {t(name)}</h1>",
             f'<p class="muted">Written {when:%Y-%m-%d %H:%M} by <code>ringpipe report</code> from '
             f"{t(os.path.abspath(run_dir))}. Hover over a plot for its numbers.</p>",
             "<nav>" + "".join(f'<a href="#{anchor}">{anchor}</a>' for anchor in sections) + "</nav>"]
    if header is None:
        parts.append('<p class="note" data-missing="monitor.json">This run has no monitor.json (an older run, '
                     "or one still starting): the report is drawn from metrics.jsonl alone.</p>")
    parts.append(summary(run_dir, header, records))
    if not records:
        parts.append('<p class="note" data-missing="records">No step record yet: metrics.jsonl is empty or '
                     "missing (the run has not finished its first step). Run the report again later.</p>")
        parts.append("</body></html>\n")
        return "".join(parts)
    parts.append(stragglers_section(header, records))
    parts.append(loss_section(header, records))
    parts.append(classifier_section(records, found, problem))
    parts.append(speed_section(header, records))
    parts.append(ranks_section(header, records))
    parts.append("</body></html>\n")
    return "".join(parts)


# ---- the command ------------------------------------------------------------------------

def check_out(path: str, force: bool) -> None:
    """--out may be written: a new file in an existing folder that takes files, or a report
    this command wrote (any file with --force). Raises ReportError saying what to do."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ReportError(f"--out {path} is a folder: name the HTML file to write, e.g. {os.path.join(path, 'report.html')}")
    if not os.path.isdir(folder):
        raise ReportError(f"--out {path}: its folder {folder} does not exist; create it first (mkdir -p {folder})")
    try:
        try_create_beside(path)
    except OSError as e:
        raise ReportError(f"--out {path}: no file can be written in {folder} ({e.strerror or e}); name a file in "
                          "a folder you can write to") from None
    if not os.path.lexists(path) or force:
        return
    if not os.path.isfile(path) or os.path.islink(path):
        raise ReportError(f"--out {path} exists and is not a regular file; name another file")
    try:
        with open(path, "rb") as fh:
            head = fh.read(MARK_BYTES)
    except OSError as e:
        raise ReportError(f"--out {path} exists and cannot be read ({e.strerror or e}); name another file") from None
    if GENERATOR.encode() not in head:
        raise ReportError(f"--out {path} exists and is not a report ringpipe wrote: it is left alone. Name "
                          "another file, or add --force to replace it")


def main(argv=None, prog: str = "ringpipe report") -> int:
    p = argparse.ArgumentParser(
        prog=prog, description="Write one self-contained HTML report of a run: loss, validation loss and bits "
        "per byte against steps and tokens, tokens/s and MFU, a per-rank compute-time heat map, the time split "
        "and memory per rank, stragglers, and for a classifier its accuracy and confusion matrix. No script, no "
        "external URL: it opens offline in any browser. Works during a run and after it, from a login node.",
        epilog="example: ringpipe report runs/gpt --out gpt-report.html")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (the --out of `ringpipe train`)")
    p.add_argument("--out", metavar="FILE.html", default=None,
                   help="the HTML file to write (default: RUN_DIR/report.html); an existing file is replaced "
                   "only if this command wrote it")
    p.add_argument("--force", action="store_true", help="replace --out even if it is not a report ringpipe wrote")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:                # --help (0) or a usage error (2, argparse printed it)
        return int(e.code or 0)
    out = args.out or os.path.join(args.run_dir, "report.html")
    try:
        read.check_run_dir(args.run_dir)
        check_out(out, args.force)
        header = read.read_header(args.run_dir)
        records = read.read_records(args.run_dir)
    except (read.ReadError, ReportError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:                   # an I/O error reading the run (permissions, a vanished mount)
        print(f"{prog}: error: cannot read {e.filename or args.run_dir} ({e.strerror or e}); check the path "
              "and its permissions", file=sys.stderr)
        return 2
    page = render(args.run_dir, header, records)
    try:
        write_text_atomic(out, page)
    except OSError as e:
        print(f"{prog}: error: cannot write {out} ({e.strerror or e}); check the folder's permissions and "
              "free space, or name another --out", file=sys.stderr)
        return 2
    steps = len({r["step"] for r in records})       # a resumed run wrote some steps twice
    print(f"{prog}: wrote {out} ({len(page.encode()) / 1024:.0f} KiB; {steps} steps)")
    return 0
