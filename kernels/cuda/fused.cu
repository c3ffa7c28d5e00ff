// Fused memory-bound kernels for ringpipe (layernorm, GELU, causal softmax,
// softmax cross-entropy, AdamW / SGD, column sums, sum of squares; RMSNorm, RoPE, SwiGLU), loaded by
// kernels/cuda/cupy_kernels.py through cupy.RawModule (NVRTC); compile-checked with
// nvcc by tests/test_cuda_kernels.py. NVRTC has no host headers: builtins only.
//
// Each op is a template over the element type T (float or double) with extern "C"
// instantiations name_f32 / name_f64, so CuPy finds them by plain names.
//
// Conventions (mirroring kernels/reference.py, the ground truth):
//   - row statistics (means, variances, softmax normalizers, dot products) are
//     accumulated in double, as the reference does. These kernels are memory-bound:
//     FP64 adds cost nothing visible on a data-center GPU, and it keeps float32
//     results within a few ulp of the reference;
//   - row kernels use one block per row, blockDim a multiple of 32 (the host picks
//     it), warp shuffles and one shared slot per warp for block reductions;
//   - each thread reads and writes only "its" columns of a row (same stride in every
//     pass), so outputs may alias inputs where the public API allows it;
//   - cross-row sums (dweight/dbias, column sums) go through fixed-size row chunks
//     and a double partial array summed in a fixed order: reproducible, no atomics.
// Not tuned: no vectorized (float4) loads, rows re-read from L1/L2 rather than kept in
// registers, one block size for all widths.

#define RP_FULL 0xffffffffu

__device__ __forceinline__ float rp_exp(float x) { return expf(x); }
__device__ __forceinline__ double rp_exp(double x) { return exp(x); }
__device__ __forceinline__ float rp_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double rp_tanh(double x) { return tanh(x); }

__device__ __forceinline__ double rp_neg_inf() { return __longlong_as_double(0xfff0000000000000ULL); }
__device__ __forceinline__ double rp_nan() { return __longlong_as_double(0x7ff8000000000000ULL); }

__device__ __forceinline__ double rp_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(RP_FULL, v, o);
    return v;
}

__device__ __forceinline__ double rp_warp_max(double v) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(RP_FULL, v, o));
    return v;
}

// Sum over the block, returned to every thread. sh: 32 doubles of shared memory.
// Every warp reduces the per-warp partials itself, so no broadcast step is needed;
// the leading barrier makes back-to-back calls on the same sh safe.
__device__ __forceinline__ double rp_block_sum(double v, double* sh) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = rp_warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    return rp_warp_sum(lane < nw ? sh[lane] : 0.0);
}

__device__ __forceinline__ double rp_block_max(double v, double* sh) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = rp_warp_max(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    return rp_warp_max(lane < nw ? sh[lane] : rp_neg_inf());
}

// ---------------------------------------------------------------------------
// layernorm: x (N, C), w/b (C,) -> out (N, C), mean/rstd (N,); grid N, block <= 1024

template <typename T>
__device__ __forceinline__ void layernorm_forward(const T* __restrict__ x, const T* __restrict__ w,
                                                  const T* __restrict__ b, T* __restrict__ out,
                                                  T* __restrict__ mean, T* __restrict__ rstd, int C,
                                                  double eps) {
    __shared__ double sh[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * C;
    T* yr = out + row * C;
    double s = 0.0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += (double)xr[c];
    const double mu = rp_block_sum(s, sh) / C;
    s = 0.0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {  // two-pass variance: no cancellation
        const double d = (double)xr[c] - mu;
        s += d * d;
    }
    const double var = rp_block_sum(s, sh) / C;
    // rounded to T before use, as the reference: out agrees with the saved mean/rstd
    const T mu_t = (T)mu, rs_t = (T)(1.0 / sqrt(var + eps));
    if (threadIdx.x == 0) {
        mean[row] = mu_t;
        rstd[row] = rs_t;
    }
    for (int c = threadIdx.x; c < C; c += blockDim.x) yr[c] = (xr[c] - mu_t) * rs_t * w[c] + b[c];
}

// dx = rstd * (dnorm - mean_c(dnorm) - norm * mean_c(dnorm * norm)), dnorm = dout * w.
// dx may alias dout.
template <typename T>
__device__ __forceinline__ void layernorm_backward_dx(const T* dout, const T* __restrict__ x,
                                                      const T* __restrict__ w, const T* __restrict__ mean,
                                                      const T* __restrict__ rstd, T* dx, int C) {
    __shared__ double sh[32];
    const long long row = blockIdx.x;
    const T* dr = dout + row * C;
    const T* xr = x + row * C;
    T* gr = dx + row * C;
    const double mu = (double)mean[row], rs = (double)rstd[row];
    double s1 = 0.0, s2 = 0.0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const double dn = (double)(dr[c] * w[c]);  // product in T, like the reference's dnorm
        s1 += dn;
        s2 += dn * (((double)xr[c] - mu) * rs);
    }
    const double a1 = rp_block_sum(s1, sh) / C;
    const double a2 = rp_block_sum(s2, sh) / C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const double dn = (double)(dr[c] * w[c]);
        const double nrm = ((double)xr[c] - mu) * rs;
        gr[c] = (T)((dn - a1 - nrm * a2) * rs);
    }
}

