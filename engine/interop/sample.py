"""`ringpipe sample RUN_DIR_OR_CHECKPOINT --prompt TEXT`: text from a trained GPT.

The checkpoint (a run directory, its checkpoints folder or a ckpt_*.json) gives
the weights and the model's shape; the run's tokenizer (OUT/tokenizer.json, as
its manifest names it) encodes the prompt and decodes the continuation. One
process, on the CPU: every layout's checkpoint holds the whole model. The recipe's
generate keeps a KV cache, so each new token is one token's forward pass (the tokens
are the full-window path's: engine/model/gpt.py generate).

The model's shape is the manifest's model_config, checked against the shapes the
npz declares before the model is built (a manifest can declare any size; the npz
holds what it holds). A run directory's newest valid checkpoint is used; if newer
ones are damaged, a note on stderr names them and says why they were skipped.

A prompt that is not valid UTF-8 (bytes the shell passed as they are, which Python
holds as surrogate escapes): the byte tokenizer encodes those bytes as they are,
and the prompt is echoed with U+FFFD in their place; a BPE tokenizer encodes text,
so such a prompt is refused.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def load_run(path: str, notes=None):
    """(LayerChain of the checkpoint's family with its weights, its Tokenizer, checkpoint path).
    notes: a list to which a note about skipped newer checkpoints is appended."""
    from ringpipe.engine.job import checkpoint
    from ringpipe.engine.model.chain import LayerChain
    from ringpipe.engine.interop.hf import check_checkpoint_shapes
    from ringpipe.engine.model.registry import RECIPES
    resolved, note = checkpoint.resolve_with_note(path)
    if note and notes is not None:
        notes.append(note)
    manifest, declared = checkpoint.declared_arrays(resolved)
    if RECIPES[manifest["model"]].generate is None:       # the checkpoint's check knows every family
        raise ValueError(f"{resolved} holds a {manifest['model']} model: only a GPT generates text")
    # model_config against the npz's declared shapes and the memory, before the model is built.
    cfg = check_checkpoint_shapes(manifest, declared, resolved)
    # Not initialised: every parameter is loaded from the checkpoint just below.
    model = LayerChain(RECIPES[manifest["model"]].layers(cfg), dtype=np.float32)
    wanted = {f"param/{s.name}": s.shape for s in model.params.specs}
    arrays, _ = checkpoint.load(resolved, expected=wanted)
    model.params.load_flat(model.params.data, {k[6:]: v for k, v in arrays.items()})
    return model, run_tokenizer(resolved, manifest), resolved


def run_tokenizer(checkpoint_path: str, manifest: dict):
    """The tokenizer a checkpoint's run trained with: the file its manifest names
    (checked by hash), or the byte tokenizer for byte-level runs from before runs
    recorded theirs."""
    from ringpipe.engine.data.tokenizer import load_tokenizer
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint_path)))
    entry = manifest.get("tokenizer")
    if entry is None:
        if manifest["model_config"]["vocab"] == 256:
            return load_tokenizer("bytes")
        raise ValueError(f"{checkpoint_path} records no tokenizer and its vocabulary is not bytes: nothing can "
                         "decode its tokens")
    from ringpipe.engine.job import files
    from ringpipe.engine.data.tokenizer import from_json
    path = os.path.join(run_dir, entry["file"])
    if not os.path.lexists(path):
        raise ValueError(f"the run's tokenizer {path} is missing (the checkpoint names it): copy it back from the "
                         "data folder the run trained on")
    # Read through engine/files: a FIFO, a device, a huge file or JSON nested too deeply is
    # refused naming the file (load_tokenizer would block, read forever or overflow).
    raw = files.read_regular(path, "the run's tokenizer", 256 * files.MiB)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the run's tokenizer {path} is not UTF-8 text (byte {e.start}); copy it back from the "
                         "data folder the run trained on") from None
    files.parse_json(text, f"the run's tokenizer {path}")
    tokenizer = from_json(text, source=path, folder=os.path.dirname(path))
    if tokenizer.sha256 != entry["sha256"]:
        raise ValueError(f"{path} is not the tokenizer the checkpoint was trained with (sha256 differs)")
    return tokenizer


# --temperature: 0 is greedy; below MIN_TEMPERATURE the likeliest token wins every draw
# anyway (and below ~1e-308 the logits' differences / T overflow); above MAX_TEMPERATURE
# every token is about as likely as any other (the text is noise).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
MAX_SEED = 2**63 - 1        # as ringpipe train's <seed> (engine/train/ranges.py): what an int64 holds


def main(argv=None, prog="ringpipe sample") -> int:
    from ringpipe.engine.model.gpt import MAX_NEW_TOKENS
    p = argparse.ArgumentParser(prog=prog, description="Generate text from a trained ringpipe GPT or Llama-family model.",
                                epilog="Example: ringpipe sample runs/gpt --prompt 'def main(' --tokens 200")
    p.add_argument("path", nargs="?", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (its latest valid checkpoint), a checkpoints folder or a ckpt_*.json")
    p.add_argument("--checkpoint", default=None, metavar="RUN_DIR_OR_CHECKPOINT",
                   help="the same, as an option (give one of the two)")
    p.add_argument("--prompt", default="", help="text to continue (default: the start of a document)")
    p.add_argument("--tokens", type=int, default=200,
                   help=f"tokens to generate, 1 to {MAX_NEW_TOKENS:,} (default 200); printed as they come, and "
                        "Ctrl-C ends the text there")
    p.add_argument("--temperature", type=float, default=0.8,
                   help=f"0: always the likeliest token; else {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g} (default 0.8)")
    p.add_argument("--seed", type=int, default=0, help="the draws' seed, a whole number >= 0 (default 0)")
    args = p.parse_args(argv)
    if (args.path is None) == (args.checkpoint is None):
        p.error("give the run directory or checkpoint once: ringpipe sample RUN_DIR --prompt TEXT")
    args.checkpoint = args.checkpoint or args.path
    if not 1 <= args.tokens <= MAX_NEW_TOKENS:
        p.error(f"--tokens must be 1 to {MAX_NEW_TOKENS:,} (got {args.tokens}); the tokens are printed as they "
                "come, and Ctrl-C ends the text early")
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature <= MAX_TEMPERATURE):
        p.error(f"--temperature must be 0 (always the likeliest token) or {MIN_TEMPERATURE:g} to "
                f"{MAX_TEMPERATURE:g} (got {args.temperature}): below {MIN_TEMPERATURE:g} the likeliest token wins "
                f"every draw anyway, above {MAX_TEMPERATURE:g} every token is about as likely")
    if not 0 <= args.seed <= MAX_SEED:
        p.error(f"--seed must be a whole number from 0 to 2^63 - 1 (got {args.seed}): it seeds numpy's generator")
    from ringpipe.engine.job import checkpoint
    from ringpipe.engine.model.registry import RECIPES
    notes = []          # said whether the checkpoint then loads or not: it explains either outcome
    try:
        model, tokenizer, path = load_run(args.checkpoint, notes)
    except (checkpoint.CheckpointError, ValueError, OSError) as e:
        print("".join(f"{note}\n" for note in notes) + f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, file=sys.stderr)
    try:
        ids, shown = prompt_ids(args.prompt, tokenizer)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    manifest = checkpoint.read_manifest(path)           # load_run checked it: its family generates text
    generate = RECIPES[manifest["model"]].generate
    return stream_sample(lambda on_token: generate(model, ids, args.tokens, manifest["model_config"]["context"],
                                                   temperature=args.temperature, seed=args.seed, on_token=on_token),
                         tokenizer, shown, args.tokens)


def stream_sample(generate, tokenizer, prompt_shown: str, wanted: int, out=None) -> int:
    """Print the prompt, then each token's text as generate(on_token) draws it (flushed,
    so a long sample shows as it grows). Ctrl-C ends it there: the text so far stays
    printed, a note on stderr says how far it got, and the exit code is 130 (the shell's
    for Ctrl-C). A reader that stops reading (`| head`) ends it quietly."""
    out = out or sys.stdout
    text = TextStream(tokenizer, out)
    try:
        out.write(prompt_shown)
        out.flush()
        generate(text.add)
        text.finish()
        return 0
    except KeyboardInterrupt:
        text.finish()
        print(f"interrupted (Ctrl-C) after {text.count} of {wanted} tokens", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader has what it wanted; later writes (Python's own flush at exit) go nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0


class TextStream:
    """The text of token ids printed as they come. A token's text alone can be part of a
    character (a byte of UTF-8) or change with its neighbours (a tokenizer's spaces), so
    the ids since the last line end are decoded together, and what their text adds is
    printed once it does not end in a partial character (U+FFFD). At a line end, or past
    WINDOW ids, it starts again from the last CONTEXT ids: each token costs the decoding
    of at most WINDOW ids, however long the sample."""

    WINDOW, CONTEXT = 256, 8

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list = []            # the ids decoded together
        self.printed = 0               # characters of their text already printed
        self.count = 0                 # tokens received

    def add(self, token: int) -> None:
        self.ids.append(int(token))
        self.count += 1
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return                     # a character not whole yet: its next bytes come with the next ids
        self._write(text[self.printed:])
        if text.endswith("\n") or len(self.ids) > self.WINDOW:
            self.ids = self.ids[-self.CONTEXT:] if not text.endswith("\n") else []
            self.printed = len(self.tokenizer.decode(self.ids)) if self.ids else 0
        else:
            self.printed = len(text)

    def finish(self) -> None:
        """The rest (a character cut off at the end shows as U+FFFD), and the line's end."""
        text = self.tokenizer.decode(self.ids) if self.ids else ""
        self._write(text[self.printed:] + "\n")
        self.ids, self.printed = [], 0

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


def prompt_ids(prompt: str, tokenizer):
    """(the prompt's token ids, the prompt as printed). argv bytes that are not UTF-8 reach
    Python as surrogate escapes (U+DC80..U+DCFF): the byte tokenizer encodes the bytes as
    they were given, and they print as U+FFFD; a BPE tokenizer encodes only text, so
    such a prompt is refused (encoding it would raise deep in the tokenizer)."""
    if not prompt:
        return list(tokenizer.separator), ""
    try:
        raw = prompt.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError as e:        # a lone surrogate that stands for no byte
        raise ValueError(f"--prompt holds U+{ord(prompt[e.start]):04X} at position {e.start}, which is not a "
                         "character: pass the prompt as UTF-8 text") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if tokenizer.kind != "bytes":
            raise ValueError(f"--prompt is not valid UTF-8 text (byte 0x{raw[e.start]:02x} at position {e.start}); "
                             f"the run's tokenizer ({tokenizer.source}) encodes text only: pass the prompt as "
                             "UTF-8") from None
        return list(raw), raw.decode("utf-8", errors="replace")
    return list(tokenizer.encode(prompt)), prompt


if __name__ == "__main__":
    sys.exit(main())
