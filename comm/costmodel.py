"""The alpha-beta cost of the all-reduce algorithms, per level of the machine.

A message of n bytes between two ranks costs alpha + n * beta: alpha (s) the
latency, beta (s/byte) the inverse bandwidth, one pair per level: inside a node
and between nodes. With p ranks on N nodes of L ranks (the reduce's own cost
folded into beta, as a ping-pong of the real buffers measures it):

  flat ring      2(p-1) alpha_x + 2(p-1)/p n beta_x
                 (every step crosses a node boundary somewhere: the slowest link sets the pace)
  hierarchical   2(L-1) alpha_i + 2(L-1)/L n beta_i          reduce-scatter + all-gather in the node
                 + 2(N-1) alpha_x + 2(N-1)/N n beta_x        the L chunks cross the node's link together

What one training step moves, for a model of M bytes and n workers, on the
busiest link (bytes each way: links are full duplex, and each way carries as
much as the other in all of these; in + out is twice that):

  flat ring            2(n-1)/n M      (reduce-scatter + all-gather)
  hierarchical         2(N-1)/N M      on a node's link, N nodes
  PS, K servers        max(M, n M/K)   a worker pushes M and pulls M; a server, on its
                                       own node, receives n M/K and sends n M/K
    single master      n M             K = 1: about n/2 times the ring
    K = n servers      M               up to 2x better than the ring
  PS colocated (K = 0) 2(n-1)/n M      every rank pushes (n-1)/n M to the other owners
                                       and, as a server, sends (n-1)/n M back: the ring's

and its alpha-beta time (ps_time; comm/ps.py: chunks of at most C bytes,
c = ceil(M/C) of them), one level (the link between the nodes):
  K servers   2 max(c alpha + M beta, (n c/K) alpha + (n M/K) beta)
              push, then pull: the global norm is agreed between them, so a step
              cannot overlap the two; with overlap (no clipping barrier, each
              bucket's pull under the next one's push) the 2 goes: max(...)
  colocated   2 ((n-1)/n c alpha + (n-1)/n M beta), with or without overlap (a rank's
              link carries both its worker's and its server's messages)
A link handles its messages one after the other (alpha each); the servers'
norm exchange (K values) is left out.

calibrate() measures both levels with ping-pongs (the first two ranks of the
first node; the first ranks of the first two nodes), rank 0 fits and broadcasts,
so every rank holds the same numbers and algorithm="auto" picks the same
algorithm everywhere. A fit is kept per node layout for the life of the
process, and in RINGPIPE_CALIBRATION (a JSON file) when that is set: later jobs
on the same hosts read it instead of measuring.

The file is a cache, so nothing in it can stop a job: it is opened without
blocking and read only if it is a regular file of at most 4 MiB (a FIFO there
would wait forever for a writer, /dev/zero be read forever), malformed or
deeply nested JSON counts as no cache, and an entry is used only if its alpha
and beta are finite (alpha >= 0, beta > 0: a beta of 0 divided by zero) and it
is for this node layout. Anything else is warned about and measured again; a
path that is not a regular file is never written over. (comm may not import
engine/job/files.py, which does the same for the engine's files.)
"""
from __future__ import annotations

import json
import math
import os
import stat
import time
import warnings
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

ENV_CALIBRATION = "RINGPIPE_CALIBRATION"
SIZES = (8, 1 << 20, 4 << 20)
REPEATS = 3
CACHE_LIMIT_BYTES = 4 << 20           # an entry is ~200 bytes: room for thousands of host layouts
_fits: dict = {}

__all__ = ["Level", "CostModel", "calibrate", "ENV_CALIBRATION", "ring_link_bytes", "hierarchical_link_bytes",
           "ps_link_bytes", "ring_time", "ps_time"]
PS_CHUNK_BYTES = 4 << 20              # the parameter server's chunks (comm/ps.py's CHUNK_BYTES): the issue's <= 4 MB


class Level(NamedTuple):
    alpha: float        # seconds per message
    beta: float         # seconds per byte

    def describe(self) -> str:
        return f"alpha {self.alpha * 1e6:.1f} us, beta {self.beta * 1e9:.3f} ns/B ({1e-9 / self.beta:.2f} GB/s)"


