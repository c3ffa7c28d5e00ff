"""The checkout's top folders step aside for the packages whose names they share.

The repository keeps kernels/, comm/ and engine/ at its top; setup.py installs them as
ringpipe.kernels, ringpipe.comm and ringpipe.engine. But Python started in the repository's
root (where the docs tell a reader to be) puts that folder first on sys.path, so a plain
`import kernels` finds kernels/ before Hugging Face's `kernels` package (which transformers 5
imports), and `import comm` finds comm/ before Jupyter's. Each of those folders' __init__.py,
run under its top-level name instead of ringpipe.<name>, calls step_aside: the next package of
that name on the path (or from another import hook) is loaded in its place, and sys.modules
holds that one (the import machinery reads sys.modules[name] again after the module ran, so a
module may put another in its place). With no other package of the name the import fails,
saying the folder is ringpipe's and how to import it.

Standard library only, and loaded by path from those __init__.py files, not imported: importing
`ringpipe` would set the thread defaults (ringpipe/threads.py) in a process that only wanted
transformers.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

# What every stepping-aside __init__.py holds, as it loads this file: it tells one of ringpipe's
# folders (this checkout's, another checkout's, a package view's) from the package to find.
MARK = "_shadowing.py"


def step_aside(name: str, init_file: str) -> None:
    """Puts the package `name` that is not ringpipe's into sys.modules[name], loaded; called from
    the __init__.py (init_file) of ringpipe's folder of that name, imported under it."""
    spec = find_other(name)
    if spec is None:
        folder = os.path.dirname(os.path.abspath(init_file))
        raise ModuleNotFoundError(
            f"No module named {name!r} other than ringpipe's folder {folder}, found first on sys.path "
            f"(Python started in ringpipe's checkout puts the checkout there). That folder is "
            f"ringpipe.{name}: `import ringpipe.{name}` (installed by `make train` or `pip install -e .`); "
            f"for another package called {name!r}, install it.", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        # as a failed import leaves it: no half-made module under the name
        sys.modules.pop(name, None)
        raise


def find_other(name: str):
    """The spec Python would find for the top-level `name` if ringpipe's folders of that name were
    not there: the import hooks in their order, the path without the entries that hold one."""
    path = [entry for entry in sys.path
            if not (isinstance(entry, str) and is_ringpipes(os.path.join(entry or os.getcwd(), name, "__init__.py")))]
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(name, path)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, None)
        else:
            spec = None
        # a spec with no loader is a folder without __init__.py (a namespace portion), not a package
        if spec is not None and spec.loader is not None and not is_ringpipes(spec.origin):
            return spec
    return None


def is_ringpipes(init_file) -> bool:
    """Is init_file the __init__.py of one of ringpipe's stepping-aside folders?"""
    if not init_file or os.path.basename(init_file) != "__init__.py" or not os.path.isfile(init_file):
        return False
    with open(init_file, encoding="utf-8", errors="replace") as f:
        return MARK in f.read()
