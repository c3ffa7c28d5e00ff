"""`ringpipe sample` prints the text as the tokens come, ends at Ctrl-C with what was
generated (exit 130), and refuses counts and temperatures that make no sense before it
loads anything. Before, `--tokens 10^20` ran forever printing nothing, and
`--temperature 1e-320` overflowed numpy and sampled anyway.

No model here: stream_sample is fed token ids by a stand-in for generate.
"""
import io

import pytest

from ringpipe.engine.data.tokenizer import load_tokenizer
from ringpipe.engine.interop import sample

BYTES = load_tokenizer("bytes")
TEXT = "héllo\nwörld ≠ " + "x" * 600          # two-byte and three-byte characters, a line end, a long line


class Screen(io.StringIO):
    """stdout as a reader sees it: what was flushed so far."""

    def __init__(self):
        super().__init__()
        self.flushed = []

    def flush(self):
        self.flushed.append(self.getvalue())


def feeding(ids, interrupt_after=None):
    """A stand-in for generate(on_token): hands out `ids`, Ctrl-C after `interrupt_after`."""
    def generate(on_token):
        for n, token in enumerate(ids):
            if n == interrupt_after:
                raise KeyboardInterrupt
            on_token(token)
        return list(ids)
    return generate


def test_the_text_is_printed_as_the_tokens_come():
    ids = list(TEXT.encode())
    screen = Screen()
    seen = []

    def generate(on_token):
        for token in ids:
            on_token(token)
            seen.append(screen.getvalue())           # what the reader has after each token
        return ids

    assert sample.stream_sample(generate, BYTES, "say: ", len(ids), out=screen) == 0
    assert screen.getvalue() == "say: " + TEXT + "\n"
    assert seen[0] == "say: h"                       # the first token is on screen before the second is drawn
    assert seen[1] == "say: h"                       # half of é: held back, never shown as U+FFFD
    assert seen[2] == "say: hé"
    assert all("\ufffd" not in shown for shown in seen)
    assert all(TEXT.startswith(shown[5:]) for shown in seen)
    assert screen.flushed[-1] == screen.getvalue()


def test_ctrl_c_keeps_what_was_generated_and_exits_130(capsys):
    ids = list(TEXT.encode())
    screen = Screen()
    assert sample.stream_sample(feeding(ids, interrupt_after=4), BYTES, "", len(ids), out=screen) == 130
    assert screen.getvalue() == "hél\n"              # the 4 tokens (h, é's two bytes, l), and the line's end
    assert f"interrupted (Ctrl-C) after 4 of {len(ids)} tokens" in capsys.readouterr().err


def test_a_character_cut_off_by_ctrl_c_shows_as_a_replacement():
    screen = Screen()
    assert sample.stream_sample(feeding(list("é".encode()), interrupt_after=1), BYTES, "", 2, out=screen) == 130
    assert screen.getvalue() == "\ufffd\n"


@pytest.mark.parametrize("flags, says", [
    (["--tokens", "99999999999999999999"], "--tokens must be 1 to 1,000,000"),
    (["--tokens", "0"], "--tokens must be 1 to 1,000,000"),
    (["--temperature", "1e-320"], "--temperature must be 0 (always the likeliest token) or 0.001 to 100"),
    (["--temperature", "1e9"], "--temperature must be 0"),
    (["--temperature", "nan"], "--temperature must be 0"),
    (["--seed", "99999999999999999999"], "--seed must be a whole number from 0 to 2^63 - 1"),
])
def test_nonsense_is_refused_before_anything_loads(tmp_path, capsys, flags, says):
    with pytest.raises(SystemExit) as refused:
        sample.main([str(tmp_path / "no-such-run"), *flags])
    assert refused.value.code == 2
    assert says in capsys.readouterr().err
