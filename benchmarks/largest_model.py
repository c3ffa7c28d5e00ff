"""The largest model this machine trains, every moment sharded: a Hugging Face folder of a
real model's shape fine-tuned under ZeRO-3, saved sharded, resumed at two other layouts,
exported, and loaded by transformers; each run's memory measured moment by moment.

    python benchmarks/largest_model.py                       # qwen3-0.6b, 4 ranks (~15 min, ~21 GiB)
    python benchmarks/largest_model.py --quick               # a small shape (a smoke test)
    python benchmarks/largest_model.py --json results.json

What it does, in a folder of its own (removed at the end unless --keep):
  1. writes a Hugging Face folder of the preset's shape in bf16 (as a download is), random
     weights, tensor by tensor (never the whole model in memory);
  2. `mpiexec -n R ringpipe train --init-from hf:DIR --zero 3 --dp R ... --memory-report`,
     a checkpoint every step (sharded);
  3. resumes that checkpoint at `--tp 2 --zero 3` and at `--pp 2 --zero 3` (each a step more);
  4. `ringpipe export`s the last checkpoint and loads it with transformers (when installed),
     comparing its logits with ringpipe's on a few tokens.
Each run's `--memory-report` moments (start-up, import, resume, steps, save: the largest
rank's peak within each) are collected into one table against the steady state, with the
machine's memory and the job's total beside them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import table, write_json  # noqa: E402

RINGPIPE = [shutil.which("ringpipe") or "ringpipe"]
ROW = re.compile(r"^\s{2}(\S.*?)\s{2,}([\d.]+) (MiB|GiB)\s+([\d.]+|-)\s+(?:([\d.]+) (MiB|GiB)|-)\s*$")


def mib(value, unit):
    return float(value) * (1024 if unit == "GiB" else 1)


def write_folder(preset: str, folder: str, overrides: dict) -> dict:
    """A Hugging Face folder of the preset's shape, bf16, tensor by tensor. Returns config.json."""
    from ringpipe.engine.interop import hf_llama
    from ringpipe.engine.model.llama import PRESETS, LlamaConfig, llama_layers
    cfg = LlamaConfig(**{**PRESETS[preset], **overrides}).validate()
    specs = {s.name: s for layer in llama_layers(cfg) for s in layer.specs()}
    names = hf_llama.name_map(cfg)
    header, offset = {}, 0
    for ours, theirs in names:
        shape = hf_llama.shape_of(cfg, ours, cfg.vocab)
        size = math.prod(shape) * 2
        header[theirs] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.safetensors"), "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for ours, theirs in names:
            spec = specs[ours]
            shape = hf_llama.shape_of(cfg, ours, cfg.vocab)
            rng = np.random.default_rng(zlib.crc32(theirs.encode()))
            values = (np.ones(shape, np.float32) if spec.init == "ones" else
                      rng.normal(0, spec.std, shape).astype(np.float32))
            bits = values.view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")   # to bf16, nearest even
            fh.write(rounded.tobytes())
    config = hf_llama.hf_config(cfg, None, None)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    return config


def write_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer.json of exactly `vocab` ids ("t0", "t1", ..., "<|endoftext|>"): what ties the
    data's vocabulary to the model's (a real model brings its own)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = {f"t{i}": i for i in range(vocab - 1)}
    words["<|endoftext|>"] = vocab - 1          # documents' separator (the data's checks want one)
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(path)


