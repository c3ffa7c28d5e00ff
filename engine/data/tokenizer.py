"""Tokenizers: text to token ids and back, saved as a Hugging Face tokenizer.json.

    tok = load_tokenizer("bytes")                      # ids are the UTF-8 bytes: vocab 256
    tok = load_tokenizer("path/to/tokenizer.json")     # any Hugging Face tokenizer (or a folder holding one)
    tok = train_bpe(texts, vocab_size=8192)            # byte-level BPE trained on your own text
    ids = tok.encode("hello")                          # numpy array (uint16, or uint32 over 65536 ids)
    tok.decode(ids); tok.save(folder); tok.identity

Every tokenizer, the bytes one included, is written as a tokenizer.json that
the `tokenizers` and `transformers` libraries load and that encodes text to
the same ids: a prepared dataset, a run directory and an exported model all
carry the tokenizer they were made with. Two are told apart by `identity`, a
hash of what decides the ids (tokenizer_identity), not of the file: a file that
`transformers` re-saved (a no-op post-processor added, merges re-written)
is the same tokenizer. `sha256` is the older hash of the whole file's JSON,
still read where data.json or a checkpoint recorded it.

A document's text is text: a special token's string inside it ("<|endoftext|>"
in a web page) is encoded as the characters it is, as tiktoken's
encode_ordinary does for llm.c and nanoGPT, never as the special token, so a
document cannot forge a separator and the ids match those peers'.

The bytes tokenizer encodes with numpy (it is the UTF-8 bytes, nothing more);
only "hf" tokenizers need the `tokenizers` library, which is imported lazily.
Nothing here downloads anything.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable

import numpy as np

from ringpipe.engine.job import files

# Token ids are stored as uint32 at most (llm.c's largest shard format).
MAX_VOCAB = 2**32
# The names of an end-of-document token, in the order we look for them when a
# tokenizer.json has no "<|endoftext|>" (GPT-2's): Llama 3's, then SentencePiece's.
END_OF_TEXT = "<|endoftext|>"
_OTHER_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>")
# A tokenizer.json is megabytes (Llama 3's: 9 MB); one past this is not a tokenizer,
# and would be read into memory whole before the JSON parser saw it.
MAX_TOKENIZER_JSON = 512 << 20


def _library_failure(e: BaseException) -> bool:
    """Whether `e` is the `tokenizers` library failing on its input: it raises bare
    Exception and TypeError (a lone surrogate in the text), and a panic in its Rust
    code surfaces as pyo3's PanicException, which derives from BaseException (so an
    `except Exception` misses it). Ctrl-C and exits are not failures to reword."""
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError)):
        return False
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def _failed(source: str, doing: str, e: BaseException,
            fix: str = "fix or replace the tokenizer.json, or use 'bytes' or bpe:VOCAB") -> ValueError:
    """The ValueError (exit code 2) for the library failing while `doing`, naming the tokenizer file."""
    detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ValueError(f"the tokenizer {source} failed while {doing} ({type(e).__name__}: {detail}); it is not a "
                      "tokenizer this library can use on this text (a pathological regex, a vocabulary without its "
                      f"unknown token?): {fix}")


class Tokenizer:
    """kind "bytes" (ids = UTF-8 bytes) or "hf" (a `tokenizers.Tokenizer`).

    vocab_size   ids are 0 .. vocab_size - 1
    separator    ids appended after every document: "\\n" for bytes; the
                 end-of-text token for hf if it has one, else the ids of "\\n"
    separator_bytes  how many bytes of text the separator stands for (for
                 bits per byte: 1 for "\\n", 0 for an end-of-text token)
    dtype        the smallest unsigned dtype holding every id (uint16 / uint32)
    """

    def __init__(self, kind: str, vocab_size: int, separator: tuple, separator_bytes: int, json_text: str,
                 hf=None, source: str = ""):
        if vocab_size > MAX_VOCAB:
            raise ValueError(f"the tokenizer {source or kind} has {vocab_size} tokens, more than 2^32: token ids "
                             "are stored as uint32 at most; use a tokenizer with a smaller vocabulary")
        if not separator:
            raise ValueError(f"the tokenizer {source or kind} has no end-of-text token and encodes '\\n' to nothing, "
                             "so documents could not be told apart; add an '<|endoftext|>' special token to it")
        self.kind = kind
        self.vocab_size = int(vocab_size)
        self.separator = tuple(int(i) for i in separator)
        self.separator_bytes = separator_bytes
        self.dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
        self.source = source or kind
        self._json = json_text
        self._hf = hf
        self.sha256 = json_sha256(json_text)
        self.identity = tokenizer_identity(json.loads(json_text))

    def __repr__(self):
        return f"Tokenizer({self.kind}, vocab {self.vocab_size}, from {self.source})"

    def encode(self, text: str) -> np.ndarray:
        """The token ids of `text` (no special tokens added: documents are joined by the separator)."""
        if self.kind == "bytes":
            return np.frombuffer(_utf8(text), dtype=np.uint8).astype(self.dtype)
        try:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        except BaseException as e:
            if not _library_failure(e):
                raise
            _utf8(text)                    # a lone surrogate is the text's fault: say so, not the tokenizer's
            raise _failed(self.source, "encoding text", e) from None
        return np.asarray(ids, dtype=self.dtype)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """encode() of each text; Hugging Face tokenizers encode the batch on several threads."""
        if self.kind == "bytes":
            return [self.encode(t) for t in texts]
        try:
            encodings = self._hf.encode_batch(texts, add_special_tokens=False)
        except BaseException as e:
            if not _library_failure(e):
                raise
            for t in texts:
                _utf8(t)                   # a lone surrogate is the text's fault: say so, not the tokenizer's
            raise _failed(self.source, "encoding text", e) from None
        return [np.asarray(e.ids, dtype=self.dtype) for e in encodings]

    def decode(self, ids) -> str:
        """Text of `ids`; a character cut off by the ends of `ids` becomes U+FFFD."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary of {self.source} (0..{self.vocab_size - 1})")
        if self.kind == "bytes":
            return bytes(ids).decode("utf-8", errors="replace")
        try:
            return self._hf.decode(ids, skip_special_tokens=False)
        except BaseException as e:
            if not _library_failure(e):
                raise
            raise _failed(self.source, "decoding ids", e) from None

    def to_json(self) -> str:
        """The tokenizer as a Hugging Face tokenizer.json."""
        return self._json

    def save(self, folder) -> str:
        """Write folder/tokenizer.json atomically (temp file, fsync, rename); returns its path."""
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "tokenizer.json")
        files.write_text_atomic(path, self._json)
        return path


