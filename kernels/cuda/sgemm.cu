// float32 GEMM for ringpipe, loaded by kernels/cuda/cupy_kernels.py through
// cupy.RawModule (NVRTC) and compile-checked with nvcc by tests/test_cuda_kernels.py.
// NVRTC has no host headers: only builtins here.
//
//   C[z] = alpha * op(A[z]) @ op(B[z]) + beta * C[z]   (beta = 0: C is not read)
//          then optionally + bias[n], a copy to Cpre (pre-activation), GELU
//
// Everything is row-major. op(A) is M x K: A is stored (M, K) ("n") or (K, M) ("t");
// op(B) is K x N: B is stored (K, N) ("n") or (N, K) ("t"). Batch z = blockIdx.z with
// element strides sA/sB/sC (0 broadcasts an operand over the batch).
//
// The SGEMM ladder rungs implemented (siboehm's worklog numbering, see
// shared/notes/anchors.md): shared-memory tiling, 2D block tiling (a 128x128 block
// tile, 64 outputs per thread), vectorized float4 global loads and float4 shared
// reads, warp tiling (each warp owns a 64x32 sub-tile, each thread 2x2 sub-blocks of
// 4x4 spread across it), and a register prefetch of the next K-tile that overlaps
// its global loads with the current tile's math.
// Not done (honest list of what a tuned kernel adds): multi-stage cp.async / TMA
// pipelines, block swizzling for L2 reuse, split-K for small M*N, autotuning of the
// tile shape per problem. The tile shape was chosen from the worklog, not tuned on
// an H200.
//
// Edges: any M, N, K. Loads outside the matrix read as zero (they add nothing);
// stores are guarded. float4 paths run only where the host says the contiguous
// dimension is a multiple of 4 and the base pointer 16-byte aligned (vec_* flags),
// and then only for 4-element groups fully inside the matrix.

#define SG_BM 128
#define SG_BN 128
#define SG_BK 8
#define SG_THREADS 256
#define SG_WM 64   // warp tile: 8 warps as 2 (M) x 4 (N)
#define SG_WN 32
#define SG_WMITER 2  // each thread: WMITER x WNITER sub-blocks of TM x TN
#define SG_WNITER 2
#define SG_TM 4
#define SG_TN 4
#define SG_WSUBM (SG_WM / SG_WMITER)  // 32 = 8 thread rows * TM
#define SG_WSUBN (SG_WN / SG_WNITER)  // 16 = 4 thread cols * TN
// +4 floats per shared row: keeps float4 alignment and puts the two k-halves that
// one warp's transposed stores hit into different banks
#define SG_PAD 4

#define SG_EPI_BIAS 1
#define SG_EPI_GELU 2

__device__ __forceinline__ float sg_gelu(float x) {
    // tanh approximation, as kernels/reference.py
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(k0 * (x + k1 * x * x * x)));
}

// Elements (row, col..col+3) of a row-major nrows x ncols matrix with leading
// dimension ld; zero outside the matrix.
__device__ __forceinline__ float4 sg_load4(const float* __restrict__ p, int row, int col, int nrows,
                                           int ncols, long long ld, bool vec) {
    float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row < nrows) {
        const float* q = p + (long long)row * ld + col;
        if (vec && col + 3 < ncols) {
            r = *reinterpret_cast<const float4*>(q);
        } else {
            if (col < ncols) r.x = q[0];
            if (col + 1 < ncols) r.y = q[1];
            if (col + 2 < ncols) r.z = q[2];
            if (col + 3 < ncols) r.w = q[3];
        }
    }
    return r;
}