def write_tokens(folder: str, vocab: int, n: int = 1 << 20) -> None:
    """Token shards in llm.c's llama-3 format (uint32; no tokenizer, so the model's vocabulary is
    the data's bound): words of a small random vocabulary over the model's ids, so the loss falls."""
    rng = np.random.default_rng(0)
    words = [rng.integers(0, vocab, size=rng.integers(2, 7)) for _ in range(64)]
    tokens = np.concatenate([words[i] for i in rng.integers(0, len(words), size=n // 4)])[:n].astype("<u4")
    os.makedirs(folder, exist_ok=True)
    write_tokenizer(os.path.join(folder, "tokenizer.json"), vocab)
    cut = len(tokens) * 9 // 10
    for split, part in (("train", tokens[:cut]), ("val", tokens[cut:])):
        header = np.zeros(256, dtype="<i4")
        header[:3] = (20240801, 7, len(part))
        with open(os.path.join(folder, f"tok_{split}_000000.bin"), "wb") as fh:
            fh.write(header.tobytes() + part.tobytes())


def moments(output: str) -> list[dict]:
    """The `memory per moment` table of a run's output."""
    rows, inside = [], False
    for line in output.splitlines():
        if line.startswith("memory per moment"):
            inside = True
            continue
        if inside:
            m = ROW.match(line)
            if not m:
                if line.strip().startswith("moment"):
                    continue
                inside = False
                continue
            name, value, unit, ratio, pvalue, punit = m.groups()
            rows.append({"moment": name.strip(), "measured_mib": mib(value, unit),
                         "x_steady": None if ratio == "-" else float(ratio),
                         "predicted_mib": mib(pvalue, punit) if pvalue else None})
    return rows


def train(ranks: int, flags: list, env: dict, what: str) -> tuple[str, float]:
    cmd = ["mpiexec", "-n", str(ranks), *RINGPIPE, "train", *flags]
    print(f"$ mpiexec -n {ranks} ringpipe train {' '.join(flags)}", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"{what} failed (exit {done.returncode})")
    return done.stdout + done.stderr, wall


def transformers_check(folder: str) -> dict:
    """Load the export with transformers; a forward pass on a few tokens must be finite."""
    script = f"""
import json, sys, numpy as np, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({folder!r}, torch_dtype=torch.float32)
tokens = [1, 5, 9, 42, 7, 3, 11, 100]
with torch.no_grad():
    theirs = model(torch.tensor([tokens])).logits[0].numpy()
print(json.dumps({{"class": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
                  "logits_finite": bool(np.isfinite(theirs).all())}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if done.returncode != 0:
        return {"loaded": False, "why": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), loaded=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-0.6b", help="a Llama-family preset (default qwen3-0.6b)")
    p.add_argument("--ranks", type=int, default=4, help="ranks of the fine-tune (default 4)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="a small shape (2 layers, d 256): a smoke test")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    overrides = dict(n_layer=2, d_model=256, n_head=4, n_kv_head=2, d_ff=512, head_dim=64, vocab=4096) \
        if args.quick else {}
    ranks = args.ranks
    work = tempfile.mkdtemp(prefix="ringpipe-largest-")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    results = {"preset": args.preset, "overrides": overrides, "ranks": ranks, "seq_len": args.seq_len,
               "machine_mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, "runs": []}
    try:
        folder = os.path.join(work, "hf")
        t0 = time.perf_counter()
        config = write_folder(args.preset, folder, overrides)
        results["folder_bytes"] = os.path.getsize(os.path.join(folder, "model.safetensors"))
        results["folder_s"] = time.perf_counter() - t0
        print(f"wrote {folder}: {config.get('model_type')} "
              f"{results['folder_bytes'] / 2**30:.2f} GiB of bf16 in {results['folder_s']:.0f} s", flush=True)
        data = os.path.join(work, "data")
        write_tokens(data, config["vocab_size"])
        common = ["--model", "llama", "--data", data, "--seq-len", str(args.seq_len), "--batch-size", "4",
                  "--memory-report", "--sample-tokens", "0", "--eval-batches", "1", "--no-keep-best"]
        first = os.path.join(work, "first")
        runs = [("fine-tune", ranks, ["--init-from", f"hf:{folder}", "--dp", str(ranks), "--zero", "3",
                                      "--steps", "2", "--eval-every", "2", "--checkpoint-every", "1", "--out", first])]
        ckpt = os.path.join(first, "checkpoints", "ckpt_00000002.json")
        half = max(1, ranks // 2)
        runs.append(("resume tp2", ranks, ["--resume", ckpt, "--tp", "2", "--dp", str(half), "--zero", "3",
                                           "--steps", "3", "--eval-every", "3", "--out", os.path.join(work, "tp2")]))
        runs.append(("resume pp2", ranks, ["--resume", ckpt, "--pp", "2", "--dp", str(half), "--zero", "3",
                                           "--microbatches", "2", "--recompute", "full", "--steps", "3",
                                           "--eval-every", "3", "--out", os.path.join(work, "pp2")]))
        for what, n, flags in runs:
            output, wall = train(n, common + flags, env, what)
            rows = moments(output)
            results["runs"].append({"run": what, "flags": flags, "wall_s": wall, "moments": rows})
            print(f"\n{what} ({wall:.0f} s):")
            print(table(rows, [("moment", "moment", "s"), ("measured_mib", "MiB a rank", ".0f"),
                               ("x_steady", "x steady", ".2f"), ("predicted_mib", "predicted MiB", ".0f")]))
            print(f"  the job: {max(r['measured_mib'] for r in rows) * n / 1024:.1f} GiB at its peak moment "
                  f"(x {n} ranks) on a {results['machine_mem_gib']:.1f} GiB machine", flush=True)
        out = os.path.join(work, "export")
        done = subprocess.run([*RINGPIPE, "export", os.path.join(work, "tp2"), "--out", out],
                              capture_output=True, text=True, env=env)
        results["export"] = {"ok": done.returncode == 0, "tail": (done.stdout + done.stderr)[-300:]}
        if done.returncode == 0:
            results["export"]["transformers"] = transformers_check(out)
        print(f"\nexport: {results['export']}")
        worst = max((r["x_steady"] or 0) for run in results["runs"] for r in run["moments"])
        results["largest_x_steady"] = worst
        print(f"largest moment against its run's steady state: {worst:.2f}x")
    finally:
        if args.json:
            write_json(args.json, results)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
