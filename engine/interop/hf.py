"""Models in and out of the Hugging Face format: ringpipe's GPT is GPT-2 (here), its Llama
LlamaForCausalLM (hf_llama.py, which export_hf, import_hf and check_checkpoint_shapes hand a
Llama to). What both families share, the folder's files read and written, is hf_folder.py's.

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
import re
import sys

import numpy as np

from ringpipe.engine.interop import hf_llama, hf_values
from ringpipe.engine.interop.hf_folder import (MASK_BUFFERS, MAX_CONFIG_BYTES, MAX_TOKENIZER_BYTES, HFError,
                                               TensorBoxes, Tokenizer, check_memory, check_out_dir, checked,
                                               files_call, json_bytes, layer_indices, param_arrays, read_headers,
                                               read_json, safetensors_header, tokenizer_of, weight_files,
                                               write_model_folder)
from ringpipe.engine.job import checkpoint, files
from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
from ringpipe.engine.model.params import dedup_specs
from ringpipe.engine.model.registry import RECIPES, names_of


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
                      "engine/interop/hf.py (a bug: the model changed, its conversion did not)")
    return shapes


def _hf_shape(ours: str, shape: tuple, transposed: bool, cfg: GPTConfig) -> tuple:
    """The shape GPT-2 stores our parameter `ours` of shape `shape` in."""
    if ours == "wte":
        return (cfg.vocab, cfg.d_model)      # GPT-2's wte has exactly vocab_size rows
    return tuple(reversed(shape)) if transposed else shape


# ---- declared sizes, checked against the tensors before anything is built ------------------
#
# config.json and a checkpoint's manifest are a few bytes that declare sizes; the tensors
# are what the files hold. Building a model from a declared size before looking at the
# tensors lets a 2 KB file cost minutes and gigabytes (n_layer 10**6 builds a million
# layers) or a MemoryError. So the declared shape is checked first against the shapes in
# the files' headers (read without reading any tensor data), then against the memory
# available; only then is anything built or read.


def check_gpt_shapes(cfg: GPTConfig, shapes: dict, where: str, wte_rows: int, naming, exact_layers=True) -> int:
    """Refuse the declared model `cfg` unless the tensors present are that model's, and it fits
    in memory; returns its number of parameters. Nothing is built and no tensor is read.

    shapes: {our parameter name: shape in our orientation}, from file headers.
    where: what declared cfg, for messages ("{dir}/config.json", "the manifest ...").
    wte_rows: the rows the file's wte must have (GPT-2: vocab; a checkpoint: padded).
    naming(ours, shape) -> (the tensor's name in the file, the shape as the file stores it).
    exact_layers: refuse layers beyond n_layer too (a checkpoint); an import leaves extra
    tensors to its own check, which names them."""
    C = cfg.d_model

    def tensor(ours):
        name, _ = naming(ours, ())
        if ours not in shapes:
            raise HFError(f"the tensor {name} is missing ({where} declares {_describe_cfg(cfg)}): the weights are "
                          f"incomplete or do not match {where}")
        return shapes[ours]

    def expect(ours, want, because):
        have = tensor(ours)
        if tuple(have) != tuple(want):
            name, shown = naming(ours, tuple(have))
            _, wanted = naming(ours, tuple(want))
            raise HFError(f"the tensor {name} has shape {shown}, but {where} declares {because}, which implies "
                          f"{wanted}: the two disagree (was {where} edited?)")

    # wte and wpe first: they carry vocab, d_model and context, and are bounded by the file.
    expect("wte", (wte_rows, C), f"vocab {cfg.vocab} and d_model {C}")
    expect("wpe", (cfg.context, C), f"context {cfg.context} and d_model {C}")
    if C % cfg.n_head:
        raise HFError(f"{where} declares n_head {cfg.n_head}, which does not divide d_model {C}: no GPT has that "
                      "shape (was it edited?)")
    present = layer_indices(shapes)
    missing = [i for i in range(min(cfg.n_layer, len(present) + 1)) if i not in present]
    if missing:
        name, _ = naming(f"h.{missing[0]}.ln1.w", ())
        raise HFError(f"{where} declares n_layer {cfg.n_layer}, but the weights hold {len(present)} layers: the "
                      f"tensor {name} (and the rest of layer {missing[0]}) is missing")
    extra = sorted(i for i in present if i >= cfg.n_layer)
    if exact_layers and extra:
        raise HFError(f"{where} declares n_layer {cfg.n_layer}, but the weights hold {len(present)} layers "
                      f"(up to layer {extra[-1]}): the two disagree (was {where} edited?)")
    # Every layer is now backed by tensors in the file, so one layer's shapes (from the model's
    # own specs, so they cannot drift from it) are cheap to compute and to check n_layer times.
    one = _our_shapes(GPTConfig(n_layer=1, d_model=C, n_head=cfg.n_head, context=cfg.context, vocab=cfg.vocab))
    block = {ours[len("h.0."):]: shape for ours, shape in one.items() if ours.startswith("h.0.")}
    for i in range(cfg.n_layer):
        for suffix, want in block.items():
            expect(f"h.{i}.{suffix}", want, f"d_model {C}")
    for ours, want in one.items():
        if not ours.startswith("h.") and ours not in ("wte", "wpe"):
            expect(ours, want, f"d_model {C}")

    n_params = (math.prod(shapes["wte"]) + math.prod(shapes["wpe"]) + 2 * C
                + cfg.n_layer * sum(math.prod(shape) for shape in block.values()))
    check_memory(n_params, where, floats=max(n_params, cfg.padded_vocab * C))
    return n_params


def _describe_cfg(cfg: GPTConfig) -> str:
    return ", ".join(f"{key} {value}" for key, value in cfg.to_dict().items())


def check_checkpoint_shapes(manifest: dict, declared: dict, path: str) -> GPTConfig:
    """The GPTConfig of a GPT checkpoint whose manifest's model_config agrees with the arrays
    its npz declares ({name: (shape, dtype)}, checkpoint.declared_arrays), else HFError naming
    the key and the array. Call it before building the model or reading an array. A Llama
    checkpoint's is checked by hf_llama.check_checkpoint_shapes, and gives its LlamaConfig."""
    other = _OTHER_FAMILIES.get(manifest["model"])
    if other is not None:
        return other.check_checkpoint_shapes(manifest, declared, path)
    where = f"the manifest {path}'s model_config"
    model_config = manifest["model_config"]
    cfg = GPTConfig(**model_config)
    params = {}
    for name, (shape, dtype) in declared.items():
        if name.startswith("param/"):
            if np.dtype(dtype).kind != "f":
                raise HFError(f"the checkpoint's array {name} has dtype {dtype}, not a float type: a GPT's "
                              f"parameters are floats ({path} was not written by ringpipe, or was edited)")
            params[name[len("param/"):]] = tuple(shape)
    check_gpt_shapes(cfg, params, where, cfg.padded_vocab,
                     lambda ours, shape: (f"param/{ours}", shape))
    # Every value's range too (the manifest is a file anyone can edit): what the arrays do
    # not bind, or a value the shapes above happen to agree with.
    try:
        cfg.validate()
    except ValueError as e:                     # ConfigError is one
        raise HFError(f"{where}: {e}; the manifest was edited: use the checkpoint as it was written") from None
    # The run's own record of its flags and tokenizer, where they name a size: n_head is in no
    # array's shape, so an edited n_head shows only against what the run was started with.
    heads = manifest.get("args", {}).get("heads")
    if type(heads) is int and heads != cfg.n_head:
        raise HFError(f"{where} declares n_head {cfg.n_head}, but the run was started with --heads {heads}: the "
                      "manifest was edited; use the checkpoint as it was written")
    tokenizer = manifest.get("tokenizer")
    if tokenizer and tokenizer["vocab_size"] != cfg.vocab:
        raise HFError(f"{where} declares vocab {cfg.vocab}, but the run's tokenizer has {tokenizer['vocab_size']} "
                      "tokens: the manifest was edited; use the checkpoint as it was written")
    return cfg


# ---- export --------------------------------------------------------------------------------

def export_hf(arrays: dict, model_config: dict, out_dir: str, tokenizer_json: str | None = None,
              overwrite=False, protect=(), model: str = "gpt") -> str:
    """Write a GPT's parameters as a Hugging Face GPT-2 folder; returns its absolute path.
    model: the checkpoint's family; a Llama's is written by hf_llama.export (LlamaForCausalLM).

    arrays: {"param/<name>": host array} as checkpoint.load returns them (other arrays, like
    "opt/m/<name>", are ignored), or {<name>: array}. model_config: a GPTConfig dict.
    tokenizer_json: a tokenizer.json path (or its JSON text) to ship with the model, so that
    AutoTokenizer.from_pretrained(out_dir) works. Written as float32 into a temp folder that
    is renamed into place, so out_dir is never half-written. A non-empty out_dir is replaced
    only with overwrite, and only if it is a model folder (see check_out_dir): never a run
    directory, a dataset, a folder holding other files, nor one that is, holds or lies in
    one of the paths in `protect` (the checkpoint being exported)."""
    other = _OTHER_FAMILIES.get(model)
    if other is not None:
        return other.export(arrays, model_config, out_dir, tokenizer_json, overwrite, protect)
    cfg = _gpt_config(model_config)
    given = param_arrays(arrays)
    # The declared depth against the layers given, before _check_params builds the GPT's
    # specs from it (a model_config of n_layer 10**6 would build a million layers first).
    if cfg.n_layer > len(layer_indices(given)):
        raise HFError(f"model_config declares n_layer {cfg.n_layer}, but the parameters hold "
                      f"{len(layer_indices(given))} layers: are they this GPT's ({cfg.to_dict()})?")
    params = _check_params(cfg, given)
    tokenizer = Tokenizer.read(tokenizer_json, cfg.vocab) if tokenizer_json is not None else None
    special_id = tokenizer.end_of_text_id() if tokenizer is not None else None

    tensors = {}
    for ours, theirs, transposed in name_map(cfg.n_layer):
        array = params[ours].astype(np.float32)
        if ours == "wte":
            array = array[:cfg.vocab]       # the padding rows are ours alone: GPT-2 has vocab_size rows
        if transposed:
            array = array.T
        tensors[PREFIX + theirs] = np.ascontiguousarray(array)

    files = {"config.json": json_bytes(_hf_config(cfg, special_id)),
             "generation_config.json": json_bytes({"bos_token_id": special_id, "eos_token_id": special_id})}
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer.text.encode()
        files["tokenizer_config.json"] = json_bytes(tokenizer.config(cfg.context, special_id, special_id))
        files["special_tokens_map.json"] = json_bytes(tokenizer.special_tokens_map(special_id, special_id))
    return write_model_folder(tensors, files, out_dir, overwrite, protect)


# The families converted elsewhere, by the checkpoint's model name (the GPT's is this module's).
_OTHER_FAMILIES = {"llama": hf_llama}


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
        # The same value under GPT-2's older name: transformers ignores it, but llama.cpp's
        # convert_hf_to_gguf.py reads config["n_ctx"] for GPT-2 and fails without it (KeyError).
        "n_ctx": cfg.context,
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


# ---- import --------------------------------------------------------------------------------

# GPT2Config's defaults, for keys a config.json leaves out (transformers would use these).
_GPT2_DEFAULTS = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "add_cross_attention": False,
    "tie_word_embeddings": True,
}
# Names transformers gives the same function, GELU in its tanh approximation (our kernels'):
# gelu_fast writes sqrt(2/pi) as 0.7978845608 and x * (1 + 0.044715 x^2) for x + 0.044715 x^3,
# which differ from gelu_new only in float rounding. Exact GELU ("gelu", erf) is not among them.
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# The dropout rates a GPT-2 config.json may set (GPT-2's own: 0.1). ringpipe trains without
# dropout; a model trained with it is still represented exactly (dropout is off at inference),
# so import_notes says so instead of refusing.
# summary_first_dropout is left out: only GPT2DoubleHeadsModel's summary head uses it.
_DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
_GPT2_DROPOUT_DEFAULT = 0.1     # GPT2Config's, for a key config.json leaves out


