"""`ringpipe sample RUN_DIR_OR_CHECKPOINT --prompt TEXT`: text from a trained GPT.

The checkpoint (a run directory, its checkpoints folder or a ckpt_*.json) gives
the weights and the model's shape; the run's tokenizer (OUT/tokenizer.json, as
its manifest names it) encodes the prompt and decodes the continuation. One
process, on the CPU: every layout's checkpoint holds the whole model.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def load_run(path: str):
    """(GPT LayerChain with the checkpoint's weights, its Tokenizer, checkpoint path)."""
    from ringpipe.engine import checkpoint
    from ringpipe.engine.gpt import GPTConfig, build_gpt, checkpoint_vocab_rows, fit_vocab_rows
    resolved = checkpoint.resolve(path)
    manifest = checkpoint.read_manifest(resolved)
    if manifest["model"] != "gpt":
        raise ValueError(f"{resolved} holds a {manifest['model']} model: only a GPT generates text")
    cfg = GPTConfig(**manifest["model_config"])
    model = build_gpt(cfg, dtype=np.float32)
    wanted = {f"param/{s.name}": s.shape for s in model.params.specs}
    wanted["param/wte"] = (checkpoint_vocab_rows(cfg, manifest), cfg.d_model)
    arrays, _ = checkpoint.load(resolved, expected=wanted)
    arrays = fit_vocab_rows(arrays, cfg, cfg.padded_vocab)
    model.params.load_flat(model.params.data, {k[6:]: v for k, v in arrays.items()})
    return model, run_tokenizer(resolved, manifest), resolved


def run_tokenizer(checkpoint_path: str, manifest: dict):
    """The tokenizer a checkpoint's run trained with: the file its manifest names
    (checked by hash), or the byte tokenizer for byte-level runs from before runs
    recorded theirs."""
    from ringpipe.engine.tokenizer import load_tokenizer
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint_path)))
    entry = manifest.get("tokenizer")
    if entry is None:
        if manifest["model_config"]["vocab"] == 256:
            return load_tokenizer("bytes")
        raise ValueError(f"{checkpoint_path} records no tokenizer and its vocabulary is not bytes: nothing can "
                         "decode its tokens")
    path = os.path.join(run_dir, entry["file"])
    if not os.path.exists(path):
        raise ValueError(f"the run's tokenizer {path} is missing (the checkpoint names it): copy it back from the "
                         "data folder the run trained on")
    tokenizer = load_tokenizer(path)
    if tokenizer.sha256 != entry["sha256"]:
        raise ValueError(f"{path} is not the tokenizer the checkpoint was trained with (sha256 differs)")
    return tokenizer


def main(argv=None, prog="ringpipe sample") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Generate text from a trained ringpipe GPT.",
                                epilog="Example: ringpipe sample runs/gpt --prompt 'def main(' --tokens 200")
    p.add_argument("path", nargs="?", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (its latest valid checkpoint), a checkpoints folder or a ckpt_*.json")
    p.add_argument("--checkpoint", default=None, metavar="RUN_DIR_OR_CHECKPOINT",
                   help="the same, as an option (give one of the two)")
    p.add_argument("--prompt", default="", help="text to continue (default: the start of a document)")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest token (default 0.8)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.path is None) == (args.checkpoint is None):
        p.error("give the run directory or checkpoint once: ringpipe sample RUN_DIR --prompt TEXT")
    args.checkpoint = args.checkpoint or args.path
    if args.tokens < 1 or args.temperature < 0 or not np.isfinite(args.temperature):
        p.error("--tokens must be >= 1 and --temperature a number >= 0")
    from ringpipe.engine import checkpoint
    from ringpipe.engine.gpt import generate
    try:
        model, tokenizer, path = load_run(args.checkpoint)
    except (checkpoint.CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = list(tokenizer.encode(args.prompt)) if args.prompt else list(tokenizer.separator)
    context = model.params.view("wpe").shape[0]
    new = generate(model, ids, args.tokens, context, temperature=args.temperature, seed=args.seed)
    print(args.prompt + tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
