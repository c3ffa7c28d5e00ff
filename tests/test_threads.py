"""Thread defaults at every entry point, the user's settings winning, and oversubscription
found and named (ringpipe/threads.py; issue 21).

Each default is observed in a child process started with no thread variables (tests/run_all.sh
exports OMP_NUM_THREADS=1 etc., and this process's own import of ringpipe set them too):
the defaults are set when ringpipe is first imported, so only a fresh process shows them."""
import json
import os
import subprocess
import sys

import pytest

from ringpipe import threads

from tests.support import ROOT

THREAD_VARIABLES = threads.COMPUTE_VARIABLES + (threads.TOKENIZER_VARIABLE, "OMP_WAIT_POLICY", threads.MARKER)
LAUNCHER_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                      "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
ALL_VARIABLES = threads.COMPUTE_VARIABLES + (threads.TOKENIZER_VARIABLE, "OMP_WAIT_POLICY")
YIELD_VARIABLES = tuple(threads.YIELDING_WAITS)

# What the commands, the library and the kernels import first (ringpipe/cli.py's COMMANDS).
ENTRY_POINTS = ["ringpipe.cli", "ringpipe.engine.data.prepare", "ringpipe.engine.train.cli", "ringpipe.engine.interop.sample",
                "ringpipe.engine.interop.hf", "ringpipe.engine.schedules.__main__", "ringpipe.engine.job.rundir",
                "ringpipe.engine.train.run", "ringpipe.kernels"]

SHOW_SETTINGS = ("import importlib, json, os, sys; importlib.import_module(sys.argv[1]); "
                 f"print(json.dumps({{v: os.environ.get(v) for v in {ALL_VARIABLES!r}}}))")


def child(code, *args, cpus=None, **env_vars):
    """Run CODE in a fresh python with no thread or launcher variables but ENV_VARS, on CPUS if given.
    The node's load counts as none unless ENV_VARS say otherwise: the machine is shared, and a
    test judges only what it set up itself."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES + LAUNCHER_VARIABLES + YIELD_VARIABLES}
    env[threads.LOAD_VARIABLE] = "0"
    env.update(env_vars)
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300, preexec_fn=pin)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def cores():
    return threads.available_cores()[0]


# ---- every entry point ------------------------------------------------------------------------

@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_each_entry_point_sets_the_defaults_and_the_users_settings_win(module):
    split = str(cores())
    got = json.loads(child(SHOW_SETTINGS, module).stdout)
    assert got == {**{v: split for v in threads.COMPUTE_VARIABLES + (threads.TOKENIZER_VARIABLE,)},
                   "OMP_WAIT_POLICY": "PASSIVE"}, got
    # OMP_NUM_THREADS alone stands for the library variables left unset; the others stay as set.
    got = json.loads(child(SHOW_SETTINGS, module, OMP_NUM_THREADS="1", MKL_NUM_THREADS="3",
                           RAYON_NUM_THREADS="5", OMP_WAIT_POLICY="ACTIVE").stdout)
    assert got == {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "3",
                   "NUMBA_NUM_THREADS": "1", "RAYON_NUM_THREADS": "5", "OMP_WAIT_POLICY": "ACTIVE"}, got


def test_the_split_is_among_the_nodes_ranks():
    got = json.loads(child(SHOW_SETTINGS, "ringpipe.kernels", MPI_LOCALNRANKS=str(cores())).stdout)
    assert got["OMP_NUM_THREADS"] == got["NUMBA_NUM_THREADS"] == "1", got


@pytest.mark.skipif(cores() < 2, reason="needs 2 cores to tell a chosen Numba thread count from the default")
def test_numba_loaded_before_ringpipe_gets_the_limit_at_run_time_unless_the_user_set_one():
    show = "import numba; {} import ringpipe.kernels; print(numba.get_num_threads())"
    assert child(show.format(""), MPI_LOCALNRANKS=str(cores())).stdout.split() == ["1"]
    # numba.set_num_threads called by the user: kept, and said in the start-up line.
    r = child(show.format("numba.set_num_threads(1);")
              + "; from ringpipe import threads; print(threads.apply_defaults().describe())")
    assert r.stdout.splitlines()[0] == "1", r.stdout
    assert "numba.set_num_threads(1)" in r.stdout, r.stdout


def test_blas_loaded_before_ringpipe_is_limited_with_threadpoolctl_unless_the_user_set_it(tmp_path):
    """numpy's BLAS read its variables before ringpipe could set them: threadpoolctl (a stand-in
    here, recording its calls) lowers a pool still at its own default of a thread per core."""
    (tmp_path / "threadpoolctl.py").write_text(
        "import os\ncalls = []\n"
        "def threadpool_info():\n"
        "    return [{'user_api': 'blas', 'num_threads': len(os.sched_getaffinity(0))}]\n"
        "def threadpool_limits(limits, user_api=None):\n"
        "    calls.append((limits, user_api))\n")
    show = "import numpy; import ringpipe, threadpoolctl; print(threadpoolctl.calls)"
    ranks = str(cores() + 1)                      # more ranks than cores: a split of one thread each
    r = child(show, MPI_LOCALNRANKS=ranks, PYTHONPATH=str(tmp_path))
    assert r.stdout.strip() == ("[(1, 'blas')]" if cores() > 1 else "[]"), r.stdout
    r = child(show, MPI_LOCALNRANKS=ranks, PYTHONPATH=str(tmp_path), OPENBLAS_NUM_THREADS=str(cores()))
    assert r.stdout.strip() == "[]", r.stdout


def test_a_process_started_by_a_ringpipe_process_makes_its_own_split():
    """Variables ringpipe set in a parent (it says which, in RINGPIPE_THREAD_DEFAULTS) are not
    the user's in its child; one the user changed since is."""
    inherited = {"OMP_NUM_THREADS": "8", "NUMBA_NUM_THREADS": "8", threads.MARKER: "OMP_NUM_THREADS=8,NUMBA_NUM_THREADS=8"}
    choice, to_set = threads.choose(inherited, ranks=2, cores=4, cores_why="test")
    assert to_set["OMP_NUM_THREADS"] == to_set["NUMBA_NUM_THREADS"] == "2" and not choice.user
    choice, to_set = threads.choose({**inherited, "NUMBA_NUM_THREADS": "1"}, ranks=2, cores=4, cores_why="test")
    assert "NUMBA_NUM_THREADS" not in to_set and choice.user == {"NUMBA_NUM_THREADS": "1"}


