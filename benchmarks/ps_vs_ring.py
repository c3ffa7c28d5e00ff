"""The parameter server against the ring: the communication time of one training
step's gradient synchronisation of M bytes (issue 27), next to the alpha-beta model.

    # emulated nodes, one rank per node: n workers on n1..nn, the servers on the nodes after them
    slurm/local/nodes.sh up --nodes 8 --link 1gbit
    slurm/local/nodes.sh mpiexec -ppn 1 -n 8 python benchmarks/ps_vs_ring.py --workers 4 \\
        --bytes 16M --link 1gbit --json ps.json --plot ps.png
    # one machine (a quick check: the "link" is shared memory, the between-node model does not apply)
    mpiexec -n 3 python benchmarks/ps_vs_ring.py --workers 2 --servers 1,0 --bytes 1M

Modes, each on the same n workers (ranks 0..n-1 of the world) and float32 buffer of M bytes:

  ring           comm.allreduce(algorithm="ring") among the workers
  hierarchical   comm.allreduce(algorithm="hierarchical") among the workers
  PS, K >= 1     comm/ps.py with K dedicated servers (world ranks n..n+K-1, on nodes of their
                 own when launched one rank per node): every worker pushes its whole gradient,
                 the servers reduce (sum, the global norm) and send the parameters back
                 (an identity update: no optimizer), the workers pull
  PS, K = 0      the colocated sharded PS: every worker also serves 1/n of the chunks
  PS streamed    (--streamed, for each K above) the overlapped step of runs without clipping:
                 the workers post the pull before pushing (push_and_pull), the servers
                 serve_streamed: each chunk summed and sent back once all its pushes are in

Method: one round runs every mode once, in an order rotated each round, so the
machine's noise hits them alike (--warmup rounds first, not counted). Before each
mode the whole world meets in a barrier that sleeps while it waits (ranks idle in
a mode must not take the 2 cores from those that run it), then its ranks meet in
an ordinary barrier, and each times its own part; a repeat's time is the slowest
worker's. Each rank reads its node's eth0 counters (rx, tx) around each mode, so
with one rank per emulated node the bytes each link moved are measured too (frames,
with their TCP/IP headers: a few % above the payload).

  all-to-all x2  the colocated PS's flows without comm/ps.py: twice, every worker sends M/n
                 to each other worker and receives as much, all at once (plain Isend/Irecv):
                 a control for what the many-to-many pattern itself costs on the links

The prediction: comm/costmodel.py's formulas, alpha and beta from a ping-pong between
the first two workers (costmodel's fit(): alpha from 8 B, beta from the slope between
4 and 16 MiB, 9 round trips a size; its start-up calibration takes 1-4 MiB and 3, which
the loaded machine's jitter moves by 10%), on the
level between nodes when the workers are on different nodes. ring and hierarchical:
CostModel.ring / .hierarchical; PS: ps_time (push, then pull: comm/ps.py agrees on
the global norm before any update, so the two cannot overlap) and, in the JSON, the
same with overlap=True (push and pull at once on the full-duplex link: the issue's
"PS with K = n ahead of the ring"), which the streamed modes are predicted with: only
without clipping, when no update waits for the global norm.
Bytes on the busiest link, each way: ring_link_bytes, hierarchical_link_bytes,
ps_link_bytes (max(M, nM/K); the colocated PS 2(n-1)/n M).
The model leaves out the CPU's work (the servers' sums and norms, copies), which on
a 2-core machine running 2n ranks is not nothing: measured/predicted says how much.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
# ringpipe.comm first: it settles what the launch needs before MPI_Init (comm/launcher.py),
# and the import of mpi4py.MPI below initializes MPI.
from ringpipe import comm as rcomm  # noqa: E402
from ringpipe.comm import costmodel  # noqa: E402
from ringpipe.comm.context import context_for  # noqa: E402
from mpi4py import MPI  # noqa: E402

from _common import (fmt_size, median, nonneg_int, output_path, positive_int, positive_size,  # noqa: E402
                     table, write_json)

ALGORITHMS = ("ring", "hierarchical", "all-to-all x2")
STAT_FILES = ("/sys/class/net/eth0/statistics/rx_bytes", "/sys/class/net/eth0/statistics/tx_bytes")
PINGPONG_REPEATS = 9
PINGPONG_SIZES = (8, 4 << 20, 16 << 20)   # beta from the 4-16 MiB slope: 105 ms apart at 1 Gbit/s, not 27
COLUMNS = [("mode", "mode", "s"), ("K", "K", "s"), ("link_pred_MiB", "busiest link MiB (pred)", ".1f"),
           ("link_meas_MiB", "(meas)", ".1f"), ("time_ms", "time ms (median)", ".1f"),
           ("range_ms", "[range]", "s"), ("pred_ms", "predicted ms", ".1f"),
           ("ratio", "meas/pred", ".2f"), ("vs_ring", "vs ring", ".2f")]


def server_counts(text: str) -> list[int]:
    """argparse type: a comma list of K >= 0 (0: the colocated PS), order kept, no repeats."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty list: give server counts K, e.g. 1,2,4,0 (0: colocated)")
    out = []
    for s in items:
        try:
            k = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid server count {s!r}: give whole numbers >= 0, "
                                             "e.g. 1,2,4,0") from None
        if k < 0:
            raise argparse.ArgumentTypeError(f"server count {k} < 0: K >= 1 dedicated servers, 0 colocated")
        if k in out:
            raise argparse.ArgumentTypeError(f"server count {k} is listed twice: list each K once")
        out.append(k)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=positive_size, default=16 << 20,
                   help="M, the gradient's size (float32; default 16M, a GPT-sized buffer)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="n, the workers: world ranks 0..n-1 (default: half the ranks, at least 2)")
    p.add_argument("--servers", type=server_counts, default=None,
                   help="the PS modes' server counts K (0: colocated; default 1,n/2,n,0, those the ranks "
                        "beyond the workers can hold)")
    p.add_argument("--no-allreduce", dest="allreduce", action="store_false",
                   help="leave out the ring, the hierarchical all-reduce and the all-to-all control (the speed-up column needs the ring)")
    p.add_argument("--streamed", action="store_true",
                   help="also run each PS mode streamed (serve_streamed: push and pull overlapped, the "
                        "step of runs without gradient clipping)")
    p.add_argument("--chunk-bytes", type=positive_size, default=costmodel.PS_CHUNK_BYTES,
                   help="the PS's chunk size (default 4M, comm/ps.py's)")
    p.add_argument("--push-order", choices=("whole", "rotated"), default="whole",
                   help="whole: one push of the whole gradient (chunks leave in index order, every worker's "
                        "first to the same server); rotated: chunk by chunk, worker i starting at chunk i")
    p.add_argument("--repeats", type=positive_int, default=7, help="timed rounds through every mode (default 7)")
    p.add_argument("--warmup", type=nonneg_int, default=1, help="rounds first, not counted (default 1)")
    p.add_argument("--link", default="", help="the link rate, for the record (e.g. 1gbit)")
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--plot", type=output_path, default=None,
                   help="a PNG: measured and predicted time per mode (matplotlib)")
    args = p.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: .venv/bin/pip install matplotlib (or leave out --plot)")
    return args, p


