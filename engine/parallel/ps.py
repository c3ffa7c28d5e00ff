"""The data axis as a parameter server (`--sync ps`): colocated and sharded
(`--ps-servers 0`), or on K dedicated server ranks (`--ps-servers K`).

ParameterServerData wraps the local model as DataParallel does and offers the
same RankModel surface, so the trainer drives it alike (compose.py picks it);
the communication is comm/ps.py's ParameterServerGroup.

Colocated (K = 0): every data-parallel rank is both a worker and a server.

- the cut: the flat buffer in chunks of <= 4 MiB (comm.ps_layout), chunk c
  owned by data-parallel rank c % dp (interleaved: every layer's gradient is
  spread over all servers);
- backward: each parameter's gradient is pushed as it is final (the chunks it
  completes leave at once, to their owners; --no-overlap: all after backward);
- then each rank, as a server, sums the dp copies of its chunks in the fixed
  pairwise tree (comm/ps.py tree_sum: recursive doubling's order), averages,
  and the servers agree on the global norm: each chunk's float64 sum of squares,
  added in chunk order, the same bits on every rank whoever owns which chunk;
  the summed chunks are written into this rank's gradient buffer (the others
  zeroed, as under ZeRO-1);
- the trainer clips (scale_grads: the owned chunks) and updates: the optimizer
  steps over the owned chunks only (its state is theirs, packed, as ZeRO-1's),
  then every chunk's new parameters go from its owner to every rank (the pull).

Per step a rank sends (dp-1)/dp of the gradients and receives (dp-1)/dp of the
parameters: the ring all-reduce's 2(dp-1)/dp M.

With a pipeline or a tensor axis the data axis is one group per (pipeline,
tensor) coordinate (grid.comm("data")), each serving the chunks of its own
flat buffer: one parameter-server group per stage and tensor rank. Two things
cross the groups: the tied embedding's gradient is summed between the first
and last stage before it is pushed (the pipeline holds back its on_ready:
GradSync.sum_separate_first), and each group's norm leaves out what another
stage or tensor rank counts (inner.norm_excluded(): the last stage's copy of
wte, the replicated parameters on all tensor ranks but the first) and is then
summed over the pipeline and tensor ranks (inner.sum_norm). Without them the
norm is the group's alone, unchanged to the bit.

Dedicated servers (K >= 1): the last K ranks of the job serve (comm.ps_ranks),
the others are the workers and train among themselves (engine/train/run.py
splits the world: every collective of the trainer stays among the workers).
ServerLink is the two sides' channel over the whole job; serve() is a server
rank's whole run. The servers hold no model. There is one group per
(pipeline, tensor) coordinate, over its data-parallel workers and every
server (a coordinate communicator each; without those axes, one): the first
worker sends the servers, once, the coordinates' count and each one's lead
(its data index 0), and each lead its coordinate's flat length, dtype,
workers and the ranges its norm leaves out (START); then before the first
step each lead sends the parameters, weight-decay mask and (on a resume)
optimizer state of each server's chunks, the first worker the optimizer's
step count (INIT). Every step the first worker tells each server STEP; the
servers sum every coordinate's chunks' pushes, agree on each coordinate's
norm (chunk order, as above) and add them in coordinate order (the global
norm), clip with cfg.grad_clip, step the optimizer over their chunks with
lr_at(step) from cfg (no update when the norm is not finite: the workers raise
Diverged on it), and send the parameters and the norm back. Without clipping
(cfg.grad_clip 0) no update waits for the norm: the servers stream the step
(comm/ps.py serve_streamed: each chunk updated and sent back as soon as every
worker pushed it, while later chunks still arrive) and the workers post their
pull before backward, into a buffer of their own (`streamed`). So on a worker
grad_norm_sq() waits for the pull (parameters and norm come together: the
servers updated already), scale_grads and update do nothing but count the
step, and its optimizer is the real one over no elements (its step count and
state names for checkpoints; the state lives only on the servers). A checkpoint
asks the servers for their chunks' state (SAVE), so it is whole and loads in any
layout; STOP ends the servers' loop. The servers block on these control
messages only, never on a push that will not come: whatever ends the workers
(the last step, a signal, a bad batch, divergence, an error before the model is
built) ends with STOP, and the workers' outcome is then broadcast over the job,
so the servers return the same exit code or raise alike.
A stop signal to a server (its StopFlag; a server takes part in no all-reduce)
is told to the first worker after the control message it came during: each
server sends it exactly one message, the signal, or 0 when STOP comes first,
into a receive the first worker posted when the link was made; each step's stop
agreement tests those receives (one Testsome, no message of its own) and counts
a server's signal as the first worker's own (StopFlag.heard), so the workers'
all-reduce carries it on and every rank stops at that step boundary with the
workers' checkpoint, as for a signal to a worker. Once the exit code is decided
and a checkpoint covers it, the servers are told (DECIDED): a second signal then
exits a server with that code, as it does a worker; after a stop every rank's own
signal is gathered on the first worker, whose line names who got which.
The busiest link is a server's: n M / K each way per step (or a worker's M).

Checkpoints: the optimizer state of the owned chunks gathered whole on the
first replica (point to point, chunk by chunk), restored from any layout's
arrays by taking the owned chunks: a PS run resumes an all-reduce run's
checkpoint and back, with or without dedicated servers.

Host (numpy) buffers only (comm/ps.py's); any layout of pipeline and tensor
axes, colocated or on dedicated servers.

Import rule: that of engine/parallel (its __init__.py).
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np
from mpi4py import MPI

from ringpipe import comm
from ringpipe.comm.device import Transport
from ringpipe.comm.ps import ordered_sum
from ringpipe.engine.job import lifecycle
from ringpipe.engine.job.array_module import to_host
from ringpipe.engine.model.optim import clip_scale, lr_at, make_optimizer
from ringpipe.engine.parallel import GradSync

_STATE_TAG = 1          # the checkpoint gather's messages, on a communicator of their own
# Dedicated servers: the first worker's control messages (int64 [kind, a, b]) and the
# arrays that follow them, on ServerLink's own communicator; each server's one message
# back to the first worker about a stop signal (ServerLink.relay_signal).
_CONTROL_TAG, _DATA_TAG, _SIGNAL_TAG = 2, 3, 4
_COORDINATE_TAG_BASE = 100      # Create_group's tag for coordinate p's communicator: 100 + p
START, INIT, STEP, SAVE, STOP, FETCH, DECIDED = 1, 2, 3, 4, 5, 6, 7
# The chunks' size, read when a model is built (tests make it small, so a small model
# has many chunks: chunks across parameters, every rank a server of several).
CHUNK_BYTES = comm.ps.CHUNK_BYTES


class _PushSync(GradSync):
    """Pushes each parameter's gradient as the inner model says it is final."""

    # A pipeline's tied embedding is pushed once both stages' parts are summed.
    sum_separate_first = True

    def __init__(self, model):
        self.model = model

    def on_ready(self, param_index):
        if self.model.overlap:
            self.model._push(param_index)

    def finish(self):
        for i in range(len(self.model.ranges)):
            self.model._push(i)


