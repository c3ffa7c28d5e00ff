"""`ringpipe top RUN_DIR`: a live terminal view of a running job, from a login node.

It reads what rank 0 writes (OUT/monitor.json, OUT/metrics.jsonl; docs/monitoring.md) over
the shared file system, every --interval seconds, and shows one row per rank from the
newest per-rank section: its node, step time and how that time splits (compute, exposed
communication, pipeline bubble, data wait), memory, CPU and GPU use; stragglers stand out.
A header says what the run is, where it is (step, loss, speed, ETA) and whether it is
running, finished or stalled.

    load_view(run_dir)      everything shown, read once (pure reading; no terminal)
    plain_text(view)        the same as a plain-text table (--once, and when stdout is no terminal)
    make_app(run_dir)       the live view: a Textual app (keys q, s, p)
    main(argv, prog)        the command line

Import rule: engine/monitor's (job/ only). Textual (the `monitor` extra) is imported only
for the live view, so `--once` and `--help` work where it is not installed.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

from ringpipe.engine.job.files import try_create_beside, write_text_atomic
from ringpipe.engine.job.rundir import DONE_NAME, MAX_RANKS, FinishedError, finished
from ringpipe.engine.monitor.read import (HEADER_NAME, TAIL_BYTES, ReadError, check_run_dir, last_with, metrics_path,
                                          job_ranks, read_header, sync_text, tail_records)
from ringpipe.engine.monitor.svg import finite

DEFAULT_INTERVAL = 2.0
# The ETA's pace: wall time over the newest records (pauses for validation and checkpoints
# included, as the run will have them again), at most this many.
PACE_RECORDS = 50
# "no progress" is said after this long without a new record, or 10 steps' time if longer:
# a slow model's step is not a stall.
STALL_MIN_S = 60.0
STALL_STEPS = 10
SORTS = ("rank", "step time", "compute")      # the `s` key cycles through them, in this order
TEXT_LIMIT = 40                                # a node name or a field read longer than this is cut
# The log's tail read each time: 1 MiB, and room for two per-rank sections (a rank's entry is
# ~400 bytes: 4096 ranks write 1.6 MiB sections, which a fixed 1 MiB would never hold whole).
RANK_ENTRY_BYTES = 1024
# The first line of a --screenshot: an existing file is replaced only when it starts so (this
# command wrote it), never someone's picture that happens to have the name.
SCREENSHOT_MARK = "<!-- ringpipe top screenshot: --screenshot replaces this file -->"


@dataclass
class RankRow:
    """One rank's numbers from a per-rank section, ready to show (None: not in the record)."""
    rank: int
    node: str
    step: int
    step_ms: float | None
    compute_pct: float | None
    comm_pct: float | None
    bubble_pct: float | None
    data_pct: float | None
    rss_bytes: float | None
    peak_bytes: float | None
    cpu_percent: float | None
    gpu_percent: float | None
    compute_ms: float | None
    straggler: str = ""                        # "straggler: compute 1.8x", "" when not one


@dataclass
class View:
    """What `top` shows of a run at one moment."""
    run_dir: str
    facts: list[str] = field(default_factory=list)   # the header line's pieces: model, layout, step, ETA ...
    state: str = ""                                   # running / finished / no progress for ... (stalled?)
    note: str = ""                                    # waiting for the run, or why there are no rows yet
    error: str = ""                                   # a ReadError's message: shown, not fatal
    rows: list[RankRow] = field(default_factory=list)
    summary: str = ""
    has_gpu: bool = False


# ---- reading ------------------------------------------------------------------------------

def _number(value) -> float | None:
    """A finite JSON number, else None: a field missing, null, of the wrong type or beyond
    any real measurement (svg.finite) is shown as "-" (the files may come from another
    version, or be damaged), never a crash."""
    return float(value) if finite(value) else None


def _text(value, limit: int = TEXT_LIMIT) -> str:
    """A string from a file, safe to print: control characters (a terminal's escape
    sequences) become "?", and it is cut at `limit`."""
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _pace(records: list[dict]) -> float | None:
    """Seconds per step over the newest records: their wall times ("time"), else their
    step_ms. Only the newest run of rising steps counts (a resumed run repeats steps)."""
    recent = [records[-1]]
    for record in reversed(records[:-1]):
        if record["step"] >= recent[-1]["step"] or len(recent) >= PACE_RECORDS:
            break
        recent.append(record)
    timed = [r for r in recent if _number(r.get("time")) is not None]
    if len(timed) >= 2:
        steps = timed[0]["step"] - timed[-1]["step"]
        seconds = timed[0]["time"] - timed[-1]["time"]
        if steps > 0 and seconds > 0:
            return seconds / steps
    step_ms = [_number(r.get("step_ms")) for r in recent]
    step_ms = [ms for ms in step_ms if ms is not None and ms > 0]
    return statistics.median(step_ms) / 1e3 if step_ms else None


