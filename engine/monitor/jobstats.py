"""The job summary at the end of a run: per node CPU and memory use, the time split and
their efficiency (like Princeton's Jobstats), and Slurm's accounting of the job (sacct).

    json_path, text_path = write_summary(out_dir, header, totals, wall_s)

writes OUT/job_summary.json (the numbers, for tools) and OUT/job_summary.txt (the same, for
people, with one verdict line per node), each atomically. `header` is monitor.json's content;
`totals` holds one plain dict per rank, gathered by the trainer at the end of the run:

    rank, node, wall_s, cpu_s (user + sys), cores (this rank's CPU affinity count),
    peak_bytes (VmHWM), compute_s, comm_s, bubble_s, data_s, other_s (sums over the run's
    steps), steps; optional cpus (the affinity set itself, a list of CPU numbers),
    gpu_util_percent (mean), gpu_mem_peak_bytes, threads (compute threads per rank),
    others_runnable (other programs' runnable threads on the rank's cores, the most seen at
    start and at the end: ringpipe/threads.py)

The definitions are Jobstats': CPU efficiency = CPU seconds / (cores x wall seconds), with
the run's wall time; a node's memory peak is the sum of its ranks' peaks (VmHWM), against
Slurm's allocation (SLURM_MEM_PER_NODE, or SLURM_MEM_PER_CPU x the node's cores) or, for the
node this runs on only, its MemTotal. A node's cores are the union of its ranks' affinity
sets when the ranks report them ("cpus"): ranks that share cores (mpiexec without binding)
count them once. Without the sets the ranks' counts are added, capped at the node's CPU count
where it is known (this node's), and the summary says the count is an upper bound.

This is written after training finished: nothing here may fail the run. Whatever cannot be
known (a rank's totals, a field, Slurm's accounting) is null and named under "missing"; an
unexpected error becomes the summary's "error"; a file that cannot be written is reported on
stderr and its path returned as "".

Import rule: engine/job and the standard library only (no MPI, no model): it reads plain dicts.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time

from ringpipe.engine.job.files import write_text_atomic

JSON_NAME = "job_summary.json"
TEXT_NAME = "job_summary.txt"
FORMAT = "ringpipe-job-summary"
VERSION = 1
SPLIT = ("compute", "comm", "bubble", "data", "other")    # the step's time split (docs/monitoring.md)
SACCT_FIELDS = ("JobID", "JobName", "State", "Elapsed", "TotalCPU", "CPUTime", "MaxRSS", "ReqMem",
                "AllocCPUS", "NodeList", "ExitCode")
SACCT_TIMEOUT_S = 10
MiB = 1 << 20

# Verdict thresholds (Jobstats flags CPU efficiency and memory use the same way).
LOW_CPU_EFFICIENCY = 0.5         # below: the job holds cores it does not use
OVER_CPU_EFFICIENCY = 1.05       # above: more CPU time than the counted cores allow (cores miscounted)
LOW_MEMORY_USE = 0.2             # below, against Slurm's allocation: ask for less memory
HIGH_MEMORY_USE = 0.9            # above: near the limit, the next larger run is killed for memory
HIGH_COMM_SHARE = 0.3            # exposed communication + bubble, of the step time
HIGH_DATA_SHARE = 0.1            # waiting for data, of the step time


def write_summary(out_dir: str, header: dict, totals: list[dict], wall_s: float, env=os.environ,
                  sacct: str = "sacct") -> tuple[str, str]:
    """Write OUT/job_summary.json and OUT/job_summary.txt; their paths ("" for one that could
    not be written: the reason is on stderr). Never raises."""
    try:
        summary = summarize(header, totals, wall_s, env=env, sacct=sacct)
    except Exception as e:                 # a finished run must never fail for its summary
        summary = {"format": FORMAT, "version": VERSION, "written": time.time(),
                   "error": f"the job summary could not be computed ({type(e).__name__}: {e})"}
    try:
        text = render_text(summary)
    except Exception as e:
        text = f"ringpipe job summary: could not be rendered as text ({type(e).__name__}: {e}); see {JSON_NAME}\n"
    json_path = _write(os.path.join(out_dir, JSON_NAME), lambda: json.dumps(summary, indent=1) + "\n")
    text_path = _write(os.path.join(out_dir, TEXT_NAME), lambda: text)
    return json_path, text_path


def _write(path: str, make_text) -> str:
    try:
        write_text_atomic(path, make_text())
        return path
    except Exception as e:
        print(f"ringpipe: warning: the job summary {path} could not be written ({type(e).__name__}: {e}); "
              "the run itself finished", file=sys.stderr)
        return ""


# ---- the numbers -------------------------------------------------------------------------

def summarize(header: dict, totals: list[dict], wall_s: float, env=os.environ, sacct: str = "sacct") -> dict:
    """The summary as a JSON-ready dict (what job_summary.json holds)."""
    header = header if isinstance(header, dict) else {}
    missing: list[str] = []
    ranks = [t for t in (totals or []) if isinstance(t, dict)]
    ranks.sort(key=lambda t: t.get("rank") if isinstance(t.get("rank"), int) else 1 << 30)
    wall = _num(wall_s)
    if wall is None or wall <= 0:
        missing.append("the run's wall time (efficiencies need it)")
        wall = None
    _note_missing_ranks(header, ranks, missing)

    slurm = slurm_fields(env)
    by_node: dict[str, list[dict]] = {}
    for t in ranks:
        node = t.get("node") if isinstance(t.get("node"), str) and t.get("node") else _header_node(header, t)
        by_node.setdefault(node or "?", []).append(t)
    nodes = [_node(name, rs, wall, slurm, missing) for name, rs in by_node.items()]
    job = _job(header, ranks, nodes, wall, slurm)
    summary = {
        "format": FORMAT, "version": VERSION, "written": time.time(),
        "model": header.get("model"), "precision": header.get("precision"),
        "world": header.get("world"), "layout": header.get("layout"),
        "start_step": header.get("start_step"), "steps": header.get("steps"),
        "slurm": slurm,
        "job": job,
        "nodes": nodes,
        "ranks": [_rank(t, wall) for t in ranks],
        "sacct": sacct_rows(env, sacct),
        "missing": missing,
    }
    return summary


def _num(value) -> float | None:
    """A finite number, or None (a missing or damaged field)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _sum(values) -> float | None:
    """The sum of the known values; None when none is known."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _header_node(header: dict, t: dict) -> str | None:
    for r in header.get("ranks") or []:
        if isinstance(r, dict) and r.get("rank") == t.get("rank") and isinstance(r.get("node"), str):
            return r["node"]
    return None


def _note_missing_ranks(header: dict, ranks: list[dict], missing: list[str]) -> None:
    world = header.get("world")
    if not isinstance(world, int) or isinstance(world, bool):
        return
    have = {t.get("rank") for t in ranks}
    absent = [r for r in range(world) if r not in have]
    if absent:
        shown = ", ".join(map(str, absent[:20])) + (", ..." if len(absent) > 20 else "")
        missing.append(f"the totals of rank(s) {shown} of {world} (their nodes are under-counted)")


def slurm_fields(env=os.environ) -> dict | None:
    """The Slurm job's fields from its environment; None outside Slurm (no SLURM_JOB_ID)."""
    if not env.get("SLURM_JOB_ID"):
        return None

    def whole(name):
        value = env.get(name, "")
        return int(value) if value.isdigit() else None

    return {"job_id": env.get("SLURM_JOB_ID"), "job_name": env.get("SLURM_JOB_NAME"),
            "nodelist": env.get("SLURM_JOB_NODELIST"), "ntasks": whole("SLURM_NTASKS"),
            "cpus_per_task": whole("SLURM_CPUS_PER_TASK"), "mem_per_node_mb": whole("SLURM_MEM_PER_NODE"),
            "mem_per_cpu_mb": whole("SLURM_MEM_PER_CPU"), "cluster": env.get("SLURM_CLUSTER_NAME")}


