"""An MLP classifier: features (B, D) -> hidden GELU layers -> class logits -> loss."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ringpipe.engine.model import limits
from ringpipe.engine.model.layers import ClassifierHead, DenseGELU
from ringpipe.engine.model.recipe import ModelRecipe


@dataclass
class MLPConfig:
    n_in: int = 784
    hidden: int = 256
    n_layer: int = 2          # hidden layers
    n_classes: int = 10

    def validate(self):
        """Check every value, type and range (limits.py). The data decides n_in and n_classes:
        bounded as token ids are, far past any dataset; what fits is check_memory's."""
        for name, high in (("n_in", limits.MAX_VOCAB), ("hidden", limits.MAX_WIDTH), ("n_layer", limits.MAX_LAYERS),
                           ("n_classes", limits.MAX_VOCAB)):
            limits.check_whole(f"MLP <{name}>", getattr(self, name), 1, high)
        return self

    def to_dict(self):
        return asdict(self)


def mlp_layers(cfg: MLPConfig):
    cfg.validate()
    widths = [cfg.n_in] + [cfg.hidden] * cfg.n_layer
    layers = [DenseGELU(f"fc.{i}", widths[i], widths[i + 1]) for i in range(cfg.n_layer)]
    layers.append(ClassifierHead("head", widths[-1], cfg.n_classes))
    return layers


def flops_per_example(cfg: MLPConfig) -> float:
    widths = [cfg.n_in] + [cfg.hidden] * cfg.n_layer + [cfg.n_classes]
    return 3.0 * sum(2 * a * b for a, b in zip(widths[:-1], widths[1:]))


def _layers(cfg: MLPConfig, tensor=None):
    return mlp_layers(cfg)         # no tensor group: the recipe offers the data axis only


def _flops_per_item(cfg: MLPConfig, seq_len=None) -> float:
    return flops_per_example(cfg)


def memory(cfg: MLPConfig, rows: int, microbatches: int, seq_len, pp: int) -> tuple[int, int]:
    """(parameters, activation elements of a replica's rows): engine/train/config.py
    memory_floor's lower bound, before the data has said the features and classes."""
    widths = [1] + [cfg.hidden] * cfg.n_layer + [1]
    return sum(a * b for a, b in zip(widths[:-1], widths[1:])), rows * sum(widths)


def _fit_to_data(cfg: MLPConfig, dataset) -> None:
    cfg.n_in, cfg.n_classes = dataset.n_features, dataset.n_classes


MLP_RECIPE = ModelRecipe(
    name="mlp", shape=MLPConfig, fields={"layers": "n_layer", "d_model": "hidden"},
    fields_hint="the MLP takes <layers> and <d_model> (hidden width)",
    layers=_layers, flops_per_item=_flops_per_item, memory=memory,
    data="classes", default_data="fashion-mnist", data_path_data="fashion-mnist", unit="examples", rate_unit="ex",
    fit_to_data=_fit_to_data, classifier=True)