def _state(run_dir: str, header: dict | None, last: dict | None, pace: float | None, now: float) -> str:
    """running, finished (every rank's completion marker), or no progress for a while."""
    if os.path.isdir(os.path.join(run_dir, DONE_NAME)):
        try:
            done, _ = finished(run_dir, job_ranks(header))
        except (FinishedError, OSError) as e:
            return f"completion markers unreadable ({_text(e, 200)})"
        if done:
            return "finished"
    last_time = _number(last.get("time")) if last else None
    if last_time is None:
        try:
            last_time = os.stat(metrics_path(run_dir)).st_mtime
        except OSError:
            return "waiting"
    idle = now - last_time
    if idle > max(STALL_MIN_S, STALL_STEPS * (pace or 0.0)):
        return f"no progress for {duration(idle)} (stalled?)"
    return "running"


def _layout(header: dict) -> str:
    layout = header.get("layout")
    if not isinstance(layout, dict):
        return "layout ?"
    return "layout " + " x ".join(f"{name} {_text(layout.get(name, '?'), 8)}" for name in ("dp", "pp", "tp"))


def _ranks_and_nodes(header: dict | None, rows: list[RankRow]) -> str:
    nodes: set[str] = set()
    ranks = None
    if header and isinstance(header.get("ranks"), list):
        ranks = len(header["ranks"])
        nodes = {_text(r.get("node")) for r in header["ranks"] if isinstance(r, dict) and "node" in r}
    if rows:
        ranks = ranks or len(rows)
        nodes = nodes or {row.node for row in rows}
    if ranks is None:
        return ""
    servers = header.get("parameter_servers") if header else None
    plus = f" + {len(servers)} parameter server(s)" if isinstance(servers, list) and servers else ""
    return f"{ranks} rank{'s' if ranks != 1 else ''}{plus}" + (
        f" on {len(nodes)} node{'s' if len(nodes) != 1 else ''}" if nodes else "")


def _rows(record: dict) -> list[RankRow]:
    """One RankRow per entry of a per-rank section (entries that are not objects with an
    integer rank are left out: a damaged entry must not hide the others)."""
    markers: dict[int, list[str]] = {}
    stragglers = record.get("stragglers")
    for s in stragglers if isinstance(stragglers, list) else []:
        if isinstance(s, dict) and type(s.get("rank")) is int:
            ratio = _number(s.get("ratio"))
            markers.setdefault(s["rank"], []).append(
                f"{_text(s.get('what', '?'), 12)} {ratio:.1f}x" if ratio is not None else _text(s.get("what", "?"), 12))
    rows = []
    entries = record.get("ranks")
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or type(entry.get("rank")) is not int:
            continue
        step_ms = _number(entry.get("step_ms"))

        def share(key: str) -> float | None:
            part = _number(entry.get(key))
            return 100.0 * part / step_ms if part is not None and step_ms else None

        rank = entry["rank"]
        rows.append(RankRow(
            rank=rank, node=_text(entry.get("node", "?")), step=record["step"], step_ms=step_ms,
            compute_pct=share("compute_ms"), comm_pct=share("comm_ms"), bubble_pct=share("bubble_ms"),
            data_pct=share("data_ms"), rss_bytes=_number(entry.get("rss_bytes")),
            peak_bytes=_number(entry.get("peak_bytes")), cpu_percent=_number(entry.get("cpu_percent")),
            gpu_percent=_number(entry.get("gpu_util_percent")), compute_ms=_number(entry.get("compute_ms")),
            straggler="straggler: " + ", ".join(markers[rank]) if rank in markers else ""))
    return rows


def _summary(rows: list[RankRow], record: dict) -> str:
    timed = [row for row in rows if row.step_ms is not None]
    if not timed:
        return ""
    slowest = max(timed, key=lambda row: row.step_ms)
    over = record.get("interval_steps")
    over = f", each the mean of {over} steps" if type(over) is int else ""
    text = (f"step {record['step']}{over}: step time median {statistics.median(r.step_ms for r in timed):.0f} ms, "
            f"max {slowest.step_ms:.0f} ms (slowest: rank {slowest.rank} on {slowest.node})")
    stragglers = [row for row in rows if row.straggler]
    if stragglers:
        text += "; stragglers: " + ", ".join(f"rank {row.rank} ({row.straggler.removeprefix('straggler: ')})"
                                             for row in stragglers[:8])
        text += f" and {len(stragglers) - 8} more" if len(stragglers) > 8 else ""
    else:
        text += "; no stragglers"
    return text


