"""Every rank reaches the same verdict before work: a step that depends on one
rank's own state (its filesystem, its GPU, its node's memory, its command line
in an MPMD launch) is run on every rank and its outcome shared, so a failure
anywhere stops every rank with the same error, never some ranks waiting
forever in the next collective.

    result = agree(world, lambda: checkpoint.read_manifest(path), "checkpoint")
    notes = agree_on_rank0(world, prepare_run_dir, "run directory")   # rank 0 works, all learn

What a training run agrees on besides (one config, a usable batch) is
engine/train/agreement.py: this module is the generic part, which data tools
such as `ringpipe prepare` use too, so it imports no training code.
"""
from __future__ import annotations

from ringpipe.engine.job import checkpoint, rundir
from ringpipe.engine.job.errors import ConfigError, JobFailure

# What a step that depends on this rank's state may raise to be refused (others are bugs).
_REFUSALS = (ConfigError, checkpoint.CheckpointError, rundir.RunDirError, JobFailure, OSError, ValueError)


def _message(e: BaseException) -> str:
    return e.message if isinstance(e, ConfigError) else str(e)


def agree(world, fn, what, same_result=False, hint="is the path on a filesystem every node sees?",
          compared=lambda result: result):
    """Run `fn` on every rank; if it failed anywhere, raise ConfigError on every
    rank (naming the ranks, and `hint` when only some failed). same_result: the
    ranks' results (or what `compared` picks of them) must also be equal."""
    try:
        result, error = fn(), None
    except _REFUSALS as e:
        result, error = None, _message(e)
    errors = world.allgather(error)
    failed = [r for r, e in enumerate(errors) if e]
    if failed:
        first = errors[failed[0]]
        if len(failed) == world.Get_size() and all(e == first for e in errors):
            raise ConfigError(first)
        raise ConfigError(f"the {what} failed on rank(s) {failed} only ({hint}): rank {failed[0]}: {first}")
    if same_result:
        results = world.allgather(compared(result))
        if any(r != results[0] for r in results):
            listing = ", ".join(f"rank {i}: {r}" for i, r in enumerate(results))
            raise ConfigError(f"the ranks found different results for the {what} ({listing}); put <out> on a "
                              "filesystem every node sees, or pass the same <resume> file to all")
    return result


def agree_on_rank0(world, fn, what):
    """Run `fn` on world rank 0 only (the owner of the run directory) and give
    every rank its result, or make every rank raise its error."""
    result = error = None
    if world.Get_rank() == 0:
        try:
            result = fn()
        except _REFUSALS as e:
            error = _message(e)
    if world.Get_size() > 1:
        result, error = world.bcast((result, error), root=0)
    if error:
        raise ConfigError(error)
    return result
