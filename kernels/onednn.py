"""oneDNN's C API through ctypes: the library, its OpenMP threads, and one GEMM loop.

Two GEMMs of ringpipe run here (kernels/bf16.py: dnnl_gemm_bf16bf16f32 for bf16
operands; kernels/sgemm.py: dnnl_sgemm for float32 where it beats numpy's BLAS on this
host). Both are row-major with transpose flags and leading dimensions, so transposed
views cost no copy, and take one matrix per call: batch dimensions are a loop over the
matrices' addresses here.

The library comes from a PyPI package (the `bf16` extra installs onednn-cpu-gomp,
whose libdnnl needs only libgomp and libstdc++). Loaded once per process, on first use.
"""

import ctypes
import importlib.metadata
import os

import numpy as np

# PyPI distributions that ship libdnnl, the fewest runtime dependencies first:
# onednn-cpu-gomp needs libgomp and libstdc++ only; onednn (2025+) pulls Intel's
# SYCL/OpenCL runtimes (hundreds of MB), -iomp Intel's OpenMP, -tbb TBB.
LIBRARY_PACKAGES = ("onednn-cpu-gomp", "onednn-cpu-iomp", "onednn-cpu-tbb", "onednn")
INSTALL_HINT = "pip install 'ringpipe[bf16]' (or onednn-cpu-gomp)"
# GEMMs of fewer multiply-adds per matrix than this run on one OpenMP thread (see gemm).
SMALL_MACS = 1 << 21

_state = {"library": None, "threads": None}


def find_library():
    """(path of libdnnl from an installed PyPI package, package name), or (None, None)."""
    for package in LIBRARY_PACKAGES:
        try:
            files = importlib.metadata.files(package) or ()
        except importlib.metadata.PackageNotFoundError:
            continue
        found = sorted(str(f.locate()) for f in files if os.path.basename(str(f)).startswith("libdnnl.so"))
        if found:
            # libdnnl.so.3 (the soname) over the bare .so link and the full version
            found.sort(key=lambda p: (p.count(".so.") != 1, len(p)))
            return found[0], package
    return None, None


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


class Library:
    """The loaded oneDNN: its two GEMMs, its version, and its OpenMP threads."""

    def __init__(self, path, package):
        self.lib = ctypes.CDLL(path)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        args = [ctypes.c_char, ctypes.c_char, i64, i64, i64, ctypes.c_float, ptr, i64, ptr, i64,
                ctypes.c_float, ptr, i64]
        self.gemm = self.lib.dnnl_gemm_bf16bf16f32      # bf16 x bf16 -> float32
        self.sgemm = self.lib.dnnl_sgemm                # float32
        for fn in (self.gemm, self.sgemm):
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.lib.dnnl_version.restype = ctypes.POINTER(_Version)
        v = self.lib.dnnl_version().contents
        self.version = f"{v.major}.{v.minor}.{v.patch}"
        self.package = package
        self.openmp = v.cpu_runtime == 2     # DNNL_RUNTIME_OMP; TBB and sequential builds ignore OpenMP
        # the OpenMP runtime the library links (libgomp for onednn-cpu-gomp)
        self.omp = ctypes.CDLL("libgomp.so.1") if self.openmp else None
        if _state["threads"] is not None:
            self.set_num_threads(_state["threads"])

    def describe(self):
        return f"oneDNN {self.version} ({self.package})"

    def set_num_threads(self, n):
        if self.omp is not None:
            self.omp.omp_set_num_threads(n)

    def get_num_threads(self):
        return self.omp.omp_get_max_threads() if self.omp is not None else 1


def library():
    """(Library, None), or (None, why it is not there); loaded on the first call."""
    if _state["library"] is None:
        path, package = find_library()
        if path is None:
            _state["library"] = (None, f"no oneDNN library is installed ({INSTALL_HINT})")
        else:
            try:
                _state["library"] = (Library(path, package), None)
            except (OSError, AttributeError) as exc:
                _state["library"] = (None, f"{path} did not load ({exc})")
    return _state["library"]


def set_num_threads(n):
    """Threads of oneDNN's GEMMs (an OpenMP setting of the calling thread) for calls from
    this thread; before the library loads, kept for when it does."""
    _state["threads"] = int(n)
    lib = _state["library"][0] if _state["library"] else None
    if lib is not None:
        lib.set_num_threads(int(n))


# ---------------------------------------------------------------------------
# one GEMM loop for both


