"""Offline replay of a schedule under the executor's semantics.

Executor semantics modelled here (the MPI executor implements the same):

* Each rank runs its list in order; every action occupies the rank for its
  cost (comm and REDUCE_GRAD cost 0 by default).
* SEND_* is an Isend: it never blocks the rank.
* RECV_* is an Irecv: posting it never blocks the rank.
* A message starts moving once its SEND action has ended *and* its RECV is
  posted (rendezvous), and arrives ``comm_latency`` later.  Pre-posting receives
  therefore hides latency; a late post exposes it.
* A compute that needs a remote input (F off the first virtual stage, B/I
  off the last one) blocks until that message has arrived.  With p == 1 the
  neighbour stage is local and the compute waits for the producing compute.
* At the end of the step every outstanding send/receive must complete, so a
  SEND nobody receives (or a RECV nobody sends to) hangs the rank.

Because ranks only interact through messages, a rank's timing depends only
on message arrival times.  The replay therefore advances every rank as far
as its inputs allow, round-robin, until nothing moves: the times equal those
of a global event queue, and "nothing moves but work remains" is exactly a
deadlock.

Data-parallel communication (optional: ``simulate(schedule, zero=ZeroComm(...))``)
---------------------------------------------------------------------------------
Each pipeline rank also belongs to a data-parallel group of ``dp`` ranks that
share its chunks.  Their collectives run on the rank's *data lane*: one
collective at a time, in the order they are issued (a reduction and a gather
issued at the same instant: the gather first, it is on the critical path).
A collective over S bytes (the full, unsharded size) costs the ring's
``steps * latency + moved / bandwidth``: all-gather and reduce-scatter move
S(N-1)/N bytes in N-1 steps per rank, all-reduce twice that.  Each chunk is
split into ``units`` equal units (FSDP's unit: a block; the embedding and the
head are units too), and a compute action's cost is split evenly over them.

* ZeRO-3 gathers.  Before each unit's part of an F or a B/I (W reads only
  activations and output gradients: no gather) the unit is all-gathered:
  ``gather="use"`` before every such action of every micro-batch (dropped
  after it: 2m gathers per unit per step); ``"step"`` only at its first use
  in the step (kept to the end: one per unit); ``"auto"``: use with p == 1,
  step with a pipeline.  Prefetch depth 1: a unit's gather is issued when
  the compute of the unit before it on this rank starts (the previous action's
  last unit, across action boundaries), so it hides behind that compute if
  shorter and the lane is free; the first unit of a step is issued at 0.
  A unit whose gather is not done stalls the rank (inside an action the stall
  counts as exposed communication, not as busy time).
* Gradient reduction.  After each unit's part of a chunk's last weight-
  gradient action on this rank (its last B, or its last W when backward is
  split), that unit's bucket is reduced: all-reduce for ZeRO-0,
  reduce-scatter for ZeRO-1/2/3 (each rank updates its chunk of each bucket).  Later backwards overlap it; REDUCE_GRAD
  waits until the lane has finished every reduction.
* ZeRO-1/2 parameter all-gather.  The optimizer step follows the global
  gradient norm, so it starts when every pipeline rank has passed
  REDUCE_GRAD (optimizer time itself is not modelled); then each rank
  all-gathers its updated parameters, exposed (the next step needs them).

Bytes per rank per step, Psi = the parameter bytes of a pipeline rank's chunks,
f = (N-1)/N:  ZeRO-0 2 Psi f (all-reduce); ZeRO-1 and ZeRO-2 2 Psi f (reduce-scatter
+ gather); ZeRO-3 "step" 2 Psi f; ZeRO-3 "use" (2m+1) Psi f (3 Psi f at m = 1).
``zero_bytes_formula`` gives them; ``SimResult.comm_bytes`` counts what was
simulated.  Not modelled: contention between the data lane and the pipeline's
sends, the optimizer's compute, the global norm's own latency, and tensor
parallelism (give the bytes of one tensor-parallel shard).  With ``zero=None``
or ``dp == 1`` the replay is exactly the one without it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .schedule import (
    ALL_KINDS, B, F, I, RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, SHORT_NAMES, W, Action, Schedule,
)

DEFAULT_COSTS = {F: 1.0, B: 2.0, I: 1.0, W: 1.0,
                 SEND_F: 0.0, RECV_F: 0.0, SEND_B: 0.0, RECV_B: 0.0,
                 REDUCE_GRAD: 0.0}
_KIND_BY_NAME = {**{k: k for k in ALL_KINDS}, **{short: k for k, short in SHORT_NAMES.items()}}


def resolve_costs(costs: Mapping | None, p: int) -> list[dict[str, float]]:
    """Per-rank cost tables.

    ``costs`` maps kinds (full or compact names: "B", "SEND_F"/"SF", "RG"...)
    to times; integer keys map a rank to its own overrides, e.g.
    ``{"F": 1, "B": 2, 3: {"F": 1.5}}`` makes rank 3's forwards slower.
    """
    base = dict(DEFAULT_COSTS)
    per_rank: dict[int, Mapping] = {}
    for key, value in (costs or {}).items():
        if isinstance(key, int):
            if not 0 <= key < p:
                raise ValueError(f"cost override for rank {key}, but p = {p}")
            per_rank[key] = value
        else:
            base[_kind(key)] = _cost(key, value)
    tables = []
    for rank in range(p):
        table = dict(base)
        for key, value in per_rank.get(rank, {}).items():
            table[_kind(key)] = _cost(key, value)
        tables.append(table)
    return tables


def _kind(name) -> str:
    if name not in _KIND_BY_NAME:
        raise ValueError(f"unknown action kind {name!r} in costs; valid: {sorted(_KIND_BY_NAME)}")
    return _KIND_BY_NAME[name]


def _cost(name, value) -> float:
    value = float(value)
    if value < 0 or math.isnan(value):
        raise ValueError(f"cost of {name} must be >= 0, got {value}")
    return value


ZERO_STAGES = (0, 1, 2, 3)
GATHER_MODES = ("auto", "use", "step")
ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all-gather", "reduce-scatter", "all-reduce"


@dataclass(frozen=True)
class ZeroComm:
    """The data-parallel communication to add to a replay (see the module docstring).

    ``chunk_bytes``: parameter bytes of one chunk, the same for every chunk,
    or one list per rank with one number per chunk (e.g. a heavier first stage
    that holds the embedding).  ``bandwidth`` is in bytes per time unit of the
    costs, ``latency`` (the ring's alpha per step) in time units.
    """

    stage: int
    dp: int
    chunk_bytes: float | Sequence[Sequence[float]]
    bandwidth: float
    latency: float = 0.0
    units: int = 1
    gather: str = "auto"

    def __post_init__(self):
        if self.stage not in ZERO_STAGES:
            raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {self.stage!r}")
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp (data-parallel ranks) must be an integer >= 1, got {self.dp!r}")
        if self.stage > 0 and self.dp == 1:
            raise ValueError(f"ZeRO-{self.stage} shards over the data-parallel ranks: give dp >= 2")
        if not (self.bandwidth > 0) or math.isinf(self.bandwidth):
            raise ValueError(f"bandwidth must be a finite number > 0 (bytes per time unit), got {self.bandwidth!r}")
        if not (self.latency >= 0):
            raise ValueError(f"latency must be >= 0, got {self.latency!r}")
        if not isinstance(self.units, int) or self.units < 1:
            raise ValueError(f"units per chunk must be an integer >= 1, got {self.units!r}")
        if self.gather not in GATHER_MODES:
            raise ValueError(f"gather must be one of {GATHER_MODES}, got {self.gather!r}")

    def bytes_of(self, p: int, v: int) -> list[list[float]]:
        """Parameter bytes per [rank][chunk]."""
        if isinstance(self.chunk_bytes, (int, float)):
            table = [[float(self.chunk_bytes)] * v for _ in range(p)]
        else:
            table = [[float(b) for b in row] for row in self.chunk_bytes]
            if len(table) != p or any(len(row) != v for row in table):
                raise ValueError(f"chunk_bytes needs {p} ranks x {v} chunks, got "
                                 f"{[len(row) for row in table]} chunks per rank")
        if any(b < 0 or math.isnan(b) for row in table for b in row):
            raise ValueError("chunk_bytes must be >= 0")
        return table

    def gather_mode(self, p: int) -> str:
        """ZeRO-3's mode once "auto" is resolved: per use without a pipeline, per step with one."""
        if self.gather != "auto":
            return self.gather
        return "use" if p == 1 else "step"

    def collective(self, kind: str, nbytes: float) -> tuple[float, float]:
        """(bytes this rank moves, time) of a ring collective over ``nbytes`` (the full size)."""
        steps = (self.dp - 1) * (2 if kind == ALL_REDUCE else 1)
        moved = nbytes * steps / self.dp
        return moved, steps * self.latency + moved / self.bandwidth


def zero_bytes_formula(stage: int, psi: float, dp: int, m: int, gather: str = "step") -> tuple[float, str]:
    """Bytes a rank moves over the data axis per step, and the formula as text.

    ``psi``: the parameter bytes of the rank's chunks; ``gather``: ZeRO-3's
    resolved mode ("use" or "step").
    """
    factor, text = {0: (2, "2"), 1: (2, "2"), 2: (2, "2")}.get(stage, (None, None))
    if stage == 3:
        factor, text = (2 * m + 1, "(2m+1)") if gather == "use" else (2, "2")
    if factor is None:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    return factor * psi * (dp - 1) / dp, f"{text}Ψ(N-1)/N"


class _DataLane:
    """One rank's data-parallel collectives: one at a time, in the order issued."""

    def __init__(self, zero: ZeroComm):
        self.zero = zero
        self.free = 0.0
        self.ops: list[tuple[tuple, float, float]] = []  # (label, start, end)
        self.moved = 0.0
        self.pending: deque = deque()  # reductions issued, not yet placed: (issue, label, kind, bytes)

    def place(self, issue: float, label: tuple, kind: str, nbytes: float) -> float:
        moved, duration = self.zero.collective(kind, nbytes)
        start = max(self.free, issue)
        self.free = start + duration
        self.ops.append(((kind, *label), start, self.free))
        self.moved += moved
        return self.free

    def flush(self, before: float = math.inf) -> None:
        """Place the reductions issued before ``before`` (pending is in issue order)."""
        while self.pending and self.pending[0][0] < before:
            self.place(*self.pending.popleft())


@dataclass
class SimResult:
    schedule: Schedule
    timeline: list[list[tuple[Action, float, float]]]  # per rank: (action, start, end)
    makespan: float
    busy: list[float]          # compute time (F/B/I/W) per rank
    bubble: list[float]        # 1 - busy / makespan per rank
    mean_bubble: float
    peak_in_flight: list[int]  # per rank, (mb, chunk) held from F to B/I
    deadlock: str | None = None
    stuck: dict[int, str] = field(default_factory=dict)  # rank -> what it waits for
    comm_latency: float = 0.0
    zero: ZeroComm | None = None
    gather_mode: str | None = None  # ZeRO-3's resolved gather mode
    # per rank, with ``zero`` only: the data lane's collectives ((kind, *what), start, end) and bytes moved
    comm: list[list[tuple[tuple, float, float]]] = field(default_factory=list)
    comm_bytes: list[float] = field(default_factory=list)


def simulate(schedule: Schedule, costs: Mapping | None = None, comm_latency: float = 0.0,
             zero: ZeroComm | None = None) -> SimResult:
    """Replay ``schedule``; never raises on a deadlock, reports it in the result.

    ``costs``: see ``resolve_costs`` (defaults F=1, B=2, I=1, W=1, rest 0).
    Bubble counts compute (F/B/I/W) only: 1 - busy / makespan per rank.
    ``zero``: also replay the data-parallel communication (module docstring).
    """
    p = schedule.p
    tables = resolve_costs(costs, p)
    if zero is not None and zero.dp == 1:
        zero = None  # nothing crosses a data axis of one rank: exactly the replay without it
    data = _DataParallel(schedule, zero) if zero is not None else None
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    position = [0] * p
    clock = [0.0] * p
    sent: dict[tuple, float] = {}     # message key -> time the SEND executed
    posted: dict[tuple, float] = {}   # message key -> time the RECV was posted
    computed: dict[tuple, float] = {}  # (F | "BI" | W, mb, stage) -> end time

    def input_ready(rank: int, action: Action):
        """Earliest start the action's inputs allow, or None while one is missing."""
        if not action.is_compute:
            return 0.0
        stage = schedule.stage(rank, action.chunk)
        own = _own_prerequisite(action, stage)
        if own is not None and own not in computed:
            return None  # same rank, later in the list: it never comes
        if schedule.needs_remote_input(rank, action):
            key = schedule.message_key(rank, _receive_for(action))
            if key not in posted or key not in sent:
                return None
            return max(sent[key], posted[key]) + comm_latency
        producer = _local_producer(schedule, action, stage)
        if producer is not None:
            return computed.get(producer)
        return 0.0

    moved = True
    while moved:
        moved = False
        for rank in range(p):
            actions = schedule.ranks[rank]
            while position[rank] < len(actions):
                action = actions[position[rank]]
                ready = input_ready(rank, action)
                if ready is None:
                    break
                start = max(clock[rank], ready)
                if data is not None and action.is_compute:
                    start, end = data.compute(rank, position[rank], action, start, tables[rank][action.kind])
                elif data is not None and action.kind == REDUCE_GRAD:
                    start = max(start, data.reductions_done(rank))
                    end = start + tables[rank][action.kind]
                else:
                    end = start + tables[rank][action.kind]
                timeline[rank].append((action, start, end))
                clock[rank] = end
                position[rank] += 1
                moved = True
                if action.is_send:
                    sent.setdefault(schedule.message_key(rank, action), end)
                elif action.is_recv:
                    posted.setdefault(schedule.message_key(rank, action), end)
                elif action.is_compute:
                    computed[_done_key(action, schedule.stage(rank, action.chunk))] = end

    stuck = _diagnose(schedule, position, sent, posted, computed)
    deadlock = None
    if stuck:
        deadlock = "deadlock: " + "; ".join(f"rank {r} {why}" for r, why in sorted(stuck.items()))

    makespan = max((end for row in timeline for _, _, end in row), default=0.0)
    busy = [sum(end - start for a, start, end in row if a.is_compute) for row in timeline]
    extra = {}
    if data is not None:
        if not stuck:
            data.after_step([max((end for _, _, end in row), default=0.0) for row in timeline])
        makespan = max([makespan] + [lane.free for lane in data.lanes])
        # A stall inside an action (a unit waiting for its gather) is exposed communication, not work.
        busy = [sum(tables[r][a.kind] for a, _, _ in row if a.is_compute) for r, row in enumerate(timeline)]
        extra = dict(zero=zero, gather_mode=data.mode, comm=[lane.ops for lane in data.lanes],
                     comm_bytes=[lane.moved for lane in data.lanes])
    bubble = [1.0 - b / makespan if makespan > 0 else 0.0 for b in busy]
    return SimResult(
        schedule=schedule, timeline=timeline, makespan=makespan, busy=busy, bubble=bubble,
        mean_bubble=sum(bubble) / p, peak_in_flight=[schedule.micro_batches_in_flight(r) for r in range(p)],
        deadlock=deadlock, stuck=stuck, comm_latency=comm_latency, **extra)


class _DataParallel:
    """The data-parallel side of a replay: every rank's lane, gathers and reductions."""

    def __init__(self, schedule: Schedule, zero: ZeroComm):
        self.zero = zero
        self.training = schedule.training  # evaluation: no reductions, no update
        self.bytes = zero.bytes_of(schedule.p, schedule.v)
        self.mode = zero.gather_mode(schedule.p) if zero.stage == 3 else None
        self.lanes = [_DataLane(zero) for _ in range(schedule.p)]
        self.gathered: list[set] = [set() for _ in range(schedule.p)]  # (chunk, unit) kept, "step" mode
        self.prefetch_from = [0.0] * schedule.p  # start of the rank's latest unit of compute
        # Per rank, the index of each chunk's last weight-gradient action: its buckets reduce after it.
        last_kind = W if schedule.splits_backward else B
        self.last_backward: list[set[int]] = []
        for actions in schedule.ranks:
            last = {}
            for index, action in enumerate(actions):
                if action.kind == last_kind:
                    last[action.chunk] = index
            self.last_backward.append(set(last.values()))

    def compute(self, rank: int, index: int, action: Action, ready: float, cost: float) -> tuple[float, float]:
        """Run a compute action unit by unit from ``ready``; return (start of its first unit, end)."""
        zero, lane, k = self.zero, self.lanes[rank], self.zero.units
        unit_bytes = self.bytes[rank][action.chunk] / k
        needs_params = zero.stage == 3 and action.kind in (F, B, I)
        reduce = ALL_REDUCE if zero.stage == 0 else REDUCE_SCATTER
        units = range(k) if action.kind == F else range(k - 1, -1, -1)
        t, first = ready, None
        for unit in units:
            begin = t
            if needs_params and (self.mode == "use" or (action.chunk, unit) not in self.gathered[rank]):
                self.gathered[rank].add((action.chunk, unit))
                issue = self.prefetch_from[rank]
                lane.flush(before=issue)
                begin = max(t, lane.place(issue, (action.compact(True), unit), ALL_GATHER, unit_bytes))
            self.prefetch_from[rank] = begin
            first = begin if first is None else first
            t = begin + cost / k
            if index in self.last_backward[rank]:
                lane.pending.append((t, (action.chunk, unit), reduce, unit_bytes))
        return first, t

    def reductions_done(self, rank: int) -> float:
        lane = self.lanes[rank]
        lane.flush()
        return lane.free

    def after_step(self, rank_ends: list[float]) -> None:
        """ZeRO-1/2: after the update (which waits for the global norm), gather the parameters."""
        for lane in self.lanes:
            lane.flush()
        if self.training and self.zero.stage in (1, 2):
            update = max(rank_ends)
            for rank, lane in enumerate(self.lanes):
                lane.place(update, ("params",), ALL_GATHER, sum(self.bytes[rank]))


def _done_key(action: Action, stage: int) -> tuple:
    # B and I both deliver the input gradient, so dependants look for "BI".
    return ("BI" if action.kind in (B, I) else action.kind, action.mb, stage)


def _own_prerequisite(action: Action, stage: int) -> tuple | None:
    """The same-rank compute this one consumes: F's activations, I's leftovers."""
    if action.kind in (B, I):
        return (F, action.mb, stage)
    if action.kind == W:
        return ("BI", action.mb, stage)
    return None


def _local_producer(schedule: Schedule, action: Action, stage: int) -> tuple | None:
    """With p == 1 the neighbouring virtual stage is on this rank too."""
    if schedule.p != 1:
        return None
    if action.kind == F and stage > 0:
        return (F, action.mb, stage - 1)
    if action.kind in (B, I) and stage < schedule.num_stages - 1:
        return ("BI", action.mb, stage + 1)
    return None


def _receive_for(action: Action) -> Action:
    return Action(RECV_F if action.kind == F else RECV_B, action.mb, action.chunk)


def _diagnose(schedule: Schedule, position, sent, posted, computed) -> dict[int, str]:
    """Say what each unfinished rank waits for (empty when the step completes)."""
    stuck = {}
    for rank, actions in enumerate(schedule.ranks):
        if position[rank] < len(actions):
            action = actions[position[rank]]
            why = _waiting_for(schedule, rank, action, position, sent, posted, computed)
            stuck[rank] = f"is stuck at #{position[rank]} {action}: {why}"
    # Ranks that ran their whole list still hang in the end-of-step wait on
    # a send nobody receives or a receive nobody sends to.
    for rank, actions in enumerate(schedule.ranks):
        if rank in stuck:
            continue
        for action in actions:
            if not (action.is_send or action.is_recv):
                continue
            key = schedule.message_key(rank, action)
            peer, chunk = schedule.peer(rank, action)
            if action.is_send and key not in posted:
                partner = Action(RECV_F if action.kind == SEND_F else RECV_B, action.mb, chunk)
                stuck[rank] = (f"finished its list but its {action} is never received (rank {peer} posts no "
                               f"{partner}), so the end-of-step wait hangs")
                break
            if action.is_recv and key not in sent:
                partner = Action(SEND_F if action.kind == RECV_F else SEND_B, action.mb, chunk)
                stuck[rank] = (f"finished its list but its {action} is never matched (rank {peer} executes no "
                               f"{partner}), so the end-of-step wait hangs")
                break
    return stuck


def _waiting_for(schedule, rank, action, position, sent, posted, computed) -> str:
    stage = schedule.stage(rank, action.chunk)
    own = _own_prerequisite(action, stage)
    if own is not None and own not in computed:
        needed = f"{F}{action.mb}" if own[0] == F else f"I{action.mb}"
        return f"needs its own {needed} (chunk {action.chunk}) first, which is later in this rank's list"
    local = _local_producer(schedule, action, stage)
    if local is not None:
        return "its input comes from a neighbouring stage on this rank whose compute is later in the list"
    what = "activation" if action.kind == F else "output gradient"
    receive = _receive_for(action)
    peer, chunk = schedule.peer(rank, receive)
    key = schedule.message_key(rank, receive)
    sender = Action(SEND_F if action.kind == F else SEND_B, action.mb, chunk)
    text = f"waits for the {what} of mb {action.mb} chunk {action.chunk} from rank {peer}"
    if key not in posted:
        return text + f", but no {receive} was posted"
    if key not in sent:
        peer_actions = schedule.ranks[peer]
        if sender not in peer_actions:
            return text + f", but rank {peer} has no {sender}"
        where = ("has finished" if position[peer] >= len(peer_actions)
                 else f"is stuck at #{position[peer]} {peer_actions[position[peer]]}")
        return text + f" ({sender} not executed yet; rank {peer} {where})"
    return text


# ---------------------------------------------------------------------------
# Theory.
# ---------------------------------------------------------------------------

def bubble_formula(name: str, p: int, m: int, v: int = 1) -> tuple[float, str, bool]:
    """Expected bubble fraction idle / (idle + compute) with the default
    costs, the formula as text, and whether ``simulate`` reproduces it exactly
    for the default generator (otherwise it is a lower bound).

    Idle time per rank, in units of one micro-batch's work on one chunk:

    * gpipe, 1f1b (F=1, B=2; any uniform F, B): p-1, for every m >= 1.
      So the fraction is (p-1) / (m+p-1).
    * interleaved (F=1, B=2 per chunk): (p-1) + (v-1)*max(0, p-m), i.e.
      Megatron's (p-1)/(v*m+p-1) for m >= p.  With m < p a chunk's wave is
      shorter than the p-hop trip to the next chunk, so each of the v-1
      chunk hand-offs idles p-m more.  Exact when p | m or m <= p; for other
      m the default ragged="pad" idles more (the formula is a lower bound)
      and ragged="merge" matches it exactly.
    * zbh1 (F=I=W=1): (p-1) + max(0, p-m) passes, out of 3m passes of work;
      for m >= p that is Qi et al.'s (p-1)(F+I-W).  With m < p, rank 0 gets
      its first I back only at 2p-1 and still owes m I's and m W's, so the
      tail cannot be hidden.
    """
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)", True
    if name == "interleaved":
        idle = (p - 1) + (v - 1) * max(0, p - m)
        text = "(p-1)/(v*m+p-1)" if m >= p else "((p-1)+(v-1)(p-m)) / (v*m+(p-1)+(v-1)(p-m))"
        return idle / (idle + v * m), text, v == 1 or m <= p or m % p == 0
    if name == "zbh1":
        idle = (p - 1) + max(0, p - m)
        text = "(p-1)/(3m+p-1)" if m >= p else "(2p-m-1)/(2m+2p-1)"
        return idle / (idle + 3 * m), text, True
    raise ValueError(f"no theory for schedule {name!r}; known: gpipe, 1f1b, interleaved, zbh1")


