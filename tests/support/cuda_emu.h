// CPU emulation of the slice of CUDA C++ that kernels/cuda/*.cu use, so those
// kernels can be run and checked against the numpy references on a machine with no
// GPU (tests/fake_cupy.py compiles them with g++ -include cuda_emu.h).
//
// Model: a launch runs its blocks one after another. Within a block every CUDA
// thread is a fiber (ucontext) on one OS thread: a thread runs until it reaches a
// barrier; __syncthreads is released once every live thread of the block has
// reached it, __syncwarp and each shuffle step once every live lane of the warp
// has. Between barriers threads run in a shuffled order that changes per block, so
// a missing barrier (reading what another thread has not written yet) shows up as
// wrong results; a barrier that some threads never reach is reported as a deadlock
// (the launch fails). __shared__ variables become function statics: one copy,
// reused block after block (not zeroed in between, as on a GPU).
// WMMA is emulated at the API level: a fragment holds the whole 16x16 tile in every
// lane; load/mma/store compute exactly what the API promises (float accumulation),
// and check WMMA's pointer alignment (256-bit) and ldm rules.
// Compile with -fsanitize=address,alignment to catch out-of-bounds accesses and
// misaligned float4/uint4 accesses (the vector types carry their CUDA alignment).
//
// Not emulated: performance, memory coalescing, bank conflicts, the real fragment
// layout, true simultaneity (a race that needs two threads between the same pair of
// barriers to interleave finely is not seen), atomics, streams.

#pragma once
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>
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
// threads as fibers: all CUDA threads of a block run on one OS thread as ucontext
// fibers; a barrier switches back to the scheduler, which releases the barrier once
// every live thread (or warp lane) has reached it. Cheap switches, no OS scheduling
// storms, and a barrier that not all threads reach is reported as a deadlock.

enum EmuState { EMU_RUNNABLE = 0, EMU_AT_BLOCK_BARRIER = 1, EMU_AT_WARP_BARRIER = 2, EMU_DONE = 3 };

struct EmuFiber {
    ucontext_t ctx;
    char* stack = nullptr;
    int tid = 0;
    int state = EMU_DONE;
};

inline uint3_ threadIdx;
inline uint3_ blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
inline int emu_linear_tid = 0;
inline ucontext_t emu_sched_ctx;
inline EmuFiber* emu_cur = nullptr;
inline const std::function<void(void**)>* emu_fn = nullptr;
inline void** emu_argv = nullptr;
inline unsigned long long emu_slot[32][32];  // [warp][lane] shuffle mailboxes

inline void emu_block_on(int state) {
    emu_cur->state = state;
    swapcontext(&emu_cur->ctx, &emu_sched_ctx);
}

inline void __syncthreads() { emu_block_on(EMU_AT_BLOCK_BARRIER); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_block_on(EMU_AT_WARP_BARRIER); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    const int warp = emu_linear_tid / 32, lane = emu_linear_tid % 32;
    std::memcpy(&emu_slot[warp][lane], &v, sizeof(T));
    emu_block_on(EMU_AT_WARP_BARRIER);
    T r;
    std::memcpy(&r, &emu_slot[warp][lane ^ lane_mask], sizeof(T));
    emu_block_on(EMU_AT_WARP_BARRIER);  // nobody overwrites a mailbox before everyone has read
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

inline void emu_fiber_entry() {
    (*emu_fn)(emu_argv);
    emu_cur->state = EMU_DONE;  // uc_link returns to the scheduler
}

inline void emu_set_thread(const EmuFiber& f) {
    const unsigned t = (unsigned)f.tid;
    emu_linear_tid = f.tid;
    threadIdx = uint3_{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
}

inline int emu_launch_impl(const std::function<void(void**)>& fn, unsigned gx, unsigned gy, unsigned gz,
                           unsigned bx, unsigned by, unsigned bz, void** argv) {
    const int nthreads = (int)(bx * by * bz);
    if (nthreads <= 0 || nthreads > 1024) return 1;
    const std::size_t stack_size = 256 * 1024;
    std::vector<EmuFiber> fibers(nthreads);
    for (int t = 0; t < nthreads; ++t) {
        fibers[t].tid = t;
        fibers[t].stack = static_cast<char*>(std::malloc(stack_size));
    }
    emu_fn = &fn;
    emu_argv = argv;
    blockDim = dim3{bx, by, bz};
    gridDim = dim3{gx, gy, gz};
    std::vector<int> order(nthreads);
    unsigned long long lcg = 0x9E3779B97F4A7C15ULL;
    int rc = 0;
    const long long nblocks = (long long)gx * gy * gz;
    for (long long b = 0; b < nblocks && rc == 0; ++b) {
        blockIdx = uint3_{(unsigned)(b % gx), (unsigned)((b / gx) % gy), (unsigned)(b / ((long long)gx * gy))};
        for (auto& f : fibers) {
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = f.stack;
            f.ctx.uc_stack.ss_size = stack_size;
            f.ctx.uc_link = &emu_sched_ctx;
            makecontext(&f.ctx, emu_fiber_entry, 0);
            f.state = EMU_RUNNABLE;
        }
        // threads run between barriers in a shuffled order that changes per block, so
        // a missing barrier (one thread reading what another has not yet written) shows
        for (int t = 0; t < nthreads; ++t) order[t] = t;
        for (int t = nthreads - 1; t > 0; --t) {
            lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
            std::swap(order[t], order[(int)((lcg >> 33) % (unsigned long long)(t + 1))]);
        }
        for (;;) {
            for (int i : order) {
                EmuFiber& f = fibers[i];
                if (f.state != EMU_RUNNABLE) continue;
                emu_cur = &f;
                emu_set_thread(f);
                swapcontext(&emu_sched_ctx, &f.ctx);
            }
            int live = 0, at_block = 0;
            bool released = false;
            for (int w = 0; w * 32 < nthreads; ++w) {
                int lanes_live = 0, lanes_at = 0;
                for (int t = w * 32; t < nthreads && t < w * 32 + 32; ++t) {
                    if (fibers[t].state != EMU_DONE) ++lanes_live;
                    if (fibers[t].state == EMU_AT_WARP_BARRIER) ++lanes_at;
                }
                if (lanes_at > 0 && lanes_at == lanes_live) {
                    for (int t = w * 32; t < nthreads && t < w * 32 + 32; ++t) fibers[t].state = EMU_RUNNABLE;
                    released = true;
                }
            }
            for (auto& f : fibers) {
                if (f.state != EMU_DONE) ++live;
                if (f.state == EMU_AT_BLOCK_BARRIER) ++at_block;
            }
            if (live == 0) break;
            if (released) continue;
            if (at_block == live) {
                for (auto& f : fibers)
                    if (f.state == EMU_AT_BLOCK_BARRIER) f.state = EMU_RUNNABLE;
                continue;
            }
            std::fprintf(stderr, "cuda_emu: deadlock in block (%u,%u,%u): %d live threads, %d at __syncthreads, "
                         "the rest at a warp barrier that not all live lanes reach\n",
                         blockIdx.x, blockIdx.y, blockIdx.z, live, at_block);
            rc = 3;
            break;
        }
    }
    for (auto& f : fibers) std::free(f.stack);
    return rc;
}
