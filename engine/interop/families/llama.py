"""Llama (LlamaForCausalLM): the block as it is; no sliding window in transformers' class."""
from .family import Family

FAMILY = Family(
    model_type="llama", architecture="LlamaForCausalLM",
    defaults={"num_key_value_heads": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "hidden_act": "silu", "head_dim": None, "attention_bias": False,
              "mlp_bias": False})
