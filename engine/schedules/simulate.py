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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

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


def simulate(schedule: Schedule, costs: Mapping | None = None, comm_latency: float = 0.0) -> SimResult:
    """Replay ``schedule``; never raises on a deadlock, reports it in the result.

    ``costs``: see ``resolve_costs`` (defaults F=1, B=2, I=1, W=1, rest 0).
    Bubble counts compute (F/B/I/W) only: 1 - busy / makespan per rank.
    """
    p = schedule.p
    tables = resolve_costs(costs, p)
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
    bubble = [1.0 - b / makespan if makespan > 0 else 0.0 for b in busy]
    return SimResult(
        schedule=schedule, timeline=timeline, makespan=makespan, busy=busy, bubble=bubble,
        mean_bubble=sum(bubble) / p, peak_in_flight=[schedule.micro_batches_in_flight(r) for r in range(p)],
        deadlock=deadlock, stuck=stuck, comm_latency=comm_latency)


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