def open_hf(hf_dir: str) -> tuple:
    """import_hf, the weights not read yet: (config, hf_folder.TensorBoxes over our parameters'
    names, the path of its tokenizer.json or None): each rank reads only the boxes it holds."""
    if not os.path.isdir(hf_dir):
        raise HFError(f"{hf_dir} is not a folder (expected a Hugging Face model folder with config.json)")
    config = _read_config(hf_dir)
    if config.get("model_type") in hf_llama.MODEL_TYPES:
        return hf_llama.open_folder(config, hf_dir)
    return _open_gpt2(config, hf_dir)


def import_hf(hf_dir: str) -> tuple[GPTConfig, dict, str | None]:
    """Read a Hugging Face GPT-2 folder: (GPTConfig, {our parameter name: float32 array}, the
    path of its tokenizer.json or None). wte is padded to cfg.padded_vocab rows. Anything
    ringpipe's GPT cannot represent exactly is refused with an HFError (a ValueError)
    naming the config key or tensor. A Llama-style folder (hf_llama.MODEL_TYPES) gives a
    LlamaConfig and the Llama's parameters instead (hf_llama.import_folder)."""
    if not os.path.isdir(hf_dir):
        raise HFError(f"{hf_dir} is not a folder (expected a Hugging Face model folder with config.json)")
    config = _read_config(hf_dir)
    if config.get("model_type") in hf_llama.MODEL_TYPES:
        return hf_llama.import_folder(config, hf_dir)
    cfg, source, tokenizer = _open_gpt2(config, hf_dir)
    return cfg, {ours: source.read_whole(ours) for ours, _, _ in name_map(cfg.n_layer)}, tokenizer


