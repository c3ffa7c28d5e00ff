"""Reading a file a user named, or one found in a folder, without trusting it.

Every reader of such a file (a data folder's data.json, a Hugging Face config.json,
a tokenizer.json, an index file, a completion marker) goes through here, so that

  - a FIFO, a device or a socket where a file is expected is refused at once: the
    file is opened with O_NONBLOCK (opening a FIFO would otherwise wait forever for
    a writer) and checked to be a regular file (/dev/zero would be read forever);
  - a file larger than the reader's limit is refused before it is read whole
    (a real manifest is kilobytes; a 20 GB one would be read into memory);
  - JSON nested too deeply (a RecursionError in the parser, or deeper than the reader's
    max_depth: a value nested just short of the parser's limit would exhaust the
    recursion of whatever prints it later), an integer longer than Python converts
    (4,300 digits) or than the reader's max_int_digits, or text that is not UTF-8, is a
    ValueError that names the file, like any other malformed JSON.

The errors are `UnreadableFile` (a ValueError): the command line turns them into
exit code 2 with the message, which names the file and says what it found.

A lock file (OUT/run.lock, DATA_DIR/prepare.lock) says who holds it; it is read the same
untrusting way (read_lock_owner, describe_lock_owner): it may be damaged, written by hand,
or name a pid no process can have.

Writing a small text file whole or not at all (write_text_atomic) is here too: the shards'
data.json and a tokenizer's tokenizer.json both need it, and neither may import the other.
try_create_beside(path) tries the folder first, for a tool whose work comes before its write.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys

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


# No JSON file ringpipe reads nests deeper than a few levels: deeper is damaged or hostile.
MAX_DEPTH = 100


class _TooLarge(ValueError):
    """An integer literal longer than the reader allows (raised inside the parser)."""


def _bounded_int(digits: int):
    """json's parse_int that refuses an integer of more than `digits` digits, before int() converts it."""
    def parse_int(literal: str) -> int:
        if len(literal.lstrip("-")) > digits:
            raise _TooLarge(f"holds an integer of {len(literal.lstrip('-')):,} digits, more than the {digits} "
                            "such a file has")
        return int(literal)
    return parse_int


def _deeper_than(value, limit: int) -> bool:
    """Whether `value` nests lists and objects more than `limit` deep (a loop, not recursion:
    the check must not be what exhausts the stack)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (list, dict)))
    return False


def parse_json(text, where: str, *, max_depth: int = MAX_DEPTH, max_int_digits: int | None = None):
    """json.loads with every failure a ValueError naming `where`: malformed JSON, text that
    is not UTF-8, nesting deeper than `max_depth` (or than the parser's recursion allows),
    and an integer longer than Python converts or than `max_int_digits`."""
    try:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8")
        value = json.loads(text, parse_int=_bounded_int(max_int_digits) if max_int_digits else None)
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"{where} is not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise UnreadableFile(f"{where} is not valid JSON: it is nested too deeply") from None
    except json.JSONDecodeError as e:
        raise UnreadableFile(f"{where} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except _TooLarge as e:
        raise UnreadableFile(f"{where} {e}") from None
    except ValueError:               # Python's own limit on int() of a long digit string (3.11, 3.10.7)
        raise UnreadableFile(f"{where} holds an integer longer than Python converts (its limit: "
                             f"{getattr(sys, 'get_int_max_str_digits', lambda: 4300)():,} digits)") from None
    # Counting brackets is quick; only text with more of them than the limit is walked.
    if text.count("[") + text.count("{") > max_depth and isinstance(value, (list, dict)) \
            and _deeper_than(value, max_depth):
        raise UnreadableFile(f"{where} nests lists or objects more than {max_depth} deep")
    return value


def read_json(path: str, what: str, limit: int = 16 * MiB, **bounds):
    """The parsed JSON of the regular file `path` (at most `limit` bytes); UnreadableFile otherwise.
    bounds: parse_json's max_depth and max_int_digits."""
    return parse_json(read_regular(path, what, limit), f"{what} {path}", **bounds)


# ---- lock files: who holds one, told without trusting what the file says ------------------

# flock() is not offered by every cluster filesystem (Lustre mounted without
# -o flock, some FUSE mounts): these errors mean "no locking here".
NO_LOCKING = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}

_OWNER_TEXT_LIMIT = 300
_PID_MAX = 1 << 22                  # Linux's pid_max ceiling (PID_MAX_LIMIT): larger is no process


def read_lock_owner(fd: int, what: str) -> dict | None:
    """What the lock file open at `fd` says of its owner: a dict, None when it is empty,
    or {"unreadable": True} for anything else (it is any bytes: damaged, or written by hand)."""
    try:
        raw = os.pread(fd, 4096, 0)      # bounded: a real one is ~200 bytes
        if not raw.strip():
            return None
        owner = parse_json(raw, what)
    except (OSError, ValueError):
        return {"unreadable": True}
    return owner if isinstance(owner, dict) else {"unreadable": True}


def _shown(value) -> str:
    """A field of the lock file as text for a message: printable, bounded."""
    text = value if isinstance(value, str) else json.dumps(value) if isinstance(value, (int, float)) else "?"
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text[:_OWNER_TEXT_LIMIT] + ("..." if len(text) > _OWNER_TEXT_LIMIT else "")


def describe_lock_owner(owner: dict | None) -> str:
    """'host H pid P, running, started T: COMMAND', each field checked before it is used."""
    if not isinstance(owner, dict) or not isinstance(owner.get("host"), str):
        return "owner unknown"
    pid = owner.get("pid")
    alive = ""
    if owner["host"] == socket.gethostname() and type(pid) is int and pid > 0:
        # Past the kernel's largest pid no process can be running (and os.kill would overflow).
        alive = ", running" if pid <= _PID_MAX and _pid_alive(pid) else ", no longer running"
    return (f"host {_shown(owner['host'])} pid {_shown(pid)}{alive}, started {_shown(owner.get('started', '?'))}: "
            f"{_shown(owner.get('command', '?'))}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def try_create_beside(path: str) -> None:
    """Create, and remove at once, the temp file write_text_atomic(path, ...) writes first:
    the OSError of a folder that takes no new file (read-only, /proc, not ours) comes
    before the work whose result would be lost, not after it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644))
    os.remove(tmp)


def write_text_atomic(path: str, text: str) -> None:
    """A UTF-8 text file written whole or not at all (temp file, fsync, rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