def theoretical_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """Expected bubble fraction with the default costs; see ``bubble_formula``."""
    return bubble_formula(name, p, m, v)[0]


# ---------------------------------------------------------------------------
# Pictures.
# ---------------------------------------------------------------------------

_MB_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def ascii_timeline(result: SimResult, width: int | None = None, style: str = "kind") -> str:
    """One row per rank, one character per time unit, '.' where the rank idles.

    style "kind" prints F/B/I/W; style "mb" prints the micro-batch id
    (0-9, then a-z, then '#').  If the makespan exceeds ``width`` characters,
    each character covers makespan/width time and shows what runs at its
    middle.
    """
    if style not in ("kind", "mb"):
        raise ValueError("style must be 'kind' or 'mb'")
    span = result.makespan
    columns = max(1, math.ceil(span - 1e-9))
    if width is not None and columns > width:
        columns = width
    scale = span / columns if span > 0 else 1.0
    rows = []
    label_width = len(f"rank {len(result.timeline) - 1}")
    ruler = [" "] * columns
    for tick in range(0, columns, 10):
        for offset, ch in enumerate(str(round(tick * scale))):
            if tick + offset < columns:
                ruler[tick + offset] = ch
    rows.append(" " * (label_width + 1) + "".join(ruler).rstrip())
    for rank, row in enumerate(result.timeline):
        cells = ["."] * columns
        for action, start, end in row:
            if not action.is_compute or end <= start:
                continue
            first = max(0, math.ceil(start / scale - 0.5 - 1e-9))
            last = min(columns - 1, math.ceil(end / scale - 0.5 - 1e-9) - 1)
            for col in range(first, last + 1):
                if style == "kind":
                    cells[col] = action.kind
                else:
                    cells[col] = _MB_DIGITS[action.mb] if action.mb < len(_MB_DIGITS) else "#"
        rows.append(f"{f'rank {rank}':<{label_width}} " + "".join(cells))
    if not math.isclose(scale, 1.0):
        rows.append(f"(one character = {scale:.3g} time units)")
    return "\n".join(rows)