def _open_gpt2(config: dict, hf_dir: str) -> tuple:
    """open_hf for a GPT-2 folder: (GPTConfig, TensorBoxes over our names, tokenizer.json or None),
    every tensor's presence and shape checked from the headers, none read whole."""
    cfg = _config_from_hf(config, hf_dir)
    headers = read_headers(weight_files(hf_dir), hf_dir)
    # config.json's sizes against the tensors' shapes (headers only), before any model is
    # built or tensor read: see check_gpt_shapes.
    declared = _strip_prefix({name: shape for name, (_, shape, _) in headers.items()}, hf_dir)
    check_gpt_shapes(cfg, _ours_from_gpt2(declared), f"{hf_dir}/config.json", cfg.vocab, _gpt2_naming,
                     exact_layers=False)
    entries = _strip_prefix(headers, hf_dir)
    shapes = _our_shapes(cfg)
    mine, transposed = {}, set()
    for ours, theirs, is_transposed in name_map(cfg.n_layer):
        if theirs not in entries:
            raise HFError(f"{hf_dir}: the tensor {PREFIX + theirs} is missing (config.json says n_layer "
                          f"{cfg.n_layer}): the weights are incomplete or do not match config.json")
        want = _hf_shape(ours, shapes[ours], is_transposed, cfg)
        if tuple(entries[theirs][1]) != want:
            raise HFError(f"{hf_dir}: the tensor {PREFIX + theirs} has shape {tuple(entries[theirs][1])}, "
                          f"config.json implies {want}")
        mine[ours] = entries.pop(theirs)
        if is_transposed:
            transposed.add(ours)
    # Our wte has padded_vocab rows. The padding rows never matter: no token id reaches them
    # in the embedding, and the head masks their logits (LMHead.PAD_LOGIT), so they get no
    # probability and no gradient. Zeros keep the import deterministic.
    names = {ours: (PREFIX if PREFIX + theirs in headers else "") + theirs for ours, theirs, _ in name_map(cfg.n_layer)}
    source = TensorBoxes(mine, rows={"wte": cfg.padded_vocab}, transposed=transposed, names=names)
    lm_head = entries.pop("lm_head.weight", None)
    if lm_head is None and config.get("tie_word_embeddings", True) is False:
        raise HFError(f"{hf_dir}: config.json says tie_word_embeddings false but there is no lm_head.weight "
                      "(transformers would start the head from random values)")
    if lm_head is not None and not source.same("wte", lm_head):
        raise HFError(f"{hf_dir}: lm_head.weight differs from wte (config.json tie_word_embeddings "
                      f"{config.get('tie_word_embeddings', True)}): ringpipe's LM head is always the token "
                      "embedding, so this model cannot be represented")
    leftover = sorted(name for name in entries if not name.endswith(MASK_BUFFERS))
    if leftover:
        raise HFError(f"{hf_dir}: tensors that GPT-2 with this config.json does not have: "
                      f"{', '.join(leftover[:5])}{', ...' if len(leftover) > 5 else ''}")
    return cfg, source, tokenizer_of(hf_dir)


