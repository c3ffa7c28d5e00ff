// Tensor-core GEMM (bf16 or fp16 inputs, float32 accumulation and output) through
// the WMMA API, plus float32 <-> bf16/fp16 conversions. Loaded by
// kernels/cuda/cupy_kernels.py through cupy.RawModule (NVRTC; CuPy has no bfloat16
// dtype, so bf16 matrices travel as uint16 arrays); compile-checked with nvcc for
// sm_80 and sm_90 by tests/test_cuda_kernels.py.
//
//   C[z] (float32) = alpha * op(A[z]) @ op(B[z]) + beta * C[z]     (beta = 0: C not read)
//
// Row-major; "n"/"t" as in sgemm.cu: A stored (M, K) or (K, M), B stored (K, N) or
// (N, K). A transposed operand needs no transpose pass: its shared tile is simply
// handed to WMMA as a col_major fragment.
//
// Block tile 128x128, K-step 32, 8 warps as 2 (M) x 4 (N), each warp a 64x32 tile =
// 4x2 WMMA 16x16x16 fragments (8 float accumulators fragments per warp).
// Global -> shared moves 16 bytes (8 elements) per load where the contiguous dim
// allows (vec_* flags from the host), zero-filling outside the matrix, so any M, N,
// K works; the float32 epilogue goes through a per-warp 16x16 staging tile so edge
// stores can be guarded.
//
// What this is not: WMMA on Hopper compiles to mma.sync (the Ampere-style warp MMA);
// cuBLAS on an H100/H200 uses wgmma + TMA with deep asynchronous pipelines, so expect
// this kernel well below cuBLAS there. Next steps, not done: cp.async multi-stage
// pipelining (global loads overlapped with MMA), ldmatrix-friendly swizzled shared
// layouts instead of padding, larger warp tiles, then wgmma/TMA for sm_90.

#include <mma.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

using namespace nvcuda;

#define WG_BM 128
#define WG_BN 128
#define WG_BK 32
#define WG_THREADS 256
#define WG_WM 64
#define WG_WN 32
// 8 bf16 of padding per shared row: keeps rows 16-byte aligned for the vector
// copies and WMMA's ldm a multiple of 8, and staggers rows across banks
#define WG_PAD 8
#define WG_LDK (WG_BK + WG_PAD)  // rows that run along k (A "n", B "t")
#define WG_LDM (WG_BM + WG_PAD)  // rows that run along m (A "t")
#define WG_LDN (WG_BN + WG_PAD)  // rows that run along n (B "n")
#define WG_TILE_ELEMS (WG_BM * WG_LDK > WG_BK * WG_LDM ? WG_BM * WG_LDK : WG_BK * WG_LDM)

template <bool C, class X, class Y> struct wg_cond { typedef X type; };
template <class X, class Y> struct wg_cond<false, X, Y> { typedef Y type; };

// Copy a ROWS x COLS tile, columns contiguous in global memory, from element (r0, c0)
// of an nr x nc matrix (leading dim ld) into shared memory (leading dim lds); zeros
// outside the matrix. 16-bit words are copied as raw bits: no conversions.
template <int ROWS, int COLS>
__device__ __forceinline__ void wg_load_tile(unsigned short* __restrict__ s, int lds,
                                             const unsigned short* __restrict__ g, long long ld, int r0, int c0,
                                             int nr, int nc, bool vec) {
    const int chunks_per_row = COLS / 8;
    for (int idx = threadIdx.x; idx < ROWS * chunks_per_row; idx += WG_THREADS) {
        const int r = idx / chunks_per_row, c = (idx % chunks_per_row) * 8;
        const int gr = r0 + r, gc = c0 + c;
        unsigned short* dst = s + r * lds + c;
        if (vec && gr < nr && gc + 7 < nc) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(g + (long long)gr * ld + gc);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                dst[e] = (gr < nr && gc + e < nc) ? g[(long long)gr * ld + gc + e] : (unsigned short)0;
        }
    }
}

