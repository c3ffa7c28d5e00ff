"""
A stand-in for the `cupy` module that runs kernels/cuda/*.cu on the CPU.

tests/kernels/test_cuda_kernels.py copies this file to <tmp>/cupy/__init__.py and runs the
GPU tests in a subprocess with <tmp> first on PYTHONPATH, so that on a machine with
no GPU the real host code (kernels/cuda/cupy_kernels.py) drives the real CUDA C
sources, compiled with g++ against tests/support/cuda_emu.h (one OS thread per CUDA thread,
real barriers; see that header for what is and is not emulated).

Arrays are numpy arrays of a subclass whose module is "cupy" (so kernels.backend
treats them as GPU arrays). Everything not defined here falls through to numpy, with
array results re-wrapped.

RawModule is stricter than CuPy on purpose: it reads each kernel's C parameter list
and rejects an argument whose width or type does not match (a bare Python int for an
`int` parameter, a float64 array for a `float*`, a non-contiguous array for any
pointer) -- mistakes that real CuPy passes through silently as wrong results.

Environment: CUDA_EMU_MUTATE="old=>new" edits the source text before compiling (the
planted-bug tests); CUDA_EMU_SANITIZE=1 builds with -fsanitize=address,alignment,bounds
(needs libasan preloaded into python: LD_PRELOAD=$(g++ -print-file-name=libasan.so)).
"""

import atexit
import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading

import numpy as _np

__version__ = "0.0-cuda-emu"
EMULATED = True
_HERE_HEADER = os.environ.get("CUDA_EMU_HEADER")  # path of tests/support/cuda_emu.h, set by the test


class ndarray(_np.ndarray):
    """numpy array posing as a cupy array."""

    @property
    def data(self):  # cupy: arr.data.ptr is the device pointer
        return _Ptr(self.__array_interface__["data"][0])

    @property
    def device(self):  # cupy: the Device the array lives on
        return _Device(0)

    @property
    def __cuda_array_interface__(self):  # what comm/device.py recognises a device array by
        iface = dict(self.__array_interface__)
        iface["version"] = 3
        return iface

    def get(self, stream=None, order="C", out=None):
        if out is None:
            return _np.array(self, copy=True).view(_np.ndarray)
        out[...] = self
        return out

    def set(self, arr):
        self[...] = arr


ndarray.__module__ = "cupy"


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


def _wrap(x):
    if isinstance(x, _np.ndarray) and not isinstance(x, ndarray):
        return x.view(ndarray)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


def __getattr__(name):
    attr = getattr(_np, name)
    if callable(attr) and not isinstance(attr, type):
        def wrapped(*args, **kwargs):
            return _wrap(attr(*args, **kwargs))

        wrapped.__name__ = name
        return wrapped
    return attr


def asnumpy(x, stream=None):
    return _np.array(x, copy=True).view(_np.ndarray) if isinstance(x, _np.ndarray) else _np.asarray(x)


def asarray(x, dtype=None):
    return _np.array(x, dtype=dtype, copy=True).view(ndarray) if not isinstance(x, ndarray) else (
        x if dtype is None or x.dtype == dtype else x.astype(dtype))


def array(x, dtype=None, copy=True):
    return _np.array(x, dtype=dtype, copy=True).view(ndarray)


def get_array_module(*args):
    return sys.modules[__name__]


# ---------------------------------------------------------------------------
# cupy.cuda


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def getDeviceProperties(i):
        return {"name": b"cuda_emu (CPU emulation)", "major": 9, "minor": 0, "multiProcessorCount": 1}

    @staticmethod
    def deviceSynchronize():
        pass


class _Device:
    def __init__(self, i=0):
        self.id = i

    def synchronize(self):
        pass

    def use(self):
        pass


class _Event:
    """Wall-clock stand-in for cupy.cuda.Event (kernels run synchronously here)."""

    def __init__(self, *a, **k):
        self.t = None

    def record(self, stream=None):
        import time

        self.t = time.perf_counter()

    def synchronize(self):
        pass


class _Stream:
    """Kernels run synchronously here: streams only need to exist."""
    ptr = 0

    def __init__(self, null=False, non_blocking=False, ptds=False):
        pass

    def use(self):
        return self

    def synchronize(self):
        pass


