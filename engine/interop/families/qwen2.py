"""Qwen2 (Qwen2ForCausalLM): Llama's block with biases on q, k and v (none elsewhere), and a
window on the layers layer_types names when use_sliding_window is on."""
from .family import Family


def _write(cfg, config, windows):
    config.update(windows)


FAMILY = Family(
    model_type="qwen2", architecture="Qwen2ForCausalLM",
    defaults={"num_key_value_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "hidden_act": "silu", "head_dim": None, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28},
    parts={"qkv_bias": True}, windows="types", window_switch="use_sliding_window",
    drop=("attention_bias", "mlp_bias", "pretraining_tp"), write=_write)
