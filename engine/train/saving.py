"""Writing a run's checkpoints: sharded (every rank its slices, the default) or whole-file
(gathered on the first rank), at once or in the background (<checkpoint_async>).

Sharded (engine/job/sharded.py, engine/parallel/slices.py): the first rank makes the
temp folder; every rank writes its own file of the slices it writes (in parallel);
a gather tells the first rank that every file is on disk, which commits (renames the
folder, writes the manifest) and tells every rank the outcome. A rank model that
cannot say its slices (the parameter server's) writes whole-file, as before.

Asynchronous: the slices are copied to host memory (the staging copy, counted by the
memory report: one buffer a rank, made and touched at start-up and kept for the run) and a
thread of each rank writes them while training goes on. The
commit waits for every rank's thread: at each step boundary after the save, one small
all-reduce asks whether all are done (only while a save is in flight), and the commit
follows at the first step where they are. The next save, a stop signal and the end of
the run wait for the write in flight and commit it first, so a stop never loses it.
A failure elsewhere (an error on some rank, SIGKILL) leaves it uncommitted: the
checkpoint before it stays the newest, as a crash during a synchronous save would.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from ringpipe.engine.job import checkpoint, sharded
from ringpipe.engine.job.errors import JobFailure
from ringpipe.engine.job.rundir import describe_write_error
from ringpipe.engine.parallel import slices


@dataclass
class _InFlight:
    """An asynchronous save being written by this rank's thread."""
    step: int
    directory: str
    meta: dict
    alone: bool
    thread: threading.Thread
    declared: dict
    outcome: list                  # [record or None, failure or None], set by the thread
    started: float