def load_view(run_dir: str, now: float | None = None) -> View:
    """Read the run once: everything `top` shows. A file that cannot be used (ReadError,
    an OSError of the shared file system) is the view's error, not an exception."""
    now = time.time() if now is None else now
    view = View(run_dir=run_dir)
    try:
        header = read_header(run_dir)
        world = header.get("world") if header else None
        world = world if type(world) is int and 0 < world <= MAX_RANKS else 0
        damaged: list = []
        records = tail_records(run_dir, TAIL_BYTES + 2 * world * RANK_ENTRY_BYTES, skipped=damaged)
    except ReadError as e:
        view.error = _text(e, 2000)
        return view
    except OSError as e:
        view.error = _text(f"cannot read {e.filename or run_dir} ({e.strerror or e}); check the path and its "
                           "permissions", 2000)
        return view
    if damaged:
        # The good records around them still show; the report (which reads every line) refuses.
        # Why the first was skipped, as the report says it (the file, the line, the fault).
        view.error = _text(f"{len(damaged)} damaged line(s) in the log's tail skipped, the other records are "
                           f"shown; the first: {damaged[0]}", 2000)
    if header:
        view.facts.append(f"model {_text(header.get('model', '?'))}")
        view.facts.append(_layout(header))
        sync = sync_text(header)
        if sync:
            view.facts.append(sync)
    else:
        view.facts.append(f"no {HEADER_NAME}: model and layout unknown")
    ranked = last_with(records, "ranks")
    if ranked is not None:
        view.rows = _rows(ranked)
        view.has_gpu = any(row.gpu_percent is not None for row in view.rows)
        view.summary = _summary(view.rows, ranked)
    who = _ranks_and_nodes(header, view.rows)
    if who:
        view.facts.append(who)
    steps = header.get("steps") if header else None
    steps = steps if type(steps) is int and steps > 0 else None
    if not records:
        view.note = "waiting for the run to write metrics.jsonl ..."
        view.facts.append(f"step -/{steps}" if steps else "step -")
        view.state = "waiting"
        return view
    last = records[-1]
    view.facts.append(f"step {last['step']}/{steps}" if steps else f"step {last['step']}")
    loss = _number(last.get("loss"))
    view.facts.append(f"loss {loss:.4f}" if loss is not None else "loss -")
    unit = _text(header.get("unit", "tokens"), 12) if header else "tokens"
    speed = _number(last.get(f"{unit}_per_s"))
    view.facts.append(f"{unit}/s {speed:,.0f}" if speed is not None else f"{unit}/s -")
    pace = _pace(records)
    view.state = _state(run_dir, header, last, pace, now)
    if view.state == "finished":
        view.facts.append("ETA -")
    elif steps and pace:
        view.facts.append(f"ETA {duration(max(0, steps - last['step']) * pace)} ({pace:.2f} s/step)")
    else:
        view.facts.append("ETA ?" if not steps else "ETA - (no step times yet)")
    if ranked is None:
        interval = header.get("interval") if header else None
        if interval == 0:
            view.note = ("no per-rank sections: the run was started with --monitor-every 0 (per-rank "
                         "measurements off); the header's numbers come from rank 0's step records")
        else:
            view.note = ("no per-rank section in the log's newest records yet (rank 0 writes one every "
                         + (f"{interval} steps)" if type(interval) is int else "interval; see monitor.json)"))
    elif not view.rows:
        view.note = f"the per-rank section of step {ranked['step']} holds no rank entries ringpipe can read"
    return view


# ---- showing ------------------------------------------------------------------------------