class ServerLink:
    """The dedicated servers' channel (`--ps-servers K`): which ranks of `world`
    (the whole job) work and which serve, the workers' own communicator, and the
    first worker's control messages to the servers. Made collectively by every
    rank of `world`; the trainer on the workers runs over `workers_comm`."""

    def __init__(self, world, n_servers: int):
        self.world = world
        self.workers, self.servers = comm.ps_ranks(world.Get_size(), n_servers)
        self.rank = world.Get_rank()
        self.is_server = self.rank in self.servers
        self.is_first_worker = self.rank == self.workers[0]
        self.channel = world.Dup()            # control messages and the arrays they announce
        self.workers_comm = world.Split(1 if self.is_server else 0, self.rank)
        self.stopped = False                  # STOP sent (first worker) or received (a server)
        self.server_places: list = []         # the servers' {"rank", "node", "pid"} (the trainer fills it)
        self.outcome = None                   # the first worker's: how the run ended (share_outcome)
        # A stop signal to a server (module docstring): each server sends the first worker
        # exactly one message, the signal it got or 0 at STOP, into a receive posted now.
        self.relayed = False                  # a server: its message sent
        self._signals = np.zeros(len(self.servers), dtype=np.int64)
        self._signal_receives = [self.channel.Irecv(self._signals[i:i + 1], source=server, tag=_SIGNAL_TAG)
                                 for i, server in enumerate(self.servers)] if self.is_first_worker else []

    # ---- the first worker's side -----------------------------------------------------
    def tell(self, kind: int, a: int = 0, b: int = 0) -> None:
        """Send control message `kind` to every server (the first worker only)."""
        for server in self.servers:
            self.channel.Send(np.array([kind, a, b], dtype=np.int64), dest=server, tag=_CONTROL_TAG)

    def send(self, server: int, array) -> None:
        self.channel.Send(np.ascontiguousarray(array), dest=server, tag=_DATA_TAG)

    def stop(self) -> None:
        """STOP to every server, once: from the model's close(), or from the trainer's end
        when no model was built (an error before it): no server is left waiting. Each
        server answers STOP with its signal message if it has not sent it yet, so every
        receive posted for them completes."""
        if self.is_first_worker and not self.stopped:
            self.tell(STOP)
            MPI.Request.Waitall(self._signal_receives)
        self.stopped = True

    def servers_signal(self) -> int:
        """The largest stop signal a server has told of so far (0: none; a worker but the
        first: 0). One Testsome of the receives posted at the start: no message of its own."""
        if self._signal_receives:
            MPI.Request.Testsome(self._signal_receives)
        return int(self._signals.max(initial=0))

    def decided(self, code: int, checkpoint_step: int | None) -> None:
        """DECIDED: the job's exit code, covered by the stop checkpoint of `checkpoint_step`
        (or, None, the final one), so that a second signal to a server exits with it as a
        worker's does (the first worker only)."""
        if self.is_first_worker:
            self.tell(DECIDED, code, -1 if checkpoint_step is None else checkpoint_step)

    def gather_signals(self, signum: int) -> list | None:
        """Every rank of the job's own signal number (0: none), on the first worker
        (None elsewhere): who got what, named when the job stops. Collective over the job."""
        return self.channel.gather(int(signum), root=self.workers[0])

    # ---- a server's side -----------------------------------------------------------------
    def receive(self) -> tuple[int, int, int]:
        msg = np.zeros(3, dtype=np.int64)
        self.channel.Recv(msg, source=self.workers[0], tag=_CONTROL_TAG)
        return int(msg[0]), int(msg[1]), int(msg[2])

    def relay_signal(self, signum: int) -> None:
        """A server's one message to the first worker: the stop signal it got, or 0 (at STOP,
        when none came). Its receive is posted already: the send cannot wait."""
        if not self.relayed:
            self.relayed = True
            self.channel.Send(np.array([signum], dtype=np.int64), dest=self.workers[0], tag=_SIGNAL_TAG)

    def receive_array(self, n: int, dtype, source: int | None = None) -> np.ndarray:
        """An array the first worker (or `source`, a coordinate's lead) sent after a control message."""
        a = np.empty(n, dtype=dtype)
        self.channel.Recv(a, source=self.workers[0] if source is None else source, tag=_DATA_TAG)
        return a

    # ---- every rank ----------------------------------------------------------------------
    def coordinate_comm(self, coordinate: int, workers) -> MPI.Comm:
        """The communicator of one (pipeline, tensor) coordinate's workers (world ranks,
        sorted) and every server: its ranks are the workers in order, then the servers.
        Collective over those ranks only: a server makes one per coordinate, in order."""
        ranks = sorted(int(w) for w in workers) + list(self.servers)
        group = self.world.Get_group().Incl(ranks)
        try:
            return self.world.Create_group(group, tag=_COORDINATE_TAG_BASE + coordinate)
        finally:
            group.Free()

    # ---- the end, every rank -----------------------------------------------------------
    def share_outcome(self, outcome: dict | None) -> dict:
        """The workers' outcome (the first worker's `outcome`) on every rank of the job:
        {"steps_done", "exit_code", "stopped_by"} or {"error": type name, "message": ...}."""
        return self.channel.bcast(outcome if self.is_first_worker else None, root=self.workers[0])

    def free(self) -> None:
        if not MPI.Is_finalized():
            for request in self._signal_receives:     # never stopped (an error before STOP): not waited for
                if request != MPI.REQUEST_NULL:
                    request.Cancel()
                    request.Wait()
        for c in (self.workers_comm, self.channel):
            if c != MPI.COMM_NULL and not MPI.Is_finalized():
                c.Free()


