"""Memory per rank, measured against the prediction (engine/train/memory.py), for every ZeRO
stage and activation recomputation mode; their tokens/s and communication bytes per step.

    python benchmarks/memory.py [--ranks 2,4] [--zero 0,1,2,3] [--recompute none,selective,full]
                                [--seq 64] [--rows 2] [--steps 3] [--rounds 1] [--json PATH]
    python benchmarks/memory.py --quick       # a tiny GPT, 2 ranks, ZeRO 0/1, no recomputation
    python benchmarks/memory.py --largest     # the largest GPT and Llama preset that trains at 4 ranks
    python benchmarks/memory.py --baseline    # the fixed overhead (FIXED_OVERHEAD_BYTES) at 1, 2, 4 ranks

Each run is `mpiexec -n N python benchmarks/memory.py --child SPEC RESULT`: the trainer's own
pieces (engine.train.assemble then the step loop, engine.train.run.train; no checkpoint at the
end), GPT-2 124M's shape (12 x 768, 12 heads, vocabulary 50257 padded to 50304 rows) on random
token ids (a nanoGPT train.bin/val.bin folder written once), --rows sequences of --seq tokens
per rank, float32, AdamW, --steps steps. Every rank reads its own peak resident memory (VmHWM,
/proc/self/status) after the last step; the prediction is engine.train.memory.predict for the
same Config, the ratio is measured / predicted for the largest rank. Communication: the child
wraps comm/ring.py's _run and the small all-reduce and counts the bytes each rank sends; a
step's figure is the median of the steps between the first and the last (the first gathers
nothing ZeRO-3 prefetched, the last runs the validation pass), against 2 x 4 Psi (N-1)/N bytes
for ZeRO 0-2 (a reduce-scatter and an all-gather of the gradients, or of the parameters after
the update) and 3 x 4 Psi (N-1)/N for ZeRO-3 (parameters gathered for forward and again for
backward, gradients reduce-scattered). Tokens/s: the median
step time of the same steps, each setting next to ZeRO-1 without recomputation at its rank
count. --rounds N alternates N passes over the settings and keeps each setting's fastest.

--largest: for each setting, the presets in order of size (gpt2-124m ... gpt2-1558m; the Llama
presets) at 4 ranks, one step each, skipping those whose predicted peak x 4 exceeds this
machine's memory; a run is killed (and counts as not fitting) when the ranks' summed resident
memory passes MemAvailable minus a margin, which the parent watches every 0.1 s, and every
child runs with oom_score_adj 1000, so that if the kernel must kill something it kills a
benchmark rank. PyTorch FSDP (gloo, CPU) on the same GPT shapes, if torch is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from _common import choice_list, int_list, output_path, positive_int, table, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
GPT2_VOCAB = 50257
ZERO = ("0", "1", "2", "3")
RECOMPUTE = ("none", "selective", "full")
QUICK_SHAPE = {"layers": 2, "d_model": 64, "heads": 2, "context": 64}
GPT_PRESETS = ("gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1558m")
LLAMA_PRESETS = ("smollm2-135m", "llama3.2-1b")
MARGIN = 2 * 2**30            # --largest: what the parent leaves free when it kills a run
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


# ---- the child: one training run, every rank measuring itself -----------------------------

class Counter:
    """Bytes this rank sends through comm's collectives (ring phases and the small all-reduce)."""

    def __init__(self):
        self.bytes = 0
        self.lock = threading.Lock()

    def install(self):
        from ringpipe.comm import collectives, ring
        run, small = ring._run, collectives.allreduce_small

        def counted_run(ctx, flat, wire, ufunc, avg, t0, t1, *rest, **kw):
            p, r = ctx.size, ctx.rank
            bounds = ring.chunk_bounds(flat.size, p)
            sent = sum(bounds[(r - t - 1) % p][1] - bounds[(r - t - 1) % p][0] for t in range(t0, t1))
            with self.lock:
                self.bytes += sent * flat.itemsize
            return run(ctx, flat, wire, ufunc, avg, t0, t1, *rest, **kw)

        def counted_small(ctx, flat, *rest, **kw):
            rounds = max(1, (ctx.size - 1).bit_length())
            with self.lock:
                self.bytes += rounds * flat.nbytes
            return small(ctx, flat, *rest, **kw)

        ring._run = counted_run
        collectives.allreduce_small = counted_small


