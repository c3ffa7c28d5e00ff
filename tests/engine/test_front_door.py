"""engine/__init__.py, the library's front door: `from ringpipe.engine import run, Config`
gives the trainer's own objects, and importing the engine (or its pure planner) loads
neither numpy nor MPI until a name is used."""
import subprocess
import sys

import pytest

from tests.support import ROOT


def test_the_front_door_names_are_the_modules_own():
    from ringpipe.engine import Config, ConfigError, Diverged, JobFailure, RunResult, run
    from ringpipe.engine.job import errors
    from ringpipe.engine.train import config, run as run_module
    assert run is run_module.run and RunResult is run_module.RunResult and Config is config.Config
    assert (ConfigError, JobFailure, Diverged) == (errors.ConfigError, errors.JobFailure, errors.Diverged)


def test_an_unknown_name_is_an_attribute_error():
    import ringpipe.engine
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        ringpipe.engine.Trainer


def test_importing_the_engine_and_the_planner_loads_no_numpy_nor_mpi():
    code = ("import sys, ringpipe.engine, ringpipe.engine.schedules; "
            "print(sorted(m for m in ('numpy', 'mpi4py') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
