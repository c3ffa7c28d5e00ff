"""A classifier's validation: accuracy, per-class precision and recall and the confusion
matrix (engine/train/evaluation.py, engine/model/layers.py ClassifierHead.confusion).

The counts are checked against a hand count (a Python loop over numpy's argmax) on
fixed batches, through the head, through the trainer's metrics.jsonl, and under MPI
(`mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi
tests/engine/train/test_classifier_eval.py`): every data-parallel layout counts the
same matrix as one process, exactly. The MLP runs on the data axis only (its recipe's
axes), so there is no pipeline layout to compare.
"""
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.data.datasets import ClassificationDataset, synthetic_classification
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.layers import ClassifierHead, confusion_counts
from ringpipe.engine.model.mlp import MLP_RECIPE, MLPConfig
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.evaluation import classifier_metrics
from ringpipe.engine.train.reporting import _validation
from ringpipe.engine.train.run import run

world = MPI.COMM_WORLD
FIELDS = ("val_accuracy", "val_precision", "val_recall", "val_confusion")
# Global batch 8 divides among 1, 2 and 4 ranks; float64, so every layout's logits agree to
# rounding and no argmax can flip between them.
SETTINGS = dict(model="mlp", data="synthetic", batch_size=8, steps=4, eval_every=2, eval_batches=3,
                dtype="float64", sample_tokens=0, quiet=True, overwrite=True)


def hand_count(logits, targets, n_classes):
    """The confusion matrix counted one row at a time: rows true, columns numpy's argmax."""
    counts = [[0] * n_classes for _ in range(n_classes)]
    for row, true in zip(np.asarray(logits), np.asarray(targets).reshape(-1)):
        counts[int(true)][int(np.argmax(row))] += 1
    return counts


def hand_metrics(counts):
    """Accuracy, precision and recall from a list-of-lists confusion matrix, by hand."""
    n = len(counts)
    right = [counts[c][c] for c in range(n)]
    predicted = [sum(counts[t][c] for t in range(n)) for c in range(n)]
    actual = [sum(counts[c]) for c in range(n)]
    return (sum(right) / sum(actual), [r / p if p else None for r, p in zip(right, predicted)],
            [r / a if a else None for r, a in zip(right, actual)])


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def confusion_file(out):
    with open(os.path.join(out, "val_confusion.json")) as fh:
        return json.load(fh)


# ---- the count itself ----------------------------------------------------------------------

def test_ties_go_to_the_lowest_class_as_numpy_argmax():
    logits = np.array([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0], [3.0, 3.0, 3.0], [0.0, 0.0, 5.0]])
    targets = np.array([1, 2, 0, 2])
    counts = confusion_counts(logits, targets, 3)
    assert counts.dtype == np.int64
    assert counts.tolist() == hand_count(logits, targets, 3) == [[1, 0, 0], [1, 0, 0], [0, 1, 1]]


def test_metrics_of_a_class_never_predicted_or_never_seen_are_none():
    confusion = np.array([[3, 1, 0], [0, 0, 0], [2, 0, 4]], dtype=np.int64)
    got = classifier_metrics(confusion)
    assert got["val_accuracy"] == 7 / 10
    assert got["val_precision"] == [3 / 5, 0.0, 1.0]          # class 1 predicted once, wrongly
    assert got["val_recall"] == [3 / 4, None, 4 / 6]          # class 1 never in the rows
    assert classifier_metrics(np.array([[2, 0], [1, 0]]))["val_precision"] == [2 / 3, None]
    assert got["val_confusion"] == confusion.tolist()
    json.dumps(got, allow_nan=False)          # strict JSON: no NaN anywhere