def _utf8(text: str) -> bytes:
    """text as UTF-8; a lone surrogate (JSON's "\\ud800" decodes to one) is not Unicode
    text and has no UTF-8: a ValueError that says so, where the caller adds the file."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone surrogate U+{ord(text[e.start]):04X} at character {e.start} "
                         "(half of a UTF-16 pair, not a character): fix the text that produced it") from None


def file_sha256(json_text: str) -> str:
    """sha256 of the file's bytes (what `sha256sum tokenizer.json` prints for a UTF-8 file)."""
    return hashlib.sha256(json_text.encode("utf-8")).hexdigest()


# The model's settings whose default a file may write out or leave out (tokenizers 0.20
# added "ignore_merges"; an older file has none): left out of the identity when default.
_MODEL_DEFAULTS = {"dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                   "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}


# Settings of a normalizer or pre-tokenizer that newer `tokenizers` write out and older files
# leave out (GPT-2's Hub tokenizer.json has no "use_regex"): filled in with the default the
# library reads a missing one as, so a file re-saved by a newer library keeps its identity.
_COMPONENT_DEFAULTS = {"ByteLevel": {"add_prefix_space": True, "trim_offsets": True, "use_regex": True},
                       "Metaspace": {"replacement": "\u2581", "split": True}}


def _with_defaults(component):
    """A normalizer or pre-tokenizer (nested in a Sequence too) with _COMPONENT_DEFAULTS filled in.
    Metaspace's older add_prefix_space is its prepend_scheme "always" / "never"."""
    if isinstance(component, list):
        return [_with_defaults(c) for c in component]
    if not isinstance(component, dict):
        return component
    out = {key: _with_defaults(value) for key, value in component.items()}
    for key, default in _COMPONENT_DEFAULTS.get(out.get("type"), {}).items():
        out.setdefault(key, default)
    if out.get("type") == "Metaspace" and "prepend_scheme" not in out:
        out["prepend_scheme"] = "always" if out.pop("add_prefix_space", True) else "never"
    elif out.get("type") == "Metaspace":
        out.pop("add_prefix_space", None)
    return out


