"""`ringpipe sample`: text from a trained run, with the run's own tokenizer."""
import os

import pytest

from ringpipe.engine.data import prepare as prep
from ringpipe.engine.interop import sample
from ringpipe.engine.train.cli import run_flags


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sample")
    (tmp / "corpus").mkdir()
    for i in range(6):
        (tmp / "corpus" / f"{i}.txt").write_text("the ring all-reduce moves every byte once. " * (20 + i))
    prep.prepare([str(tmp / "corpus")], tmp / "data", tokenizer="bpe:280", progress=False)
    out = str(tmp / "run")
    run_flags(["--data", str(tmp / "data"), "--layers", "1", "--d-model", "16", "--heads", "2", "--context", "16",
               "--batch-size", "4", "--steps", "2", "--sample-tokens", "0", "--quiet", "--out", out])
    return out


@pytest.mark.parametrize("form", ["positional", "option"])
def test_sample_continues_the_prompt_with_the_runs_tokenizer(bpe_run, capsys, form):
    where = [bpe_run] if form == "positional" else ["--checkpoint", bpe_run]
    assert sample.main([*where, "--prompt", "the ring", "--tokens", "8", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("the ring") and len(text) > len("the ring")


def test_sample_is_a_pure_function_of_the_seed(bpe_run, capsys):
    outs = []
    for _ in range(2):
        sample.main([bpe_run, "--tokens", "10", "--seed", "3"])
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


def test_sample_errors_are_messages(bpe_run, tmp_path, capsys):
    assert sample.main([str(tmp_path / "nothing")]) == 2
    assert "error:" in capsys.readouterr().err
    os.rename(os.path.join(bpe_run, "tokenizer.json"), os.path.join(bpe_run, "moved.json"))
    try:
        assert sample.main([bpe_run]) == 2
        err = capsys.readouterr().err
        assert "tokenizer.json is missing" in err and "copy it back" in err
    finally:
        os.rename(os.path.join(bpe_run, "moved.json"), os.path.join(bpe_run, "tokenizer.json"))
    with pytest.raises(SystemExit):
        sample.main([])                          # neither the path nor --checkpoint
    with pytest.raises(SystemExit):
        sample.main([bpe_run, "--tokens", "0"])


def test_ctrl_c_ends_the_sample_with_the_tokens_printed_so_far(bpe_run, capsys, monkeypatch):
    """The tokens are printed as they come: Ctrl-C after 5 leaves those 5 on the screen
    (the same text as a 5-token sample) and exits 130."""
    from ringpipe.engine.model import gpt
    drawn = []
    last_logits = gpt.CachedDecoder.last_logits

    def interrupted(self, tokens):
        drawn.append(len(tokens))
        if len(drawn) == 6:
            raise KeyboardInterrupt
        return last_logits(self, tokens)

    monkeypatch.setattr(gpt.CachedDecoder, "last_logits", interrupted)
    try:
        code = sample.main([bpe_run, "--prompt", "the ring", "--tokens", "100", "--seed", "1"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped `ringpipe sample` as a traceback, the text generated so far unprinted")
    assert code == 130
    out, err = capsys.readouterr()
    assert "interrupted (Ctrl-C) after 5 of 100 tokens" in err
    monkeypatch.setattr(gpt.CachedDecoder, "last_logits", last_logits)
    assert sample.main([bpe_run, "--prompt", "the ring", "--tokens", "5", "--seed", "1"]) == 0
    assert out == capsys.readouterr().out
