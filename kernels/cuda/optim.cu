/* kernels/cuda/optim.cu: the optimizer's pieces: sums and sums of squares in double (a
 * fixed grid and a fixed-order reduction, so the same input gives the same bits; the
 * result is copied back, which waits for the stream), scaling, the finiteness check
 * (also waits) and the fused AdamW step (one pass, in double per element; over the whole
 * parameter arena in a 16-bit precision it also writes the GEMMs' 16-bit shadow, so the
 * refresh that follows has nothing left to do). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_common.cuh"

#define SUM_MAX_BLOCKS 1024

template <int SQUARE> static __global__ void sum_partial(double *part, const real *x, size_t n)
{
    double s = 0.0;
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const double v = x[i];
        s += SQUARE ? v * v : v;
    }
    s = moe_block_sum_d(s);
    if (threadIdx.x == 0)
        part[blockIdx.x] = s;
}

static __global__ void sum_final(double *out, const double *part, int blocks)
{
    double s = 0.0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x)
        s += part[b];
    s = moe_block_sum_d(s);
    if (threadIdx.x == 0)
        *out = s;
}

template <int SQUARE> static double sum_of(const real *x, size_t n)
{
    if (n == 0)
        return 0.0;
    unsigned blocks = moe_cuda_blocks(n, MOE_CUDA_THREADS);
    if (blocks > SUM_MAX_BLOCKS)
        blocks = SUM_MAX_BLOCKS;
    double *part = (double *)moe_cuda_scratch(sizeof(double) * (blocks + 1));
    if (!part)
        return 0.0;
    MOE_CUDA_LAUNCH(sum_partial<SQUARE>, blocks, MOE_CUDA_THREADS, 0, part + 1, x, n);
    MOE_CUDA_LAUNCH(sum_final, 1, MOE_CUDA_THREADS, 0, part, part + 1, (int)blocks);
    const double *host = (const double *)moe_cuda_fetch(part, sizeof(double));
    return host ? *host : 0.0;
}

extern "C" double cuda_sum_values(const real *x, size_t n) { return sum_of<0>(x, n); }
extern "C" double cuda_sum_squares(const real *x, size_t n) { return sum_of<1>(x, n); }

static __global__ void scale_kernel(real *x, real s, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n) { x[i] = __fmul_rn(x[i], s); }
}

extern "C" void cuda_scale_inplace(real *x, real s, size_t n)
{
    if (n == 0)
        return;
    MOE_CUDA_LAUNCH(scale_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0, x, s,
                    n);
}

/* *bad = 1 if some element is not finite (every writer writes the same value). */
static __global__ void finite_kernel(int *bad, const real *x, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        if (!isfinite(x[i]))
            *bad = 1;
    }
}

extern "C" int cuda_all_finite(const real *x, size_t n)
{
    if (n == 0)
        return 1;
    int *bad = (int *)moe_cuda_scratch(sizeof(int));
    if (!bad || !MOE_CUDA_OK(cudaMemsetAsync(bad, 0, sizeof(int), moe_cuda_stream())))
        return 0;
    MOE_CUDA_LAUNCH(finite_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0, bad,
                    x, n);
    const int *host = (const int *)moe_cuda_fetch(bad, sizeof(int));
    return host ? !*host : 0;
}

/* As the CPU reference: p = p*decay - step * m / (sqrt(v)/sqrt_bc2 + eps), in double. */
static __global__ void adamw_kernel(real *p, const real *g, real *m, real *v, size_t n, double b1,
                                    double b2, double step, double sqrt_bc2, double decay,
                                    double eps)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const double gi = g[i];
        const double mi = __dadd_rn(__dmul_rn(b1, m[i]), __dmul_rn(1.0 - b1, gi));
        const double vi = __dadd_rn(__dmul_rn(b2, v[i]), __dmul_rn(__dmul_rn(1.0 - b2, gi), gi));
        m[i] = (real)mi;
        v[i] = (real)vi;
        const double denom = __dadd_rn(__ddiv_rn(sqrt(vi), sqrt_bc2), eps);
        p[i] =
            (real)__dsub_rn(__dmul_rn((double)p[i], decay), __ddiv_rn(__dmul_rn(step, mi), denom));
    }
}

