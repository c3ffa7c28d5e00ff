"""Sharded checkpoints: every rank writes its own slices, one manifest says where each is.

Format "ringpipe-checkpoint-3". Checkpoint S of a run is, in its checkpoints folder:

  ckpt_SSSSSSSS.shards/rank_RRRRR.bin   one file per rank that holds a slice: its pieces
                                        one after another, each a box of a whole array
                                        stored C-contiguous, raw bytes, 64-byte aligned
  ckpt_SSSSSSSS.json                    the manifest (the commit marker), the keys of
                                        format 2 without npz/npz_bytes/npz_crc32, and
                                        `shards`: {folder, files: [{name, bytes,
                                        crc32: [one per 4 MiB of the file]}],
                                        arrays: {name: {shape, dtype}},
                                        pieces: [[array, file index, offset, box]]}

A box is [[lo, hi], ...], one pair per dimension of the whole array (its full,
layout-independent shape, as in format 2): the same checkpoint describes itself in
the coordinates of the model, never of the layout that wrote it. So a reader at any
layout asks for the boxes it holds and reads only the pieces that overlap them
(`Reader.read_box`, which checks the CRC32 of each 4 MiB block of a file it reads
from; `check_files` checks them all), and the pieces of every array tile it exactly
once (checked before a checkpoint is used).

Commit: every rank writes its file into ckpt_SSSSSSSS.shards.tmp/ and fsyncs it; once
every rank says it has (the caller's gather), the first rank renames the folder into
place, then writes the manifest atomically (engine/job/checkpoint.py). A crash before
the manifest leaves a folder no manifest names: it counts as nothing, and the next run
holding the lock removes it (checkpoint.remove_stale_temp_files).

This module knows boxes and bytes only: which rank holds which box is the parallel
axes' (engine/parallel/slices.py).

Import rule: like every module of job/ (no model/, parallel/, train/).
"""
from __future__ import annotations

import math
import os
import re
import zlib

import numpy as np

FORMAT_SHARDED = "ringpipe-checkpoint-3"
ALIGN = 64                           # each piece starts on a cache line
CRC_BLOCK = 4 << 20                  # a file's CRC32s, one per 4 MiB: a reader checks only what it reads
_BLOCK = 1 << 24                     # bytes read or hashed at once: never a second copy of a piece
_RANK_FILE = re.compile(r"rank_\d{5}\.bin")
_ARRAY_NAME = re.compile(r"[A-Za-z0-9_./\-]{1,200}")


class Problem(Exception):
    """What is wrong with a checkpoint, in a few words (engine/job/checkpoint.py's _Problem)."""


def folder_name(step: int) -> str:
    return f"ckpt_{step:08d}.shards"


def temp_folder_name(step: int) -> str:
    return f"ckpt_{step:08d}.shards.tmp"


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.bin"


