"""What every family's Hugging Face conversion shares (hf.py's GPT-2, hf_llama.py's Llama): the
folder's files, read and written, and the checks made of them. hf.py dispatches a family to
its module; both import this one, and it imports neither.

    HFError                          a folder or a model that cannot be converted (a ValueError)
    checked(where, key, value)       a config.json value against its rule (hf_values.RULES)
    check_memory(n_params, where)    refuse a declared model a conversion cannot hold in memory
    weight_files, read_headers,      the safetensors files of a folder, their headers (shapes
    read_tensors                     checked against the file, no data read), then the tensors
                                     as float32, each checked finite
    Tokenizer, tokenizer_of          a tokenizer.json read as JSON (its size and special tokens)
    write_model_folder               tensors and files into a temp folder renamed into place;
                                     check_out_dir: what --out may replace (never a run, a
                                     dataset, a folder of other things)

Only safetensors files are read or written: a pickle can run code when it is loaded.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import struct
import tempfile

import numpy as np

from ringpipe.engine.interop import hf_values
from ringpipe.engine.job import checkpoint, files


class HFError(ValueError):
    """A Hugging Face folder, or a model, that cannot be converted; the message says why."""


# ---- config values and sizes, checked before anything is built ---------------------------------

def checked(where: str, key: str, value):
    """value, if it holds the rule of `key` (hf_values.RULES; a dotted key, rope_scaling.factor,
    by its last part); else HFError saying what to set it to."""
    rule = hf_values.RULES[key.rsplit(".", 1)[-1]]
    if not rule.holds(value):
        raise HFError(hf_values.invalid(where, key, value, rule.expected()))
    return value


# Bytes a conversion holds per parameter, at most, as float32: the tensors as read and the
# converted (or loaded-into) copy. A bound to refuse the hopeless early, not an estimate.
_CONVERSION_COPIES = 2


def _available_memory():
    """Bytes of memory available now (MemAvailable of /proc/meminfo), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(n_params: int, where: str, floats: int | None = None) -> None:
    """Refuse the model of n_params parameters that `where` declares when a conversion of it
    (_CONVERSION_COPIES float32 copies of `floats` values, n_params unless given) needs more
    memory than is available now."""
    need = _CONVERSION_COPIES * 4 * (n_params if floats is None else floats)
    available = _available_memory()
    if available is not None and need > available:
        raise HFError(f"{where} declares a model of {n_params:,} parameters: it needs about {need / 2**30:.1f} GiB "
                      f"of memory here, and {available / 2**30:.1f} GiB are available; use a machine with more "
                      "memory")


def layer_indices(names) -> set:
    """The block indices i of the names "h.<i>.<...>" (ours), written without leading zeros."""
    found = set()
    for name in names:
        match = re.fullmatch(r"h\.(0|[1-9][0-9]*)\..+", name)
        if match:
            found.add(int(match.group(1)))
    return found


def param_arrays(arrays: dict) -> dict:
    """{our name: array}: the "param/" arrays of a checkpoint, or already bare names."""
    params = {name[len("param/"):]: array for name, array in arrays.items() if name.startswith("param/")}
    return params or dict(arrays)


# ---- reading a folder --------------------------------------------------------------------------

# Limits on the JSON files of a model folder: far above any real one, far below a problem.
MAX_CONFIG_BYTES = files.MiB                # config.json, generation_config.json: a few KB
MAX_INDEX_BYTES = 64 * files.MiB            # model.safetensors.index.json: ~100 bytes a tensor
MAX_TOKENIZER_BYTES = 256 * files.MiB       # tokenizer.json: GPT-2's 1.4 MB, large vocabularies tens of MB
MAX_HEADER_BYTES = 100 * files.MiB          # a safetensors header: the library's own limit


def files_call(function, *args):
    """engine/files' readers, their refusals (UnreadableFile) as HFError for our callers."""
    try:
        return function(*args)
    except files.UnreadableFile as e:
        raise HFError(str(e)) from None


def read_json(path: str, what: str, limit: int):
    return files_call(files.read_json, path, what, limit)


