"""engine/monitor/jobstats.py: the job summary (per node CPU, memory, time split, efficiency)
and Slurm's accounting, from made-up totals of 4 ranks on 2 nodes; sacct faked by scripts on
PATH (a real one answers, one whose accounting is disabled, none at all)."""
import json
import os
import socket
import stat
import subprocess

import pytest

from ringpipe.engine.monitor import jobstats
from tests.slurm.test_slurm import TINY, sbatch_wait, slurm  # noqa: F401 (slurm: the fixture)
from tests.support import ROOT
from tests.test_scripts import FAKE_PY, MPICH_LIB

GiB = 1 << 30
WALL = 100.0
# Node names that are never this machine's (its MemTotal and CPU count would be used).
N1, N2 = "jobstats-node-a", "jobstats-node-b"
assert socket.gethostname().split(".")[0] not in (N1, N2)

HEADER = {"format": "ringpipe-monitor", "version": 1, "started": 0.0, "start_step": 0, "steps": 50,
          "model": "gpt2", "unit": "tokens", "items_per_step": 8192, "precision": "float32", "world": 4,
          "layout": {"dp": 2, "pp": 2, "tp": 1},
          "ranks": [{"rank": r, "node": N1 if r < 2 else N2, "dp": r % 2, "pp": r // 2, "tp": 0}
                    for r in range(4)],
          "slurm": None}


def _rank(rank, node, cpu_s, peak_gib, cpus=None, **extra):
    t = {"rank": rank, "node": node, "wall_s": WALL, "cpu_s": cpu_s, "cores": 2, "peak_bytes": int(peak_gib * GiB),
         "compute_s": 70.0, "comm_s": 20.0, "bubble_s": 5.0, "data_s": 1.0, "other_s": 4.0, "steps": 50}
    if cpus is not None:
        t["cpus"] = cpus
    t.update(extra)
    return t


def totals(with_sets=True):
    # N1: ranks 0 and 1 share cores 0-1 (2 cores); N2: ranks 2 and 3 on cores 0-1 and 2-3 (4 cores).
    sets = ([0, 1], [0, 1], [0, 1], [2, 3]) if with_sets else (None,) * 4
    return [_rank(0, N1, 30.0, 1.0, sets[0]), _rank(1, N1, 40.0, 1.0, sets[1]),
            _rank(2, N2, 150.0, 1.5, sets[2]), _rank(3, N2, 150.0, 2.0, sets[3])]


SLURM_ENV = {"SLURM_JOB_ID": "123", "SLURM_JOB_NAME": "train", "SLURM_JOB_NODELIST": f"{N1},{N2}",
             "SLURM_NTASKS": "4", "SLURM_CPUS_PER_TASK": "2", "SLURM_MEM_PER_NODE": "4096",
             "SLURM_CLUSTER_NAME": "testcluster"}


def _fake_sacct(tmp_path, body):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "sacct"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(bin_dir)


def _env(path, **fields):
    """PATH is `path` alone: a real sacct elsewhere on this machine is never found."""
    return dict(fields, PATH=path)


def _write(tmp_path, env, tots=None, header=HEADER):
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    json_path, text_path = jobstats.write_summary(str(out), header, totals() if tots is None else tots, WALL,
                                                  env=env)
    assert json_path == str(out / "job_summary.json") and text_path == str(out / "job_summary.txt")
    with open(json_path) as fh:
        summary = json.load(fh)
    with open(text_path) as fh:
        return summary, fh.read()


def test_efficiency_memory_and_split_per_node(tmp_path):
    s, text = _write(tmp_path, _env(str(tmp_path / "nobin"), **SLURM_ENV))
    assert s["format"] == "ringpipe-job-summary"
    n1, n2 = s["nodes"]
    assert (n1["node"], n1["ranks"], n2["node"], n2["ranks"]) == (N1, [0, 1], N2, [2, 3])
    # cores: the union of the ranks' affinity sets (ranks 0 and 1 share theirs)
    assert (n1["cores"], n2["cores"]) == (2, 4)
    # CPU efficiency = CPU seconds / (cores x wall): (30 + 40) / (2 x 100), (150 + 150) / (4 x 100)
    assert n1["cpu_s"] == 70.0 and n1["cpu_efficiency"] == pytest.approx(0.35)
    assert n2["cpu_s"] == 300.0 and n2["cpu_efficiency"] == pytest.approx(0.75)
    # memory: the sum of the ranks' peaks against SLURM_MEM_PER_NODE (4096 MB = 4 GiB)
    assert n1["peak_bytes"] == 2 * GiB and n2["peak_bytes"] == int(3.5 * GiB)
    assert n1["memory_limit_bytes"] == 4 * GiB and n1["memory_limit_from"].startswith("Slurm")
    assert n1["memory_use"] == pytest.approx(0.5) and n2["memory_use"] == pytest.approx(0.875)
    # time split: seconds summed over the node's ranks, percentages of the whole step
    assert n1["time_split"]["seconds"] == {"compute": 140.0, "comm": 40.0, "bubble": 10.0, "data": 2.0,
                                           "other": 8.0}
    assert n1["time_split"]["percent"] == pytest.approx({"compute": 70.0, "comm": 20.0, "bubble": 5.0,
                                                          "data": 1.0, "other": 4.0})
    # the job: 6 cores, 370 CPU seconds over 100 s
    job = s["job"]
    assert (job["nodes"], job["ranks"], job["cores"], job["steps"]) == (2, 4, 6, 50)
    assert job["cpu_efficiency"] == pytest.approx(370 / 600)
    assert job["peak_bytes"] == int(5.5 * GiB)
    # per rank: its own cores and wall time
    assert [r["cpu_efficiency"] for r in s["ranks"]] == pytest.approx([0.15, 0.2, 0.75, 0.75])
    # verdicts: N1 holds cores it does not use; N2 is fine
    assert n1["verdict"].startswith("CPU efficiency 35%: the job asked for more cores than it uses")
    assert "ask for fewer (-c)" in n1["verdict"]
    assert n2["verdict"] == "CPU efficiency 75%: good"
    assert s["slurm"]["job_id"] == "123" and s["slurm"]["mem_per_node_mb"] == 4096
    assert s["slurm"]["cluster"] == "testcluster" and s["slurm"]["ntasks"] == 4
    # the text names every node, with its verdict
    for name in (N1, N2):
        assert name in text
    assert "CPU efficiency 35%" in text and "testcluster" in text
    assert s["missing"] == []


def test_low_efficiency_advises_more_threads_only_on_a_quiet_node_with_cores_to_spare(tmp_path):
    """A busy node (other programs' runnable threads seen by a rank): the ranks waited for the CPU,
    and more threads would wait too (issue 35: a newcomer was told to ask for more threads).
    Threads already filling the cores: fewer cores, not more threads."""
    busy = totals()
    busy[1]["others_runnable"] = 3
    n1 = _write(tmp_path, _env(str(tmp_path / "nobin"), **SLURM_ENV), tots=busy)[0]["nodes"][0]
    assert n1["others_runnable"] == 3 and "the node was busy (3 other programs' runnable threads" in n1["verdict"]
    assert "more threads" not in n1["verdict"].replace("more threads would wait too", "")
    full = totals()
    for t in full[:2]:
        t["threads"] = 1
    n1 = _write(tmp_path, _env(str(tmp_path / "nobin"), **SLURM_ENV), tots=full)[0]["nodes"][0]
    assert n1["threads"] == 2 and "ask for fewer (-c)" in n1["verdict"] and "more threads" not in n1["verdict"]


def test_cores_without_affinity_sets_are_the_ranks_counts(tmp_path):
    s, _ = _write(tmp_path, _env(str(tmp_path / "nobin"), **SLURM_ENV), tots=totals(with_sets=False))
    n1, n2 = s["nodes"]
    assert (n1["cores"], n2["cores"]) == (4, 4)
    assert "at most" in n1["cores_from"]
    assert n1["cpu_efficiency"] == pytest.approx(70 / 400)


def test_memory_per_cpu_and_the_near_limit_verdict(tmp_path):
    env = dict(SLURM_ENV, SLURM_MEM_PER_CPU="1024")
    del env["SLURM_MEM_PER_NODE"]
    s, _ = _write(tmp_path, _env(str(tmp_path / "nobin"), **env))
    n1 = s["nodes"][0]
    assert n1["memory_limit_bytes"] == 2 * GiB            # 1024 MB x 2 cores
    assert n1["memory_use"] == pytest.approx(1.0)
    assert "close to the limit" in n1["verdict"]


def test_sacct_rows_parsed_by_field(tmp_path):
    args = tmp_path / "args"
    path = _fake_sacct(tmp_path, f'echo "$@" > {args}\n'
                       "echo '123|train|COMPLETED|00:01:40|06:10.000|00:10:00||4G|6|n[1-2]|0:0'\n"
                       "echo '123.batch|batch|COMPLETED|00:01:40|00:01.000|00:03:20|12M||2|n1|0:0'\n")
    s, text = _write(tmp_path, _env(path, **SLURM_ENV))
    assert args.read_text().split() == ["-j", "123", "--parsable2", "--noheader",
                                        "--format=" + ",".join(jobstats.SACCT_FIELDS)]
    rows = s["sacct"]["rows"]
    assert s["sacct"]["reason"] is None and len(rows) == 2
    assert rows[0]["JobID"] == "123" and rows[0]["State"] == "COMPLETED" and rows[0]["TotalCPU"] == "06:10.000"
    assert rows[0]["NodeList"] == "n[1-2]" and rows[0]["ExitCode"] == "0:0" and rows[0]["MaxRSS"] == ""
    assert rows[1]["JobID"] == "123.batch" and rows[1]["MaxRSS"] == "12M"
    assert "123.batch" in text and "TotalCPU" in text


def test_sacct_with_accounting_disabled_records_the_reason(tmp_path):
    path = _fake_sacct(tmp_path, "echo 'Slurm accounting storage is disabled' >&2\nexit 1\n")
    s, text = _write(tmp_path, _env(path, **SLURM_ENV))
    assert s["sacct"] == {"rows": None, "reason": "no Slurm accounting: Slurm accounting storage is disabled"}
    assert "no Slurm accounting: Slurm accounting storage is disabled" in text


def test_no_sacct_on_path_records_the_reason(tmp_path):
    s, _ = _write(tmp_path, _env(str(tmp_path / "nobin"), **SLURM_ENV))
    assert s["sacct"]["rows"] is None
    assert s["sacct"]["reason"] == "no Slurm accounting: sacct is not on PATH"


def test_sacct_that_hangs_is_given_up(tmp_path, monkeypatch):
    monkeypatch.setattr(jobstats, "SACCT_TIMEOUT_S", 0.5)
    path = _fake_sacct(tmp_path, "exec /bin/sleep 30\n")
    s, _ = _write(tmp_path, _env(path, **SLURM_ENV))
    assert "did not answer" in s["sacct"]["reason"]


def test_outside_slurm_still_a_summary(tmp_path):
    path = _fake_sacct(tmp_path, "echo should not run >&2\nexit 1\n")
    s, text = _write(tmp_path, _env(path))
    assert s["slurm"] is None
    assert s["sacct"] == {"rows": None, "reason": "not a Slurm job (no SLURM_JOB_ID)"}
    assert s["nodes"][0]["cpu_efficiency"] == pytest.approx(0.35)
    # no Slurm allocation and neither node is this one: the memory limit is unknown, and said so
    assert s["nodes"][0]["memory_limit_bytes"] is None
    assert any(N1 in m for m in s["missing"])
    assert "not a Slurm job" in text and N1 in text and N2 in text


def test_this_node_is_measured_against_its_memtotal(tmp_path):
    here = socket.gethostname()
    tots = [dict(t, node=here) for t in totals()[:2]]
    s, _ = _write(tmp_path, _env(str(tmp_path / "nobin")), tots=tots, header=dict(HEADER, world=2))
    node = s["nodes"][0]
    assert node["memory_limit_from"] == "the node's MemTotal"
    assert node["memory_limit_bytes"] == jobstats.mem_total_bytes() > 0


def test_missing_ranks_and_fields_are_named_not_raised(tmp_path):
    tots = totals()[:3]
    tots[0] = dict(tots[0], cpu_s=None, comm_s=float("nan"))
    s, text = _write(tmp_path, _env(str(tmp_path / "nobin"), **SLURM_ENV), tots=tots)
    assert any("rank(s) 3 of 4" in m for m in s["missing"])
    assert any("CPU time" in m for m in s["missing"])
    assert s["nodes"][0]["cpu_s"] == 40.0                  # the rank that reported
    assert "Missing" in text


def test_nothing_usable_still_writes_both_files(tmp_path):
    s, text = _write(tmp_path, {}, tots=[None, "x", {}], header=None)
    assert s["format"] == "ringpipe-job-summary"
    assert "ringpipe job summary" in text


def test_unwritable_folder_returns_empty_paths(tmp_path, capsys):
    out = tmp_path / "not-a-folder"
    out.write_text("")
    paths = jobstats.write_summary(str(out), HEADER, totals(), WALL, env={})
    assert paths == ("", "")
    assert "could not be written" in capsys.readouterr().err
    assert not os.path.exists(str(out) + "/job_summary.json")


# ---- slurm/train.sbatch: sacct's lines appended to RUN_DIR/sacct.txt once the step ended ----

def _train_sbatch(tmp_path, sacct_body, srun_rc=0):
    """slurm/train.sbatch with stand-ins for python, srun, scontrol and sacct (tests/test_scripts.py's
    python, the MPICH library); srun exits `srun_rc`. sacct_body None: no sacct on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_ins = {"python": FAKE_PY, "srun": f"#!/bin/bash\nexit {srun_rc}\n",
                 "scontrol": '#!/bin/bash\necho "$*" >> "$FAKE_DIR/scontrol.log"\n'}
    if sacct_body is not None:
        stand_ins["sacct"] = "#!/bin/bash\n" + sacct_body
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RINGPIPE_"))}
    env.update(PATH=f"{bin_dir}:{_system_without_sacct(tmp_path)}", FAKE_DIR=str(tmp_path), FAKE_MPI_LIB=MPICH_LIB,
               RINGPIPE_PYTHON=str(bin_dir / "python"), RINGPIPE_RUN_DIR=str(tmp_path / "run"),
               SLURM_JOB_ID="77", SLURM_NTASKS="1")
    r = subprocess.run(["bash", "slurm/train.sbatch", "--steps", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    sacct_txt = tmp_path / "run" / "sacct.txt"
    return r, (sacct_txt.read_text() if sacct_txt.exists() else None)


def _system_without_sacct(tmp_path):
    """A folder of links to the system's commands, all but sacct: the script finds what it runs
    (bash, git, date, timeout, ...) and no real sacct, whether or not this machine has Slurm."""
    farm = tmp_path / "system"
    farm.mkdir(exist_ok=True)
    for folder in ("/usr/local/bin", "/usr/bin", "/bin"):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            if name != "sacct" and not os.path.lexists(farm / name):
                os.symlink(os.path.join(folder, name), farm / name)
    return str(farm)


SACCT_LINES = ('echo "$*" > "$FAKE_DIR/sacct.args"\n'
               "echo 'JobID|JobName|State|Elapsed|TotalCPU|CPUTime|MaxRSS|ReqMem|AllocCPUS|NodeList|ExitCode'\n"
               "echo '77|ringpipe|RUNNING|00:00:09|00:03.000|00:00:18||2000M|2|n1|0:0'\n"
               "echo '77.0|python|COMPLETED|00:00:08|00:03.000|00:00:16|41M||2|n1|0:0'\n")


def test_train_sbatch_appends_sacct_lines_after_the_step(tmp_path):
    r, text = _train_sbatch(tmp_path, SACCT_LINES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert text is not None, r.stdout + r.stderr
    assert "restart 0: the training step exited with 0" in text
    assert "77.0|python|COMPLETED" in text and text.count("JobID|") == 1
    assert (tmp_path / "sacct.args").read_text().split()[:3] == ["-j", "77", "--parsable2"]


def test_train_sbatch_requeues_as_before_with_accounting(tmp_path):
    r, text = _train_sbatch(tmp_path, SACCT_LINES, srun_rc=85)
    assert r.returncode == 0, r.stdout + r.stderr            # requeued: scontrol answered
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "77"]
    assert "the training step exited with 85" in text


@pytest.mark.parametrize("sacct_body", ["echo 'Slurm accounting storage is disabled' >&2\nexit 1\n", None],
                         ids=["disabled", "absent"])
def test_train_sbatch_without_accounting_keeps_its_exit_code(tmp_path, sacct_body):
    r, text = _train_sbatch(tmp_path, sacct_body, srun_rc=3)
    assert r.returncode == 3, r.stdout + r.stderr
    assert text is None
    if sacct_body:
        assert "no Slurm accounting (sacct: Slurm accounting storage is disabled)" in r.stdout


# ---- under the real local Slurm (slurm/local): optional, marked slurm ---------------------

@pytest.mark.slurm
def test_a_slurm_job_leaves_its_summary_and_says_why_no_sacct(slurm, tmp_path):  # noqa: F811 (the fixture)
    """A train.sbatch job on the local Slurm, which keeps no accounting: the script says so
    (sacct's real message), writes no sacct.txt and still succeeds. Its job_summary.json is
    checked once the trainer writes one (skipped until then)."""
    run = tmp_path / "run"
    rc, jid, info = sbatch_wait(slurm, ["-N", "1", "-n", "2", "--ntasks-per-node=2", "-c", "1", "--time=10",
                                        "-o", str(tmp_path / "job.out"), "slurm/train.sbatch"] + TINY,
                                extra_env={"RINGPIPE_RUN_DIR": str(run)})
    log = (tmp_path / "job.out").read_text()
    assert rc == 0, f"{info}\n{log}"
    assert "no Slurm accounting (sacct: Slurm accounting storage is disabled)" in log, log
    assert not (run / "sacct.txt").exists()
    if not (run / "job_summary.json").exists():
        pytest.skip("the trainer does not write job_summary.json yet (write_summary is not wired into "
                    "the end of a run)")
    summary = json.loads((run / "job_summary.json").read_text())
    assert summary["slurm"]["job_id"] == jid and summary["job"]["ranks"] == 2
    assert summary["sacct"]["reason"] == "no Slurm accounting: Slurm accounting storage is disabled"
    assert all(n["node"] in (run / "job_summary.txt").read_text() for n in summary["nodes"])