def serve(cfg, link: ServerLink, stop: lifecycle.StopFlag | None = None) -> dict:
    """A dedicated server rank's run (`--ps-servers K`, module docstring): answer the
    first worker's control messages until STOP; returns the workers' outcome
    (ServerLink.share_outcome). Optimizer, learning rate and clipping come from cfg;
    under --ps-mode async (ps_modes.py) each worker's push is an update of its own.
    A server serves every (pipeline, tensor) coordinate's group (one without those axes);
    the global norm is theirs added in coordinate order. `stop`: this rank's StopFlag: a
    signal it got is told to the first worker after the control message it came during."""
    coordinates: list[_Coordinate] = []
    served = 0
    log = None
    try:
        while True:
            kind, a, b = link.receive()
            if kind == STOP:
                link.stopped = True
                link.relay_signal(stop.received if stop is not None else 0)    # (0: none came)
                if log is not None:
                    log.info("stopped by the workers after serving %d update(s)", served)
                break
            if kind == START:            # a: the coordinates, b: chunk bytes; then their leads
                leads = link.receive_array(a, np.int64)
                coordinates = [_Coordinate(link, p, int(lead), b) for p, lead in enumerate(leads)]
                # The workers made the run folder by now: this rank's log beside theirs.
                log = lifecycle.setup_rank_logging(cfg.out_dir, link.rank, link.world.Get_size())
                log.info("parameter server rank %d of %d: %s", link.rank, link.world.Get_size(),
                         "; ".join(f"coordinate {c.p}: {len(c.owned)} of {c.group.layout.n_chunks} chunk(s), "
                                   f"{sum(hi - lo for lo, hi in c.owned)} elements, mode {c.group.mode}"
                                   for c in coordinates))
            elif kind == INIT:           # a: the optimizer's step count, b: 1 when its state follows
                for c in coordinates:
                    c.state = _ServerState(cfg, link, c.owned, c.group.dtype, a, b, c.n_workers,
                                           c.group.mode == "async", source=c.lead, per_chunk=streamed(cfg, c))
            elif kind == STEP:           # a: the workers' step count, which must be ours
                steps = coordinates[0].state.steps
                if a != steps:
                    raise RuntimeError(f"parameter server rank {link.rank}: the workers are at update {a}, this "
                                       f"server at {steps}: their messages no longer line up")
                lr = lr_at(steps, cfg.peak_lr, cfg.warmup_steps, cfg.schedule_steps, cfg.min_lr_ratio)
                if coordinates[0].group.mode == "async":
                    for c in coordinates:
                        c.group.serve_async(lambda chunk, w, grad, c=c: c.state.apply_one(c.index[chunk], grad, lr))
                elif streamed(cfg, coordinates[0]):
                    # No clipping: no update waits for the norm, each chunk goes back once summed.
                    norms = [c.group.serve_streamed(lambda chunk, grad, _, c=c: c.state.apply_chunk(c.index[chunk],
                                                                                                    grad, lr),
                                                    norm_exclude=c.excluded, send_norm=False) for c in coordinates]
                    norm_sq = norms[0] if len(norms) == 1 else ordered_sum(norms)
                    for c in coordinates:
                        c.group.send_norm(norm_sq)
                else:
                    norms = [c.group.reduce(norm_exclude=c.excluded) for c in coordinates]
                    norm_sq = norms[0] if len(norms) == 1 else ordered_sum(norms)
                    for c in coordinates:
                        c.state.apply_sum(c.group, lr, norm_sq)
                for c in coordinates:
                    c.state.steps += 1
                served += 1
            elif kind == SAVE:           # every optimizer state, chunk by chunk, to each coordinate's lead
                if log is not None:
                    log.info("checkpoint: optimizer state of update %d sent", served)
                for c in coordinates:
                    for i in range(len(c.owned)):
                        for buf in c.state.chunk_state(i):
                            link.send(c.lead, buf)
            elif kind == FETCH:          # async: every worker gets this server's parameters
                for c in coordinates:
                    for w in c.workers:
                        for i in range(len(c.owned)):
                            link.send(w, c.state.chunk(i))
            elif kind == DECIDED:        # a: the job's exit code; b: the stop checkpoint's step (-1: the final one)
                _decided(stop, link, log, a, b)
            else:
                raise RuntimeError(f"parameter server rank {link.rank}: unknown control message {kind}")
            if stop is not None and stop.requested and not link.relayed:
                link.relay_signal(stop.received)
                if log is not None:
                    log.warning("%s received by this parameter server (rank %d): the workers are told, and the job "
                                "stops at their next step boundary with a checkpoint", stop.signal_name, link.rank)
    except Exception:
        # The abort handler that ends the job names the rank only, and the workers' ranks
        # look alike: say that this one is a server, and how far it got.
        print(f"error: parameter server rank {link.rank} failed after serving {served} update(s); "
              f"the job ends (its error follows)", file=sys.stderr, flush=True)
        raise
    finally:
        if link.stopped:
            for c in coordinates:
                c.free()
    return link.share_outcome(None)


