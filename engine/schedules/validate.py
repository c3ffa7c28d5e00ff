"""Static and dynamic checks of a schedule.

``validate`` raises ScheduleError naming the rank, the action (with its
position in the rank's list) and the rule broken.  Rule names:

  shape               p/m/v sane, one list per rank
  range               mb < m, chunk < v
  no-peer             SEND/RECV across the ends of the pipeline
  local-stages        SEND/RECV with p == 1 (stages there are passed locally)
  compute-count       exactly one F and one B (or one I and one W) per (mb, chunk);
                      forward-only schedules: one F and nothing else
  order               F before B/I, I before W on a rank
  local-dependency    p == 1: stage k-1 before k forward, k+1 before k backward
  recv-before-compute a compute needing a remote input has its RECV earlier
  send-after-compute  a SEND comes after the compute producing its data
  send-recv-match     every SEND meets exactly one RECV on the peer, and back
  reduce-grad         training: one REDUCE_GRAD, last; forward-only: none
  deadlock            replay with unit costs does not finish
"""

from __future__ import annotations

from collections import defaultdict

from .schedule import (
    B, F, I, RECV_B, RECV_F, REDUCE_GRAD, SEND_B, SEND_F, W, Action, Schedule, ScheduleError,
)

UNIT_COSTS = {"F": 1, "B": 1, "I": 1, "W": 1}


def validate(schedule: Schedule, *, check_deadlock: bool = True) -> None:
    _check_shape(schedule)
    for rank in range(schedule.p):
        _check_rank(schedule, rank)
    _check_matching(schedule)
    if check_deadlock:
        from .simulate import simulate  # simulate imports schedule only; keep the cycle lazy anyway

        result = simulate(schedule, costs=UNIT_COSTS)
        if result.deadlock:
            error = ScheduleError("; ".join(f"rank {r} {why}" for r, why in sorted(result.stuck.items())),
                                  rule="deadlock")
            error.stuck = result.stuck  # rank -> what it waits for
            raise error


