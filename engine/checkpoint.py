"""Checkpoints: named arrays in an .npz (loaded with allow_pickle=False, so a file
can never run code) plus a JSON manifest that is the commit marker.

Write order: npz to a temp file, fsync, rename; then the JSON (with the npz's
size and CRC32) the same way. A crash at any point leaves either the previous
checkpoint or a complete new one; a checkpoint whose npz does not match its
manifest is refused with a clear error and `find_latest` skips it.

Arrays are stored by parameter name ("param/h.0.attn.qkv.w", "opt/m/h.0...."),
never by offset in a flat buffer, so a checkpoint written by one data x pipeline
layout loads into any other.
"""
from __future__ import annotations

import glob
import json
import os
import re
import zipfile
import zlib

import numpy as np

from engine.device import to_host

FORMAT = "ringpipe-checkpoint-1"
_NAME = re.compile(r"ckpt_(\d{8})\.json$")


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path):
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


def _atomic_write(path, write):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _crc32_file(path):
    crc = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc


def manifest_path(directory, step) -> str:
    """Where checkpoint `step` of `directory` has (or will have) its manifest."""
    return os.path.join(directory, f"ckpt_{step:08d}.json")


def save(directory, step, arrays: dict, meta: dict, keep=3):
    """Write checkpoint `step` atomically; keep the newest `keep` (0 = keep all). Returns the JSON path."""
    os.makedirs(directory, exist_ok=True)
    json_path = manifest_path(directory, step)
    npz_path = json_path[:-5] + ".npz"
    host = {k: np.asarray(to_host(v)) for k, v in arrays.items()}
    _atomic_write(npz_path, lambda fh: np.savez(fh, **host))
    manifest = dict(meta, format=FORMAT, step=step, npz=os.path.basename(npz_path),
                    npz_bytes=os.path.getsize(npz_path), npz_crc32=_crc32_file(npz_path))
    _atomic_write(json_path, lambda fh: fh.write(json.dumps(manifest, indent=1, sort_keys=True).encode()))
    if keep > 0:
        for old in list_checkpoints(directory)[:-keep]:
            for p in (old, old[:-5] + ".npz"):
                try:
                    os.remove(p)
                except FileNotFoundError:
                    pass
    return json_path


def list_checkpoints(directory):
    """Manifest paths in step order (oldest first)."""
    return sorted(p for p in glob.glob(os.path.join(directory, "ckpt_*.json")) if _NAME.search(p))


def resolve(path):
    """The manifest path meant by `path`: a ckpt_*.json or .npz, a checkpoints
    folder (its latest valid checkpoint) or a run directory holding checkpoints/."""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if os.path.isdir(path):
        latest = find_latest(path)
        if latest is None:
            raise CheckpointError(f"no valid checkpoint in {path!r} (looked for ckpt_*.json with a matching .npz)")
        return latest
    if path.endswith(".npz"):
        return path[:-4] + ".json"
    return path


def load(path):
    """Load a checkpoint by its .json (or .npz, checkpoints folder, run directory). Returns (arrays, manifest)."""
    path = resolve(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist; pass a run directory, "
                              "a ckpt_XXXXXXXX.json file, or --resume auto")
    try:
        with open(path, "rb") as fh:
            manifest = json.loads(fh.read().decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {path!r} is corrupt ({e}); "
                              "delete it to fall back to the previous checkpoint") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a ringpipe checkpoint (format {manifest.get('format')!r})")
    npz_path = os.path.join(os.path.dirname(path), manifest["npz"])
    problem = _verify(npz_path, manifest)
    if problem:
        raise CheckpointError(f"checkpoint {npz_path!r} is {problem}; it was not written completely "
                              "or was damaged. Resume from an earlier one (--resume auto skips bad ones).")
    try:
        with np.load(npz_path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise CheckpointError(f"checkpoint {npz_path!r} cannot be read: {e}") from e
    return arrays, manifest


def _verify(npz_path, manifest):
    if not os.path.exists(npz_path):
        return "missing"
    size = os.path.getsize(npz_path)
    if size != manifest.get("npz_bytes"):
        return f"truncated ({size} bytes, manifest says {manifest.get('npz_bytes')})"
    if _crc32_file(npz_path) != manifest.get("npz_crc32"):
        return "corrupt (CRC32 mismatch)"
    return None


def find_latest(directory):
    """Newest checkpoint whose npz matches its manifest, or None."""
    for path in reversed(list_checkpoints(directory)):
        try:
            with open(path, "rb") as fh:
                manifest = json.loads(fh.read().decode())
            if manifest.get("format") == FORMAT and not _verify(
                    os.path.join(directory, manifest["npz"]), manifest):
                return path
        except (OSError, ValueError, KeyError, UnicodeDecodeError):
            continue
    return None
