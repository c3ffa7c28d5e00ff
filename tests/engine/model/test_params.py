"""ParamBuffer's memory: ranges given back to the OS (ZeRO-2/3) and masks built on demand."""
import numpy as np

from ringpipe.engine.model.optim import AdamW
from ringpipe.engine.model.params import ParamBuffer, ParamSpec


def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


def test_release_zeroes_the_range_and_returns_its_pages():
    params = ParamBuffer([ParamSpec("w", (4_000, 1_000)), ParamSpec("b", (4_000,), decay=False)])
    params.data[:] = 1.0
    held = resident_mib()
    params.release(params.data, 3, params.size - 5)         # not page aligned at either end
    assert resident_mib() < held - 10                        # 16 MB written, nearly all of it back
    assert params.data[:3].tolist() == [1.0] * 3 and params.data[-5:].tolist() == [1.0] * 5
    assert not np.any(params.data[3:-5])
    params.view("w")[0, 0] = 2.0                             # views stay valid: pages come back on write
    assert params.data[0] == 2.0
    params.release(params.grad, 10, 10)                      # empty: nothing happens


def test_release_of_an_array_without_pages_of_its_own_only_zeroes():
    params = ParamBuffer([ParamSpec("w", (10,))])
    other = np.ones(10, dtype=np.float32)
    params.release(other, 2, 8)
    assert other.tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 1, 1]


def test_decay_mask_of_chunks_matches_the_whole_mask():
    params = ParamBuffer([ParamSpec("a.w", (3, 4)), ParamSpec("a.b", (3,), decay=False), ParamSpec("c.w", (5,))])
    whole = params.decay_mask()
    assert whole.tolist() == [1] * 12 + [0] * 3 + [1] * 5
    chunks = [(10, 14), (0, 2), (18, 20)]
    assert params.decay_mask(chunks).tolist() == np.concatenate([whole[a:b] for a, b in chunks]).tolist()


def test_an_optimizer_step_over_chunks_is_the_step_over_them_packed():
    rng = np.random.default_rng(0)
    n, chunks = 50, [(30, 41), (0, 7), (44, 50)]
    param, grad = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    mask = (np.arange(n) % 3 > 0).astype(np.uint8)
    size = sum(b - a for a, b in chunks)
    packed_mask = np.concatenate([mask[a:b] for a, b in chunks])
    by_chunks, packed = AdamW(size, np.float32, np, packed_mask), AdamW(size, np.float32, np, packed_mask)
    p1 = param.copy()
    p2 = np.concatenate([param[a:b] for a, b in chunks])
    g2 = np.concatenate([grad[a:b] for a, b in chunks])
    for _ in range(3):
        by_chunks.step(p1, grad, 1e-2, chunks=chunks)
        packed.step(p2, g2, 1e-2)
    assert np.array_equal(np.concatenate([p1[a:b] for a, b in chunks]), p2)
    assert np.array_equal(by_chunks.m, packed.m) and np.array_equal(by_chunks.v, packed.v)
    untouched = np.ones(n, dtype=bool)
    for a, b in chunks:
        untouched[a:b] = False
    assert np.array_equal(p1[untouched], param[untouched])
