"""What a run prints (engine/train/reporting.py): quiet is quiet, and the start-up line names
the model's parameters (issue 34)."""
from mpi4py import MPI

from ringpipe.engine.model.registry import recipe_named
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.reporting import Reporter, model_line, model_parameters
from ringpipe.engine.train.run import run


def test_a_quiet_reporter_prints_notes_and_warnings_only(capsys):
    quiet, loud = Reporter(True, True, 10, None), Reporter(True, False, 10, None)
    for report in (quiet, loud):
        report.say("data: synthetic tokens")
        report.note("note: a setting with no effect")
    assert capsys.readouterr().out.splitlines() == [
        "note: a setting with no effect", "data: synthetic tokens", "note: a setting with no effect"]
    Reporter(False, False, 10, None).note("warning: only rank 0 speaks")
    assert capsys.readouterr().out == ""


def test_config_quiet_prints_no_start_up_report_nor_summary_but_its_notes(tmp_path, capsys):
    """Config(quiet=True) printed 13 lines (the start-up report, the epochs, the end): a library
    user asking for quiet hears the warnings and notes only."""
    run(Config(data="synthetic", layers=1, d_model=16, heads=2, context=16, batch_size=4, steps=1, sample_tokens=0,
               quiet=True, tensorboard=False, monitor_every=0, tp_overlap="on", out=str(tmp_path / "run")),
        world=MPI.COMM_SELF)
    printed = capsys.readouterr().out.splitlines()
    assert printed, "the note about <tp_overlap> went unsaid"
    assert all(line.startswith(("note:", "warning:")) for line in printed), printed
    assert any("tp_overlap" in line for line in printed)


def test_the_start_up_line_gives_the_models_parameters_and_what_rank_0_holds():
    """A tensor-parallel run said rank 0's part where a reader expects the model's count."""
    shape = {"n_layer": 2, "d_model": 64}
    split = model_line("gpt", shape, 842_496, 421_312, "float32", bf16=False)
    assert split == "ringpipe | gpt {'n_layer': 2, 'd_model': 64} | 842,496 parameters (rank 0 holds 421,312) | float32"
    whole = model_line("gpt", shape, 842_496, 842_496, "float32", bf16=True)
    assert whole == "ringpipe | gpt {'n_layer': 2, 'd_model': 64} | 842,496 parameters on rank 0 | float32, bf16 matmuls"


def test_the_models_parameters_are_counted_from_its_layers_with_a_tied_weight_once():
    recipe = recipe_named("gpt")
    shape = recipe.shape(n_layer=1, d_model=16, n_head=2, context=16, vocab=64)
    assert model_parameters(recipe.layers(shape)) == recipe.build(shape).params.size