// Per-chunk column sums of norm*dout and dout: pw/pb (chunks, C) double.
// grid (ceil(C/blockDim), chunks); a warp reads 32 consecutive columns of a row.
template <typename T>
__device__ __forceinline__ void layernorm_backward_params_partial(const T* __restrict__ dout,
                                                                  const T* __restrict__ x,
                                                                  const T* __restrict__ mean,
                                                                  const T* __restrict__ rstd, double* pw,
                                                                  double* pb, int N, int C, int rows_per_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const long long chunk = blockIdx.y;
    if (c >= C) return;
    const long long r0 = chunk * rows_per_chunk;
    long long r1 = r0 + rows_per_chunk;
    if (r1 > N) r1 = N;
    double sw = 0.0, sb = 0.0;
    for (long long r = r0; r < r1; ++r) {
        const double d = (double)dout[r * C + c];
        sw += (((double)x[r * C + c] - (double)mean[r]) * (double)rstd[r]) * d;
        sb += d;
    }
    pw[chunk * C + c] = sw;
    pb[chunk * C + c] = sb;
}

template <typename T>
__device__ __forceinline__ void column_sum_partial(const T* __restrict__ x, double* p, int N, int C,
                                                   int rows_per_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const long long chunk = blockIdx.y;
    if (c >= C) return;
    const long long r0 = chunk * rows_per_chunk;
    long long r1 = r0 + rows_per_chunk;
    if (r1 > N) r1 = N;
    double s = 0.0;
    for (long long r = r0; r < r1; ++r) s += (double)x[r * C + c];
    p[chunk * C + c] = s;
}

// out[c] (+)= sum over chunks of p[:, c], in chunk order
template <typename T>
__device__ __forceinline__ void column_sum_finish(const double* __restrict__ p, int chunks, int C, T* out,
                                                  int accumulate) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    double s = 0.0;
    for (int k = 0; k < chunks; ++k) s += p[(long long)k * C + c];
    out[c] = accumulate ? (T)((double)out[c] + s) : (T)s;
}

// ---------------------------------------------------------------------------
// GELU (tanh approximation), elementwise, grid-stride

template <typename T>
__device__ __forceinline__ void gelu_forward(const T* x, T* y, long long n) {
    const T k0 = (T)0.7978845608028654, k1 = (T)0.044715, half = (T)0.5, one = (T)1;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const T v = x[i];
        y[i] = half * v * (one + rp_tanh(k0 * (v + k1 * v * v * v)));
    }
}

template <typename T>
__device__ __forceinline__ void gelu_backward(const T* dout, const T* x, T* dx, long long n) {
    const T k0 = (T)0.7978845608028654, k1 = (T)0.044715, k3 = (T)(3 * 0.044715), half = (T)0.5, one = (T)1;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const T v = x[i];
        const T t = rp_tanh(k0 * (v + k1 * v * v * v));
        // 1 - t^2 rather than sech^2: cannot overflow
        const T g = half * (one + t) + half * v * (one - t * t) * k0 * (one + k3 * v * v);
        dx[i] = g * dout[i];
    }
}

// ---------------------------------------------------------------------------
// causal softmax over (R, T) rows, R = batch*T; row r is query t = r % T, keys j <= t.
// out may alias s (forward) / dp (backward).

