"""Tiny helpers shared by the benchmarks: sizes, medians, tables, JSON."""

from __future__ import annotations

import json
import os
import statistics

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20,
          "MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'8', '64K', '256M', '1G' -> bytes (binary units)."""
    t = str(text).strip().upper()
    i = len(t)
    while i and not t[i - 1].isdigit():
        i -= 1
    return int(float(t[:i]) * _UNITS[t[i:].strip()])


def fmt_size(nbytes: int) -> str:
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div}{unit}"
    return str(nbytes)


def median(xs) -> float:
    return float(statistics.median(xs))


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """rows of dicts -> fixed-width text. columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def write_json(path: str, obj) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
