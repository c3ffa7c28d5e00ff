"""The parameter server's communication: workers push gradient chunks, servers
sum them, run the caller's optimizer on their own chunks and send the new
parameters back (issue 27's `--sync ps`; no model and no optimizer here: the
optimizer step is a callback the server is given).

The flat parameter buffer (n elements) is cut into chunks of at most
chunk_bytes (4 MiB by default), chunk c being elements [c*E, min((c+1)*E, n))
with E = chunk_bytes // itemsize, owned round-robin (interleaved) by the
sorted servers: chunk c belongs to servers[c % K]. Interleaving spreads every
gradient bucket over all servers. ps_layout() computes it, the same on every
rank. A server may also be a worker: servers == workers is the colocated
sharded PS (`--ps-servers 0`), every rank owning 1/n of the chunks.

One step, per rank:

    worker                                  server
    push(grad, lo, hi) per bucket           serve_step(update, clip_scale)
      Isend each chunk once all of it is      receive every worker's copy of each owned chunk,
      pushed (buckets come in any order)      sum them in the fixed pairwise tree (below),
    pull(params)  (or start_pull/wait_pull)   global norm: sums of squares per chunk, gathered
      receive every chunk from its owner,     to every server, added in chunk-index order;
      and the global squared gradient norm    update(c, summed, scale) -> new chunk, Isend to
                                              every worker; the first server sends the norm

serve_step is reduce() (receive, sum, agree on the norm; the sums in
`summed`) then send_params(new chunks): a caller that runs its own clipping
and optimizer between them calls the two (engine/parallel/ps.py, colocated:
push..., reduce, wait_pushes, then it may write the gradient buffer; its
update; start_pull, send_params, wait_pull).

The issue's "the next bucket's push overlaps this bucket's pull" cannot
hold together with its "global norm before any update": no chunk may be
updated before every chunk is summed, so with clipping pulls start after the
last push (the pushes themselves overlap backward: each leaves as its bucket
is final). comm/costmodel.py's ps_time models both (overlap=False: serve_step).

Without clipping (--grad-clip 0) no update needs the norm, and
serve_streamed(update) overlaps the two: it posts every push receive, then,
chunk by chunk in chunk order (workers push in chunk order, so waiting in
that order still overlaps), sums each chunk in the same fixed tree as soon as
all its pushes are in, updates it with scale 1.0 and sends it back at once:
chunk c travels back while chunk c + 1 still arrives (ps_time overlap=True).
The norm is still computed, per chunk in chunk order, and agreed after the
last chunk, for reporting only. The workers change nothing but the order:
start_pull before the first push (push_and_pull does both), so the returned
chunks land while they still push. Same bits as serve_step with scale 1.
The chunks are taken as their pushes complete (Waitsome), so it overlaps in
any push order: the trainer's (from the buffer's end, as backward runs) or a
benchmark's (chunk order).

A rank that is worker and server calls push..., serve_step, pull: every
message is nonblocking and its own pushes reach it as messages like any
other's, so pushing to itself cannot deadlock.

Deterministic summation. Workers are sorted by rank; worker i's contribution
is x_i. For a power-of-two count the sum is the pairwise tree
((x0 + x1) + (x2 + x3)) + ..., lower operand first: exactly the combine order
of recursive doubling (comm/small.py). For other counts small.py's fold
defines it: with pof2 the largest power of two <= n and rem = n - pof2, the
leaves are (x_{2i} + x_{2i+1}) for i < rem and x_{i+rem} for rem <= i < pof2,
then the pairwise tree over the leaves. op="avg" divides the sum by n
afterwards, as small.py does. So the summed gradient equals, bitwise,
comm.allreduce(grad, workers_comm, op, algorithm="small") on the workers.
The global norm is the same bits whoever owns which chunk: each chunk's sum
of squares is float64 of that chunk alone (server_norm_sq), and they are
added one by one in chunk-index order (ordered_sum).

Messages run on a private Dup of the caller's communicator (like CommContext:
our messages never meet the caller's) with the tag ((chunk * 2 + step parity)
* 4 + kind), kind push, pull or norm: a receive names its source and its tag,
so a message of another chunk, kind or step is never taken for it. Parity is
enough: a worker pushes step t+2 only after pulling all of step t+1, which
the servers send only after receiving all of step t+1's pushes, so they hold
no step t receive any more. With steps in flight (end_step, below) a tag may
repeat between steps; MPI's order between one sender and one receiver on
one tag keeps them apart, the servers serving steps in order.

Staleness and asynchrony (the engine's --ps-mode; the math changes):
- Bounded staleness: a worker ends a step (end_step) without waiting for its
  pull, each step's pull into a buffer of its own, and later completes them
  oldest first (wait_oldest): it computes on parameters some updates old.
  The servers do not change: every step is summed and updated as above.
- mode="async" (a group's mode, the same on every rank): the servers apply
  each worker's push of a chunk alone, as it arrives (serve_async), and send
  that worker the chunk so updated; there is no sum and no global norm.

Memory: a server receives into one buffer per (owned chunk, worker), n times
its share of the parameters (n M / K; M in the colocated case): simple, and
fine for tests and moderate n; the receive of a chunk could reuse fewer
buffers by summing as copies arrive, at the price of a fixed arrival order.

Errors. The group is made collectively; the ranks first compare its
arguments (one small Allgather), so a mismatch raises the same error on every
rank, and a bad layout raises ValueError saying what to pass. A call that
fails half-way cancels its pending receives and refuses every later call
(its messages would be taken for the next step's). A dead or failed peer:
like the rest of comm there is no timeout; under comm.abort_on_error() (as the
trainer runs) an exception on any rank ends the whole job, and MPI ends it
when a process dies.

Host (numpy) buffers only, float16/32/64. Import rule: MPI and numpy only,
nothing of ringpipe.engine or ringpipe.kernels.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from . import fingerprint
from .consistency import check_consistent
from .costmodel import PS_CHUNK_BYTES

__all__ = ["CHUNK_BYTES", "PSLayout", "ps_layout", "ps_ranks", "ParameterServerGroup", "server_norm_sq",
           "ordered_sum", "tree_sum"]

CHUNK_BYTES = PS_CHUNK_BYTES    # 4 MiB: the "<= 4 MB" chunks (the cost model's too)
_PUSH, _PULL, _NORM = 0, 1, 2   # the message kinds in the tag's low two bits
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class PSLayout(NamedTuple):
    """Who owns which chunk of the flat buffer; ps_layout() makes one."""
    n_elements: int
    itemsize: int
    workers: tuple[int, ...]        # sorted ranks: the order of the summation tree
    servers: tuple[int, ...]        # sorted ranks: chunk c belongs to servers[c % K]
    chunk_elements: int             # elements per chunk (the last one may be shorter)

    @property
    def n_chunks(self) -> int:
        return -(-self.n_elements // self.chunk_elements)

    @property
    def colocated(self) -> bool:
        """Every worker is also a server and there is no other server (K = 0)."""
        return self.servers == self.workers

    def bounds(self, chunk: int) -> tuple[int, int]:
        """(lo, hi): the elements of chunk `chunk`."""
        lo = chunk * self.chunk_elements
        return lo, min(lo + self.chunk_elements, self.n_elements)

    def owner(self, chunk: int) -> int:
        return self.servers[chunk % len(self.servers)]

    def owned_by(self, server: int) -> range:
        """The chunks `server` owns, in increasing order (empty for a rank that is no server)."""
        if server not in self.servers:
            return range(0)
        return range(self.servers.index(server), self.n_chunks, len(self.servers))

    def chunks_in(self, lo: int, hi: int) -> range:
        """The chunks that overlap elements [lo, hi) (a gradient bucket)."""
        if hi <= lo:
            return range(0)
        return range(lo // self.chunk_elements, -(-hi // self.chunk_elements))


def ps_layout(n_elements: int, itemsize: int, workers, servers, chunk_bytes: int = CHUNK_BYTES) -> PSLayout:
    """The chunks of an n-element flat buffer of `itemsize`-byte elements and
    their owners (module docstring). A pure function: the same on every rank.
    servers == workers is the colocated sharded PS."""
    workers, servers = list(workers), list(servers)
    if not workers:
        raise ValueError("ps_layout: no workers: pass the ranks that compute gradients (at least one)")
    if not servers:
        raise ValueError("ps_layout: no servers: pass the server ranks, or the workers themselves for a "
                         "colocated sharded parameter server (--ps-servers 0)")
    for name, ranks in (("workers", workers), ("servers", servers)):
        if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0 for r in ranks):
            raise ValueError(f"ps_layout: {name} must be ranks (integers >= 0), got {ranks}")
        twice = sorted({int(r) for r in ranks if ranks.count(r) > 1})
        if twice:
            raise ValueError(f"ps_layout: {name} lists rank(s) {twice} more than once: list each rank once")
    if isinstance(n_elements, bool) or int(n_elements) != n_elements or n_elements < 1:
        raise ValueError(f"ps_layout: need n_elements >= 1 (the flat buffer's length), got {n_elements!r}")
    if int(itemsize) != itemsize or itemsize < 1:
        raise ValueError(f"ps_layout: need itemsize >= 1 byte, got {itemsize!r}")
    if int(chunk_bytes) != chunk_bytes or chunk_bytes < itemsize:
        raise ValueError(f"ps_layout: chunk_bytes {chunk_bytes!r} holds no element of {itemsize} bytes: pass "
                         f"chunk_bytes >= {itemsize} (default {CHUNK_BYTES}, 4 MiB)")
    return PSLayout(int(n_elements), int(itemsize), tuple(sorted(int(r) for r in workers)),
                    tuple(sorted(int(r) for r in servers)), int(chunk_bytes) // int(itemsize))


def ps_ranks(size: int, n_servers: int) -> tuple[list[int], list[int]]:
    """(workers, servers) of a `size`-rank job with `n_servers` dedicated
    servers (`--ps-servers K`): the last K ranks serve, the others work;
    K = 0: every rank is both (colocated)."""
    if n_servers < 0 or n_servers >= size:
        raise ValueError(f"--ps-servers {n_servers} with {size} ranks: need 0 <= K < {size} (K = 0 makes every "
                         f"worker a server too); launch K more ranks than the workers you want")
    if n_servers == 0:
        return list(range(size)), list(range(size))
    return list(range(size - n_servers)), list(range(size - n_servers, size))


def tree_sum(rows: np.ndarray) -> np.ndarray:
    """Sum the rows of `rows` (worker i's contribution in row i) in the fixed
    pairwise tree of recursive doubling (module docstring), in place: returns
    the row view that holds the sum; the other rows are left as scratch."""
    n = rows.shape[0]
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2
    leaves = []
    for i in range(pof2):
        if i < rem:                        # small.py's fold: the even rank hands its data to the odd one
            np.add(rows[2 * i], rows[2 * i + 1], out=rows[2 * i])
            leaves.append(2 * i)
        else:
            leaves.append(i + rem)
    step = 1
    while step < pof2:                     # one doubling step: pairs 2*step apart, lower operand first
        for j in range(0, pof2, 2 * step):
            a, b = leaves[j], leaves[j + step]
            np.add(rows[a], rows[b], out=rows[a])
        step *= 2
    return rows[leaves[0]]


def server_norm_sq(chunks) -> np.ndarray:
    """float64 sum of squares of each chunk (a list of arrays), each from its
    chunk alone (numpy's sum, as kernels' reference sum_of_squares): the same
    bits whoever owns the chunk."""
    return np.array([float(np.sum(np.square(c, dtype=np.float64))) for c in chunks], dtype=np.float64)


def ordered_sum(values) -> float:
    """Add float64 values one by one in the order given (not Python's sum(),
    which compensates since 3.12, nor a pairwise numpy sum)."""
    total = 0.0
    for v in values:
        total += float(v)
    return total


def _wire(a: np.ndarray) -> np.ndarray:
    # float16 travels as uint16, as in comm/collectives.py: MPI only moves our bytes.
    return a.view(np.uint16) if a.dtype.char == "e" else a


class ParameterServerGroup:
    """The push/serve/pull exchange of one flat buffer among `workers` and
    `servers` (ranks of `comm`, which holds them all; servers == workers: the
    colocated sharded PS). Creating it is collective over `comm` (Dup, the
    argument check, the servers' Split); so is free().

    Worker: push(grad, lo, hi) once per element per step, then pull(params)
    (or start_pull(params) any time before, wait_pull() after) -> the global
    squared gradient norm. `grad` must stay untouched until wait_pull
    returns (its chunks may still be on their way), and `params` may not
    share memory with it.

    Server: serve_step(update, clip_scale=None) -> the global squared norm.
    update(chunk, summed_grad, scale) returns the chunk's new parameters
    (an array of the group's dtype and the chunk's length; the server sends
    it as it is, so it must not change until the next serve_step: the
    master weights themselves are fine). clip_scale(norm_sq) -> the factor
    for update (1.0 without it), e.g. engine's optim.clip_scale with max_norm.
    `summed_grad` is a view of a receive buffer, valid until the next step.
    Without clipping, serve_streamed(update) instead overlaps push and pull
    (the workers: push_and_pull, or start_pull before the pushes; wait_pull).
    """

    def __init__(self, comm, workers, servers, n_elements: int, dtype, chunk_bytes: int = CHUNK_BYTES,
                 op: str = "avg", mode: str = "sync"):
        self.broken: str | None = None       # why our messages no longer line up, if they do not
        self._abandoned: list = []
        self._param_sends: list = []         # (requests, the arrays they send): kept alive until done
        self._push_sends: list = []
        self.comm = comm.Dup()
        self.server_comm = MPI.COMM_NULL
        try:
            dtype = np.dtype(dtype)
            args = (n_elements, dtype.str, op, chunk_bytes, tuple(workers), tuple(servers), mode)
            check_consistent(self.comm, "ParameterServerGroup(n_elements, dtype, op, chunk_bytes, workers, "
                             "servers, mode)", args)
            if mode not in ("sync", "async"):
                raise ValueError(f"ParameterServerGroup: mode {mode!r}: use 'sync' or 'async'")
            if dtype not in _FLOATS:
                raise ValueError(f"ParameterServerGroup: dtype {dtype} is not float16, float32 or float64")
            if op not in ("sum", "avg"):
                raise ValueError(f"ParameterServerGroup: op {op!r}: use 'sum' or 'avg'")
            self.layout = ps_layout(n_elements, dtype.itemsize, workers, servers, chunk_bytes)
            size = self.comm.Get_size()
            outside = sorted(r for r in set(self.layout.workers + self.layout.servers) if r >= size)
            if outside:
                raise ValueError(f"ParameterServerGroup: rank(s) {outside} are not in the {size}-rank "
                                 f"communicator: workers and servers must be ranks of `comm`")
            last_tag = ((self.layout.n_chunks - 1) * 2 + 1) * 4 + _NORM
            ub = (1 << fingerprint.tag_bits(self.comm)) - 1
            if last_tag > ub:
                raise ValueError(f"ParameterServerGroup: {self.layout.n_chunks} chunks need tags up to "
                                 f"{last_tag}, more than this MPI's {ub}: pass a larger chunk_bytes")
            self.rank = self.comm.Get_rank()
            self.is_worker = self.rank in self.layout.workers
            self.is_server = self.rank in self.layout.servers
            # The servers' own communicator, for the norm; ranks in comm's order (key).
            self.server_comm = self.comm.Split(0 if self.is_server else MPI.UNDEFINED, self.rank)
        except BaseException:
            self.free()          # every rank raises alike, so every rank frees alike
            raise
        self.dtype = dtype
        self.op = op
        self.mode = mode
        lay = self.layout
        # Worker state for the step under way.
        self._step = 0                       # steps this worker pulled
        self._grad = None                    # the buffer this step's pushes come from
        self._pushed: list[tuple[int, int]] = []
        self._covered = np.zeros(lay.n_chunks, dtype=np.int64)   # elements pushed per chunk
        self._pull_recvs: list = []
        self._pull_params = None             # kept alive while its receives are posted
        self._norm_in = np.zeros(1, dtype=np.float64)
        # Steps whose pushes are made and pull posted, not yet waited for (end_step), oldest
        # first: (pull receives, push sends, the pull's params, its norm buffer) each.
        self._in_flight: deque = deque()
        # Server state.
        self._served = 0                     # steps this server served
        self.summed = None                   # reduce()'s sums until send_params() sends the step
        self._norm_sq = 0.0
        self._owned = lay.owned_by(self.rank)
        n_w = len(lay.workers)
        self._inbox = np.empty((len(self._owned), n_w, lay.chunk_elements if self._owned else 0), dtype=dtype)

    # ---- tags and state ----------------------------------------------------------

    @staticmethod
    def _tag(chunk: int, step: int, kind: int) -> int:
        return (chunk * 2 + step % 2) * 4 + kind

    def _ensure_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(
                "ringpipe: this ParameterServerGroup no longer works: an earlier call broke off half-way, "
                f"leaving messages in flight that would be taken for the next step's. It failed with: "
                f"{self.broken}")

    def _abandon(self, receives, e: BaseException) -> None:
        """Cancel the receives still pending (no late message lands in a caller's
        buffer) and keep every request alive: mpi4py would free an active one with
        its Python object, while MPI may still touch the memory."""
        for req in receives:
            if req:
                try:
                    req.Cancel()
                except MPI.Exception:
                    pass
        self._abandoned.append((list(receives), self._push_sends, self._param_sends, list(self._in_flight)))
        self.broken = f"{type(e).__name__}: {e}"

    def _check_flat(self, name: str, a, writeable: bool = False) -> None:
        if type(a) is not np.ndarray:
            raise TypeError(f"ParameterServerGroup: {name} must be a numpy array (host memory), got "
                            f"{type(a).__name__}")
        if a.ndim != 1 or a.size != self.layout.n_elements or a.dtype != self.dtype \
                or not a.flags.c_contiguous or (writeable and not a.flags.writeable):
            raise ValueError(f"ParameterServerGroup: {name} must be a contiguous{' writeable' if writeable else ''} "
                             f"1-D {self.dtype}[{self.layout.n_elements}] (the flat buffer the group was made "
                             f"for), got {a.dtype}{list(a.shape)}")

    # ---- worker side -----------------------------------------------------------

    def push(self, grad: np.ndarray, lo: int, hi: int) -> None:
        """Mark elements [lo, hi) of `grad` final for this step (a gradient
        bucket) and send each chunk they complete to its owner (nonblocking).
        Every element is pushed exactly once per step, in any order of ranges."""
        self._ensure_usable()
        if not self.is_worker:
            raise ValueError(f"ParameterServerGroup.push: rank {self.rank} is no worker "
                             f"(workers: {list(self.layout.workers)})")
        self._check_flat("grad", grad)
        n = self.layout.n_elements
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"ParameterServerGroup.push: range [{lo}, {hi}) is not inside [0, {n})")
        if self._grad is None:
            self._grad = grad
        elif grad.ctypes.data != self._grad.ctypes.data:
            raise ValueError("ParameterServerGroup.push: every push of a step must come from the same "
                             "gradient buffer (a chunk may span two buckets)")
        if lo == hi:
            return
        for plo, phi in self._pushed:
            if lo < phi and plo < hi:
                raise ValueError(f"ParameterServerGroup.push: [{lo}, {hi}) overlaps [{plo}, {phi}), pushed "
                                 f"before in this step: push each element once per step")
        self._pushed.append((lo, hi))
        lay, step = self.layout, self._step
        try:
            for c in lay.chunks_in(lo, hi):
                clo, chi = lay.bounds(c)
                self._covered[c] += min(hi, chi) - max(lo, clo)
                if self._covered[c] == chi - clo:
                    self._push_sends.append(
                        self.comm.Isend(_wire(grad[clo:chi]), lay.owner(c), self._tag(c, step, _PUSH)))
        except BaseException as e:
            self._abandon((), e)
            raise

    def start_pull(self, params: np.ndarray) -> None:
        """Post the receives of every chunk's new values into `params` (and of
        the global norm); wait_pull() completes them. May come before the pushes."""
        self._ensure_usable()
        if not self.is_worker:
            raise ValueError(f"ParameterServerGroup.start_pull: rank {self.rank} is no worker")
        if self._pull_recvs:
            raise ValueError("ParameterServerGroup.start_pull: a pull is already posted: wait_pull() first")
        self._check_flat("params", params, writeable=True)
        if self._grad is not None and np.may_share_memory(params, self._grad):
            raise ValueError("ParameterServerGroup.start_pull: params shares memory with the pushed gradient, "
                             "whose sends may still read it: pull into another buffer")
        lay, step = self.layout, self._step
        recvs = []
        try:
            for c in range(lay.n_chunks):
                clo, chi = lay.bounds(c)
                recvs.append(self.comm.Irecv(_wire(params[clo:chi]), lay.owner(c), self._tag(c, step, _PULL)))
            if self.mode == "sync":         # (async: no global norm; each worker has its own)
                recvs.append(self.comm.Irecv(self._norm_in, lay.servers[0], self._tag(0, step, _NORM)))
        except BaseException as e:
            self._abandon(recvs, e)
            raise
        self._pull_params = params
        self._pull_recvs = recvs

    def wait_pull(self) -> float | None:
        """Wait for this step's pull (start_pull) and pushes; returns the global
        squared gradient norm (before clipping), the same on every rank (None
        in mode "async": the servers agree on no norm)."""
        self._ensure_usable()
        if not self._pull_recvs:
            raise ValueError("ParameterServerGroup.wait_pull: no pull posted: start_pull(params) first")
        missing = self.layout.n_elements - int(self._covered.sum())
        if missing:
            raise ValueError(f"ParameterServerGroup.wait_pull: {missing} of {self.layout.n_elements} elements "
                             f"were not pushed this step: push every element (every bucket) before wait_pull, "
                             f"or the servers wait for them forever")
        try:
            MPI.Request.Waitall(self._pull_recvs)
            MPI.Request.Waitall(self._push_sends)
        except BaseException as e:
            self._abandon(self._pull_recvs, e)
            raise
        norm = float(self._norm_in[0]) if self.mode == "sync" else None
        self._next_step()
        return norm

    def _next_step(self) -> None:
        self._step += 1
        self._grad, self._pushed, self._push_sends, self._pull_recvs = None, [], [], []
        self._covered[:] = 0
        self._pull_params = None

    # Bounded staleness (engine's --ps-mode ssp:S): a worker goes on to its next step while
    # the pulls of its last ones are still on their way, each into a buffer of its own.

    def end_step(self) -> None:
        """This step's pushes are all made and its pull posted (start_pull into a buffer that
        nothing else reads or writes until wait_oldest() returns it): go on to the next step
        without waiting. wait_oldest() completes the steps so ended, oldest first. Before the
        pushed gradient buffer is written again, wait_sent(). The servers serve steps in
        order, and MPI delivers one sender's messages of one tag in order, so the pulls of
        several steps in flight (their tags' step parity may repeat) land where they should."""
        self._ensure_usable()
        if not self._pull_recvs:
            raise ValueError("ParameterServerGroup.end_step: no pull posted: start_pull(params) first")
        missing = self.layout.n_elements - int(self._covered.sum())
        if missing:
            raise ValueError(f"ParameterServerGroup.end_step: {missing} of {self.layout.n_elements} elements "
                             "were not pushed this step: push every element first")
        self._in_flight.append((self._pull_recvs, self._push_sends, self._pull_params, self._norm_in))
        self._norm_in = np.zeros(1, dtype=np.float64)
        self._next_step()

    @property
    def in_flight(self) -> int:
        """Steps ended (end_step) whose pulls were not waited for yet."""
        return len(self._in_flight)

    def wait_oldest(self) -> float | None:
        """Wait for the oldest step in flight (end_step): its pull has landed in the buffer
        given to start_pull. Returns that step's global squared norm (None in mode "async")."""
        self._ensure_usable()
        if not self._in_flight:
            raise ValueError("ParameterServerGroup.wait_oldest: no step in flight: end_step() first")
        recvs, sends, _, norm_in = self._in_flight[0]
        try:
            MPI.Request.Waitall(recvs)
            MPI.Request.Waitall(sends)
        except BaseException as e:
            self._abandon(recvs, e)
            raise
        self._in_flight.popleft()
        return float(norm_in[0]) if self.mode == "sync" else None

    def wait_sent(self) -> None:
        """Wait until the pushes of every step in flight have left their gradient buffer
        (it may be written from then on). They complete once the servers receive them,
        which they do in step order: it waits for no pull."""
        self._ensure_usable()
        for _, sends, _, _ in self._in_flight:
            try:
                MPI.Request.Waitall(sends)
            except BaseException as e:
                self._abandon([r for recvs, _, _, _ in self._in_flight for r in recvs], e)
                raise

    def wait_pushes(self) -> None:
        """Wait until this step's pushes have left `grad` (every element pushed):
        the gradient buffer may be written from then on, before wait_pull()
        (the colocated PS writes its summed chunks there). Their receivers must
        be receiving: a colocated rank calls it after its own reduce()."""
        self._ensure_usable()
        missing = self.layout.n_elements - int(self._covered.sum())
        if missing:
            raise ValueError(f"ParameterServerGroup.wait_pushes: {missing} of {self.layout.n_elements} elements "
                             f"were not pushed this step: push every element first")
        try:
            MPI.Request.Waitall(self._push_sends)
        except BaseException as e:
            self._abandon(self._pull_recvs, e)
            raise
        self._push_sends = []

    def pull(self, params: np.ndarray) -> float:
        """start_pull(params) and wait_pull(): blocking; returns the global squared norm."""
        self.start_pull(params)
        return self.wait_pull()

    def push_and_pull(self, grad: np.ndarray, params: np.ndarray, buckets=None) -> None:
        """The streamed step's worker half, up to the wait: start_pull(params)
        first, so chunks that a server (serve_streamed) returns land while this
        rank still pushes, then push(grad, lo, hi) for each bucket (default:
        the whole buffer). wait_pull() follows (after serve_streamed on a
        colocated rank)."""
        if np.may_share_memory(params, grad):
            raise ValueError("ParameterServerGroup.push_and_pull: params shares memory with grad, whose sends "
                             "may still read it: pull into another buffer")
        self.start_pull(params)
        for lo, hi in buckets if buckets is not None else [(0, self.layout.n_elements)]:
            self.push(grad, lo, hi)

    # ---- server side -------------------------------------------------------------

    def global_norm_sq(self, per_chunk: np.ndarray) -> float:
        """Collective among the servers: every owned chunk's float64 value
        (per_chunk[i] for self's i-th owned chunk) gathered to every server and
        added in global chunk-index order (ordered_sum)."""
        lay = self.layout
        k = len(lay.servers)
        counts = [len(range(i, lay.n_chunks, k)) for i in range(k)]
        gathered = np.empty(lay.n_chunks, dtype=np.float64)
        mine = np.ascontiguousarray(per_chunk, dtype=np.float64)
        self.server_comm.Allgatherv(mine, [gathered, counts, None, MPI.DOUBLE])
        values = np.empty(lay.n_chunks, dtype=np.float64)
        at = 0
        for i in range(k):                  # server i's block holds chunks i, i + k, ...
            values[i::k] = gathered[at:at + counts[i]]
            at += counts[i]
        return ordered_sum(values)

    def serve_step(self, update: Callable[[int, np.ndarray, float], np.ndarray],
                   clip_scale: Callable[[float], float] | None = None) -> float:
        """Receive every worker's push of each owned chunk, sum them (tree_sum,
        then / n for op="avg"), agree on the global norm with the other servers,
        then update(chunk, summed_grad, scale) each owned chunk and send the new
        values to every worker. Returns the global squared gradient norm.
        reduce() and send_params() are its two halves, for a caller whose own
        code runs between them (the trainer: clipping and the optimizer)."""
        norm_sq = self.reduce()
        try:
            scale = 1.0 if clip_scale is None else float(clip_scale(norm_sq))
            new = [update(c, g, scale) for c, g in zip(self._owned, self.summed)]
        except BaseException as e:
            self._abandon((), e)
            raise
        self.send_params(new)
        return norm_sq

    def reduce(self, norm_exclude=()) -> float:
        """serve_step's first half: receive every worker's push of each owned
        chunk, sum them (tree_sum, then / n for op="avg") and agree on the global
        squared norm with the other servers (collective among them); returns it.
        The sums are `summed` (a view per owned chunk, in owned_by order, valid
        until the next step); send_params() must follow before the next reduce().
        norm_exclude: (lo, hi) ranges of the flat buffer left out of the norm (the
        caller counts them elsewhere: a pipeline's second copy of a tied weight)."""
        self._begin_serving("reduce", "this step is reduced already: send_params() first")
        recvs: list = []
        try:
            recvs = self._post_push_receives()
            summed = [self._summed_chunk(i, c, recvs[i]) for i, c in enumerate(self._owned)]
            self._norm_sq = self.global_norm_sq(server_norm_sq(self._norm_counted(summed, norm_exclude)))
        except BaseException as e:
            self._abandon([r for rs in recvs for r in rs], e)
            raise
        self.summed = summed
        return self._norm_sq

    def _norm_counted(self, summed, exclude) -> list:
        """The owned chunks' sums as the norm counts them: the elements in `exclude`
        ((lo, hi) ranges of the flat buffer) zeroed, in copies of the chunks they cut."""
        return [self._counted(c, total, exclude) for c, total in zip(self._owned, summed)]

    def _counted(self, c: int, total: np.ndarray, exclude) -> np.ndarray:
        """Chunk c's sum as the norm counts it (_norm_counted, one chunk)."""
        clo, chi = self.layout.bounds(c)
        cuts = [(max(lo, clo) - clo, min(hi, chi) - clo) for lo, hi in exclude if max(lo, clo) < min(hi, chi)]
        if cuts:
            total = total.copy()
            for a, b in cuts:
                total[a:b] = 0
        return total

    def _begin_serving(self, what: str, pending: str) -> None:
        """The checks before a server's step (reduce, serve_streamed, serve_async); `pending`:
        what to say when reduce() ran this step and send_params() did not follow."""
        self._ensure_usable()
        if (self.mode == "async") != (what == "serve_async"):
            raise ValueError(f"ParameterServerGroup.{what}: this group's mode is {self.mode!r}: "
                             + ("serve each step with serve_async()" if self.mode == "async" else
                                "serve_async() needs a group made with mode='async'"))
        if not self.is_server:
            raise ValueError(f"ParameterServerGroup.{what}: rank {self.rank} is no server "
                             f"(servers: {list(self.layout.servers)})")
        if self.summed is not None:
            raise ValueError(f"ParameterServerGroup.{what}: {pending}")
        if self.is_worker and self._covered.sum() != self.layout.n_elements:
            raise ValueError(f"ParameterServerGroup.{what}: this rank is a worker too and has not pushed "
                             "every element of this step: push every bucket first, or it waits for itself")

    def _post_push_receives(self) -> list:
        """Every worker's push of each owned chunk, posted: [requests per owned chunk]. First
        the last step's parameter sends are waited for: done once the workers pulled, which
        they did before pushing this step; their arrays may change from now on."""
        lay, step = self.layout, self._served
        for reqs, _ in self._param_sends:
            MPI.Request.Waitall(reqs)
        self._param_sends = []
        recvs = []
        for i, c in enumerate(self._owned):
            clo, chi = lay.bounds(c)
            rows = self._inbox[i, :, :chi - clo]
            recvs.append([self.comm.Irecv(_wire(rows[w]), src, self._tag(c, step, _PUSH))
                          for w, src in enumerate(lay.workers)])
        return recvs

    def _summed_chunk(self, i: int, c: int, requests) -> np.ndarray:
        """Owned chunk c (the i-th) once its pushes are in: their tree_sum, then / n for op="avg"."""
        MPI.Request.Waitall(requests)
        clo, chi = self.layout.bounds(c)
        total = tree_sum(self._inbox[i, :, :chi - clo])
        if self.op == "avg":
            np.divide(total, len(self.layout.workers), out=total)       # as comm/small.py: after the tree
        return total

    def _send_chunk(self, c: int, values) -> None:
        """Chunk c's new parameters to every worker (checked first)."""
        self._check_new(c, values)
        reqs = [self.comm.Isend(_wire(values), w, self._tag(c, self._served, _PULL)) for w in self.layout.workers]
        self._param_sends.append((reqs, values))

    def _send_norm(self, step: int | None = None) -> None:
        """The first server sends the global squared norm of step `step` (default: the one
        being served) to every worker."""
        if self.rank == self.layout.servers[0]:
            norm_out = np.array([self._norm_sq], dtype=np.float64)
            step = self._served if step is None else step
            reqs = [self.comm.Isend(norm_out, w, self._tag(0, step, _NORM)) for w in self.layout.workers]
            self._param_sends.append((reqs, norm_out))

    def _check_new(self, c: int, values) -> None:
        clo, chi = self.layout.bounds(c)
        if type(values) is not np.ndarray or values.shape != (chi - clo,) or values.dtype != self.dtype \
                or not values.flags.c_contiguous:
            raise ValueError(f"ParameterServerGroup: chunk {c}'s new parameters (serve_step: what "
                             f"update({c}, ...) returned) are {getattr(values, 'dtype', type(values).__name__)}"
                             f"{list(getattr(values, 'shape', []))}: give them as a contiguous "
                             f"{self.dtype}[{chi - clo}]")

    def send_params(self, new, norm_sq: float | None = None) -> None:
        """serve_step's second half: send each owned chunk's new parameters
        (new[i] for the i-th owned chunk: a contiguous array of the group's dtype
        and the chunk's length, unchanged until the next reduce(); it must not
        share memory with a buffer this rank pulls into) to every worker, and
        from the first server the global norm (norm_sq, when given: a caller whose norm
        covers more than this group, e.g. several groups' added)."""
        self._ensure_usable()
        if norm_sq is not None:
            self._norm_sq = float(norm_sq)
        if self.summed is None:
            raise ValueError("ParameterServerGroup.send_params: nothing reduced this step: reduce() first")
        new = list(new)
        try:
            if len(new) != len(self._owned):
                raise ValueError(f"ParameterServerGroup.send_params: {len(new)} arrays for this server's "
                                 f"{len(self._owned)} chunks: pass one per owned chunk")
            for c, values in zip(self._owned, new):
                self._send_chunk(c, values)
            self._send_norm()
        except BaseException as e:
            self._abandon((), e)
            raise
        self.summed = None
        self._served += 1

    def serve_streamed(self, update: Callable[[int, np.ndarray, float], np.ndarray], norm_exclude=(),
                       send_norm: bool = True) -> float:
        """serve_step without clipping, push and pull overlapped (module
        docstring): post every push receive, then take the owned chunks as their
        pushes complete (the trainer pushes from the buffer's end while backward
        runs, a benchmark may push in chunk order: either way a chunk goes back as
        soon as all its copies are in), sum each (tree_sum, / n for op="avg"; the
        same bits as reduce()), take its sum of squares (less norm_exclude, as
        reduce()), call update(chunk, summed_grad, 1.0) and send the result to
        every worker at once. After the last chunk the servers agree on the global
        squared norm (collective among them) and it is returned: for reporting,
        never used to scale. The first server sends it, unless send_norm is False
        (the caller adds several groups' norms, then calls send_norm()).
        update's contract is serve_step's."""
        self._begin_serving("serve_streamed", "reduce() ran this step and send_params() did not follow: finish "
                            "that step with send_params() first")
        recvs: list = []
        try:
            recvs = self._post_push_receives()
            n_w = len(self.layout.workers)
            flat = [r for rs in recvs for r in rs]          # owned chunk i's pushes: flat[i * n_w:(i + 1) * n_w]
            missing = [n_w] * len(self._owned)
            norm_parts = np.empty(len(self._owned), dtype=np.float64)
            while True:
                done = MPI.Request.Waitsome(flat)
                if done is None or not done:               # (every request completed)
                    break
                for k in done:
                    i = k // n_w
                    missing[i] -= 1
                    if missing[i]:
                        continue
                    c = self._owned[i]
                    total = self._summed_chunk(i, c, [])     # its pushes are in
                    # Before update(), which may write `total`.
                    norm_parts[i] = server_norm_sq([self._counted(c, total, norm_exclude)])[0]
                    self._send_chunk(c, update(c, total, 1.0))
            self._norm_sq = self.global_norm_sq(norm_parts)
            if send_norm:
                self._send_norm()
        except BaseException as e:
            self._abandon(recvs and [r for rs in recvs for r in rs], e)
            raise
        self._served += 1
        return self._norm_sq

    def send_norm(self, norm_sq: float) -> None:
        """After serve_streamed(send_norm=False): the first server sends `norm_sq` (e.g.
        several groups' norms added) as this step's global norm."""
        self._ensure_usable()
        self._norm_sq = float(norm_sq)
        self._send_norm(self._served - 1)        # the step serve_streamed served

    def serve_async(self, update: Callable[[int, int, np.ndarray], np.ndarray]) -> None:
        """Mode "async": apply each worker's push as it arrives. Every push of this step is
        posted; whichever (owned chunk c, worker w) lands first goes first: update(c, i,
        grad) with i the worker's index in `workers` and `grad` that worker's chunk alone
        (a view of the receive buffer, valid during the call) returns the chunk's new
        parameters, sent to that worker only (a fresh array: the next worker's update must
        not change it while it travels). So a worker pulls the chunk with its own update
        and those that arrived before it: the order, and so the bits, vary from run to run.
        No sum, no global norm, none sent."""
        self._begin_serving("serve_async", "unreachable")
        lay, n_w = self.layout, len(self.layout.workers)
        recvs: list = []
        try:
            recvs = [r for rs in self._post_push_receives() for r in rs]
            while True:
                k = MPI.Request.Waitany(recvs)
                if k == MPI.UNDEFINED:
                    break
                i, w = divmod(k, n_w)
                c = self._owned[i]
                clo, chi = lay.bounds(c)
                values = update(c, w, self._inbox[i, w, :chi - clo])
                self._check_new(c, values)
                req = self.comm.Isend(_wire(values), lay.workers[w], self._tag(c, self._served, _PULL))
                self._param_sends.append(([req], values))
        except BaseException as e:
            self._abandon(recvs, e)
            raise
        self._served += 1

    # ---- the end -----------------------------------------------------------------

    def free(self) -> None:
        """Wait for the last sends and free the private communicators (collective)."""
        if self.broken is None:
            for reqs, _ in getattr(self, "_param_sends", ()):
                MPI.Request.Waitall(reqs)
            if getattr(self, "_push_sends", None):
                MPI.Request.Waitall(self._push_sends)
            for recvs, sends, _, _ in getattr(self, "_in_flight", ()):    # the servers send every step's pull
                MPI.Request.Waitall(recvs)
                MPI.Request.Waitall(sends)
            self._param_sends, self._push_sends, self._in_flight = [], [], deque()
        for name in ("server_comm", "comm"):
            c = getattr(self, name, MPI.COMM_NULL)
            # Free() leaves COMM_NULL behind, so a second free() does nothing.
            if c != MPI.COMM_NULL and not MPI.Is_finalized():
                c.Free()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.free()
        return False
