"""Checkpoints: named arrays plus a JSON manifest that is the commit marker.

Two formats. Sharded (FORMAT_SHARDED = "ringpipe-checkpoint-3", the trainer's default):
every rank's slices in a folder of rank files, the manifest's `shards` saying which box of
which array is where; engine/job/sharded.py holds that format's writing, checks and reads,
this module its commit (start_sharded, commit_sharded), pruning, finding and loading.
Whole-file (FORMAT = "ringpipe-checkpoint-2", --checkpoint-format whole), described here:
checkpoint S of a run is two files in its checkpoints folder:

  ckpt_SSSSSSSS.npz   np.savez of named arrays ("param/h.0.attn.qkv.w",
                      "opt/m/h.0.attn.qkv.w", ...), every member stored
                      uncompressed, plain numeric dtypes only
  ckpt_SSSSSSSS.json  the manifest: format, step, npz (the npz's file name),
                      npz_bytes, npz_crc32, model, model_config, optimizer,
                      opt_step_count, loss, dtype, precision, layout, args,
                      best (optional: {step, val_loss}, the best validation so
                      far of a run with --keep-best), and checksum = sha256 of
                      json.dumps(every other key, sort_keys=True,
                      separators=(",", ":")), which binds the
                      step, the model config and the npz's CRC together.

Arrays are stored by parameter name, never by offset in a flat buffer, and
whole (a tensor-parallel run joins its ranks' parts, its in-memory padding left
out), so a checkpoint written by one data x pipeline x tensor layout loads into
any other as it is. Older GPT checkpoints written at a tensor-parallel size that
does not divide 128 hold wte with more padding rows: `load` and `declared_arrays`
hand those arrays over without the extra rows (_legacy_vocab_rows), the one
place that knows of them.

Write order: the npz and the manifest are each written to a temp file
(ckpt_*.npz.tmp.<pid>) and fsynced; then the npz is renamed into place, then the
manifest (the folder fsynced after each). A crash or a full disk at any point leaves the previous checkpoints
intact and never a manifest that points at a partial npz; temp files are removed
on failure (and `remove_stale_temp_files` removes those of killed runs).
`save` refuses parameters that hold NaN or inf.

What is checked before a checkpoint is used (`inspect`, `find_latest`, `load`),
without trusting anything in it: both files are regular files (a FIFO never
blocks us); the manifest is at most 1 MiB of UTF-8 JSON and matches the schema
(every key, its type and range); its checksum matches; its npz is the file named
like the manifest and its step is the step in its file name; the npz's size and
CRC32 match the manifest; its zip directory is readable; every member is a
stored (uncompressed), non-overlapping .npy whose header parses, whose dtype is
plain numeric (allow_pickle=False everywhere, so no file can run code) and whose
declared shape fits the bytes it holds. Sizes are checked before any array is
allocated, so a zip bomb costs nothing. `load(path, expected=...)` also checks
names and shapes against what the model needs before reading data. Format 1
files (no checksum; older ones lack precision and layout) are still read.

Pruning (`save(..., keep)`): only valid checkpoints count toward `keep`; the
newest `keep` valid ones and the one just written are kept, older valid ones are
deleted, and invalid ones are left on disk untouched (they are never the reason
a good one is deleted). Validity for pruning is remembered per process by
(path, size, mtime_ns), so a save does not re-read the checkpoints it kept.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
import struct
import zipfile
import zlib
import dataclasses
from dataclasses import dataclass

import numpy as np

from ringpipe.engine.job import sharded
from ringpipe.engine.job.array_module import to_host
from ringpipe.engine.job.rundir import describe_write_error
from ringpipe.engine.job.sharded import FORMAT_SHARDED

FORMAT = "ringpipe-checkpoint-2"
FORMAT_1 = "ringpipe-checkpoint-1"      # no checksum; still read, since users have such files
MAX_MANIFEST_BYTES = 64 << 20           # a whole-file one is ~1-2 KB, a sharded one's piece table ~100 B a piece
MAX_STEP = 99_999_999                   # the file name holds the step in 8 digits

_NAME = re.compile(r"ckpt_(\d{8})\.json")
_TEMP_NAME = re.compile(r"ckpt_\d{8}\.(json|npz)\.tmp\.\d+")
_TEMP_FOLDER = re.compile(r"ckpt_\d{8}\.shards\.tmp")          # a sharded save's, before its commit
_SHARDS_FOLDER = re.compile(r"ckpt_(\d{8})\.shards")
_SHORT_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

# The keys of model_config for each model (engine.model.gpt.GPTConfig, engine.model.mlp.MLPConfig).
_MODEL_CONFIG_KEYS = {"gpt": ("context", "d_model", "n_head", "n_layer", "vocab"),
                      "llama": ("context", "d_ff", "d_model", "head_dim", "n_head", "n_kv_head", "n_layer",
                                "attn_scalar", "embed_scale", "logit_softcap", "mlp_act", "nope_layers", "norm_place", "qk_norm",
                                "qkv_bias", "rms_eps", "rms_offset", "rope_local_theta", "rope_scaling", "rope_theta",
                                "sliding_window", "tie_embeddings", "vocab", "window_layers"),
                      "mlp": ("hidden", "n_classes", "n_in", "n_layer")}
# Keys a model_config written before they existed lacks (its model then had the default: no q/k norm).
# (engine/interop/hf_llama.py fills them in with LlamaConfig's defaults.)
OPTIONAL_MODEL_CONFIG_KEYS = {"llama": ("attn_scalar", "embed_scale", "logit_softcap", "mlp_act", "nope_layers",
                                        "norm_place", "qk_norm", "rms_offset", "rope_local_theta", "sliding_window",
                                        "window_layers")}
# The model_config keys that are settings rather than counts: a number, a switch, or
# (rope_scaling) null or an object of numbers and names.
_MODEL_SETTINGS = ("attn_scalar", "embed_scale", "logit_softcap", "mlp_act", "norm_place", "qk_norm", "qkv_bias", "rms_offset",
                   "rope_local_theta", "sliding_window", "rms_eps", "rope_scaling", "rope_theta", "tie_embeddings")
_LIST_SETTINGS = ("nope_layers", "window_layers")        # null or a list of block indices
_LAYOUT_KEYS = ("chunks", "dp", "pp", "tp")
_OPTIONAL_LAYOUT_KEYS = ("tp",)          # checkpoints written before tensor parallelism have none
_KEYS = ("args", "best", "checksum", "dtype", "format", "layout", "loss", "model", "model_config", "npz", "npz_bytes",
         "npz_crc32", "opt_step_count", "optimizer", "precision", "step", "tokenizer")
_NOT_IN_FORMAT_1 = ("best", "checksum")
_NPZ_KEYS = ("npz", "npz_bytes", "npz_crc32")                    # formats 1 and 2; format 3 has shards instead
_OPTIONAL_IN_FORMAT_1 = ("precision", "layout", "tokenizer")    # format 1 files written before these keys existed
# The tokenizer the run trained with: {"kind", "sha256", "vocab_size", "file" (relative to the run directory)};
# optional, since checkpoints of byte-level runs written before it existed have none.
# best: only runs that keep their best checkpoint (--keep-best) record it.
_OPTIONAL_IN_FORMAT_2 = ("best", "tokenizer")
_TOKENIZER_KEYS = ("file", "kind", "sha256", "vocab_size")
# A GPT's wte rows are its vocabulary padded to a multiple of this (engine/model/gpt.py
# VOCAB_PAD_MULTIPLE; tests/engine/job/test_checkpoint_vocab.py checks they agree).
_GPT_VOCAB_PAD = 128

_DAMAGED_HINT = ("it was not written completely, was damaged or was edited; resume from an earlier "
                 "checkpoint (--resume auto skips damaged ones)")


class CheckpointError(RuntimeError):
    pass


# What is wrong with a checkpoint, in a few words: `inspect` returns it, `load` wraps it
# (one class with engine/job/sharded.py's checks).
_Problem = sharded.Problem


# ---- writing -------------------------------------------------------------------------

def fsync_dir(path):
    """Make a rename in `path` durable (best effort: not every filesystem can)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_temp(path, write):
    """Write `path`'s content to a temp file next to it and fsync it; returns the temp
    path. On any failure the temp file is removed: a leftover would keep a full disk
    full and make every retry fail the same way."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp


def _remove_quietly(path):
    try:
        os.remove(path)
    except OSError:
        pass


def _crc32(fh):
    fh.seek(0)
    crc = 0
    for block in iter(lambda: fh.read(1 << 20), b""):
        crc = zlib.crc32(block, crc)
    return crc


def _checksum(manifest):
    """sha256 of the canonical JSON of every key but the checksum itself."""
    fields = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# The manifest keys `save` and `commit_sharded` set themselves (a caller's meta holds the others).
WRITTEN_KEYS = ("checksum", "format", "npz", "npz_bytes", "npz_crc32", "shards", "step")


def files_of(json_path) -> list:
    """What checkpoint `json_path` is on disk: its manifest, then its npz or its shards folder."""
    return [json_path] + [p for p in (json_path[:-5] + ".npz", json_path[:-5] + ".shards") if os.path.lexists(p)]


def manifest_path(directory, step) -> str:
    """Where checkpoint `step` of `directory` has (or will have) its manifest."""
    return os.path.join(directory, f"ckpt_{step:08d}.json")


def save(directory, step, arrays: dict, meta: dict, keep=3, alone=False):
    """Write checkpoint `step` atomically; keep the newest `keep` valid ones (0 = keep all). Returns the JSON path.
    alone: keep no other valid checkpoint in `directory`, newer ones included (OUT/best/ holds one: a
    newer one there is from a run resumed from before it, and is not the best of this run)."""
    # Everything that can be refused is refused before a byte is written. The JSON
    # round trip makes meta what a reader will see (a NumPy float becomes a float).
    try:
        meta = json.loads(json.dumps(meta))
        _check_schema(dict(meta, format=FORMAT, step=step, npz="ckpt.npz", npz_bytes=1, npz_crc32=0,
                           checksum="0" * 64))
    except (TypeError, ValueError, _Problem) as e:
        raise CheckpointError(f"cannot write the checkpoint for step {step}: {e} (a bug in the caller)") from None
    host = {}
    for name, value in arrays.items():
        host[name] = array = np.asarray(to_host(value))
        if not _plain_numeric(array.dtype):
            raise CheckpointError(f"cannot write the checkpoint for step {step}: array {name!r} has dtype "
                                  f"{array.dtype}, expected a plain numeric dtype")
        if name.startswith("param/") and array.dtype.kind in "fc" and not np.isfinite(array).all():
            raise CheckpointError(f"refusing to write the checkpoint for step {step}: {name} holds NaN or inf "
                                  "(training diverged). Nothing was written; the previous checkpoints are intact.")

    json_path = manifest_path(directory, step)
    npz_path = json_path[:-5] + ".npz"
    try:
        os.makedirs(directory, exist_ok=True)
        # Both temp files are complete before either is renamed, so a full disk
        # (the likely failure) changes nothing on disk but the temp files, which go.
        npz_tmp = _write_temp(npz_path, lambda fh: np.savez(fh, allow_pickle=False, **host))
        try:
            with open(npz_tmp, "rb") as fh:
                npz_bytes, npz_crc32 = os.fstat(fh.fileno()).st_size, _crc32(fh)
            manifest = dict(meta, format=FORMAT, step=step, npz=os.path.basename(npz_path),
                            npz_bytes=npz_bytes, npz_crc32=npz_crc32)
            manifest["checksum"] = _checksum(manifest)
            text = json.dumps(manifest, indent=1, sort_keys=True).encode()
            json_tmp = _write_temp(json_path, lambda fh: fh.write(text))
        except BaseException:
            _remove_quietly(npz_tmp)
            raise
        try:
            os.replace(npz_tmp, npz_path)
            fsync_dir(directory)       # the npz is on disk before its manifest can be
            os.replace(json_tmp, json_path)
        except BaseException:
            # An npz without its manifest counts as nothing, but it takes space: remove it.
            for path in (npz_tmp, json_tmp, npz_path):
                _remove_quietly(path)
            raise
        fsync_dir(directory)
    except OSError as e:
        raise CheckpointError(_write_error_message(e, directory, step)) from e
    _remember(json_path, None)          # written and fsynced by us: known valid
    if keep > 0 or alone:
        _prune(directory, 0 if alone else keep, json_path)
    return json_path


def start_sharded(directory, step) -> str:
    """Before the ranks write checkpoint `step` sharded (the first rank, holding the run's
    lock): the temp folder they write their files into, made empty. Returns its path."""
    tmp = os.path.join(directory, sharded.temp_folder_name(step))
    try:
        os.makedirs(directory, exist_ok=True)
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp)          # a killed save's of this same step: ours by its name
        os.mkdir(tmp)
    except OSError as e:
        raise CheckpointError(_write_error_message(e, directory, step)) from e
    return tmp


def commit_sharded(directory, step, meta: dict, records: list, arrays: dict, keep=3, alone=False) -> str:
    """Commit checkpoint `step`, whose ranks each wrote their file (records: write_rank_file's,
    None for a rank without pieces) into start_sharded's folder: rename the folder into place,
    then write the manifest (the commit marker). Prunes like `save`. Returns the manifest path."""
    try:
        meta = json.loads(json.dumps(meta))
        manifest = dict(meta, format=FORMAT_SHARDED, step=step, shards=sharded.shards_entry(step, records, arrays),
                        checksum="0" * 64)
        _check_schema(manifest)
    except (TypeError, ValueError, _Problem) as e:
        raise CheckpointError(f"cannot write the checkpoint for step {step}: {e} (a bug in the caller)") from None
    manifest["checksum"] = _checksum(manifest)
    json_path = manifest_path(directory, step)
    tmp, final = (os.path.join(directory, name) for name in (sharded.temp_folder_name(step), sharded.folder_name(step)))
    try:
        text = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        json_tmp = _write_temp(json_path, lambda fh: fh.write(text))
        try:
            if os.path.lexists(final):    # a checkpoint of this step written before (OUT/best/), or a killed commit's
                _remove_quietly(json_path)
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(directory)          # the shards are in place before their manifest can be
            os.replace(json_tmp, json_path)
        except BaseException:
            _remove_quietly(json_tmp)
            raise
        fsync_dir(directory)
    except OSError as e:
        raise CheckpointError(_write_error_message(e, directory, step)) from e
    _remember(json_path, None)
    if keep > 0 or alone:
        _prune(directory, 0 if alone else keep, json_path)
    return json_path


def abandon_sharded(directory, step) -> None:
    """Remove start_sharded's folder of a save that failed on some rank (best effort: a
    leftover is removed by the next run, remove_stale_temp_files)."""
    shutil.rmtree(os.path.join(directory, sharded.temp_folder_name(step)), ignore_errors=True)


def _write_error_message(e, directory, step):
    return describe_write_error(e, directory, f"the checkpoint for step {step}",
                                "; the previous checkpoints are intact")


def _prune(directory, keep, just_written):
    """Delete valid checkpoints older than the newest `keep` valid ones (keep 0: every
    other valid one). Invalid ones are not counted and not deleted; the one just written
    is always kept."""
    valid = [p for p in list_checkpoints(directory) if p == just_written or _known_problem(p) is None]
    kept = (set(valid[-keep:]) if keep > 0 else set()) | {just_written}
    for old in valid:
        if old in kept:
            continue
        # The manifest first: it is the commit marker, an npz or shards without one are nothing.
        for path in (old, old[:-5] + ".npz", old[:-5] + ".shards"):
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise CheckpointError(f"the checkpoint {just_written} was written, but the old checkpoint "
                                      f"{path} could not be removed ({e.strerror}); remove it by hand") from e
        _verified.pop(os.path.abspath(old), None)


def remove_stale_temp_files(directory) -> list:
    """Delete the temp files (ckpt_*.npz.tmp.<pid>, ckpt_*.json.tmp.<pid>) that killed runs
    left in `directory`; returns their paths. Call it only while holding the run's lock:
    it cannot tell a dead writer's temp file from a live one's."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        path = os.path.join(directory, name)
        mode = os.lstat(path).st_mode
        # A sharded save's temp folder, or its folder renamed into place by a commit killed before
        # its manifest was: nothing names it.
        folder = stat.S_ISDIR(mode) and (_TEMP_FOLDER.fullmatch(name) or (
            _SHARDS_FOLDER.fullmatch(name) and not os.path.lexists(os.path.join(directory, name[:-7] + ".json"))))
        if not folder and not (_TEMP_NAME.fullmatch(name) and stat.S_ISREG(mode)):
            continue
        try:
            shutil.rmtree(path) if folder else os.remove(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise CheckpointError(f"cannot remove the stale temp file {path} ({e.strerror}); "
                                  "remove it by hand or point --out elsewhere") from e
        removed.append(path)
    return removed


# ---- finding -------------------------------------------------------------------------

def list_checkpoints(directory):
    """Manifest paths in step order (oldest first), valid or not."""
    try:
        names = os.listdir(directory or ".")
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(os.path.join(directory, name) for name in names if _NAME.fullmatch(name))


def scan(directory):
    """(valid manifest paths, [(invalid manifest path, problem)]), each in step order."""
    valid, invalid = [], []
    for path in list_checkpoints(directory):
        problem = _inspect_and_remember(path)
        if problem is None:
            valid.append(path)
        else:
            invalid.append((path, problem))
    return valid, invalid


def find_latest(directory):
    """Newest valid checkpoint (see `inspect`), or None."""
    for path in reversed(list_checkpoints(directory)):
        if _inspect_and_remember(path) is None:
            return path
    return None


def resolve(path):
    """The manifest path meant by `path`: a ckpt_*.json or .npz, a checkpoints
    folder (its latest valid checkpoint) or a run directory holding checkpoints/."""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if os.path.isdir(path):
        latest = find_latest(path)
        if latest is None:
            _, invalid = scan(path)
            why = "".join(f"; {os.path.basename(p)}: {problem}" for p, problem in invalid[-3:])
            raise CheckpointError(f"no valid checkpoint in {path!r} (looked for ckpt_*.json with a matching .npz)"
                                  f"{why}")
        return latest
    if path.endswith(".npz"):
        return path[:-4] + ".json"
    return path


# ---- checking ------------------------------------------------------------------------

def resolve_with_note(path: str):
    """(the checkpoint `path` means, as checkpoint.resolve finds it; a note or None). The
    note, for a run directory or checkpoints folder whose newest checkpoints cannot be
    used, names the one used and each newer one skipped with why: silently falling back
    to an older model would pass it off as the newest."""
    folder = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
    if not os.path.isdir(folder):
        return resolve(path), None
    skipped = []
    for candidate in reversed(list_checkpoints(folder)):
        problem = inspect(candidate)
        if problem is None:
            if not skipped:
                return candidate, None
            why = "; ".join(f"{os.path.basename(p)}: {problem}" for p, problem in skipped)
            return candidate, (f"note: using {candidate}, an older checkpoint: the newer "
                               f"{', '.join(os.path.basename(p) for p, _ in skipped)} cannot be used ({why})")
        skipped.append((candidate, problem))
    return resolve(folder), None        # none valid: resolve raises the error that lists why


def inspect(path):
    """None if the checkpoint with manifest `path` is valid, else a short description of
    what is wrong. Reads the manifest, the npz's bytes (for the CRC) and the .npy
    headers, but no array data; never blocks on a FIFO."""
    try:
        manifest = _read_manifest(path)
        if manifest["format"] == FORMAT_SHARDED:
            sharded.check_files(path, manifest, _open_regular)
            return None
        with _open_regular(_npz_path(path, manifest), "npz") as fh:
            _check_size_and_crc(fh, manifest)
            with _open_zip(fh) as zf:
                _check_members(zf, fh)
    except _Problem as e:
        return str(e)
    except OSError as e:        # an I/O error on a failing disk, not something in the files
        return f"reading it failed ({e.strerror or e})"
    return None


def read_manifest(path) -> dict:
    """The validated manifest of checkpoint `path` (as for `load`), without touching its arrays."""
    return _read_manifest_or_raise(_existing(resolve(path)))


def load(path, expected=None):
    """Load a checkpoint by its .json (or .npz, checkpoints folder, run directory). Returns (arrays, manifest).

    expected: optional {array name: shape} of the arrays the caller needs; then only
    those are read, and a missing name or another shape is refused before any data is read."""
    def read(json_path, zf, members):
        if expected is None:
            wanted = list(members)
        else:
            _check_expected(json_path, {name: member.shape for name, member in members.items()}, expected)
            wanted = list(expected)
        return {name: _read_array(zf, members[name]) for name in wanted}

    path = _existing(resolve(path))
    manifest = _read_manifest_or_raise(path)
    if manifest["format"] == FORMAT_SHARDED:
        reader = sharded.Reader(path, manifest, _open_regular)
        try:
            declared = {name: reader.shape(name) for name in manifest["shards"]["arrays"]}
            _check_expected(path, declared, expected or declared)
            return {name: _sharded_read(reader, lambda: reader.read_whole(name)) for name in expected or declared}, \
                manifest
        finally:
            reader.close()
    manifest, arrays = _with_checked_members(path, read)
    return arrays, manifest


def open_sharded(path):
    """(manifest, sharded.Reader) of the sharded checkpoint `path` (resolved as for `load`):
    its manifest checked (the schema, the checksum, the pieces' tiling), its files not yet
    read: each piece's CRC32 is checked as it is first read. Close the reader after use."""
    path = _existing(resolve(path))
    manifest = _read_manifest_or_raise(path)
    if manifest["format"] != FORMAT_SHARDED:
        raise CheckpointError(f"checkpoint {path!r} is not sharded ({manifest['format']})")
    return manifest, sharded.Reader(path, manifest, _open_regular)


def read_box(reader, name, box, out) -> None:
    """reader.read_box, its problems as CheckpointError naming the checkpoint."""
    _sharded_read(reader, lambda: reader.read_box(name, box, out))


def check_declared(path, reader, expected: dict) -> None:
    """Refuse a sharded checkpoint that lacks an array of `expected` ({name: shape}) or
    holds it in another shape, before any data is read."""
    _check_expected(path, {name: reader.shape(name) for name in reader.entry["arrays"]}, expected)


def _sharded_read(reader, read):
    try:
        return read()
    except _Problem as e:
        raise CheckpointError(f"checkpoint {reader.folder!r} cannot be used: {e}; {_DAMAGED_HINT}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {reader.folder!r} cannot be read ({e.strerror or e})") from e


def _with_checked_members(path, use):
    """(manifest, use(json_path, zf, members)) for checkpoint `path`: the manifest read and
    checked, the npz opened as a regular file, its size, CRC and members checked first.
    Any problem is a CheckpointError naming the file."""
    path = _existing(resolve(path))
    manifest = _read_manifest_or_raise(path)
    npz_path = _npz_path(path, manifest)
    try:
        with _open_regular(npz_path, "npz") as fh:
            _check_size_and_crc(fh, manifest)
            with _open_zip(fh) as zf:
                return manifest, use(path, zf, _legacy_vocab_rows(manifest, _check_members(zf, fh)))
    except _Problem as e:
        raise CheckpointError(f"checkpoint {npz_path!r} cannot be used: {e}; {_DAMAGED_HINT}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {npz_path!r} cannot be read ({e.strerror or e})") from e


def _read_manifest_or_raise(path):
    try:
        return _read_manifest(path)
    except _Problem as e:
        raise CheckpointError(f"checkpoint {path!r} cannot be used: {e}; {_DAMAGED_HINT}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path!r} cannot be read ({e.strerror or e})") from e


def _existing(path):
    if not os.path.lexists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist; pass a run directory, "
                              "a ckpt_XXXXXXXX.json file, or --resume auto")
    return path