def weight_files(hf_dir: str) -> list:
    """The safetensors files of a model folder: model.safetensors, or the shards that
    model.safetensors.index.json names. Pickled weights are refused, never opened."""
    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    # lexists, not isfile: a FIFO or a device under the name is refused by name when it is
    # opened (engine/files), not mistaken for a missing file.
    if os.path.lexists(single):
        return [single]
    if os.path.lexists(index):
        return _shard_files(index, hf_dir)
    names = os.listdir(hf_dir)
    pickles = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    if pickles:
        raise HFError(f"{hf_dir} holds its weights only as {pickles[0]}, a pickle, which ringpipe never loads "
                      "(loading a pickle can run code). Convert it to safetensors: load it with transformers "
                      "where you trust it and re-save it with model.save_pretrained(folder, "
                      "safe_serialization=True)")
    raise HFError(f"{hf_dir} has no model.safetensors (nor model.safetensors.index.json)")


def _shard_files(index: str, hf_dir: str) -> list:
    document = read_json(index, "the weights index", MAX_INDEX_BYTES)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise HFError(f"{index} has no \"weight_map\" object: it is not a model.safetensors.index.json")
    shards = list(weight_map.values())
    files_ = []
    for shard in sorted(set(shards)) if all(isinstance(v, str) for v in shards) else shards:
        # A shard is a file next to the index, never a path elsewhere on the machine.
        if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise HFError(f"{index} names the shard {shard!r}; expected a file name in {hf_dir}")
        path = os.path.join(hf_dir, shard)
        if not os.path.lexists(path):
            raise HFError(f"{index} names the shard {shard}, which is missing")
        files_.append(path)
    return files_


# safetensors' float dtypes and their bytes per element: a GPT's weights are floats. An
# integer or boolean tensor would be cast to float and trained on as if it were weights.
_FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
# Buffers older transformers saved with a GPT-2's weights (the causal mask, bool or integer in
# some files): not parameters, so their dtype is not checked and they are never read.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


def read_headers(paths: list, hf_dir: str) -> dict:
    """{tensor name: (dtype, shape, (path, absolute offset of its data))} of every tensor in
    the files, from their headers alone; a tensor in two files is refused."""
    headers = {}
    for path in paths:
        for name, entry in safetensors_header(path).items():
            if name in headers:
                raise HFError(f"{hf_dir}: the tensor {name} is in two shards")
            headers[name] = entry
    return headers


def safetensors_header(path: str) -> dict:
    """{tensor name: (dtype, shape, (path, data offset))} from one safetensors file's header,
    every entry checked against the file's size; no tensor data is read. The layout: an
    8-byte little-endian header size, the JSON header, then the data (offsets relative to
    its start)."""
    fd = files_call(files.open_regular, path, "the weights file")
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) != 8:
            raise HFError(f"{path} is {size} bytes, too short to be a safetensors file")
        (header_size,) = struct.unpack("<Q", head)
        if header_size > min(size - 8, MAX_HEADER_BYTES):
            raise HFError(f"{path} declares a header of {header_size:,} bytes, more than the file's {size:,} bytes "
                          f"or safetensors' {MAX_HEADER_BYTES:,}: it is not a safetensors file, or it is damaged")
        header = files_call(files.parse_json, fh.read(header_size), f"the header of {path}")
    if not isinstance(header, dict):
        raise HFError(f"the header of {path} is not a JSON object: it is not a safetensors file")
    data_size = size - 8 - header_size
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or not isinstance(shape, list)
                or not all(type(n) is int and n >= 0 for n in shape) or not isinstance(offsets, list)
                or len(offsets) != 2 or not all(type(n) is int for n in offsets)):
            raise HFError(f"{path}: the header's entry for the tensor {name} is malformed (expected dtype, shape "
                          "and data_offsets): the file is damaged or not safetensors")
        dtype = info["dtype"]
        if dtype not in _FLOAT_DTYPES and not name.endswith(MASK_BUFFERS):
            raise HFError(f"{path}: the tensor {name} is {dtype}, not a float type (F16, BF16, F32 or F64): a "
                          "GPT-2's weights are floats, and ringpipe would cast it to float and train on it; "
                          "remove the tensor or store it as floats")
        begin, end = offsets
        itemsize = _FLOAT_DTYPES.get(dtype)
        if not 0 <= begin <= end <= data_size or (itemsize and end - begin != math.prod(shape) * itemsize):
            raise HFError(f"{path}: the tensor {name} declares shape {tuple(shape)} of {dtype} at bytes "
                          f"{begin}..{end}, which the file's {data_size:,} bytes of data do not hold: it is "
                          "truncated or damaged")
        entries[name] = (dtype, tuple(shape), (path, 8 + header_size + begin))
    return entries


