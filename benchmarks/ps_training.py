"""The parameter server against the all-reduce in training runs (issue 27): tokens/s and the
communication time per step of `ringpipe train --sync allreduce` and `--sync ps --ps-servers K`
on emulated nodes, next to the alpha-beta model's time for one synchronisation.

    # emulated nodes, one rank per node: n workers on n1..nn, K servers on the nodes after them
    slurm/local/nodes.sh up --nodes 8 --link 1gbit
    python benchmarks/ps_training.py --workers 4 --servers 0,1,2,4 --link 1gbit \\
        --json ps_training.json --plot ps_training.png
    slurm/local/nodes.sh down
    # one machine (a quick check: the "link" is shared memory, the between-node model does not apply)
    python benchmarks/ps_training.py --launcher local --workers 2 --servers 0,1 --steps 5 --skip 1

ps_vs_ring.py times one synchronisation of M bytes alone; this runs the trainer. Each run is
its own job, `MPIEXEC -ppn 1 -n n+K python -m ringpipe.train MODEL --steps S ...`, writing into
a folder of its own under a temp folder this benchmark makes (and removes at the end, unless
--keep-runs, or a run failed), with the monitor on every step (--monitor-every 1), so that each
step's record in OUT/metrics.jsonl holds every worker's time split (engine/monitor/clock.py):

  allreduce    --sync allreduce: gradient buckets all-reduced while backward runs. The trainer
               has no flag for the algorithm: comm.allreduce's "auto" takes the small-message
               path up to the crossover and, above it, the hierarchical all-reduce only where
               several ranks share each node and the cost model says it is faster; with one
               rank per node that is the ring (the run's own line, "all-reduce ring/small",
               is kept in the JSON)
  PS K = 0     --sync ps --ps-servers 0: every worker also serves 1/n of the chunks
  PS K >= 1    --sync ps --ps-servers K: K dedicated server ranks (the last K, on nodes of their
               own), which hold the master weights and the optimizer state, clip and update

The model: a GPT whose parameters are many for its compute (2 layers of width 512: 6.45 M
parameters, 24.6 MiB of float32 gradients) on a global batch of 4 sequences of 32 tokens (one
per worker), so that on 1 Gbit/s links a step is mostly communication. --steps steps, the
first --skip not counted (start-up, first touches).

Per run, over its counted steps: tokens/s (tokens over the sum of the step times), the median
step time (rank 0's), the median of the workers' mean exposed communication (comm_ms: the time
a worker waited for a collective, a push or a pull; what overlaps backward is hidden and not
in it), compute, the busiest worker link's bytes a step (the monitor's net_rx/tx of each
worker's node times the step time; the servers' nodes are not in the monitor's ranks). The runs
go round by round, each round every mode once, round r starting at mode r x modes / rounds, so
the machine's noise hits the modes alike; the table gives, per mode, the median over the rounds
and the range.

The prediction: after the runs, one more job on the first n nodes measures alpha and beta by
ping-pong between workers 0 and 1 (ps_vs_ring.pingpong_level: 8 B and 4-16 MiB, 9 round
trips) and gives ps_vs_ring.predictions() for the runs' gradient bytes: the ring
(CostModel.ring) for allreduce; comm/costmodel.py's ps_time for the PS (push, then pull: the
trainer clips, so no update starts before the global norm, --grad-clip 1.0 by default). The
model times one whole synchronisation without the CPU's work (the servers' sums, the optimizer
on the servers, copies) and without overlap with backward: measured/model below 1 is hidden
communication, above 1 the CPU's work and the links' loss under many flows (ps_vs_ring's
all-to-all control). Beside it, "chunks' model": the same formula with each link's bytes
from comm/ps.py's own chunks (chunk c on server c % K: 7 chunks of <= 4 MiB over 4 servers
put 2 on the busiest, 1.3x its even share), where ps_time spreads the bytes evenly.

The children get OMP_NUM_THREADS=1 (and OpenBLAS, Numba, MKL): one thread per rank, since
the emulated nodes share the machine's cores (8 ranks on 2 cores at K = 4).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, nonneg_int, output_path, positive_int, table, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES_SH = os.path.join(ROOT, "slurm", "local", "nodes.sh")
LOCAL_MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS")
# The GPT: many parameters for its compute (see the module docstring).
MODEL = ["--model", "gpt", "--data", "synthetic", "--layers", "2", "--d-model", "512", "--heads", "8",
         "--context", "32", "--seq-len", "32"]
SEQ_LEN = 32
# Nothing but steps: no validation pass, no sample, no TensorBoard; the one checkpoint comes
# after the last step (--checkpoint-every 0), outside the counted steps' times.
# Not --quiet: the start-up lines (parameters, global batch) are read.
QUIET = ["--eval-every", "1000000", "--checkpoint-every", "0", "--sample-tokens", "0", "--no-tensorboard",
         "--monitor-every", "1"]
COLUMNS = [("mode", "mode", "s"), ("K", "K", "s"), ("tokens_per_s", "tokens/s", ".1f"),
           ("tokens_range", "[range]", "s"), ("comm_ms", "comm ms/step", ".1f"), ("comm_range", "[range]", "s"),
           ("step_ms", "step ms", ".1f"), ("compute_ms", "compute ms", ".1f"),
           ("link_MiB", "worker link MiB/step", ".1f"), ("link_model_MiB", "(model)", ".1f"),
           ("pred_ms", "model comm ms", ".1f"), ("ratio", "comm/model", ".2f"),
           ("pred_chunks_ms", "chunks' model ms", ".1f"), ("ratio_chunks", "comm/chunks'", ".2f"),
           ("vs_ring", "vs ring", ".2f")]


def server_counts(text: str) -> list[int]:
    """argparse type: a comma list of K >= 0 (0: colocated), order kept, no repeats."""
    out = []
    for s in (s.strip() for s in text.split(",")):
        if not s:
            continue
        if not s.isdigit():
            raise argparse.ArgumentTypeError(f"invalid server count {s!r}: give whole numbers >= 0, e.g. 0,1,2,4")
        if int(s) in out:
            raise argparse.ArgumentTypeError(f"server count {s} is listed twice: list each K once")
        out.append(int(s))
    if not out:
        raise argparse.ArgumentTypeError("empty list: give server counts K, e.g. 0,1,2,4 (0: colocated)")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=positive_int, default=4, help="n, the training ranks (default 4)")
    p.add_argument("--servers", type=server_counts, default=None,
                   help="the PS runs' server counts K (0: colocated; default 0,1,n/2,n)")
    p.add_argument("--no-allreduce", dest="allreduce", action="store_false",
                   help="leave out the --sync allreduce runs (the vs ring column needs them)")
    p.add_argument("--steps", type=positive_int, default=12, help="steps a run (default 12)")
    p.add_argument("--skip", type=nonneg_int, default=2, help="first steps of a run not counted (default 2)")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds, each running every mode once (default 3)")
    p.add_argument("--launcher", choices=("nodes", "local"), default="nodes",
                   help="nodes (default): slurm/local/nodes.sh mpiexec -ppn 1, one rank per emulated node "
                        "(bring them up first); local: this venv's mpiexec on this machine")
    p.add_argument("--run-timeout", type=positive_int, default=300,
                   help="seconds one training run may take before it is stopped (default 300)")
    p.add_argument("--link", default="", help="the link rate, for the record (e.g. 1gbit)")
    p.add_argument("--keep-runs", action="store_true", help="keep the runs' folders (default: removed at the end)")
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--plot", type=output_path, default=None,
                   help="a PNG: tokens/s and measured and model communication per mode (matplotlib)")
    p.add_argument("--calibrate", metavar="SPEC", default=None, help=argparse.SUPPRESS)   # the model's child job
    args = p.parse_args(argv)
    if args.calibrate is None:
        if args.skip >= args.steps:
            p.error(f"--skip {args.skip} leaves none of --steps {args.steps} to count: give --steps > --skip")
        if args.workers < 2:
            p.error(f"--workers {args.workers}: the data axis needs at least 2 workers")
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                p.error("--plot needs matplotlib: .venv/bin/pip install matplotlib (or leave out --plot)")
    return args, p


# ---- the model's child job: alpha and beta by ping-pong, the predictions ----------------------

def chunked_ps_time(level, layout) -> tuple[float, int]:
    """costmodel.ps_time (push, then pull) for the chunks as comm/ps.py lays them out: chunk c
    on server c % K, so a server holds ceil(chunks / K) or floor of them (the last one shorter),
    where ps_time spreads the bytes evenly (nM/K on a server's link). Each phase lasts as
    long as its busiest link: a server's, receiving its chunks from every other worker (and
    sending them back in the pull), or a worker's, sending the chunks it does not own.
    Returns (seconds, bytes on the busiest link in one phase: with dedicated servers its bytes
    each way per step; colocated, a node sends in both phases)."""
    def nbytes(chunks):
        return sum(hi - lo for lo, hi in map(layout.bounds, chunks)) * layout.itemsize
    links = []                                       # (messages, bytes) each way on a node's link
    for server in layout.servers:
        owned = list(layout.owned_by(server))
        others = sum(1 for w in layout.workers if w != server)
        links.append((others * len(owned), others * nbytes(owned)))
    for worker in layout.workers:
        sent = [c for c in range(layout.n_chunks) if layout.owner(c) != worker]
        links.append((len(sent), nbytes(sent)))
    phase = max(messages * level.alpha + size * level.beta for messages, size in links)
    return 2 * phase, max(size for _, size in links)


def calibrate(spec: dict) -> int:
    """Under MPI on the n workers' nodes: ps_vs_ring's ping-pong and predictions, written to
    spec["result"] by rank 0. Imported here, not at the top: ps_vs_ring initializes MPI."""
    import ps_vs_ring
    from mpi4py import MPI
    from ringpipe.comm import costmodel
    from ringpipe.comm.context import context_for
    from ringpipe.comm.ps import ps_layout

    world = MPI.COMM_WORLD
    n = world.Get_size()
    nodes = context_for(world).nodes
    level = ps_vs_ring.pingpong_level(world, ps_vs_ring.PINGPONG_REPEATS)
    if world.Get_rank() != 0:
        return 0
    # One rank per node (or all on one): one level, as ps_vs_ring builds it.
    model = costmodel.CostModel(level, level, nodes.n_nodes, nodes.sizes[0])
    out = dict(level=level._asdict(), cost_model=model.to_dict(), nodes=nodes.n_nodes, modes={})
    elements = spec["bytes"] // 4
    for key, k in spec["modes"]:
        mode = (ps_vs_ring.Mode("ring", None, list(range(n))) if k is None else
                ps_vs_ring.Mode("PS colocated" if k == 0 else "PS dedicated", k, list(range(n + k))))
        pred = ps_vs_ring.predictions(mode, model, level, spec["bytes"], n, spec["chunk_bytes"])
        out["modes"][key] = {name: value for name, value in pred.items() if value is not None}
        # A worker's own link, each way: the ring's and the colocated PS's 2(n-1)/n M; with
        # dedicated servers the push and the pull of its M (the servers' links carry nM/K).
        out["modes"][key]["worker_link_bytes"] = (costmodel.ring_link_bytes(spec["bytes"], n) if not k
                                                  else spec["bytes"])
        if k is not None:
            servers = range(n, n + k) if k else range(n)
            layout = ps_layout(elements, 4, range(n), servers, spec["chunk_bytes"])
            out["modes"][key]["pred_chunks_s"], out["modes"][key]["link_chunks_bytes"] = chunked_ps_time(level, layout)
    write_json(spec["result"], out)       # whole or not at all
    return 0


# ---- the driver: no MPI of its own, one job per run --------------------------------------------

def child_env() -> dict:
    env = dict(os.environ)
    for var in THREAD_VARS:
        env[var] = "1"
    if os.path.exists(LOCAL_MPIEXEC):
        env.setdefault("MPIEXEC", LOCAL_MPIEXEC)      # nodes.sh's, when the venv is not activated
    return env


def launcher(kind: str) -> list[str]:
    if kind == "local":
        return [LOCAL_MPIEXEC]
    return [NODES_SH, "mpiexec", "-ppn", "1"]


def nodes_up() -> list[str]:
    """The emulated nodes nodes.sh has up (its status line: 'nodes: n1 n2 ...; link ...')."""
    r = subprocess.run([NODES_SH, "status"], capture_output=True, text=True, env=child_env())
    line = r.stdout.strip()
    if r.returncode != 0 or not line.startswith("nodes:"):
        return []
    return line[len("nodes:"):].split(";")[0].split()


def run_job(cmd: list[str], timeout: int) -> tuple[int, str, float]:
    """(exit code, stdout+stderr, seconds) of one job; stopped (its whole process group) after timeout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        out, _ = proc.communicate()
        return 124, (out or "") + f"\n(stopped after {timeout} s: --run-timeout)", time.perf_counter() - t0
    return proc.returncode, out, time.perf_counter() - t0