def duration(seconds: float) -> str:
    """12 s, 4 min 05 s, 3 h 20 min, 2 d 04 h."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 86400:
        return f"{s // 3600} h {s // 60 % 60:02d} min"
    return f"{s // 86400} d {s // 3600 % 24:02d} h"


def human_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1 << 30:
        return f"{value / (1 << 30):.1f} GiB"
    return f"{value / (1 << 20):.0f} MiB"


def _fixed(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


# (column key, title, right-aligned?, the cell's text)
COLUMNS = [
    ("rank", "rank", True, lambda r: str(r.rank)),
    ("node", "node", False, lambda r: r.node),
    ("step", "step", True, lambda r: str(r.step)),
    ("step_ms", "step ms", True, lambda r: _fixed(r.step_ms)),
    ("compute", "compute", True, lambda r: _fixed(r.compute_pct, "%")),
    ("comm", "comm", True, lambda r: _fixed(r.comm_pct, "%")),
    ("bubble", "bubble", True, lambda r: _fixed(r.bubble_pct, "%")),
    ("data", "data", True, lambda r: _fixed(r.data_pct, "%")),
    ("rss", "RSS", True, lambda r: human_bytes(r.rss_bytes)),
    ("peak", "peak", True, lambda r: human_bytes(r.peak_bytes)),
    ("cpu", "CPU%", True, lambda r: _fixed(r.cpu_percent, "%")),
    ("gpu", "GPU%", True, lambda r: _fixed(r.gpu_percent, "%")),
    ("straggler", "", False, lambda r: r.straggler),
]


def columns(view: View) -> list[tuple]:
    """The columns shown: GPU% only for a run that measured it."""
    return [c for c in COLUMNS if c[0] != "gpu" or view.has_gpu]


def sort_rows(rows: list[RankRow], sort: str) -> list[RankRow]:
    """By rank, or slowest (step time, compute time) first."""
    if sort == "step time":
        return sorted(rows, key=lambda r: (-(r.step_ms or 0.0), r.rank))
    if sort == "compute":
        return sorted(rows, key=lambda r: (-(r.compute_ms or 0.0), r.rank))
    return sorted(rows, key=lambda r: r.rank)


def header_line(view: View) -> str:
    return "   ".join(view.facts + [view.state])


def plain_text(view: View, sort: str = "rank") -> str:
    """The view as plain text: a header, the table (every rank), the summary."""
    lines = [f"ringpipe top {_text(view.run_dir, 200)}", header_line(view)]
    if view.error:
        lines.append(f"error: {view.error}")
    if view.note:
        lines.append(view.note)
    if view.rows:
        shown = columns(view)
        cells = [[c[3](row) for c in shown] for row in sort_rows(view.rows, sort)]
        widths = [max([len(c[1])] + [len(line[i]) for line in cells]) for i, c in enumerate(shown)]

        def line(texts: list[str]) -> str:
            return "  ".join(t.rjust(w) if c[2] else t.ljust(w) for t, w, c in zip(texts, widths, shown)).rstrip()

        lines += ["", line([c[1] for c in shown])] + [line(texts) for texts in cells]
    if view.summary:
        lines += ["", view.summary]
    return "\n".join(lines)


# ---- the live view (Textual) --------------------------------------------------------------

def make_app(run_dir: str, interval: float = DEFAULT_INTERVAL):
    """The live view, a Textual App (app.run() shows it; the tests drive it headless)."""
    # Textual is imported here, not at the top, so that --once and --help need only the
    # base install; the app's class is built here for the same reason.
    from rich.text import Text
    from textual import work
    from textual.app import App, ComposeResult
    from textual.widgets import DataTable, Footer, Static

    class TopApp(App):
        """The live view: a header, every rank's row (scrolls), the summary; keys q, s, p."""
        TITLE = "ringpipe top"
        ENABLE_COMMAND_PALETTE = False     # its ctrl+p beside p (pause) would surprise
        CSS = """
        #title { height: auto; background: $boost; padding: 0 1; }
        #note { height: auto; padding: 0 1; color: $warning; }
        #ranks { height: 1fr; }
        #summary { height: auto; padding: 0 1; background: $boost; }
        """
        BINDINGS = [("q", "quit", "quit"), ("s", "cycle_sort", "sort"), ("p", "pause", "pause")]

        def __init__(self):
            super().__init__()
            self.view: View | None = None
            self.sort = SORTS[0]
            self.paused = False
            self.shown_columns: list[tuple] = []

        def compose(self) -> ComposeResult:
            yield Static(id="title")
            yield Static(id="note")
            # No padding of the table's own: the cells carry it (a space each side), so a
            # straggler's whole row is one band of colour, not cells with gaps between them.
            yield DataTable(id="ranks", cursor_type="row", zebra_stripes=True, cell_padding=0)
            yield Static(id="summary")
            yield Footer()

        def on_mount(self) -> None:
            self.query_one("#title", Static).update(Text(f"ringpipe top {_text(run_dir, 200)}   reading ..."))
            self.poll()
            self.set_interval(interval, self.poll)

        def poll(self) -> None:
            if not self.paused:
                self.load()

        @work(thread=True, exclusive=True)
        def load(self) -> None:
            # A thread: a slow shared file system must not freeze the keys.
            view = load_view(run_dir)
            self.call_from_thread(self.show, view)

        def show(self, view: View) -> None:
            self.view = view
            title = Text(f"ringpipe top {_text(run_dir, 200)}", style="bold")
            title.append(f"   sort: {self.sort}" + ("   PAUSED (p resumes)" if self.paused else ""))
            title.append("\n" + "   ".join(view.facts) + "   ")
            title.append(view.state, style="bold red" if "stalled" in view.state else "bold")
            self.query_one("#title", Static).update(title)
            note = self.query_one("#note", Static)
            note.update(Text(f"error: {view.error}", style="bold red") if view.error else Text(view.note))
            note.display = bool(view.error or view.note)
            if view.error:
                return                     # keep the last rows that could be read
            self.fill_table(view)
            self.query_one("#summary", Static).update(Text(view.summary))

        def fill_table(self, view: View) -> None:
            table = self.query_one("#ranks", DataTable)
            shown = columns(view)
            if [c[0] for c in shown] != [c[0] for c in self.shown_columns]:
                table.clear(columns=True)
                for key, title, right, _ in shown:
                    table.add_column(Text(f" {title} ", justify="right" if right else "left"), key=key)
                self.shown_columns = shown
            _fill_rows(table, shown, view, self.sort)

        def action_cycle_sort(self) -> None:
            self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
            if self.view is not None:
                self.show(self.view)

        def action_pause(self) -> None:
            self.paused = not self.paused
            if self.view is not None:
                self.show(self.view)
            if not self.paused:
                self.load()

    return TopApp()


