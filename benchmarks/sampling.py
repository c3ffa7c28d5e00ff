"""
Sampling speed: ringpipe's generate with the KV cache, without it, and transformers'
generate on the same weights, in the same process, timed alternately.

    python benchmarks/sampling.py                                # small GPT and smollm2-135m's shape
    python benchmarks/sampling.py --models llama --new 16 --rounds 2 --threads 1
    python benchmarks/sampling.py --quick --json /tmp/sampling.json  # tiny shapes (the smoke test)

Every row is greedy decoding (temperature 0) of --new tokens after a --prompt-token
prompt, from random weights (float32). "cached" is generate(cache=True): the prompt in
one pass, then one token per step against the kept keys and values; "uncached" runs the
model over the whole window every step (what `ringpipe sample` did before the cache);
"transformers" is the same weights exported with engine/interop/hf.py, loaded by
AutoModelForCausalLM and run by its generate (do_sample=False, exactly --new tokens,
its own KV cache). The three are timed in alternating order, the order reversed every
round, so a machine that speeds up or slows down shifts them alike; the table shows
medians of --rounds. tokens/s counts the new tokens (prompt processing included in the
time). The thread count (--threads) is set for BLAS, OpenMP, Numba and torch alike
before any of them loads; the BLAS in use is printed and recorded.
The machines here are shared: read the ratios, and rerun before trusting a row.
"""

import argparse
import os
import sys
import tempfile
import time

from _common import choice_list, median, output_path, positive_int, table, write_json

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
MODELS = ("gpt", "llama")
WAYS = ("cached", "uncached", "transformers")
# (family, shape) by size: "full" is what the issue asks to measure, "quick" the smoke test's.
SHAPES = {
    "full": {"gpt": dict(n_layer=6, d_model=384, n_head=6, context=256),
             "llama": "smollm2-135m"},
    "quick": {"gpt": dict(n_layer=2, d_model=32, n_head=4, context=32),
              "llama": "hf-tiny"},
}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=choice_list(MODELS), default=list(MODELS), help="comma list (default: both)")
    ap.add_argument("--prompt", type=positive_int, default=None, help="prompt tokens (default 16; quick 4)")
    ap.add_argument("--new", type=positive_int, default=None, help="new tokens per generate (default 32; quick 4)")
    ap.add_argument("--window", type=positive_int, default=512,
                    help="the context generate slides over (default 512, at most the model's); prompt + new must "
                         "fit in it, so every way sees the whole text")
    ap.add_argument("--rounds", type=positive_int, default=3, help="timed rounds, medians shown (default 3)")
    ap.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1,
                    help="threads for BLAS/OpenMP/Numba and torch alike (default: every core, %(default)s)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers rows")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one round: a smoke test, not a measurement")
    ap.add_argument("--json", metavar="PATH", type=output_path,
                    default="benchmarks/results/2026-12-02-cpu2/sampling.json",
                    help="where the rows go (default %(default)s)")
    args = ap.parse_args(argv)
    args.prompt = args.prompt or (4 if args.quick else 16)
    args.new = args.new or (4 if args.quick else 32)
    if args.quick:
        args.rounds = 1
    if args.prompt + args.new > args.window:
        ap.error(f"--prompt {args.prompt} + --new {args.new} exceed --window {args.window}: raise --window or "
                 "shorten the text (past the window the three ways would not see the same text)")
    return ap, args


def set_threads(n):
    """Before numpy, numba or torch load: they read these once."""
    for var in THREAD_VARS:
        os.environ[var] = str(n)


