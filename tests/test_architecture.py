"""The dependency rules of ARCHITECTURE.md, checked against the code.

kernels/ (compute) and comm/ (MPI) know nothing of the engine, nor of each
other; kernels/ never touches MPI. Inside engine/, each folder is one concern
with one rule (its __init__.py says it too): the model knows no MPI, the
planner only the standard library, data and job control know neither the
model nor the program, and only train/ may import everything. Every import
counts, the lazy ones inside functions too.
"""
import ast
import os
import sys

import pytest

from tests.support import ROOT

E = "ringpipe.engine."
# folder -> import names it must never use (top-level names, or ringpipe.<package>...)
FORBIDDEN = {
    "kernels": ("mpi4py", "ringpipe.comm", "ringpipe.engine"),
    "comm": ("ringpipe.kernels", "ringpipe.engine"),
    # No MPI: a model is the same on one process and on many.
    "engine/model": ("mpi4py", "ringpipe.comm", E + "parallel", E + "schedules", E + "data", E + "job",
                     E + "train", E + "interop"),
    "engine/parallel": (E + "train", E + "interop", E + "data"),
    "engine/data": (E + "model", E + "parallel", E + "schedules", E + "train", E + "interop"),
    "engine/job": (E + "model", E + "parallel", E + "schedules", E + "data", E + "train", E + "interop"),
    # A checkpoint is read and written on one process; the step loop is train/'s alone.
    "engine/interop": (E + "parallel", E + "schedules", E + "train"),
    # Watching a job: measures and files; the tools read files only (no model, no loop).
    "engine/monitor": (E + "model", E + "parallel", E + "schedules", E + "data", E + "train", E + "interop"),
    "engine/train": (),          # the program: on top, it may import every other folder
}
# The narrower names a folder may use inside one it may not: the model raises the engine's
# errors and copies arrays off the GPU (two leaves of job/ that import nothing of it);
# interop reads a run's Config, never the loop.
EXCEPT = {
    "engine/model": (E + "job.errors", E + "job.array_module"),
    "engine/interop": (E + "train.config",),
}
# The pure planner: the standard library only, so `ringpipe pipeline` runs anywhere
# (matplotlib only inside plot_timeline, for --plot).
STDLIB_ONLY = {"engine/schedules": ("ringpipe.engine.schedules", "matplotlib")}


def _under(module, names):
    return any(module == n or module.startswith(n + ".") for n in names)


def _breaks(folder, module) -> bool:
    """Does importing `module` break the rule of `folder`?"""
    if folder.startswith("engine/") and module == "ringpipe.engine":
        return True              # the front door is the users': inside, name the module that defines it
    if folder in STDLIB_ONLY:
        top = module.split(".")[0]
        return not (top in sys.stdlib_module_names or _under(module, STDLIB_ONLY[folder]))
    return _under(module, FORBIDDEN[folder]) and not _under(module, EXCEPT.get(folder, ()))


RULES = sorted(FORBIDDEN) + sorted(STDLIB_ONLY)


def _imports(path):
    """Every module a file imports, absolute (relative imports resolved)."""
    package = "ringpipe." + os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, ".")
    return _imports_of(open(path).read(), package)


def _imports_of(source, package):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            yield node.lineno, module
            for alias in node.names:               # from ringpipe import comm
                yield node.lineno, f"{module}.{alias.name}"


def _files(folder):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def _package(folder):
    return "ringpipe." + folder.replace("/", ".")


@pytest.mark.parametrize("folder", RULES)
def test_lower_layers_do_not_import_upper_ones(folder):
    broken = []
    for path in _files(folder):
        for line, module in _imports(path):
            if _breaks(folder, module):
                broken.append(f"{os.path.relpath(path, ROOT)}:{line} imports {module}")
    assert not broken, "\n".join(broken)


def test_every_engine_folder_has_a_rule():
    """A new folder under engine/ gets a rule before it gets code."""
    engine = os.path.join(ROOT, "engine")
    folders = {f"engine/{d}" for d in os.listdir(engine)
               if os.path.isfile(os.path.join(engine, d, "__init__.py"))}
    assert folders == {r for r in RULES if r.startswith("engine/")}


def test_the_rules_see_an_import_that_breaks_them():
    """The checker itself: lazy imports of the engine and of MPI inside a kernels function are seen."""
    found = [m for _, m in _imports_of("def f():\n    from ..engine import config\n    import mpi4py\n",
                                       "ringpipe.kernels")]
    assert "ringpipe.engine.config" in found and "mpi4py" in found


