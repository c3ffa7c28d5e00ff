"""The dependency rules of ARCHITECTURE.md, checked against the code.

kernels/ (compute) and comm/ (MPI) know nothing of the engine, nor of each
other; kernels/ never touches MPI. Every import counts, the lazy ones inside
functions too.
"""
import ast
import os

import pytest

from tests.support import ROOT

# folder -> import names it must never use (top-level names, or ringpipe.<package>)
FORBIDDEN = {
    "kernels": ("mpi4py", "ringpipe.comm", "ringpipe.engine"),
    "comm": ("ringpipe.kernels", "ringpipe.engine"),
}


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


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(folder):
    broken = []
    for path in _files(folder):
        for line, module in _imports(path):
            for banned in FORBIDDEN[folder]:
                if module == banned or module.startswith(banned + "."):
                    broken.append(f"{os.path.relpath(path, ROOT)}:{line} imports {module}")
    assert not broken, "\n".join(broken)


def test_the_rules_see_an_import_that_breaks_them():
    """The checker itself: lazy imports of the engine and of MPI inside a kernels function are seen."""
    found = [m for _, m in _imports_of("def f():\n    from ..engine import config\n    import mpi4py\n",
                                       "ringpipe.kernels")]
    assert "ringpipe.engine.config" in found and "mpi4py" in found


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