def child_fsdp(spec, result_path):
    """PyTorch FSDP2 (fully_shard per transformer block and the root, gloo, CPU) on
    transformers' GPT2LMHeadModel of the same shape (vocabulary padded as ringpipe pads it),
    AdamW, the same tokens per rank; each rank's VmHWM after --steps steps."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel
    from ringpipe.engine.model.gpt import PRESETS
    from ringpipe.engine.train import memory
    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size, init_method=f"tcp://127.0.0.1:{spec['port']}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n_layer, d_model, n_head, context = PRESETS[spec["preset"]]
    config = GPT2Config(vocab_size=-(-GPT2_VOCAB // 128) * 128, n_positions=context, n_embd=d_model,
                        n_layer=n_layer, n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    mesh = init_device_mesh("cpu", (size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(rank)
    times = []
    for _ in range(spec["steps"]):
        x = torch.from_numpy(rng.integers(0, GPT2_VOCAB, size=(spec["rows"], spec["seq"])))
        t0 = time.perf_counter()
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    peaks = [None] * size
    dist.all_gather_object(peaks, memory.peak_rss())
    if rank == 0:
        with open(result_path, "w") as fh:
            json.dump({"peaks": peaks, "step_times_s": times, "torch": torch.__version__}, fh)
    dist.destroy_process_group()


def child_main(spec_json, result_path):
    spec = json.loads(spec_json)
    if spec.get("framework") == "fsdp":
        return child_fsdp(spec, result_path)
    from ringpipe.engine.job import runtime
    runtime.set_thread_defaults()         # as `ringpipe train` does (engine/train/cli.py)
    runtime.reuse_freed_memory()
    import contextlib
    import numpy as np
    from mpi4py import MPI
    from ringpipe.engine.job import lifecycle
    from ringpipe.engine.train import memory
    from ringpipe.engine.train.assemble import assemble
    from ringpipe.engine.train.config import Config
    from ringpipe.engine.train.run import train
    world = MPI.COMM_WORLD
    counter = Counter()
    counter.install()
    settings = dict(spec["config"])
    cfg = Config(**settings)
    steps = []
    with contextlib.ExitStack() as cleanup:
        stop = lifecycle.StopFlag()
        cleanup.callback(stop.uninstall)
        training = assemble(cfg, world, stop, cleanup)
        done_before = training.report.step_done

        def step_done(record, first_step, items_name):
            steps.append({"step": record["step"], "step_s": record["step_ms"] / 1e3, "loss": record["loss"],
                          "sent_bytes": counter.bytes, "hwm": memory.peak_rss()})
            return done_before(record, first_step, items_name)

        training.report.step_done = step_done
        train(training)
        predicted = training.memory.to_dict()
        items_per_step = training.items_per_step
        params_rank = int(training.model.params.size)
    hwm = memory.peak_rss()
    per_rank = world.gather({"peak_rss_bytes": hwm, "steps": steps}, root=0)
    if world.Get_rank() == 0:
        out = {"predicted": predicted, "ranks": per_rank, "items_per_step": items_per_step,
               "params_rank": params_rank, "versions": {"numpy": np.__version__}}
        with open(result_path, "w") as fh:
            json.dump(out, fh)


# ---- the parent --------------------------------------------------------------------------------

def token_folder(vocab=GPT2_VOCAB):
    """A folder of random token ids below `vocab`, the largest one present, so that the
    data's vocabulary is the model's (engine/data/shards.py infers it): nanoGPT's headerless
    uint16 train.bin/val.bin (the largest id + 1) up to 65536 ids, llm.c's uint32 shards
    (Llama 3's 128256) above. Written once into the temp folder, each file whole or not at all."""
    import numpy as np
    from ringpipe.engine.data import shards
    folder = os.path.join(tempfile.gettempdir(), f"ringpipe-memory-bench-tokens-{vocab}")
    wide = vocab > 2**16
    names = {split: f"tok_{split}.bin" if wide else f"{split}.bin" for split in ("train", "val")}
    if os.path.exists(os.path.join(folder, names["val"])):
        return folder
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 1_000_000), ("val", 100_000)):
        ids = rng.integers(0, vocab, size=n)
        ids[0] = vocab - 1
        path = os.path.join(folder, names[split])
        if wide:
            shards.write_shard(path, ids, vocab)
        else:
            tmp = os.path.join(folder, f".{names[split]}.tmp")
            ids.astype(np.uint16).tofile(tmp)
            os.replace(tmp, path)
    return folder