def _is_this_node(name: str) -> bool:
    here = socket.gethostname()
    return name in (here, here.split(".")[0]) or name.split(".")[0] == here.split(".")[0]


def mem_total_bytes(path: str = "/proc/meminfo") -> int | None:
    """This machine's MemTotal, or None where /proc/meminfo cannot tell."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    parts = line.split()
                    if len(parts) >= 2 and parts[1].isdigit():
                        return int(parts[1]) * 1024            # kB
    except OSError:
        pass
    return None


def _node_cores(name: str, rs: list[dict]) -> tuple[int | None, str]:
    """The node's cores and how they were counted."""
    sets = [t.get("cpus") for t in rs]
    if sets and all(isinstance(s, list) and s for s in sets):
        union = {c for s in sets for c in s if isinstance(c, int) and not isinstance(c, bool)}
        if union:
            return len(union), "the union of its ranks' CPU affinity sets"
    counts = [t.get("cores") for t in rs]
    if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts):
        return None, "unknown (a rank did not report its cores)"
    cores = sum(counts)
    if _is_this_node(name):
        cpus = os.cpu_count()
        if cpus and cores > cpus:
            return cpus, (f"this node's {cpus} CPUs (its ranks' affinity counts add up to {cores}: "
                          "they share cores)")
    return cores, "the sum of its ranks' affinity counts (at most: ranks that share cores count twice)"


