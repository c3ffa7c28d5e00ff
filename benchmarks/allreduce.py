"""All-reduce bandwidth, nccl-tests style: our ring, our small-message path,
the MPI library's own Allreduce and a naive Reduce+Bcast, in the same run.

    mpiexec -n P python benchmarks/allreduce.py [--min-bytes 8 --max-bytes 256M
        --dtype float32 --iters N --warmup N --json PATH --algorithms ring,small,mpi,naive]
    mpiexec -n P python benchmarks/allreduce.py --quick            # few sizes, few iters
    mpiexec -n P python benchmarks/allreduce.py --overlap [--work matmul|sleep]
        # GradBuckets: fake backward (CPU-bound matmuls, or sleeps standing in
        # for device compute) with mark_ready per layer; fraction of the
        # all-reduce time hidden, from stats() and from wall clock

Method: sizes double from --min-bytes to --max-bytes. At each size the
algorithms run round-robin, iteration by iteration, so machine noise hits all
of them alike. Every iteration is in place on a buffer restored from a pristine
copy outside the timed region, with a Barrier before it (also outside); its
time is the max over ranks; a row reports the median. #wrong counts elements
(all ranks) that differ from the exact expected sum (small-integer data, so
every algorithm must match exactly). busbw = algbw * 2(p-1)/p.

Footer: average busbw per algorithm, ring/MPI busbw ratio per size >= 1 MiB,
the least-squares alpha-beta fit of the ring
    t = 2(p-1) * alpha + 2(p-1)/p * n * beta'      (beta' folds in the reduce cost)
weighted by 1/t (relative error), each ring row's deviation from it, and the
measured ring-vs-small crossover next to the one "auto" uses.
"""

from __future__ import annotations

import argparse
import socket
import time

import numpy as np


# ringpipe.comm first: it settles what the launch needs before MPI_Init (comm/launcher.py),
# and the import of mpi4py.MPI below initializes MPI.
from ringpipe import comm as rcomm  # noqa: E402
from mpi4py import MPI  # noqa: E402

from _common import (choice_list, fmt_size, median, nonneg_float, nonneg_int, output_path,  # noqa: E402
                     positive_float, positive_int, positive_size, size_arg, table, write_json)

ALGOS = ("ring", "small", "hierarchical", "auto", "mpi", "naive")
DEFAULT_ALGOS = ("ring", "small", "hierarchical", "mpi", "naive")
DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
          "int32": np.int32, "int64": np.int64}
# (key, header, format, width): fixed widths as in nccl-tests, so the rows,
# printed size by size, line up under the header up to 1 TB messages.
COLUMNS = [("size", "size", "d", 12), ("count", "count", "d", 12), ("type", "type", "s", 8),
           ("redop", "redop", "s", 5), ("algo", "algo", "s", 12), ("time_us", "time(us)", ".1f", 10),
           ("algbw", "algbw(GB/s)", ".3f", 11), ("busbw", "busbw(GB/s)", ".3f", 11),
           ("wrong", "#wrong", "d", 8)]


def mpi_library() -> str:
    """The MPI library's first version line (Open MPI's ends in a NUL byte)."""
    return MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()


def make_runner(algo: str, world):
    if algo == "ring":
        return lambda buf: rcomm.allreduce(buf, world, op="sum", algorithm="ring")
    if algo in ("small", "hierarchical", "auto"):
        return lambda buf: rcomm.allreduce(buf, world, op="sum", algorithm=algo)
    if algo == "mpi":
        return lambda buf: world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    if algo == "naive":
        def naive(buf):
            if world.Get_rank() == 0:
                world.Reduce(MPI.IN_PLACE, buf, op=MPI.SUM, root=0)
            else:
                world.Reduce(buf, None, op=MPI.SUM, root=0)
            world.Bcast(buf, root=0)
        return naive
    raise ValueError(algo)


def pattern(n: int, rank: int, dtype, start: int = 0) -> np.ndarray:
    # Small integers: every summation order gives the exact same result, so
    # #wrong can demand equality for every dtype (float16 included).
    return ((np.arange(start, start + n) % 7) + rank).astype(dtype)