def check_init_data(hf_dir: str, init: tuple, data_vocab, data_has_tokenizer: bool = True) -> list:
    """For --init-from hf:DIR, once the data is open: refuse data whose vocabulary is larger
    than the model's (token ids past the embedding's rows), and return the notes to print.
    init: import_hf's (GPTConfig, arrays, tokenizer.json or None); data_vocab: the data's
    vocabulary's size, or None where the data has none; data_has_tokenizer: whether it came
    from a tokenizer (not: a peer's folder without tokenizer.json, its size assumed). Where
    both have a tokenizer.json the caller compares them by identity; otherwise nothing can,
    so a note says that only the vocabulary's size was checked."""
    cfg, _, tokenizer_json = init
    if data_vocab is not None and data_vocab > cfg.vocab:
        whose = ("the data's tokenizer has" if data_has_tokenizer else
                 "the data's vocabulary (it has no tokenizer.json) is")
        raise HFError(f"{whose} {data_vocab} tokens, more than the {cfg.vocab} of the model in "
                      f"{hf_dir} (its embedding's rows): token ids from {cfg.vocab} on have no embedding; prepare "
                      "the data with the model's tokenizer")
    notes = import_notes(hf_dir)
    if tokenizer_json is not None and not data_has_tokenizer and data_vocab is not None:
        notes.append(f"note: the data has no tokenizer.json, so it cannot be verified to be tokenized with the model's "
                     f"({tokenizer_json}); only its vocabulary's size ({data_vocab}) was checked. Copy that "
                     "tokenizer.json beside the data's shards to have it checked")
    if tokenizer_json is None:
        size = f"its size ({data_vocab} tokens, the model's {cfg.vocab})" if data_vocab is not None else "nothing"
        notes.append(f"note: {hf_dir} has no tokenizer.json, so the data's tokenizer cannot be verified to be the "
                     f"model's; only {size} was checked. Prepare the data with the tokenizer the model was trained with")
    return notes