def leading_dim(x):
    """Elements between rows of a matrix with unit column stride."""
    rows, cols = x.shape[-2:]
    return max(1, cols, x.strides[-2] // x.itemsize if rows > 1 else cols)


def writable_direct(out, N):
    """Can the library write out's matrices in place? (unit column stride, rows apart)"""
    M = out.shape[-2]
    item = out.itemsize
    return ((out.strides[-1] == item or N <= 1)
            and (M <= 1 or (out.strides[-2] % item == 0 and out.strides[-2] >= item * N)))


def matrix_addresses(batch, *arrays):
    """The address of each matrix of each array over the broadcast batch dims, as
    tuples of ints: computed at once, since the Python loop over them is what costs
    on small batched GEMMs (attention heads), not the library's call."""
    if not batch:
        return [tuple(x.ctypes.data for x in arrays)]
    index = np.indices(batch).reshape(len(batch), -1).T          # (matrices, batch dims)
    columns = []
    for x in arrays:
        strides = np.broadcast_to(x, batch + x.shape[-2:]).strides[:len(batch)]   # 0 where broadcast
        columns.append((x.ctypes.data + index @ np.array(strides, np.int64)).tolist())
    return list(zip(*columns))


def gemm(lib, fn, name, a, ta, b, tb, out, accumulate, hint):
    """out = op(a) @ op(b) (+ out if accumulate) through FN (lib.gemm or lib.sgemm), float32
    out; a and b have unit column stride (their callers make sure), batch dims broadcast.
    HINT: what to set if the library fails (a RuntimeError naming the call)."""
    M, K = (a.shape[-1], a.shape[-2]) if ta else a.shape[-2:]
    N = b.shape[-2] if tb else b.shape[-1]
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if out is None:
        out = np.empty(batch + (M, N), np.float32)
    c = out if writable_direct(out, N) else np.empty(batch + (M, N), np.float32)
    if M == 0 or N == 0:
        return out
    if K == 0:
        if not accumulate:
            out[...] = 0.0
        return out
    beta = 1.0 if accumulate and c is out else 0.0
    ca, cb = (b"T" if ta else b"N"), (b"T" if tb else b"N")
    lda, ldb, ldc = leading_dim(a), leading_dim(b), leading_dim(c)
    # Small matrices (attention heads) run on one OpenMP thread each: waking a second
    # sleeping OpenMP thread costs about 10 us a call (measured), more than a 128^3 GEMM
    # gains. A batch of them is shared out among the threads instead (_run_shared).
    threads = lib.get_num_threads() if M * N * K < SMALL_MACS else 1
    addresses = matrix_addresses(batch, a, b, c)
    args = (ca, cb, M, N, K, 1.0, lda, ldb, beta, ldc)
    if threads > 1:
        lib.set_num_threads(1)
    try:
        failed = _run_shared(lib, fn, args, addresses, threads) if threads > 1 and len(addresses) > 1 \
            else _run(fn, args, addresses)
    finally:
        if threads > 1:
            lib.set_num_threads(threads)
    if failed:
        raise RuntimeError(f"{name} failed with status {failed} on ({M}, {N}, {K}) "
                           f"trans {ca.decode()}{cb.decode()}, lda {lda} ldb {ldb} ldc {ldc}; {hint}")
    if c is not out:
        if accumulate:
            out += c
        else:
            out[...] = c
    return out


def _run(fn, args, addresses):
    """Each matrix's GEMM in turn; the first failing status, or 0."""
    ca, cb, M, N, K, alpha, lda, ldb, beta, ldc = args
    for pa, pb, pc in addresses:
        status = fn(ca, cb, M, N, K, alpha, pa, lda, pb, ldb, beta, pc, ldc)
        if status != 0:
            return status
    return 0


_pool = {"executor": None, "size": 0}


def _run_shared(lib, fn, args, addresses, threads):
    """The matrices of a batch of small GEMMs shared out among THREADS threads, each matrix on
    one (this thread takes the first share; ctypes lets go of the GIL during each call, so the
    shares run at once). Every matrix is computed as _run would: the same numbers."""
    from concurrent.futures import ThreadPoolExecutor

    if _pool["size"] != threads - 1:
        if _pool["executor"] is not None:
            _pool["executor"].shutdown(wait=True)
        _pool["executor"] = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="ringpipe-gemm")
        _pool["size"] = threads - 1
    step = -(-len(addresses) // threads)
    shares = [addresses[i:i + step] for i in range(0, len(addresses), step)]

    def share(part):
        lib.set_num_threads(1)        # an OpenMP setting of the calling thread: one thread per matrix
        return _run(fn, args, part)

    futures = [_pool["executor"].submit(share, part) for part in shares[1:]]
    statuses = [_run(fn, args, shares[0])] + [f.result() for f in futures]
    return next((s for s in statuses if s), 0)