def count_wrong(buf: np.ndarray, p: int) -> int:
    wrong, step = 0, 1 << 22
    for s in range(0, buf.size, step):
        e = min(buf.size, s + step)
        expect = (p * (np.arange(s, e) % 7) + p * (p - 1) // 2).astype(buf.dtype)
        wrong += int(np.count_nonzero(buf[s:e] != expect))
    return wrong


def iters_for(nbytes: int, args) -> int:
    if args.iters:
        return args.iters
    # About args.budget seconds per algorithm and size at a pessimistic
    # 1 GB/s + 50 us, clamped; keeps the default 8 B..256 MiB run to minutes.
    est = 50e-6 + nbytes / 1e9
    return int(min(args.max_iters, max(args.min_iters, args.budget / est)))


def bench_size(world, nbytes: int, dtype, algos, args) -> list[dict]:
    p, rank = world.Get_size(), world.Get_rank()
    itemsize = np.dtype(dtype).itemsize
    n = max(1, nbytes // itemsize)
    pristine = pattern(n, rank, dtype)
    buf = np.empty_like(pristine)
    runners = {a: make_runner(a, world) for a in algos}
    iters = iters_for(n * itemsize, args)
    times = {a: np.zeros(iters) for a in algos}
    wrong = {a: 0 for a in algos}
    for it in range(args.warmup + iters):
        for a in algos:
            np.copyto(buf, pristine)
            world.Barrier()
            t = time.perf_counter()
            runners[a](buf)
            dt = time.perf_counter() - t
            if it >= args.warmup:
                times[a][it - args.warmup] = dt
            if it == args.warmup + iters - 1:
                wrong[a] = count_wrong(buf, p)
    rows = []
    for a in algos:
        tmax = np.empty_like(times[a])
        world.Allreduce(times[a], tmax, op=MPI.MAX)  # an iteration lasts as long as its slowest rank
        w = world.allreduce(wrong[a], op=MPI.SUM)
        t = median(tmax)
        algbw = n * itemsize / t / 1e9
        rows.append(dict(size=n * itemsize, count=n, type=np.dtype(dtype).name, redop="sum",
                         algo=a, time_us=t * 1e6, algbw=algbw, busbw=algbw * 2 * (p - 1) / p,
                         wrong=w, iters=iters))
    return rows


def fit_alpha_beta(rows: list[dict], p: int):
    """Weighted least squares of t = 2(p-1)*alpha + 2(p-1)/p*n*beta'."""
    if p < 2 or len(rows) < 2:
        return None
    t = np.array([r["time_us"] * 1e-6 for r in rows])
    n = np.array([r["size"] for r in rows], dtype=float)
    A = np.stack([np.full_like(n, 2 * (p - 1)), 2 * (p - 1) / p * n], axis=1)
    w = 1.0 / t  # relative error: small sizes count as much as large ones
    (alpha, beta), *_ = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)
    model = A @ np.array([alpha, beta])
    dev = (t - model) / model * 100
    return dict(alpha_us=alpha * 1e6, beta_GBps=(1.0 / beta / 1e9) if beta > 0 else float("inf"),
                beta_s_per_byte=beta, deviation_pct=[float(d) for d in dev],
                sizes=[int(x) for x in n],
                within_20pct=int(np.sum(np.abs(dev) <= 20)), rows=len(rows))


def measured_crossover(rows: list[dict]):
    """Smallest size from which the ring beats the small path at every larger size."""
    by = {}
    for r in rows:
        by.setdefault(r["size"], {})[r["algo"]] = r["time_us"]
    sizes = sorted(s for s in by if "ring" in by[s] and "small" in by[s])
    cross = None
    for s in reversed(sizes):
        if by[s]["ring"] < by[s]["small"]:
            cross = s
        else:
            break
    return cross


def run_bandwidth(world, args) -> None:
    p, rank = world.Get_size(), world.Get_rank()
    dtype = DTYPES[args.dtype]
    algos = args.algorithms
    if args.quick:
        sizes = [8, 4096, 64 * 1024, 1 << 20, 4 << 20]
    else:
        sizes, s = [], max(args.min_bytes, np.dtype(dtype).itemsize)
        while s <= args.max_bytes:
            sizes.append(s)
            s *= 2
    cols = COLUMNS
    from ringpipe.comm.context import context_for
    nodes = context_for(world).nodes if p > 1 else None
    cost = context_for(world).cost if p > 1 else None
    hosts = world.allgather(MPI.Get_processor_name())
    if rank == 0:
        print(f"# ringpipe all-reduce benchmark: {p} ranks on {len(set(hosts))} host(s) "
              f"({', '.join(sorted(set(hosts)))}), dtype {args.dtype}, algorithms {','.join(algos)}")
        if nodes is not None:
            print(f"# nodes as comm sees them: {nodes.describe()}; auto above the crossover picks "
                  f"{rcomm.collectives.choose_algorithm('auto', 1 << 30, context_for(world))}"
                  + (f"; link {args.link}" if args.link else ""))
        if cost is not None:
            print(f"# {cost.describe()}")
        print(f"# {mpi_library()}; "
              f"thread level {MPI.Query_thread()}; auto crossover {rcomm.get_crossover()} B")
        print(table([], cols), flush=True)
    rows = []
    for nbytes in sizes:
        new = bench_size(world, nbytes, dtype, algos, args)
        rows += new
        if rank == 0:
            print(table(new, cols, header=False), flush=True)

    if rank != 0:
        return
    out = dict(ranks=p, dtype=args.dtype, host=socket.gethostname(), hosts=hosts, link=args.link,
               nodes=None if nodes is None else {"node_of_rank": nodes.node, "ranks_per_node": nodes.sizes},
               mpi=mpi_library(), rows=rows,
               auto_crossover_bytes=rcomm.get_crossover())
    print("#")
    for a in algos:
        bw = [r["busbw"] for r in rows if r["algo"] == a]
        print(f"# Avg bus bandwidth {a:>12}: {np.mean(bw):.3f} GB/s")
    wrong = sum(r["wrong"] for r in rows)
    print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if "ring" in algos and "mpi" in algos:
        ratios = {}
        for s in sorted({r["size"] for r in rows}):
            if s < 1 << 20:
                continue
            ring = next(r for r in rows if r["size"] == s and r["algo"] == "ring")
            mpi = next(r for r in rows if r["size"] == s and r["algo"] == "mpi")
            ratios[s] = ring["busbw"] / mpi["busbw"]
        if ratios:
            print("# ring / MPI.Allreduce busbw, sizes >= 1 MiB:")
            print("#   " + "  ".join(f"{fmt_size(s)}: {v:.2f}" for s, v in ratios.items()))
            print(f"#   min {min(ratios.values()):.2f}, median {median(list(ratios.values())):.2f}")
        out["ring_over_mpi"] = {str(s): v for s, v in ratios.items()}
    if cost is not None:
        out["cost_model"] = cost.to_dict()
        checks = []
        for r in rows:
            if r["size"] >= 1 << 20 and r["algo"] in ("ring", "hierarchical"):
                predicted = getattr(cost, r["algo"])(r["size"]) * 1e6
                checks.append({"size": r["size"], "algo": r["algo"], "predicted_us": predicted,
                               "measured_us": r["time_us"], "error_pct": 100 * (predicted / r["time_us"] - 1)})
        out["predicted"] = checks
        if checks:
            print("# cost model, predicted vs measured (>= 1 MiB): " + "  ".join(
                f"{fmt_size(c['size'])} {c['algo'][:4]}: {c['error_pct']:+.0f}%" for c in checks))
            within = sum(abs(c["error_pct"]) <= 25 for c in checks)
            print(f"#   {within}/{len(checks)} within 25%")
    for a, b in (("hierarchical", "ring"), ("hierarchical", "mpi")):
        if a in algos and b in algos:
            ratios = {}
            for sz in sorted({r["size"] for r in rows}):
                if sz >= 4 << 20:
                    ra = next(r for r in rows if r["size"] == sz and r["algo"] == a)
                    rb = next(r for r in rows if r["size"] == sz and r["algo"] == b)
                    ratios[sz] = ra["busbw"] / rb["busbw"]
            if ratios:
                print(f"# {a} / {b} busbw, sizes >= 4 MiB: "
                      + "  ".join(f"{fmt_size(sz)}: {v:.2f}" for sz, v in ratios.items())
                      + f"; min {min(ratios.values()):.2f}")
            out[f"{a}_over_{b}"] = {str(sz): v for sz, v in ratios.items()}
    if "ring" in algos:
        ring_rows = [r for r in rows if r["algo"] == "ring"]
        fit = fit_alpha_beta(ring_rows, p)
        out["ring_fit"] = fit
        if fit:
            print(f"# ring alpha-beta fit: alpha = {fit['alpha_us']:.2f} us/message, "
                  f"beta = {fit['beta_GBps']:.2f} GB/s (effective, incl. reduce); "
                  f"{fit['within_20pct']}/{fit['rows']} sizes within 20% of the model")
            print("#   deviation from model: " + "  ".join(
                f"{fmt_size(s)}: {d:+.0f}%" for s, d in zip(fit["sizes"], fit["deviation_pct"])))
    if "ring" in algos and "small" in algos:
        cross = measured_crossover(rows)
        t = {(r["size"], r["algo"]): r["time_us"] for r in rows}
        sizes = sorted({r["size"] for r in rows})
        wins = [sz for sz in sizes if t[(sz, "ring")] < t[(sz, "small")]]
        out["measured_crossover_bytes"] = cross
        out["ring_faster_than_small_at"] = wins
        where = f"at every size from {cross} B on" if cross else "not at the largest size"
        print(f"# measured crossover: ring beats small {where} "
              f"(auto uses small up to {rcomm.get_crossover()} B)")
        print("#   small/ring time: " + "  ".join(
            f"{fmt_size(sz)}: {t[(sz, 'small')] / t[(sz, 'ring')]:.2f}" for sz in sizes if sz >= 1 << 16))
    if args.json:
        write_json(args.json, out)
        print(f"# wrote {args.json}")


def run_overlap(world, args) -> None:
    """Fake backward: per layer some GIL-releasing matmuls, then mark_ready.
    Compares compute alone, comm alone and the overlapped step."""
    p, rank = world.Get_size(), world.Get_rank()
    layers, per = args.layers, args.layer_elems
    ranges = [(i * per, (i + 1) * per) for i in range(layers)]
    grad = np.zeros(layers * per, np.float32)
    m = args.matmul_n
    a = np.random.default_rng(rank).standard_normal((m, m)).astype(np.float32)
    out = np.empty_like(a)

    def backward(gb):
        for i in reversed(range(layers)):
            if args.work == "sleep":
                time.sleep(args.sleep_ms * 1e-3)
            else:
                for _ in range(args.matmuls):
                    np.matmul(a, a, out=out)
            grad[ranges[i][0]:ranges[i][1]] = 1.0
            if gb is not None:
                gb.mark_ready(i)

    def timed(fn):
        ts = []
        for _ in range(args.warmup + args.steps):
            world.Barrier()
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        arr = np.array(ts[args.warmup:])
        mx = np.empty_like(arr)
        world.Allreduce(arr, mx, op=MPI.MAX)
        return median(mx)

    t_compute = timed(lambda: backward(None))
    res = {}
    for overlap in (False, True):
        gb = rcomm.GradBuckets(grad, ranges, world, bucket_bytes=args.bucket_bytes,
                               op="avg", overlap=overlap)
        hidden = []

        def step():
            backward(gb)
            gb.wait()
            hidden.append(gb.stats())

        t = timed(step)
        st = hidden[args.warmup:]
        res[overlap] = dict(step_s=t, comm_s=median([s["comm_s"] for s in st]),
                            wait_s=median([s["wait_s"] for s in st]),
                            hidden=median([s["hidden"] for s in st]), buckets=len(gb.buckets))
        gb.close()
    if rank != 0:
        return
    t_comm = res[False]["comm_s"]
    t_ov = res[True]["step_s"]
    effective = (t_compute + t_comm - t_ov) / t_comm if t_comm > 0 else 0.0
    work = (f"{args.sleep_ms} ms sleep (device-like: CPU idle)" if args.work == "sleep"
            else f"{args.matmuls} x {m}^3 matmul (CPU-bound)")
    print(f"# GradBuckets overlap: {p} ranks, {layers} layers x {per * 4 / 2**20:.1f} MiB, "
          f"bucket {fmt_size(args.bucket_bytes)} ({res[True]['buckets']} buckets), "
          f"{work} per layer, thread level {MPI.Query_thread()}")
    print(f"# backward compute alone          : {t_compute * 1e3:8.2f} ms")
    print(f"# step, overlap=False (reduce in wait): {res[False]['step_s'] * 1e3:8.2f} ms "
          f"(comm {t_comm * 1e3:.2f} ms)")
    print(f"# step, overlap=True                : {t_ov * 1e3:8.2f} ms "
          f"(comm in thread {res[True]['comm_s'] * 1e3:.2f} ms, blocked in wait "
          f"{res[True]['wait_s'] * 1e3:.2f} ms)")
    print(f"# hidden fraction, stats() (1 - wait/comm)           : {res[True]['hidden']:.2f}")
    print(f"# hidden fraction, wall clock ((compute+comm-step)/comm): {effective:.2f}")
    if args.json:
        write_json(args.json, dict(ranks=p, work=work, compute_s=t_compute, no_overlap=res[False],
                                   overlap=res[True], effective_hidden=effective))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-bytes", type=size_arg, default="8",
                    help="smallest message (e.g. 8, 4K; suffixes K, M, G are binary)")
    ap.add_argument("--max-bytes", type=size_arg, default="256M", help="largest message (e.g. 16M, 256M)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--iters", type=nonneg_int, default=0,
                    help="timed iterations per size; 0 (the default) picks them by size from "
                    "--budget, within --min-iters..--max-iters (--quick: 5)")
    ap.add_argument("--warmup", type=nonneg_int, default=2, help="untimed iterations per size")
    ap.add_argument("--min-iters", type=positive_int, default=10)
    ap.add_argument("--max-iters", type=positive_int, default=200)
    ap.add_argument("--budget", type=positive_float, default=0.3,
                    help="seconds per algorithm and size used to pick default iterations")
    ap.add_argument("--algorithms", type=choice_list(ALGOS), default=",".join(DEFAULT_ALGOS),
                    help="comma list of " + ",".join(ALGOS))
    ap.add_argument("--link", default="",
                    help="the link between nodes, as a label for the table and JSON (e.g. 1gbit; recorded, not set)")
    ap.add_argument("--json", type=output_path, default=None, help="write rows + fit to this path (rank 0)")
    ap.add_argument("--quick", action="store_true", help="5 sizes up to 4 MiB, 5 iterations")
    ap.add_argument("--overlap", action="store_true", help="measure GradBuckets overlap instead")
    ap.add_argument("--layers", type=positive_int, default=8, help="--overlap: fake layers")
    ap.add_argument("--layer-elems", type=positive_int, default=1 << 20, help="--overlap: float32 grads per layer")
    ap.add_argument("--work", choices=["matmul", "sleep"], default="matmul",
                    help="--overlap: fake backward work per layer: CPU-bound matmuls, or a "
                    "sleep that models device compute (CPU idle, GIL released)")
    ap.add_argument("--sleep-ms", type=nonneg_float, default=3.0, help="--overlap --work sleep: ms per layer")
    ap.add_argument("--matmuls", type=nonneg_int, default=4, help="--overlap: matmuls per layer")
    ap.add_argument("--matmul-n", type=positive_int, default=256, help="--overlap: matmul size")
    ap.add_argument("--bucket-bytes", type=positive_size, default=4 << 20, help="--overlap: bucket size")
    ap.add_argument("--steps", type=positive_int, default=10, help="--overlap: timed steps")
    args = ap.parse_args(argv)
    # Every rank parses the same argv, so every rank refuses alike, before
    # any collective.
    if args.min_bytes > args.max_bytes:
        ap.error(f"--min-bytes ({args.min_bytes} B) is larger than --max-bytes ({args.max_bytes} B): "
                 "no sizes to measure; swap them or raise --max-bytes")
    itemsize = np.dtype(DTYPES[args.dtype]).itemsize
    if args.max_bytes < itemsize:
        ap.error(f"--max-bytes ({args.max_bytes} B) is smaller than one {args.dtype} element "
                 f"({itemsize} B): give at least {itemsize}")
    if args.min_iters > args.max_iters:
        ap.error(f"--min-iters ({args.min_iters}) is larger than --max-iters ({args.max_iters})")
    if MPI.COMM_WORLD.Get_size() < 2:
        ap.error("an all-reduce needs at least 2 ranks, and this run has 1: "
                 "launch with mpiexec -n N python benchmarks/allreduce.py ..., N >= 2")
    if args.quick:
        args.iters = args.iters or 5
        args.warmup = min(args.warmup, 1)
        args.steps = min(args.steps, 3)
    world = MPI.COMM_WORLD
    if args.overlap:
        run_overlap(world, args)
    else:
        run_bandwidth(world, args)


if __name__ == "__main__":
    main()