class Mode:
    """One way of training: its name, K (None: all-reduce), its flags, and per round its run's numbers."""

    def __init__(self, k: int | None, n: int):
        self.k = k
        self.key = "allreduce" if k is None else f"ps{k}"
        self.name = "allreduce" if k is None else ("PS colocated" if k == 0 else "PS dedicated")
        self.flags = ["--sync", "allreduce"] if k is None else ["--sync", "ps", "--ps-servers", str(k)]
        self.ranks = n + (k or 0)
        self.runs: list[dict] = []


def read_run(out_dir: str, skip: int, workers: int) -> dict:
    """One run's numbers over its counted steps, from OUT/metrics.jsonl (module docstring)."""
    records = []
    with open(os.path.join(out_dir, "metrics.jsonl")) as fh:
        for line in fh:
            record = json.loads(line)
            if "step" in record and record["step"] > skip:
                records.append(record)
    if not records or any(len(r.get("ranks") or []) != workers for r in records):
        raise ValueError(f"{out_dir}/metrics.jsonl: expected every counted step with the {workers} workers' "
                         "time split (--monitor-every 1); the run's records are incomplete")
    tokens = sum(r["tokens_per_s"] * r["step_ms"] / 1e3 for r in records)
    seconds = sum(r["step_ms"] for r in records) / 1e3

    def mean_of_workers(name):
        return [sum(w[name] for w in r["ranks"]) / workers for r in records]

    link = [max(max(w["net_rx_bytes_per_s"], w["net_tx_bytes_per_s"]) for w in r["ranks"]) * r["step_ms"] / 1e3
            for r in records]
    hidden = [r["comm_hidden_frac"] for r in records if r.get("comm_hidden_frac") is not None]
    return dict(steps=len(records), tokens_per_s=tokens / seconds, step_ms=median(r["step_ms"] for r in records),
                comm_ms=median(mean_of_workers("comm_ms")), compute_ms=median(mean_of_workers("compute_ms")),
                link_MiB=median(link) / 2**20, comm_hidden_frac=median(hidden) if hidden else None,
                step_ms_all=[r["step_ms"] for r in records], comm_ms_all=mean_of_workers("comm_ms"))