class CostModel(NamedTuple):
    intra: Level
    inter: Level
    nodes: int
    per_node: int

    def ring(self, nbytes: int) -> float:
        p = self.nodes * self.per_node
        level = self.inter if self.nodes > 1 else self.intra
        return 2 * (p - 1) * level.alpha + 2 * (p - 1) / p * nbytes * level.beta

    def hierarchical(self, nbytes: int) -> float:
        n_, L = self.nodes, self.per_node
        return (2 * (L - 1) * self.intra.alpha + 2 * (L - 1) / L * nbytes * self.intra.beta
                + 2 * (n_ - 1) * self.inter.alpha + 2 * (n_ - 1) / n_ * nbytes * self.inter.beta)

    def best(self, nbytes: int) -> str:
        return "hierarchical" if self.hierarchical(nbytes) < self.ring(nbytes) else "ring"

    def to_dict(self) -> dict:
        return {"intra": self.intra._asdict(), "inter": self.inter._asdict(), "nodes": self.nodes,
                "per_node": self.per_node}

    def describe(self) -> str:
        return (f"cost model ({self.nodes} nodes x {self.per_node} ranks): inside a node {self.intra.describe()}; "
                f"between nodes {self.inter.describe()}")


def ring_link_bytes(nbytes: float, p: int) -> float:
    """Bytes each way on a rank's link in a flat ring all-reduce of nbytes over p ranks."""
    return 2 * (p - 1) / p * nbytes


def hierarchical_link_bytes(nbytes: float, nodes: int) -> float:
    """Bytes each way on a node's link in the hierarchical all-reduce over `nodes` nodes."""
    return 2 * (nodes - 1) / nodes * nbytes


def ps_link_bytes(nbytes: float, workers: int, servers: int) -> float:
    """Bytes each way on the busiest link of one parameter-server step: `servers`
    dedicated servers on their own nodes (1: a single master), or 0: colocated."""
    if servers == 0:
        return 2 * (workers - 1) / workers * nbytes
    return max(nbytes, workers * nbytes / servers)


def ring_time(level: Level, nbytes: float, p: int) -> float:
    """The flat ring's alpha-beta time on one level (CostModel.ring picks the level)."""
    return 2 * (p - 1) * level.alpha + ring_link_bytes(nbytes, p) * level.beta


def ps_time(level: Level, nbytes: float, workers: int, servers: int, chunk_bytes: int = PS_CHUNK_BYTES,
            overlap: bool = False) -> float:
    """Alpha-beta time of one parameter-server step (module docstring): push then
    pull, or (overlap=True) the two at once."""
    chunks = max(1, math.ceil(nbytes / chunk_bytes))
    if servers == 0:
        share = (workers - 1) / workers
        return 2 * (share * chunks * level.alpha + share * nbytes * level.beta)
    phase = max(chunks * level.alpha + nbytes * level.beta,
                workers * chunks / servers * level.alpha + workers * nbytes / servers * level.beta)
    return phase if overlap else 2 * phase


def fit(sizes, times) -> Level:
    """alpha from the smallest message, beta from the slope between the two
    largest: a least-squares line is pulled off by mid sizes that fit in a
    buffer or a shaper's burst and cross faster than the sustained rate."""
    order = np.argsort(sizes)
    n = np.asarray(sizes, dtype=float)[order]
    t = np.asarray(times, dtype=float)[order]
    beta = (t[-1] - t[-2]) / (n[-1] - n[-2])
    alpha = t[0] - n[0] * beta
    return Level(max(float(alpha), 0.0), max(float(beta), 1e-15))