def _check_expected(path, shapes, expected):
    """Refuse a checkpoint whose arrays ({name: shape}) lack one of `expected` or hold it in another shape."""
    missing = [name for name in expected if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {path!r} lacks {missing[0]}{more}: "
                              "was it written by a model with another configuration?")
    for name, shape in expected.items():
        if tuple(shapes[name]) != tuple(shape):
            raise CheckpointError(f"checkpoint {path!r}: {name} has shape {tuple(shapes[name])}, the model "
                                  f"expects {tuple(shape)}: was it written by a model with another configuration?")


# Checks whose results pruning reuses: {abspath of manifest: ((stats of both files), problem)}.
_verified = {}


def _stats(json_path):
    def key(path):
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns
    shards = json_path[:-5] + ".shards"
    return key(json_path), key(shards if os.path.isdir(shards) else json_path[:-5] + ".npz")


def _remember(json_path, problem):
    _verified[os.path.abspath(json_path)] = (_stats(json_path), problem)


def _inspect_and_remember(json_path):
    problem = inspect(json_path)
    _remember(json_path, problem)
    return problem


def _known_problem(json_path):
    """`inspect`, but reusing this process's earlier result while neither file changed."""
    stats, problem = _verified.get(os.path.abspath(json_path), (None, None))
    if stats == _stats(json_path) and None not in stats:
        return problem
    return _inspect_and_remember(json_path)


