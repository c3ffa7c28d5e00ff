"""Issue 20, round two, comm's part: settings and the calibration cache that cannot
stop or slow a job.

- RINGPIPE_RING_SUBCHUNK / RINGPIPE_ALLREDUCE_CROSSOVER outside a sane range are
  refused naming the variable, the value and the range (a sub-chunk of 1 byte made
  steps 200x slower);
- RINGPIPE_CALIBRATION pointing at a FIFO, /dev/zero, deep or damaged JSON, or an
  entry with a beta of 0, NaN or the wrong node layout: warned about and measured
  again, never a hang or a crash, and a path that is not a regular file never written.
"""
import json
import os
import types

import pytest
from mpi4py import MPI

from ringpipe.comm import costmodel, settings
from tests.support.hostile import deadline


@pytest.mark.parametrize("variable,value", [
    ("RINGPIPE_RING_SUBCHUNK", "1"), ("RINGPIPE_RING_SUBCHUNK", "4095"), ("RINGPIPE_RING_SUBCHUNK", "2G"),
    ("RINGPIPE_ALLREDUCE_CROSSOVER", "2G"), ("RINGPIPE_ALLREDUCE_CROSSOVER", "99999999999999999999"),
])
def test_sizes_outside_their_range_are_refused_naming_variable_value_and_range(variable, value):
    with pytest.raises(ValueError) as e:
        settings.parse({variable: value})
    low = "4096 (4K)" if variable == "RINGPIPE_RING_SUBCHUNK" else "0"
    assert f"{variable}={value!r}" in str(e.value)
    assert f"at least {low} and at most 1073741824 (1G)" in str(e.value)


@pytest.mark.parametrize("variable,value,expected", [
    ("RINGPIPE_RING_SUBCHUNK", "4K", 4096), ("RINGPIPE_RING_SUBCHUNK", "1G", 1 << 30),
    ("RINGPIPE_ALLREDUCE_CROSSOVER", "0", 0), ("RINGPIPE_ALLREDUCE_CROSSOVER", "1G", 1 << 30),
])
def test_the_ends_of_the_ranges_are_accepted(variable, value, expected):
    s = settings.parse({variable: value})
    assert (s.subchunk if variable == "RINGPIPE_RING_SUBCHUNK" else s.crossover) == expected


# ---- the calibration cache ----------------------------------------------------------------------

NODES = types.SimpleNamespace(node=[0], n_nodes=1, sizes=[1])
KEY = costmodel._key(NODES, [MPI.Get_processor_name()])
GOOD = {"intra": {"alpha": 1e-6, "beta": 1e-10}, "inter": {"alpha": 2e-6, "beta": 2e-10}, "nodes": 1,
        "per_node": 1}





@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = str(tmp_path / "calibration.json")
    monkeypatch.setenv(costmodel.ENV_CALIBRATION, path)
    monkeypatch.setattr(costmodel, "_fits", {})
    return path


def write(path, obj):
    with open(path, "w") as fh:
        fh.write(obj if isinstance(obj, str) else json.dumps(obj))


def test_a_good_entry_is_used(cache):
    write(cache, {KEY: GOOD})
    model = costmodel.calibrate(MPI.COMM_SELF, NODES)
    assert model.intra.beta == 1e-10 and model.inter.alpha == 2e-6


@pytest.mark.parametrize("change", [
    {"intra": {"alpha": 1e-6, "beta": 0}}, {"intra": {"alpha": 1e-6, "beta": -1e-10}},
    {"inter": {"alpha": float("nan"), "beta": 1e-10}}, {"inter": {"alpha": 1e-6, "beta": "fast"}},
    {"intra": {"alpha": 1e-6, "beta": True}}, {"intra": None}, {"nodes": 3}, {"per_node": 0},
], ids=["beta-0", "beta-negative", "alpha-nan", "beta-string", "beta-bool", "no-level", "other-nodes",
        "per-node-0"])
def test_an_invalid_entry_is_warned_about_and_measured_again(cache, change):
    write(cache, {KEY: {**GOOD, **change}})
    with pytest.warns(RuntimeWarning, match="not usable.*measured again"):
        model = costmodel.calibrate(MPI.COMM_SELF, NODES)
    model.intra.describe(), model.inter.describe()                # no ZeroDivisionError
    assert model.intra.beta > 0
    with open(cache) as fh:
        assert json.load(fh)[KEY]["intra"]["beta"] > 0             # the measured entry replaced it


@pytest.mark.parametrize("content,words", [
    ("[" * 100000 + "]" * 100000, "nested too deeply"), ("{not json", "not valid JSON"), ("[1, 2]", "not a JSON object"),
])
def test_a_damaged_cache_is_warned_about_measured_and_rewritten(cache, content, words):
    write(cache, content)
    with pytest.warns(RuntimeWarning, match=words):
        costmodel.calibrate(MPI.COMM_SELF, NODES)
    with open(cache) as fh:
        assert KEY in json.load(fh)


def test_a_huge_cache_is_not_read(cache):
    with open(cache, "wb") as fh:
        fh.truncate(costmodel.CACHE_LIMIT_BYTES + 1)
    with pytest.warns(RuntimeWarning, match="more than a calibration cache holds"):
        costmodel.calibrate(MPI.COMM_SELF, NODES)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_cache_that_is_not_a_regular_file_neither_blocks_nor_is_written(tmp_path, monkeypatch, kind):
    path = str(tmp_path / "calibration.json")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)
    monkeypatch.setenv(costmodel.ENV_CALIBRATION, path)
    monkeypatch.setattr(costmodel, "_fits", {})
    with deadline(10), pytest.warns(RuntimeWarning, match="not a regular file"):
        model = costmodel.calibrate(MPI.COMM_SELF, NODES)
    assert model.intra.beta > 0
    assert os.path.islink(path) if kind == "dev-zero" else not os.path.isfile(path)