template <typename T>
__device__ __forceinline__ void softmax_causal_forward(const T* s, T* out, int Tn, double scale, int window) {
    // window > 0: query t sees keys lo..t only, lo = t - window + 1 (a sliding window); 0: all j <= t
    __shared__ double sh[32];
    const long long row = blockIdx.x;
    const int t = (int)(row % Tn);
    const int lo = (window > 0 && t - window + 1 > 0) ? t - window + 1 : 0;
    const T* sr = s + row * Tn;
    T* orow = out + row * Tn;
    double mx = rp_neg_inf();
    for (int j = lo + threadIdx.x; j <= t; j += blockDim.x) mx = fmax(mx, (double)sr[j] * scale);
    mx = rp_block_max(mx, sh);  // finite: the diagonal is always kept
    double tot = 0.0;
    for (int j = lo + threadIdx.x; j <= t; j += blockDim.x) tot += exp((double)sr[j] * scale - mx);
    tot = rp_block_sum(tot, sh);
    const double inv = 1.0 / tot;
    for (int j = threadIdx.x; j < Tn; j += blockDim.x)
        orow[j] = (j <= t && j >= lo) ? (T)(exp((double)sr[j] * scale - mx) * inv) : (T)0;
}

// dscores = scale * p * (dp - sum_{j<=t} dp*p), 0 above the diagonal whatever dp holds there
template <typename T>
__device__ __forceinline__ void softmax_causal_backward(const T* dp, const T* __restrict__ p, T* out, int Tn,
                                                        double scale) {
    __shared__ double sh[32];
    const long long row = blockIdx.x;
    const int t = (int)(row % Tn);
    const T* dr = dp + row * Tn;
    const T* pr = p + row * Tn;
    T* orow = out + row * Tn;
    double dot = 0.0;
    for (int j = threadIdx.x; j <= t; j += blockDim.x) dot += (double)dr[j] * (double)pr[j];
    dot = rp_block_sum(dot, sh);
    for (int j = threadIdx.x; j < Tn; j += blockDim.x)
        orow[j] = j <= t ? (T)(scale * (double)pr[j] * ((double)dr[j] - dot)) : (T)0;
}

// ---------------------------------------------------------------------------
// softmax cross-entropy, forward and backward in one kernel; one block per row.
// Pass 1 keeps a running (max, sum) per thread ("online softmax"), so logits are
// read twice in total (stats, then gradient) instead of three times.
// dlogits may be null (loss only) or alias logits.
// An out-of-range target cannot raise on the device: its loss is NaN and its row's
// gradient is the plain softmax (no one-hot), so the NaN shows up in the loss.

template <typename T>
__device__ __forceinline__ void cross_entropy(const T* logits, const long long* __restrict__ targets,
                                              T* __restrict__ losses, T* dlogits, int V, double grad_scale) {
    __shared__ double sh[32];
    const long long row = blockIdx.x;
    const T* lr = logits + row * V;
    const long long tgt = targets[row];
    const bool tgt_ok = tgt >= 0 && tgt < V;
    // read before the reductions' barriers: afterwards another thread may already
    // have overwritten logits[row, tgt] with its gradient (dlogits aliasing logits)
    const double lt = (threadIdx.x == 0 && tgt_ok) ? (double)lr[tgt] : 0.0;
    double m = rp_neg_inf(), s = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const double v = (double)lr[j];
        if (v > m) {
            s = s * exp(m - v) + 1.0;  // exp(-inf) = 0 on the first element
            m = v;
        } else {
            s += v == rp_neg_inf() ? 0.0 : exp(v - m);  // -inf logits add 0 (not exp(nan)); NaN propagates
        }
    }
    const double gm = rp_block_max(m, sh);
    // threads that saw no element have m = -inf, s = 0: contribute 0, not NaN
    const double tot = rp_block_sum(s > 0.0 ? s * exp(m - gm) : 0.0, sh);
    const double lse = gm + log(tot);
    if (threadIdx.x == 0) losses[row] = tgt_ok ? (T)(lse - lt) : (T)rp_nan();
    if (dlogits) {
        T* gr = dlogits + row * V;
        const T lse_t = (T)lse;  // the reference subtracts lse rounded to T
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            double g = (double)rp_exp((T)(lr[j] - lse_t));
            if (j == tgt) g -= 1.0;
            gr[j] = (T)(g * grad_scale);
        }
    }
}

