"""The Llama family in and out of the Hugging Face format (hf.py dispatches here).

    export(arrays, model_config, out_dir, ...)   a Llama checkpoint -> a folder that
                                                 LlamaForCausalLM.from_pretrained loads
    import_folder(config, hf_dir)                a Llama-style folder (model_type llama, or a
                                                 mistral/qwen2/qwen3/smollm3 config ringpipe can
                                                 represent)
                                                 -> (LlamaConfig, {our name: array}, tokenizer.json)

A conversion is renaming and the vocabulary's padding only. ringpipe's Llama stores every
Linear weight (out, in) like torch.nn.Linear, and its q/k rows in Hugging Face's order:
heads contiguous, RoPE's half-split (rotate_half) pairs within each head. So no weight is
transposed or permuted (Meta's original checkpoints, with interleaved pairs, would need HF's
permutation: they are not a format read here).

config.json is written in full rather than left to transformers' defaults, which differ
from Llama 3's (rms_norm_eps 1e-6, tie_word_embeddings false). A model with q/k/v biases
exports as Qwen2ForCausalLM: Llama's attention_bias would put one on o_proj as well. A model
with the per-head q/k norm (qk_norm "head") exports as Qwen3ForCausalLM, one with NoPE
blocks (nope_layers) as SmolLM3ForCausalLM (its no_rope_layers: 1 rotates, 0 does not), one
with the norms after attention and the MLP and the q/k norm over all heads as Olmo2ForCausalLM
(whose post_attention_layernorm is then ringpipe's norm1, post_feedforward_layernorm its norm2),
one with Gemma 3's parts (four norms a block scaling by 1 + w, GeGLU, sqrt(d) embeddings, the
per-head q/k norm, local and global RoPE bases) as Gemma3ForCausalLM (model_type gemma3_text).
"""
from __future__ import annotations

import math
import re

import numpy as np

from ringpipe.engine.interop import hf_folder, hf_values
from ringpipe.engine.job import checkpoint
from ringpipe.engine.interop.families import BY_MODEL_TYPE, FAMILIES, PART_DEFAULTS, gemma3, olmo2, parts_of, signature
from ringpipe.engine.interop.hf_folder import HFError

# (our name, Hugging Face's name) per block, after "h.{i}." and "model.layers.{i}.".
_BLOCK_NAMES = [
    ("norm1.w", "input_layernorm.weight"),
    ("attn.q.w", "self_attn.q_proj.weight"),
    ("attn.k.w", "self_attn.k_proj.weight"),
    ("attn.v.w", "self_attn.v_proj.weight"),
    ("attn.o.w", "self_attn.o_proj.weight"),
    ("norm2.w", "post_attention_layernorm.weight"),
    ("mlp.gate.w", "mlp.gate_proj.weight"),
    ("mlp.up.w", "mlp.up_proj.weight"),
    ("mlp.down.w", "mlp.down_proj.weight"),
]
_QK_NORM_NAMES = [                       # qk_norm "head" only (Qwen3's)
    ("attn.q_norm.w", "self_attn.q_norm.weight"),
    ("attn.k_norm.w", "self_attn.k_norm.weight"),
]
_BIAS_NAMES = [                          # qkv_bias only (Qwen2's)
    ("attn.q.b", "self_attn.q_proj.bias"),
    ("attn.k.b", "self_attn.k_proj.bias"),
    ("attn.v.b", "self_attn.v_proj.bias"),
]
# Our parameters with a row per token: padded_vocab rows here, vocab_size rows in the file.
_VOCAB_ROWS = ("wte", "lm_head.w")
# Buffers older transformers saved with the weights (RoPE's inverse frequencies): not
# parameters, recomputed from the config, never read.
_BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)


def _llama_module():
    from ringpipe.engine.model import llama     # imported when a Llama is converted, not with hf.py
    return llama


def head_dim(cfg) -> int:
    return cfg.head_dim if cfg.head_dim is not None else cfg.d_model // cfg.n_head