def test_the_head_counts_what_a_hand_count_of_a_fixed_batch_says():
    """The MLP with fixed weights (seed 3) on fixed batches of the synthetic blobs: the head's
    counts, and the metrics from them, equal a hand count of numpy's argmax of its logits."""
    data = synthetic_classification(seed=5, dtype=np.float64)
    shape = MLPConfig(n_in=data.n_features, hidden=16, n_layer=2, n_classes=data.n_classes)
    model = MLP_RECIPE.build(shape, dtype=np.float64, seed=3)
    head = model.layers[-1]
    assert isinstance(head, ClassifierHead) and head.confusion is None

    head.confusion = np.zeros((shape.n_classes,) * 2, dtype=np.int64)
    expected = np.zeros((shape.n_classes,) * 2, dtype=np.int64)
    for i in range(3):
        x, y = data.batch(i, 32, split="val")
        logits, _ = model.forward(x)                        # no targets: the logits, nothing counted
        expected += np.array(hand_count(logits, y, shape.n_classes))
        model.loss(x, y)                                    # the validation forward: counts
    got = classifier_metrics(head.confusion)
    assert got["val_confusion"] == expected.tolist() and expected.sum() == 3 * 32
    accuracy, precision, recall = hand_metrics(expected.tolist())
    assert got["val_accuracy"] == accuracy
    assert got["val_precision"] == precision and got["val_recall"] == recall
    assert 0 < accuracy < 1          # an untrained model: some rows right, some wrong

    # Training's forward (need_grad) overwrites the logits with their gradient: counted before that.
    head.confusion[:] = 0
    x, y = data.batch(0, 32, split="val")
    model.forward(x, y, grad_scale=1.0, need_grad=True)
    assert head.confusion.tolist() == hand_count(model.forward(x)[0], y, shape.n_classes)


def test_the_progress_line_shows_the_accuracy():
    assert _validation({"val_loss": 0.5, "val_accuracy": 0.912}) == " | val 0.5000 | acc 91.2%"
    assert _validation({"val_loss": 0.5}) == " | val 0.5000"


# ---- through the trainer -------------------------------------------------------------------

def test_metrics_jsonl_holds_the_classifier_fields_on_validation_steps(tmp_path):
    out = str(tmp_path / "mlp")
    result = run(Config(**SETTINGS, out=out), world=MPI.COMM_SELF)
    records = metrics(out)
    validated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in validated] == [2, 4]
    assert all(not set(FIELDS) & set(r) for r in records if "val_loss" not in r)
    # The matrix is a file of its own, the newest validation's (engine/monitor/confusion.py).
    assert all("val_confusion" not in r for r in records)
    newest = confusion_file(out)
    assert newest["step"] == validated[-1]["step"]
    confusion = np.array(newest["val_confusion"])
    assert confusion.shape == (4, 4) and confusion.sum() == SETTINGS["eval_batches"] * SETTINGS["batch_size"]
    assert validated[-1]["val_accuracy"] == np.trace(confusion) / confusion.sum()
    assert all(len(r["val_precision"]) == len(r["val_recall"]) == 4 for r in validated)
    # The last validation ran on the final weights: a hand count of the same batches agrees.
    data = synthetic_classification(Config(**SETTINGS).seed, dtype=np.float64)
    chain = result.model.inner.chain
    expected = np.zeros((4, 4), dtype=np.int64)
    for i in range(SETTINGS["eval_batches"]):
        x, y = data.batch(i, SETTINGS["batch_size"], split="val")
        expected += np.array(hand_count(chain.forward(x)[0], y, 4))
    assert newest["val_confusion"] == expected.tolist()
    accuracy, precision, recall = hand_metrics(expected.tolist())
    assert (validated[-1]["val_accuracy"], validated[-1]["val_precision"], validated[-1]["val_recall"]) == \
        (accuracy, precision, recall)


def test_a_model_that_is_no_classifier_reports_no_classifier_fields(tmp_path):
    out = str(tmp_path / "gpt")
    run(Config(data="synthetic", layers=1, d_model=16, heads=2, context=16, batch_size=4, steps=1,
               eval_batches=1, sample_tokens=0, quiet=True, overwrite=True, out=out), world=MPI.COMM_SELF)
    (record,) = metrics(out)
    assert "val_loss" in record and not set(FIELDS) & set(record)


# ---- the whole validation split, each example once ------------------------------------------

def test_validation_batches_walk_the_split_once():
    """Batches 0, 1, ... of a pass are consecutive slices of one shuffle of the split: no
    example twice, all of them once the batches reach the end (the last one partial), and
    a rank's rows lo:hi of that last one may be fewer, or none."""
    data = synthetic_classification(seed=5)
    n = data.examples("val")
    assert n == 205                                  # 25 batches of 8 and one of 5
    xs, ys = zip(*(data.batch(i, 8, split="val") for i in range(26)))
    assert [len(y) for y in ys] == [8] * 25 + [5]
    x_val, y_val = data.splits["val"]
    assert sorted(map(bytes, np.concatenate(xs))) == sorted(map(bytes, x_val))      # each example once
    assert sorted(np.concatenate(ys)) == sorted(y_val)
    assert [len(data.batch(25, 8, lo, lo + 2, split="val")[1]) for lo in (0, 2, 4, 6)] == [2, 2, 1, 0]
    with pytest.raises(ValueError, match="validation batch 26 of 8 examples starts past the 205 examples"):
        data.batch(26, 8, split="val")