def _decided(stop, link: ServerLink, log, code: int, step: int) -> None:
    """DECIDED on a server: the workers' exit code is covered by a checkpoint, so a second
    signal here exits with it, as on a worker; after a stop (step >= 0) every rank's own
    signal goes to the first worker, which names who got what (ServerLink.gather_signals)."""
    if stop is not None:
        stop.decided(code, step if step >= 0 else None)
    if step >= 0:
        if log is not None:
            log.info("the workers stopped with the checkpoint of step %d: exit code %d", step, code)
        link.gather_signals(stop.received if stop is not None else 0)


def streamed(cfg, coordinate) -> bool:
    """Whether the servers stream a sync step: without clipping (the workers then post
    their pull before they push: ParameterServerData's `streamed`)."""
    return coordinate.group.mode == "sync" and cfg.grad_clip <= 0


class _Coordinate:
    """A server's part of one (pipeline, tensor) coordinate: its group over that
    coordinate's workers and the servers, the chunks it owns, the ranges left out of the
    norm, and (from INIT) its _ServerState. Made from what the lead sends at START."""

    def __init__(self, link, p, lead, chunk_bytes):
        self.p = p
        size, itemsize, asynchronous, n_workers, n_excluded = (
            int(v) for v in link.receive_array(5, np.int64, source=lead))
        self.lead = lead
        self.workers = [int(w) for w in link.receive_array(n_workers, np.int64, source=lead)]
        self.excluded = [tuple(int(v) for v in pair) for pair in
                         link.receive_array(2 * n_excluded, np.int64, source=lead).reshape(-1, 2)]
        self.n_workers = n_workers
        self.comm = link.coordinate_comm(p, self.workers)
        self.group = comm.ParameterServerGroup(self.comm, range(n_workers),
                                               range(n_workers, n_workers + len(link.servers)), size,
                                               np.dtype(f"f{itemsize}"), chunk_bytes=chunk_bytes, op="avg",
                                               mode="async" if asynchronous else "sync")
        mine = self.group.layout.owned_by(self.comm.Get_rank())
        self.owned = [self.group.layout.bounds(c) for c in mine]
        self.index = {c: i for i, c in enumerate(mine)}      # chunk -> its place among the owned
        self.state = None

    def free(self):
        self.group.free()
        self.comm.Free()