template <bool TA, bool TB>
__device__ __forceinline__ void sgemm_body(const float* __restrict__ A, const float* __restrict__ B,
                                           float* __restrict__ C, int M, int N, int K, long long sA,
                                           long long sB, long long sC, float alpha, float beta,
                                           const float* __restrict__ bias, float* __restrict__ Cpre,
                                           int epilogue, int vec_a, int vec_b, int vec_c) {
    __shared__ __align__(16) float As[SG_BK][SG_BM + SG_PAD];  // op(A) tile, k-major
    __shared__ __align__(16) float Bs[SG_BK][SG_BN + SG_PAD];  // op(B) tile, k-major

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int warp_row = warp / (SG_BN / SG_WN), warp_col = warp % (SG_BN / SG_WN);
    const int trow = lane / (SG_WSUBN / SG_TN), tcol = lane % (SG_WSUBN / SG_TN);
    const int m0 = blockIdx.y * SG_BM, n0 = blockIdx.x * SG_BN;
    const long long z = blockIdx.z;
    A += z * sA;
    B += z * sB;
    C += z * sC;
    if (Cpre) Cpre += z * sC;

    // Each thread moves one float4 of each operand per K-tile (128*8/4 = 256 of them).
    // "n" A (M,K): 2 float4 along k per row; "t" A (K,M): 32 float4 along m per k.
    const int a_r = TA ? tid / (SG_BM / 4) : tid / (SG_BK / 4);
    const int a_c = TA ? (tid % (SG_BM / 4)) * 4 : (tid % (SG_BK / 4)) * 4;
    const int b_r = TB ? tid / (SG_BK / 4) : tid / (SG_BN / 4);
    const int b_c = TB ? (tid % (SG_BK / 4)) * 4 : (tid % (SG_BN / 4)) * 4;
    const long long lda = TA ? M : K, ldb = TB ? K : N;

    float acc[SG_WMITER * SG_TM][SG_WNITER * SG_TN];
#pragma unroll
    for (int i = 0; i < SG_WMITER * SG_TM; ++i)
#pragma unroll
        for (int j = 0; j < SG_WNITER * SG_TN; ++j) acc[i][j] = 0.f;

    auto load_a = [&](int k0) {
        return TA ? sg_load4(A, k0 + a_r, m0 + a_c, K, M, lda, vec_a)
                  : sg_load4(A, m0 + a_r, k0 + a_c, M, K, lda, vec_a);
    };
    auto load_b = [&](int k0) {
        return TB ? sg_load4(B, n0 + b_r, k0 + b_c, N, K, ldb, vec_b)
                  : sg_load4(B, k0 + b_r, n0 + b_c, K, N, ldb, vec_b);
    };

    const int ktiles = (K + SG_BK - 1) / SG_BK;
    float4 pa = load_a(0), pb = load_b(0);
    for (int kt = 0; kt < ktiles; ++kt) {
        if (TA) {
            *reinterpret_cast<float4*>(&As[a_r][a_c]) = pa;
        } else {  // transpose on the way in, so the inner loop reads As like Bs
            As[a_c + 0][a_r] = pa.x;
            As[a_c + 1][a_r] = pa.y;
            As[a_c + 2][a_r] = pa.z;
            As[a_c + 3][a_r] = pa.w;
        }
        if (TB) {
            Bs[b_c + 0][b_r] = pb.x;
            Bs[b_c + 1][b_r] = pb.y;
            Bs[b_c + 2][b_r] = pb.z;
            Bs[b_c + 3][b_r] = pb.w;
        } else {
            *reinterpret_cast<float4*>(&Bs[b_r][b_c]) = pb;
        }
        __syncthreads();
        // the next tile's global loads are in flight while this tile is multiplied
        if (kt + 1 < ktiles) {
            pa = load_a((kt + 1) * SG_BK);
            pb = load_b((kt + 1) * SG_BK);
        }
#pragma unroll
        for (int k = 0; k < SG_BK; ++k) {
            float ra[SG_WMITER * SG_TM], rb[SG_WNITER * SG_TN];
#pragma unroll
            for (int wm = 0; wm < SG_WMITER; ++wm) {
                const float4 v = *reinterpret_cast<const float4*>(
                    &As[k][warp_row * SG_WM + wm * SG_WSUBM + trow * SG_TM]);
                ra[wm * SG_TM + 0] = v.x;
                ra[wm * SG_TM + 1] = v.y;
                ra[wm * SG_TM + 2] = v.z;
                ra[wm * SG_TM + 3] = v.w;
            }
#pragma unroll
            for (int wn = 0; wn < SG_WNITER; ++wn) {
                const float4 v = *reinterpret_cast<const float4*>(
                    &Bs[k][warp_col * SG_WN + wn * SG_WSUBN + tcol * SG_TN]);
                rb[wn * SG_TN + 0] = v.x;
                rb[wn * SG_TN + 1] = v.y;
                rb[wn * SG_TN + 2] = v.z;
                rb[wn * SG_TN + 3] = v.w;
            }
#pragma unroll
            for (int i = 0; i < SG_WMITER * SG_TM; ++i)
#pragma unroll
                for (int j = 0; j < SG_WNITER * SG_TN; ++j) acc[i][j] = fmaf(ra[i], rb[j], acc[i][j]);
        }
        __syncthreads();  // before the next iteration overwrites As/Bs
    }

    // epilogue: alpha, beta*C, bias, pre-activation copy, GELU; 4 columns at a time
#pragma unroll
    for (int wm = 0; wm < SG_WMITER; ++wm)
#pragma unroll
        for (int i = 0; i < SG_TM; ++i) {
            const int m = m0 + warp_row * SG_WM + wm * SG_WSUBM + trow * SG_TM + i;
            if (m >= M) continue;
#pragma unroll
            for (int wn = 0; wn < SG_WNITER; ++wn) {
                const int n = n0 + warp_col * SG_WN + wn * SG_WSUBN + tcol * SG_TN;
                if (n >= N) continue;
                float v[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = alpha * acc[wm * SG_TM + i][wn * SG_TN + j];
                float* crow = C + (long long)m * N;
                const bool full = vec_c && n + 3 < N;
                if (beta != 0.f) {
                    if (full) {
                        const float4 c = *reinterpret_cast<const float4*>(crow + n);
                        v[0] += beta * c.x;
                        v[1] += beta * c.y;
                        v[2] += beta * c.z;
                        v[3] += beta * c.w;
                    } else {
                        for (int j = 0; j < 4; ++j)
                            if (n + j < N) v[j] += beta * crow[n + j];
                    }
                }
                if (epilogue & SG_EPI_BIAS)
                    for (int j = 0; j < 4; ++j)
                        if (n + j < N) v[j] += bias[n + j];
                if (Cpre) {
                    float* prow = Cpre + (long long)m * N;
                    if (full) *reinterpret_cast<float4*>(prow + n) = make_float4(v[0], v[1], v[2], v[3]);
                    else
                        for (int j = 0; j < 4; ++j)
                            if (n + j < N) prow[n + j] = v[j];
                }
                if (epilogue & SG_EPI_GELU)
                    for (int j = 0; j < 4; ++j) v[j] = sg_gelu(v[j]);
                if (full) {
                    *reinterpret_cast<float4*>(crow + n) = make_float4(v[0], v[1], v[2], v[3]);
                } else {
                    for (int j = 0; j < 4; ++j)
                        if (n + j < N) crow[n + j] = v[j];
                }
            }
        }
}

#define SG_ARGS                                                                                          \
    const float *__restrict__ A, const float *__restrict__ B, float *__restrict__ C, int M, int N, int K, \
        long long sA, long long sB, long long sC, float alpha, float beta, const float *__restrict__ bias, \
        float *__restrict__ Cpre, int epilogue, int vec_a, int vec_b, int vec_c
#define SG_PASS A, B, C, M, N, K, sA, sB, sC, alpha, beta, bias, Cpre, epilogue, vec_a, vec_b, vec_c

// grid (ceil(N/128), ceil(M/128), batch), block 256. At most 128 registers per thread
// (2 blocks of 256 threads per SM): the accumulators alone are 64.
extern "C" __global__ void __launch_bounds__(SG_THREADS, 2) sgemm_nn(SG_ARGS) { sgemm_body<false, false>(SG_PASS); }
extern "C" __global__ void __launch_bounds__(SG_THREADS, 2) sgemm_nt(SG_ARGS) { sgemm_body<false, true>(SG_PASS); }
extern "C" __global__ void __launch_bounds__(SG_THREADS, 2) sgemm_tn(SG_ARGS) { sgemm_body<true, false>(SG_PASS); }
extern "C" __global__ void __launch_bounds__(SG_THREADS, 2) sgemm_tt(SG_ARGS) { sgemm_body<true, true>(SG_PASS); }
