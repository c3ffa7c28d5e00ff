"""Models in and out of the Hugging Face format: ringpipe's GPT is GPT-2.

    export_hf(arrays, model_config, out_dir)   a checkpoint's parameters -> a folder that
                                               transformers.GPT2LMHeadModel.from_pretrained loads
    import_hf(hf_dir)                          a GPT-2 folder (save_pretrained, a local download,
                                               or export_hf's) -> (GPTConfig, {our name: array}, tokenizer.json)
    ringpipe export RUN_DIR --format hf --out HF_DIR      the command line (main)

The architectures are the same: token + learned position embeddings, pre-LayerNorm blocks
(causal self-attention with one fused qkv projection, an MLP 4x wide with GELU in its tanh
approximation, biases on every Linear), a final LayerNorm, the LM head tied to the token
embedding, LayerNorm eps 1e-5. So a conversion is only renaming, transposing and the
vocabulary's padding:

  - GPT-2's Conv1D stores its weight (in, out), our Linear (out, in) like torch.nn.Linear:
    the four matrices of each block are transposed.
  - qkv needs no reordering: both split the 3C outputs as [q | k | v], each C wide, with
    head h in columns h*hs:(h+1)*hs (our reshape(B, T, 3, H, hs) is GPT-2's split(C) and
    view(B, T, H, hs)).
  - our wte has padded_vocab rows (a multiple of 128); GPT-2's has vocab_size. Exports keep
    the first `vocab` rows, imports add the padding back.

Only safetensors files are read or written: a pickle (pytorch_model.bin) can run code when
it is loaded, so it is refused. Needs the `safetensors` package (pip install 'ringpipe[hf]');
never torch or transformers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import sys
import tempfile

import numpy as np

from ringpipe.engine import checkpoint
from ringpipe.engine.gpt import GPTConfig, fit_vocab_rows, gpt_layers
from ringpipe.engine.params import dedup_specs


class HFError(ValueError):
    """A Hugging Face folder, or a model, that cannot be converted; the message says why."""


# ---- the name mapping ----------------------------------------------------------------------

# (our parameter name, GPT-2's name without the "transformer." prefix, transposed?) per block.
_BLOCK_NAMES = [
    ("ln1.w", "ln_1.weight", False),
    ("ln1.b", "ln_1.bias", False),
    ("attn.qkv.w", "attn.c_attn.weight", True),     # ours (3C, C), GPT-2's (C, 3C)
    ("attn.qkv.b", "attn.c_attn.bias", False),
    ("attn.proj.w", "attn.c_proj.weight", True),    # (C, C)
    ("attn.proj.b", "attn.c_proj.bias", False),
    ("ln2.w", "ln_2.weight", False),
    ("ln2.b", "ln_2.bias", False),
    ("mlp.fc.w", "mlp.c_fc.weight", True),          # ours (4C, C), GPT-2's (C, 4C)
    ("mlp.fc.b", "mlp.c_fc.bias", False),
    ("mlp.proj.w", "mlp.c_proj.weight", True),      # ours (C, 4C), GPT-2's (4C, C)
    ("mlp.proj.b", "mlp.c_proj.bias", False),
]

# The prefix GPT2LMHeadModel puts before the base model's names (GPT2Model saves without it).
PREFIX = "transformer."


def name_map(n_layer: int) -> list:
    """[(our name, GPT-2's name without the prefix, transposed?)] for every parameter.
    The LM head is no entry: it is wte in both models (tied)."""
    names = [("wte", "wte.weight", False), ("wpe", "wpe.weight", False)]
    for i in range(n_layer):
        names += [(f"h.{i}.{ours}", f"h.{i}.{theirs}", transposed) for ours, theirs, transposed in _BLOCK_NAMES]
    names += [("ln_f.w", "ln_f.weight", False), ("ln_f.b", "ln_f.bias", False)]
    return names


def _our_shapes(cfg: GPTConfig) -> dict:
    """{our parameter name: shape}, from the model's own layer specs (so a parameter the GPT
    gains without a mapping here is noticed, not silently left out of an export)."""
    specs = dedup_specs([spec for layer in gpt_layers(cfg) for spec in layer.specs()])
    shapes = {spec.name: tuple(spec.shape) for spec in specs}
    mapped = {ours for ours, _, _ in name_map(cfg.n_layer)}
    if set(shapes) != mapped:
        raise HFError(f"the GPT's parameters {sorted(set(shapes) ^ mapped)} have no Hugging Face mapping in "
                      "engine/hf.py (a bug: the model changed, its conversion did not)")
    return shapes


def _hf_shape(ours: str, shape: tuple, transposed: bool, cfg: GPTConfig) -> tuple:
    """The shape GPT-2 stores our parameter `ours` of shape `shape` in."""
    if ours == "wte":
        return (cfg.vocab, cfg.d_model)      # GPT-2's wte has exactly vocab_size rows
    return tuple(reversed(shape)) if transposed else shape


# ---- export --------------------------------------------------------------------------------

def export_hf(arrays: dict, model_config: dict, out_dir: str, tokenizer_json: str | None = None,
              overwrite=False) -> str:
    """Write a GPT's parameters as a Hugging Face GPT-2 folder; returns its absolute path.

    arrays: {"param/<name>": host array} as checkpoint.load returns them (other arrays, like
    "opt/m/<name>", are ignored), or {<name>: array}. model_config: a GPTConfig dict.
    tokenizer_json: a tokenizer.json path (or its JSON text) to ship with the model, so that
    AutoTokenizer.from_pretrained(out_dir) works. Written as float32 into a temp folder that
    is renamed into place, so out_dir is never half-written; a non-empty out_dir is refused
    unless overwrite (and a ringpipe run directory always is)."""
    cfg = _gpt_config(model_config)
    params = _check_params(cfg, _param_arrays(arrays))
    tokenizer = _Tokenizer.read(tokenizer_json, cfg.vocab) if tokenizer_json is not None else None
    special_id = tokenizer.end_of_text_id() if tokenizer is not None else None

    tensors = {}
    for ours, theirs, transposed in name_map(cfg.n_layer):
        array = params[ours].astype(np.float32)
        if ours == "wte":
            array = array[:cfg.vocab]       # the padding rows are ours alone: GPT-2 has vocab_size rows
        if transposed:
            array = array.T
        tensors[PREFIX + theirs] = np.ascontiguousarray(array)

    files = {"config.json": _json_bytes(_hf_config(cfg, special_id)),
             "generation_config.json": _json_bytes({"bos_token_id": special_id, "eos_token_id": special_id})}
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer.text.encode()
        files["tokenizer_config.json"] = _json_bytes(tokenizer.config(cfg.context, special_id))
        files["special_tokens_map.json"] = _json_bytes(tokenizer.special_tokens_map(special_id))

    out_dir = os.path.abspath(out_dir)
    _check_out_dir(out_dir, overwrite)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        _save_safetensors(tensors, os.path.join(tmp, "model.safetensors"))
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as fh:
                fh.write(data)
        for name in os.listdir(tmp):
            _fsync(os.path.join(tmp, name))
        os.chmod(tmp, 0o755)                # mkdtemp makes it 0700; a model folder is for sharing
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _gpt_config(model_config: dict) -> GPTConfig:
    if not isinstance(model_config, dict):
        raise HFError(f"model_config must be a GPTConfig dict, got {type(model_config).__name__}")
    expected = set(GPTConfig().to_dict())
    if set(model_config) != expected:
        # A key we do not know may change the architecture (an export would then be wrong).
        raise HFError(f"model_config has the keys {sorted(model_config)}, expected {sorted(expected)}: "
                      "is it a GPT checkpoint's model_config?")
    cfg = GPTConfig(**model_config)
    cfg.validate()
    return cfg


def _param_arrays(arrays: dict) -> dict:
    """{our name: array}: the "param/" arrays of a checkpoint, or already bare names."""
    params = {name[len("param/"):]: array for name, array in arrays.items() if name.startswith("param/")}
    return params or dict(arrays)


def _check_params(cfg: GPTConfig, params: dict) -> dict:
    for name, shape in _our_shapes(cfg).items():
        if name not in params:
            raise HFError(f"the parameters lack {name!r}: are they this GPT's ({cfg.to_dict()})?")
        array = np.asarray(params[name])
        if array.shape != shape:
            raise HFError(f"parameter {name!r} has shape {array.shape}, the GPT {cfg.to_dict()} has {shape}")
        if array.dtype.kind != "f":
            raise HFError(f"parameter {name!r} has dtype {array.dtype}, expected floating point")
        if not np.isfinite(array).all():
            raise HFError(f"parameter {name!r} holds NaN or inf: the model diverged; export an earlier checkpoint")
        params[name] = array
    return params


def _hf_config(cfg: GPTConfig, special_id) -> dict:
    """config.json: what GPT2Config needs to build exactly our model."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab,            # the tokenizer's size: the padding is not exported
        "n_positions": cfg.context,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,                    # None means 4 * n_embd, our MLP's width
        "activation_function": "gelu_new",  # GELU, tanh approximation: our kernels' GELU
        "layer_norm_epsilon": 1e-5,
        "scale_attn_weights": True,         # scores / sqrt(head size), as ours
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,        # our LM head is wte
        # ringpipe trains without dropout; GPT-2's default 0.1 would change the math of
        # anyone fine-tuning the export.
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": special_id,
        "eos_token_id": special_id,
        "dtype": "float32",                 # transformers >= 4.56 reads "dtype",
        "torch_dtype": "float32",           # older versions "torch_dtype"
    }


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _save_safetensors(tensors: dict, path: str) -> None:
    numpy_api = _safetensors("numpy")
    # transformers refuses a safetensors file whose metadata does not name a framework;
    # "pt" is what save_pretrained writes.
    numpy_api.save_file(tensors, path, metadata={"format": "pt"})


