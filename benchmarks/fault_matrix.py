"""Fault matrix: jobs and tools killed, interrupted, signalled twice, starved of
disk, fed damaged or hostile files, or sharing their output folder with a second
run, each repeated with random timing, and what happened.

    python benchmarks/fault_matrix.py --repeat 10 --json faults.json     # ~20 minutes on 2 cores
    python benchmarks/fault_matrix.py --repeat 1 --only kill,disk-full   # what CI runs, in seconds

Training trials are real `mpiexec -n 2 python -m ringpipe.train` jobs of a tiny
float64 GPT (the parameter-server trials: `mpiexec -n 3`, two workers and a dedicated
server, `--sync ps --ps-servers 1`); the tool trials run `ringpipe prepare` (under `mpiexec -n 2` where
it matters), `export`, `sample`, `train --init-from` and `finished` the way a
user would. For each trial the table counts:

    ended     the job ended within --deadline seconds of the fault (no hang)
    named     its output names the cause (the signal, "disk full", the damaged
              checkpoint or file, the other run's pid)
    kept      nothing valid before the fault was lost: every checkpoint, the run,
              the dataset (old or new, never a mix), the files beside them
    truthful  the exit code says what happened (0 only for work done; 2 for a
              refusal; the signal's or the abort's code for a stop)
    exact     (training) `--resume auto` then finishes bit-identical (every
              parameter) to an uninterrupted run of the same seed (ps-signal: in
              the modes that keep sync's math, sync and streamed; ssp and async
              change it, by design, and their stop checkpoint must resume to the
              end, counted in `kept`)

A check that does not apply to a scenario is shown as "-".

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

from ringpipe.engine.job import checkpoint

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
             "export-overwrite", "hostile-load", "hostile-markers")
CHECKS = ("ended", "named", "kept", "truthful", "exact")


# ---- running jobs -------------------------------------------------------------------------

def launch(out, *extra, steps=STEPS, ranks=2):
    return subprocess.Popen([MPIEXEC, "-n", str(ranks), PY, "-m", "ringpipe.train", *MODEL, "--steps", str(steps),
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


def run_to_end(out, *extra, steps=STEPS, deadline=300, ranks=2):
    rc, output, _, _ = finish(launch(out, *extra, steps=steps, ranks=ranks), deadline)
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
        leftovers = [f for f in os.listdir(ckpt) if ".tmp." in f] if os.path.isdir(ckpt) else []
        invalid = checkpoint.scan(ckpt)[1] if os.path.isdir(ckpt) else []
        with open(os.path.join(out, "metrics.jsonl"), "rb") as fh:
            metrics = fh.read()
        whole = metrics.endswith(b"\n") or not metrics
        subprocess.run(["mount", "-o", "remount,size=64m", disk], check=True)
        exact, _ = resume_is_exact(out, reference)
        return dict(did=f"{size // 1024} KiB disk, a checkpoint every step", seconds=seconds,
                    ended=ended, truthful=rc == 1, named="disk full at" in output,
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


def _tiny_run(folder, data):
    """A 2-step GPT run on `data` with a checkpoint per step (a run to export, sample, damage)."""
    run = os.path.join(folder, "run")
    rc, output, _, _ = run_tool("train", "--data", data, "--layers", "1", "--d-model", "16", "--heads", "2",
                                "--context", "16", "--batch-size", "4", "--steps", "2", "--checkpoint-every", "1",
                                "--sample-tokens", "0", "--quiet", "--out", run, deadline=300)
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


def _int_tensor(model_dir):
    """Rewrite model.safetensors with one tensor stored as int64."""
    from safetensors.numpy import load_file, save_file
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].astype(np.int64)
    save_file(tensors, path)


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


RUNNERS = {"kill": kill, "double-signal": double_signal, "disk-full": disk_full,
           "bad-checkpoint": bad_checkpoint, "concurrent": concurrent, "ps-signal": ps_signal,
           "prepare-kill": prepare_kill, "prepare-interrupt": prepare_interrupt, "prepare-disk-full": prepare_disk_full,
           "prepare-concurrent": prepare_concurrent, "export-overwrite": export_overwrite,
           "hostile-load": hostile_load, "hostile-markers": hostile_markers}
TRAINING = ("kill", "double-signal", "disk-full", "bad-checkpoint", "concurrent")    # (ps-signal: ps_reference)
# Scenarios whose trials take a list of cases in turn (from a random one on), not at random.
CYCLED = {"ps-signal": PS_SIGNAL_TRIALS}


# ---- the matrix ---------------------------------------------------------------------------

def reference_params(folder):
    out = os.path.join(folder, "reference")
    rc, output = run_to_end(out)
    if rc != 0:
        raise SystemExit(f"fault_matrix: the uninterrupted reference run failed:\n{output[-3000:]}")
    return params(out)


def failed_checks(trial):
    """The checks a trial did not pass (those that do not apply to its scenario are absent)."""
    return [k for k in CHECKS if k in trial and not trial[k]]


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
                    f"{k}={'yes' if result[k] else 'NO'}" for k in CHECKS if k in result)
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
