"""The Llama-style families in Hugging Face's format, one module each (issue 36): what one
transformers class adds to the Llama block, as data, over the shared core of
engine/interop/hf_llama.py (names, shapes, config.json checks, reading and writing folders).

A Family says:
  model_type, architecture   its config.json's model_type and class name
  defaults                   transformers' defaults for the keys a config.json may leave out
  parts                      the LlamaConfig fields the class fixes (Qwen2: qkv_bias True, ...);
                             the others keep LlamaConfig's defaults
  windows                    how it takes sliding windows: "none", "all" (Mistral: every block)
                             or "types" (layer_types names the blocks)
  window_switch              the key that turns its window on (use_sliding_window), or None
  read(c, n_layer)           LlamaConfig fields it reads from config.json beyond the shared ones
  rope(c)                    (theta, scaling, local theta) where its RoPE keys are not Llama's
  check(c)                   refusals of its own keys (beyond the shared core's), by key
  window_layers(c, n_layer)  the windowed layers where config.json has no layer_types
  drop                       the Llama keys its config.json does not have
  write(cfg, config, windows)  its own keys into an exported config.json

Export picks the family whose parts are the model's (and that can say its windows); import
takes the family of config.json's model_type. Nothing here reads a tensor.
"""
from .family import PART_DEFAULTS, Family, parts_of, signature  # noqa: F401  (the package's names)
from . import gemma3, llama, mistral, olmo2, qwen2, qwen3, smollm3

# In the order export prefers them (Llama before Mistral: a model without a window is a Llama).
FAMILIES = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, smollm3.FAMILY, olmo2.FAMILY, gemma3.FAMILY)
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