class _ServerState:
    """A dedicated server's master weights of its chunks (packed, in owned order) and
    the optimizer state: one optimizer over them all, or one per chunk (async: each
    counts its own updates; a streamed sync step updates each chunk as it is summed). Received at INIT: the parameters, their weight-decay
    mask and, when `restored`, every optimizer state."""

    def __init__(self, cfg, link, owned, dtype, steps, restored, n_workers, asynchronous, source, per_chunk=False):
        size = sum(hi - lo for lo, hi in owned)
        self.steps = steps                  # the workers' step count (one sync update a step)
        self.n_workers = n_workers
        self.grad_clip = cfg.grad_clip
        self.master = link.receive_array(size, dtype, source)
        mask = link.receive_array(size, np.uint8, source)
        self.spans, at = [], 0              # each owned chunk's [lo, hi) in the packed arrays
        for lo, hi in owned:
            self.spans.append((at, at + hi - lo))
            at += hi - lo
        pieces = self.spans if asynchronous or per_chunk else [(0, size)]
        self.opts = [make_optimizer(cfg.optimizer, hi - lo, dtype, np, mask[lo:hi], cfg.weight_decay)
                     for lo, hi in pieces]
        if restored:                        # sent packed over every chunk, one state after another
            for name in self.opts[0].state_names:
                flat = link.receive_array(size, dtype, source)
                for opt, (lo, hi) in zip(self.opts, pieces):
                    opt.state()[name][...] = flat[lo:hi]
        for opt in self.opts:               # async: n updates a step
            opt.step_count = steps * (n_workers if asynchronous else 1)

    def chunk(self, i):
        lo, hi = self.spans[i]
        return self.master[lo:hi]

    def chunk_state(self, i):
        """Chunk i's optimizer state arrays, in state_names order."""
        if len(self.opts) > 1:
            return list(self.opts[i].state().values())
        lo, hi = self.spans[i]
        return [buf[lo:hi] for buf in self.opts[0].state().values()]

    def apply_sum(self, group, lr, norm_sq) -> None:
        """sync and ssp, after group.reduce(): the step's sum over every worker, clipped by
        the global norm (every coordinate's), which goes to the workers with the parameters."""
        if math.isfinite(norm_sq):      # else no update: the workers raise Diverged on this norm
            # The step count is the trainer's step index: one update a step, and every
            # checkpoint records the two equal (its step and opt_step_count).
            grad = np.concatenate(group.summed) if group.summed else np.zeros(0, dtype=self.master.dtype)
            scale = clip_scale(norm_sq, self.grad_clip)
            if scale != 1.0:
                grad *= scale
            self.opts[0].step(self.master, grad, lr)
        group.send_params([self.chunk(i) for i in range(len(self.spans))], norm_sq=norm_sq)

    def apply_chunk(self, i, grad, lr):
        """sync without clipping, streamed: chunk i's sum over every worker, updated alone
        (one optimizer per chunk: the bits of one step over them packed); the chunk's new
        values (the master weights' view: sent as they are until the next step)."""
        if np.isfinite(grad).all():     # (a non-finite norm stops the workers: keep the weights finite)
            self.opts[i].step(self.chunk(i), grad, lr)
        return self.chunk(i)

    def apply_one(self, i, grad, lr):
        """async: one worker's (clipped) gradient of chunk i, applied alone with lr / n; the
        chunk's new values, a copy (the next worker's update must not change it in flight)."""
        if np.isfinite(grad).all():     # (the workers stop on a non-finite norm before pushing)
            self.opts[i].step(self.chunk(i), grad, lr / self.n_workers)
        return self.chunk(i).copy()