_COLOURS = {F: "#4c72b0", B: "#dd8452", I: "#c44e52", W: "#55a868"}


def plot_timeline(result: SimResult, path: str, title: str | None = None) -> None:
    """Draw the timeline as a Gantt chart PNG (needs matplotlib)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:  # matplotlib is an optional extra
        raise ImportError("plot_timeline needs matplotlib: pip install ringpipe[plot] "
                          "(or pip install matplotlib)") from exc
    schedule = result.schedule
    figure = Figure(figsize=(min(40, max(6, result.makespan * 0.3)), 0.6 * schedule.p + 1.5))
    axes = figure.add_subplot()
    for rank, row in enumerate(result.timeline):
        for action, start, end in row:
            if not action.is_compute or end <= start:
                continue
            shade = 1.0 - 0.45 * action.chunk / max(1, schedule.v - 1)
            axes.broken_barh([(start, end - start)], (rank - 0.4, 0.8), facecolors=_COLOURS[action.kind],
                             alpha=shade, edgecolor="black", linewidth=0.5)
            label = f"{action.mb}.{action.chunk}" if schedule.v > 1 else str(action.mb)
            axes.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=7)
    axes.set_yticks(range(schedule.p), [f"rank {r}" for r in range(schedule.p)])
    axes.invert_yaxis()
    axes.set_xlim(0, max(result.makespan, 1))
    axes.set_xlabel("time")
    used = sorted({a.kind for row in result.timeline for a, _, _ in row if a.is_compute},
                  key="FBIW".index)
    axes.legend(handles=[Patch(color=_COLOURS[k], label=k) for k in used],
                loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes.set_title(title or f"{schedule.name}  p={schedule.p} m={schedule.m} v={schedule.v}  "
                            f"makespan {result.makespan:g}  mean bubble {result.mean_bubble:.3f}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