class _Cuda:
    runtime = _Runtime()
    Device = _Device
    Event = _Event
    Stream = _Stream

    @staticmethod
    def get_cuda_path():
        return None

    @staticmethod
    def get_elapsed_time(start, end):
        return (end.t - start.t) * 1e3  # ms, like cupy

    @staticmethod
    def get_current_stream():
        return _Stream()


_Runtime.memcpyAsync = staticmethod(lambda dst, src, size, kind, stream: ctypes.memmove(dst, src, size))
_Runtime.runtimeGetVersion = staticmethod(lambda: 0)
_Runtime.driverGetVersion = staticmethod(lambda: 0)
cuda = _Cuda()


class _RandomState:
    def __init__(self, seed=None):
        self._g = _np.random.default_rng(seed)

    def standard_normal(self, size=None, dtype=float):
        return self._g.standard_normal(size, dtype=dtype).view(ndarray)

    def randint(self, low, high=None, size=None, dtype=int):
        return _np.asarray(self._g.integers(low, high, size=size)).astype(dtype).view(ndarray)


class _Random:
    RandomState = _RandomState


random = _Random()


class _Pool:
    def free_all_blocks(self):
        pass


def get_default_memory_pool():
    return _Pool()


def from_dlpack(x):
    return _np.from_dlpack(x).view(ndarray)


def _install_cupyx():
    # the engine uses cupyx.scatter_add for embedding gradients
    import types

    mod = types.ModuleType("cupyx")
    mod.scatter_add = lambda a, slices, value: _np.add.at(a, slices, value)
    mod.empty_pinned = lambda shape, dtype=float, order="C": _np.empty(shape, dtype=dtype, order=order)
    sys.modules.setdefault("cupyx", mod)


_install_cupyx()


# ---------------------------------------------------------------------------
# RawModule on g++


_CTYPES = {"int": (ctypes.c_int32, _np.int32), "long long": (ctypes.c_int64, _np.int64),
           "float": (ctypes.c_float, _np.float32), "double": (ctypes.c_double, _np.float64),
           "unsigned long long": (ctypes.c_uint64, _np.uint64)}
_POINTEE = {"float": ("float32",), "double": ("float64",), "unsigned short": ("uint16", "float16"),
            "long long": ("int64",), "unsigned char": ("uint8", "bool"), "int": ("int32",)}
_build_lock = threading.Lock()
_mutation_applied = []


def _report_mutation():
    if os.environ.get("CUDA_EMU_MUTATE") and not _mutation_applied:
        print("cuda_emu: planted mutation not found in any compiled source", file=sys.stderr)
        print("cuda_emu: planted mutation not found in any compiled source")


atexit.register(_report_mutation)


def _parse_params(params):
    out = []
    for p in [p.strip() for p in params.split(",") if p.strip()]:
        ptr = "*" in p
        words = [w for w in re.split(r"[\s*]+", p) if w and w not in ("const", "__restrict__", "__restrict")]
        base = " ".join(words[:-1])  # the last word is the parameter name
        out.append((ptr, base, words[-1]))
    return out


class CompileException(Exception):
    pass


