"""Every example in README.md and docs/*.md runs as written, in order (issue 21).

What runs: each fenced ```bash block, the `$ ` lines of each ```console block, and each
```python block (fed to `python -`), of README.md and then of docs/*.md (in the reading order
docs/README.md lists them; a page it does not list is picked up by itself, after them, by name),
one block after another, in one fresh copy of the checkout (the files git knows, with the
working tree's contents), with the project's .venv first on PATH: the state a reader is in
who has run `make train` and follows the text from the top.

- Small step counts: in a training command (`ringpipe train`, `python -m ringpipe.train`),
  every step count (--steps, --checkpoint-every, --eval-every, --log-every, --warmup,
  --decay-steps) is divided by STEP_DIVISOR, rounded up, and one without --steps gets the
  default 300 divided so (3): the markdown keeps what a user would type, and a
  `--resume auto --steps 600` still continues a run that had 300.
- Skips, each with its reason in the markdown, on the last line before the block:
  `<!-- example: skip (REASON) -->` never runs here (GPUs, real clusters, the test suite
  itself); `<!-- example: needs NAME -->` runs where NAME (a key of NEEDS) is present.
  Every other fence names a language that is not run (```text, ```json).
- The state `make train` leaves: the setup runs the Makefile's own `train` recipe with 3 steps
  (runs/gpt, the stdlib shards in ~/.cache/ringpipe). `my_texts/`, the reader's own text in
  the README's walk-through, is a few of the Python standard library's modules copied as .txt.
- Nothing outside the copy is written: HOME is a temp folder beside it, XDG_* and RINGPIPE_*
  variables are dropped, PYTHONPATH makes `ringpipe` the copy's code (so its Numba cache is
  the copy's), and both are removed afterwards.
"""
import importlib.util
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_DIVISOR = 100
STEP_FLAGS = ("--steps", "--checkpoint-every", "--eval-every", "--log-every", "--warmup", "--decay-steps")
DEFAULT_STEPS = 300                 # ringpipe train's --steps default (Config.steps; checked below)
BLOCK_TIMEOUT_S = 600               # a block that takes longer has hung: its process group is killed
RUNNABLE = ("bash", "sh", "shell", "console", "python")
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
# `<!-- example: needs NAME -->`: NAME -> (is it here?, what to install when not)
NEEDS = {
    "fashion-mnist": (lambda: os.path.isdir(FASHION_MNIST_DIR), "apt-get install dataset-fashion-mnist"),
    "gpu": (lambda: importlib.util.find_spec("cupy") is not None and shutil.which("nvidia-smi") is not None,
            "an NVIDIA GPU and CuPy: pip install cupy-cuda12x"),
}
MARKER = re.compile(r"<!--\s*example:\s*(.*?)\s*-->")
FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")
TRAIN_COMMAND = re.compile(r"(\bringpipe(?:\s+|\.|-)train\b)")
# The copy's .venv is the project's own: `make` must never rebuild it from the copy (an editable
# install would then point at a folder this test deletes), and no example may install into it.
MAKE_KEEPS_VENVS = "make -o .venv/.installed -o .venv-openmpi/.installed"
NOT_HERE = re.compile(r"\bmake\s+(?:\S+\s+)*test\b|\bpip\s+install\b|\bpython3?\s+-m\s+venv\b|run_all\.sh")


@dataclass
class Block:
    where: str          # "README.md:115"
    language: str
    lines: list          # the block's text, line by line
    marker: str | None   # the text of its `<!-- example: ... -->`, if any

    def commands(self) -> list:
        """The commands a reader types, one logical line each (a trailing backslash continues);
        a python block is one command: python reading it."""
        if self.language == "python":
            return ["python - <<'END_OF_EXAMPLE'\n" + "\n".join(self.lines) + "\nEND_OF_EXAMPLE"]
        if self.language == "console":
            typed, continuing = [], False
            for ln in self.lines:
                if ln.startswith("$ ") or continuing:
                    typed.append(ln[2:] if ln.startswith("$ ") else ln)
                    continuing = ln.endswith("\\")
            lines = typed
        else:
            lines = self.lines
        return [c for c in "\n".join(lines).replace("\\\n", " ").split("\n") if c.strip()]

    def skip_reason(self) -> str | None:
        """Why this block does not run here; None when it does."""
        if self.marker is None:
            return None
        skip = re.fullmatch(r"skip \((.+)\)", self.marker)
        if skip:
            return skip.group(1)
        need = re.fullmatch(r"needs ([\w-]+)", self.marker)
        if not need or need.group(1) not in NEEDS:
            raise ValueError(f"{self.where}: example marker '{self.marker}': write 'skip (REASON)' "
                             f"or 'needs NAME', NAME one of {sorted(NEEDS)}")
        present, install = NEEDS[need.group(1)]
        return None if present() else f"needs {need.group(1)} ({install})"