# One import each folder's rule refuses, written as a newcomer might (lazy, relative, or
# through the front door), and one it allows: the checker must tell them apart.
BREAKING = {
    "kernels": ("def f():\n    import mpi4py\n", "import numpy\n"),
    "comm": ("from ..engine.job import checkpoint\n", "import mpi4py\n"),
    "engine/model": ("def f():\n    from ringpipe import comm\n", "from ..job.errors import ConfigError\n"),
    "engine/parallel": ("def f():\n    from ..train.config import Config\n", "from ..schedules import validate\n"),
    "engine/data": ("from ..model.gpt import GPTConfig\n", "from ..job import files\n"),
    "engine/job": ("def f():\n    from ringpipe.engine.data import shards\n", "from . import rundir\n"),
    "engine/interop": ("from ..train.run import run\n", "from ..train.config import Config\n"),
    "engine/monitor": ("from ..parallel.data import DataParallel\n", "from ..job.files import read_json\nimport mpi4py\n"),
    "engine/schedules": ("def f():\n    import numpy\n", "from collections import deque\nfrom . import schedule\n"),
    "engine/train": ("from ringpipe.engine import run\n", "from ..interop import hf\nimport mpi4py\n"),
}


@pytest.mark.parametrize("folder", RULES)
def test_each_rule_fails_on_an_import_it_forbids(folder):
    """Adding a forbidden import to any folder's code is caught; an allowed one is not."""
    bad, good = BREAKING[folder]
    assert any(_breaks(folder, m) for _, m in _imports_of(bad, _package(folder))), (folder, bad)
    assert not any(_breaks(folder, m) for _, m in _imports_of(good, _package(folder))), (folder, good)


def test_the_model_may_use_two_leaves_of_job_only():
    """job/'s errors and array_module, yes; the rest of job/ (checkpoints, signals), no."""
    assert not _breaks("engine/model", "ringpipe.engine.job.errors.ConfigError")
    assert _breaks("engine/model", "ringpipe.engine.job.checkpoint")
    assert _breaks("engine/model", "ringpipe.engine.job")


# The dead code that sat after a `return` in comm/safety.py (the abort handler's
# old home) before the linter ran in CI: it named variables that did not exist.
DEAD_CODE = """
import threading
_contexts_lock = threading.Lock()

def context_for(comm):
    ctx = comm
    return ctx
    ctx = CommContext(comm)
    with _contexts_lock:
        _contexts[key] = ctx
    return ctx
"""


def test_the_linter_ci_runs_catches_undefined_names():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", os.path.join(ROOT, "ruff.toml"),
                        "--stdin-filename", "dead.py", "-"], input=DEAD_CODE, capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    for name in ("CommContext", "_contexts", "key"):
        assert f"Undefined name `{name}`" in r.stdout, r.stdout


# ---- a model is a recipe (engine/model/recipe.py) ---------------------------------------

def _family_names():
    from ringpipe.engine.model.registry import RECIPES
    return set(RECIPES)


def _names_a_model(node) -> bool:
    """cfg.model, manifest["model"], model_kind, model: an expression that holds a family's name."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("model", "model_kind")
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "model"
    return isinstance(node, ast.Name) and node.id in ("model", "model_kind")


def _strings(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for element in node.elts:
            yield from _strings(element)


def _model_branches(source, families):
    """Lines that compare a model's name with a string (`cfg.model == "gpt"`, `kind in ("gpt",)`),
    or anything with a family's name (`"mlp" != name`): a branch on the model kind."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        strings = {s for operand in operands for s in _strings(operand)}
        if strings & families or (strings and any(_names_a_model(operand) for operand in operands)):
            yield node.lineno


# The files outside engine/model/ that may name a family: none. (The checkpoint format's key
# table in job/checkpoint.py names them as dict keys, not in a branch.)
MAY_NAME_A_FAMILY = set()


def test_no_branch_on_the_model_kind_outside_the_recipes():
    """The trainer, the config checks, reporting and interop ask the model's recipe; only
    engine/model/ (where each family's recipe lives) may name a family in a comparison."""
    families = _family_names()
    found = [f"{os.path.relpath(path, ROOT)}:{line}" for path in _files("engine")
             if not os.path.relpath(path, ROOT).startswith(os.path.join("engine", "model") + os.sep)
             and os.path.relpath(path, ROOT).replace(os.sep, "/") not in MAY_NAME_A_FAMILY
             for line in _model_branches(open(path).read(), families)]
    assert not found, "a branch on the model kind (ask the recipe instead):\n" + "\n".join(found)


@pytest.mark.parametrize("source", ['if cfg.model == "gpt":\n    pass\n',
                                    'unit = "tokens" if r.cfg.model != "mlp" else "examples"\n',
                                    'if manifest["model"] in ("gpt", "other"):\n    pass\n',
                                    'ok = model_kind == "toy"\n',
                                    'ok = "gpt" == name\n'])
def test_the_model_branch_check_sees_one(source):
    assert list(_model_branches(source, {"gpt", "mlp"})), source


def test_the_model_branch_check_lets_other_comparisons_be():
    source = ('if r.manifest.get("model") != r.cfg.model:\n    pass\n'
              'if cfg.dataset == "stdlib" and recipe.data == "tokens":\n    pass\n')
    assert not list(_model_branches(source, {"gpt", "mlp"}))


