"""Layout fingerprints in the message tags, comm settings and their checks (comm/fingerprint.py,
comm/settings.py), and GradBuckets' first bucket.

    python -m pytest tests/comm/test_comm_fingerprint.py                                  # serial part
    mpiexec -n 2 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/comm/test_comm_fingerprint.py   # and -n 4

A layout mismatch after first use skips the first-use Allgather check, so
these tests use each layout once on every rank before mixing them. MPI tests
collect each rank's problems and agree on them before asserting (see
tests/comm/test_comm.py).
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe import comm
from ringpipe.comm import settings
from ringpipe.comm.buckets import _make_buckets
from ringpipe.comm.ring import set_subchunk_bytes
from tests.comm.test_comm import ROOT, SCRIPTS, _clean_env, _model, agree, close, data, mpi_reference

WORLD = MPI.COMM_WORLD
P, RANK = WORLD.Get_size(), WORLD.Get_rank()
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
serial_only = pytest.mark.skipif(P > 1, reason="launches its own mpiexec; run serially")


# ---------------------------------------------------------------------------
# MPI: layouts of the same message structure swapped after first use


def _call(kind, c):
    """The collective `kind` on communicator c, as fn(buf)."""
    if kind == "reduce_scatter":
        return lambda b: comm.reduce_scatter(b, c)
    if kind == "allgather":
        return lambda b: comm.allgather(b, c)
    algorithm = kind.split("-")[1]
    return lambda b: comm.allreduce(b, c, algorithm=algorithm)


def _swapped(kind, n, what):
    """(layout of the even ranks, layout of the odd ranks) as (shape, dtype, op)."""
    if what == "dtype":                  # same byte size: the messages line up exactly
        return ((n,), np.float32, "sum"), ((n,), np.int32, "sum")
    if what == "shape":
        return ((n,), np.float32, "sum"), ((n, 1), np.float32, "sum")
    return ((n,), np.float32, "sum"), ((n,), np.float32, "max")


def _run_layout(kind, c, layout):
    shape, dtype, op = layout
    buf = np.ones(shape, dtype)
    if kind.startswith("allreduce"):
        comm.allreduce(buf, c, op=op, algorithm=kind.split("-")[1])
    elif kind == "reduce_scatter":
        comm.reduce_scatter(buf, c, op=op)
    else:
        comm.allgather(buf, c)


CASES = [("allreduce-ring", 3), ("allreduce-ring", 5000), ("allreduce-ring", 100_002),
         ("allreduce-small", 14), ("allreduce-auto", 5000), ("reduce_scatter", 5000),
         ("allgather", 5000)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["dtype", "shape", "op"])
@pytest.mark.parametrize("kind,n", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_layouts_swapped_after_first_use_raise_the_same_error_everywhere(kind, n, what):
    if kind == "allgather" and what == "op":
        pytest.skip("allgather has no op")
    # Ranks 0, 2, ... pass one layout and 1, 3, ... the other: the fingerprints
    # of both differ only in semantics, so the calls run to their end
    # poisoned and every rank raises the same error.
    even, odd = _swapped(kind, n, what)
    c = WORLD.Dup()
    problems = []
    try:
        set_subchunk_bytes(4096)          # many pipelined messages per ring chunk
        for layout in (even, odd):        # first use of both on every rank: checked, agreed
            _run_layout(kind, c, layout)
        t = time.perf_counter()
        try:
            _run_layout(kind, c, odd if RANK % 2 else even)
            message = None
            problems.append("the mismatched call returned")
        except RuntimeError as e:
            message = str(e)
        if time.perf_counter() - t > 10:
            problems.append("took over 10 s")
        everyone = WORLD.allgather(message)
        if len(set(everyone)) != 1:
            problems.append(f"the ranks raised different errors: {everyone}")
        elif message is not None:
            for part in ["inconsistent", "layout", "rank 0:", "rank 1:", "garbage"]:
                if part not in message:
                    problems.append(f"{part!r} not in the error: {message}")
        # The messages lined up, so nothing is left in flight: the communicator still works.
        x = np.full(5, RANK + 1.0)
        comm.allreduce(x, c, algorithm="ring")
        if not np.all(x == P * (P + 1) / 2):
            problems.append(f"the next call gave {x}")
    finally:
        set_subchunk_bytes(settings.DEFAULT_SUBCHUNK)
        c.Free()
    agree(problems)


@pytest.mark.mpi(min_size=2)
def test_the_reported_case_float_int_after_first_use():
    # As reproduced: float32[5000] and int32[5000] each ran once on both ranks;
    # then rank 0 passed the float array and the others the int array, and
    # the call "succeeded" with different bytes on every rank.
    c = WORLD.Dup()
    try:
        f, i = np.full(5000, 1.5, np.float32), np.full(5000, 7, np.int32)
        comm.allreduce(f.copy(), c)
        comm.allreduce(i.copy(), c)
        try:
            comm.allreduce(f.copy() if RANK == 0 else i.copy(), c)
            message = "returned"
        except RuntimeError as e:
            message = str(e)
        everyone = WORLD.allgather(message)
    finally:
        c.Free()
    assert len(set(everyone)) == 1 and "inconsistent allreduce layout" in everyone[0], everyone


@pytest.mark.mpi(min_size=2)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_grad_buckets_reductions_carry_fingerprints(overlap):
    # A GradBuckets whose ranks disagree about a bucket (simulated: rank 1's
    # fingerprint of bucket 0 is off) must fail the step on every rank alike,
    # also from the progress thread.
    ranges, n = _model()
    g = np.zeros(n, np.float32)
    with comm.GradBuckets(g, ranges, WORLD, bucket_bytes=64 * 1024, overlap=overlap) as gb:
        if RANK == 1:
            gb._semantics[0] ^= 1
        for i in reversed(range(len(ranges))):
            gb.mark_ready(i)
        try:
            gb.wait()
            message = "returned"
        except RuntimeError as e:
            message = f"{e}: {e.__cause__}" if overlap else str(e)
        everyone = WORLD.allgather(message)
    assert len(set(everyone)) == 1, everyone
    assert "layout fingerprints in GradBuckets bucket all-reduce differed" in everyone[0], everyone[0]


# ---------------------------------------------------------------------------
# Whole jobs: mismatches of the message structure end the job; settings that
# differ between ranks raise the same error everywhere.


def _launch(args, timeout=60, env=None):
    t = time.perf_counter()
    out = subprocess.run([MPIEXEC, *args], env=env or _clean_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    return out, time.perf_counter() - t


STRUCTURE_CASES = ["ring-dtype-size", "ring-length", "small-dtype-size", "small-length",
                   "reduce_scatter-length", "allgather-dtype-size", "reduce_scatter-few-elements",
                   "allgather-few-elements", "subchunk", "crossover", "rs-vs-ag"]


@serial_only
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", STRUCTURE_CASES)
def test_structure_mismatch_after_first_use_ends_the_job(case, n):
    out, dt = _launch(["-n", str(n), sys.executable, os.path.join(SCRIPTS, "structure_mismatch.py"), case])
    assert out.returncode != 0, out.stdout[-2000:]
    assert dt < 30, f"job took {dt:.1f}s to die"
    assert "RuntimeError: ringpipe: layout mismatch: rank " in out.stderr, out.stderr[-3000:]
    assert "(length, dtype size, algorithm, collective or ring sub-chunk size)" in out.stderr
    if not case.endswith("few-elements"):
        # There a rank that has nothing to receive returns its (correct)
        # result while the others fail.
        assert "unreachable" not in out.stdout


def _per_rank(stdout):
    """{rank: error or None} from comm_settings.py's JSON lines (the launcher may glue lines together)."""
    decoder, found, i = json.JSONDecoder(), {}, 0
    while (i := stdout.find('{"rank"', i)) >= 0:
        obj, i = decoder.raw_decode(stdout, i)
        found[obj["rank"]] = obj["error"]
    return found