def markdown_files() -> list:
    """README.md, then docs/README.md, then docs' pages in the order its index lists them (a page
    builds on the pages before it: docs/data.md prepares the data/mine docs/data-format.md reads),
    then any page the index does not list, by name."""
    docs = os.path.join(ROOT, "docs")
    names = sorted(n for n in os.listdir(docs) if n.endswith(".md")) if os.path.isdir(docs) else []
    listed = docs_reading_order(os.path.join(docs, "README.md"))
    ordered = [n for n in listed if n in names] + [n for n in names if n not in listed]
    return [os.path.join(ROOT, "README.md")] + [os.path.join(docs, n) for n in ordered]


def docs_reading_order(index: str) -> list:
    """The pages docs/README.md links to (`](page.md)`), in the order of their first link, itself first."""
    if not os.path.isfile(index):
        return []
    linked = re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", open(index, encoding="utf-8").read())
    return list(dict.fromkeys(["README.md"] + linked))


def fenced_blocks(path: str) -> list:
    """Every fenced block of a markdown file, with the example marker on the last line before it."""
    rel = os.path.relpath(path, ROOT)
    lines = open(path, encoding="utf-8").read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        above = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        marker = MARKER.search(above)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(opening.group(1))), len(lines))
        blocks.append(Block(f"{rel}:{i + 1}", opening.group(2), lines[i + 1:end],
                            marker.group(1) if marker else None))
        i = end + 1
    return blocks


def all_blocks() -> list:
    return [b for path in markdown_files() for b in fenced_blocks(path)]


def example_blocks() -> list:
    return [b for b in all_blocks() if b.language in RUNNABLE]


def as_run_here(command: str) -> str:
    """The command as this test runs it: small step counts, the project's .venv kept."""
    return small_steps(re.sub(r"^(\s*)make\b", rf"\1{MAKE_KEEPS_VENVS}", command))


def small_steps(command: str) -> str:
    """A training command with its step counts divided by STEP_DIVISOR (rounded up)."""
    if not TRAIN_COMMAND.search(command):
        return command

    def divided(match):
        return f"{match.group(1)}{match.group(2)}{max(1, math.ceil(int(match.group(3)) / STEP_DIVISOR))}"
    flags = "|".join(re.escape(f) for f in STEP_FLAGS)
    command = re.sub(rf"({flags})(\s+|=)(\d+)\b", divided, command)
    if not re.search(r"--steps\b", command):
        command = TRAIN_COMMAND.sub(rf"\1 --steps {math.ceil(DEFAULT_STEPS / STEP_DIVISOR)}", command, count=1)
    return command


# ---- checks of the markdown itself (fast) -------------------------------------------------

def test_every_fence_names_a_language_and_every_marker_a_known_reason():
    assert example_blocks(), "no example found in README.md: has the parser broken?"
    for block in all_blocks():
        assert block.language, (f"{block.where}: a fence without a language; say ```bash for commands "
                                "a reader types, ```text for output or file listings")
        if block.marker is not None:
            assert block.language in RUNNABLE, f"{block.where}: an example marker on a ```{block.language} block"
            block.skip_reason()     # raises on a marker that is neither form
        if block.language in RUNNABLE and not (block.marker or "").startswith("skip"):
            unsafe = [c for c in block.commands() if NOT_HERE.search(c)]
            assert not unsafe, (f"{block.where}: {unsafe} would run the test suite or install into the "
                                "project's .venv, which the examples' copy shares: mark the block "
                                "<!-- example: skip (REASON) -->")


def test_step_counts_get_small_and_the_rest_of_the_command_stays():
    try:
        from ringpipe.engine.train.config import Config
    except ImportError:                  # engine/ before it was split by concern (issue 22)
        from ringpipe.engine.config import Config
    assert Config().steps == DEFAULT_STEPS
    assert small_steps("mpiexec -n 4 ringpipe train --dp 4 --out runs/dp4   # DP") == \
        "mpiexec -n 4 ringpipe train --steps 3 --dp 4 --out runs/dp4   # DP"
    assert small_steps("ringpipe train --resume auto --steps 600 --checkpoint-every=50 --eval-every 100") == \
        "ringpipe train --resume auto --steps 6 --checkpoint-every=1 --eval-every 1"
    assert small_steps("python -m ringpipe.train --steps 20") == "python -m ringpipe.train --steps 1"
    assert small_steps("ringpipe sample runs/mine --tokens 40") == "ringpipe sample runs/mine --tokens 40"
    assert as_run_here("make train NP=2") == f"{MAKE_KEEPS_VENVS} train NP=2"
    console = Block("x.md:1", "console", ["$ ringpipe prepare a \\", "  --out b", "prepared b", "$ ls"], None)
    assert console.commands() == ["ringpipe prepare a    --out b", "ls"]