def trainer_facts(output: str) -> dict:
    """What the run says of itself: its parameter count and its data axis's line."""
    params = re.search(r"\| ([\d,]+) parameters on rank 0", output)
    axis = next((line.strip() for line in output.splitlines() if "global batch" in line), "")
    return dict(parameters=int(params.group(1).replace(",", "")) if params else None, data_axis=axis)


def summarize(mode: Mode) -> dict:
    def stat(name):
        values = [r[name] for r in mode.runs if r.get(name) is not None]
        return (median(values), min(values), max(values)) if values else (None, None, None)
    tps, comm, step, compute, link = (stat(n) for n in ("tokens_per_s", "comm_ms", "step_ms", "compute_ms", "link_MiB"))
    hidden = stat("comm_hidden_frac")
    return dict(mode=mode.name, K="-" if mode.k is None else str(mode.k), key=mode.key, ranks=mode.ranks,
                tokens_per_s=tps[0], tokens_min=tps[1], tokens_max=tps[2],
                tokens_range=f"[{tps[1]:.0f}-{tps[2]:.0f}]",
                comm_ms=comm[0], comm_min_ms=comm[1], comm_max_ms=comm[2], comm_range=f"[{comm[1]:.0f}-{comm[2]:.0f}]",
                step_ms=step[0], step_min_ms=step[1], step_max_ms=step[2], compute_ms=compute[0], link_MiB=link[0],
                comm_hidden_frac=hidden[0], runs=mode.runs)


