"""The fault matrix (benchmarks/fault_matrix.py), once per scenario with random timing:
training (kills, double signals, a full disk, damaged and hostile checkpoints, two runs on
one --out, a stop signal to a parameter server or a worker in a PS mode) and the tools
around it (prepare killed, interrupted on one rank, out of disk, run twice on one --out;
export --overwrite onto folders that are not models; hostile folders and manifests for
--init-from, sample and export; hostile completion markers), one of the hostile-value
cases (the matrix runs all of them: `--only hostile-values --repeat 34`) and one of the six
faults during a sharded or asynchronous save, at random (tests/engine/test_sharded_faults.py
checks each of them).
Each trial must end within seconds, name its cause, lose nothing, exit with a truthful
code and (training) resume bit-identical. A failure prints the seed to replay it:

    python benchmarks/fault_matrix.py --seed SEED --only SCENARIO --repeat 1
"""
import os
import random

import pytest

from benchmarks import fault_matrix

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(fault_matrix.MPIEXEC), reason="no mpiexec next to this python")]


@pytest.mark.parametrize("scenario", [s for s in fault_matrix.SCENARIOS
                                      if s != "hostile-values" and s not in fault_matrix.SAVE_FAULTS])
def test_fault_matrix(scenario):
    check_scenario(scenario)


def test_a_save_fault_trial():
    """One of sharded-kill, sharded-term, sharded-disk-full and the async ones, at random (each
    ~30-60 s with its reference run; tests/engine/test_sharded_faults.py checks every kind)."""
    check_scenario(random.choice(sorted(fault_matrix.SAVE_FAULTS)))


def check_scenario(scenario):
    seed = random.randrange(2**31)
    lines = []
    trials = fault_matrix.run_matrix([scenario], repeat=1, seed=seed, deadline=30.0, log=lines.append)
    if all(t.get("skipped") for t in trials):
        pytest.skip(trials[0]["did"])
    for t in trials:
        failed = fault_matrix.failed_checks(t)
        assert not failed, f"{scenario}, seed {seed}: {t['did']}: not {', '.join(failed)}\n" + "\n".join(lines)


def test_a_hostile_value_trial(tmp_path):
    """Another exporter's file as --metrics-textfile, under two ranks: refused on both (exit 2,
    naming it) and left as it was. One case only: each is a second or two, and CI's time is short."""
    case = next(case for case in fault_matrix.HOSTILE_VALUES if case[1] == "textfile")
    os.makedirs(tmp_path / "trial")
    trial = fault_matrix.hostile_values(random.Random(0), str(tmp_path / "trial"), None, 30.0, trial=case)
    failed = fault_matrix.failed_checks(trial)
    assert not failed, f"{trial['did']}: not {', '.join(failed)}; it said: {trial['said']}"
