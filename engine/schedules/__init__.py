"""Pipeline schedules as data: IR, generators, validator, offline simulator.

    from ringpipe.engine.schedules import make_schedule, validate, simulate, ascii_timeline
    s = make_schedule("1f1b", p=4, m=8)
    validate(s)
    print(ascii_timeline(simulate(s)))

No MPI here; the executor (engine/parallel/pipeline/executor.py) consumes ``Schedule.ranks``.
Import rule (tests/test_architecture.py): the standard library only (matplotlib, for
plot_timeline alone, is optional and imported there), so the `ringpipe pipeline` tool
runs anywhere.
"""

from .schedule import (
    ALL_KINDS, B, COMM_KINDS, COMPUTE_KINDS, F, I, RECV_B, RECV_F, RECV_KINDS, REDUCE_GRAD,
    SCHEDULE_NAMES, SEND_B, SEND_F, SEND_KINDS, STEP_KINDS, W, Action, Schedule, ScheduleError, forward_only, gpipe,
    interleaved_1f1b, make_schedule, one_f_one_b, parse_actions, parse_schedule, schedule_from_compute_orders,
    zero_bubble_h1,
)
from .simulate import (
    DEFAULT_COSTS, GATHER_MODES, ZERO_STAGES, SimResult, ZeroComm, ascii_timeline, bubble_formula, plot_timeline,
    resolve_costs, simulate, theoretical_bubble, zero_bytes_formula,
)
from .validate import validate

__all__ = [
    "ALL_KINDS", "B", "COMM_KINDS", "COMPUTE_KINDS", "F", "I", "RECV_B", "RECV_F", "RECV_KINDS",
    "REDUCE_GRAD", "SCHEDULE_NAMES", "SEND_B", "SEND_F", "SEND_KINDS", "STEP_KINDS", "W", "Action", "Schedule",
    "ScheduleError", "forward_only", "gpipe", "interleaved_1f1b", "make_schedule", "one_f_one_b", "parse_actions",
    "parse_schedule", "schedule_from_compute_orders", "zero_bubble_h1",
    "DEFAULT_COSTS", "GATHER_MODES", "ZERO_STAGES", "SimResult", "ZeroComm", "ascii_timeline", "bubble_formula",
    "plot_timeline", "resolve_costs", "simulate", "theoretical_bubble", "zero_bytes_formula", "validate",
]