def _mpmd(env_of_second, what="allreduce", n_first=1):
    script = [sys.executable, os.path.join(SCRIPTS, "comm_settings.py"), what]
    env_args = [a for name, value in env_of_second.items() for a in ("-env", name, value)]
    return _launch(["-n", str(n_first), *script, ":", "-n", "1", *env_args, *script])


@serial_only
@pytest.mark.parametrize("variable,value,shown", [
    ("RINGPIPE_COMM_CHECK", "off", "RINGPIPE_COMM_CHECK: 'first' on rank 0; 'off' on rank 1"),
    ("RINGPIPE_COMM_CHECK", "always", "RINGPIPE_COMM_CHECK: 'first' on rank 0; 'always' on rank 1"),
    ("RINGPIPE_ALLREDUCE_CROSSOVER", "4096", "32768 on rank 0; 4096 on rank 1"),
    ("RINGPIPE_RING_SUBCHUNK", "64K", "1048576 on rank 0; 65536 on rank 1"),
])
@pytest.mark.parametrize("what", ["allreduce", "buckets"])
def test_settings_that_differ_between_ranks_raise_everywhere(variable, value, shown, what):
    # Before the fix, RINGPIPE_COMM_CHECK=off on one rank of an MPMD launch hung:
    # that rank skipped the first-use Allgather the others made.
    out, dt = _mpmd({variable: value}, what)
    assert out.returncode != 0
    assert dt < 60
    errors = _per_rank(out.stdout)
    assert sorted(errors) == [0, 1], out.stdout + out.stderr[-2000:]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("RuntimeError: ringpipe: the 2 ranks of this communicator run with "
                                "different comm settings"), errors[0]
    assert variable in errors[0] and shown in errors[0], errors[0]