def _safetensors(module: str):
    try:
        if module == "numpy":
            import safetensors.numpy as found
        else:
            import safetensors as found
    except ImportError:
        raise HFError("reading and writing Hugging Face model files needs the safetensors package: "
                      "pip install 'ringpipe[hf]' (or pip install safetensors)") from None
    return found


def _fsync(path: str) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"--out {out_dir} exists and is not a folder")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    names = os.listdir(out_dir)
    # Never replace a training run with a model folder, --overwrite or not: it would
    # delete the run's checkpoints, probably the very one being exported.
    if "checkpoints" in names or "metrics.jsonl" in names or any(n.startswith("ckpt_") for n in names):
        raise FileExistsError(f"--out {out_dir} is a ringpipe run directory (it holds checkpoints or "
                              "metrics.jsonl); export to another folder")
    if not overwrite:
        raise FileExistsError(f"--out {out_dir} is not empty ({', '.join(sorted(names)[:4])}"
                              f"{', ...' if len(names) > 4 else ''}); pass --overwrite to replace it "
                              "(overwrite=True), or choose another folder")


def _move_into_place(tmp: str, out_dir: str) -> None:
    """Rename the finished temp folder to out_dir. An existing (non-empty) out_dir is first
    renamed aside and removed only after the new folder is in place."""
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        os.replace(tmp, out_dir)            # rename(2) replaces an empty folder
        return
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
    old = os.path.join(aside, "old")
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)             # put the previous export back
        os.rmdir(aside)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    checkpoint.fsync_dir(os.path.dirname(out_dir))