def _memory_limit(name: str, cores: int | None, slurm: dict | None) -> tuple[int | None, str | None]:
    if slurm and slurm.get("mem_per_node_mb"):            # 0 means "all of the node": fall through
        return slurm["mem_per_node_mb"] * MiB, "Slurm's allocation (--mem)"
    if slurm and slurm.get("mem_per_cpu_mb") and cores:
        return slurm["mem_per_cpu_mb"] * cores * MiB, "Slurm's allocation (--mem-per-cpu x cores)"
    if _is_this_node(name):
        total = mem_total_bytes()
        if total:
            return total, "the node's MemTotal"
    return None, None


def _split(rs: list[dict]) -> dict:
    seconds = {k: _sum(_num(t.get(f"{k}_s")) for t in rs) for k in SPLIT}
    whole = _sum(seconds.values())
    return {"seconds": seconds,
            "percent": {k: (100.0 * v / whole if v is not None and whole else None) for k, v in seconds.items()}}


def _node(name: str, rs: list[dict], wall: float | None, slurm: dict | None, missing: list[str]) -> dict:
    cores, cores_from = _node_cores(name, rs)
    cpu_s = _sum(_num(t.get("cpu_s")) for t in rs)
    if any(_num(t.get("cpu_s")) is None for t in rs):
        missing.append(f"the CPU time of a rank on {name}")
    peak = _sum(_num(t.get("peak_bytes")) for t in rs)
    limit, limit_from = _memory_limit(name, cores, slurm)
    if limit is None:
        missing.append(f"the memory {name} may use (no Slurm allocation; MemTotal is known only for "
                       "the node the summary is written on)")
    efficiency = _ratio(cpu_s, cores * wall if cores and wall else None)
    gpu_util = [_num(t.get("gpu_util_percent")) for t in rs if _num(t.get("gpu_util_percent")) is not None]
    node = {
        "node": name, "ranks": [t.get("rank") for t in rs],
        "cores": cores, "cores_from": cores_from,
        "cpu_s": cpu_s, "cpu_efficiency": efficiency,
        "peak_bytes": int(peak) if peak is not None else None,
        "memory_limit_bytes": limit, "memory_limit_from": limit_from,
        "memory_use": _ratio(peak, limit),
        "time_split": _split(rs),
        "threads": _sum(_num(t.get("threads")) for t in rs),
        "others_runnable": max((_num(t.get("others_runnable")) or 0 for t in rs), default=0),
        "gpu_util_percent": sum(gpu_util) / len(gpu_util) if gpu_util else None,
        "gpu_mem_peak_bytes": _sum(_num(t.get("gpu_mem_peak_bytes")) for t in rs),
    }
    node["verdict"] = verdict(node)
    return node


def _rank(t: dict, wall: float | None) -> dict:
    """One rank's totals as given, with its own CPU efficiency (its CPU time over its cores
    and its own wall time)."""
    row = {k: v for k, v in t.items() if isinstance(k, str)}
    cpu_s, cores, rank_wall = _num(t.get("cpu_s")), _num(t.get("cores")), _num(t.get("wall_s"))
    row["cpu_efficiency"] = _ratio(cpu_s, cores * rank_wall if cores and rank_wall else None)
    return row


def _job(header: dict, ranks: list[dict], nodes: list[dict], wall: float | None, slurm: dict | None) -> dict:
    cores = _sum(n["cores"] for n in nodes) if all(n["cores"] for n in nodes) else None
    cpu_s = _sum(n["cpu_s"] for n in nodes)
    steps = [t.get("steps") for t in ranks if isinstance(t.get("steps"), int)]
    return {
        "wall_s": wall, "nodes": len(nodes), "ranks": len(ranks),
        "steps": max(steps) if steps else None,
        "cores": int(cores) if cores is not None else None,
        "cpu_s": cpu_s, "cpu_efficiency": _ratio(cpu_s, cores * wall if cores and wall else None),
        "peak_bytes": _sum(n["peak_bytes"] for n in nodes),
        "time_split": _split(ranks),
    }