_NUMPY = {"F16": "<f2", "BF16": "<u2", "F32": "<f4", "F64": "<f8"}
_ROWS_AT_ONCE = 64 << 20          # bytes of a tensor read at a time by TensorBoxes


class TensorBoxes:
    """Boxes of a folder's tensors, read from their safetensors files without reading them
    whole: a rank that holds a slice of a parameter (its tensor-parallel part, its ZeRO-3
    chunk) reads that slice's rows, 64 MiB at a time, and casts and checks them (finite
    float32) as it goes. `read_box(name, box, out)` is the reader engine/parallel/slices.py's
    fill takes ("param/<our name>"), so an import is a sharded checkpoint's read.

    entries: {our name: (dtype, shape, (path, data offset))}, read_headers' entries under our
    names; rows: {our name: row count} for a parameter with padding rows beyond the tensor's
    (the vocabulary's): those read as zeros; transposed: our names whose tensor is stored
    transposed (GPT-2's Conv1D weights); names: {our name: the folder's}, which a refusal names."""

    def __init__(self, entries: dict, rows: dict | None = None, transposed=(), names: dict | None = None):
        self.entries, self.rows, self.transposed = entries, rows or {}, set(transposed)
        self.names = names or {}           # {our name: the folder's}, for what a refusal names
        self.bytes_read = 0                # of tensor data, by read_box (what a sharded import costs a rank)

    def shape(self, ours: str) -> tuple:
        _, shape, _ = self.entries[ours]
        shape = tuple(reversed(shape)) if ours in self.transposed else tuple(shape)
        return (self.rows[ours], *shape[1:]) if ours in self.rows else shape

    def read_whole(self, ours: str) -> np.ndarray:
        out = np.empty(self.shape(ours), dtype=np.float32)
        self.read_box(f"param/{ours}", [(0, n) for n in out.shape], out)
        return out

    def read_box(self, name: str, box, out) -> None:
        ours = name[len("param/"):] if name.startswith("param/") else name
        if ours in self.transposed:        # GPT-2's Conv1D weights, stored as the transpose of ours
            theirs = np.empty(out.shape[::-1], dtype=np.float32)
            self._read_stored(ours, box[::-1], theirs)
            out[...] = theirs.T
        else:
            self._read_stored(ours, box, out)

    def _read_stored(self, ours: str, box, out) -> None:
        """The box of the tensor as it is stored (its rows, whole, 64 MiB at a time)."""
        dtype, shape, (path, offset) = self.entries[ours]
        stored = shape[0] if shape else 1
        (r0, r1), rest = box[0], box[1:]
        row_items = math.prod(shape[1:])
        itemsize = _FLOAT_DTYPES[dtype]
        step = max(1, _ROWS_AT_ONCE // max(1, row_items * itemsize))
        fd = files_call(files.open_regular, path, "the weights file")
        with os.fdopen(fd, "rb") as fh:
            for a in range(r0, min(r1, stored), step):
                b = min(a + step, r1, stored)
                fh.seek(offset + a * row_items * itemsize)
                raw = np.frombuffer(fh.read((b - a) * row_items * itemsize), dtype=_NUMPY[dtype])
                self.bytes_read += raw.nbytes
                if raw.size != (b - a) * row_items:
                    raise HFError(f"{path} ends inside the tensor data: it was truncated while it was read")
                if dtype == "BF16":
                    raw = (raw.astype(np.uint32) << 16).view(np.float32)
                rows = raw.reshape(b - a, *shape[1:])[(slice(None), *(slice(lo, hi) for lo, hi in rest))]
                out[a - r0:b - r0] = _finite_float32(rows, self.names.get(ours, ours), path, count=math.prod(shape))
        if r1 > stored:            # padding rows: no token id reaches them, zeros keep the import deterministic
            out[max(0, stored - r0):] = 0

    def same(self, ours: str, other: tuple) -> bool:
        """Whether the tensor `other` (a read_headers entry) holds the same values as `ours`'s
        stored rows, compared 64 MiB at a time (a tied head against the embedding)."""
        _, shape, _ = self.entries[ours]
        mirror = TensorBoxes({"x": other}, names={"x": "lm_head.weight"})
        if tuple(other[1]) != tuple(shape):
            return False
        step = max(1, _ROWS_AT_ONCE // max(1, math.prod(shape[1:]) * 4))
        for a in range(0, shape[0], step):
            box = [(a, min(a + step, shape[0])), *((0, n) for n in shape[1:])]
            mine = np.empty([hi - lo for lo, hi in box], dtype=np.float32)
            theirs = np.empty_like(mine)
            self._read_stored(ours, box, mine)
            mirror._read_stored("x", box, theirs)
            if not np.array_equal(mine, theirs):
                return False
        return True


def read_tensors(headers: dict) -> dict:
    """{name: float32 array, checked finite} of the tensors in `headers` (read_headers), read
    after their shapes were checked. The old causal-mask buffers are not read: nothing uses them."""
    by_file = {}
    for name, (dtype, shape, (path, _)) in headers.items():
        if not name.endswith(MASK_BUFFERS):
            by_file.setdefault(path, []).append(name)
    tensors = {}
    for path, names in by_file.items():
        tensors.update(_read_safetensors_file(path, names, headers))
    return tensors


def _read_safetensors_file(path: str, names: list, headers: dict) -> dict:
    """{name: float32 array} of the tensors `names` of one file, each checked finite as it is read."""
    safetensors = _safetensors("safe_open")
    tensors = {}
    try:
        with safetensors.safe_open(path, framework="np") as fh:
            for name in names:
                if headers[name][0] == "BF16":
                    tensor = _read_bf16(headers[name])     # numpy has no bfloat16
                else:
                    tensor = fh.get_tensor(name)
                tensors[name] = _finite_float32(tensor, name, path)
    except HFError:
        raise
    except Exception as e:   # the library raises its own types (SafetensorError, TypeError) for a bad file
        raise HFError(f"{path} cannot be read as safetensors ({type(e).__name__}: {e})") from None
    return tensors


def _finite_float32(tensor: np.ndarray, name: str, path: str, count: int | None = None) -> np.ndarray:
    """The tensor as float32, ringpipe's weights, refused naming it unless every value is finite
    there: a NaN or infinite weight (or a float64 one beyond float32's range, which becomes
    infinite) would otherwise surface steps later as "training diverged... lower --lr",
    blaming the learning rate for the file. count: the whole tensor's size where `tensor` is
    a part of it (TensorBoxes reads rows), so the refusal says which it counted."""
    with np.errstate(over="ignore", invalid="ignore"):
        weights = tensor.astype(np.float32, copy=False)
        # One pass, no temporary array: a float64 sum of finite float32 values cannot overflow
        # (each is at most 3.4e38; 2**64 of them sum to 6e57), so it is finite exactly when they all are.
        if math.isfinite(weights.sum(dtype=np.float64)):
            return weights
        bad = int(weights.size - np.count_nonzero(np.isfinite(weights)))
        unrepresentable = bool(np.isfinite(tensor).all())
    part = "" if count in (None, weights.size) else f" in the {weights.size:,} read"
    whole = weights.size if count is None else count
    what = (f"{bad:,} of its {whole:,} values beyond float32's range (3.4e38){part}, which ringpipe trains in"
            if unrepresentable else f"{bad:,} NaN or infinite values{part} (of {whole:,})")
    raise HFError(f"{path}: the tensor {name} holds {what}: the weights are damaged, or were saved from a run that "
                  "diverged; use an undamaged copy of the model (download it again, or take an earlier checkpoint)")


def _read_bf16(entry) -> np.ndarray:
    """A bfloat16 tensor as float32: bfloat16 is the top 16 bits of a float32. Its place
    and size in the file come from the checked header (safetensors_header)."""
    _, shape, (path, offset) = entry
    count = math.prod(shape)
    fd = files_call(files.open_regular, path, "the weights file")
    with os.fdopen(fd, "rb") as fh:
        fh.seek(offset)
        raw = np.frombuffer(fh.read(2 * count), dtype="<u2")
    if raw.size != count:
        raise HFError(f"{path} ends inside the tensor data: it was truncated while it was read")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)


# ---- the tokenizer -----------------------------------------------------------------------------

# Tokens that end a text, in the order we look for them (engine/data/tokenizer.py's order):
# GPT-2's, Llama 3's, then SentencePiece's.
_END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class Tokenizer:
    """A tokenizer.json (the `tokenizers` library's format), read as JSON: we only need
    its size and its special tokens, and copy the file as it is."""

    def __init__(self, text: str, ids: dict, special: list):
        self.text = text            # the file's exact text
        self.ids = ids              # {token: id} of the model's vocabulary and the added tokens
        self.special = special      # the added tokens marked special

    @classmethod
    def read(cls, tokenizer_json: str, vocab: int) -> "Tokenizer":
        if tokenizer_json.lstrip().startswith("{"):
            text, where = tokenizer_json, "the tokenizer JSON"
        else:
            where = tokenizer_json
            raw = files_call(files.read_regular, tokenizer_json, "the tokenizer", MAX_TOKENIZER_BYTES)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise HFError(f"the tokenizer {tokenizer_json} is not UTF-8 text (byte {e.start})") from None
        data = files_call(files.parse_json, text, where)
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise HFError(f"{where} is not a tokenizer.json of the tokenizers library (its \"model\" is missing or "
                          "not an object)")
        ids = {}
        vocab_entries = data["model"].get("vocab")
        added = data.get("added_tokens") or []
        if isinstance(vocab_entries, list) and not all(isinstance(e, list) and e and isinstance(e[0], str)
                                                       for e in vocab_entries):
            raise HFError(f"{where}: its Unigram vocabulary is not a list of [piece, score] pairs")
        if not isinstance(added, list) or not all(isinstance(t, dict) and isinstance(t.get("content"), str)
                                                  for t in added):
            raise HFError(f"{where}: its added_tokens is not a list of tokens (objects with a content and an id)")
        if isinstance(vocab_entries, dict):              # BPE, WordPiece, WordLevel: {token: id}
            ids.update(vocab_entries)
        elif isinstance(vocab_entries, list):            # Unigram: [[piece, score], ...] in id order
            ids.update({entry[0]: i for i, entry in enumerate(vocab_entries)})
        special = []
        for token in added:
            ids[token["content"]] = token.get("id")
            if token.get("special"):
                special.append(token["content"])
        if not ids or not all(type(i) is int and i >= 0 for i in ids.values()):
            raise HFError(f"{where} holds no vocabulary of token ids")
        size = max(ids.values()) + 1
        if size > vocab:
            raise HFError(f"the tokenizer {where} has {size} token ids, more than the model's vocabulary of "
                          f"{vocab}: it is not the tokenizer this model was trained with")
        return cls(text, ids, special)

    def end_of_text_id(self):
        """GPT-2's bos and eos are one token, <|endoftext|>; use it (or another end-of-text
        token) if the tokenizer has one, else no bos/eos at all (a byte tokenizer)."""
        for token in _END_OF_TEXT_TOKENS:
            if token in self.ids:
                return self.ids[token]
        return None

    def _special_token(self, special_id):
        return next(t for t, i in self.ids.items() if i == special_id) if special_id is not None else None

    def config(self, context: int, bos_id, eos_id) -> dict:
        """tokenizer_config.json: AutoTokenizer builds a PreTrainedTokenizerFast over tokenizer.json."""
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
                "bos_token": self._special_token(bos_id), "eos_token": self._special_token(eos_id),
                "clean_up_tokenization_spaces": False}

    def special_tokens_map(self, bos_id, eos_id) -> dict:
        tokens = {"bos_token": self._special_token(bos_id), "eos_token": self._special_token(eos_id)}
        return {key: token for key, token in tokens.items() if token is not None}