# ---- the tokenizer -------------------------------------------------------------------------

# Tokens that end a text, in the order we look for them (engine/tokenizer.py's order):
# GPT-2's, Llama 3's, then SentencePiece's.
_END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class _Tokenizer:
    """A tokenizer.json (the `tokenizers` library's format), read as JSON: we only need
    its size and its special tokens, and copy the file as it is."""

    def __init__(self, text: str, ids: dict, special: list):
        self.text = text            # the file's exact text
        self.ids = ids              # {token: id} of the model's vocabulary and the added tokens
        self.special = special      # the added tokens marked special

    @classmethod
    def read(cls, tokenizer_json: str, vocab: int) -> "_Tokenizer":
        if tokenizer_json.lstrip().startswith("{"):
            text, where = tokenizer_json, "the tokenizer JSON"
        else:
            where = tokenizer_json
            try:
                with open(tokenizer_json, encoding="utf-8") as fh:
                    text = fh.read()
            except OSError as e:
                raise HFError(f"cannot read the tokenizer {tokenizer_json} ({e.strerror or e})") from None
            except UnicodeDecodeError:
                raise HFError(f"the tokenizer {tokenizer_json} is not UTF-8 JSON") from None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise HFError(f"{where} is not valid JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise HFError(f"{where} is not a tokenizer.json of the tokenizers library (no \"model\")")
        ids = {}
        vocab_entries = data["model"].get("vocab")
        if isinstance(vocab_entries, dict):              # BPE, WordPiece, WordLevel: {token: id}
            ids.update(vocab_entries)
        elif isinstance(vocab_entries, list):            # Unigram: [[piece, score], ...] in id order
            ids.update({entry[0]: i for i, entry in enumerate(vocab_entries)})
        special = []
        for token in data.get("added_tokens") or []:
            ids[token["content"]] = token["id"]
            if token.get("special"):
                special.append(token["content"])
        if not ids or not all(type(i) is int and i >= 0 for i in ids.values()):
            raise HFError(f"{where} holds no vocabulary of token ids")
        size = max(ids.values()) + 1
        if size > vocab:
            raise HFError(f"the tokenizer {where} has {size} token ids, more than the model's vocabulary of "
                          f"{vocab}: it is not the tokenizer this model was trained with")
        return cls(text, ids, special)

    def end_of_text_id(self):
        """GPT-2's bos and eos are one token, <|endoftext|>; use it (or another end-of-text
        token) if the tokenizer has one, else no bos/eos at all (a byte tokenizer)."""
        for token in _END_OF_TEXT_TOKENS:
            if token in self.ids:
                return self.ids[token]
        return None

    def _special_token(self, special_id):
        return next(t for t, i in self.ids.items() if i == special_id) if special_id is not None else None

    def config(self, context: int, special_id) -> dict:
        """tokenizer_config.json: AutoTokenizer builds a PreTrainedTokenizerFast over tokenizer.json."""
        token = self._special_token(special_id)
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
                "bos_token": token, "eos_token": token, "clean_up_tokenization_spaces": False}

    def special_tokens_map(self, special_id) -> dict:
        token = self._special_token(special_id)
        return {"bos_token": token, "eos_token": token} if token is not None else {}