def verdict(node: dict) -> str:
    """One line on what the node's numbers say, and what to change (Jobstats' advice)."""
    says = []
    eff = node.get("cpu_efficiency")
    if eff is not None and eff < LOW_CPU_EFFICIENCY:
        says.append(_low_efficiency(node, eff))
    elif eff is not None and eff > OVER_CPU_EFFICIENCY:
        says.append(f"CPU efficiency {eff:.0%}: more CPU time than {node.get('cores')} cores give; "
                    "the cores are under-counted (ranks report their affinity sets to count them exactly)")
    use = node.get("memory_use")
    if use is not None and use > HIGH_MEMORY_USE:
        says.append(f"memory {use:.0%} of {node.get('memory_limit_from')}: close to the limit; "
                    "ask for more (--mem) or use less (--zero, --recompute, smaller micro-batches)")
    elif use is not None and use < LOW_MEMORY_USE and (node.get("memory_limit_from") or "").startswith("Slurm"):
        says.append(f"memory {use:.0%} of Slurm's allocation: ask for less (--mem) so jobs start sooner")
    pct = node.get("time_split", {}).get("percent", {})
    exposed = _sum([pct.get("comm"), pct.get("bubble")])
    if exposed is not None and exposed > 100 * HIGH_COMM_SHARE:
        says.append(f"{exposed:.0f}% of the step waits on communication or the pipeline bubble: "
                    "fewer ranks, a larger batch per rank, or more micro-batches")
    if pct.get("data") is not None and pct["data"] > 100 * HIGH_DATA_SHARE:
        says.append(f"{pct['data']:.0f}% of the step waits for data: put the shards on faster storage")
    if says:
        return "; ".join(says)
    if eff is None:
        return "CPU efficiency unknown (see missing)"
    return f"CPU efficiency {eff:.0%}: good"


def _low_efficiency(node: dict, eff: float) -> str:
    """Why the node's cores sat idle, and what to change. More threads only where the ranks
    ran fewer threads than cores on a node nobody else used: on a busy node the ranks waited
    for the CPU, and more threads would wait too."""
    others, used, cores = node.get("others_runnable") or 0, node.get("threads"), node.get("cores")
    if others:
        return (f"CPU efficiency {eff:.0%}: the node was busy ({others:g} other programs' runnable threads on "
                "its cores): the ranks waited for the CPU, not for threads (more threads would wait too); "
                "ask for cores of your own (--exclusive, a quiet node) for full speed")
    if used is not None and cores and used >= cores:
        return (f"CPU efficiency {eff:.0%}: the job asked for more cores than it uses; its {used:g} threads "
                "wait for communication, data or Python between kernels: ask for fewer (-c)")
    return (f"CPU efficiency {eff:.0%}: the job asked for more cores than it uses; "
            "ask for fewer (-c) or set more threads per rank")


# ---- Slurm's accounting ------------------------------------------------------------------

