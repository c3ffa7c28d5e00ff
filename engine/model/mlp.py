"""An MLP classifier: features (B, D) -> hidden GELU layers -> class logits -> loss."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.layers import ClassifierHead, DenseGELU


@dataclass
class MLPConfig:
    n_in: int = 784
    hidden: int = 256
    n_layer: int = 2          # hidden layers
    n_classes: int = 10

    def validate(self):
        for name in ("n_in", "hidden", "n_layer", "n_classes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"MLP <{name}> must be >= 1, got {getattr(self, name)}")
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
