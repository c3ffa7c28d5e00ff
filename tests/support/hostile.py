"""Helpers of the hostile-input tests (tests/engine/test_abuse_*.py, test_reliability.py):
a deadline that turns a hang into a failure, and a small real disk to fill."""
import contextlib
import os
import signal
import subprocess

import pytest


@contextlib.contextmanager
def deadline(seconds):
    """Fail instead of hanging: a FIFO opened for reading waits for a writer forever,
    /dev/zero is never read to its end. SIGALRM raises TimeoutError after `seconds`."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s: it blocked")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def tmpfs(path, size):
    """A tmpfs of `size` (e.g. "600k") mounted at `path` (made here): a disk that fills up.
    Skips the test where it cannot be mounted (not root, no permission)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    return path