def tokenizer_of(hf_dir: str) -> str | None:
    """The path of the folder's tokenizer.json, or None where it has none; HFError naming it
    where it is not a tokenizer."""
    tokenizer = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.lexists(tokenizer):
        return None
    _check_model_tokenizer(tokenizer, hf_dir)
    return tokenizer


def _check_model_tokenizer(path: str, hf_dir: str) -> None:
    """Refuse a model folder's tokenizer.json that is not a tokenizer (a FIFO, deep JSON,
    {"model": 5}) at import, naming it: on every rank and before any work, not where the data
    is compared with it later (a traceback there). Read as export reads it (its vocabulary),
    then, where the `tokenizers` library is installed, as the run reads it
    (engine/data/tokenizer.py: whatever the library raises is named too)."""
    fix = ("replace it with the tokenizer.json the model was published with, or remove it (the data's tokenizer "
           "then cannot be checked against the model's)")
    try:
        tokenizer = Tokenizer.read(path, hf_values.MAX_VOCAB)
    except HFError as e:
        raise HFError(f"{e}; {fix}") from None
    if importlib.util.find_spec("tokenizers") is None:
        return                      # only the size is read then (check_init_data), and it was
    from ringpipe.engine.data.tokenizer import from_json
    try:
        from_json(tokenizer.text, source=path, folder=hf_dir, fix=fix)
    except ValueError as e:
        raise HFError(str(e)) from None