@serial_only
def test_settings_differences_are_listed_by_rank_groups():
    out, dt = _mpmd({"RINGPIPE_COMM_CHECK": "off"}, n_first=3)
    assert out.returncode != 0 and dt < 60
    errors = _per_rank(out.stdout)
    assert sorted(errors) == [0, 1, 2, 3] and len(set(errors.values())) == 1, out.stdout
    assert "RINGPIPE_COMM_CHECK: 'first' on ranks 0-2; 'off' on rank 3" in errors[0]


@serial_only
def test_a_bad_value_on_one_rank_raises_everywhere():
    out, dt = _mpmd({"RINGPIPE_RING_SUBCHUNK": "abc"})
    assert out.returncode != 0 and dt < 60
    errors = _per_rank(out.stdout)
    assert sorted(errors) == [0, 1] and errors[0] == errors[1], errors
    assert errors[0].startswith("ValueError: ringpipe: bad comm settings on rank 1 of the 2 ranks")
    assert "RINGPIPE_RING_SUBCHUNK='abc'" in errors[0]


@serial_only
@pytest.mark.parametrize("mode", ["off", "first", "always"])
def test_every_mode_catches_a_first_use_swap(mode):
    # "off" skips the layout check, but the fingerprints stay.
    out, dt = _launch(["-n", "2", "-env", "RINGPIPE_COMM_CHECK", mode, sys.executable,
                       os.path.join(SCRIPTS, "comm_settings.py"), "swap"])
    assert out.returncode != 0 and dt < 60
    errors = _per_rank(out.stdout)
    assert sorted(errors) == [0, 1] and errors[0] == errors[1], out.stdout + out.stderr[-2000:]
    assert "inconsistent allreduce layout" in errors[0]
    assert ("garbage" in errors[0]) == (mode == "off")     # only "off" let the call run


