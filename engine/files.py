"""Reading a file a user named, or one found in a folder, without trusting it.

Every reader of such a file (a data folder's data.json, a Hugging Face config.json,
a tokenizer.json, an index file, a completion marker) goes through here, so that

  - a FIFO, a device or a socket where a file is expected is refused at once: the
    file is opened with O_NONBLOCK (opening a FIFO would otherwise wait forever for
    a writer) and checked to be a regular file (/dev/zero would be read forever);
  - a file larger than the reader's limit is refused before it is read whole
    (a real manifest is kilobytes; a 20 GB one would be read into memory);
  - JSON nested too deeply (a RecursionError in the parser) or not UTF-8 is a
    ValueError that names the file, like any other malformed JSON.

The errors are `UnreadableFile` (a ValueError): the command line turns them into
exit code 2 with the message, which names the file and says what it found.
"""
from __future__ import annotations

import json
import os
import stat

MiB = 1 << 20


class UnreadableFile(ValueError):
    """A file that is missing, not a regular file, too large, or not the JSON it should be."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def open_regular(path: str, what: str, *, follow_symlinks: bool = True) -> int:
    """A read-only file descriptor of `path` if it is a regular file, else UnreadableFile.
    Opened with O_NONBLOCK (a FIFO opens at once instead of waiting for a writer) and
    checked with fstat after opening (what was checked is what is read); blocking mode
    is restored for the reads. follow_symlinks=False refuses a symlink (O_NOFOLLOW)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise UnreadableFile(f"{what} {path} does not exist") from None
    except OSError as e:
        if not follow_symlinks and os.path.islink(path):
            raise UnreadableFile(f"{what} {path} is a symbolic link, not a regular file; remove the link") from None
        raise UnreadableFile(f"{what} {path} cannot be opened ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnreadableFile(f"{what} {path} is {file_kind(mode)}, not a regular file; put the file itself there")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: str, what: str, limit: int) -> bytes:
    """The bytes of the regular file `path`, refused (UnreadableFile) if it is larger than `limit`."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnreadableFile(f"{what} {path} is {size:,} bytes, more than the {limit:,} such a file can be "
                                 "(it is not the file expected, or is damaged)")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)            # the size may have changed since fstat
        if len(data) > limit:
            raise UnreadableFile(f"{what} {path} grew past {limit:,} bytes while it was read")
        return data
    finally:
        os.close(fd)


def parse_json(text, where: str):
    """json.loads with every failure a ValueError naming `where`: malformed JSON,
    text that is not UTF-8, and nesting deep enough to exhaust the parser's recursion."""
    try:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8")
        return json.loads(text)
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"{where} is not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise UnreadableFile(f"{where} is not valid JSON: it is nested too deeply") from None
    except json.JSONDecodeError as e:
        raise UnreadableFile(f"{where} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def read_json(path: str, what: str, limit: int = 16 * MiB):
    """The parsed JSON of the regular file `path` (at most `limit` bytes); UnreadableFile otherwise."""
    return parse_json(read_regular(path, what, limit), f"{what} {path}")
