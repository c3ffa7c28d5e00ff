"""The environment variables comm reads, parsed and checked in one place.

    RINGPIPE_COMM_CHECK           first (default) | always | off: when the ranks compare a
                                  layout before a collective (comm/context.py)
    RINGPIPE_ALLREDUCE_CROSSOVER  bytes at or below which algorithm="auto" takes the
                                  small-message path (default 32K); 0 to 1G
    RINGPIPE_RING_SUBCHUNK        bytes per ring message (default 1M); 4K to 1G
    RINGPIPE_CUDA_AWARE_MPI       1 | 0 | auto (default): how device buffers reach MPI
                                  (comm/device.py)

Sizes are whole numbers of bytes, or with a binary suffix: 32K = 32768, 1M, 1G.
An empty value counts as unset.

Nothing is read at import, so `import comm` never fails. The first collective
parses the variables (or check_settings(), which a program calls to have a bad
value refused before any work) and refuses a bad one with a ValueError naming
the variable, the value and what to set instead. Every rank must run with the
same settings (they decide which messages are sent); creating a communicator's
private context compares them across its ranks (agree()).
"""

from __future__ import annotations

import dataclasses
import os
import re

__all__ = ["ENV_CHECK", "ENV_CROSSOVER", "ENV_SUBCHUNK", "ENV_CUDA_AWARE", "CHECK_MODES",
           "DEFAULT_CROSSOVER", "DEFAULT_SUBCHUNK", "Settings", "parse", "cuda_aware_choice",
           "current", "agree", "check_settings"]

ENV_CHECK = "RINGPIPE_COMM_CHECK"
ENV_CROSSOVER = "RINGPIPE_ALLREDUCE_CROSSOVER"
ENV_SUBCHUNK = "RINGPIPE_RING_SUBCHUNK"
ENV_CUDA_AWARE = "RINGPIPE_CUDA_AWARE_MPI"

CHECK_MODES = ("first", "always", "off")

# Messages of at most this many bytes go to the latency-optimal path under
# algorithm="auto". Measured with benchmarks/allreduce.py on the 2-core dev
# box with the machine otherwise idle (MPICH 5 shared memory, float32, 2
# ranks, 2026-11-30): recursive doubling wins below 16 KiB, the ring wins from
# 32 KiB on (2x faster at 256 KiB-2 MiB, where the small path's full-buffer
# exchanges pay twice the copies). Runs taken while the machine was loaded put
# the switch at 4 MiB: measure on a quiet machine. With many ranks on a real
# network the ring's bandwidth advantage grows (log2(p)·n vs 2(p-1)/p·n bytes
# sent): rerun the benchmark there and set RINGPIPE_ALLREDUCE_CROSSOVER to the
# crossover it reports.
DEFAULT_CROSSOVER = 32 * 1024
# Sub-chunk size for the pipelined ring. Each extra message costs a
# rendezvous round trip; on the dev box 1 and 2 MiB tie, 512 KiB loses a few
# %, 256 KiB up to 2x (2 ranks, 1-64 MiB buffers).
DEFAULT_SUBCHUNK = 1024 * 1024
# The ranges a value must fall in. A sub-chunk is one message per ring step, and
# each costs a message latency (alpha: microseconds in shared memory, more over a
# network) while 4 KiB cross in well under one at any bandwidth: below a page,
# smaller sub-chunks only multiply latency (RINGPIPE_RING_SUBCHUNK=1 made steps
# 200x slower, one message per byte). Above 1 GiB nothing changes any more (a
# sub-chunk as large as a whole bucket already sends one message per ring
# chunk) except byte counts nearing MPI's int limit of 2^31 - 1. The crossover
# has the same ceiling: a crossover of more than 1 GiB would send whole gradient
# buckets through the small-message path, whose log2(p) full-buffer exchanges
# cost many times the ring's at those sizes (pass algorithm= to force a path).
SUBCHUNK_RANGE = (4 << 10, 1 << 30)
CROSSOVER_RANGE = (0, 1 << 30)

# Bump when the messages of a collective or their tags change: ranks running
# different ringpipe code then refuse each other when a context is created,
# instead of misreading each other's tags.
WIRE_VERSION = 1


@dataclasses.dataclass
class Settings:
    check: str          # one of CHECK_MODES
    crossover: int      # bytes; comm.set_crossover() changes it
    subchunk: int       # bytes; comm.ring.set_subchunk_bytes() changes it


_SIZE = re.compile(r"(\d+)\s*([KMG]?)", re.IGNORECASE)
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _spelled(nbytes: int) -> str:
    """1073741824 -> '1073741824 (1G)': the bytes and the suffix form a user would write."""
    for suffix in ("G", "M", "K"):
        if nbytes and nbytes % _SUFFIX[suffix] == 0:
            return f"{nbytes} ({nbytes // _SUFFIX[suffix]}{suffix})"
    return str(nbytes)


def _size(environ, name: str, default: int, allowed: tuple, meaning: str) -> int:
    raw = environ.get(name, "")
    if not raw.strip():
        return default
    m = _SIZE.fullmatch(raw.strip())
    value = int(m.group(1)) * _SUFFIX[m.group(2).upper()] if m else None
    low, high = allowed
    if value is None or not low <= value <= high:
        raise ValueError(
            f"{name}={raw!r} is not a size in bytes of at least {_spelled(low)} and at most {_spelled(high)} "
            f"({meaning}): set it to a whole number of bytes in that range, optionally with a binary suffix "
            f"K, M or G (32K = 32768), or unset it for the default {_spelled(default)}")
    return value