def plot(path: str, rows: list[dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    labels = [r["mode"].replace(" ", "\n") + ("" if r["K"] == "-" else f"\nK={r['K']}") for r in rows]
    x = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(9, 1.6 * len(rows)), 4.4))
    tps = np.array([r["tokens_per_s"] for r in rows])
    left.bar(x, tps, 0.6, yerr=[tps - [r["tokens_min"] for r in rows], [r["tokens_max"] for r in rows] - tps],
             capsize=3)
    left.set_xticks(x, labels, fontsize=8)
    left.set_ylabel("tokens/s (median over rounds, range)")
    comm = np.array([r["comm_ms"] for r in rows])
    right.bar(x - 0.2, comm, 0.4, label="measured: exposed comm per step (median, range)",
              yerr=[comm - [r["comm_min_ms"] for r in rows], [r["comm_max_ms"] for r in rows] - comm], capsize=3)
    right.bar(x + 0.2, [r["pred_ms"] or 0 for r in rows], 0.4, label="alpha-beta model: one synchronisation")
    right.set_xticks(x, labels, fontsize=8)
    right.set_ylabel("ms per step")
    right.set_ylim(0, 1.3 * max(max(comm), max(r["pred_ms"] or 0 for r in rows)))   # room for the legend
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def fail(message: str) -> int:
    print(f"ps_training.py: error: {message}", file=sys.stderr)
    return 2


