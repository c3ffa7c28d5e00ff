"""Damaging and removing checkpoints in tests, whatever their format (an .npz, or a
folder of rank files: engine/job/sharded.py)."""
from __future__ import annotations

import os
import shutil

from ringpipe.engine.job import checkpoint


def data_file(json_path) -> str:
    """The file a checkpoint's arrays are in: its .npz, or its first rank file."""
    path = checkpoint.files_of(str(json_path))[-1]
    if os.path.isdir(path):
        return os.path.join(path, sorted(os.listdir(path))[0])
    return path


def truncate(json_path, size=100) -> None:
    with open(data_file(json_path), "r+b") as fh:
        fh.truncate(size)


def flip_middle(json_path, count=16) -> None:
    """Overwrite `count` bytes in the middle of the checkpoint's data with 0xff."""
    path = data_file(json_path)
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        fh.write(b"\xff" * count)


def remove(json_path) -> None:
    """Remove the checkpoint whole: its manifest first (the commit marker), then its data."""
    for path in checkpoint.files_of(str(json_path)):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
