// CPU emulation of the slice of CUDA C++ that kernels/cuda/*.cu use, so those
// kernels can be run and checked against the numpy references on a machine with no
// GPU (tests/fake_cupy.py compiles them with g++ -include cuda_emu.h).
//
// Model: a launch runs its blocks one after another; within a block every CUDA
// thread is an OS thread, so __syncthreads is a real barrier and a kernel that
// forgets one can race here too. Warp shuffles and __syncwarp use a per-warp barrier
// (all 32 lanes must take part, as the kernels require). __shared__ variables become
// function statics: one copy, reused by block after block (fine: blocks run one at a
// time; stale data from the previous block is not zeroed, like on a GPU).
// WMMA is emulated at the API level: a fragment holds the whole 16x16 tile in every
// lane; load/mma/store compute exactly what the API promises (float accumulation),
// and check WMMA's pointer alignment (256-bit) and ldm rules.
// Compile with -fsanitize=address,alignment to catch out-of-bounds accesses and
// misaligned float4/uint4 accesses (the vector types carry their CUDA alignment).
//
// Not emulated: performance, memory coalescing, the real fragment layout, warp
// divergence (lanes run independently), atomics, streams.

#pragma once
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))

using std::exp;
using std::fmax;
using std::log;
using std::sqrt;
using std::tanh;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct uint3_ {
    unsigned x = 0, y = 0, z = 0;
};

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

// ---------------------------------------------------------------------------
// barriers that tolerate threads leaving early (a CUDA thread that returned no
// longer counts for __syncthreads)

struct EmuBarrier {
    std::mutex mu;
    std::condition_variable cv;
    int expected = 0, arrived = 0;
    long generation = 0;

    void reset(int n) {
        expected = n;
        arrived = 0;
        generation = 0;
    }
    void wait() {
        std::unique_lock<std::mutex> lock(mu);
        const long gen = generation;
        if (++arrived >= expected) {
            arrived = 0;
            ++generation;
            cv.notify_all();
            return;
        }
        cv.wait(lock, [&] { return generation != gen; });
    }
    void leave() {
        std::unique_lock<std::mutex> lock(mu);
        --expected;
        if (arrived > 0 && arrived >= expected) {
            arrived = 0;
            ++generation;
            cv.notify_all();
        }
    }
};

struct EmuWarp {
    EmuBarrier bar;
    unsigned long long slot[32];
};

struct EmuBlockCtx {
    EmuBarrier block;
    std::vector<EmuWarp> warps;
};

inline thread_local uint3_ threadIdx;
inline thread_local uint3_ blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
inline thread_local EmuBlockCtx* emu_ctx = nullptr;
inline thread_local int emu_linear_tid = 0;

inline void __syncthreads() { emu_ctx->block.wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_ctx->warps[emu_linear_tid / 32].bar.wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    EmuWarp& w = emu_ctx->warps[emu_linear_tid / 32];
    const int lane = emu_linear_tid % 32;
    std::memcpy(&w.slot[lane], &v, sizeof(T));
    w.bar.wait();
    T r;
    std::memcpy(&r, &w.slot[lane ^ lane_mask], sizeof(T));
    w.bar.wait();  // nobody overwrites a slot before everyone has read
    return r;
}

inline double __longlong_as_double(unsigned long long v) {
    double d;
    std::memcpy(&d, &v, 8);
    return d;
}
inline double __longlong_as_double(long long v) { return __longlong_as_double((unsigned long long)v); }

// ---------------------------------------------------------------------------
// 16-bit float types

struct __nv_bfloat16 {
    unsigned short x;
};
struct __half {
    unsigned short x;
};

