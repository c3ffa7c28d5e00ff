"""A model family registered by a test, trained through run(Config(model=...)) with no
change to engine/train/: the trainer, its checks and its reporting ask the recipe."""
import json
import os

from mpi4py import MPI

from ringpipe.engine.job import checkpoint
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.run import run
from tests.engine.model.test_recipes import toy  # noqa: F401  (the fixture that registers TOY)


def test_a_registered_family_trains_saves_and_resumes(toy, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "run")
    result = run(Config(model="toy", steps=2, batch_size=8, out=out), world=MPI.COMM_SELF)
    said = capsys.readouterr().out
    assert result.steps_done == 2 and result.exit_code == 0
    assert "ringpipe | toy {'n_in': 32, 'n_classes': 4}" in said and "8 rows/step" in said
    manifest = checkpoint.read_manifest(result.checkpoint)
    assert manifest["model"] == "toy" and manifest["model_config"] == {"n_in": 32, "n_classes": 4}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2] and all("rows_per_s" in r for r in records)
    resumed = run(Config(model="toy", steps=3, batch_size=8, out=out, resume="auto"),
                  world=MPI.COMM_SELF)
    assert resumed.steps_done == 3 and "resumed from" in capsys.readouterr().out
