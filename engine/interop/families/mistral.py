"""Mistral (MistralForCausalLM): Llama's block with a sliding window on every block (on by
default: 4096)."""
from .family import Family


def _write(cfg, config, windows):
    config["sliding_window"] = cfg.sliding_window


FAMILY = Family(
    model_type="mistral", architecture="MistralForCausalLM",
    defaults={"num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "hidden_act": "silu", "head_dim": None, "sliding_window": 4096},
    windows="all", drop=("attention_bias", "mlp_bias", "pretraining_tp"), write=_write)