// ---------------------------------------------------------------------------
// optimizers, in place on flat arrays; mask (MT = unsigned char / float / double) may
// be null (weight decay everywhere). bc1/bc2 = 1 - beta^step, computed on the host.

template <typename T, typename MT>
__device__ __forceinline__ void adamw(T* p, const T* __restrict__ g, T* m, T* v, const MT* __restrict__ mask,
                                      long long n, double lr, double beta1, double beta2, double eps,
                                      double wd, double bc1, double bc2) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double gi = (double)g[i];
        const T mi = (T)(beta1 * (double)m[i] + (1.0 - beta1) * gi);
        const T vi = (T)(beta2 * (double)v[i] + (1.0 - beta2) * gi * gi);
        m[i] = mi;
        v[i] = vi;
        const double decay = mask ? wd * (double)mask[i] : wd;
        const double pi = (double)p[i];
        // decoupled weight decay: on the parameter, not folded into the gradient
        p[i] = (T)(pi - lr * (((double)mi / bc1) / (sqrt((double)vi / bc2) + eps) + decay * pi));
    }
}

// PyTorch convention: g' = g + wd*mask*p ; buf = momentum*buf + g' ; p -= lr*buf
template <typename T, typename MT>
__device__ __forceinline__ void sgd_momentum(T* p, const T* __restrict__ g, T* buf, const MT* __restrict__ mask,
                                             long long n, double lr, double momentum, double wd) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double decay = mask ? wd * (double)mask[i] : wd;
        const double pi = (double)p[i];
        const T b = (T)(momentum * (double)buf[i] + ((double)g[i] + decay * pi));
        buf[i] = b;
        p[i] = (T)(pi - lr * (double)b);
    }
}

// partial[blockIdx.x] = sum of x^2 over this block's grid-stride share, in double;
// the host sums the (few) partials in a fixed order
template <typename T>
__device__ __forceinline__ void sum_of_squares_partial(const T* __restrict__ x, long long n, double* partial) {
    __shared__ double sh[32];
    double s = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double v = (double)x[i];
        s += v * v;
    }
    s = rp_block_sum(s, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// ---------------------------------------------------------------------------
// Llama-family ops. RMSNorm: x (N, C), w (C,) -> y (N, C), rstd (N,); grid N.

template <typename T>
__device__ __forceinline__ void rmsnorm_forward(const T* __restrict__ x, const T* __restrict__ w,
                                                T* __restrict__ y, T* __restrict__ rstd, int C, double eps) {
    __shared__ double sh[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * C;
    T* yr = y + row * C;
    double s = 0.0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += (double)xr[c] * (double)xr[c];
    // rounded to T before use, as the reference: y agrees with the saved rstd
    const T r = (T)(1.0 / sqrt(rp_block_sum(s, sh) / C + eps));
    if (threadIdx.x == 0) rstd[row] = r;
    for (int c = threadIdx.x; c < C; c += blockDim.x) yr[c] = (xr[c] * r) * w[c];
}

// dx = rstd * (g - xhat * mean_c(g * xhat)), g = dy * w, xhat = x * rstd
template <typename T>
__device__ __forceinline__ void rmsnorm_backward_dx(const T* __restrict__ dy, const T* __restrict__ x,
                                                    const T* __restrict__ w, const T* __restrict__ rstd,
                                                    T* __restrict__ dx, int C) {
    __shared__ double sh[32];
    const long long row = blockIdx.x;
    const T* gr = dy + row * C;
    const T* xr = x + row * C;
    T* dr = dx + row * C;
    const T r = rstd[row];
    double s = 0.0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += (double)(gr[c] * w[c]) * (double)(xr[c] * r);
    const T m = (T)(rp_block_sum(s, sh) / C);
    for (int c = threadIdx.x; c < C; c += blockDim.x) dr[c] = (gr[c] * w[c] - (xr[c] * r) * m) * r;
}

// Per-chunk column sums of dy * xhat: pw (chunks, C) double; grid (ceil(C/blockDim), chunks)
template <typename T>
__device__ __forceinline__ void rmsnorm_backward_dw_partial(const T* __restrict__ dy, const T* __restrict__ x,
                                                            const T* __restrict__ rstd, double* pw, int N, int C,
                                                            int rows_per_chunk) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const long long chunk = blockIdx.y;
    if (c >= C) return;
    const long long r0 = chunk * rows_per_chunk;
    long long r1 = r0 + rows_per_chunk;
    if (r1 > N) r1 = N;
    double s = 0.0;
    for (long long r = r0; r < r1; ++r) s += (double)dy[r * C + c] * (double)(x[r * C + c] * rstd[r]);
    pw[chunk * C + c] = s;
}

// RoPE, half-split: x, y (rows, H, hd) with row = b * Tn + t; cos/sin (Tn, hd). One thread
// per (row, head, i < hd/2) pair, grid-stride. sign > 0 forward:
//   y1 = x1*cos1 - x2*sin1, y2 = x2*cos2 + x1*sin2;
// sign < 0 the transpose (backward): dx1 = dy1*cos1 + dy2*sin2, dx2 = dy2*cos2 - dy1*sin1.
template <typename T>
__device__ __forceinline__ void rope(const T* __restrict__ x, const T* __restrict__ cs, const T* __restrict__ sn,
                                     T* __restrict__ y, long long pairs, int Tn, int H, int hd, int sign) {
    const int h = hd / 2;
    for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < pairs; p += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(p % h);
        const long long rowhead = p / h;  // row * H + head
        const int t = (int)((rowhead / H) % Tn);
        const long long base = rowhead * hd;
        const T a = x[base + i], b = x[base + i + h];
        const T* c = cs + (long long)t * hd;
        const T* s = sn + (long long)t * hd;
        if (sign > 0) {
            y[base + i] = a * c[i] - b * s[i];
            y[base + i + h] = b * c[i + h] + a * s[i + h];
        } else {
            y[base + i] = a * c[i] + b * s[i + h];
            y[base + i + h] = b * c[i + h] - a * s[i];
        }
    }
}

