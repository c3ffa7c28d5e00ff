"""ringpipe.engine: the trainer, one folder per concern.

    from ringpipe.engine import run, Config
    result = run(Config(data="synthetic", steps=20, out="runs/lib", overwrite=True), world=MPI.COMM_WORLD)

    model/      parameters, layers, the layer chain, GPT, MLP, optimizers (no MPI)
    parallel/   the rank-model protocol and one module per parallel axis; pipeline/ its rank model,
                executor and partitioner
    schedules/  pipeline schedules as data: plan, validate, simulate (standard library only)
    data/       datasets, token shards, tokenizers, `ringpipe prepare`
    job/        what a cluster does to a job: signals, watchdog, run directory, checkpoints,
                agreement, settings, files, errors
    train/      the program: command line, Config, assembly, the step loop, reporting
    interop/    Hugging Face in and out, sampling

Each folder's import rule is in its __init__.py and checked by tests/test_architecture.py.
The names below load on first use, so importing a light part (engine.schedules) never pulls
in numpy or MPI.
"""
if __name__ == "engine":
    # Python started in the checkout's root found this folder as a top-level `engine`, a name
    # any other package may use: that one takes it, else the import fails naming ringpipe.engine
    # (ringpipe/_shadowing.py).
    import os
    import runpy

    _shadowing = runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(__file__)), "ringpipe", "_shadowing.py"))
    _shadowing["step_aside"](__name__, __file__)
else:
    from importlib import import_module

    # name -> the module that defines it: the library's public surface
    _PUBLIC = {
        "run": "ringpipe.engine.train.run",
        "RunResult": "ringpipe.engine.train.run",
        "Config": "ringpipe.engine.train.config",
        "ConfigError": "ringpipe.engine.job.errors",
        "JobFailure": "ringpipe.engine.job.errors",
        "Diverged": "ringpipe.engine.job.errors",
    }

    __all__ = sorted(_PUBLIC)

    def __getattr__(name):
        if name in _PUBLIC:
            return getattr(import_module(_PUBLIC[name]), name)
        raise AttributeError(f"module 'ringpipe.engine' has no attribute {name!r}")