def _fill_rows(table, shown: list, view: View, sort: str) -> None:
    """The rank table's rows (a DataTable with the columns `shown`), updated in place from
    `view`, then sorted by `sort`. Rows are kept by rank: the table keeps its scroll
    position and cursor across refreshes (clear() would reset them)."""
    from rich.text import Text
    rows = {str(row.rank): row for row in view.rows}
    for key in [k.value for k in table.rows if k.value not in rows]:
        table.remove_row(key)
    for key, row in rows.items():
        style = "bold reverse red" if row.straggler else ""
        cells = [Text(f" {c[3](row)} ", style=style, justify="right" if c[2] else "left") for c in shown]
        if key in table.rows:
            for c, cell in zip(shown, cells):
                # Widths only grow: a narrower cell would make the table measure its
                # whole column again, for every such cell (minutes at 512 ranks).
                wider = cell.cell_len > table.columns[c[0]].content_width
                table.update_cell(key, c[0], cell, update_width=wider)
        else:
            table.add_row(*cells, key=key)
    order = {str(row.rank): i for i, row in enumerate(sort_rows(view.rows, sort))}
    table.sort("rank", key=lambda cell: order[cell.plain.strip()])


async def first_reading(app, pilot, timeout: float = 10.0) -> None:
    """Wait until a headless app (app.run_test()) shows its first reading (a thread's)."""
    deadline = time.monotonic() + timeout
    while app.view is None and time.monotonic() < deadline:
        await pilot.pause(0.05)
    await pilot.pause(0.1)