def sacct_rows(env=os.environ, sacct: str = "sacct") -> dict:
    """{"rows": [{field: value}], "reason": None}, or {"rows": None, "reason": why not}."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return {"rows": None, "reason": "not a Slurm job (no SLURM_JOB_ID)"}
    exe = shutil.which(sacct, path=env.get("PATH"))
    if exe is None:
        return {"rows": None, "reason": f"no Slurm accounting: {sacct} is not on PATH"}
    command = [exe, "-j", job_id, "--parsable2", "--noheader", "--format=" + ",".join(SACCT_FIELDS)]
    try:
        r = subprocess.run(command, env=dict(env), capture_output=True, text=True, errors="replace",
                           timeout=SACCT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"rows": None, "reason": f"no Slurm accounting: sacct did not answer within {SACCT_TIMEOUT_S} s"}
    except OSError as e:
        return {"rows": None, "reason": f"no Slurm accounting: sacct could not be run ({e})"}
    if r.returncode != 0:
        first = next((line.strip() for line in r.stderr.splitlines() if line.strip()), f"sacct exit {r.returncode}")
        return {"rows": None, "reason": f"no Slurm accounting: {first}"}
    rows = []
    for line in r.stdout.splitlines():
        if not line.strip():
            continue
        values = line.split("|")
        if len(values) == len(SACCT_FIELDS):
            rows.append(dict(zip(SACCT_FIELDS, values)))
        else:                               # a "|" in a job name: kept whole rather than misread
            rows.append({"raw": line})
    return {"rows": rows, "reason": None if rows else f"sacct knows no job {job_id} (yet)"}


# ---- the text ----------------------------------------------------------------------------

def _hms(seconds) -> str:
    if seconds is None:
        return "?"
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _gib(n) -> str:
    return "?" if n is None else f"{n / (1 << 30):.2f} GiB"


def _pct(x) -> str:
    return "?" if x is None else f"{x:.0%}"


def render_text(s: dict) -> str:
    """job_summary.txt: the summary for people, Jobstats' layout."""
    rule = "=" * 78
    out = [rule, "ringpipe job summary".center(78).rstrip(), rule]
    if s.get("error"):
        return "\n".join(out + [s["error"], ""])
    slurm = s.get("slurm")
    job = s["job"]
    if slurm:
        out += [f"       Job ID: {slurm.get('job_id')}", f"     Job name: {slurm.get('job_name')}",
                f"      Cluster: {slurm.get('cluster') or '?'}", f"     Nodelist: {slurm.get('nodelist') or '?'}",
                f"        Tasks: {slurm.get('ntasks') or '?'} x {slurm.get('cpus_per_task') or 1} CPUs"]
    else:
        out.append("        Slurm: not a Slurm job")
    layout = s.get("layout") or {}
    shape = " x ".join(f"{k} {v}" for k, v in layout.items()) if isinstance(layout, dict) else ""
    out += [f"        Model: {s.get('model') or '?'} ({s.get('precision') or '?'}), "
            f"{job['ranks']} rank{'s' if job['ranks'] != 1 else ''} on {job['nodes']} "
            f"node{'s' if job['nodes'] != 1 else ''}" + (f" ({shape})" if shape else ""),
            f"        Steps: {job.get('steps') if job.get('steps') is not None else '?'} this run "
            f"(from step {s.get('start_step')} to {s.get('steps')})",
            f"    Wall time: {_hms(job['wall_s'])}", ""]
    out += ["Overall utilization",
            f"  CPU efficiency: {_pct(job['cpu_efficiency'])} ({_hms(job['cpu_s'])} of CPU time on "
            f"{job['cores'] if job['cores'] is not None else '?'} cores)",
            f"  Memory peak:    {_gib(job['peak_bytes'])} (the sum of the ranks' peaks)",
            "  Time split:     " + _split_text(job["time_split"]), ""]
    out.append("Per node")
    for n in s["nodes"]:
        limit = (f" of {_gib(n['memory_limit_bytes'])} ({_pct(n['memory_use'])}, {n['memory_limit_from']})"
                 if n["memory_limit_bytes"] else " (limit unknown)")
        out += [f"  {n['node']}: ranks {', '.join(map(str, n['ranks']))}",
                f"    cores {n['cores'] if n['cores'] is not None else '?'} ({n['cores_from']}), "
                f"CPU time {_hms(n['cpu_s'])}, CPU efficiency {_pct(n['cpu_efficiency'])}",
                f"    memory peak {_gib(n['peak_bytes'])}{limit}",
                "    time split: " + _split_text(n["time_split"])]
        if n.get("gpu_util_percent") is not None:
            out.append(f"    GPU utilization {n['gpu_util_percent']:.0f}%, GPU memory peak "
                       f"{_gib(n.get('gpu_mem_peak_bytes'))}")
        out.append(f"    verdict: {n['verdict']}")
    out.append("")
    out.append("Slurm accounting (sacct)")
    acct = s.get("sacct") or {}
    if acct.get("rows"):
        out += _table(acct["rows"])
    else:
        out.append(f"  {acct.get('reason')}")
    if s.get("missing"):
        out += ["", "Missing"] + [f"  {m}" for m in s["missing"]]
    return "\n".join(out) + "\n"


def _split_text(split: dict) -> str:
    pct = split["percent"]
    parts = [f"{k} {pct[k]:.0f}%" for k in SPLIT if pct.get(k) is not None]
    return ", ".join(parts) if parts else "unknown"


def _table(rows: list[dict]) -> list[str]:
    """sacct's rows as aligned columns; a line that did not parse is shown as sacct printed it."""
    parsed = [r for r in rows if "raw" not in r]
    widths = [max([len(c)] + [len(str(r.get(c, ""))) for r in parsed]) for c in SACCT_FIELDS]
    lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(SACCT_FIELDS, widths)).rstrip()]
    for r in rows:
        cells = [str(r.get(c, "")).ljust(w) for c, w in zip(SACCT_FIELDS, widths)]
        lines.append("  " + (r["raw"] if "raw" in r else "  ".join(cells).rstrip()))
    return lines
