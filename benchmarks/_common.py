"""Tiny helpers shared by the benchmarks: sizes, medians, tables, JSON, and
argparse types that refuse bad flag values before any measurement starts."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20,
          "MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'8', '64K', '256M', '1G' -> bytes (binary units). ValueError if malformed."""
    t = str(text).strip().upper()
    i = len(t)
    while i and not t[i - 1].isdigit():
        i -= 1
    unit = t[i:].strip()
    try:
        value = float(t[:i])
    except ValueError:
        value = None
    if unit not in _UNITS or value is None or not math.isfinite(value) or value < 0:
        raise ValueError(f"invalid size {text!r}: use a non-negative number with an optional "
                         "K, M or G suffix (binary units; e.g. 8, 64K, 256M, 1G)")
    return int(value * _UNITS[unit])


def fmt_size(nbytes: int) -> str:
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div}{unit}"
    return str(nbytes)


def median(xs) -> float:
    return float(statistics.median(xs))


def table(rows: list[dict], columns: list[tuple], header: bool = True) -> str:
    """rows of dicts -> fixed-width text. columns: (key, header, format spec[, min width]).

    Without a min width a column is as wide as its widest cell in this call;
    give one when rows are printed a few at a time (header=False for the later
    calls) so every call lines up."""
    cells = [[c[1] for c in columns]] if header else []
    for r in rows:
        cells.append([format(r[c[0]], c[2]) if r.get(c[0]) is not None else "-" for c in columns])
    widths = [max([c[3] if len(c) > 3 else 0] + [len(row[i]) for row in cells])
              for i, c in enumerate(columns)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def write_json(path: str, obj) -> None:
    """`obj` as JSON at `path`, whole or not at all (a temp file beside it, then one rename):
    a benchmark stopped while writing leaves no half file where an older result stood."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# argparse types: a bad value becomes "prog: error: argument --flag: ..."
# (exit code 2) while parsing, before any work. Every MPI rank parses the same
# argv, so every rank refuses alike and none is left waiting in a collective.
# ---------------------------------------------------------------------------

def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}: give a whole number >= {low}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def _float_above(text: str, low: float, strict: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(value) or value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>' if strict else '>='} {low:g}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _float_above(text, 0.0, strict=True)


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    return _float_above(text, 0.0, strict=False)


def size_arg(text: str) -> int:
    """parse_size as an argparse type: '64K', '256M', '1G' -> bytes."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_size(text: str) -> int:
    """A size (see parse_size) of at least one byte."""
    value = size_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _comma_items(text: str, wanted: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"empty list: give {wanted}")
    return items


def choice_list(choices):
    """argparse type: a comma list whose items all come from choices -> list (order kept)."""
    def parse(text: str) -> list[str]:
        items = _comma_items(text, f"a comma list of {','.join(choices)}")
        unknown = [s for s in items if s not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; choose from "
                                             f"{','.join(choices)} (comma-separated)")
        return items
    return parse


def int_list(low: int = 1):
    """argparse type: a comma list of integers, each >= low -> list[int]."""
    def parse(text: str) -> list[int]:
        items = _comma_items(text, f"comma-separated integers >= {low}, e.g. 1,2,4")
        values = []
        for s in items:
            try:
                values.append(int(s))
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"invalid integer {s!r} in {text!r}: give comma-separated integers >= {low}, e.g. 1,2,4") from None
        bad = [v for v in values if v < low]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be >= {low}, got {','.join(map(str, bad))}")
        return values
    return parse


def output_path(text: str) -> str:
    """argparse type for an output file written at the end of a run: makes its
    folder now (as write_json would) and checks a file can be created there,
    so a bad path fails before the measurements instead of after them."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder: give a file path, "
                                         f"e.g. {os.path.join(text, 'out.json')}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r} (no write permission): give another path")
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except FileExistsError:   # the folder, or one above it, is a file
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: part of {folder!r} is a file, not a folder; "
                                         "give a path in a folder you can write to") from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r} ({e.strerror or e}): "
                                         "give a path in a folder you can write to") from None
    return text


# ---- a training step timed in a child process of its own (gpt2_step.py, llama_step.py) ----

def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_steps(step, spec):
    """Run spec's warmup + steps; step() -> (loss, fwd_bwd_s, update_s). Medians of the timed steps."""
    losses, totals, fbs, updates = [], [], [], []
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        loss, fb, upd = step()
        total = time.perf_counter() - t0
        losses.append(loss)
        if i == 0:
            first = total
        if i >= spec["warmup"]:
            totals.append(total)
            fbs.append(fb)
            updates.append(upd)
    return {"losses": losses, "step_times_s": totals, "first_step_s": first,
            "step_s": median(totals), "fwd_bwd_s": median(fbs), "update_s": median(updates)}


def run_child(script, framework, spec, thread_vars, cwd, what=""):
    """`python SCRIPT --child FRAMEWORK SPEC RESULT` with spec["threads"] threads in each of
    thread_vars (0: none of them set); its JSON result plus what the parent saw of it: peak memory (wait4), wall
    and CPU time, and how disturbed it was (the 1-minute load average around it, its own
    threads included, and how often the kernel preempted it)."""
    env = dict(os.environ, **{var: str(spec["threads"]) for var in thread_vars})
    if not spec["threads"]:                  # 0: each framework's own default, as a user who sets none
        env = {k: v for k, v in env.items() if k not in thread_vars}
    name = os.path.basename(script)
    fd, result = tempfile.mkstemp(prefix=f"{name[:-3]}-{framework}-", suffix=".json")
    os.close(fd)
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    try:
        proc = subprocess.Popen([sys.executable, os.path.abspath(script), "--child", framework,
                                 json.dumps(spec), result], cwd=cwd, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise SystemExit(f"{name}: the {framework} child{what} failed (exit {code})")
        with open(result) as fh:
            out = json.load(fh)
    finally:
        os.unlink(result)
    out.update(peak_rss_bytes=usage.ru_maxrss * 1024, wall_s=time.perf_counter() - t0,
               cpu_s=usage.ru_utime + usage.ru_stime, involuntary_switches=usage.ru_nivcsw,
               load_before=load_before, load_after=os.getloadavg()[0])
    return out
