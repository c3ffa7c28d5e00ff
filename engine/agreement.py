"""Every rank reaches the same verdict before work: a step that depends on one
rank's own state (its filesystem, its GPU, its node's memory, its command line
in an MPMD launch) is run on every rank and its outcome shared, so a failure
anywhere stops every rank with the same error, never some ranks waiting
forever in the next collective.

    result = agree(world, lambda: checkpoint.read_manifest(path), "checkpoint")
    notes = agree_on_rank0(world, prepare_run_dir, "run directory")   # rank 0 works, all learn
    check_same_config(cfg, world)                                     # MPMD launches with other flags
    agree_batch(world, error)           # a batch some rank could not read (or holds a bad id): all stop
"""
from __future__ import annotations

import numpy as np

from ringpipe.engine import checkpoint, rundir
from ringpipe.engine.config import same_value
from ringpipe.engine.errors import ConfigError, JobFailure

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


def check_same_config(cfg, world) -> None:
    """Every rank must run the same configuration: ranks launched with different
    flags would take different communication paths and hang. One small
    allgather at start-up turns that into an error on every rank that names the
    settings and ranks that differ."""
    mine = cfg.to_dict()
    everyone = world.allgather(mine)
    diffs = [f"rank {r} has <{k}> {theirs.get(k)!r} where rank 0 has {everyone[0].get(k)!r}"
             for r, theirs in enumerate(everyone) for k in mine
             if not same_value(theirs.get(k), everyone[0].get(k))]
    if diffs:
        raise ConfigError("the ranks were launched with different arguments; every rank must get the same "
                          "command line:\n  " + "\n  ".join(diffs[:10]))


# ---- a batch every rank may use -------------------------------------------------------

class BadBatch(ConfigError):
    """A batch some rank read could not be used (a token id outside the vocabulary, a
    shard that changed): raised alike on every rank before any rank computes on it."""


def batch_problem(error: BaseException | None, rank: int):
    """What this rank found reading its rows of a batch, in the form the ranks compare:
    (kind, position, rank, message); None when its rows are fine. Bad token ids sort
    first and by their position in the split, so when several ranks found one, every
    rank reports the earliest: the same words at any layout (the ranks' rows together
    are always the whole global batch)."""
    if error is None:
        return None
    position = getattr(error, "position", None)
    if position is not None:
        return (0, int(position), 0, str(error))
    return (1, 0, rank, str(error))


def batch_error(world, problem) -> BadBatch:
    """Every rank's problem gathered (collective; only once some rank has one): the
    error to raise on every rank."""
    problems = world.allgather(problem) if world.Get_size() > 1 else [problem]
    return BadBatch(min(p for p in problems if p is not None)[3])


def agree_batch(world, error: BaseException | None) -> None:
    """Collective: raise BadBatch on every rank if reading the batch failed on any
    (`error`: this rank's, or None). One 8-byte Allreduce when every rank's rows are
    fine; the messages are gathered only when one is not."""
    flag = np.array([0 if error is None else 1], dtype=np.int64)
    if world.Get_size() > 1:
        from mpi4py import MPI
        world.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if flag[0]:
        raise batch_error(world, batch_problem(error, world.Get_rank()))