def config_for(shape, ranks, zero, recompute, rows, seq, steps, out, data, model="gpt"):
    settings = dict(model=model, data=data, seq_len=seq, batch_size=rows * ranks, steps=steps,
                    zero=int(zero), recompute=recompute, out=out, overwrite=True, eval_batches=1,
                    eval_every=steps,     # validation at the last step only: not in the steps measured
                    sample_tokens=0, quiet=True, warmup=1)
    settings.update(shape)
    return settings


def _tree(root):
    """root and every process below it (mpiexec, its proxy, the ranks: each rank in a
    process group of its own, so a group kill would miss them)."""
    parent = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    parent[int(pid)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def kill_tree(root):
    for pid in sorted(_tree(root), reverse=True):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class Watch:
    """--largest: kill the run (mpiexec and every rank) when its summed RSS passes `limit`."""

    def __init__(self, proc, limit):
        self.proc, self.limit, self.killed, self.peak = proc, limit, False, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _tree_rss(self):
        total = 0
        for pid in _tree(self.proc.pid):
            try:
                with open(f"/proc/{pid}/statm") as fh:
                    total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                continue
        return total

    def _run(self):
        while self.proc.poll() is None:
            rss = self._tree_rss()
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.killed = True
                kill_tree(self.proc.pid)
                return
            time.sleep(0.1)


def run_child(spec, ranks, limit=None, timeout=None):
    """mpiexec -n RANKS this script --child; its result (rank 0's JSON) and how it went."""
    fd, result = tempfile.mkstemp(prefix="memory-bench-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, **{v: "1" for v in THREAD_VARS})
    # The kernel's OOM killer, if it must kill something, takes a benchmark rank first.
    def pre():
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000")
    t0 = time.perf_counter()
    proc = subprocess.Popen([MPIEXEC, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--child",
                             json.dumps(spec), result], cwd=ROOT, env=env, preexec_fn=pre,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = Watch(proc, limit) if limit else None
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        output, _ = proc.communicate()
        output += "\n(timed out)"
    wall = time.perf_counter() - t0
    try:
        with open(result) as fh:
            out = json.load(fh) if proc.returncode == 0 and os.path.getsize(result) else None
    finally:
        os.unlink(result)
    return out, {"exit": proc.returncode, "wall_s": wall, "killed": bool(watch and watch.killed),
                 "tree_peak_rss": watch.peak if watch else None, "output_tail": output[-2000:]}


def summarise(out, ranks, zero, recompute, psi):
    """One row from a child's result."""
    peaks = [r["peak_rss_bytes"] for r in out["ranks"]]
    middle = [s for s in out["ranks"][0]["steps"][1:-1]] or out["ranks"][0]["steps"][-1:]
    step_s = statistics.median(s["step_s"] for s in middle)
    sent = []
    for r in out["ranks"]:
        st = r["steps"]
        deltas = [st[i]["sent_bytes"] - st[i - 1]["sent_bytes"] for i in range(1, len(st) - 1)]
        if not deltas and len(st) >= 2:
            deltas = [st[-1]["sent_bytes"] - st[-2]["sent_bytes"]]
        sent.append(statistics.median(deltas) if deltas else 0)
    z = int(zero)
    factor = 3 if z == 3 else 2
    formula = factor * 4 * psi * (ranks - 1) / ranks
    predicted = out["predicted"]["total"]
    return {"ranks": ranks, "zero": z, "recompute": recompute, "peak_gib": max(peaks) / 2**30,
            "predicted_gib": predicted / 2**30, "ratio": max(peaks) / predicted,
            "peak_phase": out["predicted"]["peak_phase"], "tokens_per_s": out["items_per_step"] / step_s,
            "step_s": step_s, "sent_mib": max(sent) / 2**20, "formula_mib": formula / 2**20,
            "sent_over_formula": max(sent) / formula if formula else None, "comm_factor": factor,
            "peaks_gib": [p / 2**30 for p in peaks], "predicted": out["predicted"],
            "losses": [s["loss"] for s in out["ranks"][0]["steps"]]}


COLUMNS = [("ranks", "ranks", "d"), ("zero", "zero", "d"), ("recompute", "recompute", ""),
           ("predicted_gib", "predicted GiB", ".2f"), ("peak_gib", "peak RSS GiB", ".2f"),
           ("ratio", "measured/pred", ".3f"), ("peak_phase", "peak phase", ""),
           ("tokens_per_s", "tokens/s", ".1f"), ("vs_zero1", "vs ZeRO-1", ".2f"),
           ("sent_mib", "sent MiB/step", ".1f"), ("formula_mib", "formula MiB", ".1f"),
           ("sent_over_formula", "sent/formula", ".3f")]


def sweep(args):
    data = token_folder()
    shape = QUICK_SHAPE if args.quick else {"preset": "gpt2-124m"}
    rows = []
    best = {}
    for n in range(args.rounds):
        for ranks in args.ranks:
            for zero in args.zero:
                for recompute in args.recompute:
                    with tempfile.TemporaryDirectory(prefix="memory-bench-run-") as out_dir:
                        spec = {"config": config_for(shape, ranks, zero, recompute, args.rows, args.seq,
                                                     args.steps, out_dir, data)}
                        out, how = run_child(spec, ranks, timeout=args.timeout)
                    key = (ranks, zero, recompute)
                    if out is None:
                        print(f"# {key}: failed (exit {how['exit']})\n{how['output_tail']}", flush=True)
                        best.setdefault(key, None)
                        continue
                    psi = out["params_rank"] * 1.0
                    r = summarise(out, ranks, zero, recompute, psi)
                    r.update(round=n + 1, wall_s=how["wall_s"], params=out["params_rank"])
                    print(f"# round {n + 1}: {ranks} ranks, zero {zero}, recompute {recompute}: peak "
                          f"{r['peak_gib']:.2f} GiB, predicted {r['predicted_gib']:.2f} ({r['ratio']:.3f}x), "
                          f"{r['tokens_per_s']:.1f} tokens/s, {r['wall_s']:.0f} s", flush=True)
                    prev = best.get(key)
                    r["rounds_step_s"] = (prev["rounds_step_s"] if prev else []) + [r["step_s"]]
                    if prev is None or r["step_s"] < prev["step_s"]:
                        best[key] = r                    # each setting's least disturbed round
                    else:
                        prev["rounds_step_s"] = r["rounds_step_s"]
    for key, r in best.items():
        if r is None:
            continue
        base = best.get((key[0], "1", "none"))
        r["vs_zero1"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        rows.append(r)
    print(table(rows, COLUMNS))
    return rows


def largest(args):
    """The largest preset that trains (three steps) at the most --ranks under each setting:
    the presets from the largest down, those predicted not to fit skipped, the first that
    trains is the answer (one killed at the memory limit counts as not fitting)."""
    from ringpipe.engine.train import memory
    from ringpipe.engine.train.config import Config, model_config
    available = memory.mem_available() or 0
    ranks = max(args.ranks)
    found = []
    for family, presets in (("gpt", GPT_PRESETS), ("llama", LLAMA_PRESETS)):
        if family not in args.families:
            continue
        for zero in args.zero:
            for recompute in args.recompute:
                fits = None
                for preset in reversed(presets):
                    settings = config_for({"preset": preset}, ranks, zero, recompute, args.rows, args.seq, 3,
                                          "/tmp/unused", None, model=family)
                    cfg = Config(**settings)
                    shape = model_config(cfg, vocab=GPT2_VOCAB if family == "gpt" else None)
                    settings["data"] = token_folder(shape.vocab)
                    predicted = memory.predict(cfg, shape, args.seq, ranks).total
                    row = {"family": family, "framework": "ringpipe", "zero": int(zero), "recompute": recompute,
                           "preset": preset, "predicted_gib": predicted / 2**30, "ranks": ranks}
                    if predicted * ranks > available - MARGIN:
                        row.update(result="skipped: predicted x ranks exceeds MemAvailable")
                        print(f"# {family} {preset} zero {zero} {recompute}: {row['result']} "
                              f"({predicted / 2**30:.2f} GiB a rank)", flush=True)
                        found.append(row)
                        continue
                    with tempfile.TemporaryDirectory(prefix="memory-bench-run-") as out_dir:
                        settings["out"] = out_dir
                        out, how = run_child({"config": settings}, ranks, limit=available - MARGIN,
                                             timeout=args.timeout)
                    if out is None:
                        row.update(result="killed at the memory limit" if how["killed"] else f"failed (exit {how['exit']})",
                                   tree_peak_gib=(how["tree_peak_rss"] or 0) / 2**30, tail=how["output_tail"][-500:])
                        print(f"# {family} {preset} zero {zero} {recompute}: {row['result']}", flush=True)
                        found.append(row)
                        continue
                    peak = max(r["peak_rss_bytes"] for r in out["ranks"])
                    row.update(result="trains", peak_gib=peak / 2**30, ratio=peak / out["predicted"]["total"],
                               wall_s=how["wall_s"])
                    print(f"# {family} {preset} zero {zero} {recompute}: trains, peak {peak / 2**30:.2f} GiB per "
                          f"rank (predicted {predicted / 2**30:.2f}), {how['wall_s']:.0f} s", flush=True)
                    found.append(row)
                    fits = preset
                    break
                print(f"largest {family} at {ranks} ranks, zero {zero}, recompute {recompute}: {fits or 'none'}",
                      flush=True)
    if "fsdp" in args.families:
        found += fsdp_largest(args, ranks, available)
    return found


def fsdp_largest(args, ranks, available):
    """PyTorch FSDP (gloo, CPU) on the GPT presets at `ranks`, smallest first, until one does
    not train within the machine's memory (killed as the ringpipe runs are)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("# PyTorch FSDP: torch or transformers is not installed: skipped")
        return []
    rows = []
    for preset in GPT_PRESETS:
        spec = {"framework": "fsdp", "preset": preset, "rows": args.rows, "seq": args.seq, "steps": 3,
                "port": 29500 + os.getpid() % 1000}
        out, how = run_child(spec, ranks, limit=available - MARGIN, timeout=args.timeout)
        row = {"family": "gpt", "framework": "torch-fsdp", "preset": preset, "ranks": ranks}
        if out is None:
            row.update(result="killed at the memory limit" if how["killed"] else f"failed (exit {how['exit']})",
                       tail=how["output_tail"][-500:])
            print(f"# FSDP {preset}: {row['result']}", flush=True)
            rows.append(row)
            break
        row.update(result="trains", peak_gib=max(out["peaks"]) / 2**30, step_s=statistics.median(out["step_times_s"][1:]),
                   torch=out["torch"])
        print(f"# FSDP {preset}: trains, peak {row['peak_gib']:.2f} GiB per rank, step {row['step_s']:.1f} s", flush=True)
        rows.append(row)
    return rows


def baseline(args):
    """The fixed overhead: a 1-layer, 64-wide GPT's peak minus its prediction without it."""
    from ringpipe.engine.train import memory
    rows = []
    for ranks in sorted({1, *args.ranks}):
        with tempfile.TemporaryDirectory(prefix="memory-bench-run-") as out_dir:
            shape = {"layers": 1, "d_model": 64, "heads": 2, "context": 64}
            spec = {"config": config_for(shape, ranks, 0, "none", 2, 64, 3, out_dir, "synthetic")}
            out, how = run_child(spec, ranks, timeout=args.timeout)
        if out is None:
            print(f"# {ranks} ranks failed\n{how['output_tail']}")
            continue
        peak = max(r["peak_rss_bytes"] for r in out["ranks"])
        model = out["predicted"]["total"] - memory.FIXED_OVERHEAD_BYTES
        rows.append({"ranks": ranks, "peak_mib": peak / 2**20, "model_mib": model / 2**20,
                     "overhead_mib": (peak - model) / 2**20})
    print(table(rows, [("ranks", "ranks", "d"), ("peak_mib", "peak MiB", ".1f"), ("model_mib", "model MiB", ".1f"),
                       ("overhead_mib", "fixed overhead MiB", ".1f")]))
    print(f"FIXED_OVERHEAD_BYTES now: {memory.FIXED_OVERHEAD_BYTES / 2**20:.0f} MiB")
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int_list(1), default=None, help="rank counts (default 2,4; --quick 2)")
    p.add_argument("--zero", type=choice_list(ZERO), default=None, help="ZeRO stages (default 0,1,2,3; --quick 0,1)")
    p.add_argument("--recompute", type=choice_list(RECOMPUTE), default=None,
                   help="recomputation modes (default none,selective,full; --quick none)")
    p.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--rows", type=positive_int, default=2, help="sequences per rank and step (default 2)")
    p.add_argument("--steps", type=positive_int, default=None, help="steps per run, at least 3 (default 4; --quick 3)")
    p.add_argument("--rounds", type=positive_int, default=1, help="alternating passes over the settings (default 1)")
    p.add_argument("--timeout", type=positive_int, default=1800, help="seconds a run may take (default 1800)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a tiny GPT (2 x 64) at 2 ranks, ZeRO 0/1: a smoke test")
    mode.add_argument("--largest", action="store_true", help="the largest preset that trains at the most --ranks")
    mode.add_argument("--baseline", action="store_true", help="measure the fixed overhead")
    p.add_argument("--families", type=choice_list(("gpt", "llama", "fsdp")), default=["gpt", "llama", "fsdp"],
                   help="with --largest: what to search, gpt and llama (ringpipe's presets) and fsdp (PyTorch FSDP, "
                        "gloo, CPU, on the GPT presets, if torch is installed) (default gpt,llama,fsdp)")
    p.add_argument("--json", type=output_path, default=None, help="write the results here")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    quick = args.quick
    args.ranks = args.ranks or ([2] if quick else ([4] if args.largest else [2, 4]))
    args.zero = list(dict.fromkeys(args.zero or (["0", "1"] if quick else list(ZERO))))
    args.recompute = list(dict.fromkeys(args.recompute or (["none"] if quick else list(RECOMPUTE))))
    args.steps = args.steps or (3 if quick else 4)
    if args.steps < 3:
        p.error("argument --steps: at least 3 (the first and the last step are not timed)")
    if quick and args.seq > QUICK_SHAPE["context"]:
        p.error(f"argument --seq: {args.seq} exceeds the quick model's context {QUICK_SHAPE['context']}")
    if max(args.ranks) > 8:
        p.error("argument --ranks: at most 8 on this machine")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child_main(*args.child)
    meta = {"benchmark": "memory", "seq": args.seq, "rows_per_rank": args.rows, "steps": args.steps,
            "ranks": args.ranks, "zero": args.zero, "recompute": args.recompute, "quick": args.quick,
            "machine_mem_available": None, "date": time.strftime("%Y-%m-%d")}
    from ringpipe.engine.train import memory
    meta["machine_mem_available"] = memory.mem_available()
    meta["fixed_overhead_bytes"] = memory.FIXED_OVERHEAD_BYTES
    if args.baseline:
        result = {**meta, "mode": "baseline", "rows": baseline(args)}
    elif args.largest:
        result = {**meta, "mode": "largest", "rows": largest(args)}
    else:
        print(f"# memory per rank: {'quick GPT 2 x 64' if args.quick else 'GPT-2 124M shape'} | {args.rows} x "
              f"{args.seq} tokens per rank and step | float32 AdamW | {args.steps} steps | ranks {args.ranks}",
              flush=True)
        result = {**meta, "mode": "sweep", "rows": sweep(args)}
        worst = max((abs(r["ratio"] - 1) for r in result["rows"]), default=0)
        print(f"largest |measured/predicted - 1|: {worst:.3f}")
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    sys.exit(main())
