"""engine/data/tokenizer.py at its boundary (issue 34): a file that is JSON but not a tokenizer
is refused naming the file and saying what the shape lacks, before the `tokenizers` library
is asked (its own refusal of {"model": 5}, "data did not match any variant of untagged enum
ModelUntagged", says little), and a caller that took the file from elsewhere (a model's
folder) says what to do there."""
import json

import pytest

from ringpipe.engine.data import tokenizer as tk

NOT_TOKENIZERS = {
    "model a number": ({"model": 5}, 'its "model" is 5, not an object'),
    "model null": ({"model": None}, 'its "model" is null'),
    "model empty": ({"model": {}}, 'its "model" is {}'),
    "no model": ({"vocab": {"a": 0}}, 'it has no "model"'),
    "a list": ([{"model": {}}], "it is a JSON list, not an object"),
    "added tokens a number": ({"model": {"type": "BPE", "vocab": {}, "merges": []}, "added_tokens": 5},
                              '"added_tokens" is not a list of objects'),
}


@pytest.mark.parametrize("document, says", NOT_TOKENIZERS.values(), ids=NOT_TOKENIZERS.keys())
def test_json_that_is_not_a_tokenizer_is_refused_naming_the_file_and_what_it_lacks(tmp_path, document, says):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError) as refused:
        tk.load_tokenizer(str(path))
    message = str(refused.value)
    assert message.startswith(f"{path} is JSON but not a Hugging Face tokenizer.json ("), message
    assert says in message and tk.CHOOSE_ANOTHER in message, message


def test_the_caller_says_what_to_do_with_a_file_it_did_not_choose():
    with pytest.raises(ValueError, match=r"m/tokenizer.json is JSON but not .*; replace the model's"):
        tk.from_json('{"model": 5}', source="m/tokenizer.json", fix="replace the model's")
