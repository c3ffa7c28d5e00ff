"""benchmarks/package_view.py: the package setup.py installs, made of links into the checkout,
for a machine with no pip (benchmarks/gpu_check.sh). A checkout's ringpipe/ alone is not it.

Each child runs from where gpu_check.sh runs its steps, with it on PYTHONPATH: a module found
there comes before the editable install (which maps the same checkout, so the files are
told apart by the path they were found at)."""
import ast
import os
import subprocess
import sys

from tests.support import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import package_view  # noqa: E402

WHERE = ("import importlib.util, ringpipe.engine.schedules as s, ringpipe.kernels.ops as k; "
         "print(s.__file__); print(k.__file__); print(importlib.util.find_spec('ringpipe.comm').origin)")


def python_in(where, code, *flags):
    """`python -c code` run from `where` with it on PYTHONPATH, as gpu_check.sh runs its steps."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([sys.executable, *flags, "-c", code], env=dict(env, PYTHONPATH=where), cwd=where,
                          capture_output=True, text=True, timeout=60)


def test_the_view_imports_the_checkouts_own_code(tmp_path):
    view = package_view.make_view(str(tmp_path / "view"))
    r = python_in(view, WHERE)
    assert r.returncode == 0, r.stderr
    assert all(line.startswith(os.path.join(view, "ringpipe", "")) for line in r.stdout.split()), r.stdout
    files = [os.path.realpath(line) for line in r.stdout.split()]
    assert files == [os.path.join(ROOT, "engine", "schedules", "__init__.py"), os.path.join(ROOT, "kernels", "ops.py"),
                     os.path.join(ROOT, "comm", "__init__.py")]
    # Run from the view, the checkout's other folders are where a checkout has them.
    assert os.path.realpath(os.path.join(view, "tests", "support")) == os.path.join(ROOT, "tests", "support")


def test_a_checkout_never_installed_is_not_the_package_without_the_view():
    # ringpipe/ no longer appends the checkout to its __path__: the package on disk is the one imported.
    r = python_in(ROOT, "import ringpipe.engine", "-S")      # -S: no site-packages, no editable install
    assert r.returncode != 0 and "No module named 'ringpipe.engine'" in r.stderr


def test_the_view_is_never_written_over(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "package_view.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "exists already" in r.stderr


def test_the_view_maps_the_folders_setup_py_installs():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    top = next(ast.literal_eval(node.value) for node in tree.body
               if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TOP")
    assert top == {"ringpipe": "ringpipe", **{f"ringpipe.{name}": folder
                                              for name, folder in package_view.SUBPACKAGES.items()}}
