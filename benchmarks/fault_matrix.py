"""Fault matrix: jobs killed, signalled twice, starved of disk, fed damaged or
hostile checkpoints, or sharing their --out with a second run, each repeated
with random timing, and what happened.

    python benchmarks/fault_matrix.py --repeat 10 --json faults.json     # ~10 minutes on 2 cores
    python benchmarks/fault_matrix.py --repeat 1 --only kill,disk-full   # what CI runs, in seconds

Every trial is a real `mpiexec -n 2 python -m ringpipe.train` job of a tiny
float64 GPT. For each one the table counts:

    ended   the job ended within --deadline seconds of the fault (no hang)
    named   its output names the cause (the signal, "disk full", the damaged
            checkpoint it skipped, the other run's pid)
    kept    every checkpoint that was valid before the fault is still valid
    exact   `--resume auto` then finishes bit-identical (every parameter) to an
            uninterrupted run of the same seed

A trial prints its random choices, so a failure can be replayed with --seed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

from ringpipe.engine import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PY = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), "mpiexec")
STEPS = 80
MODEL = ["--data", "synthetic", "--layers", "2", "--d-model", "16", "--heads", "2", "--context", "16",
         "--batch-size", "8", "--sample-bytes", "0", "--dtype", "float64", "--lr", "1e-3", "--log-every", "1",
         "--decay-steps", str(STEPS)]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
           PYTHONUNBUFFERED="1")
LONG = 10**6       # steps of a run that is stopped by its fault long before it ends
SCENARIOS = ("kill", "double-signal", "disk-full", "bad-checkpoint", "concurrent")


# ---- running jobs -------------------------------------------------------------------------

def launch(out, *extra, steps=STEPS):
    return subprocess.Popen([MPIEXEC, "-n", "2", PY, "-m", "ringpipe.train", *MODEL, "--steps", str(steps),
                             "--out", out, *extra], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, deadline):
    """(returncode, output, seconds, ended): wait at most `deadline` s, then kill."""
    t0 = time.time()
    try:
        out, err = proc.communicate(timeout=deadline)
        return proc.returncode, out + err, time.time() - t0, True
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return proc.returncode, out + err, time.time() - t0, False


def run_to_end(out, *extra, steps=STEPS, deadline=300):
    rc, output, _, _ = finish(launch(out, *extra, steps=steps), deadline)
    return rc, output


def rank_pids(mpiexec_pid):
    """PIDs of the python ranks below an mpiexec (through hydra's proxy)."""
    children = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        children.setdefault(ppid, []).append((int(pid), cmd))
    found, todo = [], [mpiexec_pid]
    while todo:
        for pid, cmd in children.get(todo.pop(), []):
            todo.append(pid)
            if b"ringpipe.train" in cmd and b"mpiexec" not in cmd and b"hydra" not in cmd:
                found.append(pid)
    return sorted(found)


def wait_for_step(out, step, proc, timeout=120):
    """Block until metrics.jsonl holds `step` records (or the job ended)."""
    path = os.path.join(out, "metrics.jsonl")
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        try:
            with open(path) as fh:
                if sum(1 for _ in fh) >= step:
                    return True
        except OSError:
            pass
        time.sleep(0.01)
    return False


def params(out):
    arrays, _ = checkpoint.load(os.path.join(out, "checkpoints"))
    return {k: v for k, v in arrays.items() if k.startswith("param/")}


def same_as(reference, out):
    try:
        got = params(out)
    except checkpoint.CheckpointError:
        return False
    return got.keys() == reference.keys() and all(np.array_equal(got[k], reference[k]) for k in got)


def valid_checkpoints(out):
    folder = os.path.join(out, "checkpoints")
    return checkpoint.scan(folder)[0] if os.path.isdir(folder) else []


def resume_is_exact(out, reference, *extra):
    rc, output = run_to_end(out, "--resume", "auto", "--checkpoint-every", "2", *extra)
    return rc == 0 and same_as(reference, out), output


# ---- the scenarios ------------------------------------------------------------------------
# Each takes (rng, folder, reference params, deadline) and returns the four
# verdicts plus what it did, for the report.

def kill(rng, folder, reference, deadline):
    out = os.path.join(folder, "run")
    at, victim = rng.randint(2, STEPS // 2), rng.randint(0, 1)
    # A run that would go on and on (same schedule: --decay-steps), so the kill
    # always meets it running; resuming to STEPS then gives the reference's end.
    proc = launch(out, "--checkpoint-every", "2", "--keep", "0", steps=LONG)
    wait_for_step(out, at, proc)
    time.sleep(rng.uniform(0, 0.05))                    # anywhere in the step: forward, ring, checkpoint
    before = valid_checkpoints(out)
    os.kill(rank_pids(proc.pid)[victim], signal.SIGKILL)
    rc, output, seconds, ended = finish(proc, deadline)
    kept = set(before) <= set(valid_checkpoints(out))
    exact, _ = resume_is_exact(out, reference)
    return dict(did=f"SIGKILL rank {victim} after step {at}", seconds=seconds, ended=ended and rc != 0,
                named="signal 9" in output.lower() or "killed" in output.lower(), kept=kept, exact=exact)


def double_signal(rng, folder, reference, deadline):
    out = os.path.join(folder, "run")
    sig = rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
    second = signal.SIGTERM if sig == signal.SIGUSR1 else sig
    at, victim, gap = rng.randint(2, STEPS // 2 - 10), rng.randint(0, 1), rng.uniform(0, 0.1)
    proc = launch(out, "--checkpoint-every", "4", "--keep", "0", steps=LONG)
    wait_for_step(out, at, proc)
    before = valid_checkpoints(out)
    pid = rank_pids(proc.pid)[victim]
    os.kill(pid, sig)
    time.sleep(gap)
    try:
        os.kill(pid, second)
    except ProcessLookupError:                        # it already stopped on the first one
        pass
    rc, output, seconds, ended = finish(proc, deadline)
    # The exit code must say what happened: the code the run announced when it
    # stopped with a checkpoint, else a forced stop (128 + the signal) or the
    # launcher's code for a rank it saw end.
    announced = [int(w) for w in output.replace(";", " ").split() if w.isdigit()
                 and f"exiting with code {w}" in output]
    truthful = rc in announced if announced else rc != 0
    kept = set(before) <= set(valid_checkpoints(out))
    exact, _ = resume_is_exact(out, reference)
    return dict(did=f"{sig.name} then {second.name} {gap * 1e3:.0f} ms later to rank {victim} after step {at}",
                seconds=seconds, ended=ended and truthful, named=sig.name in output or second.name in output,
                kept=kept, exact=exact)


def _mount_tmpfs(path, size):
    os.makedirs(path)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True,
                       text=True)
    return r.stderr.strip() or "mount failed" if r.returncode else None


def disk_full(rng, folder, reference, deadline):
    disk = os.path.join(folder, "disk")
    size = rng.randint(250, 900) * 1024
    refused = _mount_tmpfs(disk, size)
    if refused:
        return dict(did=f"skipped: {refused}", skipped=True)
    try:
        out = os.path.join(disk, "run")
        proc = launch(out, "--checkpoint-every", "1", "--keep", "0")
        rc, output, seconds, ended = finish(proc, deadline)
        ckpt = os.path.join(out, "checkpoints")
        leftovers = [f for f in os.listdir(ckpt) if ".tmp." in f] if os.path.isdir(ckpt) else []
        invalid = checkpoint.scan(ckpt)[1] if os.path.isdir(ckpt) else []
        with open(os.path.join(out, "metrics.jsonl"), "rb") as fh:
            metrics = fh.read()
        whole = metrics.endswith(b"\n") or not metrics
        subprocess.run(["mount", "-o", "remount,size=64m", disk], check=True)
        exact, _ = resume_is_exact(out, reference)
        return dict(did=f"{size // 1024} KiB disk, a checkpoint every step", seconds=seconds,
                    ended=ended and rc == 1, named="disk full at" in output,
                    kept=not leftovers and not invalid and whole, exact=exact)
    finally:
        subprocess.run(["umount", "-l", disk], capture_output=True)


def _zip_bomb(npz_path):
    """Rewrite the npz with one member declaring 10^12 elements (deflated: a few
    KB on disk), then fix up the manifest as a forger who knows the format would."""
    with zipfile.ZipFile(npz_path) as z:
        names = z.namelist()
        members = {n: z.read(n) for n in names}
    victim = next(n for n in names if n.startswith("param/"))
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1))
    header["shape"] = (10**12,)
    import io
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    members[victim] = buf.getvalue() + b"\0" * (1 << 20)
    with zipfile.ZipFile(npz_path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for n, data in members.items():
            z.writestr(n, data)
    return victim


def _forge_manifest(json_path):
    """Make the manifest match its (tampered) npz again: size, CRC and checksum."""
    with open(json_path) as fh:
        m = json.load(fh)
    npz = json_path[:-5] + ".npz"
    m["npz_bytes"] = os.path.getsize(npz)
    with open(npz, "rb") as fh:
        import zlib
        m["npz_crc32"] = zlib.crc32(fh.read())
    m.pop("checksum", None)
    m["checksum"] = checkpoint._checksum(m)
    with open(json_path, "w") as fh:
        json.dump(m, fh)


DAMAGE = ("flip bytes in the npz", "truncate the npz", "delete the npz", "edit the manifest's step",
          "edit the manifest's n_layer", "replace the manifest by a FIFO", "manifest holds null",
          "npz member declares 10^12 elements (forged manifest)")


def _damage(kind, json_path):
    npz = json_path[:-5] + ".npz"
    if kind == DAMAGE[0]:
        with open(npz, "r+b") as fh:
            fh.seek(os.path.getsize(npz) // 2)
            fh.write(os.urandom(32))
    elif kind == DAMAGE[1]:
        with open(npz, "r+b") as fh:
            fh.truncate(os.path.getsize(npz) // 3)
    elif kind == DAMAGE[2]:
        os.remove(npz)
    elif kind in DAMAGE[3:5]:
        with open(json_path) as fh:
            m = json.load(fh)
        if kind == DAMAGE[3]:
            m["step"] = max(1, m["step"] - 1)
        else:
            m["model_config"]["n_layer"] += 1
        with open(json_path, "w") as fh:
            json.dump(m, fh)
    elif kind == DAMAGE[5]:
        os.remove(json_path)
        os.mkfifo(json_path)
    elif kind == DAMAGE[6]:
        with open(json_path, "w") as fh:
            fh.write("null")
    else:
        _zip_bomb(npz)
        _forge_manifest(json_path)


def bad_checkpoint(rng, folder, reference, deadline):
    out = os.path.join(folder, "run")
    rc, _ = run_to_end(out, "--checkpoint-every", "2", "--keep", "0", steps=STEPS // 2)
    found = checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))
    n = rng.randint(1, min(3, len(found) - 1))
    damaged = found[-n:]
    kinds = [rng.choice(DAMAGE) for _ in damaged]
    for kind, path in zip(kinds, damaged):
        _damage(kind, path)
    before = [p for p in found if p not in damaged]
    proc = launch(out, "--resume", "auto", "--checkpoint-every", "2", "--keep", "0")
    rc, output, seconds, ended = finish(proc, deadline)
    named = all(os.path.basename(p) in output for p in damaged)
    # The checkpoints it resumed from and before stay valid; the run then rewrote the damaged steps.
    kept = set(before) <= set(valid_checkpoints(out))
    return dict(did="; ".join(f"{os.path.basename(p)}: {k}" for p, k in zip(damaged, kinds)), seconds=seconds,
                ended=ended and rc == 0, named=named, kept=kept, exact=rc == 0 and same_as(reference, out))


def concurrent(rng, folder, reference, deadline):
    out = os.path.join(folder, "run")
    how = rng.choice([[], ["--resume", "auto"], ["--overwrite"]])
    # The first run trains until told to stop, so the second surely meets it running.
    first = launch(out, "--checkpoint-every", "2", "--keep", "0", steps=LONG)
    wait_for_step(out, rng.randint(1, 8), first)
    t0 = time.time()
    rc2, output2, _, ended2 = finish(launch(out, *how), deadline)
    seconds = time.time() - t0
    first.send_signal(signal.SIGUSR1)                 # stop with a checkpoint (exit 85)
    rc1, _, _, ended1 = finish(first, deadline)
    # The first run was not disturbed: its checkpoint equals a run of its own
    # length that had the directory to itself.
    stopped_at = int(os.path.basename(checkpoint.find_latest(os.path.join(out, "checkpoints")))[5:13])
    alone = os.path.join(folder, "alone")
    run_to_end(alone, "--steps", str(stopped_at), steps=stopped_at)
    valid = valid_checkpoints(out)
    return dict(did=f"second run {' '.join(how) or '(fresh)'} on the same --out", seconds=seconds,
                ended=ended2 and rc2 == 2 and ended1 and rc1 == 85,
                named=f"pid {first.pid}" in output2 or "is in use by another run" in output2,
                kept=len(valid) == stopped_at // 2 or len(valid) == stopped_at // 2 + 1,
                exact=same_as(params(alone), out))


RUNNERS = {"kill": kill, "double-signal": double_signal, "disk-full": disk_full,
           "bad-checkpoint": bad_checkpoint, "concurrent": concurrent}


# ---- the matrix ---------------------------------------------------------------------------

def reference_params(folder):
    out = os.path.join(folder, "reference")
    rc, output = run_to_end(out)
    if rc != 0:
        raise SystemExit(f"fault_matrix: the uninterrupted reference run failed:\n{output[-3000:]}")
    return params(out)


def run_matrix(scenarios, repeat, seed, deadline, log=print):
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix="ringpipe-faults-")
    try:
        reference = reference_params(root)
        trials = []
        for name in scenarios:
            for i in range(repeat):
                folder = os.path.join(root, f"{name}-{i}")
                os.makedirs(folder)
                result = RUNNERS[name](rng, folder, reference, deadline)
                result["scenario"] = name
                trials.append(result)
                verdict = "skipped" if result.get("skipped") else " ".join(
                    f"{k}={'yes' if result[k] else 'NO'}" for k in ("ended", "named", "kept", "exact"))
                log(f"{name} #{i + 1}: {result['did']}: {verdict}"
                    + (f" ({result['seconds']:.1f} s to end)" if "seconds" in result else ""))
                shutil.rmtree(folder, ignore_errors=True)
        return trials
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarize(trials):
    rows = []
    for name in dict.fromkeys(t["scenario"] for t in trials):
        ts = [t for t in trials if t["scenario"] == name and not t.get("skipped")]
        row = {"scenario": name, "trials": len(ts),
               "skipped": sum(1 for t in trials if t["scenario"] == name and t.get("skipped"))}
        for k in ("ended", "named", "kept", "exact"):
            row[k] = sum(1 for t in ts if t[k])
        row["max_seconds"] = max((t["seconds"] for t in ts), default=None)
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="trials per scenario (default 3)")
    ap.add_argument("--only", default=",".join(SCENARIOS),
                    help=f"comma-separated scenarios (default all: {','.join(SCENARIOS)})")
    ap.add_argument("--seed", type=int, default=None, help="random seed for the timings (default: random, printed)")
    ap.add_argument("--deadline", type=float, default=30.0,
                    help="seconds a job may take to end after its fault (default 30)")
    ap.add_argument("--json", default=None, help="write every trial and the summary here")
    args = ap.parse_args(argv)
    scenarios = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in RUNNERS]
    if unknown or not scenarios:
        ap.error(f"--only: unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if not os.path.exists(MPIEXEC):
        ap.error(f"needs mpiexec next to this python ({MPIEXEC})")
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"fault matrix: {', '.join(scenarios)} x {args.repeat}, seed {seed}, deadline {args.deadline:g} s",
          flush=True)
    trials = run_matrix(scenarios, args.repeat, seed, args.deadline, log=lambda s: print(s, flush=True))
    rows = summarize(trials)
    print("\n| scenario | trials | ended in time | cause named | valid checkpoints kept | resume bit-identical "
          "| slowest end (s) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        slowest = f"{r['max_seconds']:.1f}" if r["max_seconds"] is not None else "-"
        skipped = f" ({r['skipped']} skipped)" if r["skipped"] else ""
        print(f"| {r['scenario']} | {r['trials']}{skipped} | {r['ended']} | {r['named']} | {r['kept']} "
              f"| {r['exact']} | {slowest} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"seed": seed, "repeat": args.repeat, "deadline_s": args.deadline, "summary": rows,
                       "trials": trials}, fh, indent=1)
    failed = [t for t in trials if not t.get("skipped") and not all(t[k] for k in ("ended", "named", "kept",
                                                                                    "exact"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
