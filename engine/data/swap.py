"""The swap that replaces the dataset in `ringpipe prepare --out` whole (renames only).

The new dataset is complete in the staging folder first; then a journal of the names
(OUT/previous/swap.json), the old dataset's files hard-linked into OUT/previous/, the new
ones renamed in (data.json last), the old shards the new data.json does not name removed,
OUT/previous/ removed. At every instant OUT or OUT/previous/ holds a whole dataset (on a
filesystem without hard links the old files are moved there instead: whole again once
moved). A failure or Ctrl-C during the swap puts the old dataset back; after a kill the
next prepare does (restore_previous, from the journal), and says so.

Only the files a manifest names are the dataset (data.json, its tokenizer, its shards):
the swap replaces those and never deletes any other file in OUT.
"""
from __future__ import annotations

import os
import shlex

from ringpipe.engine.job import files
from ringpipe.engine.data import shards
from ringpipe.engine.data.errors import PrepareError

PREVIOUS_NAME = "previous"         # OUT/previous/: the old dataset while --overwrite swaps the new one in
SWAP_JOURNAL = "swap.json"         # OUT/previous/swap.json: the files a swap renames, to undo a killed one


def fsync_dir(path: str) -> None:
    """Make the renames in a folder durable (a crash after it must not undo them)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass                       # not every filesystem can fsync a folder; the renames still happened
    finally:
        os.close(fd)


def swap_in(out: str, staging: str, old: list[str], new: list[str]) -> None:
    """The files `new` from `staging` into OUT in place of the dataset whose files are `old`
    (data.json last in both; see the module's docstring and OutFolder.install)."""
    previous = os.path.join(out, PREVIOUS_NAME)
    data_json = shards.MANIFEST_NAME
    aside = linked = False
    try:
        if old:
            os.mkdir(previous)
            aside = True
            # The journal first: a prepare killed from here on is undone by the next one
            # (restore_previous), which then knows which files in OUT were this run's.
            shards.write_json_atomic(os.path.join(previous, SWAP_JOURNAL), {"new": new, "old": old})
            try:
                for name in old:                # data.json last
                    os.link(os.path.join(out, name), os.path.join(previous, name))
                linked = True
            except OSError:
                # No hard links here (some FUSE and object-store mounts): move the files
                # instead, data.json first, so OUT never holds a manifest naming moved shards.
                for name in [data_json] + [n for n in old if n != data_json]:
                    src = os.path.join(out, name)
                    if os.path.lexists(src):
                        os.replace(src, os.path.join(previous, name))
            fsync_dir(previous)
            if linked:
                os.remove(os.path.join(out, data_json))
        for name in new:
            os.replace(os.path.join(staging, name), os.path.join(out, name))
        fsync_dir(out)
        os.replace(os.path.join(staging, data_json), os.path.join(out, data_json))
        fsync_dir(out)
    except BaseException:
        if aside:
            _put_back(out, previous, new, old)
        raise
    # The new dataset is in place: what remains of the old one goes, its shards in OUT the
    # new manifest does not name, then previous/ (its data.json last). Best effort: the run
    # succeeded; whatever a failure or a kill leaves here is still named by previous/data.json
    # (or is a hard link of it), and the next prepare clears it (clear_previous).
    try:
        for name in old:
            if name not in new and name != data_json and os.path.lexists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        if aside:
            for name in sorted(os.listdir(previous), key=lambda n: n == data_json):
                os.remove(os.path.join(previous, name))
            os.rmdir(previous)
    except (OSError, KeyboardInterrupt):
        pass                   # the new dataset is in place: a Ctrl-C now has nothing left to stop


def _put_back(out: str, previous: str, new: list[str], old: list[str]) -> None:
    """After a failed swap: the old dataset back into OUT (data.json last), the new
    files that were renamed in removed. If this fails too, OUT/previous/ stays with
    its journal, and the next prepare finishes the job (restore_previous)."""
    try:
        move_back(out, previous, new, old)
    except OSError:
        pass


def restore_previous(out: str, previous: str) -> str:
    """OUT holds no data.json and OUT/previous/ a dataset: a prepare --overwrite was
    killed while it swapped. Its journal (previous/swap.json, written before it touched
    anything) names the files it was renaming in: those go, the old dataset's files come
    back (data.json last). Without a journal nothing is guessed: refuse, saying how."""
    q = shlex.quote
    try:
        journal = files.read_json(os.path.join(previous, SWAP_JOURNAL), "the swap's journal")
        new, old = journal["new"], journal["old"]
        if not all(isinstance(n, str) and n not in ("", ".", "..") and "/" not in n for n in new + old):
            raise ValueError("it names files outside the folder")
    except (ValueError, KeyError, TypeError) as e:
        raise PrepareError(
            f"--out {out} holds no dataset, but {previous} holds one: a prepare --overwrite was stopped while "
            f"it swapped the new dataset in, and what it left cannot be undone safely ({e}). Train on the old one "
            f"where it is (--data {q(previous)}), or move its files back by hand: `cd {q(out)} && for f in "
            "previous/*; do rm -f \"${f#previous/}\"; mv \"$f\" .; done && rmdir previous`") from None

    move_back(out, previous, new, old)
    return (f"restored the dataset in {out} from {previous}, where a prepare --overwrite that was stopped while "
            "it swapped datasets had set it aside")


def clear_previous(out: str, previous: str, old: list[str]) -> list[str]:
    """OUT/previous/ beside a complete dataset in OUT (under --overwrite) is in the way of
    the swap. Cleared if it is what a stopped prepare left: the dataset it had replaced
    (named by its own data.json) or hard links of OUT's files; the old shards left in OUT
    that are the same files and that OUT's data.json does not name go too. Anything
    else in it is the user's: refuse, deleting nothing."""
    if not os.path.isdir(previous) or os.path.islink(previous):
        raise PrepareError(f"{previous} is not a folder prepare made; prepare keeps the old dataset there while "
                           "it swaps the new one in: move it away")

    def same(name):
        there, here = os.path.join(previous, name), os.path.join(out, name)
        return os.path.lexists(there) and os.path.lexists(here) and os.path.samefile(there, here)
    held = os.listdir(previous)
    ours = set(dataset_files(previous)) if shards.MANIFEST_NAME in held else set()
    ours |= {n for n in held if same(n) or n == SWAP_JOURNAL or n.startswith(SWAP_JOURNAL + ".tmp-")}
    others = sorted(set(held) - ours)
    if others:
        raise PrepareError(f"{previous} holds {', '.join(others[:10])}: not a dataset prepare set aside; "
                           "prepare keeps the old dataset there while it swaps the new one in: move the folder "
                           "away")
    for name in sorted(ours, key=lambda n: n == shards.MANIFEST_NAME):     # its data.json last
        if name not in old and same(name):
            os.remove(os.path.join(out, name))   # an old shard the new dataset does not name
        if os.path.lexists(os.path.join(previous, name)):
            os.remove(os.path.join(previous, name))
    os.rmdir(previous)
    return [f"removed {previous}, the old dataset a stopped prepare --overwrite had set aside ({out} "
            "holds a complete one)"]


def move_back(out: str, previous: str, new: list[str], old: list[str]) -> None:
    """Undo a swap: the files it renamed into OUT that the old dataset does not have go,
    the old dataset's files come back from previous/ (data.json last), previous/ goes.
    A file of previous/ that is a hard link of OUT's (the old file never left) is just
    dropped: rename(2) between two links of one file does nothing."""
    for name in new:
        if name not in old and os.path.lexists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for name in old:                                      # data.json last
        there, here = os.path.join(previous, name), os.path.join(out, name)
        if not os.path.lexists(there):
            continue
        if os.path.lexists(here) and os.path.samefile(there, here):
            os.remove(there)
        else:
            os.replace(there, here)
    for name in os.listdir(previous):
        if name == SWAP_JOURNAL or name.startswith(SWAP_JOURNAL + ".tmp-"):
            os.remove(os.path.join(previous, name))
    os.rmdir(previous)
    fsync_dir(out)


def dataset_files(folder: str) -> list[str]:
    """The files of the dataset in `folder` its data.json names: tokenizer, shards, then
    data.json itself. Refused if the manifest cannot be read (prepare cannot tell then
    which files are the dataset, and deletes nothing it cannot name)."""
    path = os.path.join(folder, shards.MANIFEST_NAME)
    try:
        m = files.read_json(path, "the dataset's manifest")
        names = [m["tokenizer"]["file"]] + [f for s in shards.SPLITS for f in m["splits"][s]["shards"]]
        if not all(isinstance(n, str) and n not in ("", ".", "..") and "/" not in n for n in names):
            raise ValueError("it names files outside its folder")
    except (ValueError, KeyError, TypeError) as e:
        raise PrepareError(f"{path} cannot be read ({e}), so prepare cannot tell which files in {folder} are its "
                           "dataset and replaces none: remove the old dataset's files (data.json, tokenizer.json, "
                           "the .bin shards) by hand, or choose another --out") from None
    return [n for n in dict.fromkeys(names) if n != shards.MANIFEST_NAME] + [shards.MANIFEST_NAME]