class RawModule:
    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", name_expressions=None, **kw):
        if code is None:
            with open(path) as f:
                code = f.read()
        mut = os.environ.get("CUDA_EMU_MUTATE")  # "old=>new": a planted bug for the tests' teeth check
        if mut:
            old, new = mut.split("=>", 1)
            if old in code:
                code = code.replace(old, new)
                _mutation_applied.append(old)
        self.code = code
        self.options = tuple(options)
        self._lib = None
        self._sigs = None

    def _build(self):
        header = _HERE_HEADER or os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu.h")
        sanitize = os.environ.get("CUDA_EMU_SANITIZE") == "1"
        with open(header) as f:
            key = hashlib.sha256((self.code + f.read() + str(sanitize)).encode()).hexdigest()[:20]
        root = os.path.join(tempfile.gettempdir(), f"ringpipe_cuda_emu_{os.getuid()}")
        stub = os.path.join(root, "stub_include")
        os.makedirs(stub, exist_ok=True)
        for h in ("mma.h", "cuda_fp16.h", "cuda_bf16.h", "cuda_runtime.h"):
            hp = os.path.join(stub, h)
            if not os.path.exists(hp):
                with open(hp, "w") as f:
                    f.write("#pragma once\n")
        src = os.path.join(root, f"{key}.cu")
        lib = os.path.join(root, f"{key}.so")
        with _build_lock:
            if not os.path.exists(src):
                with open(src, "w") as f:
                    f.write(self.code)
            # kernel names and parameter lists, from the preprocessed source
            pre = subprocess.run(
                ["g++", "-std=c++17", "-E", "-P", "-x", "c++", "-I", stub, "-D__launch_bounds__(...)=", src],
                capture_output=True, text=True)
            if pre.returncode:
                raise CompileException(pre.stderr[-4000:])
            sigs = {}
            for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', pre.stdout):
                sigs[m.group(1)] = _parse_params(m.group(2))
            if not os.path.exists(lib):
                reg = os.path.join(root, f"{key}_emu.cpp")
                with open(reg, "w") as f:
                    f.write(f'#include "{src}"\n#include <map>\n#include <string>\n')
                    f.write("static std::map<std::string, std::function<void(void**)>>& emu_registry() {\n"
                            "  static std::map<std::string, std::function<void(void**)>> r = {\n")
                    for name in sigs:
                        f.write(f'    {{"{name}", emu_caller({name})}},\n')
                    f.write("  };\n  return r;\n}\n")
                    f.write('extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,\n'
                            "    unsigned bx, unsigned by, unsigned bz, void** argv) {\n"
                            "  auto it = emu_registry().find(name);\n"
                            "  if (it == emu_registry().end()) return 2;\n"
                            "  return emu_launch_impl(it->second, gx, gy, gz, bx, by, bz, argv);\n}\n")
                flags = ["-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-pthread", "-w"]
                if sanitize:
                    flags += ["-fsanitize=address,alignment,bounds", "-fno-sanitize-recover=all",
                              "-fno-omit-frame-pointer"]
                tmp = lib + f".{os.getpid()}.tmp"
                r = subprocess.run(["g++", *flags, "-include", header, "-I", stub, reg, "-o", tmp],
                                   capture_output=True, text=True)
                if r.returncode:
                    raise CompileException(r.stderr[-6000:])
                os.replace(tmp, lib)
        self._lib = ctypes.CDLL(lib)
        self._lib.emu_launch.restype = ctypes.c_int
        self._lib.emu_launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [ctypes.c_void_p]
        self._sigs = sigs

    def get_function(self, name):
        if self._lib is None:
            self._build()
        if name not in self._sigs:
            raise RuntimeError(f"cuda_emu: no kernel named {name!r} (have {sorted(self._sigs)})")
        return _Kernel(self._lib, name, self._sigs[name])

    def compile(self, log_stream=None):
        if self._lib is None:
            self._build()


class _Kernel:
    def __init__(self, lib, name, params):
        self.lib, self.name, self.params = lib, name, params

    def __call__(self, grid, block, args, shared_mem=0, stream=None, enable_cooperative_groups=False):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        keep, ptrs = [], []
        for (is_ptr, base, pname), a in zip(self.params, args):
            where = f"{self.name}({pname})"
            if is_ptr:
                if isinstance(a, _np.ndarray):
                    if a.dtype.name not in _POINTEE.get(base, ()):
                        raise TypeError(f"{where}: {base}* parameter got a {a.dtype} array")
                    if not a.flags.c_contiguous:
                        raise TypeError(f"{where}: non-contiguous array passed as a pointer")
                    v = ctypes.c_void_p(a.__array_interface__["data"][0])
                elif isinstance(a, _np.uint64) and int(a) == 0:
                    v = ctypes.c_void_p(0)
                else:
                    raise TypeError(f"{where}: pointer parameter got {type(a).__name__} {a!r}")
            else:
                ct, nt = _CTYPES[base]
                if type(a) is not nt:
                    raise TypeError(f"{where}: '{base}' parameter needs a {nt.__name__} scalar, got {type(a).__name__}")
                v = ct(a.item())
            keep.append(v)
            ptrs.append(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p))
        argv = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        rc = self.lib.emu_launch(self.name.encode(), *[int(g) for g in grid], *[int(b) for b in block], argv)
        if rc:
            raise RuntimeError(f"cuda_emu: launch of {self.name} failed (rc {rc}, grid {grid}, block {block})")


class RawKernel:
    def __init__(self, code, name, options=(), **kw):
        self._mod = RawModule(code=code, options=options)
        self._name = name

    def __call__(self, grid, block, args, **kw):
        return self._mod.get_function(self._name)(grid, block, args, **kw)