def import_notes(hf_dir: str) -> list:
    """Notes on what --init-from hf:DIR imports but ringpipe does not do, for the caller to
    print once: the dropout config.json sets (ringpipe trains without it, so fine-tuning
    here differs from fine-tuning the model in transformers). check_init_data includes them."""
    config = _read_config(hf_dir)
    if config.get("model_type") in hf_llama.MODEL_TYPES:
        return hf_llama.import_notes(config, hf_dir)
    rates = [(key, config.get(key, _GPT2_DROPOUT_DEFAULT)) for key in _DROPOUT_KEYS]
    rates = [(key, value) for key, value in rates if type(value) in (int, float) and value != 0]
    if not rates:
        return []
    listed = ", ".join(f"{key} {value}" + ("" if key in config else " by default") for key, value in rates)
    return [f"note: {hf_dir}/config.json sets dropout ({listed}); ringpipe trains without dropout, so "
            "fine-tuning here runs with none"]


def family_of(hf_dir: str) -> str | None:
    """The model family (a registered recipe's name) a Hugging Face folder holds, from its
    config.json's model_type: "gpt" for gpt2, "llama" for the Llama-style types; None when
    the folder cannot tell (no readable config.json, another model_type): the import then
    says what is wrong."""
    try:
        model_type = _read_config(hf_dir).get("model_type")
    except (HFError, OSError, ValueError):
        return None
    if model_type == "gpt2":
        return "gpt"
    return "llama" if model_type in hf_llama.MODEL_TYPES else None