# ---- import --------------------------------------------------------------------------------

# GPT2Config's defaults, for keys a config.json leaves out (transformers would use these).
_GPT2_DEFAULTS = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "add_cross_attention": False,
    "tie_word_embeddings": True,
}
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")      # two names of the same function
# Buffers older transformers saved with the weights (the causal mask): not parameters.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def import_hf(hf_dir: str) -> tuple[GPTConfig, dict, str | None]:
    """Read a Hugging Face GPT-2 folder: (GPTConfig, {our parameter name: float32 array}, the
    path of its tokenizer.json or None). wte is padded to cfg.padded_vocab rows. Anything
    ringpipe's GPT cannot represent exactly is refused with an HFError (a ValueError)
    naming the config key or tensor."""
    if not os.path.isdir(hf_dir):
        raise HFError(f"{hf_dir} is not a folder (expected a Hugging Face model folder with config.json)")
    config = _read_config(hf_dir)
    cfg = _config_from_hf(config, hf_dir)
    tensors = _read_tensors(hf_dir)
    tensors = _strip_prefix(tensors, hf_dir)
    shapes = _our_shapes(cfg)

    arrays = {}
    for ours, theirs, transposed in name_map(cfg.n_layer):
        if theirs not in tensors:
            raise HFError(f"{hf_dir}: the tensor {PREFIX + theirs} is missing (config.json says n_layer "
                          f"{cfg.n_layer}): the weights are incomplete or do not match config.json")
        array = tensors.pop(theirs)
        want = _hf_shape(ours, shapes[ours], transposed, cfg)
        if array.shape != want:
            raise HFError(f"{hf_dir}: the tensor {PREFIX + theirs} has shape {array.shape}, config.json "
                          f"implies {want}")
        array = array.astype(np.float32)
        if transposed:
            array = array.T
        arrays[ours] = np.ascontiguousarray(array)

    # Our wte has padded_vocab rows. The padding rows never matter: no token id reaches them
    # in the embedding, and the head masks their logits (LMHead.PAD_LOGIT), so they get no
    # probability and no gradient. Zeros keep the import deterministic.
    wte = np.zeros((cfg.padded_vocab, cfg.d_model), dtype=np.float32)
    wte[:cfg.vocab] = arrays["wte"]
    arrays["wte"] = wte

    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is None and config.get("tie_word_embeddings", True) is False:
        raise HFError(f"{hf_dir}: config.json says tie_word_embeddings false but there is no lm_head.weight "
                      "(transformers would start the head from random values)")
    if lm_head is not None and not np.array_equal(lm_head.astype(np.float32), arrays["wte"][:cfg.vocab]):
        raise HFError(f"{hf_dir}: lm_head.weight differs from wte (config.json tie_word_embeddings "
                      f"{config.get('tie_word_embeddings', True)}): ringpipe's LM head is always the token "
                      "embedding, so this model cannot be represented")
    leftover = sorted(name for name in tensors if not name.endswith(_BUFFER_SUFFIXES))
    if leftover:
        raise HFError(f"{hf_dir}: tensors that GPT-2 with this config.json does not have: "
                      f"{', '.join(leftover[:5])}{', ...' if len(leftover) > 5 else ''}")
    tokenizer = os.path.join(hf_dir, "tokenizer.json")
    return cfg, arrays, tokenizer if os.path.isfile(tokenizer) else None


