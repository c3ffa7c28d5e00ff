"""A model family as a recipe (torchtitan's ModelSpec): everything the trainer, the
config checks, the reporting and interop ask of a model, in one object per family.

    recipe = recipe_named(cfg.model)           # engine/model/registry.py
    layers = recipe.layers(shape, tensor)      # the model, or a tensor group's part of it

The code outside engine/model/ asks the recipe and never compares a model's name
(tests/test_architecture.py checks that), so a new family is one module with its
recipe plus a line in the registry: ARCHITECTURE.md, "How to add a model family".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ringpipe.engine.model.chain import LayerChain

# The kinds of data a family trains on; engine/train/config.py DATASETS names the
# datasets of each kind.
DATA_KINDS = ("tokens", "classes")
AXES = ("data", "pipe", "tensor")


def _nothing_from_data(shape, dataset):
    return None


@dataclass(frozen=True)
class ModelRecipe:
    name: str                     # <model> NAME, the checkpoint's "model", the default run directory runs/NAME
    shape: type                   # the shape's dataclass: fields with defaults, validate(), to_dict()
    fields: dict                  # Config field -> the shape field it sets ({"layers": "n_layer", ...})
    layers: Callable              # (shape, tensor=None) -> [layer]: the model, or a tensor group's part of it
    flops_per_item: Callable      # (shape, seq_len) -> training FLOPs per counted item (matmuls only)
    memory: Callable              # (shape, rows, microbatches, seq_len, pp) -> (parameters, activation
    #                               elements of one micro-batch): engine/train/config.py memory_floor's bound
    data: str                     # the kind of data it trains on (DATA_KINDS): "tokens" are sequences with a
    #                               vocabulary (seq_len, the tokenizer, bits per byte); "classes" (features, label)
    default_data: str             # <data> when neither <data> nor <data_path> is given
    data_path_data: str           # <data> when <data_path> alone is given
    unit: str                     # what a step counts, in words ("tokens", "examples"): start-up lines, metrics
    rate_unit: str                # its short form in the progress line's rate ("tok", "ex")
    fields_hint: str = ""         # what it takes, said when a shape setting of another family is given
    axes: tuple = ("data",)       # the parallel axes it runs on (AXES); data parallelism always
    presets: dict = field(default_factory=dict)   # <preset> name -> the shape fields it fixes
    hf_format: bool = False       # its checkpoints export to, and <init_from> imports, a Hugging Face format
    fit_to_data: Callable = _nothing_from_data    # (shape, dataset): set the shape fields the data decides
    generate: Callable | None = None              # text sampling (engine/model/gpt.py generate); None: no text
    blocks: bool = False          # built of transformer blocks (layers.py Block): <recompute> full/selective apply
    classifier: bool = False      # its head is a ClassifierHead and its shape has n_classes: validation counts a
    #                               confusion matrix, reports accuracy, per-class precision, recall (train/evaluation.py)

    def __post_init__(self):
        # A recipe is checked once, where it is written: a typo here would otherwise
        # surface as a refusal of some user's run.
        if self.data not in DATA_KINDS:
            raise ValueError(f"recipe {self.name}: data {self.data!r} is not one of {DATA_KINDS}")
        if "data" not in self.axes or not set(self.axes) <= set(AXES):
            raise ValueError(f"recipe {self.name}: axes {self.axes} must hold 'data' and only {AXES}")
        shape_fields = {f.name for f in dataclasses.fields(self.shape)}
        unknown = [f for f in self.fields.values() if f not in shape_fields]
        unknown += [f for preset in self.presets.values() for f in preset if f not in shape_fields]
        if unknown:
            raise ValueError(f"recipe {self.name}: {unknown} are not fields of {self.shape.__name__}")

    @property
    def config_keys(self) -> tuple:
        """The keys of a checkpoint's model_config (engine/job/checkpoint.py checks them)."""
        return tuple(sorted(f.name for f in dataclasses.fields(self.shape)))

    def build(self, shape, dtype=np.float32, xp=np, seed=0) -> LayerChain:
        """The whole model on one process, initialised from `seed` (sampling, tests)."""
        model = LayerChain(self.layers(shape), dtype=dtype, xp=xp)
        model.params.init(seed)
        return model
