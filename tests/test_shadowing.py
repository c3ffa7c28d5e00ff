"""The checkout's kernels/, comm/ and engine/ shadow no other package (issue 34).

Python started in the repository's root, where the docs tell a reader to be, puts the root
first on sys.path: a bare `import kernels` found kernels/ instead of Hugging Face's `kernels`,
which transformers 5 imports (`from transformers import GPT2LMHeadModel` failed with "cannot
import name 'CUDAProperties' from 'kernels'"), and `import comm` found comm/ instead of
Jupyter's. Each folder, imported under its top-level name, now steps aside
(ringpipe/_shadowing.py): the other package takes the name, or, with none, the import fails
naming ringpipe.<name>. Each check runs in a fresh Python started in a folder, as a reader's.
"""
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support import ROOT


def _installed(*distributions) -> bool:
    # asked of the metadata: from the checkout's root, find_spec("kernels") finds kernels/ itself
    try:
        for name in distributions:
            importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _python(code, cwd, **env):
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


THE_OTHERS_AND_OURS = """
import json, sys
from transformers import GPT2LMHeadModel     # imports Hugging Face's kernels
import comm, kernels
from ringpipe import comm as our_comm, kernels as our_kernels
print(json.dumps({"model": GPT2LMHeadModel.__name__, "kernels": kernels.__file__, "comm": comm.__file__,
                  "hf_kernels": hasattr(kernels, "CUDAProperties"), "jupyter_comm": hasattr(comm, "create_comm"),
                  "ours": [our_kernels.__file__, our_comm.__file__],
                  "ours_work": callable(our_kernels.matmul) and callable(our_comm.allreduce)}))
"""


@pytest.mark.skipif(not _installed("transformers", "torch", "kernels", "comm"),
                    reason="needs transformers, torch, Hugging Face's kernels and Jupyter's comm (the test extra)")
def test_transformers_and_jupyters_comm_load_from_the_checkout_root():
    got = _python(THE_OTHERS_AND_OURS, cwd=ROOT)
    assert got["model"] == "GPT2LMHeadModel"
    for name in ("kernels", "comm"):
        assert got[name] != os.path.join(ROOT, name, "__init__.py"), f"import {name} gave the checkout's folder"
    assert got["hf_kernels"] and got["jupyter_comm"]
    # ringpipe's own, in the same process, are the checkout's folders (or links to them: a package view)
    assert [os.path.realpath(f) for f in got["ours"]] == [os.path.realpath(os.path.join(ROOT, name, "__init__.py"))
                                                          for name in ("kernels", "comm")]
    assert got["ours_work"]


NO_OTHER = """
import json, sys
refused = {}
def refusal(name):
    try:
        __import__(name)
    except ModuleNotFoundError as e:
        return {"message": str(e), "name": e.name, "left": name in sys.modules}
    return None
refused["engine"] = refusal("engine")                    # no other package is called engine
from ringpipe.engine import ConfigError                  # ringpipe's is untouched
# kernels and comm with nothing installed: the path without site-packages
sys.path[:] = [p for p in sys.path if not p.rstrip("/").endswith("-packages")]
refused["kernels"] = refusal("kernels")
refused["comm"] = refusal("comm")
print(json.dumps({"refused": refused, "ours": ConfigError.__module__}))
"""


def test_with_no_other_package_of_the_name_the_import_says_which_to_use():
    got = _python(NO_OTHER, cwd=ROOT)
    assert got["ours"] == "ringpipe.engine.job.errors"
    for name in ("engine", "kernels", "comm"):
        refused = got["refused"][name]
        assert refused is not None, f"import {name} from the checkout's root gave the checkout's folder"
        assert refused["name"] == name and not refused["left"]
        assert f"import ringpipe.{name}" in refused["message"]
        assert os.path.join(ROOT, name) in refused["message"]


ANOTHER_CHECKOUT = """
import json, sys
import kernels
try:
    import comm
    failed = None
except RuntimeError as e:
    failed = str(e)
print(json.dumps({"kernels": kernels.WHO, "comm_failed": failed, "comm_left": "comm" in sys.modules}))
"""


def test_another_ringpipe_checkout_on_the_path_steps_aside_too(tmp_path):
    """A second copy of ringpipe's folders on the path (another checkout, a package view) is
    passed over like the first, not taken for the other package (each would hand the name to
    the other, forever); and the other package's own import error is its own, with no half
    module left under the name."""
    other = tmp_path / "other_checkout"
    (other / "ringpipe").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "ringpipe", "_shadowing.py"), other / "ringpipe")
    for name in ("kernels", "comm"):
        (other / name).mkdir()
        shutil.copy(os.path.join(ROOT, name, "__init__.py"), other / name)
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHO = 'the other kernels'\n")
    (site / "comm").mkdir()
    (site / "comm" / "__init__.py").write_text("raise RuntimeError('the other comm is broken')\n")
    got = _python(ANOTHER_CHECKOUT, cwd=ROOT, PYTHONPATH=os.pathsep.join([str(other), str(site)]))
    assert got == {"kernels": "the other kernels", "comm_failed": "the other comm is broken", "comm_left": False}
