"""Tensor parallelism measured: memory per rank, bytes on the tensor axis, throughput vs DP and PP.

    mpiexec -n 2 python benchmarks/tensor_parallel.py --json tp2.json
    mpiexec -n 4 python benchmarks/tensor_parallel.py --json tp4.json

One GPT (--layers, --d-model, --heads, --seq-len) and one global batch, in the same run:

1. memory per rank at tp = 1, 2, 4 (those that divide the ranks), with and without
   sequence parallelism: parameters from the ParamBuffer, activations of one
   micro-batch from the layers' own contexts (the bytes the pipeline executor
   counts), each next to its formula;
2. bytes through the tensor axis in one training step, counted by the group
   (engine/parallel/tensor.py), next to the formula: per micro-batch
   4 all-reduces of B*T*C per block (2 forward, 2 backward), plus one each for
   the embedding and the head; under sequence parallelism all-gathers and
   reduce-scatters of the same size (6L+2 and 4L+2: the backward gathers a
   column-parallel layer's input again instead of keeping it);
3. tokens/s and model FLOP/s of the layouts that fill the ranks (dp, pp and tp
   alone, and with 4 ranks dp2 x tp2 and pp2 x tp2), the median over the
   steps of --rounds rounds through every layout in turn, and
   for tp the share of its communication hidden behind the weight-gradient
   GEMMs (--tp-overlap on), with overlap off alongside for the difference in time.

Note: with more ranks than cores, ranks compete for CPU (MPI's busy waiting
included); 2 ranks on 2 cores is the clean comparison. Times are medians, the
comparisons ratios measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
# ringpipe.comm first: it settles what the launch needs before MPI_Init (comm/launcher.py),
# and the import of mpi4py.MPI below initializes MPI.
from ringpipe import comm  # noqa: E402
from mpi4py import MPI  # noqa: E402

from _common import median, output_path, positive_int, table, write_json  # noqa: E402
from ringpipe.engine.train.config import Config  # noqa: E402
from ringpipe.engine.model.gpt import GPTConfig, flops_per_token, gpt_layers  # noqa: E402
from ringpipe.engine.model.layers import Block, Embedding, LMHead  # noqa: E402  (the tensor axis's: subclasses)
from ringpipe.engine.model.chain import LayerChain  # noqa: E402
from ringpipe.engine.parallel.compose import build_rank_model  # noqa: E402
from ringpipe.engine.parallel.tensor import TensorGroup  # noqa: E402
from ringpipe.engine.parallel.pipeline.executor import nbytes  # noqa: E402

DTYPE = np.float32


# ---- 1. memory -----------------------------------------------------------------------------

def param_formula(cfg: GPTConfig, tp: int) -> int:
    """Parameters one tensor-parallel rank holds (elements)."""
    C, L = cfg.d_model, cfg.n_layer
    V = -(-cfg.padded_vocab // tp) * tp        # wte's rows in memory: the tensor axis pads to a multiple of tp
    per_block = 12 * C * C // tp + (3 * C + 4 * C) // tp + (C + C) + 4 * C   # matrices, split biases, row biases, LNs
    return V // tp * C + cfg.context * C + L * per_block + 2 * C


def activation_formula(cfg: GPTConfig, tp: int, sp: bool, micro: int, T: int) -> int:
    """Bytes one rank's blocks keep for backward, per micro-batch (what their contexts hold):
    per block 4 B*T*C whole (LayerNorm inputs and outputs, the residual) and 4 B*T
    (means, rstds), or both / tp under sequence parallelism; 12 B*T*C / tp in the
    regions (q, k, v, the heads' output, fc before and after GELU) and H/tp attention
    matrices of T x T."""
    C, H, L, s = cfg.d_model, cfg.n_head, cfg.n_layer, np.dtype(DTYPE).itemsize
    BT = micro * T
    stream = (4 * BT * C + 4 * BT) // (tp if sp else 1)
    region = 12 * BT * C // tp + micro * (H // tp) * T * T
    return L * (stream + region) * s


def measure_memory(world, cfg, micro, T, tp, sp):
    """(parameters, block activation bytes) on this rank for tensor parallel tp."""
    sub = world.Split(world.rank // tp, world.rank)
    tensor = TensorGroup(sub, sequence_parallel=sp, overlap=False) if tp > 1 else None
    try:
        chain = LayerChain(gpt_layers(cfg, tensor), dtype=DTYPE)
        chain.params.init(0)
        rng = np.random.default_rng(0)
        x = rng.integers(0, cfg.vocab, size=(micro, T))
        _, ctxs = chain.forward(x, x, grad_scale=1.0)
        blocks = sum(nbytes(ctx) for ctx in ctxs[1:-1])     # the Transformer blocks
        chain.backward(None, ctxs)                          # the group's collectives in order on every rank
        return chain.params.size, blocks
    finally:
        if tensor is not None:
            tensor.close()
        sub.Free()


# ---- 2 and 3. a layout's step --------------------------------------------------------------

def comm_formula(here: dict, micro: int, T: int, C: int, m: int, sp: bool) -> dict:
    """Tensor-axis buffer bytes of one training step on a rank holding here["blocks"]
    blocks (and the embedding, the head, if here says so), by collective."""
    S = micro * T * C * np.dtype(DTYPE).itemsize
    # The embedding's forward and the head's backward add one each (an all-reduce, or under
    # sequence parallelism a reduce-scatter and an all-gather: each end has both).
    L, ends = here["blocks"], here["embedding"] + here["head"]
    if sp:
        return {"all-gather": m * (6 * L + ends) * S, "reduce-scatter": m * (4 * L + ends) * S, "all-reduce": 0}
    return {"all-reduce": m * (4 * L + ends) * S, "all-gather": 0, "reduce-scatter": 0}


def layers_here(model):
    """What this rank's model holds: its blocks, and whether the embedding and the head."""
    inner = model.inner.inner if hasattr(model.inner, "tensor") else model.inner
    chains = inner.chunks if hasattr(inner, "chunks") else [inner.chain]
    layers = [layer for chain in chains for layer in chain.layers]
    return {"blocks": sum(isinstance(layer, Block) for layer in layers),
            "embedding": int(any(isinstance(layer, Embedding) for layer in layers)),
            "head": int(any(isinstance(layer, LMHead) for layer in layers))}


def run_layout(world, shape, batch, T, layout, steps):
    dp, pp, tp = layout["dp"], layout["pp"], layout["tp"]
    m = layout.get("m", 1)
    cfg = Config(dp=dp, pp=pp, tp=tp, microbatches=m, sequence_parallel=layout.get("sp", False),
                 tp_overlap="off" if layout.get("no_overlap") else "on", batch_size=batch)
    grid = comm.ProcessGrid(world, [("pipe", pp), ("data", dp), ("tensor", tp)])
    micro = batch // dp // m
    model = build_rank_model(grid, lambda tensor=None: gpt_layers(shape, tensor), cfg, DTYPE, np,
                             micro_shape=(micro, T, shape.d_model), cost_batch=None)
    opt = model.make_optimizer("adamw", 0.1)
    rng = np.random.default_rng(1)
    x = rng.integers(0, shape.vocab, size=(batch, T))
    y = rng.integers(0, shape.vocab, size=(batch, T))
    rows = slice(grid.index("data") * (batch // dp), (grid.index("data") + 1) * (batch // dp))
    tensor = getattr(model.inner, "tensor", None)
    here = layers_here(model)
    times, step_stats = [], None
    for step in range(steps + 1):                          # step 0 warms up, and its bytes are counted
        if tensor is not None and step < 2:
            tensor.reset_stats()                           # the times below: the timed steps only
        world.Barrier()
        t0 = time.perf_counter()
        model.params.zero_grad()
        model.forward_backward(x[rows], y[rows], 1.0 / (batch * T))
        model.grad_norm_sq()
        model.update(opt, 1e-3)
        span = np.array([time.perf_counter() - t0])
        world.Allreduce(MPI.IN_PLACE, span, op=MPI.MAX)
        if tensor is not None and step_stats is None:
            step_stats = {k: (list(v) if isinstance(v, list) else v) for k, v in tensor.stats.items()}
        if step:
            times.append(float(span[0]))
    hidden = None
    if tensor is not None:
        totals = world.allgather((tensor.stats["comm_s"], tensor.stats["async_s"], tensor.stats["waited_s"]))
        comm_s, async_s, waited_s = (sum(t[i] for t in totals) for i in range(3))
        hidden = {"of_overlapped": max(0.0, 1 - waited_s / async_s) if async_s else None,
                  "of_all": max(0.0, async_s - waited_s) / comm_s if comm_s else None,
                  "comm_share_of_step": comm_s / len(totals) / steps / median(times)}
    model.close()
    grid.free()
    step_s = median(times)
    name = "x".join(f"{k}{layout[k]}" for k in ("dp", "pp", "tp") if layout[k] > 1) or "1 rank"
    if layout.get("sp"):
        name += "+sp"
    if layout.get("no_overlap"):
        name += " (overlap off)"
    return {"layout": name, **layout, "micro": micro, "step_ms": step_s * 1e3, "step_times_s": times,
            "tokens_per_s": batch * T / step_s, "model_tflops": batch * T * flops_per_token(shape, T) / step_s / 1e12,
            "params_rank0": model.params.size, "tp_stats": step_stats, "hidden": hidden, "rank0_holds": here}


def layouts_for(p):
    out = [dict(dp=p, pp=1, tp=1), dict(dp=1, pp=p, tp=1, m=4 * p), dict(dp=1, pp=1, tp=p),
           dict(dp=1, pp=1, tp=p, no_overlap=True), dict(dp=1, pp=1, tp=p, sp=True)]
    if p == 4:
        out += [dict(dp=2, pp=1, tp=2), dict(dp=1, pp=2, tp=2, m=8)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--d-model", type=positive_int, default=256)
    ap.add_argument("--heads", type=positive_int, default=8)
    ap.add_argument("--seq-len", type=positive_int, default=128)
    ap.add_argument("--batch", type=positive_int, default=16, help="global batch in sequences (default 16)")
    ap.add_argument("--steps", type=positive_int, default=5, help="timed steps per round (after a warm-up step)")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="rounds over all layouts (default 3): medians over every round's steps")
    ap.add_argument("--json", type=output_path, default=None)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    p = world.Get_size()
    # Every rank parses the same argv, so every rank refuses alike, before any collective.
    if args.d_model % args.heads:
        ap.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    if p not in (2, 4):
        ap.error(f"run under mpiexec -n 2 or -n 4 (got {p} rank(s)): the layouts compared are dp, pp and tp of "
                 "the ranks")
    if args.heads % p:
        ap.error(f"--heads {args.heads} must divide by the {p} ranks (tp {p} holds whole heads)")
    if args.seq_len % p or args.batch % (4 * p):
        ap.error(f"--seq-len {args.seq_len} must divide by {p} (sequence parallel) and --batch {args.batch} by "
                 f"{4 * p} (the pipeline's micro-batches)")
    comm.install_abort_handler()
    shape = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, context=args.seq_len)
    T, micro = args.seq_len, args.batch // 4

    memory = []
    for tp in [t for t in (1, 2, 4) if p % t == 0]:
        for sp in ((False, True) if tp > 1 else (False,)):
            params, acts = measure_memory(world, shape, micro, T, tp, sp)
            memory.append({"tp": tp, "sp": sp, "params": params, "params_formula": param_formula(shape, tp),
                           "act_MiB": acts / 2**20,
                           "act_formula_MiB": activation_formula(shape, tp, sp, micro, T) / 2**20})
    # Rounds over every layout in turn, so a slow spell of the shared machine hits them all alike.
    rounds = [[] for _ in range(args.rounds)]
    for i in range(args.rounds):
        for layout in layouts_for(p):
            rounds[i].append(run_layout(world, shape, args.batch, T, layout, args.steps))
            if world.rank == 0:
                print(f"  round {i + 1}: {rounds[i][-1]['layout']:<22} {rounds[i][-1]['tokens_per_s']:9.0f} tok/s",
                      flush=True)
    if world.rank != 0:
        return
    rows = []
    for same in zip(*rounds):           # one layout's rounds: the median over all their steps
        row = dict(same[-1])
        times = [t for r in same for t in r["step_times_s"]]
        row.update(step_times_s=times, step_ms=median(times) * 1e3, tokens_per_s=args.batch * T / median(times),
                   model_tflops=args.batch * T * flops_per_token(shape, T) / median(times) / 1e12,
                   round_tokens_per_s=[r["tokens_per_s"] for r in same])
        rows.append(row)
    print(f"\n# tensor parallelism: GPT {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
          f"T {T}, global batch {args.batch}, float32; {p} ranks on {os.cpu_count()} cores")
    print(f"\n## memory per rank (activations: the blocks' contexts for one micro-batch of {micro})")
    print(table(memory, [("tp", "tp", "d"), ("sp", "seq-par", ""), ("params", "params", ","),
                         ("params_formula", "formula", ","), ("act_MiB", "act MiB", ".2f"),
                         ("act_formula_MiB", "formula MiB", ".2f")]))
    print("\n## bytes through rank 0's tensor axis in one step (MiB, buffer sizes) vs the formula")
    comm_rows = []
    for r in rows:
        if r["tp_stats"] is None:
            continue
        formula = comm_formula(r["rank0_holds"], r["micro"], T, shape.d_model, r.get("m", 1), r.get("sp", False))
        for kind in ("all-reduce", "all-gather", "reduce-scatter"):
            calls, measured = r["tp_stats"][kind]
            if calls or formula[kind]:
                comm_rows.append({"layout": r["layout"], "kind": kind, "calls": calls, "MiB": measured / 2**20,
                                  "formula_MiB": formula[kind] / 2**20,
                                  "small": (measured - formula[kind]) / 2**20})
        r["comm_formula"] = formula
    print(table(comm_rows, [("layout", "layout", ""), ("kind", "collective", ""), ("calls", "calls", "d"),
                            ("MiB", "measured", ".3f"), ("formula_MiB", "formula", ".3f"),
                            ("small", "rest (CE)", ".3f")]))
    print("   (rest: the cross-entropy's per-row max and sums, 3 numbers a token; under sequence parallelism also "
          "the LayerNorms' partial gradients)")
    base = next(r for r in rows if r["layout"] == f"dp{p}")
    for r in rows:
        r["vs_dp"] = r["tokens_per_s"] / base["tokens_per_s"]
        h = r["hidden"] or {}
        r["hidden_overlapped"], r["hidden_all"], r["comm_share"] = (h.get("of_overlapped"), h.get("of_all"),
                                                                    h.get("comm_share_of_step"))
    print("\n## throughput, same model and global batch (median step)")
    print(table(rows, [("layout", "layout", ""), ("step_ms", "step ms", ".1f"), ("tokens_per_s", "tok/s", ",.0f"),
                       ("model_tflops", "model TFLOP/s", ".4f"), ("vs_dp", f"vs dp{p}", ".2f"),
                       ("params_rank0", "params/rank", ","), ("comm_share", "TP comm/step", ".0%"),
                       ("hidden_overlapped", "hidden (overlapped)", ".0%"), ("hidden_all", "hidden (all TP)", ".0%")]))
    tp_on = next(r for r in rows if r["layout"] == f"tp{p}")
    tp_off = next(r for r in rows if r["layout"] == f"tp{p} (overlap off)")
    print(f"\noverlap on vs off: {tp_off['step_ms'] / tp_on['step_ms']:.2f}x the step time without it")
    if args.json:
        write_json(args.json, {"ranks": p, "cores": os.cpu_count(), "shape": shape.to_dict(), "batch": args.batch,
                               "memory": memory, "comm": comm_rows, "rows": rows})


if __name__ == "__main__":
    main()