def _pingpong(comm, me: int, peer: int, sizes=SIZES) -> list[float]:
    """Median one-way time per size between ranks me and peer of comm (both call it)."""
    times = []
    for size in sizes:
        buf = np.zeros(max(size // 8, 1), dtype=np.float64)
        samples = []
        for _ in range(REPEATS + 1):
            t0 = time.perf_counter()
            if me < peer:
                comm.Send(buf, dest=peer, tag=77)
                comm.Recv(buf, source=peer, tag=77)
            else:
                comm.Recv(buf, source=peer, tag=77)
                comm.Send(buf, dest=peer, tag=77)
            samples.append((time.perf_counter() - t0) / 2)
        times.append(float(np.median(samples[1:])))
    return times


def _key(nodes, hosts) -> str:
    return json.dumps([hosts, nodes.node])


def calibrate(comm, nodes) -> CostModel:
    """Collective over comm (a private Dup: our messages only). `nodes`: its NodeMap."""
    hosts = comm.allgather(MPI.Get_processor_name())
    key = _key(nodes, hosts)
    model = None
    if comm.Get_rank() == 0:
        model = _fits.get(key) or _read_cache(key, nodes.n_nodes, nodes.sizes[0])
    model = comm.bcast(model, root=0)
    if model is None:
        first = [r for r, n in enumerate(nodes.node) if n == 0]
        second = [r for r, n in enumerate(nodes.node) if n == 1]
        rank = comm.Get_rank()
        intra = inter = None
        if len(first) > 1 and rank in first[:2]:
            intra = _pingpong(comm, rank, first[1] if rank == first[0] else first[0])
        comm.Barrier()                               # the two levels measured one after the other
        if second and rank in (first[0], second[0]):
            inter = _pingpong(comm, rank, second[0] if rank == first[0] else first[0])
        gathered = comm.gather((intra, inter), root=0)
        if rank == 0:
            intra_t = next((g[0] for g in gathered if g[0]), None)
            inter_t = next((g[1] for g in gathered if g[1]), None)
            intra_l = fit(SIZES, intra_t) if intra_t else Level(0.0, 1e-15)
            inter_l = fit(SIZES, inter_t) if inter_t else intra_l
            model = CostModel(intra_l, inter_l, nodes.n_nodes, nodes.sizes[0])
            _write_cache(key, model)
        model = comm.bcast(model, root=0)
    _fits[key] = model
    return model


def _warn(message: str) -> None:
    warnings.warn(f"{ENV_CALIBRATION}: {message}", RuntimeWarning, stacklevel=3)


def _load_table(path: str):
    """The cache file's JSON object: {} when there is none yet, None (warned) when
    `path` is not a regular file and must be left alone. A regular file that is
    too large or not a JSON object is warned about and counts as empty (it is
    measured again, and rewritten)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return {}
    except OSError as e:
        _warn(f"{path} cannot be opened ({e.strerror or e}); the cost model is measured and not cached")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _warn(f"{path} is not a regular file (a FIFO, device or folder?); it is left alone, and the cost "
                  "model is measured and not cached: point the variable at a file")
            return None
        if st.st_size > CACHE_LIMIT_BYTES:
            _warn(f"{path} is {st.st_size:,} bytes, more than a calibration cache holds "
                  f"({CACHE_LIMIT_BYTES:,}); it is measured again and the file rewritten")
            return {}
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(CACHE_LIMIT_BYTES + 1)
    except OSError as e:
        _warn(f"{path} cannot be read ({e.strerror or e}); the cost model is measured again")
        return {}
    finally:
        os.close(fd)
    try:
        table = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else f"not valid JSON ({e})"
        _warn(f"{path} is {what}; it is measured again and the file rewritten")
        return {}
    if not isinstance(table, dict):
        _warn(f"{path} holds {type(table).__name__}, not a JSON object; it is measured again and the file "
              "rewritten")
        return {}
    return table


def _level(entry, name: str) -> Level:
    """A Level from the cache, or ValueError saying what is wrong with it."""
    level = entry.get(name) if isinstance(entry, dict) else None
    if not isinstance(level, dict):
        raise ValueError(f"{name} is not an object")
    values = {}
    for field in ("alpha", "beta"):
        v = level.get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}.{field} is {v!r}, not a finite number")
        values[field] = float(v)
    if values["alpha"] < 0 or values["beta"] <= 0:
        raise ValueError(f"{name} has alpha {values['alpha']!r} and beta {values['beta']!r}: a latency must be "
                         ">= 0 and a time per byte > 0")
    return Level(values["alpha"], values["beta"])


def _read_cache(key: str, n_nodes: int | None = None, per_node: int | None = None) -> CostModel | None:
    """The cached model for `key`, or None: none there, or an entry that cannot be
    right (warned about; the caller measures again)."""
    path = os.environ.get(ENV_CALIBRATION, "")
    if not path:
        return None
    table = _load_table(path)
    entry = (table or {}).get(key)
    if entry is None:
        return None
    try:
        model = CostModel(_level(entry, "intra"), _level(entry, "inter"), entry.get("nodes"), entry.get("per_node"))
        for field, expected in (("nodes", n_nodes), ("per_node", per_node)):
            value = getattr(model, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 \
                    or (expected is not None and value != expected):
                raise ValueError(f"{field} is {value!r}, not {expected if expected is not None else 'a count'}")
    except ValueError as e:
        _warn(f"the entry for these hosts in {path} is not usable ({e}); it is measured again")
        return None
    return model


def _write_cache(key: str, model: CostModel) -> None:
    path = os.environ.get(ENV_CALIBRATION, "")
    if not path:
        return
    table = _load_table(path)
    if table is None:
        return                                        # not a regular file: never replaced by ours
    table[key] = model.to_dict()
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(table, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
