"""Inspect a pipeline schedule: action lists, validation, simulated timeline.

    ringpipe pipeline --schedule 1f1b -p 4 -m 8           (or python -m ringpipe.pipeline ...)
    ringpipe pipeline --schedule interleaved -p 4 -m 8 -v 2 --plot out.png
    ringpipe pipeline --schedule zbh1 -p 4 -m 8 --costs F=1,I=1,W=1
    ringpipe pipeline --schedule 1f1b -p 4 -m 8 --dp 4 --zero 3 --param-mb 100 --link-gbps 100
"""

from __future__ import annotations

import argparse
import sys

from .schedule import SCHEDULE_NAMES, ScheduleError, make_schedule
from .simulate import (
    DEFAULT_COSTS, GATHER_MODES, ZERO_STAGES, ZeroComm, ascii_timeline, bubble_formula, plot_timeline, simulate,
    zero_bytes_formula,
)
from .validate import validate


def _parse_costs(text: str) -> dict[str, float]:
    costs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected KIND=TIME, got {item!r}")
        try:
            costs[kind.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"time for {kind!r} is not a number: {value!r}") from None
    return costs


def build_parser(prog: str = "ringpipe pipeline") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Generate a pipeline schedule, print each rank's action list, validate it, "
                    "simulate it under the executor's semantics and draw the timeline.",
        epilog="Compact actions: F3 forward of micro-batch 3; B3 full backward; I3 input-grad backward; "
               "W3 weight-grad backward; SF/RF send/receive activations; SB/RB send/receive gradients; "
               "RG gradients complete (the data-parallel all-reduce finishes).  '.c' suffix = model chunk (when v > 1).  "
               f"Default costs: {', '.join(f'{k}={v:g}' for k, v in DEFAULT_COSTS.items() if v)}, "
               "everything else 0.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--schedule", "-s", default="1f1b", choices=SCHEDULE_NAMES, help="schedule to build")
    parser.add_argument("-p", type=int, default=4, help="pipeline ranks")
    parser.add_argument("-m", type=int, default=8, help="micro-batches per step")
    parser.add_argument("-v", type=int, default=1, help="model chunks per rank (interleaved only)")
    parser.add_argument("--costs", type=_parse_costs, default=None,
                        help="action times, e.g. F=1,B=2,I=1,W=1 (also SF, RF, SB, RB, RG); "
                             "unlisted kinds keep their defaults")
    parser.add_argument("--latency", type=float, default=0.0, help="time a message spends in flight")
    parser.add_argument("--width", type=int, default=120, help="max characters per timeline row")
    parser.add_argument("--no-comm", action="store_true", help="hide SEND/RECV in the action lists")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="also draw the timeline to this file (needs matplotlib)")
    data = parser.add_argument_group(
        "data-parallel communication",
        "with --dp > 1 the replay adds the data axis' collectives (ZeRO's gathers, the gradients' reduction) "
        "and reads the costs as milliseconds")
    data.add_argument("--dp", type=int, default=1, help="data-parallel ranks of each pipeline rank")
    data.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES,
                      help="0: all-reduce the gradients; 1 and 2: reduce-scatter them, then gather the "
                           "parameters after the update; 3: parameters sharded, each unit gathered before use")
    data.add_argument("--zero-gather", default="auto", choices=GATHER_MODES,
                      help="ZeRO-3: gather each unit before every F and B (use) or once a step (step); "
                           "auto: use without a pipeline (-p 1), step with one")
    data.add_argument("--param-mb", type=float, default=100.0,
                      help="MiB of parameters a pipeline rank holds (all its chunks, split evenly)")
    data.add_argument("--units", type=int, default=4,
                      help="units (blocks; the embedding and head count as units) per chunk")
    data.add_argument("--link-gbps", type=float, default=100.0, help="data-axis bandwidth per rank, Gbit/s")
    data.add_argument("--link-latency-us", type=float, default=0.0,
                      help="latency of one ring step of a collective, microseconds")
    return parser


def _zero_from_args(args, v: int) -> ZeroComm | None:
    """The data-parallel model the flags describe (time unit: ms), or None with --dp 1 and --zero 0."""
    if args.dp == 1 and args.zero == 0:
        return None
    if args.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {args.dp}")
    if args.zero > 0 and args.dp == 1:
        raise ValueError(f"--zero {args.zero} shards over the data-parallel ranks: give --dp N with N >= 2")
    if args.param_mb < 0:
        raise ValueError(f"--param-mb must be >= 0, got {args.param_mb:g}")
    if not args.link_gbps > 0:
        raise ValueError(f"--link-gbps must be > 0, got {args.link_gbps:g}")
    return ZeroComm(stage=args.zero, dp=args.dp, chunk_bytes=args.param_mb * 2**20 / v,
                    bandwidth=args.link_gbps * 1e9 / 8 / 1e3, latency=args.link_latency_us / 1e3,
                    units=args.units, gather=args.zero_gather)