class Saver:
    """One per run: writes its checkpoints, holds the asynchronous save in flight."""

    def __init__(self, training):
        self.training = training
        self.in_flight: _InFlight | None = None
        self.blocking_s: list = []         # each save's time on the training thread (the benchmark reads it)
        self.staging = None                # --checkpoint-async: the buffer the slices are copied into, kept

    @property
    def staged_bytes(self) -> int:
        """The staging copy's size (the benchmark reads it): the buffer is sized to it exactly."""
        return 0 if self.staging is None else self.staging.size

    @property
    def sharded(self) -> bool:
        return self.training.cfg.checkpoint_format == "sharded" and hasattr(self.training.model, "local_slices")

    # ---- the entry points ------------------------------------------------------------------
    def save(self, step, meta, directory, keep, alone=False, background=False) -> dict | None:
        """Write checkpoint `step` into `directory`. Returns the whole arrays on the first rank
        for a whole-file save, None for a sharded one. Raises JobFailure (every rank) when it
        cannot be written, DivergedWeight where a weight holds NaN or inf."""
        t0 = time.perf_counter()
        self.wait()
        if alone:
            # OUT/best/ (rank 0 holds the run's lock): temp files and folders there are a killed run's.
            self._on_first_rank(step, lambda: checkpoint.remove_stale_temp_files(directory))
        try:
            if not self.sharded:
                return self._whole(step, meta, directory, keep, alone)
            if background:
                self._start_async(step, meta, directory, alone)
                return None
            self._sharded(step, meta, directory, keep, alone)
            return None
        finally:
            self.blocking_s.append(time.perf_counter() - t0)

    def poll(self) -> None:
        """At a step boundary (every rank alike): commit the save in flight once every rank
        has written its file."""
        if self.in_flight is None:
            return
        world = self.training.world
        done = not self.in_flight.thread.is_alive()
        if world.Get_size() > 1:
            done = world.allreduce(int(done), op=_min_op()) == 1
        if done:
            self._commit_in_flight()

    def wait(self) -> None:
        """Finish the save in flight (every rank alike): wait for the threads, commit."""
        if self.in_flight is not None:
            self.in_flight.thread.join()
            self._commit_in_flight()

    # ---- whole-file ------------------------------------------------------------------------
    def _whole(self, step, meta, directory, keep, alone):
        training = self.training
        arrays = training.model.gather_state(training.opt)
        failure = None
        if training.world.Get_rank() == 0:
            bad = next((k for k, v in arrays.items() if k.startswith("param/") and not np.isfinite(v).all()), None)
            if bad:
                failure = ("diverged", f"{bad} holds NaN or inf after step {step}")
            else:
                try:
                    checkpoint.save(directory, step, arrays, meta, keep=keep, alone=alone)
                except checkpoint.CheckpointError as e:
                    failure = ("write", str(e))
        self._raise(self._bcast(failure), step)
        return arrays

    # ---- sharded -----------------------------------------------------------------------------
    def _begin(self, step, directory):
        """The first rank makes the temp folder; every rank learns whether it could."""
        self._on_first_rank(step, lambda: checkpoint.start_sharded(directory, step))
        return os.path.join(directory, sharded.temp_folder_name(step))

    def _sharded(self, step, meta, directory, keep, alone):
        folder = self._begin(step, directory)
        local = self.training.model.local_slices(self.training.opt)
        outcome = [None, _diverged(local, step)]
        if outcome[1] is None:
            # One piece at a time: a view where it is contiguous, else a copy of that piece alone.
            _write(folder, self.training.world.Get_rank(), slices.pieces(local), outcome, directory, step)
        self._commit(step, meta, directory, keep, alone, outcome, slices.whole_shapes(local))

    def prepare_staging(self) -> None:
        """--checkpoint-async: the staging buffer made and its pages touched now, at start-up,
        kept for the run: a first touch of fresh memory costs more than the copy itself (on the
        2-core VM, 2.2 s of a first save's 3 s at GPT-2 124M), and a save would pay it each time
        the buffer were new."""
        if self.sharded and self.training.cfg.checkpoint_async and self.training.cfg.checkpoint_every:
            self._staging_buffer(slices.piece_bytes(self.training.model.local_slices(self.training.opt)))

    def _staging_buffer(self, nbytes):
        if self.staging is None or self.staging.size < nbytes:
            self.staging = None
            self.staging = np.zeros(nbytes, dtype=np.uint8)
            self.staging[::4096] = 1          # every page backed now (zeros may map the zero page)
        return self.staging

    def _stage(self, local):
        """This rank's pieces copied into the staging buffer, each a view of it."""
        buffer = self._staging_buffer(slices.piece_bytes(local))
        staged, at = [], 0
        for name, box, data in slices.pieces(local):
            view = buffer[at:at + data.nbytes].view(data.dtype).reshape(data.shape)
            view[...] = data
            staged.append((name, box, view))
            at += data.nbytes
        return staged

    def _start_async(self, step, meta, directory, alone):
        folder = self._begin(step, directory)
        local = self.training.model.local_slices(self.training.opt)
        outcome = [None, _diverged(local, step)]
        staged = [] if outcome[1] else self._stage(local)
        rank = self.training.world.Get_rank()
        thread = threading.Thread(target=_write, args=(folder, rank, staged, outcome, directory, step),
                                  name=f"checkpoint {step}", daemon=True)
        if outcome[1] is None:
            thread.start()
        self.in_flight = _InFlight(step, directory, meta, alone, thread, slices.whole_shapes(local), outcome,
                                   time.perf_counter())

    def _commit_in_flight(self):
        f, self.in_flight = self.in_flight, None
        keep = 0 if f.alone else self.training.cfg.keep
        self._commit(f.step, f.meta, f.directory, keep, f.alone, f.outcome, f.declared)
        self.training.report.log.info("checkpoint %d written in the background in %.2f s", f.step,
                                      time.perf_counter() - f.started)

    def _commit(self, step, meta, directory, keep, alone, outcome, declared):
        """Every rank's (record, failure, shapes) to the first rank, which commits or abandons."""
        training = self.training
        record, failure = outcome
        gathered = training.world.gather((record, failure, declared), root=0) \
            if training.world.Get_size() > 1 else [(record, failure, declared)]
        verdict = None
        if training.world.Get_rank() == 0:
            verdict = next((f for _, f, _ in gathered if f is not None), None)
            if verdict is None:
                arrays = {}
                for _, _, shapes in gathered:
                    arrays.update(shapes)
                try:
                    checkpoint.commit_sharded(directory, step, meta, [r for r, _, _ in gathered], arrays, keep=keep,
                                              alone=alone)
                except checkpoint.CheckpointError as e:
                    verdict = ("write", str(e))
            if verdict is not None:
                checkpoint.abandon_sharded(directory, step)
        self._raise(self._bcast(verdict), step)

    # ---- every rank learns the outcome ----------------------------------------------------------
    def _on_first_rank(self, step, action) -> None:
        """action() on the first rank (a file operation under the run's lock); every rank raises
        JobFailure if it failed there."""
        failure = None
        if self.training.world.Get_rank() == 0:
            try:
                action()
            except checkpoint.CheckpointError as e:
                failure = ("write", str(e))
        self._raise(self._bcast(failure), step)

    def _bcast(self, failure):
        world = self.training.world
        return world.bcast(failure, root=0) if world.Get_size() > 1 else failure

    def _raise(self, failure, step):
        if failure and failure[0] == "diverged":
            raise DivergedWeight(failure[1], step)
        if failure:
            raise JobFailure(failure[1])


class DivergedWeight(Exception):
    """A weight holds NaN or inf: run.save turns it into Diverged (it knows the run's wording)."""

    def __init__(self, why, step):
        super().__init__(why)
        self.why, self.step = why, step


def _diverged(local, step):
    """("diverged", why) if a parameter this rank writes holds NaN or inf, else None."""
    for name, _, data in slices.pieces(local.only("param")):
        if not np.isfinite(data).all():
            return ("diverged", f"{name} holds NaN or inf after step {step}")
    return None


def _write(folder, rank, pieces, outcome, directory, step):
    """This rank's file (on the training thread, or the save's own): outcome[0] its record
    (None: it writes no piece), outcome[1] a failure."""
    try:
        outcome[0] = sharded.write_rank_file(folder, rank, pieces)
    except OSError as e:
        outcome[1] = ("write", describe_write_error(e, directory, f"the checkpoint for step {step}",
                                                    "; the previous checkpoints are intact"))


def _min_op():
    from mpi4py import MPI
    return MPI.MIN
