"""Reading what a run wrote for its watchers: OUT/monitor.json and OUT/metrics.jsonl.

The tools (`ringpipe top`, `ringpipe report`) read a run that may be writing while they
read, on a shared file system, from another machine: a last line still being written is
not an error (it is left out), and neither is a run that has not written anything yet.
Everything read is checked before it is used: a damaged or foreign file gives a
ReadError that names the file and what to do. Every JSON the tools read goes through
parse() below (files.parse_json, bounded for these files): an integer of thousands of
digits or a value nested hundreds deep is a damaged record, never a traceback.

    header = read_header(run_dir)            # monitor.json: layout, ranks, steps (or None)
    records = read_records(run_dir)          # every whole record of metrics.jsonl
    recent = tail_records(run_dir)           # the records in the file's last MiB (a live view), and
                                             # further back when the newest record is longer
"""
from __future__ import annotations

import os

from ringpipe.engine.job.files import UnreadableFile, open_regular, parse_json, read_json

HEADER_NAME = "monitor.json"
METRICS_NAME = "metrics.jsonl"
FORMAT = "ringpipe-monitor"
# A metrics.jsonl of a long run is large (a record per step, a per-rank section every
# interval); the report reads all of it, within this bound.
RECORDS_LIMIT = 2 << 30
TAIL_BYTES = 1 << 20
# A live view reads further back than TAIL_BYTES when the newest record is longer (an older
# run wrote a classifier's whole confusion matrix into its validation records: 18 MB for
# 3,000 classes), up to this much; a record longer still is said, not waited for.
TAIL_LIMIT = 64 << 20
# What ringpipe writes for its watchers nests a few levels (a record, its per-rank list, an
# entry) and counts nothing past 64 bits: deeper or longer is a damaged or hostile file.
MAX_DEPTH = 16
MAX_INT_DIGITS = 19


class ReadError(ValueError):
    """A run directory's files cannot be used; the message says which and why."""


def parse(text, where: str):
    """The JSON of one of the run's files (a line of the log, the header, a section file):
    files.UnreadableFile naming `where` for anything malformed, too deep or too large."""
    return parse_json(text, where, max_depth=MAX_DEPTH, max_int_digits=MAX_INT_DIGITS)


def header_path(run_dir: str) -> str:
    return os.path.join(run_dir, HEADER_NAME)


def metrics_path(run_dir: str) -> str:
    return os.path.join(run_dir, METRICS_NAME)


def check_run_dir(run_dir: str) -> None:
    """A folder that holds a run (monitor.json or metrics.jsonl), else ReadError."""
    if not os.path.exists(run_dir):
        raise ReadError(f"{run_dir} does not exist: name a run directory (the --out of `ringpipe train`)")
    if not os.path.isdir(run_dir):
        raise ReadError(f"{run_dir} is not a folder: name a run directory (the --out of `ringpipe train`)")
    if not (os.path.exists(header_path(run_dir)) or os.path.exists(metrics_path(run_dir))):
        raise ReadError(f"{run_dir} holds no {HEADER_NAME} nor {METRICS_NAME}: it is not a run directory, or "
                        "its run has not started yet (name the --out of `ringpipe train`)")


def read_header(run_dir: str) -> dict | None:
    """monitor.json (what the run is: its ranks, nodes, layout, steps), or None when the run
    has not written one (an older run, or one not started yet)."""
    path = header_path(run_dir)
    if not os.path.exists(path):
        return None
    try:
        header = read_json(path, "the run's monitor header", limit=64 << 20, max_depth=MAX_DEPTH,
                           max_int_digits=MAX_INT_DIGITS)
    except UnreadableFile as e:
        raise ReadError(f"{e}; it is rewritten when the run (re)starts") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ReadError(f"{path} is not a ringpipe monitor header (no \"format\": \"{FORMAT}\")")
    return header