def tokenizer_identity(doc: dict) -> str:
    """sha256 of what decides the ids a tokenizer.json gives a text, as ringpipe encodes
    (no special tokens added): its model (vocabulary, merges, settings), normalizer,
    pre-tokenizer and added tokens, in canonical JSON. Not the post-processor (it only
    adds special tokens, which encode(add_special_tokens=False) never asks for), the
    decoder (text back, not ids), padding, truncation or the format's version: what
    `transformers`' save_pretrained changes. Merges are compared as pairs, whether the
    file writes "a b" (tokenizers < 0.20) or ["a", "b"]; a setting left out is its default
    (_MODEL_DEFAULTS, _COMPONENT_DEFAULTS)."""
    model = doc.get("model")
    model = dict(model) if isinstance(model, dict) else model
    if isinstance(model, dict):
        for key, default in _MODEL_DEFAULTS.items():
            if key in model and model[key] == default:
                del model[key]
        if isinstance(model.get("merges"), list):
            model["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
    added = doc.get("added_tokens") or []
    if isinstance(added, list):
        added = sorted(added, key=lambda t: json.dumps(t, sort_keys=True))
    what = {"model": model, "normalizer": _with_defaults(doc.get("normalizer")),
            "pre_tokenizer": _with_defaults(doc.get("pre_tokenizer")), "added_tokens": added}
    canonical = json.dumps(what, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def json_sha256(json_text: str) -> str:
    """sha256 of a JSON document in canonical form (keys sorted, no spaces), so the
    same tokenizer hashes alike however its file was indented or ordered."""
    canonical = json.dumps(json.loads(json_text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# ---- the bytes tokenizer ----------------------------------------------------------------

def _byte_level_characters() -> list[str]:
    """GPT-2's byte-to-character table (`bytes_to_unicode`): byte b is written as the
    character chars[b] in a byte-level tokenizer.json (printable bytes as themselves,
    the others shifted past U+0100 so that every token is visible text)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


def _bytes_tokenizer_json() -> str:
    """A Hugging Face byte-level BPE with the 256 byte characters as its vocabulary, in
    byte order, and no merges: it encodes any text to exactly its UTF-8 bytes. The
    ByteLevel pre-tokenizer runs without its regex (which would only split the text
    into words; with no merges that changes nothing) and adds no prefix space."""
    vocab = {char: b for b, char in enumerate(_byte_level_characters())}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    return json.dumps(doc, ensure_ascii=False, indent=2)


_BYTES = None


def bytes_tokenizer() -> Tokenizer:
    global _BYTES
    if _BYTES is None:
        _BYTES = Tokenizer("bytes", 256, separator=(10,), separator_bytes=1, json_text=_bytes_tokenizer_json())
    return _BYTES


# ---- Hugging Face tokenizers ------------------------------------------------------------

def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("this tokenizer needs the Hugging Face `tokenizers` library: "
                         "pip install 'tokenizers>=0.19' (or pip install -e '.[data]')") from None
    return tokenizers


# What to do about a file that is not a tokenizer, where the user chose it (--tokenizer);
# a caller that took the file from elsewhere (a model's folder) says what to do there.
CHOOSE_ANOTHER = ("pass a Hugging Face tokenizer.json (one that `tokenizers.Tokenizer.from_file` reads), 'bytes', "
                  "or bpe:VOCAB")


def from_json(json_text: str, source: str = "tokenizer.json", folder: str | None = None,
              fix: str = CHOOSE_ANOTHER) -> Tokenizer:
    """A Tokenizer from the text of a tokenizer.json. The bytes tokenizer's own file
    comes back as the bytes tokenizer (the fast numpy path); anything else is "hf".
    `folder`: where to look for a tokenizer_config.json naming the end-of-text token.
    `fix`: what a refusal tells the user to do. Whatever the file holds, a refusal is a
    ValueError naming `source`, the `tokenizers` library's own failures included."""
    try:
        parsed = files.parse_json(json_text, source)          # deep nesting too: a ValueError naming the file
    except ValueError as e:
        raise ValueError(f"{e}; {fix}") from None
    problem = _not_a_tokenizer(parsed)
    if problem:
        raise ValueError(f"{source} is JSON but not a Hugging Face tokenizer.json ({problem}); {fix}")
    if json_sha256(json_text) == bytes_tokenizer().sha256:
        return bytes_tokenizer()
    tokenizers = _import_tokenizers()
    try:
        hf = tokenizers.Tokenizer.from_str(json_text)
    except BaseException as e:    # the Rust library raises a bare Exception, or panics
        if not _library_failure(e):
            raise
        raise ValueError(f"{source} does not load as a Hugging Face tokenizer ({e}); {fix}") from None
    _text_is_text(hf, source)
    try:
        vocab_size = hf.get_vocab_size(with_added_tokens=True)
        # The ids must run 0 .. vocab_size - 1: take the largest id, since added tokens may sit past the model's.
        vocab_size = max(vocab_size, max(hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
        eos = _end_of_text(hf, folder)
        if eos is not None:
            separator, separator_bytes = (eos,), 0
        else:
            # Encoding here, at load, finds a model that fails on any text (a WordLevel
            # without its unknown token) before hours of work, not at the first document.
            separator = tuple(hf.encode("\n", add_special_tokens=False).ids)
            separator_bytes = 1
        hf.encode("Probe text, 123 .\n", add_special_tokens=False)
    except BaseException as e:
        if not _library_failure(e):
            raise
        raise _failed(source, "loading (its first encode)", e, fix) from None
    return Tokenizer("hf", vocab_size, separator, separator_bytes, json_text, hf=hf, source=source)


def _not_a_tokenizer(parsed) -> str | None:
    """What makes a parsed tokenizer.json not one, in words, or None: the shape every
    tokenizer.json has (an object whose "model" is an object with a "type" or a "vocab", and
    added tokens as a list of objects), checked before the library, whose own refusal of
    {"model": 5} ("data did not match any variant of untagged enum ModelUntagged") says little."""
    if not isinstance(parsed, dict):
        return f"it is a JSON {type(parsed).__name__}, not an object"
    if "model" not in parsed:
        return 'it has no "model"'
    algorithm = parsed["model"]            # BPE, Unigram, WordPiece, WordLevel: its type and vocabulary
    if not isinstance(algorithm, dict) or not ("type" in algorithm or "vocab" in algorithm):
        return f'its "model" is {json.dumps(algorithm)[:60]}, not an object with a "type" and a "vocab"'
    added = parsed.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(token, dict) for token in added):
        return 'its "added_tokens" is not a list of objects'
    return None


def _text_is_text(hf, source: str) -> None:
    """Encode special tokens' strings in a text as text (see the module's docstring).
    The switch is tokenizers' `encode_special_tokens` (0.14 on); a library without it
    would make "<|endoftext|>" in a document a separator: refused, not done silently."""
    if not hasattr(hf, "encode_special_tokens"):
        import tokenizers
        raise ValueError(f"the tokenizer {source} needs tokenizers >= 0.14 to encode special tokens' strings in "
                         f"a text as text (this is {tokenizers.__version__}): pip install 'tokenizers>=0.19'")
    hf.encode_special_tokens = True


def _end_of_text(hf, folder):
    """The id of the tokenizer's end-of-document token, or None: "<|endoftext|>", else the
    eos_token of a tokenizer_config.json beside it, else a special token with a usual name."""
    if hf.token_to_id(END_OF_TEXT) is not None:
        return hf.token_to_id(END_OF_TEXT)
    config_path = os.path.join(folder, "tokenizer_config.json") if folder else None
    if config_path and os.path.lexists(config_path):
        try:                                # a FIFO here must not block, nor a deep one recurse: files.read_json
            eos = files.read_json(config_path, "tokenizer config", 16 << 20).get("eos_token")
        except (ValueError, AttributeError):
            eos = None                      # an unreadable config only loses the hint
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and hf.token_to_id(eos) is not None:
            return hf.token_to_id(eos)
    for name in _OTHER_EOS_NAMES:
        if hf.token_to_id(name) is not None:
            return hf.token_to_id(name)
    return None


def load_tokenizer(spec: str) -> Tokenizer:
    """ "bytes", a tokenizer.json file, or a folder holding one (a run directory, a
    prepared dataset, a Hugging Face model folder)."""
    if spec == "bytes":
        return bytes_tokenizer()
    if isinstance(spec, str) and spec.startswith("bpe:"):
        raise ValueError(f"--tokenizer {spec} trains a new tokenizer, which only `ringpipe prepare` does; "
                         "elsewhere pass the tokenizer.json it wrote (in the data folder)")
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.exists(path):
        where = f"the folder {spec} holds no tokenizer.json" if os.path.isdir(spec) else f"{spec} does not exist"
        raise ValueError(f"tokenizer: {where}; pass 'bytes', bpe:VOCAB (prepare only), a tokenizer.json "
                         "or a folder holding one")
    # A FIFO or device is refused without blocking, a huge file before it is read (files.read_regular).
    raw = files.read_regular(path, "tokenizer", MAX_TOKENIZER_JSON)
    try:
        json_text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text, so not a tokenizer.json; pass a Hugging Face "
                         "tokenizer.json, 'bytes', or bpe:VOCAB") from None
    return from_json(json_text, source=path, folder=os.path.dirname(path))


def parse_vocab_spec(spec: str) -> int:
    """The VOCAB of "bpe:VOCAB", checked: more than the 256 bytes + the end-of-text token."""
    text = spec[len("bpe:"):]
    try:
        vocab_size = int(text)
    except ValueError:
        raise ValueError(f"--tokenizer {spec}: {text!r} is not a whole number; say how many tokens the BPE "
                         "vocabulary has, e.g. bpe:8192") from None
    if vocab_size <= 256 + 1:
        raise ValueError(f"--tokenizer {spec}: a byte-level BPE needs more than {256 + 1} tokens (the 256 bytes "
                         "and <|endoftext|>, then the merges it learns); use e.g. bpe:8192")
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"--tokenizer {spec}: more than 2^32 tokens, but token ids are stored as uint32 at "
                         "most; use a smaller vocabulary, e.g. bpe:50257")
    return vocab_size


def train_bpe(texts: Iterable[str], vocab_size: int, progress: bool = False) -> Tokenizer:
    """A byte-level BPE (GPT-2's design: the 256 byte characters, then learned merges
    of frequent pairs within words) trained by Hugging Face `tokenizers` on `texts`,
    with "<|endoftext|>" (id 0) as its one special token: the separator. The same
    texts give the same tokenizer.json. Fewer merges than asked are learned when
    the text runs out of pairs; vocab_size then says how many there are."""
    if vocab_size <= 256 + 1 or vocab_size > MAX_VOCAB:
        parse_vocab_spec(f"bpe:{vocab_size}")           # raises the message that explains
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    try:
        hf.train_from_iterator(texts, trainer=trainer)
    except BaseException as e:
        if not _library_failure(e) or isinstance(e, ValueError):
            raise                          # ValueError: the texts' own refusal (a bad input file), already worded
        raise _failed(f"bpe:{vocab_size}", "training", e) from None
    return from_json(hf.to_str(pretty=True), source=f"bpe:{vocab_size}")
