"""What the ranks of a training run must agree on besides the generic verdicts of
engine/job/agreement.py: one configuration, and a batch every rank may use.

    check_same_config(cfg, world)       # MPMD launches with other flags
    agree_batch(world, error)           # a batch some rank could not read (or holds a bad id): all stop
    stop_requested(training)            # a stop signal any rank (or dedicated server) got: all stop
"""
from __future__ import annotations

import numpy as np

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.train.config import same_value


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


def stop_requested(training) -> bool:
    """Collective: True on every rank when any rank got a stop signal (StopFlag.should_stop,
    one 16-byte all-reduce), a dedicated parameter server's included (told to the first
    worker: ServerLink.servers_signal, counted as the first worker's own). A failure a rank
    reported (StopFlag.fail) raises lifecycle.StopError, the same on every rank: the caller
    says what it means there (the step loop, validation)."""
    if training.servers is not None:
        training.stop.heard(training.servers.servers_signal())
    return training.stop.should_stop(training.world)


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