def volume(box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def intersect(a, b):
    """The box common to boxes a and b, or None."""
    out = [(max(lo, c), min(hi, d)) for (lo, hi), (c, d) in zip(a, b)]
    return out if all(lo < hi for lo, hi in out) else None


# ---- writing ---------------------------------------------------------------------------

class _BlockCRCs:
    """The CRC32 of each CRC_BLOCK bytes of a stream, fed in pieces of any length."""

    def __init__(self):
        self.done, self.crc, self.filled = [], 0, 0

    def feed(self, data) -> None:
        data = memoryview(data).cast("B")
        while data.nbytes:
            take = min(data.nbytes, CRC_BLOCK - self.filled)
            self.crc = zlib.crc32(data[:take], self.crc)
            self.filled += take
            data = data[take:]
            if self.filled == CRC_BLOCK:
                self.done.append(self.crc)
                self.crc, self.filled = 0, 0

    def blocks(self) -> list:
        return self.done + ([self.crc] if self.filled else [])


def write_rank_file(folder: str, rank: int, pieces) -> dict | None:
    """Write this rank's pieces ((array name, box, host array), in any order, an iterable
    consumed one piece at a time) to folder/rank_RRRRR.bin and fsync it. Returns its record
    for the manifest: {name, bytes, crc32: [one per 4 MiB of the file], pieces: [[array,
    offset, box]]}, or None (and no file) when there was no piece. On failure the partial
    file is removed (a full disk stays no fuller) and the OSError raised."""
    name = rank_file_name(rank)
    path = os.path.join(folder, name)
    records, crcs, offset = [], _BlockCRCs(), 0
    try:
        with open(path, "wb") as fh:
            for array, box, data in pieces:
                pad = bytes(-offset % ALIGN)
                raw = memoryview(np.ascontiguousarray(data)).cast("B")
                for chunk in (pad, raw):
                    fh.write(chunk)
                    crcs.feed(chunk)
                offset += len(pad)
                records.append([array, offset, [list(map(int, pair)) for pair in box]])
                offset += raw.nbytes
            fh.flush()
            os.fsync(fh.fileno())
        if not records:        # this rank holds nothing to write (its share was all another's)
            os.remove(path)
            return None
    except BaseException:
        try:
            os.remove(path)
        except OSError:
            pass
        raise
    return {"name": name, "bytes": offset, "crc32": crcs.blocks(), "pieces": records}


def shards_entry(step: int, records: list, arrays: dict) -> dict:
    """The manifest's `shards` from every rank's record (write_rank_file's; None for a
    rank that wrote nothing) and {array name: (whole shape, dtype)}."""
    files, pieces = [], []
    for record in records:
        if record is None:
            continue
        index = len(files)
        files.append({"name": record["name"], "bytes": record["bytes"], "crc32": record["crc32"]})
        pieces.extend([array, index, offset, box] for array, offset, box in record["pieces"])
    pieces.sort(key=lambda p: (p[0], p[3]))
    declared = {name: {"shape": [int(n) for n in shape], "dtype": np.dtype(dtype).name}
                for name, (shape, dtype) in sorted(arrays.items())}
    return {"folder": folder_name(step), "files": files, "arrays": declared, "pieces": pieces}


# ---- checking ---------------------------------------------------------------------------

def _int(value, low, high, what):
    if type(value) is not int or not low <= value <= high:
        raise Problem(f"the manifest's shards.{what} holds {value!r}, expected an integer from {low} to {high}")


def check_entry(entry, step: int) -> None:
    """The `shards` key's schema, and that the pieces tile every array exactly once and
    fit their files; raises Problem. Reads no file."""
    if type(entry) is not dict or sorted(entry) != ["arrays", "files", "folder", "pieces"]:
        raise Problem("the manifest's shards is not an object with exactly the keys arrays, files, folder, pieces")
    if entry["folder"] != folder_name(step):
        raise Problem(f"the manifest names the shards folder {entry['folder']!r}, expected {folder_name(step)!r}")
    files = entry["files"]
    if type(files) is not list or not 1 <= len(files) <= 1 << 20:
        raise Problem("the manifest's shards.files is not a list of 1 or more files")
    for f in files:
        if type(f) is not dict or sorted(f) != ["bytes", "crc32", "name"] or not isinstance(f["name"], str) \
                or not _RANK_FILE.fullmatch(f["name"]):
            raise Problem(f"the manifest's shards.files holds {str(f)[:60]}, expected {{name: rank_RRRRR.bin, "
                          "bytes, crc32}")
        _int(f["bytes"], 0, 2**50, "files.bytes")
        crcs = f["crc32"]
        if type(crcs) is not list or len(crcs) != -(-f["bytes"] // CRC_BLOCK) or not all(
                type(c) is int and 0 <= c < 2**32 for c in crcs):
            raise Problem(f"the manifest's shards.files entry of {f['name']} does not hold one CRC32 per "
                          f"{CRC_BLOCK >> 20} MiB of it")
    if len({f["name"] for f in files}) != len(files):
        raise Problem("the manifest's shards.files names a file twice")
    arrays = entry["arrays"]
    if type(arrays) is not dict:
        raise Problem("the manifest's shards.arrays is not an object")
    for name, a in arrays.items():
        if not _ARRAY_NAME.fullmatch(name) or type(a) is not dict or sorted(a) != ["dtype", "shape"] \
                or type(a["shape"]) is not list or not 1 <= len(a["shape"]) <= 4 \
                or a["dtype"] not in ("float16", "float32", "float64", "int32", "int64", "uint16"):
            raise Problem(f"the manifest's shards.arrays[{name[:60]!r}] is not {{shape: a list of 1 to 4 sizes, "
                          "dtype: a numeric dtype}")
        for n in a["shape"]:
            _int(n, 0, 2**40, f"arrays[{name!r}].shape")
    _check_pieces(entry["pieces"], files, arrays)


def _check_pieces(pieces, files, arrays):
    if type(pieces) is not list:
        raise Problem("the manifest's shards.pieces is not a list")
    by_array = {name: [] for name in arrays}
    for p in pieces:
        if type(p) is not list or len(p) != 4 or p[0] not in arrays:
            raise Problem(f"the manifest's shards.pieces holds {str(p)[:80]}, expected [array, file, offset, box] "
                          "of a declared array")
        name, index, offset, box = p
        _int(index, 0, len(files) - 1, "pieces' file")
        _int(offset, 0, 2**50, "pieces' offset")
        shape = arrays[name]["shape"]
        if type(box) is not list or len(box) != len(shape) or not all(
                type(pair) is list and len(pair) == 2 and type(pair[0]) is int and type(pair[1]) is int
                and 0 <= pair[0] < pair[1] <= n for pair, n in zip(box, shape)):
            raise Problem(f"the manifest's piece of {name} has the box {str(box)[:60]}, which is not inside its "
                          f"shape {shape}")
        end = offset + volume(box) * np.dtype(arrays[name]["dtype"]).itemsize
        if end > files[index]["bytes"]:
            raise Problem(f"the manifest's piece of {name} at byte {offset} of {files[index]['name']} runs past "
                          "its end")
        by_array[name].append(box)
    for name, boxes in by_array.items():
        _check_tiling(name, arrays[name]["shape"], boxes)


def _check_tiling(name, shape, boxes):
    """The boxes cover the array exactly once: their volumes add up to its size and no
    two overlap (sorted by their first corner, only neighbours that start before the
    other ends can overlap; fine for the few pieces per rank an array has)."""
    if sum(volume(b) for b in boxes) != math.prod(shape):
        raise Problem(f"the pieces of {name} do not cover its shape {shape} exactly once")
    boxes = sorted(boxes)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if b[0][0] >= a[0][1]:
                break
            if intersect(a, b):
                raise Problem(f"two pieces of {name} overlap ({a} and {b})")


def check_files(json_path: str, manifest: dict, open_regular) -> None:
    """Every rank file is a regular file of the size the manifest says, and every 4 MiB of it
    has its CRC32 (reads them all, a block at a time); raises Problem."""
    reader = Reader(json_path, manifest, open_regular)
    try:
        for index, f in enumerate(reader.entry["files"]):
            reader.verify(index, 0, f["bytes"])
    finally:
        reader.close()


# ---- reading ---------------------------------------------------------------------------

class Reader:
    """Reads boxes of a sharded checkpoint's arrays from the pieces that hold them, each
    4 MiB block of a file CRC-checked the first time it is read from, each file's size
    checked when it is opened."""

    def __init__(self, json_path: str, manifest: dict, open_regular):
        self.entry = manifest["shards"]
        self.folder = os.path.join(os.path.dirname(json_path), self.entry["folder"])
        self.open_regular = open_regular
        self.pieces = {name: [] for name in self.entry["arrays"]}
        for name, index, offset, box in self.entry["pieces"]:
            self.pieces[name].append((index, offset, box))
        self._files, self._verified = {}, set()
        self.bytes_checked = 0             # what the CRC checks read: each rank only its slices' blocks

    def shape(self, name):
        return tuple(self.entry["arrays"][name]["shape"])

    def dtype(self, name):
        return np.dtype(self.entry["arrays"][name]["dtype"])

    def read_whole(self, name):
        out = np.empty(self.shape(name), dtype=self.dtype(name))
        self.read_box(name, [(0, n) for n in out.shape], out)
        return out

    def read_box(self, name, box, out) -> None:
        """Fill `out` (an array of the box's shape, any dtype: values are cast) with the
        box of array `name`, reading only the pieces that overlap it."""
        itemsize = self.dtype(name).itemsize
        for index, offset, stored in self.pieces[name]:
            common = intersect(box, stored)
            if common is None:
                continue
            row = volume(stored[1:]) * itemsize
            first, last = common[0][0] - stored[0][0], common[0][1] - stored[0][0]
            self.verify(index, offset + first * row, offset + last * row)
            self._read_rows(self._file(index), offset, stored, common, self.dtype(name),
                            out[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(common, box))])

    def _read_rows(self, fh, offset, stored, common, dtype, out):
        """The `common` sub-box of a stored piece into `out`: its rows (first dimension) read
        whole, at most _BLOCK bytes at a time, the other dimensions cut in memory."""
        shape = [hi - lo for lo, hi in stored]
        row = math.prod(shape[1:]) * dtype.itemsize
        first, last = common[0][0] - stored[0][0], common[0][1] - stored[0][0]
        step = max(1, _BLOCK // max(1, row))
        cut = tuple(slice(lo - s, hi - s) for (lo, hi), (s, _) in zip(common[1:], stored[1:]))
        for a in range(first, last, step):
            b = min(a + step, last)
            data = np.empty((b - a) * row, dtype=np.uint8)
            fh.seek(offset + a * row)
            if fh.readinto(data) != data.size:
                raise Problem(f"a shard of {self.folder} ends early")
            out[a - first:b - first] = data.view(dtype).reshape([b - a, *shape[1:]])[(slice(None), *cut)]

    def verify(self, index, lo, hi) -> None:
        """Check the CRC32 of each 4 MiB block of file `index` that its bytes [lo, hi) touch
        (each block once per reader)."""
        f, fh = self.entry["files"][index], self._file(index)
        for block in range(lo // CRC_BLOCK, -(-hi // CRC_BLOCK)):
            if (index, block) in self._verified:
                continue
            fh.seek(block * CRC_BLOCK)
            data = fh.read(min(CRC_BLOCK, f["bytes"] - block * CRC_BLOCK))
            if zlib.crc32(data) != f["crc32"][block]:
                raise Problem(f"the shard {f['name']} is corrupt (CRC32 mismatch)")
            self._verified.add((index, block))
            self.bytes_checked += len(data)

    def _file(self, index):
        if index not in self._files:
            f = self.entry["files"][index]
            fh = self.open_regular(os.path.join(self.folder, f["name"]), f"shard {f['name']}")
            size = os.fstat(fh.fileno()).st_size
            if size != f["bytes"]:
                fh.close()
                raise Problem(f"the shard {f['name']} is truncated or the wrong file ({size} bytes, the manifest "
                              f"says {f['bytes']})")
            self._files[index] = fh
        return self._files[index]

    def close(self):
        for fh in self._files.values():
            fh.close()
        self._files = {}