inline float emu_bits_to_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned emu_float_to_bits(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    unsigned u = emu_float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(unsigned short)((u >> 16) | 0x40)};  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return __nv_bfloat16{(unsigned short)(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 h) { return emu_bits_to_float((unsigned)h.x << 16); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }

inline float emu_half_to_float(__half h) {
    _Float16 v;
    std::memcpy(&v, &h.x, 2);
    return (float)v;
}
inline __half __float2half_rn(float f) {
    _Float16 v = (_Float16)f;
    __half h;
    std::memcpy(&h.x, &v, 2);
    return h;
}
inline float __half2float(__half h) { return emu_half_to_float(h); }
inline unsigned short __half_as_ushort(__half h) { return h.x; }

inline float emu_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
inline float emu_to_float(__half v) { return emu_half_to_float(v); }

// ---------------------------------------------------------------------------
// WMMA (16x16x16 only), API-level

namespace nvcuda {
namespace wmma {
struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int m, int n, int k, typename T, typename Layout = void>
struct fragment {
    float v[16 * 16];
};

inline void emu_wmma_check(const void* p, unsigned ldm, unsigned elem_bytes) {
    if (reinterpret_cast<uintptr_t>(p) % 32 != 0) {
        std::fprintf(stderr, "cuda_emu: WMMA pointer %p is not 256-bit aligned\n", p);
        std::abort();
    }
    if ((ldm * elem_bytes) % 16 != 0) {
        std::fprintf(stderr, "cuda_emu: WMMA ldm %u is not a multiple of 16 bytes\n", ldm);
        std::abort();
    }
}

template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
    emu_wmma_check(p, ldm, sizeof(T));
    const bool row = std::is_same<Layout, row_major>::value;
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) f.v[r * 16 + c] = emu_to_float(row ? p[r * ldm + c] : p[c * ldm + r]);
}

template <typename T>
inline void fill_fragment(fragment<accumulator, 16, 16, 16, T>& f, T x) {
    for (int i = 0; i < 256; ++i) f.v[i] = x;
}

template <typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
    float out[256];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            float s = c.v[i * 16 + j];
            for (int k = 0; k < 16; ++k) s += a.v[i * 16 + k] * b.v[k * 16 + j];
            out[i * 16 + j] = s;
        }
    std::memcpy(d.v, out, sizeof(out));
}

// a collective store: lane 0 writes; the caller's __syncwarp orders it before reads
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
    emu_wmma_check(p, ldm, sizeof(float));
    if (emu_linear_tid % 32 != 0) return;
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) {
            if (layout == mem_row_major) p[r * ldm + c] = f.v[r * 16 + c];
            else p[c * ldm + r] = f.v[r * 16 + c];
        }
}
}  // namespace wmma
}  // namespace nvcuda

// ---------------------------------------------------------------------------
// launching: kernels take their arguments the way cuLaunchKernel passes them
// (an array of pointers to the values)

template <typename... A, std::size_t... I>
inline void emu_call(void (*f)(A...), void** argv, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(argv[I])...);
}

template <typename... A>
inline std::function<void(void**)> emu_caller(void (*f)(A...)) {
    return [f](void** argv) { emu_call(f, argv, std::index_sequence_for<A...>{}); };
}

inline int emu_launch_impl(const std::function<void(void**)>& fn, unsigned gx, unsigned gy, unsigned gz,
                           unsigned bx, unsigned by, unsigned bz, void** argv) {
    const int nthreads = (int)(bx * by * bz);
    if (nthreads <= 0 || nthreads > 1024) return 1;
    EmuBlockCtx ctx;
    ctx.warps = std::vector<EmuWarp>((nthreads + 31) / 32);
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                ctx.block.reset(nthreads);
                for (int w = 0; w < (int)ctx.warps.size(); ++w) {
                    const int lanes = nthreads - 32 * w < 32 ? nthreads - 32 * w : 32;
                    ctx.warps[w].bar.reset(lanes);
                }
                std::vector<std::thread> threads;
                threads.reserve(nthreads);
                for (int t = 0; t < nthreads; ++t) {
                    threads.emplace_back([&, t, x, y, z] {
                        emu_ctx = &ctx;
                        emu_linear_tid = t;
                        threadIdx = uint3_{(unsigned)t % bx, ((unsigned)t / bx) % by, (unsigned)t / (bx * by)};
                        blockIdx = uint3_{x, y, z};
                        blockDim = dim3{bx, by, bz};
                        gridDim = dim3{gx, gy, gz};
                        fn(argv);
                        ctx.warps[t / 32].bar.leave();
                        ctx.block.leave();
                    });
                }
                for (auto& th : threads) th.join();
            }
    return 0;
}