// SwiGLU, elementwise, grid-stride: h = silu(g) * u
template <typename T>
__device__ __forceinline__ void swiglu_forward(const T* gate, const T* up, T* out, long long n) {
    const T one = (T)1;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const T g = gate[i];
        out[i] = g / (one + rp_exp(-g)) * up[i];  // exp overflow for g << 0 gives -0, no NaN
    }
}

template <typename T>
__device__ __forceinline__ void swiglu_backward(const T* dh, const T* gate, const T* up, T* dgate, T* dup,
                                                long long n) {
    const T one = (T)1;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const T g = gate[i], d = dh[i];
        const T sig = one / (one + rp_exp(-g));
        dgate[i] = d * up[i] * sig * (one + g * (one - sig));
        dup[i] = d * g * sig;
    }
}

// ---------------------------------------------------------------------------
// extern "C" instantiations

#define RP_INSTANTIATE(SUF, T)                                                                                     \
    extern "C" __global__ void layernorm_forward_##SUF(const T* x, const T* w, const T* b, T* out, T* mean,        \
                                                       T* rstd, int C, double eps) {                               \
        layernorm_forward<T>(x, w, b, out, mean, rstd, C, eps);                                                    \
    }                                                                                                              \
    extern "C" __global__ void layernorm_backward_dx_##SUF(const T* dout, const T* x, const T* w, const T* mean,   \
                                                           const T* rstd, T* dx, int C) {                          \
        layernorm_backward_dx<T>(dout, x, w, mean, rstd, dx, C);                                                   \
    }                                                                                                              \
    extern "C" __global__ void layernorm_backward_params_partial_##SUF(const T* dout, const T* x, const T* mean,   \
                                                                       const T* rstd, double* pw, double* pb,      \
                                                                       int N, int C, int rows_per_chunk) {         \
        layernorm_backward_params_partial<T>(dout, x, mean, rstd, pw, pb, N, C, rows_per_chunk);                   \
    }                                                                                                              \
    extern "C" __global__ void column_sum_partial_##SUF(const T* x, double* p, int N, int C, int rows_per_chunk) { \
        column_sum_partial<T>(x, p, N, C, rows_per_chunk);                                                         \
    }                                                                                                              \
    extern "C" __global__ void column_sum_finish_##SUF(const double* p, int chunks, int C, T* out, int accumulate) { \
        column_sum_finish<T>(p, chunks, C, out, accumulate);                                                       \
    }                                                                                                              \
    extern "C" __global__ void gelu_forward_##SUF(const T* x, T* y, long long n) { gelu_forward<T>(x, y, n); }      \
    extern "C" __global__ void gelu_backward_##SUF(const T* dout, const T* x, T* dx, long long n) {                \
        gelu_backward<T>(dout, x, dx, n);                                                                          \
    }                                                                                                              \
    extern "C" __global__ void softmax_causal_forward_##SUF(const T* s, T* out, int Tn, double scale, int window) { \
        softmax_causal_forward<T>(s, out, Tn, scale, window);                                                      \
    }                                                                                                              \
    extern "C" __global__ void softmax_causal_backward_##SUF(const T* dp, const T* p, T* out, int Tn,              \
                                                             double scale) {                                       \
        softmax_causal_backward<T>(dp, p, out, Tn, scale);                                                         \
    }                                                                                                              \
    extern "C" __global__ void cross_entropy_##SUF(const T* logits, const long long* targets, T* losses,           \
                                                   T* dlogits, int V, double grad_scale) {                         \
        cross_entropy<T>(logits, targets, losses, dlogits, V, grad_scale);                                         \
    }                                                                                                              \
    extern "C" __global__ void sum_of_squares_partial_##SUF(const T* x, long long n, double* partial) {            \
        sum_of_squares_partial<T>(x, n, partial);                                                                  \
    }