# ---- oversubscription -------------------------------------------------------------------------

def test_an_affinity_limit_sets_the_split_and_explicit_settings_over_it_are_warned_of_once():
    one_cpu = {min(os.sched_getaffinity(0))}
    r = child(SHOW_SETTINGS, "ringpipe.kernels", cpus=one_cpu)
    assert json.loads(r.stdout)["OMP_NUM_THREADS"] == "1" and "warning" not in r.stderr, r.stdout + r.stderr
    warn = "import ringpipe.kernels; from ringpipe import threads; threads.warn_once()"
    r = child(warn, cpus=one_cpu, OMP_NUM_THREADS="2")
    assert r.stderr.count("ringpipe: warning:") == 1, r.stderr
    assert "OMP_NUM_THREADS=2" in r.stderr and "1 core available" in r.stderr and "CPU affinity" in r.stderr
    assert "set OMP_NUM_THREADS=1" in r.stderr, r.stderr
    # Rank 0 alone says it: the other ranks of a launch would repeat the same line.
    assert "warning" not in child(warn, cpus=one_cpu, OMP_NUM_THREADS="2", PMI_RANK="1").stderr


def test_more_ranks_than_cores_is_warned_of_even_with_one_thread_each():
    r = child("import ringpipe.kernels", MPI_LOCALNRANKS=str(cores() + 1))
    assert r.stderr.count("ringpipe: warning:") == 1, r.stderr
    assert f"start at most {cores()} ranks per node" in r.stderr, r.stderr


def test_the_train_start_up_report_says_the_threads_and_the_warning_once(tmp_path):
    one_cpu = {min(os.sched_getaffinity(0))}
    flags = ["--data", "synthetic", "--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16",
             "--batch-size", "4", "--sample-tokens", "0", "--steps", "1", "--out", str(tmp_path / "run")]
    r = child("import sys; from ringpipe.engine.train.cli import main; main(sys.argv[1:])", *flags, cpus=one_cpu,
              OMP_NUM_THREADS="2")
    assert "threads: 2 per rank; the user's settings kept: OMP_NUM_THREADS=2; 1 core available to 1 rank" \
        in r.stdout, r.stdout
    assert (r.stdout + r.stderr).count("ringpipe: warning:") == 1, r.stdout + r.stderr