def _read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        raise HFError(f"{hf_dir} has no config.json: it is not a Hugging Face model folder") from None
    except (OSError, ValueError) as e:
        raise HFError(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise HFError(f"{path} holds no JSON object")
    return config


def _config_from_hf(config: dict, hf_dir: str) -> GPTConfig:
    """Our GPTConfig from config.json, refusing every setting our GPT computes differently."""
    where = f"{hf_dir}/config.json"
    model_type = config.get("model_type")
    if model_type != "gpt2":
        raise HFError(f"{where}: model_type is {model_type!r}; ringpipe's GPT is GPT-2 and imports only "
                      "model_type \"gpt2\"")

    def get(key):
        return config.get(key, _GPT2_DEFAULTS[key])

    def refuse(key, why):
        raise HFError(f"{where}: {key} is {get(key)!r}; {why}")

    sizes = {}
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        value = get(key)
        if type(value) is not int or value < 1:
            refuse(key, "expected a positive integer")
        sizes[key] = value
    if sizes["n_embd"] % sizes["n_head"]:
        refuse("n_head", f"it must divide n_embd {sizes['n_embd']}")
    if get("activation_function") not in _TANH_GELUS:
        refuse("activation_function", f"ringpipe's MLP uses GELU in its tanh approximation "
                                      f"({' or '.join(_TANH_GELUS)})")
    if get("n_inner") not in (None, 4 * sizes["n_embd"]):
        refuse("n_inner", f"ringpipe's MLP is 4 * n_embd = {4 * sizes['n_embd']} wide")
    epsilon = get("layer_norm_epsilon")
    if type(epsilon) not in (int, float) or not math.isclose(epsilon, 1e-5, rel_tol=1e-6):
        refuse("layer_norm_epsilon", "ringpipe's LayerNorm uses 1e-5")
    if get("scale_attn_weights") is not True:
        refuse("scale_attn_weights", "ringpipe always scales attention scores by 1/sqrt(head size)")
    for key, why in (("scale_attn_by_inverse_layer_idx", "ringpipe does not scale attention by 1/(layer+1)"),
                     ("reorder_and_upcast_attn", "ringpipe does not support it"),
                     ("add_cross_attention", "ringpipe's GPT has no cross-attention")):
        if get(key) is not False:
            refuse(key, why)
    # tie_word_embeddings false is fine if lm_head.weight equals wte: checked with the tensors.
    return GPTConfig(n_layer=sizes["n_layer"], d_model=sizes["n_embd"], n_head=sizes["n_head"],
                     context=sizes["n_positions"], vocab=sizes["vocab_size"])


def _read_tensors(hf_dir: str) -> dict:
    """{name: numpy array} of every tensor in model.safetensors, or in the shards that
    model.safetensors.index.json names. Pickled weights are refused, never opened."""
    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        files = _shard_files(index, hf_dir)
    else:
        names = os.listdir(hf_dir)
        pickles = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        if pickles:
            raise HFError(f"{hf_dir} holds its weights only as {pickles[0]}, a pickle, which ringpipe never loads "
                          "(loading a pickle can run code). Convert it to safetensors: load it with transformers "
                          "where you trust it and re-save it with model.save_pretrained(folder, "
                          "safe_serialization=True)")
        raise HFError(f"{hf_dir} has no model.safetensors (nor model.safetensors.index.json)")
    tensors = {}
    for path in files:
        for name, array in _read_safetensors_file(path).items():
            if name in tensors:
                raise HFError(f"{hf_dir}: the tensor {name} is in two shards")
            tensors[name] = array
    return tensors


def _shard_files(index: str, hf_dir: str) -> list:
    try:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HFError(f"{index} cannot be read (expected JSON with a \"weight_map\"): {e}") from None
    if not isinstance(weight_map, dict):
        raise HFError(f"{index}: \"weight_map\" is not an object")
    files = []
    for shard in sorted(set(weight_map.values())):
        # A shard is a file next to the index, never a path elsewhere on the machine.
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise HFError(f"{index} names the shard {shard!r}; expected a file name in {hf_dir}")
        path = os.path.join(hf_dir, shard)
        if not os.path.isfile(path):
            raise HFError(f"{index} names the shard {shard}, which is missing")
        files.append(path)
    return files


def _read_safetensors_file(path: str) -> dict:
    safetensors = _safetensors("safe_open")
    tensors = {}
    try:
        with safetensors.safe_open(path, framework="np") as fh:
            for name in fh.keys():
                if fh.get_slice(name).get_dtype() == "BF16":
                    tensors[name] = _read_bf16(path, name)     # numpy has no bfloat16
                else:
                    tensors[name] = fh.get_tensor(name)
    except HFError:
        raise
    except Exception as e:   # the library raises its own types (SafetensorError, TypeError) for a bad file
        raise HFError(f"{path} cannot be read as safetensors ({type(e).__name__}: {e})") from None
    return tensors


def _read_bf16(path: str, name: str) -> np.ndarray:
    """A bfloat16 tensor as float32: bfloat16 is the top 16 bits of a float32. The file's
    layout: an 8-byte little-endian header size, the JSON header, then the data (offsets
    relative to its start); safe_open has already checked the header."""
    with open(path, "rb") as fh:
        (header_size,) = struct.unpack("<Q", fh.read(8))
        info = json.loads(fh.read(header_size))[name]
        begin, end = info["data_offsets"]
        fh.seek(8 + header_size + begin)
        raw = np.frombuffer(fh.read(end - begin), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def _strip_prefix(tensors: dict, hf_dir: str) -> dict:
    """GPT-2's names without "transformer.": GPT2LMHeadModel saves them with it, GPT2Model
    (and the original GPT-2 download) without; lm_head.weight keeps its name."""
    if PREFIX + "wte.weight" in tensors:
        return {name[len(PREFIX):] if name.startswith(PREFIX) else name: array for name, array in tensors.items()}
    if "wte.weight" in tensors:
        return dict(tensors)
    raise HFError(f"{hf_dir}: the tensor {PREFIX}wte.weight is missing: is this a GPT-2 model?")


# ---- the command line: ringpipe export -------------------------------------------------------

def main(argv=None, prog="ringpipe export") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write a trained ringpipe GPT as a Hugging Face GPT-2 folder (config.json,\n"
                    "model.safetensors, the tokenizer) that transformers loads with no conversion code.",
        epilog="Example:\n  ringpipe export runs/gpt --format hf --out runs/gpt-hf\n"
               "  python -c \"from transformers import pipeline; "
               "print(pipeline('text-generation', 'runs/gpt-hf')('def ', max_new_tokens=40)[0])\"",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory (its latest valid checkpoint), a checkpoints folder or a ckpt_*.json")
    parser.add_argument("--format", choices=["hf"], default="hf", help="output format (hf: Hugging Face GPT-2)")
    parser.add_argument("--out", required=True, metavar="HF_DIR", help="the folder to write (must be empty or new)")
    parser.add_argument("--overwrite", action="store_true", help="replace HF_DIR if it is not empty")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:          # argparse has printed the usage and the error (or --help)
        return 2 if e.code else 0
    try:
        return _export_command(args)
    except (HFError, checkpoint.CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _export_command(args) -> int:
    if not os.path.exists(args.source):
        raise HFError(f"{args.source} does not exist; pass a run directory, its checkpoints folder or a "
                      "ckpt_XXXXXXXX.json")
    manifest_path = checkpoint.resolve(args.source)
    arrays, manifest = checkpoint.load(manifest_path)
    if manifest["model"] != "gpt":
        raise HFError(f"{manifest_path} is a checkpoint of the {manifest['model']} model; only the GPT "
                      "exports to the Hugging Face format")
    params = {name: array for name, array in arrays.items() if name.startswith("param/")}
    cfg = GPTConfig(**manifest["model_config"])
    params = fit_vocab_rows(params, cfg, cfg.padded_vocab)      # a tp not dividing 128 padded further
    run_dir = _run_dir(args.source, manifest_path)
    tokenizer, about_tokenizer = _find_tokenizer(manifest, run_dir, manifest["model_config"]["vocab"])
    out = export_hf(params, manifest["model_config"], args.out, tokenizer_json=tokenizer, overwrite=args.overwrite)

    n_params = sum(int(np.prod(params[f"param/{ours}"].shape)) for ours, _, _ in name_map(
        manifest["model_config"]["n_layer"]))
    print(f"exported {manifest_path} (step {manifest['step']}, {n_params:,} parameters) to {out}:")
    print(f"  {', '.join(sorted(os.listdir(out)))}")
    print(f"  tokenizer: {about_tokenizer}")
    print("load it with:")
    print("  from transformers import AutoModelForCausalLM, AutoTokenizer")
    loads_tokenizer = f"; tokenizer = AutoTokenizer.from_pretrained({out!r})" if tokenizer is not None else ""
    print(f"  model = AutoModelForCausalLM.from_pretrained({out!r}){loads_tokenizer}")
    return 0


def _tokenizer_sha256(path: str) -> str:
    """The sha256 a checkpoint records for its tokenizer: engine.tokenizer's, over the JSON in
    canonical form, so re-indenting the file does not change it."""
    from ringpipe.engine.tokenizer import json_sha256
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        return json_sha256(text)
    except ValueError as e:
        raise HFError(f"{path} is not valid JSON ({e})") from None


def _run_dir(source: str, manifest_path: str) -> str:
    """The run directory: RUN/checkpoints/ckpt_*.json -> RUN (or the source itself if it is one)."""
    if os.path.isdir(os.path.join(source, "checkpoints")):
        return source
    folder = os.path.dirname(os.path.abspath(manifest_path))
    return os.path.dirname(folder) if os.path.basename(folder) == "checkpoints" else folder


def _find_tokenizer(manifest: dict, run_dir: str, vocab: int):
    """(tokenizer.json path or JSON text or None, a description): the tokenizer the checkpoint
    names, else RUN_DIR/tokenizer.json, else the byte tokenizer for a 256-token model."""
    entry = manifest.get("tokenizer")
    if entry:
        path = os.path.join(run_dir, entry["file"])
        if not os.path.isfile(path):
            raise HFError(f"the checkpoint was trained with the tokenizer {entry['file']} of its run directory, "
                          f"but {path} is missing; put it back (its sha256 is {entry['sha256']})")
        digest = _tokenizer_sha256(path)
        if digest != entry["sha256"]:
            raise HFError(f"{path} is not the tokenizer the checkpoint was trained with (sha256 {digest[:12]}..., "
                          f"the checkpoint says {entry['sha256'][:12]}...)")
        return path, f"{path} (the checkpoint's)"
    path = os.path.join(run_dir, "tokenizer.json")
    if os.path.isfile(path):
        return path, path
    if vocab == 256:
        try:
            from ringpipe.engine.tokenizer import load_tokenizer
        except ImportError:
            return None, "none written (a byte model, and this ringpipe has no engine/tokenizer.py to write one)"
        text = load_tokenizer("bytes").to_json()
        return (text if isinstance(text, str) else json.dumps(text)), "the byte tokenizer (256 tokens)"
    return None, f"none found (no tokenizer in the checkpoint nor {path}); the model has {vocab} tokens"


if __name__ == "__main__":
    sys.exit(main())
