"""slurm/submit_scaling.sh never leaves half a sweep (issue 21): every job is checked
with `sbatch --test-only` before any is submitted, so a rank count the cluster cannot
run submits nothing (exit 2), and a submission that fails midway cancels the jobs the
script had already submitted (exit 1).

Against stand-in `sbatch` and `scancel` commands that log their calls, so no Slurm is
needed; tests/slurm/test_slurm.py runs a refused sweep against a real one.
"""
import os
import subprocess

from tests.support import ROOT

SCRIPT = os.path.join(ROOT, "slurm", "submit_scaling.sh")

# sbatch: --test-only refuses -n $REFUSE_RANKS like Slurm does; a real submission
# prints the next id (101, 102, ...), except the $FAIL_AT-th, which fails.
SBATCH = r"""#!/bin/bash
echo "sbatch $*" >>"$STUB_LOG"
prev=; test_only=0
for a in "$@"; do
    [ "$a" = --test-only ] && test_only=1
    if [ "$prev" = -n ] && [ "$a" = "${REFUSE_RANKS:-none}" ]; then refuse=1; fi
    prev=$a
done
if [ $test_only = 1 ]; then
    [ -n "${refuse:-}" ] && { echo "allocation failure: More processors requested than permitted" >&2; exit 1; }
    echo "sbatch: Job 1 to start at now using 1 processors on nodes vm in partition debug" >&2; exit 0
fi
n=$(( $(cat "$STUB_COUNT" 2>/dev/null || echo 0) + 1 )); echo $n >"$STUB_COUNT"
[ "$n" = "${FAIL_AT:-0}" ] && { echo "sbatch: error: Batch job submission failed: Socket timed out" >&2; exit 1; }
echo $((100 + n))
"""
SCANCEL = """#!/bin/bash
echo "scancel $*" >>"$STUB_LOG"
"""


def sweep(tmp_path, *args, **stub_env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("sbatch", SBATCH), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", STUB_LOG=str(log),
               STUB_COUNT=str(tmp_path / "count"), **stub_env)
    r = subprocess.run(["bash", SCRIPT, "--results", str(tmp_path / "res"), *args], env=env, capture_output=True,
                       text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return r, [c for c in calls if "--test-only" not in c], [c for c in calls if "--test-only" in c]


def test_a_rank_count_the_cluster_cannot_run_submits_nothing(tmp_path):
    r, submitted, tried = sweep(tmp_path, "--ranks", "1 2 4 8", "--mode", "both", REFUSE_RANKS="8")
    assert r.returncode == 2, r.stderr
    assert submitted == [], submitted                       # not one job queued
    assert len(tried) == 4 * 2 + 1                           # every point and the merge job were checked
    assert "refuses train strong, 8 ranks on 2 node(s)" in r.stderr and "refuses train weak, 8 ranks" in r.stderr
    assert "More processors requested than permitted" in r.stderr and "nothing was submitted" in r.stderr
    assert "refuses train strong, 4 ranks" not in r.stderr   # the sizes that fit are not blamed
    assert not (tmp_path / "res").exists()                   # nor a results folder left behind


def test_a_submission_failing_midway_cancels_what_was_submitted(tmp_path):
    r, submitted, _ = sweep(tmp_path, "--ranks", "1 2 4", FAIL_AT="3")
    assert r.returncode == 1, r.stderr
    assert [c.split()[0] for c in submitted] == ["sbatch", "sbatch", "sbatch", "scancel"], submitted
    assert submitted[-1] == "scancel 101 102"
    assert "submitting train strong, 4 ranks" in r.stderr and "Socket timed out" in r.stderr
    assert "cancelled the 2 job(s) this sweep had submitted: 101 102" in r.stderr


def test_a_sweep_that_fits_is_submitted_whole_with_its_merge_job_last(tmp_path):
    r, submitted, tried = sweep(tmp_path, "--ranks", "1 2", "--kind", "both", "--", "--layers", "2")
    assert r.returncode == 0, r.stderr
    assert len(tried) == len(submitted) == 2 + 1 + 1          # train 1, 2; all-reduce 2; merge
    assert all("--dependency=singleton" in c for c in submitted)
    assert "--kind train" in submitted[0] and submitted[0].endswith("-- --layers 2")
    assert "--kind allreduce" in submitted[2] and "--layers" not in submitted[2]
    assert "--wrap" in submitted[-1] and "collect.py merge" in submitted[-1]
    assert "merge job 104 runs after 101 102 103" in r.stderr
    assert r.stdout.strip() == str(tmp_path / "res") and (tmp_path / "res" / "logs").is_dir()