# ---- running them -------------------------------------------------------------------------

def copy_checkout(dest: str) -> None:
    """The files git knows (tracked, and new ones it does not ignore), as the working tree has
    them, with their times (make then sees nothing to rebuild); the Numba cache too, which a
    reader's `make train` has filled."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    cache = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(os.path.join(ROOT, "kernels"))
             for f in files if f.endswith((".nbi", ".nbc"))]
    for rel in [p for p in listed if p] + cache:
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src) and not os.path.islink(src):      # a file deleted in the working tree is not copied
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    os.symlink(sys.prefix, os.path.join(dest, ".venv"))
    # The copy's ringpipe/ made the whole package (its engine/, kernels/, comm/ linked in, as
    # setup.py maps them), so that `ringpipe` found from the copy is all of the copy's code.
    spec = importlib.util.spec_from_file_location("package_view", os.path.join(dest, "benchmarks", "package_view.py"))
    package_view = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(package_view)
    package_view.link_subpackages(os.path.join(dest, "ringpipe"), dest)


def reader_environment(checkout: str, home: str) -> dict:
    """A reader's shell: the .venv active, installed from this checkout, a home of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGPIPE_", "XDG_", "VIRTUAL_ENV"))}
    env.update(HOME=home, PATH=os.path.join(sys.prefix, "bin") + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=checkout,     # the editable install names the real checkout: the copy goes first
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1")
    return env


def run_commands(commands: list, cwd: str, env: dict) -> tuple:
    """Runs the commands as one bash script that stops at the first failure, naming it."""
    script = "\n".join(["set -eo pipefail",
                        "trap 'echo \"example failed (exit $?): $BASH_COMMAND\" >&2' ERR"] + commands)
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = proc.communicate(timeout=BLOCK_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0] + f"\n(killed after {BLOCK_TIMEOUT_S} s)".encode()
    return proc.returncode, out.decode("utf-8", "replace")


def give_my_texts(checkout: str) -> None:
    """my_texts/: the reader's own text of the README's walk-through, here about 1 MB of the
    standard library's modules copied as .txt."""
    os.makedirs(os.path.join(checkout, "my_texts"))
    stdlib, size = os.path.dirname(os.__file__), 0
    for name in sorted(n for n in os.listdir(stdlib) if n.endswith(".py")):
        if size > 1 << 20:
            break
        shutil.copy(os.path.join(stdlib, name), os.path.join(checkout, "my_texts", name[:-3] + ".txt"))
        size += os.path.getsize(os.path.join(stdlib, name))


@pytest.fixture(scope="module")
def reader():
    """A fresh copy of the checkout after `make train` (3 steps): (its folder, the environment)."""
    if not os.path.exists(os.path.join(ROOT, ".git")) or shutil.which("git") is None:   # a worktree's .git is a file
        pytest.skip("needs a git checkout (the examples run in a copy of its files)")
    top = tempfile.mkdtemp(prefix="ringpipe-examples-")
    checkout, home = os.path.join(top, "ringpipe"), os.path.join(top, "home")
    os.makedirs(home)
    try:
        copy_checkout(checkout)
        give_my_texts(checkout)
        env = reader_environment(checkout, home)
        make_train = f"{MAKE_KEEPS_VENVS} train ARGS='--steps {math.ceil(DEFAULT_STEPS / STEP_DIVISOR)}'"
        rc, out = run_commands([make_train], checkout, env)
        assert rc == 0, f"{make_train} failed:\n{out[-3000:]}"
        yield checkout, env
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("block", example_blocks(), ids=lambda b: b.where)
def test_example_runs_as_written(block, reader):
    """One block, run after the ones before it (pytest runs them in order)."""
    reason = block.skip_reason()
    if reason:
        pytest.skip(f"{block.where}: {reason}")
    checkout, env = reader
    commands = [as_run_here(c) for c in block.commands()]
    rc, out = run_commands(commands, checkout, env)
    assert rc == 0, (f"{block.where} fails as written (run after the examples before it), exit {rc}:\n"
                     + "\n".join(commands) + f"\n---- output (its end) ----\n{out[-4000:]}")
