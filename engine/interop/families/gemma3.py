"""Gemma 3, its text model (Gemma3ForCausalLM, model_type gemma3_text): four RMSNorms a block
scaling by (1 + w), GeGLU with GELU's tanh form (hidden_activation), the embedding times
sqrt(hidden_size), the per-head q/k norm, scores by query_pre_attn_scalar^-1/2, and windowed
(local) layers with a RoPE base of their own (rope_parameters per layer type in transformers 5,
rope_local_base_freq in 4), the others global. Attention soft-capping, bidirectional attention and the
larger models' linear RoPE scaling are refused by key; final-logit soft-capping is read (null in
Gemma 3's own configs)."""
from .family import Family

# transformers' names of GELU's tanh form (ACT2FN): the gate's activation.
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
# Its block norms: before and after attention, before and after the MLP.
NORM_NAMES = {"norm2.w": "pre_feedforward_layernorm.weight"}
EXTRA_NAMES = [("post_attn_norm.w", "post_attention_layernorm.weight"),
               ("post_mlp_norm.w", "post_feedforward_layernorm.weight")]


def _check(c):
    if c.get("hidden_activation") not in TANH_GELUS:
        c.unsupported("hidden_activation", "ringpipe's Gemma 3 MLP is GeGLU with GELU's tanh form",
                      "hidden_activation gelu_pytorch_tanh")
    if c.get("attn_logit_softcapping") is not None:
        c.unsupported("attn_logit_softcapping", "ringpipe's attention kernels do not soft-cap the scores (Gemma 3 "
                      "does not either; Gemma 2 did)", "attn_logit_softcapping null")
    if c.get("use_bidirectional_attention"):
        c.unsupported("use_bidirectional_attention", "ringpipe's attention is causal", "use_bidirectional_attention false")


def _rope(c):
    """(global theta, None, local theta): rope_parameters per layer type (transformers 5), or
    rope_theta and rope_local_base_freq (4); default RoPE only."""
    params = c.raw("rope_parameters")
    if isinstance(params, dict) and set(params) >= {"full_attention", "sliding_attention"}:
        found = {}
        for kind in ("full_attention", "sliding_attention"):
            one = params[kind]
            if not isinstance(one, dict):
                c.invalid(f"rope_parameters.{kind}", "an object of a rope_type and a rope_theta")
            if one.get("rope_type", "default") != "default":
                c.unsupported(f"rope_parameters.{kind}.rope_type", "ringpipe reads Gemma 3's default RoPE only (the "
                              "linear scaling of its larger models is not implemented)", "rope_type \"default\"",
                              one.get("rope_type"))
            found[kind] = c.checked(f"rope_parameters.{kind}.rope_theta", one.get("rope_theta"))
        return float(found["full_attention"]), None, float(found["sliding_attention"])
    if c.raw("rope_scaling"):
        c.unsupported("rope_scaling", "ringpipe reads Gemma 3's default RoPE only (the linear scaling of its larger "
                      "models is not implemented)", "rope_scaling null")
    return float(c.get("rope_theta")), None, float(c.get("rope_local_base_freq"))


def _window_layers(c, n_layer):
    pattern = c.raw("sliding_window_pattern")      # transformers' rule: all but every pattern-th layer slide
    if type(pattern) is not int or not 1 <= pattern <= 2**14:
        c.invalid("sliding_window_pattern", "a whole number from 1 to 16,384 (every pattern-th layer is global)")
    return [i for i in range(n_layer) if (i + 1) % pattern]


def _read(c, n_layer):
    cap = c.get("final_logit_softcapping")
    return {"attn_scalar": float(c.get("query_pre_attn_scalar")), "logit_softcap": None if cap is None else float(cap)}


def _write(cfg, config, windows):
    """Its keys, and its per-layer-type RoPE (transformers 5) as rope_theta / rope_local_base_freq (4)."""
    local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    scalar = cfg.attn_scalar if cfg.attn_scalar is not None else config["head_dim"]
    config.update(hidden_activation="gelu_pytorch_tanh",
                  query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                  sliding_window=cfg.sliding_window, layer_types=windows["layer_types"],
                  rope_local_base_freq=local, final_logit_softcapping=cfg.logit_softcap, attn_logit_softcapping=None,
                  use_bidirectional_attention=False,
                  rope_parameters={"full_attention": config["rope_parameters"],
                                   "sliding_attention": {"rope_type": "default", "rope_theta": local}})


FAMILY = Family(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM",
    defaults={"num_key_value_heads": 4, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "hidden_act": "silu", "hidden_activation": "gelu_pytorch_tanh",
              "head_dim": 256, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
              "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "final_logit_softcapping": None,
              "attn_logit_softcapping": None, "use_bidirectional_attention": False, "sliding_window_pattern": 6},
    parts={"qk_norm": "head", "norm_place": "sandwich", "rms_offset": 1.0, "mlp_act": "gelu_tanh",
           "embed_scale": True},
    windows="types", read=_read, rope=_rope, check=_check, window_layers=_window_layers,
    drop=("hidden_act", "mlp_bias", "pretraining_tp", "rope_scaling"), write=_write)