def name_map(cfg) -> list:
    """[(our name, Hugging Face's name)] of every parameter of the model `cfg`."""
    block = _BLOCK_NAMES + (_BIAS_NAMES if cfg.qkv_bias else []) + (_QK_NORM_NAMES if cfg.qk_norm != "none" else [])
    if cfg.norm_place == "post":          # OLMo 2's: after attention and after the MLP
        block = [(ours, olmo2.NORM_NAMES.get(ours, theirs)) for ours, theirs in block]
    if cfg.norm_place == "sandwich":      # Gemma 3's four: before and after each
        block = [(ours, gemma3.NORM_NAMES.get(ours, theirs)) for ours, theirs in block] + gemma3.EXTRA_NAMES
    names = [("wte", "model.embed_tokens.weight")]
    for i in range(cfg.n_layer):
        names += [(f"h.{i}.{ours}", f"model.layers.{i}.{theirs}") for ours, theirs in block]
    names.append(("norm_f.w", "model.norm.weight"))
    if not cfg.tie_embeddings:
        names.append(("lm_head.w", "lm_head.weight"))
    return names


def block_shapes(cfg) -> dict:
    """{our name after "h.{i}.": shape} of one block."""
    C, F, hd = cfg.d_model, cfg.d_ff, head_dim(cfg)
    q, kv = cfg.n_head * hd, cfg.n_kv_head * hd
    shapes = {"norm1.w": (C,), "attn.q.w": (q, C), "attn.k.w": (kv, C), "attn.v.w": (kv, C),
              "attn.o.w": (C, q), "norm2.w": (C,), "mlp.gate.w": (F, C), "mlp.up.w": (F, C), "mlp.down.w": (C, F)}
    if cfg.qkv_bias:
        shapes.update({"attn.q.b": (q,), "attn.k.b": (kv,), "attn.v.b": (kv,)})
    if cfg.qk_norm == "head":
        shapes.update({"attn.q_norm.w": (hd,), "attn.k_norm.w": (hd,)})
    if cfg.qk_norm == "all":
        shapes.update({"attn.q_norm.w": (q,), "attn.k_norm.w": (kv,)})
    if cfg.norm_place == "sandwich":
        shapes.update({"post_attn_norm.w": (C,), "post_mlp_norm.w": (C,)})
    return shapes


def shape_of(cfg, ours: str, vocab_rows: int) -> tuple:
    """The shape of our parameter `ours`, with `vocab_rows` rows for wte and lm_head.w."""
    if ours in _VOCAB_ROWS:
        return (vocab_rows, cfg.d_model)
    if ours == "norm_f.w":
        return (cfg.d_model,)
    return block_shapes(cfg)[ours.split(".", 2)[2]]


def count_params(cfg, vocab_rows: int) -> int:
    heads = 1 if cfg.tie_embeddings else 2
    return (heads * vocab_rows * cfg.d_model + cfg.d_model
            + cfg.n_layer * sum(math.prod(s) for s in block_shapes(cfg).values()))


def _check_memory(cfg, where: str) -> None:
    hf_folder.check_memory(count_params(cfg, cfg.padded_vocab), where)


def config_from_dict(model_config: dict, where: str = "model_config"):
    """The LlamaConfig of a checkpoint's model_config, every value checked (LlamaConfig.validate);
    where: what holds it, for a refusal (the manifest's path)."""
    llama = _llama_module()
    import dataclasses
    fields = {f.name: f.default for f in dataclasses.fields(llama.LlamaConfig)}
    expected = set(fields)
    if isinstance(model_config, dict):
        # The keys a model_config written before them lacks (the checkpoint format's list): the
        # model then had their defaults (no q/k norm, no window, ...).
        model_config = {**{k: fields[k] for k in checkpoint.OPTIONAL_MODEL_CONFIG_KEYS["llama"]}, **model_config}
    if not isinstance(model_config, dict) or set(model_config) != expected:
        keys = sorted(model_config) if isinstance(model_config, dict) else type(model_config).__name__
        raise HFError(f"model_config has the keys {keys}, expected {sorted(expected)}: is it a Llama "
                      "checkpoint's model_config?")
    return _validated(llama.LlamaConfig(**model_config), where)