def split_loss(result, data):
    """The final weights' mean loss over the whole validation split, by hand."""
    x, y = data.splits["val"]
    return result.model.inner.chain.loss(x, y.astype(np.int64)) / len(y)


@pytest.mark.parametrize("eval_batches", [None, "all"], ids=["default", "all"])
def test_a_classifier_scores_its_whole_validation_split(tmp_path, monkeypatch, eval_batches):
    """By default a pass takes 4 batches and the last one of the run the whole split; with
    all, every pass the whole split. Before, the last pass scored 4 x 8 = 32 of the 205."""
    read = []
    batch = ClassificationDataset.batch

    def reading(self, step, batch_size, lo=0, hi=None, split="train"):
        if split == "val":
            read.append(step)
        return batch(self, step, batch_size, lo, hi, split)

    monkeypatch.setattr(ClassificationDataset, "batch", reading)
    out = str(tmp_path / "mlp")
    settings = dict(SETTINGS, eval_batches=eval_batches, out=out)
    result = run(Config(**settings), world=MPI.COMM_SELF)
    whole = list(range(26))                          # 25 batches of 8 and one of 5
    assert read == (list(range(4)) if eval_batches is None else whole) + whole
    assert np.sum(confusion_file(out)["val_confusion"]) == 205
    data = synthetic_classification(Config(**settings).seed, dtype=np.float64)
    assert metrics(out)[-1]["val_loss"] == pytest.approx(split_loss(result, data), rel=1e-12)


def test_more_validation_batches_than_the_split_holds_are_refused(tmp_path):
    """1000 batches of 16 once counted 16,000 examples of a 10,000-example split."""
    with pytest.raises(ConfigError, match=r"eval_batches 27 x batch_size 8 = 216 examples, but the "
                                          r"validation split of synthetic blobs holds 205.*use eval_batches all "
                                          r"\(the whole split: 26 batches, the last of 5\) or at most 26"):
        run(Config(**dict(SETTINGS, eval_batches=27), out=str(tmp_path / "mlp")), world=MPI.COMM_SELF)
    assert not os.path.exists(tmp_path / "mlp" / "metrics.jsonl")
    run(Config(**dict(SETTINGS, eval_batches=26), out=str(tmp_path / "mlp")), world=MPI.COMM_SELF)


# ---- under MPI: every layout counts the same matrix ----------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("extra", [dict(), dict(microbatches=2), dict(zero=1), dict(eval_batches="all"),
                                   dict(eval_batches="all", microbatches=2), dict(eval_batches="all", zero=3)],
                         ids=["dp", "dp-microbatches", "dp-zero1", "all", "all-microbatches", "all-zero3"])
def test_every_data_parallel_layout_counts_what_one_process_counts(shared_dir, extra):
    """With all, the last batch (5 of 8 rows) leaves a rank fewer rows, or none, and a
    micro-batch fewer or none: every example is still counted once, by one rank."""
    if SETTINGS["batch_size"] % world.size:
        pytest.skip("global batch 8 must divide among the ranks")
    ref_out, par_out = os.path.join(shared_dir, f"ref{world.rank}"), os.path.join(shared_dir, "dp")
    alone = dict(SETTINGS, **extra)
    if alone.get("zero", 0) >= 2:
        alone["zero"] = 0                        # one process: ZeRO-2/3 need 2+ ranks (the same math)
    run(Config(**alone, out=ref_out), world=MPI.COMM_SELF)
    run(Config(**dict(SETTINGS, **extra), out=par_out), world=world)
    world.Barrier()
    ref = [{k: r[k] for k in FIELDS[:3]} for r in metrics(ref_out) if "val_loss" in r]
    par = [{k: r[k] for k in FIELDS[:3]} for r in metrics(par_out) if "val_loss" in r]
    assert len(par) == 2 and par == ref          # counts exactly; so the ratios from them too
    if extra.get("eval_batches") == "all":
        assert np.sum(confusion_file(par_out)["val_confusion"]) == 205
    assert confusion_file(par_out) == confusion_file(ref_out)      # the newest matrix