def main() -> int:
    args, parser = parse_args()
    if args.calibrate is not None:
        return calibrate(json.loads(args.calibrate))
    n = args.workers
    ks = args.servers if args.servers is not None else [0] + list(dict.fromkeys([1, max(1, n // 2), n]))
    modes = ([Mode(None, n)] if args.allreduce else []) + [Mode(k, n) for k in ks]
    needed = max(m.ranks for m in modes)
    if args.launcher == "nodes":
        if os.geteuid() != 0:
            return fail("the emulated nodes need root (network namespaces): run as root, or --launcher local")
        up = nodes_up()
        if len(up) < needed:
            return fail(f"{len(up)} emulated node(s) up ({' '.join(up) or 'none'}), the runs need {needed} "
                        f"(n = {n} workers + K = {max(ks)} servers, one rank a node): slurm/local/nodes.sh up "
                        f"--nodes {needed} --link 1gbit")
    elif not os.path.exists(LOCAL_MPIEXEC):
        return fail(f"no mpiexec next to {sys.executable}: install the project's MPI extra (pip install -e '.[mpi]')")

    work = tempfile.mkdtemp(prefix="ps_training-")
    load_start = os.getloadavg()
    print(f"# ps_training: n = {n} workers, {' '.join(m.key for m in modes)}; {args.rounds} rounds of {args.steps} "
          f"steps (first {args.skip} not counted); launcher {args.launcher}"
          + (f", link {args.link}" if args.link else "") + f"; runs in {work}", flush=True)
    print(f"# model: {' '.join(MODEL[1:])} (flags), global batch {n} x {SEQ_LEN} tokens; "
          f"load average {load_start[0]:.2f} at the start", flush=True)

    facts = None
    for r in range(args.rounds):
        shift = r * len(modes) // args.rounds
        for m in modes[shift:] + modes[:shift]:
            out_dir = os.path.join(work, f"round{r + 1}-{m.key}")
            cmd = (launcher(args.launcher) + ["-n", str(m.ranks), sys.executable, "-m", "ringpipe.train"] + MODEL
                   + ["--batch-size", str(n), "--steps", str(args.steps)] + QUIET + m.flags + ["--out", out_dir])
            load_before = os.getloadavg()[0]
            code, output, wall = run_job(cmd, args.run_timeout)
            if code != 0:
                tail = "\n".join(output.splitlines()[-25:])
                return fail(f"round {r + 1}, {m.key}: the training run exited {code}:\n  $ {' '.join(cmd)}\n{tail}\n"
                            f"its folder is kept: {out_dir} (and the other runs' in {work})")
            try:
                numbers = read_run(out_dir, args.skip, n)
            except (OSError, ValueError) as e:
                return fail(f"round {r + 1}, {m.key}: {e}; the runs are kept in {work}")
            here = trainer_facts(output)
            facts = facts or here
            if here["parameters"] != facts["parameters"]:
                return fail(f"{m.key} trained {here['parameters']} parameters, the first run "
                            f"{facts['parameters']}: the modes must train the same model")
            if args.launcher == "local":
                numbers["link_MiB"] = None         # one host: the ranks talk through shared memory, not eth0
            numbers.update(round=r + 1, wall_s=wall, load_before=load_before, load_after=os.getloadavg()[0],
                           data_axis=here["data_axis"])
            m.runs.append(numbers)
            print(f"#   round {r + 1} {m.key:>9}: {numbers['tokens_per_s']:7.1f} tokens/s, comm "
                  f"{numbers['comm_ms']:7.1f} ms/step, step {numbers['step_ms']:7.1f} ms ({wall:.0f} s, load "
                  f"{load_before:.1f})", flush=True)

    # The model, in the same session: a ping-pong job on the workers' nodes.
    nbytes = facts["parameters"] * 4
    result = os.path.join(work, "model.json")
    spec = dict(result=result, bytes=nbytes, chunk_bytes=4 << 20, modes=[(m.key, m.k) for m in modes])
    code, output, _ = run_job(launcher(args.launcher) + ["-n", str(n), sys.executable, os.path.abspath(__file__),
                                                         "--calibrate", json.dumps(spec)], args.run_timeout)
    if code != 0:
        return fail(f"the ping-pong job for the model exited {code}:\n{output[-3000:]}\nthe runs are kept in {work}")
    with open(result) as fh:
        model = json.load(fh)

    rows = [summarize(m) for m in modes]
    ring = next((row for row in rows if row["key"] == "allreduce"), None)
    for row in rows:
        pred = model["modes"][row["key"]]
        row.update(pred_ms=pred["pred_s"] * 1e3, pred_overlap_ms=pred["pred_overlap_s"] * 1e3,
                   link_pred_MiB=pred["link_pred_bytes"] / 2**20, link_model_MiB=pred["worker_link_bytes"] / 2**20)
        row["ratio"] = row["comm_ms"] / row["pred_ms"]
        if "pred_chunks_s" in pred:
            row.update(pred_chunks_ms=pred["pred_chunks_s"] * 1e3, link_chunks_MiB=pred["link_chunks_bytes"] / 2**20,
                       ratio_chunks=row["comm_ms"] / (pred["pred_chunks_s"] * 1e3))
        row["vs_ring"] = None if ring is None else row["tokens_per_s"] / ring["tokens_per_s"]
    level = model["level"]
    load_end = os.getloadavg()
    print(f"# gradient: {facts['parameters']:,} parameters = {nbytes / 2**20:.1f} MiB float32; alpha-beta model: "
          f"alpha {level['alpha'] * 1e6:.1f} us, beta {level['beta'] * 1e9:.3f} ns/B "
          f"({1e-9 / level['beta']:.2f} GB/s), ping-pong between workers 0 and 1, {model['nodes']} node(s)")
    if ring is not None:
        print(f"# allreduce's data axis, as the run says: {ring['runs'][0]['data_axis']}")
    print(table(rows, COLUMNS))
    print("# tokens/s: the counted steps' tokens over their time; comm: a worker's exposed communication a step "
          "(the workers' mean, median over the steps), median over the rounds [range of the rounds]")
    print("# worker link MiB/step: the busiest worker node's eth0 a step, max of rx and tx (the monitor's rate x the "
          "step time); model: a worker's bytes each way. The busiest link of all, the model's: "
          + "  ".join(f"{r['key']} {r['link_pred_MiB']:.1f}" for r in rows) + " (a server's; not measured); "
          "with comm/ps.py's chunks (c on server c % K): " + "  ".join(f"{r['key']} {r['link_chunks_MiB']:.1f}"
                                                                      for r in rows if r["K"] not in ("-", "0")))
    print(f"# chunks' model: the same, each link's bytes from comm/ps.py's chunks ({-(-nbytes // (4 << 20))} of "
          "<= 4 MiB, chunk c on server c % K) instead of ps_time's even nM/K")
    print("# model comm: one synchronisation of the gradient (ring; PS push then pull), no overlap with backward, "
          "no CPU work; vs ring: tokens/s over the allreduce runs'")
    print(f"# load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    out = dict(benchmark="ps_training", workers=n, servers=ks, steps=args.steps, skip=args.skip, rounds=args.rounds,
               launcher=args.launcher, link=args.link, model_flags=MODEL, batch=[n, SEQ_LEN],
               parameters=facts["parameters"], bytes=nbytes, host=socket.gethostname(),
               load_start=load_start[0], load_end=load_end[0], level=level, cost_model=model["cost_model"],
               argv=sys.argv[1:], rows=rows)
    if args.json:
        write_json(args.json, out)      # whole or not at all
        print(f"# wrote {args.json}")
    if args.plot:
        where = f"emulated nodes, link {args.link or '?'}" if args.launcher == "nodes" else "one host (shared memory)"
        plot(args.plot, rows, f"ringpipe train, {n} workers, GPT {facts['parameters'] / 1e6:.2f} M parameters, {where}")
        print(f"# wrote {args.plot}")
    if args.keep_runs:
        print(f"# runs kept in {work}")
    else:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