# ---- writing a folder --------------------------------------------------------------------------

def write_model_folder(tensors: dict, files: dict, out_dir: str, overwrite: bool, protect) -> str:
    """model.safetensors of `tensors` and the files {name: bytes}, written into a temp folder
    renamed into place (export_hf's contract); returns out_dir's absolute path. A failure to
    write is an HFError naming out_dir (not the temp folder, which is removed)."""
    out_dir = os.path.abspath(out_dir)
    check_out_dir(out_dir, overwrite, protect)
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    except OSError as e:                # /proc/self/x: the checks above cannot foresee every filesystem
        raise HFError(f"--out {out_dir}: cannot create a folder in {parent} ({e.strerror or e}); choose --out in "
                      "a folder you can write to") from None
    try:
        try:
            _write_files(tmp, tensors, files)
        except OSError as e:
            raise HFError(f"--out {out_dir}: writing the model failed ({e.strerror or e}), and nothing was written "
                          "there; free space on its filesystem, or choose another --out") from None
        check_out_dir(out_dir, overwrite, protect)     # again: it may have changed while we wrote
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_files(tmp: str, tensors: dict, files: dict) -> None:
    _save_safetensors(tensors, os.path.join(tmp, "model.safetensors"))
    for name, data in files.items():
        with open(os.path.join(tmp, name), "wb") as fh:
            fh.write(data)
    # mkdtemp makes the folder 0700 and safetensors writes its file 0600: give both the
    # modes every other file of the user gets (their umask), so the folder is not
    # readable while model.safetensors, the one file that matters, is not.
    umask = _umask()
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
        _fsync(os.path.join(tmp, name))
    os.chmod(tmp, 0o777 & ~umask)


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _save_safetensors(tensors: dict, path: str) -> None:
    numpy_api = _safetensors("numpy")
    # transformers refuses a safetensors file whose metadata does not name a framework;
    # "pt" is what save_pretrained writes.
    try:
        numpy_api.save_file(tensors, path, metadata={"format": "pt"})
    except OSError:
        raise
    except Exception as e:      # the Rust library's SafetensorError wraps the I/O error: "... (os error 28)"
        code = re.search(r"os error ([0-9]+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from None


def _safetensors(module: str):
    try:
        if module == "numpy":
            import safetensors.numpy as found
        else:
            import safetensors as found
    except ImportError:
        raise HFError("reading and writing Hugging Face model files needs the safetensors package: "
                      "pip install 'ringpipe[hf]' (or pip install safetensors)") from None
    return found


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc: setting it
    to read it back would briefly change it for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: str) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


