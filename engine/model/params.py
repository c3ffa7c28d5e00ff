"""All parameters in one flat buffer, all gradients in another, with named views.

One buffer means the ring all-reduce, gradient clipping, checkpointing and the
optimizer are each a single call over contiguous memory (llm.c's layout).

Initialization is seeded per parameter *name*, not by position in the buffer,
so a pipeline stage that holds only some layers gets exactly the weights the
single-process model would have: parallelism never changes the math. A normal
init is drawn per block of INIT_BLOCK elements of the full parameter (unsplit,
flattened row-major), block b from the stream (seed, crc32(name), b), so any
element is drawn without the others: a rank that keeps a slice draws the blocks
its slice meets and nothing else, and gets the one-process values. A
tensor-parallel rank holds a *part* of the parameters the tensor axis splits
(ParamSpec.split) and draws that part; a ZeRO-3 rank draws only its chunks of
the buffer (init's ranges), so no rank ever holds the whole model at start-up.
Checkpoints and imports hand a split parameter whole by name; the rank slices it.
"""
from __future__ import annotations

import mmap
import zlib
from dataclasses import dataclass

import numpy as np

from ringpipe.engine.job.array_module import to_host


@dataclass(frozen=True)
class Split:
    """Which part of a full parameter a tensor-parallel rank holds: along `dim`,
    the full parameter is `groups` equal blocks (qkv's q, k and v: 3), each
    cut into `count` equal slices; this rank holds slice `index` of every
    block, in block order. groups=1 is one contiguous slice.

    pad: zero rows along dim that exist in memory only, so that a full length
    `count` does not divide still splits evenly (the vocabulary-parallel wte:
    the last ranks hold them). The full parameter (its full_shape, what
    checkpoints and imports hold) is without them, the same for every count."""
    dim: int
    index: int
    count: int
    groups: int = 1
    pad: int = 0

    def __post_init__(self):
        if self.pad and self.groups != 1:
            raise ValueError("a split with padding rows is one contiguous slice (groups=1)")

    def full_shape(self, shape) -> tuple:
        return tuple(n * self.count - self.pad if d == self.dim else n for d, n in enumerate(shape))

    def blocks(self, full_len):
        """(lo, hi) along dim of this rank's slice of each block, in the padded array."""
        block = (full_len + self.pad) // self.groups
        part = block // self.count
        return [(g * block + self.index * part, g * block + (self.index + 1) * part) for g in range(self.groups)]

    def take(self, full):
        """This rank's part of the full array (a copy; padding rows are zeros)."""
        if self.pad:
            shape = list(full.shape)
            shape[self.dim] = self.pad
            full = np.concatenate([full, np.zeros(shape, dtype=full.dtype)], axis=self.dim)
        blocks = self.blocks(full.shape[self.dim] - self.pad)
        pieces = [np.take(full, np.arange(lo, hi), axis=self.dim) for lo, hi in blocks]
        return np.concatenate(pieces, axis=self.dim)

    def place(self, full, part) -> None:
        """Write this rank's part into the full array (its padding rows are left out)."""
        width = part.shape[self.dim] // self.groups
        length = full.shape[self.dim]
        for g, (lo, hi) in enumerate(self.blocks(length)):
            hi = min(hi, length)
            if hi <= lo:
                continue
            index = [slice(None)] * full.ndim
            index[self.dim] = slice(lo, hi)
            block = [slice(None)] * full.ndim
            block[self.dim] = slice(g * width, g * width + hi - lo)
            full[tuple(index)] = part[tuple(block)]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple              # what this rank holds (its part's shape, when the tensor axis splits it)
    init: str = "normal"      # "normal", "zeros" or "ones"
    std: float = 0.02
    decay: bool = True        # AdamW weight decay applies (matrices yes, biases/norms no)
    split: Split | None = None    # tensor parallelism: how the axis divides the parameter
    partial: bool = False     # each tensor-parallel rank holds part of the gradient (sequence
                              # parallelism): summed over the tensor axis once final

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def full_shape(self) -> tuple:
        return self.split.full_shape(self.shape) if self.split else tuple(self.shape)


def dedup_specs(specs):
    """Keep the first spec of each name; a repeated name is a tied parameter
    (the GPT's output head reuses the token embedding)."""
    seen = {}
    for spec in specs:
        if spec.name in seen:
            if seen[spec.name].shape != spec.shape:
                raise ValueError(f"tied parameter {spec.name!r} declared with shapes "
                                 f"{seen[spec.name].shape} and {spec.shape}")
            continue
        seen[spec.name] = spec
    return list(seen.values())