class ParameterServerData:
    """A RankModel (engine/parallel/__init__.py): the data axis over a parameter server,
    colocated and sharded (link None) or on dedicated server ranks (link: a ServerLink)."""

    def __init__(self, inner, grid, overlap=True, trace=None, link=None, mode="sync", streamed=False):
        """mode: the group's, "async" for ps_modes.AsynchronousPS (dedicated servers only).
        streamed: dedicated servers without clipping (serve()'s `streamed`): the pull is
        posted before backward pushes, into a buffer of its own (the parameters are still in
        use), and copied into the parameters once complete."""
        self.inner, self.params = inner, inner.params
        self.trace = trace             # list-like to append (name, category, t0, t1), or None
        self.data_comm = grid.comm("data")
        self.dp, self.index = grid.size("data"), grid.index("data")
        if self.dp < 2:
            raise ValueError("ParameterServerData needs >= 2 data-parallel ranks (one rank has nothing to sum)")
        if self.params.xp is not np:
            raise ValueError("ParameterServerData: the parameter server moves host (numpy) buffers only")
        self.overlap = overlap
        self.stage = 0                 # nothing sharded between steps but the optimizer state (the harness asks)
        self.link = link
        self.streamed = streamed and link is not None
        self._landing = np.empty_like(self.params.data) if self.streamed else None
        self.leads = False             # dedicated: this rank is its coordinate's lead (_join_servers)
        if link is None:
            ranks = list(range(self.dp))
            self.group = comm.ParameterServerGroup(self.data_comm, ranks, ranks, self.params.size,
                                                   self.params.dtype, chunk_bytes=CHUNK_BYTES, op="avg")
            self.me = self.data_comm.Get_rank()
            # Pipeline and tensor axes: this group's part of the norm leaves out what another
            # stage or tensor rank counts, and is summed over them (inner.sum_norm).
            self.norm_excluded = inner.norm_excluded()
        else:
            self._join_servers(grid, link, mode)
        self.layout = self.group.layout
        self.owned_chunks = list(self.layout.owned_by(self.me))      # none for a worker of dedicated servers
        self.owned = [self.layout.bounds(c) for c in self.owned_chunks]    # the optimizer's chunks
        self.ranges = self.params.ranges()
        self._pushed = np.zeros(len(self.ranges), dtype=bool)
        self._norm_sq = None
        self._opt = None               # dedicated: the (empty) optimizer whose step count the servers share
        self._servers_ready = False    # dedicated: INIT sent
        self._restored = None          # dedicated, a lead: the checkpoint's optimizer state until INIT
        self.state_comm = self.data_comm.Dup()      # the checkpoint gather's point-to-point messages

    # ---- a step ------------------------------------------------------------------------
    def _push(self, i):
        if not self._pushed[i]:
            self._pushed[i] = True
            lo, hi = self.ranges[i]
            self.group.push(self.params.grad, lo, hi)

    def zero_grad(self):
        self.params.zero_grad()

    def forward_backward(self, x, y, grad_scale):
        self._pushed[:] = False
        if self.link is not None:
            self._start_servers()
            if self.link.is_first_worker:
                self.link.tell(STEP, self._opt.step_count)
            if self.streamed:       # each chunk comes back as soon as every worker pushed it
                self.group.start_pull(self._landing)
            loss = self.inner.forward_backward(x, y, grad_scale, sync=_PushSync(self))
            # The servers update as soon as every push is in: the pull (the new parameters
            # and the norm) is posted now and waited for in grad_norm_sq.
            if not self.streamed:
                self.group.start_pull(self.params.data)
            return loss
        loss = self.inner.forward_backward(x, y, grad_scale, sync=_PushSync(self))
        t0 = time.perf_counter()
        # This rank as a server: its chunks summed, and the norm of this group's buffer.
        part = self.group.reduce(norm_exclude=self.norm_excluded)
        self.group.wait_pushes()                 # this rank's gradient has left: its buffer may be written
        self._norm_sq = self.inner.sum_norm(part)    # over the pipeline and tensor ranks (none: itself)
        grad, at = self.params.grad, 0
        for (lo, hi), summed in zip(self.owned, self.group.summed):
            grad[at:lo] = 0                      # what it does not own: not its to clip or update
            grad[lo:hi] = summed
            at = hi
        grad[at:] = 0
        self._event("PS push and reduce", "comm", t0)
        return loss

    def forward_loss(self, x, y):
        return self.inner.forward_loss(x, y)

    def grad_norm_sq(self):
        if self.link is not None:
            t0 = time.perf_counter()
            self._norm_sq = self.group.wait_pull()     # the servers clipped and updated already
            if self.streamed:
                self.params.data[...] = self._landing
            self._event("PS push, server update and pull", "comm", t0)
        return self._norm_sq

    def scale_grads(self, scale):
        """Multiply the gradients this rank updates from (its chunks) by `scale` (clipping);
        a worker of dedicated servers owns none: they clipped."""
        if scale == 1.0:
            return
        for a, b in self.owned:
            self.params.grad[a:b] *= scale

    def make_optimizer(self, name, weight_decay):
        mask = self.params.decay_mask(self.owned)
        self._opt = make_optimizer(name, len(mask), self.params.dtype, self.params.xp, mask, weight_decay)
        return self._opt

    def update(self, opt, lr):
        # The optimizer's state is this rank's chunks, packed one after another (as ZeRO-1's).
        opt.step(self.params.data, self.params.grad, lr, chunks=self.owned)
        if self.link is not None:
            return       # the servers updated, the parameters are pulled: only the step was counted
        t0 = time.perf_counter()
        data = self.params.data
        self.group.start_pull(data)
        # Copies: this rank pulls its own chunks into the same buffer (MPI's send and
        # receive buffers may not overlap); they stay alive until the next step's reduce.
        self.group.send_params([data[lo:hi].copy() for lo, hi in self.owned])
        self.group.wait_pull()
        self._event("PS parameter pull", "comm", t0)

    def _event(self, name, category, t0):
        if self.trace is not None:
            self.trace.append((name, category, t0, time.perf_counter()))

    def start_identical(self):
        # Every replica initialised identically from the seed; broadcasting the first
        # one's copy makes that a guarantee rather than an assumption.
        Transport(self.params.xp).in_place(self.params.data, lambda buf: self.data_comm.Bcast(buf, root=0))

    # ---- dedicated servers: their start ------------------------------------------------------
    def _join_servers(self, grid, link, mode):
        """START: one group per (pipeline, tensor) coordinate, over its data-parallel workers
        and every server (collective over the workers; the servers, in serve(), make every
        coordinate's). The first worker sends the coordinates' count and their leads (the
        world rank of each one's data index 0); each lead sends its coordinate's flat length,
        itemsize, mode, workers and the ranges its norm leaves out (another stage or tensor
        rank counts them: inner.norm_excluded())."""
        here = (grid.index("pipe"), grid.index("tensor"))
        everyone = link.workers_comm.allgather((here, self.index, link.rank))
        coordinates = sorted({c for c, _, _ in everyone})
        self.coordinate = coordinates.index(here)
        workers = sorted(r for c, _, r in everyone if c == here)
        leads = [next(r for c, d, r in everyone if c == k and d == 0) for k in coordinates]
        self.leads = leads[self.coordinate] == link.rank      # this coordinate's data index 0
        if link.is_first_worker:
            link.tell(START, len(coordinates), CHUNK_BYTES)
            for server in link.servers:
                link.send(server, np.array(leads, dtype=np.int64))
        if self.leads:
            excluded = np.array(self.inner.norm_excluded(), dtype=np.int64).reshape(-1)
            head = np.array([self.params.size, np.dtype(self.params.dtype).itemsize, int(mode == "async"),
                             len(workers), len(excluded) // 2], dtype=np.int64)
            for server in link.servers:
                for array in (head, np.array(workers, dtype=np.int64), excluded):
                    link.send(server, array)
        self.coordinate_comm = link.coordinate_comm(self.coordinate, workers)
        n = len(workers)
        self.group = comm.ParameterServerGroup(self.coordinate_comm, range(n), range(n, n + len(link.servers)),
                                               self.params.size, self.params.dtype, chunk_bytes=CHUNK_BYTES,
                                               op="avg", mode=mode)
        self.me = self.coordinate_comm.Get_rank()

    def _server_chunks(self, i):
        """The (lo, hi) of server i's chunks (link.servers[i]; in the group, rank workers + i)."""
        return [self.layout.bounds(c) for c in self.layout.owned_by(self.layout.servers[i])]

    def _start_servers(self):
        """INIT, once, before the first step or checkpoint: each server's chunks of the
        parameters (as they are after start_identical or a restore), their weight-decay
        mask, the optimizer's step count and, on a resume, its state."""
        if self._servers_ready:
            return
        self._servers_ready = True
        link = self.link
        if link.is_first_worker:
            link.tell(INIT, self._opt.step_count, int(self._restored is not None))
        if not self.leads:
            return
        data = self.params.data
        for i, server in enumerate(link.servers):
            chunks = self._server_chunks(i)
            link.send(server, np.concatenate([data[lo:hi] for lo, hi in chunks] or [data[:0]]))
            link.send(server, self.params.decay_mask(chunks))
            if self._restored is not None:
                for state_name in self._opt.state_names:
                    flat = self._restored[state_name]
                    link.send(server, np.concatenate([flat[lo:hi] for lo, hi in chunks] or [flat[:0]]))
        self._restored = None

    def _gather_from_servers(self):
        """The servers' optimizer state of this coordinate, whole, on its lead (SAVE)."""
        link, names = self.link, self._opt.state_names
        full = {name: np.zeros(self.params.size, dtype=self.params.dtype) for name in names}
        if link.is_first_worker:
            link.tell(SAVE)
        for i, server in enumerate(link.servers):   # each sends its chunks in order, every state of each
            for lo, hi in self._server_chunks(i):
                for name in names:
                    link.channel.Recv(full[name][lo:hi], source=server, tag=_DATA_TAG)
        return full

    # ---- checkpoint state ----------------------------------------------------------------
    def _gather_to_first(self, packed):
        """The whole flat array on the first replica (None elsewhere) from every rank's
        packed owned chunks: each chunk sent by its owner, received in chunk order."""
        first = self.me == 0
        flat = np.zeros(self.params.size, dtype=self.params.dtype) if first else None
        offsets, pos = {}, 0
        for lo, hi in self.owned:
            offsets[lo], pos = pos, pos + hi - lo
        for c in range(self.layout.n_chunks):
            lo, hi = self.layout.bounds(c)
            owner = self.layout.owner(c)
            if owner == self.me:
                mine = packed[offsets[lo]:offsets[lo] + hi - lo]
                if first:
                    flat[lo:hi] = mine
                else:
                    self.state_comm.Send(np.ascontiguousarray(mine), dest=0, tag=_STATE_TAG)
            elif first:
                self.state_comm.Recv(flat[lo:hi], source=owner, tag=_STATE_TAG)
        return flat

    def gather_state(self, opt):
        if self.link is not None:
            self._start_servers()
            if not self.leads:
                return {}
            return self.inner.named_arrays(self._gather_from_servers())
        full = {name: self._gather_to_first(to_host(buf)) for name, buf in opt.state().items()}
        # Every replica holds the same parameters: the first one gathers the arrays.
        return self.inner.named_arrays(full) if self.me == 0 else {}

    def state_shapes(self, opt):
        return self.inner.named_shapes(opt.state_names)

    def restore_state(self, arrays, opt):
        full = self.inner.load_named(arrays, opt.state_names)
        if self.link is not None:
            # The servers get their chunks of it before the first step (INIT).
            self._restored = full if self.leads else None
            return
        for state_name, buf in opt.state().items():
            flat = full.pop(state_name)           # (its memory goes before the next is packed)
            parts = [flat[a:b] for a, b in self.owned] or [flat[:0]]     # (a rank may own no chunk)
            buf[...] = self.params.xp.asarray(np.concatenate(parts))

    # ---- reporting and shutdown -------------------------------------------------------------
    def describe(self):
        lay = self.layout
        largest = lay.chunk_elements * lay.itemsize if lay.n_chunks > 1 else lay.n_elements * lay.itemsize
        if self.link is None:
            where = (f"parameter server, colocated and sharded over {self.dp} ranks: {lay.n_chunks} chunk(s) of "
                     f"<= {largest / 2**20:.2f} MiB, {len(self.owned)} owned here (their optimizer state only)")
        else:
            ranks = (f"rank {self.link.servers[0]}" if len(self.link.servers) == 1 else
                     f"ranks {self.link.servers[0]}-{self.link.servers[-1]}")
            where = (f"parameter server on dedicated {ranks}: "
                     f"{lay.n_chunks} "
                     f"chunk(s) of <= {largest / 2**20:.2f} MiB interleaved over them; they hold the master weights "
                     f"and the optimizer state, clip and update")
        if self.link is not None and lay.n_chunks < len(self.link.servers):
            where += (f" ({len(self.link.servers) - lay.n_chunks} server(s) own no chunk of this model: fewer "
                      f"servers would do)")
        pulled = ("each chunk pulled as soon as every worker pushed it (streamed: no clipping)" if self.streamed
                  else "parameters pulled after the update")
        parts = [self.inner.describe(),
                 f"{where}; gradients pushed {'as backward makes them' if self.overlap else 'after backward'}, "
                 f"{pulled}"]
        return " | ".join(p for p in parts if p)

    def summary(self):
        return self.inner.summary()

    def notes(self):
        return self.inner.notes()

    def comm_hidden_fraction(self):
        return None

    def close(self):
        if self.link is not None:
            self.link.stop()       # the servers leave their loop and free the group with us
        self.group.free()
        if self.link is not None:
            self.coordinate_comm.Free()
        self.state_comm.Free()
        self.inner.close()