template <typename T, bool TA, bool TB>
__device__ __forceinline__ void wmma_gemm_body(const unsigned short* __restrict__ A,
                                               const unsigned short* __restrict__ B, float* __restrict__ C,
                                               int M, int N, int K, long long sA, long long sB, long long sC,
                                               float alpha, float beta, int vec_a, int vec_b) {
    typedef typename wg_cond<TA, wmma::col_major, wmma::row_major>::type LayoutA;
    typedef typename wg_cond<TB, wmma::col_major, wmma::row_major>::type LayoutB;

    __shared__ __align__(128) unsigned short As[WG_TILE_ELEMS];
    __shared__ __align__(128) unsigned short Bs[WG_TILE_ELEMS];
    __shared__ __align__(128) float Cs[WG_THREADS / 32][16 * 16];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warp_row = warp / (WG_BN / WG_WN), warp_col = warp % (WG_BN / WG_WN);
    const int m0 = blockIdx.y * WG_BM, n0 = blockIdx.x * WG_BN;
    const long long z = blockIdx.z;
    A += z * sA;
    B += z * sB;
    C += z * sC;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[WG_WM / 16][WG_WN / 16];
#pragma unroll
    for (int i = 0; i < WG_WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WG_WN / 16; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    for (int k0 = 0; k0 < K; k0 += WG_BK) {
        if (TA) wg_load_tile<WG_BK, WG_BM>(As, WG_LDM, A, M, k0, m0, K, M, vec_a);  // A (K, M)
        else    wg_load_tile<WG_BM, WG_BK>(As, WG_LDK, A, K, m0, k0, M, K, vec_a);  // A (M, K)
        if (TB) wg_load_tile<WG_BN, WG_BK>(Bs, WG_LDK, B, K, n0, k0, N, K, vec_b);  // B (N, K)
        else    wg_load_tile<WG_BK, WG_BN>(Bs, WG_LDN, B, N, k0, n0, K, N, vec_b);  // B (K, N)
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < WG_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA> fa[WG_WM / 16];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb[WG_WN / 16];
#pragma unroll
            for (int i = 0; i < WG_WM / 16; ++i) {
                const int m = warp_row * WG_WM + i * 16;
                // element (m, k) of op(A): As[m*LDK + k] ("n") or As[k*LDM + m] ("t", col_major)
                const unsigned short* p = TA ? As + kk * WG_LDM + m : As + m * WG_LDK + kk;
                wmma::load_matrix_sync(fa[i], reinterpret_cast<const T*>(p), TA ? WG_LDM : WG_LDK);
            }
#pragma unroll
            for (int j = 0; j < WG_WN / 16; ++j) {
                const int n = warp_col * WG_WN + j * 16;
                // element (k, n) of op(B): Bs[k*LDN + n] ("n") or Bs[n*LDK + k] ("t", col_major)
                const unsigned short* p = TB ? Bs + n * WG_LDK + kk : Bs + kk * WG_LDN + n;
                wmma::load_matrix_sync(fb[j], reinterpret_cast<const T*>(p), TB ? WG_LDK : WG_LDN);
            }
#pragma unroll
            for (int i = 0; i < WG_WM / 16; ++i)
#pragma unroll
                for (int j = 0; j < WG_WN / 16; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();  // before the next K-step overwrites As/Bs
    }

    float* stage = Cs[warp];
#pragma unroll
    for (int i = 0; i < WG_WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WG_WN / 16; ++j) {
            wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            const int mb = m0 + warp_row * WG_WM + i * 16, nb = n0 + warp_col * WG_WN + j * 16;
            for (int e = lane; e < 256; e += 32) {
                const int m = mb + e / 16, n = nb + e % 16;
                if (m < M && n < N) {
                    float v = alpha * stage[e];
                    if (beta != 0.f) v += beta * C[(long long)m * N + n];
                    C[(long long)m * N + n] = v;
                }
            }
            __syncwarp();  // the stage is rewritten by the next fragment
        }
}

#define WG_ARGS                                                                                             \
    const unsigned short *__restrict__ A, const unsigned short *__restrict__ B, float *__restrict__ C, int M, \
        int N, int K, long long sA, long long sB, long long sC, float alpha, float beta, int vec_a, int vec_b
#define WG_PASS A, B, C, M, N, K, sA, sB, sC, alpha, beta, vec_a, vec_b

// grid (ceil(N/128), ceil(M/128), batch), block 256
#define WG_KERNEL(NAME, T, TA, TB) \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) NAME(WG_ARGS) { wmma_gemm_body<T, TA, TB>(WG_PASS); }

WG_KERNEL(wmma_gemm_bf16_nn, __nv_bfloat16, false, false)
WG_KERNEL(wmma_gemm_bf16_nt, __nv_bfloat16, false, true)
WG_KERNEL(wmma_gemm_bf16_tn, __nv_bfloat16, true, false)
WG_KERNEL(wmma_gemm_f16_nn, __half, false, false)
WG_KERNEL(wmma_gemm_f16_nt, __half, false, true)
WG_KERNEL(wmma_gemm_f16_tn, __half, true, false)

// conversions, grid-stride; round to nearest even
extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, unsigned short* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
}

extern "C" __global__ void bf16_to_f32(const unsigned short* __restrict__ x, float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = __bfloat162float(__ushort_as_bfloat16(x[i]));
}