def blas_info():
    """The BLAS numpy uses: threadpoolctl's report where it is installed, else numpy's config."""
    try:
        from threadpoolctl import threadpool_info
        return [{k: d.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer")}
                for d in threadpool_info() if d.get("user_api") == "blas"]
    except ImportError:
        import numpy as np
        deps = np.show_config(mode="dicts").get("Build Dependencies", {})
        blas = deps.get("blas", {})
        return [{"internal_api": blas.get("name"), "version": blas.get("version"), "source": "numpy.show_config"}]


def build(family, shape):
    """(ringpipe LayerChain with random float32 weights, its config)."""
    import numpy as np
    if family == "gpt":
        from ringpipe.engine.model.gpt import GPTConfig, build_gpt
        cfg = GPTConfig(**shape).validate()
        return build_gpt(cfg, dtype=np.float32, seed=0), cfg
    from ringpipe.engine.model.llama import PRESETS, LlamaConfig, build_llama
    cfg = LlamaConfig(**PRESETS[shape]).validate()
    return build_llama(cfg, dtype=np.float32, seed=0), cfg


def hf_model(model, cfg, family, folder):
    """The same weights as a transformers model: exported by engine/interop/hf.py, loaded back."""
    import torch
    import transformers
    from ringpipe.engine.interop import hf
    out = hf.export_hf(model.params.state_dict(model.params.data), cfg.to_dict(), os.path.join(folder, family),
                       model=family)
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def ways(model, cfg, family, args, folder):
    """{way: call} where call() -> the new token ids."""
    from ringpipe.engine.model.gpt import generate
    prompt = [(7 * i + 3) % cfg.vocab for i in range(args.prompt)]
    window = min(args.window, cfg.context)
    calls = {"cached": lambda: generate(model, prompt, args.new, window, temperature=0, cache=True),
             "uncached": lambda: generate(model, prompt, args.new, window, temperature=0, cache=False)}
    if not args.no_transformers:
        import torch
        theirs = hf_model(model, cfg, family, folder)
        ids = torch.tensor([prompt])

        def transformers_generate():
            with torch.no_grad():
                out = theirs.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0)
            return out[0, len(prompt):].tolist()
        calls["transformers"] = transformers_generate
    return calls


def measure(calls, rounds):
    """({way: [seconds]}, {way: tokens of the warm-up call}), timed alternately."""
    tokens = {way: call() for way, call in calls.items()}      # warm-up: numba, page faults, lazy tables
    times = {way: [] for way in calls}
    order = list(calls)
    for _ in range(rounds):
        for way in order:
            t0 = time.perf_counter()
            calls[way]()
            times[way].append(time.perf_counter() - t0)
        order.reverse()
    return times, tokens


def rows_of(family, cfg, args, folder):
    model, cfg = build(family, cfg)
    times, tokens = measure(ways(model, cfg, family, args, folder), args.rounds)
    shape = (f"{cfg.n_layer}x{cfg.d_model}, {cfg.n_head} heads"
             + (f", {cfg.n_kv_head} kv" if family == "llama" else "") + f", vocab {cfg.vocab}")
    rows = []
    for way, ts in times.items():
        rows.append(dict(model=family, shape=shape, way=way, params=int(model.params.data.size),
                         seconds=median(ts), tokens_per_s=args.new / median(ts), times_s=ts,
                         same_tokens_as_cached=tokens[way] == tokens["cached"]))
    cached = rows[0]["tokens_per_s"]
    for row in rows:
        row["cached_speedup"] = cached / row["tokens_per_s"]
    return rows


def main(argv=None):
    ap, args = parse_args(argv)
    set_threads(args.threads)
    if not args.no_transformers:
        try:
            import torch
            import transformers  # noqa: F401
        except ImportError:
            print("transformers or torch is not installed: its rows are skipped (pip install transformers torch)",
                  file=sys.stderr)
            args.no_transformers = True
        else:
            torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ringpipe-sampling-") as folder:
        for family in args.models:
            rows += rows_of(family, SHAPES["quick" if args.quick else "full"][family], args, folder)
    print(table(rows, [("model", "model", "<"), ("shape", "shape", "<"), ("way", "way", "<"),
                       ("tokens_per_s", "tokens/s", ".1f"), ("cached_speedup", "cached is x faster", ".2f"),
                       ("same_tokens_as_cached", "same tokens", "")]))
    blas = blas_info()
    print(f"(greedy, {args.prompt}-token prompt, {args.new} new tokens, float32; medians of {args.rounds} "
          f"alternating rounds; {args.threads} thread(s); BLAS: {blas})")
    versions = {"numpy": __import__("numpy").__version__}
    if not args.no_transformers:
        import torch
        import transformers
        versions.update(torch=torch.__version__, transformers=transformers.__version__)
    write_json(args.json, dict(benchmark="sampling", quick=args.quick, rows=rows, prompt=args.prompt, new=args.new,
                               rounds=args.rounds, threads=args.threads, blas=blas, versions=versions,
                               cpus=os.cpu_count(), dtype="float32", decoding="greedy"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
