"""The checkout as an installed ringpipe sees it, made of links, for a machine that cannot pip install.

    cd "$(python3 benchmarks/package_view.py DEST)" && export PYTHONPATH=$PWD    # then run as from the checkout

setup.py installs the checkout's top folders as one package: ringpipe/ as `ringpipe`, engine/
as `ringpipe.engine`, kernels/ as `ringpipe.kernels`, comm/ as `ringpipe.comm`. A checkout that
was never installed has no such package (ringpipe/ does not hold engine/), and the package does
not pretend otherwise. Where pip is missing (a lent GPU machine: benchmarks/gpu_check.sh), DEST
is the checkout again, every top entry a symbolic link to the checkout's, except ringpipe/: a
folder of links to ringpipe/'s files with engine/, kernels/, comm/ under it, the package setup.py
would install. Run from DEST (python -m puts the working folder first on the path, so it must be
DEST's ringpipe/ there), with DEST on PYTHONPATH. The code is the checkout's own: nothing is
copied, nothing in the checkout changes. Standard library only: it runs before anything is installed.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ringpipe's subpackages and the checkout folders they are, as setup.py's TOP maps them
# (tests/benchmarks/test_package_view.py checks the two agree).
SUBPACKAGES = {"engine": "engine", "kernels": "kernels", "comm": "comm"}


def make_view(dest: str, root: str = ROOT) -> str:
    """Writes dest (links into root) and returns it. dest must not exist yet: a view is made
    once, in a folder of its own, and never written over."""
    if os.path.lexists(dest):
        raise FileExistsError(f"{dest} exists already: give package_view.py a path that does not")
    package = os.path.join(dest, "ringpipe")
    os.makedirs(package)
    for name in sorted(os.listdir(root)):
        if name != "ringpipe":
            os.symlink(os.path.join(root, name), os.path.join(dest, name))
    link_subpackages(package, root)
    for name in sorted(os.listdir(os.path.join(root, "ringpipe"))):
        if name != "__pycache__":
            os.symlink(os.path.join(root, "ringpipe", name), os.path.join(package, name))
    return dest


def link_subpackages(package: str, root: str) -> None:
    """engine/, kernels/, comm/ of root linked into the folder `package`, as setup.py maps them."""
    for name, folder in SUBPACKAGES.items():
        os.symlink(os.path.join(root, folder), os.path.join(package, name))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python3 benchmarks/package_view.py DEST   (DEST is made; run from it, with it on PYTHONPATH)",
              file=sys.stderr)
        return 2
    try:
        print(make_view(os.path.abspath(argv[0])))
    except OSError as e:
        print(f"package_view.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