def _fake_cgroup(root, files):
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)
    return str(root)


def test_the_cgroup_v2_quota_binds_from_any_folder_above_the_process(tmp_path):
    root = _fake_cgroup(tmp_path, {"job_7/cpu.max": "200000 100000\n", "job_7/step_0/cpu.max": "max 100000\n"})
    assert threads.cgroup_cpu_limit(root, self_cgroup="0::/job_7/step_0\n") == 2.0
    assert threads.cgroup_cpu_limit(root, self_cgroup="0::/elsewhere\n") is None
    # In a container the process's cgroup is the mount's root.
    root = _fake_cgroup(tmp_path / "container", {"cpu.max": "150000 100000\n"})
    assert threads.cgroup_cpu_limit(root, self_cgroup="0::/\n") == 1.5


def test_the_cgroup_v1_quota_is_read_and_minus_one_means_none(tmp_path):
    root = _fake_cgroup(tmp_path, {"cpu,cpuacct/slurm/job_3/cpu.cfs_quota_us": "100000\n",
                                   "cpu,cpuacct/slurm/job_3/cpu.cfs_period_us": "100000\n",
                                   "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert threads.cgroup_cpu_limit(root, self_cgroup="4:cpu,cpuacct:/slurm/job_3\n2:memory:/x\n") == 1.0
    assert threads.cgroup_cpu_limit(root, self_cgroup="4:cpu,cpuacct:/\n") is None


def test_a_cgroup_limit_sets_the_split_and_explicit_settings_over_it_are_warned_of(tmp_path):
    root = _fake_cgroup(tmp_path, {"cpu.max": "250000 100000\n"})
    cores, why = threads.available_cores(cgroup_root=root, self_cgroup="0::/\n", affinity={0, 1, 2, 3, 4, 5, 6, 7})
    assert (cores, why) == (2, "cgroup CPU quota of 2.5 cores")
    choice, to_set = threads.choose({}, ranks=1, cores=cores, cores_why=why)
    assert to_set["OMP_NUM_THREADS"] == "2" and choice.warning() is None
    assert choice.describe() == "threads: 2 per rank; 2 cores available to 1 rank (cgroup CPU quota of 2.5 cores)"
    choice, _ = threads.choose({"OMP_NUM_THREADS": "8"}, ranks=2, cores=cores, cores_why=why)
    assert choice.warning().startswith("ringpipe: warning: 2 ranks x 8 threads (OMP_NUM_THREADS=8) oversubscribe "
                                       "the 2 cores available to 2 ranks (cgroup CPU quota of 2.5 cores)")
    assert "set OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1" in choice.warning()


# ---- a busy node (issue 35) ---------------------------------------------------------------------

SHOW_ALL = ("import json, os; import ringpipe.kernels; from ringpipe import threads; "
            f"print(json.dumps({{v: os.environ.get(v) for v in {ALL_VARIABLES + YIELD_VARIABLES!r}}})); "
            "print(threads.apply_defaults().describe())")


def test_a_busy_node_gets_fewer_threads_and_waits_that_yield_and_the_start_up_line_says_so():
    """Two other programs' threads on 2 cores: one thread per rank, not 2, and OpenBLAS's and MPI's
    waits sleep; the same node quiet: the cores split, and no waiting setting at all."""
    choice, to_set = threads.choose({}, ranks=1, cores=2, cores_why="test", others=2, others_why="counted")
    assert to_set["OMP_NUM_THREADS"] == to_set["NUMBA_NUM_THREADS"] == "1" and choice.crowded
    assert {k: to_set[k] for k in YIELD_VARIABLES} == threads.YIELDING_WAITS
    assert "the node is busy: 2 other runnable threads on these cores (counted), so 1 per rank instead of 2" \
        in choice.describe() and "yield" in choice.describe() and choice.warning() is None
    choice, to_set = threads.choose({}, ranks=1, cores=2, cores_why="test", others=0)
    assert to_set["OMP_NUM_THREADS"] == "2" and not choice.crowded and not set(YIELD_VARIABLES) & set(to_set)
    assert "busy" not in choice.describe()
    # 4 ranks on 2 cores (what make train once ran): the ranks themselves crowd the node.
    choice, to_set = threads.choose({}, ranks=4, cores=2, cores_why="test")
    assert choice.crowded and to_set["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] == "1"
    # A fresh process told the load by RINGPIPE_NODE_LOAD.
    r = child(SHOW_ALL, RINGPIPE_NODE_LOAD="5")
    got, line = json.loads(r.stdout.splitlines()[0]), r.stdout.splitlines()[1]
    assert got["OMP_NUM_THREADS"] == "1" and got["OPENBLAS_THREAD_TIMEOUT"] == "4", got
    assert got["OMPI_MCA_mpi_yield_when_idle"] == "1" and "RINGPIPE_NODE_LOAD=5" in line, line


def test_the_users_waiting_settings_win_and_threads_over_a_busy_node_are_warned_of():
    choice, to_set = threads.choose({"OMPI_MCA_mpi_yield_when_idle": "0", "OMP_NUM_THREADS": "2"}, ranks=1,
                                    cores=2, cores_why="test", others=2, others_why="counted")
    assert "OMPI_MCA_mpi_yield_when_idle" not in to_set and to_set["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert choice.warning().startswith("ringpipe: warning: 1 rank x 2 threads (OMP_NUM_THREADS=2) share the 2 cores")
    assert "set OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1" in choice.warning()
    # One thread each over a busy node: nothing fewer to advise.
    choice, _ = threads.choose({"OMP_NUM_THREADS": "1"}, ranks=2, cores=2, cores_why="test", others=3, others_why="x")
    assert choice.warning() is None


def test_the_load_is_read_from_the_kernels_count_of_runnable_threads(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("3.10 2.00 1.00 5/300 4242\n")
    read = lambda: threads.running_threads(str(loadavg))       # noqa: E731
    # 5 runnable, 1 of them this reader (1 rank): 4 others; on 2 of the machine's 8 cores: 1 of them.
    assert threads.node_load({}, 1, 8, machine_cores=8, read=read, sleep=lambda s: None) == \
        (4, "the node's runnable threads, /proc/loadavg")
    assert threads.node_load({}, 1, 2, machine_cores=8, read=read, sleep=lambda s: None)[0] == 1
    assert threads.node_load({"RINGPIPE_NODE_LOAD": "ignore"}, 1, 8, read=read) == (0, None)
    assert threads.node_load({}, 1, 8, read=lambda: None, sleep=lambda s: None) == (0, None)
    assert threads.running_threads(str(tmp_path / "missing")) is None


def test_a_real_busy_neighbour_is_seen(tmp_path):
    """Two spinning processes this test started: the fresh process counts them (at least one:
    the kernel's count is a snapshot) and takes one thread."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        import time
        time.sleep(0.5)
        r = child(SHOW_ALL, RINGPIPE_NODE_LOAD="auto", cpus=set(list(os.sched_getaffinity(0))[:2]))
    finally:
        for p in spin:
            p.kill()
            p.wait()
    got, line = json.loads(r.stdout.splitlines()[0]), r.stdout.splitlines()[1]
    assert "the node is busy" in line and got["OMP_NUM_THREADS"] == "1", line


@pytest.mark.parametrize("value", ["many", "-1", "1e9"])
def test_a_bad_load_setting_is_warned_of_by_the_library_and_refused_by_the_trainer(value, tmp_path):
    r = child("import ringpipe.kernels; from ringpipe import threads; threads.warn_once()", RINGPIPE_NODE_LOAD=value)
    assert "RINGPIPE_NODE_LOAD" in r.stderr and "not auto, ignore or a count" in r.stderr, r.stderr
    flags = ["--data", "synthetic", "--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16",
             "--batch-size", "4", "--sample-tokens", "0", "--steps", "1", "--out", str(tmp_path / "run")]
    env = {k: v for k, v in os.environ.items()}
    env["RINGPIPE_NODE_LOAD"] = value
    r = subprocess.run([sys.executable, "-m", "ringpipe.cli", "train", *flags], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "RINGPIPE_NODE_LOAD" in r.stderr + r.stdout, r.stdout + r.stderr