extern "C" void cuda_adamw_update(real *p, const real *g, real *m, real *v, size_t n, real lr,
                                  real beta1, real beta2, real eps, real wd, int t)
{
    if (n == 0)
        return;
    const double b1 = beta1, b2 = beta2;
    const double step = (double)lr / (1.0 - pow(b1, t));
    const double sqrt_bc2 = sqrt(1.0 - pow(b2, t));
    const double decay = 1.0 - (double)lr * wd;
    MOE_CUDA_LAUNCH(adamw_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0, p, g,
                    m, v, n, b1, b2, step, sqrt_bc2, decay, (double)eps);
}

/* Multi-tensor AdamW: one pass over the arena. The segment offsets and weight decays are
 * staged in shared memory; a thread's elements only grow (grid stride), so its segment
 * is found once by binary search and then only walks forward. As adamw_kernel
 * otherwise. */
static __global__ void adamw_multi_kernel(real *p, const real *g, real *m, real *v,
                                          const int64_t *offsets, const real *wd, int n_segs,
                                          size_t n, double b1, double b2, double step,
                                          double sqrt_bc2, double lr, double eps, double scale,
                                          uint16_t *shadow, int bf16)
{
    extern __shared__ int64_t seg_lo[]; /* n_segs offsets, then n_segs decays (as real) */
    real *seg_wd = (real *)(seg_lo + n_segs);
    for (int s = threadIdx.x; s < n_segs; s += blockDim.x) {
        seg_lo[s] = offsets[s];
        seg_wd[s] = wd[s];
    }
    __syncthreads();
    int seg = -1;
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        if (seg < 0) {
            int lo = 0, hi = n_segs - 1;
            while (lo < hi) {
                int mid = (lo + hi + 1) / 2;
                if ((int64_t)i >= seg_lo[mid])
                    lo = mid;
                else
                    hi = mid - 1;
            }
            seg = lo;
        }
        while (seg + 1 < n_segs && (int64_t)i >= seg_lo[seg + 1])
            seg++;
        const double decay = 1.0 - lr * (double)seg_wd[seg];
        const double gi = scale == 1.0 ? (double)g[i] : __dmul_rn((double)g[i], scale);
        const double mi = __dadd_rn(__dmul_rn(b1, m[i]), __dmul_rn(1.0 - b1, gi));
        const double vi = __dadd_rn(__dmul_rn(b2, v[i]), __dmul_rn(__dmul_rn(1.0 - b2, gi), gi));
        m[i] = (real)mi;
        v[i] = (real)vi;
        const double denom = __dadd_rn(__ddiv_rn(sqrt(vi), sqrt_bc2), eps);
        const real pi =
            (real)__dsub_rn(__dmul_rn((double)p[i], decay), __ddiv_rn(__dmul_rn(step, mi), denom));
        p[i] = pi;
        if (shadow) { /* as matmul.cu's round_kernel */
            if (bf16) {
                const __nv_bfloat16 h = __float2bfloat16(pi);
                shadow[i] = *(const uint16_t *)&h;
            } else {
                const __half h = __float2half(pi);
                shadow[i] = *(const uint16_t *)&h;
            }
        }
    }
}

extern "C" uint16_t *cuda_gemm_shadow_for_update(const real *p, size_t n, int *bf16);

extern "C" void cuda_adamw_update_multi(real *p, const real *g, real *m, real *v, size_t n,
                                        const int64_t *offsets, const real *wd, int n_segs, real lr,
                                        real beta1, real beta2, real eps, real grad_scale, int t)
{
    if (n_segs <= 0 || n == 0)
        return;
    const double b1 = beta1, b2 = beta2;
    const double step = (double)lr / (1.0 - pow(b1, t));
    const double sqrt_bc2 = sqrt(1.0 - pow(b2, t));
    int bf16 = 0; /* the 16-bit shadow of the parameters, written in the same pass */
    uint16_t *shadow = cuda_gemm_shadow_for_update(p, n, &bf16);
    const size_t smem = (sizeof(int64_t) + sizeof(real)) * (size_t)n_segs;
    if (smem > 48 * 1024) {
        MOE_CUDA_FAIL("adamw: %d segments are more than the kernel stages (%zu bytes)", n_segs,
                      smem);
        return;
    }
    MOE_CUDA_LAUNCH(adamw_multi_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                    smem, p, g, m, v, offsets, wd, n_segs, n, b1, b2, step, sqrt_bc2, (double)lr,
                    (double)eps, (double)grad_scale, shadow, bf16);
}