def _file_kind(mode):
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def _open_regular(path, what):
    """Open `path` for reading if it is a regular file (a symlink to one is fine).
    It is checked before opening (a device must not even be opened) and again after,
    in case it was swapped; O_NONBLOCK makes opening a FIFO return at once instead
    of waiting forever for a writer."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise _Problem(f"the {what} {os.path.basename(path)} is missing") from None
    except OSError as e:
        raise _Problem(f"the {what} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise _Problem(f"the {what} is not a regular file (it is {_file_kind(mode)})")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise _Problem(f"the {what} cannot be opened ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _Problem(f"the {what} is not a regular file (it is {_file_kind(mode)})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _no_duplicate_keys(pairs):
    # json.loads would silently keep the last of two "step" keys.
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise _Problem(f"the manifest has the key {key!r} twice")
        obj[key] = value
    return obj


def _read_manifest(path):
    """Read, parse and check the manifest at `path` (schema, checksum, name); raises _Problem."""
    with _open_regular(path, "manifest") as fh:
        # In blocks: read(n) would allocate n bytes whatever the file holds.
        chunks, size = [], 0
        for block in iter(lambda: fh.read(1 << 20), b""):
            chunks.append(block)
            size += len(block)
            if size > MAX_MANIFEST_BYTES:
                break
        data = b"".join(chunks)
    if len(data) > MAX_MANIFEST_BYTES:
        raise _Problem(f"the manifest is larger than {MAX_MANIFEST_BYTES >> 20} MiB (a real one is a few KB)")
    try:
        manifest = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError as e:
        raise _Problem(f"the manifest is not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise _Problem("the manifest is not valid JSON (nested too deeply)") from None
    except ValueError as e:
        raise _Problem(f"the manifest is not valid JSON ({e})") from None
    _check_schema(manifest)
    if manifest["format"] != FORMAT_1 and manifest["checksum"] != _checksum(manifest):
        raise _Problem("the manifest's checksum does not match its content (it was edited or damaged)")
    _check_name(path, manifest)
    return manifest


def _npz_path(json_path, manifest):
    # manifest["npz"] is checked to be the manifest's own name with .npz.
    return os.path.join(os.path.dirname(json_path), manifest["npz"])


def _check_name(path, manifest):
    """Bind the manifest to its file name: ckpt_00000012.json holds step 12 and names ckpt_00000012.npz."""
    name = os.path.basename(path)
    match = _NAME.fullmatch(name)
    if not match:
        raise _Problem(f"the manifest's file name {name!r} is not ckpt_XXXXXXXX.json (the step is part of the "
                       "name: use the original file)")
    if manifest["step"] != int(match.group(1)):
        raise _Problem(f"the manifest says step {manifest['step']} but its file name says step {int(match.group(1))}")
    if manifest["format"] == FORMAT_SHARDED:       # check_entry bound its folder to the step
        return
    npz = name[:-5] + ".npz"
    if manifest["npz"] != npz:
        raise _Problem(f"the manifest names the npz {manifest['npz']!r}, expected {npz!r} (the npz sits next to "
                       "its manifest under the same name)")


# ---- the manifest's schema -------------------------------------------------------------

def _describe(value):
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    text = json.dumps(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


def _wrong(key, value, expected):
    return _Problem(f"the manifest's {key!r} holds {_describe(value)}, expected {expected}")


def _check_int(key, value, low, high):
    # type() rather than isinstance(): True is an int in Python, but not a step count.
    if type(value) is not int or not low <= value <= high:
        raise _wrong(key, value, f"an integer from {low} to {high}")


def _check_short_name(key, value):
    if not isinstance(value, str) or not _SHORT_NAME.fullmatch(value):
        raise _wrong(key, value, "a short name (letters, digits, '_', '.', '-')")


def _check_object(key, value, keys, optional=()):
    if type(value) is not dict:
        raise _wrong(key, value, "an object")
    missing = [k for k in keys if k not in value and k not in optional]
    unknown = [k for k in value if k not in keys]
    if missing or unknown:
        may = f" (optional: {', '.join(optional)})" if optional else ""
        raise _wrong(key, value, f"an object with exactly the keys {', '.join(keys)}{may}")
    for k in keys:
        if k in value and k in _LIST_SETTINGS:
            _check_int_list(f"{key}.{k}", value[k])
        elif k in value and k in _MODEL_SETTINGS:
            _check_setting(f"{key}.{k}", value[k])
        elif k in value:
            _check_int(f"{key}.{k}", value[k], 1, 2**31 - 1)


def _check_setting(key, value):
    def plain(v):
        return (type(v) in (bool, int) or (type(v) is float and math.isfinite(v))
                or (isinstance(v, str) and _SHORT_NAME.fullmatch(v)))
    if not (plain(value) or value is None or (type(value) is dict and all(plain(v) for v in value.values()))):
        raise _wrong(key, value, "a finite number, true or false, null, or an object of those")


def _check_int_list(key, value):
    if value is not None and not (type(value) is list and len(value) <= 2**14
                                  and all(type(v) is int and 0 <= v < 2**14 for v in value)):
        raise _wrong(key, value, "null or a list of block indices (integers from 0 to 16383)")


def _check_schema(m):
    """Every key of the manifest, its type and its range; raises _Problem naming the first wrong one."""
    if type(m) is not dict:
        raise _Problem(f"the manifest holds {_describe(m)}, expected a JSON object")
    if "format" not in m:
        raise _Problem("the manifest lacks the key format: it is not a ringpipe checkpoint")
    if not isinstance(m["format"], str) or m["format"] not in (FORMAT_SHARDED, FORMAT, FORMAT_1):
        raise _wrong("format", m["format"], f"{FORMAT_SHARDED!r}, {FORMAT!r} or {FORMAT_1!r} (not a ringpipe "
                                            "checkpoint, or one from a newer version)")
    if m["format"] == FORMAT_SHARDED:
        allowed = [k for k in _KEYS if k not in _NPZ_KEYS] + ["shards"]
    else:
        allowed = _KEYS if m["format"] == FORMAT else [k for k in _KEYS if k not in _NOT_IN_FORMAT_1]
    optional = _OPTIONAL_IN_FORMAT_1 if m["format"] == FORMAT_1 else _OPTIONAL_IN_FORMAT_2
    missing = [k for k in allowed if k not in m and k not in optional]
    if missing:
        raise _Problem(f"the manifest lacks the key(s) {', '.join(missing)}")
    unknown = sorted(k for k in m if k not in allowed)
    if unknown:
        raise _Problem(f"the manifest has unknown key(s) {', '.join(unknown)} (expected only {', '.join(allowed)})")

    _check_int("step", m["step"], 0, MAX_STEP)
    if m["format"] == FORMAT_SHARDED:
        sharded.check_entry(m["shards"], m["step"])
    else:
        if not isinstance(m["npz"], str) or not 1 <= len(m["npz"]) <= 64:
            raise _wrong("npz", m["npz"], "the npz's file name")
        _check_int("npz_bytes", m["npz_bytes"], 1, 2**50)
        _check_int("npz_crc32", m["npz_crc32"], 0, 2**32 - 1)
    if not isinstance(m["model"], str) or m["model"] not in _MODEL_CONFIG_KEYS:
        raise _wrong("model", m["model"], " or ".join(repr(k) for k in _MODEL_CONFIG_KEYS))
    _check_object("model_config", m["model_config"], _MODEL_CONFIG_KEYS[m["model"]],
                  OPTIONAL_MODEL_CONFIG_KEYS.get(m["model"], ()))
    _check_short_name("optimizer", m["optimizer"])
    _check_int("opt_step_count", m["opt_step_count"], 0, 2**62)
    loss = m["loss"]
    if loss is not None and (type(loss) not in (int, float) or not math.isfinite(loss)):
        raise _wrong("loss", loss, "a finite number or null")
    _check_short_name("dtype", m["dtype"])
    if "precision" in m:
        _check_short_name("precision", m["precision"])
    if "layout" in m:
        _check_object("layout", m["layout"], _LAYOUT_KEYS, _OPTIONAL_LAYOUT_KEYS)
    if type(m["args"]) is not dict:
        raise _wrong("args", m["args"], "an object (the run's flags)")
    if "tokenizer" in m:
        t = m["tokenizer"]
        if type(t) is not dict or sorted(t) != list(_TOKENIZER_KEYS):
            raise _wrong("tokenizer", t, f"an object with exactly the keys {', '.join(_TOKENIZER_KEYS)}")
        _check_short_name("tokenizer.kind", t["kind"])
        _check_short_name("tokenizer.file", t["file"])
        _check_int("tokenizer.vocab_size", t["vocab_size"], 1, 2**32)
        if not isinstance(t["sha256"], str) or not _SHA256_HEX.fullmatch(t["sha256"]):
            raise _wrong("tokenizer.sha256", t["sha256"], "64 lowercase hex digits (a sha256)")
    if "best" in m:
        _check_best(m["best"])
    if "checksum" in m and (not isinstance(m["checksum"], str) or not _SHA256_HEX.fullmatch(m["checksum"])):
        raise _wrong("checksum", m["checksum"], "64 lowercase hex digits (a sha256)")


def _check_best(best):
    if type(best) is not dict or sorted(best) != ["step", "val_loss"]:
        raise _wrong("best", best, "an object with exactly the keys step, val_loss")
    _check_int("best.step", best["step"], 0, MAX_STEP)
    if type(best["val_loss"]) not in (int, float) or not math.isfinite(best["val_loss"]):
        raise _wrong("best.val_loss", best["val_loss"], "a finite number")


# ---- the npz -----------------------------------------------------------------------

def _plain_numeric(dtype):
    """bool, integers, floats, complex: no objects (pickles), strings, records or sub-arrays."""
    return dtype.kind in "biufc" and not dtype.hasobject and dtype.fields is None and dtype.subdtype is None


def _check_size_and_crc(fh, manifest):
    size = os.fstat(fh.fileno()).st_size
    if size != manifest["npz_bytes"]:
        raise _Problem(f"the npz is truncated or the wrong file ({size} bytes, the manifest says "
                       f"{manifest['npz_bytes']})")
    if _crc32(fh) != manifest["npz_crc32"]:
        raise _Problem("the npz is corrupt (CRC32 mismatch)")


def _open_zip(fh):
    fh.seek(0)
    try:
        return zipfile.ZipFile(fh)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, NotImplementedError,
            struct.error) as e:
        raise _Problem(f"the npz is not a readable zip archive ({e})") from None


@dataclass(frozen=True)
class _Member:
    """One array of the npz: its zip entry and what its .npy header declares.
    stored: the header's shape where `shape`, what a reader gets, keeps fewer rows."""
    info: zipfile.ZipInfo
    shape: tuple
    fortran_order: bool
    dtype: np.dtype
    stored: tuple | None = None