def _print_data_parallel(schedule, base, result, args) -> None:
    zero = result.zero
    if args.zero_gather != "auto" and zero.stage != 3:
        print(f"note: --zero-gather {args.zero_gather} has no effect without --zero 3")
    mode = f", gathers per {result.gather_mode}" if zero.stage == 3 else ""
    print(f"\ndata parallel: ZeRO-{zero.stage} over dp {zero.dp}{mode}; {args.param_mb:g} MiB of parameters "
          f"per pipeline rank in {schedule.v} chunk(s) x {zero.units} units; {args.link_gbps:g} Gb/s, "
          f"{args.link_latency_us:g} us a ring step (costs read as ms)")
    print("\ntimeline with it, by kind:")
    print(ascii_timeline(result, width=args.width, style="kind"))
    grow = (result.makespan / base.makespan - 1) * 100 if base.makespan > 0 else 0.0
    print(f"\nstep time: {base.makespan:g} ms without the data-parallel communication, "
          f"{result.makespan:.4g} ms with it (+{grow:.1f}%)")
    lane = [sum(end - start for _, start, end in ops) for ops in result.comm]
    print("data lane busy per rank (ms): " + " ".join(f"{t:.4g}" for t in lane))
    print("bubble per rank with it: " + " ".join(f"{b:.4f}" for b in result.bubble)
          + f"  (mean {result.mean_bubble:.4f})")
    if schedule.training:
        expected, formula = zero_bytes_formula(zero.stage, args.param_mb * 2**20, zero.dp, schedule.m,
                                               result.gather_mode or "step")
        print("bytes per step per rank (MiB): " + " ".join(f"{b / 2**20:.2f}" for b in result.comm_bytes)
              + f"; formula {formula} = {expected / 2**20:.2f} (Ψ = {args.param_mb:g} MiB, N = {zero.dp}, "
                f"m = {schedule.m})")


def main(argv: list[str] | None = None, prog: str = "ringpipe pipeline") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        schedule = make_schedule(args.schedule, args.p, args.m, args.v)
        zero = _zero_from_args(args, schedule.v)
    except ValueError as error:  # ScheduleError too
        print(f"error: {error}", file=sys.stderr)
        return 2

    print(f"# {schedule.name}: p={schedule.p} m={schedule.m} v={schedule.v}")
    show_chunk = schedule.v > 1
    for rank, actions in enumerate(schedule.ranks):
        shown = [a for a in actions if not (args.no_comm and (a.is_send or a.is_recv))]
        print(f"rank {rank}: " + " ".join(a.compact(show_chunk) for a in shown))

    try:
        validate(schedule)
        print("\nvalidate: OK")
    except ScheduleError as error:
        print(f"\nvalidate: FAILED: {error}")
        return 1

    try:
        result = simulate(schedule, args.costs, comm_latency=args.latency)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\ntimeline by kind:")
    print(ascii_timeline(result, width=args.width, style="kind"))
    print("\ntimeline by micro-batch:")
    print(ascii_timeline(result, width=args.width, style="mb"))

    print(f"\nmakespan {result.makespan:g}")
    print("bubble per rank: " + " ".join(f"{b:.4f}" for b in result.bubble) + f"  (mean {result.mean_bubble:.4f})")
    value, formula, exact = bubble_formula(schedule.name, schedule.p, schedule.m, schedule.v)
    if not exact:
        note = "a lower bound here: p does not divide m"
    elif args.costs or args.latency:
        note = "derived for the default costs; yours differ"
    else:
        note = "exact for the default costs"
    print(f"theory: {formula} = {value:.4f}  ({note})")
    in_flight = [schedule.micro_batches_in_flight(r) for r in range(schedule.p)]
    print("peak micro-batches in flight (F done, B/I pending): " + " ".join(map(str, in_flight)))
    if schedule.name == "zbh1":
        until_w = [schedule.micro_batches_in_flight(r, until_weight_grad=True) for r in range(schedule.p)]
        print("peak micro-batches held until W: " + " ".join(map(str, until_w)))

    try:
        with_data = simulate(schedule, args.costs, comm_latency=args.latency, zero=zero) if zero else None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if with_data is not None and with_data.zero is not None:
        _print_data_parallel(schedule, result, with_data, args)

    if args.plot:
        try:
            plot_timeline(result, args.plot)
        except ImportError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
