"""Where ringpipe keeps what it computes once and reuses (the stdlib corpus's shards, the
float32 GEMM chosen for a host): standard library only, for kernels/ and engine/ alike."""
import os


def cache_root() -> str:
    """$RINGPIPE_CACHE, else $XDG_CACHE_HOME/ringpipe, else ~/.cache/ringpipe."""
    if os.environ.get("RINGPIPE_CACHE"):
        return os.environ["RINGPIPE_CACHE"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ringpipe")
