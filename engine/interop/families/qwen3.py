"""Qwen3 (Qwen3ForCausalLM, dense): Llama's block with an RMSNorm of head_dim weights over each
head's q and k before RoPE (q_norm, k_norm), head_dim apart from hidden / heads (128 by
default), windows as Qwen2's. Its attention_bias would bias o_proj too: refused when true."""
from .family import Family


def _write(cfg, config, windows):
    config.update(windows)


FAMILY = Family(
    model_type="qwen3", architecture="Qwen3ForCausalLM",
    defaults={"num_key_value_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "hidden_act": "silu", "head_dim": 128, "attention_bias": False,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    parts={"qk_norm": "head"}, windows="types", window_switch="use_sliding_window",
    drop=("mlp_bias", "pretraining_tp"), write=_write)
