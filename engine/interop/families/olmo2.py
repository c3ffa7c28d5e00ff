"""OLMo 2 (Olmo2ForCausalLM): the norms after attention and after the MLP, before each
residual add, none before (post_attention_layernorm, post_feedforward_layernorm: ringpipe's
norm1 and norm2), and one RMSNorm over a position's whole q and one over its whole k. No
sliding window."""
from .family import Family

# Its block norms' names (ringpipe's norm1 and norm2 sit after attention and the MLP).
NORM_NAMES = {"norm1.w": "post_attention_layernorm.weight", "norm2.w": "post_feedforward_layernorm.weight"}

FAMILY = Family(
    model_type="olmo2", architecture="Olmo2ForCausalLM",
    defaults={"num_key_value_heads": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "hidden_act": "silu", "head_dim": None, "attention_bias": False},
    parts={"qk_norm": "all", "norm_place": "post"}, drop=("mlp_bias", "pretraining_tp"))
