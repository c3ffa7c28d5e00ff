"""The two protocols of engine/parallel/__init__.py, as the classes implement them: the
rank model the trainer holds (RankModel: DataParallel) and the inner models an outer
axis wraps (InnerModel), whose methods have names of their own."""
import inspect

import pytest

from ringpipe.engine.parallel import InnerModel, RankModel
from ringpipe.engine.parallel.data import DataParallel
from ringpipe.engine.parallel.local import LocalModel
from ringpipe.engine.parallel.pipeline.stage import PipelineModel
from ringpipe.engine.parallel.tensor import TensorParallel


def _methods(cls):
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def test_the_trainers_rank_model_offers_every_method_of_the_protocol():
    """Including what the trainer used to fish for with getattr: the start-up notes
    and the hidden share of the communication."""
    wanted = _methods(RankModel)
    assert {"notes", "comm_hidden_fraction"} <= wanted
    assert wanted <= _methods(DataParallel)


@pytest.mark.parametrize("cls", [LocalModel, PipelineModel, TensorParallel])
def test_each_inner_model_offers_the_inner_protocol_under_its_own_names(cls):
    wanted = _methods(InnerModel)
    assert wanted <= _methods(cls), wanted - _methods(cls)
    # The checkpoint methods take other arguments than the rank model's (state names and
    # flat arrays, not the optimizer): they must not share RankModel's names.
    assert not {"gather_state", "state_shapes", "restore_state"} & _methods(cls)
    for name in wanted:
        theirs = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]
        protocol = [p for p in inspect.signature(getattr(InnerModel, name)).parameters if p != "self"]
        assert len(theirs) == len(protocol), f"{cls.__name__}.{name}{theirs} vs InnerModel.{name}{protocol}"