def _check_mode(environ) -> str:
    raw = environ.get(ENV_CHECK, "")
    mode = raw.strip().lower() or "first"
    if mode not in CHECK_MODES:
        raise ValueError(
            f"{ENV_CHECK}={raw!r}: use first (the default: the ranks compare each layout on its first "
            f"use per communicator), always (they compare on every call: one small extra Allgather "
            f"each) or off (no comparison; the layout fingerprints in the message tags stay)")
    return mode


def cuda_aware_choice(raw: str) -> bool | None:
    """RINGPIPE_CUDA_AWARE_MPI's value: True (MPI takes device buffers), False
    (stage them through host memory) or None (auto: ask the MPI library)."""
    value = raw.strip().lower()
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off"):
        return False
    if value in ("", "auto"):
        return None
    raise ValueError(f"{ENV_CUDA_AWARE}={value!r}: use 1 (MPI takes GPU buffers), "
                     "0 (stage through pinned host memory) or auto (ask the MPI library)")


def parse(environ=None) -> Settings:
    """The settings in `environ` (default os.environ). Raises a ValueError
    that names every bad variable, its value and what to set instead."""
    environ = os.environ if environ is None else environ
    found, errors = {}, []
    for key, read in (
            ("check", lambda: _check_mode(environ)),
            ("crossover", lambda: _size(environ, ENV_CROSSOVER, DEFAULT_CROSSOVER, CROSSOVER_RANGE,
                                        'algorithm="auto" takes the small-message path at or below it')),
            ("subchunk", lambda: _size(environ, ENV_SUBCHUNK, DEFAULT_SUBCHUNK, SUBCHUNK_RANGE,
                                       "the size of one ring message: smaller ones only add message latency")),
            ("cuda_aware", lambda: cuda_aware_choice(environ.get(ENV_CUDA_AWARE, "auto")))):
        try:
            found[key] = read()
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ValueError("\n".join(errors))
    # RINGPIPE_CUDA_AWARE_MPI is only validated here; comm/device.py decides with it.
    return Settings(found["check"], found["crossover"], found["subchunk"])


_current: Settings | None = None


def current() -> Settings:
    """The settings this process runs with: parsed from the environment on the
    first call, then kept (set_crossover and set_subchunk_bytes change them).
    A bad value raises on every call, until the environment is fixed."""
    global _current
    if _current is None:
        _current = parse()
    return _current


def _reset() -> None:
    """Forget the parsed settings (tests change the environment)."""
    global _current
    _current = None


# -- the same settings on every rank -----------------------------------------------

# (field of agree()'s record, what the user changes to fix a difference)
_FIELDS = (
    ("check", ENV_CHECK),
    ("crossover", f"{ENV_CROSSOVER} (or comm.set_crossover())"),
    ("subchunk", f"{ENV_SUBCHUNK} (or comm.ring.set_subchunk_bytes())"),
    ("tag_bits", "the MPI library's tag range (MPI_TAG_UB; the ranks run different MPI libraries?)"),
    ("wire", "ringpipe's message format version (the ranks run different ringpipe versions)"),
)


def _ranks(ranks: list) -> str:
    """[0, 2, 3, 4, 7] -> 'ranks 0, 2-4, 7'."""
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _by_value(values: list) -> str:
    """Each distinct value once, with the ranks that hold it."""
    groups: dict = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return "; ".join(f"{v!r} on {_ranks(rs)}" for v, rs in groups.items())


def agree(comm, tag_bits: int, extra=None):
    """This process's settings, once every rank of `comm` is known to run with
    the same ones. Collective (one small allgather, where a private context is
    created; not a hot path): settings that differ between ranks would make
    them send different messages and hang, so instead every rank raises the
    same error, naming each rank's values and the variable to fix. A bad value
    on any rank raises a ValueError on every rank; a difference a RuntimeError.
    `extra`: anything else the ranks should exchange in the same allgather;
    given, the result is (settings, [every rank's extra])."""
    try:
        mine, error = current(), None
    except ValueError as e:
        mine, error = None, str(e)
    if comm.Get_size() == 1:
        if error is not None:
            raise ValueError(error)
        return mine if extra is None else (mine, [extra])
    record = {"error": error, "tag_bits": tag_bits, "wire": WIRE_VERSION, "extra": extra}
    if mine is not None:
        record.update(dataclasses.asdict(mine))
    table = comm.allgather(record)
    errors = [rec["error"] for rec in table]
    if any(errors):
        if all(e == errors[0] for e in errors):
            raise ValueError(errors[0])
        bad = [(r, e) for r, e in enumerate(errors) if e]
        raise ValueError(
            f"ringpipe: bad comm settings on {_ranks([r for r, _ in bad])} of the {len(table)} ranks "
            f"(every rank needs valid, equal settings):\n"
            + "\n".join(f"  rank {r}: {e}" for r, e in bad))
    lines = []
    for field, variable in _FIELDS:
        values = [rec[field] for rec in table]
        if any(v != values[0] for v in values):
            lines.append(f"  {variable}: {_by_value(values)}")
    if lines:
        raise RuntimeError(
            f"ringpipe: the {len(table)} ranks of this communicator run with different comm settings, "
            "which would make them send different messages and hang. Give every rank the same "
            "values (in an MPMD launch `mpiexec ... : ...`, set the variables for all blocks "
            "alike, or for none):\n" + "\n".join(lines))
    return mine if extra is None else (mine, [rec["extra"] for rec in table])


def check_settings(comm=None) -> Settings:
    """Parse the RINGPIPE_* variables now and return the settings; a bad value
    raises a ValueError naming it. Call it early (a trainer, before any work)
    to have a mistake refused at once. With `comm`, also compare the settings
    across its ranks (collective), raising the same error on every rank if
    they differ."""
    if comm is None:
        return current()
    from .fingerprint import tag_bits

    return agree(comm, tag_bits(comm))
