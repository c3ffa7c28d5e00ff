"""A model family is a recipe (engine/model/recipe.py): the registry drives the config checks,
and a family registered by a test (a toy linear classifier) is checked, and refused, the
same way as the two that ship. tests/engine/train/test_recipe_run.py trains it through run()."""
import dataclasses

import pytest

from ringpipe.engine.job import checkpoint
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.layers import ClassifierHead
from ringpipe.engine.model.recipe import ModelRecipe
from ringpipe.engine.model.registry import RECIPES, names_of, recipe_named
from ringpipe.engine.train import config as config_checks
from ringpipe.engine.train.config import Config


@dataclasses.dataclass
class ToyShape:
    n_in: int = 1
    n_classes: int = 1

    def validate(self):
        return self

    def to_dict(self):
        return dataclasses.asdict(self)


def _toy_memory(shape, rows, microbatches, seq_len, pp):
    return shape.n_in * shape.n_classes, rows * (shape.n_in + shape.n_classes)


def _toy_fit_to_data(shape, dataset):
    shape.n_in, shape.n_classes = dataset.n_features, dataset.n_classes


# One linear layer to class logits: the smallest family, with nothing of its own but this recipe.
TOY = ModelRecipe(
    name="toy", shape=ToyShape, fields={},
    layers=lambda shape, tensor=None: [ClassifierHead("head", shape.n_in, shape.n_classes)],
    flops_per_item=lambda shape, seq_len: 6.0 * shape.n_in * shape.n_classes, memory=_toy_memory,
    data="classes", default_data="synthetic", data_path_data="fashion-mnist", unit="rows", rate_unit="rows",
    fit_to_data=_toy_fit_to_data)


@pytest.fixture
def toy(monkeypatch):
    """TOY registered for this test only: in the registry, and in the checkpoint format's
    table of model_config keys (job/ may not import the model, so a family names its keys there)."""
    monkeypatch.setitem(RECIPES, "toy", TOY)
    monkeypatch.setitem(checkpoint._MODEL_CONFIG_KEYS, "toy", TOY.config_keys)
    return TOY


def test_every_family_is_registered_under_its_name():
    assert set(RECIPES) == {"gpt", "llama", "mlp"}
    for name, recipe in RECIPES.items():
        assert recipe.name == name and recipe_named(name) is recipe


def test_the_checkpoint_format_knows_every_family_s_shape():
    """A new family's checkpoints are refused until engine/job/checkpoint.py names its model_config keys."""
    for name, recipe in RECIPES.items():
        assert tuple(sorted(checkpoint._MODEL_CONFIG_KEYS[name])) == recipe.config_keys, name


def test_an_unknown_model_is_refused_naming_the_families():
    with pytest.raises(ConfigError, match=r"unknown model 'transformer': use one of gpt, llama, mlp"):
        config_checks.check(Config(model="transformer"), 1)


def test_a_registered_family_is_offered_and_checked(toy):
    assert Config(model="toy").dataset == "synthetic" and Config(model="toy").out_dir.endswith("toy")
    assert config_checks.check(Config(model="toy"), 2) == []
    with pytest.raises(ConfigError, match=r"unknown model 'x': use one of gpt, llama, mlp, toy"):
        config_checks.check(Config(model="x"), 1)
    # The shape settings it does not take, named with the families that do.
    with pytest.raises(ConfigError, match=r"^layers applies to model gpt or llama or mlp only$"):
        config_checks.check(Config(model="toy", layers=2), 1)
    with pytest.raises(ConfigError, match=r"heads, seq_len apply to model gpt or llama only"):
        config_checks.check(Config(model="toy", heads=2, seq_len=8), 1)
    # The axes it does not offer, and what only the GPT's recipe offers.
    with pytest.raises(ConfigError, match=r"pipeline stages .* implemented for model gpt or llama only"):
        config_checks.check(Config(model="toy", pp=2), 2)
    with pytest.raises(ConfigError, match=r"tensor parallelism .* implemented for model gpt or llama only"):
        config_checks.check(Config(model="toy", tp=2), 2)
    with pytest.raises(ConfigError, match=r"model toy has no presets: preset and init_from are for model gpt"):
        config_checks.check(Config(model="toy", preset="gpt2-124m"), 1)


def test_the_recipe_fixes_the_shape_and_the_memory_bound(toy):
    shape = config_checks.model_config(Config(model="toy"))
    assert isinstance(shape, ToyShape)
    shape.n_in, shape.n_classes = 1000, 1000
    need, what = config_checks.memory_floor(Config(model="toy", batch_size=8), shape, dp=1)
    # parameters x (weights, gradients, two AdamW moments) + 8 rows x 2000 activations, float32
    assert need == (1e6 * 4 + 8 * 2000) * 4 and "1e+06 parameters" in what


def test_the_shipped_recipes_keep_their_shapes_and_messages():
    gpt, mlp = recipe_named("gpt"), recipe_named("mlp")
    assert config_checks.model_config(Config(preset="gpt2-124m")).to_dict() == \
        {"n_layer": 12, "d_model": 768, "n_head": 12, "context": 1024, "vocab": 256}
    assert config_checks.model_config(Config(model="mlp", layers=3, d_model=64)).to_dict() == \
        {"n_in": 784, "hidden": 64, "n_layer": 3, "n_classes": 10}
    assert (gpt.unit, gpt.rate_unit, mlp.unit, mlp.rate_unit) == ("tokens", "tok", "examples", "ex")
    assert names_of(lambda r: "tensor" in r.axes) == "gpt or llama" and names_of(lambda r: True) == "gpt or llama or mlp"
    with pytest.raises(ConfigError, match=r"^heads, context apply to model gpt or llama only; the MLP takes "
                                          r"layers and d_model \(hidden width\)$"):
        config_checks.check(Config(model="mlp", heads=2, context=8), 1)
    notes = config_checks.check(Config(data_path="corpus.txt"), 1)
    assert "note: <data_path> given without <data>: reading it as <data> text" in notes
    assert not config_checks.check(Config(model="mlp", data_path="idx"), 1)


@pytest.mark.parametrize("change, problem", [
    ({"data": "pictures"}, r"data 'pictures' is not one of"),
    ({"axes": ("pipe",)}, r"axes .* must hold 'data'"),
    ({"axes": ("data", "expert")}, r"axes .* and only"),
    ({"fields": {"layers": "depth"}}, r"\['depth'\] are not fields of ToyShape"),
    ({"presets": {"big": {"width": 9}}}, r"\['width'\] are not fields of ToyShape"),
])
def test_a_recipe_is_checked_where_it_is_written(change, problem):
    with pytest.raises(ValueError, match=problem):
        dataclasses.replace(TOY, **change)