def _read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.lexists(path):
        raise HFError(f"{hf_dir} has no config.json: it is not a Hugging Face model folder")
    config = read_json(path, "the model's config", MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise HFError(f"{path} holds no JSON object")
    return config


def check_config(hf_dir: str):
    """The model config (GPTConfig or LlamaConfig) of a Hugging Face folder's config.json, every
    value checked (type, range, what ringpipe's model can represent); HFError naming the key
    otherwise. Reads config.json only: cheap enough to run before anything else is said."""
    config = _read_config(hf_dir)
    if config.get("model_type") in hf_llama.MODEL_TYPES:
        return hf_llama.config_from_hf(config, hf_dir)
    return _config_from_hf(config, hf_dir)


def _config_from_hf(config: dict, hf_dir: str) -> GPTConfig:
    """Our GPTConfig from config.json: every value checked, every setting our GPT computes
    differently refused."""
    where = f"{hf_dir}/config.json"
    model_type = config.get("model_type")
    if model_type != "gpt2":
        raise HFError(f"{where}: ringpipe cannot import this model: model_type is {hf_values.shown(model_type)}, "
                      f"and ringpipe imports model_type \"gpt2\" (its GPT) and the Llama family "
                      f"({', '.join(hf_llama.MODEL_TYPES)}). Fine-tune it with transformers instead, or choose a "
                      "model of one of those types")

    defaults = dict(_GPT2_DEFAULTS, **{key: _GPT2_DROPOUT_DEFAULT for key in _DROPOUT_KEYS})

    def get(key):
        return checked(where, key, config.get(key, defaults[key]))

    def refuse(key, why, instead):
        raise HFError(hf_values.unsupported(where, key, get(key), why, instead))

    sizes = {key: get(key) for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
    for key in defaults:                                 # every other value read: type and range first
        get(key)
    if sizes["n_embd"] % sizes["n_head"]:
        raise HFError(hf_values.invalid(where, "n_head", sizes["n_head"],
                                        f"a divisor of n_embd {sizes['n_embd']} (the heads split it evenly)"))
    if get("activation_function") not in _TANH_GELUS:
        refuse("activation_function", "ringpipe's MLP uses GELU in its tanh approximation",
               f"activation_function {' or '.join(_TANH_GELUS)}")
    if get("n_inner") not in (None, 4 * sizes["n_embd"]):
        refuse("n_inner", f"ringpipe's MLP is 4 * n_embd = {4 * sizes['n_embd']} wide",
               "n_inner null (4 * n_embd)")
    if not math.isclose(get("layer_norm_epsilon"), 1e-5, rel_tol=1e-6):
        refuse("layer_norm_epsilon", "ringpipe's LayerNorm uses 1e-5", "layer_norm_epsilon 1e-5")
    if get("scale_attn_weights") is not True:
        refuse("scale_attn_weights", "ringpipe always scales attention scores by 1/sqrt(head size)",
               "scale_attn_weights true")
    for key, why in (("scale_attn_by_inverse_layer_idx", "ringpipe does not scale attention by 1/(layer+1)"),
                     ("add_cross_attention", "ringpipe's GPT has no cross-attention")):
        if get(key) is not False:
            refuse(key, why, f"{key} false")
    # reorder_and_upcast_attn is not refused: it only makes transformers compute q.k in float32
    # with the scale applied before the matmul, the same attention in another order and precision.
    # tie_word_embeddings false is fine if lm_head.weight equals wte: checked with the tensors.
    return GPTConfig(n_layer=sizes["n_layer"], d_model=sizes["n_embd"], n_head=sizes["n_head"],
                     context=sizes["n_positions"], vocab=sizes["vocab_size"])


# GPT-2's names (without the prefix) of our parameters, and back.
def _gpt2_block():
    return {theirs: (ours, transposed) for ours, theirs, transposed in _BLOCK_NAMES}


_GPT2_TOP = {theirs: ours for ours, theirs, _ in name_map(0)}     # wte, wpe, ln_f


def _ours_from_gpt2(shapes: dict) -> dict:
    """{our name: shape in our orientation} of the GPT-2 tensors in `shapes` (prefix stripped);
    names that are not a GPT-2 parameter are left out (import_hf names them later)."""
    block = _gpt2_block()
    ours = {}
    for name, shape in shapes.items():
        if name in _GPT2_TOP:
            ours[_GPT2_TOP[name]] = tuple(shape)
            continue
        match = re.fullmatch(r"h\.(0|[1-9][0-9]*)\.(.+)", name)
        if match and match.group(2) in block:
            our_suffix, transposed = block[match.group(2)]
            ours[f"h.{match.group(1)}.{our_suffix}"] = tuple(reversed(shape)) if transposed else tuple(shape)
    return ours


def _gpt2_naming(ours: str, shape: tuple) -> tuple:
    """(GPT-2's full name of our parameter, the shape as GPT-2 stores it)."""
    top = {o: t for t, o in _GPT2_TOP.items()}
    if ours in top:
        return PREFIX + top[ours], shape
    index, suffix = ours[len("h."):].split(".", 1)
    theirs, transposed = next((t, tr) for o, t, tr in _BLOCK_NAMES if o == suffix)
    return f"{PREFIX}h.{index}.{theirs}", tuple(reversed(shape)) if transposed else shape


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
        description="Write a trained ringpipe model as a Hugging Face folder (config.json,\n"
                    "model.safetensors, the tokenizer) that transformers loads with no conversion code:\n"
                    "a GPT as GPT2LMHeadModel, a Llama as LlamaForCausalLM (Qwen2ForCausalLM with q/k/v biases).",
        epilog="Example:\n  ringpipe export runs/gpt --format hf --out runs/gpt-hf\n"
               "  python -c \"from transformers import pipeline; "
               "print(pipeline('text-generation', 'runs/gpt-hf')('def ', max_new_tokens=40)[0])\"",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory (its latest valid checkpoint), a checkpoints folder or a ckpt_*.json")
    parser.add_argument("--format", choices=["hf"], default="hf", help="output format (hf: Hugging Face, the checkpoint's family)")
    parser.add_argument("--out", required=True, metavar="HF_DIR", help="the folder to write (must be empty or new)")
    parser.add_argument("--overwrite", action="store_true", help="replace HF_DIR if it is not empty")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:          # argparse has printed the usage and the error (or --help)
        return 2 if e.code else 0
    try:
        return _export_command(args)
    except (ValueError, checkpoint.CheckpointError, OSError) as e:    # HFError, UnreadableFile, ConfigError
        print(f"error: {e}", file=sys.stderr)
        return 2


def _export_command(args) -> int:
    if not os.path.exists(args.source):
        raise HFError(f"{args.source} does not exist; pass a run directory, its checkpoints folder or a "
                      "ckpt_XXXXXXXX.json")
    manifest_path, note = checkpoint.resolve_with_note(args.source)
    if note:
        print(note, file=sys.stderr)
    # The manifest and the arrays' declared shapes first: model_config is checked against them
    # (check_checkpoint_shapes) before anything is built or read, and the output folder before
    # the arrays are read, so a refusal costs nothing.
    manifest, declared = checkpoint.declared_arrays(manifest_path)
    if not RECIPES[manifest["model"]].hf_format:            # the checkpoint's check knows every family
        raise HFError(f"{manifest_path} is a checkpoint of the {manifest['model']} model; only the GPT "
                      f"exports to the Hugging Face format (the families that do: "
                      f"{names_of(lambda recipe: recipe.hf_format)})")
    check_checkpoint_shapes(manifest, declared, manifest_path)
    run_dir = _run_dir(args.source, manifest_path)
    protect = (os.path.abspath(args.source), *map(os.path.abspath, checkpoint.files_of(manifest_path)), run_dir)
    check_out_dir(os.path.abspath(args.out), args.overwrite, protect)
    # Only the parameters (not the optimizer's state), each checked against its declared shape.
    params, _ = checkpoint.load(manifest_path, expected={name: shape for name, (shape, _) in declared.items()
                                                         if name.startswith("param/")})
    tokenizer, about_tokenizer = _find_tokenizer(manifest, run_dir, manifest["model_config"]["vocab"])
    out = export_hf(params, manifest["model_config"], args.out, tokenizer_json=tokenizer, overwrite=args.overwrite,
                    protect=protect, model=manifest["model"])

    # Counted from what was written, not from the checkpoint: its wte holds padding rows the
    # export trims (vocab 300 is stored as 384 rows), which the exported model does not have.
    n_params = sum(math.prod(shape) for _, shape, _ in
                   safetensors_header(os.path.join(out, "model.safetensors")).values())
    print(f"exported {manifest_path} (step {manifest['step']}, {n_params:,} parameters) to {out}:")
    print(f"  {', '.join(sorted(os.listdir(out)))}")
    print(f"  tokenizer: {about_tokenizer}")
    print("load it with:")
    print("  from transformers import AutoModelForCausalLM, AutoTokenizer")
    loads_tokenizer = f"; tokenizer = AutoTokenizer.from_pretrained({out!r})" if tokenizer is not None else ""
    print(f"  model = AutoModelForCausalLM.from_pretrained({out!r}){loads_tokenizer}")
    return 0


def _tokenizer_sha256(path: str) -> str:
    """The sha256 a checkpoint records for its tokenizer: engine.data.tokenizer's, over the JSON in
    canonical form, so re-indenting the file does not change it."""
    from ringpipe.engine.data.tokenizer import json_sha256
    raw = files_call(files.read_regular, path, "the run's tokenizer", MAX_TOKENIZER_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HFError(f"the run's tokenizer {path} is not UTF-8 text (byte {e.start})") from None
    files_call(files.parse_json, text, f"the run's tokenizer {path}")     # deep nesting refused by name
    try:
        return json_sha256(text)
    except ValueError as e:
        raise HFError(f"{path} is not valid JSON ({e})") from None


def _run_dir(source: str, manifest_path: str) -> str:
    """The run directory: RUN/checkpoints/ckpt_*.json or RUN/best/ckpt_*.json (--keep-best's) -> RUN
    (or the source itself if it is one)."""
    if os.path.isdir(os.path.join(source, "checkpoints")):
        return os.path.abspath(source)
    folder = os.path.dirname(os.path.abspath(manifest_path))
    return os.path.dirname(folder) if os.path.basename(folder) in ("checkpoints", "best") else folder


def _find_tokenizer(manifest: dict, run_dir: str, vocab: int):
    """(tokenizer.json path or JSON text or None, a description): the tokenizer the checkpoint
    names, else RUN_DIR/tokenizer.json, else the byte tokenizer for a 256-token model."""
    entry = manifest.get("tokenizer")
    if entry:
        path = os.path.join(run_dir, entry["file"])
        if not os.path.lexists(path):       # a FIFO or device under the name is refused when read
            raise HFError(f"the checkpoint was trained with the tokenizer {entry['file']} of its run directory, "
                          f"but {path} is missing; put it back (its sha256 is {entry['sha256']})")
        digest = _tokenizer_sha256(path)
        if digest != entry["sha256"]:
            raise HFError(f"{path} is not the tokenizer the checkpoint was trained with (sha256 {digest[:12]}..., "
                          f"the checkpoint says {entry['sha256'][:12]}...)")
        return path, f"{path} (the checkpoint's)"
    path = os.path.join(run_dir, "tokenizer.json")
    if os.path.lexists(path):
        return path, path
    if vocab == 256:
        try:
            from ringpipe.engine.data.tokenizer import load_tokenizer
        except ImportError:
            return None, "none written (a byte model, and this ringpipe has no engine/data/tokenizer.py to write one)"
        text = load_tokenizer("bytes").to_json()
        return (text if isinstance(text, str) else json.dumps(text)), "the byte tokenizer (256 tokens)"
    return None, f"none found (no tokenizer in the checkpoint nor {path}); the model has {vocab} tokens"


if __name__ == "__main__":
    sys.exit(main())
