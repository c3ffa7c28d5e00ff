"""SmolLM3 (SmolLM3ForCausalLM): Llama's block, every fourth without RoPE (NoPE): its
no_rope_layers is 1 where a block rotates q and k, 0 where it does not, or, where that list is
absent, every no_rope_layer_interval-th block is NoPE (transformers' rule)."""
from .family import Family


def nope_layers(c, n_layer):
    """The blocks without RoPE, from no_rope_layers or no_rope_layer_interval; None for none."""
    flags = c.raw("no_rope_layers")
    if flags is None:
        interval = c.raw("no_rope_layer_interval")
        if type(interval) is not int or not 1 <= interval <= 2**14:
            c.invalid("no_rope_layer_interval", "a whole number from 1 to 16,384 (every interval-th block has no RoPE)")
        flags = [int((i + 1) % interval != 0) for i in range(n_layer)]
    if (not isinstance(flags, list) or len(flags) != n_layer or not all(type(f) is int and f in (0, 1)
                                                                         for f in flags)):
        c.invalid("no_rope_layers", f"a list of num_hidden_layers {n_layer} values, each 1 (the block rotates q "
                                    "and k) or 0 (NoPE), or null")
    return [i for i, rotates in enumerate(flags) if not rotates] or None


def _read(c, n_layer):
    return {"nope_layers": nope_layers(c, n_layer)}


def _write(cfg, config, windows):
    nope = set(cfg.nope_layers)
    config.update(no_rope_layers=[0 if i in nope else 1 for i in range(cfg.n_layer)],
                  **{k: v for k, v in windows.items() if k != "max_window_layers"})


FAMILY = Family(
    model_type="smollm3", architecture="SmolLM3ForCausalLM",
    defaults={"num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "hidden_act": "silu", "head_dim": None, "attention_bias": False,
              "mlp_bias": False, "use_sliding_window": False, "sliding_window": None, "rope_theta": 2000000.0,
              "no_rope_layers": None, "no_rope_layer_interval": 4},
    parts={"nope": True}, windows="types", window_switch="use_sliding_window", read=_read,
    window_layers=lambda c, n_layer: nope_layers(c, n_layer) or [],    # transformers': its NoPE layers slide
    drop=("pretraining_tp",), write=_write)