@serial_only
def test_swapped_layouts_with_three_ranks():
    # 3 ranks: the small path folds a rank out and the ring has an odd size;
    # the same MPI tests must pass there too.
    out, dt = _launch(["-n", "3", sys.executable, os.path.join(ROOT, "tests", "support", "mpi_pytest.py"), "-q",
                       "-m", "mpi", "--with-mpi", "-k", "swapped or reported",
                       os.path.join(ROOT, "tests", "comm", "test_comm_fingerprint.py")], timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert dt < 240
    assert " passed" in out.stdout


# ---------------------------------------------------------------------------
# Serial: parsing the settings


@pytest.mark.parametrize("environ,expect", [
    ({}, ("first", 32768, 1 << 20)),
    ({"RINGPIPE_COMM_CHECK": " Always "}, ("always", 32768, 1 << 20)),
    ({"RINGPIPE_COMM_CHECK": ""}, ("first", 32768, 1 << 20)),
    ({"RINGPIPE_ALLREDUCE_CROSSOVER": "0", "RINGPIPE_RING_SUBCHUNK": "4K"}, ("first", 0, 4096)),
    ({"RINGPIPE_ALLREDUCE_CROSSOVER": "64k", "RINGPIPE_RING_SUBCHUNK": "2M"}, ("first", 65536, 2 << 20)),
    ({"RINGPIPE_ALLREDUCE_CROSSOVER": "4096", "RINGPIPE_CUDA_AWARE_MPI": "0"}, ("first", 4096, 1 << 20)),
])
def test_settings_parse(environ, expect):
    s = settings.parse(environ)
    assert (s.check, s.crossover, s.subchunk) == expect


@pytest.mark.parametrize("environ,text", [
    ({"RINGPIPE_ALLREDUCE_CROSSOVER": "abc"},
     r"RINGPIPE_ALLREDUCE_CROSSOVER='abc' is not a size in bytes of at least 0"),
    ({"RINGPIPE_ALLREDUCE_CROSSOVER": "-1"}, r"RINGPIPE_ALLREDUCE_CROSSOVER='-1'"),
    ({"RINGPIPE_RING_SUBCHUNK": "abc"}, r"RINGPIPE_RING_SUBCHUNK='abc' is not a size in bytes of at least 4096 \(4K\)"),
    ({"RINGPIPE_RING_SUBCHUNK": "0"}, r"RINGPIPE_RING_SUBCHUNK='0' is not a size in bytes of at least 4096 \(4K\)"),
    ({"RINGPIPE_RING_SUBCHUNK": "1"}, r"RINGPIPE_RING_SUBCHUNK='1'.*at most 1073741824 \(1G\)"),
    ({"RINGPIPE_RING_SUBCHUNK": "1.5M"}, r"RINGPIPE_RING_SUBCHUNK='1.5M'.*suffix K, M or G"),
    ({"RINGPIPE_COMM_CHECK": "sometimes"}, r"RINGPIPE_COMM_CHECK='sometimes': use first .*always .*off"),
    ({"RINGPIPE_CUDA_AWARE_MPI": "maybe"}, r"RINGPIPE_CUDA_AWARE_MPI='maybe': use 1 .*0 .*auto"),
    ({"RINGPIPE_COMM_CHECK": "x", "RINGPIPE_RING_SUBCHUNK": "y"},   # all bad values at once
     r"(?s)RINGPIPE_COMM_CHECK='x'.*\n.*RINGPIPE_RING_SUBCHUNK='y'"),
])
def test_settings_parse_refuses_bad_values(environ, text):
    with pytest.raises(ValueError, match=text):
        settings.parse(environ)


@serial_only
@pytest.mark.parametrize("variable,value", [
    ("RINGPIPE_ALLREDUCE_CROSSOVER", "abc"), ("RINGPIPE_RING_SUBCHUNK", "abc"),
    ("RINGPIPE_RING_SUBCHUNK", "0"), ("RINGPIPE_COMM_CHECK", "sometimes"),
])
def test_a_bad_value_is_refused_at_first_use_not_at_import(variable, value):
    # Before the fix the sizes crashed `import comm` with int()'s ValueError,
    # and RINGPIPE_COMM_CHECK=sometimes silently meant "first".
    code = """if True:
        import numpy as np
        from ringpipe import comm                               # must not fail
        from mpi4py import MPI
        for name, call in [("check_settings", comm.check_settings),
                           ("allreduce", lambda: comm.allreduce(np.ones(3), MPI.COMM_SELF)),
                           ("allreduce auto", lambda: comm.allreduce(np.ones(3), MPI.COMM_SELF, algorithm="auto")),
                           ("get_crossover", comm.get_crossover)]:
            try:
                call()
                print(name, "accepted")
            except ValueError as e:
                print(name, "refused:", str(e).splitlines()[0])
    """
    env = dict(_clean_env(), **{variable: value})
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 4, out.stdout
    for line in lines:
        assert f"refused: {variable}={value!r}" in line, line


def test_check_settings_returns_the_settings():
    s = comm.check_settings()
    assert s.crossover == comm.get_crossover() and s.check in settings.CHECK_MODES


# ---------------------------------------------------------------------------
# GradBuckets: first_bucket_bytes


def test_first_bucket_bytes_caps_the_first_bucket_only():
    sizes = [100, 100, 100, 100, 100, 100]          # float32: 400 bytes each
    ranges, lo = [], 0
    for s in sizes:
        ranges.append((lo, lo + s))
        lo += s
    # Plain: greedy 1200-byte buckets from the model's end.
    assert [(b[2], b[3]) for b in _make_buckets(ranges, 4, 1200)] == [(3, 5), (0, 2)]
    # First bucket capped at 400 bytes (one param), the rest at 1200.
    assert [(b[2], b[3]) for b in _make_buckets(ranges, 4, 1200, 400)] == [(5, 5), (2, 4), (0, 1)]
    # A parameter larger than the cap is a bucket of its own.
    assert [(b[2], b[3]) for b in _make_buckets(ranges, 4, 1200, 1)] == [(5, 5), (2, 4), (0, 1)]
    # A cap above bucket_bytes is honoured too.
    assert [(b[2], b[3]) for b in _make_buckets(ranges, 4, 400, 800)] == [(4, 5), (3, 3), (2, 2), (1, 1),
                                                                          (0, 0)]
    g = np.zeros(lo, np.float32)
    with comm.GradBuckets(g, ranges, MPI.COMM_SELF, bucket_bytes=1200, first_bucket_bytes=400) as gb:
        assert [(b[0], b[1]) for b in gb.buckets] == [(500, 600), (200, 500), (0, 200)]
        assert gb.first_bucket_bytes == 400
    with pytest.raises(ValueError, match="first_bucket_bytes must be positive"):
        comm.GradBuckets(g, ranges, MPI.COMM_SELF, first_bucket_bytes=0)


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_first_bucket_bytes_equals_plain_allreduce(overlap):
    ranges, n = _model()
    g = np.zeros(n, np.float32)
    problems = []
    with comm.GradBuckets(g, ranges, WORLD, bucket_bytes=600_000, first_bucket_bytes=64 * 1024,
                          overlap=overlap) as gb:
        first_lo, first_hi = gb.buckets[0][:2]
        if (first_hi - first_lo) * 4 > 64 * 1024 and gb.buckets[0][2] != gb.buckets[0][3]:
            problems.append(f"first bucket {gb.buckets[0]} exceeds its cap")
        if len(gb.buckets) < 2:
            problems.append(f"buckets {gb.buckets}")
        for step in range(2):
            g[:] = data(n, np.float32, seed=100 * step + RANK)
            ref = mpi_reference(g, "avg")
            for i in reversed(range(len(ranges))):
                gb.mark_ready(i)
            gb.wait()
            if not close(g, ref, np.float32, P):
                problems.append(f"step {step}: differs from Allreduce avg")
    agree(problems)


@pytest.mark.mpi(min_size=2)
def test_first_bucket_bytes_is_part_of_the_layout_check():
    ranges, n = _model()
    g = np.zeros(n, np.float32)
    first = None if RANK == 0 else 25 * 2**20     # the same buckets, only the argument differs
    with pytest.raises(RuntimeError, match="inconsistent GradBuckets layout"):
        comm.GradBuckets(g, ranges, WORLD, first_bucket_bytes=first)
