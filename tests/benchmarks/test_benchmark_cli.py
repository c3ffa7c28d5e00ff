"""The CPU benchmarks refuse bad flag values up front, argparse-style: exit code
2 and a message naming the flag, before any measurement (so no run is lost
to a typo, and no MPI rank is left waiting in a collective).

Each case is refused while parsing or right after, so each subprocess takes
about as long as the script's imports."""
import os
import re
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.bench_cli import bench_env, refused


def _env():
    return bench_env()


def _run(script, *args):
    return subprocess.run([sys.executable, os.path.join("benchmarks", script), *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def unwritable(tmp_path):
    # A path below a regular file cannot be created, even by root.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return str(blocker / "out.json")


# --- allreduce.py ------------------------------------------------------------

def test_allreduce_refuses_one_rank():
    # Without mpiexec there is one rank: busbw = algbw * 2(p-1)/p would divide by zero.
    refused(_run("allreduce.py", "--quick"), "mpiexec -n N", "N >= 2")


@pytest.mark.parametrize("args, words", [
    (["--min-bytes", "1M", "--max-bytes", "4K"], ["--min-bytes", "--max-bytes"]),
    (["--iters", "-3"], ["--iters", ">= 0"]),
    (["--max-bytes", "4Q"], ["--max-bytes", "invalid size '4Q'", "K, M or G"]),
    (["--min-bytes", "lots"], ["--min-bytes", "invalid size"]),
    (["--overlap", "--steps", "0"], ["--steps", ">= 1"]),
    (["--algorithms", "ring,rign"], ["--algorithms", "'rign'", "ring,small,hierarchical,auto,mpi,naive"]),
    (["--warmup", "-1"], ["--warmup"]),
    (["--budget", "nan"], ["--budget"]),
    (["--bucket-bytes", "0"], ["--bucket-bytes"]),
])
def test_allreduce_refuses_bad_flags(args, words):
    refused(_run("allreduce.py", *args), *words)


def test_allreduce_refuses_unwritable_json(unwritable):
    refused(_run("allreduce.py", "--quick", "--json", unwritable), "--json", "cannot write")


def test_allreduce_help_says_what_iters_0_means():
    r = _run("allreduce.py", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())   # argparse wraps to the terminal width
    assert "--iters ITERS timed iterations per size; 0 (the default) picks them by size" in text


def test_allreduce_columns_line_up_at_large_sizes():
    # Rows are printed size by size under one header: fixed widths keep every
    # column's right edge where the header's is, from 8 B to 1 GiB messages.
    code = """if True:
        import sys
        sys.path.insert(0, "benchmarks")
        import allreduce, _common
        big = dict(size=2**30, count=2**30, type="float16", redop="sum", algo="naive", time_us=9876543.2,
                   algbw=123.456, busbw=1234.567, wrong=2**20)
        small = dict(size=8, count=1, type="int32", redop="sum", algo="mpi", time_us=1.0, algbw=0.0,
                     busbw=0.0, wrong=0)
        print(_common.table([], allreduce.COLUMNS))
        print(_common.table([small], allreduce.COLUMNS, header=False))
        print(_common.table([big], allreduce.COLUMNS, header=False))
    """
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()
    assert header.split() == ["size", "count", "type", "redop", "algo", "time(us)", "algbw(GB/s)",
                              "busbw(GB/s)", "#wrong"]
    edges = [m.end() for m in re.finditer(r"\S+", header)]
    for row in rows:
        assert [m.end() for m in re.finditer(r"\S+", row)] == edges, f"\n{header}\n{row}"


# --- kernels_cpu.py ----------------------------------------------------------

def test_kernels_cpu_refuses_unknown_op_and_lists_the_known_ones():
    last = refused(_run("kernels_cpu.py", "--only", "gelu_forward,foo"), "--only", "'foo'")
    for name in ("layernorm_forward", "adamw_update", "matmul"):
        assert name in last


@pytest.mark.parametrize("args, words", [
    (["--repeats", "0"], ["--repeats", ">= 1"]),
    (["--P", "-5"], ["--P"]),
    (["--threads", "0"], ["--threads"]),
])
def test_kernels_cpu_refuses_bad_counts(args, words):
    refused(_run("kernels_cpu.py", *args), *words)


def test_kernels_cpu_refuses_unwritable_json_before_the_run(unwritable):
    refused(_run("kernels_cpu.py", "--json", unwritable), "--json", "cannot write")


# --- scaling.py --------------------------------------------------------------

def test_scaling_refuses_a_global_batch_some_rank_counts_do_not_divide():
    last = refused(_run("scaling.py", "--ranks", "1,3", "--global-batch", "4"), "--global-batch")
    assert "count(s) 3 " in last
    suggested = int(re.search(r"use e\.g\. --global-batch (\d+)", last).group(1))
    assert suggested % 3 == 0 and suggested >= 4


@pytest.mark.parametrize("args, words", [
    (["--warmup", "5", "--steps", "5"], ["--warmup", "--steps"]),
    (["--ranks", "0"], ["--ranks", ">= 1"]),
    (["--ranks", "1,two"], ["--ranks", "'two'"]),
    (["--steps", "0"], ["--steps"]),
])
def test_scaling_refuses_bad_flags(args, words):
    refused(_run("scaling.py", *args), *words)


def test_scaling_refuses_unwritable_json(unwritable):
    refused(_run("scaling.py", "--json", unwritable), "--json", "cannot write")


# --- pipeline.py -------------------------------------------------------------
# Flags are checked before the rank count, so one rank is enough here.

@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], ["--steps", ">= 1"]),
    (["--mb-size", "0"], ["--mb-size", ">= 1"]),
    (["--ms", "2,x"], ["--ms", "'x'"]),
    (["--ms", "0"], ["--ms", ">= 1"]),
    (["--schedules", "gpipe,pipedream"], ["--schedules", "'pipedream'", "gpipe,1f1b,interleaved,zbh1"]),
    (["--d-model", "30"], ["--d-model"]),
])
def test_pipeline_refuses_bad_flags(args, words):
    refused(_run("pipeline.py", *args), *words)


def test_pipeline_refuses_one_rank():
    refused(_run("pipeline.py"), "mpiexec -n P", "P >= 2")


# --- the shared parsers ------------------------------------------------------

def test_size_parser():
    from benchmarks import _common
    assert [_common.parse_size(s) for s in ("8", "64K", "64kb", "1.5M", "256MiB", "1G")] == \
        [8, 65536, 65536, 3 << 19, 256 << 20, 1 << 30]
    for bad in ("4Q", "", "K", "-1K", "nan", "inf", "1e999"):
        with pytest.raises(ValueError, match="invalid size"):
            _common.parse_size(bad)
