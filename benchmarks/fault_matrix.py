"""Fault matrix: jobs and tools killed, interrupted, signalled twice, starved of
disk, fed damaged or hostile files, or sharing their output folder with a second
run, each repeated with random timing, and what happened.

    python benchmarks/fault_matrix.py --repeat 10 --json faults.json     # ~20 minutes on 2 cores
    python benchmarks/fault_matrix.py --repeat 1 --only kill,disk-full   # what CI runs, in seconds

Training trials are real `mpiexec -n 2 python -m ringpipe.train` jobs of a tiny
float64 GPT (the parameter-server trials: `mpiexec -n 3`, two workers and a dedicated
server, `--sync ps --ps-servers 1`); the tool trials run `ringpipe prepare` (under `mpiexec -n 2` where
it matters), `export`, `sample`, `train --init-from` and `finished` the way a
user would. The hostile-value trials give `train`, `sample` and `prepare` absurd numbers,
`--init-from` model folders with values out of type or range (config.json, a weight,
tokenizer.json), `report` and `top` a run whose metrics.jsonl or monitor.json holds what no
run writes, the tools places no file may be written, and Ctrl-C to a streaming `sample`.
The save-fault trials (sharded-kill, sharded-term, sharded-disk-full and the same three async-)
meet a sharded checkpoint while it is written, at once or in the background
(--checkpoint-async), by a model whose checkpoint is ~155 MB: SIGKILL or SIGTERM to a random rank
once the ranks are writing their files (half the SIGKILLs: to rank 0 inside the commit, between
the folder's rename and the manifest's), or --out on a disk too small for the second save.
For each trial the table counts:

    ended     the job ended within --deadline seconds of the fault (no hang)
    named     its output names the cause (the signal, "disk full", the damaged
              checkpoint or file, the other run's pid; the flag, key, file or tensor),
              with no traceback, raw errno line or temp file's name in its place
    kept      nothing valid before the fault was lost: every checkpoint, the run,
              the dataset (old or new, never a mix), the files beside them (another
              exporter's .prom file); a refusal wrote nothing. The save faults: no
              manifest names a half-written checkpoint, the newest valid one is the
              one before the fault (SIGTERM: the stop's, the save in flight committed),
              and the next run removed what the fault left (the temp folder, a shards
              folder no manifest names, the manifest's temp file; a full disk's run
              its own)
    truthful  the exit code says what happened (0 only for work done; 2 for a
              refusal; the signal's or the abort's code for a stop; 130 for Ctrl-C)
    exact     (training) `--resume auto` then finishes bit-identical (every
              parameter) to an uninterrupted run of the same seed, resuming from the
              checkpoint `kept` expects (save faults) (ps-signal: in
              the modes that keep sync's math, sync and streamed; ssp and async
              change it, by design, and their stop checkpoint must resume to the
              end, counted in `kept`)

A check that does not apply to a scenario is shown as "-". A save fault that missed
the save it was meant for (the signal sent after the commit) fails the trial (`landed`).

A trial prints its random choices, so a failure can be replayed with --seed.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

from ringpipe.engine.job import checkpoint, lifecycle, sharded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PY = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), "mpiexec")
STEPS = 80
MODEL = ["--data", "synthetic", "--layers", "2", "--d-model", "16", "--heads", "2", "--context", "16",
         "--batch-size", "8", "--sample-tokens", "0", "--dtype", "float64", "--lr", "1e-3", "--log-every", "1",
         "--decay-steps", str(STEPS)]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
           PYTHONUNBUFFERED="1")
LONG = 10**6       # steps of a run that is stopped by its fault long before it ends
SCENARIOS = ("kill", "double-signal", "disk-full", "bad-checkpoint", "concurrent", "ps-signal",
             "prepare-kill", "prepare-interrupt", "prepare-disk-full", "prepare-concurrent",
             "export-overwrite", "hostile-load", "hostile-markers", "hostile-values",
             "sharded-kill", "sharded-term", "sharded-disk-full", "async-kill", "async-term", "async-disk-full")
CHECKS = ("ended", "named", "kept", "truthful", "exact")


# ---- running jobs -------------------------------------------------------------------------

def launch(out, *extra, steps=STEPS, ranks=2, model=MODEL):
    return subprocess.Popen([MPIEXEC, "-n", str(ranks), PY, "-m", "ringpipe.train", *model, "--steps", str(steps),
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


def run_to_end(out, *extra, steps=STEPS, deadline=300, ranks=2, model=MODEL):
    rc, output, _, _ = finish(launch(out, *extra, steps=steps, ranks=ranks, model=model), deadline)
    return rc, output


def rank_pids(mpiexec_pid, command=b"ringpipe.train"):
    """PIDs of the python ranks below an mpiexec (through hydra's proxy) whose command line holds `command`."""
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
            if command in cmd and b"mpiexec" not in cmd and b"hydra" not in cmd:
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
    return dict(did=f"SIGKILL rank {victim} after step {at}", seconds=seconds, ended=ended, truthful=rc != 0,
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
                seconds=seconds, ended=ended, truthful=truthful, named=sig.name in output or second.name in output,
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
        left = leftovers(ckpt)             # temp files, a sharded save's temp folder or orphan shards folder
        invalid = checkpoint.scan(ckpt)[1] if os.path.isdir(ckpt) else []
        with open(os.path.join(out, "metrics.jsonl"), "rb") as fh:
            metrics = fh.read()
        whole = metrics.endswith(b"\n") or not metrics
        subprocess.run(["mount", "-o", "remount,size=64m", disk], check=True)
        exact, _ = resume_is_exact(out, reference)
        return dict(did=f"{size // 1024} KiB disk, a checkpoint every step", seconds=seconds,
                    ended=ended, truthful=rc == 1, named="disk full at" in output,
                    kept=not left and not invalid and whole, exact=exact)
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
    """Make the manifest match its (tampered) npz again: size, CRC and checksum (a sharded one's,
    whose rank files are untouched: its checksum)."""
    with open(json_path) as fh:
        m = json.load(fh)
    if "npz" in m:
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
    # The checkpoint's data: its npz (whole-file), or its first rank file (sharded; never zip-bombed).
    npz = json_path[:-5] + ".npz"
    shards = json_path[:-5] + ".shards"
    if not os.path.exists(npz) and os.path.isdir(shards):
        npz = os.path.join(shards, sorted(os.listdir(shards))[0])
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
    # Either format: sharded (the default; its data is a folder of rank files) or whole-file (an npz).
    fmt = rng.choice(["sharded", "whole"])
    rc, _ = run_to_end(out, "--checkpoint-every", "2", "--keep", "0", "--checkpoint-format", fmt, steps=STEPS // 2)
    found = checkpoint.list_checkpoints(os.path.join(out, "checkpoints"))
    n = rng.randint(1, min(3, len(found) - 1))
    damaged = found[-n:]
    kinds = [rng.choice(DAMAGE if fmt == "whole" else DAMAGE[:-1]) for _ in damaged]
    for kind, path in zip(kinds, damaged):
        _damage(kind, path)
    before = [p for p in found if p not in damaged]
    proc = launch(out, "--resume", "auto", "--checkpoint-every", "2", "--keep", "0", "--checkpoint-format", fmt)
    rc, output, seconds, ended = finish(proc, deadline)
    named = all(os.path.basename(p) in output for p in damaged)
    # The checkpoints it resumed from and before stay valid; the run then rewrote the damaged steps.
    kept = set(before) <= set(valid_checkpoints(out))
    said = {"sharded": lambda k: k.replace("the npz", "rank file 0"), "whole": lambda k: k}[fmt]
    return dict(did=f"{fmt}: " + "; ".join(f"{os.path.basename(p)}: {said(k)}" for p, k in zip(damaged, kinds)),
                seconds=seconds,
                ended=ended, truthful=rc == 0, named=named, kept=kept, exact=rc == 0 and same_as(reference, out))


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
                ended=ended2 and ended1, truthful=rc2 == 2 and rc1 == 85,
                named=f"pid {first.pid}" in output2 or "is in use by another run" in output2,
                kept=len(valid) == stopped_at // 2 or len(valid) == stopped_at // 2 + 1,
                exact=same_as(params(alone), out))


# The parameter-server signal trials: every stop signal, to the server (rank 2) and to a
# worker (rank 0 or 1), in every mode of `--sync ps --ps-servers 1`. The trials of a matrix
# take these combinations in turn (from a random one on), so --repeat 24 runs each once.
PS_MODES = {"sync": [], "ssp": ["--ps-mode", "ssp:2"], "async": ["--ps-mode", "async"],
            "streamed": ["--grad-clip", "0"]}
PS_SIGNAL_TRIALS = [(mode, sig, target) for mode in PS_MODES
                    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT) for target in ("server", "worker")]
# The modes that repeat bit for bit: a resume must end as the uninterrupted run of the same mode
# (ps_reference: the servers' global norm is added in another order than the all-reduce's, so
# a clipped step's bits differ from the all-reduce reference's).
PS_EXACT = ("sync", "streamed")
_PS_REFERENCES: dict = {}


def ps_reference(root, mode):
    """The parameters of an uninterrupted `mode` run of STEPS steps, made once per matrix."""
    if (root, mode) not in _PS_REFERENCES:
        out = os.path.join(root, f"reference-ps-{mode}")
        rc, output = run_to_end(out, "--sync", "ps", "--ps-servers", "1", *PS_MODES[mode], ranks=3)
        if rc != 0:
            raise SystemExit(f"fault_matrix: the uninterrupted {mode} reference run failed:\n{output[-3000:]}")
        _PS_REFERENCES[(root, mode)] = params(out)
    return _PS_REFERENCES[(root, mode)]


def ps_signal(rng, folder, reference, deadline, trial=None):
    mode, sig, target = trial or rng.choice(PS_SIGNAL_TRIALS)
    out = os.path.join(folder, "run")
    flags = ["--sync", "ps", "--ps-servers", "1", *PS_MODES[mode]]
    victim = 2 if target == "server" else rng.randint(0, 1)
    at = rng.randint(2, STEPS // 2 - 10)
    proc = launch(out, "--checkpoint-every", "4", "--keep", "0", *flags, steps=LONG, ranks=3)
    wait_for_step(out, at, proc)
    time.sleep(rng.uniform(0, 0.05))                    # anywhere in the step
    before = valid_checkpoints(out)
    os.kill(rank_pids_by_rank(proc.pid)[victim], sig)
    rc, output, seconds, ended = finish(proc, deadline)
    code = 130 if sig == signal.SIGINT else 85
    latest = checkpoint.find_latest(os.path.join(out, "checkpoints"))
    stopped_at = checkpoint.read_manifest(latest)["step"] if latest else None
    # The stop's line on rank 0 names the step, the code every rank exits with, and who got what.
    announced = f"checkpoint at step {stopped_at} written; exiting with code {code}" in output
    kept = set(before) <= set(valid_checkpoints(out)) and stopped_at is not None
    resumed, _ = run_to_end(out, "--resume", "auto", "--checkpoint-every", "2", *flags, ranks=3)
    result = dict(did=f"{sig.name} to {target} rank {victim} ({mode}) after step {at}", seconds=seconds, ended=ended,
                  truthful=rc == code and announced, named=f"{sig.name} to rank {victim}" in output, kept=kept)
    if mode in PS_EXACT:
        result["exact"] = resumed == 0 and same_as(ps_reference(os.path.dirname(folder), mode), out)
    else:                            # ssp, async: the resume follows the mode's own trajectory to the end
        final = checkpoint.find_latest(os.path.join(out, "checkpoints"))
        result["kept"] = kept and resumed == 0 and checkpoint.read_manifest(final)["step"] == STEPS
    return result


def rank_pids_by_rank(mpiexec_pid) -> dict:
    """{rank: pid} of a job's python ranks, from the rank its launcher gives each in the
    environment (rank_pids' order is the pids', not the ranks')."""
    ranks = {}
    for pid in rank_pids(mpiexec_pid):
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(v.split(b"=", 1) for v in fh.read().split(b"\0") if b"=" in v)
        ranks[int(env.get(b"PMI_RANK", env.get(b"OMPI_COMM_WORLD_RANK", b"-1")))] = pid
    return ranks


# ---- faults during a save: sharded, and in the background (--checkpoint-async) ---------------
# A model whose checkpoint is ~155 MB (a 77 MB file a rank: float64 parameters and Adam's two
# moments), so that one save takes ~0.5 s (sharded) to ~1 s (in the background, beside the
# training) on the 2-core VM: a window a fault can be placed in. Its runs save every SAVE_EVERY
# steps; the fault meets the second save (step 2 * SAVE_EVERY), so the first is the previous
# checkpoint that must come through. The trigger is the second save's temp folder
# (ckpt_S.shards.tmp, made by rank 0 before any rank writes) holding a rank file: the ranks are
# writing. From there the fault waits a random part of the first save's measured length; the
# trial then records whether the temp folder was still there after the signal was sent (it
# `landed` in the save) and fails if not. A full disk needs no trigger: the run's --out is on a
# tmpfs of 1.25-1.9 checkpoints, so the first save fits and the second runs out of space partway.
SAVE_STEPS, SAVE_EVERY = 12, 4
SAVE_MODEL = ["--data", "synthetic", "--layers", "2", "--d-model", "512", "--heads", "2", "--context", "16",
              "--batch-size", "4", "--sample-tokens", "0", "--dtype", "float64", "--lr", "1e-3", "--log-every", "1",
              "--decay-steps", str(SAVE_STEPS)]
SAVE_FAULTS = {f"{how}-{fault}": (how, fault) for how in ("sharded", "async") for fault in ("kill", "term", "disk-full")}
_SAVE_REFERENCES: dict = {}
_LEFTOVER = re.compile(r"ckpt_\d{8}\.(shards\.tmp|(json|npz)\.tmp\.\d+)")
_SHARDS = re.compile(r"ckpt_(\d{8})\.shards")


def save_reference(root):
    """An uninterrupted SAVE_STEPS-step run of SAVE_MODEL, made once per matrix: {"params": its
    final parameters, "ckpt_bytes": the size of one checkpoint (its last; every one is as large)}."""
    if root not in _SAVE_REFERENCES:
        out = os.path.join(root, "reference-save")
        rc, output = run_to_end(out, steps=SAVE_STEPS, model=SAVE_MODEL)
        if rc != 0:
            raise SystemExit(f"fault_matrix: the uninterrupted save-fault reference run failed:\n{output[-3000:]}")
        last = checkpoint.manifest_path(os.path.join(out, "checkpoints"), SAVE_STEPS)
        shards = last[:-5] + ".shards"
        size = os.path.getsize(last) + sum(os.path.getsize(os.path.join(shards, name)) for name in os.listdir(shards))
        _SAVE_REFERENCES[root] = dict(params=params(out), ckpt_bytes=size)
        shutil.rmtree(out, ignore_errors=True)
    return _SAVE_REFERENCES[root]


def leftovers(ckpt):
    """What an interrupted save leaves in a checkpoints folder: its temp folder, temp files, and a
    shards folder no manifest names (a commit killed between its two renames)."""
    try:
        names = os.listdir(ckpt)
    except OSError:
        return []
    return sorted(n for n in names if _LEFTOVER.fullmatch(n) or (
        _SHARDS.fullmatch(n) and not os.path.exists(os.path.join(ckpt, n[:-7] + ".json"))))


def _step_of(json_path):
    return int(os.path.basename(json_path)[5:13]) if json_path else None


def wait_for_save(ckpt, step, proc, timeout=120):
    """Block until sharded checkpoint `step` is being written (its temp folder holds a rank file);
    False if the job ended first or the save came and went between two looks."""
    tmp = os.path.join(ckpt, sharded.temp_folder_name(step))
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        try:
            if os.listdir(tmp):
                return True
        except OSError:
            if os.path.exists(checkpoint.manifest_path(ckpt, step)):
                return False
        time.sleep(0.001)
    return False


def save_seconds(ckpt, step, proc, timeout=120):
    """How long sharded checkpoint `step` took, from its first rank file to its commit (None: not seen)."""
    if not wait_for_save(ckpt, step, proc, timeout):
        return None
    t0, tmp, end = time.time(), os.path.join(ckpt, sharded.temp_folder_name(step)), time.time() + timeout
    while os.path.isdir(tmp) and time.time() < end and proc.poll() is None:
        time.sleep(0.001)
    return time.time() - t0


# The one moment of a sharded commit a timed signal cannot hit: rank 0 has renamed the rank files'
# folder into place (ckpt_S.shards) and not yet the manifest (microseconds apart). A shim loaded
# into rank 0 alone (LD_PRELOAD) raises SIGKILL when rename() is asked to make the path in
# FAULT_MATRIX_KILL_AT_RENAME, before it does: the run dies exactly there, leaving a shards
# folder no manifest names and the manifest's temp file.
_KILL_AT_RENAME_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

static void die_if_asked(const char *to) {
    const char *at = getenv("FAULT_MATRIX_KILL_AT_RENAME");
    if (at && to && strcmp(at, to) == 0)
        raise(SIGKILL);
}

int rename(const char *from, const char *to) {
    static int (*real)(const char *, const char *);
    if (!real)
        real = (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
    die_if_asked(to);
    return real(from, to);
}

int renameat(int fd1, const char *from, int fd2, const char *to) {
    static int (*real)(int, const char *, int, const char *);
    if (!real)
        real = (int (*)(int, const char *, int, const char *))dlsym(RTLD_NEXT, "renameat");
    die_if_asked(to);
    return real(fd1, from, fd2, to);
}
"""


def kill_at_rename_shim(folder):
    """The shim's shared library, built in `folder` (once); None where no C compiler builds it."""
    lib = os.path.join(folder, "kill_at_rename.so")
    if not os.path.exists(lib):
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            return None
        source = os.path.join(folder, "kill_at_rename.c")
        with open(source, "w") as fh:
            fh.write(_KILL_AT_RENAME_C)
        r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", lib, source, "-ldl"], capture_output=True)
        if r.returncode:
            return None
    return lib


def launch_killed_at_rename(out, shim, target, *extra, steps, model):
    """`launch`, with rank 0 killed (SIGKILL) when it renames a file onto `target`."""
    args = [PY, "-m", "ringpipe.train", *model, "--steps", str(steps), "--out", out, *extra]
    return subprocess.Popen([MPIEXEC, "-n", "1", "-env", "LD_PRELOAD", shim, "-env", "FAULT_MATRIX_KILL_AT_RENAME",
                             target, *args, ":", "-n", "1", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def save_fault(rng, folder, reference, deadline, trial=None):
    """SIGKILL or SIGTERM to a random rank while the ranks write a sharded checkpoint (at once, or in
    the background with --checkpoint-async; half the SIGKILLs: to rank 0 inside the commit), or the
    disk filling up during it."""
    how, fault = trial
    ref = save_reference(os.path.dirname(folder))
    flags = ["--checkpoint-every", str(SAVE_EVERY), "--keep", "0"] + (["--checkpoint-async"] if how == "async" else [])
    first, second = SAVE_EVERY, 2 * SAVE_EVERY
    parent = folder
    if fault == "disk-full":
        parent = os.path.join(folder, "disk")
        size = int(ref["ckpt_bytes"] * rng.uniform(1.25, 1.9))
        refused = _mount_tmpfs(parent, size)
        if refused:
            return dict(did=f"skipped: {refused}", skipped=True)
    shim = kill_at_rename_shim(os.path.dirname(folder)) if fault == "kill" and rng.random() < 0.5 else None
    misses = 0
    try:
        out = os.path.join(parent, "run")
        ckpt = os.path.join(out, "checkpoints")
        manifest = checkpoint.manifest_path(ckpt, second)
        before = [checkpoint.manifest_path(ckpt, first)]           # committed before the second save began
        if fault == "disk-full":
            did = f"{how} saves every {SAVE_EVERY} steps on a {size / 2**20:.0f} MiB disk " \
                  f"({size / ref['ckpt_bytes']:.2f} checkpoints)"
            proc = launch(out, *flags, steps=SAVE_STEPS, model=SAVE_MODEL)
            wait_for_save(ckpt, second, proc)             # the time to end counts from the save's start
            rc, output, seconds, ended = finish(proc, deadline)
            landed = f"the checkpoint for step {second} was not written" in output
            named = ("disk full at" in output and f"the checkpoint for step {second} was not written; the previous "
                     "checkpoints are intact" in output and _told_plainly(output))
            truthful, expected, said = rc == 1, {first}, _line_naming("disk full at", output)
        elif shim:
            # Rank 0 killed inside the commit: the folder renamed into place, the manifest not yet.
            proc = launch_killed_at_rename(out, shim, manifest, *flags, steps=LONG, model=SAVE_MODEL)
            wait_for_save(ckpt, second, proc)
            while not os.path.isdir(manifest[:-5] + ".shards") and proc.poll() is None:
                time.sleep(0.001)                         # the folder's rename: the kill follows at once
            rc, output, seconds, ended = finish(proc, deadline)
            landed = os.path.isdir(manifest[:-5] + ".shards") and not os.path.exists(manifest)
            did = f"SIGKILL to rank 0 inside {how} save {second}'s commit (its folder renamed, its manifest not yet)"
            named = "signal 9" in output.lower() or "killed" in output.lower()
            truthful = rc != 0 and "exiting with code" not in output
            expected, said = {first}, _line_naming("signal 9", output)
        else:
            sig = signal.SIGKILL if fault == "kill" else signal.SIGTERM
            # A save can be quicker than the first was: a signal sent after its commit missed it, and
            # the trial is run again from the start (at most 3 times), the misses counted.
            for misses in range(3):
                shutil.rmtree(out, ignore_errors=True)
                victim, share = rng.randint(0, 1), rng.uniform(0, 0.6)
                proc = launch(out, *flags, steps=LONG, model=SAVE_MODEL)
                length = save_seconds(ckpt, first, proc) or 0.0
                pids = rank_pids_by_rank(proc.pid)
                if not wait_for_save(ckpt, second, proc) or victim not in pids:
                    rc, output, seconds, ended = finish(proc, deadline)
                    return dict(did=f"{sig.name} meant for rank {victim} during save {second}: the save was not "
                                    f"seen (exit {rc})", seconds=seconds, ended=ended, landed=False,
                                said=output[-400:], output=output[-4000:])
                time.sleep(share * length)
                os.kill(pids[victim], sig)
                landed = os.path.isdir(os.path.join(ckpt, sharded.temp_folder_name(second)))
                rc, output, seconds, ended = finish(proc, deadline)
                if landed:
                    break
            did = (f"{sig.name} to rank {victim} {share * length * 1e3:.0f} ms into {how} save {second} "
                   f"(the first took {length * 1e3:.0f} ms)" + (f"; {misses} earlier one(s) missed" if misses else ""))
            if sig == signal.SIGKILL:
                named = "signal 9" in output.lower() or "killed" in output.lower()
                truthful = rc != 0 and "exiting with code" not in output
                expected, said = {first}, _line_naming("signal 9", output)
            else:
                stopped = _step_of(checkpoint.find_latest(ckpt))
                named = f"SIGTERM to rank {victim}" in output
                truthful = rc == lifecycle.REQUEUE_EXIT_CODE and (
                    f"checkpoint at step {stopped} written; exiting with code {rc}" in output)
                # A sharded save finishes and is the stop's checkpoint. One in the background is
                # committed first, then the stop's is written at the step boundary where the ranks
                # agree to stop (its own step's, when the signal came before they agreed on that one).
                expected = {second} if how == "sharded" else set(range(second, second + 4))
                said = _line_naming("exiting with code", output)
        # After the fault: every checkpoint there before is still valid, no manifest names a half
        # written one, the newest valid one is the one expected; a full disk's run removed its own
        # temp folder (a disk left full would fail the next run).
        found = leftovers(ckpt)
        valid, invalid = checkpoint.scan(ckpt) if os.path.isdir(ckpt) else ([], [])
        latest = _step_of(valid[-1] if valid else None)
        kept = set(before) <= set(valid) and not invalid and latest in expected
        if how == "async" and fault == "term":            # the save in flight was committed before the stop's
            kept = kept and manifest in valid
        if fault == "disk-full":
            kept = kept and not found
            subprocess.run(["mount", "-o", "remount,size=2g", parent], check=True)
        # The next run: removes what the fault left, resumes from that newest checkpoint, ends as the
        # uninterrupted run did.
        rc2, output2 = run_to_end(out, "--resume", "auto", *flags, steps=SAVE_STEPS, model=SAVE_MODEL)
        cleaned = not leftovers(ckpt) and (not found or "left by an interrupted checkpoint write" in output2)
        exact = (rc2 == 0 and f"resumed from {checkpoint.manifest_path(ckpt, latest)} at step {latest}" in output2
                 and same_as(ref["params"], out))
        result = dict(did=did, seconds=seconds, ended=ended, landed=landed, named=named, truthful=truthful,
                      kept=kept and cleaned, exact=exact, said=said, exit=rc, resumed_at=latest, left=found,
                      misses=misses)
        if failed_checks(result):                         # the record keeps what the job said, to see why
            result["output"] = "\n".join(line for line in output.splitlines() if not line.startswith("step "))[-4000:]
            result["resume_output"] = output2[-2000:]
        return result
    finally:
        if fault == "disk-full":
            subprocess.run(["umount", "-l", parent], capture_output=True)


# ---- the tools around training: prepare, export, sample, --init-from, finished --------------
# Each trial builds what it needs in its own folder; corpora and reference datasets are made
# once per matrix (in the matrix's root folder) and reused.

def ringpipe_cmd(*args, ranks=1):
    """A `ringpipe` command line, under `mpiexec -n ranks` when ranks > 1."""
    cmd = [PY, "-m", "ringpipe", *args]
    return [MPIEXEC, "-n", str(ranks), *cmd] if ranks > 1 else cmd


def start_tool(*args, ranks=1, cwd=ROOT):
    return subprocess.Popen(ringpipe_cmd(*args, ranks=ranks), cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def run_tool(*args, ranks=1, deadline=60.0, cwd=ROOT):
    """(returncode, output, seconds, ended) of a whole tool run."""
    return finish(start_tool(*args, ranks=ranks, cwd=cwd), deadline)


def _corpus(root, name, files, kb):
    """A folder of `files` text files of about `kb` KB each (deterministic words), made once."""
    folder = os.path.join(root, f"corpus-{name}")
    if not os.path.isdir(folder):
        rng = np.random.default_rng(len(name) * 1000 + files)
        words = np.array(["ring", "pipe", "rank", "shard", "token", "step", "all-reduce", "bubble", "node",
                          "gradient", "stage", "micro-batch", "the", "a", "of", "and", "is", "\n"])
        os.makedirs(folder + ".tmp", exist_ok=True)
        for i in range(files):
            text = " ".join(words[rng.integers(0, len(words), size=kb * 180)])
            with open(os.path.join(folder + ".tmp", f"doc{i:03d}.txt"), "w") as fh:
                fh.write(f"{name} {i}\n{text}\n")
        os.rename(folder + ".tmp", folder)
    return folder


def prepare_args(corpus, out, *extra):
    return ("prepare", corpus, "--out", out, "--quiet", "--tokens-per-shard", "500000", *extra)


def dataset_id(folder):
    """A valid prepared dataset's fingerprint (its tokenizer and every shard's bytes, in order), or None."""
    from ringpipe.engine.data import shards
    import hashlib
    try:
        m = shards.read_manifest(folder)
    except (ValueError, OSError):
        return None
    h = hashlib.sha256(m["tokenizer"]["sha256"].encode())
    for split in shards.SPLITS:
        for name in m["splits"][split]["shards"]:
            with open(os.path.join(folder, name), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def datasets_in(out):
    """The fingerprints of the valid datasets in `out` and in the folders inside it (previous/...)."""
    found = [dataset_id(out)]
    if os.path.isdir(out):
        found += [dataset_id(os.path.join(out, d)) for d in sorted(os.listdir(out))
                  if os.path.isdir(os.path.join(out, d))]
    return [f for f in found if f]


_REFERENCES = {}


def reference_datasets(root):
    """Corpus A (small: prepared in a second), corpus B (a few seconds under 2 ranks), their
    fingerprints, and how long B takes under `mpiexec -n 2` (to place faults inside the run)."""
    if root not in _REFERENCES:
        small, large = _corpus(root, "A", 4, 8), _corpus(root, "B", 48, 300)
        ids = {}
        for name, corpus in (("A", small), ("B", large)):
            out = os.path.join(root, f"reference-{name}")
            t0 = time.time()
            rc, output, seconds, _ = run_tool(*prepare_args(corpus, out), ranks=2, deadline=300)
            if rc != 0:
                raise SystemExit(f"fault_matrix: preparing corpus {name} failed:\n{output[-3000:]}")
            ids[name] = dataset_id(out)
            ids[f"{name}_seconds"] = time.time() - t0
        _REFERENCES[root] = dict(small=small, large=large, **ids)
    return _REFERENCES[root]


def _dataset_verdict(out, refs):
    """kept: a whole dataset (old or new) is in `out` or beside it, and nothing there is a mix."""
    found = datasets_in(out)
    return bool(found) and all(f in (refs["A"], refs["B"]) for f in found)


def _signal_prepare(rng, folder, deadline, sig):
    refs = reference_datasets(os.path.dirname(folder))
    out = os.path.join(folder, "data")
    rc, output, _, _ = run_tool(*prepare_args(refs["small"], out))
    assert rc == 0, output
    victim = rng.randint(0, 1)
    at = rng.uniform(0.05, 0.9) * refs["B_seconds"]
    proc = start_tool(*prepare_args(refs["large"], out, "--overwrite"), ranks=2)
    # From the moment the ranks exist plus 50 ms: within a rank's first ~20 ms Python is still
    # starting (no ringpipe code has run), and a SIGINT there makes Python itself abort in
    # site's import, which MPICH's proxy was seen not to report (the README says so).
    while len(rank_pids(proc.pid, b"prepare")) < 2 and proc.poll() is None:
        time.sleep(0.002)
    time.sleep(at)
    pids = rank_pids(proc.pid, b"prepare")
    if proc.poll() is not None or len(pids) < 2:
        rc, output, seconds, ended = finish(proc, deadline)
        return dict(did=f"{sig.name} meant for rank {victim} at {at:.2f} s: the job had already ended",
                    seconds=seconds, ended=ended, named=True, kept=_dataset_verdict(out, refs),
                    truthful=rc == 0 and dataset_id(out) == refs["B"])
    t0 = time.time()
    os.kill(pids[victim], sig)
    rc, output, _, ended = finish(proc, deadline)
    seconds = time.time() - t0
    if sig == signal.SIGKILL:
        named = "signal 9" in output.lower() or "killed" in output.lower()
    else:
        named = sig.name in output or "interrupt" in output.lower()
    # rc 0 is truthful only if the job had finished its work before the signal landed.
    truthful = rc != 0 or dataset_id(out) == refs["B"]
    return dict(did=f"{sig.name} to rank {victim} of `mpiexec -n 2 prepare --overwrite` {at:.2f} s in",
                seconds=seconds, ended=ended, named=named, kept=_dataset_verdict(out, refs), truthful=truthful)


def prepare_kill(rng, folder, reference, deadline):
    return _signal_prepare(rng, folder, deadline, signal.SIGKILL)


def prepare_interrupt(rng, folder, reference, deadline):
    return _signal_prepare(rng, folder, deadline, signal.SIGINT)


def prepare_disk_full(rng, folder, reference, deadline):
    refs = reference_datasets(os.path.dirname(folder))
    disk = os.path.join(folder, "disk")
    size = rng.randint(300, 2000) * 1024
    refused = _mount_tmpfs(disk, size)
    if refused:
        return dict(did=f"skipped: {refused}", skipped=True)
    try:
        out = os.path.join(disk, "data")
        rc, output, _, _ = run_tool(*prepare_args(refs["small"], out))
        if rc != 0:
            return dict(did=f"skipped: the small dataset does not fit a {size // 1024} KiB disk", skipped=True)
        ranks = rng.choice([1, 2])
        rc, output, seconds, ended = run_tool(*prepare_args(refs["large"], out, "--overwrite"), ranks=ranks,
                                              deadline=deadline + refs["B_seconds"])
        low = output.lower()
        return dict(did=f"prepare --overwrite on a {size // 1024} KiB disk ({ranks} rank(s))", seconds=seconds,
                    ended=ended, named="disk" in low and ("full" in low or "space" in low),
                    kept=dataset_id(out) == refs["A"] or _dataset_verdict(out, refs), truthful=rc in (1, 2))
    finally:
        subprocess.run(["umount", "-l", disk], capture_output=True)


def prepare_concurrent(rng, folder, reference, deadline):
    """A long prepare (corpus B) and, after a random delay, a second one (corpus A) on the same --out."""
    refs = reference_datasets(os.path.dirname(folder))
    out = os.path.join(folder, "data")
    how = rng.choice([[], ["--overwrite"]])
    delay = rng.uniform(0, 1.2 * refs["B_seconds"])
    first = start_tool(*prepare_args(refs["large"], out), ranks=2)
    time.sleep(delay)
    t0 = time.time()
    rc2, output2, _, ended2 = run_tool(*prepare_args(refs["small"], out, *how), deadline=deadline)
    seconds = time.time() - t0
    rc1, output1, _, ended1 = finish(first, deadline + refs["B_seconds"])
    final = dataset_id(out)
    wrote = [name for name, rc in (("B", rc1), ("A", rc2)) if rc == 0]
    refused = [out_ for rc, out_ in ((rc1, output1), (rc2, output2)) if rc != 0]
    # Whoever exited 0 wrote the dataset; if both did, they ran one after the other and the second's is there.
    kept = bool(wrote) and final == refs[wrote[-1]]
    named = all("pid " in o or "in use" in o or "already holds" in o for o in refused)
    truthful = all(rc in (0, 2) for rc in (rc1, rc2)) and (rc1 == 0 or rc2 == 0)
    return dict(did=f"a second prepare {' '.join(how) or '(plain)'} {delay:.2f} s after the first "
                    f"(exits {rc1}, {rc2})", seconds=seconds, ended=ended1 and ended2, named=named, kept=kept,
                truthful=truthful)


# The shape of the tools' runs: one block, trained in a second or two.
TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--sample-tokens", "0", "--quiet"]


def _tiny_run(folder, data, *flags, name="run"):
    """A 2-step GPT run on `data` with a checkpoint per step (a run to export, sample, damage);
    `flags` (e.g. --model llama) follow the shape's."""
    run = os.path.join(folder, name)
    rc, output, _, _ = run_tool("train", "--data", data, *TINY, "--steps", "2", "--checkpoint-every", "1", *flags,
                                "--out", run, deadline=300)
    if rc != 0:
        raise SystemExit(f"fault_matrix: the run to export failed:\n{output[-3000:]}")
    return run


def _snapshot(paths):
    """Every file under `paths` with its bytes' hash: what must still be there, unchanged."""
    import hashlib
    seen = {}
    for top in paths:
        for dirpath, _, files in os.walk(top):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    with open(path, "rb") as fh:
                        seen[path] = hashlib.sha256(fh.read()).hexdigest()
                except OSError:
                    seen[path] = None
    return seen


EXPORT_TARGETS = ("the folder holding the run", "the run itself", "the run's checkpoints/", "a prepared dataset",
                  "a folder of the user's notes", "--out . from the folder holding the run", "an earlier export")


def export_overwrite(rng, folder, reference, deadline):
    refs = reference_datasets(os.path.dirname(folder))
    work = os.path.join(folder, "work")
    os.makedirs(work)
    data = os.path.join(work, "data")
    run_tool(*prepare_args(refs["small"], data))
    run = _tiny_run(work, data)
    notes = os.path.join(work, "notes")
    os.makedirs(notes)
    with open(os.path.join(notes, "results.txt"), "w") as fh:
        fh.write("three weeks of notes\n")
    model = os.path.join(work, "model")
    run_tool("export", run, "--out", model)
    target = rng.choice(EXPORT_TARGETS)
    out, cwd = {EXPORT_TARGETS[0]: (work, ROOT), EXPORT_TARGETS[1]: (run, ROOT),
                EXPORT_TARGETS[2]: (os.path.join(run, "checkpoints"), ROOT), EXPORT_TARGETS[3]: (data, ROOT),
                EXPORT_TARGETS[4]: (notes, ROOT), EXPORT_TARGETS[5]: (".", work),
                EXPORT_TARGETS[6]: (model, ROOT)}[target]
    precious = [run, data, notes] + ([] if target == EXPORT_TARGETS[6] else [model])
    before = _snapshot(precious)
    rc, output, seconds, ended = run_tool("export", run, "--out", out, "--overwrite", cwd=cwd, deadline=deadline)
    after = _snapshot(precious)
    if target == EXPORT_TARGETS[6]:              # the one target --overwrite is for: replaced, nothing else touched
        ok = rc == 0 and os.path.exists(os.path.join(model, "config.json"))
        return dict(did=f"export --overwrite onto {target}", seconds=seconds, ended=ended, named=True,
                    kept=before == after, truthful=ok)
    return dict(did=f"export --overwrite onto {target}", seconds=seconds, ended=ended,
                named="refus" in output.lower() or "not a model folder" in output or "holds" in output,
                kept=before == after, truthful=rc == 2)


def _edit_json(path, edit):
    with open(path) as fh:
        obj = json.load(fh)
    edit(obj)
    with open(path, "w") as fh:
        json.dump(obj, fh)


def _rewrite_tensor(model_dir, change):
    """Rewrite model.safetensors with its first tensor (by name) replaced by change(tensor);
    returns the tensor's name."""
    from safetensors.numpy import load_file, save_file
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = change(tensors[name])
    save_file(tensors, path)
    return name


def _int_tensor(model_dir):
    """Rewrite model.safetensors with one tensor stored as int64."""
    return _rewrite_tensor(model_dir, lambda tensor: tensor.astype(np.int64))


HOSTILE = ("init-from: config.json n_layer 10^6", "init-from: config.json n_embd 10^8",
           "init-from: config.json is a FIFO", "init-from: config.json is /dev/zero",
           "init-from: config.json nested 10^5 deep", "init-from: an int64 tensor",
           "sample: every checkpoint's n_embd 10^6 (forged manifests)",
           "export: every checkpoint's n_head edited (forged manifests)", "sample: every manifest a FIFO")


def _damage_hostile(kind, model, run):
    config = os.path.join(model, "config.json")
    manifests = checkpoint.list_checkpoints(os.path.join(run, "checkpoints"))
    if kind == HOSTILE[0]:
        _edit_json(config, lambda c: c.update(n_layer=10**6))
    elif kind == HOSTILE[1]:
        _edit_json(config, lambda c: c.update(n_embd=10**8))
    elif kind == HOSTILE[2]:
        os.remove(config)
        os.mkfifo(config)
    elif kind == HOSTILE[3]:
        os.remove(config)
        os.symlink("/dev/zero", config)
    elif kind == HOSTILE[4]:
        with open(config, "w") as fh:
            fh.write("[" * 100000 + "]" * 100000)
    elif kind == HOSTILE[5]:
        _int_tensor(model)
    elif kind in HOSTILE[6:8]:
        for path in manifests:
            key, value = ("n_embd", 10**6) if kind == HOSTILE[6] else ("n_head", 3)
            _edit_json(path, lambda m: m["model_config"].update({key: value}))
            _forge_manifest(path)
    else:
        for path in manifests:
            os.remove(path)
            os.mkfifo(path)


def hostile_load(rng, folder, reference, deadline):
    refs = reference_datasets(os.path.dirname(folder))
    data = os.path.join(folder, "data")
    run_tool(*prepare_args(refs["small"], data))
    run = _tiny_run(folder, data)
    model = os.path.join(folder, "model")
    run_tool("export", run, "--out", model)
    kind = rng.choice(HOSTILE)
    _damage_hostile(kind, model, run)
    if kind.startswith("init-from"):
        args = ("train", "--init-from", f"hf:{model}", "--data", data, "--steps", "1", "--sample-tokens", "0",
                "--out", os.path.join(folder, "new"))
        culprit = "config.json" if "config" in kind else "model.safetensors"
    elif kind.startswith("sample"):
        args, culprit = ("sample", run, "--tokens", "4"), "ckpt_"
    else:
        args, culprit = ("export", run, "--out", os.path.join(folder, "model2")), "ckpt_"
    rc, output, seconds, ended = run_tool(*args, deadline=deadline)
    return dict(did=kind, seconds=seconds, ended=ended, named=culprit in output, kept=True, truthful=rc == 2)


MARKERS = ('"ranks": 1e12', '"ranks": 10**12 (an int)', "a string rank count", "a float step",
           "a marker linked to /dev/zero", "a marker that is a FIFO", "a marker nested 10^5 deep",
           "--ranks -1 on a missing folder", "--ranks 0")


def hostile_markers(rng, folder, reference, deadline):
    run = os.path.join(folder, "run")
    done = os.path.join(run, "finished")
    os.makedirs(done)
    for r in range(2):
        with open(os.path.join(done, f"rank{r}.json"), "w") as fh:
            json.dump({"rank": r, "ranks": 2, "step": 10, "host": "n1", "pid": 1, "time": 0.0}, fh)
    kind = rng.choice(MARKERS)
    marker = os.path.join(done, "rank1.json")
    args = ["finished", run]
    if kind in MARKERS[:4]:
        value = {MARKERS[0]: ("ranks", 1e12), MARKERS[1]: ("ranks", 10**12), MARKERS[2]: ("ranks", "2"),
                 MARKERS[3]: ("step", 10.5)}[kind]
        _edit_json(marker, lambda m: m.update([value]))
    elif kind == MARKERS[4]:
        os.remove(marker)
        os.symlink("/dev/zero", marker)
    elif kind == MARKERS[5]:
        os.remove(marker)
        os.mkfifo(marker)
    elif kind == MARKERS[6]:
        with open(marker, "w") as fh:
            fh.write("[" * 100000 + "]" * 100000)
    elif kind == MARKERS[7]:
        args = ["finished", os.path.join(folder, "missing"), "--ranks", "-1"]
    else:
        args = ["finished", run, "--ranks", "0"]
    rc, output, seconds, ended = run_tool(*args, deadline=deadline)
    named = "rank1.json" in output or "--ranks" in output or "missing" in output
    return dict(did=kind, seconds=seconds, ended=ended, named=named, kept=True, truthful=rc in (1, 2))


# ---- hostile values: absurd numbers, model folders and files no run writes (issue 34) -------
# Each case runs one command the way a user would, on a copy of what it needs: a tiny GPT run
# (sample, export, top, report), a tiny Llama's Hugging Face folder (--init-from) or a small
# dataset (prepare), each made once per matrix when a case first asks for it. Every case is a
# refusal (exit 2 on every rank, naming the flag, key, file or tensor, before anything is
# written, nothing of anyone's changed) but one: Ctrl-C of a sample that streams, which keeps
# the text printed so far and exits 130. The trials take the cases in turn (from a random one
# on), so --repeat len(HOSTILE_VALUES) runs each once.

HUGE = "9" * 20                        # the 99999999999999999999, about 10^20
LONG_INT = "9" * 5000                  # past Python's int() limit of 4,300 digits
DEEP = "[" * 100_000 + "]" * 100_000   # past the JSON parser's recursion
# A valid Llama 3 RoPE scaling for the tiny Llama (context 16); each case breaks one number of it.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
MLP = ["--model", "mlp", "--data", "synthetic", "--layers", "1", "--d-model", "16", "--batch-size", "16",
       "--quiet"]


def _config(**changes):
    """A change of the folder's config.json; returns the key the refusal must name."""
    def change(model):
        _edit_json(os.path.join(model, "config.json"), lambda c: c.update(changes))
        return next(iter(changes))
    return change


def _rope(**bad):
    def change(model):
        _edit_json(os.path.join(model, "config.json"), lambda c: c.update(rope_scaling=dict(LLAMA3, **bad)))
        return f"rope_scaling.{next(iter(bad))}"
    return change


def _weight(value, dtype):
    """One value of the folder's first tensor set to `value`, the tensor stored as `dtype`."""
    def poison(tensor):
        tensor = tensor.astype(dtype)
        tensor.flat[0] = value
        return tensor
    return lambda model: _rewrite_tensor(model, poison)


def _not_a_tokenizer(model):
    with open(os.path.join(model, "tokenizer.json"), "w") as fh:
        fh.write('{"model": 5}')
    return "tokenizer.json"


# (what was done, the command, its hostile part, what its refusal must name, ranks)
HOSTILE_VALUES = [
    ("train --eval-batches 10^20", "train", ["--eval-batches", HUGE], "--eval-batches", 1),
    ("train --sample-tokens 10^20", "train", ["--sample-tokens", HUGE], "--sample-tokens", 1),
    ("train --heads 10^20", "train", ["--heads", HUGE], "--heads", 1),
    ("mpiexec -n 2 train --pp 0", "train", ["--pp", "0"], "--pp", 2),
    ("train --weight-decay 1e20", "train", ["--weight-decay", "1e20"], "--weight-decay", 1),
    ("mpiexec -n 3 train --sync ps --ps-servers 1 --ps-mode ssp:1e20", "train",
     ["--sync", "ps", "--ps-servers", "1", "--ps-mode", "ssp:1e20"], "--ps-mode", 3),
    ("mpiexec -n 3 train --sync ps --ps-servers 1 --ps-mode ssp:10^20", "train",
     ["--sync", "ps", "--ps-servers", "1", "--ps-mode", "ssp:" + HUGE], "--ps-mode", 3),
    ("train --model mlp --eval-batches 1000 (16,000 examples of a 205-example split)", "mlp",
     ["--eval-batches", "1000"], "--eval-batches", 1),
    ("mpiexec -n 2 train --metrics-textfile onto another exporter's .prom file", "textfile", [], "node.prom", 2),
    ("sample --tokens 10^20", "sample", ["--tokens", HUGE], "--tokens", 1),
    ("sample --temperature 1e-320", "sample", ["--temperature", "1e-320"], "--temperature", 1),
    ("sample --tokens 10^6, Ctrl-C once text has streamed", "ctrl-c", [], "interrupted (Ctrl-C)", 1),
    ("prepare --overwrite --val-every 10^20 onto a dataset", "prepare", ["--val-every", "1" + "0" * 20],
     "--val-every", 1),
    ("prepare --overwrite --tokens-per-shard 1 onto a dataset", "prepare", ["--tokens-per-shard", "1"],
     "--tokens-per-shard", 1),
    ("init-from: rope_scaling low_freq_factor 0", "init-from", _rope(low_freq_factor=0.0), None, 2),
    ("init-from: rope_scaling original_max_position_embeddings 0", "init-from",
     _rope(original_max_position_embeddings=0), None, 2),
    ("init-from: rope_scaling original_max_position_embeddings 1.5", "init-from",
     _rope(original_max_position_embeddings=1.5), None, 2),
    ("init-from: rope_scaling factor NaN", "init-from", _rope(factor=float("nan")), None, 2),
    ("init-from: layer_types of 1 for 2 layers", "init-from", _config(layer_types=["full_attention"]), None, 2),
    ('init-from: attention_dropout "x"', "init-from", _config(attention_dropout="x"), None, 2),
    ("init-from: rope_theta Infinity", "init-from", _config(rope_theta=float("inf")), None, 2),
    ("init-from: a NaN weight", "init-from", _weight(np.nan, np.float32), None, 2),
    ("init-from: a float64 weight of 1e39 (past float32)", "init-from", _weight(1e39, np.float64), None, 2),
    ('init-from: tokenizer.json {"model": 5}', "init-from", _not_a_tokenizer, None, 2),
    ("report: metrics.jsonl holds a 5,000-digit integer", "report", ("metrics.jsonl", LONG_INT), "metrics.jsonl", 1),
    ("report: metrics.jsonl nested 10^5 deep", "report", ("metrics.jsonl", DEEP), "metrics.jsonl", 1),
    ("report: monitor.json holds a 5,000-digit integer", "report", ("monitor.json", LONG_INT), "monitor.json", 1),
    ("report: monitor.json nested 10^5 deep", "report", ("monitor.json", DEEP), "monitor.json", 1),
    ("top --once: metrics.jsonl holds a 5,000-digit integer", "top", ("metrics.jsonl", LONG_INT), "damaged line", 1),
    ("top --once: metrics.jsonl nested 10^5 deep", "top", ("metrics.jsonl", DEEP), "damaged line", 1),
    ("top --once: monitor.json holds a 5,000-digit integer", "top", ("monitor.json", LONG_INT), "monitor.json", 1),
    ("top --once: monitor.json nested 10^5 deep", "top", ("monitor.json", DEEP), "monitor.json", 1),
    ("top --screenshot /missing/x.svg", "screenshot", [], "/missing", 1),
    ("export --out /proc/self/x", "export", [], "--out /proc/self/x", 1),
]
_HOSTILE_BASES: dict = {}


def hostile_base(root, name):
    """What the cases damage a copy of, made once per matrix: "gpt" a 2-step GPT run, "llama" a
    2-layer Llama's Hugging Face folder (ringpipe export of a 2-step run), "data" a small dataset."""
    if (root, name) not in _HOSTILE_BASES:
        base = os.path.join(root, f"hostile-base-{name}")
        os.makedirs(base, exist_ok=True)
        rc, output = 0, ""
        if name == "gpt":
            made = _tiny_run(base, "synthetic")
        elif name == "llama":
            made = os.path.join(base, "model")
            run = _tiny_run(base, "synthetic", "--model", "llama", "--layers", "2")
            rc, output, _, _ = run_tool("export", run, "--out", made, deadline=300)
        else:
            made = os.path.join(base, "data")
            rc, output, _, _ = run_tool(*prepare_args(_corpus(root, "A", 4, 8), made), deadline=300)
        if rc != 0:
            raise SystemExit(f"fault_matrix: making the hostile cases' {name} failed:\n{output[-3000:]}")
        _HOSTILE_BASES[(root, name)] = made
    return _HOSTILE_BASES[(root, name)]


def _copy_of(folder, name):
    """A copy, in the trial's folder, of the matrix's base `name` (hostile_base)."""
    copy = os.path.join(folder, name)
    shutil.copytree(hostile_base(os.path.dirname(folder), name), copy, symlinks=True)
    return copy


def _spoil(run, name, value):
    """A value no run writes in the run's metrics.jsonl (a record appended) or monitor.json (a key added)."""
    path = os.path.join(run, name)
    if name == "metrics.jsonl":
        with open(path, "a") as fh:
            fh.write('{"step": 3, "loss": %s}\n' % value)
    else:
        with open(path) as fh:
            text = fh.read().rstrip()[:-1]
        with open(path, "w") as fh:
            fh.write(text + ', "extra": %s}' % value)


def _hostile_command(kind, part, folder):
    """(argv, paths that must stay as they were, paths that must stay empty or absent, what to
    name or None) of a case: the input it damages is made and damaged here."""
    new = os.path.join(folder, "new")
    if kind in ("train", "mlp", "textfile"):
        shape = MLP if kind == "mlp" else ["--data", "synthetic", *TINY]
        precious = []
        if kind == "textfile":                      # node_exporter's folder, holding another exporter's file
            precious = [os.path.join(folder, "textfiles")]
            os.makedirs(precious[0])
            with open(os.path.join(precious[0], "node.prom"), "w") as fh:
                fh.write("# HELP node_disk_io_now I/Os in progress.\nnode_disk_io_now{device=\"sda\"} 0\n")
            part = ["--metrics-textfile", os.path.join(precious[0], "node.prom")]
        return ["train", *shape, "--steps", "2", *part, "--out", new], precious, [new], None
    if kind == "prepare":
        data = _copy_of(folder, "data")
        corpus = _corpus(os.path.dirname(folder), "A", 4, 8)
        return list(prepare_args(corpus, data, "--overwrite", *part)), [data, corpus], [], None
    if kind == "init-from":
        model = _copy_of(folder, "llama")
        culprit = part(model)
        return (["train", "--init-from", f"hf:{model}", "--data", "synthetic", "--steps", "1", "--batch-size", "2",
                 "--sample-tokens", "0", "--quiet", "--out", new], [model], [new], culprit)
    run = _copy_of(folder, "gpt")
    if kind in ("report", "top"):
        _spoil(run, *part)
        report = os.path.join(folder, "report.html")
        args = ["report", run, "--out", report] if kind == "report" else ["top", run, "--once"]
        return args, [run], [report], None
    if kind == "screenshot":
        return ["top", run, "--screenshot", "/missing/x.svg"], [run], ["/missing"], None
    if kind == "export":
        return ["export", run, "--out", "/proc/self/x"], [run], [], None
    return ["sample", run, *part], [run], [], None


def _holds_nothing(path):
    """Absent, or a folder holding no file but a run's run.lock (its claim on the folder, taken first)."""
    return not os.path.exists(path) or (os.path.isdir(path) and all(
        name == "run.lock" and d == path for d, _, names in os.walk(path) for name in names))


def _told_plainly(output):
    """No traceback, raw errno line, temp file's name or numpy warning instead of the message."""
    return not any(s in output for s in ("Traceback", "[Errno", ".tmp-", "RuntimeWarning"))


def hostile_values(rng, folder, reference, deadline, trial=None):
    what, kind, part, culprit, ranks = trial or rng.choice(HOSTILE_VALUES)
    if kind == "ctrl-c":
        return _interrupted_sample(what, folder, deadline)
    args, precious, fresh, damaged = _hostile_command(kind, part, folder)
    culprit = culprit or damaged
    if any(os.path.exists(p) for p in fresh):
        return dict(did=f"skipped: {', '.join(fresh)} exists on this machine", skipped=True)
    before = _snapshot(precious)
    rc, output, seconds, ended = run_tool(*args, ranks=ranks, deadline=deadline)
    kept = _snapshot(precious) == before and all(_holds_nothing(p) for p in fresh)
    return dict(did=what, seconds=seconds, ended=ended, named=culprit in output and _told_plainly(output),
                kept=kept, truthful=rc == 2, said=_line_naming(culprit, output))


def _line_naming(culprit, output):
    """The first error line of the output that names the culprit (else any line naming it, else
    its last line), for the record: argparse's usage lines name every flag."""
    lines = [line for line in output.splitlines() if line.strip()]
    naming = [line for line in lines if culprit in line]
    return next((line for line in naming if "error" in line), naming[0] if naming else lines[-1] if lines else "")[:400]


def _interrupted_sample(what, folder, deadline):
    """Ctrl-C as a terminal sends it (SIGINT to the foreground process group) to a sample of up
    to 10^6 tokens once its first 64 bytes of text are out: it must end at once with exit 130,
    the text printed so far kept (and what it printed before, still valid UTF-8), and say so."""
    import select
    run = _copy_of(folder, "gpt")
    before = _snapshot([run])
    proc = subprocess.Popen(ringpipe_cmd("sample", run, "--tokens", "1000000"), cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    streamed, until = b"", time.time() + 120
    while len(streamed) < 64 and time.time() < until and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            streamed += os.read(proc.stdout.fileno(), 4096) or b""
    t0 = time.time()
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:                       # it had ended already: the check below says so
        pass
    try:
        rest, err = proc.communicate(timeout=deadline)
        ended = True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, err = proc.communicate()
        ended = False
    text, said = streamed + rest, err.decode(errors="replace")
    try:
        text.decode()
        whole = True
    except UnicodeDecodeError:
        whole = False
    return dict(did=f"{what} ({len(streamed)} bytes streamed before it, {len(text)} in all)",
                seconds=time.time() - t0, ended=ended, truthful=proc.returncode == 130,
                named="interrupted (Ctrl-C) after" in said and _told_plainly(said),
                said=_line_naming("interrupted (Ctrl-C) after", said),
                kept=len(streamed) >= 64 and whole and _snapshot([run]) == before)


RUNNERS = {"kill": kill, "double-signal": double_signal, "disk-full": disk_full,
           "bad-checkpoint": bad_checkpoint, "concurrent": concurrent, "ps-signal": ps_signal,
           "prepare-kill": prepare_kill, "prepare-interrupt": prepare_interrupt, "prepare-disk-full": prepare_disk_full,
           "prepare-concurrent": prepare_concurrent, "export-overwrite": export_overwrite,
           "hostile-load": hostile_load, "hostile-markers": hostile_markers, "hostile-values": hostile_values,
           **{name: functools.partial(save_fault, trial=case) for name, case in SAVE_FAULTS.items()}}
TRAINING = ("kill", "double-signal", "disk-full", "bad-checkpoint", "concurrent")    # (ps-signal: ps_reference)
# Scenarios whose trials take a list of cases in turn (from a random one on), not at random.
CYCLED = {"ps-signal": PS_SIGNAL_TRIALS, "hostile-values": HOSTILE_VALUES}


# ---- the matrix ---------------------------------------------------------------------------

def reference_params(folder):
    out = os.path.join(folder, "reference")
    rc, output = run_to_end(out)
    if rc != 0:
        raise SystemExit(f"fault_matrix: the uninterrupted reference run failed:\n{output[-3000:]}")
    return params(out)


def failed_checks(trial):
    """The checks a trial did not pass (those that do not apply to its scenario are absent); a
    save fault that missed the save it was meant for (`landed`) fails too."""
    return [k for k in ("landed", *CHECKS) if k in trial and not trial[k]]


def run_matrix(scenarios, repeat, seed, deadline, log=print):
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix="ringpipe-faults-")
    try:
        # The uninterrupted training run the resumed ones must equal (only training scenarios need it).
        reference = reference_params(root) if any(s in TRAINING for s in scenarios) else None
        trials = []
        for name in scenarios:
            first = rng.randrange(len(CYCLED[name])) if name in CYCLED else 0
            for i in range(repeat):
                folder = os.path.join(root, f"{name}-{i}")
                os.makedirs(folder)
                case = dict(trial=CYCLED[name][(first + i) % len(CYCLED[name])]) if name in CYCLED else {}
                result = RUNNERS[name](rng, folder, reference, deadline, **case)
                result["scenario"] = name
                trials.append(result)
                verdict = "skipped" if result.get("skipped") else " ".join(
                    f"{k}={'yes' if result[k] else 'NO'}" for k in ("landed", *CHECKS) if k in result)
                log(f"{name} #{i + 1}: {result['did']}: {verdict}"
                    + (f" ({result['seconds']:.1f} s to end)" if "seconds" in result else ""))
                shutil.rmtree(folder, ignore_errors=True)
        return trials
    finally:
        for sub in os.listdir(root):                 # a trial's tmpfs left mounted by an error
            subprocess.run(["umount", "-l", os.path.join(root, sub, "disk")], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def summarize(trials):
    rows = []
    for name in dict.fromkeys(t["scenario"] for t in trials):
        ts = [t for t in trials if t["scenario"] == name and not t.get("skipped")]
        row = {"scenario": name, "trials": len(ts),
               "skipped": sum(1 for t in trials if t["scenario"] == name and t.get("skipped"))}
        for k in CHECKS:
            row[k] = sum(1 for t in ts if t.get(k)) if any(k in t for t in ts) else None
            row[f"{k}_trials"] = sum(1 for t in ts if k in t)       # those it applies to (ps-signal's exact)
        if any("landed" in t for t in ts):
            row["landed"] = sum(1 for t in ts if t.get("landed"))      # the save faults: met the save
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
    print("\n| scenario | trials | ended in time | cause named | nothing lost | exit code truthful "
          "| resume bit-identical | slowest end (s) |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        slowest = f"{r['max_seconds']:.1f}" if r["max_seconds"] is not None else "-"
        skipped = f" ({r['skipped']} skipped)" if r["skipped"] else ""
        counts = " | ".join("-" if r[k] is None else str(r[k]) if r[f"{k}_trials"] == r["trials"]
                            else f"{r[k]} of {r[f'{k}_trials']}" for k in CHECKS)
        print(f"| {r['scenario']} | {r['trials']}{skipped} | {counts} | {slowest} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"seed": seed, "repeat": args.repeat, "deadline_s": args.deadline, "summary": rows,
                       "trials": trials}, fh, indent=1)
    failed = [t for t in trials if not t.get("skipped") and failed_checks(t)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