def _check_shape(s: Schedule) -> None:
    for label, value in (("p", s.p), ("m", s.m), ("v", s.v)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{label} must be an integer >= 1, got {value!r}", rule="shape")
    if len(s.ranks) != s.p:
        raise ScheduleError(f"schedule has {len(s.ranks)} rank lists but p = {s.p}", rule="shape")


def _check_rank(s: Schedule, rank: int) -> None:
    where = _check_actions(s, rank)
    for chunk in range(s.v):
        for mb in range(s.m):
            _check_micro_batch(s, rank, where, mb, chunk)
    _check_reduce_grad(s, rank, where)


def _failing(s: Schedule, rank: int):
    """fail(index, message, rule) and missing(message, rule) for one rank's list."""
    actions = s.ranks[rank]

    def fail(index, message, rule):
        raise ScheduleError(message, rank=rank, index=index, action=actions[index], rule=rule)

    def missing(message, rule):
        raise ScheduleError(message, rank=rank, rule=rule)
    return fail, missing


def _check_actions(s: Schedule, rank: int) -> dict:
    """Rules about single actions; returns {(kind, mb, chunk): index} (each occurs once)."""
    actions = s.ranks[rank]
    last_stage = s.num_stages - 1
    where: dict[tuple, int] = {}
    fail, _ = _failing(s, rank)

    for index, a in enumerate(actions):
        if a.mb is not None and not (a.mb < s.m and a.chunk < s.v):
            fail(index, f"micro-batch must be < m={s.m} and chunk < v={s.v}", "range")
        if a.is_send or a.is_recv:
            if s.p == 1:
                fail(index, "with p == 1 every virtual stage is on this rank and data is passed "
                            "locally, so SEND/RECV must not appear", "local-stages")
            stage = s.stage(rank, a.chunk)
            if a.kind in (SEND_F, RECV_B) and stage == last_stage:
                fail(index, "the last virtual stage has no next stage to talk to", "no-peer")
            if a.kind in (RECV_F, SEND_B) and stage == 0:
                fail(index, "the first virtual stage has no previous stage to talk to", "no-peer")
        key = (a.kind, a.mb, a.chunk)
        if key in where:
            rule = "compute-count" if a.is_compute else "send-recv-match"
            if a.kind == REDUCE_GRAD:
                rule = "reduce-grad"
            fail(index, f"{a} appears twice on this rank (first at #{where[key]})", rule)
        where[key] = index
    return where


def _check_micro_batch(s: Schedule, rank: int, where: dict, mb: int, chunk: int) -> None:
    """The computes of one (micro-batch, chunk) on this rank: counts, order, and
    the messages they need."""
    actions = s.ranks[rank]
    last_stage = s.num_stages - 1
    fail, missing = _failing(s, rank)
    show_chunk = s.v > 1
    stage = s.stage(rank, chunk)
    name = lambda kind: Action(kind, mb, chunk).compact(show_chunk)  # noqa: E731
    f_at = where.get((F, mb, chunk))
    b_at, i_at, w_at = (where.get((k, mb, chunk)) for k in (B, I, W))
    if f_at is None:
        missing(f"{name(F)} is missing (every micro-batch needs one F per chunk)", "compute-count")
    if not s.training:
        grad = next((at for at in (b_at, i_at, w_at) if at is not None), None)
        if grad is not None:
            fail(grad, "a forward-only schedule has no backward", "compute-count")
        grad_at = None
    else:
        if b_at is not None and (i_at is not None or w_at is not None):
            fail(b_at, f"mixes a full B with split I/W for mb {mb} chunk {chunk}; use one or the other",
                 "compute-count")
        if b_at is None and (i_at is None or w_at is None):
            missing(f"mb {mb} chunk {chunk} needs either one B or one I and one W "
                    f"(has {'I' if i_at is not None else 'no I'}, {'W' if w_at is not None else 'no W'})",
                    "compute-count")
        grad_at = b_at if b_at is not None else i_at
        if grad_at < f_at:
            fail(grad_at, f"backward runs before {name(F)} on this rank", "order")
        if w_at is not None and w_at < i_at:
            fail(w_at, f"weight gradient runs before {name(I)}", "order")

    if s.p == 1:
        if stage > 0 and where[(F, mb, chunk - 1)] > f_at:
            fail(f_at, f"needs the output of {Action(F, mb, chunk - 1).compact(show_chunk)}, "
                       "which comes later on this rank", "local-dependency")
        if grad_at is not None and stage < last_stage:
            up = where.get((B, mb, chunk + 1), where.get((I, mb, chunk + 1)))
            if up is not None and up > grad_at:
                fail(grad_at, f"needs the input gradient of mb {mb} chunk {chunk + 1}, "
                              "which is computed later on this rank", "local-dependency")
        return

    computes = [(f_at, RECV_F, SEND_F)] + ([(grad_at, RECV_B, SEND_B)] if grad_at is not None else [])
    for compute_at, recv_kind, send_kind in computes:
        if s.needs_remote_input(rank, actions[compute_at]):
            recv = Action(recv_kind, mb, chunk)
            recv_at = where.get((recv_kind, mb, chunk))
            peer, _ = s.peer(rank, recv)
            what = "activation" if recv_kind == RECV_F else "output gradient"
            if recv_at is None:
                fail(compute_at, f"needs the {what} from rank {peer} but no "
                                 f"{recv.compact(show_chunk)} is posted before it", "recv-before-compute")
            if recv_at > compute_at:
                fail(compute_at, f"needs the {what} from rank {peer} but its {recv.compact(show_chunk)} "
                                 f"is only posted later, at #{recv_at}", "recv-before-compute")
        send_at = where.get((send_kind, mb, chunk))
        if send_at is not None and send_at < compute_at:
            fail(send_at, f"sends data before {actions[compute_at].compact(show_chunk)} computes it",
                 "send-after-compute")


def _check_reduce_grad(s: Schedule, rank: int, where: dict) -> None:
    actions = s.ranks[rank]
    fail, missing = _failing(s, rank)
    rg_at = where.get((REDUCE_GRAD, None, 0))
    if not s.training:
        if rg_at is not None:
            fail(rg_at, "a forward-only schedule has no gradients to reduce", "reduce-grad")
        return
    last_grad = max((i for i, a in enumerate(actions) if a.kind in (B, W)), default=-1)
    if rg_at is None:
        missing("REDUCE_GRAD is missing (one per step, after the last B/W)", "reduce-grad")
    if rg_at < last_grad:
        fail(rg_at, f"all-reduces gradients before the last weight-gradient compute "
                    f"{actions[last_grad].compact(show_chunk=s.v > 1)} at #{last_grad}", "reduce-grad")
    if rg_at != len(actions) - 1:
        fail(rg_at, "REDUCE_GRAD must be the last action of the rank", "reduce-grad")


def _check_matching(s: Schedule) -> None:
    ends = defaultdict(lambda: {"send": [], "recv": []})
    for rank, actions in enumerate(s.ranks):
        for index, a in enumerate(actions):
            if a.is_send or a.is_recv:
                ends[s.message_key(rank, a)]["send" if a.is_send else "recv"].append((rank, index, a))
    show_chunk = s.v > 1
    for key, sides in ends.items():
        for side, other in (("send", "recv"), ("recv", "send")):
            if sides[side] and not sides[other]:
                rank, index, a = sides[side][0]
                peer, chunk = s.peer(rank, a)
                partner = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}[a.kind]
                raise ScheduleError(f"has no matching {Action(partner, a.mb, chunk).compact(show_chunk)} "
                                    f"on rank {peer}", rank=rank, index=index, action=a,
                                    rule="send-recv-match")