def gentle_barrier(comm) -> None:
    """A barrier that sleeps while it waits: the idle ranks of a mode leave the cores to its ranks."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def pingpong_level(comm, repeats: int) -> costmodel.Level:
    """alpha and beta from ping-pongs between ranks 0 and 1 of comm (every rank calls it):
    comm/costmodel.py's sizes and fit(), with more repeats than its start-up calibration
    takes (its 3 let one slow round trip of the loaded machine into the 8-byte alpha)."""
    rank = comm.Get_rank()
    times = []
    for size in PINGPONG_SIZES if rank < 2 else ():
        buf = np.zeros(max(size // 8, 1), dtype=np.float64)
        samples = []
        for _ in range(repeats + 1):                 # the first one warms the connection up
            t0 = time.perf_counter()
            if rank == 0:
                comm.Send(buf, dest=1, tag=7)
                comm.Recv(buf, source=1, tag=7)
            else:
                comm.Recv(buf, source=0, tag=7)
                comm.Send(buf, dest=0, tag=7)
            samples.append((time.perf_counter() - t0) / 2)
        times.append(median(samples[1:]))
    gentle_barrier(comm)                             # the others sleep meanwhile: the 2 cores go to the two
    level = costmodel.fit(PINGPONG_SIZES, times) if rank == 0 else None
    return comm.bcast(level, root=0)


def link_counters(enabled: bool) -> np.ndarray:
    """This rank's node's eth0 (rx, tx) byte counters; zeros when not measured."""
    if not enabled:
        return np.zeros(2, dtype=np.int64)
    values = []
    for path in STAT_FILES:
        with open(path) as fh:
            values.append(int(fh.read()))
    return np.array(values, dtype=np.int64)


class Mode:
    """One way of synchronising: its name, K, the world ranks taking part, and per repeat its run."""

    def __init__(self, name: str, k: int | None, members: list[int], streamed: bool = False):
        self.name, self.k, self.members, self.streamed = name, k, members, streamed
        self.key = (("alltoall" if name == "all-to-all x2" else name) if k is None
                    else f"ps{k}" + ("s" if streamed else ""))
        self.comm = MPI.COMM_NULL
        self.ps = None
        self.times: list[float] = []               # this rank's, per repeat (NaN: not a worker here)
        self.bytes = np.zeros(2, dtype=np.int64)    # this rank's node's (rx, tx) over the counted repeats
        self.wrong = 0


def build_modes(world, n: int, ks: list[int], allreduce: bool, streamed: bool = False) -> list[Mode]:
    workers = list(range(n))
    modes = [Mode(a, None, workers) for a in ALGORITHMS] if allreduce else []
    for k in ks:
        modes.append(Mode("PS colocated" if k == 0 else "PS dedicated", k, workers + list(range(n, n + k))))
    for k in ks if streamed else ():
        modes.append(Mode("PS coloc. streamed" if k == 0 else "PS streamed", k, workers + list(range(n, n + k)),
                          streamed=True))
    rank = world.Get_rank()
    for m in modes:                                  # collective over the world, in the same order everywhere
        m.comm = world.Split(0 if rank in m.members else MPI.UNDEFINED, rank)
    return modes


def run_once(mode: Mode, n: int, grad: np.ndarray, pristine: np.ndarray, params: np.ndarray, check: bool,
             push_order: str = "whole") -> float:
    """One synchronisation on this rank (a member of mode); its seconds, NaN on a dedicated server."""
    sub = mode.comm
    me = sub.Get_rank()
    if mode.name == "all-to-all x2":
        sub.Barrier()
        t0 = time.perf_counter()
        alltoall_twice(sub, pristine, grad)
        return time.perf_counter() - t0
    if mode.k is None:
        np.copyto(grad, pristine)
        sub.Barrier()
        t0 = time.perf_counter()
        rcomm.allreduce(grad, sub, op="avg", algorithm=mode.name)
        dt = time.perf_counter() - t0
        result = grad
    else:
        ps = mode.ps
        is_worker = me < n
        sub.Barrier()
        t0 = time.perf_counter()
        if is_worker:
            ps.start_pull(params)                    # receives posted first: no unexpected-message copies
            if push_order == "whole":
                ps.push(pristine, 0, pristine.size)  # the whole gradient at once: one bucket
            else:
                chunks = ps.layout.n_chunks
                for i in range(chunks):
                    ps.push(pristine, *ps.layout.bounds((me + i) % chunks))
        if ps.is_server:
            identity = lambda chunk, summed, scale: summed   # noqa: E731  (communication only)
            if mode.streamed:
                ps.serve_streamed(identity)
            else:
                ps.serve_step(identity)
        if is_worker:
            ps.wait_pull()
        dt = time.perf_counter() - t0
        if not is_worker:
            return float("nan")
        result = params
    if check:
        # every worker's pristine is (i % 7) + rank: the average is (i % 7) + (n - 1) / 2
        expect = (np.arange(result.size) % 7).astype(np.float32) + np.float32((n - 1) / 2)
        mode.wrong += int(np.count_nonzero(~np.isclose(result, expect, rtol=1e-6, atol=1e-6)))
    return dt


def alltoall_twice(comm, send: np.ndarray, recv: np.ndarray) -> None:
    """The colocated PS's traffic without comm/ps.py: twice (push, pull), every rank sends
    block j of `send` to rank j and receives every other rank's block into `recv`, all at once."""
    p, me = comm.Get_size(), comm.Get_rank()
    bounds = [(j * send.size // p, (j + 1) * send.size // p) for j in range(p)]
    for _ in range(2):
        reqs = []
        for i in range(1, p):
            src, dst = (me - i) % p, (me + i) % p
            reqs.append(comm.Irecv(recv[slice(*bounds[src])], src, 11))
            reqs.append(comm.Isend(send[slice(*bounds[dst])], dst, 11))
        MPI.Request.Waitall(reqs)


def predictions(mode: Mode, model: costmodel.CostModel, level: costmodel.Level, nbytes: int, n: int,
                chunk_bytes: int) -> dict:
    if mode.name == "all-to-all x2":
        return dict(pred_s=costmodel.ps_time(level, nbytes, n, 0, -(-nbytes // n)),
                    pred_overlap_s=costmodel.ps_time(level, nbytes, n, 0, -(-nbytes // n)),
                    link_pred_bytes=costmodel.ps_link_bytes(nbytes, n, 0))
    if mode.k is None:
        time_s = getattr(model, mode.name)(nbytes)
        link = (costmodel.ring_link_bytes(nbytes, n) if mode.name == "ring" or model.nodes < 2
                else costmodel.hierarchical_link_bytes(nbytes, model.nodes))
        return dict(pred_s=time_s, pred_overlap_s=time_s, link_pred_bytes=link)
    overlapped = costmodel.ps_time(level, nbytes, n, mode.k, chunk_bytes, overlap=True)
    if mode.streamed:
        # ps_time(overlap=True) counts push and pull fully at once; a server can only send a
        # chunk back once it has all of it, so its last chunk's return is not overlapped:
        # with j chunks per server, (1 + 1/j) times that (j = 1: no overlap at all).
        per_server = -(-max(1, -(-nbytes // chunk_bytes)) // mode.k) if mode.k else None
        return dict(pred_s=overlapped, pred_overlap_s=overlapped,
                    pred_fill_s=overlapped * (1 + 1 / per_server) if per_server else None,
                    link_pred_bytes=costmodel.ps_link_bytes(nbytes, n, mode.k))
    return dict(pred_s=costmodel.ps_time(level, nbytes, n, mode.k, chunk_bytes),
                pred_overlap_s=costmodel.ps_time(level, nbytes, n, mode.k, chunk_bytes, overlap=True),
                link_pred_bytes=costmodel.ps_link_bytes(nbytes, n, mode.k))


def plot(path: str, rows: list[dict], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # one word a line: eleven modes side by side do not fit their names on one line
    labels = [r["mode"].replace(" ", "\n") + ("" if r["K"] == "-" else f"\nK={r['K']}") for r in rows]
    x = np.arange(len(rows))
    meas = np.array([r["time_ms"] for r in rows])
    lo = meas - np.array([r["min_ms"] for r in rows])
    hi = np.array([r["max_ms"] for r in rows]) - meas
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(rows)), 4.6))
    ax.bar(x - 0.2, meas, 0.4, yerr=[lo, hi], capsize=3, label="measured (median, range)")
    ax.bar(x + 0.2, [r["pred_ms"] for r in rows], 0.4, label="alpha-beta model")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("one gradient synchronisation (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def main() -> int:
    args, parser = parse_args()
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    n = args.workers or (size // 2 if size >= 4 else size)
    if size < 2 or n < 2 or n > size:
        if rank == 0:
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: {size} rank(s) and --workers {args.workers or n}: need 2 <= n <= ranks; "
                  "launch with mpiexec -n P (P >= 2), e.g. slurm/local/nodes.sh mpiexec -ppn 1 -n 8 python "
                  f"{parser.prog} --workers 4", file=sys.stderr)
        return 2
    spare = size - n
    ks = args.servers if args.servers is not None else [k for k in dict.fromkeys([1, n // 2, n]) if 1 <= k <= spare] + [0]
    too_many = [k for k in ks if k > spare]
    if too_many:
        if rank == 0:
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: --servers {','.join(map(str, ks))}: K = {too_many[0]} dedicated servers "
                  f"need {n + too_many[0]} ranks, {size} launched with --workers {n}: launch more ranks or list "
                  "smaller K", file=sys.stderr)
        return 2

    hosts = world.allgather(MPI.Get_processor_name())
    emulated = len(set(hosts)) > 1
    counters = emulated and all(os.path.exists(p) for p in STAT_FILES)
    counters = world.allreduce(int(counters), op=MPI.MIN) == 1
    modes = build_modes(world, n, ks, args.allreduce, args.streamed)

    nbytes = args.bytes - args.bytes % 4
    elems = max(1, nbytes // 4)
    nbytes = elems * 4
    pristine = ((np.arange(elems) % 7) + rank).astype(np.float32)
    grad, params = np.empty_like(pristine), np.empty_like(pristine)

    # The model: costmodel's own ping-pong among the workers (between nodes when they are on several).
    wcomm = world.Split(0 if rank < n else MPI.UNDEFINED, rank)
    model = level = None
    if rank < n:
        nodes = context_for(wcomm).nodes
        cal = wcomm.Dup()
        if nodes.n_nodes in (1, n):
            # One level: the ping-pong between workers 0 and 1 (across the link when on two nodes).
            level = pingpong_level(cal, PINGPONG_REPEATS)
            model = costmodel.CostModel(level, level, nodes.n_nodes, nodes.sizes[0])
        else:
            model = costmodel.calibrate(cal, nodes)      # several ranks per node: both levels
            level = model.inter
        cal.Free()
        wcomm.Free()
    gentle_barrier(world)                            # the servers sleep through the ping-pong
    model, level = world.bcast((model, level), root=0)
    for m in modes:
        if m.k is not None and m.comm != MPI.COMM_NULL:
            workers, servers = rcomm.ps_ranks(m.comm.Get_size(), m.k)
            m.ps = rcomm.ParameterServerGroup(m.comm, workers, servers, elems, np.float32,
                                              chunk_bytes=args.chunk_bytes, op="avg")

    if rank == 0:
        where = (f"{len(set(hosts))} hosts ({', '.join(dict.fromkeys(hosts))})" if emulated else
                 f"one host ({hosts[0]}): the 'link' is shared memory, so the model's between-node numbers and "
                 "the link bytes do not apply (a quick check of the modes only)")
        print(f"# ps_vs_ring: {size} ranks on {where}; n = {n} workers (ranks 0..{n - 1}), M = {fmt_size(nbytes)} "
              f"float32, chunks of {fmt_size(args.chunk_bytes)}, PS K = {','.join(map(str, ks))}"
              + (f", link {args.link}" if args.link else ""))
        between = "the link between nodes" if model.nodes > 1 else "inside one node"
        print(f"# alpha-beta model: {level.describe()}, {between} (ping-pong between workers 0 and 1"
              + ("" if model.intra == model.inter else f"; {model.describe()}") + ")")
        print(f"# {args.repeats} rounds (+{args.warmup} warm-up), modes interleaved; MPI: "
              f"{MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip()}", flush=True)

    rounds = args.warmup + args.repeats
    for r in range(rounds):
        counted = r >= args.warmup
        shift = r % len(modes)
        for m in modes[shift:] + modes[:shift]:
            gentle_barrier(world)
            before = link_counters(counters)
            dt = float("nan")
            if rank in m.members:
                dt = run_once(m, n, grad, pristine, params, check=(r == rounds - 1), push_order=args.push_order)
            gentle_barrier(world)
            if counted:
                m.times.append(dt if rank < n else float("nan"))
                m.bytes += link_counters(counters) - before

    rows = []
    ring_median = None
    for m in modes:
        times = np.array(m.times, dtype=np.float64)
        slowest = np.empty_like(times)
        world.Allreduce(np.nan_to_num(times, nan=0.0), slowest, op=MPI.MAX)   # a repeat lasts as long as its slowest worker
        node_bytes = world.gather(m.bytes.tolist(), root=0)
        wrong = world.allreduce(m.wrong, op=MPI.SUM)
        if rank != 0:
            continue
        pred = predictions(m, model, level, nbytes, n, args.chunk_bytes)
        med = median(slowest)
        if m.name == "ring":
            ring_median = med
        per_sync = [[b / args.repeats for b in nb] for nb in node_bytes]      # (rx, tx) per rank's node, per sync
        members = sorted(m.members)
        busiest = max(max(per_sync[r]) for r in members) if counters else None
        row = dict(mode=m.name, K="-" if m.k is None else str(m.k), key=m.key,
                   link_pred_MiB=pred["link_pred_bytes"] / 2**20,
                   link_meas_MiB=None if busiest is None else busiest / 2**20,
                   time_ms=med * 1e3, min_ms=float(slowest.min()) * 1e3, max_ms=float(slowest.max()) * 1e3,
                   pred_ms=pred["pred_s"] * 1e3, pred_overlap_ms=pred["pred_overlap_s"] * 1e3,
                   pred_fill_ms=None if pred.get("pred_fill_s") is None else pred["pred_fill_s"] * 1e3,
                   ratio=med / pred["pred_s"], wrong=wrong, times_ms=[t * 1e3 for t in slowest],
                   node_bytes_per_sync={f"rank{r}@{hosts[r]}": per_sync[r] for r in members} if counters else None)
        row["range_ms"] = f"[{row['min_ms']:.0f}-{row['max_ms']:.0f}]"
        rows.append(row)
    if rank != 0:
        return 0
    for row in rows:
        row["vs_ring"] = None if ring_median is None else ring_median / (row["time_ms"] * 1e-3)
    print(table(rows, COLUMNS))
    print("# busiest link: bytes each way on the most loaded node's link per synchronisation (pred: the model; "
          "meas: max of its eth0 rx, tx" + (")" if counters else "; not measured on one host)"))
    print("# vs ring: the ring's median time / this mode's (> 1: faster than the ring)")
    print("# predicted with push and pull overlapped (serve_step cannot, serve_streamed does; the streamed rows' "
          "prediction): " + "  ".join(f"{r['key']}: {r['pred_overlap_ms']:.0f} ms" for r in rows
                                      if r["K"] != "-" and not r["key"].endswith("s")))
    fill = [r for r in rows if r["pred_fill_ms"] is not None]
    if fill:
        print("# streamed, with the pipeline's fill (a server returns its last chunk only after it all arrived: "
              "x (1 + 1/its chunks)): " + "  ".join(f"{r['key']}: {r['pred_fill_ms']:.0f} ms "
                                                      f"(meas/fill {r['time_ms'] / r['pred_fill_ms']:.2f})"
                                                      for r in fill))
    bad = sum(r["wrong"] for r in rows)
    print(f"# results checked against the exact average on the last round: {bad} wrong element(s) "
          f"{'OK' if bad == 0 else 'FAILED'}")
    title = (f"{n} workers, M = {fmt_size(nbytes)}, " + (f"emulated nodes, link {args.link or '?'}" if emulated
                                                          else "one host (shared memory)"))
    out = dict(benchmark="ps_vs_ring", ranks=size, workers=n, servers=ks, bytes=nbytes, dtype="float32",
               chunk_bytes=args.chunk_bytes, push_order=args.push_order, streamed=args.streamed, repeats=args.repeats, warmup=args.warmup, link=args.link,
               emulated=emulated, link_counters=counters, hosts=hosts, host=socket.gethostname(),
               cost_model=model.to_dict(), level=level._asdict(), rows=rows)
    if args.json:
        write_json(args.json, out)      # whole or not at all
        print(f"# wrote {args.json}")
    if args.plot:
        plot(args.plot, rows, title)
        print(f"# wrote {args.plot}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