def _validated(cfg, where: str):
    try:
        cfg.validate()
    except ValueError as e:                      # ConfigError is one
        raise HFError(f"{where}: {e}") from None
    return cfg


# ---- export --------------------------------------------------------------------------------

def export(arrays: dict, model_config: dict, out_dir: str, tokenizer_json=None, overwrite=False,
           protect=()) -> str:
    """hf.export_hf for a Llama: the same contract (float32, atomic, out_dir rules)."""
    cfg = config_from_dict(model_config)
    params = hf_folder.param_arrays(arrays)
    layers = hf_folder.layer_indices(params)
    if cfg.n_layer > len(layers):                # before a table of n_layer entries is built
        raise HFError(f"model_config declares n_layer {cfg.n_layer}, but the parameters hold {len(layers)} "
                      "layers: are they this Llama's?")
    _check_params(cfg, params)
    tokenizer = hf_folder.Tokenizer.read(tokenizer_json, cfg.vocab) if tokenizer_json is not None else None
    bos, eos = _special_ids(tokenizer)
    tensors = {}
    for ours, theirs in name_map(cfg):
        array = params[ours][:cfg.vocab] if ours in _VOCAB_ROWS else params[ours]   # the padding is ours alone
        tensors[theirs] = np.ascontiguousarray(array, dtype=np.float32)
    written = {"config.json": hf_folder.json_bytes(hf_config(cfg, bos, eos)),
               "generation_config.json": hf_folder.json_bytes({"bos_token_id": bos, "eos_token_id": eos})}
    if tokenizer is not None:
        written["tokenizer.json"] = tokenizer.text.encode()
        written["tokenizer_config.json"] = hf_folder.json_bytes(tokenizer.config(cfg.context, bos, eos))
        written["special_tokens_map.json"] = hf_folder.json_bytes(tokenizer.special_tokens_map(bos, eos))
    return hf_folder.write_model_folder(tensors, written, out_dir, overwrite, protect)


def _check_params(cfg, params: dict) -> None:
    mapped = {ours for ours, _ in name_map(cfg)}
    unmapped = sorted(set(params) - mapped)
    if unmapped:
        raise HFError(f"the parameters {unmapped[:5]} have no Hugging Face mapping in engine/interop/"
                      "hf_llama.py (a bug: the model changed, its conversion did not), or are not this "
                      f"Llama's ({cfg.to_dict()})")
    for ours in sorted(mapped):
        if ours not in params:
            raise HFError(f"the parameters lack {ours!r}: are they this Llama's ({cfg.to_dict()})?")
        array = np.asarray(params[ours])
        want = shape_of(cfg, ours, cfg.padded_vocab)
        if array.shape != want:
            raise HFError(f"parameter {ours!r} has shape {array.shape}, the Llama {cfg.to_dict()} has {want}")
        if array.dtype.kind != "f":
            raise HFError(f"parameter {ours!r} has dtype {array.dtype}, expected floating point")
        if not np.isfinite(array).all():
            raise HFError(f"parameter {ours!r} holds NaN or inf: the model diverged; export an earlier "
                          "checkpoint")


# Tokens that begin a text, in the order we look for them: Llama 3's, SentencePiece's, Gemma's.
_BEGIN_OF_TEXT_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>")


def _special_ids(tokenizer) -> tuple:
    """(bos id, eos id) from the tokenizer's own tokens; a tokenizer without a begin token
    (GPT-2's, SmolLM2's) begins with its end-of-text token, as those models do; none without one."""
    if tokenizer is None:
        return None, None
    eos = tokenizer.end_of_text_id()
    bos = next((tokenizer.ids[t] for t in _BEGIN_OF_TEXT_TOKENS if t in tokenizer.ids), eos)
    return bos, eos


