"""The model: parameters, the plain layers, the layer chain, the model recipes, GPT, Llama, the MLP, the optimizers.

    params.py   the flat parameter and gradient buffers, named views, init from (seed, name)
    layers.py   the hand-written layers (forward, backward_input, backward_weight)
    chain.py    LayerChain: a contiguous run of layers on one parameter buffer
    recipe.py   ModelRecipe: what the trainer, its checks and reporting ask of a model family
    registry.py RECIPES: the families by name, where a new one is registered
    gpt.py, llama.py, mlp.py   the model families, each with its recipe
    optim.py    AdamW, SGD, global-norm clipping, the LR schedule

Import rule (tests/test_architecture.py): numpy, ringpipe.kernels, this folder, and the
two leaves of job/ every layer may need (errors: ConfigError; array_module: to_host).
No MPI, no comm: a model is the same on one process and on many.
"""