# ---- no import circles (issue 34) ---------------------------------------------------------------
#
# A module that imports the module which dispatches to it ties the two into one: neither can
# be read, tested or changed alone, and which half loads first decides what works. Imports
# inside functions count: a lazy import hides a circle from the import order, not from the
# reader (both circles issue 34 named ran through one: comm/hierarchical.py imported
# comm/collectives.py inside allreduce_hierarchical, and kernels/backend.py imported bf16.py
# inside set_num_threads, whose reference.py imported backend.py back).

CYCLE_FOLDERS = ("kernels", "comm", "engine")
# Circles known and not yet untied, each with its reason, by file. Remove an entry when its
# circle is gone (test_the_known_circles_are_still_there says so).
KNOWN_CYCLES = set()


def _module_files(folders):
    """{module name: file} of every module under `folders` (a package by its __init__.py)."""
    found = {}
    for folder in folders:
        for path in _files(folder):
            rel = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
            found["ringpipe." + rel.removesuffix(".__init__")] = path
    return found


def _import_graph(folders):
    """{module: the modules of `folders` it imports}, lazy imports included. `from package
    import name` is an edge to the submodule `name` when there is one, else to the package."""
    modules = _module_files(folders)
    graph = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in modules:          # numpy, or a name inside a module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def _cycles(graph):
    """The circles of `graph`: its strongly connected components of more than one module
    (Tarjan's algorithm, iterative), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _as_files(cycle, files):
    return frozenset(os.path.relpath(files[m], ROOT).replace(os.sep, "/") for m in cycle)


def test_no_module_imports_one_that_imports_it_back():
    """No import circle among the modules of kernels/, comm/ and engine/ (but the known ones)."""
    files = _module_files(CYCLE_FOLDERS)
    circles = [_as_files(c, files) for c in _cycles(_import_graph(CYCLE_FOLDERS))]
    new = [sorted(c) for c in circles if c not in KNOWN_CYCLES]
    assert not new, ("import circles (a lower module must not import the one that dispatches to it: move "
                     "the piece both need into the lower module or a leaf):\n" + "\n".join(map(str, new)))


def test_the_known_circles_are_still_there():
    files = _module_files(CYCLE_FOLDERS)
    circles = {_as_files(c, files) for c in _cycles(_import_graph(CYCLE_FOLDERS))}
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in circles]
    assert not gone, f"untied: remove from KNOWN_CYCLES {gone}"


def test_the_circle_check_sees_a_lazy_circle_and_lets_a_chain_be():
    """The checker itself: a -> b -> c -> a (c's import inside a function) is one circle; a -> b -> c is none."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    found = [m for _, m in _imports_of("def f():\n    from .collectives import allreduce\n", "ringpipe.comm")]
    assert "ringpipe.comm.collectives" in found


# ---- functions stay short (the house keeps them <= 100 lines) ----------------------------------

MAX_FUNCTION_LINES = 100
LENGTH_FOLDERS = ("kernels", "comm", "engine", "ringpipe")
# Functions over the limit, not yet split, with the length they may not grow past. Remove an
# entry once its function is split (test_the_known_long_functions_are_still_long says so).
KNOWN_LONG: dict = {}


def _long_in(source, limit=MAX_FUNCTION_LINES):
    """{name: lines} of every function (and method, and nested function) of `source` of more
    than `limit` lines: from its def to its last line, decorators left out."""
    return {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit}


def _long_functions(folders):
    """{"path:name": lines} of the functions over the limit in `folders`."""
    return {f"{os.path.relpath(path, ROOT).replace(os.sep, '/')}:{name}": lines
            for folder in folders for path in _files(folder) for name, lines in _long_in(open(path).read()).items()}


def test_every_function_is_at_most_100_lines():
    found = _long_functions(LENGTH_FOLDERS)
    over = {k: n for k, n in found.items() if k not in KNOWN_LONG or n > KNOWN_LONG[k]}
    assert not over, ("functions over the house's 100 lines (split them into named parts that each say what "
                      "they do):\n" + "\n".join(f"  {k}: {n} lines" for k, n in sorted(over.items())))


def test_the_known_long_functions_are_still_long():
    found = _long_functions(LENGTH_FOLDERS)
    split = [k for k in KNOWN_LONG if k not in found]
    assert not split, f"now within the limit: remove from KNOWN_LONG {split}"


def test_the_length_check_counts_a_function_from_def_to_its_last_line():
    """The checker itself: 101 lines (a def and 100 of body) is one too many, decorators aside;
    a method or a nested function is seen too."""
    body = "    x = 1\n" * 99
    source = ("@decorator\ndef f():\n" + body + "    return x\n"
              "def g():\n" + body + "\n"
              "class C:\n    def m(self):\n" + "    " + body.replace("\n", "\n    ").rstrip() + "\n        return 1\n")
    assert _long_in(source) == {"f": 101, "m": 101}