def check_screenshot(path: str) -> None:
    """--screenshot may be written: a new *.svg in an existing folder that takes files, or a
    screenshot this command wrote. Raises ValueError saying what to do (before the view starts)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path.endswith(".svg"):
        raise ValueError(f"--screenshot {path}: the file is an SVG picture; name it *.svg")
    if os.path.isdir(path):
        raise ValueError(f"--screenshot {path} is a folder: name the file to write, e.g. "
                         f"{os.path.join(path, 'top.svg')}")
    if not os.path.isdir(folder):
        raise ValueError(f"--screenshot {path}: its folder {folder} does not exist; create it first "
                         f"(mkdir -p {folder}) or name a file in another folder")
    if os.path.lexists(path):
        if os.path.islink(path) or not os.path.isfile(path):
            raise ValueError(f"--screenshot {path} exists and is not a regular file; name another file")
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                first = fh.readline(len(SCREENSHOT_MARK) + 2)
        except OSError as e:
            raise ValueError(f"--screenshot {path} exists and cannot be read ({e.strerror or e}); name another "
                             "file") from None
        if first.rstrip("\n") != SCREENSHOT_MARK:
            raise ValueError(f"--screenshot {path} exists and is not a screenshot ringpipe top wrote: it is left "
                             "alone. Name another file, or remove it first")
    try:
        try_create_beside(path)
    except OSError as e:
        raise ValueError(f"--screenshot {path}: no file can be written in {folder} ({e.strerror or e}); name a "
                         "file in a folder you can write to") from None


def save_screenshot(run_dir: str, path: str, size: tuple[int, int]) -> None:
    """The live view drawn headless at `size` (columns, lines) into an SVG file (the
    documentation's picture: docs/monitoring.md says how it is made), written whole or
    not at all, its first line SCREENSHOT_MARK."""
    import asyncio
    app = make_app(run_dir)
    shot = []

    async def shoot() -> None:
        async with app.run_test(size=size) as pilot:
            await first_reading(app, pilot)
            shot.append(app.export_screenshot())

    asyncio.run(shoot())
    write_text_atomic(path, SCREENSHOT_MARK + "\n" + shot[0])


# ---- the command line ---------------------------------------------------------------------

def _size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"{text!r} is not COLUMNSxLINES (e.g. 160x40)") from None
    if not (40 <= width <= 1000 and 10 <= height <= 1000):
        raise ValueError(f"{text}: the width must be in 40..1000 and the height in 10..1000")
    return width, height


def main(argv=None, prog: str = "ringpipe top") -> int:
    import argparse
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A live terminal view of a running job: one row per rank (node, step, step time, "
                    "the share of it spent in compute, exposed communication, pipeline bubble and data "
                    "wait, memory, CPU and GPU use), stragglers highlighted, the job's ETA. It reads the "
                    "run directory's monitor.json and metrics.jsonl, so it runs anywhere the shared file "
                    "system is mounted (a login node), without MPI.",
        epilog="keys: q quit, s sort by rank / step time / compute time (slowest first), p pause, "
               "arrows and PgUp/PgDn scroll.\nThe per-rank numbers are rank 0's newest per-rank section "
               "(every `interval` steps, averaged over them); docs/monitoring.md explains every column.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (the --out of `ringpipe train`)")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL, metavar="SECONDS",
                   help=f"how often to read the files again (default {DEFAULT_INTERVAL:g})")
    p.add_argument("--once", action="store_true", help="print the newest state as a plain-text table and "
                   "exit (for scripts and logs; chosen by itself when stdout is not a terminal)")
    p.add_argument("--screenshot", metavar="FILE.svg", help="draw the live view once, headless, into an SVG "
                   "file and exit (the documentation's picture)")
    p.add_argument("--size", default="160x40", metavar="COLUMNSxLINES",
                   help="the terminal size of --screenshot (default 160x40)")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:                # --help (0) or a usage error (2, argparse printed it)
        return int(e.code or 0)
    if not (math.isfinite(args.interval) and 0.1 <= args.interval <= 3600):
        print(f"{prog}: error: --interval {args.interval:g}: give seconds in 0.1..3600", file=sys.stderr)
        return 2
    try:
        size = _size(args.size)
    except ValueError as e:
        print(f"{prog}: error: --size {e}", file=sys.stderr)
        return 2
    try:
        check_run_dir(args.run_dir)
        if args.screenshot:
            check_screenshot(args.screenshot)
    except ValueError as e:                # ReadError too
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    once = args.once
    if not once and not args.screenshot and not sys.stdout.isatty():
        print(f"{prog}: stdout is not a terminal: printing the newest state once (as --once)", file=sys.stderr)
        once = True
    if once:
        view = load_view(args.run_dir)
        try:
            print(plain_text(view), flush=True)
        except BrokenPipeError:          # `ringpipe top RUN --once | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if view.error:
            print(f"{prog}: error: {view.error}", file=sys.stderr)
            return 2
        return 0
    try:
        import textual  # noqa: F401  (checked before the screen is taken over)
    except ImportError:
        print(f"{prog}: error: the live view needs Textual, which is not installed: pip install "
              "'ringpipe[monitor]' (or pip install textual); --once prints the table without it", file=sys.stderr)
        return 2
    if args.screenshot:
        try:
            save_screenshot(args.run_dir, args.screenshot, size)
        except OSError as e:               # checked before; a full disk or a vanished folder since
            print(f"{prog}: error: cannot write {args.screenshot} ({e.strerror or e}); check the folder's "
                  "permissions and free space, or name another file", file=sys.stderr)
            return 2
        print(f"saved {args.screenshot}")
        return 0
    make_app(args.run_dir, args.interval).run()
    return 0
