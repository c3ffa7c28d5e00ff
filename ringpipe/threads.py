"""How many BLAS/Numba threads each process of ringpipe runs, chosen before numpy loads.

OpenBLAS, MKL and Numba read their thread counts once, when they load, and each
defaults to one thread per core of the machine. Two things then go wrong:
several ranks on one node each start one thread per core, and OpenMP's threads
spin after each kernel, starving every other thread on the same cores (measured:
a GPT step 10x slower on 2 cores; a one-process run 5.4 s/step instead of 0.47
on a busy machine). So ringpipe's import (ringpipe/__init__.py) sets, for every
entry point alike (the commands, `ringpipe.engine.train.run`, `ringpipe.kernels` in a
user's own code):

    OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS, NUMBA_NUM_THREADS,
    RAYON_NUM_THREADS (Hugging Face tokenizers)   the cores this process may use,
                                                  split among the node's ranks
    OMP_WAIT_POLICY=PASSIVE                       threads sleep instead of spinning

A setting the user made always wins: a variable already in the environment is
never changed (OMP_NUM_THREADS alone, the general knob, also stands for the
library variables left unset), nor is a Numba thread count set at run time.
"The cores this process may use" are its CPU affinity (taskset, Slurm's cpusets)
and its cgroup's CPU quota (cgroup v2 cpu.max, v1 cpu.cfs_quota_us), not
os.cpu_count(), less the cores other programs keep busy: a shared node (a login
node, a neighbour's job, more ranks than cores) is the normal case on a cluster.
The node's load is what the kernel says runs right now (/proc/loadavg's count of
runnable threads, the median of a few readings over ~15 ms, less this job's own
ranks); RINGPIPE_NODE_LOAD=ignore trusts the cores to be this job's alone (a
dedicated node: no readings), a number says how many other threads to count on.
Reported (issue 35): one process at 2 threads on a busy 2-core node ran 40 steps in
72.5 s, and in 7.3 s with 1 thread: the threads of one GEMM wait for each other while
the neighbours hold the cores.

When the node's threads outnumber its cores, waiting must not spin: besides
OMP_WAIT_POLICY=PASSIVE (oneDNN's OpenMP, Numba's omp layer), ringpipe then sets

    OPENBLAS_THREAD_TIMEOUT=4                     OpenBLAS's idle threads sleep at once
                                                  (its default spins 2^28 cycles)
    MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 and         MPICH's progress loop sleeps (usleep) after
    MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=16   16 polls that found nothing
    OMPI_MCA_mpi_yield_when_idle=1                Open MPI yields while it waits

which MPI_Init and the libraries read when they load. When the ranks and threads
add up to more than the cores, one warning says what to set; when ringpipe chose
fewer threads for a busy node, the start-up line says so.

Standard library only: it runs before numpy is imported. kernels/ and engine/
both use it (kernels/ must not import engine/).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

# The thread counts of the compute libraries, in the order a reader looks for them.
COMPUTE_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
TOKENIZER_VARIABLE = "RAYON_NUM_THREADS"
# How the node's load is found: auto (read it), ignore (the cores are this job's), or a count.
LOAD_VARIABLE = "RINGPIPE_NODE_LOAD"
LOAD_SAMPLES, LOAD_GAP_S = 8, 0.002
# Waiting that yields the core, set where the node's threads outnumber its cores (see above).
YIELDING_WAITS = {"OPENBLAS_THREAD_TIMEOUT": "4",
                  "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
                  "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "16",
                  "OMPI_MCA_mpi_yield_when_idle": "1"}
# Which variables ringpipe itself set, and to what: a process started from a ringpipe process
# (mpiexec from a test or a benchmark) inherits them, and must make its own split, not take
# its parent's defaults for the user's choice. A value the user changed since no longer matches.
MARKER = "RINGPIPE_THREAD_DEFAULTS"

_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def local_rank_count(environ=None) -> int:
    """How many ranks share this node, as the launcher says (MPICH/Hydra, Open MPI,
    Slurm's "2(x3)" form); 1 when not launched by one."""
    environ = os.environ if environ is None else environ
    local = next((environ[k] for k in _LOCAL_SIZE_VARS if environ.get(k)), None)
    try:
        return max(1, int(local.split("(")[0])) if local else 1
    except ValueError:
        return 1


def launcher_rank(environ=None) -> int:
    """This process's rank as the launcher says; 0 when not launched by one."""
    environ = os.environ if environ is None else environ
    for var in _RANK_VARS:
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return 0


# ---- the cores this process may use -----------------------------------------------------------

def _read_numbers(path):
    try:
        with open(path) as f:
            return f.read().split()
    except (OSError, UnicodeDecodeError):
        return None


def _quota_v2(folder):
    """cores allowed by FOLDER/cpu.max ("QUOTA PERIOD", or "max PERIOD": no limit), or None."""
    words = _read_numbers(os.path.join(folder, "cpu.max"))
    if not words or len(words) != 2 or words[0] == "max":
        return None
    try:
        quota, period = int(words[0]), int(words[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(folder):
    """cores allowed by FOLDER/cpu.cfs_quota_us and cpu.cfs_period_us (quota -1: no limit), or None."""
    quota = _read_numbers(os.path.join(folder, "cpu.cfs_quota_us"))
    period = _read_numbers(os.path.join(folder, "cpu.cfs_period_us"))
    try:
        q, p = int(quota[0]), int(period[0])
    except (TypeError, IndexError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def _own_cgroups(self_cgroup):
    """[(controllers, path)] from /proc/self/cgroup's lines "ID:CONTROLLERS:PATH"."""
    if self_cgroup is None:
        try:
            with open("/proc/self/cgroup") as f:
                self_cgroup = f.read()
        except OSError:
            self_cgroup = ""
    found = []
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            found.append((parts[1], parts[2].strip() or "/"))
    return found


def _folders_up(top, path):
    """TOP/PATH and each folder above it up to TOP: a limit on any of them binds this process."""
    rel = path.strip("/")
    while True:
        yield os.path.join(top, rel) if rel else top
        if not rel:
            return
        rel = os.path.dirname(rel)


def cgroup_cpu_limit(root="/sys/fs/cgroup", self_cgroup=None):
    """The CPU quota of this process's cgroup, in cores (1.5 for "150000 100000"), or None.

    ROOT is where the cgroup filesystem is mounted and SELF_CGROUP the text of
    /proc/self/cgroup (read when None): a test points both at a fake folder. Under
    v2 the quota is cpu.max; under v1 the cpu controller's cfs_quota_us/cfs_period_us.
    The smallest quota on the way up to ROOT binds (Slurm puts the job's limit on a
    parent of the step's cgroup)."""
    limits = []
    for controllers, path in _own_cgroups(self_cgroup):
        if controllers == "":                                  # v2: one unified tree
            limits += [_quota_v2(folder) for folder in _folders_up(root, path)]
        elif "cpu" in controllers.split(","):                  # v1: the cpu controller's tree
            top = os.path.join(root, controllers)
            if not os.path.isdir(top):
                top = os.path.join(root, "cpu")
            limits += [_quota_v1(folder) for folder in _folders_up(top, path)]
    # Inside a container the process's own cgroup is the mount's root: its path may not exist there.
    limits += [_quota_v2(root), _quota_v1(os.path.join(root, "cpu"))]
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def available_cores(cgroup_root="/sys/fs/cgroup", self_cgroup=None, affinity=None) -> tuple[int, str]:
    """(cores this process may use, where that number comes from)."""
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except (AttributeError, OSError):        # macOS has no affinity
            affinity = range(os.cpu_count() or 1)
    cores, why = max(1, len(affinity)), "this process's CPU affinity"
    if len(affinity) == (os.cpu_count() or len(affinity)):
        why = "all of the machine's"
    quota = cgroup_cpu_limit(cgroup_root, self_cgroup)
    # A fraction of a core left over is time shared with others: no thread of its own.
    if quota is not None and max(1, math.floor(quota)) < cores:
        cores, why = max(1, math.floor(quota)), f"cgroup CPU quota of {quota:g} cores"
    return cores, why


# ---- the node's load ----------------------------------------------------------------------------

def running_threads(path="/proc/loadavg"):
    """Runnable threads on this machine right now, the reader included (the fourth field of
    /proc/loadavg, "RUNNING/TOTAL"), or None where there is no such file."""
    words = _read_numbers(path)
    try:
        return int(words[3].split("/")[0])
    except (TypeError, IndexError, ValueError):
        return None


def _load_setting(environ):
    """("auto" | "ignore" | a count, None) or (None, what is wrong with RINGPIPE_NODE_LOAD)."""
    text = environ.get(LOAD_VARIABLE, "auto").strip().lower() or "auto"
    if text in ("auto", "ignore"):
        return text, None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if 0 <= n <= 1_000_000:
        return n, None
    return None, (f"{LOAD_VARIABLE}={environ[LOAD_VARIABLE]!r} is not auto, ignore or a count of other "
                  "programs' runnable threads (0 to 1000000); unset it to have ringpipe read the node's load")


def node_load(environ, own: int, cores: int, machine_cores: int | None = None, read=running_threads,
              sleep=time.sleep) -> tuple[int, str | None]:
    """(other programs' runnable threads on this process's CORES, how that was found; None when
    ringpipe did not look). The kernel counts runnable threads machine-wide, this job's OWN
    on this node among them (at start-up its ranks, this reader included; later each rank's
    compute threads, which may still be spinning); the median of a few readings
    ~2 ms apart smooths a passing blip. Where this process may use fewer cores than the
    machine has (an affinity set, a cgroup quota, a container), the others are assumed
    spread evenly over the machine's cores."""
    setting, _ = _load_setting(environ)
    if setting is None or setting == "ignore":
        return 0, None
    if setting != "auto":
        return setting, f"{LOAD_VARIABLE}={setting}"
    readings = []
    for i in range(LOAD_SAMPLES):
        if i:
            sleep(LOAD_GAP_S)
        n = read()
        if n is not None:
            readings.append(n)
    if not readings:
        return 0, None
    others = max(0, round(statistics.median(readings)) - own)
    machine = machine_cores or os.cpu_count() or cores
    if machine > cores:
        others = others * cores // machine
    return others, "the node's runnable threads, /proc/loadavg"


def check_load_setting(environ=None) -> None:
    """A ValueError saying what is wrong with RINGPIPE_NODE_LOAD (the trainer refuses it)."""
    _, problem = _load_setting(os.environ if environ is None else environ)
    if problem:
        raise ValueError(problem)


# ---- the choice -------------------------------------------------------------------------------

def _positive_int(text):
    try:
        n = int(text)
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def _ours(environ) -> dict:
    """{variable: value} ringpipe set in this process or the one that started it (MARKER)."""
    return dict(item.split("=", 1) for item in environ.get(MARKER, "").split(",") if "=" in item)


def user_settings(environ) -> dict:
    """{variable: value} of the thread and waiting settings in ENVIRON that ringpipe did not set itself."""
    ours = _ours(environ)
    return {v: environ[v] for v in COMPUTE_VARIABLES + (TOKENIZER_VARIABLE, "OMP_WAIT_POLICY") + tuple(YIELDING_WAITS)
            if v in environ and ours.get(v) != environ[v]}


def _plural(n, word):
    return f"{n} {word}{'s' if n != 1 else ''}"


class Choice:
    """What a process runs: PER_RANK compute threads on each of RANKS ranks of this node,
    which may use CORES cores (CORES_WHY says where that number comes from), beside OTHERS
    runnable threads of other programs (OTHERS_WHY: how that was found; None: not looked).
    USER holds the settings the user made ({name: value}); empty when ringpipe chose."""

    def __init__(self, per_rank: int, user: dict, ranks: int, cores: int, cores_why: str,
                 others: int = 0, others_why: str | None = None):
        self.per_rank, self.user, self.ranks, self.cores, self.cores_why = per_rank, user, ranks, cores, cores_why
        self.others, self.others_why = others, others_why

    @property
    def crowded(self) -> bool:
        """This node's runnable threads (this job's and the others') outnumber its cores:
        a thread that waits must give its core away, not spin on it."""
        return self.ranks * self.per_rank + self.others > self.cores

    @property
    def fair(self) -> int:
        """The threads per rank that fit beside the others' threads: at least one."""
        return max(1, min(self.cores, self.cores - self.others) // self.ranks)

    def _ranks(self):
        return _plural(self.ranks, "rank")

    def _cores(self):
        return f"{_plural(self.cores, 'core')} available to {self._ranks()} ({self.cores_why})"

    def describe(self) -> str:
        """The start-up line: "threads: 2 per rank (2 cores available to 1 rank, ...)"."""
        kept = f"; the user's settings kept: {self._settings()}" if self.user else ""
        busy = ""
        if self.others:
            busy = (f"; the node is busy: {_plural(self.others, 'other runnable thread')} on these cores "
                    f"({self.others_why})")
            if not self.user and self.per_rank < self.cores // self.ranks:
                busy += f", so {self.per_rank} per rank instead of {self.cores // self.ranks}"
        waits = "; waiting threads yield their core (OpenBLAS, MPI)" if self.crowded else ""
        return f"threads: {self.per_rank} per rank{kept}; {self._cores()}{busy}{waits}"

    def _settings(self):
        # An environment variable as NAME=VALUE, a call made at run time as name(value).
        return " ".join(f"{k}({v})" if "." in k else f"{k}={v}" for k, v in self.user.items())

    def warning(self) -> str | None:
        """What to do when the ranks and threads of this node outnumber its cores; None when they fit."""
        if self.ranks > self.cores:
            return (f"ringpipe: warning: {self._cores()} on this node: the ranks "
                    f"take turns on the cores and every collective waits for the slowest; start at most "
                    f"{self.cores} ranks per node (or give the job more cores)")
        settings = self._settings() or "the thread settings"
        advice = (f"set OMP_NUM_THREADS={self.fair} NUMBA_NUM_THREADS={self.fair} (or unset them: ringpipe then "
                  "chooses from the cores and the node's load)")
        if self.ranks * self.per_rank > self.cores:
            return (f"ringpipe: warning: {self._ranks()} x {self.per_rank} threads ({settings}) oversubscribe the "
                    f"{self._cores()}: the threads spin against each other and a step can be many times slower; "
                    f"{advice}")
        if self.user and self.crowded and self.per_rank > self.fair:
            return (f"ringpipe: warning: {self._ranks()} x {self.per_rank} threads ({settings}) share the "
                    f"{self._cores()} with {_plural(self.others, 'other runnable thread')} ({self.others_why}): "
                    f"the threads of one GEMM wait for each other while the others hold the cores; {advice}")
        return None


def choose(environ, ranks: int, cores: int, cores_why: str, others: int = 0,
           others_why: str | None = None) -> tuple[Choice, dict]:
    """(the choice, {variable: value} to set): the user's settings stay, the rest is the
    split among RANKS of the CORES that OTHERS (other programs' runnable threads) leave free,
    at least one thread each. OMP_NUM_THREADS alone, the general knob, stands for the
    library variables the user left unset. Where the node's threads would outnumber its
    cores, waiting yields (YIELDING_WAITS), unless the user set those too."""
    user = user_settings(environ)
    split = str(max(1, min(cores, cores - others) // ranks))
    general = user.get("OMP_NUM_THREADS") if _positive_int(user.get("OMP_NUM_THREADS")) else None
    to_set = {v: general or split for v in COMPUTE_VARIABLES if v not in user}
    if TOKENIZER_VARIABLE not in user:
        to_set[TOKENIZER_VARIABLE] = split
    if "OMP_WAIT_POLICY" not in user:
        to_set["OMP_WAIT_POLICY"] = "PASSIVE"
    counts = [_positive_int(user.get(v, to_set.get(v))) for v in COMPUTE_VARIABLES]
    per_rank = max([n for n in counts if n] or [int(split)])
    told = {v: user[v] for v in COMPUTE_VARIABLES if v in user}
    choice = Choice(per_rank, told, ranks, cores, cores_why, others, others_why)
    if choice.crowded:
        to_set.update({v: value for v, value in YIELDING_WAITS.items() if v not in user})
    return choice, to_set


# ---- applying it, once per process ------------------------------------------------------------

_state = {"choice": None, "warned": False, "report_warns": False}


def apply_defaults() -> Choice:
    """Set the thread defaults in os.environ (the first call; later ones return the same
    choice). Before numpy/Numba load, the variables are all it takes; for a library the
    user loaded before ringpipe, the limit is applied at run time where it can be."""
    if _state["choice"] is None:
        cores, why = available_cores()
        ranks = local_rank_count()
        others, others_why = node_load(os.environ, ranks, cores)
        choice, to_set = choose(os.environ, ranks, cores, why, others, others_why)
        # What a ringpipe parent set for its own node and this process does not want: gone.
        for v, value in _ours(os.environ).items():
            if v not in to_set and os.environ.get(v) == value:
                del os.environ[v]
        os.environ.update(to_set)
        os.environ[MARKER] = ",".join(f"{k}={v}" for k, v in to_set.items())
        _limit_loaded_numba(choice)
        if not set(COMPUTE_VARIABLES[:3]) & set(choice.user):
            _limit_loaded_blas(choice.per_rank)
        _state["choice"] = choice
    return _state["choice"]


def _limit_loaded_numba(choice: Choice) -> None:
    """Numba imported before ringpipe read its thread count already: set it at run time,
    unless the user chose one (NUMBA_NUM_THREADS, or numba.set_num_threads)."""
    numba = sys.modules.get("numba")
    if numba is None or "NUMBA_NUM_THREADS" in choice.user:
        return
    try:
        from numba.np.ufunc import parallel
        if parallel._is_initialized and numba.get_num_threads() != numba.config.NUMBA_NUM_THREADS:
            choice.user["numba.set_num_threads"] = str(numba.get_num_threads())
            choice.per_rank = max(choice.per_rank, numba.get_num_threads())
            return
        numba.set_num_threads(min(choice.per_rank, numba.config.NUMBA_NUM_THREADS))
    except (ImportError, AttributeError, ValueError, RuntimeError):
        return                                       # a Numba without these: its own default stays


def _limit_loaded_blas(per_rank: int) -> None:
    """numpy imported before ringpipe started its BLAS with a thread per core: lower it with
    threadpoolctl when that is installed, leaving alone a pool the user already resized
    (one whose count is not a core count)."""
    if "numpy" not in sys.modules:
        return
    try:
        import threadpoolctl
    except ImportError:
        return
    own_default = {os.cpu_count(), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    for pool in threadpoolctl.threadpool_info():
        if pool.get("user_api") == "blas" and per_rank < pool.get("num_threads", 0) and \
                pool.get("num_threads") in own_default:
            threadpoolctl.threadpool_limits(per_rank, user_api="blas")
            return


def leave_warning_to_report() -> None:
    """The trainer says the threads, and any warning, in its start-up report on rank 0."""
    _state["report_warns"] = True


def warn_once() -> None:
    """The oversubscription warning on stderr, once per process, from the launcher's rank 0
    only; not where a start-up report will say it (leave_warning_to_report)."""
    if _state["report_warns"] or _state["warned"]:
        return
    text = _setting_warning() or apply_defaults().warning()
    if text and launcher_rank() == 0:
        print(text, file=sys.stderr, flush=True)
        _state["warned"] = True


def report_lines() -> list[str]:
    """The start-up report's lines: the threads chosen and why, and the warning if not yet said."""
    choice = apply_defaults()
    lines = [choice.describe()]
    warning = _setting_warning() or choice.warning()
    if warning and not _state["warned"]:
        lines.append(warning)
        _state["warned"] = True
    return lines


def _setting_warning() -> str | None:
    """A RINGPIPE_NODE_LOAD nothing can use, for a library's user (the trainer refuses it)."""
    problem = _load_setting(os.environ)[1]
    return f"ringpipe: warning: {problem}; the node's load is not counted" if problem else None