def _legacy_vocab_rows(manifest, members):
    """Checkpoints before wte was stored the same for every layout padded it to a
    multiple of lcm(128, tp) rows: at a tp that does not divide 128, more rows than
    today's multiple of 128. Those extra rows are padding (ids >= vocab: masked
    logits, no gradient), so such a file's wte arrays are read without them and load
    like one written today. Every other member, and every newer file, is unchanged."""
    tp = manifest.get("layout", {}).get("tp", 1)
    vocab = manifest["model_config"].get("vocab")       # only a model with a vocabulary pads rows
    if vocab is None or _GPT_VOCAB_PAD % tp == 0:
        return members
    multiple = math.lcm(_GPT_VOCAB_PAD, tp)
    written, rows = -(-vocab // multiple) * multiple, -(-vocab // _GPT_VOCAB_PAD) * _GPT_VOCAB_PAD
    out = dict(members)
    for name, member in members.items():
        if name.split("/")[-1] == "wte" and len(member.shape) == 2 and member.shape[0] == written != rows:
            out[name] = dataclasses.replace(member, shape=(rows, member.shape[1]), stored=member.shape)
    return out


def _check_members(zf, fh):
    """Check every member's zip entry and .npy header against the file; {array name: _Member}."""
    infos = zf.infolist()
    names = set()
    for info in infos:
        name = info.filename
        if not name.endswith(".npy") or name == ".npy":
            raise _Problem(f"the npz member {name!r} is not a .npy array")
        if name in names:
            raise _Problem(f"the npz has the member {name!r} twice")
        names.add(name)
        if info.flag_bits & 0x1:
            raise _Problem(f"the npz member {name!r} is encrypted")
        # np.savez stores members uncompressed: a compressed one was not written by
        # us, and decompressing it could need any amount of memory (a zip bomb).
        if info.compress_type != zipfile.ZIP_STORED:
            raise _Problem(f"the npz member {name!r} is compressed (method {info.compress_type}); "
                           "ringpipe writes members uncompressed")
        if info.compress_size != info.file_size:
            raise _Problem(f"the npz member {name!r} is stored with {info.compress_size} bytes but declares "
                           f"{info.file_size}")
    _check_extents(infos, fh)
    members = {}
    for info in infos:
        try:
            with zf.open(info) as stream:
                members[info.filename[:-4]] = _read_npy_header(stream, info)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError, struct.error) as e:
            raise _Problem(f"the npz member {info.filename!r} cannot be read ({e})") from None
    return members


