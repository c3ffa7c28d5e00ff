"""Our private view of a user's communicator: CommContext, and context_for,
which keeps one per communicator for the collectives (comm/collectives.py).

A context is what one collective call needs besides the buffer: a Dup'ed
communicator of its own, the agreed comm settings, receive scratch, the
layouts the ranks already compared, and whether an earlier call broke off
half-way (then no later call may send anything).
"""

from __future__ import annotations

import threading

import numpy as np
from mpi4py import MPI

from . import fingerprint, settings
from .consistency import check_consistent
from .device import empty_for_mpi
from .costmodel import calibrate
from .hierarchical import Hierarchy, node_key, node_map

__all__ = ["CommContext", "context_for"]


class CommContext:
    """Our private view of a user communicator.

    A Dup gives our point-to-point traffic its own context, so our messages
    can never match one the caller (say, a pipeline stage) has in flight on
    the same communicator. It also owns the receive scratch, the MPI.Status
    the receives reuse and the layouts already checked, so those are reused
    call after call. A context must be driven by one thread at a time, which
    MPI requires for collectives on one communicator anyway.

    Creating one is collective: the Dup, then one small allgather in which the
    ranks compare their comm settings (comm/settings.py: check mode, crossover,
    ring sub-chunk size, tag range). Settings that differ would make the ranks
    send different messages (one rank skipping a layout check the others make
    hangs them all), so instead every rank raises the same error here.

    RINGPIPE_COMM_CHECK decides when the ranks compare a layout (length,
    dtype, op, algorithm, shape and memory order) with one small Allgather:
      first   (default) on its first use on this communicator;
      always  on every call (one small extra Allgather each; for debugging a
              program whose ranks may diverge: names the call and each rank's
              layout);
      off     never.
    In every mode each message carries a fingerprint of its sender's layout in
    its tag (comm/fingerprint.py), which costs nothing: ranks passing
    different layouts they have each used before (or, with "off", at all) get
    an error instead of wrong bytes. A difference in what decides the message
    sizes (length, dtype size, algorithm) raises on the ranks that receive the
    odd message, and may leave the others waiting: under comm.abort_on_error()
    the job ends. Any other difference (dtype, op, shape) raises the same
    error on every rank. A rank that skips a call or makes an extra one can
    still hang the others (with "first", in the layout check it alone makes).
    """

    def __init__(self, comm):
        self._scratch: dict = {}
        self.comm = comm.Dup()
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.tag_bits = fingerprint.tag_bits(self.comm)
        try:
            # Shared with every context of this process: set_crossover() and
            # set_subchunk_bytes() act on all of them.
            # With them, which node each rank is on (comm/hierarchical.py): what
            # algorithm="auto" weighs.
            self.settings, keys = settings.agree(self.comm, self.tag_bits, extra=node_key(self.comm))
            self.nodes = node_map(keys)
            # Where the hierarchical all-reduce is a candidate, the measured cost of
            # each level decides between it and the flat ring (comm/costmodel.py).
            self.cost = None
            if self.nodes.even and 1 < self.nodes.n_nodes < self.size:
                self.cost = calibrate(self.comm, self.nodes)
        except BaseException:
            self.free()      # every rank raises alike, so every rank frees its Dup
            raise
        self._hierarchy = None
        self.always_check = self.settings.check == "always"
        self.checked: set = set()   # layouts all ranks agreed on
        self.valid: dict = {}       # layouts agreed on and validated -> semantics hash (fast path)
        self.status = MPI.Status()  # for the receives of one call at a time
        self.broken: str | None = None   # why our messages no longer line up, if they do not
        self._abandoned: list = []

    def ensure_checked(self, what: str, values: tuple, legend: str = "") -> None:
        mode = self.settings.check
        if mode == "off":
            return
        key = (what,) + tuple(values)
        if mode == "first" and key in self.checked:
            return
        check_consistent(self.comm, what, values, legend)
        self.checked.add(key)

    def ensure_usable(self) -> None:
        """Refuse to send anything once a collective broke off half-way."""
        if self.broken is not None:
            raise RuntimeError(
                "ringpipe: collectives on this communicator no longer work: an earlier call broke off "
                f"half-way, leaving messages in flight that would be mistaken for the next call's. "
                f"It failed with: {self.broken}")

    def abandon(self, receives, sends, why: str) -> None:
        """A collective broke off half-way (`why`). Cancel its receives still
        pending, so MPI writes no late message into the caller's buffer, and
        keep every request alive: mpi4py would free an active request with
        its Python object, while MPI may still touch the memory."""
        for req in receives:
            if req:                      # not yet completed
                try:
                    req.Cancel()
                except MPI.Exception:
                    pass
        self._abandoned.append((list(receives), sends))
        self.broken = why

    def scratch(self, dtype: np.dtype, n: int, xp=np) -> np.ndarray:
        """n-element receive scratch of `dtype` in xp's memory (host, or the
        device for cupy); grow-only, one per (module, dtype)."""
        key = (xp.__name__, dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            # Grow geometrically so a slowly growing workload does not
            # reallocate on every call.
            size = max(n, 1024, 0 if buf is None else buf.size + buf.size // 2)
            buf = empty_for_mpi(xp, size, dtype)
            self._scratch[key] = buf
        return buf[:n]

    def hierarchy(self):
        """The node and cross-node communicators of the hierarchical all-reduce,
        split on its first call (collective: every rank calls it at the same
        point, once the ranks agreed on the call's layout)."""
        if self._hierarchy is None:
            self._hierarchy = Hierarchy(self.comm, self.nodes)
        return self._hierarchy

    def free(self) -> None:
        if getattr(self, "_hierarchy", None) is not None:
            self._hierarchy.free()
            self._hierarchy = None
        # Free() leaves COMM_NULL behind, so a second free() does nothing.
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self._scratch.clear()


# The private context lives on the user's communicator as an MPI attribute:
# each communicator object has its own (a freed and recycled handle starts
# without one, on every rank alike), and MPI calls _free_context when the user
# frees the communicator, so our Dup goes with it instead of leaking.
_keyval = None
_contexts_lock = threading.Lock()


def _free_context(comm, keyval, ctx) -> None:
    ctx.free()


def context_for(comm) -> CommContext:
    """The private context of `comm` (Dup'ed collectively on first use, freed
    when `comm` is freed)."""
    global _keyval
    with _contexts_lock:
        if _keyval is None:
            _keyval = MPI.Comm.Create_keyval(delete_fn=_free_context)
        ctx = comm.Get_attr(_keyval)
        if ctx is None:
            ctx = CommContext(comm)
            comm.Set_attr(_keyval, ctx)
    return ctx