# What a model folder is made of: what export_hf writes, what save_pretrained writes for a
# GPT-2 (sharded weights, the slow tokenizer's files) and what a Hub download adds. Only a
# folder of these is ever replaced: --overwrite of a parent folder (--out ., --out ~) must
# not delete everything in it, the run being exported included.
_MODEL_FOLDER_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json", "README.md", ".gitattributes"})


_SHARD_NAME = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")
_RUN_DIR_MARKERS = ("run.lock", "checkpoints", "metrics.jsonl", "finished")


def _is_model_file(folder: str, name: str) -> bool:
    if name not in _MODEL_FOLDER_FILES and not _SHARD_NAME.fullmatch(name):
        return False
    path = os.path.join(folder, name)
    return os.path.islink(path) or os.path.isfile(path)     # a Hub snapshot's files are links


def _within(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def check_out_dir(out_dir: str, overwrite: bool, protect=()) -> None:
    """Refuse an out_dir that an export must not replace; return if it may be written (it
    is new or empty, or it is a model folder and overwrite is given). Only a refusal that
    --overwrite would lift suggests it."""
    _check_destination(out_dir)
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"--out {out_dir} exists and is not a folder; choose the path of a new folder")
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        return
    names = sorted(os.listdir(out_dir))
    real = os.path.realpath(out_dir)
    for source in protect:
        src = os.path.realpath(source)
        if real == src or _within(src, real) or _within(real, src):
            how = "is" if real == src else "holds" if _within(src, real) else "lies inside"
            what = ("the run directory" if os.path.isdir(os.path.join(src, "checkpoints")) else
                    "the checkpoints folder" if os.path.isdir(src) else "the checkpoint")
            raise FileExistsError(f"--out {out_dir} {how} {what} being exported ({source}): an export never "
                                  "replaces a folder that is, holds or lies inside what it exports (that could "
                                  "delete the checkpoint); export to a new folder outside the run")
    run_marks = [n for n in names if n in _RUN_DIR_MARKERS or n.startswith("ckpt_")]
    if run_marks:
        raise FileExistsError(f"--out {out_dir} is a ringpipe run directory (it holds {', '.join(run_marks)}): an "
                              "export never replaces one; export to a new folder")
    if "data.json" in names:
        raise FileExistsError(f"--out {out_dir} is a prepared dataset (it holds data.json): an export never "
                              "replaces one; export to a new folder")
    foreign = [n for n in names if not _is_model_file(out_dir, n)]
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise FileExistsError(f"--out {out_dir} holds {shown}, which no model folder is made of: an export "
                              "replaces only a model folder (config.json, model.safetensors, tokenizer files), "
                              "never a folder holding other things; export to a new or empty folder")
    if not overwrite:
        raise FileExistsError(f"--out {out_dir} is not empty: it holds a model ({', '.join(names[:4])}"
                              f"{', ...' if len(names) > 4 else ''}); pass --overwrite to replace it "
                              "(overwrite=True), or choose another folder")


def _check_destination(out_dir: str) -> None:
    """Refuse an out_dir that no folder can be made at, naming it, before the checkpoint is
    read: one under a file (--out FILE/x, /dev/null/x), or in a folder this user cannot write
    (the folders a write would create are not there yet: the nearest one that is decides)."""
    existing = os.path.dirname(out_dir)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise HFError(f"--out {out_dir}: {existing} is not a folder, so no folder can be made in it; choose --out "
                      "in a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise HFError(f"--out {out_dir}: the folder {existing} is not writable by this user; choose --out in a "
                      "folder you can write to")


def _move_into_place(tmp: str, out_dir: str) -> None:
    """Rename the finished temp folder to out_dir. An existing (non-empty) out_dir is first
    renamed aside and removed only after the new folder is in place."""
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        os.replace(tmp, out_dir)            # rename(2) replaces an empty folder
        return
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
    old = os.path.join(aside, "old")
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)             # put the previous export back
        os.rmdir(aside)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    checkpoint.fsync_dir(os.path.dirname(out_dir))
