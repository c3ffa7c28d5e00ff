"""A stop signal is honoured inside the loops of a run that can run long, not only at a
step boundary: a validation pass (--eval-batches up to a million) and the sample at the
end (--sample-tokens up to a million). Before, SIGTERM waited for the whole pass or
sample, and Slurm's SIGKILL came first.

One process (COMM_SELF), the smallest GPT, a StopFlag triggered from inside the loop.
"""
import json
import os
import signal

from mpi4py import MPI

from ringpipe.engine.data.datasets import TokenDataset
from ringpipe.engine.job import checkpoint, lifecycle
from ringpipe.engine.model import gpt
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.run import run

TINY = dict(data="synthetic", layers=1, d_model=16, heads=2, context=16, batch_size=4, quiet=True)


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_sigterm_during_validation_ends_the_pass_and_the_run_checkpoints(tmp_path, monkeypatch):
    stop = lifecycle.StopFlag(install=False)
    read = []
    batch = TokenDataset.batch

    def reading(self, step, batch_size, lo=0, hi=None, split="train"):
        if split == "val":
            read.append(step)
            if step == 2:
                stop.trigger(signal.SIGTERM)          # as the handler does, while batch 2 is read
        return batch(self, step, batch_size, lo, hi, split)

    monkeypatch.setattr(TokenDataset, "batch", reading)
    out = str(tmp_path / "run")
    result = run(Config(**TINY, steps=4, eval_every=2, eval_batches=1000, sample_tokens=0, out=out),
                 world=MPI.COMM_SELF, stop=stop)
    assert read == [0, 1, 2]                         # not the other 997 batches
    assert (result.exit_code, result.stopped_by, result.steps_done) == (lifecycle.REQUEUE_EXIT_CODE, "SIGTERM", 2)
    assert result.checkpoint == checkpoint.manifest_path(os.path.join(out, "checkpoints"), 2)
    assert os.path.exists(result.checkpoint)
    (record,) = [r for r in records(out) if r["step"] == 2]
    assert "val_loss" not in record                  # a pass cut short is no validation


def test_sigterm_during_the_final_sample_ends_it_with_what_was_drawn(tmp_path, monkeypatch, capsys):
    stop = lifecycle.StopFlag(install=False)
    drawn = []
    last_logits = gpt.CachedDecoder.last_logits

    def drawing(self, tokens):
        drawn.append(len(tokens))
        if len(drawn) == 5:
            stop.trigger(signal.SIGTERM)
        return last_logits(self, tokens)

    monkeypatch.setattr(gpt.CachedDecoder, "last_logits", drawing)
    out = str(tmp_path / "run")
    result = run(Config(**TINY, steps=2, eval_batches=1, sample_tokens=200, out=out), world=MPI.COMM_SELF,
                 stop=stop)
    assert len(drawn) == 5                           # not 200
    assert result.exit_code == 0 and result.steps_done == 2          # the run was complete before the sample
    printed = capsys.readouterr().out
    assert "---- sample ----" in printed
    assert "SIGTERM arrived while sampling: the sample above stops after 5 of sample_tokens 200 tokens" in printed


def test_generate_stops_when_asked_and_hands_each_token_as_it_comes():
    model = gpt.build_gpt(gpt.GPTConfig(n_layer=1, d_model=16, n_head=2, context=16), seed=1)
    seen = []
    new = gpt.generate(model, [1, 2, 3], 50, 16, seed=4, on_token=seen.append, stop=lambda: len(seen) >= 7)
    assert len(new) == 7 and new == seen
    assert new == gpt.generate(model, [1, 2, 3], 7, 16, seed=4)        # the same draws as a 7-token call