def _check_extents(infos, fh):
    """Each member's local header and data must lie inside the file and before the next
    member: overlapping members would let a small file hold many times its size."""
    file_size = os.fstat(fh.fileno()).st_size
    ordered = sorted(infos, key=lambda info: info.header_offset)
    for i, info in enumerate(ordered):
        local = os.pread(fh.fileno(), 30, info.header_offset) if 0 <= info.header_offset < file_size else b""
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise _Problem(f"the npz member {info.filename!r} has a broken local header")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        end = info.header_offset + 30 + name_len + extra_len + info.compress_size
        limit = ordered[i + 1].header_offset if i + 1 < len(ordered) else file_size
        if end > limit:
            raise _Problem(f"the npz member {info.filename!r} declares {info.compress_size} bytes, more than "
                           "fit before the next member or the end of the file")


def _read_npy_header(stream, info):
    """Parse the .npy header at the start of `stream` and check it against the zip entry."""
    name = info.filename
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(stream)
    else:
        raise _Problem(f"the npz member {name!r} is .npy version {version[0]}.{version[1]}, expected 1.0 or 2.0")
    if not _plain_numeric(dtype):
        raise _Problem(f"the npz member {name!r} holds dtype {dtype}, expected a plain numeric dtype")
    if any(type(n) is not int or n < 0 for n in shape):
        raise _Problem(f"the npz member {name!r} declares the shape {shape}")
    data_bytes = math.prod(shape) * dtype.itemsize
    stored = info.file_size - stream.tell()
    if data_bytes != stored:
        raise _Problem(f"the npz member {name!r} declares shape {tuple(shape)} of {dtype} ({data_bytes} bytes) "
                       f"but holds {stored} bytes")
    return _Member(info, tuple(shape), fortran_order, dtype)


