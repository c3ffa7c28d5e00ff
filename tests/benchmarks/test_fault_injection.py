"""The fault matrix (benchmarks/fault_matrix.py), once per scenario with random timing:
kills, double signals, a full disk, damaged and hostile checkpoints, two runs on one
--out. Each trial must end within seconds, name its cause, keep every valid
checkpoint and resume bit-identical. A failure prints the seed to replay it:

    python benchmarks/fault_matrix.py --seed SEED --only SCENARIO --repeat 1
"""
import os
import random

import pytest

from benchmarks import fault_matrix

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(fault_matrix.MPIEXEC), reason="no mpiexec next to this python")]


@pytest.mark.parametrize("scenario", fault_matrix.SCENARIOS)
def test_fault_matrix(scenario):
    seed = random.randrange(2**31)
    lines = []
    trials = fault_matrix.run_matrix([scenario], repeat=1, seed=seed, deadline=30.0, log=lines.append)
    if all(t.get("skipped") for t in trials):
        pytest.skip(trials[0]["did"])
    for t in trials:
        failed = [k for k in ("ended", "named", "kept", "exact") if not t[k]]
        assert not failed, f"seed {seed}: {t['did']}: not {', '.join(failed)}\n" + "\n".join(lines)