# Elements of a full parameter drawn from one random stream. Fixed: it is part of what
# the values are (a checkpoint-free run of any layout must reproduce them).
INIT_BLOCK = 2**16


def _runs(spec, lo, hi):
    """Elements [lo, hi) of the part this rank holds (flat, row-major) as runs that are
    contiguous in the part and in the full parameter: (part index, full index, length),
    increasing in both. Padding (beyond the full length) is in no run: it stays zero."""
    split = spec.split
    if split is None:
        yield lo, lo, hi - lo
        return
    # A split is along rows (dim 0) or columns (dim 1); more dimensions would need a general map.
    assert len(spec.shape) in (1, 2) and split.dim < len(spec.shape), (spec.name, spec.shape, split)
    cols = spec.shape[1] if len(spec.shape) == 2 else 1
    full_cols = spec.full_shape[1] if len(spec.shape) == 2 else 1
    full_len = spec.full_shape[split.dim]
    slices = split.blocks(full_len)            # each group's (start, end) along dim, padding included
    width = slices[0][1] - slices[0][0]         # the part's length along dim in each group

    def clipped(at, full_at, n):
        a, b = max(at, lo), min(at + n, hi)
        return (a, full_at + a - at, b - a) if a < b else None

    if split.dim == 0:        # each group's rows: one run of whole rows
        candidates = ((g * width * cols, start * cols, max(0, min(end, full_len) - start) * cols)
                      for g, (start, end) in enumerate(slices))
    else:                     # each row's columns of each group: a run per (row, group)
        candidates = ((i * cols + g * width, i * full_cols + start, max(0, min(end, full_len) - start))
                      for i in range(lo // cols, (hi - 1) // cols + 1) for g, (start, end) in enumerate(slices))
    for run in candidates:
        run = clipped(*run)
        if run:
            yield run


class _NormalInit:
    """One parameter's normal init, drawn block by block of the full parameter: block b is
    default_rng([seed, crc32(name), b]).normal(0, std, its length). Keeps the last block
    drawn, so pieces asked in increasing order draw each block once."""

    def __init__(self, seed, spec):
        self.key = [seed, zlib.crc32(spec.name.encode())]
        self.spec = spec
        self.full_size = int(np.prod(spec.full_shape))
        self.index, self.values = None, None

    def _block(self, b):
        if b != self.index:
            n = min(INIT_BLOCK, self.full_size - b * INIT_BLOCK)
            self.values = np.random.default_rng([*self.key, b]).normal(0.0, self.spec.std, size=n)
            self.index = b
        return self.values

    def part(self, lo, hi):
        """Elements [lo, hi) of this rank's part, float64 (padding: zeros)."""
        out = np.zeros(hi - lo)
        for at, full_at, n in _runs(self.spec, lo, hi):
            while n:
                b, offset = divmod(full_at, INIT_BLOCK)
                take = min(n, INIT_BLOCK - offset)
                out[at - lo:at - lo + take] = self._block(b)[offset:offset + take]
                at, full_at, n = at + take, full_at + take, n - take
        return out


_PAGE = mmap.PAGESIZE


def _zeros(size, dtype, xp):
    """A zeroed flat array. On the host, an anonymous memory map of its own, so that
    ranges of it can be given back to the OS (ParamBuffer.release) while the rest
    stays in place: a sharded optimizer (ZeRO-2/3) keeps views into one flat buffer
    yet holds in memory only what it uses. Pages are only backed once written."""
    if xp is not np or size == 0:
        return xp.zeros(size, dtype=dtype)
    pages = mmap.mmap(-1, size * np.dtype(dtype).itemsize, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(pages, dtype=dtype, count=size)


class ParamBuffer:
    """Flat `data` and `grad` arrays plus per-name views, laid out in forward order."""

    def __init__(self, specs, dtype=np.float32, xp=np):
        self.specs = dedup_specs(specs)
        self.dtype = np.dtype(dtype)
        self.xp = xp
        self.offsets = {}
        offset = 0
        for spec in self.specs:
            self.offsets[spec.name] = (offset, offset + spec.size)
            offset += spec.size
        self.size = offset
        self.data = _zeros(self.size, self.dtype, xp)
        self.grad = _zeros(self.size, self.dtype, xp)
        self._spec_by_name = {s.name: s for s in self.specs}

    # ---- views -----------------------------------------------------------------
    def names(self):
        return [s.name for s in self.specs]

    def __contains__(self, name):
        return name in self.offsets

    def view(self, name):
        lo, hi = self.offsets[name]
        return self.data[lo:hi].reshape(self._spec_by_name[name].shape)

    def grad_view(self, name):
        lo, hi = self.offsets[name]
        return self.grad[lo:hi].reshape(self._spec_by_name[name].shape)

    def ranges(self):
        """(lo, hi) of each parameter in forward order: what gradient buckets group."""
        return [self.offsets[s.name] for s in self.specs]

    def decay_mask(self, ranges=None):
        """The weight-decay mask of the (lo, hi) ranges (default: everything), one after
        another: 1 where AdamW decays (matrices), 0 elsewhere. Built when asked (once, by
        the optimizer), so a rank that updates a part of the buffer never holds it all."""
        parts = []
        for lo, hi in ranges if ranges is not None else [(0, self.size)]:
            mask = np.zeros(hi - lo, dtype=np.uint8)
            for spec in self.specs:
                a, b = self.offsets[spec.name]
                if spec.decay and max(a, lo) < min(b, hi):
                    mask[max(a, lo) - lo:min(b, hi) - lo] = 1
            parts.append(mask)
        return self.xp.asarray(np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8))

    def index_of(self, name):
        return self.names().index(name)

    # ---- state -----------------------------------------------------------------
    def init(self, seed: int, ranges=None):
        """Deterministic init from (seed, parameter name), the same values in every layout.
        ranges: the (lo, hi) of this buffer to fill (default: all of it). The rest is not
        written at all, so that a ZeRO-3 rank's pages beyond its chunks are never backed."""
        wanted = sorted(ranges) if ranges is not None else [(0, self.size)]
        for spec in self.specs:
            if spec.init not in ("zeros", "ones", "normal"):
                raise ValueError(f"unknown init {spec.init!r} for {spec.name}")
            start, end = self.offsets[spec.name]
            pieces = [(max(a, start) - start, min(b, end) - start) for a, b in wanted if max(a, start) < min(b, end)]
            if not pieces:
                continue
            flat = self.data[start:end]
            draw = _NormalInit(seed, spec) if spec.init == "normal" else None
            for a, b in pieces:
                if draw is None:
                    flat[a:b] = 1.0 if spec.init == "ones" else 0.0
                    continue
                # A block of the part at a time: float64 never held for more than that.
                for lo in range(a, b, INIT_BLOCK):
                    hi = min(lo + INIT_BLOCK, b)
                    flat[lo:hi] = self.xp.asarray(draw.part(lo, hi), dtype=self.dtype)

    def zero_grad(self):
        self.grad.fill(0)

    def release(self, flat, lo, hi):
        """Set flat[lo:hi] (flat: self.data or self.grad) to zeros and give the memory
        of its whole pages back to the OS: they read as zeros and take memory again
        only when written. A device array, or one without pages of its own, is only
        zeroed (the device allocator keeps the memory)."""
        if hi <= lo:
            return
        pages = getattr(flat.base, "obj", None) if isinstance(flat, np.ndarray) else None   # _zeros' map
        if not isinstance(pages, mmap.mmap):
            flat[lo:hi] = 0
            return
        item = flat.itemsize
        first = -(-lo * item // _PAGE) * _PAGE          # the whole pages inside [lo, hi)
        last = hi * item // _PAGE * _PAGE
        if last <= first:
            flat[lo:hi] = 0
            return
        flat[lo:first // item] = 0
        flat[last // item:hi] = 0
        pages.madvise(mmap.MADV_DONTNEED, first, last - first)

    def state_dict(self, flat, copy=True):
        """Split a flat array laid out like `data` into {name: array}: host copies, or with
        copy=False views of a host `flat` the caller will not change while they are used."""
        out = {}
        for spec in self.specs:
            lo, hi = self.offsets[spec.name]
            part = np.asarray(to_host(flat[lo:hi])).reshape(spec.shape)
            out[spec.name] = part.copy() if copy else part
        return out

    def load_flat(self, flat, named, what="parameters"):
        """Fill a flat array from {name: array}, checking names and shapes. A split
        parameter may come whole (a checkpoint, an import): this rank takes its part."""
        missing = [n for n in self.names() if n not in named]
        if missing:
            raise ValueError(f"checkpoint {what} lack {missing[:5]}{'...' if len(missing) > 5 else ''}: "
                             "was it written by a model with another configuration?")
        for spec in self.specs:
            arr = named[spec.name]
            if spec.split and tuple(arr.shape) == spec.full_shape:
                arr = spec.split.take(np.asarray(to_host(arr)))
            if tuple(arr.shape) != tuple(spec.shape):
                raise ValueError(f"checkpoint {what} {spec.name!r} has shape {tuple(arr.shape)}, "
                                 f"the model expects {spec.full_shape}")
            lo, hi = self.offsets[spec.name]
            flat[lo:hi] = self.xp.asarray(arr.reshape(-1), dtype=self.dtype)