def _read_array(zf, member):
    """Read one member's data; its header was checked, so the size is bounded by the file's."""
    name = member.info.filename
    try:
        with zf.open(member.info) as stream:
            _read_npy_header(stream, member.info)
            shape = member.stored or member.shape
            flat = np.empty(math.prod(shape), dtype=member.dtype)
            raw = flat.view(np.uint8)
            filled = 0
            while filled < raw.size:     # in blocks: a single read would hold a second copy
                block = stream.read(min(raw.size - filled, 1 << 24))
                if not block:
                    raise _Problem(f"the npz member {name!r} ends early")
                raw[filled:filled + len(block)] = np.frombuffer(block, dtype=np.uint8)
                filled += len(block)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError, struct.error) as e:
        raise _Problem(f"the npz member {name!r} cannot be read ({e})") from None
    array = flat.reshape(shape[::-1]).transpose() if member.fortran_order else flat.reshape(shape)
    if member.stored:                    # an old file's extra padding rows (_legacy_vocab_rows)
        array = np.ascontiguousarray(array[:member.shape[0]])
    return array


# ---- declared shapes, for sizing a model before building it ----------------------------

def declared_arrays(path) -> tuple[dict, dict]:
    """(manifest, {array name: (shape, dtype)}) of checkpoint `path` (resolved as for
    `load`), from the manifest and the npz's .npy headers: no array data is allocated.

    A caller sizes its model from these rather than from the manifest's model_config
    alone: nothing binds model_config to the arrays (a manifest edited, its checksum
    recomputed, can declare any n_layer), while every declared shape here is checked
    against the bytes the npz holds, so building a model that matches them costs at most
    what the file already is. Raises CheckpointError like `load`."""
    path = _existing(resolve(path))
    manifest = _read_manifest_or_raise(path)
    if manifest["format"] == FORMAT_SHARDED:
        return manifest, {name: (tuple(a["shape"]), np.dtype(a["dtype"]))
                          for name, a in manifest["shards"]["arrays"].items()}
    return _with_checked_members(path, lambda json_path, zf, members: {
        name: (member.shape, member.dtype) for name, member in members.items()})
