"""Installing ringpipe adds one import name, `ringpipe`, and shadows nothing.

Before the `ringpipe` namespace, `pip install .` put top-level packages named
`comm`, `kernels` and `engine` into site-packages: Jupyter's `comm` (a
dependency of ipykernel and ipywidgets) was overwritten, so its
`comm.create_comm` disappeared. This builds the wheel, installs it next to
Jupyter's `comm` in a fresh virtualenv, and checks both still work.
Needs pip's access to a package index (PyPI here, and in CI).
"""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy without build/: setuptools reuses a build/ folder left in the
    # checkout, whose stale files would stand in for packages setup.py no longer names.
    source = tmp_path_factory.mktemp("source") / "ringpipe"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "runs",
                                                                 "__pycache__", ".*_cache"))
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)])
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".whl")]
    return path


def test_the_wheel_holds_the_ringpipe_package_only(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert z.read(top_level).decode().split() == ["ringpipe"]
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"ringpipe"}, packages
    for sub in ("engine", "kernels", "comm"):
        assert f"ringpipe/{sub}/__init__.py" in names
    assert "ringpipe/kernels/cuda/sgemm.cu" in names          # the CUDA sources travel with it
    # Every package folder of the checkout is in it (a hand-kept list once left out engine/parallel/).
    for top, installed in (("engine", "ringpipe/engine"), ("kernels", "ringpipe/kernels"), ("comm", "ringpipe/comm")):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, top)).replace(os.sep, "/")
                member = f"{installed}/__init__.py" if rel == "." else f"{installed}/{rel}/__init__.py"
                assert member in names, f"the wheel lacks {member}"


def test_installs_next_to_jupyters_comm_without_breaking_it(wheel, tmp_path):
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    r = _run(pip + ["comm"])
    if r.returncode:
        pytest.skip(f"cannot install Jupyter's comm from the package index: {r.stderr.strip()[-300:]}")
    r = _run(pip + [wheel, "mpich"])                 # ringpipe and its dependencies (MPI from PyPI)
    assert r.returncode == 0, r.stderr[-3000:]
    code = ("import comm; assert callable(comm.create_comm), 'Jupyter comm is broken'; "
            "from ringpipe.comm import allreduce; from ringpipe import kernels; import ringpipe.engine.train.run; "
            "import ringpipe.engine.parallel, ringpipe.engine.parallel.pipeline.executor; "
            "print('ok', comm.__file__)")
    r = _run([str(venv / "bin" / "python"), "-c", code], cwd=str(tmp_path))      # not the checkout
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    assert "site-packages/comm/__init__.py" in r.stdout


def test_the_installed_wheel_does_the_whole_job(wheel, tmp_path):
    """Installed from the wheel (not editable) into a fresh venv, run outside the checkout:
    prepare, a 2-rank train, sample and export, as the README's path does. An import that
    only loads the package lazily proved nothing: a hand-kept package list once left out
    engine/parallel/, and every run of such an install failed."""
    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    r = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
              f"{wheel}[mpi,data,hf]"])
    if r.returncode and "No matching distribution" in r.stderr:
        pytest.skip(f"cannot install the dependencies from the package index: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path / "work"                          # not the checkout: only the installed package is found
    work.mkdir()
    (work / "notes.txt").write_text("the ring passes each chunk to its neighbour\n" * 300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", RINGPIPE_CACHE=str(tmp_path / "cache"))
    bin_ = venv / "bin"
    steps = [
        [bin_ / "ringpipe", "prepare", "notes.txt", "--out", "data", "--quiet"],
        [bin_ / "mpiexec", "-n", "2", bin_ / "ringpipe", "train", "--data", "data", "--steps", "2", "--layers", "1",
         "--d-model", "16", "--heads", "2", "--context", "16", "--batch-size", "4", "--sample-tokens", "0",
         "--out", "run", "--quiet"],
        [bin_ / "ringpipe", "finished", "run", "--ranks", "2"],
        [bin_ / "ringpipe", "sample", "run", "--tokens", "5", "--prompt", "the ring"],
        [bin_ / "ringpipe", "export", "run", "--out", "hf"],
    ]
    for command in steps:
        r = subprocess.run([str(c) for c in command], cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{' '.join(map(str, command[:3]))}: {r.stdout[-1500:]}{r.stderr[-3000:]}"
    assert (work / "hf" / "model.safetensors").is_file() and (work / "hf" / "config.json").is_file()
    # Every command's help, the package's module entry point and the second console script,
    # from the installed copy: each one's imports are found in the wheel, not in a checkout.
    from ringpipe.cli import COMMANDS
    helps = [[bin_ / "ringpipe", "--help"], [bin_ / "python", "-m", "ringpipe.train", "--help"],
             [bin_ / "ringpipe-train", "--help"]] + [[bin_ / "ringpipe", name, "--help"] for name in COMMANDS]
    for command in helps:
        r = subprocess.run([str(c) for c in command], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "usage" in r.stdout, f"{' '.join(map(str, command[-3:]))}: {r.stderr[-3000:]}"
    # Only `ringpipe` is installed: the checkout's tests/, benchmarks/ and slurm/ are no part of it.
    r = subprocess.run([str(bin_ / "python"), "-c", "import importlib.util as u; print([n for n in ("
                        "'ringpipe.tests', 'ringpipe.benchmarks', 'ringpipe.slurm', 'tests', 'benchmarks', 'slurm', "
                        "'engine', 'kernels', 'comm') if u.find_spec(n)])"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    where = subprocess.run([str(bin_ / "python"), "-c", "import ringpipe.engine.parallel as p; print(p.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True)
    assert str(venv) in where.stdout, where.stdout + where.stderr        # the installed copy ran