def _parse_lines(data: bytes, path: str, skipped: list | None = None, offset: int | None = None) -> list[dict]:
    """The records of whole lines. A line that is not a step record raises ReadError, or, with
    `skipped` (a list), is left out and the ReadError's message appended there instead.
    offset: where `data` starts in the file when it is a tail cut after a line's end; its
    lines are then named by the byte they start at, since their numbers are not known."""
    records = []
    lines = data.split(b"\n")
    at = offset
    # The last piece is "" after a final newline, or a line still being written: left out.
    for number, line in enumerate(lines[:-1], start=1):
        where = f"{path} line {number}" if offset is None else f"{path}: the line at byte {at:,}"
        if offset is not None:
            at += len(line) + 1
        if not line.strip():
            continue
        try:
            record, why = parse(line, where), None
        except UnreadableFile as e:
            record, why = None, str(e)
        step = record.get("step") if isinstance(record, dict) else None
        if type(step) is not int or step < 0:           # bool is an int to Python: refused too
            problem = (f"{why}: it is not a metrics log ringpipe wrote, or it was damaged" if why else
                       f"{where} is not a step record (no whole number \"step\" >= 0)")
            if skipped is not None:
                skipped.append(problem)
                continue
            raise ReadError(problem)
        records.append(record)
    return records


def _read_metrics(path: str, last: int | None = None, limit: int | None = None) -> tuple[bytes, int]:
    """(bytes, offset they start at) of the metrics log: its last `last` bytes, or all of it
    (refused past `limit`)."""
    try:
        fd = open_regular(path, "the metrics log")
    except UnreadableFile as e:
        raise ReadError(str(e)) from None
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise ReadError(f"{path} is {size:,} bytes, more than the {limit:,} this tool reads")
        start = max(0, size - last) if last is not None else 0
        return os.pread(fd, size - start, start), start
    finally:
        os.close(fd)


def read_records(run_dir: str, limit: int = RECORDS_LIMIT) -> list[dict]:
    """Every whole record of metrics.jsonl, in order ([] when there is none yet)."""
    path = metrics_path(run_dir)
    if not os.path.exists(path):
        return []
    return _parse_lines(_read_metrics(path, limit=limit)[0], path)


def tail_records(run_dir: str, max_bytes: int = TAIL_BYTES, skipped: list | None = None) -> list[dict]:
    """The whole records in the last `max_bytes` of metrics.jsonl, or further back until the
    newest whole record is in (at most TAIL_LIMIT): what a live view needs, read in constant
    time however long the run is. skipped: see _parse_lines (a live view shows the good
    records around a damaged line)."""
    path = metrics_path(run_dir)
    if not os.path.exists(path):
        return []
    window, limit = max_bytes, max(max_bytes, TAIL_LIMIT)
    while True:
        data, start = _read_metrics(path, last=window)
        if start == 0:
            return _parse_lines(data, path, skipped=skipped)
        cut = data.find(b"\n")             # the first piece is the end of a line cut in two
        if cut >= 0 and data.find(b"\n", cut + 1) >= 0:         # a whole line after it
            return _parse_lines(data[cut + 1:], path, skipped=skipped, offset=start + cut + 1)
        if window >= limit:
            raise ReadError(f"{path}: its newest record is longer than {limit:,} bytes, more than this live view "
                            "reads back; it is not a record ringpipe writes now (`ringpipe report` reads the "
                            "whole log)")
        window = min(4 * window, limit)


def last_with(records: list[dict], key: str) -> dict | None:
    """The newest record that has `key` (the last per-rank section: key "ranks")."""
    for record in reversed(records):
        if key in record:
            return record
    return None


def sync_text(header: dict | None) -> str | None:
    """How the run's data axis synced, from the header (None: not recorded): "all-reduce",
    or the parameter server with its servers and mode, a mode that changes the math said so."""
    if not isinstance(header, dict) or not isinstance(header.get("sync"), str):
        return None
    if header["sync"] != "ps":
        return "all-reduce"
    servers = header.get("parameter_servers")
    where = (f"{len(servers)} dedicated server rank(s)" if isinstance(servers, list) and servers
             else "colocated servers")
    mode = header.get("ps_mode")
    exact = "" if header.get("exact", True) else " (not sync's math)"
    return f"parameter server, {where}, mode {mode if isinstance(mode, str) else '?'}{exact}"[:200]


def job_ranks(header: dict | None) -> int | None:
    """The job's ranks: the trainer's world, plus its dedicated parameter servers (which
    write completion markers too). None when the header does not say."""
    world = header.get("world") if isinstance(header, dict) else None
    if type(world) is not int or world <= 0:
        return None
    servers = header.get("parameter_servers")
    return world + (len(servers) if isinstance(servers, list) else 0)

