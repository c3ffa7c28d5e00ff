"""Pipeline schedules as data: the action IR and the schedule generators.

A schedule is one list of actions per pipeline rank.  It says *what* each
rank does and in which order; it never touches MPI.  The executor walks the
lists, the validator checks them, and the simulator replays them on a clock.

Virtual stages (Megatron interleaving): p ranks, v model chunks per rank,
p*v virtual stages, virtual stage ``k = chunk * p + rank``.  Every action
carries the chunk *of the rank that runs it*, so ``SEND_F(mb, c)`` on rank
p-1 is received as ``RECV_F(mb, c + 1)`` on rank 0.  The first virtual stage
reads its input from the data loader (no RECV_F); the last one's F also
computes the loss and its B/I starts from it (no RECV_B).

Communication placement (the contract the MPI executor implements):

* p == 1: every virtual stage lives on rank 0, so activations and gradients
  are passed locally and no SEND/RECV is emitted at all.
* p > 1: consecutive virtual stages are always on different ranks, so every
  stage boundary is one SEND on the producer and one RECV on the consumer.
* SEND_* directly follows the compute that produced the data, so peers are
  unblocked as soon as possible.
* RECV_* is pre-posted, double-buffered: up to two receives per direction
  (activations, gradients) are outstanding.  A rank posts its first two of
  each at the top of its list, then the next one right after the compute
  that consumed an earlier one.  So every transfer can overlap at least one
  compute, even in a burst of forwards (GPipe), at the price of two receive
  buffers per direction.
* A training step ends on each rank with REDUCE_GRAD: its gradients are
  complete there (the executor lets the data-parallel axis finish their
  all-reduce and sums the tied embedding). The optimizer step is not part of
  a schedule: it follows the global gradient norm, across every stage.
* A forward-only schedule (``forward_only``, for evaluation) holds F and its
  communication only.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

# Action kinds.  Plain strings, so the executor can dispatch on them cheaply.
F, B, I, W = "F", "B", "I", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
REDUCE_GRAD = "REDUCE_GRAD"

COMPUTE_KINDS = frozenset({F, B, I, W})
SEND_KINDS = frozenset({SEND_F, SEND_B})
RECV_KINDS = frozenset({RECV_F, RECV_B})
COMM_KINDS = SEND_KINDS | RECV_KINDS
STEP_KINDS = frozenset({REDUCE_GRAD})
ALL_KINDS = COMPUTE_KINDS | COMM_KINDS | STEP_KINDS

SHORT_NAMES = {
    F: "F", B: "B", I: "I", W: "W",
    SEND_F: "SF", RECV_F: "RF", SEND_B: "SB", RECV_B: "RB",
    REDUCE_GRAD: "RG",
}
_KIND_OF_SHORT = {short: kind for kind, short in SHORT_NAMES.items()}
_TOKEN = re.compile(r"^(SF|RF|SB|RB|F|B|I|W)(\d+)(?:\.(\d+))?$")


class ScheduleError(ValueError):
    """A schedule cannot be generated, or breaks a rule.

    ``rank``, ``index`` (position in the rank's list), ``action`` and
    ``rule`` are kept as attributes so tests and tools need not parse text.
    """

    def __init__(self, message, *, rank=None, index=None, action=None, rule=None):
        self.rank, self.index, self.action, self.rule = rank, index, action, rule
        self.detail = message
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if action is not None:
            where.append(f"action #{index} {action}" if index is not None else f"action {action}")
        text = f"[{rule}] {message}" if rule else message
        super().__init__(f"{', '.join(where)}: {text}" if where else text)


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``Action(kind, mb, chunk)``.

    ``mb`` is None only for the per-step kind REDUCE_GRAD.
    """

    kind: str
    mb: int | None = None
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in ALL_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; valid: {sorted(ALL_KINDS)}")
        if self.kind in STEP_KINDS:
            if self.mb is not None or self.chunk != 0:
                raise ValueError(f"{self.kind} is per step: it takes no micro-batch or chunk")
        elif not (isinstance(self.mb, int) and self.mb >= 0 and isinstance(self.chunk, int) and self.chunk >= 0):
            raise ValueError(f"{self.kind} needs integer mb >= 0 and chunk >= 0, "
                             f"got mb={self.mb!r} chunk={self.chunk!r}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_KINDS

    def compact(self, show_chunk: bool = False) -> str:
        short = SHORT_NAMES[self.kind]
        if self.kind in STEP_KINDS:
            return short
        text = f"{short}{self.mb}"
        return f"{text}.{self.chunk}" if show_chunk or self.chunk else text

    def __str__(self) -> str:
        return self.compact()


def parse_actions(text: str) -> list[Action]:
    """Read compact tokens (``F3 SF3 RB2.1 RG``; spaces or commas) into actions."""
    actions = []
    for token in text.replace(",", " ").split():
        if token == "RG":
            actions.append(Action(_KIND_OF_SHORT[token]))
            continue
        match = _TOKEN.match(token)
        if not match:
            raise ScheduleError(
                f"cannot parse {token!r}; expected F|B|I|W|SF|RF|SB|RB followed by the "
                "micro-batch and an optional .chunk (e.g. F3, SB2.1), or RG", rule="parse")
        short, mb, chunk = match.groups()
        actions.append(Action(_KIND_OF_SHORT[short], int(mb), int(chunk or 0)))
    return actions


@dataclass
class Schedule:
    name: str
    p: int
    m: int
    v: int
    ranks: list[list[Action]]
    training: bool = True      # False: forward only (F and its messages; no backward, no REDUCE_GRAD)

    def __str__(self) -> str:
        show_chunk = self.v > 1
        return "\n".join(
            f"rank {r}: " + " ".join(a.compact(show_chunk) for a in actions)
            for r, actions in enumerate(self.ranks))

    @property
    def splits_backward(self) -> bool:
        """Whether backward runs as I and W actions (zero-bubble): the weight
        gradients then come later than the input gradients."""
        return any(a.kind == W for actions in self.ranks for a in actions)

    # -- virtual-stage geometry -------------------------------------------------

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.p + rank

    def rank_and_chunk(self, stage: int) -> tuple[int, int]:
        return stage % self.p, stage // self.p

    def needs_remote_input(self, rank: int, action: Action) -> bool:
        """Whether this compute must wait for a message from another rank.

        F needs the previous stage's activation, B/I the next stage's output
        gradient; W only uses what I left behind on this rank.  With p == 1
        the neighbour stage is local, so nothing is remote.
        """
        if self.p == 1:
            return False
        stage = self.stage(rank, action.chunk)
        if action.kind == F:
            return stage > 0
        if action.kind in (B, I):
            return stage < self.num_stages - 1
        return False

    def sends_output(self, rank: int, action: Action) -> bool:
        """Whether a compute's result goes to another rank (then a SEND follows it)."""
        if self.p == 1:
            return False
        stage = self.stage(rank, action.chunk)
        if action.kind == F:
            return stage < self.num_stages - 1
        if action.kind in (B, I):
            return stage > 0
        return False

    def peer(self, rank: int, action: Action) -> tuple[int, int]:
        """(rank, chunk) on the other end of a SEND/RECV, in the peer's own chunk numbering."""
        stage = self.stage(rank, action.chunk)
        towards_next = action.kind in (SEND_F, RECV_B)
        return self.rank_and_chunk(stage + 1 if towards_next else stage - 1)

    def message_key(self, rank: int, action: Action) -> tuple[str, int, int]:
        """Identity of the message a SEND/RECV moves: (direction, mb, receiving stage).

        A SEND and its matching RECV have the same key, so the executor can
        derive a unique MPI tag from it.
        """
        stage = self.stage(rank, action.chunk)
        if action.kind == SEND_F:
            return ("F", action.mb, stage + 1)
        if action.kind == RECV_F:
            return ("F", action.mb, stage)
        if action.kind == SEND_B:
            return ("B", action.mb, stage - 1)
        if action.kind == RECV_B:
            return ("B", action.mb, stage)
        raise ValueError(f"{action} is not a communication action")

    # -- memory ---------------------------------------------------------------

    def micro_batches_in_flight(self, rank: int, *, until_weight_grad: bool = False) -> int:
        """Peak number of (mb, chunk) activations held on ``rank``.

        A (mb, chunk) is held from its F until its B or I.  With
        ``until_weight_grad=True`` it is held until its B or W instead: W
        still needs the stage inputs that I leaves behind, so this is the
        honest measure for zero-bubble schedules.
        """
        releases = {B, W} if until_weight_grad else {B, I}
        held, peak = set(), 0
        for action in self.ranks[rank]:
            if action.kind == F:
                held.add((action.mb, action.chunk))
                peak = max(peak, len(held))
            elif action.kind in releases:
                held.discard((action.mb, action.chunk))
        return peak

    def compute_order(self, rank: int) -> list[Action]:
        return [a for a in self.ranks[rank] if a.is_compute]


def parse_schedule(text: str, *, name: str = "custom", m: int | None = None, v: int | None = None) -> Schedule:
    """Read ``str(schedule)`` (or hand-written lines) back into a Schedule.

    Lines look like ``rank 0: F0 SF0 ...``; the ``rank N:`` prefix is optional
    (then lines are ranks in order).  Blank lines and ``#`` comments are
    skipped.  m and v default to the largest micro-batch / chunk seen + 1.
    """
    ranks: list[list[Action]] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        labelled = re.match(r"^rank\s+(\d+)\s*:(.*)$", line)
        if labelled:
            if int(labelled.group(1)) != len(ranks):
                raise ScheduleError(f"expected 'rank {len(ranks)}:' but found 'rank {labelled.group(1)}:'",
                                    rule="parse")
            line = labelled.group(2)
        ranks.append(parse_actions(line))
    if not ranks:
        raise ScheduleError("no ranks in schedule text", rule="parse")
    mbs = [a.mb for actions in ranks for a in actions if a.mb is not None]
    chunks = [a.chunk for actions in ranks for a in actions]
    return Schedule(name, len(ranks), m if m is not None else max(mbs, default=-1) + 1,
                    v if v is not None else max(chunks, default=0) + 1, ranks)


# ---------------------------------------------------------------------------
# Generators.  Each builds the per-rank *compute* order, then one shared pass
# adds communication and the per-step tail, so placement rules live in one spot.
# ---------------------------------------------------------------------------

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zbh1")


def _check_sizes(p, m, v=1):
    for label, value in (("p (pipeline ranks)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{label} must be an integer >= 1, got {value!r}", rule="sizes")


def _add_communication(p: int, m: int, v: int, name: str, orders: Sequence[Sequence[Action]],
                       receive_depth: dict[str, int] | None = None, training: bool = True) -> Schedule:
    """Wrap per-rank compute orders with SEND/RECV and (training) the per-step REDUCE_GRAD.

    ``receive_depth`` is how many receives per direction (F, B) stay posted
    ahead of the computes that consume them; each is a buffer the executor
    holds.  One per direction suffices when F and B alternate (1F1B), but in
    a burst of same-direction inputs (GPipe) the next transfer would only
    start once the previous input is consumed and every compute would wait
    out the latency; two overlap it with a compute.
    """
    depth = {F: 2, B: 2, **(receive_depth or {})}
    schedule = Schedule(name, p, m, v, [], training)
    for rank, order in enumerate(orders):
        inputs = {F: deque(), B: deque()}  # receives per direction, in consumption order
        for action in order:
            if schedule.needs_remote_input(rank, action):
                direction = F if action.kind == F else B
                inputs[direction].append(Action(RECV_F if direction == F else RECV_B, action.mb, action.chunk))

        actions: list[Action] = []
        outstanding = {F: 0, B: 0}

        def post_ahead():
            for direction in (F, B):
                while inputs[direction] and outstanding[direction] < depth[direction]:
                    actions.append(inputs[direction].popleft())
                    outstanding[direction] += 1

        post_ahead()
        for action in order:
            actions.append(action)
            if schedule.sends_output(rank, action):
                actions.append(Action(SEND_F if action.kind == F else SEND_B, action.mb, action.chunk))
            if schedule.needs_remote_input(rank, action):
                outstanding[F if action.kind == F else B] -= 1
                post_ahead()
        if training:
            actions.append(Action(REDUCE_GRAD))
        schedule.ranks.append(actions)
    return schedule


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every forward, then every backward, both in micro-batch order 0..m-1.

    Forward order for the backwards (as in PyTorch's ScheduleGPipe) frees the
    oldest activations first; reverse order would give the same bubble.
    Every rank holds all m micro-batches at the flush.
    """
    _check_sizes(p, m)
    orders = [[Action(F, mb) for mb in range(m)] + [Action(B, mb) for mb in range(m)] for _ in range(p)]
    return _add_communication(p, m, 1, "gpipe", orders)


def _warmup_then_1f1b(forward_units, backward_units, warmup) -> list[Action]:
    order = [Action(F, mb, c) for mb, c in forward_units[:warmup]]
    steady = len(forward_units) - warmup
    for (fmb, fc), (bmb, bc) in zip(forward_units[warmup:], backward_units[:steady]):
        order += [Action(F, fmb, fc), Action(B, bmb, bc)]
    order += [Action(B, mb, c) for mb, c in backward_units[steady:]]
    return order


RAGGED_CHOICES = ("pad", "merge")


def _interleaved_orders(p: int, m: int, v: int, ragged: str = "pad") -> list[list[Action]]:
    if v == 1:  # PipeDream-Flush: min(p-s-1, m) warm-up forwards
        units = [(mb, 0) for mb in range(m)]
        return [_warmup_then_1f1b(units, units, min(p - rank - 1, m)) for rank in range(p)]

    # Megatron runs groups of p micro-batches through chunk 0, then chunk 1,
    # ...  Its warm-up assumes every group is p wide: rank 0 then gets a
    # group's first activation back from rank p-1 no earlier than it needs
    # it.  A narrower last group (p does not divide m) deadlocks, so:
    #   "pad":   plan for m rounded up to a multiple of p and delete the
    #            phantom micro-batches.  Keeps Megatron's memory bound and
    #            costs some bubble.  Deleting actions only merges
    #            program-order edges, so the dependency graph stays acyclic:
    #            deadlock-free by construction.
    #   "merge": fold the short tail into the previous group, and warm up for
    #            that wider group (a narrower warm-up makes the last rank
    #            reach a B before its F).  Gives the ideal bubble
    #            (p-1)/(v*m+p-1) for every m >= p, but every rank holds
    #            (v-1)*(m % p) more activations (all of them for p < m < 2p).
    #            Deadlock-freedom here is checked, not proven: the tests
    #            validate it on a grid of p, m, v.
    if ragged not in RAGGED_CHOICES:
        raise ScheduleError(f"ragged must be one of {RAGGED_CHOICES}, got {ragged!r}", rule="sizes")
    planned_m = -(-m // p) * p if ragged == "pad" else m
    groups = [list(range(first, min(first + p, planned_m))) for first in range(0, planned_m, p)]
    if len(groups) > 1 and len(groups[-1]) < p:
        tail = groups.pop()
        groups[-1] += tail
    forward_units = [(mb, chunk) for group in groups for chunk in range(v) for mb in group]
    backward_units = [(mb, v - 1 - chunk) for mb, chunk in forward_units]
    orders = []
    for rank in range(p):
        # Warm up long enough to cover the earlier chunks of the first group
        # plus the round trip of its first micro-batch through the later ranks
        # and back (2 units per hop); afterwards one F per B keeps it steady.
        warmup = min(2 * (p - rank - 1) + (v - 1) * max(map(len, groups)), len(forward_units))
        order = _warmup_then_1f1b(forward_units, backward_units, warmup)
        orders.append([a for a in order if a.mb < m])
    return orders


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush.

    Rank s runs min(p-s-1, m) warm-up forwards, then alternates one forward
    and one backward, then drains the remaining backwards.  It never holds
    more than min(p-s, m) micro-batches.
    """
    _check_sizes(p, m)
    return _add_communication(p, m, 1, "1f1b", _interleaved_orders(p, m, 1))


def interleaved_1f1b(p: int, m: int, v: int = 2, *, ragged: str = "pad") -> Schedule:
    """Megatron interleaved 1F1B with v model chunks per rank.

    Forward units run in groups of p micro-batches through each chunk; rank
    r warms up with 2*(p-r-1) + (v-1)*G forward units (G = group width, p
    unless merged; capped at m*v), then alternates one forward and one
    backward unit, then drains.  Megatron asks for m % p == 0; any m >= 1
    works here, ``ragged`` picks how a short last group is handled: "pad"
    (default: Megatron's memory, somewhat more bubble) or "merge" (ideal
    bubble, more memory); see ``_interleaved_orders``.  v = 1 is exactly
    ``one_f_one_b``.
    """
    _check_sizes(p, m, v)
    return _add_communication(p, m, v, "interleaved", _interleaved_orders(p, m, v, ragged))


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR'24): backward split into I then a deferred W.

    F and I follow 1F1B exactly (same warm-up of min(p-s-1, m) forwards, so
    at most min(p-s, m) micro-batches wait for their I).  Rank s postpones
    its weight gradients by s micro-batches: in steady state each I is
    followed by the W of the micro-batch s positions older, and the last s
    W's fill the cool-down tail where 1F1B idles.

    Memory: W still needs the stage's saved inputs, so counted until W a
    rank holds (p-s) + s = p micro-batches at most, i.e. every rank stays
    within 1F1B's peak (p, on rank 0).  Bubble with F=I=W=1 and m >= p:
    p-1 per rank, against 3(p-1) for 1F1B with B=2.
    """
    _check_sizes(p, m)
    orders = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        order = [Action(F, mb) for mb in range(warmup)]
        deferred: deque[int] = deque()
        for mb in range(m):
            if warmup + mb < m:
                order.append(Action(F, warmup + mb))
            order.append(Action(I, mb))
            deferred.append(mb)
            if mb >= rank:
                order.append(Action(W, deferred.popleft()))
        order += [Action(W, mb) for mb in deferred]
        orders.append(order)
    return _add_communication(p, m, 1, "zbh1", orders)


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Evaluation: each (micro-batch, chunk) forward once, micro-batch by
    micro-batch, with the same communication placement as training and no
    backward. The last virtual stage's F computes the loss."""
    _check_sizes(p, m, v)
    orders = [[Action(F, mb, chunk) for mb in range(m) for chunk in range(v)] for _ in range(p)]
    return _add_communication(p, m, v, "forward", orders, training=False)


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a schedule by name: "gpipe", "1f1b", "interleaved" or "zbh1"."""
    key = name.lower().replace("-", "").replace("_", "")
    aliases = {"gpipe": "gpipe", "1f1b": "1f1b", "pipedreamflush": "1f1b",
               "interleaved": "interleaved", "interleaved1f1b": "interleaved",
               "zbh1": "zbh1", "zerobubbleh1": "zbh1"}
    if key not in aliases:
        raise ScheduleError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}", rule="name")
    canonical = aliases[key]
    if canonical != "interleaved" and v != 1:
        raise ScheduleError(f"schedule {canonical!r} has one chunk per rank (v=1); got v={v}. "
                            "Use 'interleaved' for v > 1", rule="sizes")
    if canonical == "gpipe":
        return gpipe(p, m)
    if canonical == "1f1b":
        return one_f_one_b(p, m)
    if canonical == "interleaved":
        return interleaved_1f1b(p, m, v)
    return zero_bubble_h1(p, m)


def schedule_from_compute_orders(name: str, p: int, m: int, v: int,
                                 orders: Iterable[Iterable[Action]]) -> Schedule:
    """Turn hand-written per-rank compute orders into a full schedule.

    Adds SEND/RECV and REDUCE_GRAD with the same placement rules as
    the built-in generators, for experimenting with new orders.
    """
    _check_sizes(p, m, v)
    return _add_communication(p, m, v, name, [list(o) for o in orders])