#define RP_INSTANTIATE_OPT(SUF, T, MSUF, MT)                                                                       \
    extern "C" __global__ void adamw_##SUF##_##MSUF(T* p, const T* g, T* m, T* v, const MT* mask, long long n,     \
                                                    double lr, double beta1, double beta2, double eps, double wd,  \
                                                    double bc1, double bc2) {                                      \
        adamw<T, MT>(p, g, m, v, mask, n, lr, beta1, beta2, eps, wd, bc1, bc2);                                    \
    }                                                                                                              \
    extern "C" __global__ void sgd_momentum_##SUF##_##MSUF(T* p, const T* g, T* buf, const MT* mask, long long n,  \
                                                           double lr, double momentum, double wd) {                \
        sgd_momentum<T, MT>(p, g, buf, mask, n, lr, momentum, wd);                                                 \
    }

RP_INSTANTIATE(f32, float)
RP_INSTANTIATE(f64, double)
RP_INSTANTIATE_OPT(f32, float, u8, unsigned char)
RP_INSTANTIATE_OPT(f32, float, f32, float)
RP_INSTANTIATE_OPT(f32, float, f64, double)
RP_INSTANTIATE_OPT(f64, double, u8, unsigned char)
RP_INSTANTIATE_OPT(f64, double, f32, float)
RP_INSTANTIATE_OPT(f64, double, f64, double)

#define RP_INSTANTIATE_LLAMA(SUF, T)                                                                               \
    extern "C" __global__ void rmsnorm_forward_##SUF(const T* x, const T* w, T* y, T* rstd, int C, double eps) {   \
        rmsnorm_forward<T>(x, w, y, rstd, C, eps);                                                                 \
    }                                                                                                              \
    extern "C" __global__ void rmsnorm_backward_dx_##SUF(const T* dy, const T* x, const T* w, const T* rstd,       \
                                                         T* dx, int C) {                                           \
        rmsnorm_backward_dx<T>(dy, x, w, rstd, dx, C);                                                             \
    }                                                                                                              \
    extern "C" __global__ void rmsnorm_backward_dw_partial_##SUF(const T* dy, const T* x, const T* rstd,           \
                                                                 double* pw, int N, int C, int rows_per_chunk) {   \
        rmsnorm_backward_dw_partial<T>(dy, x, rstd, pw, N, C, rows_per_chunk);                                     \
    }                                                                                                              \
    extern "C" __global__ void rope_##SUF(const T* x, const T* cs, const T* sn, T* y, long long pairs, int Tn,      \
                                          int H, int hd, int sign) {                                               \
        rope<T>(x, cs, sn, y, pairs, Tn, H, hd, sign);                                                             \
    }                                                                                                              \
    extern "C" __global__ void swiglu_forward_##SUF(const T* gate, const T* up, T* out, long long n) {             \
        swiglu_forward<T>(gate, up, out, n);                                                                       \
    }                                                                                                              \
    extern "C" __global__ void swiglu_backward_##SUF(const T* dh, const T* gate, const T* up, T* dgate, T* dup,    \
                                                     long long n) {                                                \
        swiglu_backward<T>(dh, gate, up, dgate, dup, n);                                                           \
    }

RP_INSTANTIATE_LLAMA(f32, float)
RP_INSTANTIATE_LLAMA(f64, double)