def _rope_fields(cfg) -> dict:
    """RoPE as both generations of transformers read it: rope_theta and rope_scaling (up to
    4.x), rope_parameters (5.x, where rope_scaling, when set, takes precedence: so both agree)."""
    if cfg.rope_scaling is None:
        return {"rope_theta": cfg.rope_theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    scaling = {"rope_type": "llama3", **cfg.rope_scaling}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "rope_parameters": {**scaling, "rope_theta": cfg.rope_theta}}


def hf_config(cfg, bos, eos) -> dict:
    """config.json: every field that decides the math, written out."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,                 # the tokenizer's size: the padding is not exported
        "max_position_embeddings": cfg.context,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": head_dim(cfg),
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_eps,
        **_rope_fields(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,                # ringpipe trains without dropout
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        "dtype": "float32",                      # transformers >= 4.56 reads "dtype",
        "torch_dtype": "float32",                # older versions "torch_dtype"
    }
    _as_family(cfg, config)
    return config


def _as_family(cfg, config) -> None:
    """config (hf_config's Llama keys) made the class that has cfg's parts (families/: Llama,
    Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Gemma 3) and can say its sliding windows; HFError
    naming the parts when no class has them together."""
    sliding = set(range(cfg.n_layer) if cfg.window_layers is None else cfg.window_layers) if cfg.sliding_window \
        else set()
    family = _family_for(cfg, sliding)
    # The window keys of the classes that name windowed layers (layer_types; transformers 4 read
    # max_window_layers instead, which says a suffix of the layers only, and 5 reads layer_types).
    suffix = sliding and sliding == set(range(min(sliding), cfg.n_layer))
    windows = dict(use_sliding_window=bool(sliding), sliding_window=cfg.sliding_window,
                   max_window_layers=min(sliding) if suffix else cfg.n_layer,
                   layer_types=["sliding_attention" if i in sliding else "full_attention" for i in range(cfg.n_layer)])
    for key in family.drop:
        del config[key]
    config.update(architectures=[family.architecture], model_type=family.model_type)
    if family.write is not None:
        family.write(cfg, config, windows)


def _family_for(cfg, sliding: set):
    """The first family (families.FAMILIES' order) whose parts are cfg's and which can hold its
    windows: none, every block (Mistral's "all"), or the blocks layer_types names ("types")."""
    parts = parts_of(cfg)
    same = [f for f in FAMILIES if signature(f) == parts]
    if not same:
        given = ", ".join(f"{k} {v}" for k, v in parts.items() if v != PART_DEFAULTS[k])
        classes = "; ".join(f"{f.architecture}: " + ", ".join(f"{k} {v}" for k, v in f.parts.items())
                            for f in FAMILIES if f.parts)
        raise HFError(f"a model with these parts ({given}) has no Hugging Face class to export to: each class "
                      f"has its own set, and no other ({classes})")
    for family in same:
        if (not sliding and family.windows != "all") or family.windows == "types" or \
                (family.windows == "all" and len(sliding) == cfg.n_layer):
            return family
    raise HFError(f"a sliding window on {'some of the' if len(sliding) < cfg.n_layer else 'the'} blocks of a model "
                  f"with {', '.join(f.architecture for f in same)}'s parts has no Hugging Face class to export to "
                  "(Mistral's window is on every block; Qwen2's, Qwen3's, SmolLM3's and Gemma 3's on the blocks "
                  "their layer_types name; Llama's and OLMo 2's classes have none)")


def check_checkpoint_shapes(manifest: dict, declared: dict, path: str):
    """hf.check_checkpoint_shapes for a Llama checkpoint: its model_config against the arrays
    its npz declares, before anything is built or read."""
    where = f"the manifest {path}'s model_config"
    try:
        cfg = config_from_dict(manifest["model_config"], where)
    except HFError as e:
        raise HFError(f"{e}; the manifest was edited: use the checkpoint as it was written") from None
    params = {name[len("param/"):]: tuple(shape) for name, (shape, _) in declared.items()
              if name.startswith("param/")}
    if cfg.n_layer != len(hf_folder.layer_indices(params)):
        raise HFError(f"{where} declares n_layer {cfg.n_layer}, but the checkpoint holds "
                      f"{len(hf_folder.layer_indices(params))} layers: the two disagree (was it edited?)")
    for ours, _ in name_map(cfg):
        want = shape_of(cfg, ours, cfg.padded_vocab)
        if params.get(ours) != want:
            have = "missing" if ours not in params else f"of shape {params[ours]}"
            raise HFError(f"the checkpoint's array param/{ours} is {have}, but {where} implies {want} "
                          f"({_describe(cfg)}): the two disagree (was it edited?)")
    _check_memory(cfg, where)
    return cfg


def _describe(cfg) -> str:
    return ", ".join(f"{key} {value}" for key, value in cfg.to_dict().items())


# ---- import: config.json -------------------------------------------------------------------

MODEL_TYPES = tuple(BY_MODEL_TYPE)       # engine/interop/families/: one module each
# transformers' names of SiLU (ACT2FN): the gate's activation of ringpipe's SwiGLU.
_SILUS = ("silu", "swish")
# Keys that make a model a mixture of experts (a model_type we read, extended by hand).
_MOE_KEYS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
             "n_routed_experts")
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_UNSET = object()           # _Config.invalid / unsupported: show the key's value from config.json


class _Config:
    """config.json with transformers' defaults: every value read is checked against its rule
    (hf_values.RULES), and every refusal names the key and says what to do."""

    def __init__(self, config: dict, hf_dir: str):
        self.config, self.where = config, f"{hf_dir}/config.json"
        self.model_type = config["model_type"]
        self.family = BY_MODEL_TYPE[self.model_type]

    def raw(self, key, default=None):
        """The value as given, or transformers' default where config.json leaves it out."""
        return self.config.get(key, self.family.defaults.get(key, default))

    def checked(self, key, value):
        """value, if it holds the rule of `key` (a dotted key by its last part); else HFError."""
        return hf_folder.checked(self.where, key, value)

    def get(self, key, default=None):
        """raw(), checked: HFError saying what to set the key to unless its type and range hold."""
        return hf_folder.checked(self.where, key, self.raw(key, default))

    def invalid(self, key, expected, value=_UNSET):
        raise HFError(hf_values.invalid(self.where, key, self.raw(key) if value is _UNSET else value, expected))

    def unsupported(self, key, why, instead, value=_UNSET):
        raise HFError(hf_values.unsupported(self.where, key, self.raw(key) if value is _UNSET else value, why,
                                            instead))

    def size(self, key):
        if key not in self.config and key not in self.family.defaults:
            raise HFError(f"{self.where}: add {key} to config.json: model_type is {self.model_type!r}, whose "
                          "config.json gives it, and this one does not (is its model_type right?)")
        return self.get(key)


def config_from_hf(config: dict, hf_dir: str):
    """The LlamaConfig of a Llama-style config.json; HFError naming the key of any value out of
    type or range, and of anything ringpipe's Llama would compute differently. Reads no tensor."""
    c = _Config(config, hf_dir)
    sizes = {key: c.size(key) for key in _SIZE_KEYS}
    heads, width = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = c.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        c.invalid("num_key_value_heads", f"a divisor of num_attention_heads {heads} (grouped-query attention: each "
                                         "key/value head serves an equal group of query heads)", kv_heads)
    hd = c.get("head_dim")
    if hd is None and width % heads:
        c.invalid("num_attention_heads", f"a divisor of hidden_size {width} (or set head_dim)")
    if hd is None and (width // heads) % 2:
        c.invalid("num_attention_heads", f"a divisor of hidden_size {width} that leaves an even head size (rotary "
                                         "embedding turns pairs of channels), or set head_dim")
    if hd is not None and hd % 2:
        c.invalid("head_dim", "an even whole number (rotary embedding turns pairs of channels)")
    hd = width // heads if hd is None else hd
    context = c.size("max_position_embeddings")
    c.get("attention_dropout", 0.0)             # type and range: import_notes reads it (every type's default 0)
    _refuse_unsupported(c, context, sizes["num_hidden_layers"])
    family = c.family
    theta, scaling, local_theta = family.rope(c) if family.rope else (*_rope_from_hf(c, context), None)
    llama = _llama_module()
    n_layer = sizes["num_hidden_layers"]
    cfg = llama.LlamaConfig(n_layer=n_layer, d_model=width, n_head=heads, n_kv_head=kv_heads,
                            d_ff=sizes["intermediate_size"], context=context, vocab=sizes["vocab_size"], head_dim=hd,
                            rope_theta=theta, rope_scaling=scaling, rms_eps=c.get("rms_norm_eps"),
                            tie_embeddings=c.get("tie_word_embeddings"), rope_local_theta=local_theta)
    for part, value in family.parts.items():         # what the class fixes (nope: read below)
        if part != "nope":
            setattr(cfg, part, value)
    for name, value in (family.read(c, n_layer) if family.read else {}).items():
        setattr(cfg, name, value)
    cfg.sliding_window, cfg.window_layers = _windows_from_hf(c, context, n_layer)
    return _validated(cfg, c.where)


def _refuse_unsupported(c: _Config, context: int, n_layer: int) -> None:
    """Activations, biases, windows, experts and quantization ringpipe's Llama does not have."""
    if c.family.check is not None:
        c.family.check(c)                        # its own keys (Gemma 3's activation, soft-capping, ...)
    elif c.get("hidden_act") not in _SILUS:
        c.unsupported("hidden_act", "ringpipe's Llama MLP is SwiGLU, whose gate uses silu", "hidden_act silu")
    # Only some classes read attention_bias and mlp_bias (Mistral's and Qwen2's biases are fixed
    # by the architecture).
    reads = c.family.defaults
    if "attention_bias" in reads and c.get("attention_bias"):
        c.unsupported("attention_bias", "it puts a bias on o_proj too, and ringpipe's Llama has biases on q, k and "
                                        "v only (as Qwen2) or none", "attention_bias false")
    if "mlp_bias" in reads and c.get("mlp_bias"):
        c.unsupported("mlp_bias", "ringpipe's Llama MLP has no biases", "mlp_bias false")
    for key in _MOE_KEYS:
        if c.raw(key) not in (None, 0):
            c.unsupported(key, "it makes a mixture of experts, and ringpipe's Llama has one dense MLP per block",
                          f"no {key}")
    if c.raw("quantization_config") is not None:
        c.unsupported("quantization_config", "its weights are quantized, and ringpipe reads float weights only "
                                             "(F32, F16, BF16, F64)", "no quantization_config (the float model)")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        c.unsupported("partial_rotary_factor", "ringpipe's RoPE rotates every dimension of a head",
                      "partial_rotary_factor 1.0, or none")



def _windows_from_hf(c: _Config, context: int, n_layer: int) -> tuple:
    """(sliding_window, window_layers) as transformers builds the attention: Mistral's window on
    every layer; Qwen2's, Qwen3's and SmolLM3's only when use_sliding_window is true, on the
    layers layer_types calls "sliding_attention" (without layer_types: Qwen's from
    max_window_layers on, SmolLM3's NoPE layers). (None, None) when no layer has a window
    shorter than the context, where a window changes nothing."""
    layer_types = c.raw("layer_types")
    if layer_types is not None:
        if (not isinstance(layer_types, list) or len(layer_types) != n_layer
                or not all(isinstance(t, str) for t in layer_types)):
            c.invalid("layer_types", f"a list of num_hidden_layers {n_layer} strings, each layer's attention "
                                     "(\"full_attention\" or \"sliding_attention\"), or null")
        other = [t for t in layer_types if t not in ("full_attention", "sliding_attention")]
        if other:
            c.unsupported("layer_types", f"it has {other[0]} layers, and ringpipe's Llama has full_attention and "
                                         "sliding_attention layers only", "no layer_types other than those two")
    if c.family.windows == "none":
        return None, None                        # Llama's and OLMo 2's classes have no window
    window = c.get("sliding_window")
    switch = c.family.window_switch
    if switch is not None and c.get(switch) is not True:
        window = None                            # Qwen2: the window is used only when switched on
    if layer_types is not None:
        layers = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    elif c.family.window_layers is not None:
        layers = c.family.window_layers(c, n_layer)     # the class's own rule (SmolLM3's, Gemma 3's)
    elif switch is not None:
        first = c.get("max_window_layers")      # transformers' rule: layers from max_window_layers on slide
        layers = [i for i in range(n_layer) if first is None or i >= first]
    else:
        layers = list(range(n_layer))            # Mistral: every layer
    if window is None or window >= context or not layers:
        return None, None
    return window, (None if len(layers) == n_layer else layers)


def _rope_from_hf(c: _Config, context: int) -> tuple:
    """(theta, llama3 scaling dict or None), read as transformers 5 does: rope_scaling, when
    set, replaces rope_parameters; rope_theta fills in a theta neither holds. Every number is
    checked here: a NaN factor or a low_freq_factor of 0 would otherwise fail in kernels/rope.py
    when the model is built, after the data was opened."""
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(c.raw(key), (dict, type(None))):
            c.invalid(key, "an object of a rope_type and its numbers, or null")
    key = "rope_scaling" if c.raw("rope_scaling") else "rope_parameters"
    params = c.raw(key) or {}
    if any(isinstance(v, dict) for v in params.values()):
        c.unsupported(key, "it sets a RoPE per layer type, and ringpipe's Llama has one RoPE for every layer",
                      f"one {key} object of numbers and a rope_type")
    for name in ("rope_type", "type", "rope_theta", "partial_rotary_factor", *_LLAMA3_FIELDS):
        if name in params:
            hf_folder.checked(c.where, f"{key}.{name}", params[name])
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))      # the top level's is checked either way
    # Checked whatever the RoPE, though only llama3 scaling reads it.
    top = c.get("original_max_position_embeddings") if "original_max_position_embeddings" in c.config else None
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        c.unsupported(f"{key}.partial_rotary_factor", "ringpipe's RoPE rotates every dimension of a head",
                      "partial_rotary_factor 1.0, or none", params["partial_rotary_factor"])
    type_key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(type_key, "default")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        c.unsupported(f"{key}.{type_key}", "ringpipe's RoPE is \"default\" or Llama 3's \"llama3\" scaling",
                      f"{key} of rope_type \"default\" or \"llama3\"", rope_type)
    scaling = {name: params.get(name, hf_values.MISSING) for name in _LLAMA3_FIELDS}
    if scaling["original_max_position_embeddings"] is hf_values.MISSING:
        scaling["original_max_position_embeddings"] = context       # transformers' default
    if top is not None and top != scaling["original_max_position_embeddings"]:
        # transformers 5 takes the top level's, 4 the one in the RoPE object: the two must agree.
        c.invalid("original_max_position_embeddings", f"{key}.original_max_position_embeddings "
                                                      f"{scaling['original_max_position_embeddings']}, the same "
                                                      "(transformers 4 and 5 read different ones), or remove it")
    for name, value in scaling.items():
        if value is hf_values.MISSING:
            c.invalid(f"{key}.{name}", f"{hf_values.RULES[name].expected()} (llama3 scaling needs "
                                       f"{', '.join(_LLAMA3_FIELDS)})", value)
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        c.invalid(f"{key}.high_freq_factor", f"a number greater than {key}.low_freq_factor "
                                             f"{scaling['low_freq_factor']}", scaling["high_freq_factor"])
    return float(theta), scaling


# Llama 3's scaling (kernels/rope.py, transformers' _compute_llama3_parameters).
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# ---- import: the weights -------------------------------------------------------------------

def import_folder(config: dict, hf_dir: str) -> tuple:
    """hf.import_hf for a Llama-style folder: (LlamaConfig, {our name: float32 array}, the path
    of its tokenizer.json or None). wte (and lm_head.w) padded to cfg.padded_vocab rows."""
    cfg, source, tokenizer = open_folder(config, hf_dir)
    return cfg, {ours: source.read_whole(ours) for ours, _ in name_map(cfg)}, tokenizer


def open_folder(config: dict, hf_dir: str) -> tuple:
    """(LlamaConfig, hf_folder.TensorBoxes over our names, the path of its tokenizer.json or
    None), every tensor's presence and shape checked from the headers and a tied head compared
    with the embedding, but no tensor read whole: each rank reads the boxes it holds (a
    sharded import, engine/parallel/slices.py's fill). wte (and lm_head.w) read with
    cfg.padded_vocab rows, the padding rows zeros (no token id reaches them, the head masks
    their logits)."""
    cfg = config_from_hf(config, hf_dir)
    headers = hf_folder.read_headers(hf_folder.weight_files(hf_dir), hf_dir)
    _check_headers(cfg, headers, hf_dir)
    source = hf_folder.TensorBoxes({ours: headers[theirs] for ours, theirs in name_map(cfg)},
                                   rows={ours: cfg.padded_vocab for ours in _VOCAB_ROWS}, names=dict(name_map(cfg)))
    if cfg.tie_embeddings and "lm_head.weight" in headers and not source.same("wte", headers["lm_head.weight"]):
        raise HFError(f"{hf_dir}: lm_head.weight differs from model.embed_tokens.weight, but config.json says "
                      "tie_word_embeddings true (transformers would use the embedding for both): set "
                      "tie_word_embeddings false if the head is meant to be its own")
    return cfg, source, hf_folder.tokenizer_of(hf_dir)


def _check_headers(cfg, headers: dict, hf_dir: str) -> list:
    """The tensor names to read, once every tensor the config implies is present with its
    shape and no other is: from the files' headers, before any tensor is read."""
    where = f"{hf_dir}/config.json"
    shapes = {name: shape for name, (_, shape, _) in headers.items()}
    present = {int(m.group(1)) for m in map(re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.").match, shapes) if m}
    if cfg.n_layer > len(present):               # before a table of n_layer entries is built
        raise HFError(f"{where} declares num_hidden_layers {cfg.n_layer}, but the weights hold {len(present)} "
                      "layers: the weights are incomplete or do not match config.json")
    _check_memory(cfg, where)
    names = name_map(cfg)
    for ours, theirs in names:
        want = shape_of(cfg, ours, cfg.vocab)
        if theirs not in shapes:
            raise HFError(f"{hf_dir}: the tensor {theirs} is missing (config.json declares {_describe(cfg)}): "
                          "the weights are incomplete or do not match config.json")
        if tuple(shapes[theirs]) != want:
            raise HFError(f"{hf_dir}: the tensor {theirs} has shape {tuple(shapes[theirs])}, but config.json "
                          f"implies {want} ({_describe(cfg)}): the two disagree")
    wanted = [theirs for _, theirs in names]
    if cfg.tie_embeddings and "lm_head.weight" in shapes:
        if tuple(shapes["lm_head.weight"]) != (cfg.vocab, cfg.d_model):
            raise HFError(f"{hf_dir}: lm_head.weight has shape {tuple(shapes['lm_head.weight'])}, not the "
                          f"embedding's {(cfg.vocab, cfg.d_model)}, but config.json ties them")
        wanted.append("lm_head.weight")          # read to check it is the embedding
    leftover = sorted(set(shapes) - set(wanted))
    leftover = [name for name in leftover if not name.endswith(_BUFFER_SUFFIXES)]
    if leftover:
        raise HFError(f"{hf_dir}: tensors that ringpipe's Llama with this config.json does not have: "
                      f"{', '.join(leftover[:5])}{', ...' if len(leftover) > 5 else ''} (biases on o_proj "
                      "or the MLP, or more layers than num_hidden_layers, are not representable)")
    return wanted


def import_notes(config: dict, hf_dir: str) -> list:
    rate = config.get("attention_dropout", 0.0)
    if type(rate) in (int, float) and rate != 0:
        return [f"note: {hf_dir}/config.json sets dropout (attention_dropout {rate}); ringpipe trains without "
                "dropout, so fine-tuning here runs with none"]
    return []
